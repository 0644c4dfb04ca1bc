"""Outputs sent as deltas between processes decode to equal outputs, whatever the engine's fields do."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from vlora.engine.output_deltas import DeltaDecoder, DeltaEncoder
from vlora.engine.sequence import RequestOutput, TokenLogprobs


def _lp(t: int) -> TokenLogprobs:
    return TokenLogprobs(t, -0.5 * t, ((t, -0.5 * t), (t + 1, -2.0)))


@st.composite
def streams(draw):
    """A request's outputs: tokens and text mostly grow; now and then the text is rewritten (a field that did
    not simply grow) and steps add nothing; logprobs and prompt logprobs when asked for."""
    with_lp = draw(st.booleans())
    prompt = draw(st.lists(st.integers(0, 500), min_size=1, max_size=8))
    tokens, text, outs = [], "", []
    n = draw(st.integers(1, 12))
    for i in range(n):
        new = draw(st.lists(st.integers(0, 500), max_size=3))
        tokens = tokens + new
        delta = draw(st.text(max_size=4))
        text = draw(st.sampled_from([text + delta, delta + text[1:], text + delta]))
        last = i == n - 1
        outs.append(RequestOutput(
            "r", draw(st.sampled_from([None, "a1"])), prompt, list(tokens), text, last,
            draw(st.sampled_from(["stop", "length", "error"])) if last else None, new, delta,
            None if not last else draw(st.sampled_from([None, "why"])), None,
            [_lp(t) for t in tokens] if with_lp else None,
            [None, *(_lp(t) for t in prompt[1:])] if with_lp else None,
            float(-sum(tokens)) if with_lp else None))
    return outs


@settings(max_examples=150, deadline=None)
@given(st.lists(streams(), min_size=1, max_size=3))
def test_decoded_outputs_equal_the_encoded_ones(requests):
    enc, dec = DeltaEncoder(), DeltaDecoder()
    for i, outs in enumerate(requests):        # requests interleaved step by step, as in an engine step
        requests[i] = [o._replace(request_id=f"r{i}") for o in outs]
    for step in range(max(len(o) for o in requests)):
        wires = [enc.encode(outs[step]) for outs in requests if step < len(outs)]
        wires = pickle.loads(pickle.dumps(wires))               # as they cross
        want = [outs[step] for outs in requests if step < len(outs)]
        assert [dec.decode(w) for w in wires] == want
    assert not enc._sent and not dec._held                      # every request finished: nothing kept


def test_a_long_answer_crosses_as_its_new_tokens_only():
    enc = DeltaEncoder()
    prompt, tokens = list(range(512)), []
    sizes = []
    for i in range(200):
        tokens = tokens + [i]
        out = RequestOutput("r", None, prompt, list(tokens), "x" * len(tokens), False, None, [i], "x")
        sizes.append(len(pickle.dumps(enc.encode(out))))
    assert sizes[0] > 512 and max(sizes[1:]) < 100           # the prompt once, then a token and a character


def test_forget_drops_a_stream_that_ends_without_a_final_output():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    out = RequestOutput("r", None, [1], [2], "b", False, None, [2], "b")
    dec.decode(enc.encode(out))
    enc.forget(["r"])
    dec.forget(["r"])
    assert not enc._sent and not dec._held
    again = dec.decode(enc.encode(out))                         # a request of that id starts over
    assert again == out
