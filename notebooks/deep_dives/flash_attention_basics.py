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
# # Deep dive · FlashAttention basics: the memory it saves, and the smallest kernel
#
# **What it adds.** Notebook 01 says in one sentence why attention needs a kernel of its own (the
# plain way holds N² scores) and goes from the online softmax in PyTorch straight to `attend_block`
# and the engine's kernel. Here both more slowly: the working memory of both ways, plotted up to
# 32k tokens, and the smallest Triton kernel that runs the online softmax — one head, no mask,
# lengths that are multiples of the tiles, its loop written out line for line.
#
# **Where it sits.** It follows notebook 01 and uses nothing later. Nothing in the core path needs
# it: notebook 01's kernel is the one the engine runs. It exports nothing. On a CPU the kernel runs
# in Triton's interpreter.

# %%
import math
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Why the plain way does not scale: O(N²) memory
# Notebook 01's reference, `attention_ref`, holds `scores`, a float per (head, query, key): for a
# 16k-token prompt and 16 heads, 16 × 16,384² × 4 bytes = 16 GiB *per layer*. FlashAttention never
# builds it: walking over the keys in blocks, it keeps per query row a running max `m`, a running
# sum `l` and the output, O(N).

# %%
lengths = 2 ** np.arange(9, 16)  # N = 512 ... 32,768; Qwen3-0.6B's 16 heads of 128
naive_gib = 16 * lengths.astype(float) ** 2 * 4 / 2**30  # fp32 scores
flash_gib = 16 * lengths * (128 + 2) * 4 / 2**30  # fp32 accumulator, m and l per query row
fig, ax = plt.subplots(figsize=(6, 3.8), layout="tight")
ax.loglog(lengths, naive_gib, "o-", label="naive: scores (heads × N × N)")
ax.loglog(lengths, flash_gib, "s-", label="FlashAttention: acc, m, l (heads × N × (d + 2))")
ax.axhline(141e9 / 2**30, color="grey", ls=":", label="H200 memory (141 GB)")
ax.set(xlabel="sequence length N", ylabel="GiB per layer", title="Attention working memory")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.93))  # under the H200 line
fig.savefig(FIGURES / "flash_attention_basics_memory.png", dpi=120)
print(f"N = 32k: naive {naive_gib[-1]:.0f} GiB, flash {flash_gib[-1]:.2f} GiB per layer")

# %% [markdown]
# ## The smallest kernel: step 1's loop in Triton
# A Triton *program* computes on whole tiles. Ours loads a `(BLOCK_M, D)` tile of queries, then runs
# notebook 01's step 1 loop over `(BLOCK_N, D)` tiles of keys and values, `tl.dot` for both
# products; the grid launches one program per query tile. A tile's addresses are `base + row ·
# row_stride + column`, built from `tl.arange` (for `kᵀ`, swap the two). It computes `exp2`, which
# the hardware has, with `log2(e)` in the scale. Tile shapes are compile-time constants
# (`tl.constexpr`), lengths need not be. One head, no mask, lengths that are multiples of the tiles:
# notebook 01's `attend_block` is this loop's body with a mask added, and its kernel the same loop
# with what real prompts need around it.


# %%
@triton.jit
def tiny_attention_kernel(  # Q, O: (num_q, D), K, V: (N, D), contiguous; qk_scale in log2 units
    Q, K, V, O, qk_scale, N, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's query rows
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])  # (BLOCK_M, D), loaded once
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        keys = start + offs_n  # this block's key rows
        k_t = tl.load(K + keys[None, :] * D + offs_d[:, None])  # (D, BLOCK_N): kᵀ
        v = tl.load(V + keys[:, None] * D + offs_d[None, :])  # (BLOCK_N, D)
        s = tl.dot(q, k_t, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    o_ptrs = O + offs_m[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, acc / l[:, None])


# %% [markdown]
# Check: softmax's definition, all scores at once, and notebook 01's kernel on the same head.

# %%
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous

qh, kh, vh = (torch.randn(n, 32, device=DEVICE) for n in (64, 128, 128))  # one head
ref_h = torch.softmax(qh @ kh.T * 32**-0.5, dim=-1) @ vh  # the definition
out_h = torch.empty_like(qh)  # contiguous (64, 32) tensors: a row's stride is D
log2_scale = 32**-0.5 * math.log2(math.e)
tiles = dict(BLOCK_M=16, BLOCK_N=16)
tiny_attention_kernel[(triton.cdiv(64, 16),)](qh, kh, vh, out_h, log2_scale, N=128, D=32, **tiles)
torch.testing.assert_close(out_h, ref_h)
cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (64, 128))
one_head = (t[:, None] for t in (qh, kh, vh))  # (tokens, 1 head, D)
core = flash_attn_varlen_contiguous(*one_head, cu_q, cu_k, 64, 128)
torch.testing.assert_close(out_h, core[:, 0])

# %% [markdown]
# ## Check yourself
# Qwen3-0.6B has 16 query heads. What is the longest prompt, in multiples of 1,024 tokens, whose
# float32 `scores` for one layer still fit in an H200's 141 GB (141 · 10⁹ bytes)?

# %%
from minivllm.testing import check_answer

answer = None  # your answer: replace None with an expression
fits = [n for n in range(1024, 2**17, 1024) if 16 * n**2 * 4 <= 141e9]  # the plot's naive bytes
check_answer(answer, fits[-1], "longest prompt")

# %% [markdown]
# Worked answer: 16 × N² × 4 bytes ≤ 141 · 10⁹ gives N ≤ √(2.2 · 10⁹) ≈ 46,937 tokens: 45 × 1,024
# = 46,080. One layer at a time, and nothing left for the weights or the KV cache; FlashAttention
# needs 16 × 46,080 × 130 × 4 bytes ≈ 0.38 GB there.

# %%
check_answer(45 * 1024, fits[-1], "longest prompt")
