"""What an error means for the engine: one request's, one iteration's, or the end of the engine.

* :class:`RowFailed` — an error pinned on one request (its sampling, logits
  processing, stop checks, detokenizing, task head). It travels as a value in
  place of that request's token; the engine finishes the request with
  ``finish_reason="error"`` and the reason, frees its memory, and the others go on.
* An error in the batched forward that cannot be pinned on one request fails
  every request of that iteration the same way; the engine restores its state
  (pages, adapter pins, base weights) and serves on.
* :class:`EngineFatal` — the engine cannot go on: a CUDA error (the context is
  lost or poisoned) or the forward failing ``MAX_FORWARD_FAILURES`` iterations
  in a row. ``Engine.step`` raises it; the async engine answers every request in
  flight with an error and the server process exits non-zero so a supervisor
  restarts it.
"""

from __future__ import annotations

import torch

MAX_FORWARD_FAILURES = 3      # consecutive failed iterations before the engine gives up

_CUDA_MARKS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS", "cuDNN error")


class RowFailed(Exception):
    """One request's failure inside an iteration (its row of the batch), with a reason for its client. The
    client-facing exception of a failed request is ``vlora.engine.client.RequestFailed``."""


class EngineFatal(RuntimeError):
    """The engine cannot serve any more; the process should exit."""


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the device unusable (after a CUDA error every later call fails too)."""
    accel = getattr(torch, "AcceleratorError", None)
    if isinstance(exc, EngineFatal) or (accel is not None and isinstance(exc, accel)):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError):      # recoverable: the iteration's memory comes back
        return False
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CUDA_MARKS)


def describe(exc: BaseException, limit: int = 200) -> str:
    """A one-line reason: the exception's type and the start of its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}" if text else type(exc).__name__
