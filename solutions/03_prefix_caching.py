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
# # Exercise 03 · Prefix caching: an eviction policy that keeps the popular prefixes
#
# Notebook 03's `BlockManager` keeps a finished request's full blocks cached, and when it needs a
# block and no empty one is left, it evicts the **least recently freed** cached block (LRU). That is
# the right choice for a conversation that comes back soon; it is the wrong one for a service whose
# every request starts with the same system prompt, when a burst of long one-off prompts arrives:
# each of them is freed after the system prompt's blocks, so those are evicted first, and the next
# hundred requests compute the system prompt again.
#
# **Your task.** A `BlockManager` with another eviction policy, **LFU** (least frequently used):
# evict the cached free block that was hit the fewest times, the least recently freed among equals.
# Two parts, each checked right below its cell:
#
# 1. counting hits (`_share`) and keeping the cached free blocks in a heap (`_release`);
# 2. evicting by the heap (`_take_free_block`).
#
# Then a random workload, step by step against a slow but obvious version of the same policy, and a
# measurement: the hit rate of LRU and LFU on a system-prompt workload.
#
# **What it assumes.** Notebook 03's prefix caching: `BlockManager` (its chained hashes, ref counts,
# the two free lists: `free_block_ids` for empty blocks, `cached_block_ids` for free blocks that
# keep their KV), `Sequence`. No GPU, no model: a few seconds on a CPU. About 30 minutes.

# %%
import heapq
import random

from minivllm.engine.block_manager import Block, BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.testing import exercise

# %% [markdown]
# ## Where the policy lives
# `BlockManager` touches its free lists in three private methods, and only there; everything else
# (`allocate`, `cache_blocks`, `may_append`, `deallocate`, the hashes) stays as it is:
#
# * `_share(block)`: `allocate` found `block` in the cache (a hit): one more sequence holds it. A
#   free cached block comes back into use: out of `cached_block_ids`.
# * `_release(block)`: a sequence lets go of it; at ref count 0 it is free, into `cached_block_ids`
#   (least recently freed first) if the cache index names it, else emptied into `free_block_ids`.
# * `_take_free_block()`: a block for new KV: an empty one while any is left, else evict the
#   **first** of `cached_block_ids` (`popitem(last=False)`) and drop its name from the index.
#
# LFU changes only the choice in `_take_free_block`. To make it without scanning every cached block,
# keep a **heap** (`heapq`) of `(hits, freed order, block id)` entries, pushed when a block becomes
# cached and free. An entry goes **stale** when its block is hit again (it leaves the cached free
# list) or freed again later (a newer entry exists): instead of removing it from the middle of the
# heap, skip it when it comes to the top. Keep `cached_block_ids` up to date as before: the base
# class counts free blocks with it, and it tells you which blocks are cached and free.
#
# **Hits.** `hits[block_id]` counts the hits of the KV a block holds now: +1 in `_share`, back to 0
# when the block is taken for new KV (empty or evicted).


# %% [markdown]
# ## Part 1 · Counting hits, and the heap
# `reset` is given. Write `_share` and `_release`; reuse the base class's (`super()._share(block)`)
# for the ref counts and free lists.


# %%
class LFUBlockManager(BlockManager):
    """BlockManager whose cache evicts the free block with the fewest hits, the least recently freed
    first."""

    def reset(self) -> None:
        super().reset()
        self.hits = [0] * self.num_blocks  # hits of the KV each block holds now
        self.freed = 0  # a counter: the order in which blocks became cached and free
        # each block's latest freed order; older heap entries are stale
        self.freed_at = [-1] * self.num_blocks
        # (hits, freed order, block id) of cached free blocks
        self.heap: list[tuple[int, int, int]] = []

    def _share(self, block: Block) -> None:
        """A hit: count it, and hold the block (a free cached one leaves the cached free list)."""
        # BEGIN SOLUTION
        self.hits[block.block_id] += 1
        super()._share(block)
        # END SOLUTION

    def _release(self, block: Block) -> None:
        """One holder fewer; a block that becomes free and stays cached gets a heap entry."""
        # BEGIN SOLUTION
        super()._release(block)
        if block.ref_count == 0 and block.block_id in self.cached_block_ids:
            self.freed += 1
            self.freed_at[block.block_id] = self.freed
            heapq.heappush(self.heap, (self.hits[block.block_id], self.freed, block.block_id))
        # END SOLUTION


