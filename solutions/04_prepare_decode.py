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
# # Exercise 04 · The inputs of a decode step
#
# A decode step runs one new token per sequence through the model. Before it can, the runner turns the batch's
# `Sequence`s into a handful of flat arrays: which token each row is, at which position, into which cache slot
# its key and value go, how many cached tokens it attends to, and where those live (the block tables). Notebook
# 04 ("The model runner") builds them in `prepare_decode`; here you write them yourself, with NumPy over whole
# arrays, and then run the tiny model on your arrays.
#
# **Your task.** Three functions, each checked right after you write it:
#
# 1. `padded_block_tables`: the batch's block tables as one rectangular array;
# 2. `decode_slots`: the cache slot of each sequence's newest token: the address arithmetic of paging;
# 3. `my_prepare_decode`: the whole `StepInputs` of a decode step.
#
# The checks go from a case by hand (notebook 04's "check yourself": 37 tokens, block table `[7, 2, 9]`) to
# equality with `prepare_decode` on random batches, to decoding with the tiny checkpoint through a `ModelRunner`:
# your inputs must give the logits of the runner's own, and of a from-scratch forward over the whole sequence.
#
# **What it assumes.** Notebook 03's `Sequence` and `BlockManager` (block tables, slots) and notebook 04's
# `StepInputs`. No GPU: about 10 seconds on a CPU. About 20–30 minutes.

# %%
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import StepInputs, prepare_decode
from minivllm.testing import exercise

random.seed(0)

# %% [markdown]
# ## What a decode step needs
#
# Take a sequence of `n` tokens that has just sampled its newest one (`seq.append_token` ran, so `len(seq) == n`
# already counts it). The KV of the first `n - 1` tokens is in the cache; the newest token's is not, because it has
# never been through the model. This step computes it. So for each sequence:
#
# | array | value | dtype |
# |---|---|---|
# | `input_ids` | the newest token, `seq.last_token` | int64 |
# | `positions` | its position, `n - 1` (positions count from 0; RoPE needs it) | int64 |
# | `slot_mapping` | where its K and V go in the cache (below) | int64 |
# | `context_lens` | how many tokens its query attends to: `n`, itself included | int32 |
# | `block_tables` | its block table, a row of one `(num_seqs, max_blocks)` array | int32 |
#
# **Slots.** The cache is `num_blocks` blocks of `block_size` slots. Token `t` of a sequence lives in its logical
# block `t // block_size`, which the block table maps to a physical block, at offset `t % block_size`:
#
# ```
# slot = block_table[t // block_size] * block_size + t % block_size
# ```
#
# **Padding.** Sequences hold different numbers of blocks, but the kernel wants one rectangle, so short tables are
# padded, with zeros. Zero is a real block id (some other sequence's block), which is safe only because the kernel
# reads no further than `context_lens`: the padding is never dereferenced.
#
# **Whole arrays.** A decode step on a GPU takes a few milliseconds (2 ms for Qwen3-0.6B at batch 1 with CUDA
# graphs, notebook 04). A Python loop doing per-sequence arithmetic on 256 sequences costs a good fraction of
# that, every step. So compute over arrays: one loop to copy the tables (Python lists) into the rectangle is fine,
# but positions, slots and lengths are each a single NumPy expression over the batch. Fancy indexing does the
# table lookup for every row at once: `tables[rows, cols]` with `rows`, `cols` integer arrays picks
# `tables[rows[i], cols[i]]` for each `i`.

# %% [markdown]
# ## Part 1 · The padded block tables


# %%
def padded_block_tables(seqs: list[Sequence]) -> np.ndarray:
    """(num_seqs, max_blocks) int32: row i is seqs[i].block_table, then zeros."""
    # BEGIN SOLUTION
    tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    return tables
    # END SOLUTION


# %% [markdown]
# ### Check 1
# Three sequences of 3, 1 and 2 blocks; then one alone (no padding at all).


