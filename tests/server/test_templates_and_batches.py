"""Chat-template controls (chat_template_kwargs, add_generation_prompt, continue_final_message, a request's own
chat_template, --chat-template), completions with a list of prompts, and the error codes clients act on
(context_length_exceeded, a header block over 64 KiB): through the OpenAI client against a live server, each
answer equal to the offline engine's on the same rendered prompt."""

from __future__ import annotations

import re
from dataclasses import replace

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, LiveServer
from tests.server.test_errors import BASE, check_error

N = 6           # tokens per answer

# the server's default template in the `templated` app (--chat-template): ChatML with an optional persona
# variable, and a refusal the template itself raises
SERVER_TEMPLATE = """\
{% if messages[0]['content'] == 'boom' %}{{ raise_exception('boom is not a question') }}{% endif %}
{% if persona is defined %}<|im_start|>system
You are {{ persona }}.<|im_end|>
{% endif %}
{% for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# a request's own template: plain text turns, with a style variable
REQUEST_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant ({{ style | default('plain') }}):{% endif %}")
Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "chatml-persona.jinja"
    path.write_text(SERVER_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def templated(live, template_file):
    """An app on the live server's engine started with --chat-template and --trust-request-chat-template."""
    server = LiveServer(live.async_engine, replace(live.server_state.config, chat_template=str(template_file),
                                                   trust_request_chat_template=True))
    yield server
    server.stop()


def expected(ref, messages, **options) -> tuple[str, int]:
    """(greedy answer, prompt tokens) of the offline engine on ``messages`` rendered with ``options``."""
    ids = ref.llm.apply_chat_template(messages, **options)
    [text] = ref.complete([(ids, None)], N, temperature=0.0)
    return text, len(ids)


def chat(server, messages=Q, **extra):
    return server.openai().chat.completions.create(model=BASE, messages=messages, max_tokens=N, temperature=0,
                                                   extra_body=extra or None)


# -- chat-template controls -----------------------------------------------------------------------------------
def test_chat_template_kwargs_reach_the_template(templated, ref):
    plain = chat(templated)
    want, prompt_len = expected(ref, Q, chat_template=SERVER_TEMPLATE)
    assert plain.choices[0].message.content == want and plain.usage.prompt_tokens == prompt_len
    r = chat(templated, chat_template_kwargs={"persona": "a pirate"})
    want, prompt_len = expected(ref, Q, chat_template=SERVER_TEMPLATE, template_kwargs={"persona": "a pirate"})
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == prompt_len
    assert prompt_len > plain.usage.prompt_tokens           # the variable printed the persona turn


def test_variables_a_template_does_not_use_change_nothing(live, ref):
    """Qwen3's {"enable_thinking": false} sent to a model whose template ignores it: the usual answer."""
    r = chat(live, chat_template_kwargs={"enable_thinking": False})
    want, prompt_len = expected(ref, Q)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == prompt_len


def test_add_generation_prompt_false(live, ref):
    r = chat(live, add_generation_prompt=False)
    want, prompt_len = expected(ref, Q, add_generation_prompt=False)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == prompt_len
    assert prompt_len < expected(ref, Q)[1]                 # no assistant header


def test_continue_final_message(live, ref):
    messages = Q + [{"role": "assistant", "content": "The capital of France is"}]
    r = chat(live, messages, continue_final_message=True)
    want, prompt_len = expected(ref, messages, add_generation_prompt=False, continue_final_message=True)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == prompt_len
    ids = ref.llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ref.llm.tokenizer.decode(ids).endswith("The capital of France is")      # no end-of-turn after it
    streamed = live.openai().chat.completions.create(model=BASE, messages=messages, max_tokens=N, temperature=0,
                                                     stream=True, extra_body={"continue_final_message": True,
                                                                              "add_generation_prompt": False})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want


def test_a_requests_own_chat_template(templated, ref):
    r = chat(templated, chat_template=REQUEST_TEMPLATE, chat_template_kwargs={"style": "brief"})
    want, prompt_len = expected(ref, Q, chat_template=REQUEST_TEMPLATE, template_kwargs={"style": "brief"})
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == prompt_len


