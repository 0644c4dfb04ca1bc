"""Each cluster policy's placements and migrations on constructed replica states."""
import pytest

from vlora.cluster.policy import (Migration, ReplicaReport, RequestInfo, make_policy, pages_for)


def rep(rid, running=0, waiting=0, free=100, total=100, adapters=(), cap=4, alive=True, seq=0):
    return ReplicaReport(rid, running, waiting, free, total, 16, frozenset(adapters), cap, alive, seq)


def req(rid="r", adapter="a", prompt=31, gen=0, max_tokens=8):
    return RequestInfo(rid, adapter, prompt, max_tokens, gen)


def test_pages_for_counts_prompt_generated_and_next_token():
    assert pages_for(req(prompt=31), 16) == 2
    assert pages_for(req(prompt=32), 16) == 3          # 33 tokens
    assert pages_for(req(prompt=20, gen=12), 16) == 3


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="consolidate"):
        make_policy("fastest")


# -- consolidate ------------------------------------------------------------------------------------
def test_consolidate_picks_busiest_under_cap_with_kv_room():
    p = make_policy("consolidate")
    reps = [rep(0, running=1), rep(1, running=3), rep(2, running=4), rep(3, running=2, free=4)]
    # 2 is at its cap; 3 would keep 2 free pages for 3 requests (short): 1 is the busiest that fits
    assert p.place(req(), reps) == 1


def test_consolidate_tie_goes_to_highest_id_and_dead_replicas_are_skipped():
    p = make_policy("consolidate")
    assert p.place(req(), [rep(0, running=2), rep(1, running=2), rep(2, running=2)]) == 2
    assert p.place(req(), [rep(0, running=2), rep(1, running=2), rep(2, running=3, alive=False)]) == 1


def test_consolidate_queues_when_no_replica_has_room():
    p = make_policy("consolidate")
    assert p.place(req(), [rep(0, running=4), rep(1, free=1), rep(2, alive=False)]) is None
    assert p.place(req(), []) is None


def test_consolidate_counts_its_own_placements_until_the_next_report():
    p = make_policy("consolidate")
    reps = [rep(0, running=1), rep(1, running=2)]
    for i in range(2):
        assert p.place(req(f"q{i}"), reps) == 1
        p.placed(req(f"q{i}"), 1)
    assert p.place(req("q2"), reps) == 0               # 1 is at its cap of 4 counting the two placed
    # a newer report of replica 1 (a new object) replaces the count
    reps = [reps[0], rep(1, running=2)]
    assert p.place(req("q3"), reps) == 1


def test_placed_kv_counts_against_free_pages_and_numbered_reports():
    p = make_policy("consolidate")
    reps = [rep(0, running=0, seq=1), rep(1, running=1, free=4, seq=1)]
    assert p.place(req("q0"), reps) == 1
    p.placed(req("q0"), 1)                             # takes 2 of the 4 pages
    assert p.place(req("q1", prompt=40), [rep(0, seq=1), rep(1, running=1, free=4, seq=1)]) == 0
    # same seq: still the old report, so the placement still counts; a higher seq starts over
    assert p.place(req("q2", prompt=40), [rep(0, seq=1), rep(1, running=2, free=6, seq=2)]) == 1


def test_consolidate_drains_a_lightly_used_replica_onto_busier_ones():
    p = make_policy("consolidate", drain_below=0.5)    # cap 4: load 1 is light
    reps = [rep(0, running=1), rep(1, running=2), rep(2, running=3)]
    running = {0: [req("x")], 1: [req("y0"), req("y1")], 2: [req("z0"), req("z1"), req("z2")]}
    # 0 drains onto the busiest with room (2); 1 (load 2) is not light; 2 received, so it is not drained
    assert p.rebalance(reps, running) == [Migration("x", 0)]


def test_consolidate_does_not_drain_when_requests_do_not_fit():
    p = make_policy("consolidate", drain_below=0.75)
    reps = [rep(0, running=2), rep(1, running=3)]      # 1 has room for one request only
    running = {0: [req("x0"), req("x1")], 1: [req("y0"), req("y1"), req("y2")]}
    assert p.rebalance(reps, running) == []
    # nothing busier: a lone light replica stays
    assert p.rebalance([rep(0, running=1)], {0: [req("x")]}) == []


def test_consolidate_drain_respects_order_between_equal_loads():
    p = make_policy("consolidate", drain_below=0.5)
    reps = [rep(0, running=1), rep(1, running=1)]
    # (load, id): 0 drains onto 1, never 1 onto 0
    assert p.rebalance(reps, {0: [req("x")], 1: [req("y")]}) == [Migration("x", 0)]


# -- KV shortage migration ------------------------------------------------------------------------
def test_short_replica_gives_up_its_newest_requests():
    p = make_policy("consolidate", drain_below=0.0)
    # replica 0 runs 4 with 1 free page: short; each leaving request frees 2 pages (31 tokens)
    reps = [rep(0, running=4, free=1, cap=8), rep(1, running=1, cap=8)]
    running = {0: [req("old"), req("mid"), req("new1"), req("new2")], 1: [req("y")]}
    # after new2 leaves: 3 free >= 3 running
    assert p.rebalance(reps, running) == [Migration("new2", 0)]


