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
# # 04 · The model runner: paged KV kernels, sampling, CUDA graphs, tensor parallelism
#
# **What this notebook builds.** The part of the engine that turns a batch of `Sequence`s (notebook 03) into
# next tokens on the device: the flat inputs and slot mappings of a step, the Triton kernels that write keys
# and values into the paged KV cache and read them back (for decode, and for a prefill that continues after a
# cached prefix), the sampler, CUDA graphs for decode, and tensor-parallel worker processes.
#
# **What it assumes.** Notebook 01's FlashAttention kernel (online softmax), notebook 02's Qwen3 and its
# `AttentionContext`, notebook 03's `Sequence` and `BlockManager` (block tables, slots, prefix hits).
#
# **The one rule of this notebook.** Every path must give the same logits as `prompt_logits` over the whole
# sequence, computed from scratch: a prefix-cache hit, a long decode, a shuffled block table. A paged engine
# that gets this wrong does not crash; it silently writes different text.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
import random
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## The KV cache in memory
# For each layer the cache is two tensors, `k_cache` and `v_cache`, shaped
# `(num_blocks, block_size, num_kv_heads, head_dim)`: flash-attn's layout. A token's *slot* is
# `block_id * block_size + offset`, so viewing the cache as `(num_blocks * block_size, num_kv_heads, head_dim)`
# makes the slot a plain row index. Two operations touch it every step:
#
# * **store**: after computing `k` and `v` for the step's new tokens, write each token's row to its slot
#   (`slot_mapping[i]`, `-1` for padding that must not be written);
# * **attend**: each query reads the rows of its sequence's tokens, following its block table.
#
# Storing is a scatter of whole rows: one program per token copies `num_kv_heads * head_dim` values.

# %% tags=["export"] module="minivllm.kernels.paged_attn"
import math

import torch
import triton
import triton.language as tl

from minivllm.kernels.flash_attn import _check_inputs, _launch_config, attend_block, causal_bounds, load_tile
from minivllm.kernels.flash_attn import flash_attn_varlen_func as flash_attn_varlen_contiguous


