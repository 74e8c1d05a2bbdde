"""BlockManager (notebook 03): edge cases, and a hypothesis state machine over allocate / chunked prefill / append /
free / preempt.

The state machine keeps a shadow model of the KV cache: for every physical block, the token prefix whose KV
was last written into it. A sequence must only ever read blocks whose shadow equals its own prefix, which is
what "the engine produces the right tokens" means for the block manager.
"""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import minivllm.engine.block_manager as block_manager
from minivllm.engine.block_manager import BlockManager, compute_hash
from minivllm.engine.sequence import Sequence, SequenceStatus


def allocate(bm: BlockManager, tokens: list[int]) -> Sequence:
    """Allocate, then cache the full blocks, as a step that prefills the whole prompt does."""
    seq = Sequence(tokens, block_size=bm.block_size)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))
    return seq


def decode(bm: BlockManager, seq: Sequence, token: int = 0) -> None:
    seq.append_token(token)
    assert bm.can_append(seq)
    bm.may_append(seq)


# ---------------------------------------------------------------- edge cases


def test_prompt_of_exactly_one_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = allocate(bm, [1, 2, 3, 4])
    assert a.block_table == [0] and bm.blocks[0].hash != -1  # full, so cached at once
    b = allocate(bm, [1, 2, 3, 4])
    assert b.num_cached_tokens == 0 and b.block_table == [1]  # the last token is always computed
    decode(bm, a)
    assert a.block_table == [0, 2] and a.last_block_num_tokens == 1  # the 5th token opens a block


def test_allocate_caches_nothing_until_its_kv_is_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(9)), block_size=4)
    bm.allocate(a)
    assert all(block.hash == -1 for block in bm.blocks)
    assert allocate(bm, list(range(9))).num_cached_tokens == 0  # nothing to hit yet
    bm.cache_blocks(a, 9)
    assert [bm.blocks[i].hash != -1 for i in a.block_table] == [True, True, False]


def test_a_request_only_hits_the_chunks_already_computed():
    """A prompt prefilled in chunks: a request sharing its prefix must not hit blocks a later chunk computes.
    (Caching every full prompt block at allocate would give it 16 cached tokens after the first chunk.)"""
    bm = BlockManager(num_blocks=16, block_size=4)
    long = Sequence(list(range(1, 18)), block_size=4)  # 4 full blocks + 1 token
    bm.allocate(long)

    def hit_tokens() -> int:  # what a request with the same first 16 tokens would find now
        seq = Sequence(list(range(1, 17)) + [0], block_size=4)
        bm.allocate(seq)
        hit = seq.num_cached_tokens
        bm.deallocate(seq)
        return hit

    for end, expected in ((6, 4), (13, 12), (17, 16)):  # chunks 0..5, 6..12, 13..16
        bm.cache_blocks(long, end)
        long.num_cached_tokens = end  # the scheduler records it once the step has run
        assert hit_tokens() == expected


def test_cache_blocks_twice_is_an_assertion():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = allocate(bm, list(range(5)))
    with pytest.raises(AssertionError, match="being computed"):
        bm.cache_blocks(a, 5)  # a's num_cached_tokens was not advanced: block 0 is cached already


def test_one_token_past_a_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = allocate(bm, [1, 2, 3, 4, 5])
    assert a.block_table == [0, 1] and a.last_block_num_tokens == 1 and bm.blocks[1].hash == -1
    b = allocate(bm, [1, 2, 3, 4, 5])
    assert b.num_cached_tokens == 4 and b.block_table == [0, 2] and bm.blocks[0].ref_count == 2


def test_fully_cached_prompt_recomputes_its_last_block_in_a_fresh_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = allocate(bm, list(range(8)))
    b = allocate(bm, list(range(8)))
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1] and bm.blocks[a.block_table[1]].ref_count == 1
    c = allocate(bm, list(range(9)))  # longer: now the second block hits too
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table


def test_full_cache():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = allocate(bm, list(range(12)))  # all three blocks
    seq = Sequence([1], block_size=4)
    assert not bm.can_allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 0  # nothing changed
    a.append_token(0)
    assert not bm.can_append(a)  # the 13th token needs a block and none is free
    bm.deallocate(a)
    assert bm.num_free_blocks == 3


