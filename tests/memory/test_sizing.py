"""Sizing of the pool and the batch limits from the device's memory (arithmetic on made-up devices)."""

import pytest
from transformers import LlamaConfig

from vlora.config import ConfigError
from vlora.llm import LLM
from vlora.memory.sizing import CPU_POOL_CAP, GiB, adapter_pages, plan
from vlora.models.loader import RANDOM_PRESETS, decoder_config

LLAMA_7B = decoder_config(LlamaConfig(**RANDOM_PRESETS["llama-2-7b"]), "llama-7b")
SMOLLM2 = decoder_config(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                     max_position_embeddings=8192), "smollm2-135m")
WEIGHTS_7B = int(6.74e9) * 2             # bf16
CONTEXT = 600 << 20                      # CUDA context and kernels


def gpu(total_gb=80, **kw):
    args = dict(device_type="cuda", dtype_bytes=2, block_size=16, max_model_len=4096, adapters_in_pool=4,
                max_lora_rank=128, total_bytes=total_gb * 10**9, used_bytes=WEIGHTS_7B + CONTEXT)
    return plan(LLAMA_7B, **{**args, **kw})


def test_80gb_gpu_7b_serves_the_e2e_workload_with_32_adapters():
    s = gpu()
    assert s.max_num_batched_tokens == 16384 and s.max_num_seqs == 256
    assert s.source == "gpu_memory_utilization"
    # 32 adapters of rank 64 resident, and 64 sequences of 512 + 128 tokens beside them
    need = 32 * adapter_pages(LLAMA_7B, 64, 16) + 64 * (512 + 128) // 16
    assert s.num_pages >= need
    assert s.max_num_batched_tokens >= 512 and s.max_num_seqs >= 64
    # everything together stays within the share asked for
    assert WEIGHTS_7B + CONTEXT + s.pool_bytes + s.activation_bytes + s.reserve_bytes <= 0.9 * 80 * 10**9


def test_utilization_knob_moves_the_pool_by_the_share_it_frees():
    fixed = dict(max_num_batched_tokens=8192, max_num_seqs=128)      # the same activations in both
    lo, hi = gpu(gpu_memory_utilization=0.5, **fixed), gpu(gpu_memory_utilization=0.9, **fixed)
    assert (hi.pool_bytes - lo.pool_bytes) == pytest.approx(0.4 * 80e9, abs=2 * hi.page_bytes)


def test_smaller_gpu_gets_a_smaller_batch_budget():
    s = gpu(total_gb=24)
    assert s.max_num_batched_tokens < 16384
    assert s.max_num_seqs == s.max_num_batched_tokens // 64
    assert s.num_pages * s.page_bytes + s.activation_bytes + s.reserve_bytes + WEIGHTS_7B + CONTEXT <= 0.9 * 24e9


def test_explicit_settings_win():
    assert gpu(kv_cache_memory_gb=32).pool_bytes == pytest.approx(32 * GiB, abs=gpu().page_bytes)
    assert gpu(kv_cache_memory_gb=32).source == "kv_cache_memory_gb"
    s = gpu(max_num_seqs=64, max_num_batched_tokens=8192)
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (64, 8192)
    assert gpu(max_num_seqs=512).max_num_batched_tokens >= 512      # the budget never falls below the cap
    s = gpu(num_blocks=100)
    assert s.num_pages == 100 + 4 * adapter_pages(LLAMA_7B, 128, 16)


def test_gpu_too_small_is_refused_naming_the_knobs():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        gpu(total_gb=16)


def test_cpu_pool_from_limits_capped_but_one_full_sequence():
    s = plan(SMOLLM2, device_type="cpu", dtype_bytes=4, block_size=16, max_model_len=8192)
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (2048, 64)
    assert s.num_pages * 16 >= 8192                       # one full-length sequence fits
    assert s.pool_bytes <= max(CPU_POOL_CAP, (8192 // 16 + 1) * s.page_bytes)
    small = plan(SMOLLM2, device_type="cpu", dtype_bytes=4, block_size=16, max_model_len=256, max_num_seqs=4)
    assert small.num_pages == 4 * 256 // 16               # the limits, under the cap: exactly their room


def test_engine_uses_the_cpu_sizing_and_leaves_the_pool_untouched():
    llm = LLM("random:tiny-llama", device="cpu", max_model_len=128, max_num_seqs=4)
    e = llm.engine
    assert e.pool.num_pages == 4 * 128 // 16
    assert (e.config.scheduler.max_num_seqs, e.config.scheduler.max_num_batched_tokens) == (4, 2048)
    assert e.pool.buf.abs().max().item() == 0              # the pool reads as zeros before use
    out = llm.generate([[5, 6, 7]], None, __import__("vlora").SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_cli_options_of_the_sizing_knobs_are_typed_and_default_to_none():
    import argparse

    from vlora import cli

    parser = argparse.ArgumentParser()
    cli._add_config_args(parser)
    config = cli._engine_config(parser.parse_args(["--kv-cache-memory-gb", "0.5", "--max-num-seqs", "8",
                                                   "--gpu-memory-utilization", "0.8", "--no-lora-pdl"]))
    assert config.cache.kv_cache_memory_gb == 0.5 and config.scheduler.max_num_seqs == 8
    assert config.cache.gpu_memory_utilization == 0.8 and config.lora.lora_pdl is False
    defaults = cli._engine_config(parser.parse_args([]))
    assert defaults.cache.kv_cache_memory_gb is None and defaults.scheduler.max_num_batched_tokens is None
