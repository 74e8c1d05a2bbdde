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
# # Exercise 01 · Fused residual add + RMSNorm, as a Triton kernel
#
# Every Qwen3 block runs `residual = x + residual; x = rmsnorm(residual) * weight` twice, before
# attention and before the MLP. Notebook 01 ("RMSNorm, with the residual add fused in") wrote it in
# PyTorch; vLLM ships it as a hand-written kernel, `fused_add_rms_norm`, and so does our engine (the
# deep dive `triton_layers`, after notebook 01, which sends you here first). Here you write that
# kernel in Triton, the language of notebook 01's FlashAttention kernel, on a smaller problem: one
# program per row, no tiling loop, no matrix multiply.
#
# **Your task.** Two kernels, each checked right after you write it:
#
# 1. a warm-up, `scale_rows_kernel`: multiply each row of a matrix by its own number. It is only
#    there to meet program ids, masks, strides, loads and stores;
# 2. `fused_add_rms_norm_kernel`: the residual add and the RMSNorm in one pass over each row,
#    returning the normalised output *and* the new residual. It is checked against notebook 01's
#    `RMSNorm` in float32 and bfloat16, on a hidden size that is not a power of two, and on a
#    strided input.
#
# **What it assumes.** Notebook 01's `RMSNorm` (read its `add_rms_forward`) and a first look at its
# Triton kernel. No GPU: on a CPU the kernels run in Triton's interpreter, and the solution runs in
# a few seconds. About 30–45 minutes.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit runs
import triton
import triton.language as tl

from minivllm.testing import exercise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
print(
    f"device: {DEVICE}, triton {triton.__version__}, interpreter: "
    f"{os.environ.get('TRITON_INTERPRET') == '1'}"
)


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """kernel[grid](*args, **meta), except that a kernel still left as `raise NotImplementedError`
    says so (the interpreter and the compiler each wrap the exception in one of their own)."""
    try:
        kernel[grid](*args, **meta)
    except Exception as e:
        if "NotImplementedError" in f"{e!r} {e}":
            raise NotImplementedError(kernel.fn.__name__) from e
        raise


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, **tolerance) -> None:
    """torch.testing.assert_close, with the case that failed in front of its message."""
    torch.testing.assert_close(
        actual, expected, **tolerance, msg=lambda message: f"{what}: {message}"
    )


# %% [markdown]
# ## Triton in five points
#
# * **Programs.** A kernel runs as a grid of *programs*, all with the same code; `tl.program_id(0)`
#   says which one you are. Here the grid is `(num_rows,)`: program *i* handles row *i*.
# * **Blocks, not scalars.** A program works on whole vectors: `cols = tl.arange(0, BLOCK)` is the
#   vector `[0, 1, …, BLOCK - 1]`, and arithmetic on it is element-wise. `BLOCK` must be a
#   compile-time constant (`tl.constexpr`) and a power of two, so the launcher rounds the row length
#   up (`triton.next_power_of_2(96) == 128`)...
# * **Masks.** ...and the lanes past the row's end must do nothing: `mask = cols < n_cols`.
#   `tl.load(ptrs, mask=mask, other=0.0)` reads `0.0` there; `tl.store(ptrs, value, mask=mask)`
#   writes nothing.
# * **Pointers and strides.** A tensor arrives as a pointer to its first element. Element `(row,
#   col)` of a matrix whose columns are contiguous is at `X + row * stride_row + col`, and
#   `stride_row` is *not* always the row length: a slice `big[:, :96]` of a 128-wide `big` has rows
#   128 apart. So the launcher passes each tensor's `stride(0)`, and the kernel uses it.
# * **The interpreter.** With `TRITON_INTERPRET=1` (set above on a CPU) each program runs as NumPy,
#   one after the other: slow, but print-debuggable (`print` works inside the kernel). Its bfloat16
#   arithmetic is wrong, so load, then `.to(tl.float32)` before computing (notebook 01's `load_tile`
#   does the same); and its casts from float32 to bfloat16 truncate where a GPU rounds, so bfloat16
#   results may differ by one unit in the last place.
#
# ## Part 1 · Warm-up: scale each row
# `y[i, :] = x[i, :] * s[i]`. One program per row: load `s[row]` (a scalar load: one pointer, no
# mask), load the row of `x` (masked), multiply, store into `y` (masked). Write in `y`'s dtype:
# `Y.dtype.element_ty` is it.


# %%
@triton.jit
def scale_rows_kernel(X, S, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    # BEGIN SOLUTION
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    s = tl.load(S + row).to(tl.float32)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * s).to(Y.dtype.element_ty), mask=mask)
    # END SOLUTION


