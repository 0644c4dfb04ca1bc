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
