"""Structured output: the sampler's grammar mask (a forbidden token is never drawn), and through the engine outputs
that parse and validate against their JSON schema, regex or choice: greedy and sampled, with and without an
adapter, in the async loop (whose lookahead queues a constrained row's forward before its last token is read and
its sampling once that token has advanced the grammar), and after preemption and recompute. The model is a tiny random Llama with the embedded model's tokenizer, so that
llguidance sees a real vocabulary; its outputs are noise, which the grammar must hold anyway."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.helpers import make_peft_adapter, make_tiny_model
from vlora import LLM, GuidedSpec, SamplingParams
from vlora.engine.engine import RequestError
from vlora.engine.guided import apply
from vlora.engine.sampler import Sampler
from vlora.engine.sequence import Sequence

VOCAB = 49152                      # the embedded model's tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object",
                                               "properties": {"id": {"type": "integer", "minimum": 0,
                                                                     "maximum": 999},
                                                              "role": {"enum": ["admin", "guest"]}},
                                               "required": ["id", "role"], "additionalProperties": False},
                                      "active": {"type": "boolean"}},
     "required": ["user", "active"], "additionalProperties": False},
]


# -- the sampler's mask ------------------------------------------------------------------------------------
def _bitmask(allowed_rows: list[list[int] | None], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    m = torch.full((len(allowed_rows), words), -1, dtype=torch.int32)
    for r, allowed in enumerate(allowed_rows):
        if allowed is not None:
            m[r] = 0
            for t in allowed:
                m[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return m


def test_apply_forbids_exactly_the_cleared_bits():
    x = torch.randn(3, 70)
    out = apply(x, _bitmask([[0, 31, 32, 63, 69], None, list(range(0, 70, 2))], 70))
    assert torch.equal(out[1], x[1])                                  # a row without a grammar is untouched
    for r, allowed in ((0, {0, 31, 32, 63, 69}), (2, set(range(0, 70, 2)))):
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert kept == allowed
        assert torch.equal(out[r][sorted(allowed)], x[r][sorted(allowed)])


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_forbidden_token_is_never_drawn(temperature):
    vocab = 64
    sampler = Sampler(vocab, (1,), torch.device("cpu"))
    allowed = [[3, 40], None, [63]]
    seqs = [Sequence(f"r{i}", [5], SamplingParams(temperature=temperature, logprobs=1), None, i, sample_seed=i)
            for i in range(3)]
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 30.0                                               # the favourite, forbidden to rows 0 and 2
    for step in range(20):
        for s in seqs:
            s.output_token_ids.append(0)                              # a new position: new noise
        got = sampler.sample(logits, seqs, allowed=_bitmask(allowed, vocab)).result()
        assert got[0].token_id in (3, 40) and got[2].token_id == 63
        assert got[1].token_id == 7
        assert got[2].logprob < -20                                   # logprobs stay the model's own
    assert torch.isfinite(logits).all()                               # the logits are not written


# -- through the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with the embedded model's tokenizer, and a LoRA adapter of it."""
    from transformers import AutoTokenizer

    from vlora.models.loader import resolve_model_dir

    root = tmp_path_factory.mktemp("structured")
    path, hf = make_tiny_model(root, vocab_size=VOCAB, eos_token_id=2, bos_token_id=1)
    AutoTokenizer.from_pretrained(resolve_model_dir(None)).save_pretrained(path)
    return path, make_peft_adapter(hf, root / "lora", 8, seed=1)


def engine(tiny, async_scheduling=False, adapter=True, **kw) -> LLM:
    path, lora = tiny
    kw = {"num_blocks": 64, "block_size": 8, "max_model_len": 256, "dtype": "float32", "max_num_seqs": 16,
          "max_num_batched_tokens": 256, **kw}
    return LLM(str(path), device="cpu", adapters={"lora": str(lora)} if adapter else None,
               async_scheduling=async_scheduling, **kw)


def stub_engine(tiny, async_scheduling: bool) -> LLM:
    """No adapters, decode graphs (CPU emulation) and a stub forward (the graphs' Triton kernels would run in
    the interpreter): row ``i``'s logits are a fixed function of its input token and position over the whole
    vocabulary, so that async scheduling overlaps iterations and every token checks the input wiring."""
    llm = engine(tiny, async_scheduling, adapter=False)
    model = llm.engine.model
    phases = torch.arange(VOCAB, dtype=torch.float32) * 0.37

    def forward(fb, kv_cache):
        return (fb.input_ids * 31 + fb.positions * 17).to(torch.float32).unsqueeze(1)

    def compute_logits(hidden, fast=False):
        return 8.0 * torch.sin(hidden[:, :1] * 0.001 + phases)

    model.forward, model.compute_logits = forward, compute_logits
    llm.engine.runner.enable_graphs(16, llm.engine.max_model_len)
    return llm


COMBOS = [((0.0, None), (1.0, "lora")), ((0.0, "lora"), (1.0, None)), ((0.0, None), (1.0, "lora")),
          ((0.0, "lora"), (0.0, None))]
"""(temperature, adapter) of the two requests of each schema: greedy and sampled, base and adapter."""