def scale_rows(x: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[i, :] = x[i, :] * s[i], one program per row."""
    n_rows, n_cols = x.shape
    assert x.stride(1) == 1 and s.shape == (n_rows,), "rows must be contiguous; one scale per row"
    y = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == x.shape and y.stride(1) == 1
    launch(
        scale_rows_kernel,
        (n_rows,),
        x,
        s,
        y,
        x.stride(0),
        y.stride(0),
        n_cols,
        BLOCK=triton.next_power_of_2(n_cols),
    )
    return y


# %% [markdown]
# ### Check 1
# A 3 × 5 case you can follow by hand (`BLOCK` is 8: three lanes per row are masked), then a strided
# input, and an output that is a slice of a bigger buffer filled with NaN: the columns past the
# slice must stay NaN, or a store wrote past the end of its row.

# %%
with exercise("scale_rows_kernel"):
    x = torch.arange(15, dtype=torch.float32, device=DEVICE).reshape(3, 5)
    s = torch.tensor([1.0, -2.0, 0.5], device=DEVICE)
    got = scale_rows(x, s)
    rows = [[0, 1, 2, 3, 4], [-10, -12, -14, -16, -18]]  # x's rows 0 and 1 times 1 and -2
    rows.append([5, 5.5, 6, 6.5, 7])  # row 2 times 0.5
    expected = torch.tensor(rows, device=DEVICE)
    assert torch.equal(got, expected), f"3 x 5 by hand: expected\n{expected}\ngot\n{got}"

    big = torch.randn(6, 200, device=DEVICE)
    x = big[:, 10:110]  # rows 200 elements apart, 100 long
    s = torch.randn(6, device=DEVICE)
    buffer = torch.full((6, 128), float("nan"), device=DEVICE)
    got = scale_rows(x, s, out=buffer[:, :100])
    assert_close(got, x * s[:, None], "strided input (row stride 200, 100 columns)")
    assert buffer[:, 100:].isnan().all(), (
        "a store wrote past the end of a row: mask the store with `cols < n_cols`"
    )
print("scale_rows_kernel: correct")

# %% [markdown]
# ## Part 2 · Fused residual add + RMSNorm
#
# **What it computes**, for each row (token) of `x` and `residual`, both `(num_tokens, hidden)`:
#
# ```
# new_residual = x + residual
# out          = new_residual / sqrt(mean(new_residual²) + eps) * weight
# ```
#
# and it returns both: `out` goes into attention or the MLP, `new_residual` is the stream the next
# block adds to.
#
# **Why fuse.** Eager PyTorch makes the add one kernel and the norm half a dozen (`float`, `pow`,
# `mean`, `rsqrt`, `*`, `to`, `*`), each reading and writing the whole tensor. The fused kernel
# reads `x`, `residual` and `weight` once and writes `out` and `new_residual` once. A norm does
# almost no arithmetic per byte, so its time *is* its memory traffic: fewer passes, proportionally
# less time. (vLLM's kernel even writes both results in place, over `x` and `residual`; here they go
# to new tensors, which is simpler to check.)
#
# **Why one program per row.** The mean is over the hidden dimension, so a row is the natural unit:
# one program loads its whole row into registers (`BLOCK ≥ hidden`; Qwen3-0.6B's 1,024 floats are
# nothing), reduces it with `tl.sum(..., axis=0)`, and writes it back. No second pass over memory,
# no communication between programs.
#
# **Three details the checks will catch.**
#
# * The mean divides by `n_cols`, not by `BLOCK`: with `hidden = 96` and `BLOCK = 128` the 32 masked
#   lanes add zeros to the sum of squares (so load them with `other=0.0`), but they are not columns.
# * Compute in float32 (load, then `.to(tl.float32)`), and store in the output's dtype. Notebook
#   01's `RMSNorm` rounds the new residual to the model's dtype *before* normalising it, so the next
#   block sees exactly the stream that was stored; doing the same
#   (`s.to(R_OUT.dtype.element_ty).to(tl.float32)`) gets you closest.
# * `x` and `residual` may have different row strides (the check gives you a strided `x`): use each
#   one's own.
#
# `tl.sqrt`, `tl.rsqrt` (1 / sqrt) and `tl.sum(v, axis=0)` are the operations you need beyond Part
# 1's.


# %%
@triton.jit
def fused_add_rms_norm_kernel(
    X,  # (n_rows, n_cols): this layer's output
    R,  # (n_rows, n_cols): the residual stream so far
    W,  # (n_cols,): the norm's weight
    OUT,  # (n_rows, n_cols): rmsnorm(x + residual) * weight
    R_OUT,  # (n_rows, n_cols): x + residual, the new residual stream
    stride_x,
    stride_r,
    stride_out,
    stride_r_out,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    # BEGIN SOLUTION
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(R_OUT.dtype.element_ty)  # the new residual, in the model's dtype
    tl.store(R_OUT + row * stride_r_out + cols, s, mask=mask)
    s = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / n_cols + eps)  # masked lanes are 0: they add nothing
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (s * inv_rms * w).to(OUT.dtype.element_ty)
    tl.store(OUT + row * stride_out + cols, y, mask=mask)
    # END SOLUTION


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual), like RMSNorm(x, residual), in one kernel."""
    n_rows, n_cols = x.shape
    assert residual.shape == x.shape and weight.shape == (n_cols,), (
        x.shape,
        residual.shape,
        weight.shape,
    )
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.stride(0) == 1, (
        "rows must be contiguous"
    )
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out)
    launch(
        fused_add_rms_norm_kernel,
        (n_rows,),
        x,
        residual,
        weight,
        out,
        new_residual,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        new_residual.stride(0),
        n_cols,
        eps,
        BLOCK=triton.next_power_of_2(n_cols),
    )
    return out, new_residual


