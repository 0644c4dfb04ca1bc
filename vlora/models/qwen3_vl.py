"""Qwen3-VL: Qwen2-VL's request path (patches, grids, M-RoPE; ``qwen2_vl.py``) with Qwen3's decoder and its ViT.

What changes from Qwen2-VL:

- the decoder is Qwen3 (per-head q/k RMSNorm) with *interleaved* M-RoPE: rotary frequency j turns with the
  height position where j % 3 == 1, the width position where j % 3 == 2 (each within its section's share), the
  temporal one otherwise (``RotaryEmbedding``'s ``interleaved``);
- the ViT adds a learned position embedding (a square table, bilinearly resampled to each image's patch grid,
  corners aligned) to the patch embedding (a convolution with a bias); its blocks are Qwen2-VL's with a
  ``linear_fc1`` / ``linear_fc2`` MLP;
- deepstack: after each block in ``deepstack_visual_indexes`` a merger of its own (normalising after the 2x2
  shuffle) turns the block's output into one more row per image token; the k-th of them is added to the image
  tokens' hidden states after decoder layer k. The tower returns [tokens, (1 + k) * hidden]: the input
  embedding, then the k deepstack rows, which ``DecoderLM`` splits (``deepstack_layers``).

Images only: the Qwen3-VL processor writes a timestamp before each video frame, which vlora's prompt expansion
does not, so a video is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vlora.models.decoder import DecoderLM
from vlora.models.lmm import ImageInputError
from vlora.models.loader import ModelLoadError
from vlora.models.qwen2_5_vl import tower_fields
from vlora.models.qwen2_vl import PatchEmbed, Qwen2VisionConfig, Qwen2VisionTower, Qwen2VLVision, VisionBlock, \
    build_with_tower

# the Qwen3-VL processor's normalisation, for checkpoints without a preprocessor_config.json
PROCESSOR_DEFAULTS = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


@dataclass(frozen=True)
class Qwen3VisionConfig(Qwen2VisionConfig):
    num_position_embeddings: int = 2304
    deepstack_blocks: tuple[int, ...] = ()


def vision_config(hf_config) -> Qwen3VisionConfig:
    vc = hf_config.vision_config
    side = int(vc.num_position_embeddings ** 0.5)
    if side * side != vc.num_position_embeddings:
        raise ModelLoadError(f"num_position_embeddings {vc.num_position_embeddings} is not a square grid")
    deep = tuple(vc.deepstack_visual_indexes)
    if any(not 0 <= b < vc.depth for b in deep) or len(deep) > hf_config.text_config.num_hidden_layers:
        raise ModelLoadError(f"deepstack_visual_indexes {list(deep)}: each must be a block of the {vc.depth}, and at "
                             f"most one per decoder layer ({hf_config.text_config.num_hidden_layers})")
    return Qwen3VisionConfig(**tower_fields(hf_config), num_position_embeddings=vc.num_position_embeddings,
                             deepstack_blocks=deep)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(VisionBlock):
    def __init__(self, cfg: Qwen3VisionConfig, act):
        super().__init__(cfg, act, mlp=VisionMLP)


class PatchMerger(nn.Module):
    """2x2 neighbouring patches -> one LM row; ``postshuffle``: the norm runs over the four patches together
    (the deepstack mergers) instead of over each patch."""

    def __init__(self, cfg: Qwen3VisionConfig, postshuffle: bool = False):
        super().__init__()
        self.wide = cfg.embed_dim * cfg.merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.wide if postshuffle else cfg.embed_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.wide, self.wide)
        self.linear_fc2 = nn.Linear(self.wide, cfg.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.wide)) if self.postshuffle else self.norm(x).view(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(Qwen2VisionTower):
    """Qwen3-VL ViT + mergers: patches [P, C*tp*p*p] with patch grids (t, h, w) -> [P / m^2, (1 + k) D_text]."""

    block_cls, merger_cls = Block, PatchMerger

    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__(cfg)
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_blocks)

    def position_embedding(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[P, D]: the learned table resampled to each grid (bilinear, corners aligned), in the processor's
        block-major patch order, repeated for each frame."""
        m, side = self.cfg.merge_size, int(self.cfg.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0)
        rows = []
        for t, h, w in grids:
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]
            grid = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
            rows.append(grid.repeat(t, 1))
        return torch.cat(rows)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{patches.shape[0]} patches for grids {grids}")
        x = self.patch_embed(patches)
        x = x + self.position_embedding(grids).to(x.dtype)
        cos, sin = self.rope(grids)
        segments = [h * w for t, h, w in grids for _ in range(t)]
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in self.cfg.deepstack_blocks:
                deep.append(self.deepstack_merger_list[self.cfg.deepstack_blocks.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)


class Qwen3VLVision(Qwen2VLVision):
    def prepare(self, ids: list[int], images):
        if isinstance(images, (list, tuple)) and any(isinstance(it, (list, tuple)) for it in images):
            raise ImageInputError("videos are not supported for Qwen3-VL (its prompts put a timestamp before each "
                                  "frame); send the frames as images")
        return super().prepare(ids, images)


def build_qwen3_vl(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                   max_images: int, max_pixels: int) -> tuple[DecoderLM, int, Qwen2VLVision]:
    """Decoder (Qwen3 with interleaved M-RoPE and deepstack), its max length, and the vision side of a Qwen3-VL
    checkpoint."""
    vcfg = vision_config(hf_config)
    return build_with_tower(model_dir, hf_config, dtype, device, max_model_len, max_images, max_pixels, vcfg,
                            Qwen3VisionTower, vision_cls=Qwen3VLVision,
                            decoder_overrides=dict(deepstack_layers=len(vcfg.deepstack_blocks)),
                            processor_defaults=PROCESSOR_DEFAULTS)
