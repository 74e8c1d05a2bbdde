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
# # 03 · KV cache: paged blocks, prefix caching, and the decode kernel
#
# **What this notebook builds.** PagedAttention's bookkeeping (`Sequence`, one request;
# `BlockManager`, which hands out fixed-size KV blocks and shares equal prefixes between requests)
# and the Triton kernels that follow a block table: a store of new keys and values, and decode.
#
# **What it assumes.** Notebook 01's attention and its kernel (each token's keys and values, kept
# per layer: the *KV cache*); notebook 02's `SamplingParams`.
#
# **What you will see.** Why PagedAttention reduces fragmentation, in numbers; why decode needs its
# own kernel. Deep dives follow: `cascade_attention` (decode on a GPU: its roofline, split-K, a
# shared prefix read once) and `paged_prefill` (prefill after a cache hit).

# %%
import os
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: kernels interpreted
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Why the KV cache is the memory problem
# For Qwen3-0.6B (28 layers, 8 KV heads of 128 dimensions, bfloat16), per token and per sequence:

# %%
kv_bytes_per_token = 2 * 28 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bytes
seq_gib = 40_960 * kv_bytes_per_token / 2**30  # a sequence at Qwen3's full context
print(
    f"KV per token: {kv_bytes_per_token // 2**10} KiB; a full-context sequence: {seq_gib:.1f} GiB"
)

# %% [markdown]
# A request does not know how long it will run. Before vLLM, engines reserved a *contiguous* KV
# region per request, big enough for the longest possible sequence: mostly empty, and the worst case
# set how many requests fit. **Paging** is the operating system's answer: cut the cache into
# *blocks* of `block_size` token slots, give a request a block only when it needs one, and keep a
# per-request *block table* from its logical block *i* to a physical block anywhere. Token *t* lives
# at slot:

# %%
block_size, block_table, t = 16, [7, 2, 9], 37  # logical block i -> physical block
slot = block_table[t // block_size] * block_size + t % block_size
print(f"token {t} -> physical block {block_table[t // block_size]}, slot {slot}")

# %% [markdown]
# ## Sequence: one request and where its KV lives
# Its **token ids** (prompt, then completion), a **status**, a **block table**, and
# `num_cached_tokens`: the leading tokens whose KV is already in the cache.

# %% tags=["export"] module="minivllm.engine.sequence"
from enum import Enum, auto
from itertools import count

from minivllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued for prefill: new, or preempted (its KV was dropped)
    RUNNING = auto()  # holds KV blocks
    FINISHED = auto()


class Sequence:
    """One request: its token ids (prompt, then completion), KV block table and sampling params."""

    counter = count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        block_size: int = 16,
    ):
        assert token_ids and block_size >= 1, "the engine refuses empty prompts; block_size >= 1"
        self.seq_id = next(Sequence.counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)  # our own copy
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0  # leading tokens whose KV is in the cache
        self.num_scheduled_tokens = 0  # tokens this step computes after them (the scheduler's)
        self.block_size = block_size  # the block manager's
        self.block_table: list[int] = []  # logical block i -> physical block id
        self.sampling_params = sampling_params or SamplingParams()
        self.finish_reason: str | None = None  # "stop" or "length" once finished

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        cached = f"num_cached_tokens={self.num_cached_tokens}"
        return f"Sequence({self.seq_id}, {self.status.name}, {self.token_ids}, {cached})"

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
from minivllm.engine.sequence import Sequence

seq = Sequence([11, 12, 13, 14, 15, 16, 17, 18, 19, 20], block_size=4)
seq.append_token(99)
print(seq, [seq.block(i) for i in range(seq.num_blocks)])
assert (seq.num_blocks, seq.last_block_num_tokens, seq.completion_token_ids) == (3, 3, [99])

# %% [markdown]
# ## Prefix caching: naming a block by everything before it
# Many requests start the same way (a system prompt, earlier chat turns), so a block computed once
# could be shared. But a block's KV depends on *every* earlier token, so a block is named by a
# **chained hash** of (the previous block's hash, its token ids): the same tokens after another
# prefix get another name. Only *full* blocks are shared: a partial one is still being written.

