"""Adapters loaded on first request: a live server with --adapter-dir (and --allow-hub-adapters, the Hub mocked)
and --max-loaded-adapters 2, through the official client."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, QUESTIONS, LiveServer
from vlora import LLM
from vlora.config import ServerConfig
from vlora.lora.random_adapter import write_random_adapter
from vlora.models.hub import HubError
from vlora.models.loader import lora_shape
from vlora.server.on_demand import HUB_MISS_SECONDS, RecentMisses

N = 8           # tokens per answer
STARTUP = "start-r8"


@pytest.fixture(scope="module")
def disk(setup, tmp_path_factory):
    """The server's adapter directory: od-0 .. od-5 (random, rank 8), od-late (a copy of the reference's late-r8),
    od-bad (rank-8 config, rank-4 weights), od-noconfig (weights only); and a valid adapter outside it."""
    root = tmp_path_factory.mktemp("on-demand")
    shape = lora_shape(None)
    d = root / "adapters"
    for i in range(6):
        write_random_adapter(d / f"od-{i}", shape, 8, 10 + i)
    shutil.copytree(setup.adapter_dir / "late-r8", d / "od-late")
    write_random_adapter(d / "od-bad", shape, 4, 20)
    config = json.loads((d / "od-bad" / "adapter_config.json").read_text())
    (d / "od-bad" / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    write_random_adapter(d / "od-noconfig", shape, 8, 21)
    (d / "od-noconfig" / "adapter_config.json").unlink()
    write_random_adapter(root / "outside", shape, 8, 22)
    write_random_adapter(root / "hub-snapshot", shape, 8, 23)
    (d / "escape").symlink_to(root / "outside")
    return root


@pytest.fixture(scope="module")
def live(disk, setup):
    config = ServerConfig(api_key=API_KEY, adapter_dirs=(str(disk / "adapters"),), allow_hub_adapters=True,
                          max_loaded_adapters=2)
    llm = LLM(adapters={STARTUP: setup.adapters["demo-r8"]}, kv_cache_memory_gb=0.25)
    server = LiveServer(llm.engine, config)
    yield server
    server.stop()


def user(q):
    return [{"role": "user", "content": q}]


def chat(live, model, **kw) -> httpx.Response:
    with live.http() as h:
        return h.post("/v1/chat/completions", json={"model": model, "messages": user(QUESTIONS[0]), "max_tokens": N,
                                                     "temperature": 0, **kw})


def on_request(live) -> list[str]:
    """The adapters loaded on request, least recently used first."""
    return list(live.server_state.on_demand.loaded)


def reset(live) -> None:
    """Unload every adapter loaded on request, so a test starts from none."""
    with live.http() as h:
        for name in on_request(live):
            assert h.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code in (200, 404)


def test_the_first_request_loads_the_adapter_and_is_served(live, ref):
    reset(live)
    loads, timed = live.metric("vlora_adapter_loads_total"), live.metric("vlora_adapter_load_seconds_count")
    client = live.openai()
    assert "od-late" not in [m.id for m in client.models.list().data]      # on disk, not listed until loaded
    [want] = ref.chat([(QUESTIONS[0], "late-r8")], N, temperature=0.0)
    got = client.chat.completions.create(model="od-late", messages=user(QUESTIONS[0]), max_tokens=N, temperature=0)
    assert got.choices[0].message.content == want and got.model == "od-late"
    assert "od-late" in [m.id for m in client.models.list().data]
    r = client.completions.create(model="od-late", prompt="Hello", max_tokens=N, temperature=0)   # loaded: served
    assert r.choices[0].text
    assert live.metric("vlora_adapter_loads_total") == loads + 1
    assert live.metric("vlora_adapter_load_seconds_count") == timed + 1


def test_concurrent_first_requests_share_one_load(live, monkeypatch):
    reset(live)
    loads = live.metric("vlora_adapter_loads_total")
    od = live.server_state.on_demand
    entered, registered = [], []
    ensure, register = od.ensure, od.register

    async def counting_ensure(name):
        entered.append(name)
        await ensure(name)

    async def held_register(name, path):        # the load waits until every request is inside ensure
        registered.append(name)
        deadline = time.monotonic() + 30
        while entered.count("od-0") < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return await register(name, path)

    monkeypatch.setattr(od, "ensure", counting_ensure)
    monkeypatch.setattr(od, "register", held_register)
    results = [None] * 4

    def one(i):
        results[i] = chat(live, "od-0")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.status_code for r in results] == [200] * 4
    assert len({r.json()["choices"][0]["message"]["content"] for r in results}) == 1
    assert entered.count("od-0") == 4 and registered == ["od-0"]
    assert live.metric("vlora_adapter_loads_total") == loads + 1


def test_an_invalid_adapter_is_400_naming_model(live, disk):
    loads = live.metric("vlora_adapter_loads_total")
    r = chat(live, "od-bad")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "invalid_adapter" and "shape" in err["message"]
    assert str(disk) not in err["message"]                   # the server's paths are not shown
    assert "od-bad" not in live.async_engine.adapter_names
    assert live.metric("vlora_adapter_loads_total") == loads


@pytest.mark.parametrize("model", ["od-missing", "od-noconfig", "org/od-missing"])
def test_a_missing_adapter_is_404(live, monkeypatch, model):
    def no_hub(repo_id, kind):
        raise HubError(f"{repo_id} is not on the Hub")

    monkeypatch.setattr("vlora.server.app.snapshot_dir", no_hub)
    r = chat(live, model)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"


def test_a_malformed_request_loads_and_evicts_nothing(live, monkeypatch):
    """The request is validated before its adapter is loaded: a 400 loads nothing and evicts nothing; a name that
    is nowhere is a 404 first, as for a loaded model; a Hub id is not looked up."""
    def hub(repo_id, kind):
        raise AssertionError(f"{repo_id!r} reached the Hub")

    monkeypatch.setattr("vlora.server.app.snapshot_dir", hub)
    reset(live)
    for name in ("od-1", "od-2"):
        assert chat(live, name).status_code == 200
    loads, evictions = live.metric("vlora_adapter_loads_total"), live.metric("vlora_adapter_evictions_total")
    for model in ("od-3", "org/od-unchecked"):
        for body, param in [({"max_tokens": 10**6}, "max_tokens"), ({"n": 10**4}, "n")]:
            r = chat(live, model, **body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (model, r.text)
    r = chat(live, "od-missing", max_tokens=10**6)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert on_request(live) == ["od-1", "od-2"]
    assert live.metric("vlora_adapter_loads_total") == loads
    assert live.metric("vlora_adapter_evictions_total") == evictions


def test_a_hub_id_not_found_is_not_looked_up_again_for_a_while(live, monkeypatch):
    asked, now = [], [1000.0]

    def no_hub(repo_id, kind):
        asked.append(repo_id)
        raise HubError(f"{repo_id} is not on the Hub")

    monkeypatch.setattr("vlora.server.app.snapshot_dir", no_hub)
    monkeypatch.setattr(live.server_state, "hub_misses", RecentMisses(clock=lambda: now[0]))
    for _ in range(3):
        r = chat(live, "org/od-gone")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert asked == ["org/od-gone"]
    now[0] += HUB_MISS_SECONDS
    assert chat(live, "org/od-gone").status_code == 404
    assert asked == ["org/od-gone"] * 2


def test_names_that_leave_the_adapter_dir_are_refused(live, disk, monkeypatch):
    def hub(repo_id, kind):
        raise AssertionError(f"{repo_id!r} reached the Hub")

    monkeypatch.setattr("vlora.server.app.snapshot_dir", hub)
    loads = live.metric("vlora_adapter_loads_total")
    names = ["../outside", str(disk / "outside"), "od-1/../../outside", "escape", "./od-1", "od-1/", "/od-1",
             "od-1/..", "..", ".", "od-1\\..\\..\\outside", "od-1\x00"]
    for name in names:
        r = chat(live, name)
        assert r.status_code in (400, 404), (name, r.text)
        assert r.json()["error"]["param"] == "model"
    assert not set(names) & live.async_engine.adapter_names
    assert live.metric("vlora_adapter_loads_total") == loads


def test_a_hub_id_is_loaded_from_its_snapshot(live, disk, monkeypatch):
    asked = []

    def snapshot(repo_id, kind):
        asked.append((repo_id, kind))
        return disk / "hub-snapshot"

    monkeypatch.setattr("vlora.server.app.snapshot_dir", snapshot)
    loads = live.metric("vlora_adapter_loads_total")
    r = chat(live, "org/od-hub")
    assert r.status_code == 200, r.text
    assert asked == [("org/od-hub", "adapter")]
    assert live.metric("vlora_adapter_loads_total") == loads + 1


def _stream(live, model: str, stop: threading.Event, times: list[float], ready: threading.Event) -> None:
    """A long greedy stream on ``model``; each content chunk's arrival time in ``times``, until ``stop``."""
    client = live.openai()
    stream = client.chat.completions.create(model=model, messages=user("Tell me a long story."), max_tokens=2000,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "min_tokens": 2000})
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.monotonic())
                ready.set()
            if stop.is_set():
                break
    finally:
        stream.close()
        ready.set()


