"""Sampling parameters of one request, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy: dividing logits by them overflows float32 (inf, then NaN
probabilities), and at such a temperature sampling already picks the most likely token."""

REPETITION_MIN = 0.01
"""Smallest repetition_penalty (and 1 / the largest): dividing a logit by a tinier one overflows float32, which
would fail the request instead of sampling it."""

MAX_LOGPROBS = 20
"""Most alternatives per token that ``logprobs`` / ``prompt_logprobs`` may ask for (OpenAI's top_logprobs limit)."""

MAX_LOGIT_BIAS = 300
"""Most entries of ``logit_bias`` (OpenAI's limit)."""

TOP_P_MIN = 1e-6
"""top_p values below this act as it: in float32 they round to 0 and would keep no token at all; at 1e-6 the most
likely token alone is kept (its probability is at least 1 / vocabulary size), as it would be for any tinier p."""


class SamplingError(ValueError):
    """A sampling parameter is out of range."""


GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""The forms of structured output (:class:`GuidedSpec`)."""


@dataclass(frozen=True)
class GuidedSpec:
    """What the output must match (structured output); exactly one field set. The engine compiles it into a
    grammar once per distinct spec (llguidance) and masks every token the grammar forbids."""

    json_schema: str | dict | None = None
    """A JSON Schema (a dict, or its JSON text; stored as compact JSON text, property order kept)."""
    json_object: bool = False
    """Any JSON object."""
    regex: str | None = None
    """A regular expression the whole output matches (Rust ``regex`` syntax)."""
    choice: tuple[str, ...] | None = None
    """One of these strings, exactly."""
    grammar: str | None = None
    """A Lark (or GBNF) grammar, llguidance's syntax."""

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, (dict, bool)):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema, separators=(",", ":")))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise SamplingError(f"guided json_object must be a bool, got {self.json_object!r}")
        set_ = [k for k in GUIDED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise SamplingError(f"guided output needs exactly one of {', '.join(GUIDED_KINDS)}; got "
                                f"{', '.join(set_) or 'none'}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise SamplingError(f"guided json_schema must be a dict or JSON text, got {self.json_schema!r}")
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise SamplingError(f"guided json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise SamplingError("guided json_schema must be a JSON object")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingError(f"guided {name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise SamplingError(f"guided choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        return next(k for k in GUIDED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        k = self.kind
        v = getattr(self, k)
        return k, (json.dumps(v) if k == "choice" else "" if k == "json_object" else v)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 = greedy; otherwise logits are divided by it before sampling. Below GREEDY_BELOW (1e-5) it is greedy
    (the value is stored as 0.0)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p. Below TOP_P_MIN (1e-6) it is stored as
    TOP_P_MIN."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens, whatever else is in the batch."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output ends before the first one (it is not included)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (included in token_ids, not in text)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (for benchmarks)."""
    min_tokens: int = 0
    """Forbid end-of-sequence and stop tokens until this many tokens are generated."""
    task_head: bool = False
    """Answer with the adapter's vision task head (label + scores after the prefill, no tokens); the adapter must carry one."""
    min_p: float = 0.0
    """Keep the tokens whose probability is at least min_p times the most likely one's (0 = all)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's semantics, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI's semantics, in [-2, 2])."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or the output have positive logits divided by it and negative ones multiplied by it
    (1 = off; > 1 discourages repeats; in [0.01, 100])."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling (a dict is accepted); biases in [-100, 100]."""
    logprobs: int | None = None
    """None: no logprobs; k >= 0: each generated token's log-probability and the k most likely alternatives'
    (from the model's own distribution: before penalties, bias, temperature and truncation)."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: each prompt token's log-probability given the tokens before it, and the k most likely
    alternatives' (the first prompt token has none). The request's prompt is computed in full (no prefix cache)."""
    guided: GuidedSpec | None = None
    """Structured output: the output matches this JSON schema, regex, choice or grammar (tokens it forbids are
    masked before sampling; logprobs stay the model's own). The request stops when the grammar is complete."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise SamplingError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not _finite_number(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not _finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < TOP_P_MIN:
            object.__setattr__(self, "top_p", TOP_P_MIN)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise SamplingError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.task_head, bool):
            raise SamplingError(f"task_head must be a bool, got {self.task_head!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise SamplingError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not _finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite_number(v) or not -2.0 <= v <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {v!r}")
        rep = self.repetition_penalty
        if not _finite_number(rep) or not REPETITION_MIN <= rep <= 1 / REPETITION_MIN:
            raise SamplingError(f"repetition_penalty must be in [{REPETITION_MIN}, {1 / REPETITION_MIN:g}], "
                                f"got {self.repetition_penalty!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple((t, float(b) if isinstance(b, int) and not isinstance(b, bool) else b) for t, b in bias)
        except (TypeError, ValueError):
            raise SamplingError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}") from None
        if len(bias) > MAX_LOGIT_BIAS:
            raise SamplingError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for t, b in bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise SamplingError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not _finite_number(b) or not -100.0 <= b <= 100.0:
                raise SamplingError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        if len({t for t, _ in bias}) != len(bias):
            raise SamplingError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise SamplingError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")

        if self.guided is not None:
            if isinstance(self.guided, dict):
                try:
                    object.__setattr__(self, "guided", GuidedSpec(**self.guided))
                except TypeError as e:
                    raise SamplingError(f"guided: {e}") from None
            if not isinstance(self.guided, GuidedSpec):
                raise SamplingError(f"guided must be a GuidedSpec, got {type(self.guided).__name__}")
            if self.task_head:
                raise SamplingError("guided output and task_head exclude each other (a task head emits no tokens)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens seen so far (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")
