"""Structured output through the server: chat's response_format (json_schema, json_object) through the official
client, whole and streamed, on the base model and an adapter; vLLM's guided_* extras on completions; a schema or
field the engine cannot take is a 400 naming it; the spec is derived once per request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.server.test_errors import BASE, check_error

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def ask(q):
    return [{"role": "user", "content": q}]


def person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("model,temperature", [(BASE, 0.0), ("demo-r8", 0.8)])
def test_response_format_json_schema_whole_and_streamed(live, model, temperature):
    client = live.openai()
    kw = dict(model=model, messages=ask("Describe a person as JSON."), max_tokens=60, temperature=temperature,
              seed=7, response_format=person_format())
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text     # seeded: the same
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_response_format_json_object(live):
    r = live.openai().chat.completions.create(model=BASE, messages=ask("Give a JSON object with a colour."),
                                              max_tokens=40, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":        # complete within the budget: an object
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_guided_extras_on_completions(live):
    client = live.openai()
    r = client.completions.create(model=BASE, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="demo-r16", prompt="A date:", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].text)
    r = client.chat.completions.create(model=BASE, messages=ask("A person, as JSON."), max_tokens=60, temperature=0,
                                       extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("route,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),                                                  # no name
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "start: ???"}, "guided_grammar"),
])
def test_a_spec_that_cannot_compile_is_400_naming_the_field(live, route, extra, param):
    body = {"model": BASE, "max_tokens": 4, **extra}
    body.update({"messages": ask("Hi")} if "chat" in route else {"prompt": "Hi"})
    with live.http() as h:
        check_error(h.post(route, json=body), 400, param)


def test_the_spec_is_derived_once_per_request(live, monkeypatch):
    """A request's structured output is derived once, for all its prompts and choices (chat: response_format;
    completions: guided_*), and the answers follow it."""
    from vlora.server import protocol as P

    derived = []
    for cls in (P.SamplingRequest, P.ChatCompletionRequest):
        def guided(self, original=cls.__dict__["guided"], name=cls.__name__):
            derived.append(name)
            return original(self)
        monkeypatch.setattr(cls, "guided", guided)
    client = live.openai()
    r = client.chat.completions.create(model=BASE, messages=ask("A person, as JSON."), max_tokens=60, temperature=0,
                                       response_format=person_format())
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert derived == ["ChatCompletionRequest"]
    derived.clear()
    r = client.completions.create(model=BASE, prompt=["Yes or no?", "Is it?", "Well?"], n=2, max_tokens=4,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert len(r.choices) == 6 and {c.text for c in r.choices} <= {"yes", "no"}
    assert derived == ["SamplingRequest"]
