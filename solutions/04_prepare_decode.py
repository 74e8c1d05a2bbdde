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
# # Exercise 04 · The inputs of a speculative decoding step
#
# A decode step runs one new token per sequence through the model: a whole forward pass, all the
# weights read from memory, for one token. **Speculative decoding** makes that pass count for more:
# a cheap draft (a small model, or an n-gram lookup in the prompt) proposes the next `k` tokens, and
# the model checks them all in *one* forward pass, which costs about what a decode step costs while
# the batch is small. Each sequence feeds its newest token and its `k` drafts; the logits at each of
# those `k + 1` positions say which drafts the model agrees with, and give one more token at the
# first disagreement. Every draft accepted is a step saved.
#
# Notebook 04's `prepare_decode` builds the inputs of one new token per sequence. Here you build
# those of a verify step, with NumPy over whole arrays: several new tokens per sequence, after its
# cache, and the logits of every one of them. Then the tiny model runs your arrays through a
# `ModelRunner`, and a greedy speculative decoding loop must give, at every position, the logits of
# a from-scratch forward.
#
# **Your task.** Three functions, each checked right after you write it:
#
# 1. `padded_block_tables`: the batch's block tables as one rectangular array;
# 2. `token_slots`: the cache slot of any token of any sequence: the address arithmetic of paging;
# 3. `my_prepare_verify`: the whole `StepInputs` of a verify step.
#
# **What it assumes.** Notebook 03's `Sequence` (block tables, slots) and notebook 04's `StepInputs`
# and "The model runner" (how a step with cached tokens is laid out: `cu_seqlens_q`, `cu_seqlens_k`,
# `logits_rows`). No GPU: about 20 seconds on a CPU. About 30 minutes.

# %%
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import StepInputs
from minivllm.testing import exercise

random.seed(0)

# %% [markdown]
# ## What a verify step needs
#
# Take a sequence of `n` tokens whose last `new` tokens have never been through the model: its
# newest sampled token and its `new - 1` drafts, appended with `seq.append_token`. The KV of the
# first `n - new` tokens is in the cache; this step computes the others', and the logits at each of
# them. So, for token `t` of the sequence, `n - new ≤ t < n`, one row of each array, the rows of a
# sequence together and the sequences in batch order:
#
# | array | value | dtype |
# |---|---|---|
# | `input_ids` | the token, `seq.token_ids[t]` | int64 |
# | `positions` | its position, `t` (positions count from 0; RoPE needs it) | int64 |
# | `slot_mapping` | where its K and V go in the cache (below) | int64 |
#
# and per sequence, as in a prefill with cached tokens (notebook 04): `cu_seqlens_q`, the cumulative
# new tokens (`[0, new_0, new_0 + new_1, ...]`, int32); `cu_seqlens_k`, the cumulative cached + new
# tokens, `n` per sequence (int32); `block_tables`, one `(num_seqs, max_blocks)` int32 array;
# `is_prefill=True` (the kernel's causal mask makes each draft see the tokens before it, not after).
# And `logits_rows`: the rows whose logits the step returns. A prefill returns each sequence's last
# row; a verify step needs **every** row (int64).
#
# **Slots.** The cache is `num_blocks` blocks of `block_size` slots. Token `t` of a sequence lives
# in its logical block `t // block_size`, which the block table maps to a physical block, at offset
# `t % block_size`:
#
# ```
# slot = block_table[t // block_size] * block_size + t % block_size
# ```
#
# **Padding.** Sequences hold different numbers of blocks, but the kernel wants one rectangle, so
# short tables are padded with zeros. Zero is a real block id (some other sequence's block), which
# is safe only because the kernel reads no further than `cu_seqlens_k` says: the padding is never
# dereferenced.
#
# **Whole arrays.** A decode step on a GPU takes a few milliseconds (notebook 04). A Python loop
# over every token of 256 sequences costs a good fraction of that, every step. So compute over
# arrays: one loop to copy the tables (Python lists) into the rectangle and one to gather the token
# ids are fine, but positions, slots and the cumulative lengths are each a few NumPy expressions
# over the batch. Two tools: `np.repeat(values, counts)` repeats each sequence's value once per new
# token (which sequence is row `r`?), and fancy indexing, `tables[rows, cols]` with `rows`, `cols`
# integer arrays, picks `tables[rows[i], cols[i]]` for each `i`.

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
    """A sequence of num_tokens tokens that holds these blocks (as BlockManager would have given
    it)."""
    seq = Sequence([random.randrange(2048) for _ in range(num_tokens)], block_size=block_size)
    assert seq.num_blocks == len(block_table), (
        f"{num_tokens} tokens need {seq.num_blocks} blocks of {block_size}"
    )
    seq.block_table = list(block_table)
    return seq


