"""The OpenAI wire format: request and response models, and the error body.

Fields are validated strictly: a field of the wrong JSON type is an error (``"10"`` is not an
integer) that names it. Checks that span fields or look inside one (``logit_bias`` keys,
``top_logprobs`` without ``logprobs``, ``best_of`` below ``n``) are in :meth:`SamplingRequest.invalid`.
Numbers must be finite (``NaN``, ``Infinity`` and ``1e999`` are refused naming the field).

Fields nobody defines are handled as vLLM handles them: ignored, and named in one warning in the
server log per request (:func:`extra_fields` finds them, nested objects included). Fields OpenAI or
vLLM define that vlora does not implement (:data:`VLLM_FIELDS`: beam search, ``prompt_logprobs``,
``cache_salt``, ...) are accepted at their neutral value (the one that changes nothing, such as
``use_beam_search: false``); any other value is a 400 naming the field, so a client is never told
its request was honoured when it was not. OpenAI fields of the same kind that vlora declares
(``store``, ``suffix``) are checked in :meth:`SamplingRequest.unsupported`.

``response_format`` (an object) stays strict: an unknown key in it or in its ``json_schema`` is a
400, since a misspelt ``schema`` would silently drop the constraint the request is for. So do the
adapter routes' bodies (:class:`LoadAdapterRequest`): a mistaken field there changes what is loaded.

Responses carry vlora's extra fields (``task``, ``parent``) only when they hold something,
so a client that checks OpenAI's schema strictly sees nothing unknown.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

from vlora.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, GuidedSpec, SamplingError
from vlora.server.body import QUOTE_CHARS

MAX_N = 16              # most choices per request
MAX_STOP = 16           # most stop strings per request
MAX_STOP_TOKEN_IDS = 256    # most stop_token_ids per request (each is checked at every generated token)
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024    # longest per-request chat_template (real templates are a few KiB)
MAX_TOOLS = 128         # most tools per request (OpenAI's limit)
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"    # OpenAI's rule for function names


ANY = "any"      # a Known field whose every value changes nothing (a hint, a label)


@dataclass(frozen=True)
class Known:
    """A field OpenAI or vLLM defines that vlora does not implement: its JSON type, and the values that change
    nothing (accepted and ignored; null is always accepted); any other value is a 400 naming the field."""

    type: Literal["boolean", "integer", "number", "string", "array", "object"]
    neutral: tuple | Literal["any"] = ()


# vLLM's request extras (vllm/entrypoints/openai/protocol.py) and OpenAI's fields that vlora does not implement.
# One table for both routes: a field a route's model declares (completions' echo, chat's response_format) is
# implemented there, and this entry applies only where it is not declared.
VLLM_FIELDS: dict[str, Known] = {
    # vLLM sampling extras
    "use_beam_search": Known("boolean", (False,)),
    "length_penalty": Known("number", ANY),             # vLLM applies it to beam search only
    "include_stop_str_in_output": Known("boolean", (False,)),
    "skip_special_tokens": Known("boolean", (True,)),
    "spaces_between_special_tokens": Known("boolean", (True,)),
    "truncate_prompt_tokens": Known("integer"),
    "prompt_logprobs": Known("integer"),
    "allowed_token_ids": Known("array"),
    "bad_words": Known("array", ([],)),
    "logits_processors": Known("array", ([],)),
    "best_of": Known("integer", (1,)),                  # chat (completions implement it)
    "echo": Known("boolean", (False,)),                 # chat (completions implement it)
    "add_special_tokens": Known("boolean", (False,)),   # vlora adds none (vLLM's completions default: true)
    "return_tokens_as_token_ids": Known("boolean", (False,)),
    "return_token_ids": Known("boolean", (False,)),
    "prompt_embeds": Known("string"),
    # vLLM structured-output and template extras
    "response_format": Known("object", ({"type": "text"},)),    # completions (chat implements it)
    "guided_decoding_backend": Known("string", ("auto", "guidance")),    # vlora's is llguidance
    "guided_whitespace_pattern": Known("string"),
    "structural_tag": Known("string"),
    "documents": Known("array", ([],)),
    "mm_processor_kwargs": Known("object", ({},)),
    "include_reasoning": Known("boolean", (True,)),     # vlora has no reasoning parser: reasoning stays in content
    # vLLM serving extras
    "priority": Known("integer", (0,)),
    "request_id": Known("string", ANY),                 # vlora names the answer with its own id
    "cache_salt": Known("string"),                      # ignoring it would share the prefix cache it asks to split
    "kv_transfer_params": Known("object", ({},)),
    "vllm_xargs": Known("object", ({},)),
    # OpenAI's
    "reasoning_effort": Known("string"),
    "verbosity": Known("string"),
    "audio": Known("object"),
    "modalities": Known("array", (["text"],)),
    "web_search_options": Known("object"),
    "service_tier": Known("string", ("auto", "default")),
    "functions": Known("array", ([],)),                 # deprecated for tools
    "function_call": Known("string", ("none", "auto")),     # deprecated for tool_choice
    "prediction": Known("object", ANY),                 # a latency hint: the answer is the same without it
    "prompt_cache_key": Known("string", ANY),           # a cache-routing hint
    "safety_identifier": Known("string", ANY),          # a label, as user
}

_JSON_TYPES = {"boolean": (bool,), "integer": (int,), "number": (int, float), "string": (str,), "array": (list,),
               "object": (dict,)}


class _Request(BaseModel):
    """An OpenAI request object: declared fields strictly typed; other keys kept in ``model_extra`` for
    :func:`extra_fields` (``KNOWN``: the ones OpenAI or vLLM define, with their neutral values)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    KNOWN: ClassVar[dict[str, Known]] = {}


