"""The served architectures on a GPU: parity with transformers + PEFT at real widths, then bf16 speed at full depth.

Random weights of real model shapes (shapes decide speed), saved as Hugging Face checkpoints and served from them:

  gemma3-4b       Gemma-3-4B's text model (5 windowed layers to 1 global, 262k vocabulary)
  qwen2.5-vl-3b   Qwen2.5-VL-3B (window-attention ViT, Qwen2 decoder with M-RoPE)
  qwen3-vl-2b     Qwen3-VL-2B (ViT with deepstack, Qwen3 decoder with interleaved M-RoPE)
  qwen3-30b-a3b   Qwen3-30B-A3B's widths and experts (128, 8 per token) with ``--moe-layers`` of its 48 layers:
                  the whole model's 61 GB would not be written and read back within the run

1. Parity, fp32 on the device: a copy with ``--parity-layers`` decoder layers (and vision blocks), transformers +
   PEFT against vlora on one mixed batch: base rows and two adapters (ranks 8 and 16; attention only on the MoE),
   an image prompt for the VL models. The check: greedy tokens equal; also reported, the largest difference of the
   logits at every prompt position relative to their largest magnitude.
2. Speed, bf16, full depth: prefill tok/s (``--prompt-len``-token prompts, one output token) and decode tok/s
   (the time ``--decode-tokens`` more tokens add) at batch 1 and 32, without adapters and with two adapters on
   alternate requests (unmerged); for the VL models also an image prompt (a 448 x 448 image and a short question).

    python benchmarks/bench_models.py --out benchmarks/results/models      # GPU: about 3 minutes on an H100
    python benchmarks/bench_models.py --dry-run --out /tmp/bench-models    # CPU: tiny configs, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import make_peft_adapter, prefill_logits  # noqa: E402
from vlora import LLM, SamplingParams  # noqa: E402
from vlora.engine.sequence import Sequence  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ALL[:4]
QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                vision_end_token_id=151653)
TINY_IDS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def _ids(tiny: bool) -> tuple[dict, dict]:
    """(special token ids of the outer config, bos/eos of the text config)."""
    if tiny:
        return TINY_IDS, dict(bos_token_id=1, eos_token_id=2)
    return QWEN_IDS, dict(bos_token_id=151643, eos_token_id=151645)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# --- model shapes: name -> (transformers model class, config(layers, vision depth, tiny), LM targets, is VL) ---

def _tiny_text(**kw) -> dict:
    return {**dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   vocab_size=256), **kw}


def gemma3(layers: int | None, depth: int | None, tiny: bool):
    from transformers import Gemma3TextConfig

    n = layers or 34
    # the 4B model's 5:1 pattern at full depth; a short copy alternates, with a window its prompts exceed
    types = [("full_attention" if (i + 1) % (6 if layers is None else 2) == 0 else "sliding_attention")
             for i in range(n)]
    shape = (_tiny_text(query_pre_attn_scalar=16) if tiny else
             dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=256, vocab_size=262208, query_pre_attn_scalar=256))
    return Gemma3TextConfig(**shape, num_hidden_layers=n, layer_types=types,
                            sliding_window=1024 if layers is None else 8, max_position_embeddings=8192,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1e6}})


def qwen25_vl(layers: int | None, depth: int | None, tiny: bool):
    from transformers import Qwen2_5_VLConfig

    text = (_tiny_text(head_dim=None) if tiny else
            dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                 vocab_size=151936))
    text.pop("head_dim", None)
    d = depth or 32
    vision = (dict(hidden_size=32, intermediate_size=48, num_heads=4, patch_size=14) if tiny else
              dict(hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14))
    fullatt = [7, 15, 23, 31] if depth is None else [1]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3] if tiny else [16, 24, 24]}
    return Qwen2_5_VLConfig(
        text_config={**text, "num_hidden_layers": layers or 36, "rope_parameters": rope,
                     "max_position_embeddings": 8192, **_ids(tiny)[1]},
        vision_config={**vision, "depth": d, "out_hidden_size": text["hidden_size"], "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": fullatt,
                       "tokens_per_second": 2},
        tie_word_embeddings=True, **_ids(tiny)[0])


def qwen3_vl(layers: int | None, depth: int | None, tiny: bool):
    from transformers import Qwen3VLConfig

    text = (_tiny_text(head_dim=32) if tiny else
            dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936))
    vision = (dict(hidden_size=32, intermediate_size=48, num_heads=4, num_position_embeddings=16) if tiny else
              dict(hidden_size=1024, intermediate_size=4096, num_heads=16, num_position_embeddings=2304))
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5] if tiny else [24, 20, 20],
            "mrope_interleaved": True}
    return Qwen3VLConfig(
        text_config={**text, "num_hidden_layers": layers or 28, "rope_parameters": rope,
                     "max_position_embeddings": 8192, **_ids(tiny)[1]},
        vision_config={**vision, "depth": depth or 24, "out_hidden_size": text["hidden_size"], "patch_size": 16,
                       "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "deepstack_visual_indexes": [5, 11, 17] if depth is None else list(range(min(depth, 3)))},
        tie_word_embeddings=True, **_ids(tiny)[0])


def qwen3_moe(layers: int | None, depth: int | None, tiny: bool, full_layers: int = 48):
    from transformers import Qwen3MoeConfig

    shape = (_tiny_text(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2) if tiny else
             dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128, vocab_size=151936, moe_intermediate_size=768, num_experts=128,
                  num_experts_per_tok=8))
    return Qwen3MoeConfig(**shape, num_hidden_layers=layers or full_layers, norm_topk_prob=True,
                          max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                          **_ids(tiny)[1])


MODELS = {
    "gemma3-4b": ("Gemma3ForCausalLM", gemma3, ALL, False),
    "qwen2.5-vl-3b": ("Qwen2_5_VLForConditionalGeneration", qwen25_vl, ALL, True),
    "qwen3-vl-2b": ("Qwen3VLForConditionalGeneration", qwen3_vl, ALL, True),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", qwen3_moe, ATTENTION, False),
}


def save_random(name: str, cfg, dtype: torch.dtype, dev: torch.device, root: Path, seed: int):
    """Build the transformers model of ``cfg`` with random weights on ``dev`` and save it under ``root``;
    returns (path, model)."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(dev):
        model = getattr(transformers, MODELS[name][0])._from_config(cfg, dtype=dtype).eval()
    path = root / name
    model.save_pretrained(path)
    return path, model


