"""Loading checkpoints: sharded safetensors, GGUF naming, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import make_tiny_model
from vlora import LLM, SamplingParams
from vlora.models.loader import ModelLoadError, gguf_model_name, resolve_model_dir


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    path, hf = make_tiny_model(tmp_path)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    a = LLM(str(path), num_blocks=16).generate([[1, 2, 3]], None, sp)[0].token_ids
    b = LLM(str(sharded), num_blocks=16).generate([[1, 2, 3]], None, sp)[0].token_ids
    assert a == b


def test_missing_tensor_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_tiny_model(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks 1 tensors"):
        LLM(str(path), num_blocks=16)


def test_unsupported_architecture_and_bad_paths(tmp_path):
    path, _ = make_tiny_model(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises((ModelLoadError, ValueError)):
        LLM(str(path), num_blocks=16)
    with pytest.raises(ModelLoadError, match="neither"):
        resolve_model_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_dir(tmp_path / "empty")


def test_gguf_model_name_drops_the_quantisation_tag():
    assert gguf_model_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert gguf_model_name(Path("llama-3-8b-instruct.Q8_0.gguf")) == "llama-3-8b-instruct"
    assert gguf_model_name(Path("qwen2-0.5b-f16.gguf")) == "qwen2-0.5b"
    assert gguf_model_name(Path("model.gguf")) == "model"
