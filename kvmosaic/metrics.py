"""Prometheus collectors for the server: engine gauges, token counters and latency histograms.

Every server owns its own ``CollectorRegistry`` so several servers can live in one process (tests).
The engine loop pushes a stats snapshot after each iteration; scrapes read that snapshot and never
touch the engine itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvmosaic.outputs import RequestOutput

PREFIX = "kvmosaic"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

# engine.stats() key -> (metric name, help, kind)
_ENGINE_SERIES: dict[str, tuple[str, str, str]] = {
    "num_running": ("num_requests_running", "Sequences in the running batch", "gauge"),
    "num_waiting": ("num_requests_waiting", "Sequences waiting in the scheduler", "gauge"),
    "num_swapped": ("num_requests_swapped", "Sequences whose KV blocks are on the host tier", "gauge"),
    "num_queued": ("num_requests_queued", "Accepted requests that have not produced a first token", "gauge"),
    "kv_blocks_used": ("kv_blocks_used", "KV blocks referenced by live sequences (cached free blocks excluded)",
                       "gauge"),
    "kv_blocks_total": ("kv_blocks_total", "KV blocks in the device pool", "gauge"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Share of queried prompt tokens found in the prefix cache",
                              "gauge"),
    "num_preemptions": ("num_preemptions", "Sequences preempted since start", "counter"),
    "prefix_cache_queries": ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                             "counter"),
    "prefix_cache_hits": ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", "counter"),
}


# Speculative decoding (``--speculative-config``): shown only when the engine reports them.
_SPEC_SERIES: dict[str, tuple[str, str, str]] = {
    "spec_num_drafts": ("spec_decode_num_drafts", "Verifications of a sequence's proposed tokens", "counter"),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Proposed tokens verified by the target", "counter"),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Proposed tokens the target accepted",
                                 "counter"),
    "spec_mean_accepted_length": ("spec_decode_mean_accepted_length",
                                  "Tokens emitted per verification (accepted proposals plus the target's own)",
                                  "gauge"),
}

# Distributed KV cache (``kvmosaic serve --instances N``): shown only when the engine reports them.
_DIST_SERIES: dict[str, tuple[str, str, str]] = {
    "dist_instances_alive": ("dist_instances_alive", "Engine instances the gManager considers alive", "gauge"),
    "dist_outstanding_debt_blocks": ("dist_outstanding_debt_blocks", "KV blocks currently lent between instances",
                                     "gauge"),
    "dist_borrowed_blocks": ("dist_borrowed_blocks", "KV blocks held on other instances by live requests", "gauge"),
    "dist_remote_fraction": ("dist_remote_fraction", "Share of live requests' KV blocks that are borrowed", "gauge"),
    "dist_loans_total": ("dist_loans", "Loans of KV blocks recorded by the gManager", "counter"),
    "dist_repayments_total": ("dist_repayments", "Loans repaid to their creditors", "counter"),
    "dist_swaps_total": ("dist_swaps", "Debt cycles resolved by DGFM block swaps", "counter"),
    "dist_swapped_blocks_total": ("dist_swapped_blocks", "KV blocks moved home by DGFM swaps", "counter"),
    "dist_written_off_blocks_total": ("dist_written_off_blocks", "Debts dropped because an instance died",
                                      "counter"),
    "dist_reruns": ("dist_reruns", "Requests run again from the start after their instance was lost", "counter"),
    "dist_borrow_failures": ("dist_borrow_failures", "Borrow attempts no creditor could serve", "counter"),
    "dist_remote_calls": ("dist_remote_attention_calls", "Remote micro-attention calls (per layer, per creditor)",
                          "counter"),
    "dist_remote_seconds": ("dist_remote_attention_seconds", "Time spent in distributed attention", "counter"),
}

# Disaggregated prefill and decode (``kvmosaic serve --prefill-workers P --decode-workers D``).
_DISAGG_SERIES: dict[str, tuple[str, str, str]] = {
    "disagg_prefill_workers_alive": ("disagg_prefill_workers_alive", "Prefill workers not lost", "gauge"),
    "disagg_decode_workers_alive": ("disagg_decode_workers_alive", "Decode workers not lost", "gauge"),
    "disagg_pending_prefills": ("disagg_pending_prefills", "Requests waiting for a prefill worker", "gauge"),
    "disagg_prefills": ("disagg_prefills", "Prompts prefilled by the prefill workers", "counter"),
    "disagg_prefill_seconds": ("disagg_prefill_seconds", "Time the prefill workers spent on prefills", "counter"),
    "disagg_reruns": ("disagg_reruns", "Requests prefilled again from the start after their decode worker was lost",
                      "counter"),
    "disagg_prefill_retries": ("disagg_prefill_retries", "Prefills sent again after their worker was lost",
                               "counter"),
    "disagg_recomputed_prefills": ("disagg_recomputed_prefills", "Prompts a decode worker recomputed", "counter"),
    "disagg_kv_bytes_sent": ("disagg_kv_bytes_sent", "Prompt K/V bytes the prefill workers exported", "counter"),
    "disagg_export_seconds": ("disagg_export_seconds", "Time spent reading out and publishing prompt K/V",
                              "counter"),
    "disagg_kv_bytes_received": ("disagg_kv_bytes_received", "Prompt K/V bytes the decode workers fetched",
                                 "counter"),
    "disagg_transfer_seconds": ("disagg_transfer_seconds", "Time the decode workers spent fetching prompt K/V",
                                "counter"),
    "disagg_failed_transfers": ("disagg_failed_transfers", "Prompt K/V fetches that failed or timed out",
                                "counter"),
}
# supervised workers (instances, prefill and decode workers), labelled by role
_ROLE_SERIES = {"workers_live": ("workers_live", "Live workers of each role", "gauge"),
                "worker_restarts": ("worker_restarts", "Workers replaced after they died or hung", "counter")}
# per worker, labelled by role and index
_WORKER_SERIES = {"kv_blocks_used": ("disagg_worker_kv_blocks_used", "KV blocks used in one worker's pool"),
                  "num_running": ("disagg_worker_requests_running", "Sequences running in one worker")}


class EngineStatsCollector(Collector):
    """Turns the latest engine stats snapshot into gauges and counters at scrape time."""

    def __init__(self) -> None:
        self.snapshot: Mapping[str, Any] = {}  # numbers, and per-worker dicts under 'workers'

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        for key, (name, doc, kind) in _ENGINE_SERIES.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(f"{PREFIX}_{name}", doc, value=float(snapshot.get(key, 0)))
        for key, (name, doc, kind) in (_SPEC_SERIES | _DIST_SERIES | _DISAGG_SERIES).items():
            if key in snapshot:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                yield family(f"{PREFIX}_{name}", doc, value=float(snapshot[key]))
        for key, (name, doc, kind) in _ROLE_SERIES.items():
            if key in snapshot:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                by_role = family(f"{PREFIX}_{name}", doc, labels=["role"])
                for role, value in sorted(snapshot[key].items()):
                    by_role.add_metric([role], float(value))
                yield by_role
        workers = snapshot.get("workers")
        if workers:
            for key, (name, doc) in _WORKER_SERIES.items():
                family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["role", "worker"])
                for (role, index), values in sorted(workers.items()):
                    family.add_metric([role, str(index)], float(values.get(key, 0)))
                yield family


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector()
        self.registry.register(self.engine_stats)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc.
        reg = self.registry
        self.requests_finished = Counter(f"{PREFIX}_request_success", "Finished requests by finish reason",
                                         ["finish_reason"], registry=reg)
        self.requests_aborted = Counter(f"{PREFIX}_request_aborted", "Requests aborted (disconnect or shutdown)",
                                        registry=reg)
        self.requests_rejected = Counter(f"{PREFIX}_request_rejected", "Requests refused before reaching the engine",
                                         ["reason"], registry=reg)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=reg)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated by finished requests",
                                         registry=reg)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Mean gap between output tokens per request",
                              buckets=_TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last output token",
                             buckets=_LATENCY_BUCKETS, registry=reg)

    def set_engine_stats(self, stats: Mapping[str, Any]) -> None:
        self.engine_stats.snapshot = dict(stats)

    def observe_finished(self, output: RequestOutput) -> None:
        """Record one finished request; called once per request from the engine loop."""
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(generated)
        for completion in output.outputs:
            self.requests_finished.labels(completion.finish_reason or "unknown").inc()
        m = output.metrics
        if m is None or m.first_token_time is None or m.finished_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.e2e.observe(m.finished_time - m.arrival_time)
        per_sequence = generated / max(len(output.outputs), 1)
        if per_sequence > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (per_sequence - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
