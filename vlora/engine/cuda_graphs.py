"""CUDA graphs of decode iterations: captured per batch-size bucket, replayed every decode step.

A decode-only iteration of ``n`` sequences runs the graph of the smallest bucket
``B >= n``. Everything the forward reads lives in static buffers sized for the
largest bucket: one int64 block ``meta`` (token ids, positions, KV slots,
context lengths, LoRA segment starts/lengths/ranks/adapter columns, filled by a
single host-to-device copy per step), the segment scales, and the block tables.
Each adapter the graphs have seen owns a column of per-layer offset tables; the
graph itself gathers the columns of the step's segments, so the host never
assembles per-layer offsets.
The host side of a step writes into persistent host buffers (page-locked on
CUDA) and copies them with ``non_blocking`` copies: the block tables are
rewritten only where a row changed (:class:`HostTables`), the LoRA segment rows
only when the step's segments differ from the last step's. A step launched
before its predecessor's tokens reached the host takes those tokens on the
device: ``src`` names, per row, the row of the previous step's sampled tensor
that holds its input token.
Rows ``n..B`` are padding: context length 0 (attention writes zeros), their
KV goes to a scratch slot no sequence owns, and no LoRA segment covers them.

Graphs per bucket, by kind: ``0`` without LoRA kernels (base model only, no
empty launches), ``1`` with them (some row has an adapter), and for mixed mode
(rows not of the merged adapter subtract it) ``3``, segments that carry the
merged adapter as a second pair in the same launches (its rank, column and
scale per segment slot in a second set of static buffers), or ``2``, a second
LoRA pass whose segments live in those buffers (``LoRALaunch.mixed="two"``).
LoRA graphs read the adapter buffer and the offset tables at the addresses
they had at capture; when the buffer grows (an adapter registered) or the
tables fill up, they are dropped and captured again on next use. Every graph
also reads the projection weights at the addresses of its capture, so there is
one set of graphs per set of weights the layers read: the base weights, and a
merged copy in pool pages (``model.weights_key``, set by the mode switcher),
whose set is captured on first use and kept while the copy stays where it is
(docs/decisions.md, 'Merged copy in pool pages'). The LoRA graph's kernel grid
is fixed at capture: one program row per segment, so segments are split into
pieces of at most ``seg_cap`` rows (the tile height), which gives the same
result; unused segment slots have length 0 and exit at once. An iteration with
more rows than the largest bucket runs eagerly instead.

Mixed graphs (``mixed_tokens`` > 0) replay an iteration that decodes running
sequences while it prefills up to ``CHUNK_SLOTS`` prompt chunks: ``T`` rows (a
bucket of :func:`mixed_sizes`), the decodes first, then the chunks' tokens end to
end, then padding. Decode attention runs over the first ``min(T, max_batch)``
rows (rows of chunks and padding have context length 0 there), prefill
attention over the chunk slots (start row, new tokens, context, block table;
unused slots have no tokens); the logits are those of the decode rows and of
each chunk's last row. Without them such an iteration runs eagerly, and its
host work (a Python call per kernel launch) stalls every running stream for
tens of milliseconds (docs/decisions.md, 'Prefills beside decodes replayed
from graphs').
"""

from __future__ import annotations

import logging

import torch

from vlora.kernels.segments import SegmentMeta
from vlora.lora.batch import GROUPS, GroupOffsets, KernelGroupMeta, LoRABatch, LoRALaunch, LoRASegment, PackedAdapter
from vlora.memory.capture import CAPTURE
from vlora.models.forward_batch import ForwardBatch, PrefillMeta

log = logging.getLogger(__name__)


class CaptureFailed(RuntimeError):
    """A graph could not be captured (device memory ran out): the iterations it would replay run eagerly."""

