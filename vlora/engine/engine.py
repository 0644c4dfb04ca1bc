"""The engine: add requests, step the batch, abort. ``step`` is the whole loop:

    plan = self._schedule()         # who runs, how many tokens each, in which mode (a StepPlan)
    memory.prepare(plan, modes)     # adapters resident and pinned
    tokens = self._run(plan)        # forward + sample
    outputs = self._finish(plan, tokens)  # append, stop checks, free, stream
    memory.after(plan, ...)         # swapper monitor, adapter prefetch, drain when idle

A decode iteration the CUDA graphs replay is only queued (``runner.launch``): the
step then schedules and queues the next decode behind it, its input tokens taken
on the device, before it reads the first one's tokens and finishes it, so the host
work of one iteration overlaps the forward of the next (``async_scheduling``,
``_step_in_flight``). That lookahead runs only where it is exact: every running
sequence decodes, no waiting request could join, no page has to be reclaimed and no sequence
preempted, one GPU, the unmerged policy. A sequence that turns out finished by
the tokens read back has a wasted row in the iteration queued behind; its output
stops where the tokens did. Anything that changes the engine from outside the loop
(abort, merges, unregistering) first lands the iteration in flight (``land_in_flight``).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from vlora.config import ConfigError, EngineConfig
from vlora.engine.admission import SLO, Admission, ServiceEstimator
from vlora.engine.detokenizer import Detokenizer
from vlora.engine.faults import MAX_FORWARD_FAILURES, EngineFatal, RequestFailed, describe, is_fatal
from vlora.engine.mode_costs import ModeCosts
from vlora.engine.observer import StepObserver, StepRecord
from vlora.engine.orchestrator import Orchestrator
from vlora.engine.runner import Launched, ModelRunner
from vlora.engine.plan import StepPlan
from vlora.engine.scheduler import Scheduler
from vlora.engine.sequence import RequestOutput, Sequence, TokenLogprobs
from vlora.lora.adapter import ModelShape
from vlora.lora.batch import LoRALaunch, PackedAdapter
from vlora.lora.registry import AdapterRegistry
from vlora.memory.manager import MemoryManager
from vlora.memory.pool import UnifiedPool
from vlora.memory.sizing import Sizing, plan
from vlora.models.build import load_model
from vlora.models.lmm import ImageInputError
from vlora.models.task_head import TaskResult
from vlora.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestError(ValueError):
    """A request was refused before it entered the engine; nothing else changed. ``param``: the request field at
    fault, when it is not the prompt."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, hand_back_preempted: bool = False,
                 observers: Iterable[StepObserver] = ()):
        """``hand_back_preempted`` (cluster replicas): a request preempted for KV goes back to the cluster front
        (finish "migrate") to resume elsewhere by recompute, rather than wait here for pages this replica is
        short of. ``observers``: told of each forward and step (:mod:`vlora.engine.observer`)."""
        self.config = config = config or EngineConfig()
        self.observers: list[StepObserver] = list(observers)
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        mc = config.model
        loaded = load_model(mc.model, self.dtype, self.device, mc.max_model_len, mc.max_images_per_request,
                            mc.max_pixels_per_image, mc.seed, cut=_rank0_cut(mc.tensor_parallel_size))
        self.model, self.max_model_len = loaded.model, loaded.max_model_len
        self.vision = loaded.vision          # LMMs: the vision tower + projector (VisionModel)
        # random:<preset> models have no tokenizer: prompts are token ids
        self.tokenizer = _load_tokenizer(loaded.model_dir) if loaded.model_dir is not None else None
        tp = mc.tensor_parallel_size
        lc = config.lora
        kernel_lora = lc.lora_kernel == "triton" or (lc.lora_kernel == "auto" and self.device.type == "cuda")
        if tp > 1:                       # rank 0's shard; workers hold the others (vlora/parallel)
            self.model = _tensor_parallel(self.model, config, self.dtype, self.device, kernel_lora)
        kv_heads = getattr(self.model, "kv_heads_per_rank", self.model.cfg.num_kv_heads)   # this rank's KV heads
        cfg = self.model.cfg
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        cc = config.cache
        self.block_size = cc.block_size
        self.sizing = _size(config, getattr(self.model, "local_cfg", cfg), self.device, self.dtype,   # TP: a rank's
                            self.max_model_len, lc.max_loras if kernel_lora else 0)
        sc = config.scheduler
        if sc.max_num_seqs is None or sc.max_num_batched_tokens is None:    # the limits chosen for this device
            sc = replace(sc, max_num_seqs=self.sizing.max_num_seqs,
                         max_num_batched_tokens=self.sizing.max_num_batched_tokens)
            self.config = config = replace(config, scheduler=sc)
        pages = self.sizing.num_pages
        fixed = cc.memory_policy == "lru-fixed"
        self.pool = UnifiedPool(pages, cfg.num_layers, cc.block_size, kv_heads, cfg.head_dim,
                                self.dtype, self.device,
                                adapter_limit=int(pages * cc.adapter_pool_fraction) if fixed else None)
        self.allocator = self.pool                    # KV blocks are pages of the unified pool
        kv = self.pool.kv
        ins, outs = cfg.lora_in_out()
        self.adapters = AdapterRegistry(ModelShape(cfg.name, cfg.num_layers, ins, outs), config.lora.max_lora_rank,
                                        self.dtype, self.device, config.lora.check_base_model,
                                        config.lora.lora_kernel, self.pool)
        if tp > 1:
            self.model.registry = self.adapters
            if self.adapters.store is not None:      # the pool holds rank 0's slices (the workers theirs)
                self.adapters.store.view = self.model.part
        self.memory = MemoryManager(self.pool, self.adapters, cc)   # pool, adapter store, prefix tree, swapper
        self.prefix_cache, self.swapper = self.memory.tree, self.memory.swapper
        self.scheduler = Scheduler(config.scheduler, self.allocator, cc.block_size, self.prefix_cache)
        cuda = self.device.type == "cuda"
        use_kernels = mc.kernels == "triton" or (mc.kernels == "auto" and cuda)
        graph_safe = getattr(self.model, "graph_safe", True)     # e.g. not a mixture of experts (routed shapes)
        graph_batch = config.scheduler.max_num_seqs if cuda and mc.cuda_graphs and use_kernels and graph_safe else 0
        self.runner = ModelRunner(self.model, kv, cc.block_size, self.device, tuple(sorted(self.eos_token_ids)),
                                  self.adapters, use_kernels, graph_batch, self.max_model_len, self.vision,
                                  # tensor-parallel workers take segments as (rows, adapter, scale): two passes
                                  LoRALaunch(lc.lora_overlap, lc.lora_pdl, mixed="two" if tp > 1 else "one"))
        if tp > 1:                                    # merges fold each rank's slices into its shard
            from vlora.parallel.model import ShardModes

            self.runner.modes = ShardModes(self.model)
        elif self.memory.copies is not None:          # merged copies in pool pages (cache.merged_copy)
            self.runner.modes.keep_copies(self.memory.copies)
        sc = config.scheduler
        self.kernel_build = {}                        # what start-up built (vlora.engine.warmup)
        if use_kernels and cuda and mc.build_kernels:
            from vlora.engine.warmup import build_kernels

            self.kernel_build = build_kernels(self.runner, sc.max_num_batched_tokens, sc.max_num_seqs,
                                              workers=min(8, max(1, (os.cpu_count() or 2) // 2)),
                                              merges=sc.policy != "unmerged")
        self.runner.before_sync = self._before_sync
        self.detokenizer = Detokenizer(self.tokenizer)
        self.mode_costs: ModeCosts | None = None      # the modes timed on this GPU (profile_modes)
        self.orchestrator = Orchestrator(sc.policy, sc.starvation_s, sc.max_num_seqs)
        self.admission = Admission()
        self.estimator = ServiceEstimator()
        self.last_mode = None                         # inference mode of the last iteration run
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._pending: list[RequestOutput] = []       # outputs of aborts, flushed by the next step
        self._forward_failures = 0                    # iterations in a row whose forward failed
        self._flight: _Flight | None = None           # a decode queued on the device, its tokens not yet read
        self._last_landed = 0.0                       # when the tokens of the last queued iteration were read
        self.num_overlapped = 0                       # iterations queued behind another one (async_scheduling)
        self.hand_back_preempted = hand_back_preempted
        # adapters being unloaded once their requests finish (AsyncEngine's wait policy): their requests are not
        # handed back, since no other replica takes a request of an adapter being unloaded
        self.unloading: set[str] = set()
        self._rng = random.Random(config.model.seed)   # the sampling seeds of requests that bring none

    @property
    def model_name(self) -> str:
        return self.model.cfg.name

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], adapter: str | None = None,
                    params: SamplingParams | None = None, request_id: str | None = None,
                    slo: SLO | None = None, images=None) -> str:
        """Queue a request; ``slo`` overrides its adapter's latency targets (see :meth:`set_slo`).
        ``images`` (LMMs): one entry per image placeholder of the prompt, an image (PIL image, encoded bytes,
        a path or a preprocessed [C, H, W] tensor) or a video (a list of frames); see ``models/lmm.py``."""
        params = params or SamplingParams()
        if slo is not None and not isinstance(slo, SLO):
            raise RequestError(f"slo must be an SLO, got {type(slo).__name__}")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        packed = None
        if adapter is not None and adapter != self.model_name:
            try:
                packed = self.adapters.get(adapter)
            except KeyError as e:
                raise RequestError(str(e.args[0])) from None
        if params.task_head and (packed is None or packed.name not in self.adapters.heads):
            raise RequestError(f"task_head=True needs an adapter with a vision task head; "
                               f"{adapter or self.model_name!r} has none", param="task_head")
        vocab = self.model.cfg.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias names token ids outside the vocabulary [0, {vocab})", param="logit_bias")
        ids = self._tokenize(prompt)
        ids, spans = self._images(ids, images)
        self._check_fits(ids, packed)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, ids, params, packed, next(self._arrivals),
                       prompt=prompt if isinstance(prompt, str) else None, sample_seed=seed, slo=slo, images=spans)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: give the prompt as token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        vocab = self.model.cfg.vocab_size
        if not ids:
            raise RequestError("prompt is empty")
        if any(t < 0 or t >= vocab for t in ids):
            raise RequestError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        return ids

    def _images(self, ids: list[int], images) -> tuple[list[int], tuple]:
        """(prompt with image placeholders expanded, image spans); text-only models refuse images."""
        if images is not None and not isinstance(images, (list, tuple)):
            raise RequestError("images must be a list (one entry per image; a list of frames for a video)")
        if self.vision is None:
            if images:
                raise RequestError(f"model {self.model_name!r} is text-only: it does not accept images")
            return ids, ()
        if not images:
            marks = [t for t in self.vision.placeholder_ids if t in ids]
            if marks:
                raise RequestError(f"prompt holds image placeholder tokens (id {marks[0]}) but no images were given")
            return ids, ()
        try:
            return self.vision.prepare(ids, images)
        except ImageInputError as e:
            raise RequestError(str(e)) from None

    def _check_fits(self, ids: list[int], adapter: PackedAdapter | None = None) -> None:
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; the limit is max_model_len - 1 = "
                               f"{self.max_model_len - 1}")
        # a request of an adapter in the unified pool: the pool less that adapter, which shares it while the
        # request runs (the adapters pinned now are those of requests that will finish)
        pool, store = self.pool, self.adapters.store
        own = adapter is not None and store is not None and pool.adapter_limit is None
        room = pool.num_pages - store.pages_needed(adapter) if own else self.allocator.num_blocks
        if -(-(len(ids) + 1) // self.block_size) > room:
            beside = f" beside adapter {adapter.name!r}" if own else ""
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the KV cache "
                               f"({room} blocks of {self.block_size}{beside})")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its memory; False if it is unknown or already finished."""
        return self._stop(request_id, "abort")

    def hand_back(self, request_id: str) -> bool:
        """Stop a request and free its memory, finishing it with ``finish_reason="migrate"``: its output holds the
        tokens generated so far, from which the cluster front resumes it on another replica. False if unknown, or
        if its adapter is being unloaded (``unloading``): then it stays, and finishes here."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.adapter_name in self.unloading:
            return False
        return self._stop(request_id, "migrate")

    def _stop(self, request_id: str, reason: str) -> bool:
        self.land_in_flight()
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, reason)
        self._pending.append(self._output(seq, []))
        return True

    def set_slo(self, adapter: str | None, slo: SLO | None) -> None:
        """Latency targets for every request of ``adapter`` (None: the base model); None clears them.
        Requests that can no longer meet them are rejected before they are served (finish "rejected")."""
        if slo is not None and not isinstance(slo, SLO):
            raise RequestError(f"slo must be an SLO or None, got {type(slo).__name__}")
        if adapter is not None and adapter != self.model_name:
            try:
                self.adapters.get(adapter)
            except KeyError as e:
                raise RequestError(str(e.args[0])) from None
        self.admission.set_slo(None if adapter == self.model_name else adapter, slo)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter no request uses; unmerged first if it is the merged one."""
        if any(s.adapter_name == name for s in self._seqs.values()):
            raise RequestError(f"adapter {name!r} is in use by running requests")
        self.land_in_flight()
        merged = self.runner.modes.merged
        if merged is not None and merged.name == name:
            self.runner.modes.unmerge()
        self.runner.modes.forget(name)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_adapter(name)
        self.adapters.unregister(name)
        self.admission.set_slo(name, None)

    # -- inference modes (the orchestrator decides; these are the mechanics) -------------------
    def merge_adapter(self, name: str) -> float:
        """Fold adapter ``name`` into the base weights (exact; other requests keep their outputs)."""
        self.land_in_flight()
        return self.runner.modes.merge(self.adapters.get(name))

    def unmerge_adapter(self) -> float:
        """Restore the base weights bit for bit."""
        self.land_in_flight()
        return self.runner.modes.unmerge()

    def profile_modes(self, reps: int = 10) -> ModeCosts | None:
        """Time the inference modes on this GPU (:mod:`vlora.engine.mode_costs`) with up to nine registered
        adapters (the largest rank is the one merged), and give the orchestrator those costs from now on. Needs
        the decode CUDA graphs (their mixed kind is captured here), two registered adapters and nothing merged;
        None (nothing changed) otherwise. Run it while no request is in flight: the timed replays and merges hold
        the GPU."""
        from vlora.engine.mode_costs import profile_modes

        self.land_in_flight()
        store, names = self.adapters.store, self.adapters.names()[:9]
        if self.runner.graphs is None or store is None or len(names) < 2 or self.runner.modes.merged is not None:
            return None
        adapters = sorted((self.adapters.get(n) for n in names), key=lambda a: -a.rank)   # the largest merges
        if len(store.ensure(adapters, set())) < 2:
            return None
        self.runner.capture_graphs(mixed=True)
        self.mode_costs = profile_modes(self.runner, adapters, self.config.scheduler.max_num_seqs, reps)
        self.orchestrator.profile = self.mode_costs
        return self.mode_costs

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.land_in_flight()
        if hasattr(self.model, "close"):
            self.model.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending) or self._flight is not None

    def observe(self, observer: StepObserver) -> None:
        """Tell ``observer`` of each forward and step from now on (:mod:`vlora.engine.observer`)."""
        self.observers.append(observer)

    def _before_sync(self) -> None:
        for o in self.observers:
            o.before_sync()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.observers:
            return self._step()
        began, t0 = time.time(), time.perf_counter()
        outputs = self._step()
        record = StepRecord(began, time.perf_counter() - t0, len(outputs), len(self.scheduler.running))
        for o in self.observers:
            o.step_done(record)
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self._flight is not None:
            return self._step_in_flight()
        plan = self._schedule()                     # who runs, how many tokens each, in which mode
        self.memory.prepare(plan, self.runner.modes)  # the plan's adapters pinned, the merged one resident
        if not plan.is_empty and self._may_overlap():
            failed = self._launch(plan, None)       # queued: the next decode goes in behind it before its tokens
            if self._flight is not None:            # are read
                return self._step_in_flight()
            tokens = failed if failed is not None else self._run(plan)
        else:
            tokens = self._run(plan) if not plan.is_empty else {}   # forward + sample
        outputs = self._finish(plan, tokens)         # append, stop checks, free pages, stream deltas
        self.memory.after(plan, list(self.scheduler.waiting), idle=not self.scheduler.num_unfinished)
        return outputs

    # -- async scheduling: the next decode queued before the tokens of the one in flight are read ----------
    def _may_overlap(self) -> bool:
        """Whether decode iterations may be queued behind one another: the engine's setting, one GPU, the
        unmerged policy with nothing merged, no swapper (its copies run on their own stream), graphs to
        replay (with the LoRA kernels, when there are adapters)."""
        graphs = self.runner.graphs
        return (self.config.scheduler.async_scheduling and graphs is not None
                and self.config.model.tensor_parallel_size == 1 and self.config.scheduler.policy == "unmerged"
                and self.runner.modes.merged is None and self.swapper is None
                and (graphs.lora_setup is not None or not len(self.adapters)))

    def _launch(self, plan: StepPlan, prev: Launched | None, commit: bool = True) -> dict[str, RequestFailed] | None:
        """Queue ``plan`` (a graph-replayed decode) as the iteration in flight (``self._flight``; left None when
        the graphs cannot replay it); returns None, or, when queueing failed, every request's
        :class:`RequestFailed`. ``commit``: count its tokens computed now (:meth:`_commit`)."""
        mode = self.runner.modes.mode_for([s.seq.adapter for s in plan.scheduled])
        t0 = time.perf_counter()
        try:
            launched = self.runner.launch(plan.scheduled, prev)
        except Exception as e:
            return self._forward_failed(plan, e)
        if launched is None:                       # not one the graphs replay: nothing queued
            return None
        self._forward_failures = 0
        self._flight = _Flight(plan, launched, mode, t0)
        if commit:
            self._commit(plan.scheduled)
        return None

    @staticmethod
    def _commit(scheduled) -> None:
        """The queued tokens count as computed; each sequence holds a pending token until they are read."""
        for s in scheduled:
            s.seq.num_computed += 1
            s.seq.output_token_ids.append(Sequence.PENDING)

    def _step_in_flight(self) -> list[RequestOutput]:
        """With a decode in flight: queue the next one behind it where that is exact, then read the first one's
        tokens and finish it. Returns the outputs of the iteration whose tokens were read."""
        flight, self._flight = self._flight, None
        nxt = self._lookahead(flight)
        failed = None
        if nxt is not None:
            self.memory.prepare(nxt, self.runner.modes)
            failed = self._launch(nxt, flight.launched, commit=False)
        queued, self._flight = self._flight, None
        if nxt is not None and queued is None and failed is None:
            raise RuntimeError("async scheduling: the lookahead decode could not be queued")
        # the sequences hold the pending tokens of ``flight`` until it is finished; then ``queued``'s count
        outputs = self._finish(flight.plan, self._land(flight), committed=True)
        live = tuple(s for s in nxt.scheduled if not s.seq.is_finished) if nxt is not None else ()
        if queued is not None:
            self.num_overlapped += 1
            self._commit(live)
            self._flight = queued
            if not live:                   # every row ended with the tokens just read: nothing left to wait for
                self.land_in_flight()
        elif failed is not None and live:
            outputs += self._finish(replace(nxt, scheduled=live), failed)
        # no adapter prefetch for the queue while a decode is in flight: its copy stream could fill pages that
        # sequences finished just now still have a (wasted) row writing to
        waiting = [] if self._flight is not None else list(self.scheduler.waiting)
        self.memory.after(flight.plan, waiting, idle=not self.scheduler.num_unfinished)
        return outputs

    def _lookahead(self, flight: _Flight) -> StepPlan | None:
        """The next decode, scheduled while the tokens of ``flight`` are still on the device: every running
        sequence continues but those its pending token ends (``max_tokens``, ``max_model_len``). None where that
        would not be exact or not a graph replay: a waiting request could be admitted (the batch has room; with
        none, it is admitted once a sequence ends, one iteration later than without the lookahead), a running
        sequence has more than one token to compute, a new page would have to be reclaimed or a sequence
        preempted, or the batch outgrows the graphs."""
        sched = self.scheduler
        if not self._may_overlap() or (sched.waiting and len(sched.running) < self.config.scheduler.max_num_seqs):
            return None
        pool, bs, mml = self.allocator, self.block_size, self.max_model_len
        eligible, pages = [], 0
        limit = None
        for seq in sched.running:
            out, done, p = seq.output_token_ids, seq.num_computed, seq.params
            total = len(seq.prompt_token_ids) + len(out)
            if total - done != 1 or p.task_head:
                return None
            if len(out) >= p.max_tokens or total >= mml:
                continue                               # its pending token is its last
            eligible.append(seq.request_id)
            if len(seq.blocks) * bs <= done:          # its next token starts a page
                pages += 1
                limit = pool.num_blocks if limit is None else limit
                if len(seq.blocks) + 1 > limit:
                    return None
        if (not eligible or len(eligible) > self.runner.graphs.max_batch or pages > pool.num_free
                or len(eligible) > self.config.scheduler.max_num_batched_tokens):
            return None
        plan = self._schedule(only=eligible)
        if plan.preempted or plan.truncated or len(plan.scheduled) != len(eligible):
            raise RuntimeError("async scheduling: the lookahead schedule is not the decode its checks promise")
        return plan

    def _land(self, flight: _Flight) -> dict[str, int | RequestFailed]:
        """Read the tokens of ``flight`` (waits for them); a failure fails each of its requests."""
        plan = flight.plan
        try:
            tokens = flight.launched.result()
        except Exception as e:
            return self._forward_failed(plan, e)
        now = time.perf_counter()
        seconds = now - max(flight.t0, self._last_landed)   # queued behind another: from when that one landed
        self._last_landed = now
        self.orchestrator.observe(flight.mode, seconds, decode_only=True)
        self.estimator.observe(0, len(plan.scheduled), seconds)
        self.last_mode = flight.mode
        return tokens

    @property
    def in_flight(self) -> bool:
        """Whether a decode iteration is queued on the device and its tokens not read yet."""
        return self._flight is not None

    def land_in_flight(self) -> None:
        """Finish the iteration in flight, if any (its outputs go out with the next step's)."""
        flight, self._flight = self._flight, None
        if flight is not None:
            # _finish takes the pending outputs and leaves a new list: extend that one, after the call
            outputs = self._finish(flight.plan, self._land(flight), committed=True)
            self._pending.extend(outputs)

    def _schedule(self, only: list[str] | None = None) -> StepPlan:
        """SLO rejections, the mode policy's pick, the requests whose adapters can be resident, then the
        scheduler's fit of them into the token budget and free pages; the policy's weights applied."""
        for seq, reason in self.admission.reject(list(self.scheduler.waiting), time.monotonic(), self.estimator):
            self.scheduler.finish(seq, "rejected")
            self._seqs.pop(seq.request_id, None)
            self._pending.append(self._output(seq, [], error=reason))
        modes, sched = self.runner.modes, self.scheduler
        decision = self.orchestrator.plan(sched.unfinished(), modes, self.adapters)
        room = max(0, self.config.scheduler.max_num_seqs - len(sched.running))
        ready = self.memory.runnable(sched.running, list(sched.waiting), room, modes.merged)
        out = sched.schedule(_both(_both(None if decision is None else decision.batch, ready), only))
        preempted, truncated = out.preempted, out.truncated
        if out.is_empty and decision is not None:   # the policy's requests cannot run now (memory): run anyone;
            out = sched.schedule(ready)             # outputs never depend on the mode, only speed does
            preempted, truncated = preempted + out.preempted, truncated + out.truncated
        self.orchestrator.apply(decision, modes, self.adapters)
        if self.hand_back_preempted:
            for seq in preempted:
                self.hand_back(seq.request_id)
        return StepPlan(out.scheduled, preempted, truncated, decision)

    def _run(self, plan: StepPlan) -> dict[str, int | TaskResult | RequestFailed]:
        """Forward + sample. A forward that fails without being pinned on one request fails every request
        of the iteration (a :class:`RequestFailed` each) and puts the base weights back; a CUDA error, or the
        forward failing ``MAX_FORWARD_FAILURES`` iterations in a row, raises :class:`EngineFatal`."""
        mode = self.runner.modes.mode_for([s.seq.adapter for s in plan.scheduled])
        t0 = time.perf_counter()
        try:
            tokens = self.runner.run(plan.scheduled)
        except Exception as e:
            return self._forward_failed(plan, e)
        self._forward_failures = 0
        seconds = time.perf_counter() - t0
        decodes = sum(1 for s in plan.scheduled if s.start >= len(s.seq.prompt_token_ids))
        prefill = sum(s.num_tokens for s in plan.scheduled if s.start < len(s.seq.prompt_token_ids))
        self.orchestrator.observe(mode, seconds, decode_only=all(s.num_tokens == 1 for s in plan.scheduled))
        self.estimator.observe(prefill, decodes, seconds)
        self.last_mode = mode
        return tokens

    def _forward_failed(self, plan: StepPlan, exc: Exception) -> dict[str, RequestFailed]:
        self._forward_failures += 1
        if isinstance(exc, EngineFatal):            # already says why (e.g. a tensor-parallel worker exited)
            raise exc
        if is_fatal(exc):
            raise EngineFatal(f"the device failed: {describe(exc)}") from exc
        if self._forward_failures >= MAX_FORWARD_FAILURES:
            raise EngineFatal(f"the forward failed {self._forward_failures} iterations in a row; last: "
                              f"{describe(exc)}") from exc
        log.error("iteration failed; failing its %d request(s)", len(plan.scheduled), exc_info=exc)
        self.memory.release_pins()
        if self.runner.modes.merged is not None:    # back to the base weights (exact); the policy decides anew
            self.runner.modes.unmerge()
        failed = RequestFailed(f"the batched forward failed: {describe(exc)}")
        return {s.seq.request_id: failed for s in plan.scheduled}

    def _finish(self, plan: StepPlan, tokens: dict, committed: bool = False) -> list[RequestOutput]:
        """Each request of the plan on its own: an error in one (its token a :class:`RequestFailed`, or its stop
        checks or detokenizing raising) finishes it with ``finish_reason="error"`` and frees its memory.
        ``committed``: the plan was queued (:meth:`_launch`): its tokens are counted computed and each sampled
        token takes the place of its sequence's pending one; a sequence finished meanwhile is skipped."""
        results, self._pending = self._pending, []
        for seq in plan.truncated:
            self._seqs.pop(seq.request_id, None)
            results.append(self._output(seq, []))
        for s in plan.scheduled:
            seq, token = s.seq, tokens.get(s.seq.request_id)
            if committed:
                if seq.is_finished:                 # by the iteration before (its row here was wasted)
                    continue
                seq.output_token_ids.pop()          # the pending token: the sampled one, or none on failure
            if isinstance(token, RequestFailed):    # its KV of this iteration is not counted computed
                results.append(self._fail(seq, str(token)))
                continue
            if not committed:
                seq.num_computed += s.num_tokens
            if token is None:
                continue
            try:
                results.append(self._advance(seq, token))
            except Exception as e:
                if is_fatal(e):
                    raise
                log.exception("request %s failed after its forward", seq.request_id)
                results.append(self._fail(seq, f"finishing the step failed: {describe(e)}"))
        return results

    def _advance(self, seq: Sequence, token: int | TokenLogprobs | TaskResult) -> RequestOutput:
        """Append a sampled token (or a task head's answer) to ``seq``; stop checks; its output."""
        if isinstance(token, TaskResult):   # answered by the adapter's task head: no decode
            seq.task = token
            self.scheduler.finish(seq, "stop")
            del self._seqs[seq.request_id]
            return self._output(seq, [])
        if isinstance(token, TokenLogprobs):   # a row that asked for logprobs: the token and its logprobs
            seq.logprobs.append(token)
            seq.cumulative_logprob += token.logprob
            token = token.token_id
        seq.output_token_ids.append(token)
        seq.last_progress = time.monotonic()
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id]
        return self._output(seq, [token])

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """Finish ``seq`` with ``finish_reason="error"``; its pages go back (to the prefix cache or the pool)."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"
        self._seqs.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, seq.adapter_name, seq.prompt_token_ids, list(seq.output_token_ids),
                             seq.text, True, "error", [], "", reason, seq.task, *_logprobs(seq))

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.detokenizer.update(seq)
            return "stop"
        if self.detokenizer.tokenizer is not None and self.detokenizer.update(seq):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new_tokens: list[int], error: str | None = None) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.adapter_name, seq.prompt_token_ids, list(seq.output_token_ids),
                             seq.text, seq.is_finished, seq.finish_reason, new_tokens,
                             self.detokenizer.stream_delta(seq), error, seq.task, *_logprobs(seq))


def _logprobs(seq: Sequence) -> tuple:
    """(logprobs, prompt_logprobs, cumulative_logprob) of a RequestOutput: copies of what ``seq`` asked for."""
    lp = seq.logprobs
    return (None if lp is None else list(lp),
            None if seq.prompt_logprobs is None else list(seq.prompt_logprobs),
            None if lp is None else seq.cumulative_logprob)


def _tensor_parallel(model, config: EngineConfig, dtype: torch.dtype, device: torch.device, kernel_lora: bool):
    """Start the tensor-parallel workers; returns rank 0's model. Refuses what the split does not cover yet.
    An LMM's vision tower stays on rank 0 (``vlora/parallel/__init__.py`` says why). ``kernel_lora``: adapters
    live in the pool (the workers keep their slices in host memory to place them)."""
    from vlora.parallel.group import WorkerSpec
    from vlora.parallel.model import tensor_parallel

    mc, tp = config.model, config.model.tensor_parallel_size
    if getattr(model.cfg, "num_experts", 0):
        raise ConfigError(f"tensor_parallel_size {tp} does not support a mixture of experts (the experts are "
                          f"not split yet)")
    if config.cache.memory_policy == "fastlibra":
        raise ConfigError(f"tensor_parallel_size {tp} does not support memory_policy fastlibra (the swapper "
                          f"copies rank 0's pages only)")
    if config.cache.merged_copy:
        raise ConfigError(f"tensor_parallel_size {tp} does not support merged_copy (merges fold each rank's "
                          f"slices into its shard in place)")
    spec = WorkerSpec(mc.model, dtype, device.type, mc.max_model_len, mc.seed, timeout_s=60.0,
                      all_reduce=mc.all_reduce, host_adapters=kernel_lora)
    return tensor_parallel(model, tp, spec, device)


def _rank0_cut(tp: int):
    """Tensor parallelism: rank 0's cut of the model, applied while it is built where the loader can."""
    if tp == 1:
        return None
    from vlora.parallel.partition import Shard, shard_decoder

    return lambda model: shard_decoder(model, Shard.of(model.cfg, 0, tp))


