# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Exercise 03 · A paged block allocator, without prefix caching
#
# Notebook 03's `BlockManager` does two jobs at once: it hands out fixed-size KV blocks (paging), and it shares
# the blocks of equal prefixes between requests (prefix caching: hashes, ref counts, two free lists). Paging alone
# is what removes the fragmentation of contiguous allocation, and it is small enough to write in a few lines. Write
# it first; the prefix cache is then "only" a smarter way to pick and give back blocks.
#
# **Your task.** Fill in `SimpleBlockManager`: a pool of `num_blocks` block ids, of which a sequence holds
# `seq.num_blocks` in `seq.block_table` (logical block *i* → physical block id) while it runs. Two parts, each
# checked by hand in the cell after it: admitting and freeing sequences, then decoding. Then a random workload (a
# hypothesis property test) and a step-by-step comparison with minivllm's
# `BlockManager(..., enable_prefix_caching=False)` check the whole allocator.
#
# **What it assumes.** Notebook 03's `Sequence`: `token_ids`, `num_tokens`, `block_size`, `num_blocks` (the
# blocks its tokens need, rounded up), `block_table` and `append_token`. No GPU, no model: a few seconds on a CPU.

# %% [markdown]
# ## The contract
#
# The scheduler (notebook 05) talks to the allocator in five calls, the same as `BlockManager`'s:
#
# * `can_allocate(seq)`, then `allocate(seq)`, when a waiting sequence is admitted for prefill: it needs a block
#   for each of its `seq.num_blocks` blocks, the last one possibly partial. Asking first lets the scheduler try
#   another request instead of failing.
# * `can_append(seq)`, then `may_append(seq)`, **after** the scheduler appended a newly decoded token
#   (`seq.append_token`). Why only "may"? A block holds `block_size` tokens, so a decode step needs a new block
#   only when its token is the first of a block: once every `block_size` steps. In between, the new token goes
#   into the free slots of the last block. That is the whole point of paging: at most one partly empty block per
#   sequence, instead of a region reserved for the longest possible output.
# * `deallocate(seq)` when a sequence finishes, or is preempted to make room: all its blocks become free and its
#   block table is empty again.
#
# `num_free_blocks` tells the scheduler (and the checks) how many blocks are left.
#
# **Data structures.** Any free block will do, since all blocks are the same size: a `deque` of free ids gives
# one in O(1), and a set of used ids catches a block given out twice. Every call then costs time in proportion
# to the blocks it touches, never to the size of the cache.
#
# **Hint.** "The newest token starts a new block" is the same as "the table is one block short":
# `len(seq.block_table) < seq.num_blocks`. (A test like `num_tokens % block_size == 1` looks equivalent, but check
# it with `block_size = 1`.)

# %% [markdown]
# ## Part 1 · Admitting and freeing sequences
# The pool, and the calls around a sequence's life: `num_free_blocks`, `_take_block` (one block from the free pool
# into the used set), `can_allocate` and `allocate` at admission, `deallocate` when it finishes or is preempted.

# %%
from collections import deque

from minivllm.engine.sequence import Sequence
from minivllm.testing import exercise


class SimpleBlockManager:
    """Fixed-size KV blocks for sequences: paging only, every block belongs to at most one sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        # BEGIN SOLUTION
        return len(self.free_block_ids)
        # END SOLUTION

    def _take_block(self) -> int:
        """Move one block from the free pool to the used set and return its id."""
        # BEGIN SOLUTION
        block_id = self.free_block_ids.popleft()
        assert block_id not in self.used_block_ids, f"block {block_id} is free and used at once"
        self.used_block_ids.add(block_id)
        return block_id
        # END SOLUTION

    def can_allocate(self, seq: Sequence) -> bool:
        """Are there enough free blocks for all of a waiting sequence's tokens?"""
        # BEGIN SOLUTION
        return self.num_free_blocks >= seq.num_blocks
        # END SOLUTION

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence (empty block table) one block per `seq.num_blocks`."""
        # BEGIN SOLUTION
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        assert seq.block_size == self.block_size, f"sequence block_size {seq.block_size} != {self.block_size}"
        assert self.can_allocate(seq), "allocate() without room: ask can_allocate() first"
        seq.block_table.extend(self._take_block() for _ in range(seq.num_blocks))
        # END SOLUTION

    def deallocate(self, seq: Sequence) -> None:
        """Give all of a finished or preempted sequence's blocks back; its block table becomes empty."""
        # BEGIN SOLUTION
        assert seq.block_table, f"sequence {seq.seq_id} holds no blocks (freed twice?)"
        for block_id in seq.block_table:
            self.used_block_ids.remove(block_id)
            self.free_block_ids.append(block_id)
        seq.block_table.clear()
        # END SOLUTION


