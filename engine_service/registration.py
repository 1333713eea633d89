"""Registers a running ``EngineServer`` with the router fleet: its load heartbeats into Redis
(``router.registry.EngineHeartbeat``) and its tokenizer is published once for routers to use."""
from __future__ import annotations

import socket

import structlog

from engine_service.server import EngineServer
from router.lifecycle import bounded
from router.registry import EngineHeartbeat, EngineRecord, read_tokenizer_files
from router.security import connect_redis

logger = structlog.get_logger("pagoda.engine_service")


def engine_record(server: EngineServer, engine_id: str, address: str) -> EngineRecord | None:
    """The server's current load as a registry record; None until the model is loaded."""
    engine = server.engine
    if not engine.ready:
        return None
    core, load, config = engine.engine, engine.load(), engine.config
    return EngineRecord(
        engine_id=engine_id, address=address, model=server.model_name, max_model_len=core.config.max_model_len,
        vocab_size=core.vocab_size, max_logprobs=core.config.max_logprobs, block_size=config.block_size,
        num_free_blocks=load.num_free_blocks, num_total_blocks=load.num_total_blocks,
        num_running_requests=load.num_running_requests, num_waiting_requests=load.num_waiting_requests,
        num_waiting_prompt_tokens=load.num_waiting_prompt_tokens, max_num_seqs=config.max_num_seqs,
        max_waiting_requests=engine.max_waiting_requests, output_tokens_per_s=load.output_tokens_per_s(),
        accepting=server.refusal() is None)


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """Where routers should dial: ``advertise`` if given, else this host's name when bound to all interfaces."""
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


class EngineRegistration:
    """Heartbeats ``server`` into the registry at ``redis_url`` until ``stop``."""

    def __init__(self, server: EngineServer, redis_url: str, *, engine_id: str | None = None,
                 advertise_address: str | None = None, namespace: str = "pagoda", redis_password: str | None = None,
                 redis_ca: str | None = None, interval_s: float = 0.25, ttl_s: float = 2.0):
        self.server = server
        self.redis = connect_redis(redis_url, password=redis_password, ssl_ca_certs=redis_ca)
        self.engine_id = engine_id
        self.advertise_address = advertise_address
        self.namespace, self.interval_s, self.ttl_s = namespace, interval_s, ttl_s
        self.heartbeat: EngineHeartbeat | None = None

    async def start(self) -> None:
        """Call after ``server.wait_ready()`` (the tokenizer directory is known then)."""
        address = advertised_address(self.server.host, self.server.port, self.advertise_address)
        engine_id = self.engine_id or address
        tokenizer = (self.server.model_name, read_tokenizer_files(self.server.engine.engine.model_dir))
        self.heartbeat = EngineHeartbeat(self.redis, lambda: engine_record(self.server, engine_id, address),
                                         namespace=self.namespace, interval_s=self.interval_s, ttl_s=self.ttl_s,
                                         tokenizer=tokenizer)
        self.heartbeat.start()

    async def stop(self) -> None:
        """Deregister and close the Redis client, each step bounded (the engine's exit waits on this)."""
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        await bounded(self.redis.aclose(), "redis", log=logger, prefix="registry")
