"""LLaVA-style LMMs: load ``LlavaForConditionalGeneration`` checkpoints, turn a request's images into spans.

The decoder is vlora's own ``DecoderLM`` (loaded from the checkpoint's language
model); the vision tower + projector is ``vision.VisionTower``. A request's
images never enter the decoder as pixels: ``VisionModel.prepare`` decodes,
checks and preprocesses them (transformers' CLIP image processor), expands each
image placeholder of the prompt to the image's token count, and returns one
:class:`ImageSpan` per image (or video: its frames' tokens back to back). The
runner encodes the spans an iteration needs in one batched tower call and hands
the rows to the decoder through ``ForwardBatch.embed_rows`` / ``embed_values``.

Placeholders: put the image token (``config.image_token_id``) once per image or
video where it goes; a prompt already expanded (``tokens_per_image`` tokens per
frame, as transformers' LLaVA processor writes it) is accepted too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from vlora.models.decoder import DecoderLM
from vlora.models.loader import ModelLoadError, build_decoder, build_random_decoder, iter_safetensors
from vlora.models.registry import is_lmm_type
from vlora.models.vision import VisionConfig, VisionTower


class ImageInputError(ValueError):
    """A request's images cannot be used (corrupt, too many, too large, placeholders do not match)."""


@dataclass(frozen=True)
class ImageSpan:
    """One image (or video) of a request: where its tokens sit in the prompt and what they show."""

    offset: int                 # prompt position of its first token
    length: int                 # its token count (LLaVA: frames * tokens_per_image)
    pixels: torch.Tensor        # LLaVA: [frames, C, H, W]; Qwen2-VL: flattened patches [t*h*w, C*tp*p*p];
    #                             float32, preprocessed, on the host
    digest: str                 # content hash of ``pixels`` (keys its KV in the prefix cache)
    frames: int = 1             # images / video frames it holds (each counts toward max_images_per_request)
    grid: tuple[int, int, int] | None = None   # Qwen2-VL: (t, h, w) of its tokens (patch grid after merging);
    #                                            gives the tokens' M-RoPE positions
    time_step: float = 1.0      # M-RoPE: temporal positions per step of t (Qwen2.5-VL videos: absolute time)

    def keys(self, start: int, end: int) -> list[tuple[str, int]]:
        """Prefix-cache keys of prompt positions [start, end) inside this span."""
        return [(self.digest, p - self.offset) for p in range(start, end)]


def is_lmm_dir(model_dir: Path) -> bool:
    try:
        return is_lmm_type(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError):
        return False


def vision_config(hf_config) -> VisionConfig:
    vc = hf_config.vision_config
    if vc.model_type not in ("clip_vision_model", "clip"):
        raise ModelLoadError(f"vision tower {vc.model_type!r} is not supported (supported: CLIP ViT)")
    layer = hf_config.vision_feature_layer
    layers = tuple(layer) if isinstance(layer, (list, tuple)) else (layer,)
    strategy = hf_config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not supported")
    if any(not -(vc.num_hidden_layers + 1) <= i <= vc.num_hidden_layers for i in layers):
        raise ModelLoadError(f"vision_feature_layer {layer!r} is outside the tower's {vc.num_hidden_layers} layers")
    return VisionConfig(
        hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size, num_layers=vc.num_hidden_layers,
        num_heads=vc.num_attention_heads, image_size=vc.image_size, patch_size=vc.patch_size,
        num_channels=vc.num_channels, layer_norm_eps=vc.layer_norm_eps, hidden_act=vc.hidden_act,
        feature_layers=layers, select_strategy=strategy, projector_act=hf_config.projector_hidden_act,
        projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", True)),
        text_hidden_size=hf_config.text_config.hidden_size)


# checkpoint layouts: transformers < 4.52 (language_model.model.*, vision_tower.vision_model.*) and later
# (model.language_model.*, model.vision_tower.*); transformers 5 saves vision_tower.* without vision_model.
_LM_PREFIX = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")
_VISION = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)$")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.linear_([12])\.(weight|bias)$")
_VISION_NAMES = {"embeddings.class_embedding": "cls", "embeddings.patch_embedding.weight": "patch.weight",
                 "embeddings.position_embedding.weight": "pos"}
