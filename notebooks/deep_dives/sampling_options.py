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
# # Deep dive · Sampling options: penalties, min_tokens and log-probabilities
#
# **What this adds.** vLLM's `SamplingParams` (notebook 02) ask for more than notebook 04's sampler
# draws: **penalties** that make a token less likely once it was said, **`min_tokens`** (no stop
# token before then), and **log-probabilities**, of each sampled token and of every prompt token.
#
# **It follows notebook 04**; nothing in the core path needs it: notebook 06's engine refuses these
# options, and `minivllm.LLM` takes them through the runner below. It exports
# `minivllm.layers.sampling_options` (penalties, bans, log-probabilities on logits) and
# `minivllm.engine.sampling_options`: `OptionsRunner`, a subclass of notebook 04's `ModelRunner`
# that the GPU, tensor-parallel and async runners of the later deep dives build on.
#
# **What you will see.** Each option on notebook 04's cat example, then the runner's
# log-probabilities equal to a from-scratch forward's on the tiny model, a prompt scored across
# chunks.

# %%
import os
import random
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

from minivllm.checkpoint import write_checkpoint

disable_progress_bar()  # transformers' saving draws no progress bars in the outputs
torch.manual_seed(0)
random.seed(0)
words = "mat floor sofa bed chair roof table rug fence keyboard moon piano".split()
cat_logits = torch.tensor([4.0, 3.1, 2.6, 2.2, 1.9, 1.4, 1.2, 1.0, 0.6, 0.1, -0.5, -1.5])
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
path = CHECKPOINTS / "tiny"
if not (path / "model.safetensors").is_file():
    write_checkpoint(path, "tiny", seed=0)

# %% [markdown]
# ## Penalties and min_tokens: the logits, edited before the draw
# vLLM's three penalties look at what a request has seen. `repetition_penalty` (1: off) divides the
# positive logit of every token in the prompt or the reply, and multiplies a negative one, so both
# move towards less likely. `frequency_penalty` subtracts itself once per use in the reply,
# `presence_penalty` once if used at all (0: off). They count tokens, so they need each row's token
# ids: a `(batch, vocab)` count by one `scatter_add_`, padding sent past the vocabulary. Until a
# request has `min_tokens`, its stop tokens get `-inf`. Both return new logits: the raw ones stay
# for the log-probabilities, which vLLM reports before any edit.

# %% tags=["export"] module="minivllm.layers.sampling_options"
import torch

from minivllm.layers.sampler import TokenLogprobs


def apply_penalties(
    logits: torch.Tensor, presence, frequency, repetition, prompt_ids, output_ids
) -> torch.Tensor:
    """vLLM's penalties on (batch, vocab) float32 logits: each (batch,), token ids (batch, length),
    -1 padded."""
    vocab = logits.shape[-1]

    def counts(ids: torch.Tensor) -> torch.Tensor:  # (batch, vocab): occurrences of each token
        ids = ids.masked_fill(ids < 0, vocab)  # padding lands past the vocabulary
        zeros = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
        return zeros.scatter_add_(1, ids, torch.ones_like(ids, dtype=zeros.dtype))[:, :vocab]

    in_output, r = counts(output_ids), repetition[:, None]
    seen = (in_output + counts(prompt_ids)) > 0
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * in_output - presence[:, None] * (in_output > 0)


