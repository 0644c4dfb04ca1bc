"""The engine core in a process of its own: the server's process keeps the HTTP work, this one the engine.

In one process the event loop's stream work (SSE chunks, JSON, socket writes, ~50-90 us of interpreter time
per output token) and the engine thread's host work take turns on one interpreter lock; here the engine thread
shares it only with a relay. One :class:`~vlora.engine.async_engine.AsyncEngine` runs in this process as it
would in the server's, and this process's event loop only relays: commands in from the server's process, and
each engine step's outputs out as one message (the engine thread hands a step's deliveries to the loop in one
callback; :class:`_Relay` sends what they hold, encoded by :class:`~vlora.engine.output_deltas.DeltaEncoder`).

    server process (EngineProcess)                   engine-core process (this module)
      submit ---("submit", id, jobs)-------------->  AsyncEngine.add_nowait --> engine thread
             <--("reply", id, None | Refusal, ...)-
      groups <--("out", [output | failure], ...)--  _Relay <-- one callback per engine step
      abort  ---("abort", ids)-------------------->  AsyncEngine.abort

Messages are pickled tuples framed as :class:`multiprocessing.connection.Connection` frames them (a 4-byte
big-endian length, then the bytes), over the socket pair of a duplex ``Pipe``: the ready message goes through
the Connection, everything after through asyncio streams on the same socket, so neither side ever blocks on a
write. The server's process going away (the socket closes) aborts every request and ends this process.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable

from vlora.engine.async_engine import AsyncEngine
from vlora.engine.client import EngineFailed, RequestFailed, refusal
from vlora.engine.output_deltas import DeltaEncoder
from vlora.engine.sequence import RequestOutput

log = logging.getLogger(__name__)

HEADER = struct.Struct("!i")
STATE_EVERY_S = 0.1
"""How often the engine's stats reach the server's process when no output or reply carries them."""


def frame(msg) -> bytes:
    """One message as it goes on the socket."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader):
    """The next message; raises IncompleteReadError once the other side closed."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(n))


def stream_socket(conn) -> socket.socket:
    """The socket under a duplex Pipe's Connection, for asyncio streams (the Connection is closed)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    sock.setblocking(False)
    return sock


class _Relayed:
    """A request group as the engine thread sees it here: its deliveries go to the relay."""

    __slots__ = ("jobs", "request_ids", "loop", "relay")

    def __init__(self, jobs, loop, relay: _Relay):
        self.jobs = tuple(jobs)
        self.request_ids = [j.request_id for j in self.jobs]
        self.loop = loop
        self.relay = relay

    def deliver(self, item: RequestOutput | BaseException) -> None:
        self.relay.put(self, item)

    def abort(self) -> None:
        self.relay.engine.abort(self.request_ids)


