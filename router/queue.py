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

Admission and placement (`place`, one script): the caller passes every engine with its reported
room (`EngineRoom`: free KV tokens, most requests it may hold). An engine's usable room is its
reported free tokens minus the tokens *reserved* by requests admitted to it that have not yet
started there (`started` drops the reservation: from then on the engine's own load report counts
them), and it has a slot while fewer than `max_active` requests are admitted to it and not yet
released. The walk goes in score order and admits the first request that fits the engine with the
most usable room. Every request walked past has its skip count incremented; a request that does
not fit and has already been skipped `max_skips` times blocks the walk (bounded skipping, as TGI's
waiting-served ratio), so no request is ever overtaken more than `max_skips` times. The admitted
request goes to the least loaded engine it fits (load = admitted / max_active), unless the engine
that last took a request with the same prompt prefix fits and is loaded no more than
`affinity_slack` above that (prefix-cache affinity). The owner router, when it is not the caller,
is told on its channel (PUBLISH inside the script, so the notice and the admission are one step).

Leases: each router renews a lease (`renew_lease`); `reap` forgets every request whose owner's
lease has lapsed, queued or admitted, so a router that dies leaves no ghost entries.

Redis layout, all under `{namespace}:` (fixed keys, declared to each script):
    queue        ZSET   member -> score; member = zero-padded arrival sequence + ":" + request_id
    payload      HASH   request_id -> payload bytes (a field here means the id is live)
    tokens       HASH   request_id -> num_prompt_tokens
    score        HASH   request_id -> score (kept after admission so `requeue` restores the place)
    member       HASH   request_id -> ZSET member
    skips        HASH   request_id -> times overtaken
    admitted     HASH   request_id -> engine_id
    seq          STRING arrival sequence counter
    owner        HASH   request_id -> router_id
    reserved     HASH   request_id -> engine_id, while admitted and not yet started
    rsv_tokens   HASH   engine_id -> tokens reserved on it
    active       HASH   engine_id -> requests admitted to it and not released
    qtokens      STRING prompt tokens of the waiting requests
    prefix       HASH   request_id -> prompt prefix key
    affinity     HASH   prefix key -> engine_id that last took it
    affinity_lru ZSET   prefix key -> last use (bounded to `max_affinity_entries`)
    admit_log    LIST   admission times, newest first (the fleet's recent service rate)
    routers      HASH   router_id -> lease expiry (Redis server time)
    attempt      HASH   request_id -> the enqueue attempt that created the entry (see `enqueue_and_place`)
and `suspect_key` (default `{namespace}:engine_suspect`, the router passes the registry's): HASH
engine_id -> time until which `place` skips that engine (a router saw its connection fail).
Channels: `{namespace}:admitted:{router_id}` ("request_id engine_id"), `{namespace}:wake` (a
slot was freed or a request put back: routers should try to admit).
The client must be created with `decode_responses=False` (payloads are bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

# Width of the zero-padded sequence prefix of a ZSET member ("%016d:" is 17 characters).
_SEQ_WIDTH = 16
ADMIT_LOG_LENGTH = 256

_KEY_NAMES = ("queue", "payload", "tokens", "score", "member", "skips", "admitted", "seq", "owner", "reserved",
              "rsv_tokens", "active", "qtokens", "prefix", "affinity", "affinity_lru", "admit_log", "routers",
              "attempt")

_PRELUDE = """
local Q, PAYLOAD, TOKENS, SCORE, MEMBER, SKIPS, ADMITTED, SEQ, OWNER, RESERVED, RSV_TOKENS, ACTIVE,
      QTOKENS, PREFIX, AFFINITY, AFFINITY_LRU, ADMIT_LOG, ROUTERS, ATTEMPT, SUSPECT = unpack(KEYS)
local PER_ID = {PAYLOAD, TOKENS, SCORE, MEMBER, SKIPS, ADMITTED, OWNER, RESERVED, PREFIX, ATTEMPT}
local clock_now = nil
local function server_now()  -- read once per script: one step, one instant
  if clock_now == nil then
    local t = redis.call('TIME')
    clock_now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  return clock_now
end
local function time_arg(arg)
  if arg == nil or arg == '' then return server_now() end
  return tonumber(arg)
end
local function add(hash, field, delta)
  if redis.call('HINCRBY', hash, field, delta) <= 0 then redis.call('HDEL', hash, field) end
end
local function unreserve(id)
  local e = redis.call('HGET', RESERVED, id)
  if not e then return false end
  redis.call('HDEL', RESERVED, id)
  add(RSV_TOKENS, e, -tonumber(redis.call('HGET', TOKENS, id)))
  return true
end
local function unadmit(id)
  unreserve(id)
  local e = redis.call('HGET', ADMITTED, id)
  if not e then return false end
  redis.call('HDEL', ADMITTED, id)
  add(ACTIVE, e, -1)
  return true
end
local function dequeue(id, member)
  if redis.call('ZREM', Q, member) == 0 then return false end
  redis.call('DECRBY', QTOKENS, tonumber(redis.call('HGET', TOKENS, id)))
  return true
end
local function forget(id)
  local member = redis.call('HGET', MEMBER, id)
  if not member then return false end
  dequeue(id, member)
  unadmit(id)
  for _, h in ipairs(PER_ID) do redis.call('HDEL', h, id) end
  return true
end
"""

# enqueue(A), A: request_id payload priority num_prompt_tokens now('' = server time) max_queue_size
#   priority_step_s max_queue_wait_boost_s owner prefix max_queued_tokens lease_ttl_s('' = leave the lease)
#   attempt('' = none). Returns the new entry's rank, or -1 (queue full), -2 (id live), -3 (token limit),
#   -4 (the entry exists and this same attempt created it).
_ENQUEUE_FN = """
local function enqueue(A)
  local id = A[1]
  local need = tonumber(A[4])
  local attempt = A[13] or ''
  if redis.call('HEXISTS', PAYLOAD, id) == 1 then
    -- This very attempt, run again (redis-py retried after a lost reply): not a duplicate.
    if attempt ~= '' and redis.call('HGET', ATTEMPT, id) == attempt then return -4 end
    return -2
  end
  local depth = redis.call('ZCARD', Q)
  if depth >= tonumber(A[6]) then return -1 end
  -- A request larger than the whole token limit is still taken when nothing waits, or it never could be.
  if depth > 0 and tonumber(redis.call('GET', QTOKENS) or '0') + need > tonumber(A[11]) then return -3 end
  local now = time_arg(A[5])
  local shift = tonumber(A[3]) * tonumber(A[7])
  local boost = tonumber(A[8])
  if shift > boost then shift = boost end
  local score = string.format('%.17g', now - shift)
  local seq = redis.call('INCR', SEQ)
  local member = string.format('%016d', seq) .. ':' .. id
  redis.call('ZADD', Q, score, member)
  redis.call('HSET', PAYLOAD, id, A[2])
  redis.call('HSET', TOKENS, id, need)
  redis.call('HSET', SCORE, id, score)
  redis.call('HSET', MEMBER, id, member)
  if A[9] ~= '' then
    redis.call('HSET', OWNER, id, A[9])
    -- The owner's lease is renewed with the entry, so no reap can come between an enqueue and the
    -- owner's first renewal (after a Redis restart, say).
    if A[12] ~= '' then
      redis.call('HSET', ROUTERS, A[9], string.format('%.17g', server_now() + tonumber(A[12])))
    end
  end
  if A[10] ~= '' then redis.call('HSET', PREFIX, id, A[10]) end
  if attempt ~= '' then redis.call('HSET', ATTEMPT, id, attempt) end
  redis.call('INCRBY', QTOKENS, need)
  return redis.call('ZRANK', Q, member)
end
"""

# place(A), A: caller max_skips max_scan affinity_slack now channel_prefix max_affinity_entries,
#   then (engine_id free_tokens max_active) per engine. Returns {id, payload, need, engine_id, owner} or false.
_PLACE_FN = """
local function place(A)
  local caller, max_skips, slack = A[1], tonumber(A[2]), tonumber(A[4])
  local engines, maxfree = {}, nil
  local clock = server_now()
  for i = 8, #A, 3 do
    local cap = tonumber(A[i + 2])
    local active = tonumber(redis.call('HGET', ACTIVE, A[i]) or '0')
    local suspect = tonumber(redis.call('HGET', SUSPECT, A[i]) or '0')
    if active < cap and suspect <= clock then
      local free = tonumber(A[i + 1]) - tonumber(redis.call('HGET', RSV_TOKENS, A[i]) or '0')
      engines[#engines + 1] = {id = A[i], free = free, load = active / cap}
      if maxfree == nil or free > maxfree then maxfree = free end
    end
  end
  if maxfree == nil then return false end
  local members = redis.call('ZRANGE', Q, 0, tonumber(A[3]) - 1)
  local skipped = {}
  for _, member in ipairs(members) do
    local id = string.sub(member, 18)
    local need = tonumber(redis.call('HGET', TOKENS, id))
    if need <= maxfree then
      local best = nil
      for _, e in ipairs(engines) do
        if e.free >= need and (best == nil or e.load < best.load or (e.load == best.load and e.free > best.free)) then
          best = e
        end
      end
      local now = time_arg(A[5])
      local pfx = redis.call('HGET', PREFIX, id)
      if pfx then
        local aff = redis.call('HGET', AFFINITY, pfx)
        for _, e in ipairs(engines) do
          if e.id == aff and e.free >= need and e.load <= best.load + slack then best = e end
        end
        redis.call('HSET', AFFINITY, pfx, best.id)
        redis.call('ZADD', AFFINITY_LRU, now, pfx)
        while redis.call('ZCARD', AFFINITY_LRU) > tonumber(A[7]) do
          local old = redis.call('ZPOPMIN', AFFINITY_LRU)
          redis.call('HDEL', AFFINITY, old[1])
        end
      end
      dequeue(id, member)
      redis.call('HSET', ADMITTED, id, best.id)
      redis.call('HINCRBY', ACTIVE, best.id, 1)
      redis.call('HSET', RESERVED, id, best.id)
      redis.call('HINCRBY', RSV_TOKENS, best.id, need)
      redis.call('LPUSH', ADMIT_LOG, string.format('%.17g', now))
      redis.call('LTRIM', ADMIT_LOG, 0, """ + str(ADMIT_LOG_LENGTH - 1) + """)
      for _, s in ipairs(skipped) do redis.call('HINCRBY', SKIPS, s, 1) end
      local owner = redis.call('HGET', OWNER, id) or ''
      if owner ~= '' and owner ~= caller then
        redis.call('PUBLISH', A[6] .. 'admitted:' .. owner, id .. ' ' .. best.id)
      end
      return {id, redis.call('HGET', PAYLOAD, id), need, best.id, owner}
    end
    if tonumber(redis.call('HGET', SKIPS, id) or '0') >= max_skips then return false end
    skipped[#skipped + 1] = id
  end
  return false
end
"""

_ENQUEUE = _PRELUDE + _ENQUEUE_FN + "return enqueue(ARGV)"
_PLACE = _PRELUDE + _PLACE_FN + "return place(ARGV)"

# ARGV: enqueue's 13 arguments, then place's. One atomic step, so it admits exactly what an enqueue
# followed at once by a place would. Returns {error} (enqueue's negative codes but -4), or
# {rank of the request after the admission (-1: not queued), engine it is admitted to ('' = none),
#  requests still queued, then place's reply if it admitted one}.
_ENQUEUE_PLACE = _PRELUDE + _ENQUEUE_FN + _PLACE_FN + """
local E, P = {}, {}
for i = 1, 13 do E[i] = ARGV[i] end
for i = 14, #ARGV do P[#P + 1] = ARGV[i] end
local rank = enqueue(E)
if rank < 0 and rank ~= -4 then return {rank} end
local admitted = place(P)
local id = ARGV[1]
local reply = {redis.call('ZRANK', Q, redis.call('HGET', MEMBER, id)) or -1,
               redis.call('HGET', ADMITTED, id) or '', redis.call('ZCARD', Q)}
if admitted then
  for _, v in ipairs(admitted) do reply[#reply + 1] = v end
end
return reply
"""

# ARGV: request_id wake_channel attempt('' = any). Forgets a live id wherever it is (queued or admitted);
# with an attempt, only the entry that attempt created (a late release never hits a newer one).
_RELEASE = _PRELUDE + """
if ARGV[3] ~= '' and redis.call('HGET', ATTEMPT, ARGV[1]) ~= ARGV[3] then return 0 end
local was_admitted = redis.call('HEXISTS', ADMITTED, ARGV[1]) == 1
if not forget(ARGV[1]) then return 0 end
-- A freed slot matters only to a waiting request (one enqueued later runs its own admission).
if was_admitted and redis.call('ZCARD', Q) > 0 then redis.call('PUBLISH', ARGV[2], 'release') end
return 1
"""

# ARGV: request_id. Removes the id only while it is still queued.
_CANCEL = _PRELUDE + """
local member = redis.call('HGET', MEMBER, ARGV[1])
if not member or not dequeue(ARGV[1], member) then return 0 end
forget(ARGV[1])
return 1
"""

# ARGV: request_id wake_channel. Puts an admitted id back with its original score and sequence.
_REQUEUE = _PRELUDE + """
local id = ARGV[1]
if not unadmit(id) then return -1 end
local member = redis.call('HGET', MEMBER, id)
redis.call('ZADD', Q, redis.call('HGET', SCORE, id), member)
redis.call('INCRBY', QTOKENS, tonumber(redis.call('HGET', TOKENS, id)))
redis.call('PUBLISH', ARGV[2], 'requeue')
return redis.call('ZRANK', Q, member)
"""

# ARGV: request_id. The request produced output on its engine: drop its reservation.
_STARTED = _PRELUDE + """
if unreserve(ARGV[1]) then return 1 end
return 0
"""

# ARGV: request_id
_POSITION = _PRELUDE + """
local member = redis.call('HGET', MEMBER, ARGV[1])
if not member then return -1 end
local rank = redis.call('ZRANK', Q, member)
if not rank then return -1 end
return rank
"""

# ARGV: router_id ttl_s
_RENEW = _PRELUDE + """
redis.call('HSET', ROUTERS, ARGV[1], string.format('%.17g', server_now() + tonumber(ARGV[2])))
return 1
"""

# ARGV: wake_channel. Forgets every request whose owner's lease lapsed; returns their ids.
_REAP = _PRELUDE + """
local now = server_now()
local live = {}
local leases = redis.call('HGETALL', ROUTERS)
for i = 1, #leases, 2 do
  if tonumber(leases[i + 1]) > now then live[leases[i]] = true else redis.call('HDEL', ROUTERS, leases[i]) end
end
local reaped = {}
local owners = redis.call('HGETALL', OWNER)
for i = 1, #owners, 2 do
  if not live[owners[i + 1]] then
    forget(owners[i])
    reaped[#reaped + 1] = owners[i]
  end
end
if #reaped > 0 then redis.call('PUBLISH', ARGV[1], 'reap') end
return reaped
"""

# ARGV: window_s. Admissions in the last window_s seconds and the age of the oldest of them.
_RATE = _PRELUDE + """
local now = server_now()
local times = redis.call('LRANGE', ADMIT_LOG, 0, -1)
local n, oldest = 0, now
for _, t in ipairs(times) do
  t = tonumber(t)
  if now - t > tonumber(ARGV[1]) then break end
  n = n + 1
  oldest = t
end
return {n, string.format('%.17g', now - oldest)}
"""


class QueueError(Exception):
    """Base class of queue rejections."""


class QueueFull(QueueError):
    """The queue holds `max_queue_size` requests or `max_queued_tokens` tokens (router: RESOURCE_EXHAUSTED)."""


class DuplicateRequest(QueueError):
    """The request id is live: queued, or admitted and not yet released (router: ALREADY_EXISTS)."""


@dataclass(frozen=True)
class QueueConfig:
    """Limits and policy knobs of the request queue."""

    namespace: str = "pagoda"
    max_queue_size: int = 1024
    """Most requests waiting at once; one more is rejected with `QueueFull`."""
    max_queued_tokens: int = 1 << 22
    """Most prompt tokens waiting at once; a request that would pass it is rejected with `QueueFull`."""
    max_queue_wait_boost_s: float = 30.0
    """Most precedence any priority buys; a request that waited this long outranks newer ones."""
    max_skips: int = 8
    """Most times a request may be overtaken by later, smaller ones (0 = strict order)."""
    priority_step_s: float = 1.0
    """Seconds of precedence per unit of priority (capped by `max_queue_wait_boost_s`)."""
    max_scan: int = 64
    """Most queued requests one admission looks at."""
    affinity_slack: float = 0.25
    """Prefix affinity wins while its engine's load (admitted / max_active) is at most this above the least."""
    max_affinity_entries: int = 4096
    """Most prompt prefixes remembered for affinity (least recently used ones are forgotten)."""

    def __post_init__(self):
        if not self.namespace:
            raise ValueError("namespace must be non-empty")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {self.max_queued_tokens}")
        if not self.max_queue_wait_boost_s > 0:
            raise ValueError(f"max_queue_wait_boost_s must be > 0, got {self.max_queue_wait_boost_s}")
        if self.max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {self.max_skips}")
        if not self.priority_step_s > 0:
            raise ValueError(f"priority_step_s must be > 0, got {self.priority_step_s}")
        if self.max_scan < 1:
            raise ValueError(f"max_scan must be >= 1, got {self.max_scan}")
        if self.affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {self.affinity_slack}")
        if self.max_affinity_entries < 1:
            raise ValueError(f"max_affinity_entries must be >= 1, got {self.max_affinity_entries}")


@dataclass(frozen=True)
class EngineRoom:
    """What one engine can take, as its latest load report says (reservations are subtracted in Redis)."""

    engine_id: str
    free_tokens: int
    """Free KV tokens it reported (free blocks x block size, less its own waiting prompt tokens)."""
    max_active: int = 1 << 30
    """Most requests admitted to it at once (its max_num_seqs plus any waiting allowance)."""


@dataclass(frozen=True)
class Admitted:
    """A request popped from the queue and now owned by an engine until `release`/`requeue`."""

    request_id: str
    payload: bytes
    num_prompt_tokens: int
    engine_id: str = ""
    owner: str = ""


@dataclass(frozen=True)
class Placed:
    """What `enqueue_and_place` did: where the new request stands, and the admission it made if any."""

    position: int | None
    """The request's 0-based place in the queue after the admission (None: it is not queued)."""
    engine_id: str | None
    """The engine the request is admitted to (None: still queued)."""
    depth: int
    """Requests still queued."""
    admitted: Admitted | None
    """The request this step admitted (the new one or one ahead of it), as `place` returns it."""


def _time_arg(now: float | None) -> str:
    return "" if now is None else repr(float(now))


class RedisRequestQueue:
    """The request queue of all routers sharing one Redis; see the module docstring for rules."""

    def __init__(self, redis: aioredis.Redis, *, namespace: str = "pagoda", max_queue_size: int = 1024,
                 max_queued_tokens: int = 1 << 22, max_queue_wait_boost_s: float = 30.0, max_skips: int = 8,
                 priority_step_s: float = 1.0, max_scan: int = 64, affinity_slack: float = 0.25,
                 max_affinity_entries: int = 4096, suspect_key: str | None = None):
        self.config = QueueConfig(namespace=namespace, max_queue_size=max_queue_size,
                                  max_queued_tokens=max_queued_tokens, max_queue_wait_boost_s=max_queue_wait_boost_s,
                                  max_skips=max_skips, priority_step_s=priority_step_s, max_scan=max_scan,
                                  affinity_slack=affinity_slack, max_affinity_entries=max_affinity_entries)
        self._redis = redis
        self._keys = [f"{namespace}:{name}" for name in _KEY_NAMES] + [suspect_key or f"{namespace}:engine_suspect"]
        key = dict(zip(_KEY_NAMES, self._keys))
        self._queue_key, self._admitted_key, self._qtokens_key = key["queue"], key["admitted"], key["qtokens"]
        self._active_key = key["active"]
        self.channel_prefix = f"{namespace}:"
        self.wake_channel = f"{namespace}:wake"
        scripts = dict(enqueue=_ENQUEUE, place=_PLACE, enqueue_place=_ENQUEUE_PLACE, release=_RELEASE, cancel=_CANCEL, requeue=_REQUEUE,
                       started=_STARTED, position=_POSITION, renew=_RENEW, reap=_REAP, rate=_RATE)
        self._scripts = {name: redis.register_script(body) for name, body in scripts.items()}

    def admitted_channel(self, router_id: str) -> str:
        """The channel on which `router_id` hears that one of its requests was admitted by another router."""
        return f"{self.channel_prefix}admitted:{router_id}"

    async def _run(self, name: str, *args):
        return await self._scripts[name](keys=self._keys, args=list(args))

    async def enqueue(self, request_id: str, payload: bytes, *, priority: int = 0, num_prompt_tokens: int,
                      now: float | None = None, owner: str = "", prefix: str = "",
                      lease_ttl_s: float | None = None) -> int:
        """Add a request to the queue.

        Args:
            request_id: unique among live requests.
            payload: opaque bytes handed back by `admit` / `place`.
            priority: >= 0, higher goes first (by at most `max_queue_wait_boost_s`).
            num_prompt_tokens: KV room the request needs to be admitted.
            now: arrival time in seconds; Redis server time when None.
            owner: the router serving the client; its lease keeps the entry alive (see `reap`).
            prefix: a key of the prompt's leading tokens, for prefix-cache affinity ('' = none).
            lease_ttl_s: renew the owner's lease for this long with the entry (None: leave it).
        Returns:
            The request's 0-based position in the queue.
        Raises:
            QueueFull, DuplicateRequest, ValueError.
        """
        args = self._enqueue_args(request_id, payload, priority, num_prompt_tokens, now, owner, prefix, lease_ttl_s, "")
        result = await self._run("enqueue", *args)
        self._raise_refusal(result, request_id, num_prompt_tokens)
        return int(result)

    async def enqueue_and_place(self, request_id: str, payload: bytes, engines: list[EngineRoom], *,
                                priority: int = 0, num_prompt_tokens: int, attempt: str, caller: str = "",
                                now: float | None = None, owner: str = "", prefix: str = "",
                                lease_ttl_s: float | None = None) -> Placed:
        """`enqueue`, then `place(engines)`, as one atomic step: one round trip where the two calls take
        two, and the same admissions as the two calls made back to back.

        ``attempt`` names this enqueue (unique per call, e.g. random): sent again with the same
        attempt (redis-py retries after a lost reply) the call does not refuse its own entry as a
        duplicate but reports where it stands, and ``release(request_id, attempt=...)`` only
        forgets the entry this attempt created. Other arguments as `enqueue` and `place`; the
        owner of an admitted request other than ``caller`` is told as by `place`.

        Raises:
            QueueFull, DuplicateRequest, ValueError.
        """
        if not attempt:
            raise ValueError("attempt must be non-empty")
        cfg = self.config
        args = self._enqueue_args(request_id, payload, priority, num_prompt_tokens, now, owner, prefix, lease_ttl_s,
                                  attempt)
        args += [caller, cfg.max_skips, cfg.max_scan, repr(float(cfg.affinity_slack)), _time_arg(now),
                 self.channel_prefix, cfg.max_affinity_entries]
        for e in engines:
            args += [e.engine_id, int(e.free_tokens), max(0, int(e.max_active))]
        result = await self._run("enqueue_place", *args)
        if len(result) == 1:
            self._raise_refusal(result[0], request_id, num_prompt_tokens)
        position, engine_id, depth = int(result[0]), result[1].decode(), int(result[2])
        admitted = None
        if len(result) > 3:
            rid, payload, need, eid, admitted_owner = result[3:]
            admitted = Admitted(request_id=rid.decode(), payload=payload, num_prompt_tokens=int(need),
                                engine_id=eid.decode(), owner=admitted_owner.decode())
        return Placed(position=None if position < 0 else position, engine_id=engine_id or None, depth=depth,
                      admitted=admitted)

    def _enqueue_args(self, request_id: str, payload: bytes, priority: int, num_prompt_tokens: int,
                      now: float | None, owner: str, prefix: str, lease_ttl_s: float | None, attempt: str) -> list:
        if not request_id:
            raise ValueError("request_id must be non-empty")
        if priority < 0:
            raise ValueError(f"priority must be >= 0, got {priority}")
        if num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        cfg = self.config
        return [request_id, payload, int(priority), int(num_prompt_tokens), _time_arg(now), cfg.max_queue_size,
                repr(float(cfg.priority_step_s)), repr(float(cfg.max_queue_wait_boost_s)), owner, prefix,
                cfg.max_queued_tokens, "" if lease_ttl_s is None else repr(float(lease_ttl_s)), attempt]

    def _raise_refusal(self, code: int, request_id: str, num_prompt_tokens: int) -> None:
        cfg = self.config
        if code == -1:
            raise QueueFull(f"queue is full: {cfg.max_queue_size} requests waiting (max_queue_size={cfg.max_queue_size})")
        if code == -2:
            raise DuplicateRequest(f"request id {request_id!r} is already live")
        if code == -3:
            raise QueueFull(f"queue is full: {num_prompt_tokens} more prompt tokens would exceed "
                            f"max_queued_tokens={cfg.max_queued_tokens}")

    async def place(self, engines: list[EngineRoom], *, caller: str = "", now: float | None = None) -> Admitted | None:
        """Admit the next admissible request to the engine that should take it (module docstring), or None.

        The request's owner, when it is not `caller`, is notified on `admitted_channel(owner)`.
        """
        if not engines:
            return None
        cfg = self.config
        args = [caller, cfg.max_skips, cfg.max_scan, repr(float(cfg.affinity_slack)), _time_arg(now),
                self.channel_prefix, cfg.max_affinity_entries]
        for e in engines:
            args += [e.engine_id, int(e.free_tokens), max(0, int(e.max_active))]
        result = await self._run("place", *args)
        if not result:
            return None
        request_id, payload, need, engine_id, owner = result
        return Admitted(request_id=request_id.decode(), payload=payload, num_prompt_tokens=int(need),
                        engine_id=engine_id.decode(), owner=owner.decode())

    async def admit(self, engine_id: str, free_tokens: int, now: float | None = None) -> Admitted | None:
        """`place` with a single engine and no slot limit."""
        return await self.place([EngineRoom(engine_id, free_tokens)], now=now)

    async def started(self, request_id: str) -> bool:
        """The request produced output on its engine: its reservation of the engine's room ends."""
        return bool(await self._run("started", request_id))

    async def release(self, request_id: str, attempt: str = "") -> bool:
        """Forget a finished/failed request (queued or admitted); the id becomes reusable.

        With ``attempt``, only the entry that `enqueue_and_place` attempt created: a release retried
        late (after a Redis outage) leaves a newer request with the same id alone.
        """
        return bool(await self._run("release", request_id, self.wake_channel, attempt))

    async def requeue(self, request_id: str) -> int | None:
        """Put an admitted request back at its original place; its new position, or None if not admitted.

        Bypasses `max_queue_size`: the request was accepted once and must not be dropped because
        its engine died.
        """
        result = await self._run("requeue", request_id, self.wake_channel)
        return None if result == -1 else int(result)

    async def cancel(self, request_id: str) -> bool:
        """Remove a request that is still queued; False if it is not queued (admitted or unknown)."""
        return bool(await self._run("cancel", request_id))

    async def depth(self) -> int:
        """Number of requests waiting (admitted ones are not counted)."""
        return int(await self._redis.zcard(self._queue_key))

    async def queued_tokens(self) -> int:
        """Prompt tokens of the requests waiting."""
        return int(await self._redis.get(self._qtokens_key) or 0)

    async def position(self, request_id: str) -> int | None:
        """0-based position of a queued request, or None if it is not queued."""
        result = await self._run("position", request_id)
        return None if result == -1 else int(result)

    async def admitted_to(self, engine_id: str) -> list[str]:
        """Ids admitted to `engine_id` and not yet released."""
        table = await self._redis.hgetall(self._admitted_key)
        return sorted(rid.decode() for rid, eid in table.items() if eid.decode() == engine_id)

    async def engines_of(self, request_ids: list[str]) -> list[str | None]:
        """The engine each request is admitted to (None: queued or unknown)."""
        if not request_ids:
            return []
        values = await self._redis.hmget(self._admitted_key, request_ids)
        return [v.decode() if v is not None else None for v in values]

    async def active_counts(self) -> dict[str, int]:
        """engine_id -> requests admitted to it and not released."""
        return {k.decode(): int(v) for k, v in (await self._redis.hgetall(self._active_key)).items()}

    async def renew_lease(self, router_id: str, ttl_s: float) -> None:
        """Keep `router_id`'s requests alive for `ttl_s` more seconds (Redis server time)."""
        await self._run("renew", router_id, repr(float(ttl_s)))

    async def reap(self) -> list[str]:
        """Forget every request whose owner's lease has lapsed; returns their ids."""
        return [rid.decode() for rid in await self._run("reap", self.wake_channel)]

    async def admission_rate(self, window_s: float) -> tuple[int, float]:
        """(admissions in the last `window_s` seconds, seconds since the oldest of them)."""
        n, age = await self._run("rate", repr(float(window_s)))
        return int(n), float(age)
