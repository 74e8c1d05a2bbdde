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
# # Exercise 04 · A sampler filter the engine lacks: typical-p
#
# Notebook 04's sampler cuts the tail three ways (top-k, top-p, min-p), and all three keep the *most
# likely* tokens. **Locally typical sampling** (Meister et al., 2022; transformers' `typical_p`)
# asks another question: which tokens are about as surprising as the model expects its next token to
# be? A token's surprise is `-log p`; the row's expected surprise is its entropy `H = -Σ p log p`.
# Typical-p keeps the smallest set of tokens, taken in order of `|-log p - H|` (most typical first),
# whose mass reaches `τ`. On a flat row it behaves like top-p; on a peaked row with a long tail it
# may drop the single most likely token, which no filter of notebook 04 ever does.
#
# **Your task**, two functions, each checked right below its cell:
#
# 1. `typical_mask(logprobs, typical_ps)`: which tokens typical-p keeps, a whole batch with one
#    sort, each row with its own `τ`;
# 2. `sample(logits, temperatures, typical_ps, generator)`: temperature, then typical-p, then
#    notebook 04's exponential race.
#
# The checks go from a row by hand, to transformers' `TypicalLogitsWarper` on random rows, to the
# frequencies of 100,000 draws. **What it assumes.** Notebook 04's "Sampling: from logits to the
# next token" (the keep-mask of a sorted row, scattering it back to vocabulary order, the
# exponential race). No GPU, no model. About 30 minutes; the checks take a few seconds on a CPU.

# %%
import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from minivllm.testing import exercise

# %% [markdown]
# ## Part 1 · The keep-mask
# Per row, with the row's own `τ` (`typical_ps[row]`; `τ >= 1` is off: keep every token):
#
# 1. `p = exp(logprobs)` and the entropy `H = -Σ p · logprobs`. A token with `p = 0` has `logprobs =
#    -inf`, and `0 · -inf` is NaN: count it as 0 (`torch.nansum`, or mask it).
# 2. Each token's distance `|-logprobs - H|`; sort the row by it, smallest first (`torch.sort`
#    returns the order too).
# 3. Keep a token if the mass of the tokens *before* it in that order is less than `τ`: the shortest
#    prefix that reaches `τ`, exactly the rule of notebook 04's top-p (`before < τ`, from a `cumsum`
#    shifted one place).
# 4. Scatter the mask back to vocabulary order (`Tensor.scatter`), as notebook 04's `filter_probs`
#    does.
#
# No loop over rows: a per-row setting is a `(batch, 1)` tensor compared with the `(batch, vocab)`
# one.


# %%
def typical_mask(logprobs: torch.Tensor, typical_ps: torch.Tensor) -> torch.Tensor:
    """Which tokens typical-p keeps: (batch, vocab) bool in vocabulary order.

    logprobs (batch, vocab): log_softmax of each row's (temperature-scaled) logits. typical_ps
    (batch,): τ, 1 = off."""
    # BEGIN SOLUTION
    p = logprobs.exp()  # (batch, vocab)
    entropy = -(p * logprobs).nansum(dim=-1, keepdim=True)  # (batch, 1); 0 * -inf counts as 0
    distance = (-logprobs - entropy).abs()  # (batch, vocab): inf for p = 0, sorted last
    order = distance.argsort(dim=-1, stable=True)  # most typical first
    sorted_p = p.gather(-1, order)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more typical tokens
    # (batch, vocab), in sorted order
    keep = (before < typical_ps[:, None]) | (typical_ps[:, None] >= 1)
    return torch.empty_like(keep).scatter_(-1, order, keep)  # back to vocabulary order
    # END SOLUTION


# %% [markdown]
# ## Check 1 · by hand
# `p = [0.4, 0.3, 0.2, 0.1]` has entropy 1.280 nats; the surprises are 0.916, 1.204, 1.609 and
# 2.303, so the most typical token is the second (0.3, distance 0.076), then the third (0.330), the
# first (0.364) and the last (1.023). With `τ = 0.25` only the second token is kept: the most likely
# token is dropped. Then one call for a batch whose rows have different settings, and a row with an
# impossible token (`p = 0`).

