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


@pytest.mark.gpu
def test_a_buffer_registered_in_pieces_copies_piece_by_piece():
    """``pieces``: a buffer larger than a piece (not a whole number of pages either) is zero-filled and page-locked
    throughout, and one asynchronous copy per piece moves it to the device and back unchanged."""
    from vlora.memory.pinned import PIECE_BYTES, pinned_empty, piece_slices

    n = (5 * PIECE_BYTES) // 2 + 1234                         # float32 elements: 10 pieces and a bit
    t = pinned_empty(n, torch.float32, pieces=True)
    assert t.numel() == n and t.is_pinned() and t[-1:].is_pinned() and t[PIECE_BYTES // 4:].is_pinned()
    assert not t.any()                                         # zero-filled: an adapter's padding relies on it
    t.copy_(torch.arange(n, dtype=torch.float32))
    slices = piece_slices(n, torch.float32)
    assert len(slices) == -(-n * 4 // PIECE_BYTES) and slices[0].start == 0 and slices[-1].stop == n
    dev = torch.empty(n, device="cuda")
    for s in slices:
        dev[s].copy_(t[s], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), t)
    del t
    gc.collect()                                               # every piece unregistered: registering again works
    assert pinned_empty(n, torch.float32, pieces=True).is_pinned()


@pytest.mark.gpu
def test_pinning_and_copies_on_another_thread_do_not_break_a_global_capture():
    """The adapter loader's CUDA calls (pinning in pieces, moving a tensor to the device) take the capture lock,
    so graphs captured meanwhile in ``global`` mode, as the engine captures its decode graphs while serving,
    neither fail nor make those calls fail."""
    import threading

    from vlora.memory.capture import CAPTURE, guarded
    from vlora.memory.pinned import pinned_empty

    stop, errors = threading.Event(), []

    def loader():
        try:
            while not stop.is_set():
                pinned_empty(3_000_000, torch.float32, pieces=True)
                with guarded(torch.device("cuda")):
                    torch.ones(1000).to("cuda")
                gc.collect()                                   # unregistering takes the lock too
        except Exception as e:                                 # noqa: BLE001 - reported by the assertion
            errors.append(e)

    x = torch.zeros(1 << 16, device="cuda")
    th = threading.Thread(target=loader)
    th.start()
    try:
        for _ in range(50):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                (x * 2).sum()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with CAPTURE, torch.cuda.graph(graph, capture_error_mode="global"):
                y = (x * 2 + 1).sum()
            graph.replay()
            torch.cuda.synchronize()
            assert y.item() == x.numel()
    finally:
        stop.set()
        th.join()
    assert not errors, errors


@pytest.mark.gpu
def test_shared_memory_is_page_locked_in_place_while_a_view_lives():
    """A buffer in shared memory (as the adapter loader process hands one over) is registered where it is: the
    result is pinned, copies asynchronously piece by piece, and stays registered while a view of it lives."""
    from vlora.lora.loader import shared_zeros
    from vlora.memory.pinned import PIECE_BYTES, pin_in_place, piece_slices

    n = PIECE_BYTES + 12345                                      # more than a piece, not whole pages
    src = shared_zeros(n, torch.bfloat16)
    src.copy_(torch.arange(n, dtype=torch.float32) % 251)
    t = pin_in_place(src)
    assert t is not None and t.is_pinned() and t.data_ptr() == src.data_ptr() and torch.equal(t, src)
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for piece in piece_slices(n, t.dtype):
        dev[piece].copy_(t[piece], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src)
    view = t[5:]
    del t
    gc.collect()
    assert view.is_pinned()
    del view
    gc.collect()
    assert pin_in_place(src) is not None                         # unregistered when the last view went
    assert pin_in_place(shared_zeros(n, torch.bfloat16)[1:]) is None     # not on a page boundary