# %% [markdown]
# ### Check 1 · hits and heap entries
# Blocks of 2. `[1, 2, 9]` is computed and freed: its full block `[1, 2]` is cached and free, with
# no hits. Two requests hit it; each time it is freed again, with one more hit. The heap holds one
# entry per time a block was freed into the cache; only the newest entry of `[1, 2]` is live.

# %%
with exercise("LFUBlockManager._share / _release"):
    bm = LFUBlockManager(num_blocks=6, block_size=2)

    def run(tokens: list[int]) -> Sequence:
        """A request prefilled in one step and finished: its full blocks stay cached."""
        seq = Sequence(tokens, block_size=2)
        bm.allocate(seq)
        bm.cache_blocks(seq, len(seq))
        table = list(seq.block_table)
        bm.deallocate(seq)
        seq.block_table = table  # for the checks: which blocks it used
        return seq

    first = run([1, 2, 9])
    popular = first.block_table[0]
    assert bm.hits[popular] == 0, (
        f"[1, 2] was computed, never hit: hits {bm.hits[popular]}, expected 0"
    )
    assert [e[2] for e in bm.heap] == [popular], (
        f"heap {bm.heap}: expected one entry, for block {popular}"
    )
    for n in (1, 2):
        again = run([1, 2, 4 + n])
        assert again.block_table[0] == popular, (
            f"request {n} after [1, 2, 9] did not hit block {popular}"
        )
        assert bm.hits[popular] == n, (
            f"after {n} hit(s) on [1, 2]: hits {bm.hits[popular]}, expected {n}"
        )
    live = [e for e in bm.heap if e[1] == bm.freed_at[e[2]]]
    assert live == [(2, bm.freed_at[popular], popular)], (
        f"live heap entries {live}: expected [1, 2]'s, 2 hits"
    )
    assert len(bm.heap) == 3, (
        f"{len(bm.heap)} heap entries: [1, 2] was freed into the cache 3 times"
    )
    assert bm.num_cached_free_blocks == 1 and bm.num_free_blocks == 6, (
        f"{bm.num_cached_free_blocks} cached free, {bm.num_free_blocks} free: expected 1 and 6"
    )
print("hits counted; one heap entry per time a block was freed into the cache")

# %% [markdown]
# ## Part 2 · Evicting by the heap
# `_take_free_block`: while `free_block_ids` has a block, the base class's is right (but the block's
# hits start at 0). Else pop heap entries until a live one (its block is still in
# `cached_block_ids`, and the entry's freed order is the block's latest), then evict that block as
# the base class does: out of `cached_block_ids`, its name out of `hash_to_block_id`, `ref_count =
# 1`, no hash, no tokens, and 0 hits.


# %%
def _take_free_block(self: LFUBlockManager) -> Block:
    """A block for new KV: an empty one if any is left, else evict the cached free block with the
    fewest hits."""
    # BEGIN SOLUTION
    if not self.free_block_ids:
        while True:
            _, freed, block_id = heapq.heappop(self.heap)  # fewest hits, then least recently freed
            if block_id in self.cached_block_ids and self.freed_at[block_id] == freed:
                break  # live: older entries of a block freed again, or hit since, are skipped
        del self.cached_block_ids[block_id]
        # the base class takes it from there, empties it and drops its name
        self.free_block_ids.append(block_id)
        block = self.blocks[block_id]
        del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = -1, []
    block = BlockManager._take_free_block(self)
    self.hits[block.block_id] = 0
    return block
    # END SOLUTION


LFUBlockManager._take_free_block = _take_free_block

# %% [markdown]
# ### Check 2 · LFU against LRU, by hand
# Six blocks of 2. `[1, 2]` is hit twice (as in check 1), then a one-off prompt `[7, 8, 0]` leaves
# `[7, 8]` cached, freed *after* `[1, 2]`. A prompt of 5 blocks then takes the 4 empty blocks and
# must evict one cached block: LRU (notebook 03's `BlockManager`) evicts `[1, 2]`, freed first; LFU
# evicts `[7, 8]`, never hit. The next request that starts with `[1, 2]` shows which one stayed.
# Then ties: two blocks without hits go least recently freed first.

