"""Tool calls without a server: each family's parser on literal answers, whole and streamed character by character
(the same content and calls either way; long answers too, each character read a bounded number of times), the
parser a model gets, the history and tools as each family's template renders them (small templates in the
families' formats), and the forced-call grammars."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from llguidance import LLMatcher

from vlora.engine.guided import grammar_text
from vlora.server import protocol as P
from vlora.server import tools as T
from vlora.server.templates import compile_template
from vlora.server import tool_calls
from vlora.server.tool_calls import ToolCall, ToolStream, parse_answer, parser_for

CITY = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", "{}")
CALL_WITH_NOTE = ToolCall("get_weather", '{"city": "Paris", "note": "}"}')

# (parser, answer, content, calls)
ANSWERS = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [CITY]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.\n", [CITY, TIME]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None, [CITY]),  # unclosed
    ("hermes", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ("hermes", "a <b> c < d <tool", "a <b> c < d <tool", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [CITY]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [CITY]),
    ("llama3_json", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     None, [CITY, TIME]),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),                             # JSON, not a call
    ("llama3_json", '{"name": "get_time", "parameters": {}} and more', '{"name": "get_time", "parameters": {}} and more',
     []),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', None, [CITY, TIME]),
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [CITY]),     # marker left out
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "Sure. ", [TIME]),
    ("mistral", "[1] is a footnote.", "[1] is a footnote.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}', '[TOOL_CALLS][{"name": "get_time", "arguments": {}}',
     []),                                                                                       # cut short
    # mistral from tokenizer v11 on: name[ARGS]{...}, one call per marker
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [CITY]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None, [CITY, TIME]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}\n[TOOL_CALLS]get_time[ARGS]{}',
     None, [CITY, TIME]),
    ("mistral", 'Let me look. [TOOL_CALLS]get_time[ARGS]{}', "Let me look. ", [TIME]),
    ("mistral", ' get_weather{"city": "Paris"}get_time{}', None, [CITY, TIME]),                  # tags left out
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', None, [CITY]),                     # [ARGS] left out
    ("mistral", '[TOOL_CALLS]note[ARGS]{"text": "} \\" {", "n": {"m": []}}', None,             # braces in strings
     [ToolCall("note", '{"text": "} \\" {", "n": {"m": []}}')]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{city}', None, [TIME]),  # before a bad one
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{zone: UTC}", "[TOOL_CALLS]get_time[ARGS]{zone: UTC}", []),  # bad JSON
    ("mistral", "[TOOL_CALLS]get_time[ARGS][]", "[TOOL_CALLS]get_time[ARGS][]", []),           # not an object
    ("mistral", "[TOOL_CALLS]get time[ARGS]{}", "[TOOL_CALLS]get time[ARGS]{}", []),           # not a name
    ("mistral", "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", []),                           # no name
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"', '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"', []),  # cut
    ("mistral", "Paris is sunny.", "Paris is sunny.", []),
    ("mistral", "Sunny{ish} in Paris.", "Sunny{ish} in Paris.", []),
]


@pytest.mark.parametrize("name,answer,content,calls", ANSWERS)
def test_whole_answers(name, answer, content, calls):
    assert parse_answer(parser_for(name), answer) == (content, calls)


@pytest.mark.parametrize("name,answer,content,calls", ANSWERS)
def test_streams_give_what_whole_answers_give(name, answer, content, calls):
    """Fed a character at a time: no marker character goes out as content, each call goes out once, and the
    content and calls are the whole answer's."""
    stream, sent, got = ToolStream(parser_for(name)), "", []
    for ch in answer:
        text, done = stream.feed(ch)
        sent, got = sent + text, got + done
        assert "<tool_call" not in sent and "[TOOL_CALLS]" not in sent or not calls
    text, done, called = stream.finish()
    sent, got = sent + text, got + done
    assert (sent or None, got, called) == (content, calls, bool(calls))


