"""The ``auto`` all-reduce: its per-size choice is the same on every rank (two gloo processes), and each message
goes where that choice says, with the right sum."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlora.parallel.collectives import SizedAllReduce, nccl_all_reduce, calibrate, make_reduce

ROW = 8           # elements of one decode row
CAPACITY = 48     # the fake one-shot's buffer: 1, 2 and 4 rows are measured, and 6 (the most it holds)


class FakeOneShot:
    """Sums like NCCL (gloo) and counts the messages it sent."""

    capacity = CAPACITY

    def __init__(self):
        self.sent: list[int] = []

    def __call__(self, t):
        self.sent.append(t.numel())
        return nccl_all_reduce(t)


def _rank(rank: int, port: int, queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        reduce = SizedAllReduce(FakeOneShot())

        def timer(fn, numel):
            # rank 0 finds the one-shot faster at every size, rank 1 not at four rows: the slower rank decides
            if fn is reduce.nccl:
                return 2.0
            return 1.0 if rank == 0 or numel != 4 * ROW else 3.0

        timings = calibrate(reduce, ROW, torch.float32, torch.device("cpu"), timer=timer)
        sums = {}
        for rows in (1, 2, 3, 4, 5, 6, 8):       # 3 rows use 4's choice, 5 rows 6's; past the capacity, NCCL
            t = torch.full((rows, ROW), float(rank + 1))
            sums[rows] = reduce(t).unique().tolist()
        queue.put((rank, reduce.use_one_shot, reduce.one_shot.sent, sums, timings))
    finally:
        dist.destroy_process_group()


def test_auto_all_reduce_chooses_alike_on_every_rank_and_routes_by_size():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        use, sent, sums, timings = got[rank]
        assert use == [True, True, False, True]                  # 1, 2, 6 rows: one-shot; 4 rows: NCCL
        assert sent == [1 * ROW, 2 * ROW, 5 * ROW, 6 * ROW]      # 3, 4 and 8 rows went to NCCL
        assert all(v == [3.0] for v in sums.values())            # 1 + 2 on every element, by either path
        assert [t["elements"] for t in timings] == [ROW, 2 * ROW, 4 * ROW, 6 * ROW]
        assert [t["one_shot_ms"] for t in timings] == [1.0, 1.0, 3.0, 1.0]     # the slower rank's times


def test_a_vocab_shard_past_the_vocabulary_holds_padding_only():
    """Five tokens over four ranks: two rows each, the third rank one real row, the last none."""
    from vlora.parallel.partition import VocabShard

    w = torch.arange(10.0).view(5, 2)
    assert [VocabShard.of(5, r, 4).rows().tolist() for r in range(4)] == [[0, 1], [2, 3], [4], []]
    assert VocabShard.of(5, 2, 4).cut(w).tolist() == [[8.0, 9.0], [0.0, 0.0]]
    assert VocabShard.of(5, 3, 4).cut(w).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_auto_before_calibration_and_on_the_cpu_is_nccl():
    reduce = SizedAllReduce(FakeOneShot())
    assert reduce.describe() == "auto: NCCL (not calibrated)"
    assert make_reduce("auto", torch.float32, torch.device("cpu")) is nccl_all_reduce
    with pytest.raises(ValueError, match="all_reduce must be one of auto, nccl, symm_mem"):
        make_reduce("ring", torch.float32, torch.device("cpu"))
