"""Shared fixtures: tiny random Llama-family checkpoints and PEFT adapters on disk."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Caches the tests write (the converted embedded model, demo LMM, demo adapters, Hugging Face files)
# live in one temporary folder per session, removed at its end: the suite leaves nothing in HOME. Under
# pytest-xdist the workers share the controller's folder (they inherit its environment), so the embedded model
# is converted once per run, not once per worker.
_CACHE = os.environ.get("VLORA_TESTS_CACHE") or tempfile.mkdtemp(prefix="vlora-tests-")
os.environ["VLORA_TESTS_CACHE"] = _CACHE
for _var, _sub in (("VLORA_CACHE", "vlora"), ("HF_HOME", "huggingface"), ("TRITON_CACHE_DIR", "triton")):
    os.environ[_var] = os.path.join(_CACHE, _sub)
# under pytest-xdist each worker takes one core: more threads per worker would only contend
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("PYTEST_XDIST_WORKER"):        # the controller's, once every worker is done
        shutil.rmtree(_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

if not torch.cuda.is_available():          # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpret_device_calls_in_the_kernels_scope() -> None:
    """Triton's interpreter re-patches triton.language (inspect.getmembers over its modules) on every call of a
    @triton.jit helper from inside a kernel, although the running kernel's grid has already patched the same
    modules (and restores them when it ends): about a tenth of the LoRA and merge kernels' time on this CPU.
    A helper called while a grid runs, whose language modules that grid patched, now runs without patching
    again; anything else goes through Triton's own path. Same program, same results."""
    try:
        from triton.runtime import interpreter as ti
        grid_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
        tl, error = ti.tl, ti.InterpreterError
        assert callable(ti.InterpretedFunction.rewrite) and callable(ti._patch_lang)
    except (ImportError, AttributeError, AssertionError):     # another Triton: its own path
        return
    running: list[frozenset] = []           # the language modules of the grids running now, innermost last
    langs: dict[int, frozenset] = {}

    def lang_modules(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in langs:
            langs[key] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return langs[key]

    def run_grid(self, *args, **kwargs):
        running.append(lang_modules(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.pop()

    def call_device_function(self, *args, **kwargs):
        if not running or not lang_modules(self.fn) <= running[-1]:
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    ti.GridExecutor.__call__ = run_grid
    ti.InterpretedFunction.__call__ = call_device_function


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_device_calls_in_the_kernels_scope()
