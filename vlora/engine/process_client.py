"""The server's side of the engine-core process: an :class:`~vlora.engine.client.EngineClient` whose engine
runs in a process of its own (:mod:`vlora.engine.core_process` says why and what crosses).

:class:`EngineProcess` starts the process (``spawn``: the CUDA context and the engine are that process's
alone), waits for it to build its engine, then relays: a call (submit, load, unload, shutdown) is a message
with an id whose reply settles the caller's future; each "out" message carries one engine step's outputs,
decoded (:class:`~vlora.engine.output_deltas.DeltaDecoder`) and delivered to their groups on this event loop.
Refusals come back as :class:`~vlora.engine.client.Refusal` values and are raised as the exceptions an
in-process engine raises. If the process dies, every request in flight gets :class:`EngineFailed` and
``on_fatal`` is called, as when an in-process engine fails.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import socket
from collections.abc import Callable, Sequence

from vlora.engine import core_process
from vlora.engine.client import (EngineFailed, EngineInfo, EngineStats, Job, RequestFailed, RequestGroup, ShuttingDown,
                                 Timing, rebuild)
from vlora.engine.output_deltas import DeltaDecoder
from vlora.engine.sequence import RequestOutput

log = logging.getLogger(__name__)


SHUTDOWN_GRACE_S = 30.0
"""Seconds past its drain timeout that the engine's process has to answer a shutdown before it is stopped."""


class EngineStartFailed(RuntimeError):
    """The engine-core process ended before its engine was ready."""