def test_chat_template_at_start(live, templated, template_file, tmp_path):
    """--chat-template replaces the model's template; a file that is missing or does not parse is an error at
    start, naming the option (and, when it does not parse, the line)."""
    from vlora.cli import main
    from vlora.config import ConfigError
    from vlora.server.app import build_app

    assert templated.server_state.chat_template == SERVER_TEMPLATE
    with pytest.raises(ConfigError, match="--chat-template.*no such file"):
        replace(live.server_state.config, chat_template=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m['content'] }\n")
    with pytest.raises(ConfigError, match=r"--chat-template .*bad\.jinja: not a valid Jinja template \(line 2"):
        build_app(live.async_engine, replace(live.server_state.config, chat_template=str(bad)))
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        build_app(live.async_engine, replace(live.server_state.config, chat_template=str(empty)))
    for path in (bad, tmp_path / "missing.jinja"):          # the command line stops before the model loads
        assert main(["serve", "--chat-template", str(path)]) == 2


@pytest.mark.parametrize("server_name,extra,param,contains", [
    ("live", {"chat_template": REQUEST_TEMPLATE}, "chat_template", "--trust-request-chat-template"),
    ("templated", {"chat_template": "{% for m in messages %}"}, "chat_template", "does not parse"),
    ("templated", {"chat_template": "{{ nothing.here }}"}, "chat_template", "undefined"),
    ("templated", {"chat_template": ""}, "chat_template", "at least 1"),
    ("templated", {"messages": [{"role": "user", "content": "boom"}]}, "messages", "boom is not a question"),
    ("live", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "tokenize"),
    ("live", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "field"),
    ("live", {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "dictionary"),
    ("live", {"add_generation_prompt": "no"}, "add_generation_prompt", "boolean"),
    ("live", {"continue_final_message": True}, "continue_final_message", "assistant"),
    ("live", {"messages": Q + [{"role": "assistant", "content": "Paris"}], "continue_final_message": True,
              "add_generation_prompt": True}, "continue_final_message", "add_generation_prompt"),
])
def test_template_refusals(request, server_name, extra, param, contains):
    server = request.getfixturevalue(server_name)
    body = {"model": BASE, "messages": Q, "max_tokens": 2, **extra}
    with server.http() as h:
        check_error(h.post("/v1/chat/completions", json=body), 400, param, contains)


# -- completions with a list of prompts -------------------------------------------------------------------------
PROMPTS = ["The three primary colours are", "Once upon a time", "def fibonacci(n):"]


def test_a_list_of_prompts_answers_each_in_order(live, ref):
    """3 prompts x n=2: 6 choices, choice i of prompt p at index 2p + i, each equal to the prompt's answer alone."""
    r = live.openai().completions.create(model="demo-r8", prompt=PROMPTS, n=2, max_tokens=N, temperature=0)
    want = ref.complete([(p, "demo-r8") for p in PROMPTS], N, temperature=0.0)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [w for w in want for _ in range(2)]
    encode = ref.llm.tokenizer.encode
    assert r.usage.prompt_tokens == sum(len(encode(p, add_special_tokens=False)) for p in PROMPTS)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ids = [encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    r2 = live.openai().completions.create(model="demo-r8", prompt=ids, max_tokens=N, temperature=0)
    assert [c.text for c in r2.choices] == want[:2] and r2.usage.prompt_tokens == sum(map(len, ids))


def test_a_list_of_prompts_streams(live, ref):
    stream = live.openai().completions.create(model=BASE, prompt=PROMPTS, n=2, max_tokens=N, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    texts, finishes, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = finishes.get(c.index, 0) + 1
    want = ref.complete([(p, None) for p in PROMPTS], N, temperature=0.0)
    assert [texts[i] for i in range(6)] == [w for w in want for _ in range(2)]
    assert finishes == dict.fromkeys(range(6), 1)
    encode = ref.llm.tokenizer.encode
    assert usage.prompt_tokens == sum(len(encode(p, add_special_tokens=False)) for p in PROMPTS)


def test_echo_logprobs_and_best_of_work_per_prompt(live):
    """Each prompt's choice in a list equals its choice when sent alone (echoed text, logprobs, best_of)."""
    body = {"model": BASE, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "best_of": 2, "n": 1}
    with live.http() as h:
        batch = h.post("/v1/completions", json={**body, "prompt": PROMPTS[:2]}).json()
        alone = [h.post("/v1/completions", json={**body, "prompt": p}).json() for p in PROMPTS[:2]]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for choice, single, prompt in zip(batch["choices"], alone, PROMPTS):
        one = single["choices"][0]
        assert choice["text"] == one["text"] and choice["text"].startswith(prompt)
        assert choice["finish_reason"] == one["finish_reason"]
        got, want = choice["logprobs"], one["logprobs"]
        assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
        assert len(got["tokens"]) > 3                       # the prompt's tokens, then the answer's
        # the same numbers up to float rounding (a batch of other rows sums in another order)
        assert got["token_logprobs"][0] is None and want["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-3)
        for a, b in zip(got["top_logprobs"][1:], want["top_logprobs"][1:]):
            assert a == pytest.approx(b, abs=1e-3)
    assert batch["usage"] == {k: sum(a["usage"][k] for a in alone) for k in batch["usage"]}


def test_list_prompt_refusals(live):
    limit = live.async_engine.max_queued_requests
    with live.http() as h:
        def post(**kw):
            return h.post("/v1/completions", json={"model": BASE, "max_tokens": 2, **kw})

        check_error(post(prompt=[]), 400, "prompt", "empty")
        check_error(post(prompt=["Hi", ""]), 400, "prompt[1]", "empty")
        check_error(post(prompt="Hi", suffix="!"), 400, "suffix", "not supported")
        check_error(post(prompt=["Hi"] * (limit // 2 + 1), n=2), 400, "prompt", "--max-queued-requests")
        check_error(post(prompt=["Hi", "Yo"], best_of=2, stream=True), 400, "best_of", "stream")
        check_error(post(prompt=["Hi", 5]), 400)
        err = check_error(post(prompt=[[1, 2], list(range(1, 6000))]), 400, "prompt[1]", "at most")
        assert err["code"] == "context_length_exceeded"


# -- error codes clients act on ----------------------------------------------------------------------------------
def test_a_prompt_longer_than_the_context_is_context_length_exceeded(live):
    long = "word " * (live.server_state.context_len + 10)
    client = live.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": long}], max_tokens=2)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=["Hi", long], max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt[1]"


def test_a_header_block_over_64_kib_is_refused(live):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=live.url, timeout=60) as h:
        r = h.get("/v1/models", headers={**headers, "X-Pad": "a" * (60 << 10)})
        assert r.status_code == 200
        for pad in ({"X-Pad": "a" * (65 << 10)}, {f"X-Pad-{i}": "a" * 2048 for i in range(40)},
                    {"X-Pad": "a" * (4 << 20)}):
            r = h.get("/v1/models", headers={**headers, **pad})
            assert r.status_code == 431, r.text
            assert r.json()["error"]["code"] == "request_header_fields_too_large"
        assert h.get("/health").status_code == 200
        # bodies are not headers: large bodies on one kept-alive connection, each request arriving in a chunk
        for size in (100 << 10, 100 << 10, 300 << 10):
            r = h.post("/v1/completions", headers=headers, json={"model": "nope", "prompt": "x" * size})
            assert r.status_code == 404, r.text


class _Transport:
    """An in-memory transport: what the protocol writes, and whether it closed the connection."""

    def __init__(self):
        self.written, self.closed = bytearray(), False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def set_protocol(self, protocol):
        pass


def _request(body: bytes = b"", **headers) -> bytes:
    head = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return f"POST /x HTTP/1.1\r\nhost: t\r\n{head}content-length: {len(body)}\r\n\r\n".encode() + body


@pytest.mark.parametrize("reads,status", [
    ([_request(b"x" * (200 << 10))], [200]),                                 # a whole request in one read
    ([_request(b"x" * (100 << 10)) + _request(b"y" * (100 << 10))], [200, 200]),     # two pipelined
    ([_request(b"x" * (100 << 10))[:-5], b"xxxxx" + _request(b"y" * 10)], [200, 200]),
    ([_request(x_pad="a" * (60 << 10))], [200]),
    ([_request(x_pad="a" * (65 << 10))], [431]),
    ([_request(**{f"x_{i}": "a" * 1000 for i in range(70)})], [431]),
    ([b"POST /x HTTP/1.1\r\nx-pad: "] + [b"a" * 8192] * 9, [431]),         # a header that never ends
    ([b"POST /" + b"a" * (70 << 10)], [431]),                                 # nor does the target
])
def test_the_header_bound_counts_headers_only(reads, status):
    """The protocol itself, fed reads as the event loop would: bodies never count, however they arrive."""
    import asyncio

    from uvicorn.server import ServerState

    from vlora.server.transport import uvicorn_config

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run() -> _Transport:
        config = uvicorn_config(app, log_level="critical", lifespan="off")
        config.load()
        protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = _Transport()
        protocol.connection_made(transport)
        for data in reads:
            protocol.data_received(data)
            for _ in range(50):                     # let the app answer
                await asyncio.sleep(0)
        return transport

    transport = asyncio.run(run())
    got = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", bytes(transport.written))]
    assert got == status
    assert transport.closed == (status[-1] == 431)