def ban(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """A copy of logits with -inf at the (row, token id) pairs of banned, (2, n)."""
    minus_inf = torch.tensor(float("-inf"), device=logits.device)
    return logits.index_put((banned[0], banned[1]), minus_inf)


# %% [markdown]
# "The cat sat on the": "mat" said once, with `repetition_penalty=2`, falls from 4.0 to 2.0, below
# "floor"'s 3.1; but "floor" is a stop token and the request asks for 2 tokens first, so greedy says
# "sofa".

# %%
from minivllm.layers.sampling_options import apply_penalties, ban

zero, one, t = torch.zeros(1), torch.ones(1), torch.tensor
# presence 0, frequency 0, repetition 2; prompt: none, reply: "mat"
penalties = (zero, zero, 2 * one, t([[-1]]), t([[0]]))
penalized = apply_penalties(cat_logits[None], *penalties)
assert penalized[0, 0] == 2.0  # "mat", seen
assert torch.equal(penalized[0, 1:], cat_logits[1:])  # the others, not
banned = ban(penalized, torch.tensor([[0], [1]]))  # row 0, token 1: "floor"
assert banned.argmax().item() == 2 and penalized[0, 1] == 3.1  # "sofa"; the input untouched
# frequency 0.5 per use, presence 1 once: "floor" said three times loses 1.5 + 1
reply = t([[1, 1, 1, -1]])  # "floor" three times, then padding
penalties = (one, 0.5 * one, one, t([[-1]]), reply)
torch.testing.assert_close(apply_penalties(cat_logits[None], *penalties)[0, 1], torch.tensor(0.6))

# %% [markdown]
# ## Log-probabilities: what the model thought of a token
# `SamplingParams(logprobs=k)` returns, for each sampled token, its log-probability under the raw
# logits' log-softmax, its rank (1: the most likely), and the `k` most likely tokens with theirs, as
# vLLM does. One row of `logprobs_of` is a dict `TokenLogprobs` (notebook 04 names the type).


# %% tags=["export"] module="minivllm.layers.sampling_options"
def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
) -> list[TokenLogprobs]:
    """Each row's chosen token, then its k most likely, under the raw logits' log-softmax (vLLM's).
    logits (rows, vocab), token_ids (rows,)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (rows, vocab)
    chosen = logprobs.gather(-1, token_ids[:, None])  # (rows, 1)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # how many are more likely, plus one
    top = logprobs.topk(max(ks), dim=-1)  # (rows, max k)
    columns = (token_ids.tolist(), chosen[:, 0].tolist(), ranks, top.indices.tolist())
    result = []
    for (token, logprob, rank, ids), values, k in zip(zip(*columns), top.values.tolist(), ks):
        ranked = enumerate(zip(ids[:k], values[:k]), start=1)  # (rank, (token id, log-prob))
        result.append({token: (logprob, rank)} | {i: (v, j) for j, (i, v) in ranked})
    return result


# %% [markdown]
# "sofa", and the two most likely words: the chosen token first, then the top `k` by rank.

# %%
from minivllm.layers.sampling_options import logprobs_of

print(row := logprobs_of(cat_logits[None], torch.tensor([2]), [2])[0])
assert list(row) == [2, 0, 1] and row[2][1] == 3  # "sofa" is third
torch.testing.assert_close(row[0][0], torch.log_softmax(cat_logits, dim=-1)[0].item())

# %% [markdown]
# ## Prompt log-probabilities: every row of a prefill
# `SamplingParams(prompt_logprobs=k)` scores the prompt: the logits after token `i` give token
# `i + 1`'s log-probability (the first token has none). A prefill then needs the logits of every
# row of that prompt, not only its last: notebook 04's `StepInputs.logits_rows` names such rows.
# A chunked prompt is scored chunk by chunk; a prefix-cache hit skips the cached part, which vLLM
# does not score again either.

# %% tags=["export"] module="minivllm.engine.sampling_options"
from collections.abc import Callable

import numpy as np
import torch

from minivllm.engine.model_runner import ModelRunner, PromptLogprobs, StepOutput
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import StepInputs, to_device
from minivllm.layers.sampler import TokenLogprobs
from minivllm.layers.sampling_options import apply_penalties, ban, logprobs_of

PENALTIES = ("presence", "frequency", "repetition")


def scores_prompt(seq: Sequence) -> bool:
    """Whether seq asks for prompt logprobs and has prompt tokens left to score (row i scores token
    i + 1)."""
    asked = seq.sampling_params.prompt_logprobs is not None
    return asked and seq.num_cached_tokens < seq.num_prompt_tokens - 1


def scored_rows(scoring: list[bool], cu_seqlens_q: np.ndarray) -> np.ndarray:  # (num_rows,) int64
    """The rows of a prefill to take logits of: all of a scoring sequence's, each other sequence's
    last."""
    bounds = zip(scoring, cu_seqlens_q, cu_seqlens_q[1:])
    rows = [np.arange(a, b) if score else [b - 1] for score, a, b in bounds]
    return np.concatenate(rows).astype(np.int64)


def padded(rows: list[list[int]]) -> np.ndarray:  # (len(rows), longest) int64, -1 after each end
    width = max(1, *map(len, rows))
    return np.array([row + [-1] * (width - len(row)) for row in rows], dtype=np.int64)


def penalty_arrays(seqs: list[Sequence]) -> list[np.ndarray]:
    """apply_penalties' arguments after the logits: three penalties a row, then its token ids."""
    params = [seq.sampling_params for seq in seqs]
    values = [[getattr(p, f"{name}_penalty") for p in params] for name in PENALTIES]
    histories = [[s.prompt_token_ids for s in seqs], [s.completion_token_ids for s in seqs]]
    return [np.array(v, dtype=np.float32) for v in values] + [padded(h) for h in histories]


