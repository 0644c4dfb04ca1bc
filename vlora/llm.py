"""Offline API: ``LLM(...).generate(prompts, adapters=..., sampling=...)``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from vlora.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from vlora.builder import build_engine, profile_policy
from vlora.engine.engine import RequestError
from vlora.engine.sequence import RequestOutput
from vlora.models.hub import resolve_adapter_dir
from vlora.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass(frozen=True)
class AdapterRequest:
    """An adapter to register: a name requests use, and a PEFT directory or Hub id (org/name[@revision])."""

    name: str
    path: str | os.PathLike


class LLM:
    def __init__(self, model: str | None = None, *, adapters: Sequence[AdapterRequest] | dict | None = None,
                 dtype: str = "auto", device: str = "auto", max_model_len: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_memory_gb: float | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 max_prefill_tokens_with_decodes: int | None = None, max_lora_rank: int = 128,
                 check_base_model: bool = True, lora_kernel: str = "auto", policy: str | None = None,
                 starvation_s: float = 0.5, seed: int = 0, kernels: str = "auto", cuda_graphs: bool = True,
                 max_loras: int = 4, prefix_caching: bool = False, max_images_per_request: int = 16,
                 max_pixels_per_image: int = 16_000_000, memory_policy: str = "unified", host_kv_gb: float = 4.0,
                 adapter_pool_fraction: float = 0.1, gpu_memory_utilization: float = 0.9, merged_copy: bool = False,
                 lora_overlap: str = "full", lora_pdl: bool = True, tensor_parallel_size: int = 1,
                 all_reduce: str = "nccl", replicas: int = 1, ray_address: str | None = None,
                 cluster_policy: str = "round_robin", async_scheduling: bool = True, tokenizer: str | None = None,
                 config: EngineConfig | None = None):
        """``replicas`` > 1 (or a ``ray_address``): that many engine replicas on Ray, placed by
        ``cluster_policy`` (docs/cluster.md); ``self.engine`` is then None."""
        config = config or EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed,
                              kernels=kernels, cuda_graphs=cuda_graphs, max_images_per_request=max_images_per_request,
                              max_pixels_per_image=max_pixels_per_image,
                              tensor_parallel_size=tensor_parallel_size, all_reduce=all_reduce, tokenizer=tokenizer),
            cache=CacheConfig(block_size, num_blocks, prefix_caching, kv_cache_memory_gb, memory_policy, host_kv_gb,
                              adapter_pool_fraction, gpu_memory_utilization=gpu_memory_utilization,
                              merged_copy=merged_copy),
            lora=LoRAConfig(max_lora_rank, check_base_model, lora_kernel, max_loras, lora_overlap, lora_pdl),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, policy, starvation_s,
                                      async_scheduling, max_prefill_tokens_with_decodes))
        items = adapters.items() if isinstance(adapters, dict) else ((a.name, a.path) for a in adapters or ())
        self.cluster = None
        if replicas > 1 or ray_address is not None:
            from vlora.cluster.client import ClusterClient
            from vlora.cluster.config import ClusterConfig
            from vlora.cluster.front import ClusterFront

            self.engine = None
            self.cluster = ClusterClient(ClusterFront(config, ClusterConfig(replicas, cluster_policy, ray_address),
                                                      {name: str(resolve_adapter_dir(p)) for name, p in items}))
            self._ids = itertools.count()
            return
        self.engine = build_engine(config)
        for name, path in items:
            self.register_adapter(name, path)
        profile_policy(self.engine)

    def close(self) -> None:
        """Stop the tensor-parallel workers, or the replicas, if any."""
        if self.cluster is not None:
            self.cluster.close()
        else:
            self.engine.close()

    @property
    def tokenizer(self):
        return self.cluster.front.info.tokenizer if self.cluster is not None else self.engine.tokenizer

    def register_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Validate and register a PEFT adapter (a directory, or a Hub id org/name[@revision]); a refused one
        leaves the others untouched. With replicas: on every replica, and on each one that restarts."""
        if self.cluster is not None:
            self.cluster.run(self.cluster.front.load_adapter(name, str(resolve_adapter_dir(path))))
        else:
            self.engine.adapters.register(name, resolve_adapter_dir(path))

    def unregister_adapter(self, name: str) -> None:
        if self.cluster is not None:
            self.cluster.run(self.cluster.front.unload_adapter(name, "wait"))
        else:
            self.engine.unregister_adapter(name)

    def set_slo(self, adapter: str | None, slo) -> None:
        """Latency targets (``SLO(ttft_s=..., latency_s=...)``) for every request of ``adapter`` (None: the
        base model); requests that can no longer meet them finish early as "rejected", with the reason."""
        if self.cluster is not None:
            raise RequestError("latency targets are per engine; a cluster of replicas does not take them yet")
        self.engine.set_slo(adapter, slo)

    def list_adapters(self) -> list[str]:
        if self.cluster is not None:
            return sorted(self.cluster.front.adapter_names)
        return self.engine.adapters.names()

    def generate(self, prompts: Prompt | Sequence[Prompt], adapters: str | None | Sequence[str | None] = None,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 images: Sequence | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in prompt order. ``images`` (LMMs):
        per prompt, None or a list with one image (or video: a list of frames) per placeholder in it; for a
        single prompt, just its list."""
        single = isinstance(prompts, str) or _is_token_list(prompts)
        prompts = [prompts] if single else list(prompts)
        adapters_ = _broadcast(adapters, len(prompts), "adapters")
        sampling_ = _broadcast(sampling, len(prompts), "sampling")
        images_ = [None] * len(prompts) if images is None else [images] if single else list(images)
        if len(images_) != len(prompts):
            raise RequestError(f"images has {len(images_)} entries for {len(prompts)} prompts")
        if self.cluster is not None:
            return self.cluster.generate([self._job(p, a, s, im) for p, a, s, im
                                          in zip(prompts, adapters_, sampling_, images_)])
        ids = []
        try:
            for p, a, s, im in zip(prompts, adapters_, sampling_, images_):
                ids.append(self.engine.add_request(p, a, s, images=im))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def classify(self, prompts: Prompt | Sequence[Prompt], adapters: str | Sequence[str],
                 images: Sequence | None = None) -> list:
        """Answer each prompt with its adapter's vision task head (one prefill, no decoding): a list of
        ``TaskResult(label, scores)`` in prompt order."""
        outs = self.generate(prompts, adapters, SamplingParams(max_tokens=1, task_head=True), images)
        return [o.task for o in outs]

    def chat(self, conversations, adapters=None, sampling=None) -> list[RequestOutput]:
        """Like generate, for chat messages ([{"role", "content"}, ...] or a list of them)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.apply_chat_template(c) for c in conversations], adapters, sampling)

    def apply_chat_template(self, messages: list[dict], **options) -> list[int]:
        """Token ids of ``messages``; ``options``: as :func:`apply_chat_template` takes them."""
        return apply_chat_template(self.tokenizer, messages, **options)

    def stream(self, prompt: Prompt, adapter: str | None = None,
               sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's outputs as tokens arrive; closing the iterator aborts it."""
        if self.cluster is not None:
            yield from self.cluster.stream(self._job(prompt, adapter, sampling))
            return
        rid = self.engine.add_request(prompt, adapter, sampling)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(rid)


    def _job(self, prompt: Prompt, adapter: str | None, sampling: SamplingParams | None, images=None):
        from vlora.engine.client import Job

        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(sampling).__name__}")
        if images is not None and not isinstance(images, (list, tuple)):     # as one engine refuses it
            raise RequestError("images must be a list (one entry per image; a list of frames for a video)")
        return Job(prompt, adapter, sampling or SamplingParams(), f"llm-{next(self._ids)}",
                   tuple(images) if images else None)


def apply_chat_template(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` ([{"role", "content"}, ...]) in the model's chat format, ready for the answer.

    ``chat_template``: a Jinja template used in place of the model's; ``add_generation_prompt``: end with the
    header of an assistant turn; ``continue_final_message``: end inside the last message (no end-of-turn), for
    the model to continue it; ``template_kwargs``: extra template variables (e.g. ``enable_thinking``);
    ``tools``: the functions the answer may call (OpenAI's shape), for a template that shows them."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise RequestError("this model has no chat template")
    ids = tokenizer.apply_chat_template(messages, chat_template=chat_template, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tokenize=True,
                                        **(template_kwargs or {}))
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _is_token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _broadcast(value, n: int, what: str) -> list:
    if value is None or isinstance(value, (str, SamplingParams)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise RequestError(f"{what} has {len(value)} entries for {n} prompts")
    return value
