"""The executor: what runs the engine's planned batches on the device(s).

The engine schedules, keeps memory and finishes requests; it hands each iteration's chunks to its executor
once (:meth:`Executor.run` computes them, :meth:`Executor.launch` queues a graph-replayed decode without
waiting) and never looks at how the model is laid out. This one runs everything in this process on one
device; ``vlora.parallel.executor.TensorParallelExecutor`` spreads the same calls over worker processes, one
shard of the model each. ``vlora.builder.build_engine`` picks the one the configuration asks for; the engine
imports no implementation but this one.

An executor is built in two steps, because the engine sizes its memory from the model between them:

    ex = Executor(config, dtype, device)     # the model loaded (this rank's cut of it)
    ... the pool sized by ex.local_cfg and ex.kv_heads, the adapter registry built on it ...
    ex.start(kv_cache, adapters, ...)         # the model runner, its decode graphs, mode switcher, kernels
"""

from __future__ import annotations

import os

import torch

from vlora.config import ConfigError, EngineConfig
from vlora.engine.modes import ModeSwitcher
from vlora.engine.runner import Launched, ModelRunner
from vlora.engine.scheduler import ScheduledSeq
from vlora.lora.batch import LoRALaunch
from vlora.lora.registry import AdapterRegistry
from vlora.models.build import load_model


class Executor:
    """Runs iterations in this process, on one device (a GPU, or the CPU)."""

    tensor_parallel = False      # whether it serves ``tensor_parallel_size`` > 1
    may_queue = True             # whether decode iterations may be queued behind one another (async scheduling)

    def __init__(self, config: EngineConfig, dtype: torch.dtype, device: torch.device):
        tp = config.model.tensor_parallel_size
        if tp > 1 and not self.tensor_parallel:
            raise ConfigError(f"tensor_parallel_size {tp} needs the tensor-parallel executor: build the engine "
                              f"with vlora.build_engine(config) (LLM and vlora serve do)")
        self.config, self.dtype, self.device = config, dtype, device
        lc, mc = config.lora, config.model
        # the LoRA kernels (adapters in pool pages) or the torch reference (adapters as tensors)
        self.kernel_lora = lc.lora_kernel == "triton" or (lc.lora_kernel == "auto" and device.type == "cuda")
        loaded = load_model(mc.model, dtype, device, mc.max_model_len, mc.max_images_per_request,
                            mc.max_pixels_per_image, mc.seed, cut=self._cut(), tokenizer=mc.tokenizer)
        self.model = self._wrap(loaded.model)
        self.vision = loaded.vision              # LMMs: the vision tower + projector (rank 0's, under TP)
        self.max_model_len = loaded.max_model_len
        self.model_dir = loaded.model_dir
        self.runner: ModelRunner | None = None
        self.kernel_build: dict = {}             # what start-up built (vlora.engine.warmup)

    # -- loading: what a subclass changes ------------------------------------------------------------
    def _cut(self):
        """A function applied to the model while the loader builds it (a rank's shard), or None."""
        return None

    def _wrap(self, model):
        """The model the engine computes with, from the loaded one."""
        return model

    # -- what the engine sizes its memory by ---------------------------------------------------------
    @property
    def local_cfg(self):
        """This rank's model configuration (its heads and MLP columns): what its KV pages and adapter slices
        hold."""
        return self.model.cfg

    @property
    def kv_heads(self) -> int:
        """KV heads this rank keeps in its pool pages."""
        return self.local_cfg.num_kv_heads

    def attach(self, adapters: AdapterRegistry) -> None:
        """The engine's adapter registry, once it is built on the pool (before :meth:`start`)."""

    def lora_launch(self) -> LoRALaunch:
        lc = self.config.lora
        return LoRALaunch(lc.lora_overlap, lc.lora_pdl)

    def _modes(self, runner: ModelRunner, copies) -> ModeSwitcher:
        """The mode switcher merges go through; ``copies``: merged copies in pool pages (or None)."""
        if copies is not None:
            runner.modes.keep_copies(copies)
        return runner.modes

    # -- start ---------------------------------------------------------------------------------------
    def start(self, kv_cache: torch.Tensor, block_size: int, eos_token_ids: tuple[int, ...],
              adapters: AdapterRegistry, graph_batch: int, copies=None) -> None:
        """Build the model runner over ``kv_cache`` (the pool's pages), its decode graphs (``graph_batch`` > 0:
        up to that many sequences) and its mode switcher; on a GPU, apply the kernels' device limits and build
        every kernel variant the limits allow (``model.build_kernels``)."""
        mc, sc = self.config.model, self.config.scheduler
        self.runner = ModelRunner(self.model, kv_cache, block_size, self.device, eos_token_ids, adapters,
                                  self.use_kernels, graph_batch, self.max_model_len, self.vision, self.lora_launch(),
                                  sc.max_prefill_tokens_with_decodes or 0)
        self.runner.modes = self._modes(self.runner, copies)
        if self.use_kernels and self.device.type == "cuda":
            from vlora.kernels.limits import apply_limits

            apply_limits(self.device)
            if mc.build_kernels:
                from vlora.engine.warmup import build_kernels

                graphs = self.runner.graphs      # mixed graphs' rows may pass the token budget (decodes + prompt)
                rows = max([sc.max_num_batched_tokens] + (graphs.mixed_buckets if graphs is not None else []))
                self.kernel_build = build_kernels(self.runner, rows, sc.max_num_seqs,
                                                  workers=min(8, max(1, (os.cpu_count() or 2) // 2)),
                                                  merges=sc.policy != "unmerged")

    @property
    def use_kernels(self) -> bool:
        """Whether the forward runs the Triton kernels (else torch's reference ops)."""
        mc = self.config.model
        return mc.kernels == "triton" or (mc.kernels == "auto" and self.device.type == "cuda")

    @property
    def graph_safe(self) -> bool:
        """Whether decode iterations may be captured as graphs (not with routed shapes: a mixture of experts)."""
        return getattr(self.model, "graph_safe", True)

    # -- running -------------------------------------------------------------------------------------
    @property
    def modes(self) -> ModeSwitcher:
        return self.runner.modes

    @property
    def graphs(self):
        return self.runner.graphs

    def run(self, scheduled: tuple[ScheduledSeq, ...]) -> dict:
        """One forward over ``scheduled`` and its sampled tokens (computed now)."""
        return self.runner.run(scheduled)

    def launch(self, scheduled: tuple[ScheduledSeq, ...], prev: Launched | None = None) -> Launched | None:
        """Queue a graph-replayed decode without waiting for its tokens; None when it is not one."""
        return self.runner.launch(scheduled, prev)

    def capture_graphs(self, mixed: bool = False) -> None:
        self.runner.capture_graphs(mixed)

    @property
    def worker_pids(self) -> list[int]:
        """The processes this executor started (tensor parallelism's workers); none here."""
        return []

    def mirror_kv_swaps(self, host_slots: int):
        """What FastLibra's swapper tells of each KV copy between the pool and its ``host_slots`` host slots,
        so that other processes holding slices of the pages copy theirs alike; None: nobody needs to know."""
        return None

    def close(self) -> None:
        """Stop what this executor started (worker processes, under tensor parallelism)."""