with exercise("padded_block_tables"):
    seqs = [sequence(38, [7, 2, 9]), sequence(5, [4]), sequence(20, [11, 3])]
    got = padded_block_tables(seqs)
    expected = np.array([[7, 2, 9], [4, 0, 0], [11, 3, 0]], dtype=np.int32)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32, (
        f"expected an int32 array, got {type(got)} {got!r}"
    )
    assert got.shape == expected.shape and (got == expected).all(), (
        f"expected\n{expected}\ngot\n{got}"
    )
    alone = padded_block_tables([sequence(40, [5, 6, 1])])
    assert alone.tolist() == [[5, 6, 1]], (
        f"one sequence of 3 blocks: expected [[5, 6, 1]], got {alone.tolist()}"
    )
print("padded_block_tables: correct")

# %% [markdown]
# ## Part 2 · Slots
# `token_slots` takes the padded tables and, per token, its sequence (a row of the tables) and its
# position, and returns each token's slot, with no Python loop. (Careful with dtypes: the tables are
# int32 and a slot may pass 2³¹ in a big cache; compute in int64.)


# %%
def token_slots(
    block_tables: np.ndarray, seq_of: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """(num_tokens,) int64: the cache slot of token positions[i] of the sequence whose table is
    block_tables[seq_of[i]]."""
    # BEGIN SOLUTION
    blocks = block_tables[seq_of, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size
    # END SOLUTION


# %% [markdown]
# ### Check 2
# Notebook 04's question first: 37 tokens with blocks of 16 and table `[7, 2, 9]` write their 38th,
# at position 37: logical block 2 (physical 9), offset 5, so slot `9 * 16 + 5 = 149`. Then three
# tokens of one sequence across a block boundary, the first and last slot of a block, another block
# size, and a big cache.

# %%
with exercise("token_slots"):
    tables = np.array([[7, 2, 9], [4, 0, 0]], dtype=np.int32)
    got = token_slots(tables, np.array([0, 1]), np.array([37, 3]), block_size=16)
    assert list(got) == [9 * 16 + 5, 4 * 16 + 3], (
        f"positions 37 and 3 of tables {tables.tolist()}: got {list(got)}"
    )
    rows, positions = np.array([0, 0, 0, 1]), np.array([30, 31, 32, 3])
    got = token_slots(tables, rows, positions, block_size=16)
    expected = [2 * 16 + 14, 2 * 16 + 15, 9 * 16, 4 * 16 + 3]
    assert list(got) == expected, (
        f"positions 30, 31, 32 of [7, 2, 9], then 3 of [4]: expected {expected}, got {list(got)}"
    )
    for position, slot in [
        (0, 7 * 16),
        (15, 7 * 16 + 15),
        (16, 2 * 16),
        (31, 2 * 16 + 15),
        (32, 9 * 16),
    ]:
        got = token_slots(tables, np.array([0]), np.array([position]), block_size=16)
        assert list(got) == [slot], (
            f"position {position} of table [7, 2, 9], blocks of 16: expected {slot}, got {got}"
        )
    small_tables = np.array([[3, 1], [2, 0]], dtype=np.int32)
    got = token_slots(small_tables, np.array([0, 1]), np.array([5, 2]), block_size=4)
    assert list(got) == [1 * 4 + 1, 2 * 4 + 2], (
        f"blocks of 4, positions [5, 2] of [[3, 1], [2, 0]]: got {list(got)}"
    )
    got = token_slots(
        np.array([[0, 3_000_000]], dtype=np.int32), np.array([0]), np.array([1100]), block_size=1024
    )
    assert got.dtype == np.int64 and list(got) == [3_072_000_000 + 76], (
        f"block 3,000,000 of 1,024 slots: expected [3072000076] as int64, got {got!r} (int32 "
        f"overflows past 2**31)"
    )
print("token_slots: correct")

# %% [markdown]
# ## Part 3 · The whole step
# Put it together into notebook 04's `StepInputs` (a dataclass of host arrays): `num_new[i]` is the
# number of new tokens of `seqs[i]` (its last ones), at least 1. Leave the other fields at their
# defaults. Reuse your two functions.


# %%
def my_prepare_verify(seqs: list[Sequence], num_new: list[int], block_size: int) -> StepInputs:
    """Each sequence's last num_new[i] tokens, after its cached ones; the logits of every one of
    them."""
    # BEGIN SOLUTION
    news = np.array(num_new, dtype=np.int64)
    ends = np.array([len(seq) for seq in seqs], dtype=np.int64)
    cu_q = np.cumsum([0, *news], dtype=np.int32)
    seq_of = np.repeat(np.arange(len(seqs)), news)  # (num_tokens,): each new token's sequence
    positions = np.arange(cu_q[-1]) - cu_q[seq_of] + (ends - news)[seq_of]
    block_tables = padded_block_tables(seqs)
    tokens = [t for seq, n in zip(seqs, num_new) for t in seq.token_ids[len(seq) - n :]]
    return StepInputs(
        is_prefill=True,
        input_ids=np.array(tokens, dtype=np.int64),
        positions=positions,
        slot_mapping=token_slots(block_tables, seq_of, positions, block_size),
        block_tables=block_tables,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=np.cumsum([0, *ends], dtype=np.int32),
        logits_rows=np.arange(cu_q[-1], dtype=np.int64),
    )
    # END SOLUTION


# %% [markdown]
# ### Check 3 · by hand
# The sequence of 37 tokens appends its newest token and two drafts (tokens 0, 5 and 6): positions
# 37 to 39, slots 149 to 151; a second sequence of 5 tokens decodes one (`num_new` 1). Every field,
# dtypes included.

# %%
FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "logits_rows",
)


def compare_steps(ours: StepInputs, theirs: StepInputs, case: str) -> None:
    assert isinstance(ours, StepInputs), f"{case}: expected a StepInputs, got {type(ours)}"
    assert ours.is_prefill is True, (
        f"{case}: is_prefill should be True (causal attention over the new tokens)"
    )
    for name in FIELDS:
        got, expected = getattr(ours, name), getattr(theirs, name)
        assert isinstance(got, np.ndarray), (
            f"{case}, {name}: expected a NumPy array, got {type(got)}"
        )
        assert got.dtype == expected.dtype, (
            f"{case}, {name}: dtype {got.dtype}, expected {expected.dtype}"
        )
        assert got.shape == expected.shape, (
            f"{case}, {name}: shape {got.shape}, expected {expected.shape}"
        )
        assert (got == expected).all(), (
            f"{case}, {name}:\nexpected {expected.tolist()}\ngot      {got.tolist()}"
        )


with exercise("my_prepare_verify"):
    seq, short = sequence(37, [7, 2, 9]), sequence(4, [4])
    for token in (0, 5, 6):
        seq.append_token(token)
    short.append_token(8)
    step = my_prepare_verify([seq, short], [3, 1], block_size=16)
    seq_slots = [9 * 16 + 5, 9 * 16 + 6, 9 * 16 + 7]  # positions 37-39: block 9, offsets 5-7
    hand = StepInputs(
        True,
        input_ids=np.array([0, 5, 6, 8]),
        positions=np.array([37, 38, 39, 4]),
        slot_mapping=np.array([*seq_slots, 4 * 16 + 4]),
        block_tables=np.array([[7, 2, 9], [4, 0, 0]], dtype=np.int32),
        cu_seqlens_q=np.array([0, 3, 4], dtype=np.int32),
        cu_seqlens_k=np.array([0, 40, 45], dtype=np.int32),
        logits_rows=np.arange(4),
    )
    compare_steps(step, hand, "37 tokens + 3 new, table [7, 2, 9]; 4 tokens + 1 new, table [4]")
print("my_prepare_verify: the hand case")

# %% [markdown]
# ## Check 4 · greedy speculative decoding on the tiny model
# Notebook 02's tiny checkpoint (random weights), a `ModelRunner` over a 64-block cache, and four
# prompts (1, 15, 16 and 40 tokens), each with a block table of shuffled blocks, enough for
# everything it will write. The runner's own `prepare_prefill` runs the prefill. Then every step:
#
# * each sequence appends 0 to 3 drafts after its newest token. A draft is the tiny model's own
#   greedy choice (its from-scratch forward, so it will be accepted) or, one time in three, a random
#   token (rejected);
# * your `StepInputs` go through the runner (`runner.call("execute", inputs)`: device copies, the
#   paged context, the model, the logits of `logits_rows`). Every row must equal `prompt_logits` at
#   its position: the model run from scratch over the sequence, no cache at all (the oracle of
#   notebook 04);
# * greedy acceptance: draft `j` stays if it is the argmax of the row before it; the first one that
#   is not is replaced by that argmax (the bonus token), and the drafts after it are dropped. Their
#   KV, written by this step, is overwritten by the next one, which starts from the first position
#   whose KV is not right.
#
# Six steps carry the sequences across block boundaries, where a wrong slot would store a key in the
# wrong block.

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
from minivllm.models.loader import load_model
from minivllm.testing import prompt_logits

tmp_dir = tempfile.TemporaryDirectory(prefix="minivllm-verify-")  # deleted when the kernel exits
tiny_path = write_checkpoint(Path(tmp_dir.name) / "tiny", "tiny", seed=0)
runner = ModelRunner(Config(tiny_path, dtype=torch.float32, num_kvcache_blocks=64, max_num_seqs=8))
reference = load_model(tiny_path, dtype=torch.float32, device=runner.device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=tol, atol=tol, msg=lambda message: f"{what}: {message}"
    )


def greedy_next(token_ids: list[int]) -> int:
    return int(prompt_logits(reference, token_ids)[-1].argmax())


with exercise("my_prepare_verify in the runner"):
    rng = random.Random(2)
    free = list(range(runner.num_kvcache_blocks))
    rng.shuffle(free)  # block tables far from contiguous
    committed = [rng.choices(range(2048), k=n) for n in (1, 15, 16, 40)]
    seqs = [Sequence(tokens, block_size=runner.block_size) for tokens in committed]
    for seq in seqs:
        seq.block_table = [free.pop() for _ in range(6)]  # room for 96 tokens
        seq.num_scheduled_tokens = len(seq)
    for tokens, row in zip(committed, runner.step_logits(seqs, is_prefill=True)):
        tokens.append(int(row.argmax()))  # its newest token: not in the cache yet
    tables = [seq.block_table for seq in seqs]
    accepted = proposed = 0
    for step in range(1, 7):
        batch, num_new, drafts_of = [], [], []
        for tokens, table in zip(committed, tables):
            drafts: list[int] = []
            for _ in range(rng.randint(0, 3)):
                guess = greedy_next(tokens + drafts)
                drafts.append(guess if rng.random() > 1 / 3 else rng.randrange(2048))
            seq = Sequence(tokens + drafts, block_size=runner.block_size)
            seq.block_table = table
            batch.append(seq)
            num_new.append(1 + len(drafts))
            drafts_of.append(drafts)
        logits = (
            runner.call("execute", my_prepare_verify(batch, num_new, runner.block_size))
            .float()
            .cpu()
        )
        assert logits.shape[0] == sum(num_new), (
            f"step {step}: {logits.shape[0]} rows of logits for {sum(num_new)} new tokens: "
            f"`logits_rows` names them all"
        )
        row = 0
        for i, (seq, n, drafts) in enumerate(zip(batch, num_new, drafts_of)):
            # (len(seq), vocab): every position
            full = prompt_logits(reference, seq.token_ids).float().cpu()
            for j in range(n):
                position = len(seq) - n + j
                case = (
                    f"step {step}, sequence {i} ({len(seq)} tokens, {n} new), the logits at "
                    f"position {position}"
                )
                assert_close(
                    logits[row + j],
                    full[position],
                    f"{case}: your inputs vs prompt_logits",
                    tol=1e-4,
                )
            # the model's token after each new token
            choices = logits[row : row + n].argmax(-1).tolist()
            keep = 0
            while keep < len(drafts) and drafts[keep] == choices[keep]:
                keep += 1
            # the accepted drafts, then the bonus token
            committed[i] += drafts[:keep] + [choices[keep]]
            accepted, proposed, row = accepted + keep, proposed + len(drafts), row + n
print(
    f"6 verify steps on your inputs: every row equals prompt_logits; {accepted} of {proposed} "
    f"drafts accepted"
)
print(
    f"tokens per sequence per step: {(accepted + 6 * len(committed)) / (6 * len(committed)):.2f} "
    f"(decode: 1)"
)
runner.close()

# %% [markdown]
# ## What's next
# * Your arrays are `prepare_prefill`'s (notebook 04) with `num_cached_tokens = len(seq) - new` and
#   every row scored: a verify step is a prefill whose chunks are short. What does notebook 04's
#   mixed step (decode rows through the decode kernel) do with a sequence of one new token here, and
#   why does it not apply to one of three?
# * The draft: a small model of the same tokenizer (its own KV cache, `k` decode steps per verify
#   step), or no model at all: n-gram lookup finds the last few tokens earlier in the prompt and
#   proposes what followed them, which pays off on code editing and summaries, where the output
#   copies the input.
# * Sampling, not greedy: a draft token `x` drawn from the draft's `q` is accepted with probability
#   `min(1, p(x) / q(x))`, and a rejected one is resampled from `max(0, p - q)` renormalised: the
#   tokens then follow the model's `p` exactly, as if there were no draft.