def jobs(adapter=True):
    """(prompt, adapter, params): each schema twice, a regex and a choice, and one unconstrained request."""
    out = []
    for i, (schema, combos) in enumerate(zip(SCHEMAS, COMBOS)):
        for j, (temp, name) in enumerate(combos):
            out.append((f"Record {i} {j}:", name if adapter else None,
                        SamplingParams(max_tokens=120, temperature=temp, seed=10 * i + j,
                                       guided=GuidedSpec(json_schema=schema))))
    out.append(("Code:", "lora" if adapter else None,
                SamplingParams(max_tokens=30, temperature=1.0, seed=3, guided=GuidedSpec(regex=r"[A-Z]{3}-[0-9]{2,4}"))))
    out.append(("Answer:", None, SamplingParams(max_tokens=30, guided=GuidedSpec(choice=["yes", "no", "maybe"]))))
    out.append(("Free text:", None, SamplingParams(max_tokens=12, ignore_eos=True)))     # unconstrained
    return out


def generate(llm, js):
    return llm.generate([p for p, _, _ in js], [a for _, a, _ in js], [sp for _, _, sp in js])


def check(outs, js) -> None:
    for o, (_, _, sp) in zip(outs, js):
        g = sp.guided
        if g is None:
            assert o.finish_reason == "length" and len(o.token_ids) == 12
            continue
        assert o.finish_reason == "stop", (o.text, o.token_ids)       # the grammar completed: no EOS needed
        if g.json_schema is not None:
            jsonschema.validate(json.loads(o.text), json.loads(g.json_schema))
        elif g.regex is not None:
            assert re.fullmatch(g.regex, o.text), o.text
        else:
            assert o.text in g.choice


def test_outputs_match_their_schema_regex_and_choice_in_the_async_loop(tiny):
    llm, js = stub_engine(tiny, True), jobs(adapter=False)
    outs = generate(llm, js)
    check(outs, js)
    assert llm.engine.num_overlapped > 0                  # decodes queued behind one another, constrained rows in
    sync = generate(stub_engine(tiny, False), js)
    assert [o.token_ids for o in sync] == [o.token_ids for o in outs]     # the tokens of the sync loop, exactly


def test_adapters_and_preemption_with_recompute_keep_the_constrained_tokens(tiny):
    js = jobs()
    want = generate(engine(tiny), js)
    check(want, js)
    assert len({o.text for o in want[:8]}) > 4                        # sampled and adapted outputs differ
    small = engine(tiny, num_blocks=10)                               # the batch outgrows the pool
    outs = generate(small, js)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_a_constrained_request_is_never_handed_back_to_the_cluster(tiny):
    """Its grammar's state lives on this replica: preempted on a replica that hands requests back, or asked to
    migrate, it stays and finishes here, valid; an unconstrained one beside it goes back."""
    js = jobs(adapter=False)
    want = generate(engine(tiny, adapter=False), js)
    small = engine(tiny, adapter=False, num_blocks=10)              # the batch outgrows the pool
    small.engine.hand_back_preempted = True
    outs = generate(small, js)
    assert small.engine.scheduler.num_preemptions > 0
    guided = [i for i, (_, _, sp) in enumerate(js) if sp.guided is not None]
    assert [outs[i].token_ids for i in guided] == [want[i].token_ids for i in guided]
    check([outs[i] for i in guided], [js[i] for i in guided])
    rid = small.engine.add_request("Record:", None, js[0][2])
    small.engine.step()
    assert not small.engine.hand_back(rid)
    assert small.engine.abort(rid)


def test_a_schema_that_cannot_compile_names_the_field(tiny):
    llm = engine(tiny)
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("x", None, SamplingParams(guided=GuidedSpec(json_schema={"type": "frobnicate"})))
    assert e.value.param == "guided" and "frobnicate" in str(e.value)
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("x", None, SamplingParams(guided=GuidedSpec(regex="a(b")))
    assert e.value.param == "guided"
    norm = LLM("random:tiny-llama", device="cpu", num_blocks=16)       # no tokenizer: no grammar
    with pytest.raises(RequestError, match="tokenizer"):
        norm.engine.add_request([5, 6], None, SamplingParams(guided=GuidedSpec(json_object=True)))


def test_grammars_compile_once_per_spec(tiny):
    llm = engine(tiny)
    g = llm.engine.grammars
    spec = GuidedSpec(json_schema=SCHEMAS[0])
    a, b = g.compile(spec), g.compile(GuidedSpec(json_schema=json.dumps(SCHEMAS[0], separators=(",", ":"))))
    assert len(g._cache) == 1 and a.matcher is not b.matcher           # one compile; each request its own state


def test_a_random_preset_given_a_tokenizer_takes_its_vocabulary_and_text():
    """``tokenizer``: a random:<preset> model (no tokenizer of its own, a vocabulary of 256) given the embedded
    model's grows to its 49,152 tokens, takes text prompts and decodes under a grammar."""
    from vlora.models.loader import embedded_gguf

    llm = LLM("random:tiny-llama", device="cpu", tokenizer=str(embedded_gguf()), num_blocks=64, block_size=8,
              max_model_len=256, dtype="float32")
    assert llm.engine.model.cfg.vocab_size == VOCAB == len(llm.tokenizer)
    js = jobs(adapter=False)
    check(generate(llm, js), js)
