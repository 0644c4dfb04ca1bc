"""V-LoRA Alg. 1 decisions on constructed queues (each branch, credits, starvation; queues longer than a batch),
the light-load rule (queues that fit one batch), and a simulated light load that neither flaps nor makes anyone
wait."""

from __future__ import annotations

from vlora.engine.modes import Mode
from vlora.engine.orchestrator import Costs, Pending, credit, schedule, stay_pays

COSTS = Costs(step_s={Mode.MERGED: 0.010, Mode.MIXED: 0.014, Mode.UNMERGED: 0.020}, switch_s=0.005)
THETA = 0.5


def queue(spec: str, waits: dict[int, float] | None = None) -> list[Pending]:
    """'AAAB-' -> requests on adapters A, A, A, B and the base model (-), in arrival order."""
    waits = waits or {}
    return [Pending(f"r{i}", None if c == "-" else c, waits.get(i, 0.0)) for i, c in enumerate(spec)]


def test_credit_adds_waiting_mode_time_and_switch_when_needed():
    r_a, r_b = Pending("x", "A", 0.2), Pending("y", "B", 0.2)
    assert credit(r_a, Mode.MERGED, "A", COSTS) == 0.2 + 0.010
    assert credit(r_b, Mode.MERGED, "A", COSTS) == 0.2 + 0.010 + 0.005      # must switch to be served
    assert credit(r_b, Mode.MIXED, "A", COSTS) == 0.2 + 0.014
    assert credit(r_b, Mode.UNMERGED, None, COSTS) == 0.2 + 0.020


def test_dominant_adapter_and_no_starvation_merges():
    d = schedule(queue("AAAAAB-A"), Mode.UNMERGED, None, max_bs=6, theta=THETA, costs=COSTS)
    assert d.mode is Mode.MERGED and d.merged == "A"
    assert d.batch == ("r0", "r1", "r2", "r3", "r4", "r7")                   # only A's requests


def test_merged_batch_is_capped_at_max_batch_size():
    d = schedule(queue("A" * 10), Mode.MERGED, "A", max_bs=4, theta=THETA, costs=COSTS)
    assert d.mode is Mode.MERGED and d.batch == ("r0", "r1", "r2", "r3")


def test_a_few_starving_requests_switch_to_mixed_and_go_first():
    d = schedule(queue("AAAAABB-A", waits={5: 0.9, 7: 0.7}), Mode.MERGED, "A", max_bs=8, theta=THETA, costs=COSTS)
    assert d.mode is Mode.MIXED and d.merged == "A"
    assert d.batch[:2] == ("r5", "r7")                                       # starving first
    assert set(d.batch[2:]) <= {"r0", "r1", "r2", "r3", "r4", "r8"} and len(d.batch) == 8


def test_many_starving_requests_switch_to_unmerged():
    waits = {i: 1.0 for i in (5, 6, 7, 8, 9)}                             # 5 of max_bs 8 starve (> half)
    d = schedule(queue("AAAAABCDE-A", waits=waits), Mode.MIXED, "A", max_bs=8, theta=THETA, costs=COSTS)
    assert d.mode is Mode.UNMERGED and d.merged is None
    assert d.batch[:5] == ("r5", "r6", "r7", "r8", "r9") and len(d.batch) == 8


def test_the_merged_adapters_own_starving_requests_run_merged():
    """A backlog of one adapter's requests, many of which waited past θ: they need no mixed mode, so the
    adapter stays merged and they go first (counting them as starving ran the backlog unmerged)."""
    waits = {i: 0.9 for i in range(11, 20)}
    d = schedule(queue("A" * 20, waits=waits), Mode.MERGED, "A", max_bs=16, theta=THETA, costs=COSTS)
    assert d.mode is Mode.MERGED and d.merged == "A" and len(d.batch) == 16
    assert d.batch[:9] == tuple(f"r{i}" for i in range(11, 20))
    d = schedule(queue("A" * 20, waits=waits), Mode.MERGED, "A", 16, THETA, COSTS, mixed=False)
    assert d.mode is Mode.MERGED


def test_the_merged_adapter_keeps_the_merge_while_it_holds_its_share():
    """Heavy load, A merged with 9 of a 16 batch's share and B with 10: no switch on a lead of one request."""
    reqs = [Pending(f"a{i}", "A", 0.0, 20) for i in range(9)] + [Pending(f"b{i}", "B", 0.0, 20) for i in range(10)]
    d = schedule(reqs, Mode.MERGED, "A", 16, THETA, COSTS)
    assert d.mode is Mode.MERGED and d.merged == "A"


