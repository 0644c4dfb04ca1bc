"""Shared fixtures: tiny random Llama-family checkpoints and PEFT adapters on disk."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

if not torch.cuda.is_available():          # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
