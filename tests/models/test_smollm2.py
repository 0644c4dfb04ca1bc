"""The embedded default model (SmolLM2-135M-Instruct, GGUF) against transformers + PEFT."""

from __future__ import annotations

import peft
import pytest
import torch

from tests.helpers import make_peft_adapter
from vlora import LLM, SamplingParams
from vlora.models.loader import resolve_model_dir

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to five."]


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("smollm")
    model_dir = resolve_model_dir(None)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    paths = {"r8": make_peft_adapter(hf, root / "r8", 8, seed=3),
             "r16": make_peft_adapter(hf, root / "r16", 16, seed=4, targets=["q_proj", "v_proj", "down_proj"])}
    for p in paths.values():
        # low-magnitude weights keep the adapted model fluent; the check is exact token equality
        from safetensors.torch import load_file, save_file
        t = load_file(str(p / "adapter_model.safetensors"))
        save_file({k: v * 0.6 for k, v in t.items()}, str(p / "adapter_model.safetensors"))
    pm = peft.PeftModel.from_pretrained(hf, str(paths["r8"]), adapter_name="r8")
    pm.load_adapter(str(paths["r16"]), adapter_name="r16")
    llm = LLM(adapters=paths, kv_cache_memory_gb=0.25)
    return llm, pm.eval()


def test_name_and_chat_template(smollm):
    llm, _ = smollm
    assert llm.engine.model_name == "SmolLM2-135M-Instruct"
    ids = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_mixed_adapter_greedy_tokens_match_peft(smollm):
    llm, pm = smollm
    jobs = [(q, a) for q in QUESTIONS for a in (None, "r8", "r16")]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q, _ in jobs]
    n = 10
    outs = llm.generate(prompts, [a for _, a in jobs], SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True))
    for (q, a), p, o in zip(jobs, prompts, outs):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, adapter_names=[a or "__base__"])
        assert o.token_ids == ref[0, len(p):].tolist(), f"{q!r} on {a}"
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1      # adapters change the answer


def test_stop_strings_and_streamed_text(smollm):
    llm, _ = smollm
    prompt = llm.apply_chat_template([{"role": "user", "content": "Count from one to ten, separated by commas."}])
    full = llm.generate([prompt], "r8", SamplingParams(max_tokens=40))[0]
    assert len(full.text) > 10
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = llm.generate([prompt], "r8", SamplingParams(max_tokens=40, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    streamed = list(llm.stream(prompt, "r8", SamplingParams(max_tokens=40, stop=(stop,))))
    assert "".join(o.delta_text for o in streamed) == cut.text


def test_logprobs_equal_peft_log_softmax(smollm):
    """Logprobs of generated and prompt tokens, through the base model and an adapter, equal the log-softmax of
    transformers + PEFT's logits; the top alternatives come in the same order."""
    llm, pm = smollm
    prompt = llm.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    sp = SamplingParams(max_tokens=6, temperature=0.7, seed=5, logprobs=5, prompt_logprobs=1, ignore_eos=True)
    for adapter in (None, "r8"):
        out = llm.generate([prompt], adapter, sp)[0]
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(pm(input_ids=ids, adapter_names=[adapter or "__base__"]).logits[0].float(), -1)
        for j, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + j]
            assert lp.logprob == pytest.approx(row[out.token_ids[j]].item(), abs=2e-3)
            assert [t for t, _ in lp.top] == row.topk(5).indices.tolist()
        assert [lp.logprob for lp in out.prompt_logprobs[1:]] == pytest.approx(
            [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=2e-3)