def test_can_append_needs_no_free_block_inside_the_last_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = allocate(bm, [1, 2, 3, 4, 5])
    assert bm.num_free_blocks == 0
    for token in (6, 7, 8):
        decode(bm, a, token)  # fills block 1 without needing another
    a.append_token(9)
    assert not bm.can_append(a)


def test_double_free_is_an_assertion():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = allocate(bm, [1, 2, 3, 4, 5])
    bm.deallocate(a)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.deallocate(a)
    assert bm.num_free_blocks == 4


def test_freed_blocks_keep_their_hash_and_are_reused_last():
    bm = BlockManager(num_blocks=5, block_size=2)
    a = allocate(bm, [1, 2, 3, 4, 5])  # blocks 0, 1 full and cached, block 2 partial
    bm.deallocate(a)
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 5
    b = allocate(bm, [9, 9, 9])  # takes empty blocks first
    assert not {0, 1} & set(b.block_table) and bm.num_cached_free_blocks == 2
    c = allocate(bm, [1, 2, 3, 4, 6])  # so the earlier prompt still hits
    assert c.num_cached_tokens == 4 and c.block_table[:2] == [0, 1]


def test_eviction_takes_the_least_recently_freed_block_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = allocate(bm, [1, 1, 0])
    old_block = old.block_table[0]
    bm.deallocate(old)  # its full block stays cached, its partial block is empty again
    new = allocate(bm, [2, 2, 0])
    new_block = new.block_table[0]
    bm.deallocate(new)
    assert list(bm.cached_block_ids) == [old_block, new_block] and len(bm.free_block_ids) == 2
    big = allocate(
        bm, [3, 3, 3, 3, 3]
    )  # 3 blocks: both empty ones, then the least recently freed cached one
    assert old_block in big.block_table and list(bm.cached_block_ids) == [new_block]
    bm.deallocate(big)
    assert (
        allocate(bm, [2, 2, 5]).num_cached_tokens == 2
        and allocate(bm, [1, 1, 5]).num_cached_tokens == 0
    )


def test_a_sequence_frees_its_tail_first_so_the_shared_head_is_evicted_last():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = allocate(bm, [1, 2, 3, 4, 5, 6])
    bm.deallocate(a)
    assert list(bm.cached_block_ids) == [2, 1, 0]


def test_same_tokens_after_a_different_prefix_do_not_hit():
    bm = BlockManager(num_blocks=8, block_size=2)
    allocate(bm, [1, 1, 7, 7, 0])
    b = allocate(bm, [7, 7, 0])  # [7, 7] is cached, but after [1, 1]: its KV is not what b needs
    assert b.num_cached_tokens == 0


def test_a_hash_collision_is_caught_by_the_stored_tokens(monkeypatch):
    monkeypatch.setattr(block_manager, "compute_hash", lambda token_ids, parent_hash=-1: 42)
    bm = BlockManager(num_blocks=8, block_size=2)
    allocate(bm, [1, 1, 0])
    b = allocate(bm, [2, 2, 0])
    assert b.num_cached_tokens == 0 and b.block_table[0] != 0


def test_preempted_sequence_is_recomputed_mostly_from_its_own_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = allocate(bm, list(range(6)))
    for token in range(3):
        decode(bm, a, 100 + token)  # 9 tokens: blocks 0 and 1 full
    table = list(a.block_table)
    bm.deallocate(a)
    a.status = SequenceStatus.WAITING
    bm.allocate(a)
    assert a.num_cached_tokens == 8 and a.block_table[:2] == table[:2]
    assert a.completion_token_ids == [100, 101, 102]


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = allocate(bm, [1, 2, 3, 4, 5])
    b = allocate(bm, [1, 2, 3, 4, 5])
    decode(bm, a)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert all(block.hash == -1 for block in bm.blocks) and not bm.hash_to_block_id
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 8


