"""Qwen3-VL: parity with transformers (+ PEFT) on a tiny random Qwen3VLForConditionalGeneration: the ViT with its
resampled learned position table and deepstack mergers (their rows added after the first decoder layers), the
Qwen3 decoder with interleaved M-RoPE; logits of a mixed image/text LoRA batch on the torch and the fused-kernel
paths, greedy tokens with chunked prefill inside images, videos refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY, perturb_norms_and_biases
from tests.models.test_qwen2_vl import (IMG, M, P, TP, VE, VID, VS, check_mrope_positions, hf_greedy, image,
                                       ref_logits, video)
from tests.models.test_vision import close, our_logits, with_adapters
from vlora import LLM, SamplingParams
from vlora.engine.engine import RequestError

# prompt, images, adapter: images of 2 x 4 to 8 x 4 patches, resampled from a 4 x 4 position table
CASES = [
    ([5, VS, IMG, VE, 33, 2, 99], [image(1, 28, 42)], None),
    ([1, 2, 3, 4], None, "a4"),
    ([9, VS, IMG, VE, 8, 7, VS, IMG, VE, 6, 5], [image(2, 14, 28), image(3, 42, 28)], "a8"),
    ([3, VS, IMG, VE, 7, 8], [image(5, 56, 28)], "a4"),
]


def make_tiny_qwen3_vl(root, seed=0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    # head_dim 32: 16 rotary frequencies, interleaved t h w t h w ... (h and w 5 each)
    text = {**TINY, "head_dim": 32, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                "mrope_interleaved": True}}
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=P, temporal_patch_size=TP,
                  spatial_merge_size=M, out_hidden_size=TINY["hidden_size"], num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                        vision_start_token_id=VS, vision_end_token_id=VE)
    model = perturb_norms_and_biases(Qwen3VLForConditionalGeneration(cfg).eval())
    with torch.no_grad():                           # a position table far from its init's near-zero values
        model.model.visual.pos_embed.weight.normal_(0.0, 1.0)
    path = root / "tiny-qwen3-vl"
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3vl")
    path, hf = make_tiny_qwen3_vl(root)
    return (path, *with_adapters(root, hf))


@pytest.mark.parametrize("kernels,cases", [("torch", CASES), ("triton", CASES[2:3])])   # triton: interpreted, slow
def test_mixed_image_text_lora_batch_logits_match_transformers_peft(tiny, kernels, cases):
    path, paths, pm = tiny
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4, kernels=kernels, lora_kernel=kernels)
    cfg = llm.engine.model.cfg
    assert cfg.mrope_interleaved and cfg.qk_norm and cfg.deepstack_layers == 2 and llm.engine.model.fusable
    for (p, im, a), ours, ref in zip(cases, our_logits(llm, cases), ref_logits(pm, llm.engine, cases)):
        close(ours, ref, f"prompt {p} adapter {a}")


def test_mrope_positions_follow_get_rope_index(tiny):
    check_mrope_positions(tiny, CASES)


def test_greedy_generation_with_chunks_inside_images_matches_transformers(tiny):
    path, paths, pm = tiny
    sp = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True)
    cases = [CASES[0], CASES[2]]
    prompts, images, names = zip(*cases)
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    outs = llm.generate(list(prompts), list(names), sp, images=list(images))
    for (p, im, a), o in zip(cases, outs):
        assert o.token_ids == hf_greedy(pm, llm.engine, p, im, a, 4), f"prompt {p} adapter {a}"


def test_a_video_is_refused_by_name(tiny):
    path, _, _ = tiny
    llm = LLM(str(path), num_blocks=32, block_size=4)
    with pytest.raises(RequestError, match="videos are not supported for Qwen3-VL"):
        llm.engine._images([VS, VID, VE, 4], [video(4, 2, 28, 28)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_cuda_engine_matches_transformers_peft(tiny, dtype, tol):
    """The GPU path (Triton attention, fused layers with the deepstack adds, ATMM) against the CPU reference."""
    path, paths, pm = tiny
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4, device="cuda", dtype=dtype)
    for (p, im, a), ours, ref in zip(CASES, our_logits(llm, CASES), ref_logits(pm, llm.engine, CASES)):
        ours = ours.float().cpu()
        assert (ours - ref).norm() / ref.norm() <= tol, f"prompt {p} adapter {a}"
    sp = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True)
    if dtype == "float32":
        outs = llm.generate([CASES[0][0], CASES[2][0]], [CASES[0][2], CASES[2][2]], sp,
                            images=[CASES[0][1], CASES[2][1]])
        for (p, im, a), o in zip([CASES[0], CASES[2]], outs):
            assert o.token_ids == hf_greedy(pm, llm.engine, p, im, a, 4), f"prompt {p} adapter {a}"
