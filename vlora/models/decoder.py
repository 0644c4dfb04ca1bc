"""Decoder of the Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) and its relatives (Qwen3, Gemma 3 text,
Phi-3 / Phi-4-mini) over a paged KV cache.

Reads top to bottom as the math: embed -> N x (RMSNorm, GQA attention with RoPE, residual, RMSNorm, gated MLP,
residual) -> RMSNorm -> LM head; ``DecoderConfig``'s flags add what the relatives change (per-head q/k norms,
norms after attention and the MLP, per-layer windows, partial rotary, ...). Projections are packed (qkv,
gate_up); every projection passes through ``lora_linear`` so the iteration's adapters apply to their own token
rows. Weight loading lives in ``loader.py``; batch metadata arrives in a ``ForwardBatch``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlora.kernels.reference import gather_blocks, paged_decode_attention, prefill_attention
from vlora.lora.layers import lora_linear
from vlora.models.forward_batch import ForwardBatch


@dataclass(frozen=True)
class DecoderConfig:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    mrope_section: tuple[int, ...] | None = None   # M-RoPE (Qwen2-VL): rotary frequencies per t/h/w section
    qk_norm: bool = False       # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    rotary_dim: int | None = None   # RoPE on the first rotary_dim dimensions of each head only (Phi-4-mini)
    # Gemma 3: norms scale by 1 + weight (in float32), a norm after attention and after the MLP too, embeddings
    # times embed_scale, scores times attn_scale (not 1/sqrt(head_dim)), logits soft-capped, and per-layer
    # attention windows (None: global) whose layers take the local rotary table
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    final_logit_softcap: float | None = None
    layer_windows: tuple[int | None, ...] | None = None
    # Qwen3 MoE: every layer's MLP is num_experts routed experts of intermediate_size, experts_per_token per token
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    mrope_interleaved: bool = False   # Qwen3-VL: M-RoPE frequencies cycle t, h, w instead of running in sections
    deepstack_layers: int = 0         # Qwen3-VL: layers after which image rows add one more vision feature each

    def window(self, layer: int) -> int | None:
        """Attention window of ``layer`` (None: it sees the whole context)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def lora_in_out(self) -> tuple[dict[str, int], dict[str, int]]:
        """(in_features, out_features) of every LoRA-targetable projection."""
        h, i = self.hidden_size, self.intermediate_size
        ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": self.q_size,
               "gate_proj": h, "up_proj": h, "down_proj": i}
        outs = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size,
                "o_proj": h, "gate_proj": i, "up_proj": i, "down_proj": h}
        if self.num_experts:          # LoRA on a mixture of experts: attention only (the experts take none)
            attention = ("q_proj", "k_proj", "v_proj", "o_proj")
            return {m: ins[m] for m in attention}, {m: outs[m] for m in attention}
        return ins, outs


