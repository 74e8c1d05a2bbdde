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
# # Exercise 03 · Cascade attention: a shared prefix read once
#
# A decode step of a chat service: 256 rows, one new query each, every row's cache beginning with
# the same system prompt (with prefix caching, the same blocks). The deep dive cascade_attention's
# decode kernel, given `prefix_blocks` and `prefix_lens`, attends all rows' queries to that prefix
# together and each row to its own keys alone, then merges the two by their log-sum-exps. Here you
# write the same thing in PyTorch, and check it against the reference attention and against notebook
# 03's decode kernel.
#
# **Your task.** Three functions, each checked right after you write it:
#
# 1. `prefix_attention`: every row's queries over keys that all rows share, one matrix product per
#    KV head;
# 2. `merge`: two partial attentions of the same queries over disjoint keys into the attention over
#    both;
# 3. `cascade_decode`: a decode step: the shared prefix with (1), each row's own keys, then (2).
#
# **What it assumes.** Notebook 01's online softmax and split-K (a split's output and its
# log-sum-exp), notebook 03's decode kernel. No GPU: about 10 seconds on a CPU. About 25 minutes.

# %%
import os

import torch

if not torch.cuda.is_available():
    # before any @triton.jit runs: the kernel at the end
    os.environ.setdefault("TRITON_INTERPRET", "1")
from minivllm.kernels.paged_attn import flash_attn_with_kvcache, store_kvcache
from minivllm.kernels.reference import attention_ref
from minivllm.testing import exercise, scatter_into_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def check_close(got: torch.Tensor, expected: torch.Tensor, case: str, tol: float = 1e-4) -> None:
    """torch.testing.assert_close with the case that differs named in front of its message."""
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=lambda m: f"{case}: {m}")


