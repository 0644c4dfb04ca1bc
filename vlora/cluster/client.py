"""The cluster front on an event loop of its own thread, for blocking callers (``LLM(replicas=N)``)."""

from __future__ import annotations

import asyncio
import threading

from vlora.cluster.front import ClusterFront
from vlora.engine.client import Job
from vlora.engine.sequence import RequestOutput


class ClusterClient:
    """Blocking calls into a :class:`ClusterFront`, which runs on this client's event-loop thread."""

    def __init__(self, front: ClusterFront):
        self.front = front
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vlora-cluster", daemon=True)
        self.thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.front.start()

    def run(self, coro):
        """Run ``coro`` on the front's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def generate(self, jobs: list[Job]) -> list[RequestOutput]:
        async def go():
            return await (await self.front.submit(jobs)).results()
        return self.run(go())

    def stream(self, job: Job):
        """The request's outputs as they arrive; closing the iterator aborts it."""
        group = self.run(self.front.submit([job]))
        done = False
        try:
            while not done:
                try:
                    out = self.run(group.__anext__())
                except StopAsyncIteration:
                    return
                done = out.finished
                yield out
        finally:
            if not done:
                self.loop.call_soon_threadsafe(group.abort)

    def close(self) -> None:
        if self.thread.is_alive():
            self.run(self.front.shutdown(0))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
