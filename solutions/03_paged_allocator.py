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
# # Exercise 03 · A paged block allocator that forks: copy-on-write
#
# Notebook 03's `BlockManager` hands out fixed-size KV blocks (paging) and shares the blocks of
# equal prefixes (prefix caching). There is a third kind of sharing it does not do: **forking**. A
# request for `n = 4` completions of one prompt, or a beam search, runs four sequences that are
# identical up to now; they should hold one copy of the prompt's KV, not four. Each fork shares its
# parent's whole block table, and the first time one of them writes into a block that others still
# hold, it gets its own copy of that block first: **copy-on-write**, as an operating system forks a
# process.
#
# **Your task.** Fill in `SimpleBlockManager`: a pool of `num_blocks` block ids with a ref count
# each, of which a sequence holds `seq.num_blocks` in `seq.block_table` (logical block *i* →
# physical block id). Two parts, each checked by hand in the cell after it: admitting and freeing
# sequences (the warm-up: notebook 03's paging, with ref counts), then forking and decoding with
# copy-on-write. Then a random workload (a hypothesis property test that tracks what every slot of
# the cache holds) and a step-by-step comparison with minivllm's `BlockManager(...,
# enable_prefix_caching=False)` check the whole allocator.
#
# **What it assumes.** Notebook 03's `Sequence`: `token_ids`, `num_tokens`, `block_size`,
# `num_blocks` (the blocks its tokens need, rounded up), `block_table` and `append_token`. No GPU,
# no model: a few seconds on a CPU. About 30 minutes.

# %% [markdown]
# ## The contract
#
# The scheduler (notebook 05) talks to the allocator in five calls, the same as `BlockManager`'s:
#
# * `can_allocate(seq)`, then `allocate(seq)`, when a waiting sequence is admitted for prefill: it
#   needs a block for each of its `seq.num_blocks` blocks, the last one possibly partial. Asking
#   first lets the scheduler try another request instead of failing.
# * `can_append(seq)`, then `may_append(seq)`, **after** the scheduler appended a newly decoded
#   token (`seq.append_token`). Why only "may"? A block holds `block_size` tokens, so a decode step
#   needs a new block only when its token is the first of a block: once every `block_size` steps. In
#   between, the new token goes into the free slots of the last block. That is the whole point of
#   paging: at most one partly empty block per sequence, instead of a region reserved for the
#   longest possible output.
# * `deallocate(seq)` when a sequence finishes, or is preempted to make room: all its blocks become
#   free and its block table is empty again.
#
# `num_free_blocks` tells the scheduler (and the checks) how many blocks are left. Forking adds one
# call:
#
# * `fork(parent, child)`: `child` (a new `Sequence` with the parent's tokens) shares every block of
#   the parent.
#
# and changes `may_append`: it returns the **copies** the model runner must make before the step, a
# list of `(source block, destination block)` pairs, so that the new token's K and V are written
# into a block that no other sequence reads.
#
# **Data structures.** Any free block will do, since all blocks are the same size: a `deque` of free
# ids gives one in O(1), and `ref_counts[block_id]` counts the sequences whose table holds it (0:
# free). Every call then costs time in proportion to the blocks it touches, never to the size of the
# cache.
#
# **Hint.** "The newest token starts a new block" is the same as "the table is one block short":
# `len(seq.block_table) < seq.num_blocks`. (A test like `num_tokens % block_size == 1` looks
# equivalent, but check it with `block_size = 1`.)

# %% [markdown]
# ## Part 1 · Admitting and freeing sequences
# The pool, and the calls around a sequence's life: `num_free_blocks`, `_take_block` (one free
# block, its ref count now 1), `can_allocate` and `allocate` at admission, `deallocate` when it
# finishes or is preempted: one holder fewer for each of its blocks, and a block that nobody holds
# any more goes back to the free pool.

# %%
from collections import deque

from minivllm.engine.sequence import Sequence
from minivllm.testing import exercise


