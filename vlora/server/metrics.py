"""Prometheus metrics of one server, in a registry of its own (never the global one).

Series labelled by adapter (requests, tokens, latencies) exist while the adapter is registered: its unload (an
eviction of an adapter loaded on request, /v1/unload_lora_adapter) removes them (:meth:`ServerMetrics.forget`),
so with adapters loaded and unloaded by the thousand the output holds the registered ones only, as a model server
reports its loaded models. A name loaded again starts from zero (a counter reset, which ``rate`` reads as
such). The unload policy "wait" lets the adapter's requests finish and be counted first; with "abort", the
aborted requests' final outputs arrive just after the unload and count under the name again (until its next
unload). The loads and evictions of adapters loaded on request are counted and timed for all adapters together,
not per adapter (one series each, however many adapters come and go); the log names each.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from vlora.engine.client import EngineClient, Timing, sum_counts
from vlora.engine.sequence import RequestOutput

MODES = ("merged", "unmerged", "mixed")
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LOAD = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class ServerMetrics:
    def __init__(self, engine: EngineClient, base_name: str):
        self.registry = r = CollectorRegistry()
        self.base_name = base_name
        stats = lambda: engine.stats     # noqa: E731 (a snapshot the engine thread publishes)
        Gauge("vlora_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: stats().num_running)
        Gauge("vlora_requests_waiting", "Requests waiting to be scheduled", registry=r).set_function(
            lambda: stats().num_waiting)
        Gauge("vlora_kv_blocks_used", "KV-cache blocks in use", registry=r).set_function(
            lambda: stats().num_blocks_used)
        Gauge("vlora_kv_blocks_total", "KV-cache blocks in the pool", registry=r).set_function(
            lambda: stats().num_blocks)
        Gauge("vlora_kv_cache_usage_ratio", "Share of KV-cache blocks in use", registry=r).set_function(
            lambda: stats().num_blocks_used / max(1, stats().num_blocks))
        mode = Gauge("vlora_inference_mode", "Current inference mode (1 = active)", ["mode"], registry=r)
        for m in MODES:
            mode.labels(m).set_function(lambda m=m: 1 if stats().mode == m else 0)
        Gauge("vlora_mode_switches_total", "Inference-mode switches (merges and unmerges) so far",
              registry=r).set_function(lambda: stats().mode_switches)
        r.register(_Iterations(stats))
        self.requests = Counter("vlora_requests", "Finished engine requests", ["adapter", "finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("vlora_prompt_tokens", "Prompt tokens of finished requests", ["adapter"],
                                     registry=r)
        self.generation_tokens = Counter("vlora_generation_tokens", "Generated tokens of finished requests",
                                         ["adapter"], registry=r)
        self.ttft = Histogram("vlora_time_to_first_token_seconds", "Time from submission to the first token",
                              ["adapter"], buckets=_TTFT, registry=r)
        self.tpot = Histogram("vlora_time_per_output_token_seconds", "Time per output token after the first",
                              ["adapter"], buckets=_TPOT, registry=r)
        self.e2e = Histogram("vlora_e2e_request_latency_seconds", "Time from submission to the last token",
                             ["adapter"], buckets=_E2E, registry=r)
        self.per_adapter = (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e)
        # adapters loaded on first request (vlora/server/on_demand.py), all together
        self.adapter_loads = Counter("vlora_adapter_loads", "Adapters loaded on first request", registry=r)
        self.adapter_load_seconds = Histogram("vlora_adapter_load_seconds", "Time to load an adapter on first "
                                              "request: finding, reading, validating, packing and registering it",
                                              buckets=_LOAD, registry=r)
        self.adapter_evictions = Counter("vlora_adapter_evictions", "Adapters loaded on request and unloaded to "
                                         "make room for another (--max-loaded-adapters)", registry=r)
        self.http_errors = Counter("vlora_http_errors", "Requests refused or failed, by HTTP status", ["status"],
                                   registry=r)

    def forget(self, adapter: str) -> None:
        """Remove the series of ``adapter``, unloaded (called on the event loop)."""
        for metric in self.per_adapter:
            metric.remove_by_labels({"adapter": adapter})

    def observe(self, out: RequestOutput, t: Timing) -> None:
        """Record one finished engine request (called on the event loop)."""
        adapter = out.adapter or self.base_name
        self.requests.labels(adapter, out.finish_reason).inc()
        self.prompt_tokens.labels(adapter).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(adapter).inc(len(out.token_ids))
        if out.finish_reason == "abort" or t.first_token is None or t.finished is None:
            return
        self.ttft.labels(adapter).observe(t.first_token - t.arrival)
        self.e2e.labels(adapter).observe(t.finished - t.arrival)
        if len(out.token_ids) > 1:
            self.tpot.labels(adapter).observe((t.finished - t.first_token) / (len(out.token_ids) - 1))


class _Iterations:
    """``vlora_iterations_total{path}``: the engine's forwards so far by how they ran (a decode graph, a mixed
    graph of prompt chunks beside decodes, or eager), read from its published stats at each scrape."""

    def __init__(self, stats):
        self.stats = stats

    def describe(self):
        return []                  # collected at scrape time only: the names are not checked up front

    def collect(self):
        family = CounterMetricFamily("vlora_iterations", "Engine forwards by how they ran: decode_graph (a decode "
                                     "CUDA graph), mixed_graph (prompt chunks beside decodes from a CUDA graph), "
                                     "eager (kernel by kernel)", labels=["path"])
        for path, n in sum_counts([self.stats().iterations]).items():
            family.add_metric([path], n)
        yield family

