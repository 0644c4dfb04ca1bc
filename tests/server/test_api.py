"""The OpenAI routes through the official client: answers equal the offline API's, adapters by `model`."""

from __future__ import annotations

import json
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ADAPTERS, API_KEY, QUESTIONS

N = 12          # tokens per answer: short keeps the suite quick


def user(q):
    return [{"role": "user", "content": q}]


def test_models_lists_the_base_model_and_every_adapter(live):
    models = live.openai().models.list().data
    base = live.engine.model_name
    assert [m.id for m in models] == [base, *sorted(ADAPTERS)]
    assert models[0].owned_by == "vlora"
    assert all(m.parent == base and m.object == "model" for m in models[1:])
    with live.http() as h:
        cards = h.get("/v1/models").json()["data"]
    assert "parent" not in cards[0]                 # vlora's extra fields appear only when they hold something
    context = live.server_state.context_len
    assert context > 0 and all(c["max_model_len"] == context for c in cards)


def test_chat_answers_equal_the_offline_api_for_every_adapter(live, ref):
    client = live.openai()
    names = [live.engine.model_name, *ADAPTERS]
    jobs = [(q, a) for q in QUESTIONS[:3] for a in names]
    expected = ref.chat(jobs, N, temperature=0.0)
    for (q, a), want in zip(jobs, expected):
        r = client.chat.completions.create(model=a, messages=user(q), max_tokens=N, temperature=0)
        assert r.choices[0].message.content == want, (q, a)
        assert r.model == a and r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length")
        u = r.usage
        assert u.completion_tokens <= N and u.total_tokens == u.prompt_tokens + u.completion_tokens
    by_adapter = {a: [w for (_, a2), w in zip(jobs, expected) if a2 == a] for a in names}
    assert len({tuple(v) for v in by_adapter.values()}) > 1          # adapters change the answers