def banned_tokens(seqs: list[Sequence]) -> np.ndarray | None:  # (2, n) int64: rows, token ids
    """The stop tokens of each row that has fewer than min_tokens tokens: not to draw yet."""
    pairs = []
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        if seq.num_completion_tokens < params.min_tokens:
            pairs += [(row, token) for token in params.stop_token_ids or []]
    return np.array(pairs, dtype=np.int64).T.copy() if pairs else None


# %% [markdown]
# The runner changes three of notebook 04's methods. `prepare` names the rows a scoring prompt
# needs; `sample` edits the logits before the core sampler draws; `launch` takes each sequence's
# last row to sample, and fills the step's log-probabilities from the raw logits.


# %% tags=["export"] module="minivllm.engine.sampling_options"
class OptionsRunner(ModelRunner):
    """Notebook 04's runner with vLLM's other sampling options: penalties, min_tokens, and the
    log-probabilities of the sampled tokens and of the prompt."""

    def prepare(self, seqs: list[Sequence], is_prefill: bool) -> StepInputs:
        step = super().prepare(seqs, is_prefill)
        scoring = [scores_prompt(seq) for seq in seqs] if is_prefill else []  # a decode step: none
        if any(scoring):  # a prefill that scores a prompt: a logits row per token it scores
            assert step.cu_seqlens_q is not None  # a prefill step has it
            step.logits_rows = scored_rows(scoring, step.cu_seqlens_q)
        return step

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:  # (num_seqs,)
        if any(seq.sampling_params.penalized for seq in seqs):
            arrays = penalty_arrays(seqs)
            logits = apply_penalties(logits.float(), *(to_device(a, self.device) for a in arrays))
        if (banned := banned_tokens(seqs)) is not None:
            logits = ban(logits, to_device(banned, self.device))
        return super().sample(seqs, logits)

    def launch(self, seqs: list[Sequence], is_prefill: bool) -> Callable[[], StepOutput]:
        logits = self.step_logits(seqs, is_prefill)  # (num_rows, vocab): more if prompts score
        scoring = [scores_prompt(seq) for seq in seqs] if is_prefill else []  # as prepare's
        last = logits  # (num_seqs, vocab)
        if any(scoring):  # each sequence's rows end here: one, or one per token it scores
            ends = np.cumsum([s.num_scheduled_tokens if on else 1 for s, on in zip(seqs, scoring)])
            last = logits[to_device(ends - 1, logits.device)]  # to_device: the GPU goes on
        token_ids = self.sample(seqs, last)  # (num_seqs,)
        out = StepOutput([], self.sampled_logprobs(seqs, last, token_ids), [None] * len(seqs))
        for i in [i for i, on in enumerate(scoring) if on]:
            out.prompt_logprobs[i] = self.prompt_logprobs(seqs[i], logits, int(ends[i]))
        return self.deliver(token_ids, out)

    def sampled_logprobs(
        self, seqs: list[Sequence], last: torch.Tensor, token_ids: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        """Where a sequence asks (SamplingParams.logprobs), its sampled token's log-probability."""
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        asked = [i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
        if asked:
            ks = [seqs[i].sampling_params.logprobs or 0 for i in asked]
            for i, row in zip(asked, logprobs_of(last[asked], token_ids[asked], ks)):
                out[i] = row
        return out

    def prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, end: int) -> PromptLogprobs:
        """Log-probabilities of the prompt tokens this step scored: row p scores token p + 1."""
        start, k = seq.num_cached_tokens, seq.sampling_params.prompt_logprobs or 0
        n = min(seq.num_scheduled_tokens, seq.num_prompt_tokens - 1 - start)  # rows in the prompt
        targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + n], device=logits.device)
        first = end - seq.num_scheduled_tokens
        return start + 1, logprobs_of(logits[first : first + n], targets, [k] * n)


# %% [markdown]
# ## Check: the runner's log-probabilities are a from-scratch forward's
# On notebook 02's tiny checkpoint: a 40-token prompt scored in two chunks (24 tokens beside a
# greedy row that asks for its sampled token's log-probability, then 16), each row against the
# log-softmax of `prompt_logits`. Then penalties and `min_tokens` through the runner.

