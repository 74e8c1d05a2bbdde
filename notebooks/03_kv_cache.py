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
# # 03 · KV cache: paged blocks, prefix caching, and the kernels that read them
#
# **What this notebook builds.** PagedAttention, both halves: the bookkeeping (`Sequence`, one
# request, and a `BlockManager` that hands out fixed-size KV blocks and shares equal prefixes
# between requests: prefix caching), and the Triton kernels that follow a block table (a store of
# new keys and values, and a decode kernel).
#
# **What it assumes.** Notebook 01: attention at position *t* needs the keys and values (KV) of
# every earlier token, kept per layer in a *KV cache*; its FlashAttention kernel, which the paged
# kernels reuse. Notebook 02's `SamplingParams`. The block manager sees token ids only: ours are
# random.
#
# **What you will see.** Prefix-cache hits block by block; "why does PagedAttention reduce
# fragmentation?", in numbers; why decode needs its own attention kernel. Two optional deep dives
# follow: `deep_dives/cascade_attention` (rows sharing a prefix read it once) and
# `deep_dives/paged_prefill` (the prefill kernel after a cache hit).

# %%
import json
import os
from pathlib import Path

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)

# %% [markdown]
# ## Why the KV cache is the memory problem
# Every token of every running request keeps a key and a value vector per layer and KV head. For
# Qwen3-0.6B (28 layers, 8 KV heads of 128 dimensions, bfloat16) that is:

# %%
num_layers, num_kv_heads, head_dim, dtype_bytes = 28, 8, 128, 2
kv_bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes  # K and V
max_model_len = 40_960  # Qwen3-0.6B's context length
seq_bytes = max_model_len * kv_bytes_per_token
print(
    f"KV per token: {kv_bytes_per_token / 2**10:.0f} KiB; one sequence at full context: "
    f"{seq_bytes / 2**30:.1f} GiB"
)
full_context_seqs = int((141e9 - 1.2e9) // seq_bytes)
print(f"sequences an H200 (141 GB, ~1.2 GB of weights) holds at full context: {full_context_seqs}")

# %% [markdown]
# A request does not know how long it will run. Before vLLM, engines reserved one *contiguous* KV
# region per request, big enough for the longest possible sequence: most of it sits empty, and the
# worst case sets how many requests fit (the batch size, hence the throughput). **Paging** is the
# operating-system answer: cut the cache into *blocks* of `block_size` token slots, give a request a
# block only when it needs one, and keep a per-request *block table* from its logical block *i* to a
# physical block anywhere. The kernels find token *t* at slot:

# %%
# logical block i -> physical block; token 37: block 2, offset 5
block_size, block_table, t = (16, [7, 2, 9], 37)
slot = block_table[t // block_size] * block_size + t % block_size
print(f"token {t} -> physical block {block_table[t // block_size]}, slot {slot}")

# %% [markdown]
# ## Sequence: one request and where its KV lives
# What the scheduler and the block manager pass around: **token ids** (prompt, then completion), a
# **status** (*waiting*, *running* with KV blocks, *finished* with a `finish_reason`, `"stop"` or
# `"length"`), a **block table**, and `num_cached_tokens`, the leading tokens whose KV is cached,
# which a step skips. Its `block_size` is a copy of the block manager's, to cut tokens into blocks.
# The engine refuses bad requests (notebook 06).

# %% tags=["export"] module="minivllm.engine.sequence"
from enum import Enum, auto
from itertools import count

from minivllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued for prefill: new, or preempted (its KV was dropped)
    RUNNING = auto()  # holds KV blocks and decodes
    FINISHED = auto()


class Sequence:
    """One request: its token ids (prompt, then completion), its KV block table and its sampling
    parameters."""

    counter = count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        block_size: int = 16,
    ):
        assert len(token_ids) > 0 and block_size >= 1, (
            "the engine refuses empty prompts; block_size >= 1"
        )
        self.seq_id = next(Sequence.counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)  # our own copy
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = (
            0  # leading tokens whose KV is in the cache: prefix hits, then computed ones
        )
        self.num_scheduled_tokens = (
            0  # tokens the current step computes, after the cached ones (set by the scheduler)
        )
        self.block_size = block_size  # the block manager's, to cut token_ids into blocks
        self.block_table: list[int] = []  # logical block i -> physical block id
        self.sampling_params = sampling_params or SamplingParams()
        self.finish_reason: str | None = None  # "stop" or "length" once finished

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, {self.status.name}, num_tokens={self.num_tokens}, "
            f"num_cached_tokens={self.num_cached_tokens}, block_table={self.block_table})"
        )

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """The token ids of logical block i."""
        assert 0 <= i < self.num_blocks, f"block {i} of a sequence with {self.num_blocks} blocks"
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


# %%
from minivllm.engine.sequence import Sequence, SequenceStatus

# a 10-token prompt needs 3 blocks of 4, the last half full; new tokens go at the end

prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
seq = Sequence(prompt, SamplingParams(max_tokens=4), block_size=4)
print(seq, [seq.block(i) for i in range(seq.num_blocks)])
assert (seq.num_blocks, seq.last_block_num_tokens) == (3, 2)
seq.append_token(99)
prompt.append(-1)  # the caller's list: not the sequence's
assert seq.completion_token_ids == [99] and seq.prompt_token_ids == prompt[:-1] and len(seq) == 11
assert seq.status == SequenceStatus.WAITING and not seq.is_finished

# %% [markdown]
# ## Prefix caching: naming a block by everything before it
# Many requests start the same way (a system prompt, earlier chat turns, a preempted request coming
# back), so a block computed once could be shared. But a block's KV depends on *every* earlier
# token, so a block is named by a **chained hash** of (the previous block's hash, its token ids):
# the same tokens after another prefix get another name. xxh64 is fast but not cryptographic, so a
# hit is also checked against the block's stored token ids. Only *full* blocks are shared: a partial
# one is still being written by its request.

# %% tags=["export"] module="minivllm.engine.block_manager"
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import xxhash

from minivllm.engine.sequence import Sequence


def compute_hash(token_ids: list[int], parent_hash: int = -1) -> int:
    """xxh64 of (the previous block's hash, this block's token ids); -1 means there is no previous
    block."""
    h = xxhash.xxh64()
    if parent_hash != -1:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())  # int64 token ids
    return h.intdigest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0  # live sequences whose block table holds this block
    hash: int = -1  # chained hash once full and cached; -1 otherwise
    token_ids: list[int] = field(default_factory=list)  # the tokens behind `hash`, to verify a hit


# %%
from minivllm.engine.block_manager import compute_hash

