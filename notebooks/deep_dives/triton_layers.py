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
# # Deep dive · Triton layers: the small layers as fused GPU kernels
#
# **What it adds.** Notebook 01 wrote every layer in PyTorch. On a GPU the small ones (RMSNorm,
# RoPE, SiLU-and-mul) run as several tiny kernels each, and a linear layer at one token leaves most
# of the memory bandwidth idle. Here we measure why `torch.compile` does not fix the small batches,
# write each small layer as one Triton kernel and one token's linear layer as a GEMV, check each
# against the PyTorch layer, subclass each layer to run its kernel, and write
# `use_small_layer_kernels(model)`, which switches the layers of a loaded model to those subclasses.
#
# **Where it sits.** It follows notebook 01 and uses nothing later. Nothing later in the core path
# needs it: notebook 01's layers know nothing of these kernels, and the GPU runner (deep dive
# cuda_graphs, `GPUModelRunner.load`) switches a loaded model onto them, on a GPU only. Without a
# GPU the kernels run in Triton's interpreter on small sizes, and the GPU measurements are the
# committed figures.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
print(f"device: {DEVICE}, torch {torch.__version__}")

# %% [markdown]
# ## Does `torch.compile` pay off here?
# Eager PyTorch runs notebook 01's `RMSNorm` as `x.float()`, `pow`, `mean`, `rsqrt`, `*`, `.to()`
# and `*`: separate kernels, each reading and writing the whole tensor. `torch.compile` fuses them
# into one loop. That saves memory traffic on large tensors, but every compiled call first checks
# its guards, which costs time on tiny ones. Let us measure rather than guess: a decode step of one
# sequence (1 token) against a prefill of 8,192 tokens.

# %%
import time

import matplotlib.pyplot as plt

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.layernorm import RMSNorm


def bench_ms(fn, *args, repeat: int = 10) -> float:
    """Median time of fn(*args) in milliseconds: CUDA events on a GPU, wall clock on a CPU."""
    if DEVICE == "cuda":
        import triton

        return triton.testing.do_bench(lambda: fn(*args), return_mode="median")
    fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


hidden, intermediate = 1024, 3072  # Qwen3-0.6B's sizes
norm = RMSNorm(hidden).to(DEVICE)
act = SiluAndMul().to(DEVICE)
ops = {
    "RMSNorm + residual": (
        norm,
        lambda n: (torch.randn(n, hidden, device=DEVICE), torch.randn(n, hidden, device=DEVICE)),
    ),
    "SiluAndMul": (act, lambda n: (torch.randn(n, 2 * intermediate, device=DEVICE),)),
}
compile_rows = []
with torch.no_grad():
    for name, (module, make_inputs) in ops.items():
        compiled = torch.compile(module, dynamic=True)
        for num_tokens in (1, 8192):
            inputs = make_inputs(num_tokens)
            compile_rows.append(
                dict(
                    op=name,
                    num_tokens=num_tokens,
                    eager=bench_ms(module, *inputs),
                    compiled=bench_ms(compiled, *inputs),
                )
            )
for r in compile_rows:
    times = f"eager {r['eager']:.3f} ms, compiled {r['compiled']:.3f} ms"
    print(f"{r['op']:>20} {r['num_tokens']:>5} tokens: {times}")

# %%
from pathlib import Path

FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)

fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for ax, num_tokens in zip(axes, (1, 8192)):
    rows = [r for r in compile_rows if r["num_tokens"] == num_tokens]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["eager"] for r in rows], width=0.4, label="eager")
    ax.bar([x + 0.2 for x in xs], [r["compiled"] for r in rows], width=0.4, label="torch.compile")
    ax.set_xticks(list(xs), [r["op"] for r in rows])
    ax.set_title(f"{num_tokens} token{'s' if num_tokens > 1 else ''} ({DEVICE})")
    ax.set_ylabel("ms per call")
    ax.legend()