# %% [markdown]
# ### Check 1 · by hand
# Blocks of 4 tokens, a cache of 4 blocks. A prompt of exactly one block takes one block; one token more takes a
# second, whose other three slots stay empty for the tokens to come. A prompt of 9 tokens (3 blocks) no longer
# fits; once the others are freed, 16 tokens fit and 17 do not.

# %%
with exercise("SimpleBlockManager"):
    bm = SimpleBlockManager(num_blocks=4, block_size=4)
    assert bm.num_free_blocks == 4, f"a new manager of 4 blocks has {bm.num_free_blocks} free"

    one_block = Sequence([1, 2, 3, 4], block_size=4)
    assert bm.can_allocate(one_block), "4 free blocks, and a 4-token prompt needs 1: can_allocate said no"
    bm.allocate(one_block)
    assert len(one_block.block_table) == 1, f"a 4-token prompt got {len(one_block.block_table)} blocks, expected 1"
    assert bm.num_free_blocks == 3, f"{bm.num_free_blocks} free after taking 1 of 4, expected 3"

    one_past = Sequence([1, 2, 3, 4, 5], block_size=4)
    bm.allocate(one_past)
    assert len(one_past.block_table) == 2, f"a 5-token prompt got {len(one_past.block_table)} blocks, expected 2"
    assert bm.num_free_blocks == 1, f"{bm.num_free_blocks} free after taking 3 of 4, expected 1"
    shared = set(one_block.block_table) & set(one_past.block_table)
    assert not shared, f"two sequences share block(s) {shared}"
    assert not bm.can_allocate(Sequence(list(range(9)), block_size=4)), "9 tokens need 3 blocks; 1 is free"
    print("after two prompts:", one_block.block_table, one_past.block_table, "free:", bm.num_free_blocks)

    bm.deallocate(one_past)
    assert one_past.block_table == [], f"a freed sequence's table should be empty, is {one_past.block_table}"
    assert bm.num_free_blocks == 3, f"{bm.num_free_blocks} free after freeing 2 blocks of 3 used, expected 3"
    bm.deallocate(one_block)
    assert bm.num_free_blocks == 4, f"{bm.num_free_blocks} free after freeing everything, expected 4"
    assert bm.can_allocate(Sequence(list(range(16)), block_size=4)), "16 tokens fit in 4 free blocks of 4"
    assert not bm.can_allocate(Sequence(list(range(17)), block_size=4)), "17 tokens need 5 blocks of 4; 4 exist"
print("allocate and deallocate: blocks taken and given back as expected")

# %% [markdown]
# ## Part 2 · Decoding
# `can_append` and `may_append` are called after `seq.append_token`: a new block exactly when the newest token
# starts one. (Python lets us add the two methods to the class from this cell; in a module they would be in the
# class body.)


# %%
def can_append(self: SimpleBlockManager, seq: Sequence) -> bool:
    """After append_token: is there a free block in case the new token starts one?"""
    # BEGIN SOLUTION
    needs_block = len(seq.block_table) < seq.num_blocks
    return self.num_free_blocks >= needs_block
    # END SOLUTION


def may_append(self: SimpleBlockManager, seq: Sequence) -> None:
    """After append_token: a new block exactly when the newest token starts one."""
    # BEGIN SOLUTION
    assert seq.block_table and seq.num_blocks - len(seq.block_table) in (0, 1), "call after each append_token"
    if len(seq.block_table) < seq.num_blocks:
        seq.block_table.append(self._take_block())
    # END SOLUTION


SimpleBlockManager.can_append = can_append
SimpleBlockManager.may_append = may_append

# %% [markdown]
# ### Check 2 · by hand
# Decoding into a 4-token prompt, in a cache of 3 blocks of 4 where another prompt holds one block: its 5th token
# is the first of a new block, so it takes one; tokens 6 to 8 fill that block and take none; the 9th would need a
# third block, and the cache is full. Then blocks of 1 token: every token takes a block.

