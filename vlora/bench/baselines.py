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
    def __init__(self, model_dir: str | os.PathLike, adapters: dict[str, str | os.PathLike],
                 dtype: torch.dtype = torch.float32):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not adapters:
            raise ValueError("PeftBaseline needs at least one adapter")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        (first, first_path), *rest = adapters.items()
        self.model = PeftModel.from_pretrained(base, first_path, adapter_name=first)
        for name, path in rest:
            self.model.load_adapter(path, adapter_name=name)
        self.model.eval()

    @torch.inference_mode()
    def generate(self, prompts_token_ids: list[list[int]], adapter_names: list[str | None],
                 max_new_tokens: int, batch_size: int) -> list[list[int]]:
        """Greedy, exactly ``max_new_tokens`` per request, in static batches; token ids per request."""
        if len(prompts_token_ids) != len(adapter_names):
            raise ValueError(f"{len(adapter_names)} adapter names for {len(prompts_token_ids)} prompts")
        outputs: list[list[int]] = []
        for i in range(0, len(prompts_token_ids), batch_size):
            prompts = prompts_token_ids[i:i + batch_size]
            names = [BASE if n is None else n for n in adapter_names[i:i + batch_size]]
            batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
            out = self.model.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], adapter_names=names,
                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id)
            width = batch["input_ids"].shape[1]             # left padding: every prompt ends here
            outputs.extend(row[width:].tolist() for row in out)
        return outputs
