"""LLaVA-style LMMs: parity with transformers (+ PEFT) on a tiny random LlavaForConditionalGeneration,
task heads, image KV reuse, and the refusals of bad image input."""

from __future__ import annotations

import io
import re

import peft
import pytest
import torch

from tests.helpers import TINY, perturb_norms_and_biases, prefill_logits
from vlora import LLM, SamplingParams
from vlora.engine.engine import RequestError
from vlora.engine.sequence import Sequence

IMG = 255                                    # image placeholder token id
TPI = 16                                     # tokens per image: (28 / 7)^2 patches, CLS dropped
LM_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def make_tiny_llava(root, name="tiny-llava", seed=0, **overrides):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=28, patch_size=7, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2),
                      image_token_id=IMG, **{"vision_feature_layer": -2, **overrides})
    model = perturb_norms_and_biases(LlavaForConditionalGeneration(cfg).eval())
    path = root / name
    model.save_pretrained(path)
    return path, model


def make_lmm_adapter(model, path, rank, seed):
    torch.manual_seed(seed)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LM_TARGETS,
                                                    init_lora_weights=False))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    pm.save_pretrained(path)
    return pm.unload()


def pixels(seed, n=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 28, 28, generator=g) for _ in range(n)]


def expand(prompt, counts):
    """Placeholders of ``prompt`` expanded to TPI tokens per frame (what transformers' processor writes)."""
    out, it = [], iter(counts)
    for t in prompt:
        out.extend([IMG] * (TPI * next(it)) if t == IMG else [t])
    return out


# prompt, images (a video = a list of frames), adapter
CASES = [
    ([5, 17, IMG, 33, 2, 99], [pixels(1)[0]], None),
    ([1, 2, 3, 4], None, "a4"),
    ([9, IMG, 8, 7, IMG, 6, 5], pixels(2, 2), "a8"),
    ([IMG, 44, 45], [pixels(3, 3)], None),                   # one video of 3 frames
    ([250, 4, IMG, 9, 31], [pixels(4)[0]], "a4"),
]


def with_adapters(root, hf):
    """Adapters a4 (rank 4) and a8 (rank 8) on the language model of ``hf``, saved under ``root``; returns
    (their paths, the PEFT model holding both)."""
    paths = {"a4": root / "a4", "a8": root / "a8"}
    make_lmm_adapter(hf, paths["a4"], 4, seed=10)
    make_lmm_adapter(hf, paths["a8"], 8, seed=11)
    pm = peft.PeftModel.from_pretrained(hf, str(paths["a4"]), adapter_name="a4")
    pm.load_adapter(str(paths["a8"]), adapter_name="a8")
    return paths, pm.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    path, hf = make_tiny_llava(root)
    return (path, *with_adapters(root, hf))


def hf_inputs(prompt, images):
    frames = [f for it in images or () for f in (it if isinstance(it, list) else [it])]
    counts = [len(it) if isinstance(it, list) else 1 for it in images or ()]
    return expand(prompt, counts), frames


def ref_logits(pm, cases):
    """transformers + PEFT: every prompt position, one mixed batch, right padding."""
    rows = [hf_inputs(p, im) for p, im, _ in cases]
    n = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [0] * (n - len(r)) for r, _ in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r, _ in rows])
    px = torch.stack([f for _, fr in rows for f in fr])
    with torch.no_grad():
        out = pm(input_ids=ids, attention_mask=mask, pixel_values=px,
                 adapter_names=[a or "__base__" for _, _, a in cases], output_hidden_states=True)
    return [out.logits[i, :len(r)] for i, (r, _) in enumerate(rows)]


def our_logits(llm, cases):
    """vlora: every prompt position, all prompts prefilled in one iteration."""
    eng = llm.engine
    seqs = []
    for i, (p, im, a) in enumerate(cases):
        ids, spans = eng._images(list(p), im)
        seqs.append(Sequence(f"t{i}", ids, SamplingParams(), None if a is None else eng.adapters.get(a), i,
                             images=spans))
    return prefill_logits(eng, seqs)


def close(a, r, msg=""):
    torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(), msg=msg)


