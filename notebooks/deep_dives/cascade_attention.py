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
# # Deep dive · Cascade attention: a prefix every row shares, read once
#
# **What this adds.** Notebook 03's decode kernel reads each row's keys and values by itself. When
# many rows begin with the same cached blocks (a system prompt, thanks to prefix caching), it reads
# those blocks once *per row*. Cascade attention reads them once for all the rows. This deep dive
# explains the idea, checks the kernel against reading row by row, and shows what it saves on an
# H200.
#
# **Where it sits.** It follows notebook 03 (`Sequence`, `BlockManager`, the split-K decode kernel
# and its combine step). Nothing later in the core path needs it: the engine uses it on a GPU by
# itself (notebook 04's runner finds the shared prefix), and every output is the same with or
# without it (up to rounding). Its kernel, `_shared_prefix_kernel`, lives in
# `minivllm/kernels/paged_attn.py` beside the decode kernel it extends, since
# `flash_attn_with_kvcache` launches both; its arguments `prefix_blocks` and `prefix_lens` are
# explained here.
#
# **Write it yourself first?** `exercises/03_cascade_attention.ipynb` builds the same computation in
# PyTorch.

# %%
import os

import torch

if not torch.cuda.is_available():
    # before any @triton.jit runs: the kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
import inspect
import json
from pathlib import Path
from unittest import mock

from minivllm.kernels import paged_attn
from minivllm.kernels.paged_attn import flash_attn_with_kvcache
from minivllm.kernels.paged_reference import paged_attention_ref
from minivllm.testing import check_answer, scatter_into_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)

# %% [markdown]
# ## Why a shared prefix wastes decode's reads
# In a chat service every request begins with the same system prompt, and prefix caching makes its
# blocks the *same* blocks in every row's block table. Notebook 03's decode kernel still reads them
# once per row, for one query per query head: a few FLOPs per byte, far below the GPU's ridge point.
# Yet the rows' queries over those shared keys form a matrix product: all the rows' queries times
# the same keys. **Cascade attention** (FlashInfer's name; vLLM runs it when every request shares a
# prefix) cuts each row's keys in two:
#
# * the **shared prefix**, attended by all the rows' queries together: one program per tile of
#   `BLOCK_M` (row, query head) pairs of a KV head runs the decode kernel's `attend_split` over the
#   prefix's blocks (no causal mask: every row sees the whole prefix), each key tile read once per
#   tile of rows, not once per row;
# * each row's **own keys** (its prompt after the prefix, its output so far): the decode kernel,
#   from `prefix_lens[row]` on.
#
# Each half is a split in notebook 03's sense: an output normalised by its own sum, and its
# log-sum-exp. The prefix's results go into more split slots of each row, and the combine kernel,
# which already merges splits exactly, merges them too. Per layer of Qwen3-0.6B, 256 rows that share
# a 1,488-token prompt and hold ~350 tokens each of their own (notebook 06's chat workload):

# %%
rows, shared, own = 256, 1488, 350
kv_bytes_per_token = 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16
per_row = rows * (shared + own) * kv_bytes_per_token / 1e6
cascade = (shared + rows * own) * kv_bytes_per_token / 1e6
print(
    f"keys and values read per layer: {per_row:.0f} MB row by row, {cascade:.0f} MB with the "
    f"prefix read once"
)
# 2 query heads per KV head, bf16
flops_per_byte = lambda queries: 4 * queries * 2 * 128 / (2 * 128 * 2)
print(
    f"the prefix's FLOP/byte with all rows' queries: {flops_per_byte(rows):.0f} (one row's: "
    f"{flops_per_byte(1):.0f})"
)
assert cascade < per_row / 4

# %% [markdown]
# ## The kernel
# One program per (tile of rows, KV head, split of the prefix). Rows that do not share the prefix
# (`prefix_lens[row] == 0`) are computed as padding and never read: the combine kernel counts the
# prefix's slots only for the rows that share it. The prefix gets one length for all its rows, the
# largest of `prefix_lens`.

# %%
print(inspect.getsource(paged_attn._shared_prefix_kernel.fn))
print(inspect.getsource(paged_attn.prefix_num_splits))

# %% [markdown]
# ## Check it against the reference
# Rows 0–3 below begin with the same 3 blocks (48 tokens), row 4 does not. With the prefix given,
# each row's output must be what notebook 03's PyTorch reference gives (each row's keys gathered
# through its block table), and what the decode kernel gives reading every key row by row, whatever
# the number of splits of the prefix (on a CPU, with no multiprocessors to fill, `prefix_num_splits`
# picks 1; here it is forced).

