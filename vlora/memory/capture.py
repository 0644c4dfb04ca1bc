"""The lock between a CUDA graph capture and the CUDA calls other threads make.

A capture in ``global`` mode (the engine's decode graphs, :mod:`vlora.engine.cuda_graphs`) is invalidated, and
the offending call fails, when any other thread makes a potentially unsafe CUDA call while it runs: an
allocation, a synchronous copy, registering host memory. The engine captures a decode graph on a batch size's
first use, while it serves, and the adapter loader's thread pins host memory and moves task heads to the device
meanwhile. So a capture holds :data:`CAPTURE`, and a thread other than the engine's takes it around each such
call, briefly: a capture waits at most one call, and a call at most one capture. Re-entrant: the capturing
thread itself may pin memory.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

import torch

CAPTURE = threading.RLock()


def guarded(device: torch.device):
    """``CAPTURE`` for CUDA calls on ``device`` (a no-op context elsewhere)."""
    return CAPTURE if device.type == "cuda" else nullcontext()