def workdir(need_bytes: int) -> Path:
    """A scratch folder with room for the checkpoints: /dev/shm (memory) where it has it, else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * need_bytes:
        return Path(tempfile.mkdtemp(prefix="bench-models-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="bench-models-"))


# --- prompts ---

def image_prompt(cfg, n_text: int, seed: int, units: int) -> tuple[list[int], list[torch.Tensor]]:
    """<|vision_start|> <|image_pad|> <|vision_end|> + text, and one preprocessed square image ``units`` merged
    patch groups (2 x 2 patches) on a side."""
    g = torch.Generator().manual_seed(seed)
    size = units * cfg.vision_config.patch_size * cfg.vision_config.spatial_merge_size
    text = text_prompts(1, n_text, seed, cfg.text_config.vocab_size)[0]
    ids = [cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id] + text
    return ids, [torch.randn(3, size, size, generator=g)]


def text_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """Random ids below the special tokens (Qwen's start at 151643; the tiny configs' at 250)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab - 16, 150000), (n, length), generator=g).tolist()


def hf_inputs(eng, cfg, ids: list[int], images) -> dict:
    """transformers' inputs for one request of a Qwen VL model: the ids vlora expanded, token types, patches and
    patch grids (the patches are vlora's; the model tests check them against transformers' processor)."""
    ids, spans = eng._images(list(ids), images)
    kw = {"input_ids": torch.tensor([ids]),
          "mm_token_type_ids": torch.tensor([[1 if t == cfg.image_token_id else 0 for t in ids]])}
    if spans:
        m = cfg.vision_config.spatial_merge_size
        kw["pixel_values"] = torch.cat([s.pixels for s in spans])
        kw["image_grid_thw"] = torch.tensor([[t, h * m, w * m] for t, h, w in (s.grid for s in spans)])
    return kw


# --- 1. parity ---

