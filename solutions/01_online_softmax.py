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
# # Exercise 01 · The online softmax, a sliding window, and split-K
#
# Attention is `softmax(q kᵀ · scale) v`. Written that way it builds a `(len_q, len_k)` matrix of
# scores: 4 GB in float32 for one head of a 32k-token prompt. Every fast attention kernel avoids it
# with one idea, the **online softmax**: read the keys a block at a time and keep, per query, a
# running maximum `m`, a running sum `l` and an unnormalised output `acc`, rescaling both whenever
# the maximum grows. The scores of one block exist at a time.
#
# * Notebook 01's FlashAttention kernel is this loop, full causal attention: every query reads every
#   earlier key.
# * Here you extend it to **sliding-window attention** (Mistral, Gemma 2 and 3, Qwen's
#   `use_sliding_window`): a query sees only the `window` most recent positions, itself included.
#   Its point is cost: a query's work, and the KV a server must keep, stop growing with the context.
#   That holds only if the loop never reads the blocks that no query of the tile can see: masking
#   them is correct, and as slow as no window at all.
# * Notebook 03's decode kernel has one query per sequence, too little work to fill a GPU when the
#   batch is small. It **splits the keys** (split-K, "flash-decoding"): each program runs the loop
#   over its share of the cache and writes a partial output and its log-sum-exp; a second kernel
#   combines the splits.
#
# **Your task.** In plain PyTorch, one head, float32: (0) the running max and sum of a stream of
# scores, (a) attention over key blocks with the online softmax, causal and with a sliding window,
# reading only the blocks the window reaches, (b) the partial outputs and log-sum-exps of split-K,
# (c) the step that combines them. Each is checked in the cell after it: against `torch.softmax`,
# against a reference with the window's mask written out, and against the unsplit result.
#
# **What it assumes.** Softmax and attention; notebook 01's reference attention. No GPU: seconds on
# a CPU. About 30 minutes.

# %%
import torch

from minivllm.kernels.reference import attention_ref
from minivllm.testing import exercise

NEG_INF = float("-inf")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers, as triton.cdiv."""
    return -(-a // b)


def check_close(got: torch.Tensor, expected: torch.Tensor, case: str) -> None:
    """assert_close (float32 rounding), with the case named in the message."""
    assert got.shape == expected.shape, (
        f"{case}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    )
    assert not got.isnan().any(), (
        f"{case}: NaN at {got.isnan().nonzero()[:3].tolist()} (exp(-inf - -inf)?)"
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: {m}")


# %% [markdown]
# ## 0 · The running maximum and sum
# `softmax(x)_j = exp(x_j − m) / l` with `m = max x` and `l = Σ exp(x_j − m)`. Subtracting `m`
# changes nothing mathematically and keeps every `exp` at most 1: without it, a score of 100
# overflows float32's `exp`.
#
# To get `m` and `l` in **one** pass over blocks of `x`, keep both for the blocks seen so far. When
# a block raises the maximum from `m` to `m_new`, every term already in `l` was computed against the
# old maximum: multiply `l` by `alpha = exp(m − m_new)` to put it on the new one, then add the
# block's own `Σ exp(x_j − m_new)`.
#
# A masked score is `-inf` (notebook 01's causal mask). A stream of only `-inf` has `m = -inf` and
# `l = 0`, and `exp(-inf − (-inf))` is `NaN`: when the maximum is still `-inf`, subtract 0 instead.
#
# **Write** `softmax_stats`: walk `x` in blocks of `block_n` and return `(m, l)` as 0-dimensional
# tensors.


# %%
def softmax_stats(x: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the scores x: (n,), block_n at a time. Returns m = max x and l = Σ exp(x -
    m)."""
    m, l = torch.tensor(NEG_INF), torch.tensor(0.0)
    for start in range(0, x.shape[0], block_n):
        block = x[start : start + block_n]  # (block_n,), fewer at the end
        # BEGIN SOLUTION
        m_new = torch.maximum(m, block.max())
        m_safe = m_new if m_new > NEG_INF else torch.tensor(0.0)  # nothing but -inf so far
        l = l * torch.exp(m - m_safe) + torch.exp(block - m_safe).sum()
        m = m_new
        # END SOLUTION
    return m, l


