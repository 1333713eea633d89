"""KV block manager (PagedAttention): one pool of fixed-size blocks, reference counted.

A sequence's ``block_table`` maps its logical blocks to physical ones. Blocks are taken from the
pool as tokens are appended and given back the moment a sequence finishes, is aborted or is
preempted. With prefix caching, every full block is registered under a hash chained over the
whole prefix; a freed block keeps its contents and registration until the pool reuses it, so a
later request with the same prefix takes it back instead of recomputing it. Forked sequences
(``n > 1``) share blocks by reference; the shared partial last block is copied on the first write.
"""
from __future__ import annotations

from collections import OrderedDict

from engine_service.sequence import Sequence

_ROOT_HASH = hash("pagoda-prefix-root")


class Block:
    __slots__ = ("block_id", "ref_count", "key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        # (parent hash, token ids) when registered in the prefix cache. The tuple is the dict key,
        # so a hit compares the block's token ids exactly, not just a hash.
        self.key: tuple[int, tuple[int, ...]] | None = None


class BlockManager:
    """Allocates KV blocks to sequences: ``can_allocate`` / ``allocate_slots`` / ``fork`` / ``free``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first: the eviction order.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[tuple[int, tuple[int, ...]], int] = {}
        self.free_swap_blocks = list(range(num_swap_blocks))
        # Prefix-cache hit rate: prompt tokens of admitted sequences, and how many were hits.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------

    def _block_key(self, seq: Sequence, i: int) -> tuple[int, tuple[int, ...]]:
        bs = self.block_size
        parent = seq.block_hashes[i - 1] if i else _ROOT_HASH
        return parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        while len(seq.block_hashes) < num_full_blocks:
            seq.block_hashes.append(hash(self._block_key(seq, len(seq.block_hashes))))

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Physical blocks already holding this sequence's leading full blocks (no refs taken).

        At least the last token is always left to compute, since its logits are needed; hits are
        whole blocks so that a shared block is never written again.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        self._extend_hashes(seq, max_blocks)
        for i in range(max_blocks):
            block_id = self.cached.get(self._block_key(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.key is None:
                key = self._block_key(seq, i)
                # Keep the first copy when two sequences computed the same content.
                if self.cached.setdefault(key, block.block_id) == block.block_id:
                    block.key = key
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    # ---- allocation ---------------------------------------------------------------------------

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, computed: list[int]) -> int:
        have = len(seq.block_table) + len(computed)
        num_computed = seq.num_computed_tokens + len(computed) * self.block_size
        need = max(0, self.blocks_for(num_computed + num_new_tokens) - have)
        if (num_new_tokens and num_computed % self.block_size
                and self.blocks[seq.block_table[num_computed // self.block_size]].ref_count > 1):
            need += 1  # copy-on-write of the shared partial last block
        # Cached-but-free blocks we revive leave the free pool too.
        return need + sum(1 for b in computed if self.blocks[b].ref_count == 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[int] = ()) -> bool:
        return self._num_new_blocks(seq, num_new_tokens, list(computed)) <= self.num_free_blocks

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:
            # Evict its prefix-cache registration: its contents are about to be overwritten.
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key = None
        block.ref_count = 1
        return block_id

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[int] = ()) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` more tokens of ``seq``, after taking ``computed``
        prefix-cache hits. Returns the (src, dst) block copies to perform before the forward,
        or None (changing nothing) when the pool has too few free blocks."""
        if self._num_new_blocks(seq, num_new_tokens, list(computed)) > self.num_free_blocks:
            return None
        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if computed:
            seq.num_computed_tokens = len(seq.block_table) * self.block_size
        copies = []
        bs = self.block_size
        if num_new_tokens and seq.num_computed_tokens % bs:
            # The partly written block (not always the last one: a rejected speculative draft can
            # leave a block beyond it) is copied before it is written if someone else shares it.
            i = seq.num_computed_tokens // bs
            last = self.blocks[seq.block_table[i]]
            if last.ref_count > 1:
                new_id = self._take_free_block()
                last.ref_count -= 1
                seq.block_table[i] = new_id
                copies.append((last.block_id, new_id))
        total = seq.num_computed_tokens + num_new_tokens
        for _ in range(self.blocks_for(total) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching:
            # Only blocks of the sequence's own tokens: speculative drafts beyond them may be rejected.
            self._register_full_blocks(seq, min(total, seq.num_tokens))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's blocks by reference (copy-on-write on the next write)."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks at zero return to the pool (tail blocks first,
        so the end of a prefix is evicted before its start)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    # ---- swap preemption ----------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_swap_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's KV to host blocks; returns (device block, host block) copies."""
        mapping = [(b, self.free_swap_blocks.pop()) for b in seq.block_table]
        self.free(seq)
        seq.block_table = [host for _, host in mapping]
        return mapping

    def can_swap_in(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back; returns (host block, device block) copies."""
        mapping = [(host, self._take_free_block()) for host in seq.block_table]
        self.free_swap_blocks.extend(host for host, _ in mapping)
        seq.block_table = [dev for _, dev in mapping]
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        self.free_swap_blocks.extend(seq.block_table)
        seq.block_table = []

    # ---- invariants (tests and debug mode) ----------------------------------------------------

    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Every block is either free or referenced exactly ref_count times by live sequences."""
        refs = [0] * self.num_blocks
        for seq in live_seqs:
            if seq.status.name == "SWAPPED":
                continue
            for b in seq.block_table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]} owners")
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks), (
                f"block {block.block_id}: ref_count {block.ref_count} but free={block.block_id in self.free_blocks}")
        for key, block_id in self.cached.items():
            assert self.blocks[block_id].key == key, f"cached block {block_id} lost its key"
