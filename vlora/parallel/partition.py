"""The Megatron partition of a decoder and of its adapters across ``world`` tensor-parallel ranks.

Column-parallel (each rank computes some output columns, no collective): ``qkv``
(its attention heads, and the KV heads their groups read) and ``gate_up`` (a
slice of the MLP width). Row-parallel (each rank holds some input columns and
produces a partial sum): ``o`` and ``down``, followed by one all-reduce each.
A mixture of experts cuts every expert as a dense MLP (the same slice of each
expert's width on a rank; the router replicated, so every rank routes alike)
and sums the experts' partial outputs with one all-reduce.
Norms are replicated. The embedding and the LM head are vocab-parallel
(:class:`VocabShard`): each rank holds a slice of the vocabulary's rows; a
lookup is summed over the ranks (one more all-reduce per forward), and the
logits of the rows that sample are gathered from every rank.

KV heads are split when their count divides by ``world``; when ``world`` is a
multiple of it, each KV head is replicated on the ranks whose query heads read
it (every rank keeps exactly one).

LoRA adds no collective: for a column-parallel group A stays whole and B keeps
the rank's output columns; for a row-parallel group A keeps the rank's input
rows and B stays whole, and the delta lands on the partial output before the
all-reduce (the sum over ranks of ``x_i A_i B`` is ``x A B``). Ranks stay
unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from vlora.lora.batch import GroupWeights, PackedAdapter, SliceB
from vlora.parallel.collectives import all_gather_columns


@dataclass(frozen=True)
class Shard:
    """Which heads and MLP columns rank ``rank`` of ``world`` holds."""

    rank: int
    world: int
    heads: range            # query heads
    kv_heads: range         # KV heads (one replicated head when world > KV heads)
    mlp: range              # MLP intermediate columns

    @staticmethod
    def of(cfg, rank: int, world: int) -> "Shard":
        h, hkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        if h % world or inter % world:
            raise ValueError(f"tensor_parallel_size {world} must divide the attention heads ({h}) and the MLP "
                             f"width ({inter})")
        if hkv % world and world % hkv:
            raise ValueError(f"tensor_parallel_size {world} must divide the KV heads ({hkv}) or be a multiple of "
                             f"them")
        per = h // world
        if hkv % world == 0:
            kv = range(rank * hkv // world, (rank + 1) * hkv // world)
        else:
            kv = range(rank * hkv // world, rank * hkv // world + 1)
        step = inter // world
        return Shard(rank, world, range(rank * per, (rank + 1) * per), kv, range(rank * step, (rank + 1) * step))

    def local_config(self, cfg):
        return replace(cfg, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.mlp))

    def q_cols(self, cfg) -> torch.Tensor:
        return _cols(self.heads, cfg.head_dim)

    def kv_cols(self, cfg) -> torch.Tensor:
        return _cols(self.kv_heads, cfg.head_dim)

    def mlp_cols(self) -> torch.Tensor:
        return torch.arange(self.mlp.start, self.mlp.stop)


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows rank ``rank`` holds of the embedding and the LM head: ``[start, start + size)``, the
    last rank's padded with zero rows to ``size`` where ``world`` does not divide the vocabulary."""

    start: int
    size: int
    vocab: int
    world: int

    @staticmethod
    def of(vocab: int, rank: int, world: int) -> "VocabShard":
        size = -(-vocab // world)
        return VocabShard(rank * size, size, vocab, world)

    def rows(self) -> torch.Tensor:
        """The whole weight's rows this rank holds (its padding excluded)."""
        return torch.arange(min(self.start, self.vocab), min(self.start + self.size, self.vocab))

    def cut(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole [vocab, hidden] weight, padded with zero rows to ``size``."""
        mine = w[self.start:self.start + self.size]
        pad = self.size - mine.shape[0]
        if pad:
            mine = torch.cat([mine, mine.new_zeros(pad, w.shape[1])])
        return mine.contiguous()


class VocabParallel:
    """What a vocab-parallel decoder does with its slice (``DecoderLM.vocab_part``): the embedding lookup summed
    over the ranks, and the logits gathered from them (every rank calls both at the same point: collectives)."""

    def __init__(self, shard: VocabShard, reduce=None):
        self.shard, self.reduce = shard, reduce

    def embed(self, embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        h = embedding(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        return self.reduce(h)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, size] on every rank -> [n, vocab]: the ranks' columns side by side, the padding cut."""
        return all_gather_columns(logits, self.shard.world)[:, :self.shard.vocab]


def _cols(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def kv_heads_per_rank(cfg, world: int) -> int:
    return len(Shard.of(cfg, 0, world).kv_heads)


def shard_decoder(model, shard: Shard, reduce=None) -> None:
    """Cut ``model`` (a :class:`~vlora.models.decoder.DecoderLM`, its weights on a device or on ``meta``) down to
    ``shard``'s part, in place, unless it is cut already; ``reduce`` (a callable summing a tensor over the
    ranks, in place; None: set later) follows every row-parallel projection. ``model.cfg`` stays the whole
    model's; each layer's ``cfg`` becomes the local one."""
    if reduce is not None:
        for layer in model.layers:
            layer.reduce = reduce
        if model.vocab_part is not None:
            model.vocab_part.reduce = reduce
    if getattr(model, "cut_to", None) == shard:
        return
    model.cut_to = shard
    cfg = model.cfg
    local = shard.local_config(cfg)
    model.kept = keep = kept_indices(cfg, shard)        # read by a random model's build (models/loader.py)
    vocab = VocabShard.of(cfg.vocab_size, shard.rank, shard.world)
    model.kept_vocab = ("rows", vocab.rows())           # likewise, for the embedding and the LM head
    model.embed.weight = nn.Parameter(vocab.cut(model.embed.weight.data), requires_grad=False)
    model.embed.num_embeddings = vocab.size
    if model.lm_head is not None:
        model.lm_head = nn.Parameter(vocab.cut(model.lm_head.data), requires_grad=False)
    model.vocab_part = VocabParallel(vocab, reduce)
    for layer in model.layers:
        for name, (axis, index) in keep.items():
            # a row-parallel (cut by columns) bias is added once
            _keep(getattr(layer, name), **{axis: index}, bias=axis == "rows" or shard.rank == 0)
        layer.cfg = local
    if getattr(model, "stacked", None) is not None:           # the stacked views follow the new weights
        model.stack_projections()


def kept_indices(cfg, shard: Shard) -> dict[str, tuple[str, torch.Tensor]]:
    """Per projection of a decoder layer, what ``shard`` keeps of the whole weight: ("rows" or "cols", their
    indices)."""
    q, kv, mlp = shard.q_cols(cfg), shard.kv_cols(cfg), shard.mlp_cols()
    inter = cfg.intermediate_size
    out = {"qkv": ("rows", torch.cat([q, cfg.q_size + kv, cfg.q_size + cfg.kv_size + kv])), "o": ("cols", q)}
    if cfg.num_experts:       # every expert's gate/up rows [E * 2I, H] and down columns [E * H, I], as a dense MLP's
        out["experts_gate_up"] = ("rows", torch.cat([torch.cat([e * 2 * inter + mlp, e * 2 * inter + inter + mlp])
                                                     for e in range(cfg.num_experts)]))
        out["experts_down"] = ("cols", mlp)
    else:
        out["gate_up"] = ("rows", torch.cat([mlp, inter + mlp]))
        out["down"] = ("cols", mlp)
    return out


def _keep(linear: nn.Module, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None,
          bias: bool = True) -> None:
    w = linear.weight.data
    w = w[rows.to(w.device)] if rows is not None else w[:, cols.to(w.device)]
    linear.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = w.shape
    if getattr(linear, "bias", None) is not None:      # experts' weights have none
        b = linear.bias.data
        b = b[rows.to(b.device)] if rows is not None else (b if bias else torch.zeros_like(b))
        linear.bias = nn.Parameter(b.contiguous(), requires_grad=False)


def shard_adapter(adapter: PackedAdapter, cfg, shard: Shard, device: torch.device | None = None) -> PackedAdapter:
    """``adapter``'s part on ``shard`` (same name, slot, rank and scaling), on ``device`` (default: where it is)."""
    q, kv, mlp = shard.q_cols(cfg), shard.kv_cols(cfg), shard.mlp_cols()
    nq, nkv, nm = len(q), len(kv), len(mlp)
    column = {"qkv": ((q, 0), (kv, nq), (kv, nq + nkv)), "gate_up": ((mlp, 0), (mlp, nm))}
    row = {"o": q, "down": mlp}
    move = (lambda t: t.contiguous()) if device is None else (lambda t: t.contiguous().to(device))
    layers = []
    for groups in adapter.layers:
        out = {}
        for name, gw in groups.items():
            if name in column:
                slices = tuple(SliceB(s.index, column[name][s.index][1], s.rank_start,
                                      move(s.b[:, column[name][s.index][0].to(s.b.device)])) for s in gw.slices)
                out[name] = GroupWeights(move(gw.a), slices)
            else:
                out[name] = GroupWeights(move(gw.a[row[name].to(gw.a.device)]),
                                         tuple(replace(s, b=move(s.b)) for s in gw.slices))
        layers.append(out)
    return PackedAdapter(adapter.slot, adapter.name, adapter.rank, adapter.scaling, tuple(layers))