class SimpleBlockManager:
    """Fixed-size KV blocks for sequences: paging, and forks that share blocks until they write."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks  # sequences whose block table holds each block; 0 = free

    @property
    def num_free_blocks(self) -> int:
        # BEGIN SOLUTION
        return len(self.free_block_ids)
        # END SOLUTION

    def _take_block(self) -> int:
        """Take one block from the free pool: its ref count becomes 1. Returns its id."""
        # BEGIN SOLUTION
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0, f"block {block_id} is free and used at once"
        self.ref_counts[block_id] = 1
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
        assert seq.block_size == self.block_size, (
            f"sequence block_size {seq.block_size} != {self.block_size}"
        )
        assert self.can_allocate(seq), "allocate() without room: ask can_allocate() first"
        seq.block_table.extend(self._take_block() for _ in range(seq.num_blocks))
        # END SOLUTION

    def deallocate(self, seq: Sequence) -> None:
        """A finished or preempted sequence lets go of its blocks (free once nobody holds them); its
        table empties."""
        # BEGIN SOLUTION
        assert seq.block_table, f"sequence {seq.seq_id} holds no blocks (freed twice?)"
        for block_id in seq.block_table:
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed more often than taken"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        # END SOLUTION


# %% [markdown]
# ### Check 1 · by hand
# Blocks of 4 tokens, a cache of 4 blocks. A prompt of exactly one block takes one block; one token
# more takes a second, whose other three slots stay empty for the tokens to come. A prompt of 9
# tokens (3 blocks) no longer fits; once the others are freed, 16 tokens fit and 17 do not.

# %%
with exercise("SimpleBlockManager"):
    bm = SimpleBlockManager(num_blocks=4, block_size=4)
    assert bm.num_free_blocks == 4, f"a new manager of 4 blocks has {bm.num_free_blocks} free"

    one_block = Sequence([1, 2, 3, 4], block_size=4)
    assert bm.can_allocate(one_block), (
        "4 free blocks, and a 4-token prompt needs 1: can_allocate said no"
    )
    bm.allocate(one_block)
    assert len(one_block.block_table) == 1, (
        f"a 4-token prompt got {len(one_block.block_table)} blocks, expected 1"
    )
    assert bm.num_free_blocks == 3, f"{bm.num_free_blocks} free after taking 1 of 4, expected 3"

    one_past = Sequence([1, 2, 3, 4, 5], block_size=4)
    bm.allocate(one_past)
    assert len(one_past.block_table) == 2, (
        f"a 5-token prompt got {len(one_past.block_table)} blocks, expected 2"
    )
    assert bm.num_free_blocks == 1, f"{bm.num_free_blocks} free after taking 3 of 4, expected 1"
    shared = set(one_block.block_table) & set(one_past.block_table)
    assert not shared, f"two sequences share block(s) {shared}"
    assert not bm.can_allocate(Sequence(list(range(9)), block_size=4)), (
        "9 tokens need 3 blocks; 1 is free"
    )
    print(
        "after two prompts:",
        one_block.block_table,
        one_past.block_table,
        "free:",
        bm.num_free_blocks,
    )

    bm.deallocate(one_past)
    assert one_past.block_table == [], (
        f"a freed sequence's table should be empty, is {one_past.block_table}"
    )
    assert bm.num_free_blocks == 3, (
        f"{bm.num_free_blocks} free after freeing 2 blocks of 3 used, expected 3"
    )
    bm.deallocate(one_block)
    assert bm.num_free_blocks == 4, (
        f"{bm.num_free_blocks} free after freeing everything, expected 4"
    )
    assert bm.can_allocate(Sequence(list(range(16)), block_size=4)), (
        "16 tokens fit in 4 free blocks of 4"
    )
    assert not bm.can_allocate(Sequence(list(range(17)), block_size=4)), (
        "17 tokens need 5 blocks of 4; 4 exist"
    )
print("allocate and deallocate: blocks taken and given back as expected")

# %% [markdown]
# ## Part 2 · Forking and decoding, copy-on-write
# `fork(parent, child)`: the child's table becomes a copy of the parent's *list* (the same block
# ids), and each of those blocks has one holder more. No block is taken: a fork is free until
# someone writes.
#
# `can_append` and `may_append` are called after `seq.append_token`. The new token's K and V go into
# slot `len(seq) - 1`, so:
#
# * the token **starts a new block** (the table is one block short, `len(seq.block_table) <
#   seq.num_blocks`): take a block, no copy, whoever holds the earlier blocks;
# * else it goes into the **last block**. If this sequence is its only holder, nothing to do. If
#   others hold it too, writing there would change their KV: take a fresh block, let go of the
#   shared one (one holder fewer), put the fresh one in the table, and return `[(shared, fresh)]`:
#   the runner copies the shared block's KV (the tokens before the new one) into the fresh block
#   before the step writes the new token.
#
# `can_append` says whether a block is free in case either needs one. (Python lets us add the
# methods to the class from this cell; in a module they would be in the class body.)


# %%
def fork(self: SimpleBlockManager, parent: Sequence, child: Sequence) -> None:
    """child (a new sequence with parent's tokens) shares all of parent's blocks."""
    # BEGIN SOLUTION
    assert not child.block_table and child.token_ids == parent.token_ids, (
        "fork into a new copy of the parent"
    )
    child.block_table = list(parent.block_table)
    for block_id in parent.block_table:
        self.ref_counts[block_id] += 1
    # END SOLUTION


def can_append(self: SimpleBlockManager, seq: Sequence) -> bool:
    """After append_token: is there a free block in case the new token needs one (a new block, or a
    copy)?"""
    # BEGIN SOLUTION
    new_block = len(seq.block_table) < seq.num_blocks
    needs_block = new_block or self.ref_counts[seq.block_table[-1]] > 1
    return self.num_free_blocks >= needs_block
    # END SOLUTION


def may_append(self: SimpleBlockManager, seq: Sequence) -> list[tuple[int, int]]:
    """After append_token: a new block when the token starts one; a private copy of a shared last
    block. Returns the (source, destination) block copies to make before the step writes the
    token."""
    # BEGIN SOLUTION
    assert seq.block_table and seq.num_blocks - len(seq.block_table) in (0, 1), (
        "call after each append_token"
    )
    if len(seq.block_table) < seq.num_blocks:
        seq.block_table.append(self._take_block())
        return []
    shared = seq.block_table[-1]
    if self.ref_counts[shared] == 1:
        return []
    fresh = self._take_block()
    self.ref_counts[shared] -= 1  # others still hold it: it stays in use
    seq.block_table[-1] = fresh
    return [(shared, fresh)]
    # END SOLUTION


SimpleBlockManager.fork = fork
SimpleBlockManager.can_append = can_append
SimpleBlockManager.may_append = may_append

# %% [markdown]
# ### Check 2 · by hand
# Decoding into a 4-token prompt, in a cache of 3 blocks of 4 where another prompt holds one block:
# its 5th token is the first of a new block, so it takes one; tokens 6 to 8 fill that block and take
# none; the 9th would need a third block, and the cache is full. Then blocks of 1 token: every token
# takes a block.
#
# Then forks: a 5-token prompt in blocks of 4 (block 0 full, block 1 holding one token), forked
# twice. The parent's 6th token goes into block 1, which the forks still hold: the parent gets a
# copy. The first fork's 7th token: the second fork still holds block 1, so a copy again. The second
# fork's 8th: block 1 is its alone now, no copy. And a token that starts a new block never copies,
# however shared the blocks before it are.

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
        assert fits == expected, (
            f"token {token} of blocks of 4, {bm.num_free_blocks} free: can_append said {fits}"
        )
        if fits:
            bm.may_append(seq)
        blocks = len(seq.block_table)
        assert blocks == 2, f"after token {token} the sequence holds {blocks} blocks, expected 2"
        assert bm.num_free_blocks == 0, (
            f"after token {token}: {bm.num_free_blocks} free blocks, expected 0"
        )
        print(f"token {token}: block table {seq.block_table}, free {bm.num_free_blocks}")

    bm.deallocate(other)  # the scheduler preempts the other sequence: now the 9th token fits
    assert bm.can_append(seq), "one block is free and token 9 needs one: can_append said no"
    bm.may_append(seq)
    assert len(seq.block_table) == 3, (
        f"after token 9 the sequence holds {len(seq.block_table)} blocks, expected 3"
    )

    bm = SimpleBlockManager(num_blocks=3, block_size=1)
    seq = Sequence([1], block_size=1)
    bm.allocate(seq)
    for token in (2, 3):
        seq.append_token(token)
        assert bm.can_append(seq), (
            f"block_size=1, token {token}: a block is free, can_append said no"
        )
        bm.may_append(seq)
        assert len(seq.block_table) == token, (
            f"block_size=1: {len(seq.block_table)} blocks for {token} tokens"
        )
    seq.append_token(4)
    assert not bm.can_append(seq), "block_size=1, token 4: every block is used, can_append said yes"

    bm = SimpleBlockManager(num_blocks=5, block_size=4)
    parent = Sequence([1, 2, 3, 4, 5], block_size=4)
    bm.allocate(parent)
    forks = [Sequence(parent.token_ids, block_size=4) for _ in range(2)]
    for child in forks:
        bm.fork(parent, child)
    b0, b1 = parent.block_table
    assert all(child.block_table == [b0, b1] for child in forks), (
        f"forks' tables {[c.block_table for c in forks]}"
    )
    assert all(child.block_table is not parent.block_table for child in forks), (
        "a fork needs a table of its own"
    )
    assert bm.num_free_blocks == 3, f"forks take no block: {bm.num_free_blocks} free, expected 3"
    appends = [(parent, 6, 3), (forks[0], 7, 2), (forks[1], 8, 1)]  # (sequence, token, holders)
    for seq, token, holders in appends:
        seq.append_token(token)
        assert bm.can_append(seq), f"token {token}: a block is free, can_append said no"
        free, copies = bm.num_free_blocks, bm.may_append(seq)
        if holders > 1:
            assert copies == [(b1, seq.block_table[1])] and seq.block_table[1] != b1, (
                f"token {token} goes into block {b1}, which {holders} sequences hold: expected a "
                f"private copy, "
                f"[({b1}, the fresh block)], got copies {copies} and table {seq.block_table}"
            )
            assert bm.num_free_blocks == free - 1, f"token {token}: the copy takes one block"
        else:
            assert copies == [] and seq.block_table == [b0, b1], (
                f"token {token} goes into block {b1}, held by this sequence alone: no copy "
                f"expected, got copies "
                f"{copies}, table {seq.block_table}"
            )
        assert seq.block_table[0] == b0, (
            f"token {token}: block 0 ({b0}) is full and shared; it must stay shared"
        )
    assert bm.ref_counts[b0] == 3 and bm.ref_counts[b1] == 1, (
        f"ref counts: block {b0} (held by all three) {bm.ref_counts[b0]}, block {b1} "
        f"{bm.ref_counts[b1]}"
    )

    bm = SimpleBlockManager(num_blocks=3, block_size=4)
    parent, child = Sequence([1, 2, 3, 4], block_size=4), Sequence([1, 2, 3, 4], block_size=4)
    bm.allocate(parent)
    bm.fork(parent, child)
    parent.append_token(5)  # starts block 1: nothing to copy
    assert bm.may_append(parent) == [] and len(parent.block_table) == 2, (
        "a token that starts a block copies nothing"
    )
    child.append_token(6)
    bm.may_append(child)
    assert bm.num_free_blocks == 0 and parent.block_table[1] != child.block_table[1], (
        "two new blocks, one each"
    )
    other = Sequence([9, 9], block_size=4)
    bm.deallocate(child)
    bm.allocate(other)  # the last free block
    forked = Sequence(other.token_ids, block_size=4)
    bm.fork(other, forked)
    forked.append_token(3)
    assert not bm.can_append(forked), (
        "the fork's token must be written into a copy, and no block is free: can_append"
    )
print(
    "can_append / may_append / fork: a block every block_size tokens, and a copy before writing a "
    "shared block"
)


# %% [markdown]
# ## Check 3 · a property test
# Hand examples test the cases we thought of. A property test draws hundreds of random workloads
# (new prompts, forks, decode steps, finished or preempted sequences, in any order, with any block
# size) and checks after every step what must always hold:
#
# * each block's ref count is the number of live tables that hold it, and the free blocks are the
#   others;
# * each live sequence's table has exactly `seq.num_blocks` entries;
# * **every sequence reads its own tokens**: the test keeps what each slot of the cache holds (a
#   prompt's tokens written at admission, the copies `may_append` asks for, then each new token in
#   its slot), and reads every sequence's tokens back through its table. A block written while
#   another sequence still held it shows here.
#
# When it fails, hypothesis shrinks the workload to a short one that still fails, and prints it.

# %%
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

NEW, APPEND, FREE, FORK = "new", "append", "free", "fork"
operations = st.lists(
    st.one_of(
        st.tuples(st.just(NEW), st.integers(1, 12)),  # a prompt of that many tokens
        st.tuples(
            st.just(APPEND), st.integers(0, 10**6)
        ),  # decode one token into a random live sequence
        st.tuples(st.just(FREE), st.integers(0, 10**6)),  # a random live sequence finishes
        st.tuples(st.just(FORK), st.integers(0, 10**6)),  # a random live sequence is forked
    ),
    max_size=60,
)


def write(cache: dict[int, int], seq: Sequence, positions: range) -> None:
    """Store seq's tokens at these positions into their slots (what the model's forward does with
    their KV)."""
    for t in positions:
        cache[seq.block_table[t // seq.block_size] * seq.block_size + t % seq.block_size] = (
            seq.token_ids[t]
        )


def check_invariants(
    bm: SimpleBlockManager, live: list[Sequence], num_blocks: int, cache: dict[int, int]
) -> None:
    held = Counter(block_id for seq in live for block_id in seq.block_table)
    for block_id in range(num_blocks):
        assert bm.ref_counts[block_id] == held[block_id], (
            f"block {block_id}: ref count {bm.ref_counts[block_id]}, held by {held[block_id]} "
            f"live tables"
        )
    assert bm.num_free_blocks + len(held) == num_blocks, (
        f"free {bm.num_free_blocks} + used {len(held)} != {num_blocks}"
    )
    for seq in live:
        assert len(seq.block_table) == seq.num_blocks, (
            f"{seq.num_tokens} tokens in {len(seq.block_table)} blocks"
        )
        size = seq.block_size
        slots = [seq.block_table[t // size] * size + t % size for t in range(len(seq))]
        read = [cache.get(slot) for slot in slots]
        assert read == seq.token_ids, (
            f"sequence {seq.seq_id} reads {read} through its table {seq.block_table}, but its "
            f"tokens are "
            f"{seq.token_ids}: a block it shares was written by another sequence (copy before "
            f"writing)"
        )


# one failure, shrunk, rather than an ExceptionGroup of several (which Jupyter shows as text, not as
# an error)
@settings(max_examples=300, deadline=None, database=None, report_multiple_bugs=False)
@given(ops=operations, num_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
def test_allocator(ops, num_blocks, block_size):
    bm = SimpleBlockManager(num_blocks, block_size)
    live: list[Sequence] = []
    cache: dict[int, int] = {}  # slot -> the token whose KV it holds
    for op, arg in ops:
        if op == NEW:
            seq = Sequence([(arg * 7 + i) % 100 for i in range(arg)], block_size=block_size)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                write(cache, seq, range(len(seq)))
                live.append(seq)
            else:
                assert bm.num_free_blocks < seq.num_blocks, (
                    "can_allocate refused with room to spare"
                )
        elif op == FORK and live:
            parent = live[arg % len(live)]
            child = Sequence(parent.token_ids, block_size=block_size)
            bm.fork(parent, child)
            live.append(child)
        elif op == APPEND and live:
            seq = live[arg % len(live)]
            seq.append_token(arg % 100)
            if bm.can_append(seq):
                # the runner's copies, then the step writes the new token
                for src, dst in bm.may_append(seq):
                    for offset in range(block_size):
                        if src * block_size + offset in cache:
                            cache[dst * block_size + offset] = cache[src * block_size + offset]
                write(cache, seq, range(len(seq) - 1, len(seq)))
            else:  # no room for its next block or its copy: preempt it, as the scheduler would
                assert bm.num_free_blocks == 0, (
                    f"can_append refused with {bm.num_free_blocks} free blocks"
                )
                last_shared = (
                    len(seq.block_table) == seq.num_blocks
                    and bm.ref_counts[seq.block_table[-1]] > 1
                )
                assert len(seq.block_table) < seq.num_blocks or last_shared, (
                    "can_append refused a token that goes into a block of its own"
                )
                bm.deallocate(seq)
                live.remove(seq)
        elif op == FREE and live:
            seq = live.pop(arg % len(live))
            bm.deallocate(seq)
            assert seq.block_table == [], (
                f"a freed sequence's table should be empty, is {seq.block_table}"
            )
        check_invariants(bm, live, num_blocks, cache)
    for seq in live:
        bm.deallocate(seq)
    assert bm.num_free_blocks == num_blocks, (
        f"{num_blocks - bm.num_free_blocks} blocks leaked after freeing all"
    )


with exercise("SimpleBlockManager"):
    test_allocator()
print("property test passed: 300 random workloads with forks; every sequence reads its own tokens")

# %% [markdown]
# ## Check 4 · the same answers as minivllm's BlockManager
# Without forks, nothing is shared, and with prefix caching off notebook 03's `BlockManager` is a
# paged allocator too, so on the same workload it must agree with yours at every step: the same
# admission and append decisions, the same number of blocks per sequence, the same number of free
# blocks. (Which physical ids each one picks may differ, and does not matter.) Each request is a
# pair of `Sequence`s with the same tokens, one per allocator, since the table lives on the
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
                f"{len(prompt)}-token prompt, {ref.num_free_blocks} free blocks: can_allocate "
                f"says {fits}, "
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
                f"token {pair[0].num_tokens}, {ref.num_free_blocks} free blocks: can_append says "
                f"{fits}, "
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
                f"{a.num_tokens} tokens: {len(a.block_table)} blocks in yours, "
                f"{len(b.block_table)} in BlockManager's"
            )
    return admitted


with exercise("SimpleBlockManager"):
    for num_blocks, block_size in [(8, 1), (16, 4), (64, 16), (32, 3)]:
        admitted = cross_check(num_blocks, block_size, steps=3000, seed=num_blocks + block_size)
        print(
            f"{num_blocks:3d} blocks of {block_size:2d}: {admitted} admitted, same as "
            f"BlockManager at every step"
        )

# %% [markdown]
# ## What's next
# * The copies are the model runner's job: before the step, `k_cache[dst] = k_cache[src]` and the
#   same for `v_cache`, in every layer, for each pair `may_append` returned (vLLM batches them into
#   one `copy_blocks` kernel).
# * Notebook 03's `BlockManager` shares blocks another way, across *requests*: a chained hash names
#   each full block by everything before it, so a new request with the same prefix finds the blocks.
#   Your ref counts are the same as its ref counts; its free list keeps freed blocks' KV around,
#   least recently freed evicted first. With both, a block shared by a fork may also be named in the
#   cache: which of your rules would have to change?
