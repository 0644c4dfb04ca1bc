"""Sizing the unified pool and the batch limits for the machine the engine runs on.

Explicit settings win (``num_blocks``, ``kv_cache_memory_gb``, ``max_num_seqs``,
``max_num_batched_tokens``); what is left unset is chosen here:

* CUDA: the batch budget is the largest of ``TOKEN_BUDGETS`` whose activations
  (:func:`activation_bytes`) take at most ``ACTIVATION_SHARE`` of the memory left
  after the weights, and the sequence cap is the budget over ``TOKENS_PER_SEQ``.
  The pool gets ``gpu_memory_utilization`` of the GPU's memory less everything
  in use once the weights are loaded (weights, CUDA context, other processes),
  the activations of a full batch and ``CUDA_RESERVE`` for the decode graphs
  and the kernels' workspaces, as vLLM's ``gpu_memory_utilization`` does.
* CPU: the budget and the cap stay small (``CPU_LIMITS``); the pool holds
  ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at ``CPU_POOL_CAP``
  (but at least one full sequence), so that a small model's server stays small.

Either way the pool must hold one ``max_model_len`` sequence and, when adapters
live in the pool (the kernel path), ``max_loras`` adapters of ``max_lora_rank``
beside it; a default that cannot is refused with the knob to turn.
Everything here is arithmetic on numbers the caller measures, so it is tested
with made-up devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlora.config import ConfigError

GiB = 1 << 30
TOKEN_BUDGETS = (16384, 8192, 4096, 2048)
TOKENS_PER_SEQ = 64              # sequence cap = token budget / this (256 at 16,384: decode batches that fill a GPU)
ACTIVATION_SHARE = 0.1           # most of the post-weights memory the activations of a full batch may take
ACTIVATION_SAFETY = 1.5          # the estimate below counts the main tensors; allocator slack and temporaries
CUDA_RESERVE = GiB               # decode CUDA graphs' private pool, cuBLAS/Triton workspaces
CPU_LIMITS = (2048, 64)          # (max_num_batched_tokens, max_num_seqs) on the CPU
CPU_POOL_CAP = 512 << 20


@dataclass(frozen=True)
class Sizing:
    """What the engine builds: pool pages and the batch limits, with the terms that decided them (bytes)."""

    num_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_bytes: int
    activation_bytes: int = 0
    reserve_bytes: int = 0
    source: str = "default"      # num_blocks, kv_cache_memory_gb, gpu_memory_utilization or cpu-limits

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        return (f"pool {self.num_pages} pages of {self.page_bytes >> 10} KiB = {self.pool_bytes / GiB:.2f} GiB "
                f"({self.source}); batch {self.max_num_batched_tokens} tokens, {self.max_num_seqs} sequences")


def page_bytes(cfg, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one pool page: a KV block of every layer."""
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def adapter_pages(cfg, rank: int, block_size: int) -> int:
    """Pool pages an adapter of ``rank`` on every projection takes (with alignment slack)."""
    ins, outs = cfg.lora_in_out()
    elems = cfg.num_layers * (rank * sum(ins[m] + outs[m] for m in ins) + 16 * 11)
    page = cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim
    return -(-elems // page)


def activation_bytes(cfg, tokens: int, seqs: int, dtype_bytes: int) -> int:
    """Peak activation memory of one forward over ``tokens`` tokens (``seqs`` of them sampled): the residual
    stream and norms, the packed qkv and attention output, the MLP's gate/up, product and LoRA delta, and the
    float32 logits with their softmax; times ``ACTIVATION_SAFETY``."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim
    per_token = (4 * h + qkv + cfg.num_heads * cfg.head_dim + 5 * i) * dtype_bytes
    logits = 2 * seqs * cfg.vocab_size * 4
    return int(ACTIVATION_SAFETY * (tokens * per_token + logits))


def _min_pages(cfg, block_size: int, max_model_len: int, adapters: int, max_rank: int) -> int:
    """One sequence of max_model_len tokens, the scratch-free headroom of one block, and the adapters."""
    return -(-max_model_len // block_size) + 1 + adapters * adapter_pages(cfg, max_rank, block_size)


def plan(cfg, *, device_type: str, dtype_bytes: int, block_size: int, max_model_len: int,
         num_blocks: int | None = None, kv_cache_memory_gb: float | None = None,
         gpu_memory_utilization: float = 0.9, max_num_seqs: int | None = None,
         max_num_batched_tokens: int | None = None, adapters_in_pool: int = 0, max_lora_rank: int = 128,
         cuda_graphs: bool = True, total_bytes: int | None = None, used_bytes: int | None = None) -> Sizing:
    """The engine's sizing. ``cfg``: the decoder's config; ``adapters_in_pool``: adapters of ``max_lora_rank``
    the pool must hold beside one full sequence (0 when adapters live outside it); on CUDA, ``total_bytes`` and
    ``used_bytes`` are the GPU's memory and what is in use with the weights loaded."""
    pb = page_bytes(cfg, block_size, dtype_bytes)
    cuda = device_type == "cuda"
    if cuda and (total_bytes is None or used_bytes is None):
        raise ValueError("sizing for CUDA needs the device's total and used memory")
    spare = int(gpu_memory_utilization * total_bytes) - used_bytes if cuda else 0
    tokens, seqs = _limits(cfg, cuda, dtype_bytes, spare, max_num_seqs, max_num_batched_tokens)
    act = activation_bytes(cfg, tokens, seqs, dtype_bytes) if cuda else 0
    reserve = CUDA_RESERVE if cuda and cuda_graphs else 0
    need = _min_pages(cfg, block_size, max_model_len, adapters_in_pool, max_lora_rank)
    if num_blocks is not None:
        pages = num_blocks + adapters_in_pool * adapter_pages(cfg, max_lora_rank, block_size)
        return Sizing(pages, seqs, tokens, pb, act, reserve, "num_blocks")
    if kv_cache_memory_gb is not None:
        return Sizing(max(1, int(kv_cache_memory_gb * GiB) // pb), seqs, tokens, pb, act, reserve,
                      "kv_cache_memory_gb")
    if not cuda:
        want = seqs * (-(-max_model_len // block_size)) + adapters_in_pool * adapter_pages(cfg, max_lora_rank,
                                                                                           block_size)
        return Sizing(max(need, min(want, CPU_POOL_CAP // pb)), seqs, tokens, pb, act, reserve, "cpu-limits")
    left = spare - act - reserve
    pages = left // pb
    if pages < need:
        raise ConfigError(
            f"the GPU has {max(0, left) / GiB:.2f} GiB left for the KV/adapter pool (gpu_memory_utilization "
            f"{gpu_memory_utilization} of {total_bytes / GiB:.1f} GiB, less {used_bytes / GiB:.2f} GiB in use, "
            f"{act / GiB:.2f} GiB of activations for {tokens} batched tokens and {reserve / GiB:.2f} GiB for CUDA "
            f"graphs); one {max_model_len}-token sequence and {adapters_in_pool} adapters of rank {max_lora_rank} "
            f"need {need * pb / GiB:.2f} GiB: raise gpu_memory_utilization, or lower max_model_len, "
            f"max_num_batched_tokens, max_loras or max_lora_rank, or set kv_cache_memory_gb")
    return Sizing(pages, seqs, tokens, pb, act, reserve, "gpu_memory_utilization")


def _limits(cfg, cuda: bool, dtype_bytes: int, spare: int, seqs: int | None, tokens: int | None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): the given ones, the rest chosen for the device (``spare``: CUDA
    memory the engine may still use with the weights loaded)."""
    if not cuda:
        tokens = tokens or max(CPU_LIMITS[0], seqs or 0)
        return tokens, seqs or min(CPU_LIMITS[1], tokens)
    if tokens is None:
        fits = [t for t in TOKEN_BUDGETS
                if activation_bytes(cfg, t, seqs or t // TOKENS_PER_SEQ, dtype_bytes) <= ACTIVATION_SHARE * spare]
        tokens = max(fits[0] if fits else TOKEN_BUDGETS[-1], seqs or 0)
    return tokens, seqs or max(1, min(tokens // TOKENS_PER_SEQ, tokens))
