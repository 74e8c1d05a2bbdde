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
# # Deep dive · Prefill tuning: notebook 01's kernel at an H200's speed
#
# **What it adds.** Notebook 01's FlashAttention kernel is correct and short: one program per query
# tile, query head and sequence, a mask on every key tile it loads. On an H200 that leaves speed
# behind. This deep dive keeps its online softmax (`attend_block`) and changes how the work is laid
# out: key tiles that every query of a tile sees run without a mask; one program serves all the
# query heads that share a KV head, so each K and V tile is loaded once for them; the longest tiles
# start first; the launch takes the tile, warps and pipeline stages a sweep found fastest. It
# exports `flash_attn_varlen_tuned`, with `flash_attn_varlen_contiguous`'s signature and results,
# and the input checks of the flash-attn entry points (`minivllm.kernels.flash_attn_varlen_func`).
#
# **Where it sits.** It follows notebook 01 and uses nothing later. Nothing in the core path needs
# it: the core engine runs notebook 01's kernel; on a GPU the engine runs this one
# (`minivllm.kernels.prefill_tuned:flash_attn_varlen_tuned`), and the deep dive `paged_prefill`
# builds its kernel from the same pieces. Without a GPU the kernel runs in Triton's interpreter on
# small shapes, and the speed is the committed H200 figure.

# %%
import json
import os
from pathlib import Path

import numpy as np
import torch
import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Four changes to the launch, none to the arithmetic
# * **Two phases.** For query tile `m` with a cached prefix of `shift` keys, every query sees keys
#   `< m · BLOCK_M + shift + 1`: those whole key tiles need no mask (phase 1, `load_unmasked`, and
#   `attend_block` with `visible=None`). Only the tiles on the diagonal, and a ragged last tile, are
#   masked (phase 2). `causal_bounds` says where each phase ends.
# * **The query heads of a KV head together.** With GQA, query heads `h` and `h + 1` (Qwen3-0.6B: 2
#   per KV head) read the same K and V. A program takes `HEADS` of them: row `r` of its tile is
#   position `r // HEADS` of query head `first_head + r % HEADS`, so each K/V tile it loads serves
#   `HEADS × BLOCK_M` rows. `heads_per_program` keeps a tile at 128 rows at most.
# * **Longest tiles first.** A causal prompt's last query tile sees the most keys; program 0 takes
#   it, so the longest programs do not start last and leave the GPU idle at the end.
# * **Tuned launch.** `python -m minivllm.benchmarks.prefill --sweep` times every tile size, warp
#   count and pipeline depth on the GPU at hand; on an H200 (head_dim 128, bf16) the best keeps
#   notebook 01's 64 × 64 tiles (the runner sizes its query tiles by `launch_config`) with 8 warps
#   and 3 stages. `num_m_blocks` changes with every batch, so `do_not_specialize` keeps Triton from
#   compiling a kernel for each of its values' specialisations (1, a multiple of 16, other).

# %% tags=["export"] module="minivllm.kernels.prefill_tuned"
import math
from typing import Any

import torch
import triton
import triton.language as tl

from minivllm.kernels.flash_attn import attend_block, launch_config, load_tile, softmax_scale_of

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def load_unmasked(ptrs, UPCAST: tl.constexpr):
    """`load_tile` for a tile wholly in bounds: no mask to compute."""
    x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def visible_keys(keys, offs_m, k_len, shift, CAUSAL: tl.constexpr):
    """(ROWS, BLOCK_N): keys that exist and, if causal, that query offs_m sees (<= it + shift)."""
    visible = (keys < k_len)[None, :]
    if CAUSAL:
        visible = visible & (keys[None, :] <= offs_m[:, None] + shift)
    return visible