def test_block_size_one():
    bm = BlockManager(num_blocks=8, block_size=1)
    a = allocate(bm, [5, 6, 7])
    decode(bm, a, 8)
    assert len(a.block_table) == 4 and all(bm.blocks[b].hash != -1 for b in a.block_table)
    b = allocate(bm, [5, 6, 9])
    assert b.num_cached_tokens == 2


def test_reset_forgets_every_allocation_and_every_cached_prefix():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = allocate(bm, [1, 2, 3, 4, 5])
    bm.deallocate(allocate(bm, [7, 7, 8]))
    assert bm.num_used_blocks == 3 and bm.num_cached_free_blocks == 1
    bm.blocks[
        a.block_table[0]
    ].ref_count = 7  # half-updated bookkeeping, as a failed step may leave it
    bm.free_block_ids.append(a.block_table[1])
    bm.reset()
    assert (
        bm.num_free_blocks == bm.num_blocks == 6 and bm.num_used_blocks == 0 and bm.num_slots == 12
    )
    assert (
        not bm.hash_to_block_id
        and not bm.cached_block_ids
        and list(bm.free_block_ids) == list(range(6))
    )
    assert all(block.ref_count == 0 and block.hash == -1 for block in bm.blocks)
    assert allocate(bm, [1, 2, 3, 4, 5]).num_cached_tokens == 0  # the prefix is gone


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(AssertionError, match="block_size"):
        BlockManager(num_blocks=4, block_size=16).allocate(Sequence([1], block_size=8))


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_chained_hash_tells_prefixes_apart(first, other, block):
    h = compute_hash(block, compute_hash(first))
    assert h == compute_hash(list(block), compute_hash(list(first)))
    assert (h == compute_hash(block, compute_hash(other))) == (first == other)


def test_benchmark_runs():
    from minivllm.benchmarks.block_manager import run_benchmark

    row = run_benchmark(num_blocks=512, num_seqs=40, block_size=16, prompt_len=64, decode_steps=8)
    assert row["hit_rate"] > 0.5 and row["allocate_us"] > 0


# ---------------------------------------------------------------- random interleavings

