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
# # Exercise 04 · Top-k, top-p and min-p over a batch, then the draw
#
# A request asks for `temperature=0.8, top_p=0.95`, its neighbour in the batch for `top_k=50`, a third for
# nothing at all. The sampler must honour each row's settings in one pass over the `(batch, vocab)` tensor: a
# Python loop over rows would cost a GPU launch per row and per step. This exercise makes you write the part of
# the sampler that does that: the filters' **keep-mask** for a whole batch with one sort, and the **exponential
# race** that draws a token from what is left.
#
# **Where it is taught.** Notebook 04, "Sampling: from logits to the next token" (the subsections "Cutting the
# tail" and "Drawing a token"). Try it before reading `keep_mask` there, after reading the definitions.
#
# **Your task**, three functions, each checked right below its cell:
#
# 1. `keep_mask(sorted_probs, top_ks, top_ps, min_ps)`: which tokens the three filters keep, rows sorted;
# 2. `filter_probs(probs, top_ks, top_ps, min_ps)`: the same in vocabulary order, with one sort;
# 3. `draw(probs, generator)`: one token per row, by the exponential race.
#
# **What it assumes.** PyTorch tensors, `sort`, `cumsum`, `scatter`. No GPU, no model. About 30 to 45 minutes;
# the checks take a few seconds on a CPU.

# %%
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.testing import exercise

# %% [markdown]
# ## The definitions
# Per row, with the row's own settings, in this order (the one `minivllm.layers.sampler` uses):
#
# * **top-k** keeps the `k` most likely tokens. `k = -1` is off; a `k` above the vocabulary keeps all.
# * **top-p** keeps the smallest set of most likely tokens whose mass *reaches* `p`: a token stays if the tokens
#   before it (more likely) hold less than `p` of the mass. The mass is measured on **what top-k left,
#   renormalized**: top-k 3 on `[0.5, 0.3, 0.15, 0.05]` leaves a mass of 0.95, of which 0.5 + 0.3 is 84%, so
#   top-p 0.82 then stops at two tokens (on the whole row, 0.8 < 0.82, it would keep three). `p = 1` is off.
# * **min-p** keeps the tokens at least `min_p` times as likely as the most likely token of the row (the
#   temperature-scaled distribution, before any filter; the most likely token survives every filter). `0` is off.
#
# Each filter always keeps the most likely token, so a row never ends up empty.
#
# **One sort for all three.** Top-k needs ranks, top-p a running sum in rank order, min-p the maximum: all three
# are read off the row sorted largest first. So `keep_mask` takes rows already sorted and returns the mask in that
# order, as a comparison of the `(batch, vocab)` tensor with per-row thresholds of shape `(batch, 1)`. No loop over
# rows; a disabled filter is a threshold that keeps everything.
#
# **Ties.** Two equally likely tokens are told apart by their place in the sorted row, as `minivllm` does:
# top-k keeps exactly the first `k` positions, and top-p stops at the first position that reaches `p`, even if
# the next token is as likely. Min-p compares values, so tied tokens share one fate. (vLLM's top-k compares with
# the `k`-th value instead and keeps every token tied with it.)
#
# Below, the hand example of notebook 04, and a helper that turns one row's settings into the per-row tensors.

# %%
hand = torch.tensor([[0.5, 0.3, 0.15, 0.05]])  # (1, vocab), sorted largest first