@triton.jit
def _store_kvcache_kernel(
    k, v, k_cache, v_cache, slot_mapping, stride_kt, stride_vt, stride_kc, stride_vc,
    KV_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:  # a padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < KV_SIZE
    tl.store(k_cache + slot * stride_kc + offs, tl.load(k + token * stride_kt + offs, mask=mask), mask=mask)
    tl.store(v_cache + slot * stride_vc + offs, tl.load(v + token * stride_vt + offs, mask=mask), mask=mask)


def check_cache(name: str, cache: torch.Tensor, q: torch.Tensor) -> None:
    if cache.dim() != 4 or cache.dtype != q.dtype or cache.device != q.device or not cache.is_contiguous():
        raise ValueError(f"{name} must be a contiguous (num_blocks, block_size, num_kv_heads, head_dim) tensor of "
                         f"{q.dtype} on {q.device}, got {cache.dtype} {tuple(cache.shape)} on {cache.device}")


def check_index(name: str, t: torch.Tensor, dim: int, device: torch.device, dtypes=(torch.int32,)) -> None:
    if t.dim() != dim or t.dtype not in dtypes or t.device != device:
        raise ValueError(f"{name} must be a {dim}-D {' or '.join(map(str, dtypes))} tensor on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


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
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or slot_mapping.numel() != k.shape[0]:
        raise ValueError(f"k, v {tuple(k.shape)}, {tuple(v.shape)} must match the cache's (num_kv_heads, head_dim) "
                         f"{tuple(k_cache.shape[2:])} and slot_mapping's {slot_mapping.numel()} tokens")
    if k.stride(-1) != 1 or k.stride(-2) != k.shape[-1] or v.stride(-1) != 1 or v.stride(-2) != v.shape[-1]:
        raise ValueError("each token's k and v must be contiguous (num_kv_heads, head_dim) rows")
    kv_size = k.shape[1] * k.shape[2]
    _store_kvcache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(1), v_cache.stride(1),
        KV_SIZE=kv_size, BLOCK=triton.next_power_of_2(kv_size),
    )

# %% [markdown]
# Check: stored rows land in their slots, and padding (`-1`) writes nothing.

# %%
from minivllm.kernels.paged_attn import store_kvcache

k_cache = torch.zeros(4, 16, 2, 32, device=DEVICE)  # 4 blocks of 16 slots
v_cache = torch.zeros_like(k_cache)
k, v = torch.randn(3, 2, 32, device=DEVICE), torch.randn(3, 2, 32, device=DEVICE)
slot_mapping = torch.tensor([37, -1, 5], device=DEVICE)  # block 2 offset 5; padding; block 0 offset 5
store_kvcache(k, v, k_cache, v_cache, slot_mapping)
flat_k = k_cache.view(-1, 2, 32)
torch.testing.assert_close(flat_k[37], k[0])
torch.testing.assert_close(flat_k[5], k[2])
assert flat_k.abs().sum(dim=(1, 2)).count_nonzero() == 2  # nothing else was written

# %% [markdown]
# ## Why decode needs its own attention kernel
# In prefill a sequence brings thousands of queries, and every key/value block the kernel loads is used by a
# whole `BLOCK_M` tile of them: many FLOPs per byte, so the tensor cores set the speed (notebook 01).
# In decode each sequence brings **one** query per head. Every byte of its KV cache is read to do 2 FLOPs
# (a multiply-add for `q·k`, one for `p·v`) per query head that shares it. Count it:

# %%
def flops_per_byte(num_queries: int, group: int = 2, head_dim: int = 128, dtype_bytes: int = 2) -> float:
    """Attention FLOPs per byte of K and V read, for `num_queries` queries per KV head group member."""
    flops = 4 * num_queries * group * head_dim  # q·k and p·v for each query head, per key
    return flops / (2 * head_dim * dtype_bytes)  # one key and one value row per key


h200_ridge = 989e12 / 4.8e12  # dense bf16 FLOP/s over HBM bytes/s: below this a kernel waits on memory
for name, n in (("decode (1 query)", 1), ("prefill of 4,096 tokens", 4096)):
    print(f"{name:>24}: {flops_per_byte(n):7.0f} FLOP/byte (H200 ridge point ≈ {h200_ridge:.0f})")
assert flops_per_byte(1) < 10 < h200_ridge < flops_per_byte(4096)

# %% [markdown]
# Decode sits far below the ridge: it is **memory-bound**, and a good decode kernel is one that streams the
# KV cache at full HBM bandwidth. That changes the design:
#
# * **GQA packing.** Qwen3-0.6B's 16 query heads share 8 KV heads. One program handles *all* query heads of
#   a KV head, so each KV block is read once, not twice. (The prefill kernel, one program per query head,
#   reads it once per query head; there it does not matter, here it halves the traffic.)
# * **Split-K (flash-decoding).** One sequence × 8 KV heads is only 8 programs, on a GPU with 132
#   multiprocessors. So we also cut the context into `num_splits` chunks, each program reduces its chunk
#   with online softmax and writes a partial output plus its log-sum-exp; a second tiny kernel combines them:
#   `out = Σ_s exp(lse_s − lse) · out_s` with `lse = log Σ_s exp(lse_s)`.
# * **Paging.** A program finds token `t`'s row through the block table:
#   `block_table[seq, t // block_size] * block_size + t % block_size`. Blocks of 16 tokens are gathered 4 at a
#   time (64 keys per step), blocks of 256 are read in 4 steps each; the kernel works for any block size.
#
# The inner step is notebook 01's `attend_block`, unchanged: the online softmax does not care where the
# keys came from.

# %% tags=["export"]
@triton.jit
def paged_rows(block_table_row, tok, valid, BLOCK_SIZE: tl.constexpr):
    """Rows of tokens `tok` in the cache viewed as (num_blocks * block_size, ...): block base + offset."""
    block = tl.load(block_table_row + tok // BLOCK_SIZE, mask=valid, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE


@triton.jit
def _decode_kernel(
    Q, K, V, partial_out, partial_lse, cache_seqlens, block_table, qk_scale, num_splits,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seqlen = tl.load(cache_seqlens + seq)
    chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    offs_g = tl.arange(0, GROUP_PAD)  # the query heads of this KV head (padded: tl.dot needs 16 rows)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    q = load_tile(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                  (offs_g < GROUP)[:, None], UPCAST)  # (GROUP_PAD, D)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n  # (BLOCK_N,)
        valid = tok < hi
        rows = paged_rows(block_table + seq * stride_bt, tok, valid, BLOCK_SIZE)
        k = load_tile(K + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None], valid[None, :], UPCAST)
        v = load_tile(V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], valid[:, None], UPCAST)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, tok, offs_g, hi, 0, qk_scale, True, False, PRECISION)
    empty = l_i == 0.0  # a split past the end of a short sequence
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))  # log2 units
    mask = offs_g < GROUP
    tl.store(partial_out + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
             out, mask=mask[:, None])
    tl.store(partial_lse + seq * stride_lb + heads * stride_lh + split, lse, mask=mask)


