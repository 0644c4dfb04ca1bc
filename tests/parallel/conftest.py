"""Tiny Llama checkpoints with adapters of ranks 4/8/16, built once for the tensor-parallel tests."""

from __future__ import annotations

import pytest

from tests.parallel.test_tensor_parallel import build


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tp-llama"), kv_heads=2)


@pytest.fixture(scope="session")
def one_layer_llama(tmp_path_factory):
    """One decoder layer: the Triton kernels run in the interpreter, one program at a time."""
    return build(tmp_path_factory.mktemp("tp-llama-1"), kv_heads=2, num_hidden_layers=1)