# %% tags=["export"] module="minivllm.engine.block_manager"
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import xxhash

from minivllm.engine.sequence import Sequence


def compute_hash(token_ids: list[int], parent_hash: int = -1) -> int:
    """xxh64 of (the previous block's hash, this block's token ids); -1: no previous block."""
    h = xxhash.xxh64()
    if parent_hash != -1:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())  # int64 token ids
    return h.intdigest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0  # sequences whose block table holds it; free at 0
    hash: int = -1  # its chained hash once full and cached, else -1
    token_ids: list[int] = field(default_factory=list)  # the tokens behind `hash`, to verify a hit


# %%
from minivllm.engine.block_manager import compute_hash

a, b = [1, 2, 3, 4], [5, 6, 7, 8]
b_after_a, b_after_b = compute_hash(b, compute_hash(a)), compute_hash(b, compute_hash(b))
print(f"hash of b after a: {b_after_a:#x}; after b: {b_after_b:#x}")

# %% [markdown]
# ## The BlockManager (write one first? `exercises/03_paged_allocator`, then `03_prefix_caching`)
# A block here is an id and a `ref_count` (the tensors live in the model runner, notebook 04). The
# scheduler (notebook 05) calls `can_allocate`/`allocate` for a waiting
# sequence, `cache_blocks` in the step that computes a prompt's KV, `can_append`/`may_append` after
# each decoded token, and `deallocate` when a sequence ends or is preempted. Three rules:
#
# * **Two free lists.** A freed full block keeps its hash and KV for a later hit: new KV goes into
#   an empty block while one is left, only then into the least recently freed cached one.
# * **The last token is always computed**: prefill must produce its logits. So a wholly cached
#   prompt's last block is no hit, and a request never writes into a block another reads.
# * **A block is cached in the step that computes its KV**, not at `allocate`: a prompt prefilled
#   over several steps (notebook 05) must not be hit before its KV is written.
#
# xxh64 is fast but not cryptographic: a hit is checked against the block's token ids too.


