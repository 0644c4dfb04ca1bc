"""What the cluster front tells those watching its requests, without their reading its state.

Benchmarks attach an observer (``ClusterFront(..., observers=[...])`` or :meth:`ClusterFront.observe`) to see
where a request's time goes and where it ran; serving attaches none. The front calls, on its event loop:

- ``placed(request_id, replica_id)`` each time the placement policy picks a replica for a request (a moved
  request is placed again);
- ``accepted(request_id, replica_id)`` each time a replica takes it;
- ``moved(request_id, why)`` when its replica hands it back (``"migrate"``) or is lost with it (``"lost"``):
  it is placed again;
- ``outputs_arrived(replica_id, sent, received, request_ids)`` for each list read from a replica's output
  stream: when the replica sent it and when the front had it (wall clock, comparable across a host's
  processes), and the requests whose outputs in it carry new tokens.

Each does nothing by default; an observer overrides what it needs. An observer must not call back into the
front: it runs inside the front's bookkeeping.
"""

from __future__ import annotations


class FrontObserver:
    def placed(self, request_id: str, replica_id: int) -> None:
        """The policy placed the request on the replica."""

    def accepted(self, request_id: str, replica_id: int) -> None:
        """The replica took the request."""

    def moved(self, request_id: str, why: str) -> None:
        """The request left its replica unfinished (``"migrate"`` or ``"lost"``) and is placed again."""

    def outputs_arrived(self, replica_id: int, sent: float, received: float, request_ids: list[str]) -> None:
        """One list of the replica's outputs reached the front; ``request_ids``: those with new tokens in it."""
