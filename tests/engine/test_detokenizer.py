"""Incremental detokenization equals the full decode after every step (hypothesis over token ids: random,
emoji/CJK byte pieces, spaces, newlines, special tokens), and stop strings and streaming behave as with the
full decode; tokenizers whose decode is not exact per window fall back to the full decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vlora.engine.detokenizer import Detokenizer, incremental_backend
from vlora.engine.sequence import Sequence, Status
from vlora.sampling_params import SamplingParams

# text whose tokens split multi-byte characters (emoji, CJK, combining marks) and hold spaces and newlines
ADVERSARIAL = "😀🎉👍🏽 中文字符 日本語の 한국어 \n\n  \t é ñ 𝄞 ́ \r\n🇫🇷 Ω≈ç√ ▁ \ufffd"


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from vlora.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def _byte_level(cleanup: bool = False) -> PreTrainedTokenizerFast:
    """A tiny GPT-2 style tokenizer: the 256 byte pieces, a few merges, a special and two added tokens that
    are not special (one of them non-ASCII). ``cleanup``: the cleanup of spaces in effect (transformers
    skips it for BPE unless forced)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("ä", "¸"), ("ð", "Ł")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.add_tokens([AddedToken("<tool>", special=False), AddedToken("é!", special=False)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=cleanup)
    out.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = cleanup
    return out


def _byte_fallback() -> PreTrainedTokenizerFast:
    """A tiny Llama-style tokenizer (SentencePiece pieces, byte fallback, the leading space stripped)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "▁the", "he", "▁a", "b", "中"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def _pool(tok) -> list[int]:
    """Token ids that make hard cases: the pieces of ADVERSARIAL, single high bytes, the special tokens."""
    ids = set(tok.encode(ADVERSARIAL, add_special_tokens=False)) | set(tok.all_special_ids)
    byte_piece = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    ids |= {i for i in tok.convert_tokens_to_ids([byte_piece[b] for b in range(0x80, 0x100)])
            if i is not None and i != tok.unk_token_id}
    return sorted(ids)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _seq(ids=(), stop=(), stop_token_ids=()) -> Sequence:
    return Sequence("r", [1], SamplingParams(stop=stop, stop_token_ids=stop_token_ids), None, 0,
                    output_token_ids=list(ids))


def _full(tok) -> Detokenizer:
    """Today's reference: the whole output decoded every step."""
    d = Detokenizer(tok)
    d.backend = None
    return d


def _chunks(tok, pool):
    ids = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(pool), st.sampled_from(pool))
    first = st.lists(ids, max_size=12)              # set at once, as a resumed request's tokens are
    return st.tuples(first, st.lists(st.lists(ids, min_size=1, max_size=3), max_size=40))


def _check_steps(tok, first, steps, stop_token_ids=()):
    inc = Detokenizer(tok)
    assert inc.backend is not None
    seq = _seq(first, stop_token_ids=stop_token_ids)
    for chunk in [[]] + steps:
        seq.output_token_ids.extend(chunk)
        assert inc.update(seq) is False
        ids = seq.output_token_ids
        want = tok.decode(ids[:-1] if ids and ids[-1] in stop_token_ids else ids, skip_special_tokens=True)
        assert seq.text == want


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_smollm2_text_equals_full_decode_every_step(smollm2, data):
    first, steps = data.draw(_chunks(smollm2, _pool(smollm2)))
    stop_ids = data.draw(st.sampled_from([(), (2,), (smollm2.encode(" the", add_special_tokens=False)[0],)]))
    _check_steps(smollm2, first, steps, stop_ids)


@SETTINGS
@given(data=st.data())
def test_byte_level_with_added_tokens_equals_full_decode_every_step(data):
    tok = _byte_level()
    first, steps = data.draw(_chunks(tok, _pool(tok) + tok.convert_tokens_to_ids(["<tool>", "é!", "<eos>"])))
    _check_steps(tok, first, steps)


@SETTINGS
@given(data=st.data())
def test_stop_strings_and_stream_as_with_the_full_decode(smollm2, data):
    """Same stop (and cut), same text and same streamed deltas as decoding everything each step; the stop
    strings are pieces of the output itself, so they are found, also across token boundaries."""
    first, steps = data.draw(_chunks(smollm2, _pool(smollm2)))
    text = smollm2.decode(first + [t for c in steps for t in c], skip_special_tokens=True)
    piece = st.integers(0, max(0, len(text) - 1)).flatmap(
        lambda i: st.integers(1, 4).map(lambda k: text[i:i + k] or "x"))
    stop = tuple(data.draw(st.lists(piece, max_size=2)))
    inc, full = Detokenizer(smollm2), _full(smollm2)
    a, b = _seq(first, stop=stop), _seq(first, stop=stop)
    for chunk in [[]] + steps:
        a.output_token_ids.extend(chunk)
        b.output_token_ids.extend(chunk)
        stopped = inc.update(a)
        assert stopped == full.update(b) and a.text == b.text
        if stopped:
            a.status = b.status = Status.FINISHED
        assert inc.stream_delta(a) == full.stream_delta(b)
        if stopped:
            break


