"""Qwen2.5-VL: Qwen2-VL's request path (patches, grids, M-RoPE; ``qwen2_vl.py``) with its own ViT.

What the tower changes: RMSNorm and a gated (SwiGLU, with biases) MLP in every block; window attention in all
blocks but ``fullatt_block_indexes``: the patches are reordered window by window (a window is
``window_size`` pixels square, in units of merged 2x2 patch groups; windows never cross frames), the windowed
blocks attend inside each window, the full ones inside each frame, and the merger's output is put back in
grid order. The merger normalises with RMSNorm. In the decoder's M-RoPE a video's temporal positions advance
``tokens_per_second * temporal_patch_size / fps`` per group of frames (absolute time), not 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vlora.models.decoder import DecoderLM, RMSNorm
from vlora.models.loader import ModelLoadError
from vlora.models.qwen2_vl import Qwen2VisionConfig, Qwen2VisionTower, Qwen2VLVision
from vlora.models.qwen2_vl import VisionBlock as Qwen2VisionBlock
from vlora.models.qwen2_vl import build_with_tower

# frames of a video given as a list are taken as sampled at this rate (the Qwen2.5-VL processor's default)
VIDEO_FPS = 2.0


@dataclass(frozen=True)
class Qwen25VisionConfig(Qwen2VisionConfig):
    window_size: int = 112                  # pixels
    full_blocks: tuple[int, ...] = ()       # blocks attending over whole frames
    tokens_per_second: float = 2.0


def tower_fields(hf_config) -> dict:
    """Qwen2VisionConfig's fields from a vision config that names its width ``hidden_size`` and its output
    ``out_hidden_size`` (Qwen2.5-VL, Qwen3-VL), after checking them."""
    vc = hf_config.vision_config
    if not isinstance(vc.patch_size, int) or not isinstance(vc.temporal_patch_size, int):
        raise ModelLoadError(f"patch sizes must be integers, got {vc.patch_size!r}, {vc.temporal_patch_size!r}")
    head = vc.hidden_size // vc.num_heads
    if vc.hidden_size % vc.num_heads or head % 4:
        raise ModelLoadError(f"vision head size {vc.hidden_size}/{vc.num_heads} must be a multiple of 4 (2D RoPE)")
    if vc.out_hidden_size != hf_config.text_config.hidden_size:
        raise ModelLoadError(f"vision merger output {vc.out_hidden_size} != text hidden size "
                             f"{hf_config.text_config.hidden_size}")
    rope = getattr(vc, "rope_parameters", None) or {}
    return dict(embed_dim=vc.hidden_size, depth=vc.depth, num_heads=vc.num_heads, mlp_dim=vc.intermediate_size,
                hidden_act=vc.hidden_act, in_channels=vc.in_channels, patch_size=vc.patch_size,
                temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
                text_hidden_size=vc.out_hidden_size, rope_theta=float(rope.get("rope_theta", 10000.0)))


def vision_config(hf_config) -> Qwen25VisionConfig:
    fields = tower_fields(hf_config)
    vc = hf_config.vision_config
    unit = vc.spatial_merge_size * vc.patch_size
    if vc.window_size % unit:
        raise ModelLoadError(f"window_size {vc.window_size} must be a multiple of spatial_merge_size * patch_size "
                             f"= {unit}")
    return Qwen25VisionConfig(**fields, window_size=vc.window_size, full_blocks=tuple(vc.fullatt_block_indexes),
                              tokens_per_second=float(vc.tokens_per_second))


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(order of the merged patch groups, window by window [G]; each window's patch count, in that order).
    ``grids``: patch grids (t, h, w); ``window``: window side in merged groups."""
    order, sizes, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    block = idx[f, r:r + window, c:c + window].flatten()
                    order.append(block + base)
                    sizes.append(block.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), sizes


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(Qwen2VisionBlock):
    def __init__(self, cfg: Qwen25VisionConfig, act):
        super().__init__(cfg, act, norm=lambda dim: RMSNorm(dim, 1e-6), mlp=GatedMLP)


class PatchMerger(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig):
        super().__init__()
        wide = cfg.embed_dim * cfg.merge_size ** 2
        self.ln_q = RMSNorm(cfg.embed_dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class Qwen25VisionTower(Qwen2VisionTower):
    """Qwen2.5-VL ViT + merger: patches [P, C*tp*p*p] with patch grids (t, h, w) -> [P / m^2, D_text]."""

    block_cls, merger_cls = VisionBlock, PatchMerger

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{patches.shape[0]} patches for grids {grids}")
        m2 = self.cfg.merge_size ** 2
        order, windows = window_order(grids, self.cfg.merge_size,
                                      self.cfg.window_size // self.cfg.merge_size // self.cfg.patch_size)
        order = order.to(patches.device)
        regroup = lambda x: x.view(-1, m2, x.shape[-1])[order].view(-1, x.shape[-1])   # noqa: E731
        x = regroup(self.patch_embed(patches))
        cos, sin = (regroup(t) for t in self.rope(grids))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.cfg.full_blocks else windows)
        return self.merger(x)[torch.argsort(order)]


def build_qwen2_5_vl(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                     max_images: int, max_pixels: int) -> tuple[DecoderLM, int, Qwen2VLVision]:
    """Decoder (Qwen2 with M-RoPE), its max length, and the vision side of a Qwen2.5-VL checkpoint."""
    vcfg = vision_config(hf_config)
    return build_with_tower(model_dir, hf_config, dtype, device, max_model_len, max_images, max_pixels, vcfg,
                            Qwen25VisionTower,
                            video_time_step=vcfg.tokens_per_second * vcfg.temporal_patch_size / VIDEO_FPS)