def test_mixed_image_text_lora_batch_logits_match_transformers_peft(tiny):
    path, paths, pm = tiny
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4)
    assert llm.engine.vision is not None and llm.engine.vision.tokens_per_image == TPI
    for (p, im, a), ours, ref in zip(CASES, our_logits(llm, CASES), ref_logits(pm, CASES)):
        close(ours, ref, f"prompt {p} adapter {a}")
    assert llm.engine.runner.num_images_encoded == 1 + 2 + 3 + 1      # one tower call per frame


@pytest.mark.parametrize("overrides", [{"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "full"},
                                       {"vision_feature_layer": -4}, {"vision_feature_layer": 1}])
def test_feature_layer_variants_match_transformers(tmp_path, overrides):
    path, hf = make_tiny_llava(tmp_path, seed=3, **overrides)
    global TPI
    tpi, TPI = TPI, 17 if overrides.get("vision_feature_select_strategy") == "full" else 16
    try:
        cases = [([5, IMG, 6, IMG], pixels(7, 2), None), ([3, 4], None, None)]
        llm = LLM(str(path), num_blocks=64, block_size=4)
        assert llm.engine.vision.tokens_per_image == TPI
        for ours, ref in zip(our_logits(llm, cases), ref_logits(hf, cases)):
            close(ours, ref)
    finally:
        TPI = tpi


def hf_greedy(pm, prompt, images, adapter, n):
    ids, frames = hf_inputs(prompt, images)
    kw = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
              max_new_tokens=n, min_new_tokens=n, do_sample=False, adapter_names=[adapter or "__base__"])
    if frames:
        kw["pixel_values"] = torch.stack(frames)
    with torch.no_grad():
        return pm.generate(**kw)[0, len(ids):].tolist()


def test_greedy_generation_with_chunked_prefill_inside_images_matches_transformers(tiny):
    path, paths, pm = tiny
    sp = SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True)
    prompts, images, names = zip(*CASES)
    # a budget of 7 tokens per iteration cuts prefills in the middle of images (16 tokens each)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4, max_num_batched_tokens=7, max_num_seqs=4)
    outs = llm.generate(list(prompts), list(names), sp, images=list(images))
    for (p, im, a), o in zip(CASES, outs):
        assert o.token_ids == hf_greedy(pm, p, im, a, 6), f"prompt {p} adapter {a}"
    assert llm.engine.allocator.num_free == 64
    assert all(not s.image_embeds for s in llm.engine._seqs.values())


def test_expanded_prompts_and_pil_images_are_accepted(tiny):
    from PIL import Image

    path, _, _ = tiny
    llm = LLM(str(path), num_blocks=64, block_size=4)
    im = Image.new("RGB", (40, 30), (200, 10, 90))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    px = llm.engine.vision.processor(images=[im], return_tensors="pt")["pixel_values"][0]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    a, b, c = llm.generate([[7, IMG, 8], [7, IMG, 8], expand([7, IMG, 8], [1])], sampling=sp,
                           images=[[im], [buf.getvalue()], [px]])
    assert a.token_ids == b.token_ids == c.token_ids
    assert len(a.prompt_token_ids) == 2 + TPI


def test_bad_image_input_is_refused_and_disturbs_nothing(tiny, tmp_path):
    from tests.helpers import make_tiny_model

    path, _, _ = tiny
    llm = LLM(str(path), num_blocks=64, block_size=4, max_images_per_request=3)
    eng = llm.engine
    rid = eng.add_request([5, IMG, 6], params=SamplingParams(max_tokens=3, ignore_eos=True), images=pixels(9))
    bad = [
        ([1, IMG], [b"\x89PNG\r\n\x1a\nnot really"], "cannot be decoded"),
        ([1, IMG, IMG, IMG, IMG], pixels(1, 4), "limit is 3"),
        ([1, IMG, 2], [[*pixels(1, 2)], *pixels(2, 2)], "limit is 3"),   # a video's frames count too
        ([1, 2], pixels(1), "1 images"),
        ([1, IMG, IMG], pixels(1), "2 image placeholder tokens"),
        ([1, IMG], None, "no images were given"),
        ([1, IMG], [torch.zeros(3, 14, 14)], "shape [3, 28, 28]"),
        ([1, IMG], [torch.full((3, 28, 28), float("nan"))], "NaN"),
        ([1, IMG], [[]], "no frames"),
        ([1, IMG], ["/nonexistent/x.png"], "cannot be decoded"),
        ([1, IMG], [42], "expected a PIL image"),
    ]
    for prompt, images, why in bad:
        with pytest.raises(RequestError, match=re.escape(why)):
            eng.add_request(prompt, images=images)
    assert list(eng._seqs) == [rid]
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finished and len(outs[-1].token_ids) == 3

    text_path, _ = make_tiny_model(tmp_path)
    text = LLM(str(text_path), num_blocks=16, block_size=4)
    with pytest.raises(RequestError, match="text-only"):
        text.engine.add_request([1, 2], images=pixels(1))
    assert not text.engine.has_unfinished()


