"""Fuzzing the live server: random bodies built from the request schemas, valid and invalid, with numeric
extremes, unicode (lone surrogates too), nesting and wrong types. After every body: no 5xx, a 4xx has OpenAI's
error shape, a 200 has the route's shape, /health is 200. At the end: no KV page held and the fixed greedy
answer unchanged. Valid generation bodies ask for at most 3 tokens, so a few hundred examples stay quick."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import ADAPTERS, EXTRA

BASE = "SmolLM2-135M-Instruct"
FIXED = [{"role": "user", "content": "What is 2 + 2?"}]
SURROGATES = ["\ud800", "a\udfffb", "\udbff"]

INTS = st.one_of(st.integers(-3, 20), st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, -2**70,
                                                       10**12, 49151, 49152]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, 1e-300, 5e-324, 1e-5, 0.5, 1.0, 2.0, 2.0000001, -0.0, 1e308]))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(SURROGATES),
                 st.text(max_size=5).map(lambda s: s + "\x00"), st.just("\u202e\ufeff\U0001f600"))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
NESTED = st.integers(1, 5_000).map(lambda d: "[" * d + "]" * d)     # raw JSON text, spliced in below
VOCAB = 49152
GOOD_TEXT = st.text(max_size=40)                  # any unicode but lone surrogates
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": st.one_of(GOOD_TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": GOOD_TEXT}), min_size=1, max_size=2))})
RARELY = st.sampled_from([False] * 14 + [True])     # (an integer draw would favour its bounds)
SMALL = st.integers(1, 3)           # a valid token limit: a fuzzed request must not generate for long
VALID = {   # field -> a valid value
    "model": st.sampled_from([BASE, *ADAPTERS]), "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "prompt": st.one_of(GOOD_TEXT.filter(bool), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                        st.lists(GOOD_TEXT.filter(bool), min_size=1, max_size=3),        # a list of prompts
                        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), min_size=1, max_size=3)),
    "max_tokens": SMALL, "max_completion_tokens": SMALL,
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-300, 5e-324, 1e-5])),
    "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(-1, 2**70), "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 2), "stop": st.one_of(GOOD_TEXT.filter(bool), st.lists(GOOD_TEXT.filter(bool), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3), "min_tokens": st.integers(0, 3),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "user": GOOD_TEXT, "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0, 10, exclude_min=True),
    "min_p": st.floats(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
}
ROUTE_VALID = {     # fields whose meaning differs by route: route -> field -> a valid value
    "chat": {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "add_generation_prompt": st.booleans(),
             "continue_final_message": st.booleans(),
             "chat_template_kwargs": st.dictionaries(st.one_of(st.sampled_from(["enable_thinking", "bos_token",
                                                                                "tokenize", "messages"]), TEXT),
                                                     JSON, max_size=2)},
    "completions": {"logprobs": st.integers(0, 20), "echo": st.booleans(), "best_of": st.integers(1, 3)},
}
PATH = st.one_of(st.sampled_from(["late-r8", "../late-r8", "/etc", "late-r8\x00", "file:///late-r8", "nope",
                                  "", "a" * 300]), TEXT)
ROUTES = {"chat": ("/v1/chat/completions", ["model", "messages"], ["max_tokens", "max_completion_tokens"]),
          "completions": ("/v1/completions", ["model", "prompt", "max_tokens"], [])}
OPTIONAL = sorted(set(VALID) - {"model", "messages", "prompt", "max_tokens", "max_completion_tokens"})


@st.composite
def request(draw):
    """(route, body as JSON text, content type): a valid body, or one with a few fields made anything
    (wrong type, numeric extreme, lone surrogate, nesting), an unknown field (ignored), or deep nesting."""
    route = draw(st.sampled_from(["chat"] * 5 + ["completions"] * 4 + ["load", "unload", "junk"]))
    if route == "junk":
        return "/v1/chat/completions", draw(st.one_of(JSON.map(json.dumps), NESTED, st.text(max_size=50))), \
            "application/json"
    if route == "load":
        path = "/v1/load_lora_adapter"
        body = {"lora_name": draw(TEXT.filter(lambda s: s not in ADAPTERS and s != BASE)), "lora_path": draw(PATH)}
    elif route == "unload":
        path = "/v1/unload_lora_adapter"
        body = {"lora_name": draw(TEXT.filter(lambda s: s not in ADAPTERS and s not in EXTRA))}
    else:
        path, required, limits = ROUTES[route]
        valid = {**VALID, **ROUTE_VALID[route]}
        optional = OPTIONAL + limits[1:] + sorted(ROUTE_VALID[route])
        fields = required + limits[:1] + draw(st.lists(st.sampled_from(optional), max_size=4, unique=True))
        body = {name: draw(valid[name]) for name in fields}
        if body.get("stream") and draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
        # about 3 in 7 bodies stay valid; the others get one to three fields made anything
        mutated = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))
        for name in draw(st.lists(st.sampled_from(sorted(body)), min_size=mutated, max_size=mutated, unique=True)):
            if name in limits + ["max_tokens"]:
                body[name] = draw(st.sampled_from([0, -1, 2**63, 2**70, 10**12, 1.5, "2", True, None, [], {}]))
            else:
                body[name] = draw(st.one_of(INTS, FLOATS, TEXT, JSON))
        if body.get("max_tokens", 0) is None and body.get("max_completion_tokens") not in (1, 2, 3):
            body["max_tokens"] = 0                      # null would let a valid body generate to the context
    if draw(RARELY):                                                   # an unknown or misspelled field
        body[draw(st.one_of(TEXT, st.sampled_from(["temprature", "prompt", "messages"])))] = draw(JSON)
    text = json.dumps(body)          # \\u escapes: lone surrogates travel as valid JSON; NaN / Infinity as such
    if draw(RARELY):                                                   # deep nesting inside a real body
        text = text[:-1] + ', "metadata": ' + draw(NESTED) + "}"
    content_type = draw(st.sampled_from(["application/json"] * 12 + ["text/plain", "application/json; charset=utf-8"]))
    return path, text, content_type


def _stream_ok(text: str) -> bool:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return bool(events) and events[-1] == "[DONE]" and not any('"error"' in e[:20] for e in events[:-1])


@pytest.mark.timeout(600)
def test_random_bodies_never_break_the_server(live, ref):
    loaded: list[str] = []
    with live.http() as h:

        @settings(max_examples=100, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(request())
        def one(req):
            path, text, content_type = req
            r = h.post(path, content=text.encode("utf-8", "surrogatepass"), headers={"Content-Type": content_type})
            assert r.status_code < 500, (path, text[:300], r.text[:300])
            if r.status_code == 200:
                if r.headers["content-type"].startswith("text/event-stream"):
                    assert _stream_ok(r.text), r.text[-300:]
                elif path == "/v1/load_lora_adapter":
                    loaded.append(r.json()["lora_name"])
                elif path == "/v1/unload_lora_adapter":       # one a load of this run registered
                    assert json.loads(text)["lora_name"] in loaded, text[:300]
                else:
                    assert r.json()["choices"], r.text[:300]
            else:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert len(err["message"]) <= 2100
            assert h.get("/health").status_code == 200

        one()
        for name in set(loaded) & live.async_engine.adapter_names:   # leave the adapters as the other tests expect
            assert h.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
        live.wait_idle()
        assert live.engine.allocator.num_free == live.engine.allocator.num_blocks
        [want] = ref.chat([(FIXED, None)], 4, temperature=0.0)
        r = h.post("/v1/chat/completions", json={"model": BASE, "messages": FIXED, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
