"""OpenAI's and vLLM's sampling fields through the server: penalties, logit_bias, min_p, logprobs (chat and
completions, whole and streamed), echo and best_of; their ranges; and the token text logprobs carry."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from tests.server.conftest import QUESTIONS
from tests.server.test_errors import BASE, check_error

N = 8           # tokens per answer: short keeps the suite quick
PROMPT = "The three primary colours are"


def user(q):
    return [{"role": "user", "content": q}]


def chat(**kw):
    return {"model": BASE, "messages": user("Hi"), "max_tokens": 2, **kw}


def comp(**kw):
    return {"model": BASE, "prompt": "Hi", "max_tokens": 2, **kw}


def post(live, route, body):
    with live.http() as h:
        r = h.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(live, route, body) -> list[dict]:
    with live.http() as h, h.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


# -- validation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", chat(frequency_penalty=2.5), "frequency_penalty"),
    ("/v1/chat/completions", chat(frequency_penalty=-2.01), "frequency_penalty"),
    ("/v1/chat/completions", chat(presence_penalty=3), "presence_penalty"),
    ("/v1/chat/completions", chat(presence_penalty="1"), "presence_penalty"),
    ("/v1/chat/completions", chat(repetition_penalty=0), "repetition_penalty"),
    ("/v1/chat/completions", chat(repetition_penalty=-1.0), "repetition_penalty"),
    ("/v1/chat/completions", chat(min_p=1.5), "min_p"),
    ("/v1/chat/completions", chat(min_p=-0.1), "min_p"),
    ("/v1/chat/completions", chat(logit_bias={"abc": 1}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"-1": 1}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"+5": 1}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"1" * 30: 1}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"5": 100.5}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"5": -101}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"5": "1"}), "logit_bias.5"),
    ("/v1/chat/completions", chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"5": 1, "05": 2}), "logit_bias"),       # one token named twice
    ("/v1/chat/completions", chat(logprobs=1), "logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),                    # without logprobs
    ("/v1/chat/completions", chat(logprobs=False, top_logprobs=2), "top_logprobs"),
    ("/v1/completions", comp(logprobs=21), "logprobs"),
    ("/v1/completions", comp(logprobs=-1), "logprobs"),
    ("/v1/completions", comp(logprobs=True), "logprobs"),
    ("/v1/completions", comp(echo="yes"), "echo"),
    ("/v1/completions", comp(best_of=0), "best_of"),
    ("/v1/completions", comp(best_of=17), "best_of"),
    ("/v1/completions", comp(best_of=2, n=3), "best_of"),
    ("/v1/completions", comp(best_of=3, stream=True), "best_of"),
    ("/v1/completions", comp(frequency_penalty=2.5), "frequency_penalty"),
    ("/v1/completions", comp(min_p=2), "min_p"),
    ("/v1/completions", comp(logit_bias={"x": 1}), "logit_bias"),
])
def test_values_out_of_range_are_400_naming_the_field(live, route, body, param):
    with live.http() as h:
        check_error(h.post(route, json=body), 400, param)


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", chat(logit_bias={"1000000000": 5})),
                                        ("/v1/completions", comp(logit_bias={"49152": -5}))])
def test_logit_bias_ids_outside_the_vocabulary_are_400(live, route, body):
    with live.http() as h:
        err = check_error(h.post(route, json=body), 400, "logit_bias", "outside the vocabulary")
    assert err["code"] == "invalid_token_id"


@pytest.mark.parametrize("field,value", [("repetition_penalty", "Infinity"), ("min_p", "NaN"),
                                         ("presence_penalty", "1e999")])
def test_new_numbers_must_be_finite(live, field, value):
    raw = json.dumps(chat())[:-1] + f', "{field}": {value}}}'
    with live.http() as h:
        check_error(h.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}),
                    400, field, "finite")


def test_every_field_is_accepted_at_its_limits(live):
    sampling = dict(frequency_penalty=-2, presence_penalty=2.0, repetition_penalty=1.3, min_p=1, top_k=-1,
                    logit_bias={"0": -100, "42": 100.0, "49151": 0})
    r = post(live, "/v1/chat/completions", chat(**sampling, logprobs=True, top_logprobs=20))
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    r = post(live, "/v1/chat/completions", chat(**sampling, logprobs=False, top_logprobs=None))
    assert r["choices"][0]["logprobs"] is None
    r = post(live, "/v1/completions", comp(**sampling, logprobs=20, echo=True, best_of=16, n=16, seed=1))
    assert len(r["choices"]) == 16
    r = post(live, "/v1/completions", comp(logprobs=0, echo=False, best_of=1, min_p=0, repetition_penalty=1))
    assert len(r["choices"]) == 1


def test_best_of_equal_to_n_may_stream(live):
    chunks = stream(live, "/v1/completions", comp(best_of=2, n=2, temperature=1, seed=3))
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}


# -- chat logprobs ---------------------------------------------------------------------------------------
def test_chat_logprobs_shape(live, ref):
    """top_logprobs=3 on a greedy answer: every token with its text, bytes, logprob <= 0 and three
    alternatives, most likely first, the chosen one first among them (logprobs are the raw distribution)."""
    q = QUESTIONS[0]
    r = post(live, "/v1/chat/completions", {"model": "demo-r8", "messages": user(q), "max_tokens": N,
                                             "temperature": 0, "logprobs": True, "top_logprobs": 3})
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] >= 1
    [want] = ref._run([(q, "demo-r8")], N, {"temperature": 0.0, "logprobs": 3}, chat=True)
    assert [c["token"] for c in content] == [ref.llm.tokenizer.decode([t]) for t in want.token_ids]
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"}
        assert c["logprob"] <= 0 and all(0 <= b < 256 for b in c["bytes"])
        top = c["top_logprobs"]
        assert len(top) == 3 and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["token"] == c["token"] and math.isclose(top[0]["logprob"], c["logprob"], abs_tol=1e-5)
    text = b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", "replace")
    assert choice["message"]["content"] in text      # the answer, and (finished) the end-of-turn token after it


def test_chat_logprobs_through_the_official_client(live):
    r = live.openai().chat.completions.create(model=BASE, messages=user(QUESTIONS[3]), max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    r = live.openai().chat.completions.create(model=BASE, messages=user(QUESTIONS[3]), max_tokens=4, temperature=0,
                                              logprobs=True)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)     # logprobs alone: no alternatives


def test_chat_streamed_logprobs_equal_the_whole_answers(live):
    body = {"model": "demo-r16", "messages": user(QUESTIONS[2]), "max_tokens": N, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    whole = post(live, "/v1/chat/completions", body)["choices"][0]
    chunks = stream(live, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["logprobs"] is None                  # the role chunk
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert len(streamed) == N
    _same_entries(streamed, whole["logprobs"]["content"])
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == \
        whole["message"]["content"]


def test_chat_without_logprobs_has_null_logprobs(live):
    r = post(live, "/v1/chat/completions", chat())
    assert r["choices"][0]["logprobs"] is None
    assert all(ch["logprobs"] is None for c in stream(live, "/v1/chat/completions", chat()) for ch in c["choices"])


# -- completions logprobs, echo, best_of -----------------------------------------------------------------
def test_completions_logprobs_shape(live):
    r = post(live, "/v1/completions", {"model": "demo-r4", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                       "logprobs": 2, "ignore_eos": True})
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == N
    assert all(x <= 0 for x in lp["token_logprobs"])
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 2 <= len(top) <= 3 and top[token] == chosen       # the alternatives and the chosen token
        assert max(top.values()) == next(iter(top.values()))     # most likely first
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"]))
    if "\ufffd" not in "".join(lp["tokens"]):
        assert "".join(lp["tokens"]) == choice["text"]


def test_completions_streamed_logprobs_equal_the_whole_answer(live):
    body = {"model": "demo-r4", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    whole = post(live, "/v1/completions", body)["choices"][0]["logprobs"]
    parts = [ch["logprobs"] for c in stream(live, "/v1/completions", body) for ch in c["choices"] if ch["logprobs"]]
    joined = {k: [x for p in parts for x in p[k]] for k in whole}
    assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
    assert [list(t) for t in joined["top_logprobs"]] == [list(t) for t in whole["top_logprobs"]]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(joined["token_logprobs"], whole["token_logprobs"]))


def test_echo_returns_the_prompt_and_its_logprobs(live):
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    r = post(live, "/v1/completions", body)
    choice, usage = r["choices"][0], r["usage"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][:usage["prompt_tokens"]]) == PROMPT
    chunks = stream(live, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT) and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]


def test_echo_of_a_token_prompt_and_without_logprobs(live, ref):
    ids = ref.llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    r = post(live, "/v1/completions", {"model": BASE, "prompt": ids, "max_tokens": 3, "temperature": 0,
                                       "echo": True})
    assert r["choices"][0]["text"].startswith(PROMPT) and r["choices"][0]["logprobs"] is None


def test_best_of_answers_the_most_likely_candidates(live, ref):
    """best_of=3, n=1: one choice, the candidate (seed + i) of highest cumulative logprob; usage counts all three;
    no logprobs in the answer, since none were asked for."""
    body = {"model": "demo-r8", "prompt": PROMPT, "max_tokens": N, "temperature": 1.0, "seed": 11, "best_of": 3}
    r = post(live, "/v1/completions", body)
    assert len(r["choices"]) == 1 and r["choices"][0]["index"] == 0 and r["choices"][0]["logprobs"] is None
    candidates = [ref._run([(PROMPT, "demo-r8")], N, {"temperature": 1.0, "seed": 11 + i, "logprobs": 0},
                           chat=False)[0] for i in range(3)]
    best = max(candidates, key=lambda o: o.cumulative_logprob)
    assert r["choices"][0]["text"] == best.text
    assert r["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in candidates)
    r = post(live, "/v1/completions", {**body, "n": 2, "logprobs": 0})
    assert len(r["choices"]) == 2 and all(c["logprobs"] for c in r["choices"])
    ranked = sorted(candidates, key=lambda o: o.cumulative_logprob, reverse=True)
    assert [c["text"] for c in r["choices"]] == [o.text for o in ranked[:2]]


# -- penalties, bias, min_p ------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens(live, ref):
    forced = ref.llm.tokenizer.encode(" blue", add_special_tokens=False)[0]
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = post(live, "/v1/completions", {**body, "logit_bias": {str(forced): 100}})
    assert r["choices"][0]["text"] == ref.llm.tokenizer.decode([forced] * 4)
    [plain] = ref._run([(PROMPT, None)], 4, {"temperature": 0.0, "ignore_eos": True}, chat=False)
    first = plain.token_ids[0]
    banned = post(live, "/v1/completions", {**body, "logit_bias": {str(first): -100}})["choices"][0]["text"]
    assert not banned.startswith(ref.llm.tokenizer.decode([first]))


@pytest.mark.parametrize("sampling", [
    {"frequency_penalty": 1.5}, {"presence_penalty": -2.0}, {"repetition_penalty": 1.8},
    {"temperature": 1.0, "seed": 5, "min_p": 0.3},
    {"temperature": 0.8, "seed": 9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5},
])
def test_sampling_fields_answer_as_the_offline_engine(live, ref, sampling):
    """Each field reaches the engine as sent: the answer equals the offline engine's with the same parameters."""
    sampling = {"temperature": 0.0, **sampling}
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": N, **sampling}
    [want] = ref.complete([(PROMPT, None)], N, **sampling)
    [without] = ref.complete([(PROMPT, None)], N, **{k: sampling[k] for k in ("temperature", "seed") if k in sampling})
    assert want != without          # the fields change this answer, so the server must have passed them on
    assert post(live, "/v1/completions", body)["choices"][0]["text"] == want


