"""Parity of the architectures beyond the Llama family with transformers + PEFT, on tiny random configs:
logits at every position of a mixed-adapter batch (base rows, ranks 4/8/16) over the paged KV cache, greedy
tokens of requests joining a running batch, and chunked prefill under a tight token budget."""

from __future__ import annotations

import peft
import pytest
import torch

from tests.helpers import ALL_TARGETS, TINY, make_peft_adapter, perturb_norms_and_biases
from tests.models.test_parity import NAMES, PROMPTS, RANKS, peft_greedy, peft_logits, vlora_logits
from vlora import LLM, SamplingParams

FUSED_TARGETS = {"a4": ["qkv_proj"], "a8": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                 "a16": ["o_proj", "gate_up_proj", "down_proj"]}
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])
ATTENTION_TARGETS = {"a4": ["q_proj", "v_proj"], "a8": ["q_proj", "k_proj", "v_proj", "o_proj"],
                     "a16": ["k_proj", "o_proj"]}
PHI_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# label -> (transformers config and model class names, config overrides, LoRA targets of each adapter)
ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32), None),   # q_size 128 != hidden 64
    # 8 routed experts, 2 per token, renormalised; LoRA on attention only
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True), ATTENTION_TARGETS),
    # windowed and global layers alternating, a window shorter than the prompts, a scaled global rotary table,
    # soft-capped logits
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=4, num_hidden_layers=3,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         final_logit_softcapping=5.0,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 1e6}}), None),
    # fused qkv_proj / gate_up_proj in the checkpoint and in the adapters; longrope; a window shorter than prompts
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(rope_parameters=LONGROPE, max_position_embeddings=256,
                                                   original_max_position_embeddings=64, sliding_window=6,
                                                   **PHI_TOKENS), FUSED_TARGETS),
    # Phi-4-mini's partial rotary embedding (half of each head rotates)
    "phi3-partial-rotary": ("Phi3Config", "Phi3ForCausalLM",
                            dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                      partial_rotary_factor=0.5), **PHI_TOKENS), FUSED_TARGETS),
}


def build_base(tmp_path, label: str):
    """The tiny checkpoint of ``label``, saved; returns (its path, the transformers model)."""
    import transformers

    cfg_cls, model_cls, overrides, _ = ARCHS[label]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **overrides})
    hf = perturb_norms_and_biases(getattr(transformers, model_cls)(cfg).eval())
    with torch.no_grad():           # routers far from uniform: the top-k choice does not hinge on rounding
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    path = tmp_path / f"tiny-{label}"
    hf.save_pretrained(path)
    return path, hf


def build(tmp_path, label: str):
    path, hf = build_base(tmp_path, label)
    targets = ARCHS[label][3] or {"a4": ["q_proj", "v_proj"], "a8": ALL_TARGETS,
                          "a16": ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    paths = {name: make_peft_adapter(hf, tmp_path / name, r, seed=10 + i, targets=targets[name],
                                     use_rslora=(name == "a8"))
             for i, (name, r) in enumerate(RANKS.items())}
    pm = peft.PeftModel.from_pretrained(hf, str(paths["a4"]), adapter_name="a4")
    for name in ("a8", "a16"):
        pm.load_adapter(str(paths[name]), adapter_name=name)
    return path, paths, pm.eval()


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("lora_kernel", ["torch", "triton"])
def test_mixed_batch_logits_match_peft(arch, lora_kernel):
    path, paths, pm = arch
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4, lora_kernel=lora_kernel)
    for a, r, name in zip(vlora_logits(llm, PROMPTS, NAMES), peft_logits(pm, PROMPTS, NAMES), NAMES):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(), msg=f"adapter {name}")


def test_greedy_tokens_of_a_running_batch_and_chunked_prefill_match_peft(arch):
    path, paths, pm = arch
    n_new = 8
    expected = [peft_greedy(pm, p, a, n_new) for p, a in zip(PROMPTS, NAMES)]
    sp = SamplingParams(max_tokens=n_new, ignore_eos=True)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4)
    eng, ids, tokens = llm.engine, {}, {}
    for i, (p, a) in enumerate(zip(PROMPTS, NAMES)):
        ids[eng.add_request(p, a, sp)] = i
        for out in eng.step():                     # request i+1 joins a batch already decoding
            tokens[ids[out.request_id]] = out.token_ids
    while eng.has_unfinished():
        for out in eng.step():
            tokens[ids[out.request_id]] = out.token_ids
    assert [tokens[i] for i in range(len(PROMPTS))] == expected
    tight = LLM(str(path), adapters=paths, num_blocks=32, block_size=4, max_num_batched_tokens=4, max_num_seqs=4)
    assert [o.token_ids for o in tight.generate(PROMPTS, NAMES, sp)] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_cuda_engine_matches_peft(arch, dtype, tol):
    path, paths, pm = arch
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4, device="cuda", dtype=dtype)
    for a, r, name in zip(vlora_logits(llm, PROMPTS, NAMES), peft_logits(pm, PROMPTS, NAMES), NAMES):
        a = a.float().cpu()
        assert (a - r).norm() / r.norm() <= tol, f"adapter {name}"


