"""What the engine tells those watching it, without their patching its methods.

An observer is handed to ``Engine(..., observers=[...])`` or attached with :meth:`Engine.observe`. The engine
calls, on its own thread:

- ``before_sync()`` once per forward, after the forward is queued on the device and before anything waits for
  it: the moment to do host work that would otherwise stall the next step (the async engine hands the previous
  iteration's outputs to the event loop then);
- ``step_done(record)`` after each :meth:`Engine.step`, with a :class:`StepRecord`.

Both do nothing by default; an observer overrides what it needs. An observer must not call back into the
engine: it runs inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One :meth:`Engine.step`: when it began (wall clock, comparable across a host's processes), how long it
    took, the outputs it gave and the sequences running when it ended."""

    began: float
    seconds: float
    outputs: int
    running: int


class StepObserver:
    def before_sync(self) -> None:
        """A forward is queued on the device and nothing has waited for it yet."""

    def step_done(self, record: StepRecord) -> None:
        """A step ended."""