PREFIXES = [(), (0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 1, 1), (2, 2, 2, 2), (1, 2, 0, 1, 2, 0, 1, 2)]
prompts = st.builds(
    lambda prefix, suffix: list(prefix) + suffix,
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 2), min_size=1, max_size=9),
)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / free / preempt over prompts from a 3-token vocabulary, many of them sharing
    prefixes, so equal blocks after different prefixes are common."""

    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, False]),
        first=st.lists(prompts, min_size=1, max_size=4),
    )
    def setup(self, num_blocks, block_size, caching, first):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.waiting = [Sequence(tokens, block_size=block_size) for tokens in first]
        self.running: list[Sequence] = []
        self.kv: dict[
            int, tuple[int, ...]
        ] = {}  # block id -> the token prefix whose KV was last written there

    def prefix_of(self, seq: Sequence, i: int, end: int | None = None) -> tuple[int, ...]:
        """The tokens whose KV block i of seq holds once its first `end` tokens (default: all) are computed."""
        return tuple(
            seq.token_ids[: min((i + 1) * self.bm.block_size, len(seq) if end is None else end)]
        )

    @rule(tokens=prompts)
    def add_request(self, tokens):
        self.waiting.append(Sequence(tokens, block_size=self.bm.block_size))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def allocate(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        if not self.bm.can_allocate(seq):
            assert self.bm.num_free_blocks < seq.num_blocks
            return
        self.bm.allocate(seq)
        bs = self.bm.block_size
        assert seq.num_cached_tokens % bs == 0 and seq.num_cached_tokens < len(seq)
        for i, block_id in enumerate(
            seq.block_table[: seq.num_cached_blocks]
        ):  # hits: this prefix's KV, computed
            assert self.bm.blocks[block_id].token_ids == seq.block(i)
            assert self.kv[block_id] == self.prefix_of(seq, i), (
                "a hit on KV of another prefix, or not computed yet"
            )
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.compute_chunk(data, seq)

    @precondition(lambda self: any(seq.num_cached_tokens < len(seq) for seq in self.running))
    @rule(data=st.data())
    def continue_prefill(self, data):
        self.compute_chunk(
            data,
            data.draw(st.sampled_from([s for s in self.running if s.num_cached_tokens < len(s)])),
        )

    def compute_chunk(self, data, seq: Sequence) -> None:
        """One prefill step for seq: a chunk of its uncomputed tokens (all of them, or fewer)."""
        end = data.draw(st.integers(seq.num_cached_tokens + 1, len(seq)))
        self.bm.cache_blocks(seq, end)
        for i in range(seq.num_cached_tokens // self.bm.block_size, -(-end // self.bm.block_size)):
            self.kv[seq.block_table[i]] = self.prefix_of(
                seq, i, end
            )  # the step writes the chunk's KV
        seq.num_cached_tokens = end

    @precondition(lambda self: any(seq.num_cached_tokens == len(seq) for seq in self.running))
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from([s for s in self.running if s.num_cached_tokens == len(s)]))
        seq.append_token(token)
        if not self.bm.can_append(seq):  # out of blocks: the scheduler preempts it
            assert self.bm.num_free_blocks == 0 and seq.last_block_num_tokens == 1
            self.evict(seq, SequenceStatus.WAITING)
            return
        self.bm.may_append(seq)
        self.kv[seq.block_table[-1]] = self.prefix_of(
            seq, seq.num_blocks - 1
        )  # decode writes the new token
        seq.num_cached_tokens = len(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self.evict(data.draw(st.sampled_from(self.running)), SequenceStatus.FINISHED)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.evict(data.draw(st.sampled_from(self.running)), SequenceStatus.WAITING)

    def evict(self, seq: Sequence, status: SequenceStatus) -> None:
        self.bm.deallocate(seq)
        assert seq.block_table == [] and seq.num_cached_tokens == 0
        self.running.remove(seq)
        seq.status = status
        if status == SequenceStatus.WAITING:
            self.waiting.append(seq)

    @invariant()
    def ref_counts_match_block_tables(self):
        holders = Counter(block_id for seq in self.running for block_id in seq.block_table)
        for block in self.bm.blocks:
            assert block.ref_count == holders[block.block_id], f"block {block.block_id}"

    @invariant()
    def free_and_used_partition_the_blocks(self):
        bm = self.bm
        free = list(bm.free_block_ids) + list(bm.cached_block_ids)
        used = {block.block_id for block in bm.blocks if block.ref_count > 0}
        assert len(free) == len(set(free)), "a block is on a free list twice"
        assert not used & set(free), "a block is free and used at once"
        assert len(free) + len(used) == len(bm.blocks) == bm.num_free_blocks + bm.num_used_blocks
        if not self.running:
            assert bm.num_free_blocks == len(bm.blocks), "blocks leaked"

    @invariant()
    def cache_index_is_consistent(self):
        bm = self.bm
        for h, block_id in bm.hash_to_block_id.items():
            assert bm.blocks[block_id].hash == h
        for block_id in bm.cached_block_ids:
            assert bm.hash_to_block_id[bm.blocks[block_id].hash] == block_id
        for block_id in bm.free_block_ids:
            assert bm.blocks[block_id].hash == -1
        if not bm.enable_prefix_caching:
            assert not bm.hash_to_block_id and not bm.cached_block_ids

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        for seq in self.running:
            assert (
                len(seq.block_table) == seq.num_blocks
                and len(set(seq.block_table)) == seq.num_blocks
            )
            computed = seq.num_cached_tokens
            for i, block_id in enumerate(seq.block_table[: -(-computed // self.bm.block_size)]):
                assert self.kv[block_id] == self.prefix_of(seq, i, computed), (
                    f"seq {seq.seq_id} block {i}"
                )
            if (
                seq.last_block_num_tokens < self.bm.block_size
            ):  # a block still being written is never shared
                assert self.bm.blocks[seq.block_table[-1]].ref_count == 1

    def teardown(self):
        for seq in list(self.running):
            self.evict(seq, SequenceStatus.FINISHED)
        if hasattr(self, "bm"):
            assert self.bm.num_free_blocks == len(self.bm.blocks), "blocks leaked"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=500, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
