"""Copies of KV blocks between the GPU pool and host memory that overlap the running iterations.

A KV block swapped back in for a queued request, copied on the compute stream
when the request is admitted, would hold up every running request's next step
behind it, and a long history takes about as long to copy over PCIe as the GPU
takes to recompute it. :class:`StreamCopier` issues the copy on a copy stream
instead and hands back a completion token (a CUDA event): the scheduler admits
the request once its blocks have landed, and the iterations in between run
undisturbed (docs/decisions.md, 'Swap-ins on a copy stream').

The swapper has two copiers: one for swap-ins, one for swap-outs (GPU to
host: on CUDA the two directions may use separate copy engines). A copier has four
calls: ``copy(dst, src, after=None)`` issues a copy, after the copy of token
``after`` if one is given (a swap-in of a block whose swap-out is still under
way), and returns its token (None: already complete); ``done(token)`` says,
without blocking, whether it has completed; ``wait(token)`` blocks until it
has; ``barrier()`` makes the work queued next on the current stream wait for
every copy issued so far (a page whose swap-out is under way is written again
only after it). The CPU path copies at once (:class:`SyncCopier`).
"""

from __future__ import annotations

import torch


class SyncCopier:
    """Copies at once (the CPU pool): every token is None, complete."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        dst.copy_(src)
        return None

    def done(self, token) -> bool:
        return True

    def wait(self, token) -> None:
        return None

    def barrier(self) -> None:
        return None


class StreamCopier:
    """Copies on a copy stream of ``device``; the token is an event recorded after the copy.

    The copy stream first waits for the work queued so far on the current stream: the destination page was
    free, but kernels queued before may still read or write it (the request that last held it), and a swap-out
    queued there may still be writing the host slot this copy reads."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def done(self, token) -> bool:
        return token is None or token.query()

    def wait(self, token) -> None:
        if token is not None:
            token.synchronize()

    def barrier(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
