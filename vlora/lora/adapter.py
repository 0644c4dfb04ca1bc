"""Load and validate a PEFT LoRA adapter directory.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
as written by ``peft``'s ``save_pretrained``. :func:`load_adapter` reads both (it
never writes or downloads anything), checks that the adapter is plain LoRA on the
linear projections of the decoder layers (``LORA_TARGETS``) and fits the served
base model (:class:`ModelShape`), and returns a :class:`LoRAAdapter` whose weights
are laid out for ``delta = scaling * (x @ A) @ B``. Anything else is refused with
an :class:`AdapterError` whose message names the file or field and the reason.
Pickle weights (``adapter_model.bin``) are never loaded: unpickling runs code.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_PARENT = {m: ("self_attn" if m in LORA_TARGETS[:4] else "mlp") for m in LORA_TARGETS}
# [base_model.model.]model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter_name}].weight; on a LLaVA
# LMM the layers sit under model.language_model. (or language_model.model. in older transformers)
_KEY_RE = re.compile(r"(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|model\.)layers\."
                     r"(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight")
_LORA_KEY_RE = re.compile(r"(?:.*\.)?(\w+)\.lora_[AB](?:\.[^.]+)?\.weight")
_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# Fused projections (Phi-3): a LoRA on qkv_proj / gate_up_proj is the same LoRA on each of its parts, A shared and
# B's rows split by the parts' widths; it is served as that LoRA on the parts.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_KEY_RE = re.compile(r"(?P<pre>.*\.)(?P<module>qkv_proj|gate_up_proj)\.lora_(?P<ab>[AB])"
                           r"(?P<post>(?:\.[^.]+)?\.weight)")


class AdapterError(ValueError):
    """An adapter was refused; the message says which file/field and why."""


@dataclass(frozen=True)
class ModelShape:
    """What an adapter must fit: the served base model's LoRA-relevant shape."""

    name: str  # base model name, e.g. "SmolLM2-135M-Instruct" or a dir basename
    num_layers: int
    in_features: dict[str, int]  # per module in LORA_TARGETS
    out_features: dict[str, int]  # per module in LORA_TARGETS


@dataclass
class LoRAAdapter:
    """A validated LoRA adapter; ``weights[layer][module] = (A [in, r], B [r, out])``."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float  # alpha / rank, or alpha / sqrt(rank) when use_rslora
    target_modules: tuple[str, ...]  # subset of LORA_TARGETS, in LORA_TARGETS order
    base_model: str | None  # adapter_config's base_model_name_or_path
    # A layer the adapter does not touch (layers_to_transform) has no entry for that module.
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    def num_bytes(self) -> int:
        """Bytes held by all A and B tensors."""
        return sum(t.numel() * t.element_size() for layer in self.weights for ab in layer.values() for t in ab)


def _basename(name: str) -> str:
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / _CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path / _CONFIG}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / _CONFIG}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{_CONFIG}: peft_type is {config['peft_type']!r}; only LORA adapters are supported")
    unsupported = [
        ("use_dora", bool(config.get("use_dora")), "DoRA adapters are not supported"),
        ("modules_to_save", bool(config.get("modules_to_save")), "fully trained extra modules are not supported"),
        ("bias", config.get("bias", "none") not in ("none", None), "LoRA biases are not supported"),
        ("rank_pattern", bool(config.get("rank_pattern")), "per-module ranks are not supported"),
        ("alpha_pattern", bool(config.get("alpha_pattern")), "per-module alphas are not supported"),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out")), "Conv1D-style (fan_in_fan_out) weights are not supported"),
        ("target_parameters", bool(config.get("target_parameters")),
         "LoRA on parameters (such as a mixture of experts' expert weights) is not supported"),
    ]
    for field, bad, why in unsupported:
        if bad:
            raise AdapterError(f"{_CONFIG}: {field}={config[field]!r}: {why}")
    return config


def _config_targets(config: dict) -> set[str] | None:
    """Module names the config lists explicitly, or None for a regex / "all-linear" / absent."""
    targets = config.get("target_modules")
    if targets is None or isinstance(targets, str):
        if isinstance(targets, str) and targets != "all-linear":
            try:
                re.compile(targets)
            except re.error as e:
                raise AdapterError(f"{_CONFIG}: target_modules regex {targets!r} is invalid ({e})") from None
        return None
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{_CONFIG}: target_modules must be a string or a list of strings, got {targets!r}")
    names = {part for t in targets for part in FUSED.get(t.rsplit(".", 1)[-1], (t.rsplit(".", 1)[-1],))}
    bad = sorted(names - set(LORA_TARGETS))
    if bad:
        raise AdapterError(f"{_CONFIG}: target_modules {bad} not supported; LoRA is served only on {list(LORA_TARGETS)}")
    return names


def _parse_key(key: str, num_layers: int) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") for a PEFT weight key, or AdapterError."""
    m = _KEY_RE.fullmatch(key)
    if m is None or m[3] not in LORA_TARGETS or _PARENT[m[3]] != m[2]:
        if ".mlp.experts." in key or ".mlp.gate.lora_" in key:
            raise AdapterError(f"{_WEIGHTS}: tensor {key!r} adapts a mixture of experts (its experts or router); "
                               f"on such a model LoRA is served on attention only ({list(LORA_TARGETS[:4])})")
        if "vision_tower." in key or "multi_modal_projector." in key:
            raise AdapterError(f"{_WEIGHTS}: tensor {key!r} adapts the vision tower or projector; LoRA is served "
                               f"only on the language model (target e.g. r'.*language_model.*\\.(q_proj|v_proj)')")
        lora = _LORA_KEY_RE.fullmatch(key)
        if lora is not None and lora[1] not in LORA_TARGETS:
            raise AdapterError(f"{_WEIGHTS}: tensor {key!r} targets module {lora[1]!r}; "
                               f"LoRA is served only on {list(LORA_TARGETS)}")
        raise AdapterError(f"{_WEIGHTS}: unknown tensor {key!r}; only lora_A/lora_B weights of "
                           f"model.layers.N.{{self_attn,mlp}}.<module> are supported "
                           f"(no DoRA magnitudes, embedding LoRA or biases)")
    layer = int(m[1])
    if layer >= num_layers:
        raise AdapterError(f"{_WEIGHTS}: tensor {key!r} is for layer {layer}, "
                           f"but the base model has {num_layers} layers")
    return layer, m[3], m[4]