def row_settings(rows: list[tuple[int, float, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(top_k, top_p, min_p), ...] -> top_ks (batch,) int64, top_ps and min_ps (batch,) float32."""
    top_ks, top_ps, min_ps = zip(*rows)
    return torch.tensor(top_ks), torch.tensor(top_ps), torch.tensor(min_ps)


print(hand.cumsum(dim=-1))  # top-p reads this running sum: 0.5 + 0.3 reaches 0.8
print(row_settings([(-1, 1.0, 0.0), (3, 0.82, 0.0)]))  # filters off, then top-k 3 with top-p 0.82

# %% [markdown]
# ## Part 1 · The keep-mask
# Build `keep` step by step, each step a `(batch, vocab)` boolean tensor:
#
# * top-k: compare the rank `torch.arange(vocab)` with `top_ks[:, None]`, and let `k < 0` keep everything;
# * top-p: the mass *before* each token, counting only what top-k kept (a `cumsum` of `sorted_probs * keep`,
#   shifted one place right), compared with `p ×` the total that top-k kept. Multiply rather than divide:
#   `before < p * total` is exact where `before / total < p` may round. Let `p >= 1` keep everything (a float32
#   sum of 150,000 tokens need not reach exactly 1);
# * min-p: `sorted_probs >= min_p × sorted_probs[:, :1]`.


# %%
def keep_mask(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Which tokens top-k, then top-p, then min-p keep: (batch, vocab) bool, in the order of sorted_probs.

    sorted_probs (batch, vocab): each row sorted largest first. top_ks (batch,) int64, -1 = off; top_ps (batch,)
    float32, 1 = off; min_ps (batch,) float32, 0 = off."""
    # BEGIN SOLUTION
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)  # (vocab,)
    keep = (top_ks[:, None] < 0) | (ranks < top_ks[:, None])  # top-k
    cum = (sorted_probs * keep).cumsum(dim=-1)  # running mass of what top-k kept
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass of the kept tokens before
    keep &= (before < top_ps[:, None] * cum[:, -1:]) | (top_ps[:, None] >= 1)  # top-p, on what top-k left
    keep &= sorted_probs >= min_ps[:, None] * sorted_probs[:, :1]  # min-p, relative to the most likely token
    return keep
    # END SOLUTION


# %% [markdown]
# ## Check 1 · by hand
# The hand row with one filter at a time, the boundaries on both sides; ties; then one call for a batch whose
# rows have different settings.


# %%
def num_kept(probs: torch.Tensor, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> int:
    mask = keep_mask(probs, *row_settings([(top_k, top_p, min_p)]))
    assert mask.dtype == torch.bool and mask.shape == probs.shape, (
        f"keep_mask should return a bool tensor shaped like sorted_probs {tuple(probs.shape)}, "
        f"got {mask.dtype} {tuple(mask.shape)}"
    )
    assert mask[0, 0], f"the most likely token was dropped (top_k={top_k}, top_p={top_p}, min_p={min_p})"
    return int(mask.sum())


with exercise("keep_mask"):
    cases = [  # (top_k, top_p, min_p) on [0.5, 0.3, 0.15, 0.05] -> tokens kept, and why
        ((-1, 1.0, 0.0), 4, "every filter off"),
        ((3, 1.0, 0.0), 3, "top-k 3"),
        ((1, 1.0, 0.0), 1, "top-k 1"),
        ((10, 1.0, 0.0), 4, "top-k above the vocabulary keeps all"),
        ((-1, 0.8, 0.0), 2, "top-p 0.8: 0.5 + 0.3 reaches 0.8"),
        ((-1, 0.81, 0.0), 3, "top-p 0.81: 0.5 + 0.3 falls short, a third token is needed"),
        ((-1, 0.01, 0.0), 1, "top-p 0.01: the first token reaches it"),
        ((-1, 0.82, 0.0), 3, "top-p 0.82 on the whole row"),
        ((3, 0.82, 0.0), 2, "top-p 0.82 after top-k 3: 0.8 is 84% of the 0.95 top-k left"),
        ((-1, 1.0, 0.3), 3, "min-p 0.3: keep p >= 0.15"),
        ((-1, 1.0, 0.31), 2, "min-p 0.31: keep p >= 0.155"),
        ((-1, 1.0, 1.0), 1, "min-p 1: only the maximum"),
        ((2, 1.0, 0.05), 2, "min-p does not bring back what top-k dropped"),
    ]
    for (top_k, top_p, min_p), expected, why in cases:
        got = num_kept(hand, top_k, top_p, min_p)
        assert got == expected, f"{why}: top_k={top_k}, top_p={top_p}, min_p={min_p} keeps {expected}, got {got}"

    ties = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    for (top_k, top_p, min_p), expected, why in [
        ((2, 1.0, 0.0), 2, "top-k 2 keeps exactly 2 of 4 tied tokens"),
        ((-1, 0.5, 0.0), 2, "top-p 0.5 stops at the second tied token, which reaches 0.5"),
        ((-1, 0.51, 0.0), 3, "top-p 0.51 needs a third tied token"),
        ((-1, 1.0, 1.0), 4, "min-p 1 keeps every token tied with the maximum"),
    ]:
        got = num_kept(ties, top_k, top_p, min_p)
        assert got == expected, f"ties {ties.tolist()[0]}: {why}, got {got}"
    mask = keep_mask(ties, *row_settings([(2, 1.0, 0.0)]))[0].tolist()
    assert mask == [True, True, False, False], f"top-k 2 on a tie keeps the first two positions, got {mask}"

    batch = hand.expand(4, -1)
    settings_rows = [(3, 1.0, 0.0), (-1, 0.8, 0.0), (-1, 1.0, 0.31), (3, 0.82, 0.0)]
    got = keep_mask(batch, *row_settings(settings_rows)).sum(dim=-1).tolist()
    assert got == [3, 2, 2, 2], f"one call, rows {settings_rows}: expected [3, 2, 2, 2] tokens kept, got {got}"
print("keep_mask: hand cases pass")

# %% [markdown]
# ## Check 2 · a property test against a loop
# The definitions above are easiest to trust as a plain loop over one row. The check below writes them so, and a
# hypothesis test compares your batched mask with it on random batches: random sorted rows (with ties and zeros),
# random settings per row, each filter sometimes off.
#
# The rows are multiples of 1/256 and `p`, `min_p` multiples of 1/32, so every sum and product here is exact in
# float32 as in Python floats: the two must agree exactly, boundary cases (a sum that reaches `p` exactly) included.


# %%
def keep_row(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[bool]:
    """One sorted row, the definitions written as a loop (top_k -1, top_p 1, min_p 0: off)."""
    kept = len(probs) if top_k < 0 else min(top_k, len(probs))  # top-k: the first k positions
    if top_p < 1:
        total = sum(probs[:kept])  # the mass top-k left
        mass, count = 0.0, 0
        while count < kept and mass < top_p * total:  # the shortest prefix whose mass reaches p of it
            mass += probs[count]
            count += 1
        kept = count
    return [i < kept and probs[i] >= min_p * probs[0] for i in range(len(probs))]


@st.composite
def batches(draw):
    vocab, rows = draw(st.integers(1, 10)), draw(st.integers(1, 5))
    probs, settings_rows = [], []
    for _ in range(rows):
        step = draw(st.sampled_from([1, 16, 64]))  # coarse steps give many ties
        cuts = draw(st.lists(st.integers(0, 256 // step), min_size=vocab - 1, max_size=vocab - 1))
        edges = [0, *sorted(c * step for c in cuts), 256]
        probs.append(sorted(((b - a) / 256 for a, b in zip(edges, edges[1:])), reverse=True))  # sums to 1
        top_k = draw(st.just(-1) | st.integers(1, vocab + 2))
        top_p = draw(st.just(1.0) | st.integers(1, 31).map(lambda j: j / 32))
        min_p = draw(st.just(0.0) | st.integers(1, 32).map(lambda j: j / 32))
        settings_rows.append((top_k, top_p, min_p))
    return probs, settings_rows


@settings(max_examples=500, deadline=None, database=None, report_multiple_bugs=False)
@given(batch=batches())
def test_keep_mask(batch):
    probs, settings_rows = batch
    got = keep_mask(torch.tensor(probs), *row_settings(settings_rows)).tolist()
    for row, (p, s, mask) in enumerate(zip(probs, settings_rows, got)):
        expected = keep_row(p, *s)
        assert mask == expected, (
            f"row {row}, probs {p}, (top_k, top_p, min_p) = {s}: expected keep {expected}, got {mask}"
        )


with exercise("keep_mask"):
    test_keep_mask()
print("keep_mask: property test passed, 500 random batches")

# %% [markdown]
# ## Check 3 · the same mask as minivllm's `keep_mask`
# Real rows: softmax of random logits over 2,000 tokens, sharp and flat, some with many exact ties (rounded
# logits), and random settings with continuous values. Your mask must equal the library's, entry for entry.

# %%
from minivllm.layers import sampler

with exercise("keep_mask"):
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 256, 2000
    logits = torch.randn(batch, vocab, generator=gen) * torch.rand(batch, 1, generator=gen) * 6
    logits[::4] = logits[::4].round()  # exact ties
    sorted_probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values

    def off_or(values: torch.Tensor, off: float, share_off: float = 0.3) -> torch.Tensor:
        return torch.where(torch.rand(batch, generator=gen) < share_off, off, values)

    top_ks = off_or(torch.randint(1, vocab + 10, (batch,), generator=gen), -1).long()
    top_ps = off_or(torch.rand(batch, generator=gen), 1.0)
    min_ps = off_or(torch.rand(batch, generator=gen) * 0.2, 0.0)
    ours = keep_mask(sorted_probs, top_ks, top_ps, min_ps)
    ref = sampler.keep_mask(sorted_probs, top_ks, top_ps, min_ps)
    bad_rows = (ours != ref).any(dim=-1).nonzero().flatten().tolist()
    if bad_rows:
        r = bad_rows[0]
        raise AssertionError(
            f"{len(bad_rows)} of {batch} rows differ from minivllm's keep_mask; row {r} (top_k={int(top_ks[r])}, "
            f"top_p={float(top_ps[r]):.4f}, min_p={float(min_ps[r]):.4f}) keeps {int(ours[r].sum())} tokens, "
            f"expected {int(ref[r].sum())}"
        )
print(f"keep_mask equals minivllm's on {batch} rows of {vocab} tokens; tokens kept per row: {ref.sum(-1)[:8].tolist()}")

# %% [markdown]
# ## Part 2 · One sort, back to vocabulary order
# `filter_probs` takes `probs` in vocabulary order (the softmax of temperature-scaled logits), sorts each row once
# (`sort(descending=True)` also returns `order`, where each sorted entry came from), computes your mask, and
# scatters it back: the `j`-th sorted entry belongs at vocabulary position `order[:, j]` (`Tensor.scatter`). The
# dropped tokens' probabilities become 0; do not renormalize, the draw does not need it.


# %%
def filter_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """probs (batch, vocab) with the tokens the filters drop set to 0, not renormalized; one sort for the batch."""
    # BEGIN SOLUTION
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (batch, vocab)
    keep = keep_mask(sorted_probs, top_ks, top_ps, min_ps)
    keep = torch.empty_like(keep).scatter_(-1, order, keep)  # back to vocabulary order
    return probs.masked_fill(~keep, 0.0)
    # END SOLUTION


# %% [markdown]
# ## Check 4 · filter_probs
# Notebook 04's "cat sat on the" distribution, shuffled out of rank order, with top-k 3, top-p 0.8, min-p 0.1
# and no filter, then random batches against the library's `filter_probs`.

# %%
with exercise("filter_probs"):
    words = ["mat", "floor", "sofa", "bed", "chair", "roof", "table", "rug", "fence", "keyboard", "moon", "piano"]
    cat_logits = torch.tensor([4.0, 3.1, 2.6, 2.2, 1.9, 1.4, 1.2, 1.0, 0.6, 0.1, -0.5, -1.5])
    shuffle = torch.randperm(len(words), generator=torch.Generator().manual_seed(1))
    cat_probs = torch.softmax(cat_logits[shuffle], dim=-1)  # vocabulary order is no longer rank order
    rows = [(3, 1.0, 0.0), (-1, 0.8, 0.0), (-1, 1.0, 0.1), (-1, 1.0, 0.0)]
    filtered = filter_probs(cat_probs.expand(4, -1), *row_settings(rows))
    assert filtered.shape == (4, len(words)), f"expected shape (4, {len(words)}), got {tuple(filtered.shape)}"
    for (top_k, top_p, min_p), row, n_kept in zip(rows, filtered, [3, 4, 5, 12]):
        kept = sorted(words[shuffle[i]] for i in row.nonzero().flatten().tolist())
        expected = sorted(words[:n_kept])  # the n most likely words, wherever they sit in the vocabulary
        assert kept == expected, f"top_k={top_k}, top_p={top_p}, min_p={min_p}: expected {expected}, got {kept}"
        torch.testing.assert_close(row[row > 0], cat_probs[row > 0], msg="kept tokens keep their probability")
    assert torch.equal(filtered[3], cat_probs), "with every filter off, probs come back unchanged"

    gen = torch.Generator().manual_seed(2)
    for trial in range(20):
        batch, vocab = 32, 500
        probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 3, dim=-1)
        top_ks = torch.randint(0, 50, (batch,), generator=gen)
        top_ks = torch.where(top_ks == 0, -1, top_ks)  # about one row in 50 without top-k
        top_ps = torch.where(torch.rand(batch, generator=gen) < 0.3, 1.0, torch.rand(batch, generator=gen))
        min_ps = torch.rand(batch, generator=gen) * 0.3
        expected = sampler.filter_probs(probs, top_ks, top_ps, min_ps)
        got = filter_probs(probs, top_ks, top_ps, min_ps)
        differ = int(((got > 0) != (expected > 0)).sum())
        assert differ == 0, (
            f"random batch {trial}: {differ} tokens kept or dropped differently from minivllm's filter_probs "
            "(is the mask scattered back to vocabulary order?)"
        )
        assert torch.equal(got, expected), f"random batch {trial}: kept tokens must keep their probability, as is"
print("filter_probs: kept words and 20 random batches as expected")

# %% [markdown]
# ## Part 3 · The exponential race
# Notebook 04's trick: give token `i` an alarm clock that rings after `q_i / p_i`, with `q_i ~ Exp(1)`. Clock `i`
# rings first with probability `p_i / Σ_j p_j`, so `argmax(p / q)` is a draw from the renormalized `p`: no
# normalization, no `torch.multinomial` (on a GPU it makes the CPU wait), and a token with `p = 0` never wins.
#
# Draw `q` with `torch.empty_like(probs).exponential_(generator=generator)`, from the generator you are given
# (that is what makes a seeded request repeatable), and clamp it away from 0 (`clamp_min_(1e-10)`): `0 / 0` is
# NaN, and `argmax` picks a NaN.


# %%
def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of probs (batch, vocab), >= 0 and not necessarily normalized: (batch,) int64."""
    # BEGIN SOLUTION
    q = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-10)  # (batch, vocab)
    return (probs / q).argmax(dim=-1)
    # END SOLUTION


# %% [markdown]
# ## Check 5 · the draw, by sampling
# First the race itself: your tokens must be `argmax(p / q)` for the `q` the generator gives, and the same seed
# must give the same tokens. Then the statistics: a draw is right if its frequencies converge to the renormalized
# probabilities. With `n` draws, the frequency of a token of probability `p` has a standard deviation of
# `sqrt(p (1 - p) / n)`: the check allows 5 of them (a correct draw fails one of the 60 tokens checked here about
# once in 30,000 runs), and a dropped token must never come out. The rows: an unnormalized one with a dropped
# token, then your filter-and-draw on the cat distribution, against the library's filtered probabilities.


# %%
def check_frequencies(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """tokens (n,) drawn from probs (vocab,), not necessarily normalized."""
    expected, n = probs / probs.sum(), len(tokens)
    freq = torch.bincount(tokens, minlength=len(probs)).double() / n
    tolerance = 5 * (expected * (1 - expected) / n).sqrt() + 1e-12
    assert (freq[expected == 0] == 0).all(), f"{what}: a dropped token was drawn: {freq[expected == 0].tolist()}"
    worst = int(((freq - expected).abs() / tolerance).argmax())
    assert (freq - expected).abs()[worst] <= tolerance[worst], (
        f"{what}: token {worst} drawn with frequency {freq[worst]:.4f}, expected {expected[worst]:.4f} "
        f"± {tolerance[worst]:.4f} ({n} draws)"
    )


with exercise("draw"):
    p = torch.tensor([0.1, 0.0, 0.3, 0.2], dtype=torch.float64)  # sums to 0.6; token 1 dropped
    tokens = draw(p.float().expand(200_000, -1), torch.Generator().manual_seed(0))
    assert tokens.shape == (200_000,) and tokens.dtype == torch.int64, (
        f"draw should return (batch,) int64 token ids, got {tokens.dtype} {tuple(tokens.shape)}"
    )
    check_frequencies(tokens, p, "unnormalized [0.1, 0, 0.3, 0.2]")

    probs = torch.softmax(torch.randn(64, 100, generator=torch.Generator().manual_seed(5)), dim=-1)
    q = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(6))
    race = draw(probs, torch.Generator().manual_seed(6))
    assert torch.equal(race, (probs / q).argmax(dim=-1)), (
        f"{int((race != (probs / q).argmax(dim=-1)).sum())} of 64 rows differ from argmax(probs / q) with "
        "q = torch.empty_like(probs).exponential_(generator=generator): is it the exponential race?"
    )

    flat = torch.ones(8, 1000)
    a, b = (draw(flat, torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a, b), "the same generator seed gave different tokens: take the noise from `generator`"
    assert len(set(a.tolist())) > 1, f"8 rows of a uniform distribution all drew token {a[0]}: rows share noise?"

    n = 100_000
    rows = [(3, 1.0, 0.0), (-1, 0.8, 0.0), (-1, 1.0, 0.1), (5, 0.9, 0.05)]
    top_ks, top_ps, min_ps = (t.repeat_interleave(n) for t in row_settings(rows))  # n rows of each setting
    filtered = filter_probs(cat_probs.expand(len(rows) * n, -1), top_ks, top_ps, min_ps)
    tokens = draw(filtered, torch.Generator().manual_seed(3))
    expected = sampler.filter_probs(cat_probs.expand(len(rows), -1), *row_settings(rows)).double()
    for i, setting in enumerate(rows):
        check_frequencies(tokens[i * n : (i + 1) * n], expected[i], f"(top_k, top_p, min_p) = {setting}")
print("draw: frequencies match the renormalized filtered probabilities")

# %% [markdown]
# ## What's next
# Notebook 04's `Sampler` wraps these with the rest: temperature (`softmax(logits / T)`, and `T = 0` as the argmax
# of the raw logits), a flag that skips the sort when no row filters, and per-request seeds: each seeded row draws
# its noise from a generator of its own, seeded by `(seed, step)`, so a request repeats its tokens whatever
# batch it lands in.
