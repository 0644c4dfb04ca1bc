"""The client seam: what serves requests, as the server sees it.

:class:`EngineClient` is the server's only view of what serves requests: one engine on its own thread
(:class:`vlora.engine.async_engine.AsyncEngine`), one engine in a process of its own
(:class:`vlora.engine.process_client.EngineProcess`, ``vlora serve``'s default) or a cluster of replicas behind
one front (:class:`vlora.cluster.front.ClusterFront`). This module also holds what crosses the seam: a request
(:class:`Job`), the outputs of one API call (:class:`RequestGroup`), what the server reads of the model and
the load (:class:`EngineInfo`, :class:`EngineStats`), the exceptions a client gets and, where they cross
between processes, those exceptions as values (:class:`Refusal`).

    server --submit(jobs)--> EngineClient --deliver(output)--> RequestGroup --batches()--> server
                                          <--abort(ids)------- RequestGroup <--abort()----- server
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vlora.engine.engine import RequestError
from vlora.engine.runner import ITERATION_PATHS
from vlora.engine.sequence import RequestOutput
from vlora.lora.adapter import AdapterError
from vlora.sampling_params import SamplingError, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """Too many requests are waiting; try again later."""


class ShuttingDown(RuntimeError):
    """The engine no longer accepts requests (shutting down, or failed)."""


class AdapterNotFound(RequestError):
    """The request names an adapter that is not registered (or is being unloaded)."""


class AdapterExists(AdapterError):
    """An adapter of that name is registered (or still being unloaded)."""


class EngineFailed(RuntimeError):
    """The engine cannot go on (``on_fatal`` was called); the requests in flight were aborted."""


class RequestFailed(EngineFailed):
    """One request of the group failed while served (its reason); the group's others were aborted and the
    engine serves on. ``output``: the failed request's final output (finish_reason "error")."""

    def __init__(self, message: str, output: RequestOutput | None = None):
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class Job:
    """One engine request: a prompt (text or token ids), an adapter (None = base model), sampling."""

    prompt: str | list[int]
    adapter: str | None
    params: SamplingParams
    request_id: str
    images: tuple | None = None         # LMMs: one decoded image (or a list of frames) per placeholder
    resumed: int = 0                    # the prompt's last tokens are the output so far of a request moved here


@dataclass(frozen=True)
class Refusal:
    """Why an engine in another process (a cluster replica, the engine core) refused or failed a request or an
    adapter operation: the exception's class name and message, rebuilt as that exception on this side
    (:func:`raise_refusal`). Exceptions travel as these values, whatever pickling or Ray does to exceptions."""

    kind: str
    message: str
    param: str | None = None     # a RequestError's field at fault


# the exceptions another process reports by name; this side raises the same classes as one engine would
REFUSALS: dict[str, type[Exception]] = {c.__name__: c for c in (
    QueueFull, ShuttingDown, AdapterNotFound, RequestError, SamplingError, RequestFailed, EngineFailed,
    AdapterExists, AdapterError)}


def refusal(exc: Exception) -> Refusal:
    kind = next((name for name, cls in REFUSALS.items() if type(exc) is cls), None)
    if kind is None:                # a subclass (or an unexpected error): the nearest class this side knows
        kind = next((name for name, cls in REFUSALS.items() if isinstance(exc, cls)), "EngineFailed")
    return Refusal(kind, str(exc), getattr(exc, "param", None))


def rebuild(r: Refusal) -> Exception:
    """The exception ``r`` stands for."""
    cls = REFUSALS.get(r.kind, EngineFailed)
    return cls(r.message) if r.param is None else cls(r.message, r.param)    # only RequestErrors carry a param


def raise_refusal(r: Refusal):
    raise rebuild(r)


def sum_counts(counts) -> dict[str, int]:
    """Several ``EngineStats.iterations`` added up, path by path."""
    total = dict.fromkeys(ITERATION_PATHS, 0)
    for pairs in counts:
        for path, n in pairs:
            total[path] = total.get(path, 0) + n
    return total


