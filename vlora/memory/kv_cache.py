"""The error the pool raises when it runs out of pages (sizing: ``vlora/memory/sizing.py``).

KV blocks are pages of the unified pool (``vlora/memory/pool.py``); the
scheduler sees ``allocate`` / ``free`` / ``make_room`` / ``num_free`` there.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """No free page; the scheduler preempts instead of crashing."""
