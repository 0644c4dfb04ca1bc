"""A bounded load test on loopback: 128 requests from 32 concurrent clients over 4 models (base + 3
adapters), some streaming, some disconnecting midway. Every completed answer equals the offline
greedy answer; nothing is lost; every disconnected request is aborted; all KV blocks end free."""

from __future__ import annotations

import asyncio
import json

from tests.server.conftest import ADAPTERS, API_KEY, QUESTIONS

REQUESTS, CLIENTS, N = 96, 32, 10


def kind_of(i: int) -> str:
    if i % 13 == 5:
        return "drop-stream"          # reads the first event, then closes the connection
    if i % 13 == 11:
        return "drop-wait"            # non-streaming; closes the connection before the answer
    return "stream" if i % 3 == 1 else "plain"


async def _drop(port: int, body: dict, stream: bool) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    if stream:
        buf = b""
        while b"data: " not in buf:
            chunk = await reader.read(4096)
            assert chunk, buf
            buf += chunk
        assert buf.startswith(b"HTTP/1.1 200"), buf
    else:
        await asyncio.sleep(1.0)      # the answer needs far longer (200 tokens)
    writer.close()
    await writer.wait_closed()


async def _run(live, jobs) -> dict[int, str]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    queue: asyncio.Queue = asyncio.Queue()
    for i, job in enumerate(jobs):
        queue.put_nowait((i, job))
    answers: dict[int, str] = {}

    async def worker():
        while not queue.empty():
            i, (q, model, kind) = queue.get_nowait()
            messages = [{"role": "user", "content": q}]
            if kind.startswith("drop"):
                body = {"model": model, "messages": messages, "max_tokens": 200, "min_tokens": 200,
                        "temperature": 0, "stream": kind == "drop-stream"}
                await _drop(live.port, body, kind == "drop-stream")
            elif kind == "stream":
                parts = []
                async for c in await client.chat.completions.create(model=model, messages=messages, max_tokens=N,
                                                                      temperature=0, stream=True):
                    parts += [c.choices[0].delta.content or ""] if c.choices else []
                answers[i] = "".join(parts)
            else:
                r = await client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)
                answers[i] = r.choices[0].message.content

    await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    await client.close()
    return answers


def test_many_concurrent_clients(live, ref):
    models = [live.engine.model_name, *ADAPTERS]
    combos = [(q, m) for q in QUESTIONS for m in models]
    expected = dict(zip(combos, ref.chat(combos, N, temperature=0.0)))
    jobs = [(*combos[(i * 7) % len(combos)], kind_of(i)) for i in range(REQUESTS)]
    drops = sum(kind.startswith("drop") for _, _, kind in jobs)
    aborted_before = live.metric("vlora_requests_total", finish_reason="abort")
    finished_before = live.metric("vlora_requests_total")

    answers = asyncio.run(_run(live, jobs))

    live.wait_idle()
    completed = [i for i, (_, _, kind) in enumerate(jobs) if not kind.startswith("drop")]
    assert sorted(answers) == completed                                  # none lost
    wrong = [(jobs[i], answers[i], expected[jobs[i][:2]]) for i in completed if answers[i] != expected[jobs[i][:2]]]
    assert not wrong
    assert live.wait_metric("vlora_requests_total", aborted_before + drops, finish_reason="abort") \
        - aborted_before == drops
    assert live.wait_metric("vlora_requests_total", finished_before + REQUESTS) - finished_before == REQUESTS
    assert live.engine.allocator.num_free == live.engine.allocator.num_blocks
    assert not live.engine.has_unfinished()
