"""Property tests for the block manager: after any sequence of allocate / append / fork / free /
preempt, no block is leaked or owned twice, reference counts equal the number of owners, and every
sequence reads back exactly its own tokens through its block table (a simulated KV cache checks
prefix sharing and copy-on-write)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_service.block_manager import BlockManager
from engine_service.sampling_params import SamplingParams
from engine_service.sequence import Request, Sequence, SequenceStatus


class Sim:
    """Drives a BlockManager and a fake KV cache (slot -> token) the way the engine would."""

    def __init__(self, num_blocks: int, block_size: int, prefix: bool):
        self.bm = BlockManager(num_blocks, block_size, prefix)
        self.bs = block_size
        self.cache: dict[tuple[int, int], int] = {}
        self.live: list[Sequence] = []  # hold blocks
        self.preempted: list[Sequence] = []  # hold none, wait to be recomputed

    def new_seq(self, tokens: list[int]) -> Sequence:
        req = Request(f"r{len(self.live) + len(self.preempted)}", None, list(tokens), SamplingParams())
        seq = Sequence(req, 0, list(tokens), None)
        req.seqs.append(seq)
        seq.status = SequenceStatus.RUNNING
        return seq

    def compute(self, seq: Sequence, budget: int, sampled: int) -> bool:
        """Schedule up to ``budget`` tokens of ``seq``; write them; sample when complete."""
        computed = self.bm.get_computed_blocks(seq) if seq.num_computed_tokens == 0 else []
        pending = seq.num_tokens - seq.num_computed_tokens - len(computed) * self.bs
        n = max(1, min(budget, pending))
        copies = self.bm.allocate_slots(seq, n, computed)
        if copies is None:
            return False
        for src, dst in copies:
            for off in range(self.bs):
                if (src, off) in self.cache:
                    self.cache[(dst, off)] = self.cache[(src, off)]
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.cache[(seq.block_table[p // self.bs], p % self.bs)] = seq.token_ids[p]
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(sampled)
        return True

    def check(self) -> None:
        self.bm.check_invariants(self.live)
        owned = [b for s in self.live for b in set(s.block_table)]
        assert self.bm.num_free_blocks + len(set(owned)) == self.bm.num_blocks, "a block leaked"
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a sequence holds a block twice"
            assert len(seq.block_table) * self.bs >= seq.num_computed_tokens
            for p in range(seq.num_computed_tokens):
                slot = (seq.block_table[p // self.bs], p % self.bs)
                assert self.cache.get(slot) == seq.token_ids[p], (
                    f"{seq} reads the wrong token at position {p}: shared or copied block is wrong")


ops = st.lists(
    st.tuples(st.sampled_from(["new", "step", "fork", "free", "preempt", "resume"]),
              st.integers(0, 10_000), st.lists(st.integers(1, 2), min_size=1, max_size=14),
              st.integers(1, 12)),
    min_size=1, max_size=60)


@settings(max_examples=250, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]), prefix=st.booleans())
def test_block_manager_properties(ops, num_blocks, block_size, prefix):
    sim = Sim(num_blocks, block_size, prefix)
    for op, pick, tokens, budget in ops:
        if op == "new":
            seq = sim.new_seq(tokens)
            if sim.compute(seq, budget, pick % 3):
                sim.live.append(seq)
            else:
                sim.preempted.append(seq)
        elif op == "step" and sim.live:
            sim.compute(sim.live[pick % len(sim.live)], budget, pick % 3)
        elif op == "fork" and sim.live:
            parent = sim.live[pick % len(sim.live)]
            if parent.num_computed_tokens == parent.num_tokens - 1:  # just sampled, as after a prefill
                child = sim.new_seq(parent.token_ids[:parent.num_prompt_tokens])
                child.token_ids = parent.token_ids[:-1] + [(parent.token_ids[-1] + 1) % 3]
                sim.bm.fork(parent, child)
                sim.live.append(child)
        elif op == "free" and sim.live:
            seq = sim.live.pop(pick % len(sim.live))
            sim.bm.free(seq)
        elif op == "preempt" and sim.live:
            seq = sim.live.pop(pick % len(sim.live))
            sim.bm.free(seq)
            seq.num_computed_tokens = 0
            sim.preempted.append(seq)
        elif op == "resume" and sim.preempted:
            seq = sim.preempted[pick % len(sim.preempted)]
            if sim.compute(seq, budget, pick % 3):
                sim.preempted.remove(seq)
                sim.live.append(seq)
        sim.check()
    for seq in sim.live:
        sim.bm.free(seq)
    sim.live = []
    sim.check()
    assert sim.bm.num_free_blocks == num_blocks


def test_prefix_sharing_refcounts():
    sim = Sim(16, 4, True)
    a = sim.new_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert sim.compute(a, 100, 0)
    sim.live.append(a)
    b = sim.new_seq([1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert sim.compute(b, 100, 0)
    sim.live.append(b)
    # Two full blocks shared, the partial third block private.
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert [sim.bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    assert b.num_computed_tokens == 9 and sim.bm.prefix_hits == 0  # counted by the scheduler
    sim.bm.free(a)
    sim.live.remove(a)
    assert [sim.bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]
    sim.check()


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    sim = Sim(4, 2, True)
    a = sim.new_seq([1, 2, 3, 4, 5])
    assert sim.compute(a, 100, 0)
    a_blocks = list(a.block_table)
    sim.bm.free(a)
    assert sim.bm.num_free_blocks == 4 and len(sim.bm.cached) == 2
    b = sim.new_seq([1, 2, 3, 4, 9])
    computed = sim.bm.get_computed_blocks(b)
    assert computed == a_blocks[:2]
    assert sim.compute(b, 100, 0)
    assert b.block_table[:2] == a_blocks[:2]
    sim.live.append(b)
    sim.check()
    # Filling the pool with other content evicts the cached blocks.
    sim.bm.free(b)
    sim.live = []
    c = sim.new_seq([2, 2, 2, 2, 2, 2, 2])
    assert sim.compute(c, 100, 0)
    sim.live.append(c)
    assert len(sim.bm.cached) == 3
    sim.check()


def test_copy_on_write_for_forks():
    sim = Sim(8, 4, True)
    parent = sim.new_seq([1, 2, 3, 4, 5, 6])  # one full block + a partial one
    assert sim.compute(parent, 100, 7)
    sim.live.append(parent)
    child = sim.new_seq([1, 2, 3, 4, 5, 6])
    child.token_ids = [1, 2, 3, 4, 5, 6, 8]
    sim.bm.fork(parent, child)
    sim.live.append(child)
    assert child.block_table == parent.block_table
    shared_partial = parent.block_table[1]
    assert sim.bm.blocks[shared_partial].ref_count == 2
    assert sim.compute(child, 100, 0)  # writes position 6 into the shared partial block: copy first
    assert child.block_table[1] != shared_partial and child.block_table[0] == parent.block_table[0]
    assert sim.bm.blocks[shared_partial].ref_count == 1
    assert sim.compute(parent, 100, 0)  # the parent is the last owner: writes in place
    assert parent.block_table[1] == shared_partial
    sim.check()