def extra_fields(obj: _Request, path: str = "") -> tuple[list[str], tuple[str, str, str | None] | None]:
    """(paths of the undeclared fields nobody defines, to ignore; the first :class:`Known` field set to a value
    vlora cannot honour, as (path, message, code), else None), over ``obj`` and the request objects inside it."""
    ignored, problem = [], None
    for key, value in (obj.model_extra or {}).items():
        name = f"{path}.{key}" if path else key
        known = type(obj).KNOWN.get(key)
        if known is None:
            ignored.append(name)
        elif problem is None and value is not None:
            if type(value) not in _JSON_TYPES[known.type]:
                problem = name, f"{name}: Input should be a valid {known.type}", None
            elif known.neutral != ANY and not any(type(value) is type(n) and value == n for n in known.neutral):
                shown = json.dumps(value)
                shown = shown if len(shown) <= QUOTE_CHARS else shown[:QUOTE_CHARS] + "..."
                accepted = "".join(f"{json.dumps(n)} or " for n in known.neutral)
                problem = (name, f"{name}={shown} is not supported by vlora (it accepts only {accepted}null)",
                           "unsupported")
    for key in type(obj).model_fields:
        value = getattr(obj, key)
        inner = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        for name, v in inner:
            if isinstance(v, _Request):
                more, found = extra_fields(v, f"{path}.{name}" if path else name)
                ignored += more
                problem = problem or found
    return ignored, problem


class StreamOptions(_Request):
    include_usage: bool = False

    KNOWN: ClassVar[dict[str, Known]] = {"continuous_usage_stats": Known("boolean", (False,)),     # vLLM's
                                         "include_obfuscation": Known("boolean", ANY)}             # OpenAI's


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


class FunctionCall(_Request):
    name: str
    arguments: str                  # JSON text of the arguments object, as the model wrote it


class ToolCall(_Request):
    """A call an assistant message of the history made (what an answer's ``message.tool_calls`` held)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None      # None only for an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None            # assistant messages: the calls it made
    tool_call_id: str | None = None                     # tool messages: the call this is the result of

    def invalid(self) -> tuple[str, str] | None:
        """(field below this message, message) for a field its role does not allow or needs, else None."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content", "missing required field 'content' (only an assistant message with tool_calls may omit it)"
        if self.tool_calls is not None and self.role != "assistant":
            return "tool_calls", f"only assistant messages carry tool_calls (this one is {self.role!r})"
        if self.role == "tool":
            if self.tool_call_id is None:
                return "tool_call_id", "missing required field 'tool_call_id' (a tool message answers a tool call)"
            if isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
                return "content", "a tool message holds text only"
        elif self.tool_call_id is not None:
            return "tool_call_id", f"only tool messages carry tool_call_id (this one is {self.role!r})"
        return None


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None            # a JSON Schema of type object; None: no parameters
    strict: bool | None = None                          # accepted; the schema is enforced whenever a call is forced


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    """``tool_choice`` naming the function the answer must call."""

    type: Literal["function"]
    function: FunctionName


class SamplingRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    KNOWN: ClassVar[dict[str, Known]] = VLLM_FIELDS

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
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)   # extension; 1 = off
    min_p: float | None = Field(None, ge=0, le=1)           # extension; 0 = off
    logit_bias: dict[str, float] | None = None          # token id (as a string: a JSON key) -> bias
    # structured output (vLLM's extensions); at most one of them (and of chat's response_format)
    guided_json: dict[str, Any] | str | None = None     # a JSON schema (an object, or its JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None                   # a Lark or GBNF grammar (llguidance's syntax)

    GUIDED: ClassVar[dict[str, str]] = {"guided_json": "json_schema", "guided_regex": "regex",
                                        "guided_choice": "choice", "guided_grammar": "grammar"}

    def guided(self) -> tuple[GuidedSpec | None, str | None]:
        """(the structured-output spec, the field that gave it), or (None, None); raises SamplingError naming the
        field when it is malformed or more than one is set."""
        given = [(f, getattr(self, f)) for f in self.GUIDED if getattr(self, f) is not None]
        if len(given) > 1:
            raise SamplingError(f"{given[1][0]}: only one of {', '.join(f for f, _ in given)} may be set")
        if not given:
            return None, None
        field, value = given[0]
        try:
            return GuidedSpec(**{self.GUIDED[field]: value}), field
        except SamplingError as e:
            raise SamplingError(f"{field}: {e}") from None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; call after :meth:`invalid` found nothing."""
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    def logprobs_k(self) -> int | None:
        """Alternatives per generated token the client asked logprobs for (None: no logprobs)."""
        return None

    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt token the client asked logprobs for (None: none)."""
        return None

    def num_candidates(self) -> int:
        """Answers to generate: n, or best_of when the n best of more are wanted."""
        return self.n

    def invalid(self) -> tuple[str, str] | None:
        """(field, message) for the first value the field types alone do not catch, else None."""
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                return "logit_bias", f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            for key, bias in self.logit_bias.items():
                # ASCII digits only (int() would also take "+1", " 1", "1_0" and other scripts' digits), and
                # short enough that int() never meets its length limit
                if not (0 < len(key) <= 20 and key.isascii() and key.isdigit()):
                    shown = key if len(key) <= 40 else key[:40] + "..."
                    return "logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {shown!r}"
                if not -100 <= bias <= 100:
                    return "logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}"
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value vlora does not implement, else None."""
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # alternatives per token; needs logprobs
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None             # default true: a forced answer may make several calls
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # chat-template controls (vLLM's extensions)
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None      # extra variables for the template
    add_generation_prompt: bool | None = None           # default: true, unless continue_final_message
    continue_final_message: bool = False                # continue the last (assistant) message, no end-of-turn

    def template_options(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message) as the template gets them."""
        add = not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt
        return add, self.continue_final_message

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the answer's token limit, the field that gave it): max_completion_tokens wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> str:
        """What tool_choice asks: "none" (no tools), "auto", "required" or "named" (tool_choice's function)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice == "required":
            return "required"
        return "auto" if self.tools and choice != "none" else "none"

    def invalid(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            problem = m.invalid()
            if problem is not None:
                return f"messages[{i}].{problem[0]}", problem[1]
        if self.top_logprobs is not None and not self.logprobs:      # as OpenAI answers it
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        if self.continue_final_message:
            if self.add_generation_prompt:          # as vLLM answers it
                return ("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                        "true (send add_generation_prompt: false, or leave it out)")
            if self.messages[-1].role != "assistant":
                return ("continue_final_message", f"continue_final_message continues the last message, which must "
                        f"be the assistant's (it is {self.messages[-1].role!r})")
        return super().invalid()

    def guided(self) -> tuple[GuidedSpec | None, str | None]:
        """``response_format`` json_object / json_schema, else the guided_* extras (not both)."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return super().guided()
        if any(getattr(self, f) is not None for f in self.GUIDED):
            raise SamplingError("response_format: response_format and guided_* cannot both be set")
        kind = rf.get("type")
        if kind == "json_object" and set(rf) == {"type"}:
            return GuidedSpec(json_object=True), "response_format"
        if kind == "json_schema" and set(rf) <= {"type", "json_schema"}:
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not set(js) <= {"name", "schema", "strict", "description"} \
                    or not isinstance(js.get("name"), str):
                raise SamplingError("response_format: json_schema must be an object with a name and a schema "
                                    "(and optionally strict, description)")
            schema = js.get("schema", {})        # OpenAI: no schema means any JSON
            if not isinstance(schema, dict):
                raise SamplingError("response_format: json_schema.schema must be a JSON Schema object")
            try:
                return GuidedSpec(json_schema=schema or {"type": "object"}), "response_format"
            except SamplingError as e:
                raise SamplingError(f"response_format: {e}") from None
        raise SamplingError("response_format: the type must be text, json_object or json_schema "
                            "({\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}})")

    def unsupported(self) -> tuple[str, str] | None:
        if self.store:
            return "store", "store is not supported"
        return super().unsupported()