def test_no_dominant_adapter_stays_unmerged_in_arrival_order():
    d = schedule(queue("ABCD-ABCD"), Mode.UNMERGED, None, max_bs=6, theta=THETA, costs=COSTS)
    assert d.mode is Mode.UNMERGED and d.batch == ("r0", "r1", "r2", "r3", "r4", "r5")


def test_requests_of_the_base_model_are_never_merged():
    d = schedule(queue("------A"), Mode.UNMERGED, None, max_bs=4, theta=THETA, costs=COSTS)
    assert d.mode is Mode.UNMERGED


def test_ties_keep_the_adapter_already_merged():
    d = schedule(queue("ABABAB"), Mode.MERGED, "B", max_bs=4, theta=THETA, costs=COSTS)
    assert d.mode is Mode.MERGED and d.merged == "B"


def test_starvation_in_merged_mode_counts_the_switch():
    """In MERGED mode a B request also pays the switch it needs; that tips it over θ."""
    calm = schedule(queue("AAAAAB", waits={5: 0.480}), Mode.MERGED, "A", 5, THETA, COSTS)   # 0.495 <= θ
    assert calm.mode is Mode.MERGED and "r5" not in calm.batch
    tipped = schedule(queue("AAAAAB", waits={5: 0.488}), Mode.MERGED, "A", 5, THETA, COSTS)  # 0.503 > θ
    assert tipped.mode is Mode.MIXED and tipped.batch[0] == "r5"


def test_light_load_runs_everyone_and_merges_a_majority_adapter():
    """Everything pending fits one batch: nobody waits. An adapter with most of the requests is merged (MERGED
    when they are all its, else MIXED) when that pays by the measured costs; the merged adapter stays while it
    keeps a quarter of them; otherwise unmerged."""
    everyone = ("r0", "r1", "r2")
    d = schedule(queue("AAA"), Mode.UNMERGED, None, max_bs=64, theta=THETA, costs=COSTS)
    assert d.mode is Mode.MERGED and d.merged == "A" and d.batch == everyone
    d = schedule(queue("AAB"), Mode.UNMERGED, None, 64, THETA, COSTS)          # mixed measured faster here
    assert d.mode is Mode.MIXED and d.merged == "A" and d.batch == everyone
    slow_mixed = Costs(step_s={Mode.MERGED: 0.010, Mode.MIXED: 0.021, Mode.UNMERGED: 0.020}, switch_s=0.005)
    d = schedule(queue("AAB"), Mode.UNMERGED, None, 64, THETA, slow_mixed)     # ... and slower here: no switch
    assert d.mode is Mode.UNMERGED and d.batch == everyone
    assert schedule(queue("AAB"), Mode.MIXED, "A", 64, THETA, COSTS).mode is Mode.MIXED        # staying is free
    assert schedule(queue("AAB"), Mode.MIXED, "A", 64, THETA, slow_mixed).mode is Mode.UNMERGED  # ... unless slower
    assert schedule(queue("AB"), Mode.UNMERGED, None, 64, THETA, COSTS).mode is Mode.UNMERGED   # no majority
    d = schedule(queue("ABBBB"), Mode.MIXED, "A", 64, THETA, COSTS)  # A keeps 1 of 5 (< 1/4): B has the majority
    assert d.mode is Mode.MIXED and d.merged == "B" and len(d.batch) == 5
    d = schedule(queue("ABCDE"), Mode.MIXED, "A", 64, THETA, COSTS)  # nobody keeps or wins: unmerge
    assert d.mode is Mode.UNMERGED and len(d.batch) == 5
    assert schedule(queue("AA-"), Mode.UNMERGED, None, 64, THETA, COSTS).mode is Mode.MIXED     # base rows subtract
    assert schedule(queue("AAB"), Mode.MERGED, "A", 64, THETA, COSTS, mixed=False).mode is Mode.UNMERGED
    assert schedule(queue("AAA"), Mode.UNMERGED, None, 64, THETA, COSTS, mixed=False).mode is Mode.MERGED


def test_a_switch_must_pay_for_itself():
    """Merging saves 10 ms an iteration here and a switch costs 50 ms: a merge must save more than it and the
    unmerge after it (100 ms); unmerging an adapter merged now is paid either way; staying costs nothing."""
    costs = Costs(step_s={Mode.MERGED: 0.010, Mode.MIXED: 0.014, Mode.UNMERGED: 0.020}, switch_s=0.050)

    def reqs(spec, remaining):
        return [Pending(f"r{i}", c, 0.0, remaining) for i, c in enumerate(spec)]

    assert schedule(reqs("AAA", 3), Mode.UNMERGED, None, 8, THETA, costs).mode is Mode.UNMERGED
    assert schedule(reqs("AAA", 20), Mode.UNMERGED, None, 8, THETA, costs).mode is Mode.MERGED
    assert schedule(reqs("AAA", 9), Mode.MERGED, "B", 8, THETA, costs).mode is Mode.UNMERGED       # 90 < 100 ms
    assert schedule(reqs("AAA", 11), Mode.MERGED, "B", 8, THETA, costs).merged == "A"             # 110 > 100 ms
    assert schedule(reqs("AAA", 1), Mode.MERGED, "A", 8, THETA, costs).merged == "A"
    heavy = reqs("AAAAAAB", 3)                                                                    # 7 > max_bs 4
    assert schedule(heavy, Mode.UNMERGED, None, 4, THETA, costs).mode is Mode.UNMERGED
    assert schedule(reqs("AAAAAAB", 20), Mode.UNMERGED, None, 4, THETA, costs).mode is Mode.MERGED