_VISION_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_VISION_MODULES = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
                   "self_attn.v_proj": "v", "self_attn.out_proj": "out", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


def _language_weights(model_dir: Path):
    for name, t in iter_safetensors(model_dir):
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            yield "lm_head.weight", t
        elif _LM_PREFIX.match(name):
            yield _LM_PREFIX.sub("model.", name), t


def _vision_target(name: str) -> str | None:
    m = _PROJECTOR.match(name)
    if m:
        return f"proj{m[1]}.{m[2]}"
    m = _VISION.match(name)
    if not m:
        return None
    rest = m[1]
    if rest in _VISION_NAMES:
        return _VISION_NAMES[rest]
    if rest.startswith("pre_layrnorm."):
        return "pre_norm." + rest.rsplit(".", 1)[1]
    lm = _VISION_LAYER.match(rest)
    if lm:
        module, _, kind = lm[2].rpartition(".")
        if module in _VISION_MODULES:
            return f"layers.{lm[1]}.{_VISION_MODULES[module]}.{kind}"
    return None                                 # post_layernorm, layers past the deepest selected one


def load_vision_weights(tower: VisionTower, model_dir: Path) -> None:
    params = dict(tower.named_parameters())
    filled = set()
    for name, t in iter_safetensors(model_dir):
        target = _vision_target(name)
        if target is None or target not in params:
            continue
        dst = params[target].data
        if tuple(dst.shape) != tuple(t.shape):
            raise ModelLoadError(f"{name}: shape {tuple(t.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(t)
        filled.add(target)
    missing = sorted(set(params) - filled)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}")