@dataclass(frozen=True)
class EngineStats:
    """A load snapshot: one engine's, published by its thread after every command batch and step, or a cluster's
    replicas' summed."""

    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks: int
    mode: str = "unmerged"       # inference mode the orchestrator last chose
    mode_switches: int = 0       # merges + unmerges so far
    iterations: tuple[tuple[str, int], ...] = ()     # forwards so far by how they ran (ITERATION_PATHS)


@dataclass(frozen=True)
class VisionInfo:
    """What the server and a cluster front need of an LMM's vision tower: the prompt ids of one image
    placeholder, and the tokens an image takes once expanded (None where they depend on its size: Qwen2-VL).
    Small and picklable, so replicas send it instead of the tower."""

    image_prompt_ids: tuple[int, ...]
    tokens_per_image: int | None

    @classmethod
    def of(cls, tower) -> VisionInfo | None:
        return None if tower is None else cls(tuple(tower.image_prompt_ids), tower.tokens_per_image)

    def prompt_tokens_added(self, images) -> int:
        """Prompt tokens ``images`` (one image, or a video's list of frames, per placeholder) add once their
        placeholders are expanded; 0 where the count depends on the image's size."""
        if not images or self.tokens_per_image is None:
            return 0
        frames = sum(len(im) if isinstance(im, (list, tuple)) else 1 for im in images)
        return frames * self.tokens_per_image - len(images)


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the model served, alike for one engine and a cluster of replicas."""

    model_name: str
    tokenizer: object | None
    context_len: int             # longest prompt + output: the model's limit and what one sequence's KV can hold
    vocab_size: int
    vision: VisionInfo | None = None  # LMMs: image placeholders, tokens per image
    model_type: str | None = None  # the language model's config.json model_type (its family: llama, qwen2, ...)


@dataclass
class Timing:
    """Monotonic times of one request: submitted, first token delivered, finished."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class RequestGroup:
    """The requests of one API call (``n`` of them); iterate it for their outputs, in arrival order.

    What serves them calls :meth:`deliver` (on the event loop) with each output, or with the exception that
    fails the call; the consumer iterates (or :meth:`batches`, :meth:`results`) and calls :meth:`abort` when it
    goes away. ``abort_requests(request_ids)`` is how the group asks what serves it to stop requests.
    ``on_finish(output, timing)`` runs on the event loop when a request's final output arrives, whether or not
    anyone still iterates the group.
    """

    jobs: tuple[Job, ...]
    loop: asyncio.AbstractEventLoop
    abort_requests: Callable[[list[str]], None]
    on_finish: Callable[[RequestOutput, Timing], None] | None = None
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.request_ids = [j.request_id for j in self.jobs]
        self.timings = {rid: Timing(self.arrival) for rid in self.request_ids}
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(self.request_ids)      # final output not yet delivered
        self._open = len(self.request_ids)            # final output not yet yielded

    @property
    def finished(self) -> bool:
        """Every request's final output was delivered (or the group failed)."""
        return not self._unfinished

    def expects(self, request_id: str) -> bool:
        """Whether ``request_id``'s final output is still to be delivered (False once the group failed)."""
        return request_id in self._unfinished

    def abort(self) -> None:
        """Abort the requests that have not finished (no-op when all have); safe to call twice."""
        if self._unfinished:
            self.abort_requests(list(self._unfinished))

    def deliver(self, item: RequestOutput | BaseException) -> None:
        """Hand the consumer an output, or the exception that fails the whole call; on the event loop."""
        if isinstance(item, RequestOutput):
            t = self.timings[item.request_id]
            now = time.monotonic()
            if t.first_token is None and item.token_ids:
                t.first_token = now
            if item.finished:
                self._unfinished.discard(item.request_id)
                self._finished(item, t, now)
        else:
            self._unfinished.clear()
            failed = getattr(item, "output", None)
            if failed is not None:                      # counted as every finished request is
                self._finished(failed, self.timings[failed.request_id], time.monotonic())
        self._queue.put_nowait(item)

    def _finished(self, item: RequestOutput, t: Timing, now: float) -> None:
        t.finished = now
        if self.on_finish is not None:
            try:
                self.on_finish(item, t)
            except Exception:                   # metrics must never break a response
                log.exception("on_finish callback failed")

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._open == 0:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._open = 0
            raise item
        if item.finished:
            self._open -= 1
        return item

    async def batches(self):
        """The outputs in lists: each list is everything delivered by the time the consumer asks, with the
        outputs of one request folded into one (text and tokens joined, the latest state). A stream that falls
        behind the engine thus catches up in one write instead of one per token."""
        while self._open:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            folded: dict[str, RequestOutput] = {}
            failure = None
            for item in items:
                if isinstance(item, BaseException):
                    failure = item
                    break
                if item.finished:
                    self._open -= 1
                prev = folded.get(item.request_id)
                folded[item.request_id] = item if prev is None else item._replace(
                    delta_text=prev.delta_text + item.delta_text,
                    delta_token_ids=prev.delta_token_ids + item.delta_token_ids)
            if folded:
                yield list(folded.values())
            if failure is not None:
                self._open = 0
                raise failure

    async def results(self) -> list[RequestOutput]:
        """The final output of every request, in job order."""
        final = {}
        async for out in self:
            if out.finished:
                final[out.request_id] = out
        return [final[rid] for rid in self.request_ids]


