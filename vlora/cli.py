"""Command line: ``vlora generate``, ``vlora serve``, ``vlora bench``, ``vlora tune``, ``vlora adapters fuse|demo``."""

from __future__ import annotations

import argparse
import os
import sys
import time

from vlora.cluster.config import ClusterConfig
from vlora.config import CHOICES, CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, ServerConfig, field_help

ENGINE_CONFIGS = (ModelConfig, CacheConfig, LoRAConfig, SchedulerConfig)

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "Explain what a LoRA adapter is in one sentence.",
]


# the demo trains with fuse's defaults but one: LoRA on the last 8 layers for the text tasks and the last 4 for
# the image tasks (their prompts are twice as long and 8 layers are no more accurate) unless --last-layers is given
DEMO_TRAINING = dict(last_layers=None)
DEMO_LAST_LAYERS = {"text": 8, "vision": 4}
DEMO_PARTS = ("all", "text", "vision")


def _add_config_args(parser: argparse.ArgumentParser, classes=ENGINE_CONFIGS) -> None:
    """One option per config field, its docstring as help; tuple fields are repeatable options named
    in the singular (adapter_dirs -> --adapter-dir)."""
    for cls in classes:
        group = parser.add_argument_group(cls.__name__)
        for name, help_text in field_help(cls).items():
            help_text = help_text.replace("%", "%%")  # argparse formats help with %
            default = cls.__dataclass_fields__[name].default
            kind = type(default) if default is not None else str
            if kind is bool:
                group.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                                   default=default, help=help_text)
            elif kind is tuple:
                group.add_argument(f"--{name.removesuffix('s').replace('_', '-')}", dest=name, action="append",
                                   default=[], metavar=name.removesuffix("s").upper(), help=help_text)
            else:
                conv = {int: int, float: float}.get(kind, str)
                if default is None:          # an optional number: its annotation says which ("int | None")
                    annotation = str(cls.__dataclass_fields__[name].type)
                    conv = int if annotation.startswith("int") else float if annotation.startswith("float") else str
                group.add_argument(f"--{name.replace('_', '-')}", type=conv, default=default, help=help_text,
                                   choices=CHOICES.get(name))


def _pick(cls, args):
    return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__})


def _engine_config(args):
    from vlora.config import EngineConfig

    return EngineConfig(*(_pick(cls, args) for cls in ENGINE_CONFIGS))


def _parse_adapters(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter takes NAME=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"--adapter {name!r} is given twice")
        out[name] = path
    return out


def _check_paths(args) -> dict[str, str]:
    """Model, adapter and directory arguments checked (a Hub id downloaded) before any weights load; returns the
    adapters, name -> directory. ``args.model`` becomes the local directory, so the engine does not look again."""
    from vlora.models.locate import locate_adapter, locate_dir, locate_model

    def checked(flag, fn, value):
        try:
            return fn(value)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None

    adapters = {name: str(checked(f"--adapter {name}", locate_adapter, path))
                for name, path in _parse_adapters(getattr(args, "adapter", [])).items()}
    for d in getattr(args, "adapter_dirs", ()):
        checked("--adapter-dir", locate_dir, d)
    if getattr(args, "image_dir", None) is not None:
        checked("--image-dir", locate_dir, args.image_dir)
    if getattr(args, "trace", None) is not None and not os.path.isfile(args.trace):
        raise ValueError(f"--trace: {args.trace}: no such file")
    args.model = checked("--model", locate_model, args.model)
    return adapters


