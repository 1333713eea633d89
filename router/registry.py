"""The engine registry in Redis: engines heartbeat their load with a TTL, routers read the live set.

Engines register themselves (`EngineHeartbeat`, run inside the engine process) rather than being
polled by routers: a heartbeat written from the engine's own event loop is evidence that the
process and its loop are alive (a stalled engine loop reports ``accepting=false``, a dead process
stops writing and its entry lapses after ``ttl_s``); N routers read one record per engine from
Redis instead of each polling M engines over gRPC; and a router needs nothing but the Redis URL to
find the fleet, so routers stay stateless and interchangeable.

Expiry uses Redis server time, so clocks of the hosts never matter. The engine also publishes its
tokenizer files once per start (`publish_tokenizer`): routers tokenize exactly as the engine does
(to check prompt lengths and count tokens for admission) without holding model files.

Redis layout under ``{namespace}:``: ``engines`` HASH engine_id -> JSON record,
``engine_expiry`` HASH engine_id -> expiry (server time), ``engine_suspect`` HASH engine_id -> until
when routers place nothing on it (a router saw its connection fail: the whole fleet backs off, not
only that router), ``tokenizer:{model}`` STRING JSON of the tokenizer files.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import redis.asyncio as aioredis
import structlog

from router.lifecycle import bounded

logger = structlog.get_logger("pagoda.registry")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], string.format('%.17g', now + tonumber(ARGV[3])))
return 1
"""

_SUSPECT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[3], ARGV[1], string.format('%.17g', tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2])))
return 1
"""

_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local live, suspects = {}, {}
local marks = redis.call('HGETALL', KEYS[3])
for i = 1, #marks, 2 do
  if tonumber(marks[i + 1]) > now then suspects[#suspects + 1] = marks[i] else redis.call('HDEL', KEYS[3], marks[i]) end
end
local expiry = redis.call('HGETALL', KEYS[2])
for i = 1, #expiry, 2 do
  if tonumber(expiry[i + 1]) > now then
    local record = redis.call('HGET', KEYS[1], expiry[i])
    if record then live[#live + 1] = record end
  else
    redis.call('HDEL', KEYS[1], expiry[i])
    redis.call('HDEL', KEYS[2], expiry[i])
  end
end
return {live, suspects}
"""


@dataclass(frozen=True)
class EngineRecord:
    """One engine as its latest heartbeat describes it (EngineLoad's figures plus what routers need)."""

    engine_id: str
    address: str                    # host:port of its Engine gRPC service
    model: str                      # served model name (ModelInfo.model_id)
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    block_size: int
    num_free_blocks: int
    num_total_blocks: int
    num_running_requests: int
    num_waiting_requests: int
    num_waiting_prompt_tokens: int
    max_num_seqs: int
    max_waiting_requests: int
    output_tokens_per_s: float
    accepting: bool                 # false while loading, draining or unhealthy

    @property
    def free_tokens(self) -> int:
        """KV room for new prompts: free blocks, less the prompts already waiting in the engine."""
        return self.num_free_blocks * self.block_size - self.num_waiting_prompt_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "EngineRecord":
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in fields(cls)})


class EngineRegistry:
    """Read and write engine records under one namespace (one owner of the registry keys)."""

    def __init__(self, redis: aioredis.Redis, namespace: str = "pagoda"):
        self._redis = redis
        self.namespace = namespace
        self._keys = [f"{namespace}:engines", f"{namespace}:engine_expiry", f"{namespace}:engine_suspect"]
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._live = redis.register_script(_LIVE)
        self._suspect = redis.register_script(_SUSPECT)

    async def heartbeat(self, record: EngineRecord, ttl_s: float) -> None:
        await self._heartbeat(keys=self._keys, args=[record.engine_id, record.to_json(), repr(float(ttl_s))])

    async def deregister(self, engine_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.hdel(self._keys[0], engine_id).hdel(self._keys[1], engine_id).execute()

    async def live(self) -> tuple[dict[str, EngineRecord], set[str]]:
        """Engines whose heartbeat has not lapsed (lapsed ones are removed on the way), and the ids of
        those under a suspect mark."""
        records, suspects = await self._live(keys=self._keys)
        return ({r.engine_id: r for r in map(EngineRecord.from_json, records)},
                {s.decode() for s in suspects})

    async def mark_suspect(self, engine_id: str, seconds: float) -> None:
        """No router should place requests on ``engine_id`` for ``seconds`` (its connection failed)."""
        await self._suspect(keys=self._keys, args=[engine_id, repr(float(seconds))])

    async def publish_tokenizer(self, model: str, files: dict[str, str]) -> None:
        await self._redis.set(f"{self.namespace}:tokenizer:{model}", json.dumps(files))

    async def fetch_tokenizer(self, model: str) -> dict[str, str] | None:
        raw = await self._redis.get(f"{self.namespace}:tokenizer:{model}")
        return None if raw is None else json.loads(raw)


def read_tokenizer_files(model_dir: str) -> dict[str, str]:
    """The tokenizer files of a model directory, by name (those that exist)."""
    files = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                files[name] = f.read()
    if "tokenizer.json" not in files:
        raise ValueError(f"{model_dir!r} has no tokenizer.json")
    return files


class EngineHeartbeat:
    """Keeps one engine's record in the registry: every ``interval_s`` while it runs, removed on ``stop``.

    ``record_fn`` returns the current `EngineRecord` (or None while the engine is not loaded yet).
    Redis errors are logged and retried with exponential backoff (capped at ``ttl_s / 2``): the
    engine keeps serving the streams it has while Redis is away.
    """

    def __init__(self, redis: aioredis.Redis, record_fn: Callable[[], EngineRecord | None], *,
                 namespace: str = "pagoda", interval_s: float = 0.25, ttl_s: float = 2.0,
                 tokenizer: tuple[str, dict[str, str]] | None = None):
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"heartbeat interval_s must be in (0, ttl_s={ttl_s}), got {interval_s}")
        self.registry = EngineRegistry(redis, namespace)
        self._redis = redis
        self._record_fn = record_fn
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self._tokenizer = tokenizer
        self._task: asyncio.Task | None = None
        self._engine_id: str | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        backoff = self.interval_s
        tokenizer_published = False
        healthy = True
        # Checked as well as cancelled: a cancellation that a Redis call turned into one of the errors
        # retried below must not keep the loop (and the engine process waiting on it) alive.
        while not self._stopping:
            record = self._record_fn()
            try:
                if record is not None:
                    if not tokenizer_published and self._tokenizer is not None:
                        await self.registry.publish_tokenizer(*self._tokenizer)
                        tokenizer_published = True
                    await self.registry.heartbeat(record, self.ttl_s)
                    self._engine_id = record.engine_id
                if not healthy:
                    logger.info("registry.reconnected")
                healthy, backoff = True, self.interval_s
                await asyncio.sleep(self.interval_s)
            except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as e:
                tokenizer_published = False  # a restarted Redis has lost it: publish again
                if healthy:
                    logger.warning("registry.heartbeat_failed", error=str(e))
                healthy = False
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self.ttl_s / 2)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop heartbeating and remove the record (routers stop admitting to this engine at once).

        Each part bounded (``router.lifecycle.bounded``): an engine's exit waits on this."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await bounded(self._task, "heartbeat", log=logger, prefix="registry", timeout_s=timeout_s)
        if self._engine_id is not None:
            # A failure is logged and left: the entry lapses by itself after ttl_s.
            await bounded(self.registry.deregister(self._engine_id), "deregister", log=logger, prefix="registry",
                          timeout_s=timeout_s)