_IDS, _POS, _SLOTS, _LENS, _SEG_START, _SEG_LEN, _SEG_RANK, _SEG_COL, _SRC = range(9)
BASE, LORA, MIXED, PAIRED = 0, 1, 2, 3    # graph kinds (0 and 1 also read as False / True: "with LoRA")
CHUNK_SLOTS = 8                 # prompt chunks a mixed graph prefills at most (more: the iteration runs eagerly)
_C_START, _C_LEN, _C_CTX, _C_ROW = range(4)       # rows of the chunk metadata


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def mixed_sizes(max_batch: int, tokens: int) -> list[int]:
    """Row counts of the mixed graphs for iterations of up to ``max_batch`` decodes beside up to ``tokens``
    prompt tokens: steps of at most 1.5x below ``tokens`` (padding costs at most a third of the rows), then
    ``tokens`` plus 16, 32, 64, ... decodes up to ``max_batch``, where a full prompt chunk lands while the
    streams decode."""
    sizes = [s for s in (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192) if s < tokens]
    extra = [0] + [d for d in (16, 32, 64, 128, 256, 512, 1024) if d < max_batch] + [max_batch]
    return sorted(set(sizes + [tokens + d for d in extra]))


class DecodeGraphs:
    capture_error_mode = "global"      # tensor parallelism: "thread_local" (NCCL's watchdog thread runs meanwhile)
    # A graph captured on first use (a bucket not captured at start, LoRA graphs again after the adapter buffer
    # grew) that runs out of memory: its iterations run eagerly from then on, instead of failing. Not under
    # tensor parallelism, whose ranks must capture and replay the same graphs together.
    eager_when_capture_fails = True

    def __init__(self, model, kv_cache: torch.Tensor, max_batch: int, max_blocks: int, scratch_slot: int,
                 lora_setup=None, columns: int = 512, launch: LoRALaunch = LoRALaunch(), mixed_tokens: int = 0):
        """``lora_setup``: (a function returning the adapter buffer, which the store may reallocate; group widths,
        group in-features, tiling table, max rank) or None;
        ``launch``: how the captured LoRA kernels are launched;
        ``columns``: adapter columns of the offset tables to start with (about 5 KB each on a 32-layer model;
        outgrowing them recaptures every LoRA graph, so the default is sized past the adapters a pool holds at
        once); ``mixed_tokens`` > 0: mixed graphs too, for iterations that prefill up to that many prompt tokens
        beside their decodes."""
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = b = self.buckets[-1]
        self.mixed_buckets = mixed_sizes(b, mixed_tokens) if mixed_tokens > 0 else []
        w = max([b] + self.mixed_buckets)            # the widest graph's rows
        self.scratch_slot = scratch_slot
        self.page = kv_cache.shape[3]
        self.device = dev = kv_cache.device
        self.meta = torch.zeros(9, w, dtype=torch.long, device=dev)
        self.meta[_SLOTS] = scratch_slot
        # host staging of meta, the scales and the block tables; rewritten only once their last copy has left
        self.host_meta = _host_zeros((9, w), torch.long, dev)
        self.host_scales = _host_zeros((w,), torch.float32, dev)
        self.host_tables = HostTables(b, max_blocks, dev)
        # mixed graphs: each chunk slot's start row, new tokens, context and logits row; its block table
        self.chunks = torch.zeros(4, CHUNK_SLOTS, dtype=torch.long, device=dev)
        self.chunk_tables = torch.zeros(CHUNK_SLOTS, max_blocks, dtype=torch.int32, device=dev)
        self._mixed_out: torch.Tensor | None = None     # the mixed graphs' logits, one buffer for all
        self.host_chunks = _host_zeros((4, CHUNK_SLOTS), torch.long, dev)
        self.host_chunk_tables = HostTables(CHUNK_SLOTS, max_blocks, dev)
        self._meta_np, self._scales_np = self.host_meta.numpy(), self.host_scales.numpy()
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self._seg_key = None             # (segments, columns, cap, bucket) whose rows the host buffers hold
        self.scales = torch.zeros(w, dtype=torch.float32, device=dev)
        # mixed mode's second pass: start/len/rank/column; or, paired, rows 2-3: each slot's pair rank/column
        self.meta2 = torch.zeros(4, w, dtype=torch.long, device=dev)
        self.scales2 = torch.zeros(w, dtype=torch.float32, device=dev)
        self.tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.rows = torch.arange(w, device=dev)
        self.lora_setup = lora_setup
        self.launch = launch
        self._columns: dict[str, tuple[PackedAdapter, int, int]] = {}     # name -> (adapter, column, epoch)
        if lora_setup is not None:
            self._alloc_columns(columns)
        # (rows, kind, mixed) -> (graph, logits, segment piece height, segment slots)
        self.graphs: dict[tuple[int, int, bool], tuple[object, torch.Tensor, int, int]] = {}
        self._weights = None        # the weights self.graphs were captured over (None: the base weights)
        self._other_sets: dict = {}     # weights key -> the graphs of the other weights (at most one set)
        self.pool = None
        self.num_replays = 0
        self.uncapturable: set[tuple[int, int, bool]] = set()     # keys whose capture ran out of memory
        self._buf_ptr = None if lora_setup is None else lora_setup[0]().data_ptr()

    def _alloc_columns(self, n: int) -> None:
        """Offset tables with ``n`` adapter columns (the columns written so far are kept)."""
        L, dev = self.model.cfg.num_layers, self.device
        old = getattr(self, "col_tables", None)
        self.col_tables = {g: (torch.zeros(L, n, dtype=torch.int64, device=dev),
                               torch.zeros(L, n, dtype=torch.int32, device=dev),
                               torch.full((L, n, len(m)), -1, dtype=torch.int64, device=dev),
                               torch.zeros(L, n, len(m), dtype=torch.int32, device=dev))
                           for g, m in GROUPS.items()}
        if old is not None:
            for g, tabs in old.items():
                for new, prev in zip(self.col_tables[g], tabs):
                    new[:, :prev.shape[1]].copy_(prev)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _column(self, adapter: PackedAdapter) -> int:
        """The offset-table column of ``adapter``, written on first sight and again whenever the adapter has
        moved in the pool since (a reload, or a re-registered name). A full table reuses the column of an
        adapter that left the pool (columns are bounded by the adapters resident at once) and only grows, with
        a recapture of the LoRA graphs, when every column's adapter is still resident."""
        known = self._columns.get(adapter.name)
        if known is not None and known[0] is adapter and known[2] == adapter.placement.epoch:
            return known[1]
        width = next(iter(self.col_tables.values()))[0].shape[1]
        if known is not None:
            col = known[1]
        elif len(self._columns) < width:
            col = len(self._columns)
        else:
            gone = next((n for n, (a, _, epoch) in self._columns.items()
                         if a.placement.offsets is None or a.placement.epoch != epoch), None)
            if gone is not None:
                col = self._columns.pop(gone)[1]
            else:                                   # every column in use: double, recapture LoRA graphs
                col = len(self._columns)
                self._alloc_columns(2 * width)
                self._drop_lora_graphs()
        for g, tabs in self.col_tables.items():
            o = adapter.offsets[g]
            for tab, src in zip(tabs, (o.a_off, o.rtot, o.b_off, o.vcol)):
                tab[:, col].copy_(src)
        self._columns[adapter.name] = (adapter, col, adapter.placement.epoch)
        return col

    def release(self) -> None:
        """Drop every captured graph and the memory pool they share. Under tensor parallelism a graph that
        captured an NCCL collective holds a reference on the communicator, and tearing the communicator down
        waits until that graph is gone."""
        self.graphs, self._other_sets, self.pool, self._seg_key = {}, {}, None, None

    def _drop_lora_graphs(self) -> None:
        self._seg_key = None
        self.uncapturable = {key for key in self.uncapturable if not key[1]}     # tried again with the new buffer
        self.graphs = {key: v for key, v in self.graphs.items() if not key[1]}
        self._other_sets = {w: {key: v for key, v in g.items() if not key[1]} for w, g in self._other_sets.items()}
        if not self.graphs and not any(self._other_sets.values()):   # no graph holds the shared memory pool any
            self.pool = None                                          # more: start a new one

    def _use_weights(self, key) -> None:
        """Replay and capture the graphs of the weights the layers read now (``key``: None for the base weights,
        a merged copy's key): a graph replayed over other weights than its capture's would read stale ones.
        The base weights' set and the last copy's are kept; a copy placed elsewhere drops the previous one's."""
        if key == self._weights:
            return
        self._other_sets[self._weights] = self.graphs
        self.graphs = self._other_sets.pop(key, {})
        self._other_sets = {w: g for w, g in self._other_sets.items() if w is None or key is None}
        self._weights = key

    # -- capture -------------------------------------------------------------------------------
    def _decode_rows(self, b: int, mixed: bool) -> int:
        """Rows of a graph of ``b`` rows that decode attention covers: all of a decode graph's, the first
        ``max_batch`` of a mixed graph's (decodes come first, and there are never more)."""
        return min(b, self.max_batch) if mixed else b

    def _forward_batch(self, b: int, kind: int, mixed: bool = False) -> tuple[ForwardBatch, int]:
        """The forward's inputs as views of (and, for int32 and offsets, ops on) the static buffers: called
        inside the capture, so the graph recomputes the derived tensors on every replay."""
        meta, d = self.meta[:, :b], self._decode_rows(b, mixed)
        lora, cap = None, b
        if kind:
            buffer, widths, group_in, table, max_rank = self.lora_setup
            paired = kind == PAIRED
            # the tile configs of a decode graph of its decode rows: keys the start-up build compiled (a segment
            # count past max_num_seqs would meet uncompiled variants at capture)
            segs = d
            configs = {}
            for g, modules in GROUPS.items():
                r_max = len(modules) * max_rank * (2 if paired else 1)     # paired: the pair's columns of v too
                shrink = table.get("shrink", b, segs, group_in[g], r_max)
                expand = table.get("expand", b, segs, sum(widths[g]), max_rank)
                cap = min(cap, shrink.block_m, expand.block_m * expand.m_loop)
                configs[g] = (r_max, shrink, expand)
            n = self._slots(b, mixed, cap)

            def offsets(g: str, cols: torch.Tensor) -> list[torch.Tensor]:
                return [t.index_select(1, cols) for t in self.col_tables[g]]

            def lora_pass(seg_rows: torch.Tensor, cols: torch.Tensor, scales: torch.Tensor, extra=None) -> LoRABatch:
                kernel = {}
                for g, (r_max, shrink, expand) in configs.items():
                    pair = GroupOffsets(*offsets(g, self.meta2[3, :n])) if paired else None
                    kernel[g] = KernelGroupMeta(*offsets(g, cols), r_max, widths[g], shrink, expand, pair=pair,
                                                max_rank=max_rank)
                seg = seg_rows.to(torch.int32)
                pair_meta = (dict(pair_ranks=self.meta2[2, :n].to(torch.int32), pair_scales=self.scales2[:n])
                             if paired else {})
                return LoRABatch((), SegmentMeta(seg[0], seg[1], seg[2], scales, max_len=cap, num_rows=b,
                                                 **pair_meta),
                                 kernel, buffer(), extra=extra, launch=self.launch)

            minus = lora_pass(self.meta2[:3, :n], self.meta2[3, :n], self.scales2[:n]) if kind == MIXED else None
            lora = lora_pass(meta[_SEG_START:_SEG_COL, :n], meta[_SEG_COL, :n], self.scales[:n], minus)
        prefill, rows = None, self.rows[:b]
        if mixed:
            c = self.chunks.to(torch.int32)
            prefill = PrefillMeta(self.chunk_tables, c[_C_START], c[_C_LEN], c[_C_CTX], b)
            rows = torch.cat((self.rows[:d], self.chunks[_C_ROW]))
        fb = ForwardBatch(meta[_IDS], meta[_POS], meta[_SLOTS], num_decodes=d,
                          decode_block_tables=self.tables[:d], decode_lens=meta[_LENS, :d].to(torch.int32),
                          decode_max_len=self.tables.shape[1] * self.page, decode_mask=None,
                          prefills=(), prefill_meta=prefill, logits_rows=rows, lora=lora, use_kernels=True)
        return fb, cap

    def _slots(self, b: int, mixed: bool, cap: int) -> int:
        """Segment slots of a graph of ``b`` rows whose pieces are at most ``cap`` rows: one per row of a decode
        graph; a mixed graph's pieces are at most one per decode row and chunk plus one per ``cap`` rows."""
        return min(b, self._decode_rows(b, mixed) + CHUNK_SLOTS + -(-b // cap)) if mixed else b

    def _run_forward(self, b: int, kind: int, mixed: bool = False) -> tuple[torch.Tensor, int]:
        fb, cap = self._forward_batch(b, kind, mixed)
        hidden = self.model(fb, self.kv_cache)
        if mixed:                                   # the decode rows' and each chunk's last row's
            hidden = hidden.index_select(0, fb.logits_rows)
        logits = self.model.compute_logits(hidden, fast=True)
        if mixed and self._mixed_out is not None:
            # every mixed graph writes its logits into one buffer: a graph's own output would keep its memory
            # for good, about 2,900 rows of logits over the buckets of a 256-sequence engine
            out = self._mixed_out[:logits.shape[0]]
            out.copy_(logits)
            logits = out
        return logits, cap

    def _mixed_output(self, logits: torch.Tensor) -> None:
        """Allocate the mixed graphs' shared logits buffer (outside any capture) from an eager run's logits."""
        if self._mixed_out is None:
            self._mixed_out = torch.empty(self.max_batch + CHUNK_SLOTS, logits.shape[1], dtype=logits.dtype,
                                          device=logits.device)

    def _capture_on_first_use(self, key: tuple[int, int, bool]) -> None:
        """Capture a graph an iteration needs; one that runs out of device memory raises :class:`CaptureFailed`
        (``eager_when_capture_fails``) and is not tried again until the LoRA graphs are dropped."""
        b, kind, mixed = key
        try:
            self.capture(b, kind, mixed)
        except torch.cuda.OutOfMemoryError as e:
            if not self.eager_when_capture_fails:
                raise
            self.uncapturable.add(key)
            log.warning("the %s graph of %d rows (kind %d) ran out of device memory while captured; its "
                        "iterations run eagerly", "mixed" if mixed else "decode", b, kind)
            raise CaptureFailed(str(e)) from None

    def capture(self, b: int, kind: int, mixed: bool = False) -> None:
        """Capture the graph of key (``b``, ``kind``, ``mixed``) now (start-up, ``capture_all``: running out of
        device memory is an error there; an iteration's first use: :meth:`_capture_on_first_use`)."""
        self.meta[_LENS].zero_()
        self.meta[_SEG_LEN].zero_()
        self.meta[_SEG_COL].zero_()
        self.meta2[1:].zero_()
        self.meta[_SLOTS].fill_(self.scratch_slot)
        self.chunks.zero_()
        key = (b, kind, mixed)
        if self.device.type != "cuda":
            if mixed:
                self._mixed_output(self._run_forward(b, kind, mixed)[0])
            graph = _Rerun(lambda: self._run_forward(b, kind, mixed)[0])
            cap = self._forward_batch(b, kind, mixed)[1]
            self.graphs[key] = (graph, graph.out, cap, self._slots(b, mixed, cap))
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):             # warm-up: Triton compiles, caches fill
            for _ in range(2):
                warm = self._run_forward(b, kind, mixed)[0]
            if mixed:
                self._mixed_output(warm)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # no other thread's CUDA call may land inside a global capture (vlora/memory/capture.py)
        with CAPTURE, torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
            logits, cap = self._run_forward(b, kind, mixed)
        self.pool = graph.pool()
        self.graphs[key] = (graph, logits, cap, self._slots(b, mixed, cap))

    @property
    def mixed_kind(self) -> int:
        """The kind of graph mixed-mode iterations replay."""
        return PAIRED if self.launch.mixed == "one" else MIXED

    @torch.inference_mode()              # callers outside a step (benchmarks, start-up) capture as a step runs
    def capture_all(self, with_lora: bool = True, mixed: bool = False) -> None:
        """Capture every graph not captured yet: decode graphs of the base kind, with LoRA (``with_lora``) and of
        mixed mode (``mixed``), and the mixed graphs (prefills beside decodes) of the same kinds."""
        lora = with_lora and self.lora_setup is not None
        kinds = (BASE,) + ((LORA,) + ((self.mixed_kind,) if mixed else ()) if lora else ())
        todo = [(b, kind, True) for b in self.mixed_buckets for kind in kinds]
        todo += [(b, kind, False) for b in self.buckets for kind in kinds]
        for key in sorted(todo, key=lambda k: -k[0]):   # largest first: smaller graphs reuse its pool memory
            if key not in self.graphs:
                self.capture(*key)

    # -- replay --------------------------------------------------------------------------------
    def fits(self, n: int, lora: bool) -> bool:
        """Whether a decode iteration of ``n`` rows (with LoRA segments or not) can replay a graph."""
        return self.bucket(n) is not None and (not lora or self.lora_setup is not None)

    def can_queue(self, n: int, lora: bool) -> bool:
        """Whether a decode of ``n`` rows (with adapters or not, nothing merged) may be queued behind the
        iteration in flight: its graph is captured already. A graph's first capture happens in a synchronous
        iteration, where one that runs out of memory falls back to the eager forward (a queued iteration has no
        eager path: its input tokens are still on the device)."""
        b = self.bucket(n)
        return b is not None and (b, LORA if lora else BASE, False) in self.graphs

    def mixed_bucket(self, decodes: int, tokens: int, chunks: int) -> int | None:
        """Rows of the mixed graph an iteration of ``decodes`` decodes and ``chunks`` prompt chunks of
        ``tokens`` tokens in all replays; None: there is none (it runs eagerly)."""
        if decodes > self.max_batch or chunks > CHUNK_SLOTS:
            return None
        return next((b for b in self.mixed_buckets if b >= decodes + tokens), None)

    def _kind(self, segments, minus) -> int:
        paired = any(seg.pair is not None for seg in segments)
        return MIXED if minus else PAIRED if paired else LORA if segments else BASE

    def _prepare(self, kind: int, segments, minus) -> tuple | None:
        """The adapters' offset-table columns of a replay of ``kind`` (segments, minus, pairs); None: no graph
        of that kind here."""
        if kind and self.lora_setup is None:
            return None
        if not kind:
            return (), (), None
        if self.lora_setup[0]().data_ptr() != self._buf_ptr:        # the adapter buffer grew
            self._drop_lora_graphs()
            self._buf_ptr = self.lora_setup[0]().data_ptr()
        cols = [self._column(seg.adapter) for seg in segments]      # before the lookup: may drop graphs
        cols2 = [self._column(seg.adapter) for seg in minus]       # resident adapters' columns never recycle
        pair_cols = [0 if seg.pair is None else self._column(seg.pair) for seg in segments] \
            if kind == PAIRED else None
        return cols, cols2, pair_cols

    def _fill(self, key: tuple[int, int, bool], ids, positions, slots, lens, tables, counts, segments, minus,
              cols, src=None) -> tuple:
        """Write a replay's rows into the host buffers and copy them to the static ones; returns the graph and
        its logits."""
        b, kind, mixed = key
        if key not in self.graphs:
            if key in self.uncapturable:
                raise CaptureFailed(f"no graph of key {key}")
            self._capture_on_first_use(key)
        graph, logits, cap, nslots = self.graphs[key]
        cols, cols2, pair_cols = cols
        if self._copied is not None:
            self._copied.synchronize()        # the last step's copies have left the host buffers (long since)
        m, n, d = self._meta_np, len(ids), len(lens)
        m[_IDS, :n], m[_POS, :n], m[_SLOTS, :n], m[_LENS, :d] = ids, positions, slots, lens
        m[_IDS:_SLOTS + 1, n:b] = 0
        m[_SLOTS, n:b] = self.scratch_slot
        m[_LENS, d:b] = 0
        if src is not None:
            m[_SRC, :n] = src
        if kind:
            seg_key = (segments, cols, cap, nslots)
            if self._seg_key is None or not _same(self._seg_key, seg_key):     # else the rows are still there
                seg_rows, scales = self._pieces(segments, cols, cap, nslots)
                m[_SEG_START:_SEG_COL + 1, :nslots] = seg_rows
                self._scales_np[:nslots] = scales
                self._seg_key = seg_key
        self.meta.copy_(self.host_meta, non_blocking=True)
        if kind:
            self.scales.copy_(self.host_scales, non_blocking=True)
        if kind == MIXED:
            seg_rows, scales = self._pieces(minus, cols2, cap, nslots)
            self.meta2[:, :nslots].copy_(torch.tensor(seg_rows, dtype=torch.long), non_blocking=True)
            self.scales2[:nslots].copy_(torch.tensor(scales, dtype=torch.float32), non_blocking=True)
        elif kind == PAIRED:                    # the pieces' pairs: rank (0: none), column, scale
            pairs = [(0, 0, 0.0) if seg.pair is None else (seg.pair.rank, c, seg.pair_scale)
                     for seg, c in zip(segments, pair_cols) for _ in range(seg.start, seg.end, cap)]
            pairs += [(0, 0, 0.0)] * (nslots - len(pairs))
            self.meta2[2:, :nslots].copy_(torch.tensor([[p[0] for p in pairs], [p[1] for p in pairs]],
                                                       dtype=torch.long), non_blocking=True)
            self.scales2[:nslots].copy_(torch.tensor([p[2] for p in pairs], dtype=torch.float32),
                                        non_blocking=True)
        self.host_tables.fill(tables, counts)
        self.tables[:d].copy_(self.host_tables.tensor[:d], non_blocking=True)
        return graph, logits

    def run(self, ids: list[int], positions: list[int], slots: list[int], lens: list[int],
            tables: list[list[int]], counts: list[int], segments: list[LoRASegment],
            minus: list[LoRASegment] = (), src: list[int] | None = None,
            prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode iteration, or None when it cannot run from a graph. Row ``i`` reads
        the first ``counts[i]`` pages of ``tables[i]`` (a sequence's block list, read in place). Mixed mode:
        ``segments`` that carry the merged adapter as their pair, or ``minus``, a second pass (the merged adapter
        subtracted from the rows of the others). ``prev_tokens``: the previous step's sampled tokens on the
        device; row ``i`` takes ``prev_tokens[src[i]]`` as its input token where ``src[i] >= 0``."""
        self._use_weights(getattr(self.model, "weights_key", None))
        n = len(ids)
        b, kind = self.bucket(n), self._kind(segments, minus)
        cols = None if b is None else self._prepare(kind, segments, minus)
        if cols is None:
            return None
        try:
            graph, logits = self._fill((b, kind, False), ids, positions, slots, lens, tables, counts, segments,
                                       minus, cols, src)
        except CaptureFailed:
            return None
        if self._copied is not None:
            self._copied.record()
        if prev_tokens is not None:           # input tokens sampled by the step before, still on the device
            rows = self.meta[_SRC, :n]
            picked = prev_tokens.index_select(0, rows.clamp(min=0))
            self.meta[_IDS, :n].copy_(torch.where(rows >= 0, picked, self.meta[_IDS, :n]))
        graph.replay()
        self.num_replays += 1
        return logits[:n]

    def run_mixed(self, ids: list[int], positions: list[int], slots: list[int], lens: list[int],
                  tables: list[list[int]], counts: list[int], chunks: list[tuple[int, int, list[int], int]],
                  segments: list[LoRASegment], minus: list[LoRASegment] = ()) -> torch.Tensor | None:
        """Logits of an iteration that decodes ``len(lens)`` rows (the first rows of ``ids``, as :meth:`run`'s)
        and prefills ``chunks`` (new tokens, context after them, block list, pages read), whose tokens follow in
        ``ids`` in that order; row ``i`` of the result is decode row ``i``'s, row ``len(lens) + j`` chunk ``j``'s
        last token's; ``segments`` and ``minus`` as :meth:`run`'s. None when no mixed graph fits."""
        self._use_weights(getattr(self.model, "weights_key", None))
        d, tokens = len(lens), sum(c[0] for c in chunks)
        b, kind = self.mixed_bucket(d, tokens, len(chunks)), self._kind(segments, minus)
        cols = None if b is None else self._prepare(kind, segments, minus)
        if cols is None:
            return None
        try:
            graph, logits = self._fill((b, kind, True), ids, positions, slots, lens, tables, counts, segments,
                                       minus, cols)
        except CaptureFailed:
            return None
        c, row = self.host_chunks.numpy(), d
        c[:] = 0
        for j, (q_len, ctx, _, _) in enumerate(chunks):
            c[_C_START, j], c[_C_LEN, j], c[_C_CTX, j], c[_C_ROW, j] = row, q_len, ctx, row + q_len - 1
            row += q_len
        self.host_chunk_tables.fill([ch[2] for ch in chunks], [ch[3] for ch in chunks])
        self.chunks.copy_(self.host_chunks, non_blocking=True)
        k = len(chunks)
        self.chunk_tables[:k].copy_(self.host_chunk_tables.tensor[:k], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        graph.replay()
        self.num_replays += 1
        top = self._decode_rows(b, True)
        return torch.cat((logits[:d], logits[top:top + k]))

    @staticmethod
    def _pieces(segments: list[LoRASegment], cols: list[int], cap: int, b: int):
        """Segment rows (start, length, rank, column) of ``b`` slots, segments split into pieces of at most
        ``cap`` rows, unused slots of length 0; and the slots' scales."""
        pieces = [(s, min(s + cap, seg.end), seg, c) for seg, c in zip(segments, cols)
                  for s in range(seg.start, seg.end, cap)]
        k = b - len(pieces)
        rows = [[p[0] for p in pieces] + [0] * k, [p[1] - p[0] for p in pieces] + [0] * k,
                [p[2].adapter.rank for p in pieces] + [0] * k, [p[3] for p in pieces] + [0] * k]
        return rows, [p[2].scale for p in pieces] + [0.0] * k


class _Rerun:
    """Stands in for a CUDA graph off the GPU: ``replay`` re-runs the captured forward into the same output
    tensor, over the same static buffers, so the buffer and padding logic is testable on a CPU."""

    def __init__(self, fn):
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        self.out.copy_(self.fn())


class HostTables:
    """The block tables of a graph's rows in one host array (page-locked on CUDA). A row remembers the block
    list it was filled from and how many of its pages are written, so a step where the rows hold the same
    sequences writes only the pages they gained; a row whose sequence changed is rewritten. Block lists only
    grow in place (a sequence that loses its pages gets a new list), and entries past a row's count are never
    read, so what a row holds past it is left as it is."""

    def __init__(self, rows: int, cols: int, device: torch.device):
        self.tensor = _host_zeros((rows, cols), torch.int32, device)
        self._np = self.tensor.numpy()
        self._lists: list[list[int] | None] = [None] * rows
        self._filled = [0] * rows

    def fill(self, tables: list[list[int]], counts: list[int]) -> None:
        """Row ``i`` holds ``tables[i][:counts[i]]``."""
        lists, filled, arr = self._lists, self._filled, self._np
        for i, (blocks, k) in enumerate(zip(tables, counts)):
            if lists[i] is blocks:
                f = filled[i]
                if f >= k:
                    continue
                arr[i, f:k] = blocks[f:k]
            else:
                arr[i, :k] = blocks[:k]
                lists[i] = blocks
            filled[i] = k


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host staging buffer: page-locked when it feeds a GPU (``non_blocking`` copies from pageable
    memory are staged by the driver, and may wait for the stream)."""
    if device.type != "cuda":
        return torch.zeros(shape, dtype=dtype)
    from vlora.memory.pinned import pinned_empty

    t = pinned_empty(shape, dtype)
    t.zero_()
    return t


def _same(a: tuple, b: tuple) -> bool:
    """Whether two (segments, columns, cap, bucket) keys describe the same segment rows: the same segment
    objects' values, columns, tile height and bucket."""
    return a[1] == b[1] and a[2] == b[2] and a[3] == b[3] and len(a[0]) == len(b[0]) and all(
        x.start == y.start and x.end == y.end and x.adapter is y.adapter and x.scale == y.scale
        for x, y in zip(a[0], b[0]))
