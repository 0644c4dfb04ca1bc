"""Configuration: one frozen dataclass per subsystem.

Each field's docstring (the string literal below it) doubles as CLI help; each
class validates itself at construction, so a bad value fails where it is set.
"""

from __future__ import annotations

import ast
import inspect
import os
from dataclasses import dataclass, field, fields


TOOL_CALL_PARSERS = ("auto", "llama3_json", "hermes", "mistral")     # vlora.server.tool_calls has the formats
# fields whose command-line option takes one of a list
CHOICES = {"tool_call_parser": TOOL_CALL_PARSERS, "policy": ("vlora", "unmerged", "merged-only", "dlora")}


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """Local HF model directory (config.json + safetensors), a .gguf file, or random:<preset> (seeded random weights of a known shape, e.g. random:llama-2-7b, or the LMM random:llava-1.5-7b; prompts as token ids). Default: the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Weight/activation dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """Device: auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) accepted. Default: the model's max_position_embeddings, capped at 8192."""
    tokenizer: str | None = None
    """Where the tokenizer comes from when not from the model: a local HF directory, a .gguf file or a Hub id. A random:<preset> model takes it (its vocabulary grows to the tokenizer's when that is larger), so that a benchmark of a model's shape can take text and structured output."""
    seed: int = 0
    """Seed for random weights created in tests and demos; requests carry their own sampling seed."""
    kernels: str = "auto"
    """Decoder hot path: auto (Triton on CUDA, torch on CPU), triton (paged attention and fused norm/RoPE/SiLU kernels), or torch."""
    cuda_graphs: bool = True
    """Replay decode iterations from CUDA graphs captured per batch-size bucket (CUDA only)."""
    max_images_per_request: int = 16
    """LMMs: most images in one request (each video frame counts as one)."""
    max_pixels_per_image: int = 16_000_000
    """LMMs: largest image accepted before preprocessing, width x height (checked before decoding)."""
    build_kernels: bool = True
    """Build every Triton kernel variant the engine can launch at start-up (CUDA only; compiled once into Triton's disk cache), so that no request waits for a compile."""
    tensor_parallel_size: int = 1
    """Split the model over this many GPUs (one worker process each; on a CPU, processes with gloo): attention heads and MLP columns per rank, one all-reduce after each row-parallel projection; each rank's pool holds its slices of the adapters and of the KV (and, under fastlibra, its host memory its slices of the cached KV swapped out: host_kv_gb per rank)."""
    all_reduce: str = "nccl"
    """Tensor parallelism: the all-reduce after each row-parallel projection: nccl (torch.distributed), auto (per message size, the faster of nccl and symm_mem as timed when the group starts; nccl on the CPU), or symm_mem (torch's symmetric-memory one-shot all-reduce over NVLink peer memory for messages up to 2 MiB, NCCL above)."""

    def __post_init__(self) -> None:
        if self.kernels not in ("auto", "triton", "torch"):
            raise ConfigError(f"kernels must be auto, triton or torch, got {self.kernels!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_images_per_request < 1 or self.max_pixels_per_image < 1:
            raise ConfigError("max_images_per_request and max_pixels_per_image must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.all_reduce not in ("auto", "nccl", "symm_mem"):
            raise ConfigError(f"all_reduce must be auto, nccl or symm_mem, got {self.all_reduce!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block (page)."""
    num_blocks: int | None = None
    """KV blocks to allocate; the unified pool then also gets room for max_loras adapters of the largest rank (any page holds KV or adapter weights). Default: sized from kv_cache_memory_gb."""
    prefix_caching: bool = False
    """Keep finished requests' KV in a tree under their adapter and reuse the longest cached prefix (multi-turn chats, shared system prompts); cached blocks give way when the pool needs pages."""
    kv_cache_memory_gb: float | None = None
    """Memory of the unified pool (KV blocks and, on the kernel path, adapter weights) when num_blocks is not given (GiB). Default: on CUDA, the share gpu_memory_utilization of the GPU's memory less what the weights, the activations of a full batch and the CUDA graphs need; on the CPU, room for max_num_seqs sequences of max_model_len tokens, capped at 512 MiB (at least one full sequence)."""
    memory_policy: str = "unified"
    """unified: KV and adapters share the pool; cached KV gives way (least recently used first) before idle adapters. fastlibra: unified, and with prefix caching FastLibra's cost model moves cached KV and adapters between GPU and host memory (for chats whose histories overflow the pool; docs/memory.md). lru-fixed (benchmark baseline): fixed separate pools for adapters and KV, LRU eviction, cached KV discarded."""
    host_kv_gb: float = 4.0
    """Host memory for cached KV blocks swapped out of the pool (fastlibra policy with prefix caching), GiB, pinned at start-up on CUDA; under tensor parallelism each rank holds this much for its slices."""
    adapter_pool_fraction: float = 0.1
    """lru-fixed: share of the pool's pages reserved for adapters."""
    gpu_memory_utilization: float = 0.9
    """CUDA: share of the GPU's memory vlora may use in all (weights, activations, CUDA graphs and the pool); the pool gets what is left. Ignored when kv_cache_memory_gb or num_blocks is given."""
    merged_copy: bool = False
    """Merging policies (vlora, dlora, merged-only): merge an adapter into a copy of the projections it touches, kept in free pool pages, so switching to and from it is a pointer change and the base weights are never written; made only while the pool has room beyond the KV its requests may still need, dropped first when KV needs pages. Needs memory_policy unified or fastlibra and one GPU."""

    def __post_init__(self) -> None:
        if self.merged_copy and self.memory_policy == "lru-fixed":
            raise ConfigError("merged_copy needs a unified pool (memory_policy unified or fastlibra), not lru-fixed")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.memory_policy not in ("unified", "fastlibra", "lru-fixed"):
            raise ConfigError(f"memory_policy must be unified, fastlibra or lru-fixed, got {self.memory_policy!r}")
        if self.host_kv_gb < 0:
            raise ConfigError(f"host_kv_gb must be >= 0, got {self.host_kv_gb}")
        if not 0 < self.adapter_pool_fraction < 1:
            raise ConfigError(f"adapter_pool_fraction must be in (0, 1), got {self.adapter_pool_fraction}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class LoRAConfig:
    max_lora_rank: int = 128
    """Largest adapter rank accepted; adapters above it are refused."""
    check_base_model: bool = True
    """Refuse adapters whose adapter_config.json names a different base model."""
    lora_kernel: str = "auto"
    """LoRA op backend: auto (Triton ATMM on CUDA, torch on CPU), triton, or torch."""
    max_loras: int = 4
    """Kernel path: adapters of max_lora_rank the unified pool holds at least, beside one max_model_len sequence (with num_blocks: on top of the KV blocks asked for); more are registered in host memory and brought in on demand."""
    lora_overlap: str = "full"
    """CUDA: where the LoRA kernels run beside the base projection: full (shrink and expand on a side stream while the projection runs, one add after), shrink (the shrink on the side stream, the expand after the projection), or off (both after it, on the main stream)."""
    lora_pdl: bool = True
    """Hopper and later: launch each LoRA expand as a programmatic dependent of its shrink (it starts while the shrink finishes)."""

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ConfigError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.lora_overlap not in ("off", "shrink", "full"):
            raise ConfigError(f"lora_overlap must be off, shrink or full, got {self.lora_overlap!r}")
        if self.lora_kernel not in ("auto", "triton", "torch"):
            raise ConfigError(f"lora_kernel must be auto, triton or torch, got {self.lora_kernel!r}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = None
    """Most sequences in one iteration's batch. Default: 64 on the CPU; on CUDA max_num_batched_tokens / 64 (256 with a 16,384-token budget)."""
    max_num_batched_tokens: int | None = None
    """Most tokens (prefill + decode) in one iteration; longer prompts are prefilled in chunks. Default: 2,048 on the CPU; on CUDA the largest of 16,384, 8,192, 4,096 and 2,048 whose activations take at most a tenth of the memory left after the weights."""
    policy: str | None = None
    """Inference-mode policy, chosen each iteration. Default: vlora on one GPU; unmerged on the CPU and under tensor parallelism, where merging is unmeasured. vlora (V-LoRA's Algorithm 1): merges the adapter most of the batch uses into the base weights when that is cheaper than running it through the LoRA kernels (skewed popularity), serves the other requests beside it (mixed) and unmerges when popularity spreads; the modes are timed at start-up on one GPU when two or more adapters are registered by then (else learnt from the iterations as they run). In three paired H200 grids it was 16-23% faster than unmerged when one adapter had 90% of the requests and not slower beyond the noise anywhere; on 32 adapters of even popularity its throughput was unmerged's within 3% offline and within one server run's spread over HTTP, greedy and sampled (one H200, 2026-11-29; docs/benchmarks.md). unmerged: every adapter through the LoRA kernels (S-LoRA/Punica), no switches; rules merges out (e.g. to keep the base weights never written). merged-only: the most requested adapter merged, other requests wait; a deployment of one adapter. dlora: merges and unmerges without the mixed mode (dLoRA), for comparison."""
    starvation_s: float = 0.5
    """V-LoRA's θ: a request whose credit (waiting + iteration + switch time) passes it starves."""
    async_scheduling: bool = True
    """Queue each decode iteration replayed from a CUDA graph before reading the tokens of the one before it (its input tokens are taken on the GPU), so the host's work between iterations overlaps the forward. Applies to decode-only iterations when no waiting request could join (a full batch delays a waiting request by one iteration) while nothing is merged (a merging policy's iteration that would merge runs synchronously), without FastLibra's swapper (memory_policy fastlibra with prefix caching); under tensor parallelism rank 0 broadcasts the tokens the queued iteration takes to the workers (not yet measured on GPUs: --no-async-scheduling turns it off there). Outputs are the same either way."""
    max_prefill_tokens_with_decodes: int | None = None
    """Most prompt tokens an iteration computes beside the decodes of running sequences (longer prompts, and several prompts, are prefilled in chunks of that many while they decode): the bound on how long a new request stalls the streams in flight. On CUDA with CUDA graphs such an iteration replays a graph of its own (decodes and up to 8 prompt chunks together) instead of launching the forward kernel by kernel. Default: 1,024 on CUDA with CUDA graphs, else max_num_batched_tokens (no separate bound)."""

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in ("unmerged", "vlora", "merged-only", "dlora"):
            raise ConfigError(f"policy must be unmerged, vlora, merged-only or dlora, got {self.policy!r}")
        if not self.starvation_s > 0:
            raise ConfigError(f"starvation_s must be > 0, got {self.starvation_s}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_prefill_tokens_with_decodes is not None and self.max_prefill_tokens_with_decodes < 1:
            raise ConfigError("max_prefill_tokens_with_decodes must be >= 1, "
                              f"got {self.max_prefill_tokens_with_decodes}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if (self.max_num_seqs is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ConfigError("max_num_batched_tokens must be >= max_num_seqs "
                              f"({self.max_num_batched_tokens} < {self.max_num_seqs})")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address the HTTP server listens on (0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port of the HTTP server."""
    api_key: str | None = None
    """Require 'Authorization: Bearer <key>' on every /v1 route (default: $VLORA_API_KEY, else no key)."""
    served_model_name: str | None = None
    """Name of the base model in the API (the 'model' field); it must differ from every adapter's name. Default:
    the model's own name."""
    adapter_dirs: tuple[str, ...] = ()
    """Directory adapters are loaded from at run time (repeatable): by /v1/load_lora_adapter, and on first request
    (a request whose model names DIR/<model>, a PEFT adapter directory, loads it, then is served); none: runtime
    loading is refused."""
    allow_hub_adapters: bool = False
    """Let /v1/load_lora_adapter take a Hugging Face Hub id (org/name[@revision]) as lora_path, and a request's
    model name one to load on first request, downloading it into the Hub cache when no adapter directory holds
    that path."""
    max_loaded_adapters: int | None = None
    """Most adapters loaded on first request that stay registered (in host memory); loading one more unloads the
    least recently used one with no request running (429 when all are busy). Adapters given at start or loaded
    through /v1/load_lora_adapter are not counted and never unloaded. Default: no bound."""
    image_dir: str | None = None
    """Directory that image_url file paths (file:// or plain) may point into; none: only data: URIs."""
    max_queued_requests: int = 256
    """Most requests waiting for the engine; more are refused with 429."""
    max_request_bytes: int = 32 * 1024 * 1024
    """Largest request body accepted (bytes); larger ones get 413."""
    max_image_bytes: int = 10 * 1024 * 1024
    """Largest image accepted, after base64 decoding (bytes); larger ones get 413."""
    max_image_pixels: int = 16_000_000
    """Largest image accepted, width x height; larger ones get 413 (checked before decoding)."""
    unload_policy: str = "wait"
    """What /v1/unload_lora_adapter does with the adapter's running requests: wait (for them to finish) or abort."""
    drain_timeout: float = 60.0
    """On shutdown (SIGTERM), seconds to let running requests finish before they are aborted."""
    enable_docs: bool = False
    """Serve the interactive API docs (/docs, /redoc, /openapi.json); behind the API key when one is set."""
    chat_template: str | None = None
    """Jinja chat template file: the server's default template for /v1/chat/completions, in place of the model's
    own (checked at start: a missing file or one that does not parse is an error)."""
    trust_request_chat_template: bool = False
    """Let requests send their own chat_template (a Jinja template run in a sandbox); off: such a request is a 400,
    as in vLLM, since a template can make the server loop or render a huge prompt."""
    tool_call_parser: str = "auto"
    """How tool calls are read from answers: auto (by the model's family), llama3_json, hermes or mistral."""
    engine_process: bool = True
    """Run the engine in a process of its own, beside the HTTP server's (its host work then never waits on the
    server's request and stream handling for the interpreter lock); off: on a thread of the server's process."""

    def __post_init__(self) -> None:
        if isinstance(self.adapter_dirs, (str, os.PathLike)):
            object.__setattr__(self, "adapter_dirs", (self.adapter_dirs,))
        object.__setattr__(self, "adapter_dirs", tuple(str(d) for d in self.adapter_dirs))
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it unset for no key)")
        for d in self.adapter_dirs + ((self.image_dir,) if self.image_dir is not None else ()):
            if not os.path.isdir(d):
                raise ConfigError(f"{d!r} is not a directory")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ConfigError(f"chat_template (--chat-template) {self.chat_template!r}: no such file")
        for name in ("max_queued_requests", "max_request_bytes", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.unload_policy not in ("wait", "abort"):
            raise ConfigError(f"unload_policy must be wait or abort, got {self.unload_policy!r}")
        if self.max_loaded_adapters is not None and self.max_loaded_adapters < 1:
            raise ConfigError(f"max_loaded_adapters must be >= 1, got {self.max_loaded_adapters}")
        if not self.drain_timeout >= 0:
            raise ConfigError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                              f"{self.tool_call_parser!r}")


def field_help(cls: type) -> dict[str, str]:
    """Map each dataclass field of ``cls`` to the docstring written under it."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            out[node.target.id] = str(nxt.value.value)
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in out.items() if k in names}
