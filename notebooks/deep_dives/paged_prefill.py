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
# # Deep dive · Paged prefill: new tokens after a prefix-cache hit
#
# **What this adds.** Notebook 03's prefix cache lets a request skip the prompt blocks another
# request already computed. Its prefill then computes only the **new** tokens, whose queries must
# still attend to the cached ones. This deep dive builds that kernel, `flash_attn_varlen_func(...,
# block_table=...)`: the FlashAttention kernel of notebook 01, as the deep dive `prefill_tuning`
# lays it out, reading keys and values through a block table, and checks it against the PyTorch
# reference.
#
# **Where it sits.** It follows notebook 03 (the paged cache, `paged_rows`, `paged_attention_ref`)
# and builds on the deep dive `prefill_tuning`. Nothing later in the core path needs it: on a CPU
# the engine runs the reference; on a GPU the attention context of the deep dive cuda_graphs calls
# this kernel (`minivllm.kernels.flash_attn_varlen_func`, imported on first use), and every output
# is the same either way.

# %%
import os

import torch

if not torch.cuda.is_available():
    # before any @triton.jit runs: the kernel runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
import json
from pathlib import Path

import numpy as np

from minivllm.kernels.paged_reference import paged_attention_ref
from minivllm.kernels.reference import attention_ref
from minivllm.testing import scatter_into_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# %% [markdown]
# ## Why the new tokens must read the cache
# A prompt of 40 tokens whose first 32 hit the cache: prefill computes 8 queries. Attention over the
# 8 new keys alone runs, returns the right shape, and is wrong: each new token must also see the 32
# cached ones.

# %%
k, v = torch.randn(2, 40, 2, 32)  # (tokens, num_kv_heads, head_dim): 32 cached, 8 new
q = torch.randn(8, 4, 32)  # the 8 new tokens' queries, 4 query heads
cu_q, cu_k = torch.tensor([0, 8]), torch.tensor([0, 40])
# bottom-right causal: query i sees keys 0..32 + i
right = attention_ref(q, k, v, cu_q, cu_k, causal=True)
alone = attention_ref(q, k[32:], v[32:], cu_q, cu_q, causal=True)
print(
    f"new tokens over themselves only: max error {(alone - right).abs().max():.2f}, and no "
    f"exception"
)
assert not torch.allclose(alone, right)

# %% [markdown]
# ## The kernel
# The new keys and values are stored first (`store_kvcache`); then the tuned kernel reads *all*
# keys of a sequence (`cu_seqlens_k`: cached + new) through its block table (`paged_rows`, notebook
# 03), with its bottom-right causal mask. One change: its grid is a **list of work**, program `i`
# taking row `i` of `tiles`, a (sequence, query tile) pair. By default that is every tile up to the
# longest sequence's (those past a sequence's end return at once); the engine passes only the tiles
# that exist (notebook 04's `query_tiles`).


# %% tags=["export"] module="minivllm.kernels.paged_prefill"
import math
from typing import Any

import torch
import triton
import triton.language as tl

