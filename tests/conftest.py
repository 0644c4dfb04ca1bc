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