def test_unmeasured_costs_let_the_first_merge_happen():
    cold = Costs(step_s={m: 0.0 for m in Mode}, switch_s=0.0)
    d = schedule([Pending("r0", "A", 0.0, 1), Pending("r1", "A", 0.0, 1)], Mode.UNMERGED, None, 8, THETA, cold)
    assert d.mode is Mode.MERGED


def simulate_light_load(costs: Costs, mixed: bool, long_tokens: int, short_tokens: int) -> tuple[float, int, int, int]:
    """One long request of A at a time and a request of B every 0.3 s, on a simulated clock driven by ``costs``;
    asserts nobody waits (light load). Returns (time, switches, mixed iterations, B requests)."""
    t, mode, merged, switches, n, mixed_iters = 0.0, Mode.UNMERGED, None, 0, 0, 0
    left = {"a": long_tokens}
    while left.get("a", 0) > 0:
        if t >= 0.3 * n:
            left[f"b{n}"], n = short_tokens, n + 1
        pend = [Pending(k, k[0].upper(), 0.0, v) for k, v in left.items()]
        d = schedule(pend, mode, merged, 64, THETA, costs, mixed=mixed)
        assert set(d.batch) == set(left)                                  # nobody waits under light load
        if d.merged != merged:
            switches += 1
            t += costs.switch_s
        mode, merged = d.mode, d.merged
        t += costs.step_s[mode]
        mixed_iters += mode is Mode.MIXED
        for k in d.batch:
            left[k] -= 1
        left = {k: v for k, v in left.items() if v > 0}
    return t, switches, mixed_iters, n


def test_simulated_light_load_neither_flaps_nor_starves():
    """One long request of A and a short request of B every 0.3 s (each 5 tokens): A is merged once and stays
    (mixed while a B runs), and every pending request decodes in every iteration."""
    costs = Costs(step_s={Mode.MERGED: 0.010, Mode.MIXED: 0.014, Mode.UNMERGED: 0.020}, switch_s=0.050)
    _, switches, _, n = simulate_light_load(costs, True, 300, 5)
    assert switches <= 2 and n > 5


def test_a_starved_request_stays_first_until_it_finishes():
    """Once its credit passed θ, a request is served in every iteration (mixed mode), not once per θ: after the
    iteration that served it, its wait is short again, but it is still in the starved set."""
    waits = {5: 0.9}
    first = schedule(queue("AAAAAB", waits), Mode.MERGED, "A", 5, THETA, COSTS)
    assert first.mode is Mode.MIXED and first.batch[0] == "r5"
    again = schedule(queue("AAAAAB"), Mode.MIXED, "A", 5, THETA, COSTS)                 # wait reset: merged, r5 out
    assert again.mode is Mode.MERGED and "r5" not in again.batch
    sticky = schedule(queue("AAAAAB"), Mode.MIXED, "A", 5, THETA, COSTS, starved={"r5"})
    assert sticky.mode is Mode.MIXED and sticky.batch[0] == "r5"


# Decode iteration times measured on an H200 (2026-11-22, .gpu-results/run1-h200/policies-skew-high, 2-4 requests):
# mixed is slower than unmerged there, and a merge takes 59 ms.
H200 = Costs(step_s={Mode.MERGED: 0.0053, Mode.MIXED: 0.0080, Mode.UNMERGED: 0.0067}, switch_s=0.059)