class RMSNorm(nn.Module):
    """Llama: weight * normed(x) in x's dtype; ``offset`` (Gemma): (1 + weight) * normed(x) in float32."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for all positions up to ``max_len``, any of the HF scaling variants.

    M-RoPE (Qwen2-VL, ``mrope_section`` = (s_t, s_h, s_w), summing to D/2): a token has three positions
    (temporal, height, width); rotary frequency j takes its angle from position ``j``'s section
    (``sections[j] = k`` for the k-th run of lengths s_t, s_h, s_w, repeated cyclically), in both halves.
    ``interleaved`` (Qwen3-VL): frequency j takes height where j % 3 == 1 and j < 3 s_h, width where j % 3 == 2
    and j < 3 s_w, and time otherwise.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_len: int,
                 mrope_section: tuple[int, ...] | None = None, interleaved: bool = False):
        super().__init__()
        if inv_freq.is_meta:        # a model built on the meta device gets its tables later; computing them there
            cos = sin = torch.empty(max_len, 2 * inv_freq.shape[0], device="meta")   # would import torch._dynamo
        else:
            t = torch.arange(max_len, dtype=torch.float32, device=inv_freq.device)
            freqs = torch.outer(t, inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.mrope_section = mrope_section
        if mrope_section is not None:
            if sum(mrope_section) != inv_freq.shape[0]:
                raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {inv_freq.shape[0]}")
            if interleaved:
                j = torch.arange(inv_freq.shape[0])
                half = torch.zeros_like(j)
                half[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
                half[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
            else:
                half = torch.cat([torch.full((n,), k % 3) for k, n in enumerate(mrope_section)])
            self.register_buffer("sections", torch.cat((half, half)).view(1, 1, -1), persistent=False)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [T, D] of ``positions``: [T] (plain) or [3, T] (M-RoPE t/h/w positions)."""
        if positions.dim() == 1:
            return self.cos[positions], self.sin[positions]
        if self.mrope_section is None or positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"positions of shape {list(positions.shape)}: [3, T] M-RoPE positions need a model "
                             f"with mrope_section (this one has {self.mrope_section})")
        idx = self.sections.expand(1, positions.shape[1], -1)
        return self.cos[positions].gather(0, idx)[0], self.sin[positions].gather(0, idx)[0]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rows(positions)
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, R] (rotate-half layout, as HF Llama), R <= D: the first R dimensions rotate."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """One rank: a projection's output is already the whole sum."""
    return t


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int, act):
        super().__init__()
        self.index = index
        self.cfg = cfg
        self.act = act
        norm = lambda dim: RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset)   # noqa: E731
        self.window = cfg.window(index)
        self.attn_norm = norm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(cfg.head_dim), norm(cfg.head_dim)
        if cfg.sandwich_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(cfg.hidden_size), norm(cfg.hidden_size)
        self.mlp_norm = norm(cfg.hidden_size)
        self.make_mlp(cfg)
        self.scale = cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim)
        self.reduce = _whole      # tensor parallelism: sums the partial outputs of o and down over the ranks

    def make_mlp(self, cfg: DecoderConfig) -> None:
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def mlp(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The gated MLP of the normed residual ``x`` [T, hidden]."""
        i = self.index
        gu = lora_linear(x, self.gate_up, fb.lora, i, "gate_up")
        gate, up = gu.chunk(2, dim=-1)
        return self.reduce(lora_linear(self.act(gate) * up, self.down, fb.lora, i, "down"))

    def forward(self, h: torch.Tensor, fb: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        cfg, i = self.cfg, self.index
        x = self.attn_norm(h)
        qkv = self._qk_norm(lora_linear(x, self.qkv, fb.lora, i, "qkv"))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.reshape(-1, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        page = k_cache.shape[1]
        blk, off = fb.slot_mapping // page, fb.slot_mapping % page
        k_cache[blk, off] = k
        v_cache[blk, off] = v
        attn = self._attention(q, k, v, fb, k_cache, v_cache)
        o_in = attn.reshape(-1, cfg.q_size)
        o = self.reduce(lora_linear(o_in, self.o, fb.lora, i, "o"))
        h = h + (self.post_attn_norm(o) if cfg.sandwich_norms else o)

        d = self.mlp(self.mlp_norm(h), fb)
        return h + (self.post_mlp_norm(d) if cfg.sandwich_norms else d)

    def forward_fused(self, h: torch.Tensor, x: torch.Tensor, fb: ForwardBatch, rope: tuple, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, next_norm: "RMSNorm") -> torch.Tensor:
        """The same math with the fused kernels. ``x`` = this layer's attn_norm(h); ``h`` (the residual stream)
        is updated in place; returns ``next_norm(h)``, the next layer's (or the final) normed input.
        ``rope`` = (cos table, sin table, [T] row of each token in them)."""
        from vlora.kernels.fused import add_rmsnorm_, rope_and_cache, silu_mul
        from vlora.kernels.gemv import linear

        cfg, i = self.cfg, self.index
        qkv = self._qk_norm(lora_linear(x, self.qkv, fb.lora, i, "qkv", linear))
        q = rope_and_cache(qkv, *rope, fb.slot_mapping, k_cache, v_cache,
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        attn = self._attention(q, None, None, fb, k_cache, v_cache)
        o_in = attn.view(-1, cfg.q_size)
        x = add_rmsnorm_(h, self.reduce(lora_linear(o_in, self.o, fb.lora, i, "o", linear)),
                         self.mlp_norm.weight, self.mlp_norm.eps)
        gu = lora_linear(x, self.gate_up, fb.lora, i, "gate_up", linear)
        m = silu_mul(gu)
        d = self.reduce(lora_linear(m, self.down, fb.lora, i, "down", linear))
        return add_rmsnorm_(h, d, next_norm.weight, next_norm.eps)

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """[T, q + 2 kv] with each head of q and k RMS-normed (models with ``qk_norm``; others unchanged)."""
        if not self.cfg.qk_norm:
            return qkv
        cfg = self.cfg
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, cfg.num_heads, cfg.head_dim)).flatten(1)
        k = self.k_norm(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)).flatten(1)
        return torch.cat((q, k, v), dim=-1)

    def _attention(self, q, k, v, fb: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = fb.num_decodes
        if fb.use_kernels:
            from vlora.kernels.attention import paged_decode, paged_prefill

            window = self.window or 0
            if nd:
                paged_decode(q[:nd], k_cache, v_cache, fb.decode_block_tables, fb.decode_lens, self.scale, window,
                             out=out[:nd], max_ctx=fb.decode_max_len)
            pm = fb.prefill_meta
            if pm is not None:
                paged_prefill(q, k_cache, v_cache, pm.tables, pm.starts, pm.q_lens, pm.ctx_lens, pm.max_q_len,
                              self.scale, window, out=out)
            return out
        if nd:
            out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, fb.decode_block_tables,
                                              fb.decode_mask, self.scale)
        for p in fb.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.ctx_len == p.q_len:          # nothing cached before this chunk: use fresh K/V
                kk, vv = k[rows], v[rows]
            else:
                kk = gather_blocks(k_cache, p.block_table, p.ctx_len)
                vv = gather_blocks(v_cache, p.block_table, p.ctx_len)
            out[rows] = prefill_attention(q[rows], kk, vv, p.mask, self.scale)
        return out


class DecoderLM(nn.Module):
    layer_cls = DecoderLayer
    projection_groups = ("qkv", "o", "gate_up", "down")    # the packed projections of every layer
    graph_safe = True           # whether a decode iteration's shapes are fixed by its batch (CUDA graphs replay it)

    def __init__(self, cfg: DecoderConfig, inv_freq: torch.Tensor, attention_scaling: float, max_len: int):
        super().__init__()
        from transformers.activations import ACT2FN

        self.cfg = cfg
        # made without nn.Embedding's random init: the weights are loaded, and that init on the meta device
        # imports torch._dynamo (and Triton), about 175 MB of resident memory a CPU server never uses
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        act = ACT2FN[cfg.hidden_act]
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, act) for i in range(cfg.num_layers))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rope = self.rotary(inv_freq, attention_scaling, max_len)
        self.rope_local: RotaryEmbedding | None = None    # the windowed layers' table where it differs (Gemma 3)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def rotary(self, inv_freq: torch.Tensor, attention_scaling: float, max_len: int) -> RotaryEmbedding:
        """The global rotary table of this model's layout (plain or M-RoPE) for ``inv_freq``."""
        return RotaryEmbedding(inv_freq, attention_scaling, max_len, self.cfg.mrope_section,
                               self.cfg.mrope_interleaved)

    @property
    def fusable(self) -> bool:
        """Whether the fused kernels cover this model (Llama's norms, SwiGLU with SiLU, even head size)."""
        c = self.cfg
        plain = not (c.norm_offset or c.sandwich_norms or c.embed_scale or c.layer_windows or c.rotary_dim
                     or c.num_experts)
        return plain and c.hidden_act == "silu" and c.head_dim % 2 == 0

    # tensor parallelism: the vocabulary's rows this rank holds and the collectives that make them whole
    # (vlora.parallel.partition.VocabParallel); None: the whole embedding and LM head
    vocab_part = None

    def forward(self, fb: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm. kv_cache: the pool's pages [num_pages, L, 2, block_size, Hkv, D]."""
        h = self.embed(fb.input_ids) if self.vocab_part is None else self.vocab_part.embed(self.embed, fb.input_ids)
        if self.cfg.embed_scale is not None:
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        deep = ()                            # Qwen3-VL: rows added to the image tokens after each early layer
        if fb.embed_rows is not None:        # image tokens: the vision tower's rows replace the lookup
            values = fb.embed_values.to(h.dtype)
            if self.cfg.deepstack_layers:    # the tower's rows carry the deepstack features after the input's
                values, *deep = values.split(self.cfg.hidden_size, dim=-1)
            h.index_copy_(0, fb.embed_rows, values)
        if fb.use_kernels and self.fusable:
            from vlora.kernels.fused import add_rmsnorm_

            rope = (self.rope.cos, self.rope.sin, fb.positions)
            if fb.positions.dim() == 2:      # M-RoPE: the kernel reads per-token rows gathered here
                cos, sin = self.rope.rows(fb.positions)
                rope = (cos, sin, torch.arange(cos.shape[0], device=cos.device))
            first = self.layers[0].attn_norm
            x = add_rmsnorm_(h, None, first.weight, first.eps)
            for i, layer in enumerate(self.layers):
                nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
                x = layer.forward_fused(h, x, fb, rope, kv_cache[:, i, 0], kv_cache[:, i, 1], nxt)
                if i < len(deep):            # the fused layer returned next_norm(h): norm again after the add
                    h.index_add_(0, fb.embed_rows, deep[i])
                    x = nxt(h)
            return x
        cos, sin = self.rope(fb.positions, h.dtype)
        local = {}                   # window -> (batch with that window's masks, cos, sin), built once per forward
        for i, layer in enumerate(self.layers):
            if layer.window == self.cfg.sliding_window:
                h = layer(h, fb, cos, sin, kv_cache[:, i, 0], kv_cache[:, i, 1])
            else:
                if layer.window not in local:
                    rope = self.rope if self.rope_local is None else self.rope_local
                    local[layer.window] = (fb if fb.use_kernels else windowed(fb, layer.window),
                                           *rope(fb.positions, h.dtype))
                lfb, lcos, lsin = local[layer.window]
                h = layer(h, lfb, lcos, lsin, kv_cache[:, i, 0], kv_cache[:, i, 1])
            if i < len(deep):
                h = h.index_add(0, fb.embed_rows, deep[i])
        return self.norm(h)

    def stack_projections(self) -> dict[str, torch.Tensor]:
        """Put each packed projection of all layers into one [L, out, in] tensor (the layers' weights
        become views of it), so an adapter merges into every layer with one batched op."""
        stacked = {}
        for group in self.projection_groups:
            mods = [getattr(layer, group) for layer in self.layers]
            big = torch.stack([m.weight.data for m in mods])
            for i, m in enumerate(mods):
                m.weight = nn.Parameter(big[i], requires_grad=False)
            stacked[group] = big
        self.stacked = stacked
        return stacked

    def project_logits(self, hidden: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """hidden [n, h] -> raw logits [n, vocab] in the model's dtype (under tensor parallelism every rank's
        columns, gathered: every rank calls it at the same point); ``fast``: the fused path's projection kernel."""
        w = self.embed.weight if self.lm_head is None else self.lm_head
        if fast:
            from vlora.kernels.gemv import linear

            logits = linear(hidden, w)
        else:
            logits = F.linear(hidden, w)
        return logits if self.vocab_part is None else self.vocab_part.gather(logits)

    def compute_logits(self, hidden: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """hidden [n, h] -> logits [n, vocab] in float32, soft-capped where the model caps them."""
        logits = self.project_logits(hidden, fast).float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def windowed(fb: ForwardBatch, window: int | None) -> ForwardBatch:
    """``fb`` (built for global attention) with the reference path's masks limited to the last ``window`` keys
    of each query (the attention kernels take the window as an argument instead)."""
    if window is None:
        return fb
    decode_mask = fb.decode_mask
    if decode_mask is not None:
        key = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
        decode_mask = decode_mask & (key > fb.decode_lens.unsqueeze(1) - 1 - window).view(decode_mask.shape)
    prefills = []
    for p in fb.prefills:
        q = torch.arange(p.ctx_len - p.q_len, p.ctx_len, device=fb.input_ids.device).unsqueeze(1)
        k = torch.arange(p.ctx_len, device=q.device).unsqueeze(0)
        mask = (k <= q) & (k > q - window)
        prefills.append(dataclasses.replace(p, mask=mask if p.mask is None else p.mask & mask))
    return dataclasses.replace(fb, decode_mask=decode_mask, prefills=tuple(prefills))