from minivllm.kernels.cascade import check_out
from minivllm.kernels.flash_attn import attend_block, load_tile, softmax_scale_of
from minivllm.kernels.paged_attn import check_cache, check_index, paged_rows
from minivllm.kernels.prefill_tuned import (
    causal_bounds,
    check_inputs,
    flash_attn_varlen_tuned,
    heads_per_program,
    tuned_config,
    visible_keys,
)


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_kernel(
    Q,
    K,
    V,
    O,
    cu_seqlens_q,
    cu_seqlens_k,
    block_table,
    tiles,
    qk_scale,  # tensors, scalar
    # strides
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # this program's (sequence, query tile), from the list
    seq = tl.load(tiles + 2 * tl.program_id(0))
    start_m = tl.load(tiles + 2 * tl.program_id(0) + 1)
    # HEADS query heads of one KV head, as prefill_tuning's kernel
    first_head = tl.program_id(1) * HEADS
    if seq < 0:
        return  # padding: a CUDA graph's list is longer than its step's (notebook 04)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if start_m * BLOCK_M >= q_len:
        return
    k_len = tl.load(cu_seqlens_k + seq + 1) - tl.load(cu_seqlens_k + seq)
    kv_head = first_head // GROUP
    # tile row r: position r // HEADS, query head first_head + r % HEADS
    r = tl.arange(0, HEADS * BLOCK_M)
    offs_m, head = start_m * BLOCK_M + r // HEADS, first_head + r % HEADS
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_row_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + head[:, None] * stride_qh
    # (HEADS * BLOCK_M, D)
    q = load_tile(q_row_ptrs + offs_d[None, :], (offs_m < q_len)[:, None], UPCAST)
    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = k_len - q_len  # the cached prefix: new query i sees keys j <= i + shift
    unmasked, hi = causal_bounds(start_m, k_len, shift, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        tok = start_n + offs_n
        valid = tok < k_len
        rows = paged_rows(block_table + seq * stride_bt, tok, valid, BLOCK_SIZE)
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
        if start_n >= unmasked:  # the diagonal and the ragged end: masked
            visible = visible_keys(tok, offs_m, k_len, shift, CAUSAL)
            acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, PRECISION)
        else:  # keys every query of the tile sees
            acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, None, qk_scale, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_row_ptrs = O + (q_start + offs_m)[:, None] * stride_ot + head[:, None] * stride_oh
    o_ptrs = o_row_ptrs + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m < q_len)[:, None])


# %% tags=["export"]
def all_tiles(
    batch: int, num_m_blocks: int, device: torch.device
) -> torch.Tensor:  # (num_m_blocks * batch, 2)
    """(sequence, query tile) for every sequence and tile below num_m_blocks, int32: the last tiles,
    which see the most keys, first, so that the longest programs do not start last."""
    seq = torch.arange(batch, dtype=torch.int32, device=device)
    m = torch.arange(num_m_blocks - 1, -1, -1, dtype=torch.int32, device=device)
    grid_m, grid_seq = torch.meshgrid(m, seq, indexing="ij")
    return torch.stack([grid_seq, grid_m], -1).reshape(-1, 2)


