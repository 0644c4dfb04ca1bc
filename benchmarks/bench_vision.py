"""Vision serving: task heads vs LM-head answers (video analytics), image KV reuse (visual retrieval).

Random weights of LLaVA-1.5-7B shapes (``random:llava-1.5-7b``: CLIP ViT-L/14-336, 576 tokens per frame, MLP
projector, Llama-2-7B decoder), built on the device in bf16 in seconds. Requests arrive in real time
(``vlora.bench.workloads``), images are preprocessed float tensors (the engine still checks and hashes them;
PIL decoding is left out), outputs have fixed lengths (``ignore_eos``). Latency = finish - arrival.

(a) Video analytics (V-LoRA §6.1, ../shared/BENCHMARKS.md): ``--streams`` streams each send one chunk a second
    (6 frames as one video + a short question) to their task's adapter. Run twice on the same arrivals: the
    adapters' task heads answer (``task_head=True``: one prefill) vs the same adapters generate the label text
    through the LM head (the workload's 5-10 tokens). Reports mean/p50/p90 latency and the reduction.
(b) Visual retrieval: one image + a question, 200-256 output tokens, Poisson arrivals; images repeat (each
    adapter has ``--images-per-adapter`` images behind a fixed system prefix). Run with prefix caching off and
    on; reports latency, TTFT, the tree's cached-token counter and the frames through the tower.

    python benchmarks/bench_vision.py --out benchmarks/results          # GPU (< 5 min on an H100)
    python benchmarks/bench_vision.py --tiny --out /tmp/bench-vision    # CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora import LLM, SamplingParams  # noqa: E402
from vlora.bench.workloads import adapter_names, video_analytics, visual_retrieval  # noqa: E402
from vlora.kernels import compiles  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]    # noqa: E731
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": statistics.median(xs), "p90": q(0.9), "max": xs[-1]}


def drive(llm: LLM, reqs: list[dict]) -> list[dict]:
    """Send each request at its arrival time, step the engine while there is work; per request arrival, first
    output (token or task answer) and finish times, seconds from the start."""
    eng = llm.engine
    pending = deque(sorted(reqs, key=lambda r: r["arrival"]))
    rec = {}
    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0]["arrival"] <= now:
            r = pending.popleft()
            rid = eng.add_request(r["prompt"], r["adapter"], r["params"], images=r["images"])
            rec[rid] = {"arrival": now, "first": None, "finish": None, "tokens": 0}
        if not eng.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - (time.perf_counter() - t0)))
            continue
        outs = eng.step()
        t = time.perf_counter() - t0
        for o in outs:
            r = rec[o.request_id]
            if r["first"] is None and (o.token_ids or o.finished):
                r["first"] = t
            if o.finished:
                r["finish"], r["tokens"] = t, len(o.token_ids)
    return list(rec.values())


def summary(records: list[dict]) -> dict:
    return {"latency_s": stats([r["finish"] - r["arrival"] for r in records]),
            "ttft_s": stats([r["first"] - r["arrival"] for r in records]),
            "output_tokens": sum(r["tokens"] for r in records)}


def make_adapters(llm: LLM, root: Path, n: int, rank: int, labels: int) -> dict[str, Path]:
    """``n`` random adapters of rank ``rank``, each with a task head of ``labels`` labels."""
    from safetensors.torch import save_file

    cfg = llm.engine.model.cfg
    ins, outs = cfg.lora_in_out()
    shape = ModelShape(cfg.name, cfg.num_layers, ins, outs)
    paths = {}
    for i, name in enumerate(adapter_names(n)):       # the names the workload generators use
        p = write_random_adapter(root / name, shape, rank, seed=100 + i)
        g = torch.Generator().manual_seed(200 + i)
        save_file({"weight": torch.randn(labels, cfg.hidden_size, generator=g) * cfg.hidden_size ** -0.5,
                   "bias": torch.zeros(labels)}, str(p / "vlora_head.safetensors"))
        (p / "vlora_head.json").write_text(json.dumps({"labels": [f"label{j}" for j in range(labels)]}))
        paths[name] = p
    return paths


def frame(seed: int, size: int) -> torch.Tensor:
    return torch.randn(3, size, size, generator=torch.Generator().manual_seed(seed))


def video_requests(args, size: int, img: int, vocab: int, head: bool) -> list[dict]:
    specs = video_analytics(args.streams, args.video_duration, args.adapters, frames=args.frames,
                            tokens_per_frame=args.tokens_per_frame, seed=1)
    rng = random.Random(2)
    out = []
    for k, s in enumerate(specs):
        question = [rng.randrange(3, vocab - 1) for _ in range(s.input_len - s.image_tokens)]
        params = (SamplingParams(task_head=True) if head else
                  SamplingParams(max_tokens=s.output_len, min_tokens=s.output_len, ignore_eos=True))
        out.append({"arrival": s.arrival_s, "prompt": [1, img] + question, "adapter": s.adapter, "params": params,
                    "images": [[frame(10_000 * k + f, size) for f in range(args.frames)]]})
    return out


def retrieval_requests(args, size: int, img: int, vocab: int) -> list[dict]:
    specs = visual_retrieval(args.rate, args.retrieval_duration, args.adapters, seed=3)
    rng = random.Random(4)
    # the same system prefix for every request, its length chosen so that the image ends on a KV-block boundary:
    # the blocks that hold the image then hold nothing of the question and can be reused whole
    n_sys = 32 + (-(32 + args.tokens_per_frame)) % args.block_size
    system = [1] + [rng.randrange(3, vocab - 1) for _ in range(n_sys - 1)]
    gallery = {}                                                               # (adapter, k) -> image
    out = []
    for s in specs:
        key = (s.adapter, rng.randrange(args.images_per_adapter))
        if key not in gallery:
            gallery[key] = frame(len(gallery), size)
        question = [rng.randrange(3, vocab - 1) for _ in range(rng.randint(8, 32))]
        n = min(s.output_len, args.max_output) if args.max_output else s.output_len
        out.append({"arrival": s.arrival_s, "prompt": system + [img] + question, "adapter": s.adapter,
                    "params": SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True), "images": [gallery[key]]})
    return out


def warmup(reqs: list[dict], seconds: float, size: int) -> list[dict]:
    """The requests of the first ``seconds`` (at least two), with images of their own."""
    first = [r for r in reqs if r["arrival"] < seconds] or reqs[:2]
    return [dict(r, images=[[frame(-1 - 100 * i - f, size) for f in range(len(im))] if isinstance(im, list)
                            else frame(-1 - 100 * i, size) for im in r["images"]]) for i, r in enumerate(first)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="random:tiny-llava on the CPU, short runs (smoke test)")
    ap.add_argument("--model", default="random:llava-1.5-7b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--labels", type=int, default=10)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--frames", type=int, default=6)
    ap.add_argument("--video-duration", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=1.5, help="retrieval requests/s")
    ap.add_argument("--retrieval-duration", type=float, default=20.0)
    ap.add_argument("--images-per-adapter", type=int, default=2)
    ap.add_argument("--max-output", type=int, default=0, help="cap retrieval outputs (0: the workload's 200-256)")
    ap.add_argument("--warmup-s", type=float, default=5.0,
                    help="replay the first seconds of each workload (each mode) before timing it: the batch "
                         "compositions it produces compile their kernels and capture their graphs there")
    ap.add_argument("--kv-gb", type=float, default=24.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.tiny:
        args.model, args.device = "random:tiny-llava", "cpu"
        args.video_duration = args.retrieval_duration = 3.0
        args.streams, args.rate, args.max_output, args.kv_gb, args.warmup_s = 2, 2.0, 12, 0.05, 1.0
    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    tag = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    tmp = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    result = {"device": gpu, "model": args.model, "args": vars(args)}

    def engine(prefix_caching: bool, adapters=None) -> LLM:
        t = time.perf_counter()
        llm = LLM(args.model, adapters=adapters, device=str(dev), dtype=args.dtype, kv_cache_memory_gb=args.kv_gb,
                  max_num_seqs=64, max_num_batched_tokens=4096, max_loras=args.adapters, max_lora_rank=args.rank,
                  max_model_len=4096, prefix_caching=prefix_caching,
                  block_size=args.block_size)
        llm.engine.runner.capture_graphs()
        log(f"engine ready in {time.perf_counter() - t:.1f} s (prefix caching {prefix_caching})")
        return llm

    llm = engine(False)
    vis = llm.engine.vision
    size, img, vocab = vis.cfg.image_size, vis.image_token_id, llm.engine.model.cfg.vocab_size
    args.tokens_per_frame = vis.tokens_per_image
    paths = make_adapters(llm, tmp, args.adapters, args.rank, args.labels)
    for name, p in paths.items():
        llm.register_adapter(name, p)

    # warm-up: the first seconds of both modes' streams (kernel variants are built at engine start; the timed
    # runs report any built since)
    for head in (True, False):
        drive(llm, warmup(video_requests(args, size, img, vocab, head), args.warmup_s, size))

    log(f"(a) video analytics: {args.streams} streams x {args.video_duration:.0f} s, {args.frames} frames of "
        f"{args.tokens_per_frame} tokens per request")
    runs = {}
    for mode, head in (("task_head", True), ("lm_head", False)):
        mark = compiles.snapshot()
        runs[mode] = summary(drive(llm, video_requests(args, size, img, vocab, head)))
        runs[mode]["kernel_builds"] = compiles.since(mark)["compiles"]
        s = runs[mode]["latency_s"]
        log(f"  {mode:9s}: {s['n']} requests, latency mean {s['mean'] * 1e3:.1f} ms p50 {s['p50'] * 1e3:.1f} "
            f"p90 {s['p90'] * 1e3:.1f}; kernel builds {runs[mode]['kernel_builds']}")
    red = {k: 1 - runs["task_head"]["latency_s"][k] / runs["lm_head"]["latency_s"][k] for k in ("mean", "p50", "p90")}
    log(f"  task heads cut latency by {red['mean']:.0%} (mean), {red['p50']:.0%} (p50), {red['p90']:.0%} (p90); "
        f"V-LoRA reports 41-63%")
    result["video_analytics"] = {**runs, "latency_reduction": red}
    del llm, vis
    free(dev)

    log(f"(b) visual retrieval: {args.rate} req/s x {args.retrieval_duration:.0f} s, {args.images_per_adapter} "
        f"images per adapter")
    result["visual_retrieval"] = {}
    for caching in (False, True):
        llm = engine(caching, paths)
        reqs = retrieval_requests(args, size, img, vocab)
        drive(llm, warmup(reqs, args.warmup_s, size))       # other images: nothing of them is reused later
        tree = llm.engine.prefix_cache
        hits0, enc0 = (tree.hit_tokens if tree else 0), llm.engine.runner.num_images_encoded
        mark = compiles.snapshot()
        s = summary(drive(llm, reqs))
        s["kernel_builds"] = compiles.since(mark)["compiles"]
        s["prompt_tokens"] = sum(len(r["prompt"]) - 1 + args.tokens_per_frame for r in reqs)
        s["cached_prompt_tokens"] = (tree.hit_tokens if tree else 0) - hits0
        s["images_encoded"] = llm.engine.runner.num_images_encoded - enc0
        s["requests"] = len(reqs)
        key = "prefix_caching" if caching else "no_caching"
        result["visual_retrieval"][key] = s
        log(f"  {key:14s}: latency mean {s['latency_s']['mean'] * 1e3:.0f} ms p90 {s['latency_s']['p90'] * 1e3:.0f}, "
            f"TTFT mean {s['ttft_s']['mean'] * 1e3:.1f} ms p90 {s['ttft_s']['p90'] * 1e3:.1f}; cached "
            f"{s['cached_prompt_tokens']}/{s['prompt_tokens']} prompt tokens, tower ran on {s['images_encoded']}/"
            f"{len(reqs)} images; kernel builds {s['kernel_builds']}")
        del llm
        free(dev)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"vision-{tag}.json"
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