def test_max_loaded_adapters_evicts_the_least_recently_used_idle_one(live):
    reset(live)
    evictions = live.metric("vlora_adapter_evictions_total")
    for name in ("od-1", "od-2"):
        assert chat(live, name).status_code == 200
    assert chat(live, "od-1").status_code == 200                     # od-2 is now the least recently used
    assert chat(live, "od-3").status_code == 200
    assert on_request(live) == ["od-1", "od-3"]
    assert "od-2" not in live.async_engine.adapter_names and STARTUP in live.async_engine.adapter_names
    assert live.metric("vlora_adapter_evictions_total") == evictions + 1
    loads = live.metric("vlora_adapter_loads_total")
    assert chat(live, "od-2").status_code == 200                     # loaded again; od-1 goes
    assert live.metric("vlora_adapter_loads_total") == loads + 1
    assert live.metric("vlora_adapter_evictions_total") == evictions + 2
    assert on_request(live) == ["od-3", "od-2"]

    # a busy adapter is never evicted, even when it is the least recently used; all busy: 429
    stop, streams = threading.Event(), []
    try:
        for name in ("od-3", "od-2"):           # od-3 starts first, then od-2: od-3 is least recently used
            times, ready = [], threading.Event()
            t = threading.Thread(target=_stream, args=(live, name, stop, times, ready), daemon=True)
            t.start()
            assert ready.wait(120) and times
            streams.append(t)
        r = chat(live, "od-4")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "adapters_busy"
        assert on_request(live) == ["od-3", "od-2"]
    finally:
        stop.set()
        for t in streams:
            t.join(120)
    live.wait_idle()
    deadline = time.monotonic() + 30
    while live.server_state.on_demand.running and time.monotonic() < deadline:   # the aborts' outputs counted
        time.sleep(0.05)
    assert chat(live, "od-4").status_code == 200
    assert on_request(live) == ["od-2", "od-4"]
    assert STARTUP in live.async_engine.adapter_names


