"""Qwen3 MoE: the Qwen3 decoder with a routed mixture of experts in place of every layer's MLP.

Per token x (the normed residual), as transformers' ``Qwen3MoeSparseMoeBlock`` computes it:

    p = softmax(x W_router^T)                       # [E], in float32
    top-k experts by p, their p renormalised to sum 1 when ``norm_topk_prob``
    out = sum over the k experts e of p_e * down_e(silu(gate_e x) * up_e x)

The experts run in torch, grouped: the routed (token, expert) pairs are sorted by expert, and each expert that
received tokens multiplies its rows in one gate/up and one down matmul; the results, scaled by their
probabilities, are added back in ascending expert order (transformers' order). Qwen3 MoE has no shared expert.

LoRA applies to attention only: ``DecoderConfig.lora_in_out`` lists no MLP projection for a mixture of experts,
so an adapter targeting the experts or the router is refused when it registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlora.models.decoder import DecoderConfig, DecoderLayer, DecoderLM
from vlora.models.forward_batch import ForwardBatch


class ExpertWeights(nn.Module):
    """One projection of all experts as [E * out, in]: expert e's rows are e*out .. (e+1)*out, so a checkpoint's
    per-expert tensors fill row slices the way a packed projection's parts do."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.experts = experts
        self.weight = nn.Parameter(torch.empty(experts * out_features, in_features))

    def per_expert(self) -> torch.Tensor:
        return self.weight.view(self.experts, -1, self.weight.shape[1])


def route(x: torch.Tensor, router: torch.Tensor, k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, experts [T, k]) of each token's top-k experts."""
    probs = F.linear(x, router).float().softmax(dim=-1)
    top, experts = probs.topk(k, dim=-1)
    if normalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), experts


def run_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, act) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) for every token t; gate_up [E, 2I, H], down [E, H, I]."""
    k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()      # one host read per layer
    rows, scale = order // k, weights.flatten()[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        r = rows[start:start + n]
        gate, up = F.linear(x[r], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, r, F.linear(act(gate) * up, down[e]) * scale[start:start + n])
        start += n
    return out


class MoELayer(DecoderLayer):
    def make_mlp(self, cfg: DecoderConfig) -> None:
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts_gate_up = ExpertWeights(cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size)
        self.experts_down = ExpertWeights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)

    def mlp(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        weights, experts = route(x, self.router.weight, self.cfg.experts_per_token, self.cfg.norm_topk_prob)
        # under tensor parallelism each rank's experts hold a slice of their width: partial sums, summed here
        return self.reduce(run_experts(x, weights, experts, self.experts_gate_up.per_expert(),
                                       self.experts_down.per_expert(), self.act))


class MoEDecoderLM(DecoderLM):
    layer_cls = MoELayer
    projection_groups = ("qkv", "o")      # what adapters merge into: attention only
    graph_safe = False                    # the experts' matmul sizes follow the routing, read on the host