def test_image_kv_is_reused_under_its_adapter_and_content(tiny):
    path, paths, _ = tiny
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    prompt, img, other = [3, 4, 5, 6, IMG, 7, 8, 9], pixels(21), pixels(22)
    fresh = LLM(str(path), adapters=paths, num_blocks=64, block_size=4)
    expected = [fresh.generate(prompt, a, sp, images=im)[0].token_ids
                for a, im in ((None, img), ("a4", img), (None, other))]

    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4, prefix_caching=True)
    eng, tree = llm.engine, llm.engine.prefix_cache
    assert llm.generate(prompt, None, sp, images=img)[0].token_ids == expected[0]
    assert eng.runner.num_images_encoded == 1
    hits = tree.hit_tokens
    assert llm.generate(prompt, None, sp, images=img)[0].token_ids == expected[0]
    assert tree.hit_tokens - hits == 20                # 4 text + 16 image tokens came from the cache
    assert eng.runner.num_images_encoded == 1          # the tower did not run again
    hits = tree.hit_tokens
    assert llm.generate(prompt, "a4", sp, images=img)[0].token_ids == expected[1]
    assert tree.hit_tokens == hits                     # KV under another adapter is not shared
    assert llm.generate(prompt, None, sp, images=other)[0].token_ids == expected[2]
    assert tree.hit_tokens - hits == 4                 # other pixels: only the text before the image
    assert eng.runner.num_images_encoded == 3


def write_head(adapter_dir, dst, labels, seed):
    """A copy of ``adapter_dir`` with a vision task head; returns (path, weight, bias)."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(adapter_dir, dst)
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(len(labels), TINY["hidden_size"], generator=g), torch.randn(len(labels), generator=g)
    save_file({"weight": w, "bias": b}, str(dst / "vlora_head.safetensors"))
    (dst / "vlora_head.json").write_text(json.dumps({"labels": labels, "token": "last"}))
    return dst, w, b


def ref_last_hidden(pm, prompt, images, adapter):
    """transformers + PEFT: the final normed hidden state of the prompt's last token."""
    ids, frames = hf_inputs(prompt, images)
    kw = {"pixel_values": torch.stack(frames)} if frames else {}
    with torch.no_grad():
        out = pm(input_ids=torch.tensor([ids]), adapter_names=[adapter], output_hidden_states=True, **kw)
    h = out.hidden_states[-1][0, -1]
    close(pm.get_output_embeddings()(h), out.logits[0, -1])     # it is the state the LM head reads
    return h


