"""``StepPlan``: everything one engine iteration decided, as one value.

The schedule phase builds it; the memory phase makes its adapters resident; the
runner computes its chunks; the finish phase appends the sampled tokens and
frees what ended. Tensor-parallel workers get the tensors built from it (see
``vlora/parallel``), never the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlora.engine.orchestrator import Decision
from vlora.engine.scheduler import ScheduledSeq
from vlora.engine.sequence import Sequence


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[ScheduledSeq, ...]   # chunks computed this iteration: (sequence, first token, token count)
    preempted: tuple[Sequence, ...] = ()  # sent back to waiting, KV freed (recomputed later)
    truncated: tuple[Sequence, ...] = ()  # finished "length": would not fit even an empty KV cache
    decision: Decision | None = None      # the mode policy's choice (None: plain continuous batching)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def adapter_names(self) -> set[str]:
        """Adapters of the scheduled chunks (they must stay resident while the iteration runs)."""
        return {s.seq.adapter.name for s in self.scheduled if s.seq.adapter is not None}
