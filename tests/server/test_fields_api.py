"""The request-field policy through the official client: fields nobody defines are ignored and logged once,
OpenAI's and vLLM's fields that vlora does not implement are accepted at their neutral value and refused (400
naming the field, code ``unsupported``) at any other, wrong JSON types are a 400 naming the field, and
docs/server.md lists every field."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import openai
import pytest

from tests.server.test_errors import BASE
from vlora.server import protocol as P

HI = [{"role": "user", "content": "Hi"}]
LOGGED = "ignored request fields this server does not know"


def create(live, route: str, extra: dict, **kw):
    """A greedy 4-token call of ``route`` ("chat" or "completions") with ``extra`` sent as extra_body."""
    client = live.openai()
    kw = {"model": BASE, "max_tokens": 4, "temperature": 0, "extra_body": extra, **kw}
    if route == "chat":
        return client.chat.completions.create(messages=kw.pop("messages", HI), **kw)
    return client.completions.create(prompt="Hi", **kw)


def text(r) -> str:
    return r.choices[0].message.content if r.object == "chat.completion" else r.choices[0].text


def refused(live, route, extra, param, code, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        create(live, route, extra, **kw)
    assert e.value.status_code == 400 and e.value.param == param and e.value.code == code, e.value.body
    assert param.rpartition(".")[2] in e.value.message
    return e.value


def neutral_body(model: type[P.SamplingRequest]) -> dict:
    """Every Known field the route does not declare, at a value that changes nothing."""
    sample = {"boolean": True, "integer": 3, "number": 0.5, "string": "x", "array": ["x"], "object": {"a": 1}}
    return {name: sample[k.type] if k.neutral == P.ANY else (k.neutral[0] if k.neutral else None)
            for name, k in P.VLLM_FIELDS.items() if name not in model.model_fields}


@pytest.mark.parametrize("route,model", [("chat", P.ChatCompletionRequest), ("completions", P.CompletionRequest)])
def test_known_fields_at_their_neutral_values_change_nothing(live, caplog, route, model):
    extra = neutral_body(model)
    assert "use_beam_search" in extra and "prompt_logprobs" in extra
    plain = create(live, route, {})
    with caplog.at_level(logging.WARNING, logger="vlora.server.app"):
        assert text(create(live, route, extra)) == text(plain)
        r = create(live, route, {}, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False,
                                                                  "include_obfuscation": True})
        assert list(r)[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert not [rec for rec in caplog.records if LOGGED in rec.getMessage()]      # known: nothing to warn about


@pytest.mark.parametrize("route,extra,param", [
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"echo": True}, "echo"),                               # completions implement echo
    ("chat", {"best_of": 2}, "best_of"),                            # completions implement best_of
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),     # chat implements it
    ("chat", {"cache_salt": "s3cret"}, "cache_salt"),
    ("completions", {"priority": -1}, "priority"),
    ("chat", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("chat", {"logits_processors": ["my.Processor"]}, "logits_processors"),
    ("chat", {"bad_words": ["no"]}, "bad_words"),
    ("chat", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("chat", {"add_special_tokens": True}, "add_special_tokens"),
])
def test_known_fields_at_other_values_are_400_unsupported(live, route, extra, param):
    refused(live, route, extra, param, "unsupported")


def test_known_nested_fields_at_other_values_are_400_unsupported(live):
    refused(live, "chat", {}, "stream_options.continuous_usage_stats", "unsupported", stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True})


@pytest.mark.parametrize("route,extra,param", [
    ("chat", {"use_beam_search": "yes"}, "use_beam_search"),         # Known fields keep their JSON type
    ("chat", {"use_beam_search": 0}, "use_beam_search"),             # 0 is not false
    ("completions", {"priority": 1.5}, "priority"),
    ("chat", {"cache_salt": 5}, "cache_salt"),
    ("completions", {"length_penalty": "1"}, "length_penalty"),      # any number is neutral; a string is not one
    ("chat", {"top_k": "5"}, "top_k"),                               # declared fields: strict as ever
    ("completions", {"min_tokens": 1.0}, "min_tokens"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_wrong_types_are_400_naming_the_field(live, route, extra, param):
    e = refused(live, route, extra, param, None)
    assert "valid" in e.message


def test_a_wrong_type_inside_stream_options_is_400_naming_it(live):
    refused(live, "chat", {}, "stream_options.continuous_usage_stats", None, stream=True,
            stream_options={"continuous_usage_stats": "no"})


def test_unknown_fields_are_ignored_and_logged_once_per_request(live, caplog):
    plain = create(live, "chat", {})
    messages = [{"role": "user", "content": "Hi", "reasoning_content": "earlier thoughts"}]
    extra = {"temprature": 1.5, "my_extension": {"a": [1, 2]}}
    with caplog.at_level(logging.WARNING, logger="vlora.server.app"):
        assert text(create(live, "chat", extra, messages=messages)) == text(plain)       # nothing changed
        chunks = list(create(live, "chat", extra, stream=True, stream_options={"include_usage": True, "verbose": 1}))
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
        assert len(create(live, "completions", {"sufix": "!"}).choices) == 1
    logged = [rec.getMessage() for rec in caplog.records if LOGGED in rec.getMessage()]
    assert len(logged) == 3, logged                             # one line per request, naming every field
    assert all(f"'{name}'" in logged[0] for name in ("temprature", "my_extension", "messages[0].reasoning_content"))
    assert "'stream_options.verbose'" in logged[1] and "'sufix'" in logged[2]
    assert all(rec.levelno == logging.WARNING for rec in caplog.records if LOGGED in rec.getMessage())


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},   # does not compile
    {"type": "json_schema", "json_schema": {"name": "x", "shcema": {"type": "object"}}},      # a typo stays a 400
    {"type": "json_object", "strict": True},
])
def test_response_format_stays_strict(live, response_format):
    with pytest.raises(openai.BadRequestError) as e:
        live.openai().chat.completions.create(model=BASE, messages=HI, max_tokens=4, response_format=response_format)
    assert e.value.status_code == 400 and e.value.param == "response_format"


def test_the_adapter_routes_still_refuse_unknown_fields(live):
    with live.http() as h:
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "nope", "force": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "force"


def test_the_docs_table_lists_every_field():
    doc = (Path(__file__).parents[2] / "docs" / "server.md").read_text()
    section = doc.split("### Every request field", 1)[1].split("\n#", 1)[0]
    rows = {name for line in section.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([a-z_.]+)`", line.split("|")[1])}
    fields = (set(P.ChatCompletionRequest.model_fields) | set(P.CompletionRequest.model_fields) | set(P.VLLM_FIELDS)
              | {f"stream_options.{k}" for k in [*P.StreamOptions.model_fields, *P.StreamOptions.KNOWN]}) \
        - {"stream_options"}                    # listed key by key
    assert not fields - rows, sorted(fields - rows)
