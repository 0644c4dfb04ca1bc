"""Incremental detokenization and stop strings.

The text of a sequence is the decode of its output tokens (special tokens
skipped); a stop string ends the output before it. Streaming holds back an
incomplete UTF-8 character and any tail that could still become a stop string.
"""

from __future__ import annotations

from vlora.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence) -> bool:
        """Refresh ``seq.text``; True when a stop string was found (text cut before it)."""
        if self.tokenizer is None:
            return False
        ids = seq.output_token_ids
        if ids and ids[-1] in seq.params.stop_token_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stops = seq.params.stop
        if stops:
            longest = max(len(s) for s in stops)
            start = max(0, len(seq.text) - longest)
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if hits:
                seq.text = text[:min(hits)]
                return True
        seq.text = text
        return False

    def stream_delta(self, seq: Sequence) -> str:
        """Text not yet emitted that is safe to emit now; advances the emitted mark."""
        if self.tokenizer is None:                 # token ids in and out: there is no text
            return ""
        end = len(seq.text)
        if not seq.is_finished:
            while end > seq.num_emitted_chars and seq.text[end - 1] == "\ufffd":
                end -= 1                           # incomplete multi-byte character
            if seq.params.stop:
                end = max(seq.num_emitted_chars, end - max(len(s) for s in seq.params.stop) + 1)
        delta = seq.text[seq.num_emitted_chars:end]
        seq.num_emitted_chars = max(seq.num_emitted_chars, end)
        return delta
