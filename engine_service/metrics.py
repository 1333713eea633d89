"""Prometheus metrics of the engine service: vLLM's names with a ``pagoda:`` prefix.

Each ``EngineMetrics`` has its own registry (several engines may share a process, in tests), and
is updated where the event happens: the engine loop thread after each step and when a request
ends, the gRPC side when it rejects one.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# vLLM's buckets (vllm/engine/metrics.py), so dashboards carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """The engine's Prometheus metrics, labelled with ``model_name`` like vLLM's."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(f"pagoda:{name}", doc, labels, registry=r, buckets=buckets).labels(model_name)

        def counter(name, doc):
            return Counter(f"pagoda:{name}", doc, labels, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(f"pagoda:{name}", doc, labels, registry=r).labels(model_name)

        self.time_to_first_token = hist("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.inter_token_latency = hist("inter_token_latency_seconds", "Time between a request's consecutive "
                                        "outputs.", ITL_BUCKETS)
        self.e2e_request_latency = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.request_queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                                       REQUEST_BUCKETS)
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting (incl. preempted).")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self._success = Counter("pagoda:request_success", "Finished requests by finish_reason.",
                                labels + ["finish_reason"], registry=r)
        self._rejected = Counter("pagoda:request_rejected", "Requests refused or cut off, by gRPC status code.",
                                 labels + ["code"], registry=r)
        self._model_name = model_name
        # Scheduler counters already exported: preemptions, prefix queries, hits, drafts, accepted.
        self._seen = (0, 0, 0, 0, 0)

    def observe_step(self, scheduler, num_running: int, num_waiting: int, num_generated: int) -> None:
        """After each step: gauges from the scheduler, counters by difference."""
        bm = scheduler.block_manager
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage.set(bm.usage())
        now = (scheduler.num_preemptions, bm.prefix_queries, bm.prefix_hits, scheduler.num_draft_tokens,
               scheduler.num_accepted_tokens)
        counters = (self.num_preemptions, self.prefix_cache_queries, self.prefix_cache_hits, self.spec_draft_tokens,
                    self.spec_accepted_tokens)
        for counter, new, old in zip(counters, now, self._seen):
            if new > old:
                counter.inc(new - old)
        self._seen = now
        if num_generated:
            self.generation_tokens.inc(num_generated)

    def observe_finished(self, finish_reason: str, metrics) -> None:
        """When a request ends (``metrics`` is its ``RequestMetrics``)."""
        self._success.labels(self._model_name, finish_reason or "abort").inc()
        if metrics is None:
            return
        if metrics.finished_time is not None:
            self.e2e_request_latency.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.request_queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)

    def observe_rejected(self, code: str) -> None:
        self._rejected.labels(self._model_name, code).inc()

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Start the /metrics HTTP endpoint; returns (server, thread). ``server.server_port`` is the port."""
        return start_http_server(port, addr=addr, registry=self.registry)
