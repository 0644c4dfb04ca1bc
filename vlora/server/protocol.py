"""The OpenAI wire format: request and response models, and the error body.

Requests are validated strictly: a field of the wrong JSON type is an error
(``"10"`` is not an integer), and so is an unknown field, so a typo such as
``temprature`` is a 400 that names it instead of a silently ignored knob.
OpenAI fields whose feature vlora does not implement (penalties, logprobs,
tools, ...) are accepted only at their neutral value; anything else is a 400
that says the feature is unsupported (see :meth:`SamplingRequest.unsupported`).
Numbers must be finite (``NaN``, ``Infinity`` and ``1e999`` are refused naming the field).

Responses carry vlora's extra fields (``task``, ``parent``) only when they hold something,
so a client that checks OpenAI's schema strictly sees nothing unknown.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

MAX_N = 16              # most choices per request
MAX_STOP = 16           # most stop strings per request
MAX_STOP_TOKEN_IDS = 256    # most stop_token_ids per request (each is checked at every generated token)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class SamplingRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)              # extension; 0 or -1 = disabled
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                            # extension
    min_tokens: int = Field(0, ge=0)                    # extension
    task_head: bool = False                             # extension: answer with the adapter's vision task head
    user: str | None = None                             # accepted, unused
    # accepted at their neutral value only
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value vlora does not implement, else None."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.task_head and self.stream:
            return "task_head", "task_head answers are not streamed (send stream: false)"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        stops = self.stop_strings()
        if len(stops) > MAX_STOP:
            return "stop", f"at most {MAX_STOP} stop strings, got {len(stops)}"
        if any(not s for s in stops):
            return "stop", "stop strings must not be empty"
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the answer's token limit, the field that gave it): max_completion_tokens wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return ("logprobs" if self.logprobs else "top_logprobs"), "logprobs are not supported"
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format", "only response_format {\"type\": \"text\"} is supported"
        if self.store:
            return "store", "store is not supported"
        return super().unsupported()


class CompletionRequest(SamplingRequest):
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    max_tokens: int | None = Field(16, ge=1)            # OpenAI's default for completions
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        """The prompt; a batch of one (``["text"]`` or ``[[ids]]``) is unwrapped."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p

    def unsupported(self) -> tuple[str, str] | None:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
            return "prompt", "one prompt per request (send a string or a list of token ids); use n for several answers"
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs:
            return "logprobs", "logprobs are not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, self.n):
            return "best_of", "best_of is not supported (only best_of == n)"
        return super().unsupported()


class LoadAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)


# -- responses ---------------------------------------------------------------------------------
class _Response(BaseModel):
    pass


def _extension():
    """A field OpenAI's schema does not have: left out of the JSON while it is None."""
    return Field(None, exclude_if=lambda v: v is None)


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class TaskAnswer(_Response):
    """A vision task head's answer (extension): the label and every label's raw score."""

    label: str
    scores: dict[str, float]


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None
    task: TaskAnswer | None = _extension()              # task_head requests


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None
    task: TaskAnswer | None = _extension()              # task_head requests


class CompletionStreamChoice(CompletionChoice):
    """A streamed choice of a request whose prompt was token ids: its new token ids too (extension, as vLLM's
    ``token_ids``), and one per new token even when the token adds no text yet."""

    token_ids: list[int]


class CompletionResponse(_Response):
    """A whole completion, and (with usage None until the last) a streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[SerializeAsAny[CompletionChoice]]      # a stream's choices may carry token_ids
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vlora"
    parent: str | None = _extension()       # the base model, for adapters
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