# %%
with exercise("softmax_stats"):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(50, generator=gen)
    cases = {
        "50 scores, blocks of 16": (scores, 16),
        "50 scores, blocks of 1": (scores, 1),
        "50 scores, one block of 64": (scores, 64),
        "scores near 1000 (exp overflows without the max)": (scores + 1000, 16),
        "the maximum in the last block": (torch.cat([scores, torch.tensor([30.0])]), 16),
        "masked scores (-inf) in the first block": (
            torch.cat([torch.full((20,), NEG_INF), scores]),
            16,
        ),
    }
    for case, (x, block_n) in cases.items():
        m, l = softmax_stats(x, block_n)
        check_close(m, x.max(), f"{case}: m")
        check_close(l, torch.exp(x - x.max()).sum(), f"{case}: l")
        check_close(
            torch.exp(x - m) / l, torch.softmax(x, 0), f"{case}: exp(x - m) / l vs torch.softmax"
        )
    m, l = softmax_stats(torch.full((5,), NEG_INF), 2)
    assert m == NEG_INF and l == 0, (
        f"only -inf scores: expected m = -inf, l = 0, got m = {m}, l = {l}"
    )
print("softmax_stats: one pass gives torch.softmax")

# %% [markdown]
# ## a · Attention, one block of keys at a time, in a sliding window
# Now a block of `M` queries `q: (M, D)` against `N` keys and values `k, v: (N, D)`. Each query row
# keeps its own `m` and `l`, and also `acc`, its output before normalisation: `Σ_j exp(s_j − m)
# v_j`. A block of keys gives scores `s = q kᵀ · scale`, `(M, block_n)`, and the update of section 0
# row by row, with `acc` rescaled by the same `alpha` as `l`:
#
# ```
# m_new = max(m, rowmax(s))      p   = exp(s − m_new)      (with the -inf guard of section 0)
# alpha = exp(m − m_new)         l   = alpha · l + rowsum(p)
#                                acc = alpha · acc + p v_block
# ```
#
# After the last block: `out = acc / l`, and the log-sum-exp of each row's scores, `lse = m + log
# l`; split-K needs it below. A row that saw no key (all masked, or `N = 0`) has `l = 0`: its output
# is zeros and its `lse` is `-inf`.
#
# **Causal**, as in `attention_ref` and flash-attn: the queries are the *last* `M` of the `N`
# positions (a prompt chunk after `N − M` cached tokens), so query `i` sits at position `p_i = i + N
# − M` and sees key `j` exactly when `j ≤ p_i`. When `M > N`, the first `M − N` queries see nothing.
#
# **Sliding window** (`window = w > 0`, always causal): query `i` sees key `j` exactly when `p_i − w
# < j ≤ p_i`: the `w` most recent positions, itself included. `window = 0` means no window.
#
# **Which blocks to read.** The first query sees nothing before key `N − M − w + 1`, and the later
# ones even less: start the loop at the block that holds that key, not at 0. (The checks fill the
# blocks before it with NaN: a loop that reads one, even to mask it, gets `0 · NaN = NaN` in `acc`.)
#
# **Write** the loop (its range and its body) and the end of `attend_blocks`. The `(M, N)` score
# matrix must never exist: only `(M, block_n)` at a time.


# %%
def attend_blocks(
    q: torch.Tensor,  # (M, D)
    k: torch.Tensor,  # (N, D)
    v: torch.Tensor,  # (N, D)
    block_n: int,
    causal: bool = False,
    window: int = 0,  # > 0: a causal sliding window of that many positions
) -> tuple[torch.Tensor, torch.Tensor]:  # out (M, D), lse (M,)
    """Attention of one query block over keys taken block_n at a time, with the online softmax."""
    (M, D), N = q.shape, k.shape[0]
    assert window == 0 or causal, "a sliding window is causal"
    scale = D**-0.5
    m = torch.full((M,), NEG_INF)  # running max of each row's scores
    l = torch.zeros(M)  # running sum of exp(score - m)
    acc = torch.zeros(M, D)  # running Σ exp(score - m) v
    # BEGIN SOLUTION
    # the first query's earliest visible key
    first_key = max(0, N - M - window + 1) if window else 0
    for start in range(first_key // block_n * block_n, N, block_n):
        end = min(start + block_n, N)
        s = (q @ k[start:end].T) * scale  # (M, end - start)
        if causal:
            key_pos = torch.arange(start, end)[None, :]  # (1, end - start)
            query_pos = torch.arange(M)[:, None] + (N - M)  # (M, 1)
            visible = key_pos <= query_pos
            if window:
                visible &= key_pos > query_pos - window
            s = s.masked_fill(~visible, NEG_INF)
        m_new = torch.maximum(m, s.max(dim=1).values)
        m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)  # rows that have seen no key yet
        p = torch.exp(s - m_safe[:, None])  # (M, end - start)
        alpha = torch.exp(m - m_safe)  # (M,): 0 for a row's first visible block
        l = alpha * l + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ v[start:end]
        m = m_new
    out = acc / torch.where(l > 0, l, 1.0)[:, None]  # a row that saw no key: zeros
    lse = m + torch.log(l)  # -inf where l == 0
    return out, lse
    # END SOLUTION


