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
# # Deep dive · Decode on a GPU: split-K, split counts in SM waves, and a shared prefix read once
#
# **What this adds.** First, the roofline of decode measured on your CPU: why its speed is the
# bytes it reads. Then three things notebook 03's decode kernel leaves out, all for speed on a GPU.
# **Split-K**: 03 runs one program per (sequence, KV head), too few to keep a GPU's
# multiprocessors (SMs) busy when the batch is small, so each sequence's keys are split over
# several programs and their results combined exactly. **How many splits**: as many as the batch
# leaves room for in one wave of programs. **Cascade attention**: when many rows begin with the
# same cached blocks (a system prompt, thanks to prefix caching), 03 reads those blocks once *per
# row*; cascade reads them once for all the rows.
#
# **Where it sits.** It follows notebook 03 (`Sequence`, `BlockManager`, the decode kernel and
# `paged_rows`). It exports `minivllm/kernels/cascade.py`: `decode_num_splits`, and a
# `flash_attn_with_kvcache` with notebook 03's arguments plus `out`, `prefix_blocks` and
# `prefix_lens`, its inputs checked. Nothing in the core path needs it: the GPU runner uses it (the
# deep dive `cuda_graphs` finds the shared prefix), and every output is the same with or without it
# (up to rounding).
#
# **Write it yourself first?** `exercises/03_cascade_attention.ipynb` builds the cascade in PyTorch.

# %%
import os

import torch

if not torch.cuda.is_available():
    # before any @triton.jit runs: the kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
import functools
import json
import time
from pathlib import Path
from unittest import mock

import matplotlib.pyplot as plt
import numpy as np
import torch.nn.functional as F

from minivllm.kernels import paged_attn
from minivllm.kernels.paged_reference import paged_attention_ref
from minivllm.kernels.reference import attention_ref
from minivllm.testing import check_answer, scatter_into_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)

# %% [markdown]
# ## Decode on a roofline, measured on your CPU
# Notebook 03 computed decode's FLOPs per byte: a hundred times below an H200's ridge. Here it is
# measured, with PyTorch's attention (float32) on this CPU: first its limits, a big matmul's FLOP/s
# and a big copy's bytes/s; then attention shaped as decode (8 sequences, one query each over 2,048
# cached tokens) and as prefill (512 queries over 2,048 keys). Other work on the machine moves the
# timings: read ratios.


# %%
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
fig.savefig(FIGURES / "cascade_cpu_roofline.png", dpi=120)

# %% [markdown]
# Decode reaches a few percent of the matmul's FLOP/s but moves bytes at a good share of the copy's
# rate: its point is under the sloped part of the roof, where bytes set the speed. Prefill sits near
# the flat part, where FLOPs do. So a decode kernel is as fast as it keeps the memory busy: on a
# GPU, that takes enough programs in flight on every SM.
#
# ## Split-K: more programs than sequences × KV heads
# Notebook 03's kernel runs one program per (sequence, KV head): one sequence × 8 KV heads is only 8
# programs for an H200's 132 multiprocessors. **Split-K** cuts each sequence's keys into
# `num_splits` chunks, a program each. Each chunk's softmax has its own sum; weighting each chunk's
# output by `exp(lse_s − lse)`, its share of the whole sum (`lse`: log-sum-exp), combines them
# exactly. In PyTorch, 300 keys in 3 chunks (`exercises/01_online_softmax` builds it):

# %%
q1, k1, v1 = torch.randn(1, 32), torch.randn(300, 32), torch.randn(300, 32)  # one query head
scores = [q1 @ k_s.T * 32**-0.5 for k_s in k1.split(128)]  # 3 splits: 128, 128 and 44 keys
outs = [torch.softmax(s, dim=-1) @ v_s for s, v_s in zip(scores, v1.split(128))]  # own sums
lses = torch.stack([torch.logsumexp(s, dim=-1) for s in scores])  # (3, 1): each split's lse_s
combined = sum(w * out_s for w, out_s in zip(torch.softmax(lses, dim=0), outs))  # exp(lse_s - lse)
one_head = [t[:, None] for t in (q1, k1, v1)]  # (tokens, 1 head, dim)
cu_seqlens = torch.tensor([0, 1]), torch.tensor([0, 300])  # one query, 300 keys
ref = attention_ref(*one_head, *cu_seqlens)[:, 0]
torch.testing.assert_close(combined, ref)
print(f"max error of a plain average of the splits: {(sum(outs) / 3 - ref).abs().max():.2f}")