@triton.jit
def _combine_splits_kernel(
    partial_out, partial_lse, O, num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_ob, stride_oh, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(partial_lse + seq * stride_lb + head * stride_lh + offs_s, mask=offs_s < num_splits,
                  other=float("-inf"))  # (SPLITS_PAD,)
    m = tl.max(lse, 0)
    weights = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    parts = tl.load(partial_out + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=(offs_s < num_splits)[:, None], other=0.0)  # (SPLITS_PAD, D)
    out = tl.sum(parts * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1e-30)
    tl.store(O + seq * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))


def decode_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over; depends on the batch only, so a CUDA graph can fix it."""
    if device.type == "cpu":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * num_kv_heads
    return 1 if programs >= num_sms else min(128, 2 * triton.cdiv(2 * num_sms, programs))


def flash_attn_with_kvcache(
    q: torch.Tensor,  # (batch, 1, num_heads, head_dim): one new query per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,  # (batch,) int32: tokens in each sequence's cache
    block_table: torch.Tensor | None = None,  # (batch, max_blocks) int32
    softmax_scale: float | None = None,
    causal: bool = False,  # one query that sees its whole cache: causal or not is the same thing
) -> torch.Tensor:  # (batch, 1, num_heads, head_dim)
    """Decode attention over a paged KV cache, with flash-attn's signature (GQA-packed, split-K)."""
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
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads or head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {head_dim} (16..256, a power of two) must match the cache's {k_cache.shape[3]}, "
                         f"and num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if cache_seqlens.shape[0] != batch or block_table.shape[0] != batch:
        raise ValueError(f"cache_seqlens and block_table need one row per sequence ({batch})")
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    on_cpu = q.device.type == "cpu"
    num_splits = decode_num_splits(batch, num_kv_heads, q.device)
    k, v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k, v, partial_out, partial_lse, cache_seqlens, block_table, scale * math.log2(math.e), num_splits,
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_table.stride(0),
        *partial_out.stride()[:3], *partial_lse.stride()[:2],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=16 if on_cpu else 64, UPCAST=on_cpu and q.dtype != torch.float32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=1 if on_cpu else 2,
    )  # tile sizes: the fastest of a sweep on an H200 (bf16, head_dim 128, block sizes 16 and 256)
    _combine_splits_kernel[(batch, num_heads)](
        partial_out, partial_lse, out, num_splits, *partial_out.stride()[:3], *partial_lse.stride()[:2],
        out.stride(0), out.stride(2), HEAD_DIM=head_dim, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
    )
    return out

# %% [markdown]
# ### Check the decode kernel against the reference
# Random sequences of 1 to ~300 tokens, scattered over a shuffled block table, for several block sizes and
# GQA ratios: the kernel must give what notebook 01's reference gives on the same keys laid out contiguously.

# %%
from minivllm.kernels.paged_attn import flash_attn_with_kvcache
from minivllm.kernels.reference import attention_ref