# %%
def reference(q, k, v, causal=False, window=0):
    """Attention for one sequence and one head with its mask written out, and each row's
    log-sum-exp."""
    (M, D), N = q.shape, k.shape[0]
    scores = (q @ k.T) * D**-0.5  # (M, N)
    if causal:
        query_pos = torch.arange(M)[:, None] + (N - M)  # the queries are the last M positions
        key_pos = torch.arange(N)[None, :]
        visible = (key_pos <= query_pos) & ((key_pos > query_pos - window) if window else True)
        scores = scores.masked_fill(~visible, NEG_INF)
    lse = torch.logsumexp(scores, dim=1)  # -inf for a row that sees nothing
    out = torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0)[:, None]) @ v
    if not window:  # the same as notebook 01's attention_ref
        cu_q, cu_k = torch.tensor([0, M]), torch.tensor([0, N])
        one_head = [t[:, None] for t in (q, k, v)]  # (tokens, 1 head, D)
        out_ref = attention_ref(*one_head, cu_q, cu_k, causal=causal)[:, 0]
        check_close(
            out, out_ref, f"the reference's mask (M={M}, N={N}, causal={causal}) vs attention_ref"
        )
    return out, lse


def random_qkv(M: int, N: int, D: int = 32, seed: int = 0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    rows_and_scales = [(M, scale), (N, 1.0), (N, 1.0)]  # q, k, v
    return [torch.randn(n, D, generator=gen) * s for n, s in rows_and_scales]


def hide_unseen_blocks(k: torch.Tensor, v: torch.Tensor, M: int, block_n: int, window: int):
    """Copies of k and v whose whole blocks before the window's first key are NaN: a loop must not
    read them."""
    N = k.shape[0]
    first_block = max(0, N - M - window + 1) // block_n
    k, v = k.clone(), v.clone()
    k[: first_block * block_n], v[: first_block * block_n] = float("nan"), float("nan")
    return k, v, first_block


with exercise("attend_blocks"):
    cases = {  # name: (M, N, block_n, causal, window, q scale)
        "M=16, N=50, blocks of 16": (16, 50, 16, False, 0, 1.0),
        "M=16, N=50, blocks of 1": (16, 50, 1, False, 0, 1.0),
        "M=16, N=50, one block of 64": (16, 50, 64, False, 0, 1.0),
        "scores in the hundreds (q x 100): exp overflows without the max": (
            16,
            50,
            16,
            False,
            0,
            100.0,
        ),
        "causal, M=N=37, blocks of 8": (37, 37, 8, True, 0, 1.0),
        "causal, a chunk of 16 after 34 cached keys": (16, 50, 16, True, 0, 1.0),
        "causal, M=10 > N=4: six rows see no key": (10, 4, 2, True, 0, 1.0),
        "no keys (N=0)": (4, 0, 16, False, 0, 1.0),
        "window 8, M=N=37, blocks of 8": (37, 37, 8, True, 8, 1.0),
        "window 16, a chunk of 16 after 84 cached keys": (16, 100, 16, True, 16, 1.0),
        "window 5, one decode query after 60 keys, blocks of 4": (1, 61, 4, True, 5, 1.0),
        "window 1: each query sees only itself": (8, 40, 8, True, 1, 1.0),
        "window 7, blocks of 1": (6, 30, 1, True, 7, 1.0),
        "window 100 > N: plain causal": (16, 50, 16, True, 100, 1.0),
        "window 8, M=10 > N=4": (10, 4, 2, True, 8, 1.0),
    }
    for case, (M, N, block_n, causal, window, q_scale) in cases.items():
        q, k, v = random_qkv(M, N, scale=q_scale, seed=M + N)
        ref_out, ref_lse = reference(q, k, v, causal, window)
        k, v, skipped = hide_unseen_blocks(k, v, M, block_n, window) if window else (k, v, 0)
        out, lse = attend_blocks(q, k, v, block_n, causal, window)
        read = (
            f" (blocks 0..{skipped - 1} hold NaN: no query sees them, do not read them)"
            if skipped
            else ""
        )
        check_close(out, ref_out, f"{case}: out vs the reference{read}")
        check_close(lse, ref_lse, f"{case}: lse vs torch.logsumexp of the visible scores")
print("attend_blocks: the reference, causal or not, windowed or not, one block of scores at a time")

# %% [markdown]
# ## b · Split-K: partial outputs and their log-sum-exps
# In decode, `M` is 1 (one new token per sequence, GQA packs a few heads) and `N` is the whole
# cache. One program per (sequence, head) is then a few dozen programs on a GPU with 132
# multiprocessors. The deep dive `cascade_attention`'s decode kernel therefore splits the keys
# into `num_splits` contiguous chunks and gives each to its own program.
#
# Each chunk is `chunk = cdiv(cdiv(N, num_splits), block_n) · block_n` keys (a whole number of
# blocks), so split `s` covers keys `[s · chunk, min((s + 1) · chunk, N))`. For short sequences the
# last splits are **empty**: with `N = 33`, 4 splits and blocks of 16, `chunk` is 16 and split 3
# starts at 48. The kernel launches a fixed grid, so an empty split still writes its result: zeros
# and `lse = -inf`, which `attend_blocks` already gives for `N = 0`.
#
# **Write** `split_k`: run `attend_blocks` on each split's keys (not causal: a decode query sees its
# whole cache; with a window, the cache would simply start `window` tokens back) and stack the
# results.


# %%
def split_k(
    q: torch.Tensor,  # (M, D)
    k: torch.Tensor,  # (N, D)
    v: torch.Tensor,  # (N, D)
    num_splits: int,
    block_n: int,
) -> tuple[
    torch.Tensor, torch.Tensor
]:  # partial_out (num_splits, M, D), partial_lse (num_splits, M)
    """Each split's attention over its own chunk of the keys, and each row's log-sum-exp over that
    chunk."""
    N = k.shape[0]
    # BEGIN SOLUTION
    chunk = cdiv(cdiv(N, num_splits), block_n) * block_n  # whole blocks
    outs, lses = [], []
    for s in range(num_splits):
        lo, hi = min(s * chunk, N), min((s + 1) * chunk, N)
        out, lse = attend_blocks(q, k[lo:hi], v[lo:hi], block_n)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
    # END SOLUTION


# %%
with exercise("split_k"):
    q, k, v = random_qkv(4, 33)
    partial_out, partial_lse = split_k(q, k, v, num_splits=4, block_n=16)
    assert partial_out.shape == (4, 4, 32) and partial_lse.shape == (4, 4), (
        f"expected shapes (4, 4, 32) and (4, 4), got {tuple(partial_out.shape)} and "
        f"{tuple(partial_lse.shape)}"
    )
    for s, (lo, hi) in enumerate([(0, 16), (16, 32), (32, 33), (33, 33)]):
        ref_out, ref_lse = reference(q, k[lo:hi], v[lo:hi])
        check_close(
            partial_out[s], ref_out, f"N=33, 4 splits of 16: split {s} (keys {lo}:{hi}) output"
        )
        check_close(
            partial_lse[s], ref_lse, f"N=33, 4 splits of 16: split {s} (keys {lo}:{hi}) lse"
        )
    assert (partial_lse[3] == NEG_INF).all() and (partial_out[3] == 0).all(), (
        f"the empty split 3 should give zeros and lse -inf, got lse {partial_lse[3].tolist()}"
    )
print(
    "split_k: each split is the attention over its own keys; the empty one is zeros with lse -inf"
)

# %% [markdown]
# ## c · Combining the splits
# Split `s` normalised its output by its own sum, `out_s = acc_s / l_s`, with `lse_s = m_s + log
# l_s`. The whole row's sum is `Σ_s l_s · exp(m_s)` = `Σ_s exp(lse_s)`, so the full output is the
# average of the partial outputs weighted by `exp(lse_s)`:
#
# ```
# out = Σ_s exp(lse_s − M) out_s / Σ_s exp(lse_s − M)
# lse = M + log Σ_s exp(lse_s − M),   M = max_s lse_s
# ```
#
# Subtracting `M` is section 0's trick again, and so is the guard: an empty split has `lse_s = -inf`
# and weight 0; when *every* split is empty, `M = -inf`, and the row's output is zeros with `lse =
# -inf`.
#
# **Write** `combine_splits`. Notebook 03's `_combine_splits_kernel` is the same few lines, in
# base 2.


# %%
def combine_splits(
    partial_out: torch.Tensor,  # (num_splits, M, D)
    partial_lse: torch.Tensor,  # (num_splits, M)
) -> tuple[torch.Tensor, torch.Tensor]:  # out (M, D), lse (M,)
    """Merge split-K's partial results into the attention over all the keys."""
    # BEGIN SOLUTION
    m = partial_lse.max(dim=0).values  # (M,)
    m_safe = m.masked_fill(m == NEG_INF, 0.0)  # every split empty
    weights = torch.exp(partial_lse - m_safe)  # (num_splits, M): 0 for an empty split
    total = weights.sum(dim=0)  # (M,)
    total_safe = torch.where(total > 0, total, 1.0)  # every split empty: out stays 0
    out = (weights[:, :, None] * partial_out).sum(dim=0) / total_safe[:, None]
    return out, m_safe + torch.log(total)
    # END SOLUTION


# %%
with exercise("combine_splits"):
    cases = {  # name: (M, N, num_splits, block_n)
        "N=33, 4 splits of 16 (the last one empty)": (4, 33, 4, 16),
        "N=200, 3 splits": (4, 200, 3, 16),
        "N=200, 1 split": (4, 200, 1, 16),
        "N=5, 8 splits of 1": (1, 5, 8, 1),
        "N=5, 8 splits of 4 (six empty)": (1, 5, 8, 4),
        "N=0: every split empty": (2, 0, 4, 16),
    }
    for case, (M, N, num_splits, block_n) in cases.items():
        q, k, v = random_qkv(M, N, seed=N)
        out, lse = combine_splits(*split_k(q, k, v, num_splits, block_n))
        ref_out, ref_lse = reference(q, k, v)
        check_close(out, ref_out, f"{case}: combined output vs attention_ref")
        check_close(lse, ref_lse, f"{case}: combined lse vs torch.logsumexp")
    # scores in the hundreds: exp(lse) alone would overflow
    q, k, v = random_qkv(4, 200, scale=100.0)
    check_close(
        combine_splits(*split_k(q, k, v, 3, 16))[0], reference(q, k, v)[0], "large scores, 3 splits"
    )
print("combine_splits: split-K gives the unsplit attention, empty splits included")

# %% [markdown]
# ## Check yourself
# * The combine step takes partial results in any order, and combining two groups of splits and then
#   the two results gives the same as combining all at once. Why? (`(out, lse)` is a summary of a
#   set of keys, and merging summaries is what `combine_splits` does.) The cell below shows both.
# * How much memory do the scores take for a 32,768-token prompt, one head, in float32: written out,
#   and in `attend_blocks` with blocks of 64 keys and the queries in tiles of 128 (as the kernel
#   does)?

# %%
q, k, v = random_qkv(4, 300, seed=1)
partial_out, partial_lse = split_k(q, k, v, num_splits=6, block_n=16)
order = torch.randperm(6, generator=torch.Generator().manual_seed(0))
left, right = (
    combine_splits(partial_out[:2], partial_lse[:2]),
    combine_splits(partial_out[2:], partial_lse[2:]),
)
for name, (out, lse) in {
    "shuffled": combine_splits(partial_out[order], partial_lse[order]),
    "in two groups": combine_splits(
        torch.stack([left[0], right[0]]), torch.stack([left[1], right[1]])
    ),
}.items():
    check_close(out, reference(q, k, v)[0], f"combined {name}")
    check_close(lse, reference(q, k, v)[1], f"combined {name}: lse")
print("combining is order-free and can be done in groups")

n = 32768
print(
    f"scores written out: {n * n * 4 / 2**30:.0f} GiB; one tile of the online softmax: "
    f"{128 * 64 * 4 / 2**10:.0f} KiB"
)