class EngineClient(Protocol):
    """What serves requests, as the server sees it; everything the server uses is here.

    Implemented by :class:`vlora.engine.async_engine.AsyncEngine` (one engine on its own thread),
    :class:`vlora.engine.process_client.EngineProcess` (one engine in a process of its own) and
    :class:`vlora.cluster.front.ClusterFront` (replicas on Ray); ``tests/engine/test_engine_client.py`` checks
    each against this protocol. Every method runs on the server's event loop; the properties are snapshots
    that are safe to read there at any time.
    """

    on_fatal: Callable[[BaseException], None] | None
    """Called once when serving cannot go on (the engine failed, or no replica answers), after every request
    in flight was answered with :class:`EngineFailed`; the server sets it to exit for a restart."""

    @property
    def info(self) -> EngineInfo:
        """The model served: its name, tokenizer, context length, vocabulary and vision tower."""

    @property
    def adapter_names(self) -> frozenset[str]:
        """The adapters a request may name now (those being unloaded left out)."""

    @property
    def stats(self) -> EngineStats:
        """The latest load snapshot (running and waiting requests, KV blocks, inference mode)."""

    @property
    def max_queued_requests(self) -> int:
        """Requests that may wait before :meth:`submit` raises :class:`QueueFull`."""

    @property
    def accepting(self) -> bool:
        """Whether :meth:`submit` takes requests now (False while shutting down or after a failure)."""

    @property
    def failure(self) -> BaseException | None:
        """What stopped serving for good, if anything did."""

    def start(self) -> None:
        """Start serving (on the running event loop); a second call does nothing."""

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on; safe to call from a signal handler."""

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let running ones finish (up to ``timeout`` s, then abort them), stop.
        Returns whether everything finished without being aborted."""

    async def submit(self, jobs: Sequence[Job],
                     on_finish: Callable[[RequestOutput, Timing], None] | None = None) -> RequestGroup:
        """Take ``jobs``, all or none; their outputs come through the group returned. Raises QueueFull,
        ShuttingDown, AdapterNotFound or RequestError (a field at fault)."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Register the PEFT adapter in directory ``path`` as ``name``; raises AdapterError if it is refused
        (AdapterExists if the name is taken)."""

    async def unload_adapter(self, name: str, policy: str = "wait") -> int:
        """Unregister adapter ``name``; returns how many of its requests were waited for (``wait``) or aborted
        (``abort``). Raises AdapterNotFound if it is not registered."""
