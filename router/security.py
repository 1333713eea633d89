"""Connections and credentials shared by the router, the engine and the client SDK: TLS for gRPC
(mutual TLS when a client CA is given), bearer tokens, and Redis connections (passwords,
``rediss://``, timeouts and reconnect backoff).
"""
from __future__ import annotations

import os
import urllib.parse

import grpc
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for a gRPC listener; with ``client_ca`` every client must present a certificate it signed (mTLS)."""
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca),
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS for a gRPC client (``ca`` None: the system roots); ``cert`` + ``key`` for mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs both cert and key")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def load_tokens(path: str | None = None, env: str | None = None) -> tuple[str, ...]:
    """Bearer tokens, one per line in ``path`` and/or comma-separated in the environment variable ``env``."""
    tokens: list[str] = []
    if path:
        with open(path, encoding="utf-8") as f:
            tokens += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if env and os.environ.get(env):
        tokens += [t.strip() for t in os.environ[env].split(",") if t.strip()]
    return tuple(tokens)


def redact_url(url: str) -> str:
    """A Redis URL with its password replaced, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def connect_redis(url: str, *, password: str | None = None, ssl_ca_certs: str | None = None,
                  socket_timeout_s: float = 2.0) -> aioredis.Redis:
    """An asyncio Redis client that fails fast and reconnects with exponential backoff.

    Every command retries twice on connection errors (10 ms, 20 ms, capped at 250 ms) and no
    connect or read waits more than ``socket_timeout_s``, so an outage surfaces as an error within
    a few seconds instead of a hang; the next command reconnects. ``rediss://`` URLs use TLS
    (``ssl_ca_certs`` to trust a private CA); ``password`` overrides one in the URL.
    """
    kwargs = dict(socket_connect_timeout=min(1.0, socket_timeout_s), socket_timeout=socket_timeout_s,
                  retry=Retry(ExponentialBackoff(cap=0.25, base=0.01), 2),
                  retry_on_error=[RedisConnectionError, RedisTimeoutError], decode_responses=False)
    if password:
        kwargs["password"] = password
    if ssl_ca_certs and url.startswith("rediss://"):
        kwargs["ssl_ca_certs"] = ssl_ca_certs
    return aioredis.Redis.from_url(url, **kwargs)