class VisionModel:
    """What the engine needs of an LMM's vision side: request images -> spans, spans -> token embeddings."""

    def __init__(self, tower: VisionTower, image_token_id: int, processor, max_images: int, max_pixels: int):
        self.tower = tower
        self.cfg = tower.cfg
        self.image_token_id = image_token_id
        self.processor = processor
        self.max_images = max_images
        self.max_pixels = max_pixels

    @property
    def tokens_per_image(self) -> int:
        return self.cfg.tokens_per_image

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """Token ids that mark where an image (or video) goes in a prompt."""
        return (self.image_token_id,)

    @property
    def image_prompt_ids(self) -> tuple[int, ...]:
        """What a chat message's image part becomes in the prompt text (before expansion)."""
        return (self.image_token_id,)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, H, W] -> image token embeddings [N, tokens_per_image, D_text]."""
        p = self.tower.patch.weight
        return self.tower(pixels.to(device=p.device, dtype=p.dtype))

    def encode_spans(self, spans: list[ImageSpan]) -> list[torch.Tensor]:
        """One tower call over all frames of ``spans``; returns each span's rows [length, D_text]."""
        out = self.encode(torch.cat([s.pixels for s in spans]))
        return [e.reshape(-1, e.shape[-1]) for e in out.split([s.pixels.shape[0] for s in spans])]

    def prepare(self, ids: list[int], images) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """(prompt ids with every placeholder expanded, one span per image or video). ``images``: a list whose
        items are an image (PIL image, encoded bytes, a file path, or a preprocessed [C, H, W] tensor) or a
        video (a list of such frames)."""
        items = self._items(images)
        pixels = []
        for i, it in enumerate(items):
            pixels.append(torch.stack([self._pixels(f, f"image {i}" + (f" frame {j}" if len(it) > 1 else ""))
                                       for j, f in enumerate(it)]))
        lengths = [p.shape[0] * self.tokens_per_image for p in pixels]
        ids, offsets = self._expand(ids, lengths, [self.image_token_id] * len(lengths))
        return ids, tuple(ImageSpan(o, n, p, _digest(p), frames=p.shape[0])
                          for o, n, p in zip(offsets, lengths, pixels))

    def _items(self, images) -> list[list]:
        """Each entry of ``images`` as its list of frames (an image: one), after the count checks."""
        if not isinstance(images, (list, tuple)):
            raise ImageInputError("images must be a list (one entry per image; a list of frames for a video)")
        items = [list(it) if isinstance(it, (list, tuple)) else [it] for it in images]
        frames = sum(len(it) for it in items)
        if frames > self.max_images:
            raise ImageInputError(f"request has {frames} images (video frames count one each); the limit is "
                                  f"{self.max_images}")
        if any(not it for it in items):
            raise ImageInputError("a video has no frames")
        return items

    def _expand(self, ids: list[int], lengths: list[int], marks: list[int]) -> tuple[list[int], list[int]]:
        """Expand placeholder ``marks[i]`` of image i to ``lengths[i]`` tokens (or accept a prompt already
        expanded); returns (ids, offset of each image)."""
        kinds = set(self.placeholder_ids)
        where = [i for i, t in enumerate(ids) if t in kinds]
        if len(where) == len(lengths) and all(ids[w] == m for w, m in zip(where, marks)):
            out, offsets, last = [], [], 0          # one placeholder per image: expand it
            for w, n, m in zip(where, lengths, marks):
                out.extend(ids[last:w])
                offsets.append(len(out))
                out.extend([m] * n)
                last = w + 1
            return out + ids[last:], offsets
        if len(where) == sum(lengths):             # already expanded: each image's tokens must be contiguous
            offsets, k = [], 0
            for n, m in zip(lengths, marks):
                offsets.append(where[k])
                if where[k + n - 1] != where[k] + n - 1 or any(ids[j] != m for j in where[k:k + n]):
                    break
                k += n
            else:
                return list(ids), offsets
        names = " or ".join(f"id {t}" for t in self.placeholder_ids)
        raise ImageInputError(f"prompt has {len(where)} image placeholder tokens ({names}) for {len(lengths)} "
                              f"images: put one placeholder where each image (or video) goes"
                              + ("" if len(kinds) == 1 else f"; the placeholder kinds must match the inputs in "
                                 f"order (expected {marks})"))

    def _pixels(self, img, what: str) -> torch.Tensor:
        c, s = self.cfg.num_channels, self.cfg.image_size
        if isinstance(img, torch.Tensor):
            if tuple(img.shape) != (c, s, s) or not img.is_floating_point():
                raise ImageInputError(f"{what}: a preprocessed image must be a float tensor of shape {[c, s, s]}, "
                                      f"got {img.dtype} {list(img.shape)}")
            px = img.detach().to("cpu", torch.float32)
        else:
            pil = self._decode(img, what)
            try:
                px = torch.as_tensor(self.processor(images=[pil], return_tensors="pt")["pixel_values"][0])
            except Exception as e:
                raise ImageInputError(f"{what}: preprocessing failed ({type(e).__name__}: {e})") from None
            if tuple(px.shape) != (c, s, s):
                raise ImageInputError(f"{what}: the image processor gives {list(px.shape)}, the tower takes "
                                      f"{[c, s, s]}")
        if not torch.isfinite(px).all():
            raise ImageInputError(f"{what}: pixel values hold NaN or Inf")
        return px.contiguous()

    def _decode(self, img, what: str):
        from PIL import Image

        if isinstance(img, Image.Image):
            w, h = img.size
            if w * h > self.max_pixels:
                raise ImageInputError(f"{what}: {w}x{h} = {w * h} pixels; the limit is {self.max_pixels}")
            return img.convert("RGB")
        if isinstance(img, (bytes, bytearray)):
            src = io.BytesIO(img)
        elif isinstance(img, (str, os.PathLike)):
            src = str(img)
        else:
            raise ImageInputError(f"{what}: expected a PIL image, encoded bytes, a path or a [C, H, W] tensor, "
                                  f"got {type(img).__name__}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                im = Image.open(src)
                w, h = im.size
                if w * h > self.max_pixels:
                    raise ImageInputError(f"{what}: {w}x{h} = {w * h} pixels; the limit is {self.max_pixels}")
                im.load()
        except ImageInputError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageInputError(f"{what}: too many pixels (limit {self.max_pixels})") from None
        except Exception as e:      # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
            raise ImageInputError(f"{what}: cannot be decoded ({type(e).__name__}: {e})") from None
        return im.convert("RGB")


def _digest(pixels: torch.Tensor, *extra) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(str((tuple(pixels.shape), *extra)).encode())
    h.update(pixels.numpy().tobytes())
    return h.hexdigest()


def image_processor(model_dir: Path, cfg: VisionConfig):
    """The checkpoint's CLIP preprocessing (PIL backend; no torchvision), or CLIP's defaults at the tower's size."""
    from transformers import CLIPImageProcessorPil

    if (Path(model_dir) / "preprocessor_config.json").is_file():
        return CLIPImageProcessorPil.from_pretrained(model_dir)
    s = cfg.image_size
    return CLIPImageProcessorPil(size={"shortest_edge": s}, crop_size={"height": s, "width": s})


def build_llava(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                max_images: int, max_pixels: int) -> tuple[DecoderLM, int, VisionModel]:
    """Decoder (the checkpoint's language model), its max length, and the vision side of a LLaVA checkpoint."""
    text = hf_config.text_config
    model, max_len = build_decoder(model_dir, dtype, device, max_model_len, hf_config=text,
                                   weights=lambda: _language_weights(model_dir))
    vcfg = vision_config(hf_config)
    tid = hf_config.image_token_id
    if not 0 <= tid < text.vocab_size:
        raise ModelLoadError(f"image_token_id {tid} is outside the vocabulary [0, {text.vocab_size})")
    with torch.device("meta"):
        tower = VisionTower(vcfg)
    tower = tower.to_empty(device=device)
    load_vision_weights(tower, model_dir)
    tower = tower.to(dtype).eval().requires_grad_(False)
    return model, max_len, VisionModel(tower, tid, image_processor(model_dir, vcfg), max_images, max_pixels)


# model="random:<name>" LMMs (benchmarks): a random decoder preset + a CLIP tower of these shapes, seeded random
RANDOM_LMMS = {
    "llava-1.5-7b": ("llama-2-7b", dict(hidden_size=1024, intermediate_size=4096, num_layers=24, num_heads=16,
                                        image_size=336, patch_size=14)),          # CLIP ViT-L/14-336: 576 tokens
    "tiny-llava": ("tiny-llama", dict(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                                      image_size=28, patch_size=7)),
}


def is_random_lmm(spec) -> bool:
    return isinstance(spec, str) and spec.removeprefix("random:") in RANDOM_LMMS


def build_random_lmm(spec: str, dtype: torch.dtype, device: torch.device, max_model_len: int | None, max_images: int,
                     max_pixels: int, seed: int = 0) -> tuple[DecoderLM, int, VisionModel]:
    """LLaVA-1.5 shapes with seeded random weights, made on ``device`` (no files): the decoder preset, a CLIP
    tower (feature layer -2, CLS dropped, GELU projector); the image placeholder is the last vocabulary id."""
    from transformers import CLIPImageProcessorPil

    decoder, shape = RANDOM_LMMS[spec.removeprefix("random:")]
    model, max_len = build_random_decoder(f"random:{decoder}", dtype, device, max_model_len, seed)
    vcfg = VisionConfig(**shape, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu", feature_layers=(-2,),
                        select_strategy="default", projector_act="gelu", projector_bias=True,
                        text_hidden_size=model.cfg.hidden_size)
    with torch.device("meta"):
        tower = VisionTower(vcfg)
    tower = tower.to_empty(device=device).to(dtype)
    gen = torch.Generator(device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif p.dim() == 1 and name != "cls":
                p.zero_()
            else:                                  # std 1/sqrt(fan_in): activations keep their scale
                fan_in = p[0].numel() if p.dim() > 1 else p.shape[-1]
                p.normal_(0.0, fan_in ** -0.5, generator=gen)
    tower = tower.eval().requires_grad_(False)
    s = vcfg.image_size
    processor = CLIPImageProcessorPil(size={"shortest_edge": s}, crop_size={"height": s, "width": s})
    return model, max_len, VisionModel(tower, model.cfg.vocab_size - 1, processor, max_images, max_pixels)
