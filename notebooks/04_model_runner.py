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
# # 04 · The model runner: a step on the paged cache, sampling, CUDA graphs, tensor parallelism
#
# **What this notebook builds.** The part of the engine that turns a batch of `Sequence`s (notebook 03) into next
# tokens: the sampler, a step's flat inputs and slots, the attention context over notebook 03's paged kernels, KV-cache
# sizing, CUDA graphs for decode, and a runner for one tensor-parallel rank's slice (notebook 06 starts the processes).
#
# **What it assumes.** Notebook 02's Qwen3 and its `AttentionContext`, notebook 03's `Sequence`,
# `BlockManager` (block tables, slots, prefix hits) and paged kernels.
#
# **The one rule.** Every path (a prefix-cache hit, a long decode, a shuffled block table) gives the logits of
# `testing.prompt_logits`, from scratch. A paged engine that gets this wrong does not crash: it writes other text.

# %%
import os
import random
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from transformers.utils.logging import disable_progress_bar

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch.profiler (below) prints no start/stop lines
disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Sampling: from logits to the next token
# The model ends with a row of logits per sequence, a score for each of Qwen3's 151,936 tokens; the sampler turns each
# into a token id as its request's `SamplingParams` (notebook 02) say: **temperature** reshapes the distribution,
# **filters** (top-k, top-p, min-p) drop the tail, **a draw** picks from the rest. Example: "The cat sat on the".

# %%
words = ["mat", "floor", "sofa", "bed", "chair", "roof", "table", "rug", "fence", "keyboard", "moon", "piano"]
cat_logits = torch.tensor([4.0, 3.1, 2.6, 2.2, 1.9, 1.4, 1.2, 1.0, 0.6, 0.1, -0.5, -1.5])  # most likely first


def show_probs(probs: torch.Tensor, label: str) -> None:
    print(f"{label:>6}: " + " ".join(f"{w} {p:.2f}" for w, p in zip(words, probs.tolist()) if p >= 0.005))


# %% [markdown]
# ### Temperature
# Probabilities are `softmax(logits / T)`: `T` < 1 sharpens the distribution, `T` > 1 flattens it, keeping the ranking.
# Temperature 0 is the limit, **greedy**: the argmax of the raw logits, depending on nothing random nor on other rows.

# %%
probs_at = {T: torch.softmax(cat_logits / T, dim=-1) for T in (0.01, 0.25, 0.5, 1.0, 2.0)}
for T, probs in probs_at.items():
    show_probs(probs, f"T={T}")
max_probs = [probs.max().item() for probs in probs_at.values()]
assert max_probs == sorted(max_probs, reverse=True) and probs_at[0.01][0] > 0.999  # hotter is flatter; almost greedy
assert all(probs.argmax() == 0 for probs in probs_at.values())  # the ranking stays

# %% [markdown]
# ### Cutting the tail: top-k, top-p, min-p (to write yourself: `exercises/04_sampler_filters.ipynb`)
# Even a sharp distribution leaves its tail real mass: 150,000 tokens at one in a million each add up to 15%, and
# one nonsense token derails all the text after it. The filters drop the tail before the draw (vLLM's order):
#
# * **top-k** keeps the `k` most likely tokens (`-1` is off);
# * **top-p** (nucleus) keeps the smallest set of most likely tokens whose mass reaches `p` (`1` is off): few when the
#   model is sure, many when it is not, never none. It measures what top-k left, renormalized;
# * **min-p** keeps the tokens at least `min_p` times as likely as the most likely one (`0` is off); it goes last, so
#   that top-p sees top-k's mass only (vLLM v0's order; v1 applies min-p first).
#
# **One sort serves all three**: sort each row once, largest first; each filter is then one comparison of the sorted
# `(batch, vocab)` tensor with a per-row threshold, and the mask is scattered back to vocabulary order. When every
# random row has a top-k, sorting its `k` most likely tokens is enough (`torch.topk`): no sort of 151,936 entries.

# %% tags=["export"] module="minivllm.layers.sampler"
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.kernels.sampling import TOP_K_GATHERED_MAX, nucleus, race, race_ids, top_k_sample
from minivllm.sampling_params import SamplingParams


def keep_mask(sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
              min_ps: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Which tokens top-k, then top-p, then min-p keep; each row of sorted_probs is sorted largest first."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)  # (vocab,)
    keep = (top_ks[:, None] < 0) | (ranks < top_ks[:, None])  # top-k  (batch, vocab)
    cum = (sorted_probs * keep).cumsum(dim=-1)  # (batch, vocab), running mass of what top-k kept
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass of the more likely tokens
    # top-p, on top-k's renormalized distribution; p = 1 keeps all, even the tail a float32 sum no longer sees
    keep &= (before < top_ps[:, None] * cum[:, -1:]) | (top_ps[:, None] >= 1)
    keep &= sorted_probs >= min_ps[:, None] * sorted_probs[:, :1]  # min-p, relative to the most likely token
    return keep


def filter_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                 k_max: int = 0) -> torch.Tensor:  # fmt: skip
    """probs (batch, vocab) with the tokens the filters drop set to 0, not renormalized; one sort for the batch, or
    if no row keeps more than k_max tokens (its top_k; k_max > 0), only its k_max most likely: no full sort."""
    sort = probs.topk(min(k_max, probs.shape[-1])) if k_max else probs.sort(dim=-1, descending=True)
    keep = keep_mask(sort.values, top_ks, top_ps, min_ps)  # (batch, vocab or k_max)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, sort.indices, keep)  # in vocabulary order
    return probs.masked_fill(~keep, 0.0)


# %% [markdown]
# By hand, `[0.5, 0.3, 0.15, 0.05]`: top-p 0.8 stops at two tokens, as 0.5 + 0.3 *reaches* 0.8; 0.81 needs a third.
# After top-k 3, 0.5 + 0.3 is 0.84 of what is left, so top-p 0.82 keeps two, not three. Then a batch, a row per
# setting (top-k 3, top-p 0.8, min-p 0.1, none), and a picture (coloured bars are kept).

# %%
from minivllm.layers.sampler import filter_probs, keep_mask

hand = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def num_kept(top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> int:
    return int(keep_mask(hand, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])).sum())


assert num_kept() == 4 and num_kept(top_k=3) == 3 and num_kept(top_k=1) == 1  # every filter off; top-k
assert num_kept(top_p=0.8) == 2 and num_kept(top_p=0.81) == 3 and num_kept(top_p=0.01) == 1
assert num_kept(top_p=0.82) == 3 and num_kept(top_k=3, top_p=0.82) == 2  # top-p measures what top-k left
assert num_kept(min_p=0.3) == 3 and num_kept(min_p=0.31) == 2  # keep p ≥ min_p × 0.5
cat_probs = torch.softmax(cat_logits, dim=-1)
settings = dict(top_ks=[3, -1, -1, -1], top_ps=[1.0, 0.8, 1.0, 1.0], min_ps=[0.0, 0.0, 0.1, 0.0])  # a row per filter
filtered = filter_probs(cat_probs.expand(4, -1), **{name: torch.tensor(v) for name, v in settings.items()})
for name, row in zip(["top-k", "top-p", "min-p", "none"], filtered):
    show_probs(row, name)
assert (filtered > 0).sum(dim=-1).tolist() == [3, 4, 5, 12] and torch.equal(filtered[3], cat_probs)
fig, axes = plt.subplots(2, 2, figsize=(10.8, 6.2), sharey=True, layout="tight")
axes, x = axes.ravel(), torch.arange(len(words))
for T, style in ((0.5, "v--"), (2.0, "^:")):
    axes[0].plot(x, torch.softmax(cat_logits / T, dim=-1), style, color="k", label=f"T = {T}")
axes[0].bar(x, cat_probs, color="tab:blue", label="T = 1")
axes[0].set(title="temperature", ylabel="probability")
for ax, row, title in zip(axes[1:], filtered, ["top-k = 3", "top-p = 0.8", "min-p = 0.1"]):
    ax.bar(x, cat_probs, color=["tab:blue" if p > 0 else "lightgrey" for p in row.tolist()])
    ax.set_title(f"{title}: keeps {int((row > 0).sum())} of {len(words)}")
axes[2].plot(x, cat_probs.cumsum(dim=-1), ".-", color="tab:orange", label="cumulative probability")
axes[2].axhline(0.8, color="tab:orange", ls=":", label="p = 0.8")
axes[3].axhline(0.1 * cat_probs.max(), color="tab:red", ls=":", label="0.1 × max probability")
for ax in axes:
    ax.set_xticks(x, words, rotation=60)
axes[0].legend(), axes[2].legend(loc="center right"), axes[3].legend()  # top-k's panel has nothing to label
fig.suptitle('Next word after "The cat sat on the": what temperature and each filter do')
fig.savefig(FIGURES / "04_sampling.png", dpi=120)

# %% [markdown]
# ### Drawing a token: the exponential race
# `torch.multinomial` makes a GPU's host wait and draws every row from one generator (no per-row seed). Instead, give
# token `i` an exponential alarm clock ringing after `q_i / p_i` seconds, `q_i ~ Exp(1)`: clock `i` rings first with
# probability `p_i / Σ_j p_j`, so the token is `argmax(p / q)`; `p` need not sum to 1, and `p = 0` never wins.

# %%
gen, p = torch.Generator().manual_seed(0), torch.tensor([0.1, 0.0, 0.3, 0.2])  # unnormalized, one token dropped
q = torch.empty(200_000, 4).exponential_(generator=gen)  # 200,000 races: (draws, tokens)
freq = torch.bincount((p / q).argmax(dim=-1), minlength=4) / len(q)
print(f"frequencies: {freq.numpy().round(3)}, p / sum(p): {(p / p.sum()).numpy().round(3)}")
assert freq[1] == 0
torch.testing.assert_close(freq, p / p.sum(), atol=0.005, rtol=0)

# %% [markdown]
# ### Seeds: the same request, the same tokens
# `SamplingParams(seed=...)` promises the same completion whatever the scheduler does, though the batch and the row
# change every step and a preempted request (05) is recomputed elsewhere: with one generator per batch, row `r` takes the
# `r`-th slice of its stream. So each row draws from **its own generator, seeded by the row's key**: `noise_seed(seed,
# step)`, the step being the token's index (`seq.num_completion_tokens`); without a seed, a fresh draw (`LLM(seed=...)`).

# %% tags=["export"]
NOISE_SEED_MULTIPLIER = 1_000_003  # odd: distinct seeds start apart; above any step: one seed's steps never collide


def noise_seed(seed: int, step: int) -> int:
    """The generator seed for the noise of token `step` of a request seeded with `seed`."""
    return (seed * NOISE_SEED_MULTIPLIER + step) % 2**63