a, b = [1, 2, 3, 4], [5, 6, 7, 8]
b_after_a, b_after_b = compute_hash(b, compute_hash(a)), compute_hash(b, compute_hash(b))
print(f"hash(b after a) = {b_after_a:#018x}, hash(b after b) = {b_after_b:#018x}")
# and deterministic
assert b_after_a != b_after_b and b_after_a == compute_hash(list(b), compute_hash(list(a)))

# %% [markdown]
# ## The BlockManager (write one first? `exercises/03_paged_allocator`, then `03_prefix_caching`)
# It owns `num_blocks` blocks of `block_size` slots (their tensors live in the model runner,
# notebook 04; here a block is an id and a `ref_count`, free at 0). The scheduler (notebook 05)
# calls `can_allocate`/`allocate` for a waiting sequence (sharing the longest run of cached leading
# full blocks), `cache_blocks` in the step that computes a prompt's KV, `can_append`/`may_append`
# after each decoded token, `deallocate` when a sequence ends or is preempted, and `discard` for one
# dropped by a failed step. Three rules shape the code:
#
# * **Two free lists.** A freed full block keeps its hash and KV for a later hit: new KV goes into
#   an empty block while one is left, only then into the least recently freed cached one (an LRU;
#   taking it evicts its hash).
# * **The last token is always computed**, since prefill must produce its logits: a whole cached
#   prompt's last block is no hit (vLLM's rule), so a request never writes into a block another
#   reads.
# * **A block is cached in the step that computes its KV**, never at `allocate`: a long prompt
#   prefilled over several steps (notebook 05) must not be hit before its KV is written (shown
#   below).