def _split_fused(tensors: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """``tensors`` with each fused projection's A and B rewritten as its parts' (see ``FUSED``)."""
    out = {}
    for key, t in tensors.items():
        m = _FUSED_KEY_RE.fullmatch(key)
        if m is None:
            out[key] = t
            continue
        parts = FUSED[m["module"]]
        if m["ab"] == "A":
            pieces = [t] * len(parts)
        else:
            widths = [shape.out_features[p] for p in parts]
            if t.dim() != 2 or t.shape[0] != sum(widths):
                raise AdapterError(f"{_WEIGHTS}: {key!r} has shape {list(t.shape)}, expected [{sum(widths)}, r] "
                                   f"({' + '.join(map(str, widths))} rows of {', '.join(parts)}; base model "
                                   f"{shape.name!r})")
            pieces = t.split(widths)
        for part, piece in zip(parts, pieces):
            name = f"{m['pre']}{part}.lora_{m['ab']}{m['post']}"
            if name in tensors:
                raise AdapterError(f"{_WEIGHTS}: {key!r} and {name!r} both adapt {part}")
            out[name] = piece
    return out


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t`` (non-empty): one min/max pass, which propagates NaN. It reads ``t`` once, where
    ``isfinite(t).all()`` also writes a boolean tensor the size of ``t`` and reads that again (docs/decisions.md,
    'Finite check by min/max')."""
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


@dataclass
class StoredAdapter:
    """An adapter directory read and checked, its matrices as the file stores them: per layer, module ->
    ((key, A [r, in]), (key, B [out, r])) in the file's dtype. :func:`load_adapter` converts them; the loader
    (vlora/lora/loader.py) writes them straight into the pool's layout."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    base_model: str | None
    stored: list[dict[str, tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]]]


