"""Vision tower and projector of a LLaVA-style LMM: CLIP ViT -> chosen hidden layer(s) -> 2-layer MLP.

Reads top to bottom as the math (CLIP, Radford et al.; LLaVA-1.5, Liu et al.):

    x = [cls; patches(pixels) W_p] + pos                  # [N, 1 + g*g, Dv]
    x = LN_pre(x);  hs = [x]
    for each layer: x = x + Attn(LN1(x)); x = x + MLP(LN2(x)); hs.append(x)
    f = cat(hs[l] for l in feature_layers)               # 'default' drops the CLS row
    image tokens = W2 act(W1 f + b1) + b2                 # [N, tokens_per_image, D_text]

Only the layers up to the deepest selected one run. Weight loading lives in
``lmm.py``; the decoder receives these rows through ``ForwardBatch.embed_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]       # indices into hidden_states (0 = embeddings, -1 = last layer)
    select_strategy: str                  # "default": drop CLS; "full": keep it
    projector_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        return self.grid * self.grid + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_needed(self) -> int:
        """Encoder layers to run: hidden_states[i] is the output of layer i (0: the embeddings)."""
        return max(i % (self.num_layers + 1) for i in self.feature_layers)


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, act):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, S, Dv] -> [N, S, Dv] (bidirectional attention inside each image)."""
        n, s, d = x.shape
        y = self.norm1(x)
        q, k, v = (proj(y).view(n, s, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, s, d)
        x = x + self.out(attn)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class VisionTower(nn.Module):
    """CLIP ViT + LLaVA projector: pixels [N, C, H, W] -> image token embeddings [N, tokens_per_image, D_text]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.cfg = cfg
        d = cfg.hidden_size
        self.patch = nn.Conv2d(cfg.num_channels, d, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.cls = nn.Parameter(torch.empty(d))
        self.pos = nn.Parameter(torch.empty(cfg.grid * cfg.grid + 1, d))
        self.pre_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        act = ACT2FN[cfg.hidden_act]
        self.layers = nn.ModuleList(VisionLayer(cfg, act) for _ in range(cfg.layers_needed))
        self.proj1 = nn.Linear(d * len(cfg.feature_layers), cfg.text_hidden_size, bias=cfg.projector_bias)
        self.proj_act = ACT2FN[cfg.projector_act]
        self.proj2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n = pixels.shape[0]
        x = self.patch(pixels.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(n, 1, -1), x], dim=1) + self.pos
        hs = [self.pre_norm(x)]
        for layer in self.layers:
            hs.append(layer(hs[-1]))
        picked = [hs[i % (cfg.num_layers + 1)] for i in cfg.feature_layers]
        if cfg.select_strategy == "default":
            picked = [h[:, 1:] for h in picked]
        f = torch.cat(picked, dim=-1)
        return self.proj2(self.proj_act(self.proj1(f)))