def test_a_fused_adapter_that_does_not_fit_names_its_tensor(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from vlora.lora.adapter import AdapterError

    path, paths, _ = build(tmp_path, "phi3")
    bad = tmp_path / "bad"
    shutil.copytree(paths["a8"], bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in tensors if "qkv_proj.lora_B" in k)
    tensors[key] = tensors[key][1:].contiguous()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    llm = LLM(str(path), num_blocks=16)
    llm.register_adapter("good", paths["a8"])
    with pytest.raises(AdapterError, match=r"qkv_proj\.lora_B.*expected \[128, r\]"):
        llm.register_adapter("bad", bad)


def test_an_adapter_on_the_experts_of_a_mixture_is_refused_naming_them(tmp_path):
    import json

    from safetensors.torch import save_file

    from vlora.lora.adapter import AdapterError

    def adapter(name, module, out_rows, **config):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
        key = f"base_model.model.model.layers.1.{module}.lora_{{}}.weight"
        save_file({key.format("A"): torch.zeros(4, 64), key.format("B"): torch.zeros(out_rows, 4)},
                  str(d / "adapter_model.safetensors"))
        return d

    path, _ = build_base(tmp_path, "qwen3_moe")
    llm = LLM(str(path), num_blocks=16)
    assert llm.engine.model.cfg.num_experts == 8 and not llm.engine.model.graph_safe
    with pytest.raises(AdapterError, match=r"target_parameters.*mlp\.experts\.gate_up_proj"):   # PEFT on 3D weights
        llm.register_adapter("p", adapter("p", "mlp.experts", 64, target_parameters=["mlp.experts.gate_up_proj"]))
    with pytest.raises(AdapterError, match=r"mlp\.experts\.3\.gate_proj.*attention only"):     # per-expert Linears
        llm.register_adapter("e", adapter("e", "mlp.experts.3.gate_proj", 32))
    with pytest.raises(AdapterError, match=r"mlp\.gate\.lora_A.*attention only"):               # the router
        llm.register_adapter("r", adapter("r", "mlp.gate", 8))
    with pytest.raises(AdapterError, match="targets gate_proj"):                                  # a dense MLP
        llm.register_adapter("d", adapter("d", "mlp.gate_proj", 32))
    llm.register_adapter("ok", adapter("ok", "self_attn.v_proj", 64))


def test_a_mixture_checkpoint_with_all_experts_in_one_tensor_loads_the_same(tmp_path):
    """Per-expert tensors (as checkpoints hold them) and [E, out, in] ones (as transformers keeps them) alike."""
    from safetensors.torch import load_file, save_file

    path, _ = build_base(tmp_path, "qwen3_moe")
    tensors = load_file(str(path / "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(TINY["num_hidden_layers"]):
        e = f"model.layers.{layer}.mlp.experts"
        fused[f"{e}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{e}.{j}.gate_proj.weight"],
                                                             tensors[f"{e}.{j}.up_proj.weight"]]) for j in range(8)])
        fused[f"{e}.down_proj"] = torch.stack([tensors[f"{e}.{j}.down_proj.weight"] for j in range(8)])
    other = tmp_path / "fused"
    other.mkdir()
    (other / "config.json").write_text((path / "config.json").read_text())
    save_file(fused, str(other / "model.safetensors"))
    a, b = (LLM(str(p), num_blocks=16, block_size=4) for p in (path, other))
    for x, y in zip(vlora_logits(a, PROMPTS, [None] * 4), vlora_logits(b, PROMPTS, [None] * 4)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    del fused[f"{e}.down_proj"]                  # a missing expert tensor is named
    save_file(fused, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 8 tensors.*experts_down"):
        LLM(str(other), num_blocks=16)