# %% tags=["export"]
class BlockManager:
    """Fixed-size KV blocks for sequences, with ref counts and prefix caching of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            sizes = f"got {num_blocks} and {block_size}"
            raise ValueError(f"num_blocks and block_size must be >= 1, {sizes}")
        self.num_blocks = num_blocks
        self.block_size = block_size  # the one owner: sequences and the scheduler read it here
        self.enable_prefix_caching = enable_prefix_caching
        self.reset()

    def reset(self) -> None:
        """Every block free and empty, nothing cached, whatever was held before."""
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(self.num_blocks))  # free and empty
        self.cached_block_ids: OrderedDict[int, None] = OrderedDict()  # free, cached; LRU first

    @property
    def num_slots(self) -> int:
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

    def _take_free_block(self) -> Block:
        """An empty block if any is left, else evict the least recently freed cached one."""
        if self.free_block_ids:
            block = self.blocks[self.free_block_ids.popleft()]
        else:
            block = self.blocks[self.cached_block_ids.popitem(last=False)[0]]
            del self.hash_to_block_id[block.hash]
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
            self.cached_block_ids[block.block_id] = None  # keep its KV for a later hit
        else:
            block.hash, block.token_ids = -1, []
            self.free_block_ids.append(block.block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for a waiting sequence: its leading full blocks found cached, then new ones."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        assert seq.block_size == self.block_size, f"the sequence's block_size is {seq.block_size}"
        assert self.can_allocate(seq), "allocate() without room: ask can_allocate() first"
        # no hits for prompt logprobs, which score every token; the last token is always computed
        reuse = self.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None
        parent_hash = -1
        for i in range((seq.num_tokens - 1) // self.block_size if reuse else 0):
            token_ids = seq.block(i)
            parent_hash = compute_hash(token_ids, parent_hash)
            hit = self.hash_to_block_id.get(parent_hash)
            if hit is None or self.blocks[hit].token_ids != token_ids:  # a miss, or a collision
                break
            self._share(self.blocks[hit])
            seq.block_table.append(hit)
        seq.num_cached_tokens = len(seq.block_table) * self.block_size
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block().block_id)

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache the new full blocks of seq's first `num_tokens`, in the step computing their KV."""
        assert seq.num_cached_tokens <= num_tokens <= seq.num_tokens
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_cached_blocks, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            assert block.hash == -1, "only its own sequence writes a block being computed"
            parent_hash = self.blocks[seq.block_table[i - 1]].hash if i else -1
            token_ids = seq.block(i)
            self._cache(block, compute_hash(token_ids, parent_hash), token_ids)

    def can_append(self, seq: Sequence) -> bool:
        """After append_token: is there a free block in case the new token starts one?"""
        return self.num_free_blocks >= (len(seq.block_table) < seq.num_blocks)

    def may_append(self, seq: Sequence) -> None:
        """After append_token: a new block if the new token starts one; cache the last once full."""
        assert seq.num_blocks - len(seq.block_table) in (0, 1), "call it after each append_token"
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block().block_id)
        if seq.last_block_num_tokens == self.block_size and self.enable_prefix_caching:
            self._cache_last_block(seq)

    def token_known(self, seq: Sequence) -> None:
        """seq's newest token, a placeholder until now (05), is known: re-cache a block cached with
        it."""
        table = seq.block_table
        if table and len(table) == seq.num_blocks and self.blocks[table[-1]].hash != -1:
            self._cache_last_block(seq)

    def _cache_last_block(self, seq: Sequence) -> None:
        """Cache seq's full last block under the hash of its tokens, dropping a hash it held."""
        last = self.blocks[seq.block_table[-1]]
        if self.hash_to_block_id.get(last.hash) == last.block_id:
            del self.hash_to_block_id[last.hash]
        parent_hash = self.blocks[seq.block_table[-2]].hash if len(seq.block_table) > 1 else -1
        token_ids = seq.block(seq.num_blocks - 1)
        self._cache(last, compute_hash(token_ids, parent_hash), token_ids)

    def deallocate(self, seq: Sequence) -> None:
        """Give back a finished or preempted sequence's blocks, tail first: a shared head is evicted
        last."""
        assert seq.block_table, f"sequence {seq.seq_id} holds no blocks (freed twice?)"
        for block_id in reversed(seq.block_table):
            self._release(self.blocks[block_id])
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def discard(self, seq: Sequence) -> None:
        """Give back a sequence dropped mid-step: first uncache its blocks past `num_cached_tokens`,
        whose KV that step may not have written."""
        for block_id in seq.block_table[seq.num_cached_blocks :]:
            if self.hash_to_block_id.get(self.blocks[block_id].hash) == block_id:
                del self.hash_to_block_id[self.blocks[block_id].hash]
        self.deallocate(seq)


# %% [markdown]
# ## Watch it work
# 8 blocks of 4 slots. `admit` allocates a sequence and plays the step that computes its prompt
# (notebook 05's job). `s1` and `s2` begin with the same two-block system prompt.

# %%
from minivllm.engine.block_manager import BlockManager


def admit(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))


def show(bm: BlockManager, note: str) -> None:
    cached = [b.block_id for b in bm.blocks if b.hash != -1]
    print(f"{note:<26} ref counts {[b.ref_count for b in bm.blocks]}, cached blocks {cached}")


bm = BlockManager(num_blocks=8, block_size=4)
system = [1, 2, 3, 4, 5, 6, 7, 8]
admit(bm, s1 := Sequence(system + [30, 31], block_size=4))
show(bm, f"s1 holds {s1.block_table}")
admit(bm, s2 := Sequence(system + [40, 41, 42], block_size=4))
show(bm, f"s2 holds {s2.block_table}")
assert s2.num_cached_tokens == 8 and bm.blocks[0].ref_count == 2  # shared, its KV not recomputed
bm.deallocate(s1)
bm.deallocate(s2)
show(bm, "both finished")
admit(bm, s3 := Sequence(system + [50], block_size=4))
show(bm, f"s3 holds {s3.block_table}")
assert s3.num_cached_tokens == 8 and s3.block_table[:2] == [0, 1]  # freed, but still cached

