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
# # Exercise 04 · The attention of a mixed step
#
# Under the unified policy (notebook 05) one step holds decode rows (one new token each, after its cache) and
# prompt chunks. Notebook 04's `PagedContext.mixed` attends them with two kernels into one output: the decode
# kernel for the decode rows, which come first, and the paged prefill kernel for the rest, driven by a list of
# (sequence, query tile) pairs. Here you build that list and that split yourself, and check them against the
# reference attention on random steps.
#
# **Your task.** Two functions, each checked right after you write it:
#
# 1. `my_query_tiles`: the prefill kernel's work list for the sequences after the decode rows;
# 2. `mixed_attention`: the decode kernel for the first rows, the prefill kernel over your list for the others.
#
# **What it assumes.** Notebook 03's paged kernels (`flash_attn_with_kvcache`, `flash_attn_varlen_func`) and
# notebook 04's mixed steps. No GPU: on a CPU the kernels run in Triton's interpreter, about 20 seconds in all.
# About 20–30 minutes.

# %%
import os
import random

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
from minivllm.engine.model_runner import query_tiles
from minivllm.kernels import flash_attn_varlen_func
from minivllm.kernels.flash_attn import launch_config
from minivllm.kernels.paged_attn import flash_attn_with_kvcache
from minivllm.kernels.paged_reference import paged_attention_ref
from minivllm.testing import exercise, scatter_into_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
random.seed(0)

# %% [markdown]
# ## Part 1 · The work list
# The prefill kernel runs one program per query head and per entry of `tiles`, an `(num_tiles, 2)` int32 array of
# (sequence, query tile) pairs: tile `m` of a sequence is its new tokens `m * block_m` to `(m + 1) * block_m - 1`
# (the last tile may be short). The step is given by `cu_seqlens_q` (cumulative new tokens per sequence) and
# `cu_seqlens_k` (cumulative cached + new tokens); list every tile of the sequences `first_seq, first_seq + 1, ...`
# and none of the decode rows before them.
#
# **Order.** Programs start in list order, and a tile's cost grows with the keys its last row sees: the cached
# tokens plus its new tokens up to that row, `k_len - q_len + min((m + 1) * block_m, q_len)`. Put the costliest
# tiles first, so that the longest programs do not start last.


# %%
def my_query_tiles(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, first_seq: int, block_m: int) -> np.ndarray:
    """(num_tiles, 2) int32 rows of (sequence, query tile) for sequences first_seq.., the most keys first."""
    # BEGIN SOLUTION
    pairs, keys = [], []
    for seq in range(first_seq, len(cu_seqlens_q) - 1):
        q_len = int(cu_seqlens_q[seq + 1] - cu_seqlens_q[seq])
        k_len = int(cu_seqlens_k[seq + 1] - cu_seqlens_k[seq])
        for m in range(-(-q_len // block_m)):
            pairs.append((seq, m))
            keys.append(k_len - q_len + min((m + 1) * block_m, q_len))
    order = sorted(range(len(pairs)), key=lambda i: -keys[i])
    return np.array([pairs[i] for i in order], dtype=np.int32).reshape(-1, 2)
    # END SOLUTION


# %% [markdown]
# ### Check 1
# Notebook 04's step first: two decode rows, then a chunk of 128 tokens after 1,000 cached ones and a new prompt of
# 40, tiles of 64: `[[2, 1], [2, 0], [3, 0]]` (1,128 keys, 1,064, then 40). Then random steps, compared with
# notebook 04's `query_tiles`: the same pairs, in an order of non-increasing keys (ties in any order).


# %%
def keys_of(tiles: np.ndarray, cu_q: np.ndarray, cu_k: np.ndarray, block_m: int) -> list[int]:
    q_lens, k_lens = np.diff(cu_q), np.diff(cu_k)
    return [int(k_lens[s] - q_lens[s] + min((m + 1) * block_m, q_lens[s])) for s, m in tiles.tolist()]


with exercise("my_query_tiles"):
    cu_q, cu_k = np.array([0, 1, 2, 130, 170]), np.array([0, 300, 341, 1469, 1509])
    got = my_query_tiles(cu_q, cu_k, first_seq=2, block_m=64)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32, f"expected an int32 array, got {type(got)} {got!r}"
    assert got.tolist() == [[2, 1], [2, 0], [3, 0]], f"notebook 04's step: expected [[2, 1], [2, 0], [3, 0]], got {got}"
    for case in range(30):
        q_lens = [1] * random.randint(0, 4) + [random.randint(1, 90) for _ in range(random.randint(1, 4))]
        k_lens = [q + random.randint(0 if q > 1 else 1, 200) for q in q_lens]
        cu_q, cu_k = np.cumsum([0, *q_lens]), np.cumsum([0, *k_lens])
        first, block_m = q_lens.index(max(q_lens)) if random.random() < 0.3 else 0, random.choice([16, 64])
        ours, theirs = my_query_tiles(cu_q, cu_k, first, block_m), query_tiles(cu_q, cu_k, first, block_m)
        step = f"case {case}: q_lens {q_lens}, k_lens {k_lens}, first_seq {first}, block_m {block_m}"
        assert sorted(map(tuple, ours.tolist())) == sorted(map(tuple, theirs.tolist())), f"{step}: got {ours.tolist()}"
        keys = keys_of(ours, cu_q, cu_k, block_m)
        assert keys == sorted(keys, reverse=True), f"{step}: tiles not costliest first, keys {keys}"
print("my_query_tiles: correct")

# %% [markdown]
# ## Part 2 · Two kernels, one output
# `mixed_attention` gets the step's queries `q` (its rows packed end to end), the paged cache (every new token's K
# and V are already stored), the step's `cu_seqlens_q`, `cu_seqlens_k` and block tables, and `num_decode`: the
# first `num_decode` sequences are decode rows, one query each. Allocate the output once, then:
#
# * `flash_attn_with_kvcache(q[:n].unsqueeze(1), k_cache, v_cache, cache_seqlens, block_table[:n], scale,
#   out=out[:n].unsqueeze(1))`, whose `cache_seqlens` are those rows' cache lengths (int32, on the device);
# * `flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, scale, causal=True,
#   block_table=block_table, out=out, tiles=...)`, with your list (int32, on the device) of the other sequences.
#   The kernel reads each listed sequence's rows at `cu_q[seq]` in the whole `q`: no slicing.
#
# The tile size is the kernel's: `launch_config(head_dim, q.device)["BLOCK_M"]`. The index tensors live on the
# device; take their host copies with `.cpu().numpy()` for your list.


# %%
def mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q: torch.Tensor,
                    cu_k: torch.Tensor, block_table: torch.Tensor, num_decode: int, scale: float) -> torch.Tensor:  # fmt: skip
    """(num_tokens, num_heads, head_dim): the first num_decode sequences (one query each) through the decode
    kernel, the others through the paged prefill kernel over their tiles."""
    # BEGIN SOLUTION
    out = torch.empty_like(q)
    n = num_decode
    k_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    flash_attn_with_kvcache(q[:n].unsqueeze(1), k_cache, v_cache, k_lens[:n].contiguous(), block_table[:n], scale,
                            out=out[:n].unsqueeze(1))  # fmt: skip
    block_m = launch_config(q.shape[2], q.device)["BLOCK_M"]
    tiles = my_query_tiles(cu_q.cpu().numpy(), cu_k.cpu().numpy(), n, block_m)
    q_lens = cu_q[1:] - cu_q[:-1]
    flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, int(q_lens.max()), int(k_lens.max()), scale,
                           causal=True, block_table=block_table, out=out,
                           tiles=torch.from_numpy(tiles).to(q.device))  # fmt: skip
    return out
    # END SOLUTION


