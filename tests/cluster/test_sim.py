"""The cluster simulator: hand-computed timings on a constructed cost table, determinism, and the policies'
effects that the simulator exists to show."""
import math

import pytest

from vlora.bench.workloads import RequestSpec, multi_turn, synthetic
from vlora.cluster.costs import CostTable, ReplicaLimits, ServedCosts, linear_table
from vlora.cluster.policy import make_policy
from vlora.cluster.sim import ClusterSim, cycled_rank, profiled_batch_cap

# constructed costs (not a measurement): 10 ms per iteration, 1 ms per prefill token, 2 ms per decode,
# 5 ms per distinct adapter; loading a rank-8 adapter 3 ms
LIMITS = ReplicaLimits(num_pages=100, page_tokens=16, max_num_seqs=8, max_num_batched_tokens=64,
                       adapter_pages={8: 1, 64: 4})
TABLE = linear_table(LIMITS, 0.010, 0.001, 0.002, 0.005, adapter_load_s={8: 0.003, 64: 0.006}, migration_s=0.004)


def run(specs, replicas=1, policy="round_robin", table=TABLE, **kw):
    return ClusterSim(table, replicas, make_policy(policy), **kw).run(specs)


def by_arrival(result):
    return sorted(result.requests, key=lambda r: r.arrival)


def test_one_replica_matches_hand_computed_latencies():
    # A: prefill 10 (+ load of a0, rank 8) | B joins: A's decode + B's prefill of 20 | both decode
    a = RequestSpec(0.0, "a0", 10, 3)
    b = RequestSpec(0.020, None, 20, 2)
    ra, rb = by_arrival(run([a, b]))
    t1 = 0.010 + 10 * 0.001 + 0.005 + 0.003                 # 0.028
    t2 = t1 + 0.010 + 20 * 0.001 + 0.002 + 0.005            # 0.065
    t3 = t2 + 0.010 + 2 * 0.002 + 0.005                     # 0.084
    assert ra.ttft == pytest.approx(t1) and ra.latency == pytest.approx(t3)
    assert rb.ttft == pytest.approx(t2 - 0.020) and rb.latency == pytest.approx(t3 - 0.020)
    assert ra.replica == rb.replica == 0


def test_tokens_are_counted_in_the_second_they_are_sampled():
    specs = [RequestSpec(0.5 * i, None, 4, 40) for i in range(8)]        # arrivals over 3.5 s
    res = run(specs)
    assert sum(res.tokens_at.values()) == 8 * 40
    # each request alone: prefill 0.014 s, then 39 decodes of 0.012 s, done 0.482 s after it came, so two
    # requests' tokens fall in each second; the window is seconds 1 and 2 (the second half of 3.5 s)
    assert [res.tokens_at[t] for t in range(5)] == [80, 80, 80, 80, 0]
    assert res.window_tok_s() == 80


def test_chunked_prefill_and_resident_adapter():
    # a 100-token prompt takes two iterations under the 64-token budget; the adapter is loaded once
    a = RequestSpec(0.0, "a0", 100, 2)
    b = RequestSpec(1.0, "a0", 5, 1)
    ra, rb = by_arrival(run([a, b]))
    t1 = 0.010 + 64 * 0.001 + 0.005 + 0.003
    t2 = t1 + 0.010 + 36 * 0.001 + 0.005
    t3 = t2 + 0.010 + 0.002 + 0.005
    assert ra.ttft == pytest.approx(t2) and ra.latency == pytest.approx(t3)
    assert rb.ttft == pytest.approx(0.010 + 5 * 0.001 + 0.005)        # no load: a0 stayed resident


def test_batch_cap_of_sequences_queues_the_rest_in_the_replica():
    specs = [RequestSpec(0.0, None, 4, 2) for _ in range(10)]       # max_num_seqs 8: two wait an iteration
    res = by_arrival(run(specs))
    first = 0.010 + 8 * 4 * 0.001
    assert [r.ttft for r in res[:8]] == pytest.approx([first] * 8)
    assert all(r.ttft > first for r in res[8:])