class _Relay:
    """What the engine delivers, batched into one "out" message per loop pass (one per engine step)."""

    def __init__(self, engine: AsyncEngine, send: Callable[[tuple], None]):
        self.engine = engine
        self.send = send
        self.encoder = DeltaEncoder()
        self.items: list[tuple] = []
        self.stats = None
        self.names = None
        self._scheduled = False

    def put(self, group: _Relayed, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self.items.append(self.encoder.encode(item))
        else:                       # the whole group fails: a None request id marks a failure
            failed = item.output if isinstance(item, RequestFailed) else None
            wire = None if failed is None else self.encoder.encode(failed)
            if failed is None:      # the engine failed: nothing more comes for the group
                self.encoder.forget(group.request_ids)
            # (one request failed: the group's others still send their abort outputs, as in one process)
            self.items.append((None, tuple(group.request_ids), refusal(item), wire))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def state(self) -> tuple:
        """The engine's stats and adapter names, each None where unchanged since last sent."""
        stats, names = self.engine.stats, self.engine.adapter_names
        out = (None if stats == self.stats else stats, None if names == self.names else names)
        self.stats, self.names = stats, names
        return out

    def flush(self) -> None:
        self._scheduled = False
        if not self.items:
            return
        items, self.items = self.items, []
        self.send(("out", items, *self.state()))


class _Core:
    def __init__(self, engine: AsyncEngine, writer: asyncio.StreamWriter):
        self.engine = engine
        self.writer = writer
        self.relay = _Relay(engine, self.send)
        self.tasks: set[asyncio.Task] = set()
        self.done = asyncio.Event()

    def send(self, msg: tuple) -> None:
        if self.writer.is_closing():
            return
        try:
            data = frame(msg)
        except Exception as e:      # an engine bug: the server fails what runs and exits for a restart
            log.exception("engine core: a %r message cannot be pickled", msg[0])
            data = frame(("fatal", f"a message of the engine process cannot be pickled: {e!r}"))
        self.writer.write(data)

    def reply(self, call_id: int, result=None, exc: BaseException | None = None) -> None:
        self.relay.flush()                     # outputs delivered before the reply reach the server first
        self.send(("reply", call_id, result, None if exc is None else refusal(exc), *self.relay.state()))

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "submit":
            self.submit(msg[1], msg[2])
        elif kind == "load":
            self.spawn(msg[1], self.engine.load_adapter(msg[2], msg[3]))
        elif kind == "unload":
            self.spawn(msg[1], self.engine.unload_adapter(msg[2], msg[3]))
        elif kind == "shutdown":
            self.spawn(msg[1], self.engine.shutdown(msg[2]), then=self.done.set)
        else:
            log.error("engine core: unknown message %r", kind)

    def submit(self, call_id: int, jobs) -> None:
        # queued at once, so that an abort read next (a caller gone) comes after the add
        try:
            fut = self.engine.add_nowait(_Relayed(jobs, asyncio.get_running_loop(), self.relay))
        except Exception as e:
            self.reply(call_id, exc=e)
            return
        fut.add_done_callback(lambda f: self.reply(call_id, exc=f.exception()))

    def spawn(self, call_id: int, coro, then: Callable[[], None] | None = None) -> None:
        async def run():
            try:
                result, exc = await coro, None
            except Exception as e:
                result, exc = None, e
            self.reply(call_id, result, exc)
            if then is not None:
                then()
        task = asyncio.ensure_future(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def serve(self, reader: asyncio.StreamReader) -> None:
        read = asyncio.ensure_future(self._read(reader))
        publish = asyncio.ensure_future(self._publish_state())
        await self.done.wait()
        read.cancel()
        publish.cancel()
        try:
            await self.writer.drain()
        except ConnectionError:         # the server's process has gone already
            pass
        self.writer.close()

    async def _publish_state(self) -> None:
        """The engine's stats and adapter names where they changed without an output or a reply to carry them
        (a request admitted, the engine gone idle), every STATE_EVERY_S."""
        while True:
            await asyncio.sleep(STATE_EVERY_S)
            stats, names = self.relay.state()
            if stats is not None or names is not None:
                self.send(("out", [], stats, names))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self.handle(await read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            # the server's process is gone: nobody reads the outputs; abort everything and stop
            log.warning("engine core: the server's process closed the connection; stopping")
        except Exception as e:      # a message this side cannot read: nothing after it can be trusted
            log.exception("engine core: unreadable message; stopping")
            self.send(("fatal", f"the engine process could not read a message: {e!r}"))
        self.writer.close()
        await self.engine.shutdown(0)
        self.done.set()


async def _serve(conn, engine: AsyncEngine, extra: dict) -> None:
    loop = asyncio.get_running_loop()
    fatal: list[tuple] = []
    core: list[_Core] = []

    def on_fatal(exc: BaseException) -> None:       # on the engine thread, after every group got EngineFailed
        def tell():
            if core:
                core[0].relay.flush()
                core[0].send(("fatal", repr(exc)))
            else:
                fatal.append(("fatal", repr(exc)))
        loop.call_soon_threadsafe(tell)

    engine.on_fatal = on_fatal
    engine.start()
    conn.send(("ready", engine.info, engine.adapter_names, engine.stats, extra))
    reader, writer = await asyncio.open_unix_connection(sock=stream_socket(conn))
    c = _Core(engine, writer)
    core.append(c)
    for msg in fatal:
        c.send(msg)
    c.relay.state()                              # what the ready message said counts as sent
    await c.serve(reader)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)


def run(conn, build: Callable[[], tuple], max_queued_requests: int, start_loader: bool, log_level: str) -> None:
    """The process's body: ``build()`` -> (engine, extra picklable facts for the server's process); then serve
    until the server's process asks for shutdown or goes away."""
    # a server's process killed while this one builds (minutes on a large model) would leave it holding the GPU
    threading.Thread(target=_exit_with_parent, name="vlora-core-parent", daemon=True).start()
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(levelname)s:     [engine core] %(name)s: %(message)s")
    try:
        engine, extra = build()
        async_engine = AsyncEngine(engine, max_queued_requests)
        if start_loader:            # the process that reads adapters imports torch now, not on the first load
            from vlora.lora.loader import LOADER

            LOADER.start()
    except BaseException as e:
        try:
            pickle.loads(pickle.dumps(e))       # the server's process must be able to rebuild it
        except Exception:
            e = EngineFailed(f"{type(e).__name__}: {e}")
        conn.send(("failed", e, traceback.format_exc()))
        conn.close()
        return
    # built: from now on Ctrl-C, and a service manager's stop, which reach the whole process group, are the
    # server's process's to act on (it drains what runs, then stops this one); the connection's end stops it
    # whatever happened there
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        asyncio.run(_serve(conn, async_engine, extra))
    except BaseException:
        log.exception("engine core: stopped by an error")
        code = 1
    else:
        code = 0
    # the engine has stopped and every reply is sent: nothing is left for the interpreter's exit to wait for but
    # the adapter readers (they see this process end and exit on their own, vlora.lora.loader._end_with)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
