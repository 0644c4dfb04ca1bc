"""A live `vlora serve` app on the embedded SmolLM2 (loopback, free port, background thread),
random-weight adapters on disk, test images, and an identical offline engine for expected answers."""

from __future__ import annotations

import io
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlora import LLM, SamplingParams
from vlora.config import ServerConfig
from vlora.lora.random_adapter import write_random_adapter
from vlora.server.app import build_app

API_KEY = "test-key"
ADAPTERS = {"demo-r8": (8, 1), "demo-r16": (16, 2), "demo-r4": (4, 3)}   # served from the start
EXTRA = {"late-r8": (8, 4)}                                            # loaded through the API
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to five.",
             "What is 2 + 2?", "Say hello in Spanish.", "What colour is the sky?",
             "Name a large animal.", "What is water made of?"]


class LiveServer:
    """uvicorn serving ``build_app(engine, config)`` on 127.0.0.1 in a background thread."""

    def __init__(self, engine, config: ServerConfig):
        import uvicorn

        from vlora.server.transport import uvicorn_config

        self.app = build_app(engine, config)
        self.server_state = self.app.state.server
        self.async_engine = self.server_state.engine
        self.engine = engine
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # the protocol and header bound of `vlora serve`
        self.uvicorn = uvicorn.Server(uvicorn_config(self.app, log_level="warning", timeout_graceful_shutdown=30))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive()

    def openai(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120, **kw)

    def http(self, **kw):
        import httpx

        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120, **kw)

    def wait_idle(self, timeout: float = 60) -> None:
        """Until the engine has nothing running, waiting or in flight (a bounded wait, not a timing check)."""
        deadline = time.monotonic() + timeout
        while self.async_engine._live or self.async_engine.stats.num_running or self.async_engine.stats.num_waiting:
            assert time.monotonic() < deadline, "engine did not become idle"
            time.sleep(0.05)

    def wait_metric(self, name: str, value: float, timeout: float = 30, **labels) -> float:
        """The metric once it reaches ``value`` (the handler records it after the engine lets the request go),
        or its last reading after ``timeout``: a bounded wait, not a timing check."""
        deadline = time.monotonic() + timeout
        while (got := self.metric(name, **labels)) < value and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for family in self.server_state.metrics.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


@dataclass
class Setup:
    root: Path
    adapter_dir: Path           # the server's --adapter-dir
    image_dir: Path             # the server's --image-dir
    adapters: dict[str, str]    # name -> path, for every adapter written (served and extra)
    images: dict[str, bytes]


def _png(size, noise=False) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8) if noise else \
        np.full((size[1], size[0], 3), 128, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="package")
def setup(tmp_path_factory) -> Setup:
    from vlora.models.loader import resolve_model_dir

    root = tmp_path_factory.mktemp("server")
    adapter_dir, image_dir = root / "adapters", root / "images"
    adapter_dir.mkdir()
    image_dir.mkdir()
    shape = _shape(resolve_model_dir(None))
    adapters = {name: str(write_random_adapter(adapter_dir / name, shape, rank, seed, std=0.03))
                for name, (rank, seed) in {**ADAPTERS, **EXTRA}.items()}
    ok = _png((8, 8))
    images = {"ok": ok, "noisy": _png((200, 200), noise=True), "huge": _png((1500, 1000)),
              "corrupt": ok[: len(ok) // 2]}
    (image_dir / "ok.png").write_bytes(ok)
    (root / "outside.png").write_bytes(ok)
    return Setup(root, adapter_dir, image_dir, adapters, images)


def _shape(model_dir):
    """The LoRA shape of the embedded model, without loading its weights."""
    from transformers import AutoConfig

    from vlora.lora.adapter import ModelShape
    from vlora.models.loader import decoder_config

    cfg = decoder_config(AutoConfig.from_pretrained(model_dir), model_dir.name)
    ins, outs = cfg.lora_in_out()
    return ModelShape(cfg.name, cfg.num_layers, ins, outs)


def make_llm(setup: Setup, names=tuple(ADAPTERS), **kw) -> LLM:
    return LLM(adapters={n: setup.adapters[n] for n in names}, kv_cache_memory_gb=0.25, **kw)


@pytest.fixture(scope="package")
def live(setup):
    """The main server: API key, adapter and image dirs, small body and image limits."""
    config = ServerConfig(api_key=API_KEY, adapter_dirs=(str(setup.adapter_dir),), image_dir=str(setup.image_dir),
                          max_request_bytes=1 << 20, max_image_bytes=64 << 10, max_image_pixels=1_000_000)
    server = LiveServer(make_llm(setup).engine, config)
    yield server
    server.stop()


class Reference:
    """An identical offline engine; expected greedy answers, cached."""

    def __init__(self, setup: Setup):
        self.llm = make_llm(setup, names=tuple(ADAPTERS) + tuple(EXTRA))
        self.base = self.llm.engine.model_name
        self._cache: dict = {}

    def chat(self, jobs, max_tokens: int, **sampling) -> list[str]:
        """jobs: [(question or messages, adapter or None)] -> greedy answer texts (one batch)."""
        return [o.text for o in self._run(jobs, max_tokens, sampling, chat=True)]

    def complete(self, jobs, max_tokens: int, **sampling) -> list[str]:
        return [o.text for o in self._run(jobs, max_tokens, sampling, chat=False)]

    def _run(self, jobs, max_tokens, sampling, chat):
        key = lambda p, a: (repr(p), a, max_tokens, tuple(sorted(sampling.items())), chat)  # noqa: E731
        missing = list({key(p, a): (p, a) for p, a in jobs if key(p, a) not in self._cache}.values())
        if missing:
            sp = SamplingParams(max_tokens=max_tokens, **sampling)
            adapters = [None if a in (None, self.base) else a for _, a in missing]
            if chat:
                convs = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p, _ in missing]
                outs = self.llm.chat(convs, adapters, sp)
            else:
                outs = self.llm.generate([p for p, _ in missing], adapters, sp)
            for (p, a), o in zip(missing, outs):
                self._cache[key(p, a)] = o
        return [self._cache[key(p, a)] for p, a in jobs]


@pytest.fixture(scope="package")
def ref(setup) -> Reference:
    return Reference(setup)
