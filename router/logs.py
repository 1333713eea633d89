"""structlog JSON logs on stderr, for the router and the engine service alike (same fields, so a
request id can be followed from router to engine). It lives here rather than in ``engine_service``:
that package loads torch, which a router never needs."""
from __future__ import annotations

import logging

import structlog


def configure_logging(level: str = "INFO") -> None:
    """JSON logs on stderr through structlog, the standard library's records (the engine core's) included."""
    shared = [structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name,
              structlog.processors.TimeStamper(fmt="iso", utc=True)]
    # filter_by_level first: an event below the level (the router's per-request debug events) is
    # dropped before the other processors time-stamp and copy it.
    structlog.configure(processors=[structlog.stdlib.filter_by_level, *shared,
                                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
                        logger_factory=structlog.stdlib.LoggerFactory(),
                        wrapper_class=structlog.stdlib.BoundLogger, cache_logger_on_first_use=True)
    handler = logging.StreamHandler()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