def _size(config: EngineConfig, cfg, device: torch.device, dtype: torch.dtype, max_model_len: int,
          adapters_in_pool: int) -> Sizing:
    """The pool's pages and the batch limits for this device (:mod:`vlora.memory.sizing`)."""
    cc, sc, mc = config.cache, config.scheduler, config.model
    total = used = None
    if device.type == "cuda":
        torch.cuda.empty_cache()                  # loading's freed blocks are the pool's to take
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    return plan(cfg, device_type=device.type, dtype_bytes=torch.finfo(dtype).bits // 8, block_size=cc.block_size,
                max_model_len=max_model_len, num_blocks=cc.num_blocks, kv_cache_memory_gb=cc.kv_cache_memory_gb,
                gpu_memory_utilization=cc.gpu_memory_utilization, max_num_seqs=sc.max_num_seqs,
                max_num_batched_tokens=sc.max_num_batched_tokens, adapters_in_pool=adapters_in_pool,
                max_lora_rank=config.lora.max_lora_rank, cuda_graphs=mc.cuda_graphs, total_bytes=total,
                used_bytes=used)


def _both(a, b):
    """Request ids allowed by both filters (None: no filter), in ``a``'s order."""
    if a is None or b is None:
        return b if a is None else a
    return tuple(r for r in a if r in b)


def _load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    has_tok = any(os.path.exists(os.path.join(model_dir, f))
                  for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(model_dir) if has_tok else None


@dataclass
class _Flight:
    """A decode iteration queued on the device whose tokens the engine has not read yet."""

    plan: StepPlan
    launched: Launched
    mode: object              # the inference mode it runs in
    t0: float                 # when it was queued