def exponential_noise(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise shaped like probs (batch, vocab); row r's from a generator seeded with keys[r]."""
    q = torch.empty_like(probs)
    for row, key in enumerate(keys.tolist()):
        q[row].exponential_(generator=torch.Generator(probs.device).manual_seed(key))
    return q.clamp_min_(1e-10)  # a 0 would make p / q infinite, or NaN for a dropped token


# %%
from minivllm.layers.sampler import exponential_noise, noise_seed

# seed 42 at step 7: the same noise in row 0 of one batch and row 2 of another; seed 5 at step 7, seed 42 at 8 differ
step7, step8 = exponential_noise(torch.ones(2, 1000), torch.tensor([noise_seed(42, 7), noise_seed(42, 8)]))
batch = exponential_noise(torch.ones(3, 1000), torch.tensor([123, noise_seed(5, 7), noise_seed(42, 7)]))
assert torch.equal(step7, batch[2]) and not torch.equal(batch[1], batch[2]) and not torch.equal(step7, step8)

# %% [markdown]
# ### The batch's settings as tensors
# Each step the runner gathers the batch's parameters into `SamplingTensors`, one entry per row (the sampler, like
# vLLM's, knows nothing of sequences), copied from *pinned* memory with `non_blocking=True`, each row's noise key
# among them. Host-side flags skip work: `filtering` (false: no sort, the dearest step), `all_greedy`, `any_greedy`.

# %% tags=["export"]
PENALTIES = ("presence", "frequency", "repetition")


def apply_penalties(logits, presence, frequency, repetition, prompt_ids, output_ids) -> torch.Tensor:
    """vLLM's penalties (see below) on (batch, vocab) float32 logits; token ids (batch, length), -1 padded."""
    vocab = logits.shape[-1]

    def counts(ids: torch.Tensor) -> torch.Tensor:  # (batch, vocab): occurrences of each token; padding lands past it
        ids = ids.masked_fill(ids < 0, vocab)
        zeros = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
        return zeros.scatter_add_(1, ids, torch.ones_like(ids, dtype=zeros.dtype))[:, :vocab]

    in_output, r = counts(output_ids), repetition[:, None]
    seen = (in_output + counts(prompt_ids)) > 0
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * in_output - presence[:, None] * (in_output > 0)


@dataclass(slots=True)
class SamplingTensors:
    """The batch's sampling parameters, one entry per row."""

    temperatures: torch.Tensor  # (batch,) float32; 0 = greedy
    top_ks: torch.Tensor  # (batch,) int64; -1 = off
    top_ps: torch.Tensor  # (batch,) float32; 1 = off
    min_ps: torch.Tensor  # (batch,) float32; 0 = off
    keys: torch.Tensor  # (batch,) int64: noise_seed(seed, tokens generated so far), a fresh draw; empty if all greedy
    filtering: bool = True  # some random row uses top-k, top-p or min-p; if none does, the sort is skipped
    top_k_max: int = 0  # > 0: every random row has a top-k, this the largest: filter_probs sorts only that many
    largest_top_k: int = 0  # the largest top-k of a random row, 0 if none has one (on a GPU: the candidates' slots)
    any_greedy: bool = True  # some row has temperature 0
    all_greedy: bool = False  # every row has: no random draw at all
    penalties: tuple[torch.Tensor, ...] | None = None  # apply_penalties' arguments after the logits; None: no penalty
    banned: torch.Tensor | None = None  # (2, n): rows and token ids not to draw yet (stop tokens before min_tokens)

    @classmethod
    def from_params(cls, params: list[SamplingParams], steps: list[int], device: torch.device | str = "cpu",
                    histories=None) -> "SamplingTensors":  # fmt: skip
        """One row per request: its parameters, how many tokens it has generated (seeded draws and min_tokens depend
        on it) and, when some row has a penalty, its (prompt, output) token ids in `histories`."""
        pin = torch.device(device).type == "cuda"

        def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

        def padded(rows: list[list[int]]) -> torch.Tensor:  # (batch, longest) int64, -1 after each row's end
            width = max(1, *map(len, rows))
            return to_device([row + [-1] * (width - len(row)) for row in rows], torch.int64)

        early = [(r, p.stop_token_ids or []) for r, (p, n) in enumerate(zip(params, steps)) if n < p.min_tokens]
        banned = [(r, t) for r, ids in early for t in ids]
        penalties = None
        if any(p.penalized for p in params):
            assert histories is not None, "penalties need each row's prompt and output token ids"
            values = [[getattr(p, f"{name}_penalty") for p in params] for name in PENALTIES]
            penalties = (*(to_device(v, torch.float32) for v in values), *(padded(list(h)) for h in zip(*histories)))
        temperatures = [p.temperature for p in params]
        fresh = torch.randint(2**62, (len(params),)).tolist() if any(temperatures) else []  # greedy draws no noise
        random_top_ks = [p.top_k for p in params if p.temperature > 0]
        return cls(
            temperatures=to_device(temperatures, torch.float32),
            top_ks=to_device([p.top_k for p in params], torch.int64),
            top_ps=to_device([p.top_p for p in params], torch.float32),
            min_ps=to_device([p.min_p for p in params], torch.float32),
            keys=to_device([k if p.seed is None else noise_seed(p.seed, n) for p, n, k in zip(params, steps, fresh)],
                           torch.int64),
            filtering=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in params),
            top_k_max=max(random_top_ks) if min(random_top_ks, default=-1) > 0 else 0,
            largest_top_k=max([0, *random_top_ks]),
            any_greedy=0 in temperatures, all_greedy=not any(temperatures), penalties=penalties,
            banned=to_device(list(zip(*banned)), torch.int64) if banned else None,
        )  # fmt: skip


# %%
from minivllm.engine.sequence import Sequence
from minivllm.layers.sampler import SamplingTensors
from minivllm.sampling_params import SamplingParams


def tensors_of(seqs: list[Sequence]) -> SamplingTensors:  # what the runner does for its batch
    params, steps = [s.sampling_params for s in seqs], [s.num_completion_tokens for s in seqs]
    histories = [(s.prompt_token_ids, s.completion_token_ids) for s in seqs]  # the runner: only if a row has a penalty
    return SamplingTensors.from_params(params, steps, "cpu", histories)


seqs = [Sequence([1, 2, 3], SamplingParams(temperature=0)), Sequence([4, 5], SamplingParams(top_k=20, seed=7))]
seqs[1].append_token(6)  # the second request has generated one token
print(sampling := tensors_of(seqs))
assert sampling.top_ks.dtype == torch.int64 and sampling.keys[1] == noise_seed(7, 1) and sampling.filtering
assert sampling.any_greedy and not sampling.all_greedy and not tensors_of(seqs[1:]).any_greedy
assert not tensors_of(seqs[:1]).filtering and tensors_of(seqs[:1]).all_greedy

# %% [markdown]
# ### On a GPU: the race in one pass (Triton)
# Drawn in PyTorch, a token costs several passes over all `(batch, 151,936)` logits. In logarithms the race is a sum,
# the **Gumbel-max trick**: the token is `argmax(x / T - log q)`, `q = -log u`, `u` uniform: no softmax, one read of
# the logits. `u` comes from Philox, a function of the row's key and a counter, no state: `tl.rand4x(key, c)` gives four
# numbers at once, so token `t` of a vocabulary of `n` takes number `t // s` of counter `t % s`, `s = ⌈n / 4⌉`, and a
# program reads the four columns `c, c + s, c + 2s, c + 3s` per counter: a quarter of the Philox work of one call per
# token (which took about a third of the pass on an H200; the logarithms most of the rest). So the kernel scores in
# base 2, the hardware's: `log2(e) x / T - log2(q)`, `q = -log2(u)` (the same argmax), both logarithms with the
# GPU's one-instruction approximation. Its error is absolute near 1 (2^-22): for `u` near 1, `q` is tiny and the
# error would exceed it, turning a random token's score into +inf. There (`1 - u < 0.01`) `q` comes from the series
# `-ln(1 - w) = w + w²/2 + w³/3 + …`, `w = 1 - u` (exact): every score within 3·10⁻⁵ of the exact one.
# A row is cut into parts, a program each, so that one row fills the GPU too; the best part wins. With a top-k above
# 512, `topk` gives the candidates, `keep_mask` sets the dropped to `-inf`, and `race_ids` races them with each token
# id's own number (`_noise`): the same draw as over the whole row (smaller top-k: two sections below).

# %% tags=["export"] module="minivllm.kernels.sampling"
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _noise(key, ids, s):
    """The uniform number of token ids: number ids // s of Philox counter ids % s (four numbers per counter)."""
    r0, r1, r2, r3 = tl.rand4x(key, ids % s)
    lane = ids // s
    return tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))


@triton.jit
def _fast_log2(x, FAST: tl.constexpr):
    """log2; with FAST (on a GPU) the hardware's approximation: within 2^-22 for x in [0.5, 2], 2 ulp elsewhere (the
    interpreter has no libdevice)."""
    if FAST:
        y = libdevice.fast_log2f(x)
    else:
        y = tl.math.log2(x)
    return y


@triton.jit
def _neg_log2(u, FAST: tl.constexpr):
    """-log2(u) for u in [0, 1), to a relative 2e-5: near 1, where log2's absolute error (2^-22) would exceed the
    result, from the series -ln(1 - w) = w + w^2/2 + w^3/3 + ..., w = 1 - u (exact)."""
    w = 1.0 - u
    return tl.where(w < 0.01, w * LOG2E * (1.0 + w * (0.5 + w * 0.33333334)), -_fast_log2(u, FAST))


@triton.jit
def _better(x, u, t, cols, best, best_col, FAST: tl.constexpr):
    """Each lane's best score so far (the first column on ties), given logits x of columns cols, noise u."""
    if t > 0:  # the Gumbel score in base 2: log2(e) x / T - log2(q), q = -log2(u); temperature 0: the logit itself
        x = x * (LOG2E / t) - _fast_log2(_neg_log2(u, FAST), FAST)
    better = (x > best) | ((x == best) & (cols < best_col))
    return tl.where(better, x, best), tl.where(better, cols, best_col)


@triton.jit
def _lane(X, n, s, c, lane, u, t, lo, incl, best, best_col, top, FAST: tl.constexpr):
    """Counters c's columns in lane `lane` (c + lane * s), where > lo (or equal, if incl), into the race."""
    cols = c + lane * s
    x = tl.load(X + cols, mask=(cols < n) & (c < s), other=float("-inf")).to(tl.float32)
    kept = tl.where((x > lo) | ((x == lo) & (incl != 0)), x, float("-inf"))
    best, best_col = _better(kept, u, t, cols, best, best_col, FAST)
    return best, best_col, tl.maximum(top, x)


@triton.jit
def _draw(X, n, s, t, key, lo, incl, start, end, offset, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """The race among the logits > lo (>= lo if incl) of counters start..end, each counter's four columns, the noise
    at counter + offset: (the best score, its column, the largest logit)."""
    best, best_col = tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.int32)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for first in range(start, end, BLOCK):
        c = first + tl.arange(0, BLOCK)
        r0, r1, r2, r3 = tl.rand4x(key, c + offset)  # one Philox call, four tokens' numbers
        best, best_col, top = _lane(X, n, s, c, 0, r0, t, lo, incl, best, best_col, top, FAST)
        best, best_col, top = _lane(X, n, s, c, 1, r1, t, lo, incl, best, best_col, top, FAST)
        best, best_col, top = _lane(X, n, s, c, 2, r2, t, lo, incl, best, best_col, top, FAST)
        best, best_col, top = _lane(X, n, s, c, 3, r3, t, lo, incl, best, best_col, top, FAST)
    score = tl.max(best, axis=0)
    return score, tl.min(tl.where(best == score, best_col, n), axis=0), tl.max(top, axis=0)


@triton.jit(do_not_specialize=["offset"])
def _race_kernel(X, TEMPS, KEYS, LO, INCL, SEARCHING, BEST, WON, TOP, n, stride, span, offset,
                 BLOCK: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    row, part, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)  # part: counters part * span, + span
    t, key, X, s = tl.load(TEMPS + row), tl.load(KEYS + row), X + row.to(tl.int64) * stride, tl.cdiv(n, 4)
    lo, incl = t * 0 - float("inf"), 1  # no floor
    if SEARCHING is not None:  # nucleus's retries (below): only rows still searching, above their floor
        if tl.load(SEARCHING + row) == 0:
            return
        lo, incl = tl.load(LO + row), tl.load(INCL + row)
    start, end = part * span, tl.minimum(part * span + span, s)
    score, col, top = _draw(X, n, s, t, key, lo, incl, start, end, offset, BLOCK, FAST)
    tl.store(BEST + row * parts + part, score)
    tl.store(WON + row * parts + part, col)
    tl.store(TOP + row * parts + part, top)  # the part's largest logit (nucleus, below, needs the row's)


@triton.jit
def _race_ids_kernel(X, IDS, TEMPS, KEYS, WON, n, s, stride, BLOCK: tl.constexpr, FAST: tl.constexpr):
    row = tl.program_id(0)
    t, key = tl.load(TEMPS + row), tl.load(KEYS + row)
    X, IDS = X + row.to(tl.int64) * stride, IDS + row.to(tl.int64) * stride
    best, best_col = tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        ids = tl.load(IDS + cols, mask=cols < n, other=0).to(tl.int32)
        best, best_col = _better(x, _noise(key, ids, s), t, cols, best, best_col, FAST)
    tl.store(WON + row, tl.load(IDS + tl.min(tl.where(best == tl.max(best, axis=0), best_col, n), axis=0)))


def block_of(n: int) -> int:
    return min(triton.next_power_of_2(n), 4096)


Retry = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per row: floor lo, incl (>= lo), searching (0/1)