fig.tight_layout()
fig.savefig(FIGURES / "triton_layers_compile_vs_eager.png", dpi=120)
print(f"saved {FIGURES / 'triton_layers_compile_vs_eager.png'}")

# %% [markdown]
# Read the figure: on a single token the compiled call is no faster (there is almost no data to save
# traffic on, and the guard check is pure overhead); on 8,192 tokens fusion saves whole passes over
# memory. Fusion pays, but on small batches the per-call overhead, not the arithmetic, sets the
# time: so we fuse by hand. (Timings move from run to run and machine to machine, so this cell
# prints them, not asserts them.)

# %% [markdown]
# ## The small layers as Triton kernels (write the first in `exercises/01_triton_rmsnorm.ipynb`)
# A Qwen3-0.6B forward makes 169 calls to these small layers (4 norms, a RoPE and an activation in
# each of 28 layers, and a final norm). A compiled call checks guards and runs a wrapper on the
# *host* first, tens of µs or more on a GPU machine whatever the size, while the GPU waits. CUDA
# graphs hide that only in decode steps (notebook 04); eager, minivllm ran at 2,935 output tokens/s
# against 15,676 with graphs (`../figures/throughput_vs_transformers.json`). A Triton kernel fuses
# by hand for the cost of a launch. Each kernel returns new tensors.
#
# The fused residual add + RMSNorm, in full: a program takes `ROWS` rows of `BLOCK ≥ hidden` columns
# (a token of 1,024, or eight 128-wide heads for the q/k norms, whose rows are a `(tokens, heads)`
# grid of strided views of the QKV projection), adds and stores the residual, sums squares in
# float32, and rounds where `RMSNorm` rounds. SiLU-and-mul has no reduction (a program per 1,024
# columns of a token); RoPE runs a program per token, which loads its position's `cos` and `sin`
# once and rotates every head of q and k as `(heads, head_dim / 2)` tiles. Qwen3 normalises each
# head of q and k just before RoPE (notebook 02), so the RoPE kernel can do that too (`norms`): the
# heads are in registers already, and a layer makes one launch for both instead of three. (The model
# calls it so; `rms_norm` on heads stays for a norm on its own.)
#
# One more is not small: a linear layer at *one* token (a decode step of one request) is a
# matrix-vector product. Each weight is read once for one multiply-add, so the layer can only be as
# fast as its weights stream from memory. cuBLAS tiles its GEMMs for many rows; at one row some of
# its choices leave most of the bandwidth idle (on an H200, Qwen3-0.6B's 4 MB attention output
# projection took 12 µs: 0.34 TB/s of the 4.8). `gemv` gives each program `BLOCK_N` outputs, keeps a
# float32 partial sum per lane while it walks along `k`, and reduces once at the end. A linear layer
# calls it for one token only; more tokens keep cuBLAS. With `gated=True` it reads the `[gate | up]`
# rows of an output together and returns `silu(gate) * up`: the MLP's activation, no extra launch.

