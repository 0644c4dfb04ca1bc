"""Builds an engine with the executor its configuration asks for.

The engine runs iterations through an executor (``vlora/engine/executor.py``) and imports no implementation
but the one-device one; this module, above both, picks the tensor-parallel executor
(``vlora/parallel/executor.py``) when ``tensor_parallel_size`` > 1.
"""

from __future__ import annotations

from vlora.config import EngineConfig
from vlora.engine.engine import Engine
from vlora.engine.executor import Executor
from vlora.engine.guided import GrammarError


def executor_for(config: EngineConfig) -> type[Executor]:
    """The executor class that serves ``config``."""
    if config.model.tensor_parallel_size > 1:
        from vlora.parallel.executor import TensorParallelExecutor

        return TensorParallelExecutor
    return Executor


def build_engine(config: EngineConfig | None = None, **kwargs) -> Engine:
    """``Engine(config, **kwargs)`` with the executor ``config`` asks for (``kwargs``: :class:`Engine`'s
    keyword arguments)."""
    config = config or EngineConfig()
    return Engine(config, executor=executor_for(config), **kwargs)


def profile_policy(engine: Engine) -> None:
    """Time the inference modes now, before serving, when the mode policy merges (vlora, dlora): the policy then
    weighs each mode by its replay time on this GPU rather than by running means of the iterations it happened
    to run (:meth:`Engine.profile_modes`; what the paired policy runs measured). Nothing on the CPU, under
    tensor parallelism, or with fewer than two adapters registered (the policy then learns the costs as it
    runs)."""
    if engine.config.scheduler.policy in ("vlora", "dlora") and engine.config.model.tensor_parallel_size == 1:
        engine.profile_modes()


def warm_grammars(engine: Engine) -> None:
    """Build structured output's tokenizer now, before serving: it takes about a second per 50k tokens of
    vocabulary and holds the interpreter lock throughout, so built on the first structured request it would
    pause every other request's stream."""
    if engine.grammars is not None:
        try:
            engine.grammars.tokenizer()
        except GrammarError:
            pass                     # structured requests are refused with the reason; the rest is served
