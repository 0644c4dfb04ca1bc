"""The per-iteration value objects a model forward consumes.

The runner builds one :class:`ForwardBatch` per engine iteration; every layer
reads it, none mutates it. Token layout is flat (no batch dimension): the
iteration's sequences are laid end to end, decodes first, then prefill chunks.

Shapes: T = tokens in the iteration, Bd = decode sequences, nb = blocks per
decode block table (padded with 0, read only up to ``decode_lens``).

Attention metadata comes in one of two forms: the Triton kernels take packed
int32 tables and lengths (``use_kernels``, which also selects the fused
norm/RoPE/SiLU kernels); the torch reference path takes a boolean decode mask
and one :class:`PrefillChunk` per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlora.lora.batch import LoRABatch


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's prefill chunk: its new tokens attend to its cache + themselves."""

    q_start: int                      # first row of this chunk in the flat batch
    q_len: int                        # new tokens in the chunk
    ctx_len: int                      # cached tokens before the chunk + q_len
    block_table: torch.Tensor         # [ceil(ctx_len / block_size)] long, KV blocks of the sequence
    mask: torch.Tensor | None         # [q_len, ctx_len] bool (True = attend); None = plain causal


@dataclass(frozen=True)
class PrefillMeta:
    """All prefill chunks of the iteration, packed for one kernel launch."""

    tables: torch.Tensor              # [C, nb] int32, block table of each chunk's sequence
    starts: torch.Tensor              # [C] int32, first row of the chunk in the flat batch
    q_lens: torch.Tensor              # [C] int32, new tokens
    ctx_lens: torch.Tensor            # [C] int32, cached tokens before the chunk + new tokens
    max_q_len: int                    # host int: longest chunk (sizes the grid)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor           # [T] long
    positions: torch.Tensor           # [T] long, position of each token in its sequence
    slot_mapping: torch.Tensor        # [T] long, KV slot (block * block_size + offset) to write
    num_decodes: int                  # Bd: rows [0, Bd) are one-token decodes
    decode_block_tables: torch.Tensor | None  # [Bd, nb] int32 (kernels) or long (reference)
    decode_lens: torch.Tensor | None  # [Bd] int32, context length after this token (0: padded row)
    decode_max_len: int               # host int >= every decode_lens entry (splits long contexts on the GPU)
    decode_mask: torch.Tensor | None  # reference path: [Bd, 1, 1, nb * block_size] bool, True = attend
    prefills: tuple[PrefillChunk, ...]  # reference path
    prefill_meta: PrefillMeta | None  # kernel path
    logits_rows: torch.Tensor         # [S] long, rows whose hidden state feeds the LM head
    lora: LoRABatch | None = None     # None: no request in the batch uses an adapter
    use_kernels: bool = False         # True: Triton attention + fused kernels, packed metadata
    embed_rows: torch.Tensor | None = None    # [E] long, rows whose input embedding is given (image tokens)
    embed_values: torch.Tensor | None = None  # [E, hidden], used instead of the embedding lookup of those rows

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
