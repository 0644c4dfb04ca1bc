"""Qwen2-VL: parity with transformers (+ PEFT) on a tiny random Qwen2VLForConditionalGeneration (ViT with 2D RoPE
and patch merging, M-RoPE in the decoder), the fused-kernel and CUDA-graph paths, image KV reuse, refusals."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import TINY, perturb_norms_and_biases
from tests.models.test_vision import close, our_logits, with_adapters
from vlora import LLM, SamplingParams
from vlora.engine.engine import RequestError
from vlora.engine.sequence import Sequence

IMG, VID, VS, VE = 250, 251, 252, 253          # <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
P, M, TP = 7, 2, 2                              # patch, merge, temporal patch: images in multiples of 14 px


def make_tiny_qwen2_vl(root, name="tiny-qwen2-vl", seed=0, mrope_section=(2, 3, 3)):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    text = {**TINY, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(mrope_section)}}
    vision = dict(depth=2, embed_dim=32, hidden_size=TINY["hidden_size"], num_heads=4, patch_size=P,
                  temporal_patch_size=TP, spatial_merge_size=M, mlp_ratio=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                        vision_start_token_id=VS, vision_end_token_id=VE)
    model = perturb_norms_and_biases(Qwen2VLForConditionalGeneration(cfg).eval())
    path = root / name
    model.save_pretrained(path)
    return path, model


def image(seed, h, w):
    return torch.randn(3, h, w, generator=torch.Generator().manual_seed(seed))


def video(seed, n, h, w):
    return [image(seed * 100 + i, h, w) for i in range(n)]


# prompt, images (a video = a list of frames), adapter
CASES = [
    ([5, VS, IMG, VE, 33, 2, 99], [image(1, 28, 42)], None),                          # 2 x 3 tokens
    ([1, 2, 3, 4], None, "a4"),
    ([9, VS, IMG, VE, 8, 7, VS, IMG, VE, 6, 5], [image(2, 14, 28), image(3, 42, 28)], "a8"),
    ([VS, VID, VE, 44, 45], [video(4, 3, 28, 28)], None),                             # 3 frames -> t = 2
    ([3, VS, IMG, VE, VS, VID, VE, 7, 8], [image(5, 56, 28), video(6, 2, 14, 42)], "a4"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2vl")
    path, hf = make_tiny_qwen2_vl(root)
    return (path, *with_adapters(root, hf))


def hf_inputs(eng, prompt, images):
    """transformers' inputs for one request: expanded ids, mm_token_type_ids, patches and patch grids (the
    patches are vlora's; ``test_patches_match_the_processors`` checks them against transformers' processors)."""
    ids, spans = eng._images(list(prompt), images)
    kw = {"input_ids": torch.tensor([ids]),
          "mm_token_type_ids": torch.tensor([[1 if t == IMG else 2 if t == VID else 0 for t in ids]])}
    for kind, key in ((IMG, "pixel_values"), (VID, "pixel_values_videos")):
        mine = [s for s in spans if ids[s.offset] == kind]
        if mine:
            kw[key] = torch.cat([s.pixels for s in mine])
            kw[key.replace("pixel_values_videos", "video").replace("pixel_values", "image") + "_grid_thw"] = \
                torch.tensor([[t, h * M, w * M] for t, h, w in (s.grid for s in mine)])
    return kw


def ref_logits(pm, eng, cases):
    out = []
    for p, im, a in cases:
        with torch.no_grad():
            out.append(pm(**hf_inputs(eng, p, im), adapter_names=[a or "__base__"]).logits[0])
    return out


def hf_greedy(pm, eng, prompt, images, adapter, n):
    kw = hf_inputs(eng, prompt, images)
    kw["attention_mask"] = torch.ones_like(kw["input_ids"])
    with torch.no_grad():
        out = pm.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          adapter_names=[adapter or "__base__"])
    return out[0, kw["input_ids"].shape[1]:].tolist()


def check_mrope_positions(tiny, cases) -> None:
    """Each image/video prompt's M-RoPE positions and delta equal transformers' ``get_rope_index``, and the
    tokens after the prompt continue from the delta."""
    path, _, pm = tiny
    eng = LLM(str(path), num_blocks=64, block_size=4).engine
    for p, im, _ in cases:
        if im is None:
            continue
        kw = hf_inputs(eng, p, im)
        ids = kw["input_ids"][0].tolist()
        want, delta = pm.base_model.model.model.get_rope_index(
            kw["input_ids"], kw["mm_token_type_ids"], kw.get("image_grid_thw"), kw.get("video_grid_thw"))
        seq = Sequence("x", ids, SamplingParams(), None, 0, images=eng._images(list(p), im)[1])
        assert torch.equal(seq.mrope, want[:, 0]) and seq.rope_delta == int(delta)
        assert torch.equal(seq.rope_positions(len(ids) - 2, len(ids) + 2)[:, 2:],
                           (torch.arange(len(ids), len(ids) + 2) + int(delta)).expand(3, -1))


def test_mrope_positions_follow_get_rope_index(tiny):
    check_mrope_positions(tiny, CASES)


def test_mixed_image_video_text_lora_batch_logits_match_transformers_peft(tiny):
    path, paths, pm = tiny
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4)
    assert llm.engine.model.cfg.mrope_section == (2, 3, 3) and llm.engine.model.cfg.qkv_bias
    for (p, im, a), ours, ref in zip(CASES, our_logits(llm, CASES), ref_logits(pm, llm.engine, CASES)):
        close(ours, ref, f"prompt {p} adapter {a}")
    assert llm.engine.runner.num_images_encoded == 1 + 2 + 3 + 1 + 2     # frames through the tower, one call


def test_greedy_generation_with_chunks_inside_images_matches_transformers(tiny):
    path, paths, pm = tiny
    sp = SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True)
    prompts, images, names = zip(*CASES)
    # 5 tokens per iteration: prefills stop inside images; decodes of image requests run beside prefills
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    outs = llm.generate(list(prompts), list(names), sp, images=list(images))
    for (p, im, a), o in zip(CASES, outs):
        assert o.token_ids == hf_greedy(pm, llm.engine, p, im, a, 6), f"prompt {p} adapter {a}"
    assert llm.engine.allocator.num_free == 96


def test_fused_kernels_and_graph_decode_take_mrope(tiny):
    """Triton path (interpreter on CPU): [3, T] positions through the fused RoPE kernel (gathered rows);
    decode-only iterations replayed from graphs with flat positions + rope delta. Same tokens as the torch path."""
    path, paths, _ = tiny
    sp = SamplingParams(max_tokens=5, min_tokens=5, ignore_eos=True)
    prompts, images, names = zip(*CASES)
    want = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=96, block_size=4)
            .generate(list(prompts), list(names), sp, images=list(images))]
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4, max_num_seqs=8, kernels="triton",
              lora_kernel="triton", max_model_len=128)
    assert llm.engine.runner.use_kernels
    if llm.engine.runner.graphs is None:
        llm.engine.runner.enable_graphs(8, llm.engine.max_model_len)
    got = [o.token_ids for o in llm.generate(list(prompts), list(names), sp, images=list(images))]
    assert got == want
    assert llm.engine.runner.graphs.num_replays > 0


def test_rope_kernel_refuses_mrope_positions():
    from vlora.kernels.fused import rope_and_cache

    with pytest.raises(ValueError, match=re.escape("one position per token ([T]), got [3, 2]")):
        rope_and_cache(torch.zeros(2, 48), torch.zeros(8, 8), torch.zeros(8, 8), torch.zeros(3, 2, dtype=torch.long),
                       torch.zeros(2, dtype=torch.long), torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), 4, 2, 8)


def test_patches_match_the_processors(tiny):
    """A PIL image through transformers' Qwen2VLImageProcessorPil equals the same pixels given as a tensor
    (patchified here); a video's patches follow transformers' video patchify (its formula, which needs
    torchvision to import)."""
    import numpy as np
    from PIL import Image

    path, _, _ = tiny
    eng = LLM(str(path), num_blocks=16, block_size=4).engine
    arr = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)   # 56 x 56: no resize
    proc = eng.vision.processor
    x = (torch.tensor(arr).permute(2, 0, 1).float() / 255 - torch.tensor(proc.image_mean).view(3, 1, 1)) \
        / torch.tensor(proc.image_std).view(3, 1, 1)
    _, (a,) = eng._images([VS, IMG, VE], [Image.fromarray(arr)])
    _, (b,) = eng._images([VS, IMG, VE], [x])
    ref = proc(images=[Image.fromarray(arr)], return_tensors="pt")
    torch.testing.assert_close(a.pixels, torch.as_tensor(ref["pixel_values"]), rtol=0, atol=0)
    torch.testing.assert_close(b.pixels, a.pixels, rtol=0, atol=1e-5)
    assert a.grid == b.grid == (1, 4, 4) and a.length == 16

    frames = video(7, 3, 28, 42)
    _, (v,) = eng._images([VS, VID, VE], [frames])
    clip = torch.stack(frames + frames[-1:])                  # transformers pads with the last frame
    g, gh, gw = 2, 28 // P, 42 // P
    want = clip.view(g, TP, 3, gh // M, M, P, gw // M, M, P).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    torch.testing.assert_close(v.pixels, want.reshape(g * gh * gw, -1))
    assert v.grid == (2, 2, 3) and v.length == 12 and v.frames == 3


def test_image_kv_is_reused(tiny):
    path, paths, _ = tiny
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt, img = [3, 4, 5, VS, IMG, VE, 7, 8, 9], [image(21, 28, 56)]
    expected = LLM(str(path), num_blocks=64, block_size=4).generate(prompt, None, sp, images=img)[0].token_ids
    llm = LLM(str(path), num_blocks=64, block_size=4, prefix_caching=True)
    tree = llm.engine.prefix_cache
    assert llm.generate(prompt, None, sp, images=img)[0].token_ids == expected
    hits = tree.hit_tokens
    assert llm.generate(prompt, None, sp, images=img)[0].token_ids == expected
    assert tree.hit_tokens - hits == 12                 # 3 blocks: the text before, the image's 8 tokens
    assert llm.engine.runner.num_images_encoded == 1


def test_bad_qwen2_vl_input_is_refused(tiny):
    path, _, _ = tiny
    eng = LLM(str(path), num_blocks=32, block_size=4, max_images_per_request=3).engine
    bad = [
        ([1, VS, VID, VE], [image(1, 28, 28)], "placeholder kinds must match"),      # an image at a video's place
        ([1, VS, IMG, VE], [video(1, 2, 28, 28)], "placeholder kinds must match"),
        ([1, VS, IMG, VE], [torch.zeros(3, 28, 30)], "multiples of 14"),
        ([1, VS, VID, VE], [[image(1, 28, 28), image(2, 14, 28)]], "different sizes"),
        ([1, VS, VID, VE], [video(1, 4, 14, 14)], "limit is 3"),
        ([1, VS, VID, VE], None, "no images were given"),
        ([1, VS, IMG, VE], [torch.full((3, 14, 14), float("nan"))], "NaN"),
    ]
    for prompt, images, why in bad:
        with pytest.raises(RequestError, match=re.escape(why)):
            eng.add_request(prompt, images=images)
    assert not eng.has_unfinished()