# %%
with exercise("typical_mask"):
    hand = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    cases = [  # (τ, kept tokens, why)
        (
            0.25,
            [1],
            "tau 0.25: the most typical token alone reaches it; the most likely one is dropped",
        ),
        (0.01, [1], "tau 0.01: the most typical token is always kept"),
        (0.45, [1, 2], "tau 0.45: 0.3 falls short, 0.3 + 0.2 reaches it"),
        (0.55, [0, 1, 2], "tau 0.55: a third token is needed, the most likely one"),
        (0.95, [0, 1, 2, 3], "tau 0.95: all four"),
        (1.0, [0, 1, 2, 3], "tau 1: off"),
    ]
    for tau, expected, why in cases:
        mask = typical_mask(hand[None], torch.tensor([tau]))
        assert mask.dtype == torch.bool and mask.shape == (1, 4), (
            f"typical_mask should return a bool tensor shaped like logprobs (1, 4), got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )
        kept = mask[0].nonzero().flatten().tolist()
        assert kept == expected, (
            f"p = [0.4, 0.3, 0.2, 0.1], {why}: expected tokens {expected}, got {kept}"
        )

    peaked = torch.tensor([0.7, 0.1, 0.1, 0.1]).log()
    two_way = torch.tensor([0.5, 0.5, 0, 0]).log()
    batch = torch.stack([hand, hand, peaked, two_way])
    mask = typical_mask(batch, torch.tensor([0.25, 0.55, 0.5, 0.9]))
    for row, expected in enumerate([[1], [0, 1, 2], [0], [0, 1]]):
        kept = sorted(mask[row].nonzero().flatten().tolist())
        assert kept == sorted(expected), (
            f"one call for 4 rows, row {row}: expected tokens {sorted(expected)}, got {kept}"
        )
print("typical_mask: hand cases pass")

# %% [markdown]
# ## Check 2 · the same mask as transformers
# transformers' `TypicalLogitsWarper(mass=τ)` sets the tokens it drops to `-inf`. On random rows
# over 2,000 tokens, sharp and flat, each with its own `τ` (one batch for yours, row by row for
# theirs), the kept tokens must be the same. (The values are continuous, so no two tokens are
# equally typical and both sorts agree.)

# %%
with exercise("typical_mask"):
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 2000
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    taus = torch.rand(rows, generator=gen) * 0.98 + 0.01
    mask = typical_mask(torch.log_softmax(logits, dim=-1), taus)
    for row in range(rows):
        warper = TypicalLogitsWarper(mass=float(taus[row]))
        theirs = warper(None, logits[row : row + 1].clone())[0] > float("-inf")
        differ = (mask[row] != theirs).nonzero().flatten().tolist()
        tau, yours = float(taus[row]), int(mask[row].sum())
        assert not differ, (
            f"row {row} (tau {tau:.3f}): you keep {yours} tokens, transformers "
            f"{int(theirs.sum())}; they differ at tokens {differ[:8]}"
        )
print(
    f"typical_mask equals transformers' TypicalLogitsWarper on {rows} rows of {vocab}; kept: "
    f"{mask.sum(-1)[:8].tolist()}"
)

# %% [markdown]
# ## Part 2 · The sampler
# `sample` takes raw logits and, per row, a temperature and a `τ`:
#
# * **Temperature first.** The filter acts on the distribution the row samples from, `softmax(logits
#   / T)`, so divide before `log_softmax`: the entropy, and so the typical set, depends on `T`. A
#   row with `T = 0` is greedy: the argmax of its raw logits, whatever its `τ`.
# * **The draw**, notebook 04's exponential race: `q =
#   torch.empty_like(probs).exponential_(generator=generator)`, clamped away from 0
#   (`clamp_min_(1e-10)`), then `argmax(probs / q)` over the kept tokens' probabilities (the dropped
#   ones set to 0; no renormalisation needed). Take the noise from `generator`: a seeded request
#   repeats.


# %%
def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    typical_ps: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token id per row of logits (batch, vocab): (batch,) int64."""
    # BEGIN SOLUTION
    greedy = temperatures == 0
    scaled = logits / torch.where(greedy, 1.0, temperatures)[:, None]  # (batch, vocab)
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp().masked_fill(~typical_mask(logprobs, typical_ps), 0.0)
    q = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-10)
    return torch.where(greedy, logits.argmax(dim=-1), (probs / q).argmax(dim=-1))
    # END SOLUTION


# %% [markdown]
# ## Check 3 · the draw, by sampling
# Greedy rows first, and the same seed must give the same tokens. Then the statistics: a draw is
# right if its frequencies converge to the kept tokens' renormalised probabilities. With `n` draws,
# the frequency of a token of probability `p` has a standard deviation of `sqrt(p (1 - p) / n)`: the
# check allows 5 of them, and a dropped token must never come out. The rows: notebook 04's "the cat
# sat on the" distribution at three temperatures, with and without typical-p; its expected
# probabilities come from your (checked) `typical_mask`.


# %%
def check_frequencies(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """tokens (n,) drawn from probs (vocab,), not necessarily normalized."""
    expected, n = probs / probs.sum(), len(tokens)
    freq = torch.bincount(tokens, minlength=len(probs)).double() / n
    tolerance = 5 * (expected * (1 - expected) / n).sqrt() + 1e-12
    dropped = (expected == 0) & (freq > 0)
    assert not dropped.any(), (
        f"{what}: dropped token(s) {dropped.nonzero().flatten().tolist()} were drawn"
    )
    worst = int(((freq - expected).abs() / tolerance).argmax())
    assert (freq - expected).abs()[worst] <= tolerance[worst], (
        f"{what}: token {worst} drawn with frequency {freq[worst]:.4f}, expected "
        f"{expected[worst]:.4f} "
        f"± {tolerance[worst]:.4f} ({n} draws)"
    )


with exercise("sample"):
    cat_logits = torch.tensor([4.0, 3.1, 2.6, 2.2, 1.9, 1.4, 1.2, 1.0, 0.6, 0.1, -0.5, -1.5])
    shuffle = torch.randperm(len(cat_logits), generator=torch.Generator().manual_seed(1))
    cat_logits = cat_logits[shuffle]  # vocabulary order is no longer rank order
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    tokens = sample(logits, torch.zeros(8), torch.full((8,), 0.5), torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and tokens.shape == (8,), (
        f"expected (8,) int64, got {tokens.dtype} {tokens.shape}"
    )
    assert torch.equal(tokens, logits.argmax(-1)), (
        f"temperature 0 is greedy: expected {logits.argmax(-1)}, got {tokens}"
    )
    a, b = (
        sample(logits, torch.ones(8), torch.ones(8), torch.Generator().manual_seed(7))
        for _ in range(2)
    )
    assert torch.equal(a, b), (
        "the same generator seed gave different tokens: take the noise from `generator`"
    )

    n = 100_000
    # (temperature, tau)
    settings_rows = [(1.0, 1.0), (1.0, 0.5), (0.5, 0.5), (2.0, 0.3), (0.7, 0.9)]
    temperatures, taus = (
        torch.tensor(column).repeat_interleave(n) for column in zip(*settings_rows)
    )
    tokens = sample(
        cat_logits.expand(len(settings_rows) * n, -1),
        temperatures,
        taus,
        torch.Generator().manual_seed(3),
    )
    for i, (temperature, tau) in enumerate(settings_rows):
        logprobs = torch.log_softmax(cat_logits / temperature, dim=-1)[None].double()
        expected = logprobs.exp()[0] * typical_mask(logprobs, torch.tensor([tau]))[0]
        check_frequencies(
            tokens[i * n : (i + 1) * n], expected, f"temperature {temperature}, typical_p {tau}"
        )
print("sample: greedy, repeatable, and the frequencies of the typical set at its temperature")

# %% [markdown]
# ## What's next
# To offer it in the engine, `SamplingParams` would get a `typical_p` field (1.0: off),
# `SamplingTensors` a `typical_ps` row, and the sampler this mask next to `keep_mask`. It needs its
# own sort (by distance to the entropy, not by probability), so a batch with both top-p and
# typical-p rows sorts twice: measure what that costs at a vocabulary of 151,936 before you make it
# the default.