def test_chat_stream_equals_the_whole_answer_and_reports_usage(live, ref):
    q, adapter = QUESTIONS[1], "demo-r16"
    [want] = ref.chat([(q, adapter)], N, temperature=0.0)
    chunks = list(live.openai().chat.completions.create(
        model=adapter, messages=user(q), max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1


def test_sse_framing_ends_with_done(live):
    body = {"model": "demo-r8", "messages": user("Hi"), "max_tokens": 4, "temperature": 0, "stream": True}
    with live.http() as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(e[6:]) or json.loads(e[6:])["usage"] is None for e in events[:-1])


def test_completions_string_and_token_prompts(live, ref):
    client = live.openai()
    prompt = "The three primary colours are"
    [want] = ref.complete([(prompt, "demo-r4")], N, temperature=0.0)
    r = client.completions.create(model="demo-r4", prompt=prompt, max_tokens=N, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    ids = ref.llm.tokenizer.encode(prompt, add_special_tokens=False)
    r2 = client.completions.create(model="demo-r4", prompt=ids, max_tokens=N, temperature=0)
    assert r2.choices[0].text == want and r2.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model="demo-r4", prompt=prompt, max_tokens=N, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_token_id_prompt_streams_chunks_with_their_token_ids(live, ref):
    prompt = "The three primary colours are"
    [want] = ref._run([(prompt, "demo-r4")], N, {"temperature": 0.0, "ignore_eos": True}, chat=False)
    ids = ref.llm.tokenizer.encode(prompt, add_special_tokens=False)
    body = {"model": "demo-r4", "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True}
    with live.http() as h, h.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert all(c["token_ids"] for c in choices)          # a chunk whenever tokens arrive, text or not yet
    assert [t for c in choices for t in c["token_ids"]] == want.token_ids
    assert "".join(c["text"] for c in choices) == want.text
    streamed = live.openai().completions.create(model="demo-r4", prompt=prompt, max_tokens=N, stream=True)
    assert all("token_ids" not in (ch.model_extra or {}) for c in streamed for ch in c.choices)   # text prompts


def test_completions_default_to_16_tokens(live):
    r = live.openai().completions.create(model=live.engine.model_name, prompt="Once upon a time",
                                         temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_n_choices_use_consecutive_seeds(live, ref):
    client = live.openai()
    kw = dict(model="demo-r8", messages=user(QUESTIONS[4]), max_tokens=N, temperature=1.0, seed=7, n=3)
    r = client.chat.completions.create(**kw)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert texts == [ref.chat([(QUESTIONS[4], "demo-r8")], N, temperature=1.0, seed=7 + i)[0] for i in range(3)]
    assert client.chat.completions.create(**kw).choices[2].message.content == texts[2]    # seeded: reproducible
    streamed = client.chat.completions.create(**kw, stream=True)
    parts = ["", "", ""]
    for c in streamed:
        for ch in c.choices:
            parts[ch.index] += ch.delta.content or ""
    assert parts == texts


def test_n_choices_seeds_wrap_below_the_seed_limit(live, ref):
    """The largest seed a client may send, with n=2: the second choice's seed wraps to 0, as a seed is below 2**63."""
    r = live.openai().chat.completions.create(model="demo-r8", messages=user(QUESTIONS[4]), max_tokens=N,
                                              temperature=1.0, seed=2**63 - 1, n=2)
    assert [c.message.content for c in r.choices] == [
        ref.chat([(QUESTIONS[4], "demo-r8")], N, temperature=1.0, seed=s)[0] for s in (2**63 - 1, 0)]


def test_stop_strings_and_extensions(live, ref):
    client = live.openai()
    q = "Count from one to five."
    [want] = ref.chat([(q, None)], 24, temperature=0.0, stop=("3",))
    r = client.chat.completions.create(model=live.engine.model_name, messages=user(q), max_tokens=24, temperature=0,
                                       stop="3")
    assert r.choices[0].message.content == want and "3" not in want
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=live.engine.model_name, messages=user("Hi"), max_completion_tokens=6,
                                       temperature=0, extra_body={"min_tokens": 6, "top_k": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_content_parts_and_system_messages(live, ref):
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]}]
    joined = [messages[0], {"role": "user", "content": "What is\n2 + 2?"}]
    [want] = ref.chat([(joined, "demo-r8")], N, temperature=0.0)
    r = live.openai().chat.completions.create(model="demo-r8", messages=messages, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want


def test_load_and_unload_an_adapter_at_run_time(live, ref, setup):
    client, base = live.openai(), live.engine.model_name
    with live.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late-r8"})
        assert r.status_code == 200, r.text
        assert "late" in [m.id for m in client.models.list().data]
        [want] = ref.chat([(QUESTIONS[0], "late-r8")], N, temperature=0.0)
        got = client.chat.completions.create(model="late", messages=user(QUESTIONS[0]), max_tokens=N, temperature=0)
        assert got.choices[0].message.content == want
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late-r8"}).status_code == 400
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        assert "late" not in [m.id for m in client.models.list().data]
        r = h.post("/v1/chat/completions", json={"model": "late", "messages": user("Hi")})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": base}).status_code == 400
        # an absolute path inside the adapter directory works too
        absolute = str(setup.adapter_dir / "late-r8")
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "late2", "lora_path": absolute})
        assert r.status_code == 200, r.text
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "late2"}).status_code == 200


@pytest.mark.parametrize("path,status", [("../images", 403), ("/etc", 403), ("escape", 403),
                                         ("missing", 404), ("..", 403), ("demo-r8/../../..", 403)])
def test_adapter_paths_outside_the_adapter_dir_are_refused(live, setup, path, status):
    if path == "escape":
        link = setup.adapter_dir / "escape"
        if not link.exists():
            link.symlink_to(setup.root)          # a symlink inside that points outside
    with live.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "lora_path"
    assert "x" not in live.async_engine.adapter_names


def test_an_invalid_adapter_directory_is_refused(live, setup):
    (setup.adapter_dir / "empty").mkdir(exist_ok=True)
    with live.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "empty"})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]