# %%
with exercise("LFUBlockManager._take_free_block"):
    for cls, kept in ((BlockManager, "[7, 8]"), (LFUBlockManager, "[1, 2]")):
        bm = cls(num_blocks=6, block_size=2)
        for tokens in ([1, 2, 9], [1, 2, 5], [1, 2, 6], [7, 8, 0]):
            run(tokens)
        flood = Sequence([3] * 9, block_size=2)  # 5 blocks: 4 empty ones, then an eviction
        bm.allocate(flood)
        assert bm.num_cached_free_blocks == 1, (
            f"{cls.__name__}: {bm.num_cached_free_blocks} cached free, expected 1"
        )
        bm.deallocate(flood)
        probe_popular, probe_once = (
            Sequence([1, 2, 3], block_size=2),
            Sequence([7, 8, 3], block_size=2),
        )
        bm.allocate(probe_popular)
        bm.allocate(probe_once)
        got = (
            "[1, 2]"
            if probe_popular.num_cached_tokens
            else "[7, 8]"
            if probe_once.num_cached_tokens
            else "neither"
        )
        assert got == kept, (
            f"{cls.__name__}: after a 5-block prompt evicted one of [1, 2] (hit twice, freed "
            f"first) and [7, 8] (never "
            f"hit, freed last), {got} is still cached; expected {kept}"
        )
        print(f"{cls.__name__:>15}: keeps {kept}")

    bm = LFUBlockManager(num_blocks=4, block_size=2)
    a, b = run([5, 5, 0]), run([6, 6, 0])  # two cached blocks, no hits, [5, 5] freed first
    taken = [bm._take_free_block().block_id for _ in range(4)]
    assert taken[2:] == [a.block_table[0], b.block_table[0]], (
        f"ties (0 hits each): expected [5, 5] (block {a.block_table[0]}, freed first), then [6, "
        f"6] (block "
        f"{b.block_table[0]}) to be evicted after the 2 empty blocks; the order taken was {taken}"
    )
    assert all(bm.hits[i] == 0 and bm.blocks[i].hash == -1 for i in taken), (
        f"blocks taken {taken}: hits {[bm.hits[i] for i in taken]}, hashes "
        f"{[bm.blocks[i].hash for i in taken]}; "
        "a block taken for new KV comes back empty: no hash, 0 hits"
    )
    assert not bm.hash_to_block_id, (
        f"evicted blocks' names must leave the index: {bm.hash_to_block_id}"
    )
print("LFU evicts the block hit least, the least recently freed among equals")

# %% [markdown]
# ## Check 3 · a random workload, against the obvious version
# The policy is easy to state as a scan: evict the first block of `cached_block_ids` (least recently
# freed first) with the fewest hits. That is O(cached blocks) per eviction, too slow for a cache of
# 100,000 blocks, but easy to trust. Random workloads (a popular system prompt, one-off prompts,
# chunked prefills, decode steps, requests that finish) on both, compared after every step: free and
# cached free blocks, each request's hits, which requests share which blocks.


# %%
class ScanLFU(BlockManager):
    """The LFU policy written as a scan over the cached free blocks: slow, obvious."""

    def reset(self) -> None:
        super().reset()
        self.hits = [0] * self.num_blocks

    def _share(self, block: Block) -> None:
        self.hits[block.block_id] += 1
        super()._share(block)

    def _take_free_block(self) -> Block:
        if not self.free_block_ids:
            # the first of the fewest: LRU order
            victim = min(self.cached_block_ids, key=lambda i: self.hits[i])
            del self.cached_block_ids[victim]
            del self.hash_to_block_id[self.blocks[victim].hash]
            self.free_block_ids.append(victim)
        block = super()._take_free_block()
        self.hits[block.block_id] = 0
        return block


def compare(
    ours: LFUBlockManager, ref: ScanLFU, pairs: list[tuple[Sequence, Sequence]], after: str
) -> None:
    for name in ("num_free_blocks", "num_cached_free_blocks"):
        got, expected = getattr(ours, name), getattr(ref, name)
        assert got == expected, f"after {after}: {name} {got}, the scan has {expected}"
    to_ref: dict[int, int] = {}
    for mine, theirs in pairs:
        assert mine.num_cached_tokens == theirs.num_cached_tokens, (
            f"after {after}: a request of {len(mine)} tokens hit {mine.num_cached_tokens} tokens, "
            f"the scan's "
            f"{theirs.num_cached_tokens}: a different block was evicted before it"
        )
        for x, y in zip(mine.block_table, theirs.block_table):
            assert to_ref.setdefault(x, y) == y, (
                f"after {after}: blocks shared differently from the scan"
            )
            assert ours.hits[x] == ref.hits[y], (
                f"after {after}: block {x} has {ours.hits[x]} hits, the scan's {ref.hits[y]}"
            )


