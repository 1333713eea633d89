"""Router configuration: one validated object (STYLE habit 1)."""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from router.validation import Limits


def default_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class RouterConfig:
    """Options of one router process. Times in seconds, sizes in bytes."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = field(default=None, repr=False)
    redis_ca: str | None = None                # CA certificate for rediss://
    namespace: str = "pagoda"                  # key prefix shared with the engines and the other routers
    host: str = "0.0.0.0"
    port: int = 50050
    metrics_port: int | None = None
    router_id: str = field(default_factory=default_router_id)
    tokenizer: str | None = None               # a directory with tokenizer.json; default: the engines' own

    # Queue (see router/queue.py)
    max_queue_size: int = 1024
    max_queued_tokens: int = 1 << 22
    max_queue_wait_boost_s: float = 30.0
    priority_step_s: float = 1.0
    max_skips: int = 8
    affinity_slack: float = 0.25
    engine_max_waiting: int = 0
    """Requests admitted to an engine beyond its max_num_seqs (they wait in the engine, outside the fleet's order)."""

    limits: Limits = field(default_factory=Limits)
    max_batch_size: int = 1024
    max_request_bytes: int = 4 << 20           # gRPC receive limit: a larger request is refused, not buffered
    max_attempts: int = 4                      # admissions of one request before it fails UNAVAILABLE

    # Leases, registry, faults
    lease_ttl_s: float = 5.0
    maintenance_interval_s: float = 1.0        # lease renewal, reaping, retried releases
    registry_refresh_s: float = 0.1
    engine_fault_backoff_s: float = 2.0        # a faulty engine gets no admissions from this router for so long
    redis_outage_grace_s: float = 3.0          # queued requests fail UNAVAILABLE once Redis is away this long
    slo_window_s: float = 30.0                 # admission-rate window for the deadline check
    slo_min_samples: int = 8
    shutdown_grace_s: float = 30.0

    # TLS and auth
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None           # require client certificates (mTLS) on the public API
    engine_tls_ca: str | None = None           # dial engines over TLS, trusting this CA ...
    engine_tls_cert: str | None = None         # ... presenting this certificate (mTLS)
    engine_tls_key: str | None = None
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self):
        for name in ("max_queue_size", "max_queued_tokens", "max_batch_size", "max_request_bytes", "max_attempts",
                     "slo_min_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.engine_max_waiting < 0:
            raise ValueError(f"engine_max_waiting must be >= 0, got {self.engine_max_waiting}")
        for name in ("lease_ttl_s", "maintenance_interval_s", "registry_refresh_s", "engine_fault_backoff_s",
                     "redis_outage_grace_s", "slo_window_s", "max_queue_wait_boost_s", "priority_step_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.maintenance_interval_s * 2 > self.lease_ttl_s:
            raise ValueError(f"maintenance_interval_s ({self.maintenance_interval_s}) must be at most half of "
                             f"lease_ttl_s ({self.lease_ttl_s}), or a live router's lease could lapse")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        if (self.engine_tls_cert is None) != (self.engine_tls_key is None):
            raise ValueError("engine_tls_cert and engine_tls_key go together")
        if (self.engine_tls_cert or self.engine_tls_key) and not self.engine_tls_ca:
            raise ValueError("engine_tls_cert needs engine_tls_ca")
        if any(not t for t in self.auth_tokens):
            raise ValueError("auth_tokens must not contain empty tokens")
        if not self.router_id or " " in self.router_id:
            raise ValueError(f"router_id must be non-empty without spaces, got {self.router_id!r}")