# %% tags=["export"]
class BlockManager:
    """Fixed-size KV blocks for sequences, with ref counts and prefix caching of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size  # the one owner: sequences and the scheduler read it from here
        self.enable_prefix_caching = enable_prefix_caching
        self.reset()

    def reset(self) -> None:
        """Every block free and empty, nothing cached: the state of a new block manager. Trusts
        nothing it held."""
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # free, nothing worth keeping
        self.free_block_ids: deque[int] = deque(range(self.num_blocks))
        # free but cached; least recently freed first
        self.cached_block_ids: OrderedDict[int, None] = OrderedDict()

    @property
    def num_slots(self) -> int:
        """Tokens the whole cache holds."""
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_block_ids)

    def _lookup(self, h: int, token_ids: list[int]) -> Block | None:
        block_id = self.hash_to_block_id.get(h)
        # a 64-bit hash can collide
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return self.blocks[block_id]

    def _take_free_block(self) -> Block:
        """A block for new KV: an empty one if any is left, else evict the least recently freed
        cached one."""
        if self.free_block_ids:
            block = self.blocks[self.free_block_ids.popleft()]
        else:
            block = self.blocks[self.cached_block_ids.popitem(last=False)[0]]
            del self.hash_to_block_id[block.hash]
        assert block.ref_count == 0
        block.ref_count, block.hash, block.token_ids = 1, -1, []
        return block

    def _share(self, block: Block) -> None:
        if block.ref_count == 0:  # a hit on a free cached block brings it back
            del self.cached_block_ids[block.block_id]
        block.ref_count += 1

    def _cache(self, block: Block, h: int, token_ids: list[int]) -> None:
        block.hash, block.token_ids = h, token_ids
        # the first copy stays the one that hits
        self.hash_to_block_id.setdefault(h, block.block_id)

    def _release(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if self.hash_to_block_id.get(block.hash) == block.block_id:
            self.cached_block_ids[block.block_id] = None  # keep its KV for a later hit; reused last
        else:
            block.hash, block.token_ids = -1, []
            self.free_block_ids.append(block.block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for a waiting sequence: its longest run of leading full blocks found in the cache,
        then fresh ones."""
        assert not seq.block_table and seq.num_cached_tokens == 0, (
            f"sequence {seq.seq_id} already holds blocks"
        )
        assert seq.block_size == self.block_size, (
            f"sequence block_size {seq.block_size} != {self.block_size}"
        )
        assert self.can_allocate(seq), "allocate() without room: ask can_allocate() first"
        # those score every token
        reuse = self.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None
        # the last token is always computed
        max_hits = (seq.num_tokens - 1) // self.block_size if reuse else 0
        parent_hash = -1
        for i in range(max_hits):
            token_ids = seq.block(i)
            parent_hash = compute_hash(token_ids, parent_hash)
            hit = self._lookup(parent_hash, token_ids)
            if hit is None:
                break
            self._share(hit)
            seq.block_table.append(hit.block_id)
        seq.num_cached_tokens = len(seq.block_table) * self.block_size
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block().block_id)

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache the new full blocks among seq's first `num_tokens` tokens, in the step that
        computes their KV."""
        assert seq.num_cached_tokens <= num_tokens <= seq.num_tokens
        if not self.enable_prefix_caching:
            return
        # blocks before are cached already
        for i in range(seq.num_cached_blocks, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            assert block.hash == -1 and block.ref_count == 1, (
                "only its own sequence writes a block being computed"
            )
            parent_hash = self.blocks[seq.block_table[i - 1]].hash if i else -1
            token_ids = seq.block(i)
            self._cache(block, compute_hash(token_ids, parent_hash), token_ids)

    def can_append(self, seq: Sequence) -> bool:
        """After append_token: is there a free block in case the new token starts one?"""
        return self.num_free_blocks >= (len(seq.block_table) < seq.num_blocks)

    def may_append(self, seq: Sequence) -> None:
        """After append_token: a new block when the new token starts one; cache the last block once
        it is full."""
        block_table = seq.block_table
        assert block_table and seq.num_blocks - len(block_table) in (0, 1), (
            "call may_append after each append_token"
        )
        if len(block_table) < seq.num_blocks:
            assert self.blocks[block_table[-1]].hash != -1 or not self.enable_prefix_caching
            block_table.append(self._take_free_block().block_id)
        if seq.last_block_num_tokens == self.block_size and self.enable_prefix_caching:
            last = self.blocks[block_table[-1]]
            # only its own sequence ever writes into it
            assert last.hash == -1 and last.ref_count == 1
            self._cache_last_block(seq)

    def token_known(self, seq: Sequence) -> None:
        """seq's newest token, a placeholder until now (06), is known: re-cache a block cached with
        it (no hit)."""
        if (
            seq.block_table
            and len(seq.block_table) == seq.num_blocks
            and self.blocks[seq.block_table[-1]].hash != -1
        ):
            self._cache_last_block(seq)

    def _cache_last_block(self, seq: Sequence) -> None:
        """Cache seq's full last block under the hash of its tokens, first dropping a hash it
        held."""
        last = self.blocks[seq.block_table[-1]]
        if self.hash_to_block_id.get(last.hash) == last.block_id:
            del self.hash_to_block_id[last.hash]
        parent_hash = self.blocks[seq.block_table[-2]].hash if len(seq.block_table) > 1 else -1
        token_ids = seq.block(seq.num_blocks - 1)
        self._cache(last, compute_hash(token_ids, parent_hash), token_ids)

    def deallocate(self, seq: Sequence) -> None:
        """Give back a finished or preempted sequence's blocks; the ones nobody else holds become
        free."""
        assert seq.block_table, f"sequence {seq.seq_id} holds no blocks (freed twice?)"
        for block_id in reversed(seq.block_table):  # tail first: a shared head is evicted last
            self._release(self.blocks[block_id])
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def discard(self, seq: Sequence) -> None:
        """Give back a sequence dropped mid-step: its blocks past `num_cached_tokens`, cached but
        never written, first leave the cache, so no request can hit them."""
        for block_id in seq.block_table[seq.num_cached_tokens // self.block_size :]:
            block = self.blocks[block_id]
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
        self.deallocate(seq)


# %% [markdown]
# ## Watch it work
# 8 blocks of 4 slots, printed `id:ref_count` (`.` free, `#` cached). `allocate(s1)` caches nothing;
# the step that computes its prompt caches its two full blocks (`admit` plays that step until
# notebook 05). Decoding, tokens 11 and 12 fill block 2 (cached once full); the 13th opens block 3.

# %%
from minivllm.engine.block_manager import BlockManager


def show(bm: BlockManager, note: str = "") -> None:
    cells = []
    for b in bm.blocks:
        refs = b.ref_count if b.ref_count else "."
        cached = "#" if b.hash != -1 else " "
        cells.append(f"{b.block_id}:{refs}{cached}")
    used = (
        f"| used {bm.num_used_blocks}, free {bm.num_free_blocks} ({bm.num_cached_free_blocks} "
        f"cached)"
    )
    print(" ".join(cells), used, note)


def admit(
    bm: BlockManager, seq: Sequence
) -> None:  # allocate, then the step that prefills the whole prompt
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))


bm = BlockManager(num_blocks=8, block_size=4)
system = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks every request starts with
s1 = Sequence(system + [30, 31], block_size=4)
bm.allocate(s1)
show(bm, f"s1 table {s1.block_table}, cached tokens {s1.num_cached_tokens}")
assert s1.block_table == [0, 1, 2] and all(b.hash == -1 for b in bm.blocks)
bm.cache_blocks(s1, len(s1))
show(bm, "s1's prompt computed")
for token in (32, 33, 34):
    s1.append_token(token)
    bm.may_append(s1)
    show(bm, f"s1 has {len(s1)} tokens, table {s1.block_table}")
assert s1.block_table == [0, 1, 2, 3]
assert bm.blocks[2].hash != -1 and bm.blocks[3].hash == -1  # a full block is cached, not a partial

# %% [markdown]
# `s2`, with the same system prompt, shares its two blocks (ref count 2) and skips 8 tokens.

# %%
admit(bm, s2 := Sequence(system + [40, 41, 42], block_size=4))
show(bm, f"s2 table {s2.block_table}, cached tokens {s2.num_cached_tokens}")
assert s2.block_table[:2] == [0, 1] and s2.num_cached_tokens == 8
assert bm.blocks[0].ref_count == 2

# %% [markdown]
# Both finish: their full blocks stay cached at the back of the free order. An unrelated `s3` takes
# empty blocks first, so the system prompt is still cached when `s4` arrives with it.

# %%
bm.deallocate(s1)
bm.deallocate(s2)
show(bm, "after both finished")
admit(bm, s3 := Sequence([50, 51, 52, 53, 54], block_size=4))
show(bm, f"s3 table {s3.block_table}")
assert not {0, 1, 2} & set(s3.block_table) and bm.num_cached_free_blocks >= 3
admit(bm, s4 := Sequence(system + [60], block_size=4))
show(bm, f"s4 table {s4.block_table}, cached tokens {s4.num_cached_tokens}")
assert s4.block_table[:2] == [0, 1] and s4.num_cached_tokens == 8

# %% [markdown]
# Why `allocate` caches nothing: `long` (17 tokens, four full blocks) is prefilled in chunks, 8
# tokens first. A request with the same first 16 tokens arriving then must hit the two blocks
# computed, not the two unwritten:

# %%
chunked, long = (
    BlockManager(num_blocks=16, block_size=4),
    Sequence(list(range(1, 18)), block_size=4),
)
chunked.allocate(long)
chunked.cache_blocks(long, 8)  # the first chunk: tokens 0..7
long.num_cached_tokens = 8  # what the scheduler records once that step has run
admit(chunked, same_start := Sequence(list(range(1, 17)) + [99], block_size=4))
chunked.cache_blocks(long, 17)  # the second chunk computes the rest
admit(chunked, later := Sequence(list(range(1, 17)) + [99], block_size=4))
print(
    f"tokens hit: {same_start.num_cached_tokens} after the first chunk, {later.num_cached_tokens} "
    f"after the second"
)
assert same_start.num_cached_tokens == 8 and later.num_cached_tokens == 16

# %% [markdown]
# ## Why does PagedAttention reduce fragmentation? A simulated workload
# The question this notebook is for. 600 requests (prompts of 16 to 512 tokens, `max_tokens=1024`,
# each stopping after ~300 tokens on average) replayed on 65,536 KV slots (about 7 GiB for
# Qwen3-0.6B), with a **contiguous** region of `max_model_len = 2048` slots per request (engines
# before paging), a tighter contiguous `prompt + max_tokens` placed first-fit, or **paged** blocks
# (our `BlockManager`) of 256, 64 and 16 slots. A miniature scheduler admits requests first come,
# first served, decodes a token per request, preempts the newest when full.
#
# Each step, a reserved slot holds a **token**, is reserved **ahead** for one to come, or is
# **over-reserved** for tokens its request will never produce; a free slot is **stranded** in a hole
# too small for the next request (external fragmentation), or **free**. The simulator:
# `minivllm/benchmarks/fragmentation.py`.

# %%
from minivllm.benchmarks.fragmentation import plot_fragmentation, print_fragmentation, run_schemes

runs = run_schemes(num_requests=600)
print_fragmentation(runs)

# %%
plot_fragmentation(runs).savefig(FIGURES / "03_fragmentation.png", dpi=120)

# %% [markdown]
# **Reading the figure.** A max-length reservation is mostly over-reserved (red): a request uses a
# few hundred of its 2,048 slots. `prompt + max_tokens` still over-reserves, and its regions differ
# in size: free memory is stranded in holes too small for the next request (orange). Paged blocks
# come as tokens arrive, any free block serves any request, and the waste is the unfilled end of
# each request's last block: almost nothing with 16-slot blocks. So about three times as many
# requests run at once, finishing in a third of the steps: PagedAttention's throughput.

# %%
occupancy, share = (
    {n: r["occupancy"] for n, r in runs.items()},
    {n: r["share"] for n, r in runs.items()},
)
assert occupancy["paged, block 16"] > 0.97 and occupancy["contiguous, max length"] < 0.35
# each scheme in the list beats the one before
assert sorted(occupancy, key=occupancy.get) == list(runs)
assert sorted(runs, key=lambda n: -share[n]["over"]) == list(runs)  # and over-reserves less
# sizes that differ
assert [n for n in runs if share[n]["stranded"] > 0] == ["contiguous, prompt + max_tokens"]
assert runs["paged, block 16"]["batch"] > 2.5 * runs["contiguous, max length"]["batch"]
assert len(runs["paged, block 16"]["rows"]) < len(runs["contiguous, max length"]["rows"]) / 2.5

# %% [markdown]
# ## How fast is the bookkeeping?
# It runs on the CPU between GPU steps, so its cost adds to every step, and must not grow with the
# cache. A small run of `python -m minivllm.benchmarks.block_manager`, with two cache sizes 64 times
# apart:

# %%
from minivllm.benchmarks.block_manager import print_table, run_benchmark

print_table([run_benchmark(num_blocks=n, num_seqs=500, block_size=16) for n in (4_096, 262_144)])

# %% [markdown]
# ## The KV cache in memory
# Per layer, `k_cache` and `v_cache` are `(num_blocks, block_size, num_kv_heads, head_dim)`
# (flash-attn's layout); viewed as `(num_blocks * block_size, ...)`, a slot is a row. Each step the
# model **stores** each new token's `k` and `v` in its slot (`slot_mapping`, `-1` for padding: one
# program per token copies a row), then each query **attends** to its sequence's rows through its
# block table.

# %% tags=["export"] module="minivllm.kernels.paged_attn"
import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from minivllm.kernels.flash_attn import attend_block, load_tile, softmax_scale_of


@triton.jit
def _store_kvcache_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_vt,
    KV_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One token's k and v rows (KV_SIZE values each) into its slot; the caches are contiguous: a
    slot is a row."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:  # a padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < KV_SIZE
    tl.store(
        k_cache + slot * KV_SIZE + offs, tl.load(k + token * stride_kt + offs, mask=mask), mask=mask
    )
    tl.store(
        v_cache + slot * KV_SIZE + offs, tl.load(v + token * stride_vt + offs, mask=mask), mask=mask
    )


def check_cache(name: str, cache: torch.Tensor, q: torch.Tensor) -> None:
    if (
        cache.dim() != 4
        or cache.dtype != q.dtype
        or cache.device != q.device
        or not cache.is_contiguous()
    ):
        raise ValueError(
            f"{name} must be a contiguous (num_blocks, block_size, num_kv_heads, head_dim) tensor "
            f"of "
            f"{q.dtype} on {q.device}, got {cache.dtype} {tuple(cache.shape)} on {cache.device}"
        )


def check_index(
    name: str, t: torch.Tensor, dim: int, device: torch.device, dtypes=(torch.int32,)
) -> None:
    if t.dim() != dim or t.dtype not in dtypes or t.device != device:
        want = f"{dim}-D {' or '.join(map(str, dtypes))} tensor on {device}"
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}"
        raise ValueError(f"{name} must be a {want}, got {got}")


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Where a kernel writes: a new tensor like q, or `out`, checked to fit q (shape, dtype, device,
    last dim)."""
    if out is None:
        return torch.empty_like(q)
    if (
        out.shape != q.shape
        or out.dtype != q.dtype
        or out.device != q.device
        or out.stride(-1) != 1
    ):
        want = f"a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}"
        got = f"{out.dtype} {tuple(out.shape)} on {out.device} with strides {out.stride()}"
        raise ValueError(f"out must be {want}, contiguous in its last dimension; got {got}")
    return out