# %%
def sequence(num_tokens: int, block_table: list[int], block_size: int = 16) -> Sequence:
    """A sequence of num_tokens tokens that holds these blocks (as BlockManager would have given it)."""
    seq = Sequence([random.randrange(2048) for _ in range(num_tokens)], block_size=block_size)
    assert seq.num_blocks == len(block_table), f"{num_tokens} tokens need {seq.num_blocks} blocks of {block_size}"
    seq.block_table = list(block_table)
    return seq


with exercise("padded_block_tables"):
    seqs = [sequence(38, [7, 2, 9]), sequence(5, [4]), sequence(20, [11, 3])]
    got = padded_block_tables(seqs)
    expected = np.array([[7, 2, 9], [4, 0, 0], [11, 3, 0]], dtype=np.int32)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32, f"expected an int32 array, got {type(got)} {got!r}"
    assert got.shape == expected.shape and (got == expected).all(), f"expected\n{expected}\ngot\n{got}"
    alone = padded_block_tables([sequence(40, [5, 6, 1])])
    assert alone.tolist() == [[5, 6, 1]], f"one sequence of 3 blocks: expected [[5, 6, 1]], got {alone.tolist()}"
print("padded_block_tables: correct")

# %% [markdown]
# ## Part 2 · Slots
# `decode_slots` takes the padded tables and one position per row, and returns each row's slot, with no Python
# loop. (Careful with dtypes: the tables are int32 and a slot may pass 2³¹ in a big cache; compute in int64.)


