"""Page-locked host memory at its exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every block up to a power of two: 24 GiB of host KV
slots would lock 32 GiB, and an adapter's 20 MiB of matrices 32 MiB.
:func:`pinned_empty` allocates ordinary host memory and registers exactly that
range with the driver (``cudaHostRegister``), and unregisters it when the last
tensor viewing it is gone. Where registration fails it falls back to the
caching allocator.
"""

from __future__ import annotations

import logging
import math
import weakref

import numpy as np
import torch

log = logging.getLogger(__name__)


def _code(err) -> int:
    """The integer of a cudart call's result (an enum, a tuple holding one, or an int)."""
    if isinstance(err, tuple):
        err = err[0]
    return int(getattr(err, "value", err))


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
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


def pinned_empty(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` whose memory is page-locked for asynchronous copies."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    raw = np.empty(nbytes, dtype=np.uint8)
    ptr = raw.ctypes.data
    code = _code(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if code != 0:
        log.warning("cudaHostRegister of %d bytes failed (error %d); using the caching pinned allocator",
                    nbytes, code)
        _clear_last_error()
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(raw, _unregister, ptr)       # runs once every tensor over ``raw`` is gone
    return torch.from_numpy(raw).view(dtype).view(shape)
