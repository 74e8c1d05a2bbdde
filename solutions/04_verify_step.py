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
# # Exercise 04 · A speculative decoding verify step
#
# A decode step runs one new token per sequence through the model: a whole forward pass, all the
# weights read from memory, for one token. **Speculative decoding** makes that pass count for more:
# a cheap draft (a small model, or an n-gram lookup in the prompt) proposes the next `k` tokens, and
# the model checks them all in *one* forward pass, which costs about what a decode step costs while
# the batch is small. Each sequence feeds its newest token and its `k` drafts; the logits after each
# of those `k + 1` tokens say which drafts the model agrees with, and give one token more. With
# greedy decoding the result is exactly the tokens the model would have produced one at a time:
# only faster when the drafts are good.
#
# **Your task.** Two functions, each checked right after you write it, then together on the tiny
# model:
#
# 1. `verify_inputs`: the `StepInputs` of a verify step, several new tokens per sequence after its
#    cache, and the logits of every one of them;
# 2. `accept`: greedy acceptance, per sequence the number of leading drafts the model agrees with,
#    and the token it gives after them (the **bonus** token).
#
# Then six verify steps run on the tiny model through a `ModelRunner`: every row of logits must be a
# from-scratch forward's, and every token a sequence gains must be the one greedy decoding gives.
# Two questions at the end ask you to compute with what you wrote.
#
# **What it assumes.** Notebook 03's `Sequence` (its tokens, block table and `num_cached_tokens`)
# and notebook 04's step inputs (`StepInputs`, `prepare_prefill`) and model runner. No GPU: about
# 30 seconds on a CPU. About 40 minutes.

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
from minivllm.engine.step_inputs import StepInputs, prepare_prefill
from minivllm.testing import check_answer, exercise

random.seed(0)

# %% [markdown]
# ## Part 1 · The inputs of a verify step
# Between steps, a sequence holds its tokens so far, all of them in the KV cache but the newest: the
# token the last step sampled, whose KV no step has computed yet (`seq.num_cached_tokens` is
# `len(seq) - 1`). A verify step appends the sequence's `k` drafts (`seq.append_token`) and runs the
# newest token and the drafts, `1 + k` tokens, through the model at once, each attending to the
# cache and to the new tokens before it: exactly a prefill chunk after a cached prefix.
#
# Notebook 04's `prepare_prefill` lays such a step out (positions, slots, `cu_seqlens_q`,
# `cu_seqlens_k`, block tables) from what each sequence says: `num_cached_tokens`, the tokens in
# the cache, and `num_scheduled_tokens`, the tokens this step computes after them. What a prefill
# does not do is score every row: it keeps each sequence's last row, the only one whose next token
# it samples. A verify step needs the logits after **every** new token, which `StepInputs`'
# `logits_rows` names: the rows of the step, in order, whose logits the runner returns.
#
# Write `verify_inputs`: append `drafts[i]` (possibly empty) to `seqs[i]` and return the step's
# inputs. Each block table already has room for the drafts.


# %%
def verify_inputs(seqs: list[Sequence], drafts: list[list[int]], block_size: int) -> StepInputs:
    """Append each sequence's drafts; the inputs that compute its newest token and the drafts, and
    the logits after every one of them."""
    # BEGIN SOLUTION
    for seq, tokens in zip(seqs, drafts):
        for token in tokens:
            seq.append_token(token)
        seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens  # the newest token + drafts
    step = prepare_prefill(seqs, block_size)
    step.logits_rows = np.arange(step.input_ids.shape[0], dtype=np.int64)
    return step
    # END SOLUTION


# %% [markdown]
# ### Check 1 · by hand
# A sequence of 38 tokens (37 in the cache) with block table `[7, 2, 9]` and two drafts: its newest
# token (position 37) and the drafts 5 and 6 go to positions 37 to 39, slots `9 · 16 + 5` to
# `9 · 16 + 7`. Beside it, one of 5 tokens with table `[4]` and no draft: a plain decode row. The
# fields a verify step depends on, dtypes included.


# %%
def sequence(num_tokens: int, block_table: list[int], block_size: int = 16) -> Sequence:
    """A sequence of num_tokens random tokens between two steps: all but its newest in the cache,
    in these blocks."""
    seq = Sequence([random.randrange(2048) for _ in range(num_tokens)], block_size=block_size)
    seq.block_table, seq.num_cached_tokens = list(block_table), num_tokens - 1
    return seq


FIELDS = {
    "input_ids": np.int64,
    "positions": np.int64,
    "slot_mapping": np.int64,
    "cu_seqlens_q": np.int32,
    "cu_seqlens_k": np.int32,
    "logits_rows": np.int64,
}