class CompletionRequest(SamplingRequest):
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    max_tokens: int | None = Field(16, ge=1)            # OpenAI's default for completions
    echo: bool | None = None                            # the answer's text starts with the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # alternatives per token (OpenAI caps it at 5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)   # candidates generated; the n most likely are answered

    def is_batch(self) -> bool:
        """Whether ``prompt`` is a list of prompts (strings or token-id lists) rather than one prompt."""
        p = self.prompt
        return isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))

    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: one, or each of a list of prompts."""
        return list(self.prompt) if self.is_batch() else [self.prompt]

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        return self.logprobs if self.echo else None

    def num_candidates(self) -> int:
        return self.n if self.best_of is None else self.best_of

    def invalid(self) -> tuple[str, str] | None:
        if self.best_of is not None:
            if self.best_of < self.n:
                return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
            if self.best_of > self.n and self.stream:      # the best are known only once all candidates end
                return "best_of", "best_of larger than n cannot be streamed (send stream: false)"
        return super().invalid()

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (text after the insertion point) is not supported: send the prompt alone"
        return super().unsupported()


class LoadAdapterRequest(_Request):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(_Request):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


# -- responses ---------------------------------------------------------------------------------
class _Response(BaseModel):
    pass


def _optional():
    """An optional field, left out of the JSON while it is None."""
    return Field(None, exclude_if=lambda v: v is None)


def _extension():
    """A field OpenAI's schema does not have: left out of the JSON while it is None."""
    return _optional()


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCallOut(_Response):
    name: str
    arguments: str                  # JSON text of the arguments object


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None                                 # None: an answer that is only tool calls
    tool_calls: list[ToolCallOut] | None = _optional()


class TaskAnswer(_Response):
    """A vision task head's answer (extension): the label and every label's raw score."""

    label: str
    scores: dict[str, float]


class TopLogprob(_Response):
    """A token and its log-probability; ``bytes``: its UTF-8 bytes (None where the token's text is unknown:
    a model without a tokenizer)."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """A generated token, and the most likely tokens at its position (most likely first)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None


class CompletionLogprobs(_Response):
    """The legacy completions shape: parallel lists, one entry per token. ``token_logprobs`` and
    ``top_logprobs`` are None for an echoed prompt's first token (nothing comes before it);
    ``top_logprobs[i]`` maps token text to logprob for the most likely tokens and the chosen one."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    task: TaskAnswer | None = _extension()              # task_head requests


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(_Response):
    name: str | None = _optional()
    arguments: str | None = _optional()


class DeltaToolCall(_Response):
    """A streamed tool call: its first delta has the id, type and name, the next ones its arguments."""

    index: int
    id: str | None = _optional()
    type: Literal["function"] | None = _optional()
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = _optional()


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None                # the delta's tokens


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
    logprobs: CompletionLogprobs | None = None
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