# %%
with exercise("can_append / may_append"):
    bm = SimpleBlockManager(num_blocks=3, block_size=4)
    seq, other = Sequence([1, 2, 3, 4], block_size=4), Sequence([1], block_size=4)
    bm.allocate(seq)
    bm.allocate(other)
    for token in range(5, 10):
        seq.append_token(token)
        fits = bm.can_append(seq)
        expected = token != 9  # token 9 starts block 3, and no block is free
        assert fits == expected, f"token {token} of blocks of 4, {bm.num_free_blocks} free: can_append said {fits}"
        if fits:
            bm.may_append(seq)
        blocks = len(seq.block_table)
        assert blocks == 2, f"after token {token} the sequence holds {blocks} blocks, expected 2"
        assert bm.num_free_blocks == 0, f"after token {token}: {bm.num_free_blocks} free blocks, expected 0"
        print(f"token {token}: block table {seq.block_table}, free {bm.num_free_blocks}")

    bm.deallocate(other)  # the scheduler preempts the other sequence: now the 9th token fits
    assert bm.can_append(seq), "one block is free and token 9 needs one: can_append said no"
    bm.may_append(seq)
    assert len(seq.block_table) == 3, f"after token 9 the sequence holds {len(seq.block_table)} blocks, expected 3"

    bm = SimpleBlockManager(num_blocks=3, block_size=1)
    seq = Sequence([1], block_size=1)
    bm.allocate(seq)
    for token in (2, 3):
        seq.append_token(token)
        assert bm.can_append(seq), f"block_size=1, token {token}: a block is free, can_append said no"
        bm.may_append(seq)
        assert len(seq.block_table) == token, f"block_size=1: {len(seq.block_table)} blocks for {token} tokens"
    seq.append_token(4)
    assert not bm.can_append(seq), "block_size=1, token 4: every block is used, can_append said yes"
print("can_append / may_append: a block every block_size tokens, none in between")


# %% [markdown]
# ## Check 3 · a property test
# Hand examples test the cases we thought of. A property test draws hundreds of random workloads (new prompts,
# decode steps, finished or preempted sequences, in any order, with any block size) and checks after every step
# what must always hold:
#
# * every block is either free or in exactly one live sequence's table (free + used = total, no block twice);
# * each live sequence's table has exactly `seq.num_blocks` entries: no block too few, none wasted;
# * after everything is freed, every block is free again.
#
# When it fails, hypothesis shrinks the workload to a short one that still fails, and prints it.

# %%
from hypothesis import given, settings
from hypothesis import strategies as st

NEW, APPEND, FREE = "new", "append", "free"
operations = st.lists(
    st.one_of(
        st.tuples(st.just(NEW), st.integers(1, 12)),  # a prompt of that many tokens
        st.tuples(st.just(APPEND), st.integers(0, 10**6)),  # decode one token into a random live sequence
        st.tuples(st.just(FREE), st.integers(0, 10**6)),  # a random live sequence finishes
    ),
    max_size=60,
)


def check_invariants(bm: SimpleBlockManager, live: list[Sequence], num_blocks: int) -> None:
    tables = [block_id for seq in live for block_id in seq.block_table]
    assert len(tables) == len(set(tables)), f"a block is in two tables: {[s.block_table for s in live]}"
    assert all(0 <= b < num_blocks for b in tables), f"block id out of range: {tables}"
    assert bm.num_free_blocks + len(tables) == num_blocks, (
        f"free {bm.num_free_blocks} + used {len(tables)} != {num_blocks}"
    )
    for seq in live:
        assert len(seq.block_table) == seq.num_blocks, f"{seq.num_tokens} tokens in {len(seq.block_table)} blocks"


