"""Adapter registry: names -> validated, packed adapters with dense slots.

Registration validates the whole adapter before anything changes, so a refused
adapter leaves every registered one untouched. It is two steps: ``prepare``
(read, validate, pack: the costly part, safe on any thread; reading may happen
in another process, vlora/lora/loader.py, and ``finish`` completes it here)
and ``add`` (a slot and a name, on the engine's thread). The unified memory pool later
takes over where the packed weights live; names and slots stay here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from vlora.lora.adapter import AdapterError, ModelShape
from vlora.lora.batch import GroupWeights, PackedAdapter
from vlora.lora.device_store import AdapterStore, HostAdapter
from vlora.lora.loader import ReadAdapter, ReadSpec, read
from vlora.lora.merge_copy import MergedCopies
from vlora.lora.task_head import TaskHead
from vlora.memory.capture import guarded

_NAME_MAX = 128


def _on_device(packed: PackedAdapter, device: torch.device) -> PackedAdapter:
    """``packed`` with its matrices moved to ``device``."""
    layers = tuple({g: GroupWeights(gw.a.to(device), tuple(replace(sl, b=sl.b.to(device)) for sl in gw.slices))
                    for g, gw in groups.items()} for groups in packed.layers)
    return replace(packed, layers=layers)


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read, validated and packed, not yet registered (:meth:`AdapterRegistry.add`)."""

    packed: PackedAdapter           # its slot is given when it is added
    path: str
    head: TaskHead | None           # its vision task head, if it carries one
    host: HostAdapter | None        # kernel path: its matrices laid out for the pool


class AdapterRegistry:
    def __init__(self, shape: ModelShape, max_rank: int, dtype: torch.dtype, device: torch.device,
                 check_base_model: bool = True, kernel: str = "auto", pool=None):
        self.shape = shape
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.check_base_model = check_base_model
        self._by_name: dict[str, PackedAdapter] = {}
        self._paths: dict[str, str] = {}
        self.heads: dict[str, TaskHead] = {}     # adapters that carry a vision task head
        # kernel path: every adapter stays in host memory (torch path, merges); the kernels read the copy
        # the store brings into the unified pool when a request needs it
        use_kernels = kernel == "triton" or (kernel == "auto" and device.type == "cuda")
        if use_kernels and pool is None:
            raise ValueError("the kernel path needs the unified pool to hold adapters")
        self.pool = pool
        self.store = AdapterStore(pool, device) if use_kernels else None

    def merged_copies(self) -> MergedCopies:
        """An empty holder for merged copies of these adapters in the pool's pages (the memory manager asks for
        one when ``cache.merged_copy`` is on, and registers it as a source of pages)."""
        if self.pool is None:
            raise ValueError("merged copies live in the unified pool, and this registry has none")
        return MergedCopies(self.pool)

    def register(self, name: str, path: str | os.PathLike) -> PackedAdapter:
        """Read, validate, pack and register the PEFT adapter in ``path`` as ``name``."""
        self.check_name(name)              # a name taken is refused before the work
        return self.add(self.prepare(name, path))

    @property
    def spec(self) -> ReadSpec:
        """What reading an adapter for this registry needs (:func:`vlora.lora.loader.read`, in any process)."""
        return ReadSpec(self.shape, self.max_rank, self.dtype, self.check_base_model,
                        host_layout=self.store is not None and self.store.view is None)

    def prepare(self, name: str, path: str | os.PathLike) -> PreparedAdapter:
        """The adapter in ``path`` read, validated and packed (with its host copy for the pool), for :meth:`add`:
        :func:`~vlora.lora.loader.read` here, then :meth:`finish`. Changes nothing here, so it may run on any
        thread while the engine serves (the server reads in a process of its own instead:
        :class:`~vlora.lora.loader.LoaderProcess`)."""
        self.check_name(name, taken=False)
        return self.finish(read(self.spec, name, str(path)))

    def finish(self, r: ReadAdapter) -> PreparedAdapter:
        """An adapter read (:func:`~vlora.lora.loader.read`, with this registry's :attr:`spec`) made ready for
        :meth:`add`: its pool copy pinned, its task head (and, without a store, its matrices) on the device;
        refused if it could never fit the pool. Safe on any thread: its CUDA calls each take the capture lock
        (vlora/memory/capture.py), as the engine may be capturing a graph meanwhile. Whether the name is taken
        is :meth:`add`'s to say, on the engine's thread."""
        name = r.packed.name
        self.check_name(name, taken=False)
        head, packed, host = r.head, r.packed, None
        if head is not None and self.device.type != "cpu":
            with guarded(self.device):
                head = replace(head, weight=head.weight.to(self.device), bias=head.bias.to(self.device))
        if self.store is None:
            if self.device.type != "cpu":
                with guarded(self.device):
                    packed = _on_device(packed, self.device)
        else:
            host = self.store.host_copy(packed) if r.host is None else self.store.pinned(r.host)
            need, room = self.store.pages_needed(host), self.store.capacity
            if need > room:
                raise AdapterError(f"adapter {name!r} needs {need} pages of the memory pool, which has {room} for "
                                   f"adapters: it could never be loaded (a larger pool or a smaller rank)")
        return PreparedAdapter(packed, r.path, head, host)

    def add(self, prepared: PreparedAdapter) -> PackedAdapter:
        """Register a prepared adapter: a slot, its name, its host copy handed to the store (cheap)."""
        name = prepared.packed.name
        self.check_name(name)              # taken while it was prepared
        used = {a.slot for a in self._by_name.values()}
        packed = replace(prepared.packed, slot=next(i for i in range(len(used) + 1) if i not in used))
        if self.store is not None:
            self.store.add(packed, prepared.host)
        self._by_name[name] = packed
        self._paths[name] = prepared.path
        if prepared.head is not None:
            self.heads[name] = prepared.head
        return packed

    def check_name(self, name: str, taken: bool = True) -> None:
        """A refusal of ``name``'s form, of the base model's name, and (``taken``) of a name registered."""
        if not isinstance(name, str) or not name or len(name) > _NAME_MAX or name != name.strip():
            raise AdapterError(f"adapter name must be a non-empty string of at most {_NAME_MAX} "
                               f"characters without surrounding spaces, got {name!r}")
        if taken and name in self._by_name:
            raise AdapterError(f"an adapter named {name!r} is already registered (from {self._paths[name]})")
        if name == self.shape.name:
            raise AdapterError(f"adapter name {name!r} is the base model's name")

    def unregister(self, name: str) -> None:
        if name not in self._by_name:
            raise KeyError(f"unknown adapter {name!r}")
        del self._by_name[name]
        del self._paths[name]
        self.heads.pop(name, None)
        if self.store is not None:
            self.store.remove(name)

    def get(self, name: str) -> PackedAdapter:
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise KeyError(f"unknown adapter {name!r} (registered: {known})") from None

    def find(self, name: str):
        """The registered adapter ``name``, or None."""
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)