def parity(name: str, args, dev: torch.device, root: Path) -> dict:
    cls, make, targets, vl = MODELS[name]
    layers = args.parity_layers
    cfg = make(layers, layers if vl else None, args.dry_run)
    path, hf = save_random(name, cfg, torch.float32, dev, root / "parity", args.seed)
    lm_targets = (r".*language_model.*\.(" + "|".join(targets) + ")") if vl else list(targets)
    adapters = {"a8": 8, "a16": 16}
    paths = {a: make_peft_adapter(hf, root / "parity" / f"{name}-{a}", r, seed=args.seed + i, targets=lm_targets)
             for i, (a, r) in enumerate(adapters.items())}
    import peft

    pm = peft.PeftModel.from_pretrained(hf, str(paths["a8"]), adapter_name="a8")
    pm.load_adapter(str(paths["a16"]), adapter_name="a16")
    pm.eval()
    vocab = (cfg.text_config if vl else cfg).vocab_size
    prompts = text_prompts(4, 24, args.seed, vocab)
    images = [None] * 4
    if vl:
        prompts[1], images[1] = image_prompt(cfg, 12, args.seed, 4)
        prompts[2], images[2] = image_prompt(cfg, 8, args.seed + 1, 2)
    names = [None, "a8", "a16", None]

    llm = LLM(str(path), adapters=paths, device=dev.type, dtype="float32", max_model_len=256, num_blocks=128,
              block_size=16)
    eng = llm.engine
    n_new = args.parity_tokens
    got = [o.token_ids for o in llm.generate(prompts, names, SamplingParams(max_tokens=n_new, ignore_eos=True),
                                             images=images if vl else None)]
    seqs = []
    for i, (p, im, a) in enumerate(zip(prompts, images, names)):
        ids, spans = eng._images(list(p), im)
        seqs.append(Sequence(f"p{i}", ids, SamplingParams(), None if a is None else eng.adapters.get(a), i,
                             images=spans))
    ours = prefill_logits(eng, seqs)
    want, worst = [], 0.0
    for p, im, a, mine in zip(prompts, images, names, ours):
        kw = hf_inputs(eng, cfg, p, im) if vl else {"input_ids": torch.tensor([p])}
        kw = {k: v.to(dev) for k, v in kw.items()}
        with torch.no_grad():
            ref = pm(**kw, adapter_names=[a or "__base__"]).logits[0].float()
            out = pm.generate(**kw, attention_mask=torch.ones_like(kw["input_ids"]), max_new_tokens=n_new,
                              min_new_tokens=n_new, do_sample=False, adapter_names=[a or "__base__"])
        want.append(out[0, kw["input_ids"].shape[1]:].tolist())
        worst = max(worst, ((mine.float().to(ref.device) - ref).abs().max() / ref.abs().max()).item())
    llm.close()
    del llm, pm, hf
    free(dev)
    equal = got == want
    log(f"{name} parity ({layers} layers, fp32): tokens {'equal' if equal else 'DIFFER'}, max logit diff "
        f"{worst:.2e} of the largest logit")
    return {"layers": layers, "tokens_equal": equal, "max_rel_logit_diff": worst, "tokens": got,
            "reference_tokens": want}


# --- 2. speed ---

def timed_generate(llm, prompts, names, images, max_tokens: int, dev: torch.device) -> float:
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    sync(dev)
    t0 = time.perf_counter()
    llm.generate(prompts, names, sp, images=images)
    sync(dev)
    return time.perf_counter() - t0