@triton.jit
def causal_bounds(
    start_m, k_len, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr
):
    """Keys [0, unmasked) are seen by every query of the tile (whole blocks); keys >= hi by none."""
    if CAUSAL:
        hi = tl.minimum(k_len, (start_m + 1) * BLOCK_M + shift)
        unmasked = tl.maximum(tl.minimum(hi, start_m * BLOCK_M + shift + 1), 0)
    else:
        hi, unmasked = k_len, k_len
    return (unmasked // BLOCK_N) * BLOCK_N, hi


@triton.jit(do_not_specialize=["num_m_blocks"])  # changes every step: one compiled kernel for all
def _tuned_prefill_kernel(
    Q,
    K,
    V,
    O,
    cu_seqlens_q,
    cu_seqlens_k,
    qk_scale,
    num_m_blocks,
    q_strides,  # (token, head) strides of q, then of k, v and o
    k_strides,
    v_strides,
    o_strides,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = num_m_blocks - 1 - tl.program_id(0)  # longest causal tiles first
    first_head, seq = tl.program_id(1) * HEADS, tl.program_id(2)  # HEADS query heads of one KV head
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if start_m * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k + seq)
    k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
    kv_head = first_head // GROUP

    # tile row r: position r // HEADS, query head first_head + r % HEADS
    r = tl.arange(0, HEADS * BLOCK_M)
    offs_m, head = start_m * BLOCK_M + r // HEADS, first_head + r % HEADS
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    q_rows = Q + (q_start + offs_m) * q_strides[0] + head * q_strides[1]  # (ROWS,)
    q_mask = (offs_m < q_len)[:, None]  # rows of this sequence; also where o is stored
    q = load_tile(q_rows[:, None] + offs_d[None, :], q_mask, UPCAST)
    k_cols = K + (k_start + offs_n) * k_strides[0] + kv_head * k_strides[1]  # (BLOCK_N,)
    k_ptrs = k_cols[None, :] + offs_d[:, None]  # (D, BLOCK_N)
    v_rows = V + (k_start + offs_n) * v_strides[0] + kv_head * v_strides[1]
    v_ptrs = v_rows[:, None] + offs_d[None, :]  # (BLOCK_N, D)

    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = k_len - q_len  # bottom-right causal: query i sees keys j <= i + shift
    unmasked, hi = causal_bounds(start_m, k_len, shift, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, unmasked, BLOCK_N):  # phase 1: whole blocks every query sees, no masks
        k = load_unmasked(k_ptrs + start_n * k_strides[0], UPCAST)
        v = load_unmasked(v_ptrs + start_n * v_strides[0], UPCAST)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, None, qk_scale, PRECISION)
    for start_n in range(unmasked, hi, BLOCK_N):  # phase 2: the diagonal and the ragged end, masked
        keys = start_n + offs_n
        k = load_tile(k_ptrs + start_n * k_strides[0], (keys < k_len)[None, :], UPCAST)
        v = load_tile(v_ptrs + start_n * v_strides[0], (keys < k_len)[:, None], UPCAST)
        visible = visible_keys(keys, offs_m, k_len, shift, CAUSAL)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that sees no key outputs zeros
    o_rows = O + (q_start + offs_m) * o_strides[0] + head * o_strides[1]  # (ROWS,)
    o_ptrs = o_rows[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    """A ValueError naming the argument, for what flash-attn's varlen entry points reject."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            shape = tuple(t.shape)
            raise ValueError(f"{name} must be (total_tokens, num_heads, head_dim), got {shape}")
        if t.dtype not in SUPPORTED_DTYPES or t.dtype != q.dtype:
            raise ValueError(
                f"{name}.dtype {t.dtype}: q, k, v must share a dtype of {SUPPORTED_DTYPES} (q: "
                f"{q.dtype})"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if k.shape != v.shape:
        shapes = f"{tuple(k.shape)} and {tuple(v.shape)}"
        raise ValueError(f"k and v must have the same shape, got {shapes}")
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(
            f"head_dim must be 16, 32, 64, 128 or 256 and equal for q and k, got {head_dim}, "
            f"{k.shape[2]}"
        )
    if q.shape[1] % k.shape[1]:
        heads = f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})"
        raise ValueError(heads)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.dtype != torch.int32 or cu.device != q.device:
            got = f"{cu.dtype} {tuple(cu.shape)} on {cu.device}"
            raise ValueError(f"{name} must be 1-D int32 on {q.device}, got {got}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        n_q, n_k = cu_seqlens_q.numel(), cu_seqlens_k.numel()
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {n_q} and "
            f"{n_k}"
        )


def tuned_config(head_dim: int, device: torch.device) -> dict:
    """Notebook 01's tiles (the runner sizes its query tiles by them), with the warps and pipeline
    stages of a sweep on an H200 (`python -m minivllm.benchmarks.prefill --sweep`, head_dim 128,
    bf16)."""
    config = launch_config(head_dim, device)
    if device.type == "cuda":
        config.update(num_warps=8, num_stages=3)
    return config


def heads_per_program(group: int, block_m: int) -> int:
    """How many query heads of one KV head a program serves: the largest power of two that divides
    the group and keeps a tile of block_m <= 128 positions at 128 rows at most."""
    return math.gcd(group, max(1, 128 // block_m))


def flash_attn_varlen_tuned(
    q: torch.Tensor,  # (total_q, num_heads, head_dim)
    k: torch.Tensor,  # (total_k, num_kv_heads, head_dim)
    v: torch.Tensor,  # (total_k, num_kv_heads, head_dim)
    cu_seqlens_q: torch.Tensor,  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor,  # (batch + 1,) int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    tile: dict | None = None,  # BLOCK_M, BLOCK_N, num_warps, num_stages; None: tuned_config's
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """`flash_attn_varlen_contiguous` (notebook 01): the same attention, its inputs checked, laid
    out for a GPU's speed."""
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if max_seqlen_q < 1 or max_seqlen_k < 0:
        lengths = f"{max_seqlen_q}, {max_seqlen_k}"
        raise ValueError(f"max_seqlen_q must be >= 1 and max_seqlen_k >= 0, got {lengths}")
    head_dim, out = q.shape[2], torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qk_scale = softmax_scale_of(softmax_scale, head_dim) * math.log2(math.e)  # exp2 units
    config = tile or tuned_config(head_dim, q.device)
    num_m_blocks, group = triton.cdiv(max_seqlen_q, config["BLOCK_M"]), q.shape[1] // k.shape[1]
    heads = heads_per_program(group, config["BLOCK_M"])
    grid = (num_m_blocks, q.shape[1] // heads, cu_seqlens_q.numel() - 1)
    strides = [t.stride()[:2] for t in (q, k, v, out)]
    fp32 = q.dtype == torch.float32
    flags: dict[str, Any] = dict(GROUP=group, HEADS=heads, HEAD_DIM=head_dim, CAUSAL=causal)
    flags.update(UPCAST=q.device.type == "cpu" and not fp32, PRECISION="ieee" if fp32 else "tf32")
    tensors = (q, k, v, out, cu_seqlens_q, cu_seqlens_k)
    _tuned_prefill_kernel[grid](*tensors, qk_scale, num_m_blocks, *strides, **flags, **config)
    return out


# %% [markdown]
# ## Check: the same attention as notebook 01's kernel
# Lengths on and next to tile boundaries, groups of 1, 2, 3 and 4 query heads per KV head (3: one
# head per program, as `heads_per_program` says), sequences that continue after a cached prefix and
# one with fewer keys than queries (its first queries see nothing: zeros). Both kernels against the
# reference, on the CPU in the interpreter; the test suite adds bfloat16 and a GPU.

# %%
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous
from minivllm.kernels.prefill_tuned import flash_attn_varlen_tuned, heads_per_program
from minivllm.kernels.reference import attention_ref

q_lens, k_lens = [1, 15, 16, 17, 40, 5, 20], [1, 15, 16, 17, 100, 40, 3]
cu_q, cu_k = (
    torch.tensor([0, *np.cumsum(n)], dtype=torch.int32, device=DEVICE) for n in (q_lens, k_lens)
)
for num_heads in (2, 4, 6, 8):  # over 2 KV heads
    q = torch.randn(sum(q_lens), num_heads, 32, device=DEVICE)
    k, v = torch.randn(2, sum(k_lens), 2, 32, device=DEVICE)
    for causal in (True, False):
        ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal)
        args = (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
        torch.testing.assert_close(flash_attn_varlen_tuned(*args, causal=causal), ref)
        torch.testing.assert_close(flash_attn_varlen_contiguous(*args, causal=causal), ref)
    group = num_heads // 2
    print(f"{group} query heads per KV head: {heads_per_program(group, 16)} a program, both exact")

# %% [markdown]
# ## Check yourself: K tiles loaded
# For one causal prompt of 4,096 tokens, Qwen3-0.6B's 16 query and 8 KV heads, and the H200's tiles
# (64 queries × 64 keys), how many K tiles do all the programs load together, with one query head
# per program (notebook 01's kernel), and with `heads_per_program` query heads of a KV head per
# program (this one)? Answer `(one_head, packed)`.

# %%
from minivllm.kernels.flash_attn import launch_config
from minivllm.testing import check_answer

answer = None  # your answer: replace None with an expression
block = launch_config(128, torch.device("cuda"))["BLOCK_M"]  # 64: a dict, no GPU needed
n4 = 4096
k_tiles = [triton.cdiv((m + 1) * block, block) for m in range(n4 // block)]  # per query tile
programs = [16 // heads for heads in (1, heads_per_program(16 // 8, block))]  # per query tile
check_answer(answer, tuple(sum(k_tiles) * p for p in programs), "K tiles loaded")

# %% [markdown]
# Worked answer: query tile `m` (queries `64m … 64m + 63`) sees keys up to its last query: `m + 1`
# tiles of 64, so the 64 query tiles load `1 + 2 + … + 64 = 2,080` K tiles for each group of heads a
# program serves. One head per program: 16 programs per query tile, 33,280 loads; two query heads of
# a KV head per program: 8, 16,640. The FLOPs stay; the K/V traffic through shared memory halves.

# %%
check_answer((2080 * 16, 2080 * 8), tuple(sum(k_tiles) * p for p in programs), "K tiles loaded")

# %% [markdown]
# ## How fast
# `python -m minivllm.benchmarks.prefill` times both kernels on one causal prompt of 1k to 16k
# tokens (16 query heads, 8 KV heads, d = 128, bf16) beside SDPA (FlashAttention-2, cuDNN),
# FlashInfer and naive O(N²) attention: `minivllm-triton` is this kernel, `minivllm-triton-core`
# notebook 01's. On a GPU this cell re-measures 1k and 4k; else it shows the committed H200 results.

# %%
from minivllm.benchmarks.prefill import plot_prefill, run_prefill_benchmark

if DEVICE == "cuda":
    prefill = run_prefill_benchmark(seqlens=(1024, 4096))
else:
    prefill = json.loads(Path("../figures/prefill.json").read_text())
plot_prefill(prefill).savefig(FIGURES / "prefill_tuning.png", dpi=120)
print(prefill["device"], prefill["config"])
for row in prefill["rows"]:
    speed = f"{row['tflops']:6.1f} TFLOP/s ({row['ms']:.3f} ms)"
    print(f"{row['impl']:>20} N={row['seqlen']:>6}: {speed}")