def flash_attn_varlen_func(
    q: torch.Tensor,  # (total_q, num_heads, head_dim)
    k: torch.Tensor,  # (total_k, num_kv_heads, head_dim), or the k_cache when block_table is given
    v: torch.Tensor,  # likewise
    cu_seqlens_q: torch.Tensor,  # (batch + 1,) int32
    # (batch + 1,) int32: with a block table, cached + new tokens per sequence
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_table: torch.Tensor | None = None,  # (batch, max_blocks) int32
    out: torch.Tensor
    # with block_table: (total_q, num_heads, head_dim) to write the batch's rows into
    | None = None,
    tiles: torch.Tensor
    | None = None,  # with block_table: (num_tiles, 2) int32, see query_tiles; None: every tile
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """flash-attn's varlen attention; with `block_table`, keys and values are read from a paged
    cache, one program per (sequence, query tile) of `tiles` and group of query heads
    (`heads_per_program`); without, `flash_attn_varlen_tuned`."""
    if block_table is None:
        if out is not None or tiles is not None:
            raise ValueError("out= and tiles= need block_table=: they are the paged kernel's")
        return flash_attn_varlen_tuned(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
        )
    check_cache("k_cache", k, q)
    check_cache("v_cache", v, q)
    check_index("block_table", block_table, 2, q.device)
    num_kv_heads, head_dim = k.shape[2], k.shape[3]
    check_inputs(
        q,
        k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim),
        cu_seqlens_q,
        cu_seqlens_k,
    )
    if block_table.shape[0] != cu_seqlens_q.numel() - 1:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows for {cu_seqlens_q.numel() - 1} sequences"
        )
    scale = softmax_scale_of(softmax_scale, head_dim)
    config = tuned_config(head_dim, q.device)
    kf, vf = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
    out = check_out(out, q)
    if (
        tiles is None
        # every sequence's first cdiv(max_seqlen_q, BLOCK_M) tiles: those past its end return at
        # once
    ):
        tiles = all_tiles(
            cu_seqlens_q.numel() - 1, triton.cdiv(max_seqlen_q, config["BLOCK_M"]), q.device
        )
    check_index("tiles", tiles, 2, q.device)
    if tiles.shape[0] == 0:
        return out  # no tiles: nothing to compute
    group = q.shape[1] // num_kv_heads
    heads = heads_per_program(group, config["BLOCK_M"])
    tensors = (q, kf, vf, out, cu_seqlens_q, cu_seqlens_k, block_table, tiles.contiguous())
    strides = (
        *q.stride()[:2],
        *kf.stride()[:2],
        *vf.stride()[:2],
        *out.stride()[:2],
        block_table.stride(0),
    )
    meta: dict[str, Any] = dict(
        GROUP=group, HEADS=heads, HEAD_DIM=head_dim, BLOCK_SIZE=k.shape[1], CAUSAL=causal, **config
    )
    meta.update(UPCAST=q.device.type == "cpu" and q.dtype != torch.float32)
    meta.update(PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    _paged_prefill_kernel[(tiles.shape[0], q.shape[1] // heads)](
        *tensors, scale * math.log2(math.e), *strides, **meta
    )
    return out


# %% [markdown]
# ## Check against the reference
# Random caches in shuffled blocks of 16 and 256; five sequences whose new tokens (1 to 64) follow 0
# to 236 cached ones. The kernel must give what `paged_attention_ref` gives, and that what notebook
# 01's reference gives on the same keys laid out contiguously. A short list of `tiles` computes only
# its tiles and leaves the rest of `out`.

# %%
from minivllm.kernels import flash_attn_varlen_func

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
    out = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, cu_k, 64, 300, causal=True, block_table=block_table
    )
    print(f"block_size {block_size:>3}: max error {(out - ref).abs().max():.1e}")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

# sequence 1's first query tile only
tiles = torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE)
part = torch.zeros_like(q)
paged = dict(causal=True, block_table=block_table, out=part, tiles=tiles)
flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 64, 300, **paged)
rows = slice(int(cu_q[1]), int(cu_q[2]))  # its 5 new tokens: one tile holds them all
torch.testing.assert_close(part[rows], ref[rows], rtol=1e-4, atol=1e-4)
outside = torch.cat([part[: rows.start], part[rows.stop :]])
assert outside.abs().sum() == 0  # no other tile ran
print("the paged prefill kernel matches both references; a list of tiles computes only those")

# %% [markdown]
# ## How fast: why decode keeps its own kernel
# `python -m minivllm.benchmarks.decode` also runs this kernel on decode's shapes: one query per
# sequence. Its tile holds 64 positions × the query heads of a KV head, of which decode fills 2
# (Qwen3-0.6B's 2 query heads per KV head), and with one program per sequence and KV head it cannot
# fill the GPU at batch 1, where the decode kernel splits the context (split-K, deep dive
# `cascade_attention`). The committed H200 results (a GPU re-measures them):

# %%
from minivllm.benchmarks.decode import run_decode_benchmark

if DEVICE == "cuda":
    decode_data = run_decode_benchmark(shapes=[(1, 16384), (64, 4096)], block_sizes=(16,))
else:
    decode_data = json.loads(Path("../figures/decode.json").read_text())
tbps: dict[tuple, float] = {}  # (impl, batch, context) -> the best over block sizes
for r in sorted(decode_data["rows"], key=lambda r: r["tbps"]):
    tbps[r["impl"], r["batch"], r["context_len"]] = r["tbps"]
for batch, context in ((64, 4096), (1, 16384)):
    ratio = (
        tbps["minivllm-triton", batch, context] / tbps["minivllm-prefill-kernel", batch, context]
    )
    print(
        f"{batch} × {context}: the decode kernel reads the cache {ratio:.1f} times as fast as "
        f"this kernel"
    )

# %% [markdown]
# ## In the engine
# A prefill step stores the new tokens' keys and values, then calls this kernel with every
# sequence's block table. Notebook 04's runner calls `minivllm.kernels.flash_attn_varlen_func` on a
# GPU; the name is looked up lazily (`minivllm/kernels/__init__.py`), so importing the core package
# never imports this module. The contiguous case, `block_table=None`, is `prefill_tuning`'s
# kernel unchanged: a prompt with no cache hit has all its keys at hand.
