"""Reference systems that vlora is benchmarked against.

:class:`PeftBaseline` serves a mixed-adapter batch the way a user of
transformers + PEFT would: one ``PeftModel`` holding every adapter, static
batches with left padding, and ``model.generate(..., adapter_names=[...])`` so
each row of a batch runs its own adapter (``"__base__"`` for the base model).
Outputs have a fixed length (``min_new_tokens == max_new_tokens``, greedy), so
its token ids can be compared one to one with vlora's ``ignore_eos`` greedy runs
and its time with vlora's on the same work.
"""

from __future__ import annotations

import os

import torch

BASE = "__base__"


class PeftBaseline:
    """transformers (+ PEFT when adapters are given) serving token-id prompts in static batches.

    With no adapters it is plain transformers running the base model: the reference a
    user would start from."""

    def __init__(self, model, adapters: dict[str, str | os.PathLike] | None = None, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id
        self.has_adapters = bool(adapters)
        if adapters:
            from peft import PeftModel

            (first, first_path), *rest = adapters.items()
            model = PeftModel.from_pretrained(model, first_path, adapter_name=first)
            for name, path in rest:
                model.load_adapter(path, adapter_name=name)
        self.model = model.eval()

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, adapters: dict[str, str | os.PathLike] | None = None,
                        dtype: torch.dtype = torch.float32) -> "PeftBaseline":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return cls(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), adapters, pad)

    @torch.inference_mode()
    def generate(self, prompts_token_ids: list[list[int]], adapter_names: list[str | None],
                 max_new_tokens: int, batch_size: int, sampling: dict | None = None) -> list[list[int]]:
        """Exactly ``max_new_tokens`` per request, in static batches; token ids per request. Greedy, or sampled
        with ``sampling``'s ``generate`` arguments (temperature, top_p, top_k)."""
        if len(prompts_token_ids) != len(adapter_names):
            raise ValueError(f"{len(adapter_names)} adapter names for {len(prompts_token_ids)} prompts")
        if not self.has_adapters and any(n is not None for n in adapter_names):
            raise ValueError("this baseline holds no adapters")
        dev = next(self.model.parameters()).device
        outputs: list[list[int]] = []
        for i in range(0, len(prompts_token_ids), batch_size):
            prompts = prompts_token_ids[i:i + batch_size]
            width = max(len(p) for p in prompts)             # left padding: every prompt ends at `width`
            ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts], device=dev)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
            kwargs = {}
            if self.has_adapters:
                kwargs["adapter_names"] = [BASE if n is None else n for n in adapter_names[i:i + batch_size]]
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=sampling is not None, pad_token_id=self.pad_token_id, **(sampling or {}), **kwargs)
            outputs.extend(row[width:].tolist() for row in out)
        return outputs