def _stream(name: str, answer: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of ``answer`` streamed a character at a time."""
    stream, sent, got = ToolStream(parser_for(name)), [], []
    for ch in answer:
        text, done = stream.feed(ch)
        sent.append(text)
        got += done
    text, done, _ = stream.finish()
    return "".join(sent + [text]) or None, got + done


_WORDS = random.Random(0).choices(["Paris", "is", "sunny", "a", "<b>", "<", "[1]", "{x}", ";", "\n", "  "], k=6000)
LONG_TEXT = ("Well: " + " ".join(_WORDS))[:20_000]
LONG_ARGUMENTS = {"notes": "x < y, [z] " * 2_000}                 # 22k characters
LONG_CALLS = {         # a format: its parser and a call in it
    "hermes": ("hermes", f'<tool_call>\n{json.dumps({"name": "note", "arguments": LONG_ARGUMENTS})}\n</tool_call>'),
    "llama3_json": ("llama3_json", json.dumps({"name": "note", "parameters": LONG_ARGUMENTS})),
    "mistral": ("mistral", f'[TOOL_CALLS][{json.dumps({"name": "note", "arguments": LONG_ARGUMENTS})}]'),
    "mistral v11": ("mistral", f"[TOOL_CALLS]note[ARGS]{json.dumps(LONG_ARGUMENTS)}"),
    "mistral v11, tags left out": ("mistral", f"note{json.dumps(LONG_ARGUMENTS)}"),
}
LEADING_ONLY = {"llama3_json", "mistral v11, tags left out"}      # formats whose calls begin only the answer
MANY_CALLS = {          # formats whose calls go out one by one: 300 calls
    "hermes": "\n".join(f'<tool_call>{{"name": "get_time", "arguments": {{"n": {i}}}}}</tool_call>'
                        for i in range(300)),
    "mistral v11": "".join(f'[TOOL_CALLS]get_time[ARGS]{{"n": {i}}}' for i in range(300)),
}


@pytest.mark.parametrize("label", list(LONG_CALLS))
@pytest.mark.parametrize("kind", ["text", "call", "whitespace then call", "text then call"])
def test_long_streams_give_what_whole_answers_give(label, kind):
    name, call = LONG_CALLS[label]
    answer = {"text": LONG_TEXT, "call": call, "whitespace then call": " \n" * 10_000 + call,
              "text then call": LONG_TEXT + "\n" + call}[kind]
    calls = [ToolCall("note", json.dumps(LONG_ARGUMENTS))]
    want = {"text": (LONG_TEXT, []), "call": (None, calls), "whitespace then call": (None, calls),
            "text then call": (answer, []) if label in LEADING_ONLY else (LONG_TEXT + "\n", calls)}[kind]
    assert parse_answer(parser_for(name), answer) == want
    assert _stream(name, answer) == want


@pytest.mark.parametrize("label", list(LONG_CALLS))
def test_a_stream_reads_each_character_a_bounded_number_of_times(label, monkeypatch):
    """Fed a character at a time, a stream's tag searches read each new character and fewer before it than the
    longest tag holds (where a tag may begin), however long the answer grows; each call of the formats that send
    them one by one is decoded once."""
    read, decoded = [], []
    first, load = tool_calls._first, tool_calls._load

    def counted_first(text, tags):
        read.append(len(text))
        return first(text, tags)

    def counted_load(text):
        decoded.append(text)
        return load(text)

    monkeypatch.setattr(tool_calls, "_first", counted_first)
    monkeypatch.setattr(tool_calls, "_load", counted_load)
    name, call = LONG_CALLS[label]
    answer = LONG_TEXT + " \n" * 5_000 + MANY_CALLS.get(label, call)
    stream, calls = ToolStream(parser_for(name)), []
    for ch in answer:
        calls += stream.feed(ch)[1]
    longest = max(len(t) for t in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"))
    assert sum(read) <= 2 * longest * len(answer)
    assert len(decoded) == len(calls) == (300 if label in MANY_CALLS else 0)


def test_a_call_goes_out_as_soon_as_it_is_complete():
    stream = ToolStream(parser_for("hermes"))
    assert stream.feed('<tool_call>{"name": "get_time", "arguments": {}}') == ("", [])
    assert stream.feed("</tool_call>\n<tool_") == ("", [TIME])
    assert stream.feed('call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>') == ("", [CITY])
    assert stream.finish() == ("", [], True)


@pytest.mark.parametrize("tags", [("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]a1B2c3D4e"), ("", "", "")])
def test_a_mistral_call_goes_out_once_its_arguments_close(tags):
    """Tags written or left out of the text (special tokens): the same calls, each sent once its object closes."""
    marker, args, call_id = tags
    stream = ToolStream(parser_for("mistral"))
    assert stream.feed(f'{marker}get_weather{args}{{"city": "Par') == ("", [])
    assert stream.feed('is", "note": "}"') == ("", [])
    assert stream.feed(f"}}{marker}get_time{call_id}{args}{{") == ("", [CALL_WITH_NOTE])
    assert stream.feed("}") == ("", [TIME])
    assert stream.finish() == ("", [], True)


def test_a_stream_holds_a_leading_word_back_until_it_is_no_function_name():
    stream = ToolStream(parser_for("mistral"))
    assert [stream.feed(d)[0] for d in ("  Hel", "lo", " there", "!")] == ["", "", "  Hello there", "!"]
    assert stream.finish() == ("", [], False)


@pytest.mark.parametrize("configured,model_type,native,want", [
    ("auto", "llama", True, "llama3_json"), ("auto", "qwen2", True, "hermes"), ("auto", "qwen3", True, "hermes"),
    ("auto", "qwen2_5_vl_text", True, "hermes"), ("auto", "mistral", True, "mistral"),
    ("auto", "llama", False, "hermes"), ("auto", "mistral", False, "hermes"), ("auto", None, False, "hermes"),
    ("mistral", "llama", False, "mistral"), ("llama3_json", "qwen2", True, "llama3_json"),
])
def test_the_parser_follows_the_family_and_the_flag(configured, model_type, native, want):
    assert T.choose_parser(configured, model_type, native) == want


# -- templates ----------------------------------------------------------------------------------------------------
# small templates in each family's format (tools shown, calls with their arguments as objects, results)
LLAMA3 = """{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}{% for m in messages %}{% if m.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}\
{% endfor %}<|eot_id|>{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{% endif %}{% endfor %}\
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
QWEN = """{% if tools %}<|im_start|>system
# Tools
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MISTRAL = """{{ bos_token }}{% for m in messages %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}\
[TOOL_CALLS][{% for c in m.tool_calls %}{% if c.id | length != 9 %}{{ raise_exception('ids are 9 characters') }}\
{% endif %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}\
{% endfor %}]</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}, \
"call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"""
MISTRAL_V11 = """{{ bos_token }}{% for m in messages %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}\
{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>\
{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}\
{% endfor %}"""
CHATML = """{% for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_abc", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_abc", "content": "21 C"},
           {"role": "user", "content": "And now?"}]


def request(**kw) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": TOOLS, **kw})


def render(template: str, parser: str, **kw) -> str:
    """The request's conversation as the server hands it to ``template``, rendered."""
    req = request(**kw)
    compiled = compile_template(template)
    draw = lambda conv, tools: compiled.render(messages=conv, tools=tools, bos_token="", add_generation_prompt=True)  # noqa: E731
    native = T.renders_tools(draw)
    tools = T.template_tools(req)
    conv = [{"role": m.role, "content": m.content} for m in req.messages]
    return draw(T.conversation(conv, req.messages, tools, native, parser), tools if native else None)


@pytest.mark.parametrize("template,native", [(LLAMA3, True), (QWEN, True), (MISTRAL, True), (MISTRAL_V11, True),
                                             (CHATML, False)])
def test_the_probe_sees_which_templates_show_tools(template, native):
    compiled = compile_template(template)
    draw = lambda conv, tools: compiled.render(messages=conv, tools=tools, bos_token="", add_generation_prompt=True)  # noqa: E731
    assert T.renders_tools(draw) is native


def test_llama3_template_gets_tools_and_arguments_as_objects():
    text = render(LLAMA3, "llama3_json")
    assert '"name": "get_weather"' in text and "Environment: ipython" in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text       # an object, not JSON text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 C" in text


def test_qwen_template_gets_tools_calls_and_results():
    text = render(QWEN, "hermes")
    assert text.count("get_weather") == 2 and '"parameters": {"type": "object", "properties": {}}' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text


def test_mistral_template_gets_nine_character_ids():
    text = render(MISTRAL, "mistral")
    [call_id] = {text.split('"id": "')[1][:9], text.split('"call_id": "')[1][:9]}     # one id, both places
    assert call_id.isalnum() and '"call_id": "' + call_id + '"}' in text
    assert "[AVAILABLE_TOOLS]" in text and '"arguments": {"city": "Paris"}' in text


def test_mistral_v11_template_gets_calls_by_name():
    text = render(MISTRAL_V11, "mistral")
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>' in text and "[TOOL_RESULTS]21 C[/TOOL_RESULTS]" in text


def test_a_template_without_tools_gets_them_in_the_system_message():
    text = render(CHATML, "hermes")
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and "<tool_call>" in system
    assert json.dumps(T.template_tools(request())[0]) in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           "</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>" in text


def test_tool_choice_none_shows_no_tools():
    assert "# Tools" not in render(CHATML, "hermes", tool_choice="none")
    assert "get_time" not in render(QWEN, "hermes", tool_choice="none")


# -- forced calls -------------------------------------------------------------------------------------------------
FORMATS = {"hermes": ("hermes", QWEN), "llama3_json": ("llama3_json", LLAMA3), "mistral": ("mistral", MISTRAL),
           "mistral v11": ("mistral", MISTRAL_V11)}         # a format: its parser and a template in it


@pytest.mark.parametrize("label", list(FORMATS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_compile(label, choice, parallel):
    parser, template = FORMATS[label]
    spec = T.grammar(request(tool_choice=choice, parallel_tool_calls=parallel), parser, T.mistral_tags(None, template))
    assert LLMatcher.validate_grammar(grammar_text(spec)) == ""
    assert ("get_weather" in spec.grammar) is (choice == "required")
    key = {"llama3_json": '"parameters"', "mistral v11": '"get_time" "[ARGS]"'}.get(label, '"arguments"')
    assert key in spec.grammar


def test_forced_mistral_calls_are_written_as_the_template_writes_calls():
    """[ARGS] in the template: name[ARGS]{...}; the tags are the tokenizer's special tokens where it has them."""
    assert T.mistral_tags(None, MISTRAL) == T.MistralTags('"[TOOL_CALLS]"', None)          # the JSON array
    assert T.mistral_tags(None, None) == T.MistralTags('"[TOOL_CALLS]"', None)
    assert T.mistral_tags(None, MISTRAL_V11) == T.MistralTags('"[TOOL_CALLS]"', '"[ARGS]"')
    assert T.mistral_tags(None, {"default": CHATML, "tool_use": MISTRAL_V11}).args == '"[ARGS]"'
    tokenizer = SimpleNamespace(added_tokens_decoder={9: SimpleNamespace(content="[TOOL_CALLS]", special=True),
                                                      32: SimpleNamespace(content="[ARGS]", special=True)})
    assert T.mistral_tags(tokenizer, MISTRAL_V11) == T.MistralTags("<[9]>", "<[32]>")


def test_auto_and_none_force_nothing():
    assert T.grammar(request(), "hermes") is None
    assert T.grammar(request(tool_choice="none"), "hermes") is None
