"""Engine builds for the tests' engine processes (module level: the process imports them by name)."""

from __future__ import annotations

import os


def smollm(adapters: dict[str, str]):
    """The embedded model with ``adapters``, as the server tests' offline reference builds it."""
    from vlora import LLM

    return LLM(adapters=adapters, kv_cache_memory_gb=0.25).engine, {}


def tiny():
    from vlora import LLM

    return LLM("random:tiny-llama", device="cpu", num_blocks=64).engine, {}


def refuses():
    from vlora.config import ConfigError

    raise ConfigError("no room for the model")


def exits(code: int):
    os._exit(code)


def slow(seconds: float):
    """A build that takes ``seconds`` (a large model's), then fails."""
    import time

    time.sleep(seconds)
    raise RuntimeError("built nothing")
