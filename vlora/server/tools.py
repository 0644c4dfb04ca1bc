"""A chat request's tools: checked, shown to the model, and enforced when the answer must call one.

- **Shown** through the chat template (``apply_chat_template(..., tools=...)``), with the history's tool calls
  (arguments as objects) and tool results as Hugging Face templates take them. A template that renders no tools
  (the probe: the same prompt with and without a tool) gets them in the system message instead, in the Hermes
  format (``<tool_call>`` blocks), and the history's calls and results written out in that format.
- **Parsed** by the output format of the model's family (:mod:`vlora.server.tool_calls`): ``mistral`` for
  model_type mistral, ``llama3_json`` for llama, else ``hermes``, and ``hermes`` whenever the system-prompt
  fallback is in use; ``--tool-call-parser`` overrides it.
- **Enforced** for ``tool_choice`` ``required`` or a named function: a grammar of the format's calls, each an
  object whose name is one of the tools' (the named one) and whose arguments match that tool's parameters, is the
  request's structured output, so every call parses and validates. Mistral's calls are written the way the
  model's template writes them (:func:`mistral_tags`): ``[TOOL_CALLS]name[ARGS]{...}`` when it writes ``[ARGS]``
  (tokenizers v11 on), else the JSON array.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

from vlora.engine.guided import JSON_OPTIONS
from vlora.sampling_params import GuidedSpec
from vlora.server import protocol as P
from vlora.server.tool_calls import Parser

NO_PARAMETERS = {"type": "object", "properties": {}}
_PROBE = [{"type": "function", "function": {"name": "vlora_probe", "description": "probe",
                                            "parameters": NO_PARAMETERS}}]

SYSTEM_PROMPT = """\
# Tools

You may call one or more functions to answer the user. Their signatures are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> \
tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools make of its answer: the parser that reads calls out of it (None: it may call none)
    and the grammar that forces them (tool_choice required or named; else None)."""

    parser: Parser | None = None
    guided: GuidedSpec | None = None


class ToolError(ValueError):
    """A tool definition or tool_choice the request cannot have; ``param``: the field at fault."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check(req: P.ChatCompletionRequest, guided: bool) -> None:
    """Raise :class:`ToolError` for tools or a tool_choice that cannot be served; ``guided``: the request also asks
    for structured output (response_format, guided_*)."""
    mode, tools = req.tool_mode(), req.tools or []
    if mode in ("required", "named"):
        if not tools:
            raise ToolError("tool_choice", f"tool_choice {_shown(req.tool_choice)} needs tools")
        if guided:
            raise ToolError("tool_choice", "tool_choice required or a named function cannot be combined with "
                                           "response_format or guided_* (both constrain the answer)")
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolError(f"tools[{i}].function.name", f"two tools are named {name!r}")
    if mode == "named" and req.tool_choice.function.name not in names:
        raise ToolError("tool_choice", f"tool_choice names the function {req.tool_choice.function.name!r}, which "
                                       f"is not one of the tools ({', '.join(names)})")
    for i, t in enumerate(tools):
        params = t.function.parameters
        if params is None:
            continue
        if params.get("type", "object") != "object":
            raise ToolError(f"tools[{i}].function.parameters", "parameters must be a JSON Schema of type object")
        error = _schema_error(json.dumps(params))
        if error:
            raise ToolError(f"tools[{i}].function.parameters", f"parameters cannot be compiled: {error}")