# %% [markdown]
# ## How many splits: one wave of programs
# A decode step launches `batch × num_kv_heads × num_splits` programs. A program of the decode
# kernel is small (4 warps), so an SM runs about 4 at once, and an H200's 132 SMs run a **wave** of
# about 528. Fewer programs than a wave leave SMs idle; many more only add partial results to
# combine. So: when `batch × num_kv_heads` programs fill less than a wave, split each sequence
# enough to fill one (up to 128 splits); past a wave, 2 splits, the best of a sweep on an H200.
# The count depends on the batch size alone, not
# on the lengths, so a CUDA graph captured for a batch size keeps it. On a CPU: 1. The kernels come
# below, after the shared prefix: the split-K decode kernel is one of them.


# %% tags=["export"] module="minivllm.kernels.cascade"
import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from minivllm.kernels.flash_attn import attend_block, load_tile, softmax_scale_of
from minivllm.kernels.paged_attn import check_cache, check_index, paged_rows


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits for one wave of ~4 programs per SM, or 2 past a wave (an H200 sweep); per batch
    size only: CUDA graphs fix it."""
    if device.type == "cpu":
        return 1
    programs, wave = batch * num_kv_heads, 4 * num_sms(device)
    return min(128, wave // programs) if programs <= wave else 2


# %% [markdown]
# For Qwen3-0.6B's 8 KV heads on an H200 (a rule by context length alone, one split per 1,024
# tokens, would give a 16,384-token context 16 splits at every batch size: 32,768 programs at
# batch 256):

# %%
from minivllm.kernels import cascade

with mock.patch.object(cascade, "num_sms", lambda device: 132):  # an H200's
    for batch in (1, 8, 64, 256):
        splits = cascade.decode_num_splits(batch, 8, torch.device("cuda"))
        programs = batch * 8 * splits
        print(f"batch {batch:>3}: {splits:>2} splits, {programs:>4} programs")
        assert programs <= 4 * 132 or splits == 2

# %% [markdown]
# ## Why a shared prefix wastes decode's reads
# In a chat service every request begins with the same system prompt, and prefix caching makes its
# blocks the *same* blocks in every row's block table. The decode kernel still reads them
# once per row, for one query per query head: a few FLOPs per byte, far below the GPU's ridge point.
# Yet the rows' queries over those shared keys form a matrix product: all the rows' queries times
# the same keys. **Cascade attention** (FlashInfer's name; vLLM runs it when every request shares a
# prefix) cuts each row's keys in two:
#
# * the **shared prefix**, attended by all the rows' queries together: one program per tile of
#   `BLOCK_M` (row, query head) pairs of a KV head runs `attend_split` over the prefix's blocks
#   (no causal mask: every row sees the whole prefix), each key tile read once per tile of rows,
#   not once per row;
# * each row's **own keys** (its prompt after the prefix, its output so far): the split-K decode
#   kernel, from `prefix_lens[row]` on.
#
# Each half is a split in the split-K sense: an output normalised by its own sum, and its
# log-sum-exp. The prefix's results go into more split slots of each row, and the combine merges
# them exactly, as it merges splits. Per layer of Qwen3-0.6B, 256 rows that share a 1,488-token
# prompt and hold ~350 tokens each of their own (notebook 06's chat workload):

# %%
rows, shared, own = 256, 1488, 350
kv_bytes_per_token = 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16
per_row = rows * (shared + own) * kv_bytes_per_token / 1e6
cascade_mb = (shared + rows * own) * kv_bytes_per_token / 1e6
print(f"K and V read per layer: {per_row:.0f} MB row by row, {cascade_mb:.0f} MB, prefix once")
# 2 query heads per KV head, bf16
flops_per_byte = lambda queries: 4 * queries * 2 * 128 / (2 * 128 * 2)
print(
    f"the prefix's FLOP/byte with all rows' queries: {flops_per_byte(rows):.0f} (one row's: "
    f"{flops_per_byte(1):.0f})"
)
assert cascade_mb < per_row / 4

# %% [markdown]
# ## The kernels
# Two pieces first. `attend_split` is notebook 03's loop over a sequence's keys, for keys `lo` to
# `hi - 1` only, ending with the split's output and its log-sum-exp (log2 units, as `attend_block`
# keeps them); a split with no key gets `-inf`, a weight of 0. `store_split` writes both to scratch
# rows. Then three kernels:
#
# * `_own_keys_kernel`: the split-K decode kernel: 03's, with a third program index, the split,
#   and its keys starting at `prefix_lens[row]` (0 for a row that does not share the prefix), its
#   splits in the first of each row's `num_slots` scratch rows;
# * `_shared_prefix_kernel`: one program per (tile of rows, KV head, split of the prefix), into the
#   scratch rows after them. The prefix gets one length for all its rows, the largest of
#   `prefix_lens`; a row that does not share it is computed as padding and never read;
# * `_combine_splits_kernel`: the combine above (there in PyTorch) as one kernel, counting the
#   prefix's slots only for the rows that share it, and leaving a row with an empty cache (a CUDA
#   graph's padding row) alone.


# %% tags=["export"]
@triton.jit
def attend_split(
    q,
    K,
    V,
    table_row,
    lo,
    hi,
    qk_scale,
    kv_strides,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Queries q (ROWS, D) over keys lo..hi-1 of a block table row, K and V pointing at one KV
    head: the output, and the log2-sum-exp (ROWS,)."""
    ROWS: tl.constexpr = q.shape[0]
    HEAD_DIM: tl.constexpr = q.shape[1]
    stride_k, stride_v = kv_strides[0], kv_strides[2]  # from one token to the next
    offs_d, offs_n = tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_N)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n  # (BLOCK_N,)
        valid = tok < hi
        rows = paged_rows(table_row, tok, valid, BLOCK_SIZE)
        k_ptrs = K + rows[None, :] * stride_k + offs_d[:, None]  # (HEAD_DIM, BLOCK_N)
        v_ptrs = V + rows[:, None] * stride_v + offs_d[None, :]  # (BLOCK_N, HEAD_DIM)
        k = load_tile(k_ptrs, valid[None, :], UPCAST)
        v = load_tile(v_ptrs, valid[:, None], UPCAST)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, valid[None, :], qk_scale, PRECISION)
    empty = l_i == 0.0  # a split with no key: past the end of a short sequence
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = m_i + tl.math.log2(tl.where(empty, 1.0, l_i))
    return out, tl.where(empty, float("-inf"), lse)