# %%
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sampling_options import OptionsRunner
from minivllm.engine.sequence import Sequence
from minivllm.models.loader import load_model
from minivllm.sampling_params import SamplingParams
from minivllm.testing import prompt_logits

runner = OptionsRunner(Config(path, num_kvcache_blocks=32, dtype=torch.float32, max_num_seqs=4))
reference = load_model(path, dtype=torch.float32, device="cpu")
bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
scored = Sequence(random.choices(range(2048), k=40), SamplingParams(prompt_logprobs=2))
greedy = Sequence(random.choices(range(2048), k=7), SamplingParams(temperature=0, logprobs=3))
for seq in (scored, greedy):
    bm.allocate(seq)
expected = torch.log_softmax(prompt_logits(reference, scored.token_ids), dim=-1)  # (40, vocab)
rows = []
for end in (24, 40):  # two chunks; the greedy row's prompt is all in the first step
    scored.num_scheduled_tokens, greedy.num_scheduled_tokens = end - scored.num_cached_tokens, 7
    batch = [scored, greedy] if end == 24 else [scored]
    out = runner.launch(batch, is_prefill=True)()
    first, rows_now = out.prompt_logprobs[0]
    assert first == scored.num_cached_tokens + 1  # row p scores token p + 1
    rows += rows_now
    scored.num_cached_tokens = end
    if end == 24:
        token, (logprob, rank) = out.token_ids[1], out.logprobs[1][out.token_ids[1]]
        greedy_expected = torch.log_softmax(prompt_logits(reference, greedy.token_ids)[-1], -1)
        assert rank == 1 and len(out.logprobs[1]) == 3  # greedy: the most likely, and the top 3
        torch.testing.assert_close(logprob, greedy_expected.max().item(), rtol=0, atol=1e-4)
assert len(rows) == 39  # every prompt token but the first
scored_ids = scored.token_ids[1:]
got = torch.tensor([row[token][0] for row, token in zip(rows, scored_ids)])
want = expected[torch.arange(39), torch.tensor(scored_ids)]
print(f"39 prompt tokens in two chunks: worst log-probability error {(got - want).abs().max():.1e}")
torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

# %% [markdown]
# Penalties and bans through the runner. A request whose stop token is what greedy says first, and
# which must say 3 tokens first, says something else; one with `repetition_penalty=3` after a
# prompt that holds that token says the argmax of the penalized logits.

# %%
from minivllm.engine.sampling_options import penalty_arrays


def prefill(token_ids: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(token_ids, params)
    bm.allocate(seq)
    seq.num_scheduled_tokens = len(seq)
    return seq


first_token = runner.run([prefill([5, 6, 7], SamplingParams(temperature=0))], True)[0]
held = prefill([5, 6, 7], SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[first_token]))
assert runner.run([held], is_prefill=True)[0] != first_token  # banned before its 3rd token
heavy = prefill([5, 6, 7, first_token], SamplingParams(temperature=0, repetition_penalty=3.0))
logits = runner.step_logits([heavy], is_prefill=True)  # (1, vocab), raw
penalized = apply_penalties(logits, *map(torch.from_numpy, penalty_arrays([heavy])))
said = runner.run([heavy], is_prefill=True)[0]
print(f"greedy says {logits.argmax().item()}; with the penalty {said}")
assert said == penalized.argmax().item()

# %% [markdown]
# ## Check yourself
# **1.** A request with `frequency_penalty=0.5`, `presence_penalty=0.25` and
# `repetition_penalty=1.5` has said token 7 three times; token 7's raw logit is -2. What logit does
# the sampler see for token 7? (Answer a float.)

# %%
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
presence, frequency, repetition = 0.25 * one, 0.5 * one, 1.5 * one
penalties = (presence, frequency, repetition, t([[-1]]), t([[7, 7, 7]]))
expected1 = apply_penalties(torch.full((1, 8), -2.0), *penalties)[0, 7].item()
check_answer(answer1, expected1, "1. a penalized logit")

# %% [markdown]
# Worked answer: a negative logit is multiplied by the repetition penalty, -2 × 1.5 = -3; then three
# uses cost 3 × 0.5 and being used at all 0.25: -3 - 1.5 - 0.25 = -4.75.

# %%
check_answer(-2 * 1.5 - 3 * 0.5 - 0.25, expected1, "1. a penalized logit")