# %%
def decode_slots(block_tables: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """(num_seqs,) int64: the cache slot of token positions[i] of sequence i, whose table is block_tables[i]."""
    # BEGIN SOLUTION
    rows = np.arange(len(positions))
    blocks = block_tables[rows, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size
    # END SOLUTION


# %% [markdown]
# ### Check 2
# Notebook 04's question first: 37 tokens with blocks of 16 and table `[7, 2, 9]` decode their 38th, at position
# 37: logical block 2 (physical 9), offset 5, so slot `9 * 16 + 5 = 149`. Then the first and last slot of a block,
# another block size, and a big cache.

# %%
with exercise("decode_slots"):
    tables = np.array([[7, 2, 9], [4, 0, 0]], dtype=np.int32)
    got = decode_slots(tables, np.array([37, 3]), block_size=16)
    assert list(got) == [9 * 16 + 5, 4 * 16 + 3], f"positions 37 and 3 of tables {tables.tolist()}: got {list(got)}"
    for position, slot in [(0, 7 * 16), (15, 7 * 16 + 15), (16, 2 * 16), (31, 2 * 16 + 15), (32, 9 * 16)]:
        got = decode_slots(tables[:1], np.array([position]), block_size=16)
        assert list(got) == [slot], f"position {position} of table [7, 2, 9], blocks of 16: expected {slot}, got {got}"
    got = decode_slots(np.array([[3, 1], [2, 0]], dtype=np.int32), np.array([5, 2]), block_size=4)
    assert list(got) == [1 * 4 + 1, 2 * 4 + 2], f"blocks of 4, positions [5, 2] of [[3, 1], [2, 0]]: got {list(got)}"
    got = decode_slots(np.array([[0, 3_000_000]], dtype=np.int32), np.array([1100]), block_size=1024)
    assert got.dtype == np.int64 and list(got) == [3_072_000_000 + 76], (
        f"block 3,000,000 of 1,024 slots: expected [3072000076] as int64, got {got!r} (int32 overflows past 2**31)"
    )
print("decode_slots: correct")

# %% [markdown]
# ## Part 3 · The whole step
# Put it together into notebook 04's `StepInputs` (a dataclass of host arrays): `is_prefill=False`, and the five
# arrays of the table above, with their dtypes. The prefill-only fields, `cu_seqlens_q` and `cu_seqlens_k`, stay
# `None`. Reuse your two functions.


# %%
def my_prepare_decode(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Each sequence's newest token, which attends to its whole cache (itself included)."""
    # BEGIN SOLUTION
    context_lens = np.array([len(seq) for seq in seqs], dtype=np.int32)
    positions = context_lens.astype(np.int64) - 1
    block_tables = padded_block_tables(seqs)
    return StepInputs(
        is_prefill=False,
        input_ids=np.array([seq.last_token for seq in seqs], dtype=np.int64),
        positions=positions,
        slot_mapping=decode_slots(block_tables, positions, block_size),
        block_tables=block_tables,
        context_lens=context_lens,
    )
    # END SOLUTION


# %% [markdown]
# ### Check 3 · by hand, then the same arrays as `prepare_decode`
# The sequence of 37 tokens decodes its 38th: token 0 at position 37, slot 149, context 38. Then random batches:
# 1 to 8 sequences of 1 to 200 tokens, blocks of 1, 3, 16 and 32 tokens, block tables drawn from a shuffled
# cache, compared field by field, dtypes included, with notebook 04's `prepare_decode`.

# %%
FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens")


def compare_steps(ours: StepInputs, theirs: StepInputs, case: str) -> None:
    assert isinstance(ours, StepInputs), f"{case}: expected a StepInputs, got {type(ours)}"
    assert ours.is_prefill is False, f"{case}: is_prefill should be False, got {ours.is_prefill}"
    assert ours.cu_seqlens_q is None and ours.cu_seqlens_k is None, f"{case}: cu_seqlens_q/k are prefill-only"
    for name in FIELDS:
        got, expected = getattr(ours, name), getattr(theirs, name)
        assert isinstance(got, np.ndarray), f"{case}, {name}: expected a NumPy array, got {type(got)}"
        assert got.dtype == expected.dtype, f"{case}, {name}: dtype {got.dtype}, expected {expected.dtype}"
        assert got.shape == expected.shape, f"{case}, {name}: shape {got.shape}, expected {expected.shape}"
        assert (got == expected).all(), f"{case}, {name}:\nexpected {expected.tolist()}\ngot      {got.tolist()}"


with exercise("my_prepare_decode"):
    seq = sequence(37, [7, 2, 9])
    seq.append_token(0)
    step = my_prepare_decode([seq], block_size=16)
    hand = StepInputs(
        False,
        input_ids=np.array([0]),
        positions=np.array([37]),
        slot_mapping=np.array([9 * 16 + 5]),
        block_tables=np.array([[7, 2, 9]], dtype=np.int32),
        context_lens=np.array([38], dtype=np.int32),
    )
    compare_steps(step, hand, "37 tokens + 1, table [7, 2, 9]")

    rng = random.Random(1)
    for trial in range(200):
        block_size = rng.choice([1, 3, 16, 32])
        lens = [rng.randint(1, 200) for _ in range(rng.randint(1, 8))]
        free = list(range(sum(-(-n // block_size) for n in lens) + rng.randrange(50)))
        rng.shuffle(free)
        seqs = [sequence(n, [free.pop() for _ in range(-(-n // block_size))], block_size) for n in lens]
        case = f"trial {trial}: blocks of {block_size}, sequence lengths {lens}"
        compare_steps(my_prepare_decode(seqs, block_size), prepare_decode(seqs, block_size), case)
print("my_prepare_decode: the hand case and 200 random batches equal prepare_decode")

# %% [markdown]
# How long does it take? At 256 sequences of about 1,000 tokens (a busy server's decode batch), time yours and
# notebook 04's, and compare with the 2 to 8 ms of a whole decode step on an H200 (notebook 04). Printed, not
# asserted: timings vary from machine to machine.

# %%
big_batch = [
    sequence(n, random.sample(range(20_000), -(-n // 16))) for n in (random.randint(900, 1100) for _ in range(256))
]
for name, prepare in (("yours", my_prepare_decode), ("prepare_decode", prepare_decode)):
    start = time.perf_counter()
    for _ in range(20):
        prepare(big_batch, 16)
    print(f"{name:>14}: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms for 256 sequences")

# %% [markdown]
# ## Check 4 · decode the tiny model on your inputs
# Notebook 02's tiny checkpoint (random weights), a `ModelRunner` over a 64-block cache, and five prompts (1, 15,
# 16, 17 and 40 tokens) admitted by a `BlockManager` whose free blocks are shuffled, so the block tables jump
# around the cache. The runner's own `prepare_prefill` runs the prefill. Then every decode step runs twice:
#
# * on **your** `StepInputs`, through the runner (`runner.call("execute", inputs)`: device copies, the paged
#   context, the model, the logits of each row);
# * on notebook 04's, with `runner.step_logits(seqs, is_prefill=False)`.
#
# The two must agree, and both must equal `prompt_logits`: the model run from scratch over the whole sequence, no
# cache at all (the oracle of notebook 04); one forward over a finished sequence gives the logits of every step
# at once. Twelve steps carry every prompt but the first across a block boundary, where a wrong slot would store a
# key in the wrong block and the next steps would read garbage.

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner
from minivllm.models.loader import load_model
from minivllm.testing import prompt_logits

tmp_dir = tempfile.TemporaryDirectory(prefix="minivllm-decode-")  # deleted when the kernel exits
tiny_path = write_checkpoint(Path(tmp_dir.name) / "tiny", "tiny", seed=0)
runner = ModelRunner(Config(tiny_path, dtype=torch.float32, num_kvcache_blocks=64, max_num_seqs=8))
reference = load_model(tiny_path, dtype=torch.float32, device=runner.device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda message: f"{what}: {message}")


def admit(bm: BlockManager, seq: Sequence) -> None:
    """The scheduler's part (notebook 05) for a prompt prefilled in one step: blocks, cache the full ones."""
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens


with exercise("my_prepare_decode in the runner"):
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    random.Random(2).shuffle(bm.free_block_ids)  # block tables far from contiguous
    seqs = [Sequence(random.choices(range(2048), k=n), block_size=runner.block_size) for n in (1, 15, 16, 17, 40)]
    for seq in seqs:
        admit(bm, seq)
    logits = runner.step_logits(seqs, is_prefill=True)
    history: list[list[torch.Tensor]] = [[] for _ in seqs]  # each decode step's logits, per sequence
    for step in range(1, 13):
        for seq, row in zip(seqs, logits):  # the greedy token of the last step, then a block for it if it needs one
            seq.append_token(int(row.argmax()))
            bm.may_append(seq)
        logits = runner.call("execute", my_prepare_decode(seqs, runner.block_size)).float().cpu()
        theirs = runner.step_logits(seqs, is_prefill=False).float().cpu()
        for i, seq in enumerate(seqs):
            case = f"decode step {step}, sequence {i} ({len(seq)} tokens, block table {seq.block_table})"
            assert_close(logits[i], theirs[i], f"{case}: your inputs' logits vs prepare_decode's", tol=1e-5)
            history[i].append(logits[i])
    worst = 0.0
    for i, seq in enumerate(seqs):  # the oracle: one forward over the whole sequence gives every position's logits
        full = prompt_logits(reference, seq.token_ids).float().cpu()  # (len(seq), vocab)
        for step, row in enumerate(history[i], start=1):
            position = seq.num_prompt_tokens + step - 1  # the token this step fed in
            case = f"decode step {step}, sequence {i} (prompt of {seq.num_prompt_tokens}, token at position {position})"
            assert_close(row, full[position], f"{case}: your inputs' logits vs prompt_logits", tol=1e-4)
            worst = max(worst, (row - full[position]).abs().max().item())
    for seq in seqs:
        bm.deallocate(seq)
print(f"5 sequences, 12 decode steps on your inputs: the runner's logits; worst error vs prompt_logits {worst:.1e}")
runner.close()

# %% [markdown]
# ## What's next
# * `prepare_prefill` (notebook 04) is the same arithmetic over ranges: each sequence contributes the tokens after
#   its cached ones, packed end to end, with `cu_seqlens_q` (new tokens) and `cu_seqlens_k` (cached + new) to cut
#   the flat arrays back into sequences. Try writing it the same way, and check it against `prepare_prefill`.
# * With CUDA graphs (notebook 04) the decode step is replayed on fixed-size buffers: your arrays are copied into
#   the first rows, and the rows past the batch get `slot_mapping = -1` (padding: store nothing) and
#   `context_lens = 0` (attend to nothing). That is why `slot_mapping` carries a sentinel and the tables a width.