@functools.lru_cache(maxsize=1024)
def _schema_error(schema: str) -> str:
    """What the grammar engine finds wrong with a JSON schema (its text), or ""."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    except ValueError as e:
        return str(e)


def family_parser(model_type: str | None) -> str:
    """The output format of a model family whose template renders tools."""
    return {"mistral": "mistral", "llama": "llama3_json"}.get(model_type or "", "hermes")


def choose_parser(configured: str, model_type: str | None, native: bool) -> str:
    """The parser for a model: ``configured`` (--tool-call-parser) unless it is auto; else the family's when its
    template renders tools (``native``), else hermes (the system-prompt fallback's format)."""
    if configured != "auto":
        return configured
    return family_parser(model_type) if native else "hermes"


def renders_tools(render) -> bool:
    """Whether a template shows tools: ``render(conversation, tools)`` (token ids) differs with a tool."""
    probe = [{"role": "user", "content": "Hi"}]
    try:
        return render(probe, _PROBE) != render(probe, None)
    except Exception:           # a template that fails with tools does not take them
        return False


def template_tools(req: P.ChatCompletionRequest) -> list[dict] | None:
    """The tools as templates take them (OpenAI's shape, parameters always an object schema), or None when the
    answer may not call any (tool_choice none, no tools)."""
    if req.tool_mode() == "none":
        return None
    return [{"type": "function", "function": {**t.function.model_dump(exclude_none=True, exclude={"strict"}),
                                              "parameters": t.function.parameters or NO_PARAMETERS}}
            for t in req.tools]


def conversation(conv: list[dict], messages: list[P.ChatMessage], tools: list[dict] | None, native: bool,
                 parser: str) -> list[dict]:
    """``conv`` (each message's role and text content, in order) with the history's tool calls and results, for
    a template that renders tools (``native``) or, written out in the Hermes format, for one that does not; the
    latter also gets ``tools`` in its system message."""
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    ids = _mistral_id if native and parser == "mistral" else (lambda i: i)    # Mistral's templates want 9 chars
    out = []
    for d, m in zip(conv, messages):
        d = {**d, "content": d["content"] or ""}
        if m.role == "tool" and native:
            d["tool_call_id"] = ids(m.tool_call_id)
            if m.tool_call_id in names:
                d["name"] = names[m.tool_call_id]
        elif m.role == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{d['content']}\n</tool_response>"}
        elif m.tool_calls and native:
            d["tool_calls"] = [{"id": ids(c.id), "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        elif m.tool_calls:
            blocks = [json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                                 ensure_ascii=False) for c in m.tool_calls]
            d["content"] = "\n".join([d["content"]] * bool(d["content"]) +
                                     [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
        out.append(d)
    if tools and not native:
        text = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


@dataclass(frozen=True)
class MistralTags:
    """The tags of a Mistral model's forced calls, as grammar terminals: the special token where the tokenizer has
    one, else the text. ``args`` (``[ARGS]``) None: the calls are one JSON array after ``marker``."""

    marker: str = '"[TOOL_CALLS]"'
    args: str | None = None


def mistral_tags(tokenizer, template: str | dict[str, str] | None) -> MistralTags:
    """The tags of a model whose chat template (or named templates) is ``template``: calls written
    ``[TOOL_CALLS]name[ARGS]{...}`` when it writes ``[ARGS]`` (tokenizers v11 on), else the JSON array, so that
    forced calls look like those the model was trained on and that its history shows."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    named = any("[ARGS]" in t for t in texts)
    return MistralTags(_terminal(tokenizer, "[TOOL_CALLS]"), _terminal(tokenizer, "[ARGS]") if named else None)


def grammar(req: P.ChatCompletionRequest, parser: str, tags: MistralTags = MistralTags()) -> GuidedSpec | None:
    """The structured output that makes the answer call the tools (``required``) or the named function, in
    ``parser``'s format; None for auto and none. ``tags``: how the model writes mistral's calls."""
    mode = req.tool_mode()
    if mode not in ("required", "named"):
        return None
    named = req.tool_choice.function.name if mode == "named" else None
    tools = [t for t in req.tools if named in (None, t.function.name)]
    several = req.parallel_tool_calls is not False
    if parser == "mistral" and tags.args is not None:
        return GuidedSpec(grammar=_named_calls(tools, tags, several))
    key = "parameters" if parser == "llama3_json" else "arguments"
    schemas = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                 key: t.function.parameters or NO_PARAMETERS},
                "required": ["name", key], "additionalProperties": False} for t in tools]
    call = json.dumps({**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": JSON_OPTIONS})
    if parser == "hermes":
        start = 'block ("\\n" block)*' if several else "block"
        rules = f'start: {start}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\n'
    elif parser == "mistral":
        more = '(", " call)* ' if several else ""
        rules = f'start: {tags.marker} "[" call {more}"]"\n'
    else:                       # llama3_json: Llama 3 makes one call per answer
        rules = "start: call\n"
    return GuidedSpec(grammar=f"{rules}call: %json {call}")


def _named_calls(tools: list[P.Tool], tags: MistralTags, several: bool) -> str:
    """The grammar of Mistral's calls written ``[TOOL_CALLS]name[ARGS]{...}``, one per marker: the name is outside
    the JSON, so each tool is an alternative of its own, its arguments matching its parameters."""
    calls = [f"{tags.marker} {json.dumps(t.function.name)} {tags.args} %json "
             f"{json.dumps({**(t.function.parameters or NO_PARAMETERS), 'x-guidance': JSON_OPTIONS})}" for t in tools]
    return f"start: call{'+' if several else ''}\ncall: {' | '.join(calls)}\n"


def special_token(tokenizer, text: str) -> int | None:
    """The id of ``text`` if the tokenizer has it as one special token, else None."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return next((i for i, t in added.items() if t.content == text and t.special), None)


def _terminal(tokenizer, text: str) -> str:
    """A grammar's terminal for the tag ``text``: its special token, or the text where the tokenizer has none."""
    token = special_token(tokenizer, text)
    return json.dumps(text) if token is None else f"<[{token}]>"


def _arguments(text: str):
    """A call's arguments as templates want them: the object, or the text as sent if it is not a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _mistral_id(call_id: str) -> str:
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"