@triton.jit
def store_split(partial_out, partial_lse, rows, out, lse, mask):
    """A split's out (ROWS, D) and lse (ROWS,) into `rows` of the scratch tensors."""
    HEAD_DIM: tl.constexpr = out.shape[1]
    out_ptrs = partial_out + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(out_ptrs, out, mask=mask[:, None])
    tl.store(partial_lse + rows, lse, mask=mask)


@triton.jit(do_not_specialize=["num_slots", "stride_bt"])
def _own_keys_kernel(
    Q,
    K,
    V,
    partial_out,
    partial_lse,
    cache_seqlens,
    block_table,
    prefix_lens,
    qk_scale,
    num_slots,
    stride_bt,
    q_strides,
    kv_strides,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Split `split` of a row's keys from prefix_lens[seq] on (notebook 03's kernel, split-K)."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seqlen = tl.load(cache_seqlens + seq)
    first = tl.load(prefix_lens + seq) if HAS_PREFIX else 0  # the keys before: the shared prefix
    chunk = tl.cdiv(tl.cdiv(seqlen - first, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    offs_g = tl.arange(0, GROUP_PAD)
    heads, mask = kv_head * GROUP + offs_g, offs_g < GROUP
    q_rows = Q + seq * q_strides[0] + heads * q_strides[1]  # (GROUP_PAD,)
    q_ptrs = q_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    q = load_tile(q_ptrs, mask[:, None], UPCAST)  # (GROUP_PAD, HEAD_DIM)
    table = block_table + seq * stride_bt
    K, V = K + kv_head * kv_strides[1], V + kv_head * kv_strides[3]
    out, lse = attend_split(
        q, K, V, table, lo, hi, qk_scale, kv_strides, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION
    )
    rows = (seq * tl.num_programs(1) * GROUP + heads) * num_slots + split  # (GROUP_PAD,)
    store_split(partial_out, partial_lse, rows, out, lse, mask)


@triton.jit(do_not_specialize=["batch", "num_slots", "first_slot"])
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
    num_slots,
    first_slot,
    q_strides,
    kv_strides,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Split `split` of the shared prefix for BLOCK_M (row, query head) pairs of one KV head, into
    scratch slot first_slot + split."""
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
    q = load_tile(q_ptrs, shares[:, None], UPCAST)  # (BLOCK_M, HEAD_DIM)
    K, V = K + kv_head * kv_strides[1], V + kv_head * kv_strides[3]
    # a non-sharer's row is computed too, and never read: the combine kernel skips its slots
    out, lse = attend_split(
        q, K, V, prefix_blocks, lo, hi, qk_scale, kv_strides, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION
    )
    rows = (seq * tl.num_programs(1) * GROUP + heads) * num_slots + first_slot + split
    store_split(partial_out, partial_lse, rows, out, lse, seq < batch)


@triton.jit(do_not_specialize=["num_splits", "prefix_splits"])
def _combine_splits_kernel(
    partial_out,
    partial_lse,
    O,
    cache_seqlens,
    prefix_lens,
    num_splits,
    prefix_splits,
    o_strides,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    if tl.load(cache_seqlens + seq) == 0:
        # not a sequence: a CUDA graph's padding row, whose output row may be another's
        return
    num_slots = num_splits + prefix_splits
    # the shared prefix's splits follow the row's own, if it shares it
    if prefix_splits > 0:
        num_splits += tl.where(tl.load(prefix_lens + seq) > 0, prefix_splits, 0)
    offs_s, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM)
    rows = (seq * tl.num_programs(1) + head) * num_slots + offs_s  # (SPLITS_PAD,)
    lse = tl.load(partial_lse + rows, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    weights = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part_ptrs = partial_out + rows[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(part_ptrs, mask=(offs_s < num_splits)[:, None], other=0.0)  # (SPLITS_PAD, D)
    total = tl.maximum(tl.sum(weights, 0), 1e-30)
    out = tl.sum(parts * weights[:, None], 0) / total
    o_ptrs = O + seq * o_strides[0] + head * o_strides[1] + offs_d
    tl.store(o_ptrs, out.to(O.dtype.element_ty))


def prefix_num_splits(num_programs: int, device: torch.device) -> int:
    """Splits of the shared prefix: enough for one program per SM, given num_programs (tiles × KV
    heads) per split."""
    if device.type == "cpu":
        return 1
    return max(1, min(8, num_sms(device) // num_programs))


# %% [markdown]
# ## The host side
# The inputs' checks (notebook 03's kernel trusts the engine's; this one is public API), then the
# prefix's: `prefix_blocks` and `prefix_lens` go together, one length per row. The split counts
# come from the batch size (`decode_num_splits`) and, for the prefix, from how many tiles of rows
# there are (`prefix_num_splits`). Tile sizes and pipelining
# stages: the fastest of a sweep on an H200 (bf16, head_dim 128, block sizes 16 and 256).


# %% tags=["export"]
def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Where a kernel writes: a new tensor like q, or `out`, checked to fit q."""
    if out is None:
        return torch.empty_like(q)
    like_q = out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    if not like_q or out.stride(-1) != 1:
        want = f"a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}"
        got = f"{out.dtype} {tuple(out.shape)} on {out.device} with strides {out.stride()}"
        raise ValueError(f"out must be {want}, contiguous in its last dimension; got {got}")
    return out


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table) -> None:
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
    if k_cache.shape[3] != head_dim or head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {head_dim} must be a power of two in 16..256, as the cache's")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if cache_seqlens.shape[0] != batch or block_table.shape[0] != batch:
        raise ValueError(f"cache_seqlens and block_table need one row per sequence ({batch})")


def check_prefix(q: torch.Tensor, prefix_blocks, prefix_lens) -> None:
    if (prefix_blocks is None) != (prefix_lens is None):
        raise ValueError(
            "prefix_blocks and prefix_lens go together: the shared blocks, and who shares them"
        )
    if prefix_lens is not None and prefix_blocks is not None:
        check_index("prefix_blocks", prefix_blocks, 1, q.device)
        check_index("prefix_lens", prefix_lens, 1, q.device)
        if prefix_lens.shape[0] != q.shape[0]:
            raise ValueError(
                f"prefix_lens needs one row per sequence ({q.shape[0]}), got {prefix_lens.shape[0]}"
            )


def flash_attn_with_kvcache(
    q: torch.Tensor,  # (batch, 1, num_heads, head_dim): one new query per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,  # (batch,) int32: tokens in each sequence's cache
    block_table: torch.Tensor | None = None,  # (batch, max_blocks) int32
    softmax_scale: float | None = None,
    causal: bool = False,  # one query that sees its whole cache: causal or not is the same thing
    out: torch.Tensor | None = None,  # (batch, 1, num_heads, head_dim) to write into; None: new
    prefix_blocks: torch.Tensor | None = None,  # (n,) int32: blocks beginning several rows' caches
    prefix_lens: torch.Tensor | None = None,  # (batch,) int32: a row's tokens in them, or 0
) -> torch.Tensor:  # (batch, 1, num_heads, head_dim)
    """Notebook 03's decode attention, split-K with a split count in SM waves, its inputs checked.
    Rows that begin with `prefix_blocks` (`prefix_lens` > 0) attend to them together, their keys
    read once."""
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table)
    check_prefix(q, prefix_blocks, prefix_lens)
    assert cache_seqlens is not None and block_table is not None  # checked: for mypy
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, on_cpu = k_cache.shape[2], q.device.type == "cpu"
    num_splits, group = decode_num_splits(batch, num_kv_heads, q.device), num_heads // num_kv_heads
    block_m = 16 if on_cpu else 64  # (row, query head) pairs per program of the prefix kernel
    prefix_grid = (triton.cdiv(batch * group, block_m), num_kv_heads)
    prefix_splits = 0
    if prefix_blocks is not None:
        prefix_splits = prefix_num_splits(prefix_grid[0] * prefix_grid[1], q.device)
    k, v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = check_out(out, q)
    # partial results per row and head: the row's own splits, then the prefix's
    slots = num_splits + prefix_splits
    partial_out = q.new_empty(batch, num_heads, slots, head_dim, dtype=torch.float32)
    partial_lse = q.new_empty(batch, num_heads, slots, dtype=torch.float32)
    tensors = (q, k, v, partial_out, partial_lse)
    lens = cache_seqlens if prefix_lens is None else prefix_lens
    qk_scale = softmax_scale_of(softmax_scale, head_dim) * math.log2(math.e)
    q_strides = (q.stride(0), q.stride(2))  # (batch, head)
    kv_strides = (*k.stride()[:2], *v.stride()[:2])  # (token, head) of k, then of v
    strides = (q_strides, kv_strides)
    common: dict[str, Any] = dict(HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], GROUP=group)
    common.update(BLOCK_N=16 if on_cpu else 64, num_warps=4, num_stages=1 if on_cpu else 2)
    common.update(UPCAST=on_cpu and q.dtype != torch.float32)
    common.update(PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    own = dict(GROUP_PAD=max(16, triton.next_power_of_2(group)), HAS_PREFIX=prefix_lens is not None)
    scalars = (qk_scale, slots, block_table.stride(0))
    _own_keys_kernel[(batch, num_kv_heads, num_splits)](
        *tensors, cache_seqlens, block_table, lens, *scalars, *strides, **own, **common
    )
    if prefix_splits:
        prefix = (prefix_blocks, prefix_lens, qk_scale, batch, slots, num_splits)
        _shared_prefix_kernel[(*prefix_grid, prefix_splits)](
            *tensors, *prefix, *strides, BLOCK_M=block_m, **common
        )
    splits = (num_splits, prefix_splits, (out.stride(0), out.stride(2)))
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
# ## Check it against the reference
# First split-K alone (notebook 03's check, now at several split counts): sequences of 1 to 300
# tokens in shuffled blocks, several block sizes, GQA ratios and numbers of splits (short
# sequences leave some empty), against notebook 01's reference.

# %%
from minivllm.kernels.cascade import flash_attn_with_kvcache

seq_lens = [1, 17, 300, 64]
lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)  # one query each
for block_size, group, splits in ((16, 4, 1), (32, 1, 4), (256, 8, 3)):
    k_cache, v_cache, table, k, v, cu_k = scatter_into_cache(
        seq_lens, 8 // group, 32, block_size, DEVICE
    )
    q = torch.randn(len(seq_lens), 1, 8, 32, device=DEVICE)
    with mock.patch.object(cascade, "decode_num_splits", lambda *_, n=splits: n):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, lens, table)
    ref = attention_ref(q[:, 0], k, v, cu_q, cu_k)
    error = (out[:, 0] - ref).abs().max()
    print(f"block_size {block_size:>3}, GQA {group}, {splits} splits: max error {error:.1e}")
    assert error < 1e-4

