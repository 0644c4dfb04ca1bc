"""The text of a request the front moved between replicas, decoded at the front over all its tokens.

A replica that resumes a request sees the tokens sent before the move as prompt, so its text and its stop
strings cover only the tokens after it. From its first move on, the front decodes the request's text itself
with the engine's :class:`~vlora.engine.detokenizer.Detokenizer`, over every output token: text, stream
deltas and stop strings are those of one engine that ran the request unmoved.
"""

from __future__ import annotations

from vlora.engine.detokenizer import Detokenizer, DetokState
from vlora.sampling_params import SamplingParams


class ResumedText:
    """A moved request's text state, in the form the detokenizer reads and advances
    (:class:`~vlora.engine.detokenizer.Detokenized`)."""

    def __init__(self, detokenizer: Detokenizer, params: SamplingParams, tokens: list[int], emitted: int):
        """``tokens``: the request's output tokens, the list the front extends as they arrive (shared, not
        copied); ``emitted``: characters of text already streamed to the client."""
        self.detokenizer = detokenizer
        self.params = params
        self.output_token_ids = tokens
        self.text = ""
        self.detok_state: DetokState | None = None
        self.num_emitted_chars = emitted
        self.is_finished = False
        detokenizer.update(self)

    def update(self) -> bool:
        """Decode the tokens added since the last call; True when a stop string was found (text cut before
        it)."""
        return self.detokenizer.update(self)

    def finish(self) -> None:
        """No token comes after: the next delta holds what streaming held back."""
        self.is_finished = True

    def delta(self) -> str:
        """Text not yet streamed that is safe to stream now; advances the streamed mark."""
        return self.detokenizer.stream_delta(self)