def test_unload_waits_for_the_adapters_running_requests(live):
    """Policy "wait": new requests for the adapter are refused at once; running ones finish."""
    with live.http() as h:
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": "late-r8"}).status_code == 200
        body = {"model": "busy", "messages": user("Tell me a story."), "max_tokens": 40, "temperature": 0,
                "stream": True, "ignore_eos": True, "min_tokens": 40}
        with h.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")           # submitted and running
            result = {}

            def unload_it():
                with live.http() as h2:
                    result["r"] = h2.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})

            unload = threading.Thread(target=unload_it)
            unload.start()
            deadline = time.monotonic() + 30
            while "busy" in live.async_engine.adapter_names:         # the unload has begun
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = h.post("/v1/chat/completions", json={"model": "busy", "messages": user("Hi")})
            assert r.status_code == 404
            r = h.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": "late-r8"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"     # its name is still taken
            assert unload.is_alive()                          # still waiting for the stream
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        unload.join(60)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert result["r"].status_code == 200 and result["r"].json()["waited_requests"] == 1


def test_client_disconnect_aborts_and_frees_blocks(live):
    before = live.metric("vlora_requests_total", finish_reason="abort")
    body = {"model": "demo-r8", "messages": user("Tell me a long story."), "max_tokens": 200, "min_tokens": 200,
            "temperature": 0, "stream": True}
    with live.http() as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    live.wait_idle()
    assert live.wait_metric("vlora_requests_total", before + 1, finish_reason="abort") == before + 1
    assert live.engine.allocator.num_free == live.engine.allocator.num_blocks


def test_metrics(live):
    client = live.openai()
    client.chat.completions.create(model="demo-r16", messages=user("Hi"), max_tokens=4, temperature=0)
    live.wait_idle()
    with live.http() as h:
        r = h.get("/metrics", headers={"Authorization": ""})          # /metrics needs no key
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    get = lambda name, **lb: samples[(name, tuple(sorted(lb.items())))]      # noqa: E731
    assert get("vlora_requests_total", adapter="demo-r16", finish_reason="length") >= 1
    assert get("vlora_generation_tokens_total", adapter="demo-r16") >= 4
    assert get("vlora_prompt_tokens_total", adapter="demo-r16") > 0
    for h in ("vlora_time_to_first_token_seconds", "vlora_time_per_output_token_seconds",
              "vlora_e2e_request_latency_seconds"):
        assert get(f"{h}_count", adapter="demo-r16") >= 1
    assert get("vlora_kv_blocks_total") == live.engine.allocator.num_blocks
    assert get("vlora_kv_blocks_used") == 0 and get("vlora_requests_running") == 0
    assert get("vlora_requests_waiting") == 0
    assert get("vlora_inference_mode", mode="unmerged") == 1 and get("vlora_inference_mode", mode="merged") == 0
    assert get("vlora_mode_switches_total") == 0


def test_health_needs_no_key(live):
    import httpx

    r = httpx.get(f"{live.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(f"{live.url}/v1/models").status_code == 401
    assert httpx.get(f"{live.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_request_that_cannot_meet_its_latency_target_is_answered_503(live):
    """An adapter's TTFT target that no request can meet: early abort, a 503 with the engine's reason; other
    adapters are served as before, and clearing the target restores the adapter."""
    from vlora import SLO

    live.engine.set_slo("demo-r4", SLO(ttft_s=1e-9))
    try:
        with live.http() as h:
            r = h.post("/v1/chat/completions", json={"model": "demo-r4", "messages": user("Hi"), "max_tokens": 4})
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["code"] == "slo_rejected" and "TTFT SLO" in err["message"]
            ok = h.post("/v1/chat/completions", json={"model": "demo-r8", "messages": user("Hi"), "max_tokens": 4})
            assert ok.status_code == 200
    finally:
        live.engine.set_slo("demo-r4", None)
    with live.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "demo-r4", "messages": user("Hi"), "max_tokens": 4})
        assert r.status_code == 200