def test_the_merged_adapter_stays_beside_others_while_that_costs_less_than_leaving():
    """Light load, A merged, a B request comes. With mixed iterations slower than unmerged ones (the H200's
    1.3 ms), staying costs 1.3 ms for each token B has left; leaving costs an unmerge now and, when A's requests
    outlive B, the merge back. A mixed iteration no slower than an unmerged one always stays; dLoRA's policy
    (no mixed mode) always leaves. Unmeasured, the mode not measured yet runs (mixed first, then unmerged)."""
    def reqs(b_left, a_left=100):
        return [Pending("a0", "A", 0.0, a_left), Pending("a1", "A", 0.0, a_left), Pending("b0", "B", 0.0, b_left)]

    d = schedule(reqs(10), Mode.MERGED, "A", 64, THETA, H200)             # 13 ms < 59 + 59 ms: stay
    assert d.mode is Mode.MIXED and d.merged == "A" and set(d.batch) == {"a0", "a1", "b0"}
    assert schedule(reqs(80), Mode.MIXED, "A", 64, THETA, H200).mode is Mode.MIXED        # 104 < 118 ms
    assert schedule(reqs(95), Mode.MIXED, "A", 64, THETA, H200).mode is Mode.UNMERGED     # 123.5 > 118 ms
    assert schedule(reqs(40, 30), Mode.MIXED, "A", 64, THETA, H200).mode is Mode.MIXED    # 52 < 59: no merge back
    assert schedule(reqs(50, 30), Mode.MIXED, "A", 64, THETA, H200).mode is Mode.UNMERGED  # 65 > 59
    assert schedule(reqs(None), Mode.MIXED, "A", 64, THETA, H200).mode is Mode.UNMERGED   # B's length unknown
    assert schedule(reqs(10), Mode.MERGED, "A", 64, THETA, H200, mixed=False).mode is Mode.UNMERGED   # as dLoRA
    assert schedule(reqs(10)[:2], Mode.MERGED, "A", 64, THETA, H200).mode is Mode.MERGED      # pure: stays merged
    reused = Costs(H200.step_s, switch_s=0.059, unmerge_s=0.012, reuse_s=0.011)           # records reused: cheap
    assert schedule(reqs(15), Mode.MIXED, "A", 64, THETA, reused).mode is Mode.MIXED      # 19.5 < 12 + 11 ms
    assert schedule(reqs(20), Mode.MIXED, "A", 64, THETA, reused).mode is Mode.UNMERGED    # 26 > 23 ms
    fast_mixed = Costs(step_s={Mode.MERGED: 0.0053, Mode.MIXED: 0.0060, Mode.UNMERGED: 0.0067}, switch_s=0.059)
    assert schedule(reqs(None), Mode.MERGED, "A", 64, THETA, fast_mixed).mode is Mode.MIXED
    unmeasured = {m: 0.0 for m in Mode}
    assert stay_pays(Costs(unmeasured, 0.059))                                               # mixed runs first
    assert not stay_pays(Costs({**unmeasured, Mode.MIXED: 0.008}, 0.059))                    # then unmerged
    assert stay_pays(Costs({**unmeasured, Mode.MIXED: 0.008, Mode.UNMERGED: 0.008}, 0.059))  # a tie stays


def test_merge_costs_tell_a_reused_record_from_a_first_merge():
    costs = Costs(H200.step_s, switch_s=0.038, unmerge_s=0.012, reuse_s=0.011, kept="A")
    assert costs.merge_cost("A") == 0.011 and costs.merge_cost("B") == 0.038 and costs.unmerge_cost == 0.012
    assert Costs(H200.step_s, 0.05).merge_cost("A") == 0.05 and Costs(H200.step_s, 0.05).unmerge_cost == 0.05
    reqs = [Pending(f"r{i}", "A", 0.0, 40) for i in range(3)]      # merging A saves 1.4 ms x 40 = 56 ms
    assert schedule(reqs, Mode.UNMERGED, None, 8, THETA, costs).mode is Mode.MERGED        # 11 + 12 ms: pays
    cold = Costs(H200.step_s, switch_s=0.050, unmerge_s=0.012, reuse_s=0.011, kept="B")
    assert schedule(reqs, Mode.UNMERGED, None, 8, THETA, cold).mode is Mode.UNMERGED       # 50 + 12 ms: not


def test_simulated_light_load_with_slow_mixed_costs_no_more_than_without_mixed():
    """One long request of A at a time and a request of B every 0.3 s, iteration and switch times as measured
    on the H200 (mixed slower than unmerged): V-LoRA's policy runs mixed stretches only where they cost less
    than the switches they save, so on the simulated clock it serves this no slower than dLoRA's (mixed=False),
    for short B requests (it stays) and long ones (it leaves, as dLoRA does)."""
    for b_tokens in (10, 40, 150):
        vlora, _, vlora_mixed, _ = simulate_light_load(H200, True, 600, b_tokens)
        dlora = simulate_light_load(H200, False, 600, b_tokens)[0]
        assert vlora <= dlora
        assert (vlora_mixed > 0) == (b_tokens * (0.0080 - 0.0067) <= 2 * 0.059)
    fast_mixed = Costs(step_s={Mode.MERGED: 0.0053, Mode.MIXED: 0.0060, Mode.UNMERGED: 0.0067}, switch_s=0.059)
    assert simulate_light_load(fast_mixed, True, 600, 40)[2] > 0
