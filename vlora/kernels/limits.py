"""The GPU's limits the kernels' tile choices must respect: opt-in shared memory per block and SM count.

Read from the device (Triton's driver, which is what Triton checks a launch against; torch's device
properties where Triton gives none), never assumed. ``VLORA_MAX_SHARED_MEM`` (bytes) and ``VLORA_MAX_SMS``
cap them, so a large GPU can run the kernels as a smaller one would: e.g. an A100's limits on an H100
(``VLORA_MAX_SHARED_MEM=166912 VLORA_MAX_SMS=108``) or an L40S's (``101376``, ``142``). With a shared-memory
cap, Triton itself is told the capped size, so a kernel that would not fit the smaller GPU fails its launch
here as it would there.

Known opt-in shared memory per block: H100/H200 232,448 bytes (227 KiB), A100 166,912 (163 KiB),
L40S / RTX 4090 / other Ada and Ampere consumer parts 101,376 (99 KiB).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    shared_bytes: int           # opt-in shared memory one block may use
    num_sms: int


# Under the Triton interpreter (no GPU) no tile is too large; the SM count sizes the fallback's split-K
# the way a data-center GPU would, so CPU runs exercise the same variants.
CPU = DeviceLimits("cpu", 1 << 30, 132)


def _cap(var: str) -> int | None:
    raw = os.environ.get(var)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{var} must be a positive integer, got {raw!r}")
    return value


def capped(limits: DeviceLimits) -> DeviceLimits:
    """``limits`` lowered to ``VLORA_MAX_SHARED_MEM`` / ``VLORA_MAX_SMS`` where those are set."""
    smem, sms = _cap("VLORA_MAX_SHARED_MEM"), _cap("VLORA_MAX_SMS")
    return DeviceLimits(limits.name, min(limits.shared_bytes, smem or limits.shared_bytes),
                        min(limits.num_sms, sms or limits.num_sms))


def _triton_shared(index: int) -> int | None:
    """Triton's figure of the device's opt-in shared memory per block (what its launches are checked against)."""
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:               # no Triton driver for this device
        return None


def _cuda_limits(index: int) -> DeviceLimits:
    props = torch.cuda.get_device_properties(index)
    smem = _triton_shared(index) or getattr(props, "shared_memory_per_block_optin", None)
    if not smem:
        raise RuntimeError(f"cannot read the shared memory per block of {props.name}")
    return DeviceLimits(props.name, int(smem), int(props.multi_processor_count))


def device_limits(device: torch.device | str | None = None) -> DeviceLimits:
    """The (capped) limits of ``device`` (default: the current CUDA device, else the interpreter's); read once per
    device (the kernel launchers ask on every launch)."""
    return _limits(None if device is None else str(device))


@lru_cache(maxsize=16)
def _limits(device: str | None) -> DeviceLimits:
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return capped(CPU)
    _enforce_cap_in_triton()
    return capped(_cuda_limits(dev.index if dev.index is not None else torch.cuda.current_device()))


_patched = False


def apply_limits(device: torch.device | str | None = None) -> DeviceLimits:
    """Read ``device``'s limits and, with ``VLORA_MAX_SHARED_MEM`` set, make Triton's launch check compare
    against the cap: the engine calls it at start, before any kernel is built (the kernel launchers also read
    the limits before their first launch)."""
    return device_limits(device)


def _enforce_cap_in_triton() -> None:
    """With ``VLORA_MAX_SHARED_MEM`` set, make Triton's launch check compare against the cap, not the device."""
    global _patched
    if _patched or _cap("VLORA_MAX_SHARED_MEM") is None:
        return
    from triton.compiler import compiler

    real = compiler.max_shared_mem
    compiler.max_shared_mem = lambda device: min(real(device), _cap("VLORA_MAX_SHARED_MEM"))
    _patched = True