def test_every_request_gets_all_its_tokens_under_preemption_and_migration():
    limits = ReplicaLimits(num_pages=40, page_tokens=16, max_num_seqs=16, max_num_batched_tokens=256,
                           adapter_pages={8: 1, 64: 2})
    table = linear_table(limits, 0.010, 0.0001, 0.001, 0.001, adapter_load_s={8: 0.002}, migration_s=0.004)
    specs = synthetic(num_adapters=6, rate=30, duration_s=4, input_range=(8, 128), output_range=(40, 160), seed=3)
    for policy in ("round_robin", "least_loaded", "affinity", "consolidate"):
        out = run(specs, replicas=3, policy=policy, table=table)
        assert all(r.finish_reason == "length" and r.generated == r.spec.output_len for r in out.requests), policy
        assert all(r.arrival <= r.arrival + r.ttft <= r.arrival + r.latency for r in out.requests)
        assert out.preemptions > 0
        if policy != "round_robin":
            assert out.migrations > 0, policy
        assert out.migrations == sum(r.migrations for r in out.requests)


def test_fast_forward_gives_the_same_result_as_stepping_each_iteration():
    limits = ReplicaLimits(num_pages=60, page_tokens=16, max_num_seqs=16, max_num_batched_tokens=256,
                           adapter_pages={8: 1, 64: 2})
    table = linear_table(limits, 0.010, 0.0001, 0.001, 0.001, kv_s_per_token=1e-6, grid_context=8,
                         adapter_load_s={8: 0.002}, migration_s=0.004)
    specs = synthetic(num_adapters=8, rate=20, duration_s=4, input_range=(8, 128), output_range=(20, 200), seed=5)
    for policy, hand_back in (("least_loaded", True), ("consolidate", True), ("consolidate", False)):
        fast = run(specs, replicas=2, policy=policy, table=table, hand_back=hand_back)
        slow = run(specs, replicas=2, policy=policy, table=table, fast_forward=False, hand_back=hand_back)
        key = [(r.request_id, r.replica, r.first_token, r.finish, r.migrations, r.preemptions) for r in fast.requests]
        assert key == [(r.request_id, r.replica, r.first_token, r.finish, r.migrations, r.preemptions)
                       for r in slow.requests]
        mf, ms = fast.metrics(), slow.metrics()
        assert mf.pop("policy") == ms.pop("policy")
        assert mf == pytest.approx(ms, rel=1e-12)               # busy time is summed over runs, not steps
        assert fast.preemptions > 0 and fast.migrations > 0     # both paths ran through the hard cases


def test_deterministic_for_a_seed():
    a = run(synthetic(num_adapters=20, rate=15, duration_s=3, seed=7), replicas=2, policy="affinity").metrics()
    b = run(synthetic(num_adapters=20, rate=15, duration_s=3, seed=7), replicas=2, policy="affinity").metrics()
    c = run(synthetic(num_adapters=20, rate=15, duration_s=3, seed=8), replicas=2, policy="affinity").metrics()
    assert a == b and a != c


def test_consolidation_uses_fewer_replicas_than_round_robin_at_low_load():
    specs = synthetic(num_adapters=50, rate=2, duration_s=10, input_range=(8, 64), output_range=(8, 32), seed=1)
    cons = run(specs, replicas=8, policy="consolidate").metrics()
    rr = run(specs, replicas=8, policy="round_robin").metrics()
    assert rr["gpus_used"] == 8
    assert cons["gpus_used"] < rr["gpus_used"]
    assert cons["finished"] == rr["finished"] == len(specs)


def test_more_replicas_raise_throughput_at_saturation():
    specs = [RequestSpec(0.0, f"a{i % 20}", 64, 64) for i in range(400)]
    tput = [run(specs, replicas=n, policy="least_loaded").metrics()["throughput_rps"] for n in (1, 2, 4)]
    assert tput[0] < tput[1] < tput[2]