def refuse_nonfinite(key: str, stored: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise the AdapterError for tensor ``key`` whose conversion to ``dtype`` is not finite: NaN/Inf in the file,
    or values past ``dtype``'s range."""
    if not all_finite(stored):
        raise AdapterError(f"{_WEIGHTS}: {key!r} contains NaN or Inf")
    raise AdapterError(f"{_WEIGHTS}: {key!r} overflows when converted to {dtype}")


def load_adapter(path: str | os.PathLike, name: str, shape: ModelShape, *, max_rank: int,
                 dtype: torch.dtype = torch.float32, check_base_model: bool = True) -> LoRAAdapter:
    """Read, validate and return the PEFT LoRA adapter in directory ``path``.

    Raises AdapterError if the adapter is malformed, uses an unsupported PEFT feature,
    does not fit ``shape``, has rank above ``max_rank``, holds NaN/Inf, or (when
    ``check_base_model``) was trained for another base model.
    """
    s = read_stored(path, name, shape, max_rank=max_rank, check_base_model=check_base_model)
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for per_module in s.stored:
        layer = {}
        for module, pair in per_module.items():
            out = []
            for key, t in pair:
                converted = t.t().to(dtype).contiguous()
                if not all_finite(converted):              # one check on the common path; which fault, on failure
                    refuse_nonfinite(key, t, dtype)
                out.append(converted)
            layer[module] = (out[0], out[1])
        weights.append(layer)
    return LoRAAdapter(name=s.name, path=s.path, rank=s.rank, alpha=s.alpha, scaling=s.scaling,
                       target_modules=s.target_modules, base_model=s.base_model, weights=weights)


def read_stored(path: str | os.PathLike, name: str, shape: ModelShape, *, max_rank: int,
                check_base_model: bool = True) -> StoredAdapter:
    """Read and check the PEFT LoRA adapter in directory ``path`` (everything :func:`load_adapter` checks but
    the values' finiteness in the served dtype), its matrices left as stored."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a directory")
    if not (path / _CONFIG).is_file():
        raise AdapterError(f"adapter {name!r}: {path} has no {_CONFIG}")
    if not (path / _WEIGHTS).is_file():
        if (path / "adapter_model.bin").exists():
            raise AdapterError(f"adapter {name!r}: {path} has only pickle weights (adapter_model.bin), which are "
                               f"refused for safety; convert them to {_WEIGHTS}")
        raise AdapterError(f"adapter {name!r}: {path} has no {_WEIGHTS}")
    config = _read_config(path)

    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{_CONFIG}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{_CONFIG}: rank r={rank} exceeds max_rank={max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{_CONFIG}: lora_alpha must be a finite number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank

    base_model = config.get("base_model_name_or_path") or None
    if check_base_model and base_model is not None:
        if _basename(str(base_model)).casefold() != _basename(shape.name).casefold():
            raise AdapterError(f"adapter {name!r} was trained for base model {base_model!r}, but the served model is "
                               f"{shape.name!r}; pass check_base_model=False to load it anyway")
    listed = _config_targets(config)

    try:
        tensors = load_file(path / _WEIGHTS, device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{path / _WEIGHTS}: cannot be read as safetensors ({e})") from None
    if not tensors:
        raise AdapterError(f"{_WEIGHTS}: holds no tensors")
    tensors = _split_fused(tensors, shape)
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key in sorted(tensors):
        layer, module, ab = _parse_key(key, shape.num_layers)
        pair = found.setdefault((layer, module), {})
        if ab in pair:
            raise AdapterError(f"{_WEIGHTS}: tensors {pair[ab][0]!r} and {key!r} are both lora_{ab} "
                               f"of layer {layer} {module}")
        pair[ab] = (key, tensors[key])

    stored: list[dict] = [{} for _ in range(shape.num_layers)]
    for (layer, module), pair in sorted(found.items()):
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise AdapterError(f"{_WEIGHTS}: layer {layer} {module} has lora_{'AB'.replace(missing, '')} "
                               f"but no lora_{missing}")
        if module not in shape.in_features or module not in shape.out_features:
            raise AdapterError(f"adapter {name!r} targets {module}, which base model {shape.name!r} does not have")
        expected = {"A": (rank, shape.in_features[module]), "B": (shape.out_features[module], rank)}
        for ab in "AB":
            key, t = pair[ab]
            if tuple(t.shape) != expected[ab]:
                raise AdapterError(f"{_WEIGHTS}: {key!r} has shape {list(t.shape)}, expected {list(expected[ab])} "
                                   f"(rank r={rank}, base model {shape.name!r})")
            if not t.is_floating_point():
                raise AdapterError(f"{_WEIGHTS}: {key!r} has non-float dtype {t.dtype}")
        stored[layer][module] = (pair["A"], pair["B"])

    present = {module for _, module in found}
    if listed is not None and listed - present:
        raise AdapterError(f"{_CONFIG}: target_modules lists {sorted(listed - present)} "
                           f"but {_WEIGHTS} has no weights for them")
    return StoredAdapter(name=name, path=str(path), rank=rank, alpha=float(alpha), scaling=float(scaling),
                         target_modules=tuple(m for m in LORA_TARGETS if m in present),
                         base_model=base_model, stored=stored)