def workload(seed: int, num_blocks: int, block_size: int, steps: int) -> int:
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(3 * block_size)]
    ours, ref = LFUBlockManager(num_blocks, block_size), ScanLFU(num_blocks, block_size)
    live: list[tuple[Sequence, Sequence]] = []
    hits = 0
    for step in range(steps):
        r = rng.random()
        if r < 0.35 or not live:  # a new request: half start with a piece of the system prompt
            head = system[: rng.randint(0, len(system))] if rng.random() < 0.5 else []
            tokens = head + [rng.randrange(3) for _ in range(rng.randint(1, 3 * block_size))]
            pair = Sequence(tokens, block_size=block_size), Sequence(tokens, block_size=block_size)
            if not (ours.can_allocate(pair[0]) and ref.can_allocate(pair[1])):
                continue
            for bm, seq in zip((ours, ref), pair):
                bm.allocate(seq)
                bm.cache_blocks(seq, len(seq))  # prefilled in this step
            live.append(pair)
            hits += pair[1].num_cached_tokens
            after = f"step {step}, allocate({tokens})"
        elif r < 0.8:  # a decode step
            pair = rng.choice(live)
            token = rng.randrange(3)
            for seq in pair:
                seq.append_token(token)
            after = f"step {step}, may_append({pair[0].token_ids})"
            if ours.can_append(pair[0]) and ref.can_append(pair[1]):
                for bm, seq in zip((ours, ref), pair):
                    bm.may_append(seq)
            else:  # no block for it: preempted
                ours.deallocate(pair[0])
                ref.deallocate(pair[1])
                live.remove(pair)
                after = f"step {step}, deallocate({pair[0].token_ids}), preempted"
        else:  # a request finishes
            pair = live.pop(rng.randrange(len(live)))
            ours.deallocate(pair[0])
            ref.deallocate(pair[1])
            after = f"step {step}, deallocate({pair[0].token_ids})"
        compare(ours, ref, live, after)
    return hits


with exercise("LFUBlockManager"):
    caches = [(6, 1), (10, 2), (16, 2), (24, 4), (12, 3)]  # (num_blocks, block_size)
    for seed, (num_blocks, block_size) in enumerate(caches):
        hits = workload(seed, num_blocks, block_size, steps=2000)
        print(
            f"{num_blocks:3d} blocks of {block_size}: 2,000 steps, {hits} tokens hit, the same as "
            f"the scan"
        )

# %% [markdown]
# ## How much it keeps
# A service whose requests start with one 64-token system prompt, in a cache of 24 blocks of 16
# tokens; after every three of them come two long one-off documents (250 to 300 tokens: 16 to 19
# blocks). Requests run one at a time, each prefilled and finished. The fraction of system-prompt
# tokens found in the cache, by policy:


# %%
def system_prompt_hit_rate(cls: type[BlockManager], requests: int = 400, seed: int = 0) -> float:
    rng = random.Random(seed)
    bm = cls(num_blocks=24, block_size=16)
    system = [rng.randrange(1000) for _ in range(64)]
    hit = wanted = 0
    for n in range(requests):
        one_off = n % 5 >= 3
        tokens = [
            rng.randrange(1000)
            for _ in range(rng.randint(250, 300) if one_off else rng.randint(5, 40))
        ]
        seq = Sequence(tokens if one_off else system + tokens, block_size=16)
        bm.allocate(seq)
        bm.cache_blocks(seq, len(seq))
        if not one_off:
            hit, wanted = hit + min(seq.num_cached_tokens, 64), wanted + 64
        bm.deallocate(seq)
    return hit / wanted


for cls in (BlockManager, LFUBlockManager):
    print(
        f"{cls.__name__:>15}: {system_prompt_hit_rate(cls):.0%} of the system prompt's tokens "
        f"found in the cache"
    )

# %% [markdown]
# ## Check yourself
# * LFU has a known failure: a block hit a thousand times yesterday is never evicted today, even if
#   nobody asks for it any more. What would you change? (Two common answers: halve every count now
#   and then, "aging"; or count only recent hits, as in LRU-K or ARC, which keep a second list of
#   recently evicted names.)
# * Why does the heap hold an entry per time a block was freed, instead of updating an entry in
#   place? (A binary heap cannot find an entry without a scan; skipping stale ones costs O(log n)
#   each, and each is pushed once.)