# %% [markdown]
# Why `allocate` caches nothing: `long` (17 tokens) is prefilled in chunks, 8 tokens first. A
# request with the same first 16 tokens arriving then must hit the two blocks computed, not the two
# not yet written:

# %%
chunked = BlockManager(num_blocks=16, block_size=4)
chunked.allocate(long := Sequence(list(range(1, 18)), block_size=4))
chunked.cache_blocks(long, 8)  # the first chunk's step
long.num_cached_tokens = 8  # what the scheduler records once it has run
admit(chunked, early := Sequence(list(range(1, 17)) + [99], block_size=4))
assert early.num_cached_tokens == 8

# %% [markdown]
# ## Why does PagedAttention reduce fragmentation? A simulated workload
# The question this notebook is for. 600 requests (prompts of 16 to 512 tokens, ~300 generated
# tokens on average, `max_tokens=1024`) replayed on 65,536 KV slots: a **contiguous** region of
# `max_model_len = 2048` slots per request (engines before paging), a tighter contiguous
# `prompt + max_tokens` placed first-fit, or **paged** blocks (our `BlockManager`) of 256, 64 and 16
# slots. Each step, a reserved slot holds a **token**, is reserved **ahead** for one to come, or is
# **over-reserved** for tokens its request will never produce; a free slot is **stranded** in a hole
# too small for the next request, or **free** (`minivllm/benchmarks/fragmentation.py`).

# %%
from minivllm.benchmarks.fragmentation import plot_fragmentation, print_fragmentation, run_schemes

runs = run_schemes(num_requests=600)
print_fragmentation(runs)
plot_fragmentation(runs).savefig(FIGURES / "03_fragmentation.png", dpi=120)

# %% [markdown]
# **Reading the figure.** A max-length region is mostly over-reserved: a request uses a few hundred
# of its 2,048 slots. `prompt + max_tokens` still over-reserves, and its regions differ in size, so
# free memory is stranded in holes. Paged blocks come as tokens arrive and any free block serves any
# request: the waste is the unfilled end of each request's last block. So about three times as many
# requests run at once: PagedAttention's throughput.

# %%
occupancy = {name: run["occupancy"] for name, run in runs.items()}
assert occupancy["paged, block 16"] > 0.97 and occupancy["contiguous, max length"] < 0.35
assert sorted(occupancy, key=occupancy.get) == list(runs)  # each scheme beats the one before
assert runs["paged, block 16"]["batch"] > 2.5 * runs["contiguous, max length"]["batch"]


# %% [markdown]
# ## The KV cache in memory
# Per layer, `k_cache` and `v_cache` are `(num_blocks, block_size, num_kv_heads, head_dim)`
# (flash-attn's layout); viewed as `(num_blocks * block_size, ...)`, a slot is a row. Each step
# stores each new token's `k` and `v` in its slot (`slot_mapping`, `-1` for padding), then each
# query attends to its sequence's rows through its block table.

# %% tags=["export"] module="minivllm.kernels.paged_attn"
import math

import torch
import triton
import triton.language as tl

from minivllm.kernels.flash_attn import attend_block, load_tile, softmax_scale_of


