"""RedisRequestQueue against a real redis-server: ordering, aging, limits, atomic admission, skipping."""
from __future__ import annotations

import asyncio
import itertools
import shutil
import subprocess
import time
import uuid
from collections import Counter

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.queue import Admitted, DuplicateRequest, EngineRoom, QueueFull, RedisRequestQueue
from tests.fleet import free_port

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A private redis-server on a free port (never 6379), no persistence."""
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
    client.close()
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def run_with_queue(redis_url, body, **kwargs):
    """Run `await body(queue)` on a fresh client and a namespace of its own."""
    async def main():
        client = aioredis.Redis.from_url(redis_url)
        try:
            queue = RedisRequestQueue(client, namespace=f"test-{uuid.uuid4().hex}", **kwargs)
            return await body(queue)
        finally:
            await client.aclose()
    return asyncio.run(main())


async def admit_all(queue, free_tokens=10_000, engine_id="e0"):
    """Admit until nothing fits; each request starts at once (its reservation ends)."""
    ids = []
    while (admitted := await queue.admit(engine_id, free_tokens)) is not None:
        ids.append(admitted.request_id)
        assert await queue.started(admitted.request_id)
    return ids


def test_fcfs_with_equal_priority(redis_url):
    async def body(q):
        for i, rid in enumerate(["a", "b", "c", "d"]):
            assert await q.enqueue(rid, rid.encode(), num_prompt_tokens=1, now=100.0 + i) == i
        # Same arrival time: still first come, first served.
        await q.enqueue("e", b"e", num_prompt_tokens=1, now=103.0)
        assert await q.position("e") == 4
        assert await q.depth() == 5
        first = await q.admit("e0", 10)
        assert first == Admitted("a", b"a", 1, engine_id="e0")
        await q.started("a")
        assert await admit_all(q) == ["b", "c", "d", "e"]
        assert await q.depth() == 0
    run_with_queue(redis_url, body)


def test_server_time_is_used_without_now(redis_url):
    async def body(q):
        await q.enqueue("a", b"", num_prompt_tokens=1)
        await q.enqueue("b", b"", num_prompt_tokens=1)
        assert await admit_all(q) == ["a", "b"]
    run_with_queue(redis_url, body)


def test_priority_moves_ahead(redis_url):
    async def body(q):
        await q.enqueue("low1", b"", num_prompt_tokens=1, now=100.0)
        await q.enqueue("low2", b"", num_prompt_tokens=1, now=101.0)
        assert await q.enqueue("high", b"", priority=5, num_prompt_tokens=1, now=102.0) == 0
        assert await q.position("low1") == 1
        assert await admit_all(q) == ["high", "low1", "low2"]
    run_with_queue(redis_url, body, priority_step_s=1.0, max_queue_wait_boost_s=30.0)


def test_aging_old_request_outranks_newer_high_priority(redis_url):
    async def body(q):
        await q.enqueue("old", b"", priority=0, num_prompt_tokens=1, now=100.0)
        # Arrives 10.5 s later (boost is 10 s) with a huge priority: the shift is capped at 10 s.
        await q.enqueue("vip", b"", priority=1000, num_prompt_tokens=1, now=110.5)
        # Within the boost window priority still wins.
        await q.enqueue("vip-early", b"", priority=1000, num_prompt_tokens=1, now=105.0)
        assert await admit_all(q) == ["vip-early", "old", "vip"]
        with pytest.raises(ValueError):
            await q.enqueue("neg", b"", priority=-1, num_prompt_tokens=1, now=111.0)
    run_with_queue(redis_url, body, priority_step_s=1.0, max_queue_wait_boost_s=10.0)


def test_queue_full_rejects_immediately(redis_url):
    async def body(q):
        for i in range(3):
            await q.enqueue(f"r{i}", b"", num_prompt_tokens=1, now=float(i))
        start = time.monotonic()
        with pytest.raises(QueueFull):
            await q.enqueue("r3", b"", num_prompt_tokens=1, now=3.0)
        assert time.monotonic() - start < 1.0
        assert await q.depth() == 3
        assert await q.position("r3") is None
        # Admitted requests do not count towards the waiting queue.
        assert (await q.admit("e0", 10)).request_id == "r0"
        await q.enqueue("r3", b"", num_prompt_tokens=1, now=4.0)
        with pytest.raises(QueueFull):
            await q.enqueue("r4", b"", num_prompt_tokens=1, now=5.0)
    run_with_queue(redis_url, body, max_queue_size=3)


def test_duplicate_live_id_rejected_and_reusable_after_release(redis_url):
    async def body(q):
        await q.enqueue("x", b"1", num_prompt_tokens=1, now=1.0)
        with pytest.raises(DuplicateRequest):
            await q.enqueue("x", b"2", num_prompt_tokens=1, now=2.0)
        assert (await q.admit("e0", 10)).payload == b"1"
        with pytest.raises(DuplicateRequest):  # admitted and not released: still live
            await q.enqueue("x", b"2", num_prompt_tokens=1, now=3.0)
        assert await q.admitted_to("e0") == ["x"]
        assert await q.release("x") is True
        assert await q.release("x") is False
        assert await q.admitted_to("e0") == []
        await q.enqueue("x", b"3", num_prompt_tokens=1, now=4.0)
        assert (await q.admit("e0", 10)).payload == b"3"
    run_with_queue(redis_url, body)


def test_concurrent_admitters_admit_each_request_exactly_once(redis_url):
    num_requests, num_clients = 300, 8

    async def main():
        namespace = f"test-{uuid.uuid4().hex}"
        clients = [aioredis.Redis.from_url(redis_url) for _ in range(num_clients)]
        try:
            queues = [RedisRequestQueue(c, namespace=namespace, max_queue_size=num_requests) for c in clients]
            for i in range(num_requests):
                await queues[0].enqueue(f"r{i}", str(i).encode(), num_prompt_tokens=1 + i % 7, now=float(i))

            async def worker(k):
                got = []
                for attempt in itertools.count():
                    # Varying room: some admissions skip, some find nothing; all must stay exact. (The
                    # room cycles with every attempt, so a head that blocks the walk is always taken.)
                    admitted = await queues[k].admit(f"e{k}", 4 + (attempt + k) % 5)
                    if admitted is not None:
                        got.append(admitted)
                        assert admitted.engine_id == f"e{k}"
                        await queues[k].started(admitted.request_id)
                    elif await queues[k].depth() == 0:
                        return got
                    else:
                        await asyncio.sleep(0)

            results = await asyncio.gather(*(worker(k) for k in range(num_clients)))
            ids = Counter(a.request_id for got in results for a in got)
            assert all(a.payload == a.request_id[1:].encode() for got in results for a in got)
            assert set(ids) == {f"r{i}" for i in range(num_requests)}
            assert max(ids.values()) == 1
            for k, got in enumerate(results):
                assert await queues[0].admitted_to(f"e{k}") == sorted(a.request_id for a in got)
        finally:
            for c in clients:
                await c.aclose()
    asyncio.run(main())


def test_bounded_skipping_then_head_blocks_until_it_fits(redis_url):
    max_skips = 3

    async def body(q):
        await q.enqueue("big", b"", num_prompt_tokens=100, now=0.0)
        for i in range(10):
            await q.enqueue(f"s{i}", b"", num_prompt_tokens=10, now=1.0 + i)
        admitted = [(await q.admit("e0", 50)).request_id for _ in range(max_skips)]
        assert admitted == ["s0", "s1", "s2"]
        for rid in admitted:
            await q.started(rid)
        # The head has been overtaken max_skips times: nothing behind it goes while it does not fit.
        assert await q.admit("e0", 50) is None
        assert await q.admit("e0", 99) is None
        assert await q.position("big") == 0
        assert (await q.admit("e0", 100)).request_id == "big"
        assert await admit_all(q) == [f"s{i}" for i in range(3, 10)]
    run_with_queue(redis_url, body, max_skips=max_skips)


def test_zero_max_skips_is_strict_order(redis_url):
    async def body(q):
        await q.enqueue("big", b"", num_prompt_tokens=100, now=0.0)
        await q.enqueue("small", b"", num_prompt_tokens=1, now=1.0)
        assert await q.admit("e0", 50) is None
        assert await admit_all(q, free_tokens=100) == ["big", "small"]
    run_with_queue(redis_url, body, max_skips=0)


def test_requeue_keeps_original_place(redis_url):
    async def body(q):
        for i in range(4):
            await q.enqueue(f"r{i}", b"", num_prompt_tokens=1, now=float(i))
        assert (await q.admit("dead", 10)).request_id == "r0"
        assert (await q.admit("dead", 10)).request_id == "r1"
        await q.enqueue("r4", b"", num_prompt_tokens=1, now=4.0)
        assert await q.requeue("r1") == 0
        assert await q.requeue("r0") == 0
        assert await q.requeue("r0") is None  # already queued again
        assert await q.requeue("nope") is None
        assert await q.admitted_to("dead") == []
        assert await admit_all(q) == ["r0", "r1", "r2", "r3", "r4"]
    run_with_queue(redis_url, body)


def test_cancel_removes_only_queued(redis_url):
    async def body(q):
        for i in range(3):
            await q.enqueue(f"r{i}", b"", num_prompt_tokens=1, now=float(i))
        assert (await q.admit("e0", 10)).request_id == "r0"
        assert await q.cancel("r0") is False  # admitted: the router aborts on the engine, then releases
        assert await q.cancel("r1") is True
        assert await q.cancel("r1") is False
        assert await q.position("r1") is None
        assert await q.depth() == 1
        await q.enqueue("r1", b"", num_prompt_tokens=1, now=5.0)  # reusable after cancel
        assert await admit_all(q) == ["r2", "r1"]
    run_with_queue(redis_url, body)


def test_config_validation():
    client = aioredis.Redis()
    for bad in ({"max_queue_size": 0}, {"max_queue_wait_boost_s": 0}, {"max_skips": -1},
                {"priority_step_s": 0}, {"namespace": ""}, {"max_queued_tokens": 0}, {"affinity_slack": -1}):
        with pytest.raises(ValueError):
            RedisRequestQueue(client, **bad)


def test_queued_token_limit(redis_url):
    async def body(q):
        await q.enqueue("a", b"", num_prompt_tokens=60, now=1.0)
        with pytest.raises(QueueFull, match="max_queued_tokens=100"):
            await q.enqueue("b", b"", num_prompt_tokens=41, now=2.0)
        await q.enqueue("c", b"", num_prompt_tokens=40, now=3.0)
        assert await q.queued_tokens() == 100
        assert (await q.admit("e0", 1000)).request_id == "a"
        assert await q.queued_tokens() == 40
        await q.requeue("a")  # put back whatever the limit: it was accepted once
        assert await q.queued_tokens() == 100
        assert await q.cancel("c") and await q.release("a")
        assert await q.queued_tokens() == 0
        # Larger than the whole limit, but nothing waits: taken (or it never could be).
        await q.enqueue("huge", b"", num_prompt_tokens=500, now=4.0)
    run_with_queue(redis_url, body, max_queued_tokens=100)


def test_placement_least_loaded_slots_and_reservations(redis_url):
    async def body(q):
        for i in range(6):
            await q.enqueue(f"r{i}", b"", num_prompt_tokens=10, now=float(i))
        engines = [EngineRoom("a", free_tokens=100, max_active=2), EngineRoom("b", free_tokens=25, max_active=4)]
        # Least loaded (admitted / max_active) first; ties go to the engine with more usable room.
        got = [(await q.place(engines)).engine_id for _ in range(4)]
        assert got == ["a", "b", "b", "a"]  # loads 0|0, 1/2|0, 1/2|1/4, then a tie: a has more room
        # a is full (2 of 2 slots); b has slots but 25 - 2 * 10 reserved tokens = 5 < 10 of room.
        assert await q.place(engines) is None
        assert await q.started("r1")  # b's report will now count r1: 15 usable tokens
        assert (await q.place(engines)).engine_id == "b"
        assert await q.active_counts() == {"a": 2, "b": 3}
        # A release frees a slot at once (admission does not wait for the next load report).
        assert await q.release("r0")
        assert (await q.place(engines)).request_id == "r5"
        assert await q.place([EngineRoom("a", 100, max_active=0)]) is None
    run_with_queue(redis_url, body)


def test_prefix_affinity_within_slack(redis_url):
    async def body(q):
        engines = [EngineRoom("a", 1000, max_active=8), EngineRoom("b", 1000, max_active=8)]
        await q.enqueue("p1", b"", num_prompt_tokens=10, prefix="sys", now=1.0)
        first = (await q.place(engines)).engine_id
        other = "b" if first == "a" else "a"
        # Same prefix again: its engine is 1/8 more loaded, within the slack of 0.25: affinity wins.
        await q.enqueue("p2", b"", num_prompt_tokens=10, prefix="sys", now=2.0)
        assert (await q.place(engines)).engine_id == first
        # A different prefix goes to the least loaded engine.
        await q.enqueue("x", b"", num_prompt_tokens=10, prefix="other", now=3.0)
        assert (await q.place(engines)).engine_id == other
        # `first` holds 2 and `other` 1; one more on `first`: the gap is 3/8 - 1/8, still within the slack.
        await q.enqueue("y", b"", num_prompt_tokens=10, now=4.0)
        await q.place([EngineRoom(first, 1000, 8)])
        await q.enqueue("p3", b"", num_prompt_tokens=10, prefix="sys", now=5.0)
        assert (await q.place(engines)).engine_id == first
        # Now 4/8 against 1/8: beyond the slack, the least loaded engine takes it (and the prefix moves).
        await q.enqueue("p4", b"", num_prompt_tokens=10, prefix="sys", now=6.0)
        assert (await q.place(engines)).engine_id == other
        await q.enqueue("p5", b"", num_prompt_tokens=10, prefix="sys", now=7.0)
        assert (await q.place(engines)).engine_id == other
    run_with_queue(redis_url, body, affinity_slack=0.25)


def test_owner_is_told_of_admission_and_lapsed_leases_are_reaped(redis_url):
    async def body(q):
        client = aioredis.Redis.from_url(redis_url)
        pubsub = client.pubsub()
        await pubsub.subscribe(q.admitted_channel("router-b"))
        await pubsub.get_message(timeout=1)  # the subscribe confirmation
        await q.renew_lease("router-b", 0.3)
        # An enqueue renews its owner's lease: no reap can come before the owner's first renewal.
        await q.enqueue("mine", b"", num_prompt_tokens=1, owner="router-a", now=1.0, lease_ttl_s=30)
        await q.enqueue("theirs", b"", num_prompt_tokens=1, owner="router-b", now=2.0)
        await q.enqueue("queued", b"", num_prompt_tokens=1, owner="router-b", now=3.0)
        assert (await q.place([EngineRoom("e", 100)], caller="router-a")).owner == "router-a"
        admitted = await q.place([EngineRoom("e", 100)], caller="router-a")
        assert (admitted.request_id, admitted.owner) == ("theirs", "router-b")
        message = await pubsub.get_message(timeout=2)
        assert message["data"] == b"theirs e"
        assert await q.reap() == []
        await asyncio.sleep(0.4)  # router-b's lease lapses: its queued and admitted entries go
        assert sorted(await q.reap()) == ["queued", "theirs"]
        assert await q.depth() == 0 and await q.admitted_to("e") == ["mine"]
        assert await q.active_counts() == {"e": 1}
        await q.enqueue("theirs", b"", num_prompt_tokens=1, now=4.0)  # the id is free again
        await pubsub.aclose()
        await client.aclose()
    run_with_queue(redis_url, body)


def test_admission_rate_counts_recent_admissions(redis_url):
    async def body(q):
        assert await q.admission_rate(10.0) == (0, 0.0)
        for i in range(5):
            await q.enqueue(f"r{i}", b"", num_prompt_tokens=1)
            await q.admit("e", 100)
            await asyncio.sleep(0.02)
        n, age = await q.admission_rate(10.0)
        assert n == 5 and 0.06 <= age < 5.0
        assert (await q.admission_rate(0.001))[0] <= 1
    run_with_queue(redis_url, body)


# --- Property test: the queue matches a plain-Python reference model of the rules. ---

_STEP, _BOOST, _MAX_SKIPS, _MAX_SIZE = 1.0, 4.0, 2, 5

_ids = st.sampled_from([f"id{i}" for i in range(6)])
_ops = st.lists(st.one_of(
    st.tuples(st.just("enqueue"), _ids, st.integers(0, 6), st.integers(1, 60), st.sampled_from([0.0, 0.5, 1.0, 3.0])),
    st.tuples(st.just("admit"), st.integers(0, 70)),
    st.tuples(st.just("release"), _ids),
    st.tuples(st.just("requeue"), _ids),
    st.tuples(st.just("cancel"), _ids),
    st.tuples(st.just("started"), _ids),
), min_size=1, max_size=40)


class _Model:
    def __init__(self):
        self.live = {}  # id -> dict(key=(score, seq), tokens, skips, admitted, reserved)
        self.seq = 0

    def queued(self):
        return sorted((r["key"], rid) for rid, r in self.live.items() if not r["admitted"])

    def admit(self, free):
        # Requests admitted and not yet started hold their tokens of the engine's reported room.
        free -= sum(r["tokens"] for r in self.live.values() if r["reserved"])
        skipped = []
        for _, rid in self.queued():
            r = self.live[rid]
            if r["tokens"] <= free:
                r["admitted"] = r["reserved"] = True
                for s in skipped:
                    self.live[s]["skips"] += 1
                return rid
            if r["skips"] >= _MAX_SKIPS:
                return None
            skipped.append(rid)
        return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_queue_matches_reference_model(redis_url, ops):
    async def body(q):
        model, now = _Model(), 1000.0
        admissions = Counter()  # (id, incarnation) -> times admitted
        requeued = Counter()  # (id, incarnation) -> times put back by requeue
        incarnation = Counter()
        for op in ops:
            kind, args = op[0], op[1:]
            if kind == "enqueue":
                rid, priority, tokens, dt = args
                now += dt
                if rid in model.live:
                    with pytest.raises(DuplicateRequest):
                        await q.enqueue(rid, rid.encode(), priority=priority, num_prompt_tokens=tokens, now=now)
                elif len(model.queued()) >= _MAX_SIZE:
                    with pytest.raises(QueueFull):
                        await q.enqueue(rid, rid.encode(), priority=priority, num_prompt_tokens=tokens, now=now)
                else:
                    model.seq += 1
                    model.live[rid] = {"key": (now - min(priority * _STEP, _BOOST), model.seq), "tokens": tokens,
                                       "skips": 0, "admitted": False, "reserved": False}
                    pos = await q.enqueue(rid, rid.encode(), priority=priority, num_prompt_tokens=tokens, now=now)
                    assert pos == [r for _, r in model.queued()].index(rid)
            elif kind == "admit":
                expected = model.admit(args[0])
                got = await q.admit("e", args[0])
                assert (got.request_id if got else None) == expected
                if got:
                    assert got.payload == got.request_id.encode()
                    assert got.num_prompt_tokens <= args[0]
                    admissions[(got.request_id, incarnation[got.request_id])] += 1
            elif kind == "release":
                rid = args[0]
                assert await q.release(rid) == (rid in model.live)
                if model.live.pop(rid, None) is not None:
                    incarnation[rid] += 1
            elif kind == "requeue":
                rid = args[0]
                was_admitted = rid in model.live and model.live[rid]["admitted"]
                pos = await q.requeue(rid)
                if was_admitted:
                    model.live[rid]["admitted"] = model.live[rid]["reserved"] = False
                    requeued[(rid, incarnation[rid])] += 1
                    assert pos == [r for _, r in model.queued()].index(rid)
                else:
                    assert pos is None
            elif kind == "started":
                rid = args[0]
                was_reserved = rid in model.live and model.live[rid]["reserved"]
                assert await q.started(rid) == was_reserved
                if was_reserved:
                    model.live[rid]["reserved"] = False
            else:  # cancel
                rid = args[0]
                was_queued = rid in model.live and not model.live[rid]["admitted"]
                assert await q.cancel(rid) == was_queued
                if was_queued:
                    del model.live[rid]
                    incarnation[rid] += 1
            queued = [r for _, r in model.queued()]
            assert await q.depth() == len(queued)
            assert await q.queued_tokens() == sum(model.live[r]["tokens"] for r in queued)
            admitted = [r for r, v in model.live.items() if v["admitted"]]
            assert await q.active_counts() == ({"e": len(admitted)} if admitted else {})
            for i, rid in enumerate(queued):
                assert await q.position(rid) == i
            assert sorted(await q.admitted_to("e")) == sorted(r for r, v in model.live.items() if v["admitted"])
        # Admitted at most once per incarnation (enqueue..release), plus once per explicit requeue.
        assert all(n <= 1 + requeued[key] for key, n in admissions.items())
    run_with_queue(redis_url, body, max_queue_size=_MAX_SIZE, max_queue_wait_boost_s=_BOOST,
                   max_skips=_MAX_SKIPS, priority_step_s=_STEP)


def test_enqueue_and_place_is_one_step_and_its_attempt_is_idempotent(redis_url):
    """enqueue_and_place admits at once where an engine has room and otherwise queues; the same
    attempt sent again (a retried script whose reply was lost) reports where its entry stands instead
    of refusing it as a duplicate; another attempt with a live id is a duplicate; a release tagged
    with an attempt forgets only the entry that attempt created."""
    async def body(q):
        room = [EngineRoom("e0", free_tokens=100, max_active=1)]
        placed = await q.enqueue_and_place("a", b"pa", room, num_prompt_tokens=10, attempt="t1")
        assert placed.engine_id == "e0" and placed.position is None and placed.depth == 0
        assert placed.admitted is not None and placed.admitted.request_id == "a" and placed.admitted.payload == b"pa"
        again = await q.enqueue_and_place("a", b"pa", room, num_prompt_tokens=10, attempt="t1")
        assert again.engine_id == "e0" and again.admitted is None  # reported, not admitted twice
        with pytest.raises(DuplicateRequest):
            await q.enqueue_and_place("a", b"pa", room, num_prompt_tokens=10, attempt="t2")
        # e0 is full (max_active 1): the next request waits at the head of the queue.
        waiting = await q.enqueue_and_place("b", b"pb", room, num_prompt_tokens=10, attempt="t3")
        assert waiting.engine_id is None and waiting.position == 0 and waiting.depth == 1 and waiting.admitted is None
        assert not await q.release("a", attempt="t2")  # not the attempt that created "a": left alone
        assert await q.release("a", attempt="t1")
        assert not await q.release("a", attempt="t1")
        # "a"'s slot is free again: placing admits "b".
        admitted = await q.place(room)
        assert admitted is not None and admitted.request_id == "b"
        with pytest.raises(ValueError, match="attempt"):
            await q.enqueue_and_place("c", b"", room, num_prompt_tokens=1, attempt="")
    run_with_queue(redis_url, body)