def store_kvcache(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int32/int64; -1 = do not store
) -> None:
    """Write each token's key and value into its slot of the paged cache."""
    check_cache("k_cache", k_cache, k)
    check_cache("v_cache", v_cache, v)
    check_index("slot_mapping", slot_mapping, 1, k.device, (torch.int32, torch.int64))
    fits_cache = k.shape == v.shape and k.shape[1:] == k_cache.shape[2:]
    if not fits_cache or slot_mapping.numel() != k.shape[0]:
        raise ValueError(
            f"k, v {tuple(k.shape)}, {tuple(v.shape)} must match the cache's (num_kv_heads, "
            f"head_dim) "
            f"{tuple(k_cache.shape[2:])} and slot_mapping's {slot_mapping.numel()} tokens"
        )
    if (
        k.stride(-1) != 1
        or k.stride(-2) != k.shape[-1]
        or v.stride(-1) != 1
        or v.stride(-2) != v.shape[-1]
    ):
        raise ValueError("each token's k and v must be contiguous (num_kv_heads, head_dim) rows")
    kv_size = k.shape[1] * k.shape[2]
    block = triton.next_power_of_2(kv_size)
    _store_kvcache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), kv_size, block
    )


# %% [markdown]
# Check: stored rows land in their slots, and padding (`-1`) writes nothing.

# %%
from minivllm.kernels.paged_attn import store_kvcache

k_cache, v_cache = torch.zeros(2, 4, 16, 2, 32, device=DEVICE)  # 4 blocks of 16 slots each
k, v = torch.randn(2, 3, 2, 32, device=DEVICE)
# block 2 offset 5; padding; block 0 offset 5
slot_mapping = torch.tensor([37, -1, 5], device=DEVICE)
store_kvcache(k, v, k_cache, v_cache, slot_mapping)
flat_k = k_cache.view(-1, 2, 32)
torch.testing.assert_close(flat_k[[37, 5]], k[[0, 2]])
assert flat_k.abs().sum(dim=(1, 2)).count_nonzero() == 2  # nothing else was written

# %% [markdown]
# ## Why decode needs its own attention kernel
# In prefill every key/value block the kernel loads serves a whole `BLOCK_M` tile of queries: many
# FLOPs per byte, so the tensor cores set the speed (notebook 01). In decode each sequence brings
# **one** query per head, and its whole KV cache is read for 2 FLOPs per element (a multiply-add in
# `q·k` or `p·v`) per query head sharing it:


# %%
def flops_per_byte(
    num_queries: int, group: int = 2, head_dim: int = 128, dtype_bytes: int = 2
) -> float:
    """Attention FLOPs (q·k and p·v, per query head) per byte of K and V read."""
    return 4 * num_queries * group * head_dim / (2 * head_dim * dtype_bytes)