def labelled(live) -> set[str]:
    """The adapters that some series of /metrics is labelled with."""
    return {s.labels["adapter"] for family in live.server_state.metrics.registry.collect()
            for s in family.samples if "adapter" in s.labels}


def test_an_unloaded_adapters_series_are_removed(live):
    """Series labelled by adapter exist while it is registered: evicted or unloaded, its series go; the loads and
    evictions are counted for all adapters together."""
    reset(live)
    for name in ("od-1", "od-2", "od-3"):                            # od-1 evicted for od-3
        assert chat(live, name).status_code == 200
    assert live.metric("vlora_requests_total", adapter="od-2") == 1
    assert {"od-2", "od-3"} <= labelled(live) and "od-1" not in labelled(live)
    with live.http() as h:
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "od-2"}).status_code == 200
    assert "od-2" not in labelled(live) and "od-3" in labelled(live)
    assert chat(live, "od-2").status_code == 200                     # loaded again: counted from zero
    assert live.metric("vlora_requests_total", adapter="od-2") == 1


def test_a_stream_on_another_adapter_goes_on_during_a_load(live, monkeypatch):
    """The load runs off the engine thread (read in a process of its own, finished on a worker thread, here made
    slow, as a slow disk would make it): tokens of a running stream keep arriving while it runs."""
    reset(live)
    adapters = live.engine.adapters
    finish, window = adapters.finish, []

    def slow_finish(read):
        window.append(time.monotonic())
        time.sleep(1.0)
        try:
            return finish(read)
        finally:
            window.append(time.monotonic())

    monkeypatch.setattr(adapters, "finish", slow_finish)
    loads = live.metric("vlora_adapter_loads_total")
    stop, times, ready = threading.Event(), [], threading.Event()
    t = threading.Thread(target=_stream, args=(live, STARTUP, stop, times, ready), daemon=True)
    t.start()
    try:
        assert ready.wait(120) and times
        assert chat(live, "od-5").status_code == 200
    finally:
        stop.set()
        t.join(120)
    start, end = window
    during = [x for x in times if start < x < end]
    assert len(during) >= 2, (len(times), during)
    assert live.metric("vlora_adapter_loads_total") == loads + 1