@triton.jit
def _store_kvcache_kernel(
    k, v, k_cache, v_cache, slot_mapping, strides, KV_SIZE: tl.constexpr, BLOCK: tl.constexpr
):
    """One program per token: its k and v rows (KV_SIZE values each) into its slot's rows."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:  # a padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)  # KV_SIZE rounded up to a power of two
    mask = offs < KV_SIZE
    k_row = tl.load(k + token * strides[0] + offs, mask=mask)
    v_row = tl.load(v + token * strides[1] + offs, mask=mask)
    tl.store(k_cache + slot * KV_SIZE + offs, k_row, mask=mask)
    tl.store(v_cache + slot * KV_SIZE + offs, v_row, mask=mask)


def check_cache(name: str, cache: torch.Tensor, q: torch.Tensor) -> None:
    like_q = cache.dtype == q.dtype and cache.device == q.device
    if cache.dim() != 4 or not like_q or not cache.is_contiguous():
        want = f"a contiguous (num_blocks, block_size, num_kv_heads, head_dim) {q.dtype} tensor"
        got = f"{cache.dtype} {tuple(cache.shape)} on {cache.device}"
        raise ValueError(f"{name} must be {want} on {q.device}, got {got}")


def check_index(
    name: str, t: torch.Tensor, dim: int, device: torch.device, dtypes=(torch.int32,)
) -> None:
    if t.dim() != dim or t.dtype not in dtypes or t.device != device:
        want = f"{dim}-D {' or '.join(map(str, dtypes))} tensor on {device}"
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}"
        raise ValueError(f"{name} must be a {want}, got {got}")


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
    if not k.shape == v.shape == (slot_mapping.numel(), *k_cache.shape[2:]):
        shapes = f"k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}"
        raise ValueError(
            f"k and v must be (slot_mapping's length, num_kv_heads, head_dim): {shapes}"
        )
    for x in (k, v):
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            raise ValueError(
                "each token's k and v must be contiguous (num_kv_heads, head_dim) rows"
            )
    strides = (k.stride(0), v.stride(0))
    kv_size = k.shape[1] * k.shape[2]
    block = triton.next_power_of_2(kv_size)
    _store_kvcache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, strides, kv_size, block
    )


# %%
from minivllm.kernels.paged_attn import store_kvcache

k_cache, v_cache = torch.zeros(2, 4, 16, 2, 32, device=DEVICE)  # 4 blocks of 16 slots each
k, v = torch.randn(2, 3, 2, 32, device=DEVICE)
store_kvcache(k, v, k_cache, v_cache, torch.tensor([37, -1, 5], device=DEVICE))  # -1: padding
flat_k = k_cache.view(-1, 2, 32)
torch.testing.assert_close(flat_k[[37, 5]], k[[0, 2]])
assert flat_k.abs().sum(dim=(1, 2)).count_nonzero() == 2  # nothing else was written

# %% [markdown]
# ## Why decode needs its own attention kernel
# In prefill each key the kernel loads serves a whole tile of queries: many FLOPs per byte, so
# compute sets the speed (notebook 01). In decode each sequence brings **one** query per head, and
# its whole KV cache is read for a multiply-add per element per query head. In FLOPs per byte of K
# and V, against an H200's ridge (989 TFLOP/s of bf16 over 4.8 TB/s of memory bandwidth):


# %%
def flop_per_byte(num_queries: int, num_keys: int) -> float:
    """Qwen3-0.6B's 16 query heads over 8 KV heads of 128, bf16: FLOPs per byte of K and V."""
    flops = 4 * num_queries * 16 * num_keys * 128  # q·k and p·v: a multiply-add per key, feature
    return flops / (2 * num_keys * 8 * 128 * 2)  # K and V, 2 bytes each


decode, prefill, ridge = flop_per_byte(1, 2048), flop_per_byte(512, 2048), 989 / 4.8
print(f"decode: {decode:.0f} FLOP/byte; prefill: {prefill:.0f}; the H200's ridge: {ridge:.0f}")
assert decode < ridge / 50 and prefill > ridge

# %% [markdown]
# Decode sits a hundred times below the ridge: the bytes read set its speed (the deep dive
# `cascade_attention` measures this on your CPU). So the kernel reads each byte once: one program
# per (sequence, KV head) serves all the query heads of that KV head (**GQA packing**) and walks
# the sequence's keys a tile at a time through the block table (**paging**, `paged_rows`), with
# notebook 01's `attend_block`. (On a GPU, one sequence is only 8 programs for 132
# multiprocessors: the deep dive splits its keys over more, split-K; the GPU runner runs that.)