def scatter_into_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype=torch.float32, device=DEVICE, seed=0):
    """Random K/V per sequence, written to shuffled blocks of a paged cache; also returned contiguous."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(blocks_per_seq[i])]
        block_table[i, : len(blocks)] = torch.tensor(blocks)
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype) for _ in range(2))
        slots = torch.tensor([blocks[t // block_size] * block_size + t % block_size for t in range(n)], device=device)
        store_kvcache(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    cu_k = torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32, device=device)
    return k_cache, v_cache, block_table, torch.cat(ks), torch.cat(vs), cu_k


for block_size, num_heads, num_kv_heads in ((16, 8, 2), (32, 8, 8), (256, 8, 1)):
    seq_lens = [1, 17, 300, 64]
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(seq_lens, num_kv_heads, 32, block_size)
    q = torch.randn(len(seq_lens), 1, num_heads, 32, device=DEVICE)
    cache_seqlens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)
    cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = attention_ref(q[:, 0], k, v, cu_q, cu_k)
    print(f"block_size {block_size:>3}, GQA {num_heads // num_kv_heads}: max error {(out[:, 0] - ref).abs().max():.1e}")
    torch.testing.assert_close(out[:, 0], ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## Prefill after a prefix-cache hit
# When notebook 03's block manager finds a request's first blocks in the cache, the request's prefill
# computes only the **new** tokens, but their queries must still attend to the cached prefix. A teaching
# engine that runs plain prefill attention over the new tokens alone (as some do) silently drops the prefix
# from attention: the output changes and nothing crashes.
#
# So prefill gets a paged form too: `flash_attn_varlen_func(..., block_table=...)`. The new tokens' keys and
# values are first stored into the cache; then the kernel reads *all* keys of a sequence (cached prefix +
# new tokens, `cu_seqlens_k`) through its block table, with the bottom-right causal mask of notebook 01, so
# new token `i` sees every cached token and the new tokens up to itself. It is notebook 01's kernel with the
# key rows looked up instead of computed.

# %% tags=["export"]
@triton.jit
def _paged_prefill_kernel(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k, block_table, qk_scale, num_m_blocks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    start_m = num_m_blocks - 1 - tl.program_id(0)  # longest causal tiles first
    head, seq = tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if start_m * BLOCK_M >= q_len:
        return
    k_len = tl.load(cu_seqlens_k + seq + 1) - tl.load(cu_seqlens_k + seq)
    kv_head = head // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = load_tile(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                  (offs_m < q_len)[:, None], UPCAST)  # (BLOCK_M, D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = k_len - q_len  # the cached prefix: new query i sees keys j <= i + shift
    unmasked, hi = causal_bounds(start_m, k_len, shift, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        tok = start_n + offs_n
        valid = tok < k_len
        rows = paged_rows(block_table + seq * stride_bt, tok, valid, BLOCK_SIZE)
        k = load_tile(K + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None], valid[None, :], UPCAST)
        v = load_tile(V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], valid[:, None], UPCAST)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, tok, offs_m, k_len, shift, qk_scale,
                                     start_n >= unmasked, CAUSAL, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def flash_attn_varlen_func(
    q: torch.Tensor,  # (total_q, num_heads, head_dim)
    k: torch.Tensor,  # (total_k, num_kv_heads, head_dim), or the k_cache when block_table is given
    v: torch.Tensor,  # likewise
    cu_seqlens_q: torch.Tensor,  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor,  # (batch + 1,) int32: with a block table, cached + new tokens per sequence
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_table: torch.Tensor | None = None,  # (batch, max_blocks) int32
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """flash-attn's varlen attention; with `block_table`, keys and values are read from a paged cache."""
    if block_table is None:
        return flash_attn_varlen_contiguous(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal)
    check_cache("k_cache", k, q)
    check_cache("v_cache", v, q)
    check_index("block_table", block_table, 2, q.device)
    num_kv_heads, head_dim = k.shape[2], k.shape[3]
    _check_inputs(q, k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim), cu_seqlens_q, cu_seqlens_k)
    if block_table.shape[0] != cu_seqlens_q.numel() - 1:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {cu_seqlens_q.numel() - 1} sequences")
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    config = _launch_config(head_dim, q.device)
    kf, vf = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    num_m_blocks = triton.cdiv(max_seqlen_q, config["BLOCK_M"])
    _paged_prefill_kernel[(num_m_blocks, q.shape[1], cu_seqlens_q.numel() - 1)](
        q, kf, vf, out, cu_seqlens_q, cu_seqlens_k, block_table, scale * math.log2(math.e), num_m_blocks,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1), out.stride(0),
        out.stride(1), block_table.stride(0), GROUP=q.shape[1] // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k.shape[1], CAUSAL=causal, UPCAST=q.device.type == "cpu" and q.dtype != torch.float32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **config,
    )
    return out

# %% [markdown]
# Check: new tokens after a cached prefix, read through a shuffled block table, give exactly what the
# reference gives on the whole sequence's keys laid out contiguously.

# %%
from minivllm.kernels.paged_attn import flash_attn_varlen_func

for block_size in (16, 256):
    k_lens, q_lens = [40, 17, 300], [5, 17, 64]  # 35 cached tokens + 5 new; no cache; 236 cached + 64 new
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(k_lens, 2, 32, block_size)
    q = torch.randn(sum(q_lens), 4, 32, device=DEVICE)
    cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=DEVICE)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), causal=True,
                                 block_table=block_table)
    torch.testing.assert_close(out, attention_ref(q, k, v, cu_q, cu_k, causal=True), rtol=1e-4, atol=1e-4)
print("paged prefill matches the reference")
