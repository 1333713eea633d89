"""Prometheus metrics of the router, updated where each event happens. Names follow the engine's
(``pagoda:`` prefix, vLLM's style); ``priority`` labels are bounded by ``Limits.max_priority``."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# The engine's buckets (engine_service/metrics.py, vLLM's), repeated here: importing the engine
# package would load torch into every router.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

QUEUE_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                      20.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """One router's metrics in a registry of its own (tests run several routers in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.queue_depth = Gauge("pagoda:router_queue_depth", "Requests waiting in the fleet-wide queue.", registry=r)
        self.queued_tokens = Gauge("pagoda:router_queued_tokens", "Prompt tokens waiting in the fleet-wide queue.",
                                   registry=r)
        self.requests_waiting = Gauge("pagoda:router_num_requests_waiting", "This router's requests waiting in "
                                      "the queue, by priority.", ["priority"], registry=r)
        self.requests_running = Gauge("pagoda:router_num_requests_running", "This router's requests streaming "
                                      "from an engine.", registry=r)
        self.queue_wait = Histogram("pagoda:router_queue_wait_seconds", "Arrival at the router to admission, by "
                                    "priority.", ["priority"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.admitted = Counter("pagoda:router_requests_admitted", "Requests admitted to an engine (re-admissions "
                                "after an engine fault included).", registry=r)
        self.rejected = Counter("pagoda:router_requests_rejected", "Requests refused, by gRPC status code.",
                                ["code"], registry=r)
        self.expired = Counter("pagoda:router_requests_expired", "Requests whose deadline passed while queued.",
                               registry=r)
        self.finished = Counter("pagoda:router_requests_finished", "Streams completed, by finish reason.",
                                ["finish_reason"], registry=r)
        self.readmitted = Counter("pagoda:router_requests_readmitted", "Requests put back in the queue because "
                                  "their engine failed or refused before any output.", ["reason"], registry=r)
        self.engine_faults = Counter("pagoda:router_engine_faults", "Transport or server faults seen on an engine "
                                     "(client errors such as INVALID_ARGUMENT are not counted).", ["engine"],
                                     registry=r)
        self.ttft = Histogram("pagoda:router_time_to_first_token_seconds", "Arrival at the router to the first "
                              "token relayed.", buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("pagoda:router_e2e_request_latency_seconds", "Arrival at the router to the last "
                             "message.", buckets=REQUEST_BUCKETS, registry=r)
        self.engines_live = Gauge("pagoda:router_engines_live", "Engines with a live heartbeat.", registry=r)
        self.redis_up = Gauge("pagoda:router_redis_up", "1 while Redis answers.", registry=r)
        labels = ["engine"]
        self.engine_free_blocks = Gauge("pagoda:router_engine_free_blocks", "Free KV blocks an engine reported.",
                                        labels, registry=r)
        self.engine_running = Gauge("pagoda:router_engine_num_requests_running", "Running requests an engine "
                                    "reported.", labels, registry=r)
        self.engine_waiting = Gauge("pagoda:router_engine_num_requests_waiting", "Waiting requests an engine "
                                    "reported.", labels, registry=r)
        self.engine_admitted = Gauge("pagoda:router_engine_num_requests_admitted", "Requests the fleet has "
                                     "admitted to an engine and not yet released.", labels, registry=r)
        self.engine_tokens_per_s = Gauge("pagoda:router_engine_output_tokens_per_s", "Output tokens/s an engine "
                                         "reported.", labels, registry=r)
        self._engine_gauges = (self.engine_free_blocks, self.engine_running, self.engine_waiting,
                               self.engine_admitted, self.engine_tokens_per_s)

    def forget_engine(self, engine_id: str) -> None:
        for gauge in self._engine_gauges:
            try:
                gauge.remove(engine_id)
            except KeyError:
                pass

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Start the /metrics endpoint; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