def speed(name: str, args, dev: torch.device, root: Path) -> list[dict]:
    cls, make, targets, vl = MODELS[name]
    moe = name == "qwen3-30b-a3b"
    layers = args.moe_layers if moe else None
    cfg = make(layers, None, args.dry_run) if not args.dry_run else make(2, 2, True)
    t0 = time.perf_counter()
    path, hf = save_random(name, cfg, torch.bfloat16, dev, root / "speed", args.seed)
    params = sum(p.numel() for p in hf.parameters())
    del hf
    free(dev)
    save_s = time.perf_counter() - t0
    max_batch = max(args.batches)
    llm = LLM(str(path), device=dev.type, dtype="bfloat16", max_model_len=args.prompt_len + args.decode_tokens + 320,
              max_num_seqs=max_batch, max_num_batched_tokens=max(max_batch * args.prompt_len, 2048))
    eng = llm.engine
    ins, outs = eng.model.cfg.lora_in_out()
    shape = ModelShape(eng.model.cfg.name, eng.model.cfg.num_layers, ins, outs)
    for i, a in enumerate(("s1", "s2")):
        llm.register_adapter(a, write_random_adapter(root / "speed" / f"{name}-{a}", shape, rank=16,
                                                     seed=args.seed + i, targets=tuple(ins)))
    load_s = time.perf_counter() - t0 - save_s
    log(f"{name}: {params / 1e9:.2f} B parameters, checkpoint written in {save_s:.0f} s, served in {load_s:.0f} s")
    text_cfg = cfg.text_config if vl else cfg
    rows = []
    kinds = [("text", None)] + ([("image", 2 if args.dry_run else 16)] if vl else [])   # 16 groups: 448-512 px
    for kind, size in kinds:
        for batch in args.batches:
            if kind == "text":
                prompts = text_prompts(batch, args.prompt_len, args.seed, text_cfg.vocab_size)
                images = None
            else:
                pairs = [image_prompt(cfg, 16, args.seed + j, size) for j in range(batch)]
                prompts, images = [p for p, _ in pairs], [im for _, im in pairs]
            n_prompt = sum(len(p) for p in prompts) if images is None else \
                sum(len(eng._images(list(p), im)[0]) for p, im in zip(prompts, images))
            for with_adapters in (False, True):
                names = [("s1", "s2")[j % 2] if with_adapters else None for j in range(batch)]
                timed_generate(llm, prompts, names, images, 2, dev)                  # compiles, captures
                prefill = min(timed_generate(llm, prompts, names, images, 1, dev) for _ in range(args.repeats))
                whole = min(timed_generate(llm, prompts, names, images, 1 + args.decode_tokens, dev)
                            for _ in range(args.repeats))
                row = {"prompt": kind, "batch": batch, "adapters": 2 if with_adapters else 0,
                       "prompt_tokens": n_prompt, "prefill_s": prefill,
                       "prefill_tok_s": n_prompt / prefill,
                       # None where timing noise hides the decode (the dry run's tiny models)
                       "decode_tok_s": batch * args.decode_tokens / (whole - prefill) if whole > prefill else None}
                rows.append(row)
                log(f"{name} {kind} batch {batch} {'2 adapters' if with_adapters else 'base'}: prefill "
                    f"{row['prefill_tok_s']:,.0f} tok/s ({n_prompt} tokens in {prefill * 1e3:.0f} ms), decode "
                    f"{_rate(row['decode_tok_s'])} tok/s")
    llm.close()
    del llm, eng          # the engine holds the pool (most of the GPU): the next model needs it back
    free(dev)
    shutil.rmtree(path, ignore_errors=True)
    return [{"model": name, "params_b": params / 1e9, "layers": text_cfg.num_hidden_layers, **r} for r in rows]


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def markdown(res: dict) -> str:
    lines = ["# Served architectures: parity and speed", "",
             f"Device: {res['device']}; {res['date']}; random weights of the shapes named; {res['args']}", "",
             "## Parity with transformers + PEFT (fp32, reduced depth, base rows + two adapters)", "",
             "| model | layers | greedy tokens equal | max logit difference / largest logit |", "|---|---|---|---|"]
    for name, p in res["parity"].items():
        lines.append(f"| {name} | {p['layers']} | {'yes' if p['tokens_equal'] else '**no**'} | "
                     f"{p['max_rel_logit_diff']:.1e} |")
    lines += ["", "## Speed (bf16)", "",
              "| model | params (B) | layers | prompt | batch | adapters | prompt tokens | prefill tok/s | "
              "decode tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["speed"]:
        lines.append(f"| {r['model']} | {r['params_b']:.2f} | {r['layers']} | {r['prompt']} | {r['batch']} | "
                     f"{r['adapters']} | {r['prompt_tokens']} | {r['prefill_tok_s']:,.0f} | {_rate(r['decode_tok_s'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for models.json and models.md")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU: checks the script, measures "
                                                           "nothing")
    ap.add_argument("--parity-layers", type=int, default=3, help="decoder layers (and vision blocks) of the parity "
                                                                 "copies")
    ap.add_argument("--parity-tokens", type=int, default=8, help="greedy tokens compared per request")
    ap.add_argument("--moe-layers", type=int, default=8, help="layers of the Qwen3-30B-A3B-shaped model timed")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens of each text prompt")
    ap.add_argument("--decode-tokens", type=int, default=32, help="output tokens whose time gives decode tok/s")
    ap.add_argument("--batches", default="1,32", help="batch sizes timed")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case (the fastest counts)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if args.dry_run:
        args.prompt_len, args.decode_tokens, args.repeats = min(args.prompt_len, 16), min(args.decode_tokens, 3), 1
        args.parity_tokens, args.batches = min(args.parity_tokens, 3), [min(b, 2) for b in args.batches]
    dev = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu" and not args.dry_run:
        ap.error("no GPU: pass --dry-run for the CPU check of the script")
    torch.backends.cuda.matmul.allow_tf32 = False          # fp32 parity: no TF32 in transformers' matmuls
    torch.backends.cudnn.allow_tf32 = False
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (dry run)"
    res = {"device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "parity": {}, "speed": []}
    root = workdir(20 << 30 if dev.type == "cuda" else 0)
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"{device}; scratch {root}")
    try:
        for name in names:
            res["parity"][name] = parity(name, args, dev, root)
        for name in names:
            res["speed"] += speed(name, args, dev, root)
            (args.out / "models.json").write_text(json.dumps(res, indent=1))      # partial results survive a kill
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (args.out / "models.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (args.out / "models.md").write_text(md)
    print(md)
    return 0 if all(p["tokens_equal"] for p in res["parity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