def cmd_generate(args) -> int:
    from vlora import LLM, SamplingParams
    from vlora.models.loader import cache_root

    adapters = _check_paths(args)
    t0 = time.perf_counter()
    llm = LLM(config=_engine_config(args))
    prompts = args.prompt or DEMO_PROMPTS
    if not adapters:
        adapters, trained = _demo_adapters(llm.engine, cache_root() / "demo-adapters")
        if trained and not args.prompt:
            from vlora.adapters.demo import DEMO_QUESTIONS

            prompts = DEMO_PROMPTS[:2] + DEMO_QUESTIONS
    for name, path in adapters.items():
        llm.register_adapter(name, path)
    names = [None] + list(adapters)
    jobs = [(p, a) for p in prompts for a in names]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    print(f"model {llm.engine.model_name} on {llm.engine.device} ({time.perf_counter() - t0:.1f}s to load); "
          f"{len(jobs)} requests over {len(names)} adapters in one continuous batch", file=sys.stderr)
    t1 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p, _ in jobs], [a for _, a in jobs], sp)
    dt = time.perf_counter() - t1
    for (p, a), o in zip(jobs, outs):
        print(f"\n[{a or 'base'}] {p}\n  -> {o.text.strip()}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"\n{n} tokens in {dt:.1f}s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0




def cmd_serve(args) -> int:
    from vlora.server.app import serve

    if _pick(ClusterConfig, args).enabled:
        front, server_config, adapters = serving_cluster(args)
        print(f"serving {server_config.served_model_name or front.info.model_name} on {len(front.replicas)} "
              f"replicas ({front.device}, policy {front.cluster.cluster_policy}) with adapters {', '.join(adapters)} "
              f"at http://{server_config.host}:{server_config.port}/v1", file=sys.stderr)
        try:
            serve(front, server_config, log_level=args.log_level)
        finally:
            front.close()
        return 0
    if args.engine_process:
        client, server_config, facts = serving_engine_process(args)
        try:
            print(f"serving {server_config.served_model_name or client.info.model_name} on {facts['device']} with "
                  f"adapters {', '.join(facts['adapters'])} at http://{server_config.host}:{server_config.port}/v1; "
                  f"{facts['sizing']}", file=sys.stderr)
            serve(client, server_config, log_level=args.log_level, stop_client=True)
        finally:
            client.close()
        return 0
    engine, server_config, adapters = serving_engine(args)
    print(f"serving {server_config.served_model_name or engine.model_name} on {engine.device} with adapters "
          f"{', '.join(adapters)} at http://{server_config.host}:{server_config.port}/v1; {engine.sizing.describe()}",
          file=sys.stderr)
    serve(engine, server_config, log_level=args.log_level)
    return 0


def _serve_args(args):
    """(adapter name -> path, server config) of ``vlora serve``, checked before any model loads."""
    if args.api_key is None:
        args.api_key = os.environ.get("VLORA_API_KEY") or None
    adapters = _check_paths(args)
    config = _pick(ServerConfig, args)
    if config.chat_template is not None:        # a template that does not parse fails before the model loads
        from vlora.server.templates import load_chat_template

        load_chat_template(config.chat_template)
    return adapters, config


def serving_engine(args):
    """What ``vlora serve`` serves for ``args``: (engine with its adapters registered, server config, adapter
    name -> path). The arguments are checked before the model loads."""
    from vlora.builder import build_engine, profile_policy, warm_grammars
    from vlora.models.loader import cache_root

    adapters, server_config = _serve_args(args)
    engine = build_engine(_engine_config(args))
    warm_grammars(engine)
    if not adapters:
        adapters, _ = _demo_adapters(engine, cache_root() / "demo-adapters")
    for name, path in adapters.items():
        engine.adapters.register(name, path)
    profile_policy(engine)
    return engine, server_config, adapters


def serving_engine_process(args):
    """``vlora serve`` with the engine in a process of its own: (the client of that process, server config, facts
    the process reported: adapter name -> path, device, memory sizing). The arguments are checked here first."""
    from functools import partial

    from vlora.engine.process_client import EngineProcess

    _, server_config = _serve_args(args)
    client = EngineProcess(partial(core_engine, args), server_config.max_queued_requests,
                           start_loader=bool(server_config.adapter_dirs or server_config.allow_hub_adapters),
                           log_level=args.log_level)
    return client, server_config, client.extra


def core_engine(args):
    """The engine process's build for ``vlora serve``: (the engine with its adapters registered, what the
    server's process prints of it)."""
    engine, _, adapters = serving_engine(args)
    return engine, dict(adapters=adapters, device=str(engine.device), sizing=engine.sizing.describe())


def serving_cluster(args):
    """``vlora serve --replicas N``: (the cluster front, its replicas started with their adapters, server config,
    adapter name -> path)."""
    from vlora.cluster.front import ClusterFront
    from vlora.models.loader import cache_root

    adapters, server_config = _serve_args(args)
    front = ClusterFront(_engine_config(args), _pick(ClusterConfig, args),
                         max_queued_requests=server_config.max_queued_requests)
    try:
        if not adapters:
            adapters, _ = _demo_adapters_for(front.adapter_shape, front.info.vision is not None,
                                             cache_root() / "demo-adapters")
        front.set_adapters(adapters)
    except BaseException:
        front.close()
        raise
    return front, server_config, adapters


def _demo_adapters(engine, root) -> tuple[dict[str, str], bool]:
    """The demo adapters for ``engine``'s model (:func:`_demo_adapters_for`)."""
    return _demo_adapters_for(engine.adapters.shape, getattr(engine, "vision", None) is not None, root)


def _demo_adapters_for(shape, is_lmm: bool, root) -> tuple[dict[str, str], bool]:
    """The trained demo adapters for a model of adapter ``shape``: built by ``vlora adapters demo`` (in
    ``root``), else shipped with vlora (the embedded model's text tasks); else two random ones. And whether they
    are trained ones."""
    from vlora.adapters.demo import SHIPPED, TRAINED, trained_adapters
    from vlora.lora.random_adapter import write_random_adapter

    for folder in (root / shape.name / TRAINED, SHIPPED / shape.name):
        trained = trained_adapters(folder)
        if trained:
            ask = ("send an image with 'Is there a 3 in the picture?' and \"task_head\": true (LLM.classify)"
                   if is_lmm else "ask them e.g. 'Classify: The concert was wonderful.'")
            print(f"note: no --adapter given; serving the trained demo adapters {', '.join(trained)} (from "
                  f"{folder}; {ask})", file=sys.stderr)
            return trained, True
    print("note: no --adapter given; serving two random-weight demo adapters (they nudge the base model's answers "
          "at random; they are not trained skills); `vlora adapters demo` builds trained ones", file=sys.stderr)
    from vlora.models.loader import cache_lock

    out = {}
    with cache_lock(root / shape.name):
        for name, rank, seed in (("demo-r8", 8, 1), ("demo-r16", 16, 2)):
            path = root / shape.name / name
            if not (path / "adapter_model.safetensors").is_file():
                write_random_adapter(path, shape, rank, seed, std=0.03)
            out[name] = str(path)
    return out, False


def cmd_adapters_fuse(args) -> int:
    from vlora.adapters.sources import load_sources

    sources = load_sources(args.spec)                 # bad sources fail before the model loads
    return _fuse(sources, args, args.out)


def cmd_adapters_demo(args) -> int:
    """Text tasks on --model (default: the embedded model), then image tasks on the demo LMM."""
    from pathlib import Path

    from vlora.adapters.demo import IMAGES, TRAINED, demo_sources, vision_sources
    from vlora.models.demo_lmm import DEMO_LMM
    from vlora.models.loader import cache_root, resolve_model_dir

    code = 0
    for part in ("text", "vision") if args.part == "all" else (args.part,):
        model = args.model if part == "text" else DEMO_LMM
        home = cache_root() / "demo-adapters" / resolve_model_dir(model).name
        out = Path(args.out) / part if args.out else home / TRAINED
        ckpt = Path(args.checkpoint_dir) / part if args.checkpoint_dir else None
        sources = demo_sources() if part == "text" else vision_sources(home / IMAGES)
        last = DEMO_LAST_LAYERS[part] if args.last_layers is None else args.last_layers
        print(f"demo {part} tasks on {model or 'the embedded model'}:", file=sys.stderr)
        code = max(code, _fuse(sources, args, out, model=model, last_layers=last, checkpoint_dir=ckpt))
        if args.ship and part == "text":
            from vlora.adapters.demo import ship

            print(f"shipped: {ship(out, resolve_model_dir(model).name)}", file=sys.stderr)
    if args.out is None:
        print("`vlora serve` / `vlora generate` (make run) serve these adapters when no --adapter is given "
              f"(with --model {DEMO_LMM} for the image tasks' adapters)", file=sys.stderr)
    return code


def _fuse(sources, args, out, checkpoint_dir=None, **overrides) -> int:
    from vlora.adapters.fusion import METHOD_NAMES, FusionConfig, fuse
    from vlora.adapters.report import REPORT_MD
    from vlora.adapters.trainer import LoraTrainer, TrainConfig

    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    fields = {f: overrides.get(f, getattr(args, f)) for f in TrainConfig.__dataclass_fields__}
    train_config, fusion_config = TrainConfig(**fields), _pick(FusionConfig, args)   # checked before loading
    trainer = LoraTrainer(train_config, progress=not args.quiet)
    if trainer.device.type == "cpu":
        import torch

        log(f"training on the CPU with {torch.get_num_threads()} threads (--threads)")
    trainer.check(sources)                            # a source the model cannot take fails before training
    r = fuse(sources, trainer, out, fusion_config, checkpoint_dir or args.checkpoint_dir, log=log)
    print(f"{len(sources)} sources -> {len(r.output)} adapters ({METHOD_NAMES[r.chosen]}) in {out} "
          f"({', '.join('+'.join(a.tasks) for a in r.output)}); every requirement met: "
          f"{'yes' if r.all_met else 'NO'}; {r.wall_s:.0f} s; report: {out}/{REPORT_MD}", file=sys.stderr)
    return 0 if r.all_met else 1


def cmd_bench(args) -> int:
    from pathlib import Path

    from vlora.bench.sweep import POLICIES, SweepConfig, default_meta, run_sweep, write_report
    from vlora.builder import build_engine

    floats = lambda text: tuple(float(x) for x in text.split(",") if x)   # noqa: E731
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)       # noqa: E731
    policies = tuple(args.policies.split(","))
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown} (known: {', '.join(POLICIES)})")
    cfg = SweepConfig(workload=args.workload, points=floats(args.points), sweep=args.sweep, rate=args.rate,
                      skewness=args.skewness, policies=policies, duration_s=args.duration,
                      num_adapters=args.num_adapters, ranks=ints(args.ranks), input_range=ints(args.input_range),
                      output_range=ints(args.output_range), trace=args.trace, ttft_slo_s=args.ttft_slo,
                      seed=args.bench_seed, repeats=args.repeats)
    _check_paths(args)
    engine = build_engine(_engine_config(args))
    rows = run_sweep(engine, cfg, progress=not args.quiet, log=lambda m: print(m, file=sys.stderr))
    path = write_report(rows, cfg, Path(args.out), default_meta(engine))
    print(f"report: {path}", file=sys.stderr)
    return 0