def test_multi_turn_follow_ups_come_after_the_previous_answer():
    specs = multi_turn(sessions=4, turns=3, rate=2, seed=2)
    out = run(specs, replicas=2, policy="affinity").requests
    assert len(out) == 12
    for sid in range(4):
        turns = sorted((r for r in out if r.spec.session == sid), key=lambda r: r.spec.turn)
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.arrival == pytest.approx(prev.finish + nxt.spec.after_s)


def test_too_long_and_unplaceable_requests_are_reported_not_lost():
    out = run([RequestSpec(0.0, None, 100 * 16, 4), RequestSpec(0.0, None, 8, 2)])
    assert [r.finish_reason for r in by_arrival(out)] == ["too_long", "length"]


def test_table_interpolation_json_round_trip_and_batch_cap(tmp_path):
    t = CostTable(LIMITS, [0, 100], [0, 10], [0, 1], [[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]],
                  grid_context=4, kv_s_per_token=0.5, adapter_load_s={8: 0.1, 64: 0.4})
    assert t.step(50, 5, 0.5) == pytest.approx(4.5)
    assert t.step(1000, 20, 3) == pytest.approx(8.0)                  # clamped at the grid's edges
    assert t.step(0, 10, 0, context=50) == pytest.approx(3.0 + 0.5 * 10)
    assert t.load_s(16) == 0.4 and t.adapter_pages(16) == 4
    t.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == t
    served = t.with_served(ServedCosts(0.001, 0.0002, 0.003, 0.004, source="test"))
    served.save(tmp_path / "s.json")
    assert CostTable.load(tmp_path / "s.json") == served != t
    with pytest.raises(ValueError, match="shape"):
        CostTable(LIMITS, [0], [0, 1], [0], [[[1.0]]])


def test_profiled_batch_cap_is_where_doubling_the_batch_slows_tokens_more_than_it_adds_throughput():
    limits = ReplicaLimits(num_pages=100, page_tokens=16, max_num_seqs=256, max_num_batched_tokens=64)
    # s(d) = 10 ms + 0.1 ms d: doubling d multiplies latency by s(2d)/s(d) and throughput by 2 s(d)/s(2d); they
    # cross where s(2d)/s(d) = sqrt(2), at d = a / (sqrt(2) b) = 70.7
    lin = linear_table(limits, 0.010, 0.0, 0.0001, 0.0, decode=(0, 1, 64, 256))
    cap = profiled_batch_cap(lin)
    assert cap == 71
    s = lambda d: 0.010 + 0.0001 * d  # noqa: E731
    assert s(2 * cap) / s(cap) > math.sqrt(2) > s(2 * (cap - 1)) / s(cap - 1)
    # the served path's cost per sequence makes the step grow faster: a smaller cap
    served = lin.with_served(ServedCosts(seq_s=0.0001))
    assert profiled_batch_cap(served) == math.ceil(0.010 / (math.sqrt(2) * 0.0002)) == 36
    assert profiled_batch_cap(lin, latency_s=0.012) == 20                     # s(20) = 12 ms
    flat = linear_table(limits, 0.010, 0.0, 0.0, 0.0, decode=(0, 1, 256))    # no growth: the engine's cap
    assert profiled_batch_cap(flat) == 256


def test_served_costs_add_per_iteration_per_sequence_and_delays():
    # TABLE's hand-computed run (test_one_replica_matches_hand_computed_latencies) with the served path's costs:
    # +1 ms per iteration, +0.5 ms per sequence in it, 2 ms to reach the replica, 3 ms to the client
    sv = ServedCosts(iteration_s=0.001, seq_s=0.0005, submit_s=0.002, stream_s=0.003)
    a = RequestSpec(0.0, "a0", 10, 3)
    b = RequestSpec(0.020, None, 20, 2)
    ra, rb = by_arrival(run([a, b], table=TABLE.with_served(sv)))
    t1 = 0.002 + 0.010 + 10 * 0.001 + 0.005 + 0.003 + 0.001 + 0.0005           # A alone
    t2 = t1 + 0.010 + 20 * 0.001 + 0.002 + 0.005 + 0.001 + 2 * 0.0005          # B (arrived at 0.022) joins
    t3 = t2 + 0.010 + 2 * 0.002 + 0.005 + 0.001 + 2 * 0.0005
    assert ra.ttft == pytest.approx(t1 + 0.003) and ra.latency == pytest.approx(t3 + 0.003)
    assert rb.ttft == pytest.approx(t2 + 0.003 - 0.020) and rb.latency == pytest.approx(t3 + 0.003 - 0.020)
    assert TABLE.with_served(sv).step(0, 4, 1, seqs=6) == pytest.approx(TABLE.step(0, 4, 1) + 0.001 + 6 * 0.0005)