# %% [markdown]
# ### Check 2
# Random steps of 1 to 3 decode rows and 1 to 2 prompt chunks (some with a cached prefix, some whole prompts), in
# shuffled blocks of 16: your output must equal the reference's, which attends every row over its cache at once.
# Then a step of decode rows only: your list is empty, and the prefill kernel computes nothing.

# %%
with exercise("mixed_attention"):
    for case in range(4):
        n = random.randint(1, 3)
        q_lens = [1] * n + [random.randint(2, 40) for _ in range(random.randint(1, 2))]
        k_lens = [random.randint(2, 60) for _ in range(n)] + [q + random.choice([0, 17, 40]) for q in q_lens[n:]]
        k_cache, v_cache, block_table, _, _, cu_k = scatter_into_cache(k_lens, 2, 32, 16, DEVICE, seed=case)
        cu_q = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=DEVICE)
        q = torch.randn(sum(q_lens), 4, 32, device=DEVICE)
        got = mixed_attention(q, k_cache, v_cache, cu_q, cu_k, block_table, n, 32**-0.5)
        expected = paged_attention_ref(q, k_cache, v_cache, cu_q, cu_k, block_table, 32**-0.5)
        error = (got - expected).abs().max().item()
        assert error < 1e-4, f"case {case}: q_lens {q_lens}, k_lens {k_lens}: max error {error:.1e}"
    got = mixed_attention(q[:n], k_cache, v_cache, cu_q[: n + 1], cu_k[: n + 1], block_table[:n], n, 32**-0.5)
    expected = paged_attention_ref(q[:n], k_cache, v_cache, cu_q[: n + 1], cu_k[: n + 1], block_table[:n], 32**-0.5)
    assert (got - expected).abs().max().item() < 1e-4, "a step of decode rows only"
print("mixed_attention: correct")

# %% [markdown]
# ## What you built
# The engine's mixed step: `prepare_prefill` counts the leading decode rows (`num_decode_seqs`), `step_to_device`
# builds the tile list with `query_tiles`, and `PagedContext.mixed` runs your two calls. The list is also what lets
# a CUDA graph capture the step (notebook 04): a graph fixes the grid, so its list is padded with `-1` pairs, which
# return at once. On an H200, sending a chat step's ~255 decode rows through the decode kernel instead of the prefill
# kernel cut its kernels from ~25 ms to ~11 ms.
