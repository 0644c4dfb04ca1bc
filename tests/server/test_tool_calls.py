"""Tool calling through the official client against the live server on the embedded SmolLM2 (whose template shows
no tools: they reach it in the system message, Hermes format): every tool_choice mode whole and streamed, forced
calls whose arguments validate against their tool's schema, tool results in the history, and each refusal with
its status and field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.test_errors import BASE, check_error
from vlora.engine.guided import Grammars
from vlora.server import protocol as P
from vlora.server import tools as T
from vlora.server.tool_calls import ToolCall, parse_answer, parser_for

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
N = 48          # tokens per answer: a forced call fits in it


def create(live, stream: bool, **kw):
    """(content, tool calls as [(id, name, arguments)], finish reason) of one answer, whole or streamed (the
    stream's deltas put together as OpenAI's clients do)."""
    kw = {"model": BASE, "messages": ASK, "max_tokens": N, "temperature": 0, **kw}
    client = live.openai()
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        assert choice.message.role == "assistant"
        return choice.message.content, calls, choice.finish_reason
    content, calls, finishes = "", {}, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.id is not None:                # a call's first delta: id, type and name
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                calls[d.index][2] += d.function.arguments or ""
        if choice.finish_reason is not None:
            finishes.append(choice.finish_reason)
    assert len(finishes) == 1, finishes             # the last chunk, once
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finishes[0]


def check_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_calls_tools_with_valid_arguments(live):
    """Parallel calls allowed (the default): one or more calls, each complete one valid (the model may go on
    calling until max_tokens)."""
    content, calls, finish = create(live, False, tools=TOOLS, tool_choice="required")
    check_calls(calls)
    assert content is None and finish in ("tool_calls", "length")


def test_required_one_call_streamed(live):
    content, calls, finish = create(live, True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    check_calls(calls)
    assert len(calls) == 1 and content is None and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_the_one_called(live, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = create(live, stream, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    check_calls(calls, names=("get_time",))
    assert len(calls) == 1 and content is None and finish == "tool_calls"


def test_auto_answers_text_or_calls(live):
    """The model decides: either way the answer is well-formed, and whole and streamed agree (greedy)."""
    whole = create(live, False, tools=TOOLS, max_tokens=24)
    content, calls, finish = create(live, True, tools=TOOLS, max_tokens=24)
    if calls:
        assert finish in ("tool_calls", "length")
        for _, name, arguments in calls:
            assert name and isinstance(json.loads(arguments), dict)
    else:
        assert isinstance(content, str) and finish in ("stop", "length")
    assert (content, [c[1:] for c in calls], finish) == (whole[0], [c[1:] for c in whole[1]], whole[2])


def test_none_answers_as_without_tools(live):
    plain = create(live, False, max_tokens=6)
    assert create(live, False, tools=TOOLS, tool_choice="none", max_tokens=6) == plain
    assert create(live, True, tools=TOOLS, tool_choice="none", max_tokens=6) == plain


def test_a_request_without_tools_skips_their_check(live, monkeypatch):
    """No tools and no tool_choice: nothing to check, so no hop to a worker for it; the answer is the same as
    with tool_choice none, which is checked."""
    checked, check = [], T.check
    monkeypatch.setattr(T, "check", lambda req, guided: checked.append(req.tool_choice) or check(req, guided))
    plain = create(live, False, max_tokens=6)
    assert checked == []
    assert create(live, False, tool_choice="none", max_tokens=6) == plain
    assert checked == ["none"]


def test_tool_results_in_the_history(live):
    """An assistant turn that called a tool (content null) and the tool's result: accepted, rendered (the prompt
    grows by them), answered, whole and streamed."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    client = live.openai()
    short = client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=BASE, messages=history, tools=TOOLS, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 20
    assert create(live, True, messages=history, max_tokens=2)[2] == "length"


def _chat(**kw):
    return {"model": BASE, "messages": ASK, "max_tokens": 4, **kw}


def _tool(name="f", parameters=None):
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


@pytest.mark.parametrize("body,param,contains", [
    (_chat(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name",
     "missing"),
    (_chat(tools=[_tool("has space")]), "tools[0].function.name", "pattern"),
    (_chat(tools=[_tool(parameters={"type": "string"})]), "tools[0].function.parameters", "type object"),
    (_chat(tools=[_tool(parameters={"type": "object", "properties": {"a": {"type": "frob"}}})]),
     "tools[0].function.parameters", "cannot be compiled"),
    (_chat(tools=[_tool(), _tool()]), "tools[1].function.name", "two tools"),
    (_chat(tools=[{"type": "retrieval"}]), "tools[0].type", ""),
    (_chat(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice",
     "not one of the tools"),
    (_chat(tool_choice="required"), "tool_choice", "needs tools"),
    (_chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "needs tools"),
    (_chat(tools=[_tool()], tool_choice="always"), "tool_choice", ""),
    (_chat(tools=[_tool()], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined"),
    (_chat(messages=ASK + [{"role": "tool", "content": "21"}]), "messages[1].tool_call_id", "missing"),
    (_chat(messages=[{"role": "user", "content": None}]), "messages[0].content", "missing"),
    (_chat(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "messages[0].tool_call_id", "only"),
    (_chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                           "function": {"name": "f"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "missing"),
])
def test_bad_tools_are_400_naming_the_field(live, body, param, contains):
    with live.http() as h:
        check_error(h.post("/v1/chat/completions", json=body), 400, param, contains)
        assert h.get("/health").status_code == 200


def test_refusals_reach_the_client_with_their_field(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.openai().chat.completions.create(model=BASE, messages=ASK, max_tokens=4, tools=TOOLS,
                                              tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.status_code == 400 and e.value.body["param"] == "tool_choice"
    live.wait_idle()
    content, calls, _ = create(live, False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    check_calls(calls)          # the server is unharmed


@pytest.mark.parametrize("parser,template,text", [
    ("hermes", None, '<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>'),
    ("llama3_json", None, '{"name":"get_time","parameters":{"zone":"UTC"}}'),
    ("mistral", None, '[TOOL_CALLS][{"name":"get_time","arguments":{"zone":"UTC"}}]'),
    ("mistral", "{{ '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}", '[TOOL_CALLS]get_time[ARGS]{"zone":"UTC"}'),
])
def test_each_format_grammar_takes_its_calls_and_the_parser_reads_them(setup, parser, template, text):
    """The forced-call grammar of each format (mistral's as the template writes calls), on a real tokenizer
    (mistral's tags as special tokens), takes that format's call to its end, and the parser reads the answer's
    text (special tokens left out) back."""
    from transformers import AutoTokenizer

    from vlora.models.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    marker = T.special_token(tok, "[TOOL_CALLS]")
    req = P.ChatCompletionRequest.model_validate({"model": BASE, "messages": ASK, "tools": TOOLS,
                                                  "tool_choice": "required", "parallel_tool_calls": False})
    guide = Grammars(tok, len(tok), (tok.eos_token_id,)).compile(T.grammar(req, parser, T.mistral_tags(tok, template)))
    ids = tok.encode(text, add_special_tokens=False)
    assert (marker in ids) is (parser == "mistral")
    assert all(not guide.advance(t) for t in ids[:-1]) and guide.advance(ids[-1])      # complete at the last token
    answer = tok.decode(ids, skip_special_tokens=True)
    assert parse_answer(parser_for(parser), answer) == (None, [ToolCall("get_time", '{"zone": "UTC"}')])