def test_a_small_prefill_costs_what_the_eager_points_extrapolate_to():
    # decode-only iterations (prefill 0) replay graphs; prefills run eagerly: 100 tokens cost 10 ms, 200 cost 12
    t = CostTable(LIMITS, [0, 100, 200], [0, 10], [0], [[[0.0], [1.0]], [[10.0], [11.0]], [[12.0], [13.0]]])
    assert t.step(50, 0, 0) == pytest.approx(10.0 - 50 * 0.02)                 # not 5.0, halfway to the graph
    assert t.step(0, 10, 0) == 1.0 and t.step(150, 0, 0) == pytest.approx(11.0)
    assert t.step(1, 5, 0) == pytest.approx(10.5 - 99 * 0.02)
    assert TABLE.step(5, 2, 1) == pytest.approx(0.010 + 5 * 0.001 + 2 * 0.002 + 0.005)   # a linear table: a line


def test_cycled_rank_follows_the_benchmarks_registration():
    assert [cycled_rank(f"a{i}") for i in range(5)] == [8, 16, 32, 64, 8]
    assert cycled_rank(None) == 0 and cycled_rank("custom") == 64
    assert math.isclose(TABLE.load_s(8), 0.003)


def test_cost_benchmark_dry_run_writes_a_table_the_simulator_runs(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cluster_costs.py"
    spec = importlib.util.spec_from_file_location("cluster_costs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--dry-run", "--out", str(tmp_path / "costs.json")])
    table = CostTable.load(out)
    assert table.meta["dry_run"] and table.limits.max_num_seqs == 8 and table.limits.page_tokens == 16
    assert all(v > 0 for plane in table.step_s[1:] for row in plane for v in row)   # every prefill costs time
    res = run([RequestSpec(0.0, "a0", 12, 3), RequestSpec(0.0, "a1", 20, 2)], replicas=2, table=table)
    assert all(r.generated == r.spec.output_len for r in res.requests)


