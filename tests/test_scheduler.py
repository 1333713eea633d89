"""Scheduler unit tests on fake requests: budgets, FCFS, preemption, no starvation."""
from __future__ import annotations

import random

import pytest

from engine_service.config import EngineConfig
from engine_service.sampling_params import SamplingParams
from engine_service.scheduler import Scheduler
from engine_service.sequence import Request, Sequence, SequenceStatus


def make_config(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, **kw) -> EngineConfig:
    cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                       max_model_len=min(128, num_blocks * block_size),
                       max_num_batched_tokens=max_num_batched_tokens, num_gpu_blocks_override=num_blocks, **kw)
    cfg.finalize(max_position_embeddings=128, kv_bytes_per_block=1)
    return cfg


def make_seq(rid: str, prompt_len: int, max_tokens: int = 8, token_base: int = 0) -> Sequence:
    prompt = [token_base + i for i in range(prompt_len)]
    request = Request(rid, None, prompt, SamplingParams(max_tokens=max_tokens))
    seq = Sequence(request, 0, list(prompt), None)
    request.seqs.append(seq)
    return seq


def run_step(sched: Scheduler, rng: random.Random | None = None, token: int = 7):
    """Schedule, 'compute', and append a sampled token to every sequence that completed."""
    out = sched.schedule()
    cfg = sched.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.seqs) <= cfg.max_num_seqs
    assert len(sched.running) <= cfg.max_num_seqs
    assert len({s.seq_id for s in out.seqs}) == len(out.seqs), "a sequence scheduled twice in one step"
    finished = []
    for seq, n in zip(out.seqs, out.num_new_tokens):
        assert seq.status == SequenceStatus.RUNNING
        assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
        assert len(seq.block_table) * cfg.block_size >= seq.num_computed_tokens + n
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(1000) if rng else token)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                finished.append(seq)
    live = list(sched.running) + list(sched.waiting)
    sched.block_manager.check_invariants(live)
    assert sched.num_waiting_tokens() == sum(s.num_tokens for s in sched.waiting)
    return out, finished


def test_token_budget_and_chunked_prefill():
    sched = Scheduler(make_config(max_num_batched_tokens=16))
    long, short = make_seq("long", 40), make_seq("short", 3)
    sched.add(long)
    sched.add(short)
    out, _ = run_step(sched)
    # The long prompt is chunked to the budget; the short one waits behind it (FCFS).
    assert out.seqs == [long] and out.num_new_tokens == [16]
    out, _ = run_step(sched)
    assert out.seqs == [long] and out.num_new_tokens == [16]
    out, _ = run_step(sched)
    # The last chunk (8) and the short prompt share a step.
    assert dict(zip([s.request.request_id for s in out.seqs], out.num_new_tokens)) == {"long": 8, "short": 3}


def test_decodes_come_before_prefills_and_share_the_step():
    sched = Scheduler(make_config(max_num_batched_tokens=10))
    a = make_seq("a", 4)
    sched.add(a)
    run_step(sched)  # a prefilled, sampled one token
    b = make_seq("b", 30)
    sched.add(b)
    out, _ = run_step(sched)
    assert out.seqs[0] is a and out.num_new_tokens[0] == 1
    assert out.seqs[1] is b and out.num_new_tokens[1] == 9
    out, _ = run_step(sched)
    assert out.seqs[0] is a and out.num_new_tokens[0] == 1, "a long prefill must not stall a running decode"


def test_max_num_seqs_respected_and_fcfs_admission():
    sched = Scheduler(make_config(max_num_seqs=3, max_num_batched_tokens=64))
    seqs = [make_seq(f"r{i}", 4) for i in range(6)]
    for s in seqs:
        sched.add(s)
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.seqs] == ["r0", "r1", "r2"]
    assert [s.request.request_id for s in sched.waiting] == ["r3", "r4", "r5"]


def test_preempts_newest_and_requeues_at_front():
    # 8 blocks of 4 tokens; two sequences of 12 prompt tokens + growth must collide.
    sched = Scheduler(make_config(num_blocks=8, max_num_batched_tokens=64))
    old, new = make_seq("old", 12, max_tokens=30), make_seq("new", 12, max_tokens=30, token_base=100)
    waiting = make_seq("waiting", 4, token_base=200)
    sched.add(old)
    sched.add(new)
    run_step(sched)
    sched.add(waiting)
    preempted = None
    for _ in range(10):
        out, _ = run_step(sched)
        if out.preempted:
            preempted = out.preempted
            break
    assert preempted == [new], "the most recently admitted sequence is preempted"
    assert sched.waiting[0] is new, "a preempted sequence goes back to the FRONT of the queue"
    assert new.num_computed_tokens == 0 and new.block_table == []
    assert sched.num_preemptions == 1


def test_preempted_sequence_resumes_and_finishes():
    sched = Scheduler(make_config(num_blocks=10, max_num_batched_tokens=64))
    seqs = [make_seq(f"r{i}", 10, max_tokens=12, token_base=100 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    done = []
    for _ in range(400):
        _, finished = run_step(sched)
        done += finished
        if not sched.has_unfinished():
            break
    assert sorted(s.request.request_id for s in done) == ["r0", "r1", "r2"]
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 12 for s in seqs)
    assert sched.block_manager.num_free_blocks == 10


def test_prefix_cache_hit_skips_computed_blocks():
    sched = Scheduler(make_config(num_blocks=32, max_num_batched_tokens=64))
    a = make_seq("a", 13, max_tokens=1)
    sched.add(a)
    run_step(sched)  # a finishes: its 3 full blocks stay cached
    b = make_seq("b", 13, max_tokens=1)
    sched.add(b)
    out, _ = run_step(sched)
    assert b.num_cached_tokens == 12
    assert out.num_new_tokens == [1]
    # A fully cached prompt still recomputes its last block (its logits are needed).
    c = make_seq("c", 12, max_tokens=1)
    sched.add(c)
    out, _ = run_step(sched)
    assert c.num_cached_tokens == 8 and out.num_new_tokens == [4]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_randomized_load_every_request_finishes(seed, mode):
    rng = random.Random(seed)
    cfg = make_config(num_blocks=rng.randint(12, 40), block_size=rng.choice([2, 4, 8]),
                      max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(24, 48),
                      preemption_mode=mode, swap_space_bytes=16 if mode == "swap" else 0)
    sched = Scheduler(cfg)
    total = 25
    pending = [make_seq(f"r{i}", rng.randint(1, 20), rng.randint(1, 10), token_base=rng.choice([0, 1000 * i]))
               for i in range(total)]
    admitted_order = []
    done = []
    for _ in range(5000):
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        out, finished = run_step(sched, rng)
        for s in out.seqs:
            if s.request.request_id not in admitted_order:
                admitted_order.append(s.request.request_id)
        done += finished
        if not pending and not sched.has_unfinished():
            break
    assert len(done) == total, f"only {len(done)} of {total} finished: starvation or deadlock"
    # First admission is FCFS by arrival.
    assert admitted_order == sorted(admitted_order, key=lambda r: int(r[1:]))
    assert sched.block_manager.num_free_blocks == cfg.num_kv_blocks
