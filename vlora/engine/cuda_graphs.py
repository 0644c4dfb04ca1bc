"""CUDA graphs of decode iterations: captured per batch-size bucket, replayed every decode step.

A decode-only iteration of ``n`` sequences runs the graph of the smallest bucket
``B >= n``. Everything the forward reads lives in static buffers sized for the
largest bucket: token ids, positions, KV slots, block tables and context
lengths, and the LoRA segment metadata with its per-layer adapter offsets.
Rows ``n..B`` are padding: context length 0 (attention writes zeros), their
KV goes to a scratch slot no sequence owns, and no LoRA segment covers them.

Two graphs per bucket: one with the LoRA kernels (some row has an adapter) and
one without (base model only, no empty launches). LoRA graphs read the adapter
buffer at the address it had at capture; when registering an adapter grows the
buffer, they are dropped and captured again on next use. The LoRA graph's kernel grid
is fixed at capture: one program row per segment, so segments are split into
pieces of at most ``seg_cap`` rows (the tile height), which gives the same
result; unused segment slots have length 0 and exit at once. An iteration that
needs a second LoRA pass (mixed mode) or more rows than the largest bucket runs
eagerly instead.
"""

from __future__ import annotations

import torch

from vlora.lora.batch import GROUPS, KernelGroupMeta, LoRABatch, LoRASegment, SegmentMeta
from vlora.models.forward_batch import ForwardBatch


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_batch: int, max_blocks: int, scratch_slot: int,
                 lora_setup=None):
        """``lora_setup``: (adapter buffer, group widths, group in-features, tiling table, max rank) or None."""
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = self.buckets[-1]
        self.scratch_slot = scratch_slot
        dev = kv_cache.device
        self.device = dev
        b = self.max_batch
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((b,), scratch_slot, dtype=torch.long, device=dev)
        self.tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.lora_setup = lora_setup
        if lora_setup is not None:
            L = model.cfg.num_layers
            self.seg_starts = torch.zeros(b, dtype=torch.int32, device=dev)
            self.seg_lens = torch.zeros(b, dtype=torch.int32, device=dev)
            self.seg_ranks = torch.zeros(b, dtype=torch.int32, device=dev)
            self.seg_scales = torch.zeros(b, dtype=torch.float32, device=dev)
            self.offsets = {g: (torch.zeros(L, b, dtype=torch.int64, device=dev),
                                torch.zeros(L, b, dtype=torch.int32, device=dev),
                                torch.full((L, b, len(m)), -1, dtype=torch.int64, device=dev),
                                torch.zeros(L, b, len(m), dtype=torch.int32, device=dev))
                            for g, m in GROUPS.items()}
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, int]] = {}
        self.pool = None
        self.num_replays = 0
        self._buf_ptr = None if lora_setup is None else lora_setup[0].buf.data_ptr()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    # -- capture -------------------------------------------------------------------------------
    def _lora_batch(self, b: int) -> tuple[LoRABatch, int]:
        buffer, widths, group_in, table, max_rank = self.lora_setup
        kernel, cap = {}, b
        for g, modules in GROUPS.items():
            r_max = len(modules) * max_rank
            shrink = table.get("shrink", b, b, group_in[g], r_max)
            expand = table.get("expand", b, b, sum(widths[g]), max_rank)
            cap = min(cap, shrink.block_m, expand.block_m * expand.m_loop)
            a_off, rtot, b_off, vcol = self.offsets[g]
            kernel[g] = KernelGroupMeta(a_off[:, :b], rtot[:, :b], b_off[:, :b], vcol[:, :b], r_max, widths[g],
                                        shrink, expand)
        meta = SegmentMeta(self.seg_starts[:b], self.seg_lens[:b], self.seg_ranks[:b], self.seg_scales[:b],
                           max_len=cap, num_rows=b)
        return LoRABatch((), meta, kernel, buffer.buf), cap

    def _forward_batch(self, b: int, lora: LoRABatch | None) -> ForwardBatch:
        return ForwardBatch(self.ids[:b], self.positions[:b], self.slots[:b], num_decodes=b,
                            decode_block_tables=self.tables[:b], decode_lens=self.lens[:b], decode_mask=None,
                            prefills=(), prefill_meta=None, logits_rows=self.rows[:b], lora=lora,
                            kernel_attention=True)

    def capture(self, b: int, with_lora: bool) -> None:
        lora, cap = self._lora_batch(b) if with_lora else (None, b)
        fb = self._forward_batch(b, lora)
        self.lens.zero_()
        self.slots.fill_(self.scratch_slot)
        if with_lora:
            self.seg_lens.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):             # warm-up: Triton compiles, caches fill
            for _ in range(2):
                self.model.compute_logits(self.model(fb, self.kv_cache))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.compute_logits(self.model(fb, self.kv_cache))
        self.pool = graph.pool()
        self.graphs[(b, with_lora)] = (graph, logits, cap)

    def capture_all(self, with_lora: bool = True) -> None:
        for b in reversed(self.buckets):           # largest first: smaller graphs reuse its pool memory
            for lora in (False, True) if with_lora and self.lora_setup is not None else (False,):
                if (b, lora) not in self.graphs:
                    self.capture(b, lora)

    # -- replay --------------------------------------------------------------------------------
    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int], segments: list[LoRASegment]) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode iteration, or None when it cannot run from a graph."""
        n = len(ids)
        b = self.bucket(n)
        with_lora = bool(segments)
        if b is None or (with_lora and self.lora_setup is None):
            return None
        if with_lora and self.lora_setup[0].buf.data_ptr() != self._buf_ptr:   # the adapter buffer grew
            self.graphs = {key: v for key, v in self.graphs.items() if not key[1]}
            self._buf_ptr = self.lora_setup[0].buf.data_ptr()
        if (b, with_lora) not in self.graphs:
            self.capture(b, with_lora)
        graph, logits, cap = self.graphs[(b, with_lora)]
        dev = self.device
        pad = b - n
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad],
                            dtype=torch.long)
        self.ids[:b].copy_(host[0], non_blocking=True)
        self.positions[:b].copy_(host[1], non_blocking=True)
        self.slots[:b].copy_(host[2], non_blocking=True)
        nb = max(len(t) for t in tables)
        self.tables[:n, :nb].copy_(torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.int32),
                                   non_blocking=True)
        self.lens[:b].copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        if with_lora:
            self._fill_lora(segments, cap, b, dev)
        graph.replay()
        self.num_replays += 1
        return logits[:n]

    def _fill_lora(self, segments: list[LoRASegment], cap: int, b: int, dev) -> None:
        pieces = [LoRASegment(s, min(s + cap, seg.end), seg.adapter, seg.scale)
                  for seg in segments for s in range(seg.start, seg.end, cap)]
        k = len(pieces)
        pad = b - k
        ints = torch.tensor([[p.start for p in pieces] + [0] * pad, [p.end - p.start for p in pieces] + [0] * pad,
                             [p.adapter.rank for p in pieces] + [0] * pad], dtype=torch.int32)
        self.seg_starts[:b].copy_(ints[0], non_blocking=True)
        self.seg_lens[:b].copy_(ints[1], non_blocking=True)
        self.seg_ranks[:b].copy_(ints[2], non_blocking=True)
        self.seg_scales[:b].copy_(torch.tensor([p.scale for p in pieces] + [0.0] * pad), non_blocking=True)
        for g in GROUPS:
            a_off, rtot, b_off, vcol = self.offsets[g]
            offs = [p.adapter.offsets[g] for p in pieces]
            a_off[:, :k].copy_(torch.stack([o.a_off for o in offs], dim=1))
            rtot[:, :k].copy_(torch.stack([o.rtot for o in offs], dim=1))
            b_off[:, :k].copy_(torch.stack([o.b_off for o in offs], dim=1))
            vcol[:, :k].copy_(torch.stack([o.vcol for o in offs], dim=1))
