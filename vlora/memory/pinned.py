"""Page-locked host memory at its exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every block up to a power of two: 24 GiB of host KV
slots would lock 32 GiB, and an adapter's 20 MiB of matrices 32 MiB.
:func:`pinned_empty` allocates ordinary host memory and registers that range,
rounded out to whole pages, with the driver (``cudaHostRegister``; a large one
in pieces while the engine serves), and unregisters it when the last tensor
viewing it is gone. Where registration fails it falls back to the caching
allocator.
"""

from __future__ import annotations

import logging
import math
import time
import weakref

import numpy as np
import torch

from vlora.memory.capture import CAPTURE

log = logging.getLogger(__name__)


def _code(err) -> int:
    """The integer of a cudart call's result (an enum, a tuple holding one, or an int)."""
    if isinstance(err, tuple):
        err = err[0]
    return int(getattr(err, "value", err))


def _unregister(ptrs: list[int]) -> None:
    try:
        cudart = torch.cuda.cudart()
        with CAPTURE:
            for ptr in ptrs:
                cudart.cudaHostUnregister(ptr)
    except Exception:                  # interpreter shutdown: the driver may be gone already
        pass


def _clear_last_error() -> None:
    """A failed runtime call leaves its error as the thread's "last error", which the next torch kernel launch
    check would raise from an unrelated op: read it (reading clears it)."""
    cudart = torch.cuda.cudart()
    if hasattr(cudart, "cudaGetLastError"):
        cudart.cudaGetLastError()
    try:                               # a launch check calls cudaGetLastError too; a stale error raises here
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:
        pass


PAGE = 4096
"""Registrations start and end on page boundaries: two that shared a page would be refused."""

PIECE_BYTES = 4 << 20
"""A large buffer is registered with the driver this much at a time (:func:`pinned_empty`'s ``pieces``). A
registration of fresh memory faults in and locks its pages inside the driver, at about 4 GB/s on an H100 host
(19 ms for a rank-16 Llama-2-7B adapter's 80 MB, 64-78 ms for rank 64), and the engine's thread stalls meanwhile
(its steps took 20-42 ms instead of 9). So the pages are faulted in first, outside the driver, then registered
4 MiB at a time with a pause between pieces in which other threads' CUDA calls go first."""

PIECE_PAUSE_S = 2e-4
"""The pause between two pieces' registrations, in which a thread waiting for the driver gets it first."""


def pinned_empty(shape: tuple[int, ...] | int, dtype: torch.dtype, pieces: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` whose memory is page-locked for asynchronous copies.

    ``pieces``: zero-filled (its pages faulted in before they are registered) and registered :data:`PIECE_BYTES`
    at a time (for buffers registered while the engine serves, such as an adapter's host copy); an asynchronous
    copy from it then must not cross a piece's boundary (:func:`piece_slices`). Registering is one of the calls a
    CUDA graph capture must not meet on another thread: each takes :data:`~vlora.memory.capture.CAPTURE`."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        with CAPTURE:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
    span = -(-nbytes // PAGE) * PAGE                    # whole pages, all inside ``raw``
    raw = np.empty(span + PAGE, dtype=np.uint8)
    first = -raw.ctypes.data % PAGE
    raw_view = raw[first:first + span]
    ptr = raw_view.ctypes.data
    if pieces:
        raw_view.fill(0)                                # faults the pages in now, on this thread
    done = _register(ptr, span, PIECE_BYTES if pieces else span)
    if done is None:
        with CAPTURE:
            _clear_last_error()
            return (torch.zeros if pieces else torch.empty)(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(raw, _unregister, done)      # runs once every tensor over ``raw`` is gone
    return torch.from_numpy(raw_view[:nbytes]).view(dtype).view(shape)


def pin_in_place(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s memory page-locked where it is (``t``: a contiguous CPU tensor that starts on a page boundary and is
    alone on its pages, such as a buffer of its own in shared memory), :data:`PIECE_BYTES` at a time, its pages
    faulted in first: a tensor over that memory, which stays locked while any view of that tensor lives (so an
    asynchronous copy from it must not cross a piece's boundary: :func:`piece_slices`). None, with nothing
    changed, where that is not possible or the driver refuses."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes == 0 or t.data_ptr() % PAGE:
        return None
    t.view(torch.uint8)[::PAGE].max()                    # faults the pages in, outside the driver's lock
    done = _register(t.data_ptr(), -(-nbytes // PAGE) * PAGE, PIECE_BYTES)
    if done is None:
        with CAPTURE:
            _clear_last_error()
        return None
    owner = t.reshape(-1).view(torch.uint8).numpy()      # holds ``t``; every view of the result holds it
    weakref.finalize(owner, _unregister, done)
    return torch.from_numpy(owner).view(t.dtype).view(t.shape)


def _register(ptr: int, span: int, step: int) -> list[int] | None:
    """Register ``span`` bytes (whole pages) from ``ptr`` with the driver, ``step`` bytes at a time with a pause
    between, each under the capture lock; the pieces' addresses, or None (nothing left registered) where the
    driver refused one (its error is still the thread's last error)."""
    cudart = torch.cuda.cudart()
    done: list[int] = []
    for off in range(0, span, step):
        if done:
            time.sleep(PIECE_PAUSE_S)
        with CAPTURE:
            code = _code(cudart.cudaHostRegister(ptr + off, min(step, span - off), 0))
        if code != 0:
            log.warning("cudaHostRegister of %d bytes failed (error %d); falling back to the caching pinned allocator",
                        min(step, span - off), code)
            _unregister(done)
            return None
        done.append(ptr + off)
    return done


def piece_slices(numel: int, dtype: torch.dtype) -> list[slice]:
    """The element ranges of a flat :func:`pinned_empty` buffer of ``numel`` elements registered in pieces: one
    asynchronous copy per range."""
    step = PIECE_BYTES // dtype.itemsize
    return [slice(i, min(i + step, numel)) for i in range(0, numel, step)]