# %% tags=["export"]
@triton.jit
def paged_rows(table_row, tok, valid, BLOCK_SIZE: tl.constexpr):
    """Rows of tokens `tok` in the cache viewed as (num_blocks * block_size, ...)."""
    block = tl.load(table_row + tok // BLOCK_SIZE, mask=valid, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE


@triton.jit(do_not_specialize=["stride_bt"])  # varies from step to step (notebook 01)
def _decode_kernel(
    Q,
    K,
    V,
    O,
    cache_seqlens,
    block_table,
    stride_bt,
    qk_scale,
    q_strides,
    o_strides,
    kv_strides,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head): its query heads over all the sequence's keys."""
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    seqlen = tl.load(cache_seqlens + seq)
    offs_g, offs_d, offs_n = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_N)
    heads, mask = kv_head * GROUP + offs_g, offs_g < GROUP  # padded: tl.dot needs 16 rows
    q_rows = Q + seq * q_strides[0] + heads * q_strides[1]  # (GROUP_PAD,)
    q = load_tile(q_rows[:, None] + offs_d[None, :], mask[:, None], UPCAST)  # (GROUP_PAD, HEAD_DIM)
    table = block_table + seq * stride_bt  # this sequence's row
    K, V = K + kv_head * kv_strides[1], V + kv_head * kv_strides[3]  # this KV head's columns
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for start in range(0, seqlen, BLOCK_N):
        tok = start + offs_n  # (BLOCK_N,)
        valid = tok < seqlen
        rows = paged_rows(table, tok, valid, BLOCK_SIZE)
        k_ptrs = K + rows[None, :] * kv_strides[0] + offs_d[:, None]  # (HEAD_DIM, BLOCK_N)
        v_ptrs = V + rows[:, None] * kv_strides[2] + offs_d[None, :]  # (BLOCK_N, HEAD_DIM)
        k = load_tile(k_ptrs, valid[None, :], UPCAST)
        v = load_tile(v_ptrs, valid[:, None], UPCAST)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, valid[None, :], qk_scale, PRECISION)
    out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    o_rows = O + seq * o_strides[0] + heads * o_strides[1]  # (GROUP_PAD,)
    tl.store(o_rows[:, None] + offs_d[None, :], out, mask=mask[:, None])


def flash_attn_with_kvcache(
    q: torch.Tensor,  # (batch, 1, num_heads, head_dim): one new query per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,  # (batch,) int32: tokens in each cache, >= 1
    block_table: torch.Tensor | None = None,  # (batch, max_blocks) int32
    softmax_scale: float | None = None,
    causal: bool = False,  # one query that sees its whole cache: causal or not is the same
    out: torch.Tensor | None = None,  # like q, to write into; None: a new tensor
) -> torch.Tensor:  # (batch, 1, num_heads, head_dim)
    """Decode attention over a paged KV cache, flash-attn's signature, GQA-packed."""
    assert cache_seqlens is not None and block_table is not None, "the cache is paged"
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, on_cpu = k_cache.shape[2], q.device.type == "cpu"
    k, v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q) if out is None else out
    strides = [(t.stride(0), t.stride(2)) for t in (q, out)]  # (sequence, head) of q, of out
    kv_strides = (*k.stride()[:2], *v.stride()[:2])  # (token, head) of k, then of v
    qk_scale = softmax_scale_of(softmax_scale, head_dim) * math.log2(math.e)  # exp2's units
    group = num_heads // num_kv_heads
    args = (q, k, v, out, cache_seqlens, block_table, block_table.stride(0), qk_scale)
    _decode_kernel[(batch, num_kv_heads)](
        *args,
        *strides,
        kv_strides,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=16 if on_cpu else 64,  # small tiles keep the interpreter quick
        UPCAST=on_cpu and q.dtype != torch.float32,  # the interpreter's bf16
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


# %% [markdown]
# Check: sequences of 1 to 300 tokens in shuffled blocks, several block sizes and GQA ratios,
# against notebook 01's reference.

# %%
from minivllm.kernels.paged_attn import flash_attn_with_kvcache
from minivllm.kernels.reference import attention_ref
from minivllm.testing import scatter_into_cache  # random K/V in shuffled blocks, and contiguous

seq_lens = [1, 17, 300, 64]
lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)  # one query each
for block_size, group in ((16, 4), (32, 1), (256, 8)):
    k_cache, v_cache, table, k, v, cu_k = scatter_into_cache(
        seq_lens, 8 // group, 32, block_size, DEVICE
    )
    q = torch.randn(len(seq_lens), 1, 8, 32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, lens, table)
    ref = attention_ref(q[:, 0], k, v, cu_q, cu_k)
    error = (out[:, 0] - ref).abs().max()
    print(f"block_size {block_size:>3}, GQA {group}: max error {error:.1e}")
    assert error < 1e-4