# %% tags=["export"] module="minivllm.kernels.small_layers"
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit(
    do_not_specialize=["num_rows"]
)  # changes every step: one compiled kernel for all values
def _rms_norm_kernel(
    X,
    R,
    W,
    OUT,
    R_OUT,
    num_rows,
    heads,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,): row = token * heads + head
    token, head, cols = rows // heads, rows % heads, tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < n_cols)[None, :]  # (ROWS, BLOCK)
    row_starts = token * stride_xt + head * stride_xh
    x = tl.load(X + row_starts[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    offs = rows[:, None] * n_cols + cols[None, :]  # into the contiguous outputs
    # the new residual stream, rounded to the model's dtype before it is normalised
    if HAS_RESIDUAL:
        r = tl.load(
            R + (token * stride_rt + head * stride_rh)[:, None] + cols[None, :],
            mask=mask,
            other=0.0,
        )
        x = (x + r.to(tl.float32)).to(R_OUT.dtype.element_ty)
        tl.store(R_OUT + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (ROWS,); masked lanes add zeros
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    # RMSNorm rounds before the weight
    normed = (x * inv_rms[:, None]).to(X.dtype.element_ty).to(tl.float32)
    tl.store(OUT + offs, (normed * w[None, :]).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) or RMSNorm(x, residual), one launch; x: (num_tokens, hidden) or (num_tokens,
    num_heads, head_dim)."""
    # (num_tokens, heads, n_cols): a 2-D input has one "head"
    x3 = x if x.dim() == 3 else x[:, None]
    r3 = x3 if residual is None else (residual if residual.dim() == 3 else residual[:, None])
    rows_of_contiguous_heads = x3.dim() == 3 and x3.stride(2) == r3.stride(2) == 1
    assert rows_of_contiguous_heads and weight.shape == x3.shape[2:], (x.shape, weight.shape)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = out if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows, n_cols, block = (
        x3.shape[0] * x3.shape[1],
        x3.shape[2],
        triton.next_power_of_2(x3.shape[2]),
    )
    rows = max(1, (1024 if x.is_cuda else 4096) // block)  # short rows: a few per program
    strides = (*x3.stride()[:2], *r3.stride()[:2])  # (token, head) of x and of the residual
    tile = dict(
        HAS_RESIDUAL=residual is not None,
        ROWS=rows,
        BLOCK=block,
        num_warps=min(16, max(4, block // 256)),
    )
    grid = (triton.cdiv(num_rows, rows),)
    _rms_norm_kernel[grid](
        x3, r3, weight, out, new_residual, num_rows, x3.shape[1], *strides, n_cols, eps, **tile
    )
    return out if residual is None else (out, new_residual)


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, n_cols, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds to the dtype
    silu = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * n_cols + cols, (silu * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, 2 * n), [gate | up]
    """SiluAndMul(x) in one launch: a program per token and block of columns."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    n_cols = x.shape[1] // 2
    out = torch.empty(x.shape[0], n_cols, dtype=x.dtype, device=x.device)  # (num_tokens, n)
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n_cols, block))](
        x, out, x.stride(0), n_cols, BLOCK=block
    )
    return out


