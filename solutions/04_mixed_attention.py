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
# # Exercise 04 · The attention of a mixed step, decode rows anywhere
#
# Under the unified policy (notebook 05) one step holds decode rows (one new token each, after its
# cache) and prompt chunks. On a GPU, `FastPagedContext` (deep dive cuda_graphs) attends them with
# two kernels into one output: the decode kernel for the decode rows and the paged prefill kernel,
# driven by a list of (sequence, query tile) pairs, for the rest. It relies on the scheduler putting
# every decode row **first**, so that "the decode rows" is `q[:n]`.
#
# Here the step comes in any order: a scheduler that keeps requests in arrival order, a speculative
# decoding step whose sequences have one or several new tokens, a step rebuilt after a preemption.
# You find the decode rows wherever they are, gather them for the decode kernel and put its output
# back in place, and list the prefill kernel's tiles for the other sequences only, then check both
# against the reference attention on random steps.
#
# **Your task.** Two functions, each checked right after you write it:
#
# 1. `my_query_tiles`: the prefill kernel's work list for any set of sequences, costliest tiles
#    first;
# 2. `mixed_attention`: the decode kernel for the sequences with one new token, the prefill kernel
#    over your list for the others.
#
# **What it assumes.** Notebook 03's paged kernels (`flash_attn_with_kvcache`,
# `flash_attn_varlen_func`) and notebook 04's mixed steps. No GPU: on a CPU the kernels run in
# Triton's interpreter, about 20 seconds in all. About 30 minutes.

# %%
import os
import random

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
from minivllm.kernels import flash_attn_varlen_func
from minivllm.kernels.flash_attn import launch_config
from minivllm.kernels.paged_attn import flash_attn_with_kvcache
from minivllm.kernels.paged_reference import paged_attention_ref
from minivllm.testing import exercise, scatter_into_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
random.seed(0)

# %% [markdown]
# ## Part 1 · The work list
# The prefill kernel runs one program per query head and per entry of `tiles`, an `(num_tiles, 2)`
# int32 array of (sequence, query tile) pairs: tile `m` of a sequence is its new tokens `m *
# block_m` to `(m + 1) * block_m - 1` (the last tile may be short). The step is given by
# `cu_seqlens_q` (cumulative new tokens per sequence) and `cu_seqlens_k` (cumulative cached + new
# tokens); list every tile of the sequences in `seqs` (an int array of sequence indices, in any
# order) and none of the others.
#
# **Order.** Programs start in list order, and a tile's cost grows with the keys its last row sees:
# the cached tokens plus its new tokens up to that row, `k_len - q_len + min((m + 1) * block_m,
# q_len)`. Put the costliest tiles first, so that the longest programs do not start last.


# %%
def my_query_tiles(
    cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, seqs: np.ndarray, block_m: int
) -> np.ndarray:
    """(num_tiles, 2) int32 rows of (sequence, query tile) for the sequences in seqs, the most keys
    first."""
    # BEGIN SOLUTION
    pairs, keys = [], []
    for seq in seqs.tolist():
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
# Notebook 04's step first: two decode rows, then a chunk of 128 tokens after 1,000 cached ones and
# a new prompt of 40, tiles of 64: for sequences `[2, 3]`, `[[2, 1], [2, 0], [3, 0]]` (1,128 keys,
# 1,064, then 40). The same step in another order. Then random steps and random sets of sequences:
# every tile of every listed sequence exactly once, none of the others, in an order of
# non-increasing keys (ties in any order).


# %%
def keys_of(tiles: np.ndarray, cu_q: np.ndarray, cu_k: np.ndarray, block_m: int) -> list[int]:
    q_lens, k_lens = np.diff(cu_q), np.diff(cu_k)
    keys = []
    for s, m in tiles.tolist():
        rows_end = min((m + 1) * block_m, q_lens[s])  # past the tile's last query row
        keys.append(int(k_lens[s] - q_lens[s] + rows_end))
    return keys