# dense bf16 FLOP/s over HBM bytes/s: below this a kernel waits on memory
h200_ridge = 989e12 / 4.8e12
for name, n in (("decode (1 query)", 1), ("prefill of 4,096 tokens", 4096)):
    print(f"{name:>24}: {flops_per_byte(n):7.0f} FLOP/byte (H200 ridge point ≈ {h200_ridge:.0f})")
assert flops_per_byte(1) < 10 < h200_ridge < flops_per_byte(4096)

# %% [markdown]
# Measured on this machine's CPU, with PyTorch's attention (SDPA, float32). First the CPU's two
# limits: a big matmul's FLOP/s and a big copy's bytes/s. Then attention shaped as decode (8
# sequences, one query each over a 2,048-token cache) and as prefill (512 queries over one
# sequence's 2,048 keys). Other work on the machine moves the timings: read the ratios.

# %%
import functools
import time

import matplotlib.pyplot as plt
import torch.nn.functional as F


def best_seconds(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` runs after a warm-up one: the run other work disturbed least."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


big = torch.ones(2048, 2048)
peak = 2 * 2048**3 / best_seconds(functools.partial(torch.mm, big, big))  # a multiply-add: 2 FLOPs
src = torch.ones(2**25)  # 128 MiB, more than the caches hold; a copy reads it and writes as much
dst = torch.empty_like(src)
bandwidth = 2 * src.nbytes / best_seconds(functools.partial(dst.copy_, src))
del big, src, dst
print(f"this CPU: {peak / 1e9:.0f} GFLOP/s (matmul), {bandwidth / 1e9:.0f} GB/s (copy)")
k, v = torch.ones(2, 8, 8, 2048, 128)  # (batch, heads, keys, head_dim): 128 MiB of K and V
shapes = {"decode": torch.ones(8, 8, 1, 128), "prefill": torch.ones(1, 8, 512, 128)}
measured = {}  # name: (FLOP per byte, FLOP/s)
for name, q in shapes.items():
    k_seq, v_seq = k[: len(q)], v[: len(q)]  # prefill: one sequence's keys
    seconds = best_seconds(functools.partial(F.scaled_dot_product_attention, q, k_seq, v_seq))
    flops = 4 * q.numel() * k.shape[2]  # q·k and p·v: a multiply-add per key per query feature
    moved = k_seq.nbytes + v_seq.nbytes + 2 * q.nbytes  # K, V and q read, the output written
    measured[name] = (flops / moved, flops / seconds)
    compute = f"{flops / seconds / 1e9:5.1f} GFLOP/s ({flops / seconds / peak:4.0%} of peak)"
    memory = f"{moved / seconds / 1e9:4.1f} GB/s ({moved / seconds / bandwidth:4.0%} of the copy's)"
    print(f"{name:>8}: {flops / moved:5.1f} FLOP/byte, {compute}, {memory}")

intensity = np.array([0.1, peak / bandwidth, 1000])  # FLOP per byte: the roof bends at the ridge
roof = np.minimum(peak, bandwidth * intensity) / 1e9
fig, ax = plt.subplots(figsize=(6, 3.8), layout="tight")
ax.loglog(intensity, roof, "k-", label="roof: min(matmul FLOP/s, copy bytes/s × FLOP/byte)")
for name, (flop_per_byte, flop_s) in measured.items():
    ax.loglog(flop_per_byte, flop_s / 1e9, "o", label=f"{name} attention (SDPA)")
ax.set(xlabel="FLOP per byte moved", ylabel="GFLOP/s", title="Attention on this CPU, float32")
ax.legend(fontsize=8)
fig.savefig(FIGURES / "03_cpu_roofline.png", dpi=120)

# %% [markdown]
# Decode reaches a few percent of the matmul's FLOP/s but moves bytes at a good share of the copy's
# rate: its point is under the sloped part of the roof, where bytes set the speed. Prefill is near
# the flat part, where FLOPs do. An H200's ridge is near 200 FLOP/byte, further still from decode's:
# "How fast" below has the GPU half (the decode kernels' TB/s against the copy's; notebook 01 has
# the prefill kernel's TFLOP/s).
#
# Decode is **memory-bound**: a good decode kernel streams the KV cache at full HBM bandwidth. So:
# **GQA packing**, one program for *all* query heads of a KV head, each KV block read once;
# **split-K** (flash-decoding), since one sequence × 8 KV heads is 8 programs for 132
# multiprocessors: the context is cut into `num_splits` chunks, each program writes its chunk's
# output and log-sum-exp `lse_s`, a tiny kernel combines them; **paging**, keys found through the
# block table (`paged_rows`), 64 per step. A split's loop, `attend_split`, runs notebook 01's
# `attend_block`; `store_split` writes its results (the cascade kernel, below, reuses both).
#
# Split-K first in PyTorch (`exercises/01_online_softmax.ipynb`, parts b and c): 300 keys in 3
# chunks. Each chunk's softmax has its own sum, so weight each output by `exp(lse_s − lse)`, its
# share of the row's sum: exact.

# %%
from minivllm.kernels.reference import attention_ref

# one query head, 300 cached keys
q1, k1, v1 = (torch.randn(1, 32), torch.randn(300, 32), torch.randn(300, 32))
# 3 splits of 128, 128, 44 keys: (1, chunk) each
scores = [q1 @ k_s.T * 32**-0.5 for k_s in k1.split(128)]
# (1, 32): over its own sum
outs = [torch.softmax(s, dim=-1) @ v_s for s, v_s in zip(scores, v1.split(128))]
# (3, 1): the log of each split's sum
lses = torch.stack([torch.logsumexp(s, dim=-1) for s in scores])
# (3, 1): each split's share of the whole row's sum
weights = torch.exp(lses - torch.logsumexp(lses, dim=0))
# what the combine kernel computes
combined = sum(w[:, None] * out_s for w, out_s in zip(weights, outs))
one_query, all_keys = torch.tensor([0, 1]), torch.tensor([0, 300])  # cu_seqlens of q and k
one_head = [t[:, None] for t in (q1, k1, v1)]  # (tokens, 1 head, dim)
ref = attention_ref(*one_head, one_query, all_keys)[:, 0]
torch.testing.assert_close(combined, ref)
plain = (sum(outs) / len(outs) - ref).abs().max()
weighted = (combined - ref).abs().max()
print(
    f"max error: plain average of the splits {plain:.2f}, weighted by exp(lse_s - lse) "
    f"{weighted:.0e}"
)


# %% tags=["export"]
@triton.jit
def paged_rows(block_table_row, tok, valid, BLOCK_SIZE: tl.constexpr):
    """Rows of tokens `tok` in the cache viewed as (num_blocks * block_size, ...): block base +
    offset."""
    block = tl.load(block_table_row + tok // BLOCK_SIZE, mask=valid, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE


@triton.jit
def attend_split(
    q,
    K,
    V,
    table_row,
    lo,
    hi,
    kv_head,
    qk_scale,
    kv_strides,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Queries q (ROWS, D) of one KV head over keys lo..hi-1 of a block-table row: output,
    log2-sum-exp (ROWS,)."""
    ROWS: tl.constexpr = q.shape[0]
    HEAD_DIM: tl.constexpr = q.shape[1]
    stride_kt, stride_kh, stride_vt, stride_vh = kv_strides  # (token, head) of k, then of v
    offs_d, offs_n = tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_N)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n  # (BLOCK_N,)
        valid = tok < hi
        rows = paged_rows(table_row, tok, valid, BLOCK_SIZE)
        k = load_tile(
            K + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            valid[None, :],
            UPCAST,
        )
        v = load_tile(
            V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            valid[:, None],
            UPCAST,
        )
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, valid[None, :], qk_scale, PRECISION)
    # a split with no key: past the end of a short sequence (or of a shared prefix)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = m_i + tl.math.log2(tl.where(empty, 1.0, l_i))
    return out, tl.where(empty, float("-inf"), lse)


@triton.jit
def store_split(
    partial_out, partial_lse, seq, heads, slot, out, lse, mask, part_strides, HEAD_DIM: tl.constexpr
):
    """A split's results into slot `slot` of its rows (seq: one sequence, or one per row; heads: one
    per row)."""
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh = (
        part_strides  # of partial_out, then partial_lse
    )
    row = seq * stride_pb + heads * stride_ph + slot * stride_ps  # (ROWS,)
    out_ptrs = partial_out + row[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(out_ptrs, out, mask=mask[:, None])
    tl.store(partial_lse + seq * stride_lb + heads * stride_lh + slot, lse, mask=mask)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])  # vary from step to step (notebook 01)
def _decode_kernel(
    Q,
    K,
    V,
    partial_out,
    partial_lse,
    cache_seqlens,
    block_table,
    prefix_lens,
    qk_scale,
    num_splits,
    stride_bt,
    # (batch, head) of q; (token, head) of k and v; see store_split
    q_strides,
    kv_strides,
    part_strides,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seqlen = tl.load(cache_seqlens + seq)
    # keys before it: a shared prefix, attended apart
    first = tl.load(prefix_lens + seq) if HAS_PREFIX else 0
    chunk = tl.cdiv(tl.cdiv(seqlen - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    # the query heads of this KV head (padded: tl.dot needs 16 rows)
    offs_g = tl.arange(0, GROUP_PAD)
    heads, mask = kv_head * GROUP + offs_g, offs_g < GROUP
    q_rows = Q + seq * q_strides[0] + heads * q_strides[1]  # (GROUP_PAD,)
    q_ptrs = q_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    q = load_tile(q_ptrs, mask[:, None], UPCAST)  # (GROUP_PAD, D)
    table_row = block_table + seq * stride_bt
    out, lse = attend_split(
        q,
        K,
        V,
        table_row,
        lo,
        hi,
        kv_head,
        qk_scale,
        kv_strides,
        BLOCK_N,
        BLOCK_SIZE,
        UPCAST,
        PRECISION,
    )
    store_split(partial_out, partial_lse, seq, heads, split, out, lse, mask, part_strides, HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits", "prefix_splits"])
def _combine_splits_kernel(
    partial_out,
    partial_lse,
    O,
    cache_seqlens,
    prefix_lens,
    num_splits,
    prefix_splits,
    part_strides,
    o_strides,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh = part_strides
    seq, head = tl.program_id(0), tl.program_id(1)
    if tl.load(cache_seqlens + seq) == 0:
        # not a sequence: a CUDA graph's padding row (notebook 04), whose output row may be
        # another's
        return
    # the shared prefix's splits (cascade attention) follow the row's own, if it shares it
    if prefix_splits > 0:
        num_splits += tl.where(tl.load(prefix_lens + seq) > 0, prefix_splits, 0)
    offs_s, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM)
    lse_ptrs = partial_lse + seq * stride_lb + head * stride_lh + offs_s
    lse = tl.load(lse_ptrs, mask=offs_s < num_splits, other=float("-inf"))  # (SPLITS_PAD,)
    m = tl.max(lse, 0)
    weights = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part_ptrs = (
        partial_out
        + seq * stride_pb
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :]
    )
    parts = tl.load(part_ptrs, mask=(offs_s < num_splits)[:, None], other=0.0)  # (SPLITS_PAD, D)
    total = tl.maximum(tl.sum(weights, 0), 1e-30)
    out = tl.sum(parts * weights[:, None], 0) / total
    o_ptrs = O + seq * o_strides[0] + head * o_strides[1] + offs_d
    tl.store(o_ptrs, out.to(O.dtype.element_ty))


# %% tags=["export"]
# The host side: check the inputs, pick num_splits, launch both kernels.
@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits for one wave of ~4 programs per SM, or 2 past a wave (an H200 sweep); per batch only:
    graphs fix it."""
    if device.type == "cpu":
        return 1
    programs, wave = batch * num_kv_heads, 4 * num_sms(device)
    return min(128, wave // programs) if programs <= wave else 2


def check_decode_inputs(
    q, k_cache, v_cache, cache_seqlens, block_table, prefix_blocks, prefix_lens
) -> None:
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be (batch, 1, num_heads, head_dim), got {tuple(q.shape)}")
    check_cache("k_cache", k_cache, q)
    check_cache("v_cache", v_cache, q)
    if cache_seqlens is None or block_table is None:
        raise ValueError("cache_seqlens and block_table are required: the cache is paged")
    check_index("cache_seqlens", cache_seqlens, 1, q.device)
    check_index("block_table", block_table, 2, q.device)
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if (
        k_cache.shape[3] != head_dim
        or num_heads % num_kv_heads
        or head_dim not in (16, 32, 64, 128, 256)
    ):
        raise ValueError(
            f"head_dim {head_dim} (16..256, a power of two) must match the cache's "
            f"{k_cache.shape[3]}, "
            f"and num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if cache_seqlens.shape[0] != batch or block_table.shape[0] != batch:
        raise ValueError(f"cache_seqlens and block_table need one row per sequence ({batch})")
    if (prefix_blocks is None) != (prefix_lens is None):
        raise ValueError(
            "prefix_blocks and prefix_lens go together: the shared blocks, and who shares them"
        )
    if prefix_lens is not None and prefix_blocks is not None:
        check_index("prefix_blocks", prefix_blocks, 1, q.device)
        check_index("prefix_lens", prefix_lens, 1, q.device)
        if prefix_lens.shape[0] != batch:
            raise ValueError(
                f"prefix_lens needs one row per sequence ({batch}), got {prefix_lens.shape[0]}"
            )


def flash_attn_with_kvcache(
    q: torch.Tensor,  # (batch, 1, num_heads, head_dim): one new query per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,  # (batch,) int32: tokens in each sequence's cache
    block_table: torch.Tensor | None = None,  # (batch, max_blocks) int32
    softmax_scale: float | None = None,
    causal: bool = False,  # one query that sees its whole cache: causal or not is the same thing
    out: torch.Tensor
    | None = None,  # (batch, 1, num_heads, head_dim) to write into; None: a new tensor
    prefix_blocks: torch.Tensor
    | None = None,  # (n,) int32: blocks that begin the caches of several rows
    prefix_lens: torch.Tensor
    | None = None,  # (batch,) int32: a row's tokens in those blocks, or 0 (not its own)
) -> torch.Tensor:  # (batch, 1, num_heads, head_dim)
    """Decode attention over a paged KV cache, flash-attn's signature (GQA-packed, split-K). Rows
    that begin with `prefix_blocks` (`prefix_lens` > 0) attend to them together, their keys read
    once (cascade attention)."""
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table, prefix_blocks, prefix_lens)
    assert cache_seqlens is not None and block_table is not None  # checked: for mypy
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, on_cpu = k_cache.shape[2], q.device.type == "cpu"
    num_splits, group = decode_num_splits(batch, num_kv_heads, q.device), num_heads // num_kv_heads
    block_m = 16 if on_cpu else 64  # (row, query head) pairs per program of the prefix kernel
    prefix_grid = (triton.cdiv(batch * group, block_m), num_kv_heads)
    prefix_splits = (
        0 if prefix_blocks is None else prefix_num_splits(prefix_grid[0] * prefix_grid[1], q.device)
    )
    k, v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = check_out(out, q)
    # partial results per row and head: the row's own splits, the prefix's
    slots = num_splits + prefix_splits
    partial_out = torch.empty(
        batch, num_heads, slots, head_dim, dtype=torch.float32, device=q.device
    )
    partial_lse = torch.empty(batch, num_heads, slots, dtype=torch.float32, device=q.device)
    tensors, lens = (
        (q, k, v, partial_out, partial_lse),
        cache_seqlens if prefix_lens is None else prefix_lens,
    )
    qk_scale = softmax_scale_of(softmax_scale, head_dim) * math.log2(math.e)
    q_strides = (q.stride(0), q.stride(2))
    kv_strides = (*k.stride()[:2], *v.stride()[:2])
    strides = (q_strides, kv_strides, (*partial_out.stride()[:3], *partial_lse.stride()[:2]))
    # tile sizes: the fastest of a sweep on an H200 (bf16, head_dim 128, block sizes 16 and 256)
    common: dict[str, Any] = dict(
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=16 if on_cpu else 64, num_warps=4
    )
    common.update(UPCAST=on_cpu and q.dtype != torch.float32, num_stages=1 if on_cpu else 2)
    common.update(PRECISION="ieee" if q.dtype == torch.float32 else "tf32", GROUP=group)
    decode = dict(
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HAS_PREFIX=prefix_lens is not None
    )
    scalars = (qk_scale, num_splits, block_table.stride(0))
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        *tensors, cache_seqlens, block_table, lens, *scalars, *strides, **decode, **common
    )
    if prefix_splits:
        prefix = (prefix_blocks, prefix_lens, qk_scale, batch, num_splits)
        _shared_prefix_kernel[(*prefix_grid, prefix_splits)](
            *tensors, *prefix, *strides, BLOCK_M=block_m, **common
        )
    splits = (num_splits, prefix_splits, strides[2], (out.stride(0), out.stride(2)))
    pad = max(2, triton.next_power_of_2(slots))
    _combine_splits_kernel[(batch, num_heads)](
        partial_out,
        partial_lse,
        out,
        cache_seqlens,
        lens,
        *splits,
        HEAD_DIM=head_dim,
        SPLITS_PAD=pad,
    )
    return out


# %% [markdown]
# ### Check the decode kernel against the reference
# Sequences of 1 to 300 tokens in shuffled blocks, several block sizes, GQA ratios and forced
# numbers of splits (a CPU would pick 1; short sequences leave some empty): the kernel must match
# notebook 01's reference.

# %%
from unittest import mock

from minivllm.kernels.paged_attn import flash_attn_with_kvcache

# random K/V written to shuffled blocks, and kept contiguous
from minivllm.testing import scatter_into_cache

# one query per sequence
seq_lens, cu_q = ([1, 17, 300, 64], torch.arange(5, dtype=torch.int32, device=DEVICE))
cache_seqlens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
for block_size, num_heads, num_kv_heads, num_splits in (
    (16, 8, 2, 1),
    (32, 8, 8, 4),
    (256, 8, 1, 3),
):
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(
        seq_lens, num_kv_heads, 32, block_size, DEVICE
    )
    q = torch.randn(len(seq_lens), 1, num_heads, 32, device=DEVICE)
    with mock.patch("minivllm.kernels.paged_attn.decode_num_splits", lambda *_, n=num_splits: n):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)
    cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = attention_ref(q[:, 0], k, v, cu_q, cu_k)
    error = (out[:, 0] - ref).abs().max()
    print(
        f"block_size {block_size:>3}, GQA {num_heads // num_kv_heads}, {num_splits} splits: max "
        f"error {error:.1e}"
    )
    torch.testing.assert_close(out[:, 0], ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ### A prefix many rows share: cascade attention (the deep dive `deep_dives/cascade_attention`)
# Rows that begin with the same cached blocks (a system prompt) read them once per row; given
# `prefix_blocks` and `prefix_lens`, the kernel below reads them once for all those rows, as more
# splits. The deep dive explains it.


# %% tags=["export"]
@triton.jit(do_not_specialize=["batch", "first_split"])
def _shared_prefix_kernel(
    Q,
    K,
    V,
    partial_out,
    partial_lse,
    prefix_blocks,
    prefix_lens,
    qk_scale,
    batch,
    first_split,
    q_strides,
    kv_strides,
    part_strides,  # as the decode kernel's
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Split `split` of the shared prefix for BLOCK_M (row, query head) pairs of one KV head, into
    slot first_split + split."""
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (row, query head) pairs, GROUP heads per row
    seq, heads = offs_m // GROUP, kv_head * GROUP + offs_m % GROUP
    # (BLOCK_M,): the prefix's length, or 0
    lens = tl.load(prefix_lens + seq, mask=seq < batch, other=0)
    shares, prefix_len = lens > 0, tl.max(lens, 0)  # one length for all sharers
    if prefix_len == 0:
        return  # no row of this tile shares it (a CUDA graph's step may have no shared prefix)
    chunk = tl.cdiv(tl.cdiv(prefix_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix_len)
    q_rows = Q + seq * q_strides[0] + heads * q_strides[1]  # (BLOCK_M,)
    q_ptrs = q_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    q = load_tile(q_ptrs, shares[:, None], UPCAST)  # (BLOCK_M, D)
    # a non-sharer's row is computed too, and never read: the combine kernel skips its slots
    out, lse = attend_split(
        q,
        K,
        V,
        prefix_blocks,
        lo,
        hi,
        kv_head,
        qk_scale,
        kv_strides,
        BLOCK_N,
        BLOCK_SIZE,
        UPCAST,
        PRECISION,
    )
    slot, mask = first_split + split, seq < batch
    store_split(partial_out, partial_lse, seq, heads, slot, out, lse, mask, part_strides, HEAD_DIM)


def prefix_num_splits(num_programs: int, device: torch.device) -> int:
    """Splits of the shared prefix: enough for one program per SM, given num_programs (tiles × KV
    heads) per split."""
    if device.type == "cpu":
        return 1
    return max(1, min(8, num_sms(device) // num_programs))


# %% [markdown]
# ## Paged attention without a GPU
# On a CPU, Triton's interpreter is exact but thousands of times slower, so the engine uses PyTorch
# indexing there: a store is an indexed assignment; attention gathers each sequence's rows and calls
# notebook 01's reference.


# %% tags=["export"] module="minivllm.kernels.paged_reference"
import torch

from minivllm.kernels.reference import attention_ref


def store_kvcache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0  # (num_tokens,): -1 marks padding
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A sequence's first `num_tokens` rows of a paged cache, contiguous: (num_tokens, num_kv_heads,
    head_dim)."""
    num_blocks = -(-num_tokens // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_tokens]


def paged_attention_ref(
    q: torch.Tensor,  # (total_q, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # (batch + 1,)
    # (batch + 1,): tokens in each sequence's cache, the new ones included
    cu_seqlens_k: torch.Tensor,
    block_table: torch.Tensor,  # (batch, max_blocks)
    softmax_scale: float | None = None,
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """Causal attention of new tokens over their sequence's whole cache: decode is the case of one
    new token."""
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    k = torch.cat([gather_kv(k_cache, block_table[i], n) for i, n in enumerate(k_lens)])
    v = torch.cat([gather_kv(v_cache, block_table[i], n) for i, n in enumerate(k_lens)])
    return attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True)


# %% [markdown]
# Check: with new tokens after cached ones, in shuffled blocks, the reference gives what notebook
# 01's gives on the same keys laid out contiguously. (The paged prefill *kernel* after a cache hit:
# the deep dive `paged_prefill`.)

# %%
from minivllm.kernels.paged_reference import paged_attention_ref

# tokens in the cache; the new ones among them
seq_lens, q_lens = ([1, 17, 300, 64, 40], [1, 5, 64, 17, 40])
cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=DEVICE)
for block_size in (16, 256):
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(
        seq_lens, 2, 32, block_size, DEVICE
    )
    q = torch.randn(sum(q_lens), 4, 32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, cu_q, cu_k, block_table)
    torch.testing.assert_close(ref, attention_ref(q, k, v, cu_q, cu_k, causal=True))

# %% [markdown]
# ## How fast: decode vs prefill kernels on an H200
# `python -m minivllm.benchmarks.decode`, in bytes of K and V read per second: `minivllm-triton`
# (the kernel above), `flashinfer` (vLLM's, the bar to reach), `minivllm-prefill-kernel` (deep dive
# `paged_prefill`), and `naive-gather-sdpa` (blocks copied out, then PyTorch's attention). A GPU
# re-measures a subset; else committed data.

# %%
from minivllm.benchmarks.decode import plot_decode, run_decode_benchmark

if DEVICE == "cuda":
    decode_data = run_decode_benchmark(shapes=[(1, 16384), (64, 4096)], block_sizes=(16,))
else:
    decode_data = json.loads(Path("figures/decode.json").read_text())
plot_decode(decode_data).savefig(FIGURES / "04_decode.png", dpi=120)
tbps: dict[tuple, float] = {}  # (impl, batch, context) -> the best over block sizes
for r in sorted(decode_data["rows"], key=lambda r: r["tbps"]):
    tbps[r["impl"], r["batch"], r["context_len"]] = r["tbps"]
for (impl, batch, context), v in sorted(tbps.items()):
    shape = f"batch {batch:>3} × {context:>5} tokens"
    print(f"{impl:>24} {shape}: {v:.2f} TB/s")
copy_tbps = decode_data["copy_tbps"]
print(
    f"copy bandwidth, for scale: {copy_tbps:.2f} TB/s (a copy reads and writes; a read alone may "
    f"beat it)"
)

# %% [markdown]
# ## Check yourself
# Set each `answerN` and run its cell: it compares your answer with what the block manager did. The
# worked answer follows.
#
# **1.** After `x + z` and `y + w` ran (four different full blocks), `y + z + [0]` arrives: how many
# of its tokens hit?

# %%
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
check = BlockManager(num_blocks=16, block_size=16)
x, y, z, w = ([i] * 16 for i in (1, 2, 3, 4))
for prompt in (x + z + [0], y + w + [0], y + z + [0]):  # `other` is the last one
    admit(check, other := Sequence(prompt, block_size=16))
check_answer(answer1, other.num_cached_tokens, "1. chained hash")

# %% [markdown]
# Worked answer: 16, `y` only. The cached `z` was computed after `x`, so its KV mixes `x` in; its
# hash chains `x`'s, and the lookup after `y` misses. A hash of `z`'s tokens alone would hit, and
# hand over the wrong KV silently.

# %%
check_answer(len(y), other.num_cached_tokens, "1. chained hash")
assert compute_hash(z, compute_hash(x)) in check.hash_to_block_id  # z is cached, but under x's name

# %% [markdown]
# **2.** Two requests bring the same 64-token prompt, blocks of 16: the first is prefilled, then the
# second arrives. How many of the second's tokens hit, and how many blocks do the two hold in all?
# Answer `(hits, blocks)`.

# %%
answer2 = None  # your answer: replace None with an expression
twice = BlockManager(num_blocks=16, block_size=16)
prompt64 = list(range(100, 164))  # 4 full blocks
for _ in range(2):
    admit(twice, second := Sequence(prompt64, block_size=16))
held = (second.num_cached_tokens, twice.num_used_blocks)  # the second's hits, the blocks in use
check_answer(answer2, held, "2. the same prompt")

# %% [markdown]
# Worked answer: 48 and 5. The last token is always computed (its logits give the first new token),
# so the last block is no hit: 3 blocks are shared, 48 tokens, and the second computes its 4th block
# into a block of its own. The first's 4 blocks and that one: 5.

# %%
check_answer(((64 - 1) // 16 * 16, 4 + 1), held, "2. the same prompt")