# -- token text ------------------------------------------------------------------------------------------
def test_token_text_and_bytes(ref):
    """A token holding part of a character shows as the replacement character, with its own bytes, so the
    bytes of a character's tokens join back into it; a model without a tokenizer names tokens by id."""
    from vlora.server.logprobs import TokenTexts
    from vlora.server.workers import HeavyWork

    def in_worker(tokenizer, ids):
        async def run():
            return [await work.run(texts.get, t) for t in ids]
        work = HeavyWork(tokenizer, workers=1)
        texts = TokenTexts(work)
        try:
            return asyncio.run(run())
        finally:
            work.shutdown()

    ids = ref.llm.tokenizer.encode("é😀 blue", add_special_tokens=False)
    got = in_worker(ref.llm.tokenizer, ids)
    assert b"".join(raw for _, raw in got) == "é😀 blue".encode()
    assert any(text == "\ufffd" for text, _ in got)        # the emoji is split over tokens
    assert got[-1] == (" blue", b" blue")
    assert in_worker(None, [7]) == [("token_id:7", None)]


def _same_entries(a: list[dict], b: list[dict]) -> None:
    assert [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in a] == \
        [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in b]
    assert all(math.isclose(x["logprob"], y["logprob"], abs_tol=1e-5) for x, y in zip(a, b))