def test_short_replica_keeps_requests_when_no_one_can_take_them():
    p = make_policy("affinity")
    reps = [rep(0, running=4, free=1, cap=8), rep(1, running=3, free=2, cap=8), rep(2, alive=False)]
    running = {0: [req("a"), req("b"), req("c"), req("d")]}
    assert p.rebalance(reps, running) == []


def test_dead_replicas_neither_migrate_nor_receive():
    p = make_policy("least_loaded")
    reps = [rep(0, running=4, free=0, alive=False), rep(1, running=2, free=0, cap=8), rep(2, alive=False)]
    running = {0: [req("a")], 1: [req("b"), req("c")]}
    assert p.rebalance(reps, running) == []


def test_round_robin_never_migrates():
    p = make_policy("round_robin")
    assert p.rebalance([rep(0, running=4, free=0), rep(1)], {0: [req("a")] * 4}) == []


# -- affinity -------------------------------------------------------------------------------------
def test_affinity_prefers_resident_then_least_loaded():
    p = make_policy("affinity")
    reps = [rep(0, running=0), rep(1, running=2, adapters={"a"}), rep(2, running=1, adapters={"a"}),
            rep(3, running=1, adapters={"b"})]
    assert p.place(req(adapter="a"), reps) == 2
    assert p.place(req(adapter="c"), reps) == 0
    assert p.place(req(adapter=None), reps) == 0       # the base model: least loaded


def test_affinity_skips_loaded_or_kv_short_resident_replicas_and_breaks_ties_low():
    p = make_policy("affinity")
    reps = [rep(0, running=1), rep(1, running=1), rep(2, running=4, adapters={"a"}), rep(3, free=0, adapters={"a"})]
    assert p.place(req(adapter="a"), reps) == 0


def test_affinity_places_past_the_batch_cap_unless_capped():
    # every replica at (or past) its cap of 4: affinity still routes (resident within the slack, else least
    # loaded) and the replica's engine queues the request; capped, the front holds it
    reps = [rep(0, running=4, adapters={"a"}), rep(1, running=5, adapters={"b"}), rep(2, alive=False)]
    assert make_policy("affinity").place(req(adapter="a"), reps) == 0
    assert make_policy("affinity").place(req(adapter="b"), reps) == 1          # 5 <= 4 + 0.25 * 4
    assert make_policy("affinity").place(req(adapter="c"), reps) == 0
    assert make_policy("affinity", capped=True).place(req(adapter="a"), reps) is None
    assert make_policy("affinity", capped=True).place(req(adapter="a"), [rep(0, running=4), rep(1, running=3)]) == 1


def test_affinity_prefers_kv_room_then_falls_back_to_the_least_loaded():
    reps = [rep(0, running=1, free=1, adapters={"a"}), rep(1, running=3)]
    assert make_policy("affinity").place(req(adapter="a"), reps) == 1          # 0 would be short of KV
    short = [rep(0, running=2, free=1), rep(1, running=1, free=0), rep(2, alive=False)]
    assert make_policy("affinity").place(req(adapter="a"), short) == 1         # no KV room anywhere
    assert make_policy("affinity", capped=True).place(req(adapter="a"), short) is None
    assert make_policy("affinity").place(req(adapter="a"), [rep(0, alive=False)]) is None


def test_affinity_spreads_an_adapter_beyond_the_slack():
    reps = [rep(0), rep(1, running=2, adapters={"a"}), rep(2, running=1, adapters={"a"})]
    assert make_policy("affinity").place(req(adapter="a"), reps) == 2          # 1 <= 0 + 0.25 * 4
    assert make_policy("affinity", slack=0.0).place(req(adapter="a"), reps) == 0
    assert make_policy("affinity", slack=1.0).place(req(adapter="a"), reps) == 2


def test_affinity_counts_adapters_it_placed_as_resident():
    p = make_policy("affinity")
    reps = [rep(0), rep(1)]
    assert p.place(req("q0", adapter="z"), reps) == 0
    p.placed(req("q0", adapter="z"), 0)
    assert p.place(req("q1", adapter="z"), reps) == 0   # z is on its way to 0, though 0 is now busier
    assert p.place(req("q2", adapter="w"), reps) == 1


# -- least loaded and round robin -----------------------------------------------------------------
def test_least_loaded_ignores_room_and_breaks_ties_low():
    p = make_policy("least_loaded")
    reps = [rep(0, running=3), rep(1, running=1, waiting=1), rep(2, running=2, free=0), rep(3, alive=False)]
    assert p.place(req(), reps) == 1                   # 1 and 2 tie at load 2
    p.placed(req(), 1)
    assert p.place(req(), reps) == 2                   # 2 has no KV room; the replica queues it
    assert p.place(req(), [rep(0, alive=False)]) is None


def test_round_robin_cycles_live_replicas():
    p = make_policy("round_robin")
    reps = [rep(2), rep(0), rep(1, alive=False)]
    assert [p.place(req(), reps) for _ in range(3)] == [0, 2, 0]
    assert p.place(req(), [rep(0, alive=False)]) is None