# one failure, shrunk, rather than an ExceptionGroup of several (which Jupyter shows as text, not as an error)
@settings(max_examples=300, deadline=None, database=None, report_multiple_bugs=False)
@given(ops=operations, num_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
def test_allocator(ops, num_blocks, block_size):
    bm = SimpleBlockManager(num_blocks, block_size)
    live: list[Sequence] = []
    for op, arg in ops:
        if op == NEW:
            seq = Sequence(list(range(arg)), block_size=block_size)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live.append(seq)
            else:
                assert bm.num_free_blocks < seq.num_blocks, "can_allocate refused with room to spare"
        elif op == APPEND and live:
            seq = live[arg % len(live)]
            seq.append_token(arg)
            if bm.can_append(seq):
                bm.may_append(seq)
            else:  # no room for its next block: preempt it, as the scheduler would
                assert bm.num_free_blocks == 0, f"can_append refused with {bm.num_free_blocks} free blocks"
                assert len(seq.block_table) < seq.num_blocks, "can_append refused a token that needs no block"
                bm.deallocate(seq)
                live.remove(seq)
        elif op == FREE and live:
            seq = live.pop(arg % len(live))
            bm.deallocate(seq)
            assert seq.block_table == [], f"a freed sequence's table should be empty, is {seq.block_table}"
        check_invariants(bm, live, num_blocks)
    for seq in live:
        bm.deallocate(seq)
    assert bm.num_free_blocks == num_blocks, f"{num_blocks - bm.num_free_blocks} blocks leaked after freeing all"


with exercise("SimpleBlockManager"):
    test_allocator()
print("property test passed: 300 random workloads")

# %% [markdown]
# ## Check 4 · the same answers as minivllm's BlockManager
# With prefix caching off, notebook 03's `BlockManager` is a paged allocator too, so on the same workload it must
# agree with yours at every step: the same admission and append decisions, the same number of blocks per
# sequence, the same number of free blocks. (Which physical ids each one picks may differ, and does not matter.)
# Each request is a pair of `Sequence`s with the same tokens, one per allocator, since the table lives on the
# sequence.

# %%
import random

from minivllm.engine.block_manager import BlockManager


def cross_check(num_blocks: int, block_size: int, steps: int, seed: int) -> int:
    rng = random.Random(seed)
    ours, ref = (
        SimpleBlockManager(num_blocks, block_size),
        BlockManager(num_blocks, block_size, enable_prefix_caching=False),
    )
    live: list[tuple[Sequence, Sequence]] = []
    admitted = 0
    for _ in range(steps):
        r = rng.random()
        if r < 0.3 or not live:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 4 * block_size))]
            pair = Sequence(prompt, block_size=block_size), Sequence(prompt, block_size=block_size)
            fits, ref_fits = ours.can_allocate(pair[0]), ref.can_allocate(pair[1])
            assert fits == ref_fits, (
                f"{len(prompt)}-token prompt, {ref.num_free_blocks} free blocks: can_allocate says {fits}, "
                f"BlockManager {ref_fits}"
            )
            if fits:
                ours.allocate(pair[0])
                ref.allocate(pair[1])
                live.append(pair)
                admitted += 1
        elif r < 0.9:
            pair = rng.choice(live)
            token = rng.randrange(1000)
            for seq in pair:
                seq.append_token(token)
            fits, ref_fits = ours.can_append(pair[0]), ref.can_append(pair[1])
            assert fits == ref_fits, (
                f"token {pair[0].num_tokens}, {ref.num_free_blocks} free blocks: can_append says {fits}, "
                f"BlockManager {ref_fits}"
            )
            if fits:
                ours.may_append(pair[0])
                ref.may_append(pair[1])
            else:  # preempt
                ours.deallocate(pair[0])
                ref.deallocate(pair[1])
                live.remove(pair)
        else:
            pair = live.pop(rng.randrange(len(live)))
            ours.deallocate(pair[0])
            ref.deallocate(pair[1])
        assert ours.num_free_blocks == ref.num_free_blocks, (
            f"free blocks: {ours.num_free_blocks} vs {ref.num_free_blocks}"
        )
        for a, b in live:
            assert len(a.block_table) == len(b.block_table) == a.num_blocks, (
                f"{a.num_tokens} tokens: {len(a.block_table)} blocks in yours, {len(b.block_table)} in BlockManager's"
            )
    return admitted


with exercise("SimpleBlockManager"):
    for num_blocks, block_size in [(8, 1), (16, 4), (64, 16), (32, 3)]:
        admitted = cross_check(num_blocks, block_size, steps=3000, seed=num_blocks + block_size)
        print(f"{num_blocks:3d} blocks of {block_size:2d}: {admitted} admitted, same as BlockManager at every step")

# %% [markdown]
# ## What's next
# Your allocator never reuses KV: two requests with the same 1,000-token system prompt compute and store it twice.
# Notebook 03's `BlockManager` keeps your structure (a free `deque`, blocks per sequence) and adds three things to
# share such prefixes: a chained hash that names each full block by everything before it, a ref count per block
# (a shared block is free only when its last user leaves), and a second free list that keeps freed blocks' KV
# around, least recently freed evicted first.