def compare_step(step: StepInputs, expected: dict, case: str) -> None:
    assert isinstance(step, StepInputs), f"{case}: expected a StepInputs, got {type(step)}"
    assert step.is_prefill, f"{case}: is_prefill should be True (the new tokens attend causally)"
    for name, dtype in FIELDS.items():
        got = getattr(step, name)
        default = " (a prefill's default: each sequence's last row)" if got is None else ""
        assert isinstance(got, np.ndarray), (
            f"{case}, {name}: expected an array, got {got!r}{default}"
        )
        assert got.dtype == dtype, f"{case}, {name}: dtype {got.dtype}, expected {dtype.__name__}"
        assert got.tolist() == expected[name], (
            f"{case}, {name}:\nexpected {expected[name]}\ngot      {got.tolist()}"
        )


with exercise("verify_inputs"):
    long, short = sequence(38, [7, 2, 9]), sequence(5, [4])
    newest = long.last_token
    step = verify_inputs([long, short], [[5, 6], []], block_size=16)
    lengths = len(long), len(short)
    assert lengths == (40, 5) and long.token_ids[-2:] == [5, 6], (
        f"the sequences hold {lengths} tokens, expected (40, 5): 38 + 2 drafts, 5 + none"
    )
    expected = dict(
        input_ids=[newest, 5, 6, short.last_token],
        positions=[37, 38, 39, 4],
        slot_mapping=[149, 150, 151, 68],  # block * 16 + offset: 9 * 16 + 5, ..., 4 * 16 + 4
        cu_seqlens_q=[0, 3, 4],  # 3 new tokens, then 1
        cu_seqlens_k=[0, 40, 45],  # what each new token may see: cached + new
        logits_rows=[0, 1, 2, 3],  # every row
    )
    compare_step(step, expected, "38 tokens + 2 drafts, table [7, 2, 9]; 5 tokens, table [4]")
print("verify_inputs: the hand case")

# %% [markdown]
# ## Part 2 · Greedy acceptance
# The step's logits come back one row per new token, a sequence's `1 + k` rows together and the
# sequences in batch order. Row `j` of a sequence is the model's prediction **after** its new token
# `j`: row 0, after the newest token, predicts what should follow it, which is what draft 0 guessed;
# row `j` judges draft `j`. Greedy decoding takes the argmax, so:
#
# * draft `j` is accepted if it equals the argmax of row `j` and every draft before it was
#   accepted: after a rejected draft, the tokens after it were guessed on a wrong prefix;
# * the bonus token is the argmax of the row after the last accepted draft: the model's own token
#   where the first draft went wrong, or, if every draft was right, the token after the last one.
#
# So a sequence gains `accepted + 1` tokens: `drafts[:accepted]`, then the bonus. Write `accept`:
# per sequence, `accepted` and `bonus`.