# %% [markdown]
# ## Paged attention without a GPU
# Triton's interpreter is exact but thousands of times slower, so on a CPU the engine uses PyTorch:
# a store is an indexed assignment; attention gathers each sequence's rows and calls notebook 01's
# reference. (The paged prefill *kernel*: the deep dive `paged_prefill`.)

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
    """A sequence's first `num_tokens` rows: (num_tokens, num_kv_heads, head_dim)."""
    num_blocks = -(-num_tokens // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_tokens]


def paged_attention_ref(
    q: torch.Tensor,  # (total_q, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # (batch + 1,)
    cu_seqlens_k: torch.Tensor,  # (batch + 1,): tokens in each sequence's cache, new ones included
    block_table: torch.Tensor,  # (batch, max_blocks)
    softmax_scale: float | None = None,
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """Causal attention of new tokens over their sequence's whole cache (decode: one new token)."""
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    k = torch.cat([gather_kv(k_cache, block_table[i], n) for i, n in enumerate(k_lens)])
    v = torch.cat([gather_kv(v_cache, block_table[i], n) for i, n in enumerate(k_lens)])
    return attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True)


# %%
from minivllm.kernels.paged_reference import paged_attention_ref

seq_lens, q_lens = [1, 17, 300, 64, 40], [1, 5, 64, 17, 40]  # tokens in the cache; new ones
cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=DEVICE)
k_cache, v_cache, table, k, v, cu_k = scatter_into_cache(seq_lens, 2, 32, 16, DEVICE)
q = torch.randn(sum(q_lens), 4, 32, device=DEVICE)
ref = attention_ref(q, k, v, cu_q, cu_k, causal=True)  # the same keys, contiguous
torch.testing.assert_close(paged_attention_ref(q, k_cache, v_cache, cu_q, cu_k, table), ref)

# %% [markdown]
# ## How fast: decode kernels on an H200
# `python -m minivllm.benchmarks.decode`, in bytes of K and V read per second: `minivllm-triton`
# (this kernel split-K, as the GPU runner runs it: deep dive `cascade_attention`), `flashinfer`
# (vLLM's) and `naive-gather-sdpa` (blocks copied out, then PyTorch's attention), among others,
# against the GPU's copy bandwidth. A GPU re-measures a subset; else the committed H200 data.

# %%
import json

from minivllm.benchmarks.decode import plot_decode, run_decode_benchmark

if DEVICE == "cuda":
    decode_data = run_decode_benchmark(shapes=[(1, 16384), (64, 4096)], block_sizes=(16,))
else:
    decode_data = json.loads(Path("figures/decode.json").read_text())
plot_decode(decode_data).savefig(FIGURES / "04_decode.png", dpi=120)

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

# %% [markdown]
# **2.** Two requests bring the same 64-token prompt, blocks of 16: the first is prefilled, then the
# second arrives. How many of the second's tokens hit, and how many blocks do the two hold in all?
# Answer `(hits, blocks)`.

# %%
answer2 = None  # your answer: replace None with an expression
twice = BlockManager(num_blocks=16, block_size=16)
for _ in range(2):
    admit(twice, second := Sequence(list(range(100, 164)), block_size=16))
held = (second.num_cached_tokens, twice.num_used_blocks)
check_answer(answer2, held, "2. the same prompt")

# %% [markdown]
# Worked answer: 48 and 5. The last token is always computed (its logits give the first new token),
# so the last block is no hit: 3 blocks are shared, and the second computes its 4th block into a
# block of its own. The first's 4 blocks and that one: 5.

# %%
check_answer(((64 - 1) // 16 * 16, 4 + 1), held, "2. the same prompt")