# %% [markdown]
# Then the shared prefix. Rows 0–3 below begin with the same 3 blocks (48 tokens), row 4 does
# not. With the prefix given, each row's output must be what notebook 03's PyTorch reference gives
# (each row's keys gathered through its block table), and what notebook 03's decode kernel gives
# reading every key row by row, whatever the number of splits of the prefix (on a CPU, with no
# multiprocessors to fill, `prefix_num_splits` picks 1; here it is forced). Without a prefix, the
# function is notebook 03's kernel split `decode_num_splits` ways.

# %%
seq_lens = [60, 49, 100, 48, 70]
k_cache, v_cache, block_table, _, _, _ = scatter_into_cache(seq_lens, 2, 32, 16, DEVICE)
# rows 1-3 now read row 0's first 48 keys: a cached system prompt
block_table[1:4, :3] = block_table[0, :3]
prefix = dict(
    prefix_blocks=block_table[0, :3],
    prefix_lens=torch.tensor([48, 48, 48, 48, 0], device=DEVICE).int(),
)
q = torch.randn(len(seq_lens), 1, 8, 32, device=DEVICE)
cache_seqlens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)  # one new query per row
cu_k = torch.tensor([0, *seq_lens], device=DEVICE).cumsum(0).int()
# (rows, heads, head_dim)
ref = paged_attention_ref(q[:, 0], k_cache, v_cache, cu_q, cu_k, block_table)
core = paged_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)
row_by_row = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)
torch.testing.assert_close(row_by_row, core, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(row_by_row[:, 0], ref, rtol=1e-4, atol=1e-4)
for num_splits in (1, 3):
    with mock.patch.object(cascade, "prefix_num_splits", lambda *_, n=num_splits: n):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, **prefix)
    print(
        f"prefix in {num_splits} split(s): max difference from the reference "
        f"{(out[:, 0] - ref).abs().max():.1e}"
    )
    torch.testing.assert_close(out[:, 0], ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## Check yourself: who shares the prefix?
# Three rows hold 40 tokens each in blocks of 16; their block tables are `[5, 9, 2]`, `[5, 9, 7]`
# and `[5, 3, 8]`. Given `prefix_blocks = [5, 9]`, which `prefix_lens` (a list, one per row) gives
# every row the output of reading its keys row by row?

# %%
answer = None  # your answer: replace None with a list of three ints
tables = torch.tensor([[5, 9, 2], [5, 9, 7], [5, 3, 8]], dtype=torch.int32, device=DEVICE)
# which rows begin with both prefix blocks
shares = [int(row[:2].tolist() == [5, 9]) for row in tables]
check_answer(answer, [32 * s for s in shares], "who shares the prefix")

# %% [markdown]
# Worked answer: `[32, 32, 0]`. Rows 0 and 1 begin with blocks 5 and 9: 32 tokens each. Row 2 shares
# block 5 only, and the prefix kernel gives all its rows one length: row 2 reads its 40 keys itself.
# Flagging it too would attend its queries to block 9, another row's keys, silently:

# %%
# 10 blocks of 16 slots, 2 KV heads of 32
k_cache, v_cache = torch.randn(2, 10, 16, 2, 32, device=DEVICE)
q = torch.randn(3, 1, 4, 32, device=DEVICE)
lens = torch.full((3,), 40, dtype=torch.int32, device=DEVICE)
row_by_row = flash_attn_with_kvcache(q, k_cache, v_cache, lens, tables)
for prefix_lens in ([32, 32, 0], [32, 32, 32]):
    given = torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, lens, tables, prefix_blocks=tables[0, :2], prefix_lens=given
    )
    errors = (out - row_by_row).abs().amax(dim=(1, 2, 3))  # (3,): each row's largest difference
    print(
        f"prefix_lens {prefix_lens}: largest difference per row",
        ", ".join(f"{e:.1e}" for e in errors),
    )
