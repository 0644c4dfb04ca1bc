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
preempted, one GPU, nothing merged and nothing about to be (a merging policy's decision for the next
iteration checked first). A sequence that turns out finished by
the tokens read back has a wasted row in the iteration queued behind; its output
stops where the tokens did. Anything that changes the engine from outside the loop
(abort, merges, unregistering) first lands the iteration in flight (``land_in_flight``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from vlora.config import ConfigError, EngineConfig
from vlora.engine.admission import SLO, Admission, ServiceEstimator
from vlora.engine.cuda_graphs import CHUNK_SLOTS
from vlora.engine.detokenizer import Detokenizer
from vlora.engine.faults import MAX_FORWARD_FAILURES, EngineFatal, RowFailed, describe, is_fatal
from vlora.engine.guided import GrammarError, Grammars, Guide
from vlora.engine.executor import Executor
from vlora.engine.mode_costs import ModeCosts
from vlora.engine.observer import StepObserver, StepRecord
from vlora.engine.orchestrator import Orchestrator
from vlora.engine.runner import Launched
from vlora.engine.plan import StepPlan
from vlora.engine.scheduler import Scheduler
from vlora.engine.sequence import RequestOutput, Sequence, TokenLogprobs
from vlora.lora.adapter import ModelShape
from vlora.lora.batch import PackedAdapter
from vlora.lora.registry import AdapterRegistry
from vlora.lora.task_head import TaskResult
from vlora.memory.manager import MemoryManager
from vlora.memory.pool import UnifiedPool
from vlora.memory.sizing import Sizing, plan
from vlora.models.build import load_model, load_tokenizer
from vlora.models.loader import resolve_model_dir
from vlora.models.lmm import ImageInputError
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


def default_policy(config: EngineConfig, device: torch.device) -> str:
    """The inference-mode policy where none is asked for: V-LoRA's on one GPU, where paired runs found it never
    slower than a fixed policy beyond the noise, faster at skewed popularity, and offline within 3% of unmerged
    on even popularity (docs/decisions.md); unmerged on the CPU and under tensor parallelism, where merging is
    unmeasured."""
    return "vlora" if device.type == "cuda" and config.model.tensor_parallel_size == 1 else "unmerged"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _settled(method):
    """Marks an engine method that changes the engine from outside the step loop: the iterations queued on the
    device land first (their outputs go out with the next step's), so that it sees every sequence's tokens."""
    @functools.wraps(method)
    def settled(self, *args, **kwargs):
        self.land_in_flight()
        return method(self, *args, **kwargs)
    return settled


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, executor: type[Executor] | None = None,
                 hand_back_preempted: bool = False, observers: Iterable[StepObserver] = ()):
        """``executor``: what runs the iterations (:mod:`vlora.engine.executor`; ``vlora.build_engine`` picks
        the tensor-parallel one from the configuration). ``hand_back_preempted`` (cluster replicas): a request
        preempted for KV goes back to the cluster front (finish "migrate") to resume elsewhere by recompute,
        rather than wait here for pages this replica is short of. ``observers``: told of each forward and step
        (:mod:`vlora.engine.observer`)."""
        config = config or EngineConfig()
        self.observers: list[StepObserver] = list(observers)
        self.device = resolve_device(config.model.device)
        if config.scheduler.policy is None:
            config = replace(config, scheduler=replace(config.scheduler, policy=default_policy(config, self.device)))
        self.config = config
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        # the model, loaded by what runs it (this rank's cut, under tensor parallelism)
        self.executor = ex = (executor or Executor)(config, self.dtype, self.device)
        self.model, self.max_model_len, self.vision = ex.model, ex.max_model_len, ex.vision
        # random:<preset> models have no tokenizer unless given one: prompts are token ids
        tok_dir = resolve_model_dir(config.model.tokenizer) if config.model.tokenizer else ex.model_dir
        self.tokenizer = load_tokenizer(tok_dir) if tok_dir is not None else None
        cfg = self.model.cfg
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        # structured output: requests' grammars, compiled once per distinct spec (needs the tokenizer)
        self.grammars = None if self.tokenizer is None else \
            Grammars(self.tokenizer, cfg.vocab_size, tuple(sorted(self.eos_token_ids)))

        cc, lc = config.cache, config.lora
        self.block_size = cc.block_size
        self.sizing = _size(config, ex.local_cfg, self.device, self.dtype, self.max_model_len,
                            lc.max_loras if ex.kernel_lora else 0)
        sc = config.scheduler
        if sc.max_num_seqs is None or sc.max_num_batched_tokens is None:    # the limits chosen for this device
            sc = replace(sc, max_num_seqs=self.sizing.max_num_seqs,
                         max_num_batched_tokens=self.sizing.max_num_batched_tokens)
            self.config = config = replace(config, scheduler=sc)
            ex.config = config
        cuda = self.device.type == "cuda"
        graphed = cuda and config.model.cuda_graphs and ex.use_kernels and ex.graph_safe
        mixed_graphs = graphed and config.model.tensor_parallel_size == 1    # TP's workers replay decodes only
        if sc.max_prefill_tokens_with_decodes is None:   # a bound of its own where such iterations replay graphs
            bound = min(1024, sc.max_num_batched_tokens) if mixed_graphs else sc.max_num_batched_tokens
            sc = replace(sc, max_prefill_tokens_with_decodes=bound)
            self.config = config = replace(config, scheduler=sc)
            ex.config = config
        pages = self.sizing.num_pages
        fixed = cc.memory_policy == "lru-fixed"
        self.pool = UnifiedPool(pages, cfg.num_layers, cc.block_size, ex.kv_heads, cfg.head_dim,
                                self.dtype, self.device,
                                adapter_limit=int(pages * cc.adapter_pool_fraction) if fixed else None)
        self.allocator = self.pool                    # KV blocks are pages of the unified pool
        ins, outs = cfg.lora_in_out()
        self.adapters = AdapterRegistry(ModelShape(cfg.name, cfg.num_layers, ins, outs), lc.max_lora_rank,
                                        self.dtype, self.device, lc.check_base_model, lc.lora_kernel, self.pool)
        ex.attach(self.adapters)
        self.memory = MemoryManager(self.pool, self.adapters, cc)   # pool, adapter store, prefix tree, swapper
        self.prefix_cache, self.swapper = self.memory.tree, self.memory.swapper
        if self.swapper is not None:
            self.swapper.mirror = ex.mirror_kv_swaps(self.swapper.host_slots)
        self.scheduler = Scheduler(sc, self.allocator, cc.block_size, self.prefix_cache,
                                   CHUNK_SLOTS if mixed_graphs else None)
        graph_batch = sc.max_num_seqs if graphed else 0
        ex.start(self.pool.kv, cc.block_size, tuple(sorted(self.eos_token_ids)), self.adapters, graph_batch,
                 self.memory.copies)
        self.runner = ex.runner                       # rank 0's model runner (its graphs, modes, sampler)
        self.runner.before_sync = self._before_sync
        self.kernel_build = ex.kernel_build           # what start-up built (vlora.engine.warmup)
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
        # iterations handed to the executor whose tokens are not read yet, oldest first: at most one without
        # async scheduling, two while decodes are queued behind one another
        self._queue: deque[_Queued] = deque()
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
                    slo: SLO | None = None, images=None, resumed: int = 0) -> str:
        """Queue a request; ``slo`` overrides its adapter's latency targets (see :meth:`set_slo`).
        ``images`` (LMMs): one entry per image placeholder of the prompt, an image (PIL image, encoded bytes,
        a path or a preprocessed [C, H, W] tensor) or a video (a list of frames); see ``models/lmm.py``.
        ``resumed``: the prompt's last tokens are a moved request's output so far (the cluster front resumes it
        here by recompute), never read as image placeholders, whatever ids the model sampled."""
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
        if not 0 <= resumed <= len(ids):
            raise RequestError(f"resumed must be between 0 and the prompt's {len(ids)} tokens, got {resumed}")
        tail = ids[len(ids) - resumed:]
        ids, spans = self._images(ids[:len(ids) - resumed], images)
        ids = ids + tail
        self._check_fits(ids, packed)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        guide = None if params.guided is None else self._guide(params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, ids, params, packed, next(self._arrivals),
                       prompt=prompt if isinstance(prompt, str) else None, sample_seed=seed, slo=slo, images=spans)
        seq.guide = guide
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _guide(self, params: SamplingParams) -> Guide:
        """The compiled grammar of a structured-output request, its state at the start of the output."""
        if self.grammars is None:
            raise RequestError(f"model {self.model_name!r} has no tokenizer: structured output needs one",
                               param="guided")
        try:
            return self.grammars.compile(params.guided)
        except GrammarError as e:
            raise RequestError(str(e), param="guided") from None

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

    def requests_of(self, adapter: str) -> list[str]:
        """The ids of the unfinished requests of ``adapter``."""
        return [rid for rid, seq in self._seqs.items() if seq.adapter_name == adapter]

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its memory; False if it is unknown or already finished."""
        return self._stop(request_id, "abort")

    def hand_back(self, request_id: str) -> bool:
        """Stop a request and free its memory, finishing it with ``finish_reason="migrate"``: its output holds the
        tokens generated so far, from which the cluster front resumes it on another replica. False if unknown, if
        its adapter is being unloaded (``unloading``), or if it follows a grammar (its grammar's state lives here;
        resumed elsewhere from its tokens, the grammar would start over): then it stays, and finishes here."""
        seq = self._seqs.get(request_id)
        if seq is not None and (seq.adapter_name in self.unloading or seq.guide is not None):
            return False
        return self._stop(request_id, "migrate")

    @_settled
    def _stop(self, request_id: str, reason: str) -> bool:
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

    @_settled
    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter no request uses; unmerged first if it is the merged one."""
        if any(s.adapter_name == name for s in self._seqs.values()):
            raise RequestError(f"adapter {name!r} is in use by running requests")
        merged = self.executor.modes.merged
        if merged is not None and merged.name == name:
            self.executor.modes.unmerge()
        self.executor.modes.forget(name)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_adapter(name)
        self.adapters.unregister(name)
        self.admission.set_slo(name, None)

    # -- inference modes (the orchestrator decides; these are the mechanics) -------------------
    @_settled
    def merge_adapter(self, name: str) -> float:
        """Fold adapter ``name`` into the base weights (exact; other requests keep their outputs)."""
        return self.executor.modes.merge(self.adapters.get(name))

    @_settled
    def unmerge_adapter(self) -> float:
        """Restore the base weights bit for bit."""
        return self.executor.modes.unmerge()

    @_settled
    def profile_modes(self, reps: int = 10) -> ModeCosts | None:
        """Time the inference modes on this GPU (:mod:`vlora.engine.mode_costs`) with up to nine registered
        adapters (the largest rank is the one merged), and give the orchestrator those costs from now on. Needs
        the decode CUDA graphs (their mixed kind is captured here), two registered adapters and nothing merged;
        None (nothing changed) otherwise. Run it while no request is in flight: the timed replays and merges hold
        the GPU."""
        from vlora.engine.mode_costs import profile_modes

        store, names = self.adapters.store, self.adapters.names()[:9]
        if self.executor.graphs is None or store is None or len(names) < 2 or self.executor.modes.merged is not None:
            return None
        adapters = sorted((self.adapters.get(n) for n in names), key=lambda a: -a.rank)   # the largest merges
        if len(store.ensure(adapters, set())) < 2:
            return None
        self.executor.capture_graphs(mixed=True)
        self.mode_costs = profile_modes(self.runner, adapters, self.config.scheduler.max_num_seqs, reps)
        self.orchestrator.profile = self.mode_costs
        return self.mode_costs

    @_settled
    def close(self) -> None:
        """Stop what the executor started (tensor-parallel workers; they also stop when this process exits)."""
        self.executor.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending) or bool(self._queue)

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
        """Schedule, prepare memory and hand iterations to the executor until the queue is full (one iteration;
        two while a decode can be queued behind the one in flight), then finish the oldest."""
        while len(self._queue) < (2 if self._may_overlap() else 1):
            behind = self._queue[-1] if self._queue else None
            plan = self._schedule() if behind is None else self._lookahead(behind)
            if plan is None:
                break
            self.memory.prepare(plan, self.executor.modes)   # the plan's adapters pinned, the merged one resident
            item = self._submit(plan, behind)                # forward + sample: queued on the device, or done
            self._queue.append(item)
            if item.launched is None:                        # computed (or failed): nothing goes behind it
                break
        return self._land()

    @property
    def in_flight(self) -> bool:
        """Whether an iteration is queued on the device and its tokens not read yet."""
        return bool(self._queue)

    def land_in_flight(self) -> None:
        """Finish the iterations queued on the device, if any (their outputs go out with the next step's)."""
        while self._queue:
            outputs = self._land(after=False)    # takes the pending outputs and leaves a new list: extend that one
            self._pending.extend(outputs)

    def _may_overlap(self) -> bool:
        """Whether decode iterations may be queued behind one another (async scheduling): the engine's setting,
        an executor that can, nothing merged (a merging policy queues only while it keeps everything unmerged:
        :meth:`_lookahead`), no swapper (its copies run on their own stream), graphs to replay (with the LoRA
        kernels, when there are adapters)."""
        graphs = self.executor.graphs
        return (self.config.scheduler.async_scheduling and self.executor.may_queue and graphs is not None
                and self.executor.modes.merged is None
                and self.swapper is None and (graphs.lora_setup is not None or not len(self.adapters)))

    def _submit(self, plan: StepPlan, behind: _Queued | None) -> _Queued:
        """Hand ``plan`` to the executor once: a decode the graphs replay is queued on the device while async
        scheduling may queue (behind ``behind``, whose pending tokens are its input), anything else is computed
        now. A forward that fails fails every request of the plan (:meth:`_forward_failed`)."""
        mode = self.executor.modes.mode_for([s.seq.adapter for s in plan.scheduled])
        item = _Queued(plan, mode, time.perf_counter())
        if plan.is_empty:
            item.tokens = {}
            return item
        try:
            if self._may_overlap():
                item.launched = self.executor.launch(plan.scheduled, None if behind is None else behind.launched)
            if item.launched is None and behind is None:
                item.tokens = self.executor.run(plan.scheduled)
            if item.launched is None and item.tokens is None:
                # the lookahead queues only decodes whose graph is captured (DecodeGraphs.can_queue): not expected
                raise RuntimeError("async scheduling: the lookahead decode could not be queued")
        except Exception as e:
            item.launched, item.tokens = None, self._forward_failed(plan, e)
            return item
        self._forward_failures = 0
        if item.launched is not None:
            if behind is None:                    # its rows' pending tokens; one queued behind another takes
                self._commit(plan.scheduled)      # them once the one before has landed (:meth:`_land`)
            return item
        seconds = time.perf_counter() - item.t0
        decodes = sum(1 for s in plan.scheduled if s.start >= len(s.seq.prompt_token_ids))
        prefill = sum(s.num_tokens for s in plan.scheduled if s.start < len(s.seq.prompt_token_ids))
        self.orchestrator.observe(mode, seconds, decode_only=all(s.num_tokens == 1 for s in plan.scheduled))
        self.estimator.observe(prefill, decodes, seconds)
        self.last_mode = mode
        return item

    def _land(self, after: bool = True) -> list[RequestOutput]:
        """Finish the oldest iteration of the queue (reading its tokens waits for them). The one behind it, if
        any, then holds the pending tokens of its rows still running; one whose rows all ended, or whose
        queueing failed, is finished too. ``after``: the memory's after-iteration work follows."""
        item = self._queue.popleft()
        outputs = self._finish(item.plan, self._tokens(item), committed=item.launched is not None)
        if self._queue:
            nxt = self._queue[0]
            live = tuple(s for s in nxt.plan.scheduled if not s.seq.is_finished)
            if nxt.launched is not None:
                nxt.launched.sample()             # structured output's: its grammars have taken these tokens
                self.num_overlapped += 1
                self._commit(live)
                if not live:                      # every row ended with the tokens just read
                    outputs += self._land(after=False)
            else:                                 # its queueing failed: its live rows fail
                self._queue.popleft()
                outputs += self._finish(replace(nxt.plan, scheduled=live), nxt.tokens)
        if after:
            # no adapter prefetch while a decode is in flight: its copy stream could fill pages that sequences
            # finished just now still have a (wasted) row writing to
            waiting = [] if self._queue else list(self.scheduler.waiting)
            self.memory.after(item.plan, waiting, idle=not self.scheduler.num_unfinished)
        return outputs

    def _tokens(self, item: _Queued) -> dict:
        """The tokens of ``item``: read from the device for a queued one (waits), timed from when it was queued
        or when the one before it landed, whichever is later."""
        if item.launched is None:
            return item.tokens
        try:
            tokens = item.launched.result()
        except Exception as e:
            return self._forward_failed(item.plan, e)
        now = time.perf_counter()
        seconds = now - max(item.t0, self._last_landed)
        self._last_landed = now
        self.orchestrator.observe(item.mode, seconds, decode_only=True)
        self.estimator.observe(0, len(item.plan.scheduled), seconds)
        self.last_mode = item.mode
        return tokens

    @staticmethod
    def _commit(scheduled) -> None:
        """The queued tokens count as computed; each sequence holds a pending token until they are read."""
        for s in scheduled:
            s.seq.num_computed += 1
            s.seq.output_token_ids.append(Sequence.PENDING)

    def _lookahead(self, behind: _Queued) -> StepPlan | None:
        """The next decode, scheduled while the tokens of ``behind`` are still on the device: every running
        sequence continues but those its pending token ends (``max_tokens``, ``max_model_len``). None where
        that would not be exact (the scheduler's :meth:`~Scheduler.lookahead` says when), a sequence wants its
        task head, or ``behind``'s sampling is not queued yet (structured output: it waits for the tokens before
        it). None falls back to the synchronous loop exactly (the tokens are read, then the next iteration is
        scheduled). A structured-output row's next forward goes ahead; its sampling waits for the pending token
        (its mask depends on it: :meth:`Launched.sample <vlora.engine.runner.Launched.sample>`). Under a merging
        policy, None too where its decision for the next iteration merges or leaves out a row: a merge writes the
        weights the iteration in flight reads, and the lookahead runs every row."""
        sched = self.scheduler
        if (behind.launched is None or behind.launched.sampled is None
                or any(s.params.task_head for s in sched.running)):
            return None
        mml = self.max_model_len
        ending = {s.request_id for s in sched.running
                  if len(s.output_token_ids) >= s.params.max_tokens or s.num_tokens >= mml}
        ids = sched.lookahead(ending, self.executor.graphs.max_batch)
        if ids is None or not self.executor.graphs.can_queue(
                len(ids), any(self._seqs[r].adapter_name is not None for r in ids)):
            return None
        decision = self.orchestrator.plan(sched.unfinished(), self.executor.modes, self.adapters)
        if decision is not None and (decision.merged is not None or not set(ids) <= set(decision.batch)):
            return None
        plan = self._schedule(only=ids, planned=True, decision=decision)
        if plan.preempted or plan.truncated or len(plan.scheduled) != len(ids):
            raise RuntimeError("async scheduling: the lookahead schedule is not the decode the scheduler promised")
        return plan

    def _schedule(self, only: list[str] | None = None, planned: bool = False, decision=None) -> StepPlan:
        """SLO rejections, the mode policy's pick (``planned``: ``decision`` is one it made just now), the requests
        whose adapters can be resident, then the scheduler's fit of them into the token budget and free pages;
        the policy's weights applied."""
        sc = self.scheduler.config
        chunk = min(sc.max_prefill_tokens_with_decodes or sc.max_num_batched_tokens, sc.max_num_batched_tokens)
        for seq, reason in self.admission.reject(list(self.scheduler.waiting), time.monotonic(), self.estimator,
                                                 self.scheduler.running, chunk, sc.max_num_batched_tokens,
                                                 self.scheduler.max_chunks_with_decodes):
            self.scheduler.finish(seq, "rejected")
            self._seqs.pop(seq.request_id, None)
            self._pending.append(self._output(seq, [], error=reason))
        modes, sched = self.executor.modes, self.scheduler
        if not planned:
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

    def _forward_failed(self, plan: StepPlan, exc: Exception) -> dict[str, RowFailed]:
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
        if self.executor.modes.merged is not None:    # back to the base weights (exact); the policy decides anew
            self.executor.modes.unmerge()
        failed = RowFailed(f"the batched forward failed: {describe(exc)}")
        return {s.seq.request_id: failed for s in plan.scheduled}

    def _finish(self, plan: StepPlan, tokens: dict, committed: bool = False) -> list[RequestOutput]:
        """Each request of the plan on its own: an error in one (its token a :class:`RowFailed`, or its stop
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
            if isinstance(token, RowFailed):    # its KV of this iteration is not counted computed
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
        complete = seq.guide is not None and seq.guide.advance(token)     # its grammar allows nothing more
        reason = self._stop_reason(seq, token) or ("stop" if complete else None)
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


@dataclass
class _Queued:
    """An iteration handed to the executor: queued on the device (``launched``, its tokens not read yet) or
    computed (``tokens``)."""

    plan: StepPlan
    mode: object              # the inference mode it runs in
    t0: float                 # when it was handed over
    launched: Launched | None = None
    tokens: dict | None = None