def test_task_heads_answer_in_one_pass_beside_generation(tiny, tmp_path):
    path, paths, pm = tiny
    labels4, labels8 = ["walk", "run", "sit", "jump", "fall"], ["car", "bus", "bike"]
    h4, w4, b4 = write_head(paths["a4"], tmp_path / "a4h", labels4, seed=1)
    h8, w8, b8 = write_head(paths["a8"], tmp_path / "a8h", labels8, seed=2)
    llm = LLM(str(path), adapters={**paths, "a4h": h4, "a8h": h8}, num_blocks=64, block_size=4,
              max_num_batched_tokens=256)   # every prefill in one iteration: heads beside the LM head
    head, gen = SamplingParams(task_head=True), SamplingParams(max_tokens=5, min_tokens=5, ignore_eos=True)
    reqs = [  # (prompt, images, adapter, params, the LoRA weights PEFT uses)
        ([5, 17, IMG, 33, 2, 99], [pixels(1)[0]], "a4h", head, "a4"),
        ([9, IMG, 8, 7, IMG, 6, 5], pixels(2, 2), "a8", gen, "a8"),
        ([1, 2, 3, 4], None, "a8h", head, "a8"),
        ([IMG, 44, 45], [pixels(3, 3)], "a8h", head, "a8"),
        ([250, 4, IMG, 9, 31], [pixels(4)[0]], None, gen, "__base__"),
    ]
    prompts, images, names, params, peft_names = zip(*reqs)
    eng = llm.engine
    outs = llm.generate(list(prompts), list(names), list(params), images=list(images))
    assert eng.runner.num_images_encoded == 1 + 2 + 3 + 1
    for (p, im, name, sp, pname), o in zip(reqs, outs):
        if sp.task_head:
            w, b, labels = (w4, b4, labels4) if name == "a4h" else (w8, b8, labels8)
            ref = w @ ref_last_hidden(pm, p, im, pname) + b
            assert o.task.label == labels[int(ref.argmax())] and o.token_ids == [] and o.finish_reason == "stop"
            close(torch.tensor([o.task.scores[x] for x in labels]), ref, f"head of {name}")
        else:
            assert o.task is None and o.token_ids == hf_greedy(pm, p, im, pname, 5)
    assert [r.label for r in llm.classify([[1, 2, 3, 4]], "a8h")] == [outs[2].task.label]
    assert eng.allocator.num_free == 64

    with pytest.raises(RequestError, match="has none"):
        eng.add_request([1, 2], "a8", SamplingParams(task_head=True))
    with pytest.raises(RequestError, match="has none"):
        eng.add_request([1, 2], None, SamplingParams(task_head=True))


@pytest.mark.parametrize("damage,why", [
    (lambda d: (d / "vlora_head.json").unlink(), "needs both"),
    (lambda d: (d / "vlora_head.json").write_text('{"labels": []}'), "non-empty list"),
    (lambda d: (d / "vlora_head.json").write_text('{"labels": ["a", "b"], "token": "mean"}'), "not supported"),
    (lambda d: (d / "vlora_head.json").write_text('{"labels": ["a", "b"]}'), "expected [2, 64]"),
    (lambda d: (d / "vlora_head.safetensors").write_bytes(b"junk"), "cannot be read"),
])
def test_malformed_task_heads_are_refused(tiny, tmp_path, damage, why):
    from vlora.lora.adapter import AdapterError

    path, paths, _ = tiny
    llm = LLM(str(path), adapters={"a4": paths["a4"]}, num_blocks=16, block_size=4)
    bad, _, _ = write_head(paths["a8"], tmp_path / "bad", ["a", "b", "c"], seed=3)
    damage(bad)
    with pytest.raises(AdapterError, match=re.escape(why)):
        llm.register_adapter("bad", bad)
    assert llm.list_adapters() == ["a4"] and not llm.engine.adapters.heads


def test_preemption_recomputes_images_without_changing_tokens(tiny):
    path, paths, _ = tiny
    prompts, images, names = zip(*CASES)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    roomy = LLM(str(path), adapters=paths, num_blocks=128, block_size=4)
    expected = [o.token_ids for o in roomy.generate(list(prompts), list(names), sp, images=list(images))]
    tight = LLM(str(path), adapters=paths, num_blocks=22, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    got = [o.token_ids for o in tight.generate(list(prompts), list(names), sp, images=list(images))]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.allocator.num_free == 22


@pytest.mark.slow
def test_demo_lmm_matches_transformers():
    """The demo (real SmolLM2 + random ViT) loads in transformers too, with the same greedy answer."""
    from PIL import Image
    from transformers import LlavaForConditionalGeneration

    from vlora.models.demo_lmm import demo_lmm_dir

    llm = LLM("demo:smollm2-llava", num_blocks=64, block_size=16)
    im = Image.new("RGB", (300, 200), (10, 200, 30))
    ids = llm.apply_chat_template([{"role": "user", "content": "<image>\nWhat is in this picture?"}])
    out = llm.generate(ids, sampling=SamplingParams(max_tokens=8, min_tokens=8), images=[im])[0]
    assert len(out.prompt_token_ids) == len(ids) - 1 + 49
    hf = LlavaForConditionalGeneration.from_pretrained(demo_lmm_dir(), dtype=torch.float32).eval()
    px = llm.engine.vision.processor(images=[im], return_tensors="pt")["pixel_values"]
    x = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        ref = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=px, max_new_tokens=8,
                          min_new_tokens=8, do_sample=False)
    assert out.token_ids == ref[0, x.shape[1]:].tolist()
