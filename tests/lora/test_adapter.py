"""Tests for vlora.lora.adapter: loading, layout, and every refusal."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from vlora.lora.adapter import LORA_TARGETS, AdapterError, LoRAAdapter, ModelShape, load_adapter

# A 2-layer Llama-like model: hidden 32, 4 heads / 2 KV heads of dim 8 (KV out 16), intermediate 64.
IN = {"q_proj": 32, "k_proj": 32, "v_proj": 32, "o_proj": 32, "gate_proj": 32, "up_proj": 32, "down_proj": 64}
OUT = {"q_proj": 32, "k_proj": 16, "v_proj": 16, "o_proj": 32, "gate_proj": 64, "up_proj": 64, "down_proj": 32}
SHAPE = ModelShape(name="tiny-llama", num_layers=2, in_features=IN, out_features=OUT)
PREFIX = "base_model.model.model.layers"


def _key(layer: int, module: str, ab: str, prefix: str = PREFIX, adapter_name: str | None = None) -> str:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    middle = f"lora_{ab}.{adapter_name}" if adapter_name else f"lora_{ab}"
    return f"{prefix}.{layer}.{parent}.{module}.{middle}.weight"


def make_tensors(r: int = 4, modules=LORA_TARGETS, layers=(0, 1), dtype=torch.float32, **key_kw):
    """PEFT-layout tensors: lora_A [r, in], lora_B [out, r], seeded random values."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in layers:
        for m in modules:
            tensors[_key(layer, m, "A", **key_kw)] = torch.randn(r, IN[m], generator=g).to(dtype)
            tensors[_key(layer, m, "B", **key_kw)] = torch.randn(OUT[m], r, generator=g).to(dtype)
    return tensors