with exercise("my_query_tiles"):
    cu_q = np.array([0, 1, 2, 130, 170])
    cu_k = np.array([0, 300, 341, 1469, 1509])
    got = my_query_tiles(cu_q, cu_k, np.array([2, 3]), block_m=64)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32, (
        f"expected an int32 array, got {type(got)} {got!r}"
    )
    assert got.tolist() == [[2, 1], [2, 0], [3, 0]], (
        f"notebook 04's step: expected [[2, 1], [2, 0], [3, 0]], got {got}"
    )
    cu_q, cu_k = (
        np.array([0, 128, 129, 169, 170]),
        np.array([0, 1128, 1429, 1469, 1510]),
    )  # decode rows 1 and 3
    got = my_query_tiles(cu_q, cu_k, np.array([0, 2]), block_m=64).tolist()
    assert got == [[0, 1], [0, 0], [2, 0]], (
        f"the same step, reordered (sequences 0 and 2): expected [[0, 1], [0, 0], [2, 0]], got "
        f"{got}"
    )
    for case in range(30):
        q_lens = [1] * random.randint(0, 4) + [
            random.randint(1, 90) for _ in range(random.randint(1, 4))
        ]
        k_lens = [q + random.randint(0 if q > 1 else 1, 200) for q in q_lens]
        cu_q, cu_k = np.cumsum([0, *q_lens]), np.cumsum([0, *k_lens])
        random.shuffle(order := list(range(len(q_lens))))
        q_lens, k_lens = [q_lens[i] for i in order], [k_lens[i] for i in order]
        cu_q, cu_k = np.cumsum([0, *q_lens]), np.cumsum([0, *k_lens])
        listed, block_m = (
            sorted(random.sample(range(len(q_lens)), random.randint(0, len(q_lens)))),
            random.choice([16, 64]),
        )
        ours = my_query_tiles(cu_q, cu_k, np.array(listed, dtype=np.int64), block_m)
        step = f"case {case}: q_lens {q_lens}, k_lens {k_lens}, seqs {listed}, block_m {block_m}"
        assert ours.ndim == 2 and ours.shape[1] == 2, (
            f"{step}: expected (num_tiles, 2), got shape {ours.shape}"
        )
        pairs = [tuple(pair) for pair in ours.tolist()]
        assert len(set(pairs)) == len(pairs), f"{step}: a tile listed twice in {pairs}"
        for seq, q_len in enumerate(q_lens):
            tiles = sorted(m for s, m in pairs if s == seq)
            expected = list(range(-(-q_len // block_m))) if seq in listed else []
            assert tiles == expected, (
                f"{step}: sequence {seq} ({q_len} new tokens) has tiles {tiles}, expected "
                f"{expected}"
            )
        assert len(pairs) == sum(-(-q_lens[i] // block_m) for i in listed), (
            f"{step}: tiles of no sequence in {pairs}"
        )
        keys = keys_of(ours, cu_q, cu_k, block_m)
        assert keys == sorted(keys, reverse=True), f"{step}: tiles not costliest first, keys {keys}"
print("my_query_tiles: correct")

# %% [markdown]
# ## Part 2 · Two kernels, one output
# `mixed_attention` gets the step's queries `q` (its rows packed end to end, sequences in any
# order), the paged cache (every new token's K and V are already stored), and the step's
# `cu_seqlens_q`, `cu_seqlens_k` and block tables. A sequence with one new token is a decode row,
# wherever it sits. Allocate the output once, then:
#
# * the decode kernel on the decode rows only: `flash_attn_with_kvcache(q_d.unsqueeze(1), k_cache,
#   v_cache, cache_seqlens, tables_d, scale)` returns `(n, 1, num_heads, head_dim)`, where `q_d` are
#   those rows' queries (gathered: `q[rows]` with an index tensor), `tables_d` their sequences'
#   block tables and `cache_seqlens` their cache lengths (int32, on the device). Put its output back
#   at those rows;
# * `flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, scale, causal=True,
#   block_table=block_table, out=out, tiles=...)`, with your list (int32, on the device) of the
#   other sequences. The kernel reads each listed sequence's rows at `cu_q[seq]` in the whole `q`:
#   no slicing, and the rows it is not given are left alone.
#
# The tile size is the kernel's: `launch_config(head_dim, q.device)["BLOCK_M"]`. The index tensors
# live on the device; take their host copies with `.cpu().numpy()` for your list. A step may have no
# decode rows, or nothing else: launch only what has work.


# %%
def mixed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """(num_tokens, num_heads, head_dim): the sequences with one new token through the decode
    kernel, the others through the paged prefill kernel over their tiles."""
    # BEGIN SOLUTION
    out = torch.empty_like(q)
    q_lens = (cu_q[1:] - cu_q[:-1]).cpu().numpy()
    k_lens = (cu_k[1:] - cu_k[:-1]).cpu().numpy()
    decode, others = np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)
    if len(decode):
        seqs = torch.from_numpy(decode).to(q.device)
        rows = cu_q[:-1][seqs].long()  # each decode sequence's one row
        cache_seqlens = torch.from_numpy(k_lens[decode].astype(np.int32)).to(q.device)
        decoded = flash_attn_with_kvcache(
            q[rows].unsqueeze(1), k_cache, v_cache, cache_seqlens, block_table[seqs], scale
        )
        out[rows] = decoded.squeeze(1)
    if len(others):
        block_m = launch_config(q.shape[2], q.device)["BLOCK_M"]
        tiles = my_query_tiles(cu_q.cpu().numpy(), cu_k.cpu().numpy(), others, block_m)
        flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_q,
            cu_k,
            int(q_lens.max()),
            int(k_lens.max()),
            scale,
            causal=True,
            block_table=block_table,
            out=out,
            tiles=torch.from_numpy(tiles).to(q.device),
        )
    return out
    # END SOLUTION


# %% [markdown]
# ### Check 2
# Random steps of 1 to 3 decode rows and 1 to 2 prompt chunks (some with a cached prefix, some whole
# prompts), in shuffled order and shuffled blocks of 16: your output must equal the reference's,
# which attends every row over its cache at once. The check also watches the two kernels: the decode
# kernel must get exactly the decode rows, and the prefill kernel's list none of them (one query in
# a tile of `BLOCK_M` rows is the waste this split removes). Then a step of decode rows only, and
# one without any.

# %%
# (kernel, args, kwargs) of each launch in the step under test
calls: list[tuple[str, tuple, dict]] = []


def watched(name: str, kernel):
    def launch(*args, **kwargs):
        calls.append((name, args, kwargs))
        return kernel(*args, **kwargs)

    return launch


def check_step(case: str, q_lens: list[int], k_lens: list[int], seed: int) -> None:
    k_cache, v_cache, block_table, _, _, cu_k = scatter_into_cache(
        k_lens, 2, 32, 16, DEVICE, seed=seed
    )
    cu_q = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), 4, 32, device=DEVICE)
    calls.clear()
    got = mixed_attention(q, k_cache, v_cache, cu_q, cu_k, block_table, 32**-0.5)
    decoding = [i for i, n in enumerate(q_lens) if n == 1]
    step = f"{case}: q_lens {q_lens}, k_lens {k_lens}, decode rows of sequences {decoding}"
    decode = [args for name, args, _ in calls if name == "decode"]
    rows = sum(args[0].shape[0] for args in decode)
    assert rows == len(decoding), (
        f"{step}: the decode kernel ran {len(decode)} times on {rows} rows in all"
    )
    for _, _, kwargs in (c for c in calls if c[0] == "prefill"):
        tiles = kwargs.get("tiles")
        assert tiles is not None, (
            f"{step}: the prefill kernel ran without `tiles`: over every row, decode rows too"
        )
        listed = sorted({s for s, _ in tiles.tolist() if s in decoding})
        assert not listed, (
            f"{step}: the prefill kernel's tiles include the decode row(s) of sequence(s) {listed}"
        )
    expected = paged_attention_ref(q, k_cache, v_cache, cu_q, cu_k, block_table, 32**-0.5)
    for seq in range(len(q_lens)):
        rows = slice(int(cu_q[seq]), int(cu_q[seq + 1]))
        error = (got[rows] - expected[rows]).abs().max().item()
        kind = (
            "decode row"
            if seq in decoding
            else f"chunk of {q_lens[seq]} after {k_lens[seq] - q_lens[seq]} cached"
        )
        assert error < 1e-4, (
            f"{step}: sequence {seq} ({kind}) differs from the reference by {error:.1e}"
        )


