"""Request state machine: WAITING -> RUNNING -> FINISHED (preemption: RUNNING -> WAITING).

A sequence's tokens are ``prompt + output``; ``num_computed`` of them have KV in
the cache. Whatever the phase (prefill, chunked prefill, decode, recompute after
preemption) an iteration computes ``tokens[num_computed : num_computed + n]`` and
samples the next token when that reaches the end.

While an iteration's tokens are still on the device (the engine queues the next
decode before reading them), each of its sequences holds ``PENDING`` as its last
output token and counts it computed; the engine writes the token in once it
has it, and no output ever shows ``PENDING``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from vlora.engine.admission import SLO
    from vlora.engine.guided import Guide
    from vlora.engine.detokenizer import DetokState
    from vlora.lora.task_head import TaskResult
    from vlora.models.lmm import ImageSpan

from vlora.lora.batch import PackedAdapter
from vlora.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    PENDING = -1                             # an output token sampled on the device, not yet read back

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: PackedAdapter | None            # None = base model
    arrival: int                             # admission order; the newest is preempted first
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0                      # leading blocks that came from the prefix cache (pinned there)
    finish_reason: str | None = None         # "stop" | "length" | "abort" | "rejected" (SLO early abort) | "error"
    #                                          | "migrate" (handed back to the cluster front, resumed elsewhere)
    text: str = ""                           # detokenized output (stop string excluded)
    num_emitted_tokens: int = 0              # streamed so far
    num_emitted_chars: int = 0
    detok_state: "DetokState | None" = None  # the detokenizer's read offset and text so far
    num_preemptions: int = 0
    last_progress: float = field(default_factory=time.monotonic)   # arrival, then each new token
    arrival_time: float = field(default_factory=time.monotonic)
    slo: "SLO | None" = None                 # the request's own latency targets (else its adapter's)
    images: tuple["ImageSpan", ...] = ()     # LMM: where each image's tokens sit in the prompt, its pixels
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # span index -> [length, hidden], while
    #                                          its tokens still wait for KV (the runner drops them after)
    task: "TaskResult | None" = None         # the adapter's task head answer (task_head requests)
    mrope: torch.Tensor | None = None        # M-RoPE (Qwen2-VL) prompt with images: [3, prompt len] t/h/w positions
    rope_delta: int = 0                      # M-RoPE: a token after the prompt sits at its index + rope_delta
    sample_seed: int = 0                     # the sampler's counter-based stream: the request's seed, else drawn
    #                                          from the engine's generator when added
    logprobs: list["TokenLogprobs"] | None = None          # params.logprobs set: one per output token
    prompt_logprobs: list["TokenLogprobs | None"] | None = None   # params.prompt_logprobs set: one per prompt
    #                                          token computed so far (the first is None)
    cumulative_logprob: float = 0.0          # sum of the output tokens' logprobs (when logprobs is set)
    guide: "Guide | None" = None             # params.guided set: the grammar's state after the output tokens

    def __post_init__(self):
        if any(span.grid is not None for span in self.images):
            from vlora.models.qwen2_vl import mrope_positions

            self.mrope, self.rope_delta = mrope_positions(len(self.prompt_token_ids), self.images)

    @property
    def adapter_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """tokens[start:end] of prompt + output, without joining the two (a decode step reads one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - n)]

    def token_at(self, i: int) -> int:
        """Token ``i`` of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start] of tokens [start, end): the prompt's t/h/w positions, then (like
        every text token) the same position thrice."""
        pos = (torch.arange(start, end) + self.rope_delta).expand(3, -1)
        n = len(self.prompt_token_ids)
        if self.mrope is None or start >= n:
            return pos
        return torch.cat([self.mrope[:, start:min(end, n)], pos[:, max(0, n - start):]], dim=1)

    def cache_keys(self, start: int, end: int) -> list:
        """Prefix-cache keys of positions [start, end): the token id, or (image digest, index in the image)
        inside an image, so cached KV of an image is found only for the same pixels."""
        keys = self.tokens(start, end)
        for span in self.images:
            lo, hi = max(start, span.offset), min(end, span.offset + span.length)
            if lo < hi:
                keys[lo - start:hi - start] = span.keys(lo, hi)
        return keys

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


class TokenLogprobs(NamedTuple):
    """A token's log-probability under the model (log-softmax of its logits, before penalties, bias, temperature
    and truncation) and the ``k`` most likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) pairs


class RequestOutput(NamedTuple):
    """What a request has produced so far; ``delta_*`` is what is new since the last one. (A named tuple: one is
    made per request per iteration, and a frozen dataclass costs several times as much to make.)"""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    delta_token_ids: list[int]
    delta_text: str
    error: str | None = None                 # why a request was refused after admission (finish "rejected") or
    #                                          failed while served (finish "error")
    task: "TaskResult | None" = None         # task_head requests: the head's label and scores (no tokens)
    logprobs: list[TokenLogprobs] | None = None        # params.logprobs set: one per token of token_ids
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # params.prompt_logprobs set: one per prompt token
    cumulative_logprob: float | None = None  # params.logprobs set: sum of the logprobs of token_ids
