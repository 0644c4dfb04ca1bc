"""Qwen2.5-VL: parity with transformers (+ PEFT) on a tiny random Qwen2_5_VLForConditionalGeneration: the
window-attention ViT (windows smaller than the images, a full-attention block), its RMSNorm / gated MLP / merger,
M-RoPE with absolute time for videos; logits of a mixed image/video/text LoRA batch and greedy tokens with
chunked prefill."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY, perturb_norms_and_biases
from tests.models.test_qwen2_vl import CASES, IMG, M, P, TP, VE, VID, VS, hf_greedy, hf_inputs, ref_logits
from tests.models.test_vision import close, our_logits, with_adapters
from vlora import LLM, SamplingParams
from vlora.engine.sequence import Sequence


def make_tiny_qwen2_5_vl(root, seed=0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text = {**TINY, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    # windows of 2 x 2 merged groups (28 px): every test image spans several, some cut at its edge
    vision = dict(depth=3, hidden_size=32, out_hidden_size=TINY["hidden_size"], intermediate_size=48, num_heads=4,
                  patch_size=P, temporal_patch_size=TP, spatial_merge_size=M, window_size=2 * M * P,
                  fullatt_block_indexes=[1], tokens_per_second=3)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                           vision_start_token_id=VS, vision_end_token_id=VE)
    model = perturb_norms_and_biases(Qwen2_5_VLForConditionalGeneration(cfg).eval())
    path = root / "tiny-qwen2.5-vl"
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen25vl")
    path, hf = make_tiny_qwen2_5_vl(root)
    return (path, *with_adapters(root, hf))


def test_mrope_positions_follow_get_rope_index_with_video_time(tiny):
    path, _, pm = tiny
    eng = LLM(str(path), num_blocks=64, block_size=4).engine
    videos = 0
    for p, im, _ in CASES:
        if im is None:
            continue
        kw = hf_inputs(eng, p, im)
        videos += "video_grid_thw" in kw
        want, delta = pm.base_model.model.model.get_rope_index(
            kw["input_ids"], kw["mm_token_type_ids"], kw.get("image_grid_thw"), kw.get("video_grid_thw"))
        seq = Sequence("x", kw["input_ids"][0].tolist(), SamplingParams(), None, 0,
                       images=eng._images(list(p), im)[1])
        assert torch.equal(seq.mrope, want[:, 0]) and seq.rope_delta == int(delta)
    assert videos == 2


def test_mixed_image_video_text_lora_batch_logits_match_transformers_peft(tiny):
    path, paths, pm = tiny
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4)
    for (p, im, a), ours, ref in zip(CASES, our_logits(llm, CASES), ref_logits(pm, llm.engine, CASES)):
        close(ours, ref, f"prompt {p} adapter {a}")


def test_greedy_generation_with_chunks_inside_images_matches_transformers(tiny):
    path, paths, pm = tiny
    sp = SamplingParams(max_tokens=5, min_tokens=5, ignore_eos=True)
    prompts, images, names = zip(*CASES)
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    outs = llm.generate(list(prompts), list(names), sp, images=list(images))
    for (p, im, a), o in zip(CASES, outs):
        assert o.token_ids == hf_greedy(pm, llm.engine, p, im, a, 5), f"prompt {p} adapter {a}"