with exercise("mixed_attention"):
    kernels = flash_attn_with_kvcache, flash_attn_varlen_func
    flash_attn_with_kvcache, flash_attn_varlen_func = (
        watched("decode", kernels[0]),
        watched("prefill", kernels[1]),
    )
    try:
        for case in range(4):
            n = random.randint(1, 3)
            q_lens = [1] * n + [random.randint(2, 40) for _ in range(random.randint(1, 2))]
            k_lens = [random.randint(2, 60) for _ in range(n)] + [
                q + random.choice([0, 17, 40]) for q in q_lens[n:]
            ]
            random.shuffle(order := list(range(len(q_lens))))
            check_step(
                f"case {case}", [q_lens[i] for i in order], [k_lens[i] for i in order], seed=case
            )
        check_step("decode rows only", [1, 1, 1], [5, 33, 17], seed=4)
        check_step("no decode rows", [7, 20], [7, 37], seed=5)
    finally:
        flash_attn_with_kvcache, flash_attn_varlen_func = kernels
print("mixed_attention: correct")

# %% [markdown]
# ## What you built
# The GPU runner's mixed step does the same with the decode rows first (deep dive cuda_graphs):
# `num_decode_rows` counts them, `query_tiles` lists the others' tiles, and `FastPagedContext`
# runs the two kernels on `q[:n]` and the rest, with no gather and no scatter.
# Your version costs a gather and a scatter of the decode rows' queries and outputs (a few KB each);
# what does it let the scheduler do that it cannot now? The list is also what lets a CUDA graph
# capture the step (notebook 04): a graph fixes the grid, so its list is padded with `-1` pairs,
# which return at once. On an H200, sending a chat step's ~255 decode rows through the decode kernel
# instead of the prefill kernel cut its kernels from ~25 ms to ~11 ms.