def row_parts(length: int, block: int, rows: int) -> tuple[int, int]:
    """A row of `length` cut into parts of whole blocks, ~2,048 programs over all rows: (span, parts)."""
    span = block * triton.cdiv(triton.cdiv(length, block), max(1, 2048 // rows))
    return span, triton.cdiv(length, span)


def race_parts(x: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, retry: Retry | None = None,
               offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The race in parts of each row, a program each: per (row, part), the best score, its column, the largest
    logit. (rows, parts) each. With `retry`, only the searching rows, among their logits above the floor, with the
    numbers of counters + offset (a new try's)."""
    assert x.stride(1) == 1
    (rows, n), block = x.shape, 512
    span, parts = row_parts(triton.cdiv(n, 4), block, rows)  # in counters: four columns each
    best, top = torch.empty(rows, parts, device=x.device), torch.empty(rows, parts, device=x.device)
    won = torch.empty(rows, parts, dtype=torch.int64, device=x.device)
    _race_kernel[(rows, parts)](x, temperatures, keys, *(retry or (None,) * 3), best, won, top, n, x.stride(0), span,
                                offset, BLOCK=block, FAST=x.is_cuda)  # fmt: skip
    return best, won, top


def race(x: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row of x (rows, vocab): the argmax where the temperature is 0, else a draw from softmax(x / T), its noise
    keyed by (keys[row], token id). Returns (rows,) int64."""
    best, won, _ = race_parts(x, temperatures, keys)
    firsts = won.masked_fill(best < best.max(dim=1, keepdim=True).values, x.shape[1])  # the best parts' first column
    return firsts.amin(dim=1)


def race_ids(x: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, vocab: int):
    """race among candidates: x (rows, n) their logits, ids (rows, n) their token ids in a vocabulary of `vocab`;
    the same noise per token id as race over the whole row. Returns (rows,) int64 token ids."""
    assert x.stride(1) == 1 and ids.stride() == x.stride()
    won = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _race_ids_kernel[(x.shape[0],)](x, ids, temperatures, keys, won, x.shape[1], triton.cdiv(vocab, 4), x.stride(0),
                                    BLOCK=block_of(x.shape[1]), FAST=x.is_cuda)  # fmt: skip
    return won


# %% [markdown]
# ### Top-p without a sort: draw, then check
# The nucleus is an *upper set*: with a token, it holds every more likely one. So draw from all tokens, then check the
# draw in one pass: it is in the nucleus if the tokens more likely than it hold less than `p` of the mass. If not,
# neither is any token at or below it: draw again, with fresh noise, among those above (min-p alike: above its floor).
# The draws that pass follow the renormalized nucleus exactly (rejection sampling), and each try passes with
# probability `p` at least: at most `1 / p` tries on average (1.1 at `p = 0.9`), two passes each, instead of a sort.
# The tries run in parts, a program each, as the race does (one program per row would leave most of the GPU idle):
# the race's parts, then each part's masses, then one program per row adds them up and checks. A rejected row tries
# again in parts (the programs of rows already done return at once); only a row rejected
# `NUCLEUS_TRIES_IN_PARTS = 5` times (with top-p alone at most `(1 - p)^5`, 1 in 100,000 at `p = 0.9`) goes on
# alone, in one program, which reads its whole row while the batch waits; an empty try's programs only return. With
# fewer than 32 rows the GPU has time to spare and the host, which launches 3 kernels a try, does not: there only
# the first try runs in parts.


# %% tags=["export"]
@triton.jit
def _masses(X, lo, hi, n, t, m, drawn, BLOCK: tl.constexpr):
    """The sums of exp((x - m) / t) over the logits x > drawn and over all, of columns lo..hi-1: the softmax's mass
    above, its denominator (unnormalized)."""
    above, total = tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        e = tl.exp((x - m) / t)
        above, total = above + tl.where(x > drawn, e, 0.0), total + e
    return tl.sum(above, axis=0), tl.sum(total, axis=0)


@triton.jit
def _row_parts(P, row, parts, other, PARTS: tl.constexpr):
    """A row's entries of a (rows, parts) array, padded to PARTS with `other`."""
    offs = tl.arange(0, PARTS)
    return tl.load(P + row * parts + offs, mask=offs < parts, other=other)


@triton.jit
def _parts_draw(BEST, WON, TOP, row, parts, n, PARTS: tl.constexpr):
    """The race's winner over a row's parts (the first column on ties) and the row's largest logit."""
    best = _row_parts(BEST, row, parts, float("-inf"), PARTS)
    won = _row_parts(WON, row, parts, n, PARTS).to(tl.int32)
    col = tl.min(tl.where(best == tl.max(best, axis=0), won, n), axis=0)
    return col, tl.max(_row_parts(TOP, row, parts, float("-inf"), PARTS), axis=0)


@triton.jit(do_not_specialize=["span"])  # varies with the batch: one compiled kernel for all (notebook 01)
def _masses_kernel(X, TEMPS, BEST, WON, TOP, SEARCHING, ABOVE, TOTAL, n, stride, span,
                   PARTS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Part `part` (columns part * span, + span) of _masses, for the race's draw: into ABOVE and TOTAL."""
    row, part, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    if tl.load(SEARCHING + row) == 0:
        return
    t, X = tl.load(TEMPS + row), X + row.to(tl.int64) * stride
    col, m = _parts_draw(BEST, WON, TOP, row, parts, n, PARTS)
    drawn = tl.load(X + col).to(tl.float32)
    lo = part * span
    above, total = _masses(X, lo, tl.minimum(lo + span, n), n, tl.where(t > 0, t, 1.0), m, drawn, BLOCK)
    tl.store(ABOVE + row * parts + part, above)
    tl.store(TOTAL + row * parts + part, total)


@triton.jit
def _verdict(x, m, t, p, min_p, above, total):
    """Whether to draw again after drawing logit x (above, total: _masses'), and above what: (again, lo, incl)."""
    floor = tl.where(min_p > 0, m + t * tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))  # min-p: x >= it
    in_nucleus = (p >= 1) | (above < p * total) | (above == 0)
    again = (t > 0) & ((x < floor) | (in_nucleus == 0))
    return again, tl.where(x < floor, floor, x), (x < floor).to(tl.int32)


@triton.jit(do_not_specialize=["parts"])
def _verdict_kernel(X, TEMPS, TOP_PS, MIN_PS, BEST, WON, TOP, ABOVE, TOTAL, LO, INCL, SEARCHING, OUT, n, stride, parts,
                    PARTS: tl.constexpr):  # fmt: skip
    """A searching row's draw (in parts) checked: OUT its token; if rejected, still SEARCHING above LO (INCL)."""
    row = tl.program_id(0)
    if tl.load(SEARCHING + row) == 0:
        return
    t, p, min_p, X = tl.load(TEMPS + row), tl.load(TOP_PS + row), tl.load(MIN_PS + row), X + row.to(tl.int64) * stride
    col, m = _parts_draw(BEST, WON, TOP, row, parts, n, PARTS)
    above = tl.sum(_row_parts(ABOVE, row, parts, 0.0, PARTS), axis=0)
    total = tl.sum(_row_parts(TOTAL, row, parts, 0.0, PARTS), axis=0)
    again, lo, incl = _verdict(tl.load(X + col).to(tl.float32), m, t, p, min_p, above, total)
    tl.store(OUT + row, col)
    tl.store(SEARCHING + row, again.to(tl.int32))
    tl.store(LO + row, lo)
    tl.store(INCL + row, incl)


@triton.jit(do_not_specialize=["offset"])
def _nucleus_kernel(X, TEMPS, TOP_PS, MIN_PS, KEYS, LO, INCL, SEARCHING, OUT, n, stride, offset,
                    BLOCK: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """The rare row still searching after the tries in parts: draws again, alone, until a draw passes."""
    row = tl.program_id(0)
    searching = tl.load(SEARCHING + row) != 0
    if searching == 0:
        return
    t, p, min_p, key = tl.load(TEMPS + row), tl.load(TOP_PS + row), tl.load(MIN_PS + row), tl.load(KEYS + row)
    X, s = X + row.to(tl.int64) * stride, tl.cdiv(n, 4)
    lo, incl, col = tl.load(LO + row), tl.load(INCL + row), row * 0
    offset += row * 0  # the next try's counters (the loop's state as tensors: a while loop carries tensors)
    while searching:  # a draw among x > lo (>= lo if incl); rejected: the kept tokens all lie above it
        _, col, m = _draw(X, n, s, t, key, lo, incl, 0, s, offset, BLOCK, FAST)
        x = tl.load(X + col).to(tl.float32)
        above, total = _masses(X, 0, n, n, tl.where(t > 0, t, 1.0), m, x, 4 * BLOCK)
        searching, lo, incl = _verdict(x, m, t, p, min_p, above, total)
        offset += s
    tl.store(OUT + row, col)


NUCLEUS_TRIES_IN_PARTS = 5  # P(a row needs more) <= (1 - p)^5 with top-p alone: 1e-5 at top-p 0.9
NUCLEUS_PARTS_MIN_ROWS = 32  # fewer rows: only the first try in parts (each try is 3 launches of host time)


def nucleus(x: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
            keys: torch.Tensor, wanted: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Per row of x (rows, vocab): the argmax where the temperature is 0, else a draw from softmax(x / T) with top-p
    then min-p applied (keep_mask's order); the first try is race's draw. wanted (rows,) bool: only those rows, the
    others' tokens left unset (default: all). Returns (rows,) int64."""
    (rows, n), s, block = x.shape, triton.cdiv(x.shape[1], 4), 1024
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    lo = torch.full((rows,), float("-inf"), device=x.device)  # every row searches, above no floor
    incl = torch.ones(rows, dtype=torch.int32, device=x.device)
    searching = incl.clone() if wanted is None else wanted.to(torch.int32)
    retry = (lo, incl, searching)
    pad = max(2, triton.next_power_of_2(triton.cdiv(s, 512)))  # room for a row alone's parts (the most)
    tries = NUCLEUS_TRIES_IN_PARTS if rows >= NUCLEUS_PARTS_MIN_ROWS else 1
    for attempt in range(tries):  # try i: the numbers of counters + i * s, fresh ones
        best, won, top = race_parts(x, temperatures, keys, retry, offset=attempt * s)
        parts = best.shape[1]
        above, total = torch.empty_like(best), torch.empty_like(best)
        _masses_kernel[(rows, parts)](x, temperatures, best, won, top, searching, above, total, n, x.stride(0),
                                      block * triton.cdiv(triton.cdiv(n, parts), block), PARTS=pad, BLOCK=block)  # fmt: skip
        _verdict_kernel[(rows,)](x, temperatures, top_ps, min_ps, best, won, top, above, total, *retry, out, n,
                                 x.stride(0), parts, PARTS=pad)  # fmt: skip
    _nucleus_kernel[(rows,)](x, temperatures, top_ps, min_ps, keys, *retry, out, n, x.stride(0),
                             tries * s, BLOCK=min(1024, triton.next_power_of_2(s)), FAST=x.is_cuda,
                             num_warps=16)  # fmt: skip
    return out


# %%
from minivllm.kernels.sampling import nucleus, race


def rows_of(value: float, n: int) -> torch.Tensor:  # a (n,) setting on the kernels' device
    return torch.full((n,), value, device=DEVICE)


keys, cat = torch.arange(256, device=DEVICE), cat_logits.to(DEVICE)  # 256 rows with their own keys; CPU: interpreted
freq = torch.bincount(race(cat.expand(256, -1), rows_of(0.5, 256), keys).cpu(), minlength=len(words)) / 256
show_probs(freq, "race")
torch.testing.assert_close(freq, torch.softmax(cat_logits / 0.5, dim=-1), atol=0.1, rtol=0)
assert race(cat[None], rows_of(0, 1), keys[:1]).item() == 0  # temperature 0: the argmax, "mat"
# T = 1, top-p 0.7: "mat" 0.46 + "floor" 0.19 < 0.7, so "sofa" (0.11) is in the nucleus, "bed" is not
drawn = nucleus(cat.expand(128, -1), rows_of(1, 128), rows_of(0.7, 128), rows_of(0, 128), keys[:128]).cpu()
show_probs(freq := torch.bincount(drawn, minlength=len(words)) / 128, "top-p")
assert set(drawn.tolist()) == {0, 1, 2}
torch.testing.assert_close(freq[:3], torch.softmax(cat_logits[:3], dim=-1), atol=0.1, rtol=0)  # renormalized

# %% [markdown]
# ### Top-k without a sort: a floor from the lanes' maxima
# With a top-k the kept tokens are few (`k` of 151,936), so find them and race only them. A sort finds them, but
# `torch.topk` of 50 took 0.63 ms of an H200 at batch 256, six times the race's one pass. One pass gives a **floor**
# at or below the `k`-th largest logit: split the row into 1,024 *lanes* (column `c` in lane `c % 1024`) and take
# each lane's maximum; the `k` largest maxima are `k` distinct logits, so at least `k` logits are at or above the
# `k`-th of them. A second pass gathers the logits at or above the floor, the **candidates** (1.02–1.4 × `k` on
# random rows, below), into `2k` slots per row; one program per row then sorts them (largest first, the lowest id
# first on ties: what a sort of the whole row would give), applies `keep_mask`'s rules and races the kept ones with
# each token id's number, as `race_ids` does. A row with more candidates than slots (many ties, most logits `-inf`)
# finds its `k`-th logit alone, by bisection on the bits of the float (32 passes), and gathers the logits above it,
# then its ties lowest id first: the same tokens, slower.


# %% tags=["export"]
@triton.jit
def _ordered(x):
    """float32 -> int32 in the same order (-0 just below +0)."""
    i = x.to(tl.int32, bitcast=True)
    return tl.where(i >= 0, i, i ^ 0x7FFFFFFF)


@triton.jit
def _candidate_key(x, cols):
    """int64 sort keys: the logit's order, then the lower column first (descending sort)."""
    return (_ordered(x).to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _no_top_k(TEMPS, TOP_KS, row):
    """Whether a row is random without a top-k: the nucleus's (in a batch mixing them), skipped here."""
    return (tl.load(TOP_KS + row) <= 0) & (tl.load(TEMPS + row) > 0)


@triton.jit(do_not_specialize=["span"])
def _lane_max_kernel(X, TEMPS, TOP_KS, MAXIMA, n, stride, span, LANES: tl.constexpr):
    """Part `part` (columns part * span, + span) of a row: per lane (column % LANES), its largest logit."""
    row, part, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    X, lanes = X + row.to(tl.int64) * stride, tl.arange(0, LANES)
    best = tl.full([LANES], float("-inf"), tl.float32)
    for start in range(part * span, tl.minimum(part * span + span, n), LANES):
        best = tl.maximum(best, tl.load(X + start + lanes, mask=start + lanes < n, other=float("-inf")).to(tl.float32))
    tl.store(MAXIMA + (row * parts + part) * LANES + lanes, best)


@triton.jit
def _kth_order(orders, k):
    """The k-th largest of a block of orders (_ordered's), by bisection on the int32 range: 32 steps."""
    lo, hi = tl.full((), -(2**31), tl.int64), tl.full((), 2**31 - 1, tl.int64)  # the k-th lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((orders >= mid).to(tl.int32), axis=0) >= k
        lo, hi = tl.where(enough, mid, lo), tl.where(enough, hi, mid - 1)
    return lo


@triton.jit
def _floor_kernel(MAXIMA, TEMPS, TOP_KS, FLOOR, parts, LANES: tl.constexpr):
    """A row's floor (as an order): the k-th largest of its lanes' maxima (k = 1 without a top-k: a greedy row)."""
    row, lanes = tl.program_id(0), tl.arange(0, LANES)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    best = tl.full([LANES], float("-inf"), tl.float32)
    for part in range(parts):
        best = tl.maximum(best, tl.load(MAXIMA + (row * parts + part) * LANES + lanes))
    k = tl.load(TOP_KS + row)
    tl.store(FLOOR + row, _kth_order(_ordered(best), tl.where(k > 0, k, 1)).to(tl.int32))


@triton.jit(do_not_specialize=["span"])
def _gather_kernel(X, TEMPS, TOP_KS, FLOOR, COUNT, CAND, n, stride, span, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Part `part` of a row: its logits at or above the floor, as sort keys, into the row's next free slots (COUNT
    counts them)."""
    row, part = tl.program_id(0), tl.program_id(1)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    X, floor, cols = X + row.to(tl.int64) * stride, tl.load(FLOOR + row), tl.arange(0, BLOCK)
    for start in range(part * span, tl.minimum(part * span + span, n), BLOCK):
        x = tl.load(X + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
        take = ((_ordered(x) >= floor) & (start + cols < n)).to(tl.int32)
        if tl.sum(take, axis=0) > 0:
            slots = tl.atomic_add(COUNT + row, tl.sum(take, axis=0)) + tl.cumsum(take, axis=0) - 1
            tl.store(CAND + row * CAP + slots, _candidate_key(x, start + cols), mask=(take != 0) & (slots < CAP))


@triton.jit
def _append(X, n, CAND, count, lo, hi, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The logits with lo <= _ordered(x) <= hi, lowest column first, into slots count, ... (< CAP): the new count."""
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        take = ((_ordered(x) >= lo) & (_ordered(x) <= hi) & (cols < n)).to(tl.int32)
        slots = count + tl.cumsum(take, axis=0) - 1
        tl.store(CAND + slots, _candidate_key(x, cols), mask=(take != 0) & (slots < CAP))
        count += tl.sum(take, axis=0)
    return tl.minimum(count, CAP)


@triton.jit
def _exact_candidates(X, n, k, CAND, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """A row's k-th largest logit by _kth_order's bisection over the whole row (32 passes), then the
    logits above it and its ties, lowest column first, into CAND: how many (<= CAP; CAP >= 2k: the k kept are in)."""
    lo, hi = tl.full((), -(2**31), tl.int64), tl.full((), 2**31 - 1, tl.int64)
    while lo < hi:
        mid, count = (lo + hi + 1) >> 1, tl.full((), 0, tl.int32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
            count += tl.sum(((_ordered(x) >= mid) & (cols < n)).to(tl.int32), axis=0)
        lo, hi = tl.where(count >= k, mid, lo), tl.where(count >= k, hi, mid - 1)
    count = _append(X, n, CAND, tl.full((), 0, tl.int32), lo + 1, 2**31 - 1, CAP, BLOCK)  # above the k-th: < k
    return _append(X, n, CAND, count, lo, lo, CAP, BLOCK)  # its ties


@triton.jit
def _top_k_kernel(X, TEMPS, TOP_KS, TOP_PS, MIN_PS, KEYS, COUNT, CAND, OUT, n, stride,
                  CAP: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """A row's draw among its candidates: sorted, keep_mask's rules (top-k, top-p on what it left, min-p), the race
    with each token id's number; temperature 0: the largest, lowest id first."""
    row, slots = tl.program_id(0), tl.arange(0, CAP)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    X, CAND, k, count = X + row.to(tl.int64) * stride, CAND + row * CAP, tl.load(TOP_KS + row), tl.load(COUNT + row)
    if count > CAP:  # the rare row whose candidates overflowed: its exact ones
        count = _exact_candidates(X, n, tl.maximum(k, 1), CAND, CAP, BLOCK)
        tl.debug_barrier()  # the program's own stores, visible to all its threads
    keys = tl.sort(tl.load(CAND + slots, mask=slots < count, other=-(2**63)), 0, descending=True)
    valid = slots < count
    ids = tl.where(valid, 0x7FFFFFFF - (keys - ((keys >> 32) << 32)).to(tl.int32), 0)  # the keys' low halves
    t, p, min_p = tl.load(TEMPS + row), tl.load(TOP_PS + row), tl.load(MIN_PS + row)
    z = tl.load(X + ids, mask=valid, other=float("-inf")).to(tl.float32) * (LOG2E / tl.where(t > 0, t, 1.0))
    e = tl.math.exp2(z - tl.max(z, axis=0))  # relative to the most likely: 1 there
    kept = (k < 0) | (slots < k)  # top-k
    mass = tl.where(kept, e, 0.0)
    kept &= tl.cumsum(mass, axis=0) - mass < tl.where(p < 1, p * tl.sum(mass, axis=0), float("inf"))  # top-p
    kept &= valid & (e >= min_p)  # min-p
    u = _noise(tl.load(KEYS + row), ids, tl.cdiv(n, 4))
    score = tl.where(kept, z - _fast_log2(_neg_log2(u, FAST), FAST), float("-inf"))
    won = tl.min(tl.where(score == tl.max(score, axis=0), slots, CAP), axis=0)
    tl.store(OUT + row, tl.sum(tl.where(slots == tl.where(t > 0, won, 0), ids, 0), axis=0).to(tl.int64))


TOP_K_GATHERED_MAX = 512  # top-k up to here: candidates from the lanes' maxima; above: a sort (Sampler)


def top_k_sample(x: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                 min_ps: torch.Tensor, keys: torch.Tensor, k_max: int, cap: int = 0) -> torch.Tensor:  # fmt: skip
    """Per row of x (rows, vocab): the argmax where the temperature is 0, else a draw from softmax(x / T) with
    top-k, top-p, min-p applied (keep_mask's rules), top-k at most k_max (<= 512). A random row without a top-k is
    skipped, its token left unset (the nucleus's). cap: candidate slots per row (default 2 k_max, a power of two).
    Returns (rows,) int64."""
    (rows, n), lanes = x.shape, min(1024, triton.next_power_of_2(x.shape[1]))  # fewer lanes than k: floor -inf
    assert x.stride(1) == 1 and 0 < k_max <= TOP_K_GATHERED_MAX
    cap = cap or triton.next_power_of_2(2 * k_max)
    span, parts = row_parts(n, lanes, rows)
    maxima = torch.empty(rows, parts, lanes, device=x.device)
    _lane_max_kernel[(rows, parts)](x, temperatures, top_ks, maxima, n, x.stride(0), span, LANES=lanes)
    floor = torch.empty(rows, dtype=torch.int32, device=x.device)
    count = torch.zeros_like(floor)
    _floor_kernel[(rows,)](maxima, temperatures, top_ks, floor, parts, LANES=lanes)
    candidates = torch.empty(rows, cap, dtype=torch.int64, device=x.device)
    _gather_kernel[(rows, parts)](x, temperatures, top_ks, floor, count, candidates, n, x.stride(0), span, CAP=cap,
                                  BLOCK=lanes)  # fmt: skip
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _top_k_kernel[(rows,)](x, temperatures, top_ks, top_ps, min_ps, keys, count, candidates, out, n, x.stride(0),
                           CAP=cap, BLOCK=2048, FAST=x.is_cuda, num_warps=8)  # fmt: skip
    return out


# %%
from minivllm.kernels.sampling import top_k_sample

rows = torch.randn(64, 151_936, generator=torch.Generator().manual_seed(0))  # 64 random rows of Qwen3's vocabulary
maxima = torch.nn.functional.pad(rows, (0, -151_936 % 1024), value=float("-inf")).view(64, -1, 1024).amax(dim=1)
for k in (50, 256, 512):  # how many logits reach the floor, the k-th largest of the 1,024 lanes' maxima
    candidates = (rows >= maxima.sort(dim=1, descending=True).values[:, k - 1 : k]).sum(dim=1)
    print(f"top-k {k}: {candidates.float().mean():.0f} candidates on average, at most {candidates.max()}")
    assert (candidates >= k).all() and (candidates <= 2 * k).all()  # every row's top-k among them, in 2k slots
# The cat at T = 1, top-k 2: "mat" and "floor", renormalized; a greedy row: "mat"
drawn = top_k_sample(cat.expand(128, -1), rows_of(1, 128), rows_of(2, 128).long(), rows_of(1, 128), rows_of(0, 128),
                     keys[:128], k_max=2).cpu()  # fmt: skip
show_probs(freq := torch.bincount(drawn, minlength=len(words)) / 128, "top-k")
assert set(drawn.tolist()) == {0, 1}
torch.testing.assert_close(freq[:2], torch.softmax(cat_logits[:2], dim=-1), atol=0.1, rtol=0)

# %% [markdown]
# ### The sampler
# Greedy rows take the logits' argmax (temperature 0 in the race, else a final `torch.where`): no other row changes
# them. First vLLM's knobs edit the logits (`apply_penalties`): `repetition_penalty` divides a positive logit
# (multiplies a negative one) of each token already in prompt or reply, `frequency_penalty` subtracts per use in the
# reply, `presence_penalty` once; before `min_tokens`, stop tokens get `-inf`. Log-probabilities: of the raw logits.
# On a GPU each row takes the cheapest exact path for its filters: none, the race; top-p or min-p, the nucleus; a
# top-k up to 512, its candidates (in a batch where some random rows have none, those rows take the nucleus: one
# `torch.where`); a larger top-k, `topk` or, beside rows without one, a sort of the whole row.


# %% tags=["export"] module="minivllm.layers.sampler"
class Sampler(nn.Module):
    """One token id per row of logits: the argmax where temperature is 0, else a draw from the filtered distribution."""

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:  # logits: (batch, vocab)
        if t.penalties is not None:
            logits = apply_penalties(logits.float(), *t.penalties)
        if t.banned is not None:  # a new tensor: the caller's logits stay as they were
            logits = logits.index_put((t.banned[0], t.banned[1]), torch.tensor(float("-inf"), device=logits.device))
        if t.all_greedy:
            return logits.argmax(dim=-1)
        if logits.is_cuda and not t.filtering:  # one pass; greedy rows too (temperature 0)
            return race(logits, t.temperatures, t.keys)
        if logits.is_cuda and not t.largest_top_k:  # top-p, min-p: draw, check, draw again if outside
            return nucleus(logits, t.temperatures, t.top_ps, t.min_ps, t.keys)
        if logits.is_cuda and t.largest_top_k <= TOP_K_GATHERED_MAX:  # top-k rows: their candidates
            drawn = top_k_sample(logits, t.temperatures, t.top_ks, t.top_ps, t.min_ps, t.keys, t.largest_top_k)
            if t.top_k_max:  # every random row has a top-k
                return drawn
            others = (t.top_ks <= 0) & (t.temperatures > 0)  # random rows without one: the nucleus's
            return torch.where(others, nucleus(logits, t.temperatures, t.top_ps, t.min_ps, t.keys, others), drawn)
        greedy = t.temperatures == 0  # (batch,)
        temperatures = torch.where(greedy, 1.0, t.temperatures)[:, None]  # (batch, 1) float32
        if logits.is_cuda:  # the candidates, largest first: the k_max most likely, or (top-k on some rows) all
            top = logits.topk(t.top_k_max) if t.top_k_max else logits.sort(dim=-1, descending=True)
            scaled = top.values.float() / temperatures  # (batch, candidates)
            scaled.masked_fill_(~keep_mask(torch.softmax(scaled, dim=-1), t.top_ks, t.top_ps, t.min_ps), float("-inf"))
            sampled = race_ids(scaled, torch.ones_like(t.temperatures), t.keys, top.indices, logits.shape[-1])
        else:
            probs = torch.softmax(logits / temperatures, dim=-1)  # (batch, vocab) float32
            if t.filtering:
                probs = filter_probs(probs, t.top_ks, t.top_ps, t.min_ps, t.top_k_max)
            sampled = probs.div_(exponential_noise(probs, t.keys)).argmax(dim=-1)  # (batch,)
        return torch.where(greedy, logits.argmax(dim=-1), sampled) if t.any_greedy else sampled


TokenLogprobs = dict[int, tuple[float, int]]  # token id -> (log-probability, rank); rank 1 is the most likely


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Each row's chosen token, then its k most likely tokens, under the raw distribution: the log-softmax of the
    model's logits, before temperature, penalties and filters (what vLLM returns). logits: (rows, vocab)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (rows, vocab)
    chosen = logprobs.gather(-1, token_ids[:, None])  # (rows, 1)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # (rows,): how many tokens are more likely, plus one
    top = logprobs.topk(max(ks), dim=-1)  # (rows, max k)
    rows = zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks, top.indices.tolist(), top.values.tolist(), ks)
    return [{t: (lp, r)} | {i: (v, j + 1) for j, (i, v) in enumerate(zip(ids[:k], vs[:k]))}
            for t, lp, r, ids, vs, k in rows]  # fmt: skip


# %%
from minivllm.layers.sampler import Sampler, logprobs_of

sampler = Sampler()
torch.manual_seed(0)
for T in (1.0, 0.5):  # 20,000 rows of the cat distribution draw words as often as softmax(logits / T) says
    many = [Sequence([0], SamplingParams(temperature=T)) for _ in range(20_000)]
    tokens = sampler(cat_logits.expand(len(many), -1), tensors_of(many))
    freq = torch.bincount(tokens, minlength=len(words)) / len(tokens)
    show_probs(freq, f"T={T}")
    torch.testing.assert_close(freq, torch.softmax(cat_logits / T, dim=-1), atol=0.01, rtol=0)
mixed = [Sequence([0], SamplingParams(temperature=T, top_p=0.5)) for T in (0.0, 1.5, 0.0, 3.0)]
assert sampler(cat_logits.expand(4, -1), tensors_of(mixed))[[0, 2]].tolist() == [0, 0]  # greedy rows say "mat"
penalized = Sequence([0], SamplingParams(temperature=0, repetition_penalty=2.0, min_tokens=2, stop_token_ids=[1]))
penalized.append_token(0)  # "mat" said once: 4.0 / 2 is below "floor"'s 3.1, but "floor" stops it before 2 tokens
assert sampler(cat_logits[None], tensors_of([penalized])).tolist() == [2]  # so: "sofa"
print(row := logprobs_of(cat_logits[None], torch.tensor([2]), [2])[0])  # "sofa": its (log-prob, rank); the top 2
assert list(row) == [2, *cat_logits.topk(2).indices.tolist()] and row[2][1] == 1 + (cat_logits > cat_logits[2]).sum()

# %% [markdown]
# ## A forward pass over the paged cache
# Notebook 02's attention layers hand `q`, `k`, `v` to an `AttentionContext`, so paging is one new context,
# built once per step. Each layer's cache hangs on its `Attention` module (`k_cache`, `v_cache`).
#
# * **prefill**: store the new tokens' `k`, `v` into their slots; with no prefix-cache hit in the batch, attend over the
#   new `k`, `v` directly (notebook 01's kernel), else through the block tables over cached prefix + new tokens;
# * **decode**: store each sequence's one new token, then the decode kernel over each whole cache (given leading
#   blocks that many rows share, `prefix_blocks` and `prefix_lens`, it reads them once: notebook 03's cascade);
# * **mixed** (notebook 05's steps of both kinds, decode rows first): the decode kernel for those rows, the prefill
#   kernel for the rest, into one output. The prefill kernel alone would be right too, but slow: each one-token query
#   would fill a tile of 64 query rows, 63 of them padding, and its keys would not be split across programs. To
#   write yourself: `exercises/04_mixed_attention.ipynb`.

# %% tags=["export"] module="minivllm.attention.paged"
from dataclasses import dataclass

import torch

from minivllm import kernels  # kernels.flash_attn_varlen_func: imported on first use, on a GPU
from minivllm.attention.layer import Attention
from minivllm.kernels.paged_attn import flash_attn_with_kvcache, store_kvcache
from minivllm.kernels.paged_reference import paged_attention_ref, store_kvcache_ref
from minivllm.kernels.reference import attention_ref


@dataclass(slots=True)
class PagedContext:
    """How one step attends: which tokens are new, where their KV goes, and which cached KV they read."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # (num_tokens,): cache slot of each new token's KV; -1 = padding
    block_tables: torch.Tensor | None  # (num_seqs, max_blocks) int32; None in a prefill without cached prefixes
    cu_seqlens_q: torch.Tensor | None = None  # prefill: (num_seqs + 1,) int32, new tokens
    cu_seqlens_k: torch.Tensor | None = None  # prefill: (num_seqs + 1,) int32, cached + new tokens
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: torch.Tensor | None = None  # decode: (num_seqs,) int32, tokens in each cache (new one included)
    num_decode_seqs: int = 0  # a mixed step: its first rows decode one token each; context_lens holds theirs
    tiles: torch.Tensor | None = None  # prefill, paged: the (sequence, query tile) list of the other rows (03)
    prefix_blocks: torch.Tensor | None = None  # decode rows: (n,) int32, leading blocks several of them share
    prefix_lens: torch.Tensor | None = None  # (num decode rows,) int32: each one's tokens in them, or 0 (03)
    use_triton: bool = True  # False: the PyTorch reference ops (a CPU without the interpreter's patience)

    def attend(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim)
        (store_kvcache if self.use_triton else store_kvcache_ref)(k, v, layer.k_cache, layer.v_cache, self.slot_mapping)
        if not self.is_prefill:
            return self.decode(layer, q)
        if self.num_decode_seqs and self.tiles is not None and self.use_triton:
            return self.mixed(layer, q)
        return self.prefill(layer, q, k, v)

    def decode(self, layer: Attention, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The first q.shape[0] sequences, one new token each, over their whole caches."""
        assert self.context_lens is not None and self.block_tables is not None  # a decode row has both
        tables = self.block_tables[: q.shape[0]]
        if self.use_triton:
            out = None if out is None else out.unsqueeze(1)
            return flash_attn_with_kvcache(q.unsqueeze(1), layer.k_cache, layer.v_cache, self.context_lens, tables,
                                           layer.scale, out=out, prefix_blocks=self.prefix_blocks,
                                           prefix_lens=self.prefix_lens).squeeze(1)  # fmt: skip
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        cu_k = torch.nn.functional.pad(self.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return paged_attention_ref(q, layer.k_cache, layer.v_cache, cu_q, cu_k, tables, layer.scale)

    def mixed(self, layer: Attention, q: torch.Tensor) -> torch.Tensor:
        """A mixed step's decode rows (first) through the decode kernel, the tiles of its other rows through the
        prefill kernel, into one output: the prefill kernel would give each one-token query a whole tile."""
        assert self.tiles is not None  # the runner lists the other rows' tiles
        out = torch.empty_like(q)
        self.decode(layer, q[: self.num_decode_seqs], out[: self.num_decode_seqs])
        self.paged_prefill(layer, q, out)  # an empty list (decode rows only) computes nothing
        return out

    def prefill(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cu_q = self.cu_seqlens_q
        assert cu_q is not None  # a prefill step has it
        if self.block_tables is not None:
            return self.paged_prefill(layer, q)
        if self.use_triton:  # nothing cached: the new tokens are whole prompts, their k and v all there is
            return kernels.flash_attn_varlen_func(q, k, v, cu_q, cu_q, self.max_seqlen_q, self.max_seqlen_q,
                                                  layer.scale, causal=True)  # fmt: skip
        return attention_ref(q, k, v, cu_q, cu_q, layer.scale, causal=True)

    def paged_prefill(self, layer: Attention, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """New tokens over their cached ones and each other, keys and values read through the block tables."""
        cu_q, cu_k, tables = self.cu_seqlens_q, self.cu_seqlens_k, self.block_tables
        assert cu_q is not None and cu_k is not None and tables is not None  # a paged prefill has all three
        if self.use_triton:
            return kernels.flash_attn_varlen_func(q, layer.k_cache, layer.v_cache, cu_q, cu_k, self.max_seqlen_q,
                                                  self.max_seqlen_k, layer.scale, causal=True, block_table=tables,
                                                  out=out, tiles=self.tiles)  # fmt: skip
        return paged_attention_ref(q, layer.k_cache, layer.v_cache, cu_q, cu_k, tables, layer.scale)


# %% [markdown]
# ## The model runner (its decode inputs, to write yourself: `exercises/04_prepare_decode.ipynb`)
# The runner **prepares** a step's inputs on the host: for a prefill, each sequence's `num_scheduled_tokens` tokens
# after its `num_cached_tokens` cached ones, packed end to end, with positions, slots, `cu_seqlens_q` (new tokens),
# `cu_seqlens_k` (cached + new) and block tables when something is cached; for a decode, each sequence's last token,
# position, slot, cache length and block table. It **copies** them to the device (pinned memory, no waiting), runs
# the model, takes the logits of each sequence's last position, and **samples**. Preparation is NumPy over whole
# arrays (a Python loop per token costs more than the GPU's step), into a `StepInputs`, also what TP ranks receive.

# %% tags=["export"] module="minivllm.engine.model_runner"
import atexit
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from minivllm.attention.layer import Attention
from minivllm.attention.paged import PagedContext
from minivllm.attention.prefill import PrefillContext
from minivllm.config import Config
from minivllm.engine.sequence import Sequence
from minivllm.kernels.flash_attn import launch_config
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import LinearBase, TPGroup, tensor_parallel
from minivllm.layers.rotary_embedding import RotaryEmbedding
from minivllm.layers.sampler import Sampler, SamplingTensors, TokenLogprobs, logprobs_of
from minivllm.models.loader import load_model
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.sampling_params import SamplingParams


@dataclass(slots=True)
class StepInputs:
    """One step's inputs as host arrays."""

    is_prefill: bool
    input_ids: np.ndarray  # (num_tokens,) int64
    positions: np.ndarray  # (num_tokens,) int64
    slot_mapping: np.ndarray  # (num_tokens,) int64
    block_tables: np.ndarray | None  # (num_seqs, max_blocks) int32; None: a prefill with nothing cached
    cu_seqlens_q: np.ndarray | None = None  # prefill: (num_seqs + 1,) int32
    cu_seqlens_k: np.ndarray | None = None  # prefill: (num_seqs + 1,) int32
    context_lens: np.ndarray | None = None  # decode: (num_seqs,) int32; mixed: (num_decode_seqs,)
    num_decode_seqs: int = 0  # prefill: its first rows that decode one token each (notebook 05 puts them first)
    logits_rows: np.ndarray | None = None  # prefill: (num_rows,) int64 rows to score; None: each sequence's last
    prefix_blocks: np.ndarray | None = None  # (n,) int32: leading blocks that many decode rows share (cascade)
    prefix_lens: np.ndarray | None = None  # (num_decode_seqs,) int32: each decode row's tokens in them, or 0


def block_tables_array(seqs: list[Sequence]) -> np.ndarray:  # (num_seqs, max_blocks) int32, zero-padded
    tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    return tables


def scores_prompt(seq: Sequence) -> bool:
    """Whether seq asks for prompt logprobs and has prompt tokens left to score (row i scores token i + 1)."""
    return seq.sampling_params.prompt_logprobs is not None and seq.num_cached_tokens < seq.num_prompt_tokens - 1


def scored_rows(scoring: list[bool], cu_seqlens_q: np.ndarray) -> np.ndarray:  # (num_rows,) int64
    """The rows of a prefill to take logits of: all of a scoring sequence's, each other sequence's last."""
    rows = [np.arange(a, b) if score else [b - 1] for score, a, b in zip(scoring, cu_seqlens_q, cu_seqlens_q[1:])]
    return np.concatenate(rows).astype(np.int64)


def prepare_prefill(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Each sequence's scheduled tokens, those after its cached ones, packed end to end."""
    starts = np.array([seq.num_cached_tokens for seq in seqs], dtype=np.int64)
    lens = np.array([seq.num_scheduled_tokens for seq in seqs], dtype=np.int64)
    ends = starts + lens
    assert all(s < e <= len(seq) for seq, s, e in zip(seqs, starts, ends)), "a prefill computes 1..len - cached tokens"
    cu_q = np.cumsum([0, *lens], dtype=np.int32)
    seq_of = np.repeat(np.arange(len(seqs)), lens)  # (num_tokens,): each new token's sequence
    positions = np.arange(cu_q[-1]) - cu_q[seq_of] + starts[seq_of]
    tables = block_tables_array(seqs)
    slots = tables[seq_of, positions // block_size].astype(np.int64) * block_size + positions % block_size
    decodes = (starts > 0) & (lens == 1)  # one new token after cached ones
    num_decode_seqs = len(seqs) if decodes.all() else int(decodes.argmin())  # the leading run of them
    token_ids = chain.from_iterable(seq.token_ids[s:e] for seq, s, e in zip(seqs, starts, ends))
    scoring = [scores_prompt(seq) for seq in seqs]  # these score every new token, the others their last
    prefix_blocks, prefix_lens = shared_prefix(tables[:num_decode_seqs], ends[:num_decode_seqs], block_size)
    return StepInputs(
        is_prefill=True,
        input_ids=np.fromiter(token_ids, dtype=np.int64, count=int(cu_q[-1])),
        positions=positions,
        slot_mapping=slots,
        block_tables=tables if starts.any() else None,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=np.cumsum([0, *ends], dtype=np.int32),
        context_lens=ends[:num_decode_seqs].astype(np.int32) if num_decode_seqs else None,
        num_decode_seqs=num_decode_seqs,
        logits_rows=scored_rows(scoring, cu_q) if any(scoring) else None,
        prefix_blocks=prefix_blocks,
        prefix_lens=prefix_lens,
    )


def prepare_decode(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Each sequence's newest token, which attends to its whole cache (itself included)."""
    context_lens = np.array([len(seq) for seq in seqs], dtype=np.int32)
    block_tables = block_tables_array(seqs)
    last = context_lens.astype(np.int64) - 1  # the new token's position
    slots = block_tables[np.arange(len(seqs)), last // block_size].astype(np.int64) * block_size + last % block_size
    input_ids = np.array([seq.last_token for seq in seqs], dtype=np.int64)
    prefix_blocks, prefix_lens = shared_prefix(block_tables, context_lens, block_size)
    return StepInputs(False, input_ids, last, slots, block_tables, context_lens=context_lens,
                      prefix_blocks=prefix_blocks, prefix_lens=prefix_lens)  # fmt: skip


CASCADE_MIN_ROWS, CASCADE_MIN_TOKENS = 16, 256  # below these, reading a prefix once saves less than a launch


def shared_prefix(tables: np.ndarray, context_lens: np.ndarray, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:  # fmt: skip
    """The leading blocks that the most decode rows share (a system prompt in the prefix cache), if at least
    CASCADE_MIN_ROWS rows share CASCADE_MIN_TOKENS tokens: 03's `prefix_blocks` and `prefix_lens`, else Nones."""
    if len(tables) < CASCADE_MIN_ROWS:
        return None, None
    firsts, counts = np.unique(tables[:, 0], return_counts=True)
    full = (context_lens.astype(np.int64) - 1) // block_size  # blocks before the new token's: full, shareable
    rows = (tables[:, 0] == firsts[counts.argmax()]) & (full > 0)  # those that begin with the commonest block
    if rows.sum() < CASCADE_MIN_ROWS:
        return None, None
    shared = tables[rows, : full[rows].min()]  # (sharers, blocks all of them have filled)
    same = (shared == shared[0]).all(0)  # columns where they all agree
    num_blocks = int(same.argmin()) if not same.all() else len(same)
    if num_blocks * block_size < CASCADE_MIN_TOKENS:
        return None, None
    return shared[0, :num_blocks].copy(), np.where(rows, num_blocks * block_size, 0).astype(np.int32)


def query_tiles(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, first_seq: int, block_m: int) -> np.ndarray:
    """The paged prefill kernel's work list (03) for sequences first_seq..: (sequence, query tile) int32 rows, one
    per tile of block_m new tokens, the tiles that see the most keys first."""
    q_lens, k_lens = np.diff(cu_seqlens_q)[first_seq:], np.diff(cu_seqlens_k)[first_seq:]
    counts = -(-q_lens // block_m)  # tiles per sequence
    seqs = np.repeat(np.arange(first_seq, first_seq + len(q_lens)), counts)
    tiles = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)  # within its sequence
    q_len = np.repeat(q_lens, counts)
    keys = np.repeat(k_lens, counts) - q_len + np.minimum((tiles + 1) * block_m, q_len)  # its last row sees these
    order = np.argsort(-keys, kind="stable")
    return np.stack([seqs[order], tiles[order]], axis=1).astype(np.int32)


# %% tags=["export"]
def step_to_device(step: StepInputs, device: torch.device, use_triton: bool, block_m: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, PagedContext]:  # ids, positions, context  # fmt: skip
    """The step's arrays on the device, in a PagedContext. Given the prefill kernel's tile (`block_m`), a paged
    prefill also gets its list of tiles: those of the rows after the decode rows."""

    def put(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    def put_optional(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else put(a)

    context = PagedContext(step.is_prefill, put(step.slot_mapping), put_optional(step.block_tables),
                           put_optional(step.cu_seqlens_q), put_optional(step.cu_seqlens_k),
                           context_lens=put_optional(step.context_lens), num_decode_seqs=step.num_decode_seqs,
                           use_triton=use_triton)  # fmt: skip
    if use_triton and step.prefix_blocks is not None and step.prefix_lens is not None:  # the reference reads rows
        context.prefix_blocks, context.prefix_lens = put(step.prefix_blocks), put(step.prefix_lens)
    if step.is_prefill:
        assert step.cu_seqlens_q is not None and step.cu_seqlens_k is not None  # a prefill step has both
        context.max_seqlen_q = int(np.diff(step.cu_seqlens_q).max())
        context.max_seqlen_k = int(np.diff(step.cu_seqlens_k).max())
        if block_m and use_triton and step.block_tables is not None:
            tiles = query_tiles(step.cu_seqlens_q, step.cu_seqlens_k, step.num_decode_seqs, block_m)
            context.tiles = put(tiles)
    return put(step.input_ids), put(step.positions), context


# %% [markdown]
# Three sequences; the second finds its first block in the prefix cache, so prefill computes only its last 4 tokens
# (positions 16..19). `admit` stands in for notebook 05's scheduler: allocate, cache the full blocks, schedule the rest.

# %%
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import prepare_decode, prepare_prefill


def admit(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens


bm = BlockManager(num_blocks=8, block_size=16)
first = Sequence(list(range(100, 120)), block_size=16)  # 20 tokens: blocks 0 (full) and 1
again = Sequence(list(range(100, 116)) + [7, 7, 7, 7], block_size=16)  # same first block, then different
short = Sequence([5, 6, 7], block_size=16)
for seq in (first, again, short):
    admit(bm, seq)
step = prepare_prefill([first, again, short], block_size=16)
print(f"cached: {[s.num_cached_tokens for s in (first, again, short)]}, cu_seqlens_q {step.cu_seqlens_q}, cu_seqlens_k "
      f"{step.cu_seqlens_k}; `again`: positions {step.positions[20:24]}, slots {step.slot_mapping[20:24]}")  # fmt: skip
assert again.num_cached_tokens == 16 and again.block_table[0] == first.block_table[0]
assert list(step.cu_seqlens_q) == [0, 20, 24, 27] and list(step.cu_seqlens_k) == [0, 20, 40, 43]
assert list(step.positions[20:24]) == [16, 17, 18, 19]
assert list(step.slot_mapping[20:24]) == [again.block_table[1] * 16 + i for i in range(4)]
for seq, token in zip((first, again, short), (1, 2, 3)):
    seq.append_token(token)
    bm.may_append(seq)
decode = prepare_decode([first, again, short], block_size=16)
assert list(decode.input_ids) == [1, 2, 3] and list(decode.context_lens) == [21, 21, 4]
slots = [s.block_table[b] * 16 + i for s, b, i in ((first, 1, 4), (again, 1, 4), (short, 0, 3))]
assert list(decode.slot_mapping) == slots

# %% [markdown]
# ### How big can the KV cache be?
# A cached token holds a key and a value per KV head and layer (`kv_block_bytes`). On a GPU the runner runs its largest
# step and records the peak: what `gpu_memory_utilization` leaves after the weights and that peak becomes KV blocks, up
# to what `max_num_seqs` sequences of `max_model_len` can use (a tiny model would get millions); on a CPU, ≤ 1 GiB.


# %% tags=["export"]
def prefix_hit_step(block_size: int) -> StepInputs:
    """A prefill of 2 new tokens after block_size - 2 cached ones, all in block 0: the shape of a prefix-cache
    hit or a chunked prompt's next chunk, run once at start-up (the cache holds nothing yet)."""
    positions = np.arange(block_size - 2, block_size)
    cu_seqlens_q, cu_seqlens_k = np.array([0, 2], np.int32), np.array([0, block_size], np.int32)
    return StepInputs(True, np.zeros(2, np.int64), positions, positions.copy(), np.zeros((1, 1), np.int32),
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)  # fmt: skip


def kv_block_bytes(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block in every layer: the unit the cache is sized in."""
    return 2 * sum(layer.num_kv_heads * layer.head_dim for layer in layers) * block_size * dtype.itemsize


@torch.inference_mode()
def profile_step(model: Qwen3ForCausalLM, sampler: Sampler, config: Config, device: torch.device) -> None:
    """The largest step the engine will run: a full prefill, then sampling for max_num_seqs rows."""
    assert config.max_model_len is not None  # Config resolved it
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    lens = [config.max_model_len] * (num_tokens // config.max_model_len) + [num_tokens % config.max_model_len]
    lens = [n for n in lens if n][: config.max_num_seqs]
    input_ids = torch.zeros(sum(lens), dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(input_ids, positions, PrefillContext.from_lens(lens, device))
    logits = model.compute_logits(hidden[-1:].expand(config.max_num_seqs, -1))
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * config.max_num_seqs
    sampler(logits, SamplingTensors.from_params(params, [0] * config.max_num_seqs, device))


def gpu_free_blocks(block_bytes: int, gpu_memory_utilization: float) -> int:
    """KV blocks that fit in the GPU's share, after the weights and the peak of the profiling step just run."""
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    step_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    cached = stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]  # PyTorch's, free to reuse
    used = total - free - cached
    return int(total * gpu_memory_utilization - used - step_peak) // block_bytes


def bind_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> None:  # fmt: skip
    """One tensor for the whole cache; each layer gets its K and V views, (num_blocks, block_size, kv_heads, d)."""
    shape = (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    kv = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]


# %% [markdown]
# ### CUDA graphs for decode
# A decode step of Qwen3-0.6B launches a few hundred small kernels, each cheaper to run than to launch from Python. A
# CUDA graph records the launches once and replays them in one call, at the price of fixed shapes and addresses. So we
# capture a graph per batch size (1, 2, 4, 8, then every 16 up to `max_num_seqs`; the decode kernel's splits depend on
# it only) over shared static inputs, the smaller sharing the largest's memory; a step copies its inputs in, pads the
# batch to the next captured size (padding rows: slot −1, an empty cache, no writes or reads), and replays. Sizes of
# 16 rows and more are captured twice: with notebook 03's cascade for a prefix the rows share (a system prompt in the
# prefix cache; `shared_prefix` above finds it on the host), and without, for steps that have none to share.


# %% tags=["export"]
class StepGraphs:
    """Forward passes captured once per size (tokens in the step), over static inputs that each replay fills."""

    def __init__(self, sizes: list[int], max_rows: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):  # fmt: skip
        self.sizes, n = sizes, sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.zeros(2, max_rows, dtype=torch.int32, device=device)  # both zeroed by one launch a step
        self.context_lens, self.prefix_lens = self.lens  # decode rows' (0: not one), their shared prefix's (03)
        self.prefix_blocks = torch.zeros(max_blocks, dtype=torch.int32, device=device)  # a shared prefix (03)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, cascade): the graph
        self.pool: Any = None  # the graphs' memory, one pool for all
        self.num_replays = 0

    def fill(self, context: PagedContext) -> None:
        """Copy the step's attention inputs into the static ones: block tables, and the decode rows' cache lengths
        and shared prefix (the rows past them: an empty cache, no decode output)."""
        assert context.block_tables is not None  # a captured step reads the paged cache
        self.block_tables[: context.block_tables.shape[0], : context.block_tables.shape[1]] = context.block_tables
        self.lens.zero_()
        if context.context_lens is not None:
            self.context_lens[: context.context_lens.shape[0]] = context.context_lens
        if context.prefix_lens is not None and context.prefix_blocks is not None:
            self.prefix_lens[: context.prefix_lens.shape[0]] = context.prefix_lens
            self.prefix_blocks[: context.prefix_blocks.shape[0]] = context.prefix_blocks

    def capture(self, model: torch.nn.Module, context_of: Callable[[int], PagedContext], cascade: bool) -> None:
        """A graph per size, keyed (size, cascade): with `cascade`, the sizes with room for CASCADE_MIN_ROWS decode
        rows read a shared prefix once (03; rows that share none run it with lengths 0, at the price of its
        launches), and the others are captured without it."""
        for size in reversed(self.sizes):  # the largest first: the others fit in its memory pool
            context = context_of(size)
            assert context.context_lens is not None  # its decode rows (a prefill step's: empty caches)
            rows = context.context_lens.shape[0]
            key = (size, cascade and rows >= CASCADE_MIN_ROWS)
            if key in self.graphs:
                continue  # too few rows for the cascade: captured without it already
            if key[1]:
                context.prefix_blocks, context.prefix_lens = self.prefix_blocks, self.prefix_lens[:rows]
            self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], context)  # warm-up: compile
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], context)
            self.pool = self.pool or graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize(self.hidden.device)

    def reset(self) -> None:
        """Destroy the graphs now, even if something still holds this object: their memory goes back, and an NCCL
        group whose all-reduces they captured can shut down (it waits for them)."""
        for graph in self.graphs.values():
            graph.reset()

    def fits(self, size: int, context: PagedContext, num_tokens: int) -> bool:
        """Whether the graph of `size` tokens can run this step."""
        return size >= num_tokens

    def key_for(self, context: PagedContext, num_tokens: int) -> tuple[int, bool] | None:
        """The graph that runs this step, (size, cascade), or None: none can. The smallest size that fits; there, the
        cascade graph if the step has a shared prefix, else the other (a size has one of them, or both: capture)."""
        size = next((s for s in self.sizes if self.fits(s, context, num_tokens)), None)
        if size is None:
            return None
        order = (True, False) if context.prefix_lens is not None else (False, True)
        return next(((size, cascade) for cascade in order if (size, cascade) in self.graphs), None)

    def replay(self, key: tuple[int, bool], input_ids: torch.Tensor, positions: torch.Tensor, context: PagedContext
               ) -> torch.Tensor:  # fmt: skip
        """Run the step in the graph `key_for` chose."""
        n = input_ids.shape[0]
        self.input_ids[:n], self.positions[:n] = input_ids, positions
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n] = context.slot_mapping
        self.fill(context)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.hidden[:n]  # (num_tokens, hidden_size)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + [b for b in range(16, max_num_seqs + 1, 16)]
    return sizes or [max_num_seqs]


class DecodeGraphs(StepGraphs):
    """One captured decode step per batch size."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):  # fmt: skip
        sizes = graph_batch_sizes(max_num_seqs)
        super().__init__(sizes, sizes[-1], max_blocks, hidden_size, dtype, device)
        for cascade in (False, True):  # a step with a shared prefix, and one without, each as fast as it can be
            self.capture(model, lambda bs: PagedContext(False, self.slot_mapping[:bs], self.block_tables[:bs],
                                                        context_lens=self.context_lens[:bs]), cascade)  # fmt: skip


# %% [markdown]
# A graph removes each kernel's *launch* cost, not the kernel, and our layers in PyTorch make several tiny kernels
# each (a norm: a cast, a square, a mean, an rsqrt, two products). So on a GPU each norm, RoPE and gated activation
# runs as its Triton kernel (01), one launch: `torch.compile` fuses too, but checks guards on the host at each call.
# The linear layers of a one-token step run 01's `gemv`: a batch-1 decode step is mostly reading weights.


# %% tags=["export"]
def use_small_layer_kernels(model: torch.nn.Module, enabled: bool = True) -> None:
    """Run each RMSNorm, RoPE and SiluAndMul of this model as one Triton kernel (01): a launch, with no compiled
    call's guards to check on the host first; each linear layer at one token as `gemv`. CUDA graphs capture the
    launches like any other kernel's."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, SiluAndMul, LinearBase)):
            module.use_triton = enabled


# %% [markdown]
# ### CUDA graphs for prefill and mixed steps
# A prefill or mixed step runs eagerly unless it too is captured, and eagerly its few hundred launches cost the
# host more than the GPU's time (an H200, a chat step of ~255 decode rows and 170 to 650 prompt tokens: 18 to 28 ms
# of wall time for 10.4 to 11.2 ms of kernels). Capturing it needs every launch fixed: the shapes, and the grids.
# So we capture a step of `T` tokens for a few `T` (16 to 4,096), padding each step to the next, with fixed grids
# that read what to do:
#
# * the decode kernel runs over `min(T, max_num_seqs)` rows; a row that is not a decode row has an empty cache,
#   and the kernel writes nothing for it (its output row may be a prompt token's);
# * the prefill kernel runs one program per entry of a tile list long enough for `T` tokens, and the list is
#   padded with −1 (notebook 03): the step's tiles say which sequences and query rows there are.
#
# A step with more tiles than the list holds (many short prompts), more tokens, or nothing cached runs eagerly.


# %% tags=["export"]
MIXED_GRAPH_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def tile_room(num_tokens: int, block_m: int) -> int:
    """Entries in a graph's tile list for steps of num_tokens: every whole tile, and 64 partial ones."""
    return num_tokens // block_m + 64


class MixedGraphs(StepGraphs):
    """One captured prefill or mixed step per token count: its decode rows first, then prompt tokens."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_num_seqs: int, max_blocks: int, block_m: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):  # fmt: skip
        super().__init__(sizes, max_num_seqs, max_blocks, hidden_size, dtype, device)
        self.max_num_seqs, self.block_m = max_num_seqs, block_m

        def int32(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        self.cu_seqlens_q, self.cu_seqlens_k = int32(max_num_seqs + 1), int32(max_num_seqs + 1)
        self.tiles = int32(self.num_tiles(sizes[-1]), 2) - 1
        self.capture(model, self.context, cascade=True)  # steps without a shared prefix too: one capture per size

    def num_tiles(self, size: int) -> int:
        return tile_room(size, self.block_m)

    def context(self, size: int) -> PagedContext:
        rows = min(size, self.max_num_seqs)
        return PagedContext(True, self.slot_mapping[:size], self.block_tables, self.cu_seqlens_q, self.cu_seqlens_k,
                            context_lens=self.context_lens[:rows], num_decode_seqs=rows,
                            tiles=self.tiles[: self.num_tiles(size)])  # fmt: skip

    def fits(self, size: int, context: PagedContext, num_tokens: int) -> bool:
        """Room for the step's tokens and tiles; never without a paged cache (the contiguous kernel's) or tiles."""
        if context.block_tables is None or context.tiles is None:
            return False
        return size >= num_tokens and self.num_tiles(size) >= context.tiles.shape[0]

    def fill(self, context: PagedContext) -> None:
        super().fill(context)
        assert context.tiles is not None  # key_for has checked
        assert context.cu_seqlens_q is not None and context.cu_seqlens_k is not None  # a prefill step has both
        self.cu_seqlens_q[: context.cu_seqlens_q.shape[0]] = context.cu_seqlens_q
        self.cu_seqlens_k[: context.cu_seqlens_k.shape[0]] = context.cu_seqlens_k
        self.tiles.fill_(-1)
        self.tiles[: context.tiles.shape[0]] = context.tiles


# %% [markdown]
# The tile list of a mixed step: two decode rows, then a chunk of 128 prompt tokens after 1,000 cached ones and a
# new prompt of 40. Tiles of 64 query rows; the decode rows have none.

# %%
from minivllm.engine.model_runner import query_tiles

cu_q, cu_k = np.array([0, 1, 2, 130, 170]), np.array([0, 300, 341, 1469, 1509])  # new tokens; cached + new
mixed_tiles = query_tiles(cu_q, cu_k, first_seq=2, block_m=64)
print("(sequence, query tile), the tiles that see the most keys first:", mixed_tiles.tolist())
assert mixed_tiles.tolist() == [[2, 1], [2, 0], [3, 0]]  # 1,128 keys, 1,064, then 40


# %% tags=["export"] module="minivllm.engine.model_runner"
@dataclass(slots=True)
class StepOutput:
    """What a step gives each sequence: its next token and, where its parameters ask, log-probabilities."""

    token_ids: list[int]  # (num_seqs,)
    logprobs: list[TokenLogprobs | None]  # of the next token (SamplingParams.logprobs)
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None]  # the first position scored, and one per position


def rank_device(config: Config, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}" if config.device == "cuda" else "cpu")


# %% [markdown]
# ### The fast paths, composed by name
# The GPU fast paths live in optional deep dives (`notebooks/deep_dives/`), which come after this notebook or the
# one they follow. So nothing here imports them: the runner looks each one up by name, on a GPU only, when it
# needs it. On a CPU none of them is ever imported.

# %% tags=["export"] module="minivllm.engine.fast_paths"
import importlib
from typing import Any

FAST_PATHS = {  # name: "module:attribute", each exported by a deep dive
    "small-layer kernels": "minivllm.kernels.small_layers:use_small_layer_kernels",  # deep dive triton_layers
    "tensor parallelism": "minivllm.engine.workers:TPModelRunner",  # deep dive tensor_parallel
}


def fast_path(name: str) -> Any:
    """The function or class FAST_PATHS names, its module imported now (and only now)."""
    module, _, attribute = FAST_PATHS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


# %% [markdown]
# ### Putting it together
# `ModelRunner(config)` loads the model (this rank's slice), sizes the KV cache, runs one prefix-hit prefill (Triton
# compiles now, not in a request) and captures the decode graphs, timing each phase (`startup_seconds`). `run(seqs,
# is_prefill)` gives the next tokens; `launch` is `run` in two halves, queue then wait (notebook 06 schedules the next
# step in between), with the log-probabilities some requests ask for (`step_logits`: the step without sampler). A
# placeholder token id, `-1 - row`, stands for a token the previous step sampled in that row and has not sent back yet.


# %% tags=["export"]
class ModelRunner:
    """One rank's runner. Alone (`groups=None`) it holds the whole model; given a tensor-parallel rank's groups
    (notebook 06 starts those processes) it holds that rank's slice and meets the other ranks in the model."""

    def __init__(self, config: Config, rank: int = 0, groups: tuple[TPGroup, Any] | None = None):
        if groups is None and config.tensor_parallel_size > 1:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size} needs one process per rank: "
                "use minivllm.engine.workers.make_runner(config), or LLM"
            )
        self.config, self.rank, self.world_size = config, rank, config.tensor_parallel_size
        self.block_size = config.block_size
        self.device = rank_device(config, rank)
        self.use_triton = self.device.type == "cuda"
        self.control: Any  # the gloo group that carries rank 0's messages; None for one rank
        self.tp, self.control = groups or (TPGroup(), None)
        self.model: Qwen3ForCausalLM | None  # loaded below; None once the GPU memory is freed
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.last_token_ids = torch.zeros(0, dtype=torch.int64)  # the latest step's sampled ids (on the device)
        self.closed = False
        marks = [time.perf_counter()]  # where each start-up phase ends: `python -m minivllm` prints the split
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            torch.manual_seed(config.seed)
            with tensor_parallel(self.tp):  # the layers keep this engine's group
                self.model = load_model(config.model, config.dtype, self.device, config.hf_config)
            marks.append(time.perf_counter())
            self.dtype = self.model.lm_head.weight.dtype
            if self.device.type == "cuda":
                use_small_layer_kernels(self.model)
            self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
            self.block_m = launch_config(self.attention_layers[0].head_dim, self.device)["BLOCK_M"]  # prefill tile
            self.sampler = Sampler()
            self.num_kvcache_blocks = self.allocate_kv_cache()
            marks.append(time.perf_counter())
            if self.device.type == "cuda":  # compile the Triton kernels (prefill, small layers) now, not in a request
                self.execute(prefix_hit_step(self.block_size))
            marks.append(time.perf_counter())
            if self.device.type == "cuda" and not config.enforce_eager:
                assert config.max_model_len is not None  # Config resolved it
                max_blocks = -(-config.max_model_len // self.block_size)
                self.graphs = DecodeGraphs(self.model, config.max_num_seqs, max_blocks,
                                           config.hf_config.hidden_size, self.dtype, self.device)  # fmt: skip
                if sizes := [t for t in MIXED_GRAPH_SIZES if t <= config.max_num_batched_tokens]:
                    self.mixed_graphs = MixedGraphs(self.model, sizes, config.max_num_seqs, max_blocks, self.block_m,
                                                    config.hf_config.hidden_size, self.dtype, self.device)  # fmt: skip
            marks.append(time.perf_counter())
            self.startup_seconds = dict(zip(("load", "KV cache", "compile", "CUDA graphs"), np.diff(marks).tolist()))
        except BaseException:
            self.free_gpu_memory()
            raise
        if rank == 0:
            atexit.register(self.close)

    def call(self, method: str, *args):
        """Run a method on every rank (notebook 06's tensor-parallel runner tells the others first), rank 0's result."""
        return getattr(self, method)(*args)

    def close(self) -> None:
        """Free the GPU memory: the weights, the KV cache, the CUDA graphs."""
        if self.closed:
            return
        self.closed = True
        self.free_gpu_memory()
        if self.rank == 0:
            atexit.unregister(self.close)

    def free_gpu_memory(self) -> None:
        """Give the weights, KV cache and graphs' memory back to the GPU (PyTorch's allocator keeps it until
        `empty_cache()`), so that a next engine in this process can size its own cache."""
        if self.device.type != "cuda":
            return
        for layer in getattr(self, "attention_layers", []):
            layer.k_cache = layer.v_cache = None
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.reset()
        self.graphs = self.mixed_graphs = self.model = None
        gc.collect()
        torch.cuda.empty_cache()

    def allocate_kv_cache(self) -> int:
        config = self.config
        block_bytes = kv_block_bytes(self.attention_layers, self.block_size, self.dtype)
        assert config.max_model_len is not None  # Config resolved it
        wanted = config.max_num_seqs * -(-config.max_model_len // self.block_size)  # all sequences at their longest
        if config.num_kvcache_blocks:
            num_blocks = config.num_kvcache_blocks
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            assert self.model is not None  # loaded before the cache is sized
            profile_step(self.model, self.sampler, config, self.device)
            num_blocks = min(gpu_free_blocks(block_bytes, config.gpu_memory_utilization), wanted)
        else:
            num_blocks = min(wanted, 2**30 // block_bytes)
        if self.world_size > 1:  # every rank must agree: the block manager is one for all
            agreed = torch.tensor([num_blocks])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.control)
            num_blocks = int(agreed.item())
        if num_blocks < 1:
            raise ValueError(
                f"no room for a KV cache: gpu_memory_utilization={config.gpu_memory_utilization} "
                f"leaves less than one block ({block_bytes} bytes) after the weights and activations"
            )
        bind_kv_cache(self.attention_layers, num_blocks, self.block_size, self.dtype, self.device)
        return num_blocks

    # --- a step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:  # (num_seqs, vocab_size) logits
        assert self.model is not None, "the runner is closed"
        input_ids, positions, context = step_to_device(step, self.device, self.use_triton, self.block_m)
        if step.input_ids.min() < 0:  # placeholders (06): -1 - row stands for row `row` of the last step's tokens
            input_ids = torch.where(input_ids < 0, self.last_token_ids[(-1 - input_ids).clamp_min(0)], input_ids)
        graphs = self.mixed_graphs if step.is_prefill else self.graphs
        key = None if graphs is None else graphs.key_for(context, input_ids.shape[0])
        if graphs is not None and key is not None:
            hidden = graphs.replay(key, input_ids, positions, context)
        else:
            hidden = self.model(input_ids, positions, context)  # (num_tokens, hidden_size)
        if step.is_prefill:  # each sequence's last token, or all of a sequence's that scores its prompt
            assert context.cu_seqlens_q is not None  # a prefill step has it
            rows = context.cu_seqlens_q[1:] - 1 if step.logits_rows is None else torch.from_numpy(step.logits_rows)
            hidden = hidden[rows.to(hidden.device)]  # (num_rows, hidden_size)
        return self.model.compute_logits(hidden)

    def step_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        prepare = prepare_prefill if is_prefill else prepare_decode
        return self.call("execute", prepare(seqs, self.block_size))

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One step for these sequences: the next token of each."""
        return self.launch(seqs, is_prefill)().token_ids

    def launch(self, seqs: list[Sequence], is_prefill: bool) -> Callable[[], StepOutput]:
        """Queue a step on the GPU and return at once, with a function that waits for its output: the next token of
        each sequence, and the log-probabilities its parameters ask for (those are computed now, waiting)."""
        logits = self.step_logits(seqs, is_prefill)  # queued on the GPU: the host goes on
        scoring = [scores_prompt(seq) for seq in seqs] if is_prefill else []  # these have a row per token, not one
        ends = np.cumsum([seq.num_scheduled_tokens if s else 1 for seq, s in zip(seqs, scoring)])  # their rows' ends
        last = logits[torch.from_numpy(ends - 1).to(logits.device)] if any(scoring) else logits  # (num_seqs, vocab)
        params = [seq.sampling_params for seq in seqs]  # the sampling tensors are built while the GPU computes
        penalized = any(p.penalized for p in params)  # penalties need each row's tokens
        histories = [(s.prompt_token_ids, s.completion_token_ids) for s in seqs] if penalized else None
        sampling = SamplingTensors.from_params(params, [s.num_completion_tokens for s in seqs], self.device, histories)
        self.last_token_ids = token_ids = self.sampler(last, sampling)  # (num_seqs,); the next step may read it
        out = StepOutput([], [None] * len(seqs), [None] * len(seqs))
        if asked := [i for i, p in enumerate(params) if p.logprobs is not None]:
            ks = [params[i].logprobs or 0 for i in asked]
            for i, row in zip(asked, logprobs_of(last[asked], token_ids[asked], ks)):
                out.logprobs[i] = row
        for j in [j for j, s in enumerate(scoring) if s]:  # rows of prompt positions p score the tokens at p + 1
            seq, start, k = seqs[j], seqs[j].num_cached_tokens, params[j].prompt_logprobs or 0
            n = min(seq.num_scheduled_tokens, seq.num_prompt_tokens - 1 - start)  # rows before the prompt's end
            targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + n], device=logits.device)
            first = int(ends[j]) - seq.num_scheduled_tokens
            out.prompt_logprobs[j] = (start + 1, logprobs_of(logits[first : first + n], targets, [k] * n))
        host_ids = token_ids.to("cpu", non_blocking=True)  # into pinned memory, without waiting
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()

        def output() -> StepOutput:
            if ready is not None:
                ready.synchronize()
            out.token_ids = host_ids.tolist()
            return out

        return output


# %% [markdown]
# ## Every path gives the logits of a from-scratch forward (a bug to find: `exercises/04_find_the_bug.ipynb`)
# The claim of this notebook, on notebook 02's tiny checkpoint: prompts prefilled through the paged path, then
# decoded through shuffled block tables; at every step the logits equal `prompt_logits` of the whole sequence.

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner
from minivllm.models.loader import load_model
from minivllm.testing import prompt_logits

CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()
tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
reference = load_model(tiny_path, dtype=torch.float32, device=DEVICE)


def check_steps(runner: ModelRunner, prompts: list[list[int]], num_decode_steps: int, shuffle: bool = True) -> float:
    """Prefill `prompts`, decode greedily; compare every step's logits with prompt_logits. Worst |error|."""
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    if shuffle:  # hand out blocks in a random order: block tables far from contiguous
        random.shuffle(bm.free_block_ids)
    seqs = [Sequence(p, block_size=runner.block_size) for p in prompts]
    for seq in seqs:
        admit(bm, seq)
    worst = 0.0
    for step in range(num_decode_steps + 1):
        for seq, row in zip(seqs, runner.step_logits(seqs, is_prefill=step == 0)):
            worst = max(worst, (row - prompt_logits(reference, seq.token_ids)[-1]).abs().max().item())
            seq.append_token(int(row.argmax()))
            bm.may_append(seq)
    return worst


runner = ModelRunner(Config(tiny_path, num_kvcache_blocks=64, dtype=torch.float32, max_num_seqs=8))
prompts = [random.choices(range(2048), k=n) for n in (1, 15, 16, 17, 100)]
worst = check_steps(runner, prompts, num_decode_steps=40)
print(f"5 prompts, prefill + 40 decode steps, shuffled blocks: worst logit error {worst:.1e}")
assert worst < 1e-4
runner.use_triton = True  # the same through the Triton kernels (on a CPU, in the interpreter, so fewer steps)
worst = check_steps(runner, prompts[:3], num_decode_steps=3)
print(f"Triton kernels: worst logit error {worst:.1e}")
assert worst < 1e-4
runner.use_triton = DEVICE == "cuda"

# %% [markdown]
# And the path teaching engines get wrong: a prefix-cache hit. The second request's prefill computes only its
# new tokens, whose queries must attend to the cached prefix through the block table.

# %%
system_prompt = random.choices(range(2048), k=48)  # three full blocks of 16
bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
first, second = (Sequence(system_prompt + new, block_size=16) for new in ([1, 2, 3], [4, 5, 6, 7]))
admit(bm, first)
runner.step_logits([first], is_prefill=True)
admit(bm, second)
assert second.num_cached_tokens == 48  # three blocks reused: prefill computes 4 tokens, not 52
hit = runner.step_logits([second], is_prefill=True)[0]
error = (hit - prompt_logits(reference, second.token_ids)[-1]).abs().max().item()
print(f"prefix-cache hit: {second.num_cached_tokens} of {len(second)} tokens reused, logit error {error:.1e}")
assert error < 1e-4
# chunked prefill (notebook 05): each chunk's queries attend to the chunks before it, as after a prefix hit
long = Sequence(random.choices(range(2048), k=100), block_size=16)
bm.allocate(long)
for end in (37, 64, 100):  # three steps: tokens 0..36, 37..63, 64..99
    bm.cache_blocks(long, end)
    long.num_scheduled_tokens = end - long.num_cached_tokens
    logits = runner.step_logits([long], is_prefill=True)[0]
    long.num_cached_tokens = end  # the step has run: these tokens' KV is in the cache
error = (logits - prompt_logits(reference, long.token_ids)[-1]).abs().max().item()
print(f"100 tokens in chunks of 37, 27, 36: logit error {error:.1e}")
assert error < 1e-4

# %% [markdown]
# ### A whole decode step: eager vs CUDA graph
# `python -m minivllm.benchmarks.decode_step` times `runner.run(seqs, is_prefill=False)` for the 0.6B preset,
# preparation and sampling included, with and without CUDA graphs, and records the KV cache it sized.

# %%
import json

from minivllm.benchmarks.decode_step import plot_decode_step, run_decode_step_benchmark

saved = Path("figures/decode_step.json")  # an H200 run's, on a CPU
step_data = run_decode_step_benchmark(batch_sizes=(1, 8, 64)) if DEVICE == "cuda" else json.loads(saved.read_text())
plot_decode_step(step_data).savefig(FIGURES / "04_decode_step.png", dpi=120)
rows = {(r["impl"], r["batch"]): r["ms"] for r in step_data["rows"]}
for batch in sorted({b for _, b in rows}):
    graph, eager = rows["minivllm", batch], rows["minivllm-eager", batch]
    print(f"batch {batch:>3}: graph {graph:5.2f} ms, eager {eager:5.2f} ms: the graph {eager / graph:4.1f}× faster")
print(f"KV cache on {step_data['device']}: {step_data['kv_cache_tokens'] / 1e6:.2f} M tokens")
assert rows["minivllm", 1] < rows["minivllm-eager", 1]

# %% [markdown]
# ## Check yourself
# 1. A sequence of 37 tokens with blocks of 16 and block table `[7, 2, 9]` decodes its 38th token. Which slot
#    does its KV go to, and what `context_len` does the decode kernel see? Answer `(slot, context_len)`.
# 2. `second` above prefilled 4 new tokens after a 48-token cache hit. Over how many keys does that prefill
#    attend, and how many are in the new tokens' own `k` and `v`, all that notebook 01's kernel is given?
#    Answer `(keys, new)`.
# 3. A decode step of 5 sequences replays a CUDA graph (`max_num_seqs=256`): the one captured for which batch
#    size? And why may the decode kernel's `num_splits` depend on the batch size only?
# 4. A mixed step has 3 decode rows and a prompt chunk of 100 tokens (tiles of 64 query rows). Which captured
#    `T` replays it, how many programs per group of query heads (notebook 01's `heads_per_program`) does its
#    prefill kernel run, and how many of them have a tile to compute? Answer `(T, programs, real)`.
# 5. The race's `q = -log2(u)` for `u` near 1 is tiny. For how many float32 values `u < 1` is it smaller than
#    the GPU's `log2` error, 2^-22 (why `_neg_log2` takes a series near 1)? Answer an int.
# 6. `top_k_sample` with 4 lanes instead of 1,024, on the row `[11, 1, 2, 3, 10, 4, 5, 6, 9, 0, 7, 8]` at top-k 3:
#    what is its floor (the 3rd largest of the lanes' maxima), and how many candidates reach it? Answer
#    `(floor, candidates)`.

# %%
from minivllm.testing import check_answer

answer1 = answer2 = answer3 = answer4 = answer5 = answer6 = None  # your answers: replace None with expressions
seq = Sequence(list(range(38)), block_size=16)  # the 37 tokens and the 38th, just sampled
seq.block_table = [7, 2, 9]
decode, hit_step = prepare_decode([seq], block_size=16), prepare_prefill([second], block_size=16)
expected1 = (int(decode.slot_mapping[0]), int(decode.context_lens[0]))
expected2 = (int(hit_step.cu_seqlens_k[-1]), int(hit_step.cu_seqlens_q[-1]))
expected3 = next(b for b in graph_batch_sizes(256) if b >= 5)
check_answer(answer1, expected1, "1. decode slot")
check_answer(answer2, expected2, "2. keys after a hit")
check_answer(answer3, expected3, "3. graph replayed")
mixed_size = next(t for t in MIXED_GRAPH_SIZES if t >= 3 + 100)
chunk_tiles = query_tiles(np.array([0, 1, 2, 3, 103]), np.array([0, 9, 18, 27, 147]), 3, block_m=64)
expected4 = (mixed_size, tile_room(mixed_size, 64), len(chunk_tiles))
check_answer(answer4, expected4, "4. a mixed step's graph")
below_one = (torch.arange(1, 2**10, dtype=torch.int32) * -1 + 0x3F800000).view(torch.float32)  # 1023 floats below 1
expected5 = int((-torch.log2(below_one.double()) < 2**-22).sum())
check_answer(answer5, expected5, "5. floats whose q is below log2's error")
row = torch.tensor([[11.0, 1, 2, 3, 10, 4, 5, 6, 9, 0, 7, 8]], device=DEVICE)
t1, k3 = rows_of(1, 1), rows_of(3, 1).long()  # one random row, top-k 3
row_maxima, row_floor = torch.empty(1, 1, 4, device=DEVICE), torch.empty(1, dtype=torch.int32, device=DEVICE)
_lane_max_kernel[(1, 1)](row, t1, k3, row_maxima, 12, 12, 12, LANES=4)  # one part of 12 columns, 4 lanes
_floor_kernel[(1,)](row_maxima, t1, k3, row_floor, 1, LANES=4)  # an int32 order: a positive float's bits
floor6 = row_floor.view(torch.float32).item()
expected6 = (floor6, int((row >= floor6).sum()))
check_answer(answer6, expected6, "6. top-k's floor and candidates")

# %% [markdown]
# Worked answers. **1.** Token 37 (from 0): logical block 37 // 16 = 2, physical block 9, offset 37 % 16 = 5;
# the kernel attends over all 38 tokens, its own included. **2.** 52 and 4: the new queries must also see the 48
# cached keys, which live only in the paged cache, read through the block tables. **3.** Graphs exist for 1, 2,
# 4, 8, 16, 32, …: 5 pads to 8. The graph fixed its kernels' grids, `num_splits` included, at capture. **4.** The
# 103 tokens pad to `T` = 128, whose tile list has room for 128 // 64 + 64 = 66 tiles; the chunk has ⌈100 / 64⌉ = 2,
# so 64 of the 66 programs per group of heads read −1 and return: the price of a grid fixed at capture. **5.** Near
# 1, `q = -ln(u) / ln 2 ≈ (1 - u) log2(e)`, below 2^-22 when `1 - u < 2^-22 ln 2 ≈ 1.65e-7`; float32 steps there are
# 2^-24 ≈ 6e-8 apart: `1 - u` = 1 or 2 steps, 2 floats. Rare per token (about 1 in 8 million draws), but a row draws
# 151,936 numbers: about 2 % of rows hold such a token, and without the series its score could be +inf. **6.** Lane
# `c % 4`: lane 0 holds 11, 10, 9 (columns 0, 4, 8), lane 1 holds 1, 4, 0, lane 2 2, 5, 7, lane 3 3, 6, 8: maxima
# 11, 4, 7, 8, the 3rd largest 7. At or above it: 11, 10, 9, 7, 8, five candidates for k = 3, because the three
# largest share lane 0 (1,024 lanes make that rare: the 1.02–1.4 × `k` above).

# %%
check_answer((9 * 16 + 37 % 16, 37 + 1), expected1, "1. decode slot")
check_answer((48 + 4, 4), expected2, "2. keys after a hit")
check_answer(min(b for b in (1, 2, 4, 8, 16, 32) if b >= 5), expected3, "3. graph replayed")
check_answer((128, 128 // 64 + 64, -(-100 // 64)), expected4, "4. a mixed step's graph")
steps_below = [j for j in (1, 2, 3) if j * 2**-24 < 2**-22 * np.log(2)]  # 1 - u in steps of 2^-24
check_answer(len(steps_below), expected5, "5. floats whose q is below log2's error")
lane_maxima = [max(row[0, lane::4].tolist()) for lane in range(4)]  # [11, 4, 7, 8]
floor = sorted(lane_maxima)[-3]
check_answer((floor, sum(x >= floor for x in row[0].tolist())), expected6, "6. top-k's floor and candidates")
assert hit_step.block_tables is not None
