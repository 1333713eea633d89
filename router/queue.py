"""The fleet-wide request queue, kept in Redis and mutated only through atomic Lua scripts.

`RedisRequestQueue` is the one owner of the queue state (STYLE habit 6): every router process
builds one over the same Redis, and because each operation is a single script, several routers
never admit a request twice nor lose one.

Ordering rule (lower score goes first; ties broken by arrival sequence, so strict FCFS):

    score = arrival_s - min(priority * priority_step_s, max_queue_wait_boost_s)

A priority buys at most `max_queue_wait_boost_s` of precedence, so every score lies in
[arrival - boost, arrival]. Hence a request A that has waited longer than boost outranks every
request B that arrives now, whatever B's priority: score_B >= arrival_B - boost > arrival_A >=
score_A. That is the aging bound; priorities are non-negative (0 is the default and lowest)
because a negative shift would push a request back without limit and break the bound.

Admission rule (bounded skipping, as TGI's waiting-served ratio): walk the queue in score
order and admit the first request whose `num_prompt_tokens` fits the engine's `free_tokens`.
Every request walked past (it did not fit) has its skip count incremented; a request that does
not fit and has already been skipped `max_skips` times blocks the walk, so nothing behind it is
admitted until it fits. So no request is ever overtaken more than `max_skips` times.

Redis layout, all under `{namespace}:` (fixed keys, declared to each script):
    queue     ZSET   member -> score; member = zero-padded arrival sequence + ":" + request_id
    payload   HASH   request_id -> payload bytes (a field here means the id is live)
    tokens    HASH   request_id -> num_prompt_tokens
    score     HASH   request_id -> score (kept after admission so `requeue` restores the place)
    member    HASH   request_id -> ZSET member
    skips     HASH   request_id -> times overtaken
    admitted  HASH   request_id -> engine_id
    seq       STRING arrival sequence counter
The client must be created with `decode_responses=False` (payloads are bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

# Width of the zero-padded sequence prefix of a ZSET member ("%016d:" is 17 characters).
_SEQ_WIDTH = 16

_KEY_NAMES = ("queue", "payload", "tokens", "score", "member", "skips", "admitted", "seq")

# KEYS: queue payload tokens score member skips admitted seq
# ARGV: request_id payload priority num_prompt_tokens now('' = server time) max_queue_size
#       priority_step_s max_queue_wait_boost_s
_ENQUEUE = """
local id = ARGV[1]
if redis.call('HEXISTS', KEYS[2], id) == 1 then return -2 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[6]) then return -1 end
local now
if ARGV[5] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[5])
end
local shift = tonumber(ARGV[3]) * tonumber(ARGV[7])
local boost = tonumber(ARGV[8])
if shift > boost then shift = boost end
local score = string.format('%.17g', now - shift)
local seq = redis.call('INCR', KEYS[8])
local member = string.format('%016d', seq) .. ':' .. id
redis.call('ZADD', KEYS[1], score, member)
redis.call('HSET', KEYS[2], id, ARGV[2])
redis.call('HSET', KEYS[3], id, ARGV[4])
redis.call('HSET', KEYS[4], id, score)
redis.call('HSET', KEYS[5], id, member)
return redis.call('ZRANK', KEYS[1], member)
"""

# ARGV: engine_id free_tokens max_skips max_scan
_ADMIT = """
local free = tonumber(ARGV[2])
local max_skips = tonumber(ARGV[3])
local members = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[4]) - 1)
local skipped = {}
for _, member in ipairs(members) do
  local id = string.sub(member, 18)
  local need = tonumber(redis.call('HGET', KEYS[3], id))
  if need <= free then
    redis.call('ZREM', KEYS[1], member)
    redis.call('HSET', KEYS[7], id, ARGV[1])
    for _, s in ipairs(skipped) do redis.call('HINCRBY', KEYS[6], s, 1) end
    return {id, redis.call('HGET', KEYS[2], id), need}
  end
  if tonumber(redis.call('HGET', KEYS[6], id) or '0') >= max_skips then return false end
  skipped[#skipped + 1] = id
end
return false
"""

# ARGV: request_id. Forgets a live id wherever it is (queued or admitted).
_RELEASE = """
local id = ARGV[1]
local member = redis.call('HGET', KEYS[5], id)
if not member then return 0 end
redis.call('ZREM', KEYS[1], member)
for i = 2, 7 do redis.call('HDEL', KEYS[i], id) end
return 1
"""

# ARGV: request_id. Removes the id only while it is still queued.
_CANCEL = """
local id = ARGV[1]
local member = redis.call('HGET', KEYS[5], id)
if not member then return 0 end
if redis.call('ZREM', KEYS[1], member) == 0 then return 0 end
for i = 2, 7 do redis.call('HDEL', KEYS[i], id) end
return 1
"""

# ARGV: request_id. Puts an admitted id back with its original score and sequence.
_REQUEUE = """
local id = ARGV[1]
if redis.call('HDEL', KEYS[7], id) == 0 then return -1 end
local member = redis.call('HGET', KEYS[5], id)
redis.call('ZADD', KEYS[1], redis.call('HGET', KEYS[4], id), member)
return redis.call('ZRANK', KEYS[1], member)
"""

# ARGV: request_id
_POSITION = """
local member = redis.call('HGET', KEYS[5], ARGV[1])
if not member then return -1 end
local rank = redis.call('ZRANK', KEYS[1], member)
if not rank then return -1 end
return rank
"""


class QueueError(Exception):
    """Base class of queue rejections."""


class QueueFull(QueueError):
    """The queue already holds `max_queue_size` requests (router: RESOURCE_EXHAUSTED)."""


class DuplicateRequest(QueueError):
    """The request id is live: queued, or admitted and not yet released (router: ALREADY_EXISTS)."""


@dataclass(frozen=True)
class QueueConfig:
    """Limits and policy knobs of the request queue."""

    namespace: str = "pagoda"
    max_queue_size: int = 1024
    """Most requests waiting at once; one more is rejected with `QueueFull`."""
    max_queue_wait_boost_s: float = 30.0
    """Most precedence any priority buys; a request that waited this long outranks newer ones."""
    max_skips: int = 8
    """Most times a request may be overtaken by later, smaller ones (0 = strict order)."""
    priority_step_s: float = 1.0
    """Seconds of precedence per unit of priority (capped by `max_queue_wait_boost_s`)."""
    max_scan: int = 64
    """Most queued requests one admission looks at."""

    def __post_init__(self):
        if not self.namespace:
            raise ValueError("namespace must be non-empty")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if not self.max_queue_wait_boost_s > 0:
            raise ValueError(f"max_queue_wait_boost_s must be > 0, got {self.max_queue_wait_boost_s}")
        if self.max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {self.max_skips}")
        if not self.priority_step_s > 0:
            raise ValueError(f"priority_step_s must be > 0, got {self.priority_step_s}")
        if self.max_scan < 1:
            raise ValueError(f"max_scan must be >= 1, got {self.max_scan}")


@dataclass(frozen=True)
class Admitted:
    """A request popped from the queue and now owned by an engine until `release`/`requeue`."""

    request_id: str
    payload: bytes
    num_prompt_tokens: int


def _time_arg(now: float | None) -> str:
    return "" if now is None else repr(float(now))


class RedisRequestQueue:
    """The request queue of all routers sharing one Redis; see the module docstring for rules."""

    def __init__(self, redis: aioredis.Redis, *, namespace: str = "pagoda", max_queue_size: int = 1024,
                 max_queue_wait_boost_s: float = 30.0, max_skips: int = 8, priority_step_s: float = 1.0,
                 max_scan: int = 64):
        self.config = QueueConfig(namespace=namespace, max_queue_size=max_queue_size,
                                  max_queue_wait_boost_s=max_queue_wait_boost_s, max_skips=max_skips,
                                  priority_step_s=priority_step_s, max_scan=max_scan)
        self._redis = redis
        self._keys = [f"{namespace}:{name}" for name in _KEY_NAMES]
        self._queue_key = self._keys[0]
        self._admitted_key = self._keys[6]
        self._enqueue = redis.register_script(_ENQUEUE)
        self._admit = redis.register_script(_ADMIT)
        self._release = redis.register_script(_RELEASE)
        self._cancel = redis.register_script(_CANCEL)
        self._requeue = redis.register_script(_REQUEUE)
        self._position = redis.register_script(_POSITION)

    async def enqueue(self, request_id: str, payload: bytes, *, priority: int = 0, num_prompt_tokens: int,
                      now: float | None = None) -> int:
        """Add a request to the queue.

        Args:
            request_id: unique among live requests.
            payload: opaque bytes handed back by `admit`.
            priority: >= 0, higher goes first (by at most `max_queue_wait_boost_s`).
            num_prompt_tokens: KV room the request needs to be admitted.
            now: arrival time in seconds; Redis server time when None.
        Returns:
            The request's 0-based position in the queue.
        Raises:
            QueueFull, DuplicateRequest, ValueError.
        """
        if not request_id:
            raise ValueError("request_id must be non-empty")
        if priority < 0:
            raise ValueError(f"priority must be >= 0, got {priority}")
        if num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        cfg = self.config
        result = await self._enqueue(keys=self._keys, args=[
            request_id, payload, int(priority), int(num_prompt_tokens), _time_arg(now), cfg.max_queue_size,
            repr(float(cfg.priority_step_s)), repr(float(cfg.max_queue_wait_boost_s))])
        if result == -1:
            raise QueueFull(f"queue holds {cfg.max_queue_size} requests")
        if result == -2:
            raise DuplicateRequest(f"request id {request_id!r} is already live")
        return int(result)

    async def admit(self, engine_id: str, free_tokens: int, now: float | None = None) -> Admitted | None:
        """Pop the next admissible request for an engine with `free_tokens` of room, or None.

        `now` is accepted for symmetry with `enqueue`; the admission rule does not depend on time
        (aging is already in the scores).
        """
        cfg = self.config
        result = await self._admit(keys=self._keys, args=[engine_id, int(free_tokens), cfg.max_skips, cfg.max_scan])
        if not result:
            return None
        request_id, payload, need = result
        return Admitted(request_id=request_id.decode(), payload=payload, num_prompt_tokens=int(need))

    async def release(self, request_id: str) -> bool:
        """Forget a finished/failed request (queued or admitted); the id becomes reusable."""
        return bool(await self._release(keys=self._keys, args=[request_id]))

    async def requeue(self, request_id: str) -> int | None:
        """Put an admitted request back at its original place; its new position, or None if not admitted.

        Bypasses `max_queue_size`: the request was accepted once and must not be dropped because
        its engine died.
        """
        result = await self._requeue(keys=self._keys, args=[request_id])
        return None if result == -1 else int(result)

    async def cancel(self, request_id: str) -> bool:
        """Remove a request that is still queued; False if it is not queued (admitted or unknown)."""
        return bool(await self._cancel(keys=self._keys, args=[request_id]))

    async def depth(self) -> int:
        """Number of requests waiting (admitted ones are not counted)."""
        return int(await self._redis.zcard(self._queue_key))

    async def position(self, request_id: str) -> int | None:
        """0-based position of a queued request, or None if it is not queued."""
        result = await self._position(keys=self._keys, args=[request_id])
        return None if result == -1 else int(result)

    async def admitted_to(self, engine_id: str) -> list[str]:
        """Ids admitted to `engine_id` and not yet released (to requeue them if the engine dies)."""
        table = await self._redis.hgetall(self._admitted_key)
        return sorted(rid.decode() for rid, eid in table.items() if eid.decode() == engine_id)