@triton.jit
def _rotate_heads(
    X,
    W,
    OUT,
    stride_h,
    num_heads,
    cos,
    sin,
    eps,
    NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads, d = (
        tl.arange(0, BLOCK_H)[:, None],
        tl.arange(0, BLOCK_D)[None, :],
    )  # one token's heads: (BLOCK_H, BLOCK_D)
    mask = (heads < num_heads) & (d < HALF)
    x1 = tl.load(X + heads * stride_h + d, mask=mask, other=0.0).to(tl.float32)  # first halves
    # second halves
    x2 = tl.load(X + heads * stride_h + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # each head's RMSNorm first, rounded where RMSNorm rounds (its output is RoPE's input)
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        inv_rms = tl.rsqrt(sum_sq / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = (
            ((x1 * inv_rms).to(X.dtype.element_ty).to(tl.float32) * w1)
            .to(OUT.dtype.element_ty)
            .to(tl.float32)
        )
        x2 = (
            ((x2 * inv_rms).to(X.dtype.element_ty).to(tl.float32) * w2)
            .to(OUT.dtype.element_ty)
            .to(tl.float32)
        )
    out_ptrs = OUT + heads * 2 * HALF + d  # first halves; the second HALF further
    tl.store(out_ptrs, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    POS,
    Q,
    K,
    COS,
    SIN,
    QW,
    KW,
    Q_OUT,
    K_OUT,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_q_heads,
    num_k_heads,
    q_eps,
    k_eps,
    NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    pos, d = tl.load(POS + token), tl.arange(0, BLOCK_D)[None, :]
    # (1, BLOCK_D)
    cos = tl.load(COS + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    q_out = Q_OUT + token * num_q_heads * 2 * HALF
    k_out = K_OUT + token * num_k_heads * 2 * HALF
    _rotate_heads(
        Q + token * stride_qt,
        QW,
        q_out,
        stride_qh,
        num_q_heads,
        cos,
        sin,
        q_eps,
        NORM,
        HALF,
        BLOCK_H,
        BLOCK_D,
    )
    _rotate_heads(
        K + token * stride_kt,
        KW,
        k_out,
        stride_kh,
        num_k_heads,
        cos,
        sin,
        k_eps,
        NORM,
        HALF,
        BLOCK_H,
        BLOCK_D,
    )


def apply_rope(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    norms: tuple[Any, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """RotaryEmbedding(positions, q, k, norms) in one launch. q: (num_tokens, num_heads, head_dim),
    k: (num_tokens, num_kv_heads, head_dim), either may be strided; cos, sin: (max_position,
    head_dim / 2); norms: None, or the RMSNorms of q's and k's heads, applied first."""
    half = q.shape[2] // 2
    assert (
        q.stride(2) == k.stride(2) == 1
        and cos.shape[1] == half == k.shape[2] // 2
        and cos.stride() == sin.stride()
    )
    q_out, k_out = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k))
    weights_and_eps = [(n.weight, n.eps) for n in norms] if norms else [(None, 0.0)] * 2
    (q_w, q_eps), (k_w, k_eps) = weights_and_eps
    tensors = (positions, q, k, cos, sin, q_w, k_w, q_out, k_out)
    # (token, head) of q and of k; a position of cos
    strides = (*q.stride()[:2], *k.stride()[:2], cos.stride(0))
    blocks = dict(
        BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
        BLOCK_D=triton.next_power_of_2(half),
    )
    heads = (q.shape[1], k.shape[1])
    _rope_kernel[(q.shape[0],)](
        *tensors, *strides, *heads, q_eps, k_eps, NORM=norms is not None, HALF=half, **blocks
    )
    return q_out, k_out


@triton.jit
def _row_sums(X, W, rows, n, k, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N,) float32: the dot products of x with weight rows `rows` (those < n)."""
    # a partial sum per lane, reduced once at the end
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask = (rows < n)[:, None] & (cols < k)[None, :]
        w_rows = W + rows.to(tl.int64)[:, None] * stride_w
        w = tl.load(w_rows + cols[None, :], mask=mask, other=0.0)
        x = tl.load(X + cols, mask=cols < k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]  # (BLOCK_N, BLOCK_K)
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(
    X,
    W,
    B,
    Y,
    n,
    k,
    stride_w,
    BIAS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,): this program's outputs
    y = _row_sums(X, W, rows, n, k, stride_w, BLOCK_N, BLOCK_K)
    if BIAS:
        y += tl.load(B + rows, mask=rows < n, other=0.0).to(tl.float32)
    # y is the gate; the up rows lie n rows further down. silu(gate) * up, rounded where SiluAndMul
    # rounds
    if GATED:
        up = _row_sums(X, W + n * stride_w, rows, n, k, stride_w, BLOCK_N, BLOCK_K).to(
            Y.dtype.element_ty
        )
        gate = y.to(Y.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)
        y = silu * up.to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < n)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
) -> torch.Tensor:
    """F.linear(x, weight, bias) for one token, x: (1, k), weight: (n, k): a program per BLOCK_N
    outputs. gated: the weight is [gate | up] (no bias), and the result silu(gate) * up, (1, n / 2):
    SiluAndMul in the same pass."""
    # narrow layers: more programs
    (n, k), block_n = (weight.shape, 16 if weight.shape[0] >= 4096 else 4)
    assert (
        x.shape == (1, k)
        and x.stride(1) == weight.stride(1) == 1
        and not (gated and bias is not None)
    )
    # gated: each program reads a gate and an up row
    n, block_n = (n // 2, block_n // 2) if gated else (n, block_n)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    tile = dict(BLOCK_N=block_n, BLOCK_K=1024 if k >= 2048 else 512, num_warps=8)
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](
        x, weight, bias, y, n, k, weight.stride(0), BIAS=bias is not None, GATED=gated, **tile
    )
    return y


# %% [markdown]
# ### Switching a model onto the kernels
# Each kernel gets a subclass of the layer it stands in for, which overrides `forward` (a linear
# layer: `matmul`, its product on this rank, at one token only) and keeps everything else: the
# parameters, the weight loaders, the tensor-parallel slices. Qwen3's MLP (notebook 02, which this
# deep dive may not import) is found by vLLM's names: a `gate_up_proj` of `[gate | up]`, an `act_fn`
# and a `down_proj`; its subclass sends one token through `gemv(..., gated=True)`.
#
# The runner loads a model first, then calls `use_small_layer_kernels(model)`. Rather than build new
# modules and copy weights into them, it switches each module's class (`module.__class__`): the
# object stays, with its loaded parameters and every reference to it (one RoPE table is shared by
# all layers, and the attention passes its q/k norms to RoPE). `enabled=False` switches back. The
# GPU runner calls it (deep dive cuda_graphs), so no core module imports this one. CUDA graphs
# capture the kernels' launches like any other kernel's.


# %% tags=["export"] module="minivllm.layers.small_layer_kernels"
from torch import Tensor, nn

from minivllm.kernels.small_layers import apply_rope, gemv, rms_norm, silu_and_mul
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.layernorm import Pair, RMSNorm
from minivllm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.layers.rotary_embedding import RotaryEmbedding


class TritonRMSNorm(RMSNorm):
    """RMSNorm, the residual add included, in one `rms_norm` launch."""

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | Pair:
        return rms_norm(x, self.weight, self.eps, residual)


class TritonRotaryEmbedding(RotaryEmbedding):
    """RoPE of q and k (after the norms of their heads, if given) in one `apply_rope` launch."""

    def forward(
        self, positions: Tensor, q: Tensor, k: Tensor, norms: tuple[RMSNorm, RMSNorm] | None = None
    ) -> Pair:
        return apply_rope(positions, q, k, self.cos, self.sin, norms)


class TritonSiluAndMul(SiluAndMul):
    """SiluAndMul in one `silu_and_mul` launch."""

    def forward(self, x: Tensor) -> Tensor:
        return silu_and_mul(x)


class GemvLinear(LinearBase):
    """Mixed in before a linear layer's class: its product at one token is a `gemv`."""

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        return gemv(x, self.weight, bias) if x.shape[0] == 1 else super().matmul(x, bias)


class GemvColumnParallelLinear(GemvLinear, ColumnParallelLinear):
    """ColumnParallelLinear, one token through `gemv`."""


class GemvMergedColumnParallelLinear(GemvLinear, MergedColumnParallelLinear):
    """MergedColumnParallelLinear, one token through `gemv`."""


class GemvQKVParallelLinear(GemvLinear, QKVParallelLinear):
    """QKVParallelLinear, one token through `gemv`."""


class GemvRowParallelLinear(GemvLinear, RowParallelLinear):
    """RowParallelLinear, one token through `gemv` (then the all-reduce, as before)."""


class FusedGatedMLP(nn.Module):
    """Mixed in before a gated MLP's class (down_proj(act_fn(gate_up_proj(x)))): at one token,
    [gate | up] and the activation in one `gemv` pass."""

    gate_up_proj: LinearBase
    down_proj: nn.Module

    def forward(self, x: Tensor) -> Tensor:  # x: (num_tokens, hidden_size)
        if x.shape[0] != 1:
            return super().forward(x)
        return self.down_proj(gemv(x, self.gate_up_proj.weight, gated=True))


KERNEL_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: TritonRMSNorm,
    RotaryEmbedding: TritonRotaryEmbedding,
    SiluAndMul: TritonSiluAndMul,
    ColumnParallelLinear: GemvColumnParallelLinear,
    MergedColumnParallelLinear: GemvMergedColumnParallelLinear,
    QKVParallelLinear: GemvQKVParallelLinear,
    RowParallelLinear: GemvRowParallelLinear,
}
PLAIN_CLASSES = {fast: plain for plain, fast in KERNEL_CLASSES.items()}


def is_gated_mlp(module: nn.Module) -> bool:
    """vLLM's gated MLP: [gate | up] in one weight, SiluAndMul, then a down projection."""
    gate_up, act = getattr(module, "gate_up_proj", None), getattr(module, "act_fn", None)
    if not (isinstance(gate_up, MergedColumnParallelLinear) and isinstance(act, SiluAndMul)):
        return False
    return gate_up.bias is None and hasattr(module, "down_proj")  # the fused pass adds no bias


def fused_mlp_class(mlp_class: type[nn.Module]) -> type[nn.Module]:
    """`mlp_class` with FusedGatedMLP's forward (e.g. FusedQwen3MLP), made once for the tables."""
    if mlp_class not in KERNEL_CLASSES:
        fused = type(f"Fused{mlp_class.__name__}", (FusedGatedMLP, mlp_class), {})
        KERNEL_CLASSES[mlp_class], PLAIN_CLASSES[fused] = fused, mlp_class
    return KERNEL_CLASSES[mlp_class]


def use_small_layer_kernels(model: nn.Module, enabled: bool = True) -> None:
    """Run each RMSNorm, RoPE and SiluAndMul of a loaded model as one Triton kernel, each linear
    layer at one token as `gemv` (a gated MLP's [gate | up] with its activation): each module's
    class becomes its subclass above, its parameters stay. enabled=False: the PyTorch layers."""
    for module in model.modules():
        plain = PLAIN_CLASSES.get(type(module), type(module))
        fast = KERNEL_CLASSES.get(plain)
        if fast is None and is_gated_mlp(module):
            fast = fused_mlp_class(plain)
        if fast is not None:
            module.__class__ = fast if enabled else plain


# %% [markdown]
# ### Check the kernels against the layers
# Each kernel on 37 tokens with rows of 96 (not a power of two), q and k as strided views of one QKV
# projection, as the model makes them; on a CPU in the interpreter. The test suite runs many more
# shapes, bfloat16 and a GPU.

# %%
import torch.nn.functional as F

from minivllm.kernels.small_layers import apply_rope, gemv, rms_norm, silu_and_mul
from minivllm.layers.rotary_embedding import RotaryEmbedding

norm96, pos96 = RMSNorm(96).to(DEVICE), torch.randperm(4096)[:37].to(DEVICE)
# Qwen3's RoPE, 96 wide
rope96 = RotaryEmbedding(96, 4096, dict(rope_type="default", rope_theta=1e6)).to(DEVICE)
norm96.weight.data.normal_()
x, residual, qkv = (torch.randn(37, n, device=DEVICE) for n in (96, 96, 8 * 96))
q96, k96 = (
    qkv[:, :384].view(37, 4, 96),
    qkv[:, 384:576].view(37, 2, 96),
)  # 4 query heads, 2 KV heads
bias37 = torch.randn(37, device=DEVICE)
for ours, theirs in [
    (rms_norm(x, norm96.weight, norm96.eps, residual), norm96(x, residual)),
    (rms_norm(q96, norm96.weight, norm96.eps), norm96(q96)),
    (silu_and_mul(qkv[:, :192]), SiluAndMul()(qkv[:, :192])),
    (apply_rope(pos96, q96, k96, rope96.cos, rope96.sin), rope96(pos96, q96, k96)),
    (
        apply_rope(pos96, q96, k96, rope96.cos, rope96.sin, (norm96, norm96)),
        rope96(pos96, q96, k96, (norm96, norm96)),
    ),
]:
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
for ours, theirs in [  # gemv: the same sums in another order
    (
        gemv(x[:1], qkv[:, :96], bias37),
        F.linear(x[:1], qkv[:, :96], bias37),
    ),  # one token; a strided (37, 96) weight
    (
        gemv(x[:1], qkv[:36, :96], gated=True),
        silu_and_mul(F.linear(x[:1], qkv[:36, :96])),
    ),  # [gate | up], 18 each
]:
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
print("rms_norm, silu_and_mul, apply_rope and gemv give the layers' results")

# %% [markdown]
# And switched: the same layers, switched onto the kernels by `use_small_layer_kernels` and back,
# give the same outputs with the same parameter objects. The linear layer takes `gemv` at one token
# only; at five it stays on `F.linear`.

# %%
from torch import nn

from minivllm.layers.linear import RowParallelLinear
from minivllm.layers.small_layer_kernels import use_small_layer_kernels

layers = nn.ModuleList([norm96, rope96, SiluAndMul(), RowParallelLinear(96, 40)]).to(DEVICE)
layers[3].weight.data.normal_()
params = list(layers.parameters())


def run_layers() -> list:
    norm, rope, act, linear = layers
    return [
        norm(x, residual),
        rope(pos96, q96, k96, (norm, norm)),
        act(qkv[:, :192]),
        linear(x[:1]),
        linear(x[:5]),
    ]


with torch.no_grad():
    expected = run_layers()
    use_small_layer_kernels(layers)
    print([type(layer).__name__ for layer in layers])
    got = run_layers()
    use_small_layer_kernels(layers, enabled=False)
    print([type(layer).__name__ for layer in layers])
torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
assert all(a is b for a, b in zip(layers.parameters(), params, strict=True))

# %% [markdown]
# ## How fast?
# On a GPU the cell below times one call on one token of 1,024 (RMSNorm with its residual: eager,
# compiled, Triton) and one token's linear layer (cuBLAS, `gemv`). Without a GPU it shows the
# committed H200 figures of the whole engine: `python -m minivllm.benchmarks.throughput --workloads
# nano-vllm --policies unified prefill-first --impls minivllm minivllm-eager` (256 requests), with
# these kernels and CUDA graphs (`minivllm`) and eager (`minivllm-eager`: the kernels, no graphs).

# %%
import json
from pathlib import Path

from minivllm.benchmarks.throughput import plot_throughput

if DEVICE == "cuda":
    import functools

    import triton

    x1, r1 = torch.randn(2, 1, 1024, device=DEVICE)
    norm = RMSNorm(1024).to(DEVICE)
    triton_norm = lambda x, r: rms_norm(x, norm.weight, norm.eps, r)
    for name, fn in (
        ("eager", norm),
        ("torch.compile", torch.compile(norm, dynamic=True)),
        ("triton", triton_norm),
    ):
        print(f"RMSNorm + residual, 1 token, {name}: {bench_ms(fn, x1, r1) * 1e3:.0f} µs per call")
    x, w = (
        torch.randn(1, 2048, device=DEVICE, dtype=torch.bfloat16),
        torch.randn(1024, 2048, device=DEVICE).bfloat16(),
    )
    # each call's GPU time, launches hidden by a CUDA graph
    for name, fn in (("cuBLAS", F.linear), ("gemv", gemv)):
        ms = triton.testing.do_bench_cudagraph(functools.partial(fn, x, w))
        us, tbps = ms * 1e3, w.nbytes / ms / 1e9
        print(f"1 token × (2048 → 1024), {name}: {us:.1f} µs, {tbps:.2f} TB/s of weights")
else:
    committed = json.loads(Path("../figures/throughput_small_layers.json").read_text())
    print(committed["device"], committed["workloads"]["nano-vllm"])
    for row in committed["rows"]:
        config = f"{row['impl']:>15} {row['policy']:>13}"
        print(f"{config}: {row['tok_per_s']:,.0f} output tokens/s")
    plot_throughput(committed).savefig(FIGURES / "triton_layers_throughput.png", dpi=120)

# %% [markdown]
# **Exercise** (solution in `solutions/`): `exercises/01_triton_rmsnorm.ipynb`, vLLM's fused add +
# RMSNorm as a Triton kernel, the first of this notebook's kernels written by you.
