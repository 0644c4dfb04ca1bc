"""Kernel variants: keeping their number fixed, and counting the ones this process builds.

Triton compiles a kernel once per specialisation: every constexpr, and by default whether each integer
argument equals 1 or is a multiple of 16 and whether each pointer is 16-byte aligned. Arguments that follow
the batch (strides over the token count, tile counts, rows of per-layer metadata) would make new variants
appear mid-serving, each a stall of a second or more for every request of the iteration. :func:`jit` turns
that specialisation off for named arguments, so the variants are those of the tile configs, which the engine
builds at start-up (:mod:`vlora.engine.warmup`); the counter shows that nothing was built after that
(benchmarks report it per timed run). A build here is a compile or a load from Triton's disk cache.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_count = 0
_seconds = 0.0
_started: dict[int, float] = {}
_names: list[str] = []
_installed = False


def jit(*, ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()):
    """``triton.jit`` that does not specialise the named integer arguments (on 1 or on multiples of 16) nor the
    named pointers (on 16-byte alignment)."""
    import triton

    return triton.jit(do_not_specialize=list(ints), do_not_specialize_on_alignment=list(ints + pointers))


def install() -> None:
    """Hook Triton's JIT (idempotent; a no-op where Triton or its hooks are missing)."""
    global _installed
    if _installed:
        return
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous_pre, previous_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return

    def pre(**kw):
        _started[threading.get_ident()] = time.perf_counter()
        return previous_pre(**kw) if previous_pre else False     # a true value would skip the compile

    def post(**kw):
        global _count, _seconds
        t0 = _started.pop(threading.get_ident(), None)
        with _lock:
            _count += 1
            _seconds += 0.0 if t0 is None else time.perf_counter() - t0
            _names.append(getattr(kw.get("fn"), "name", "?"))
        return previous_post(**kw) if previous_post else False

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = pre, post
    _installed = True


def snapshot() -> tuple[int, float]:
    """(compiles so far, seconds spent in them)."""
    with _lock:
        return _count, _seconds


def since(mark: tuple[int, float]) -> dict:
    """Compiles after ``mark`` (a :func:`snapshot`): count, seconds and kernel names."""
    with _lock:
        return {"compiles": _count - mark[0], "compile_s": round(_seconds - mark[1], 3),
                "kernels": sorted(set(_names[mark[0]:]))}