def reference(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Row i's query (num_heads, head_dim) over its keys ks[i], vs[i] (n_i, num_kv_heads, head_dim):
    notebook 01."""
    cu_q = torch.arange(len(ks) + 1, dtype=torch.int32)
    cu_k = torch.tensor(
        [0, *torch.tensor([len(k) for k in ks]).cumsum(0).tolist()], dtype=torch.int32
    )
    # (rows, num_heads, head_dim)
    return attention_ref(q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, scale)


# %% [markdown]
# ## Part 1 · All rows over the shared keys at once
# `q` is `(rows, num_heads, head_dim)`: one query per row and head. The shared keys and values are
# `(num_prefix, num_kv_heads, head_dim)`, and query head `h` reads KV head `h // group` (GQA,
# `group = num_heads // num_kv_heads`). Row by row, each query would read all the keys again;
# instead, view the queries of KV head `j` as one matrix of `rows × group` rows and multiply it by
# that head's keys once. Return the output and, per row and head, the log-sum-exp of its scaled
# scores (natural log): the weight the merge will need.


# %%
def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (rows, num_heads, head_dim) and lse (rows, num_heads): every row's queries over the same
    keys."""
    # BEGIN SOLUTION
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qs = (
        q.view(rows, num_kv_heads, group, head_dim)
        .permute(1, 0, 2, 3)
        .reshape(num_kv_heads, rows * group, -1)
    )
    # (num_kv_heads, rows * group, num_prefix): one product per KV head
    scores = qs @ k.permute(1, 2, 0) * scale
    lse = torch.logsumexp(scores, dim=-1)  # (num_kv_heads, rows * group)
    # (num_kv_heads, rows * group, head_dim)
    out = torch.softmax(scores, dim=-1) @ v.permute(1, 0, 2)
    out = (
        out.view(num_kv_heads, rows, group, head_dim)
        .permute(1, 0, 2, 3)
        .reshape(rows, num_heads, head_dim)
    )
    return out, lse.view(num_kv_heads, rows, group).permute(1, 0, 2).reshape(rows, num_heads)
    # END SOLUTION


# %% [markdown]
# ### Check 1
# 5 rows, 8 query heads over 2 KV heads, 40 shared keys: each row's output must be the reference's
# over those keys, and the log-sum-exp `torch.logsumexp` of each row's scores.

# %%
with exercise("prefix_attention"):
    q = torch.randn(5, 8, 32)
    k, v = torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    out, lse = prefix_attention(q, k, v, 32**-0.5)
    assert out.shape == (5, 8, 32) and lse.shape == (5, 8), (
        f"shapes {tuple(out.shape)}, {tuple(lse.shape)}"
    )
    expected = reference(q, [k] * 5, [v] * 5, 32**-0.5)
    # one query head at a time: a wrong GQA mapping shows as the first wrong head
    for head in range(8):
        case = (
            f"5 rows over 40 shared keys, query head {head} (KV head {head // 4}): out differs "
            f"from the reference"
        )
        check_close(out[:, head], expected[:, head], case)
    heads = torch.arange(8) // 4  # each query head's KV head
    scores = torch.einsum("rhd,nhd->rhn", q, k[:, heads]) * 32**-0.5
    expected = torch.logsumexp(scores, dim=-1)
    check_close(lse, expected, "lse (rows, heads) vs torch.logsumexp of the scaled scores")
print("prefix_attention: correct")

# %% [markdown]
# ## Part 2 · Merging two partial attentions
# Over keys A, a query's output is `out_a = Σ_A e^{s} v / e^{lse_a}`; over disjoint keys B likewise.
# Over both, the sum is `e^{lse_a} + e^{lse_b}`, so `lse = logaddexp(lse_a, lse_b)` and each part's
# output weighs in by its share, `e^{lse_a - lse}` (notebook 01's split-K combine, with two splits).
# A part with no keys has `lse = -inf` and weight 0; both empty gives zeros, not NaN.


# %%
def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over keys A and B, from each part's out (..., head_dim) and lse (...)."""
    # BEGIN SOLUTION
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(lse == float("-inf"), 0.0, lse)  # both parts empty: weights 0, not NaN
    weight_a, weight_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    out = weight_a[..., None] * out_a + weight_b[..., None] * out_b
    return out, lse
    # END SOLUTION


# %% [markdown]
# ### Check 2
# Random keys cut in two at every point, both parts through your `prefix_attention`, merged: the
# attention over all of them. Then an empty part (its `lse` is `-inf`, its output anything finite)
# and two empty parts.

# %%
with exercise("merge"):
    q = torch.randn(3, 4, 16)
    k, v = torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    whole, whole_lse = prefix_attention(q, k, v, 0.25)
    for cut in range(1, 20):
        out, lse = merge(
            *prefix_attention(q, k[:cut], v[:cut], 0.25),
            *prefix_attention(q, k[cut:], v[cut:], 0.25),
        )
        check_close(out, whole, f"keys cut at {cut}: out")
        check_close(lse, whole_lse, f"keys cut at {cut}: lse")
    empty = torch.full_like(whole_lse, float("-inf"))
    out, lse = merge(whole, whole_lse, torch.zeros_like(whole), empty)
    check_close(
        out, whole, "merge with an empty second part (lse -inf) must change nothing", tol=1e-6
    )
    out, lse = merge(torch.zeros_like(whole), empty, torch.zeros_like(whole), empty)
    assert not out.isnan().any() and (lse == float("-inf")).all(), (
        "two empty parts: zeros and -inf, not NaN"
    )
print("merge: correct")

# %% [markdown]
# ## Part 3 · A decode step
# Rows `0 .. rows - 1` share `prefix_k`, `prefix_v`; row `i` then has its own `own_k[i]`, `own_v[i]`
# (its prompt after the prefix and its output so far; any length, 0 included). Attend the prefix
# with all rows at once, each row's own keys alone (your `prefix_attention` on that one row will
# do), and merge.


# %%
def cascade_decode(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    own_k: list[torch.Tensor],
    own_v: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """(rows, num_heads, head_dim): each row's query over the shared prefix, then its own keys."""
    # BEGIN SOLUTION
    shared, shared_lse = prefix_attention(q, prefix_k, prefix_v, scale)
    outs, lses = [], []  # each row over its own keys
    for i, (k, v) in enumerate(zip(own_k, own_v)):
        out, lse = prefix_attention(q[i : i + 1], k, v, scale)
        outs.append(out)
        lses.append(lse)
    own_out, own_lse = torch.cat(outs), torch.cat(lses)
    return merge(shared, shared_lse, own_out, own_lse)[0]
    # END SOLUTION


# %% [markdown]
# ### Check 3
# 6 rows over a 48-token prefix, with 0 to 30 keys of their own: the reference attends each row over
# its prefix and own keys laid end to end.

# %%
with exercise("cascade_decode"):
    prefix_k, prefix_v = torch.randn(48, 2, 32), torch.randn(48, 2, 32)
    own_k = [torch.randn(n, 2, 32) for n in (0, 1, 5, 17, 30, 9)]
    own_v = [torch.randn_like(k) for k in own_k]
    q = torch.randn(6, 4, 32)
    got = cascade_decode(q, prefix_k, prefix_v, own_k, own_v, 32**-0.5)
    expected = reference(
        q,
        [torch.cat([prefix_k, k]) for k in own_k],
        [torch.cat([prefix_v, v]) for v in own_v],
        32**-0.5,
    )
    for row, n in enumerate(len(k) for k in own_k):
        check_close(got[row], expected[row], f"row {row} (48 prefix keys, {n} of its own)")
print("cascade_decode: correct")

# %% [markdown]
# ## What you built, and the kernels that run it
# The deep dive cascade_attention does the same in paged memory: `_shared_prefix_kernel` is your
# Part 1 (tiles of 64 (row, query head) pairs of a KV head, each key tile read once per tile of
# rows), its decode kernel from `prefix_lens[row]` on is Part 3's own keys, and its combine kernel
# is your `merge`, over every split at once. Here the same step goes through notebook 03's decode
# kernel, which reads every row's keys, the 48 prefix tokens in 3 blocks that every row's table
# begins with included, row by row: your cascade must give what it gives.

# %%
lens = [48 + len(k) for k in own_k]
k_cache, v_cache, block_table, _, _, _ = scatter_into_cache(lens, 2, 32, 16, DEVICE)
block_table[:, :3] = block_table[0, :3]  # every row begins with row 0's 3 blocks
for i, (k, v) in enumerate(zip(own_k, own_v)):  # row i's keys, the prefix first, into its slots
    positions = torch.arange(lens[i], device=DEVICE)
    slots = block_table[i, positions // 16].long() * 16 + positions % 16
    store_kvcache(
        torch.cat([prefix_k, k]).to(DEVICE),
        torch.cat([prefix_v, v]).to(DEVICE),
        k_cache,
        v_cache,
        slots,
    )
kernel = flash_attn_with_kvcache(
    q[:, None].to(DEVICE),
    k_cache,
    v_cache,
    torch.tensor(lens, dtype=torch.int32, device=DEVICE),
    block_table,
    32**-0.5,
)
print(
    f"the kernel vs your cascade_decode: max difference "
    f"{(kernel[:, 0].cpu() - got).abs().max():.1e}"
)
check_close(kernel[:, 0].cpu(), got, "the kernel vs your cascade_decode")
