"""Qwen2-VL: ``Qwen2VLForConditionalGeneration`` checkpoints -> vlora's decoder (with M-RoPE) + this ViT.

Reads top to bottom as the math (Qwen2-VL, Wang et al. 2024):

    patches [P, C*tp*p*p]  (processor: each image -> its patch grid (t, h, w); a video: t = frames / tp)
    x = patches W_patch                                   # Conv3d with kernel = stride = one patch
    cos, sin = 2D RoPE of each patch's (row, col)         # half the rotary dims per axis
    for each block: x = x + Attn(LN1(x)); x = x + MLP(LN2(x))   # attention inside each frame (h*w patches)
    tokens = W2 GELU(W1 LN_q(x).view(-1, 4 Dv))           # 2x2 neighbouring patches -> one LM token

The processor lays a frame's patches out block-major over the 2x2 merge groups, so the merger's view
reads four neighbours at a time. The decoder is ``DecoderLM`` with ``mrope_section``: each token has a
temporal/height/width position (``mrope_positions``, transformers' ``get_rope_index``): text tokens count on
from the running position, an image's tokens take (t0 + cur, row + cur, col + cur) and the text after it
continues from cur + max(rows, cols). Generated tokens sit at their index + ``rope_delta`` (max position + 1
- prompt length), the same delta transformers keeps in ``rope_deltas``.

Images: PIL images / bytes / paths go through transformers' ``Qwen2VLImageProcessorPil`` (smart resize to a
multiple of 28 px within its pixel budget, CLIP normalisation, patches); a preprocessed [C, H, W] tensor
(H, W multiples of patch * merge) is patchified here. A video is a list of frames (each processed as an
image, all of one size), paired along time (the last frame repeated if the count is odd).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vlora.models.decoder import DecoderLM
from vlora.models.lmm import ImageInputError, ImageSpan, VisionModel, _digest
from vlora.models.loader import ModelLoadError, build_decoder, iter_safetensors


@dataclass(frozen=True)
class Qwen2VisionConfig:
    embed_dim: int
    depth: int
    num_heads: int
    mlp_dim: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    text_hidden_size: int
    rope_theta: float

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def vision_config(hf_config) -> Qwen2VisionConfig:
    vc = hf_config.vision_config
    if not isinstance(vc.patch_size, int) or not isinstance(vc.temporal_patch_size, int):
        raise ModelLoadError(f"patch sizes must be integers, got {vc.patch_size!r}, {vc.temporal_patch_size!r}")
    if vc.embed_dim % vc.num_heads or (vc.embed_dim // vc.num_heads) % 4:
        raise ModelLoadError(f"vision head size {vc.embed_dim}/{vc.num_heads} must be a multiple of 4 (2D RoPE)")
    if vc.hidden_size != hf_config.text_config.hidden_size:
        raise ModelLoadError(f"vision merger output {vc.hidden_size} != text hidden size "
                             f"{hf_config.text_config.hidden_size}")
    rope = getattr(vc, "rope_parameters", None) or {}
    return Qwen2VisionConfig(
        embed_dim=vc.embed_dim, depth=vc.depth, num_heads=vc.num_heads, mlp_dim=int(vc.embed_dim * vc.mlp_ratio),
        hidden_act=vc.hidden_act, in_channels=vc.in_channels, patch_size=vc.patch_size,
        temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
        text_hidden_size=vc.hidden_size, rope_theta=float(rope.get("rope_theta", 10000.0)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, heads, d]; cos, sin [P, d] fp32 (rotate-half layout); computed in fp32 as transformers does."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos, sin, segments: list[int]) -> torch.Tensor:
        """x [P, D]; attention is bidirectional inside each segment (one frame's patches) only."""
        p, d = x.shape
        q, k, v = self.qkv(x).view(p, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if len(set(segments)) == 1:                # all frames of one size: one batched call
            n = len(segments)
            q, k, v = (t.view(n, segments[0], self.heads, -1).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(p, d)
        else:
            parts = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in qkv)).transpose(0, 1)
                     for qkv in zip(q.split(segments), k.split(segments), v.split(segments))]
            out = torch.cat(parts).reshape(p, d)
        return self.proj(out)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP; Qwen2.5-VL's block passes RMS norms and a gated MLP."""

    def __init__(self, cfg: Qwen2VisionConfig, act, norm=lambda dim: nn.LayerNorm(dim, eps=1e-6), mlp=None):
        super().__init__()
        self.norm1 = norm(cfg.embed_dim)
        self.norm2 = norm(cfg.embed_dim)
        self.attn = VisionAttention(cfg.embed_dim, cfg.num_heads)
        self.mlp = (mlp or VisionMLP)(cfg.embed_dim, cfg.mlp_dim, act)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig, bias: bool = False):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel, stride=kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [P, C*tp*p*p] -> [P, D]: a convolution over exactly one patch is a matmul."""
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig):
        super().__init__()
        wide = cfg.embed_dim * cfg.merge_size ** 2
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL ViT + merger: patches [P, C*tp*p*p] of images with patch grids (t, h, w) -> [P / m^2, D_text].
    Module names follow the checkpoint's ``visual.*`` tensors."""

    block_cls, merger_cls = VisionBlock, PatchMerger      # Qwen2.5-VL's tower swaps in its own

    def __init__(self, cfg: Qwen2VisionConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        act = ACT2FN[cfg.hidden_act]
        self.blocks = nn.ModuleList(self.block_cls(cfg, act) for _ in range(cfg.depth))
        self.merger = self.merger_cls(cfg)
        quarter = cfg.embed_dim // cfg.num_heads // 2
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, quarter, 2).float() / quarter),
                             persistent=False)

    def rope(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim] fp32: the first half of each rotary half turns with the patch's row, the
        second with its column; patches in the processor's block-major order, repeated for each frame."""
        m, dev = self.cfg.merge_size, self.inv_freq.device
        rows = []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h, device=dev), torch.arange(w, device=dev), indexing="ij")
            hw = torch.stack([x.reshape(h // m, m, w // m, m).transpose(1, 2).flatten() for x in (hh, ww)], -1)
            rows.append(hw.repeat(t, 1))
        pos = torch.cat(rows).float()                                   # [P, 2] (row, col)
        freqs = (pos[..., None] * self.inv_freq.float()).flatten(1)     # [P, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{patches.shape[0]} patches for grids {grids}")
        x = self.patch_embed(patches)
        cos, sin = self.rope(grids)
        segments = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)


def mrope_positions(num_prompt: int, spans: tuple[ImageSpan, ...]) -> tuple[torch.Tensor, int]:
    """(positions [3, num_prompt] long, rope delta) of a prompt whose images/videos are ``spans`` (each with
    its token grid): transformers' ``Qwen2VLModel.get_rope_index`` for one sequence."""
    pos = torch.empty(3, num_prompt, dtype=torch.long)
    cur = last = 0
    for s in sorted(spans, key=lambda s: s.offset):
        pos[:, last:s.offset] = torch.arange(cur, cur + s.offset - last)
        cur += s.offset - last
        t, h, w = s.grid
        grid = torch.meshgrid((torch.arange(t) * s.time_step).long(), torch.arange(h), torch.arange(w), indexing="ij")
        pos[:, s.offset:s.offset + s.length] = torch.stack(grid).reshape(3, -1) + cur
        cur += max(h, w)
        last = s.offset + s.length
    pos[:, last:] = torch.arange(cur, cur + num_prompt - last)
    return pos, int(pos.max()) + 1 - num_prompt


class Qwen2VLVision(VisionModel):
    """The vision side of a Qwen2-VL model: images -> patch spans with grids; spans -> merged token rows."""

    def __init__(self, tower: Qwen2VisionTower, image_token_id: int, video_token_id: int, start_end: tuple[int, int],
                 processor, max_images: int, max_pixels: int, video_time_step: float = 1.0):
        super().__init__(tower, image_token_id, processor, max_images, max_pixels)
        self.video_token_id = video_token_id
        self.start_end = start_end                  # <|vision_start|>, <|vision_end|> around each image
        self.video_time_step = video_time_step      # a video's M-RoPE temporal step (Qwen2.5-VL: absolute time)

    @property
    def image_prompt_ids(self) -> tuple[int, ...]:
        return (self.start_end[0], self.image_token_id, self.start_end[1])

    @property
    def tokens_per_image(self) -> int | None:
        return None                                 # depends on each image's size

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        return (self.image_token_id, self.video_token_id)

    def encode_spans(self, spans: list[ImageSpan]) -> list[torch.Tensor]:
        m = self.cfg.merge_size
        w = self.tower.patch_embed.proj.weight
        with torch.inference_mode():
            out = self.tower(torch.cat([s.pixels for s in spans]).to(w.device),
                             [(t, h * m, ww * m) for t, h, ww in (s.grid for s in spans)])
        return list(out.split([s.length for s in spans]))

    def prepare(self, ids: list[int], images) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """Like LLaVA's (``images``: an image, or a list of frames for a video, per placeholder), with
        ``<|image_pad|>`` (image_token_id) marking an image and ``<|video_pad|>`` (video_token_id) a video."""
        items = self._items(images)
        videos = [isinstance(it, (list, tuple)) for it in images]
        spans = []
        for i, (it, video) in enumerate(zip(items, videos)):
            per_frame = [self._patches(f, f"image {i}" + (f" frame {j}" if video else "")) for j, f in enumerate(it)]
            spans.append(self._span(per_frame, video, f"image {i}"))
        marks = [self.video_token_id if v else self.image_token_id for v in videos]
        ids, offsets = self._expand(ids, [s[2] for s in spans], marks)
        return ids, tuple(ImageSpan(o, n, px, _digest(px, grid), frames=len(it), grid=grid,
                                    time_step=self.video_time_step if video else 1.0)
                          for o, (px, grid, n), it, video in zip(offsets, spans, items, videos))

    def _span(self, per_frame: list[tuple[torch.Tensor, int, int]], video: bool, what: str):
        """(patches [t*h*w, C*tp*p*p], token grid (t, h/m, w/m), token count) of one image or video."""
        tp, m = self.cfg.temporal_patch_size, self.cfg.merge_size
        if len({(h, w) for _, h, w in per_frame}) > 1:
            raise ImageInputError(f"{what}: video frames have different sizes after preprocessing "
                                  f"({sorted({(h, w) for _, h, w in per_frame})} patches)")
        _, h, w = per_frame[0]
        x = torch.stack([f for f, _, _ in per_frame])               # [F, N, C, p, p]
        if not video:
            x = x.expand(tp, *x.shape[1:])                          # an image: the frame repeated along time
        elif x.shape[0] % tp:
            x = torch.cat([x, x[-1:].expand(tp - x.shape[0] % tp, *x.shape[1:])])
        g, n = x.shape[0] // tp, x.shape[1]
        px = x.reshape(g, tp, *x.shape[1:]).permute(0, 2, 3, 1, 4, 5).reshape(g * n, -1).contiguous()
        return px, (g, h // m, w // m), g * h * w // (m * m)

    def _patches(self, img, what: str) -> tuple[torch.Tensor, int, int]:
        """One frame -> (patches [h*w, C, p, p] in the processor's block-major order, h, w) (patch grid)."""
        c, p, m = self.cfg.in_channels, self.cfg.patch_size, self.cfg.merge_size
        if isinstance(img, torch.Tensor):
            f = p * m
            if img.dim() != 3 or img.shape[0] != c or img.shape[1] % f or img.shape[2] % f or img.shape[1] == 0 \
                    or img.shape[2] == 0 or not img.is_floating_point():
                raise ImageInputError(f"{what}: a preprocessed image must be a float tensor [{c}, H, W] with H and "
                                      f"W positive multiples of {f}, got {img.dtype} {list(img.shape)}")
            if img.shape[1] * img.shape[2] > self.max_pixels:
                raise ImageInputError(f"{what}: {img.shape[2]}x{img.shape[1]} pixels; the limit is {self.max_pixels}")
            x = img.detach().to("cpu", torch.float32)
            h, w = x.shape[1] // p, x.shape[2] // p
            patches = x.reshape(c, h // m, m, p, w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6).reshape(h * w, c, p, p)
        else:
            pil = self._decode(img, what)
            try:
                out = self.processor(images=[pil], return_tensors="pt")
                px, (t, h, w) = torch.as_tensor(out["pixel_values"]), out["image_grid_thw"][0].tolist()
            except Exception as e:
                raise ImageInputError(f"{what}: preprocessing failed ({type(e).__name__}: {e})") from None
            tp = self.cfg.temporal_patch_size
            if tuple(px.shape) != (h * w, c * tp * p * p) or t != 1:
                raise ImageInputError(f"{what}: the image processor gives patches {list(px.shape)}, grid "
                                      f"{[t, h, w]}; the tower takes [{h * w}, {c * tp * p * p}]")
            patches = px.view(h * w, c, tp, p, p)[:, :, 0]
        if not torch.isfinite(patches).all():
            raise ImageInputError(f"{what}: pixel values hold NaN or Inf")
        return patches.contiguous(), h, w


def image_processor(model_dir: Path, cfg: Qwen2VisionConfig, **defaults):
    """The checkpoint's Qwen2-VL preprocessing (PIL backend; no torchvision), or its defaults at the tower's
    patch sizes (and ``defaults``, e.g. another normalisation)."""
    from transformers import Qwen2VLImageProcessorPil

    if (Path(model_dir) / "preprocessor_config.json").is_file():
        proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    else:
        proc = Qwen2VLImageProcessorPil(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                                        merge_size=cfg.merge_size, **defaults)
    sizes = (proc.patch_size, proc.temporal_patch_size, proc.merge_size)
    if sizes != (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size):
        raise ModelLoadError(f"preprocessor patch/temporal/merge sizes {sizes} do not match the tower's "
                             f"{(cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)}")
    return proc


def _language_weights(model_dir: Path):
    """Decoder-checkpoint names: ``model.*`` (as transformers saves Qwen2-VL) or ``model.language_model.*``."""
    for name, t in iter_safetensors(model_dir):
        if name.startswith("model.language_model."):
            yield "model." + name.removeprefix("model.language_model."), t
        elif not name.startswith(("visual.", "model.visual.")):
            yield name, t


def load_vision_weights(tower: Qwen2VisionTower, model_dir: Path) -> None:
    params = dict(tower.named_parameters())
    filled = set()
    for name, t in iter_safetensors(model_dir):
        for prefix in ("visual.", "model.visual."):
            if name.startswith(prefix):
                target = name.removeprefix(prefix)
                if target not in params:
                    raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the Qwen2-VL vision tower")
                if tuple(params[target].shape) != tuple(t.shape):
                    raise ModelLoadError(f"{name}: shape {tuple(t.shape)} does not fit {tuple(params[target].shape)}")
                params[target].data.copy_(t)
                filled.add(target)
    missing = sorted(set(params) - filled)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}")


def build_qwen2_vl(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                   max_images: int, max_pixels: int) -> tuple[DecoderLM, int, Qwen2VLVision]:
    """Decoder (Qwen2 with M-RoPE), its max length, and the vision side of a Qwen2-VL checkpoint."""
    return build_with_tower(model_dir, hf_config, dtype, device, max_model_len, max_images, max_pixels,
                            vision_config(hf_config), Qwen2VisionTower)


def build_with_tower(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                     max_images: int, max_pixels: int, vcfg, tower_cls, video_time_step: float = 1.0,
                     vision_cls=None, decoder_overrides: dict | None = None, processor_defaults: dict | None = None
                     ) -> tuple[DecoderLM, int, Qwen2VLVision]:
    """A Qwen2-VL-family checkpoint with the vision tower ``tower_cls`` of config ``vcfg`` (``vision_cls``: the
    request side, Qwen2VLVision by default; ``decoder_overrides``: DecoderConfig fields the text config does not
    give)."""
    text = hf_config.text_config
    text.tie_word_embeddings = bool(hf_config.tie_word_embeddings)    # the family keeps it on the outer config
    model, max_len = build_decoder(model_dir, dtype, device, max_model_len, hf_config=text,
                                   weights=lambda: _language_weights(model_dir), overrides=decoder_overrides)
    for key in ("image_token_id", "video_token_id"):
        tid = getattr(hf_config, key)
        if not 0 <= tid < text.vocab_size:
            raise ModelLoadError(f"{key} {tid} is outside the vocabulary [0, {text.vocab_size})")
    with torch.device("meta"):
        tower = tower_cls(vcfg)
    tower = tower.to_empty(device=device)
    quarter = vcfg.embed_dim // vcfg.num_heads // 2
    tower.inv_freq = 1.0 / vcfg.rope_theta ** (torch.arange(0, quarter, 2, device=device).float() / quarter)
    load_vision_weights(tower, model_dir)
    tower = tower.to(dtype).eval().requires_grad_(False)
    tower.inv_freq = tower.inv_freq.float()
    vision = (vision_cls or Qwen2VLVision)(tower, hf_config.image_token_id, hf_config.video_token_id,
                                           (hf_config.vision_start_token_id, hf_config.vision_end_token_id),
                                           image_processor(model_dir, vcfg, **(processor_defaults or {})),
                                           max_images, max_pixels, video_time_step=video_time_step)
    return model, max_len, vision