def tp_groups(model: str | None, sizes: list[int]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The packed LoRA groups one rank of ``model`` launches at each tensor-parallel size (its shard's shapes, as
    the engine cuts them): name (``@tpN`` past 1) -> (in features, output slice widths)."""
    from vlora.engine.runner import lora_groups
    from vlora.models.loader import model_config
    from vlora.parallel.partition import Shard

    cfg = model_config(model)
    groups = {}
    for tp in sizes:
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
        widths, ins = lora_groups(Shard.of(cfg, 0, tp).local_config(cfg))
        launched = ("qkv", "o") if cfg.num_experts else tuple(widths)     # a mixture of experts: attention only
        groups.update({name + (f"@tp{tp}" if tp > 1 else ""): (ins[name], widths[name]) for name in launched})
    return groups


def cmd_tune(args) -> int:
    import torch

    from vlora.kernels.tuning import (CONFIG_DIR, PRESETS, RANKS, SEGMENT_BUCKETS, TOKEN_BUCKETS, TilingTable,
                                      gpu_name, shared_keys, tune)

    sizes = [int(x) for x in args.tensor_parallel_size.split(",")]
    if args.preset:
        if sizes != [1]:
            raise ValueError("--tensor-parallel-size applies to --model (a preset is one GPU's shapes)")
        groups = PRESETS[args.preset]
    else:
        groups = tp_groups(args.model, sizes)
    if not torch.cuda.is_available():
        print("error: vlora tune profiles the Triton kernels on a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    out = args.output or CONFIG_DIR / f"{gpu_name()}.json"
    table = TilingTable.load(path=out) if args.merge and out.is_file() else TilingTable()
    ranks = tuple(int(r) for r in args.ranks.split(",")) if args.ranks else RANKS
    ints = lambda text, default: tuple(int(x) for x in text.split(",")) if text else default   # noqa: E731
    tokens, segments = ints(args.tokens, TOKEN_BUCKETS), ints(args.segments, SEGMENT_BUCKETS)
    for what, got, allowed in (("tokens", tokens, TOKEN_BUCKETS), ("segments", segments, SEGMENT_BUCKETS)):
        if not set(got) <= set(allowed):
            raise ValueError(f"--{what} must be among {','.join(map(str, allowed))}")
    # a merge keeps the configs of the keys that pairs outside this run read too (the pairs that chose them
    # were timed with them): the run's pairs on those keys are tuned around them
    fixed = {k: table.entries[k] for k in shared_keys(groups, tokens, segments, ranks) if k in table.entries}
    earlier = dict(table.meta)              # what the entries kept from the earlier table were tuned with
    earlier_list = earlier.pop("earlier", [])
    if "merged_into" in earlier:            # tables written before the list
        earlier_list = [earlier.pop("merged_into")] + earlier_list
    earlier_list = ([earlier] if earlier else []) + earlier_list

    def save(new: TilingTable) -> None:
        merged = TilingTable(meta=dict(new.meta, **({"earlier": earlier_list} if earlier_list else {})))
        merged.entries = {**table.entries, **new.entries}
        merged.save(out)

    new = tune(groups, dtype=getattr(torch, args.dtype), ranks=ranks, token_buckets=tokens,
               segment_buckets=segments, budget_s=args.budget_s, workers=args.workers, fixed=fixed, on_chunk=save)
    save(new)
    print(f"{len(new.entries)} shape buckets tuned ({len(fixed)} kept as the merged table had them) -> {out}",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlora", description="Serve many LoRA adapters on one model, fast.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer prompts through several adapters in one batch")
    _add_config_args(gen)
    gen.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                     help="PEFT adapter to serve: a directory or a Hub id org/name[@revision] (repeatable)")
    gen.add_argument("--prompt", action="append", default=[], help="prompt (repeatable); default: a demo set")
    gen.add_argument("--max-tokens", type=int, default=48, help="most tokens generated per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler (default: random)")
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, adapters, metrics)")
    _add_config_args(srv, ENGINE_CONFIGS + (ServerConfig, ClusterConfig))
    srv.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                     help="PEFT adapter to serve from the start: a directory or a Hub id org/name[@revision] "
                          "(repeatable); default: the demo adapters")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="server log level")
    srv.set_defaults(func=cmd_serve)

    ben = sub.add_parser("bench", help="serve a workload under each mode policy and write a report with plots")
    _add_config_args(ben)
    ben.add_argument("--workload", default="synthetic",
                     choices=["synthetic", "retrieval", "video", "dynamic", "multiturn", "trace"],
                     help="workload profile: arrivals and adapter popularity (synthetic), an application profile, or a trace file")
    ben.add_argument("--sweep", default="rate", choices=["rate", "skewness", "streams"], help="what --points are")
    ben.add_argument("--points", default="1,2,4", help="comma-separated values of the swept quantity")
    ben.add_argument("--rate", type=float, default=2.0, help="request rate (req/s) when not sweeping it")
    ben.add_argument("--skewness", type=float, default=None,
                     help="share of the most popular adapter when not sweeping it (default: power law)")
    ben.add_argument("--policies", default="vlora,unmerged,merged-only,dlora",
                     help="comma-separated inference-mode policies to compare")
    ben.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    ben.add_argument("--num-adapters", type=int, default=8, help="random adapters the workload spreads over")
    ben.add_argument("--ranks", default="8,16,32,64", help="ranks of the random adapters, round-robin")
    ben.add_argument("--input-range", default="8,256", help="MIN,MAX prompt tokens (synthetic, dynamic)")
    ben.add_argument("--output-range", default="8,128", help="MIN,MAX output tokens (synthetic, dynamic)")
    ben.add_argument("--trace", default=None, help="trace file (CSV or JSONL) for --workload trace")
    ben.add_argument("--ttft-slo", type=float, default=None, help="TTFT target (s) for every request: early abort")
    ben.add_argument("--bench-seed", type=int, default=0, help="seed of the workload (arrivals, lengths, adapters)")
    ben.add_argument("--repeats", type=int, default=1,
                     help="runs of every (point, policy), repeat k on the workload of seed bench-seed + k")
    ben.add_argument("--out", default="bench-report", help="directory for report.md, results.json and plots")
    ben.add_argument("--quiet", action="store_true", help="no progress bars")
    ben.set_defaults(func=cmd_bench)
    tun = sub.add_parser("tune", help="profile ATMM tile configs on this GPU and write its tiling table")
    tun.add_argument("--model", default=None,
                     help="model whose projection shapes to tune for: a directory, a Hub id or random:<preset> "
                          "(default: the embedded one)")
    tun.add_argument("--tensor-parallel-size", default="1",
                     help="comma-separated tensor-parallel sizes whose per-rank shapes of --model to tune (e.g. 1,2)")
    tun.add_argument("--preset", choices=["llama-7b", "llama-13b", "bench-grid"], default=None,
                     help="tune for a preset shape set instead of a model")
    tun.add_argument("--ranks", default=None, help="comma-separated adapter ranks (default 8,16,32,64,128,256)")
    tun.add_argument("--tokens", default=None,
                     help="comma-separated token-count buckets to tune (default: all, 1 to 8192)")
    tun.add_argument("--segments", default=None, help="comma-separated segment-count buckets (default: 1,4,16,64)")
    tun.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype to tune for")
    tun.add_argument("--output", type=__import__("pathlib").Path, default=None,
                     help="table path (default: vlora/kernels/configs/<gpu>.json)")
    tun.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True,
                     help="keep the existing table's other entries")
    tun.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds")
    tun.add_argument("--workers", type=int, default=None,
                     help="processes compiling the candidate kernels ahead of their timing (default: half the cores, "
                          "at most 16; 1 compiles each in the timing loop)")
    tun.set_defaults(func=cmd_tune)
    _add_adapters_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class _DefaultsHelp(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the text already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower() or action.default is argparse.SUPPRESS
                or action.default in (None, [], False)):
            return text
        return text + " (default: %(default)s)"


def _add_adapters_parser(sub) -> None:
    from vlora.adapters.fusion import FusionConfig
    from vlora.adapters.trainer import TrainConfig

    ada = sub.add_parser("adapters", help="generate LoRA adapters from knowledge sources (accuracy-aware fusion)")
    asub = ada.add_subparsers(dest="adapters_command", required=True)
    fz = asub.add_parser("fuse", help="train the fewest adapters that meet every task's accuracy requirement",
                         formatter_class=_DefaultsHelp)
    fz.add_argument("spec", help="JSON file listing the knowledge sources (format: docs/adapters.md)")
    fz.add_argument("--out", required=True, help="folder for adapter-N/ and fusion-report.{md,json}")
    dm = asub.add_parser("demo", help="build demo adapters from built-in text tasks (default model) and image "
                                      "tasks (demo LMM)",
                         description="Fuse three built-in text tasks (sentiment, topic, language) into adapters for "
                                     "the default model (or --model), and built-in image tasks (digit detectors, "
                                     "digit colour; answered by task heads) into adapters for the demo LMM "
                                     "demo:smollm2-llava. Training defaults are fuse's, but for --last-layers: "
                                     f"{DEMO_LAST_LAYERS['text']} (text), {DEMO_LAST_LAYERS['vision']} (images)",
                         formatter_class=_DefaultsHelp)
    dm.add_argument("--out", default=None, help="output folder, OUT/text and OUT/vision (default: "
                                                "$VLORA_CACHE/demo-adapters/<model>/trained, where vlora serve looks)")
    dm.add_argument("--part", choices=DEMO_PARTS, default="all", help="which demo tasks to fuse")
    dm.add_argument("--ship", action="store_true",
                    help="also copy the text adapters (float16) and their report into the package's "
                         "vlora/adapters/demo_weights/<model>/, which vlora serve falls back to (make demo-adapters)")
    for p in (fz, dm):
        _add_config_args(p, (TrainConfig, FusionConfig))
        p.add_argument("--checkpoint-dir", default=None,
                       help="journal and last good states; a rerun resumes from it (default: OUT/checkpoint)")
        p.add_argument("--quiet", action="store_true", help="no progress bars or step log")
    fz.set_defaults(func=cmd_adapters_fuse)
    dm.set_defaults(func=cmd_adapters_demo, **DEMO_TRAINING)


if __name__ == "__main__":
    sys.exit(main())