def _bench_module(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_validation_replays_real_records_and_reports_the_error(tmp_path):
    import json

    mod = _bench_module("sim_cluster")
    table = mod.test_table()
    specs = synthetic(num_adapters=10, rate=6, duration_s=3, seed=4)
    runs = []
    for n in (1, 2):
        recs = mod.sim_records(ClusterSim(table, n, make_policy("least_loaded")).run(specs))
        for r in recs:                                   # the real run was 10% slower to finish each request
            r["latency_s"] *= 1.1
        runs.append(dict(popularity="zipf", replicas=n, policy="least_loaded", rate=6.0, records=recs))
    lost = [dict(r, finish_reason="abort", tokens=0) for r in runs[0]["records"]]
    runs.append(dict(popularity="zipf", replicas=1, policy="least_loaded", rate=60.0, records=lost))
    real = tmp_path / "results.json"
    real.write_text(json.dumps(dict(config=dict(ranks=[8, 16, 32, 64]), runs=runs)))
    res = mod.main(["validate", "--test-table", "--real", str(real), "--out", str(tmp_path / "v")])
    assert [r["replicas"] for r in res["rows"]] == [1, 2] and len(res["skipped"]) == 1
    for r in res["rows"]:
        assert r["latency_err"] == pytest.approx(1 / 1.1 - 1)
        assert r["sim_throughput_rps"] > r["real_throughput_rps"]
    assert res["test_table"] and (tmp_path / "v" / "results.json").exists()


def test_scale_study_runs_every_policy_on_the_same_trace_and_plots(tmp_path):
    mod = _bench_module("sim_cluster")
    res = mod.main(["scale", "--test-table", "--gpus", "2,4", "--adapters", "50", "--requests-per-gpu", "4",
                    "--workloads", "skewed,dynamic", "--out", str(tmp_path)])
    rows = res["rows"]
    assert len(rows) == 2 * 2 * 4
    for kind in ("skewed", "dynamic"):
        for gpus in (2, 4):
            same = [r for r in rows if r["workload"] == kind and r["gpus"] == gpus]
            assert {r["policy"] for r in same} == {"consolidate", "affinity", "least_loaded", "round_robin"}
            assert len({r["requests"] for r in same}) == 1 and all(r["unserved"] == 0 for r in same)
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_calibration_fits_served_costs_that_predict_the_other_runs(tmp_path):
    import json

    mod = _bench_module("sim_cluster")
    truth = mod.test_table().with_served(ServedCosts(iteration_s=0.003, seq_s=0.0002, stream_s=0.02))
    runs = []
    for i, (n, rate) in enumerate(((1, 4.0), (1, 8.0), (2, 12.0))):
        specs = synthetic(num_adapters=10, rate=rate, duration_s=3, seed=10 + i)
        recs = mod.sim_records(ClusterSim(truth, n, make_policy("least_loaded")).run(specs))
        for r in recs:
            r["replicas"] = [r.pop("replica")]
            # the stamps bench_cluster.py records: the first token left the replica 20 ms before the client had it
            r["first_token_front_s"] = r["arrival_s"] + r["ttft_s"]
            r["first_token_replica_s"] = r["first_token_front_s"] - 0.02
        runs.append(dict(popularity="zipf", replicas=n, policy="least_loaded", rate=rate, records=recs))
    real = tmp_path / "results.json"
    real.write_text(json.dumps(dict(meta=dict(date="d1"), config=dict(ranks=[8, 16, 32, 64]), runs=runs)))
    table = tmp_path / "served.json"
    res = mod.main(["calibrate", "--test-table", "--real", str(real), "--runs", "1", "--out-table", str(table),
                    "--out", str(tmp_path / "c")])
    assert res["objective"] < 1e-3 and CostTable.load(table).meta["served_fit"]["runs"] == [1]
    assert res["measured_stream_s"] == pytest.approx(0.02) == CostTable.load(table).served.stream_s
    v = mod.main(["validate", "--costs", str(table), "--real", str(real), "--out", str(tmp_path / "v")])
    rows = {r["index"]: r for r in v["rows"]}
    assert rows[1]["calibration"] and not rows[0]["calibration"]
    assert rows[0]["cold"] and not rows[1]["cold"] and rows[2]["cold"]        # run 2 first used replica 1
    for i in (0, 2):                                     # held out: predicted as the true costs do
        assert abs(rows[i]["latency_err"]) < 0.05 and abs(rows[i]["ttft_err"]) < 0.1, rows[i]
    assert v["by_replicas"]["1"]["runs"] == 1 and v["by_replicas"]["2"]["runs"] == 1


def test_cluster_config_profiles_the_batch_cap_from_a_cost_table(tmp_path):
    from vlora.cluster.config import ClusterConfig
    from vlora.config import ConfigError

    limits = ReplicaLimits(num_pages=100, page_tokens=16, max_num_seqs=256, max_num_batched_tokens=64)
    table = linear_table(limits, 0.010, 0.0, 0.0001, 0.0, decode=(0, 1, 64, 256))
    table.save(tmp_path / "t.json")
    assert ClusterConfig(cost_table=str(tmp_path / "t.json")).profiled_batch_cap() == 71
    assert ClusterConfig(cost_table=str(tmp_path / "t.json"), batch_cap=8).profiled_batch_cap() == 8
    assert ClusterConfig().profiled_batch_cap() is None                    # the engine's max_num_seqs
    with pytest.raises(ConfigError, match="cost_table"):
        ClusterConfig(cost_table=str(tmp_path / "missing.json"))


def test_step_logs_give_the_served_loop_between_steps():
    mod = _bench_module("sim_cluster")
    log, t = [], 0.0
    for i in range(40):                      # steps of 10 ms, then 1 ms + 0.1 ms per output to the next one
        n = 1 + i % 7
        log.append([t, 0.010, n, n])
        t += 0.010 + 0.001 + 0.0001 * n
    log.append([t + 1.0, 0.010, 1, 1])       # after an idle second: not a gap of the loop
    g = mod.step_gaps({"steps": {"0": log}})
    assert g["steps"] == 39 and g["mean_step_s"] == pytest.approx(0.010)
    assert g["gap_per_step_s"] == pytest.approx(0.001) and g["gap_per_output_s"] == pytest.approx(0.0001)


def test_scaled_table_multiplies_decode_only_and_prefill_iterations_apart():
    table = TABLE.with_served(ServedCosts(iteration_s=0.001, stream_s=0.02)).scaled(1.5, 3.0, note="test")
    assert table.step(0, 4, 1) == pytest.approx(1.5 * TABLE.step(0, 4, 1) + 0.001)
    assert table.step(20, 4, 2) == pytest.approx(3.0 * TABLE.step(20, 4, 2) + 0.001)
    assert table.served.stream_s == 0.02 and table.meta["step_scale"] == dict(decode=1.5, prefill=3.0, note="test")
    assert TABLE.scaled(2.0).step(20, 4, 2) == pytest.approx(2 * TABLE.step(20, 4, 2))


def test_steps_compares_step_logs_with_the_table_and_writes_the_scaled_table(tmp_path):
    import json

    mod = _bench_module("sim_cluster")
    # constructed (not a measurement): 10 ms + 0.1 ms per prefill token + 1 ms per decode; no adapter term
    table = linear_table(LIMITS, 0.010, 0.0001, 0.001, 0.0)
    table.save(tmp_path / "t.json")
    log, recs = [], []
    for k, (prefills, decodes) in enumerate([(1, 0), (0, 1), (2, 1), (0, 3), (1, 3), (0, 4)]):
        began = 0.1 * k                      # steps 100 ms apart: no gap of the served loop
        seconds = (0.010 + 0.0001 * 20 * prefills + 0.001 * decodes) * (2.0 if prefills else 1.0)
        log.append([began, seconds, prefills + decodes, prefills + decodes])
        for _ in range(prefills):            # each prefill's first token leaves the replica after its step
            left = began + seconds + 0.001
            recs.append(dict(arrival_s=began - 0.01, adapter="a0", input_len=20, output_len=50, latency_s=10.0,
                             replicas=[0], first_token_replica_s=left, first_token_front_s=left + 0.02))
    real = tmp_path / "results.json"
    real.write_text(json.dumps(dict(meta=dict(date="d", device="test"), runs=[dict(records=recs, steps={"0": log})])))
    out = tmp_path / "scaled.json"
    res = mod.main(["steps", "--costs", str(tmp_path / "t.json"), "--real", str(real), "--out", str(tmp_path / "s"),
                    "--out-table", str(out)])
    assert res["steps"] == 6
    assert res["decode_ratio"] == pytest.approx(1.0) and res["prefill_ratio"] == pytest.approx(2.0)
    scaled = CostTable.load(out)
    assert scaled.step(40, 1, 1) == pytest.approx(2 * table.step(40, 1, 1))
    assert scaled.step(0, 3, 1) == pytest.approx(table.step(0, 3, 1))
    assert scaled.served.stream_s == pytest.approx(0.02) and scaled.meta["step_scale"]["prefill"] == pytest.approx(2.0)


def test_serving_code_loads_neither_the_simulator_nor_benchmark_code():
    import subprocess
    import sys

    code = ("import sys, vlora.cli, vlora.server.app, vlora.cluster.front, vlora.cluster.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('vlora.bench', 'vlora.cluster.sim'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
