"""The processes under a process, read from /proc (Linux): a server's engine process and what it starts, for
the benchmarks that count their CPU time and the tests that check none is left behind."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``, children before grandchildren of each; empty where /proc has none."""
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in descendants(k)]