def write_adapter(path, tensors=None, **config) -> str:
    """Write adapter_config.json (PEFT-like defaults, overridable; None deletes a field) and the weights."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(LORA_TARGETS),
           "base_model_name_or_path": "/models/tiny-llama", "bias": "none", "use_dora": False,
           "use_rslora": False, "fan_in_fan_out": False, "modules_to_save": None,
           "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None or k in ("modules_to_save", "layers_to_transform")}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(make_tensors() if tensors is None else tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def load(path, **kw) -> LoRAAdapter:
    kw.setdefault("max_rank", 16)
    return load_adapter(path, "test", SHAPE, **kw)


def refused(path, match: str, **kw) -> None:
    with pytest.raises(AdapterError, match=match):
        load(path, **kw)


# ---------------------------------------------------------------- loading


def test_loads_handwritten_adapter(tmp_path):
    tensors = make_tensors()
    ad = load(write_adapter(tmp_path / "a", tensors))
    assert (ad.name, ad.rank, ad.alpha, ad.scaling) == ("test", 4, 8.0, 2.0)
    assert ad.target_modules == LORA_TARGETS and ad.base_model == "/models/tiny-llama"
    assert ad.path == str(tmp_path / "a") and len(ad.weights) == 2
    for layer in range(2):
        for m in LORA_TARGETS:
            a, b = ad.weights[layer][m]
            assert a.shape == (IN[m], 4) and b.shape == (4, OUT[m])
            assert a.is_contiguous() and b.is_contiguous() and a.dtype == torch.float32
            assert torch.equal(a, tensors[_key(layer, m, "A")].T)
            assert torch.equal(b, tensors[_key(layer, m, "B")].T)
    assert ad.num_bytes() == sum(t.numel() * 4 for t in tensors.values())


def test_rslora_scaling_and_default_alpha(tmp_path):
    assert load(write_adapter(tmp_path / "a", use_rslora=True)).scaling == pytest.approx(8 / math.sqrt(4))
    ad = load(write_adapter(tmp_path / "b", make_tensors(r=8), r=8, lora_alpha=None))
    assert ad.alpha == 8.0 and ad.scaling == 1.0  # PEFT's default lora_alpha is 8
    ad = load(write_adapter(tmp_path / "c", make_tensors(r=8), r=None, lora_alpha=None))
    assert ad.rank == 8  # PEFT's default r is 8


@pytest.mark.parametrize("key_kw", [dict(adapter_name="default"), dict(prefix="model.layers")])
def test_accepts_alternative_key_forms(tmp_path, key_kw):
    tensors = make_tensors(**key_kw)
    ad = load(write_adapter(tmp_path / "a", tensors))
    assert torch.equal(ad.weights[1]["down_proj"][0], tensors[_key(1, "down_proj", "A", **key_kw)].T)


@pytest.mark.parametrize("targets", [r".*\.(q_proj|v_proj)", "all-linear"])
def test_string_target_modules_derive_from_weights(tmp_path, targets):
    modules = ("v_proj", "q_proj") if targets != "all-linear" else LORA_TARGETS
    ad = load(write_adapter(tmp_path / "a", make_tensors(modules=modules), target_modules=targets))
    assert ad.target_modules == (("q_proj", "v_proj") if targets != "all-linear" else LORA_TARGETS)


def test_layers_to_transform_leaves_missing_layers_empty(tmp_path):
    path = write_adapter(tmp_path / "a", make_tensors(modules=("q_proj", "v_proj"), layers=(1,)),
                         target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    ad = load(path)
    assert ad.weights[0] == {} and set(ad.weights[1]) == {"q_proj", "v_proj"}
    assert ad.target_modules == ("q_proj", "v_proj")
    assert ad.num_bytes() == 4 * 4 * (32 + 32 + 32 + 16)


def test_float16_weights_load_and_convert(tmp_path):
    tensors = make_tensors(dtype=torch.float16)
    path = write_adapter(tmp_path / "a", tensors)
    a, b = load(path).weights[0]["k_proj"]
    assert a.dtype == torch.float32 and torch.equal(a, tensors[_key(0, "k_proj", "A")].float().T)
    a, b = load(path, dtype=torch.float16).weights[0]["k_proj"]
    assert a.dtype == b.dtype == torch.float16 and torch.equal(b, tensors[_key(0, "k_proj", "B")].T)


def test_dtype_conversion(tmp_path):
    tensors = make_tensors()
    ad = load(write_adapter(tmp_path / "a", tensors), dtype=torch.bfloat16)
    a, b = ad.weights[1]["up_proj"]
    assert a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() and b.is_contiguous()
    assert torch.equal(a, tensors[_key(1, "up_proj", "A")].T.to(torch.bfloat16))
    assert ad.num_bytes() == sum(t.numel() * 2 for t in tensors.values())


def test_loading_has_no_side_effect(tmp_path):
    path = write_adapter(tmp_path / "a")
    before = {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)}
    load(path)
    assert {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)} == before


@pytest.mark.parametrize("use_rslora", [False, True])
def test_matches_real_peft_adapter(tmp_path, use_rslora):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny-llama")
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                                      init_lora_weights=False, use_rslora=use_rslora))
    model.save_pretrained(tmp_path / "adapter")

    ad = load_adapter(tmp_path / "adapter", "peft", SHAPE, max_rank=8)
    assert ad.rank == 4 and ad.target_modules == LORA_TARGETS
    assert ad.base_model is not None and ad.base_model.rstrip("/").endswith("tiny-llama")
    checked = 0
    for layer_idx, layer in enumerate(model.base_model.model.model.layers):
        for m in LORA_TARGETS:
            lora = getattr(layer.self_attn if m in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, m)
            a, b = ad.weights[layer_idx][m]
            assert torch.equal(a, lora.lora_A["default"].weight.detach().T)
            assert torch.equal(b, lora.lora_B["default"].weight.detach().T)
            assert ad.scaling == pytest.approx(lora.scaling["default"])
            checked += 1
    assert checked == 14


# ---------------------------------------------------------------- refusals: files


def test_refuses_path_that_is_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file", "is not a directory")
    refused(tmp_path / "nope", "is not a directory")


def test_refuses_missing_config(tmp_path):
    path = write_adapter(tmp_path / "a")
    os.remove(os.path.join(path, "adapter_config.json"))
    refused(path, "no adapter_config.json")


def test_refuses_missing_safetensors(tmp_path):
    path = write_adapter(tmp_path / "a")
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    refused(path, "no adapter_model.safetensors")


def test_refuses_pickle_only_weights(tmp_path):
    path = write_adapter(tmp_path / "a")
    os.rename(os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin"))
    refused(path, r"pickle weights.*refused for safety.*convert them to adapter_model\.safetensors")


def test_refuses_corrupt_or_empty_safetensors(tmp_path):
    path = write_adapter(tmp_path / "a")
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x00garbage")
    refused(path, "cannot be read as safetensors")
    refused(write_adapter(tmp_path / "b", {}), "holds no tensors")


# ---------------------------------------------------------------- refusals: config


def test_refuses_malformed_json(tmp_path):
    path = write_adapter(tmp_path / "a")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    refused(path, "not valid JSON")


def test_refuses_non_lora_peft_type(tmp_path):
    refused(write_adapter(tmp_path / "a", peft_type="IA3"), "peft_type is 'IA3'; only LORA")


@pytest.mark.parametrize("field,value,match", [
    ("use_dora", True, "DoRA"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("bias", "lora_only", "biases are not supported"),
    ("rank_pattern", {"q_proj": 8}, "per-module ranks"),
    ("alpha_pattern", {"q_proj": 16}, "per-module alphas"),
    ("fan_in_fan_out", True, "fan_in_fan_out"),
])
def test_refuses_unsupported_features(tmp_path, field, value, match):
    refused(write_adapter(tmp_path / "a", **{field: value}), match)


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_refuses_config_target_outside_lora_targets(tmp_path, target):
    refused(write_adapter(tmp_path / "a", target_modules=["q_proj", target]), f"'{target}'.*not supported")


def test_refuses_config_target_without_weights(tmp_path):
    path = write_adapter(tmp_path / "a", make_tensors(modules=("q_proj",)), target_modules=["q_proj", "v_proj"])
    refused(path, r"lists \['v_proj'\] but adapter_model.safetensors has no weights")


# ---------------------------------------------------------------- refusals: weights


def test_refuses_weight_for_unsupported_module(tmp_path):
    tensors = make_tensors()
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 32)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(128, 4)
    refused(write_adapter(tmp_path / "a", tensors), "targets module 'lm_head'")


@pytest.mark.parametrize("key", [
    "base_model.model.model.embed_tokens.lora_embedding_A",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",
    "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",  # wrong parent
])
def test_refuses_unknown_keys(tmp_path, key):
    tensors = make_tensors()
    tensors[key] = torch.zeros(4, 32)
    refused(write_adapter(tmp_path / "a", tensors), "unknown tensor")


def test_refuses_missing_lora_b(tmp_path):
    tensors = make_tensors()
    del tensors[_key(1, "o_proj", "B")]
    refused(write_adapter(tmp_path / "a", tensors), "layer 1 o_proj has lora_A but no lora_B")


def test_refuses_duplicate_tensor(tmp_path):
    tensors = make_tensors()
    tensors[_key(0, "q_proj", "A", adapter_name="other")] = torch.zeros(4, 32)
    refused(write_adapter(tmp_path / "a", tensors), "are both lora_A of layer 0 q_proj")


def test_refuses_layer_out_of_range(tmp_path):
    refused(write_adapter(tmp_path / "a", make_tensors(layers=(0, 1, 2))), "layer 2, but the base model has 2 layers")


@pytest.mark.parametrize("ab,bad_shape", [("A", (4, 48)), ("B", (24, 4))])
def test_refuses_shape_mismatch_with_base_model(tmp_path, ab, bad_shape):
    tensors = make_tensors()
    tensors[_key(0, "k_proj", ab)] = torch.zeros(bad_shape)
    refused(write_adapter(tmp_path / "a", tensors), rf"has shape \[{bad_shape[0]}, {bad_shape[1]}\], expected")


def test_refuses_rank_mismatch(tmp_path):
    refused(write_adapter(tmp_path / "a", make_tensors(r=4), r=8), r"shape \[4, 64\], expected \[8, 64\]")
    tensors = make_tensors(r=4)
    tensors.update(make_tensors(r=2, modules=("v_proj",)))  # one module of another rank
    refused(write_adapter(tmp_path / "b", tensors), r"shape \[2, 32\], expected \[4, 32\]")


def test_refuses_rank_above_max_rank(tmp_path):
    refused(write_adapter(tmp_path / "a", make_tensors(r=8), r=8), "r=8 exceeds max_rank=4", max_rank=4)


@pytest.mark.parametrize("r", [0, -1, 2.5, "4"])
def test_refuses_invalid_rank(tmp_path, r):
    refused(write_adapter(tmp_path / "a", r=r), "r must be an integer >= 1")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_refuses_non_finite_weights(tmp_path, bad):
    tensors = make_tensors(dtype=torch.float16)
    key = _key(1, "gate_proj", "B")
    tensors[key][3, 1] = bad
    refused(write_adapter(tmp_path / "a", tensors), f"'{key}' contains NaN or Inf")


def test_refuses_overflow_on_dtype_conversion(tmp_path):
    tensors = make_tensors()
    tensors[_key(0, "q_proj", "A")][0, 0] = 1e6
    refused(write_adapter(tmp_path / "a", tensors), "overflows when converted to torch.float16", dtype=torch.float16)


# ---------------------------------------------------------------- base-model check


def test_refuses_base_model_mismatch_unless_overridden(tmp_path):
    path = write_adapter(tmp_path / "a", base_model_name_or_path="meta-llama/Llama-3.1-8B")
    refused(path, r"'meta-llama/Llama-3.1-8B'.*'tiny-llama'.*check_base_model=False")
    assert load(path, check_base_model=False).base_model == "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize("base", ["org/Tiny-LLaMA/", "tiny-llama", "", None])
def test_base_model_match_is_basename_case_insensitive_and_optional(tmp_path, base):
    ad = load(write_adapter(tmp_path / "a", base_model_name_or_path=base))
    assert ad.base_model == (base or None)