# %%
seq_lens = [60, 49, 100, 48, 70]
k_cache, v_cache, block_table, _, _, _ = scatter_into_cache(seq_lens, 2, 32, 16, DEVICE)
# rows 1-3 now read row 0's first 48 keys: a cached system prompt
block_table[1:4, :3] = block_table[0, :3]
prefix = dict(
    prefix_blocks=block_table[0, :3],
    prefix_lens=torch.tensor([48, 48, 48, 48, 0], device=DEVICE).int(),
)
q = torch.randn(len(seq_lens), 1, 8, 32, device=DEVICE)
cache_seqlens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)  # one new query per row
cu_k = torch.tensor([0, *seq_lens], device=DEVICE).cumsum(0).int()
# (rows, heads, head_dim)
ref = paged_attention_ref(q[:, 0], k_cache, v_cache, cu_q, cu_k, block_table)
row_by_row = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)
torch.testing.assert_close(row_by_row[:, 0], ref, rtol=1e-4, atol=1e-4)
for num_splits in (1, 3):
    with mock.patch.object(paged_attn, "prefix_num_splits", lambda *_, n=num_splits: n):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, **prefix)
    print(
        f"prefix in {num_splits} split(s): max difference from the reference "
        f"{(out[:, 0] - ref).abs().max():.1e}"
    )
    torch.testing.assert_close(out[:, 0], ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## Check yourself: who shares the prefix?
# Three rows hold 40 tokens each in blocks of 16; their block tables are `[5, 9, 2]`, `[5, 9, 7]`
# and `[5, 3, 8]`. Given `prefix_blocks = [5, 9]`, which `prefix_lens` (a list, one per row) gives
# every row the output of reading its keys row by row?

# %%
answer = None  # your answer: replace None with a list of three ints
tables = torch.tensor([[5, 9, 2], [5, 9, 7], [5, 3, 8]], dtype=torch.int32, device=DEVICE)
# which rows begin with both prefix blocks
shares = [int(row[:2].tolist() == [5, 9]) for row in tables]
check_answer(answer, [32 * s for s in shares], "who shares the prefix")

# %% [markdown]
# Worked answer: `[32, 32, 0]`. Rows 0 and 1 begin with blocks 5 and 9: 32 tokens each. Row 2 shares
# block 5 only, and the prefix kernel gives all its rows one length: row 2 reads its 40 keys itself.
# Flagging it too would attend its queries to block 9, another row's keys, silently:

# %%
# 10 blocks of 16 slots, 2 KV heads of 32
k_cache, v_cache = torch.randn(2, 10, 16, 2, 32, device=DEVICE)
q = torch.randn(3, 1, 4, 32, device=DEVICE)
lens = torch.full((3,), 40, dtype=torch.int32, device=DEVICE)
row_by_row = flash_attn_with_kvcache(q, k_cache, v_cache, lens, tables)
for prefix_lens in ([32, 32, 0], [32, 32, 32]):
    given = torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, lens, tables, prefix_blocks=tables[0, :2], prefix_lens=given
    )
    errors = (out - row_by_row).abs().amax(dim=(1, 2, 3))  # (3,): each row's largest difference
    print(
        f"prefix_lens {prefix_lens}: largest difference per row",
        ", ".join(f"{e:.1e}" for e in errors),
    )
# the sharers are right either way
torch.testing.assert_close(out[:2], row_by_row[:2], rtol=1e-4, atol=1e-4)
assert (out[2] - row_by_row[2]).abs().max() > 0.01  # row 2, flagged, is wrong
check_answer([32, 32, 0], [32 * s for s in shares], "who shares the prefix")

# %% [markdown]
# ## Measured on an H200
# `python -m minivllm.benchmarks.cascade` times decode attention per layer for rows that share a
# 1,488-token prefix: each row reading every key (`row by row`), the prefix read once (`cascade`),
# and the prefix kernel launched in a step where no row shares it (`cascade, no sharers`: what a
# CUDA graph captured with it costs; notebook 04 captures decode graphs both ways). On a GPU this
# cell re-measures two shapes; without one it shows the committed H200 results.

# %%
from minivllm.benchmarks.cascade import plot_cascade, run_cascade_benchmark

if DEVICE == "cuda":
    cascade_data = run_cascade_benchmark(shapes=[(64, 350), (256, 350)])
else:
    cascade_data = json.loads(Path("../figures/cascade.json").read_text())
plot_cascade(cascade_data).savefig(FIGURES / "cascade.png", dpi=120)
cascade_rows = cascade_data["rows"]
us = {(r["impl"], r["batch"], r["own_tokens"]): r["ms"] * 1e3 for r in cascade_rows}
for rows, own in sorted({(b, o) for _, b, o in us}):
    ways = ("row by row", "cascade", "cascade, no sharers")
    print(
        f"{rows:>3} rows, ~{own} own tokens each:",
        ", ".join(f"{w} {us[w, rows, own]:5.0f} µs" for w in ways),
    )

# %% [markdown]
# **Reading it** (computed below from the rows shown). The more rows share the prefix, the more
# reads cascade saves: 256 rows read the prefix once instead of 256 times. Launching the prefix
# kernel in a step where no row shares it costs a few percent: a CUDA graph captured with it must
# not run such steps, which is why notebook 04 captures decode graphs both ways, and why its runner
# asks for the cascade only when at least `CASCADE_MIN_ROWS` rows share `CASCADE_MIN_TOKENS` tokens.
# These are one machine's measurements: printed, not asserted.

# %%
for rows, own in sorted({(b, o) for _, b, o in us}):
    saved = 1 - us["cascade", rows, own] / us["row by row", rows, own]
    extra = us["cascade, no sharers", rows, own] / us["row by row", rows, own] - 1
    print(
        f"{rows:>3} rows, ~{own} own tokens: cascade saves {saved:4.0%}; the kernel with no "
        f"sharer costs {extra:+.0%}"
    )
