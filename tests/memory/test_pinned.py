"""Exact-size page-locked host memory (GPU machines only: registration needs the driver)."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.mark.gpu
def test_pinned_empty_is_page_locked_at_its_size_and_copies_asynchronously():
    from vlora.memory.pinned import pinned_empty

    t = pinned_empty((3, 1000003), torch.bfloat16)            # not a power of two
    assert t.shape == (3, 1000003) and t.dtype == torch.bfloat16 and t.is_pinned()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    dev = torch.empty_like(t, device="cuda")
    dev.copy_(t, non_blocking=True)
    back = pinned_empty(t.shape, t.dtype)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)
    view = t[1]                                                # a view keeps the registration alive
    del t
    gc.collect()
    assert view.is_pinned()
    del view, back
    gc.collect()
    again = pinned_empty(17, torch.float32)                    # registering after unregistering works
    assert again.is_pinned()


@pytest.mark.gpu
def test_a_failed_registration_falls_back_and_leaves_no_cuda_error(monkeypatch):
    """Registering memory that is already registered fails: the caching allocator serves instead, and the
    failure does not surface later from an unrelated torch op."""
    import numpy as np

    from vlora.memory import pinned

    taken = np.empty(1 << 20, np.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(taken.ctypes.data, taken.nbytes, 0)) == 0

    class _Np:                         # pinned_empty gets the already-registered array
        uint8 = np.uint8
        empty = staticmethod(lambda n, dtype: taken)

    monkeypatch.setattr(pinned, "np", _Np)
    t = pinned.pinned_empty(1 << 20, torch.uint8)
    assert t.is_pinned()
    torch.zeros(4, device="cuda").add_(1)                      # would raise the stale registration error
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(taken.ctypes.data)