class EngineProcess:
    """An :class:`~vlora.engine.client.EngineClient` serving an engine built by ``build()`` in a process of its
    own.

    ``build``: a picklable callable (a module-level function, or a ``functools.partial`` of one) run in the new
    process, returning (the Engine, a dict of picklable facts for this side, :attr:`extra`).
    ``start_loader``: start the process that reads adapters at once (the server loads adapters at run time).
    The constructor blocks until the engine is ready (model built, kernels warmed) and raises what ``build``
    raised if it failed.
    """

    info: EngineInfo
    adapter_names: frozenset[str]
    stats: EngineStats
    max_queued_requests: int
    failure: BaseException | None
    on_fatal: Callable[[BaseException], None] | None

    def __init__(self, build: Callable[[], tuple], max_queued_requests: int = 256, start_loader: bool = False,
                 on_fatal: Callable[[BaseException], None] | None = None, log_level: str = "info"):
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.max_queued_requests = max_queued_requests
        self.on_fatal = on_fatal
        self.failure: BaseException | None = None
        self._accepting = True
        self._closed = False
        self._stopping = False
        self._sock: socket.socket | None = None
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: the engine starts processes of its own (the adapter reader, tensor-parallel workers)
        self.process = ctx.Process(target=core_process.run, name="vlora-engine-core",
                                   args=(child, build, max_queued_requests, start_loader, log_level))
        self.process.start()
        child.close()                  # this side's copy: the process's exit closes the socket for good
        atexit.register(self.close)
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(30)
            self.close()
            raise EngineStartFailed(f"the engine process exited (exit code {self.process.exitcode}) before its "
                                    f"engine was ready") from None
        if msg[0] == "failed":
            self.close()
            _, exc, trace = msg
            log.debug("engine process failed to start:\n%s", trace)
            raise exc
        _, self.info, self.adapter_names, self.stats, self.extra = msg
        self._decoder = DeltaDecoder()
        self._routes: dict[str, RequestGroup] = {}       # request id -> its group, until its final output
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._unsent: list[bytes] = []                   # written before the stream is open
        self._reader: asyncio.Task | None = None
        self._lost = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._reader is None and not self._closed:
            self._reader = asyncio.ensure_future(self._read())

    @property
    def accepting(self) -> bool:
        return self._accepting and self.failure is None and not self._lost

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (safe to call from a signal handler)."""
        self._accepting = False

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let running ones finish (up to ``timeout`` s, then abort them), stop the
        process. Returns whether everything finished without being aborted."""
        self.begin_shutdown()
        drained = not self._lost                # a process that died has failed what it ran
        if self._reader is not None and not self._lost:
            self._stopping = True               # the connection's end that follows is no failure
            try:
                # the process aborts what runs after ``timeout``; a process that does not answer is stopped
                drained = await asyncio.wait_for(self._call("shutdown", timeout),
                                                 None if timeout is None else timeout + SHUTDOWN_GRACE_S)
            except (EngineFailed, asyncio.TimeoutError):
                drained = False
        self._close_stream()
        await asyncio.get_running_loop().run_in_executor(None, self.close)
        return drained

    def close(self, timeout: float = 30) -> None:
        """Stop the process (it aborts what runs once the connection closes) and wait for it; requests still
        in flight get EngineFailed. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._accepting = False
        atexit.unregister(self.close)
        self._close_stream()
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join()

    def _close_stream(self) -> None:
        """End the connection from any thread (a socket's shutdown is the kernel's: the process reads its end
        at once, and this side's stream reads its own)."""
        self._conn.close()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- calls ------------------------------------------------------------------------------------
    async def submit(self, jobs: Sequence[Job],
                     on_finish: Callable[[RequestOutput, Timing], None] | None = None) -> RequestGroup:
        """Add ``jobs`` to the engine, all or none; raises QueueFull, ShuttingDown or RequestError."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down" if self.failure is None
                               else f"the engine failed: {self.failure!r}")
        group = RequestGroup(tuple(jobs), asyncio.get_running_loop(), self.abort, on_finish)
        for rid in group.request_ids:           # routed before the reply: outputs may come first
            self._routes[rid] = group
        try:
            await self._call("submit", group.jobs)
        except BaseException as e:
            self._unroute(group)
            if isinstance(e, asyncio.CancelledError):   # the engine may have taken them
                self.abort(group.request_ids)
            raise
        return group

    async def load_adapter(self, name: str, path: str) -> None:
        """Register the PEFT adapter in directory ``path`` as ``name`` (read in the engine process's adapter
        reader); raises AdapterError if it is refused (AdapterExists if the name is taken)."""
        await self._call("load", name, path)

    async def unload_adapter(self, name: str, policy: str = "wait") -> int:
        """Unregister adapter ``name``; returns how many of its requests were waited for or aborted."""
        if policy not in ("wait", "abort"):
            raise ValueError(f"policy must be wait or abort, got {policy!r}")
        return await self._call("unload", name, policy)

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (each ends with finish_reason "abort"); ids no longer served are skipped."""
        if not self._lost:
            self._write(("abort", list(request_ids)))

    async def _call(self, kind: str, *args):
        if self._lost or self._closed:
            raise EngineFailed("the engine process is not running" if self.failure is None
                               else f"the engine failed: {self.failure!r}")
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._write((kind, call_id, *args))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _write(self, msg: tuple) -> None:
        data = core_process.frame(msg)
        if self._writer is None:
            self._unsent.append(data)
        elif not self._writer.is_closing():
            self._writer.write(data)

    # -- what the process sends -----------------------------------------------------------------
    async def _read(self) -> None:
        try:
            self._sock = core_process.stream_socket(self._conn)
            reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
            for data in self._unsent:
                self._writer.write(data)
            self._unsent.clear()
            while True:
                self._handle(await core_process.read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            failure = None
        except Exception as e:          # a message this side cannot read: nothing after it can be trusted
            log.exception("engine process: unreadable message")
            failure = EngineFailed(f"unreadable message from the engine process: {e!r}")
            self._close_stream()
        if self._writer is not None:
            self._writer.close()
        self._gone(failure)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, items, stats, names = msg
            self._publish(stats, names)
            for item in items:
                if item[0] is None:
                    self._fail_group(*item[1:])
                else:
                    self._deliver(self._decoder.decode(item))
        elif kind == "reply":
            _, call_id, result, refused, stats, names = msg
            self._publish(stats, names)
            fut = self._calls.get(call_id)
            if fut is None or fut.done():
                return
            if refused is None:
                fut.set_result(result)
            else:
                fut.set_exception(rebuild(refused))
        elif kind == "fatal":
            self._gone(EngineFailed(f"the engine failed: {msg[1]}"))
        else:
            log.error("engine process: unknown message %r", kind)

    def _publish(self, stats: EngineStats | None, names: frozenset[str] | None) -> None:
        if stats is not None:
            self.stats = stats
        if names is not None:
            self.adapter_names = names

    def _deliver(self, out: RequestOutput) -> None:
        group = self._routes.get(out.request_id)
        if group is None:                       # its submit was cancelled, or its group failed
            return
        if out.finished:
            del self._routes[out.request_id]
        group.deliver(out)

    def _fail_group(self, request_ids: tuple[str, ...], refused, wire) -> None:
        failed = None if wire is None else self._decoder.decode(wire)     # before anything of the group is forgotten
        group = next((self._routes[r] for r in request_ids if r in self._routes), None)
        if group is None:
            return
        if refused.kind == "RequestFailed":
            # the group's other requests stay routed: their abort outputs come next, and reach the group (its
            # on_finish) as in one process
            if failed is not None and self._routes.get(failed.request_id) is group:
                del self._routes[failed.request_id]
            group.deliver(RequestFailed(refused.message, failed))
        else:
            self._unroute(group)
            group.deliver(rebuild(refused))

    def _unroute(self, group: RequestGroup) -> None:
        for rid in group.request_ids:
            if self._routes.get(rid) is group:
                del self._routes[rid]
        self._decoder.forget(group.request_ids)

    def _gone(self, failure: EngineFailed | None) -> None:
        """The connection ended: by :meth:`close` (nothing to do), or the process failed or died."""
        if self._lost:
            return
        self._lost = True
        self._accepting = False
        stopped = (self._closed or self._stopping) and failure is None
        if stopped:
            failure = EngineFailed("the engine process was stopped")
        elif failure is None:
            self.process.join(0.2)              # reaped, where it has exited, for its exit code
            code = self.process.exitcode
            failure = EngineFailed("the engine process exited" + ("" if code is None else f" (exit code {code})"))
        if not stopped:
            self.failure = failure
        groups = {id(g): g for g in self._routes.values()}
        self._routes.clear()
        for g in groups.values():
            g.deliver(EngineFailed(str(failure)))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineFailed(str(failure)))
        if self.on_fatal is not None and not stopped:
            try:
                self.on_fatal(failure)
            except Exception:
                log.exception("on_fatal callback failed")
