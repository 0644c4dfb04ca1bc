"""Model runner: scheduled sequences -> batch tensors -> forward -> sampled tokens.

All metadata (positions, KV slots, block tables, attention masks, LoRA segments)
is built once per iteration on the host, moved to the device in one go, and
shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from vlora.engine.faults import RowFailed, describe, is_fatal
from vlora.engine.guided import Masks
from vlora.engine.modes import ModeSwitcher
from vlora.engine.sampler import Sampled, Sampler
from vlora.engine.scheduler import ScheduledSeq
from vlora.engine.sequence import Sequence, TokenLogprobs
from vlora.lora.batch import LoRABatch, LoRALaunch
from vlora.lora.merge import group_widths
from vlora.lora.registry import AdapterRegistry
from vlora.lora.task_head import TaskResult, apply_heads
from vlora.models.decoder import DecoderLM
from vlora.models.forward_batch import ForwardBatch, PrefillChunk, PrefillMeta


ITERATION_PATHS = ("decode_graph", "mixed_graph", "eager")
"""How a forward ran: a decode graph replayed, a mixed graph replayed (prompt chunks beside decodes), or kernel by
kernel (prefills alone, images, task heads, the CPU, tensor parallelism)."""


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: torch.Tensor, block_size: int, device: torch.device,
                 eos_token_ids: tuple[int, ...], adapters: AdapterRegistry, use_kernels: bool = False,
                 graph_batch: int = 0, max_model_len: int = 0, vision=None,
                 lora_launch: LoRALaunch = LoRALaunch(), mixed_tokens: int = 0):
        """``kv_cache``: the pool's pages [P + 1, L, 2, block_size, Hkv, D], the last one a scratch block
        (CUDA-graph padding writes to it); ``vision``: an LMM's :class:`~vlora.models.lmm.VisionModel`;
        ``lora_launch``: how the LoRA kernels are launched (the engine's LoRAConfig);
        ``graph_batch`` > 0: replay decode iterations of up to that many sequences from CUDA graphs, and
        iterations that prefill up to ``mixed_tokens`` prompt tokens beside their decodes."""
        self.model = model
        self.kv_cache = kv_cache
        self.use_kernels = use_kernels
        self.block_size = block_size
        self.device = device
        self.window = model.cfg.sliding_window
        self.eos_token_ids = eos_token_ids
        self.adapters = adapters
        self.lora_launch = lora_launch
        self.modes = ModeSwitcher(model, None if adapters.store is None else adapters.store.pool)
        self.vision = vision
        self.num_images_encoded = 0                    # frames through the vision tower (prefix-cache hits skip it)
        # forwards by how they ran: "decode_graph", "mixed_graph" (prompt chunks beside decodes), "eager"
        self.iterations: dict[str, int] = dict.fromkeys(ITERATION_PATHS, 0)
        self.tiling = None
        if adapters.store is not None:                 # CUDA: ATMM kernels with this GPU's tiling table
            from vlora.kernels.tuning import TilingTable

            self.tiling = TilingTable.load()
            # tensor parallelism: the kernels see this rank's slices (its heads and MLP columns)
            self.group_widths, self.group_in = lora_groups(getattr(model, "local_cfg", model.cfg))
        self.graphs = None
        self._seg_cache = None        # (row adapters, merged adapter, mixed launch, segments) of the last replay
        self.sampler = Sampler(model.cfg.vocab_size, eos_token_ids, device)
        self.masks = Masks(model.cfg.vocab_size, device)   # structured output: the batch's grammar bitmask
        # called once per forward, after it is queued and before anything waits for it (the async engine
        # hands the previous iteration's outputs to the event loop then)
        self.before_sync: Callable[[], None] | None = None
        if graph_batch > 0:
            self.enable_graphs(graph_batch, max_model_len, mixed_tokens=mixed_tokens)

    def enable_graphs(self, max_batch: int, max_model_len: int, columns: int = 512, mixed_tokens: int = 0) -> None:
        """Replay decode iterations of up to ``max_batch`` sequences from captured graphs, and iterations that
        prefill up to ``mixed_tokens`` prompt tokens beside them (not under tensor parallelism) (on a CPU: an
        emulation that re-runs the captured forward on the same static buffers, for tests)."""
        from vlora.engine.cuda_graphs import DecodeGraphs

        make = getattr(self.model, "decode_graphs", None)     # tensor parallelism: every rank's graphs
        kw = {"mixed_tokens": mixed_tokens} if make is None else {}
        scratch = (self.kv_cache.shape[0] - 1) * self.block_size
        store = self.adapters.store
        lora = None if self.tiling is None else (lambda: store.buf, self.group_widths, self.group_in, self.tiling,
                                                 self.adapters.max_rank)
        self.graphs = (make or DecodeGraphs)(self.model, self.kv_cache, max_batch, -(-max_model_len // self.block_size),
                                             scratch, lora, columns, self.lora_launch, **kw)

    def capture_graphs(self, mixed: bool = False) -> None:
        """Capture every decode graph now (they are otherwise captured on a batch size's first use, which lands
        inside whatever is being timed); ``mixed``: the mixed-mode kind too. No-op without graphs."""
        if self.graphs is not None:
            self.graphs.capture_all(with_lora=True, mixed=mixed)

    @staticmethod
    def order(scheduled: tuple[ScheduledSeq, ...]) -> list[ScheduledSeq]:
        """Decodes first, then prefill chunks; inside each, grouped by adapter (long LoRA segments)."""
        return sorted(scheduled, key=lambda s: (s.num_tokens > 1, -1 if s.seq.adapter is None else s.seq.adapter.slot))

    def prepare(self, ordered: list[ScheduledSeq]) -> ForwardBatch:
        bs, dev, kernel = self.block_size, self.device, self.use_kernels
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        runs = []
        logits_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        chunks: list[tuple[int, int, int, list[int]]] = []     # (row, new tokens, context, blocks)
        embed_rows: list[range] = []
        embed_values: list[torch.Tensor] = []
        # M-RoPE positions [3, T] only when a chunk covers a prompt with images (else flat: text positions)
        mrope = [] if any(s.seq.mrope is not None and s.start < len(s.seq.prompt_token_ids) for s in ordered) else None
        for s in ordered:
            seq, start, n = s.seq, s.start, s.num_tokens
            row = len(ids)
            ids.extend(seq.tokens(start, start + n))
            pos = range(start, start + n)
            positions.extend(p + seq.rope_delta for p in pos)
            if mrope is not None:
                mrope.append(seq.rope_positions(start, start + n))
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in pos)
            runs.append((row, row + n, seq.adapter))
            for k, lo, hi in _image_overlaps(seq, start, n):
                span = seq.images[k]
                embed_rows.append(range(row + lo - start, row + hi - start))
                embed_values.append(seq.image_embeds[k][lo - span.offset:hi - span.offset])
            ctx = start + n
            nblocks = -(-ctx // bs)
            if n == 1:
                decode_tables.append(seq.blocks[:nblocks])
                decode_lens.append(ctx)
            elif kernel:
                chunks.append((row, n, ctx, seq.blocks[:nblocks]))
            else:
                prefills.append(PrefillChunk(row, n, ctx, torch.tensor(seq.blocks[:nblocks], device=dev),
                                             self._prefill_mask(start, n)))
            if s.samples:
                logits_rows.append(row + n - 1)
        nd = len(decode_tables)
        table = lens = mask = None
        if nd:
            table = _padded_table(decode_tables, torch.int32 if kernel else torch.long, dev)
            lens = torch.tensor(decode_lens, dtype=torch.int32, device=dev)
            if not kernel:
                key = torch.arange(table.shape[1] * bs, device=dev)
                allowed = key < lens.unsqueeze(1)
                if self.window is not None:
                    allowed &= key > lens.unsqueeze(1) - 1 - self.window
                mask = allowed.view(nd, 1, 1, -1)
        prefill_meta = None
        if chunks:
            i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)   # noqa: E731
            prefill_meta = PrefillMeta(_padded_table([c[3] for c in chunks], torch.int32, dev),
                                       i32([c[0] for c in chunks]), i32([c[1] for c in chunks]),
                                       i32([c[2] for c in chunks]), max(c[1] for c in chunks))
        return ForwardBatch(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.cat(mrope, dim=1).to(dev) if mrope is not None else torch.tensor(positions, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            num_decodes=nd, decode_block_tables=table, decode_lens=lens, decode_max_len=max(decode_lens, default=0),
            decode_mask=mask,
            prefills=tuple(prefills), prefill_meta=prefill_meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            lora=self._lora_batch(runs), use_kernels=kernel,
            embed_rows=torch.tensor([r for rr in embed_rows for r in rr], device=dev) if embed_rows else None,
            embed_values=torch.cat(embed_values) if embed_values else None,
        )

    def _lora_batch(self, runs) -> LoRABatch | None:
        own, minus = self.modes.segments(runs, self.lora_launch.mixed)
        main = self._lora_pass(own)
        extra = self._lora_pass(minus)
        if main is None:
            return extra
        return replace(main, extra=extra) if extra is not None else main

    def _lora_pass(self, segs) -> LoRABatch | None:
        if not segs:
            return None
        if self.tiling is None:
            return LoRABatch(tuple(segs))
        from vlora.lora.device_store import build_kernel_batch

        return build_kernel_batch(segs, self.adapters.store, self.group_widths, self.group_in, self.tiling,
                                  self.device, self.lora_launch)

    def _prefill_mask(self, start: int, n: int) -> torch.Tensor | None:
        if start == 0 and (self.window is None or n <= self.window):
            return None                                    # plain causal
        q = torch.arange(start, start + n, device=self.device).unsqueeze(1)
        k = torch.arange(start + n, device=self.device).unsqueeze(0)
        allowed = k <= q
        if self.window is not None:
            allowed &= k > q - self.window
        return allowed

    def encode_images(self, ordered: list[ScheduledSeq]) -> None:
        """Run the vision tower once over every image (frame) this iteration's chunks need and has not yet
        encoded; the embeddings stay on their sequence until its chunks have passed the image."""
        need = [(s.seq, k) for s in ordered for k, _, _ in _image_overlaps(s.seq, s.start, s.num_tokens)
                if k not in s.seq.image_embeds]
        if not need:
            return
        spans = [seq.images[k] for seq, k in need]
        for (seq, k), emb in zip(need, self.vision.encode_spans(spans)):
            seq.image_embeds[k] = emb
        self.num_images_encoded += sum(span.frames for span in spans)

    @staticmethod
    def _drop_images(ordered: list[ScheduledSeq]) -> None:
        for s in ordered:
            end = s.start + s.num_tokens
            for k in [k for k in s.seq.image_embeds if s.seq.images[k].offset + s.seq.images[k].length <= end]:
                del s.seq.image_embeds[k]

    @torch.inference_mode()
    def run(self, scheduled: tuple[ScheduledSeq, ...]) -> dict[str, int | TaskResult | RowFailed]:
        """One forward over the scheduled chunks; returns request_id -> sampled token (a task head's answer
        for ``task_head`` requests; a :class:`RowFailed` for a request whose own part failed)."""
        launched = self.launch(scheduled)
        if launched is not None:
            return launched.result()
        ordered = self.order(scheduled)
        samplers = [s.seq for s in ordered if s.samples]
        logits = self._replay_mixed(ordered)
        if logits is not None:                         # prefills beside decodes, from a mixed graph
            self.iterations["mixed_graph"] += 1
            allowed = self.masks.fill(samplers)       # overlaps the forward
            self._launched()
            if not samplers:                          # prompt chunks alone, none at its prompt's end
                return {}
            picked = [i for i, s in enumerate(ordered) if s.samples]
            if len(picked) < len(ordered):
                logits = logits[torch.tensor(picked, dtype=torch.long, device=logits.device)]
            tokens = self.sampler.sample(logits, samplers, allowed=allowed).result()
            return {seq.request_id: t for seq, t in zip(samplers, tokens)}
        self.iterations["eager"] += 1
        self.encode_images(ordered)
        fb = self.prepare(ordered)
        hidden = self.model(fb, self.kv_cache)
        allowed = self.masks.fill([seq for seq in samplers if not seq.params.task_head])   # overlaps the forward
        self._launched()
        self._drop_images(ordered)
        self._prompt_logprobs(ordered, hidden)
        if not samplers:
            return {}
        answers, samplers, hidden = self._task_heads(samplers, hidden[fb.logits_rows])
        if not samplers:
            return answers
        logits = self.model.compute_logits(hidden, fast=fb.use_kernels)
        tokens = self.sampler.sample(logits, samplers, allowed=allowed).result()
        return answers | {seq.request_id: t for seq, t in zip(samplers, tokens)}

    def _prompt_logprobs(self, ordered: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Append to each sequence that asked for prompt logprobs those of the prompt tokens its chunk predicts
        (the logits of position p score token p + 1), from this forward's hidden rows; positions already scored
        (before a preemption) are skipped."""
        rows, targets, owners = [], [], []
        row = 0
        for s in ordered:
            seq, start, n = s.seq, s.start, s.num_tokens
            have = seq.prompt_logprobs
            if have is not None:
                for p in range(max(len(have), start + 1), min(start + n, len(seq.prompt_token_ids) - 1) + 1):
                    rows.append(row + p - 1 - start)
                    targets.append(seq.prompt_token_ids[p])
                    owners.append(seq)
            row += n
        if not rows:
            return
        k = max(seq.params.prompt_logprobs for seq in owners)
        chosen, top_v, top_i = [], [], []
        for lo in range(0, len(rows), 256):          # the logits of 256 positions at a time
            idx = torch.tensor(rows[lo:lo + 256], device=hidden.device)
            lp = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, idx)), dim=-1)
            tgt = torch.tensor(targets[lo:lo + 256], device=hidden.device)
            chosen += lp.gather(1, tgt[:, None])[:, 0].tolist()
            if k:
                top = lp.topk(k, dim=-1)
                top_v += top.values.tolist()
                top_i += top.indices.tolist()
        for j, (seq, t) in enumerate(zip(owners, targets)):
            own = seq.params.prompt_logprobs
            top = tuple(zip(top_i[j][:own], top_v[j][:own])) if own else ()
            seq.prompt_logprobs.append(TokenLogprobs(t, chosen[j], top))

    def can_launch(self, scheduled: tuple[ScheduledSeq, ...]) -> bool:
        """Whether the iteration is a decode the graphs replay (:meth:`launch` queues it without waiting)."""
        g = self.graphs
        return (g is not None and 0 < len(scheduled) <= g.max_batch
                and all(n == 1 and start + 1 == len(seq.prompt_token_ids) + len(seq.output_token_ids)
                        and not seq.params.task_head for seq, start, n in scheduled))

    @torch.inference_mode()
    def launch(self, scheduled: tuple[ScheduledSeq, ...], prev: Launched | None = None) -> Launched | None:
        """Queue a decode iteration's graph replay and sampling on the device and return without waiting for its
        tokens; None when it is not one the graphs replay (:meth:`run` computes it eagerly). A row whose input
        token is still on the device (``Sequence.PENDING``) takes it from ``prev``, the iteration before."""
        if not self.can_launch(scheduled):
            return None
        ordered = self.order(scheduled)
        logits = self._replay(ordered, prev)
        if logits is None:
            return None
        self.iterations["decode_graph"] += 1
        samplers = [s.seq for s in ordered]
        if prev is not None and any(seq.guide is not None for seq in samplers):
            # structured output behind an iteration in flight: the rows' masks depend on its tokens, so the
            # sampling waits for them (Launched.sample, once they have landed); the forward runs meanwhile
            launched = Launched(samplers, None, lambda: self._sample(logits, samplers))
        else:
            launched = Launched(samplers, self._sample(logits, samplers))
        self._launched()
        return launched

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, samplers: list[Sequence]) -> Sampled:
        allowed = self.masks.fill(samplers)              # host work while the forward runs
        return self.sampler.sample(logits, samplers, pinned=self.device.type == "cuda", allowed=allowed)

    def _launched(self) -> None:
        """The forward is queued on the GPU and nothing has waited for it yet: the moment for ``before_sync``."""
        if self.before_sync is not None:
            self.before_sync()

    def _task_heads(self, samplers, hidden: torch.Tensor):
        """Answer ``task_head`` requests with their adapter's head; returns (answers, the other samplers, their
        hidden rows) for the LM head."""
        heads = [i for i, seq in enumerate(samplers) if seq.params.task_head]
        if not heads:
            return {}, samplers, hidden
        try:
            results = apply_heads(hidden[heads], [self.adapters.heads[samplers[i].adapter_name] for i in heads])
        except Exception as e:         # pin it on the request(s) whose head fails: each head on its own
            if is_fatal(e):
                raise
            results = [_one_head(hidden[i:i + 1], self.adapters.heads.get(samplers[i].adapter_name)) for i in heads]
        keep = [i for i, seq in enumerate(samplers) if not seq.params.task_head]
        return ({samplers[i].request_id: r for i, r in zip(heads, results)}, [samplers[i] for i in keep],
                hidden[keep])

    def _replay(self, ordered: list[ScheduledSeq], prev: Launched | None = None) -> torch.Tensor | None:
        """Logits of a decode-only iteration from its CUDA graph; None: run it eagerly."""
        runs = [s.seq.adapter for s in ordered]
        merged, mixed, cache = self.modes.merged, self.lora_launch.mixed, self._seg_cache
        if (cache is not None and cache[1] is merged and cache[2] == mixed and len(cache[0]) == len(runs)
                and all(a is b for a, b in zip(cache[0], runs))):
            own, minus = cache[3]                    # the same adapters row by row: the same segments
        else:
            own, minus = self.modes.segments([(i, i + 1, a) for i, a in enumerate(runs)], mixed)
            self._seg_cache = (runs, merged, mixed, (own, minus))
        bs = self.block_size
        seqs = [s.seq for s in ordered]
        positions = [s.start for s in ordered]
        ids = [seq.token_at(p) for seq, p in zip(seqs, positions)]
        src = None
        if prev is not None and Sequence.PENDING in ids:      # sampled by ``prev``: taken on the device
            rows = prev.rows
            src = [rows[seq.request_id] if t == Sequence.PENDING else -1 for seq, t in zip(seqs, ids)]
            ids = [0 if t == Sequence.PENDING else t for t in ids]
        lens = [p + 1 for p in positions]
        slots = [seq.blocks[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        counts = [p // bs + 1 for p in positions]
        rope = [p + seq.rope_delta for seq, p in zip(seqs, positions)] if any(s.rope_delta for s in seqs) \
            else positions
        return self.graphs.run(ids, rope, slots, lens, [seq.blocks for seq in seqs], counts, own, minus, src,
                               None if src is None else prev.sampled.tokens)


    def _replay_mixed(self, ordered: list[ScheduledSeq]) -> torch.Tensor | None:
        """Logits [len(ordered), vocab] of an iteration that prefills prompt chunks beside its decodes (or decodes
        rows :meth:`launch` does not take), one row per scheduled chunk (its last token's), from a mixed graph;
        None: it runs eagerly (no mixed graph fits it, or it needs what only the eager forward gives: image
        embeddings, M-RoPE prompt positions, prompt logprobs, task heads)."""
        g = self.graphs
        if g is None or not g.mixed_buckets:
            return None
        prompts = [s.num_tokens for s in ordered if s.num_tokens > 1]
        if g.mixed_bucket(len(ordered) - len(prompts), sum(prompts), len(prompts)) is None:
            return None                                # before any per-token work: a large prefill runs eagerly
        for s in ordered:
            seq = s.seq
            prompt = len(seq.prompt_token_ids)
            if (seq.params.task_head or (seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < prompt)
                    or (seq.images and s.start < prompt)):
                return None
        bs = self.block_size
        ids, positions, slots, runs = [], [], [], []
        lens, tables, counts, chunks = [], [], [], []
        for s in ordered:
            seq, start, n = s.seq, s.start, s.num_tokens
            runs.append((len(ids), len(ids) + n, seq.adapter))
            ids.extend(seq.tokens(start, start + n))
            positions.extend(p + seq.rope_delta for p in range(start, start + n))
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:                                 # decodes come first (order)
                lens.append(start + 1)
                tables.append(seq.blocks)
                counts.append(start // bs + 1)
            else:
                chunks.append((n, start + n, seq.blocks, -(-(start + n) // bs)))
        own, minus = self.modes.segments(runs, self.lora_launch.mixed)
        return g.run_mixed(ids, positions, slots, lens, tables, counts, chunks, own, minus)


class Launched:
    """An iteration queued on the device: its sampled tokens arrive in host memory without a wait; ``result``
    waits for them. ``rows``: request id -> row of the sampled tensor."""

    def __init__(self, seqs: list[Sequence], sampled: Sampled | None,
                 deferred: Callable[[], Sampled] | None = None):
        """``deferred``: queues the sampling later (:meth:`sample`), in place of ``sampled``."""
        self.seqs, self.sampled, self._deferred = seqs, sampled, deferred
        self._error: Exception | None = None          # the deferred sampling's, raised by result()
        self.rows = {seq.request_id: i for i, seq in enumerate(seqs)}

    def sample(self) -> None:
        """Queue the deferred sampling: once the tokens of the iteration before have advanced the rows'
        grammars, and before any sequence has taken another pending token (the sampler's positions)."""
        if self._deferred is not None:
            queue, self._deferred = self._deferred, None
            try:
                self.sampled = queue()
            except Exception as e:
                if is_fatal(e):
                    raise
                self._error = e

    def result(self) -> dict[str, int | TokenLogprobs | RowFailed]:
        self.sample()
        if self._error is not None:
            raise self._error
        return {seq.request_id: t for seq, t in zip(self.seqs, self.sampled.result())}


def lora_groups(cfg) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """(output width of each slice, input features) of every packed LoRA group of a model of config ``cfg``."""
    ins, _ = cfg.lora_in_out()
    # a mixture of experts takes LoRA on attention only; its MLP groups get no kernel launches
    return (group_widths(cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size),
            {"qkv": ins["q_proj"], "o": ins["o_proj"], "gate_up": ins.get("gate_proj", cfg.hidden_size),
             "down": ins.get("down_proj", cfg.intermediate_size)})


def _one_head(hidden: torch.Tensor, head) -> TaskResult | RowFailed:
    try:
        return apply_heads(hidden, [head])[0]
    except Exception as e:
        if is_fatal(e):
            raise
        return RowFailed(f"task head failed: {describe(e)}")


def _image_overlaps(seq, start: int, n: int):
    """(span index, first, end) of the prompt positions in [start, start + n) that are image tokens."""
    for k, span in enumerate(seq.images):
        lo, hi = max(start, span.offset), min(start + n, span.offset + span.length)
        if lo < hi:
            yield k, lo, hi


def _padded_table(tables: list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Block tables of different lengths as one [n, longest] tensor (padding 0, never read)."""
    nb = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=dtype, device=device)