# %% [markdown]
# ### Check 2
# First a row you can check by hand: `x + residual = [3, 4, 0, 0]` has mean square `25 / 4`, so the
# row is divided by 2.5 (eps is 0 here). Then notebook 01's `RMSNorm(hidden)(x, residual)` with a
# random weight, on Qwen3-0.6B's hidden size (1,024), on 96 and 1,000 (not powers of two: `BLOCK` is
# 128 and 1,024), in float32 (equal up to float rounding) and bfloat16 (up to a unit or two in the
# last place), and with `x` a strided slice.

# %%
from minivllm.layers.layernorm import RMSNorm

with exercise("fused_add_rms_norm_kernel"):
    x = torch.tensor([[1.0, 4.0, -1.0, 0.0]], device=DEVICE)
    residual = torch.tensor([[2.0, 0.0, 1.0, 0.0]], device=DEVICE)
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEVICE)
    out, new_residual = fused_add_rms_norm(x, residual, weight, eps=0.0)
    assert torch.equal(new_residual, torch.tensor([[3.0, 4.0, 0.0, 0.0]], device=DEVICE)), (
        f"new residual: expected x + residual = [[3, 4, 0, 0]], got {new_residual}"
    )
    expected = torch.tensor([[3 / 2.5, 2 * 4 / 2.5, 0.0, 0.0]], device=DEVICE)
    assert_close(out, expected, "[3, 4, 0, 0] / rms 2.5 * weight [1, 2, 3, 4]")

    cases = [(1, 1024), (7, 1024), (5, 96), (3, 1000), (4, 4096)]
    tolerance = {
        torch.float32: dict(rtol=1e-5, atol=1e-5),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    }
    for dtype in (torch.float32, torch.bfloat16):
        for (rows, hidden), strided in [(case, False) for case in cases] + [
            ((6, 96), True),
            ((3, 1000), True),
        ]:
            norm = RMSNorm(hidden, eps=1e-6).to(DEVICE, dtype)
            with torch.no_grad():
                norm.weight.normal_()
                if strided:  # rows 1,100 elements apart, starting at column 7
                    x = torch.randn(rows, 1100, device=DEVICE, dtype=dtype)[:, 7 : 7 + hidden]
                else:
                    x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
                residual = 3 * torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
                expected_out, expected_residual = norm(x, residual)
            out, new_residual = fused_add_rms_norm(x, residual, norm.weight.detach(), eps=norm.eps)
            case = f"{rows} x {hidden}, {dtype}{', x strided' if strided else ''}"
            assert out.dtype == new_residual.dtype == dtype, (
                f"{case}: outputs are {out.dtype}, {new_residual.dtype}"
            )
            assert_close(
                new_residual, expected_residual, f"{case}, new residual", **tolerance[dtype]
            )
            assert_close(out, expected_out, f"{case}, output", **tolerance[dtype])
print(
    "fused_add_rms_norm_kernel matches RMSNorm(x, residual): float32 and bfloat16, 96 to 4,096 "
    "wide, strided"
)

# %% [markdown]
# ## What's next
# * **Compare with the engine's.** The deep dive `triton_layers`' `rms_norm`
#   (`minivllm.kernels.small_layers`) is this kernel, grown for an engine: a few short rows per
#   program, 3-D inputs (the q/k norms: a row per head, no residual), and rounding where `RMSNorm`
#   rounds. `TritonRMSNorm`, a subclass of `RMSNorm`, runs it; `use_small_layer_kernels(model)`
#   switches a loaded model's norms to that subclass, and the runner does so on a GPU.
# * **Measure it.** On a GPU, time it with `triton.testing.do_bench` against eager `RMSNorm` and the
#   `torch.compile`d one (the deep dive's `bench_ms`) at 1 and 8,192 tokens of 1,024: at 8,192
#   tokens all three are bound by memory, and the bytes moved (4 × 8,192 × 1,024 × 2 for the fused
#   one in bfloat16: two tensors read, two written) divided by the time should come near the GPU's
#   bandwidth.
# * **Bigger rows.** One program per row holds the whole row in registers; for hidden sizes of 16k
#   and more, kernels loop over the row in chunks twice (sum of squares, then normalise), or split a
#   row across programs.
