"""Per-sequence token counts on the device, for presence, frequency and repetition penalties.

Each sequence with a penalty owns a row ("slot") of two tables: how many times it generated each token
(``counts`` [slots, V] int32) and which tokens its prompt holds (``in_prompt`` [slots, V] bool). The sampler
reads a batch's rows with one gather and adds the tokens it sampled with one scatter, on the device, so the
counts stay right while the next decode is queued before this one's tokens are read, and after preemption
and recompute (the slot outlives it). A slot is taken back once its sequence has finished, when a slot is
next needed; the tables grow by doubling.
"""

from __future__ import annotations

import torch

from vlora.engine.sequence import Sequence


class TokenCounts:
    def __init__(self, vocab: int, device: torch.device, capacity: int = 8):
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(capacity, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)
        self._owners: list[Sequence | None] = [None] * capacity
        self._slots: dict[str, int] = {}              # request id -> slot

    def slot(self, seq: Sequence) -> int:
        """``seq``'s row, set up (its prompt marked, its output so far counted) when it gets one."""
        s = self._slots.get(seq.request_id)
        if s is not None and self._owners[s] is seq:
            return s
        s = self._free_slot()
        self._owners[s], self._slots[seq.request_id] = seq, s
        self.counts[s].zero_()
        self.in_prompt[s].zero_()
        prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        self.in_prompt[s, prompt] = True
        out = [t for t in seq.output_token_ids if t != Sequence.PENDING]
        if out:
            ids = torch.tensor(out, dtype=torch.long).to(self.device, non_blocking=True)
            self.counts[s].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        return s

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count ``tokens`` [P] (sampled, on the device) for the rows ``slots`` [P]."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def _free_slot(self) -> int:
        if None not in self._owners:                   # the slots of finished sequences go back
            for i, owner in enumerate(self._owners):
                if owner.is_finished or self._slots.get(owner.request_id) != i:
                    if self._slots.get(owner.request_id) == i:
                        del self._slots[owner.request_id]
                    self._owners[i] = None
        if None in self._owners:
            return self._owners.index(None)
        n = len(self._owners)                          # every slot is live: double the tables
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self._owners += [None] * n
        return n