# the sharers are right either way
torch.testing.assert_close(out[:2], row_by_row[:2], rtol=1e-4, atol=1e-4)
assert (out[2] - row_by_row[2]).abs().max() > 0.01  # row 2, flagged, is wrong
check_answer([32, 32, 0], [32 * s for s in shares], "who shares the prefix")

# %% [markdown]
# ## Measured on an H200
# `python -m minivllm.benchmarks.cascade` times decode attention per layer for rows that share a
# 1,488-token prefix: each row reading every key (`row by row`), the prefix read once (`cascade`),
# and the prefix kernel launched in a step where no row shares it (`cascade, no sharers`: what a
# CUDA graph captured with it costs; the deep dive `cuda_graphs` captures decode graphs both ways).
# On a GPU this cell re-measures two shapes; without one it shows the committed H200 results.

# %%
from minivllm.benchmarks.cascade import plot_cascade, run_cascade_benchmark

if DEVICE == "cuda":
    cascade_data = run_cascade_benchmark(shapes=[(64, 350), (256, 350)])
else:
    cascade_data = json.loads(Path("../figures/cascade.json").read_text())
plot_cascade(cascade_data).savefig(FIGURES / "cascade.png", dpi=120)
cascade_rows = cascade_data["rows"]
us = {(r["impl"], r["batch"], r["own_tokens"]): r["ms"] * 1e3 for r in cascade_rows}
for rows, own in sorted({(b, o) for _, b, o in us}):
    ways = ("row by row", "cascade", "cascade, no sharers")
    print(
        f"{rows:>3} rows, ~{own} own tokens each:",
        ", ".join(f"{w} {us[w, rows, own]:5.0f} µs" for w in ways),
    )

# %% [markdown]
# **Reading it** (computed below from the rows shown). The more rows share the prefix, the more
# reads cascade saves: 256 rows read the prefix once instead of 256 times. Launching the prefix
# kernel in a step where no row shares it costs a few percent: a CUDA graph captured with it must
# not run such steps, which is why the deep dive `cuda_graphs` captures decode graphs both ways,
# and asks for the cascade only when at least `CASCADE_MIN_ROWS` rows share `CASCADE_MIN_TOKENS`
# tokens. These are one machine's measurements: printed, not asserted.

# %%
for rows, own in sorted({(b, o) for _, b, o in us}):
    saved = 1 - us["cascade", rows, own] / us["row by row", rows, own]
    extra = us["cascade, no sharers", rows, own] / us["row by row", rows, own] - 1
    print(
        f"{rows:>3} rows, ~{own} own tokens: cascade saves {saved:4.0%}; the kernel with no "
        f"sharer costs {extra:+.0%}"
    )