# %%
def accept(logits: torch.Tensor, drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """logits: (sum of 1 + len(d) for d in drafts, vocab_size), a verify step's rows. Per sequence,
    the number of leading drafts equal to the model's argmax, and the bonus token."""
    # BEGIN SOLUTION
    choices = logits.argmax(dim=-1).tolist()  # the model's token after each new token
    accepted, bonus, row = [], [], 0
    for tokens in drafts:
        keep = 0
        while keep < len(tokens) and tokens[keep] == choices[row + keep]:
            keep += 1
        accepted.append(keep)
        bonus.append(choices[row + keep])
        row += 1 + len(tokens)
    return accepted, bonus
    # END SOLUTION


# %% [markdown]
# ### Check 2 · by hand
# Rows whose argmax is set; five sequences: two drafts accepted of three; all accepted; none; a
# draft that matches after an earlier one did not; no draft at all.


# %%
def rows_with_argmax(tokens: list[int], vocab_size: int = 16) -> torch.Tensor:
    """(len(tokens), vocab_size) logits whose argmax in row i is tokens[i]."""
    logits = torch.randn(len(tokens), vocab_size).clamp(-1, 1)
    logits[torch.arange(len(tokens)), tokens] = 2.0
    return logits


with exercise("accept"):
    cases = [  # (drafts, the argmax of its rows, expected accepted, expected bonus)
        ([5, 7, 9], [5, 7, 2, 4], 2, 2),
        ([5, 7], [5, 7, 3], 2, 3),
        ([1], [4, 1], 0, 4),
        ([5, 8, 9], [5, 7, 9, 4], 1, 7),
        ([], [8], 0, 8),
    ]
    batch = [drafts for drafts, *_ in cases]
    got = accept(torch.cat([rows_with_argmax(choices) for _, choices, *_ in cases]), batch)
    assert isinstance(got, tuple) and len(got) == 2, f"expected (accepted, bonus), got {got!r}"
    for i, (drafts, choices, accepted, bonus) in enumerate(cases):
        case = f"sequence {i}: drafts {drafts}, the argmax of its {len(choices)} rows {choices}"
        assert (got[0][i], got[1][i]) == (accepted, bonus), (
            f"{case}: expected {accepted} accepted and bonus {bonus}, got {got[0][i]} and "
            f"{got[1][i]}"
        )
print("accept: the hand cases")

# %% [markdown]
# ## Check 3 · speculative decoding on the tiny model
# Notebook 02's tiny checkpoint (random weights), a `ModelRunner` over a 64-block cache, and four
# prompts (1, 15, 16 and 40 tokens), each with a block table of shuffled blocks, enough for
# everything it will write. The runner's own prefill runs the prompts. Then, six times:
#
# * each sequence proposes 0 to 3 drafts. A draft is the tiny model's own greedy choice (its
#   from-scratch forward, so it should be accepted) or, one time in three, a random token;
# * your `verify_inputs` go through the runner (`runner.execute`: device copies, the paged context,
#   the model, the logits of `logits_rows`). Every row must equal `prompt_logits` at its position:
#   the model run from scratch over the sequence, no cache at all (notebook 04's oracle);
# * your `accept` on those logits must give the verdict that the from-scratch logits give; the
#   sequence keeps its accepted drafts and the bonus. The rejected drafts' KV,
#   written by this step, is overwritten by the next one, which starts at the bonus token.
#
# The steps carry the sequences across block boundaries, where a wrong slot would store a key in the
# wrong block. At the end, each sequence's tokens must be those of greedy decoding, one token at a
# time from scratch: each accepted draft is the argmax after the tokens before it, and so is the
# bonus.

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


def greedy_next(token_ids: list[int]) -> int:
    return int(prompt_logits(reference, token_ids)[-1].argmax())


def check_rows(logits: torch.Tensor, seq: Sequence, n: int, case: str) -> list[int]:
    """Compare a sequence's n rows with the from-scratch forward at its last n positions; return
    the from-scratch argmax of each."""
    full = prompt_logits(reference, seq.token_ids).float().cpu()  # (len(seq), vocab_size)
    for j in range(n):
        position = len(seq) - n + j
        what = f"{case}: the logits after position {position} vs prompt_logits"
        torch.testing.assert_close(
            logits[j], full[position], rtol=1e-4, atol=1e-4, msg=lambda m, what=what: f"{what}: {m}"
        )
    return full[len(seq) - n :].argmax(dim=-1).tolist()


with exercise("verify_inputs and accept on the tiny model"):
    rng = random.Random(2)
    free = list(range(runner.num_kvcache_blocks))
    rng.shuffle(free)  # block tables far from contiguous
    committed = [rng.choices(range(2048), k=n) for n in (1, 15, 16, 40)]
    prompts = [Sequence(tokens, block_size=runner.block_size) for tokens in committed]
    tables = [[free.pop() for _ in range(6)] for _ in prompts]  # room for 96 tokens each
    for seq, table in zip(prompts, tables):
        seq.block_table, seq.num_scheduled_tokens = table, len(seq)
    for tokens, row in zip(committed, runner.step_logits(prompts, is_prefill=True)):
        tokens.append(int(row.argmax()))  # its newest token: not in the cache yet
    gained = proposed = 0
    for step in range(1, 7):
        drafts = []
        for tokens in committed:
            guesses: list[int] = []
            for _ in range(rng.randint(0, 3)):
                right = greedy_next(tokens + guesses)
                guesses.append(right if rng.random() > 1 / 3 else rng.randrange(2048))
            drafts.append(guesses)
        seqs = [Sequence(tokens, block_size=runner.block_size) for tokens in committed]
        for seq, table in zip(seqs, tables):
            seq.block_table, seq.num_cached_tokens = table, len(seq) - 1
        logits = runner.execute(verify_inputs(seqs, drafts, runner.block_size)).float().cpu()
        assert logits.shape[0] == sum(1 + len(d) for d in drafts), (
            f"step {step}: {logits.shape[0]} rows of logits for "
            f"{sum(1 + len(d) for d in drafts)} new tokens: `logits_rows` names them all"
        )
        ours, row = accept(logits, drafts), 0
        for i, (seq, guesses) in enumerate(zip(seqs, drafts)):
            n = 1 + len(guesses)
            case = f"step {step}, sequence {i} ({len(seq)} tokens, {n} new)"
            choices = check_rows(logits[row : row + n], seq, n, case)  # from scratch
            row += n
            agree = [guess == choice for guess, choice in zip(guesses, choices)] + [False]
            keep = agree.index(False)  # the leading drafts the from-scratch argmax agrees with
            got, want = (ours[0][i], ours[1][i]), (keep, choices[keep])
            assert got == want, (
                f"step {step}, sequence {i}, drafts {guesses}: from scratch the model accepts "
                f"{want[0]} and gives bonus {want[1]}; your accept on the step's logits: {got}"
            )
            committed[i] += guesses[: got[0]] + [got[1]]
            gained, proposed = gained + got[0] + 1, proposed + len(guesses)
    for i, tokens in enumerate(committed):
        start = len(prompts[i])  # its first generated token
        greedy = tokens[: start + 1]
        while len(greedy) < len(tokens):
            greedy.append(greedy_next(greedy))
        assert tokens == greedy, (
            f"sequence {i}: speculative decoding gave {tokens[start:]}, greedy decoding "
            f"{greedy[start:]}"
        )
print(
    f"6 verify steps: every row equals prompt_logits, every token greedy decoding's; {gained} "
    f"tokens from {6 * len(committed)} sequence-steps, {proposed} drafts proposed"
)
runner.close()

# %% [markdown]
# ## Check yourself
# Set each `answerN` (by hand, or computed) and run its cell: it compares your answer with what
# your functions give. The worked answer follows.
#
# **1.** Say a draft model's tokens are each accepted with probability 0.8, whatever came before
# (as long as the drafts before were accepted). With `k = 4` drafts per step, how many tokens does a
# sequence gain per verify step, on average? Answer to two decimals.

# %%
answer1 = None  # your answer: replace None with an expression


def expected_gain(p: float, k: int) -> float:
    """The mean of accepted + 1 over every outcome: the first rejection at draft m, or none."""
    total = 0.0
    for m in range(k + 1):
        prob = p**m * (1 - p) if m < k else p**k
        choices = [1] * m + [2] + [3] * (k - m)  # rows 0..m-1 agree with drafts of 1s
        accepted, _ = accept(rows_with_argmax(choices), [[1] * k])
        total += prob * (accepted[0] + 1)
    return round(total, 2)


gain = expected_gain(0.8, 4)
check_answer(answer1, gain, "1. tokens per verify step, p = 0.8, k = 4")

# %% [markdown]
# Worked answer: the sequence gains `m + 1` tokens when the first rejection is at draft `m`
# (probability `0.8^m · 0.2`), and 5 when all four are accepted (`0.8^4`). The sum is `1 + 0.8 +
# 0.8² + 0.8³ + 0.8⁴ = (1 - 0.8⁵) / (1 - 0.8)`, about 3.36: one verify step does the work of 3.36
# decode steps, for about the cost of one while decoding is memory-bound (notebook 04).

# %%
check_answer(round((1 - 0.8**5) / (1 - 0.8), 2), gain, "1. tokens per verify step")

# %% [markdown]
# **2.** The sequence of Check 1 (38 tokens, 37 cached, table `[7, 2, 9]`) verifies three drafts
# this time, and the model accepts one. Of the positions whose KV this step wrote, which ones now
# hold the KV of a token the sequence no longer has? Answer a list of positions.

# %%
answer2 = None  # your answer: replace None with an expression
seq = sequence(38, [7, 2, 9])
step = verify_inputs([seq], [[5, 6, 7]], block_size=16)
accepted, bonus = accept(rows_with_argmax([5, 3, 6, 7]), [[5, 6, 7]])  # the first draft only
kept = seq.token_ids[: 38 + accepted[0]] + [bonus[0]]  # the sequence after the step
# the KV of kept[:-1] is right; from the bonus's position on, it is the drafts'
stale = [p for p in step.positions.tolist() if p >= len(kept) - 1]
check_answer(answer2, stale, "2. positions of stale KV")

# %% [markdown]
# Worked answer: the step wrote positions 37 to 40 (the newest token and three drafts). The newest
# token (37) and the accepted draft (38) stay; the bonus token takes position 39, where the rejected
# second draft's KV is, and position 40 holds the third draft's: `[39, 40]`. Nothing needs erasing:
# the next step writes the bonus token's KV at 39 before any query reads it, and no query reads
# position 40 until the sequence is 41 tokens long, by when a later step has written it.

# %%
check_answer([39, 40], stale, "2. positions of stale KV")

# %% [markdown]
# ## What's next
# * The draft: a small model of the same tokenizer (its own KV cache, `k` decode steps per verify
#   step), or no model at all: n-gram lookup finds the last few tokens earlier in the prompt and
#   proposes what followed them, which pays off on code editing and summaries, where the output
#   copies the input.
# * Sampling, not greedy: a draft token `x` drawn from the draft's `q` is accepted with probability
#   `min(1, p(x) / q(x))`, and a rejected one is resampled from `max(0, p - q)` renormalised: the
#   tokens then follow the model's `p` exactly, as if there were no draft.
# * In an engine, the block manager must find room for `k` more tokens per sequence before the step
#   (notebook 03's `may_append`, `k` times), and give back blocks that only rejected drafts filled.