def test_stop_string_across_tokens_and_streaming_holds_back(smollm2):
    ids = smollm2.encode("Hello world, stop here", add_special_tokens=False)
    detok, seq = Detokenizer(smollm2), _seq(stop=("p he",))
    streamed = ""
    for t in ids:
        seq.output_token_ids.append(t)
        if detok.update(seq):
            seq.status = Status.FINISHED
        streamed += detok.stream_delta(seq)
    assert seq.text == "Hello world, sto" and streamed == seq.text and seq.is_finished


def test_incomplete_character_is_in_the_text_and_held_from_the_stream(smollm2):
    ids = smollm2.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3                           # the emoji's four bytes come in more than one token
    detok, seq = Detokenizer(smollm2), _seq()
    seq.output_token_ids.extend(ids[:-1])
    detok.update(seq)
    assert seq.text == smollm2.decode(ids[:-1]) and seq.text.endswith("\ufffd")
    assert detok.stream_delta(seq) == "a"
    seq.output_token_ids.append(ids[-1])
    detok.update(seq)
    assert seq.text == "a😀" and detok.stream_delta(seq) == "😀"


def test_long_undecodable_tail_is_taken_in(smollm2):
    """Stray continuation bytes never complete a character: the read offset still moves on, and the text
    stays the full decode."""
    cont = smollm2.convert_tokens_to_ids(_bytes_to_unicode()[0x80])
    detok, seq = Detokenizer(smollm2), _seq()
    for _ in range(40):
        seq.output_token_ids.append(cont)
        detok.update(seq)
        assert seq.text == smollm2.decode(seq.output_token_ids)
    assert seq.detok_state.read >= 30


def test_tokens_cut_start_over(smollm2):
    ids = smollm2.encode("one two three four", add_special_tokens=False)
    detok, seq = Detokenizer(smollm2), _seq(ids)
    detok.update(seq)
    del seq.output_token_ids[2:]
    seq.output_token_ids += smollm2.encode(" 中", add_special_tokens=False)
    detok.update(seq)
    assert seq.text == smollm2.decode(seq.output_token_ids)


def test_only_tokenizers_exact_per_window_decode_incrementally(smollm2):
    assert incremental_backend(smollm2) is not None and incremental_backend(_byte_level()) is not None
    assert incremental_backend(_byte_level(cleanup=True)) is None      # the cleanup spans token boundaries
    assert incremental_backend(_byte_fallback()) is None               # a byte run decodes as a whole
    assert Detokenizer(None).update(_seq([5])) is False


def test_byte_fallback_tokenizer_decodes_fully_every_step():
    """Its text can change before the last token (a byte run that does not decode shows every byte as a
    replacement character): the full decode each step keeps it exact."""
    tok = _byte_fallback()
    ids = tok.convert_tokens_to_ids(["▁the", "<0xE4>", "<0xB8>", "<0xAD>", "<0xE4>", "<0xB8>", "<0xAD>", "b"])
    detok, seq = Detokenizer(tok), _seq()
    for t in ids:
        seq.output_token_ids.append(t)
        detok.update(seq)
        assert seq.text == tok.decode(seq.output_token_ids, skip_special_tokens=True)
    assert seq.text == "the中中b"


def test_each_step_decodes_a_short_window(smollm2):
    """Not the whole output: on text that decodes (emoji and CJK split over tokens included) a step decodes
    the tokens since the last complete character."""
    windows = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            windows.append(len(ids))
            return smollm2.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smollm2.encode(ADVERSARIAL * 4, add_special_tokens=False)
    detok, seq = Detokenizer(smollm2), _seq()
    detok.backend = Counting()
    for t in ids:
        seq.output_token_ids.append(t)
        detok.update(seq)
    assert seq.text == ADVERSARIAL * 4 and len(windows) == len(ids) and max(windows) <= 4


def test_character_split_by_special_tokens_after_a_long_undecodable_tail(smollm2):
    """Special tokens decode to nothing: a split that leaves only them open would cut the emoji's bytes."""
    byte = dict(zip(range(256), _bytes_to_unicode()))
    stray, f0, x9f, x98, x80 = smollm2.convert_tokens_to_ids([byte[b] for b in (0x80, 0xF0, 0x9F, 0x98, 0x80)])
    ids = [stray] * 5 + [f0, x9f] + [1, 2] * 4 + [x98, x80]
    detok, seq = Detokenizer(smollm2), _seq()
    for t in ids:
        seq.output_token_ids.append(t)
        detok.update(seq)
        assert seq.text == smollm2.decode(seq.output_token_ids, skip_special_tokens=True)
    assert seq.text.endswith("😀")


def test_stop_string_found_where_replacement_characters_resolve():
    """A byte-fallback run shows every byte as a replacement character until its last byte comes, then
    fewer characters: the stop search starts before the replaced ones."""
    tok = _byte_fallback()
    ids = tok.convert_tokens_to_ids(["▁the", "<0xE4>", "<0xB8>", "<0xAD>", "<0xE4>", "<0xB8>", "<0xAD>"])
    detok, seq = Detokenizer(tok), _seq(stop=("中中",))
    stopped = [False]
    for t in ids:
        seq.output_token_ids.append(t)
        stopped.append(detok.update(seq))
    assert stopped[-1] is True and not any(stopped[:-1]) and seq.text == "the"
