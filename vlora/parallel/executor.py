"""The tensor-parallel executor: the engine's calls, run by rank 0 and its workers together.

Rank 0 is this process: it loads its cut of the model while it is built, starts the workers (each loads its
own shard), and computes with ``TensorParallelModel``, which sends every forward, graph capture and replay
and merge to the workers first (``model.py``). The engine sees the same executor interface as on one device
(``vlora/engine/executor.py``); only this module knows the model is split.
"""

from __future__ import annotations

import torch

from vlora.config import ConfigError, EngineConfig
from vlora.engine.executor import Executor
from vlora.engine.modes import ModeSwitcher
from vlora.lora.batch import LoRALaunch
from vlora.lora.registry import AdapterRegistry
from vlora.parallel.group import WorkerSpec
from vlora.parallel.model import ShardModes, tensor_parallel
from vlora.parallel.partition import Shard, shard_decoder


class TensorParallelExecutor(Executor):
    tensor_parallel = True
    # decodes queue behind one another as on one device: a replay's message carries which rows take the tokens
    # the iteration before sampled, and rank 0 broadcasts those tokens from the device before the replay
    may_queue = True

    def __init__(self, config: EngineConfig, dtype: torch.dtype, device: torch.device):
        _check(config)
        super().__init__(config, dtype, device)

    def _cut(self):
        tp = self.config.model.tensor_parallel_size
        return lambda model: shard_decoder(model, Shard.of(model.cfg, 0, tp))

    def _wrap(self, model):
        """Start the workers; returns rank 0's model. An LMM's vision tower stays on rank 0
        (``vlora/parallel/__init__.py`` says why)."""
        mc, tp = self.config.model, self.config.model.tensor_parallel_size
        # with the LoRA kernels adapters live in the pool: the workers keep their slices in host memory to place
        # them
        spec = WorkerSpec(mc.model, self.dtype, self.device.type, mc.max_model_len, mc.seed, timeout_s=60.0,
                          all_reduce=mc.all_reduce, host_adapters=self.kernel_lora, tokenizer=mc.tokenizer)
        return tensor_parallel(model, tp, spec, self.device)

    @property
    def local_cfg(self):
        return self.model.local_cfg

    @property
    def kv_heads(self) -> int:
        return self.model.kv_heads_per_rank

    def attach(self, adapters: AdapterRegistry) -> None:
        self.model.registry = adapters            # adapters the engine forgets are dropped on every rank
        if adapters.store is not None:            # the pool holds rank 0's slices (the workers theirs)
            adapters.store.view = self.model.part

    def lora_launch(self) -> LoRALaunch:
        # the workers take segments as (rows, adapter, scale): mixed mode's LoRA in two passes
        lc = self.config.lora
        return LoRALaunch(lc.lora_overlap, lc.lora_pdl, mixed="two")

    def _modes(self, runner, copies) -> ModeSwitcher:
        return ShardModes(self.model)             # merges fold each rank's slices into its shard

    def mirror_kv_swaps(self, host_slots: int):
        """The workers copy their slices of each page the swapper moves, into host slots of their own, in the
        order rank 0 copied (with the next message, before its forward or placements)."""
        self.model.host_slots = host_slots
        return self.model.queue_swap

    @property
    def worker_pids(self) -> list[int]:
        """The workers' processes, rank 1 first."""
        return [p.pid for p in self.model.group.procs]

    def close(self) -> None:
        self.model.close()


def _check(config: EngineConfig) -> None:
    """Refuse what the split does not cover yet, before any worker starts."""
    tp = config.model.tensor_parallel_size
    if config.cache.merged_copy:
        raise ConfigError(f"tensor_parallel_size {tp} does not support merged_copy (merges fold each rank's "
                          f"slices into its shard in place)")
