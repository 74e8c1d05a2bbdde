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
# # Deep dive · A GPU sampler without a sort (Triton)
#
# **What it adds.** Notebook 04's `Sampler` draws in PyTorch: a softmax, a sort for the filters, the
# exponential race, several passes over each `(batch, 151,936)` row of logits. Here the same draws
# run in one or two passes of Triton kernels, with no sort: the race as a Gumbel-max (one pass),
# top-p by drawing then checking, top-k from a floor. `GPUSampler` subclasses the core `Sampler`
# with them, and the GPU runner (deep dive cuda_graphs) makes it its sampler.
#
# **It follows notebook 04**; nothing later in the core path needs it: without it, the core sampler
# gives the same tokens (on a CPU the kernels run in Triton's interpreter, on small sizes).

# %%
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
words = "mat floor sofa bed chair roof table rug fence keyboard moon piano".split()
# 04's "The cat sat on the"
cat_logits = torch.tensor([4.0, 3.1, 2.6, 2.2, 1.9, 1.4, 1.2, 1.0, 0.6, 0.1, -0.5, -1.5])


def show_probs(probs: torch.Tensor, label: str) -> None:
    pairs = zip(words, probs.tolist())
    shown = [f"{w} {p:.2f}" for w, p in pairs if p >= 0.005]
    print(f"{label:>6}: " + " ".join(shown))


# %% [markdown]
# ### On a GPU: the race in one pass (Triton)
# Drawn in PyTorch, a token costs several passes over all `(batch, 151,936)` logits. In logarithms
# the race is a sum, the **Gumbel-max trick**: the token is `argmax(x / T - log q)`, `q = -log u`,
# `u` uniform: no softmax, one read of the logits. `u` comes from Philox, a function of the row's
# key and a counter, no state: `tl.rand4x(key, c)` gives four numbers at once, so token `t` of a
# vocabulary of `n` takes number `t // s` of counter `t % s`, `s = ⌈n / 4⌉`, and a program reads the
# four columns `c, c + s, c + 2s, c + 3s` per counter: a quarter of the Philox work of one call per
# token (which took about a third of the pass on an H200; the logarithms most of the rest). So the
# kernel scores in base 2, the hardware's: `log2(e) x / T - log2(q)`, `q = -log2(u)` (the same
# argmax), both logarithms with the GPU's one-instruction approximation. Its error is absolute near
# 1 (2^-22): for `u` near 1, `q` is tiny and the error would exceed it, turning a random token's
# score into +inf. There (`1 - u < 0.01`) `q` comes from the series `-ln(1 - w) = w + w²/2 + w³/3 +
# …`, `w = 1 - u` (exact): every score within 3·10⁻⁵ of the exact one. A row is cut into parts, a
# program each, so that one row fills the GPU too; the best part wins. With a top-k above 512,
# `topk` gives the candidates, `keep_mask` sets the dropped to `-inf`, and `race_ids` races them
# with each token id's own number (`_noise`): the same draw as over the whole row (smaller top-k:
# two sections below).

# %% tags=["export"] module="minivllm.kernels.sampling"
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _noise(key, ids, s):
    """The uniform number of token ids: number ids // s of Philox counter ids % s (four numbers per
    counter)."""
    r0, r1, r2, r3 = tl.rand4x(key, ids % s)
    lane = ids // s
    r23 = tl.where(lane == 2, r2, r3)
    return tl.where(lane == 0, r0, tl.where(lane == 1, r1, r23))


@triton.jit
def _fast_log2(x, FAST: tl.constexpr):
    """log2; with FAST (on a GPU) the hardware's approximation: within 2^-22 for x in [0.5, 2], 2
    ulp elsewhere (the interpreter has no libdevice)."""
    if FAST:
        y = libdevice.fast_log2f(x)
    else:
        y = tl.math.log2(x)
    return y


@triton.jit
def _neg_log2(u, FAST: tl.constexpr):
    """-log2(u) for u in [0, 1), to a relative 2e-5: near 1, where log2's absolute error (2^-22)
    would exceed the result, from the series -ln(1 - w) = w + w^2/2 + w^3/3 + ..., w = 1 - u
    (exact)."""
    w = 1.0 - u
    series = w * LOG2E * (1.0 + w * (0.5 + w * 0.33333334))
    return tl.where(w < 0.01, series, -_fast_log2(u, FAST))


@triton.jit
def _better(x, u, t, cols, best, best_col, FAST: tl.constexpr):
    """Each lane's best score so far (the first column on ties), given logits x of columns cols,
    noise u."""
    if (
        t > 0
        # the Gumbel score in base 2: log2(e) x / T - log2(q), q = -log2(u); temperature 0: the
        # logit itself
    ):
        x = x * (LOG2E / t) - _fast_log2(_neg_log2(u, FAST), FAST)
    better = (x > best) | ((x == best) & (cols < best_col))
    return tl.where(better, x, best), tl.where(better, cols, best_col)


@triton.jit
def _lane(X, n, s, c, lane, u, t, lo, incl, best, best_col, top, FAST: tl.constexpr):
    """Counters c's columns in lane `lane` (c + lane * s), where > lo (or equal, if incl), into the
    race."""
    cols = c + lane * s
    in_row = (cols < n) & (c < s)
    x = tl.load(X + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    kept = tl.where((x > lo) | ((x == lo) & (incl != 0)), x, float("-inf"))
    best, best_col = _better(kept, u, t, cols, best, best_col, FAST)
    return best, best_col, tl.maximum(top, x)


@triton.jit
def _draw(X, n, s, t, key, lo, incl, start, end, offset, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """The race among the logits > lo (>= lo if incl) of counters start..end, each counter's four
    columns, the noise at counter + offset: (the best score, its column, the largest logit)."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
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
def _race_kernel(
    X,
    TEMPS,
    KEYS,
    LO,
    INCL,
    SEARCHING,
    BEST,
    WON,
    TOP,
    n,
    stride,
    span,
    offset,
    BLOCK: tl.constexpr,
    FAST: tl.constexpr,
):
    # part: counters part * span, + span
    row, part, parts = (tl.program_id(0), tl.program_id(1), tl.num_programs(1))
    t, key, X, s = (
        tl.load(TEMPS + row),
        tl.load(KEYS + row),
        X + row.to(tl.int64) * stride,
        tl.cdiv(n, 4),
    )
    lo, incl = t * 0 - float("inf"), 1  # no floor
    # nucleus's retries (below): only rows still searching, above their floor
    if SEARCHING is not None:
        if tl.load(SEARCHING + row) == 0:
            return
        lo, incl = tl.load(LO + row), tl.load(INCL + row)
    start, end = part * span, tl.minimum(part * span + span, s)
    score, col, top = _draw(X, n, s, t, key, lo, incl, start, end, offset, BLOCK, FAST)
    tl.store(BEST + row * parts + part, score)
    tl.store(WON + row * parts + part, col)
    # the part's largest logit (nucleus, below, needs the row's)
    tl.store(TOP + row * parts + part, top)


@triton.jit(do_not_specialize=["n", "stride"])  # the candidates per row: a top-k, any value
def _race_ids_kernel(
    X, IDS, TEMPS, KEYS, WON, n, s, stride, BLOCK: tl.constexpr, FAST: tl.constexpr
):
    row = tl.program_id(0)
    t, key = tl.load(TEMPS + row), tl.load(KEYS + row)
    row_start = row.to(tl.int64) * stride
    X, IDS = X + row_start, IDS + row_start
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        ids = tl.load(IDS + cols, mask=cols < n, other=0).to(tl.int32)
        best, best_col = _better(x, _noise(key, ids, s), t, cols, best, best_col, FAST)
    won = tl.min(tl.where(best == tl.max(best, axis=0), best_col, n), axis=0)
    tl.store(WON + row, tl.load(IDS + won))


def block_of(n: int) -> int:
    return min(triton.next_power_of_2(n), 4096)


# per row: floor lo, incl (>= lo), searching (0/1)
Retry = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def row_parts(length: int, block: int, rows: int) -> tuple[int, int]:
    """A row of `length` cut into parts of whole blocks, ~2,048 programs over all rows: (span,
    parts)."""
    span = block * triton.cdiv(triton.cdiv(length, block), max(1, 2048 // rows))
    return span, triton.cdiv(length, span)


def race_parts(
    x: torch.Tensor,
    temperatures: torch.Tensor,
    keys: torch.Tensor,
    retry: Retry | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The race in parts of each row, a program each: per (row, part), the best score, its column,
    the largest logit. (rows, parts) each. With `retry`, only the searching rows, among their logits
    above the floor, with the numbers of counters + offset (a new try's)."""
    assert x.stride(1) == 1
    (rows, n), block = x.shape, 512
    span, parts = row_parts(triton.cdiv(n, 4), block, rows)  # in counters: four columns each
    best, top = torch.empty(rows, parts, device=x.device), torch.empty(rows, parts, device=x.device)
    won = torch.empty(rows, parts, dtype=torch.int64, device=x.device)
    _race_kernel[(rows, parts)](
        x,
        temperatures,
        keys,
        *(retry or (None,) * 3),
        best,
        won,
        top,
        n,
        x.stride(0),
        span,
        offset,
        BLOCK=block,
        FAST=x.is_cuda,
    )
    return best, won, top


def race(x: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row of x (rows, vocab): the argmax where the temperature is 0, else a draw from softmax(x
    / T), its noise keyed by (keys[row], token id). Returns (rows,) int64."""
    best, won, _ = race_parts(x, temperatures, keys)
    # the best parts' first column
    firsts = won.masked_fill(best < best.max(dim=1, keepdim=True).values, x.shape[1])
    return firsts.amin(dim=1)


def race_ids(
    x: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, vocab: int
):
    """race among candidates: x (rows, n) their logits, ids (rows, n) their token ids in a
    vocabulary of `vocab`; the same noise per token id as race over the whole row. Returns (rows,)
    int64 token ids."""
    assert x.stride(1) == 1 and ids.stride() == x.stride()
    won = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _race_ids_kernel[(x.shape[0],)](
        x,
        ids,
        temperatures,
        keys,
        won,
        x.shape[1],
        triton.cdiv(vocab, 4),
        x.stride(0),
        BLOCK=block_of(x.shape[1]),
        FAST=x.is_cuda,
    )
    return won


# %% [markdown]
# ### Top-p without a sort: draw, then check
# The nucleus is an *upper set*: with a token, it holds every more likely one. So draw from all
# tokens, then check the draw in one pass: it is in the nucleus if the tokens more likely than it
# hold less than `p` of the mass. If not, neither is any token at or below it: draw again, with
# fresh noise, among those above (min-p alike: above its floor). The draws that pass follow the
# renormalized nucleus exactly (rejection sampling), and each try passes with probability `p` at
# least: at most `1 / p` tries on average (1.1 at `p = 0.9`), two passes each, instead of a sort.
# The tries run in parts, a program each, as the race does (one program per row would leave most of
# the GPU idle): the race's parts, then each part's masses, then one program per row adds them up
# and checks. A rejected row tries again in parts (the programs of rows already done return at
# once); only a row rejected `NUCLEUS_TRIES_IN_PARTS = 5` times (with top-p alone at most `(1 -
# p)^5`, 1 in 100,000 at `p = 0.9`) goes on alone, in one program, which reads its whole row while
# the batch waits; an empty try's programs only return. With fewer than 32 rows the GPU has time to
# spare and the host, which launches 3 kernels a try, does not: there only the first try runs in
# parts.


# %% tags=["export"]
@triton.jit
def _masses(X, lo, hi, n, t, m, drawn, BLOCK: tl.constexpr):
    """The sums of exp((x - m) / t) over the logits x > drawn and over all, of columns lo..hi-1: the
    softmax's mass above, its denominator (unnormalized)."""
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
    """The race's winner over a row's parts (the first column on ties) and the row's largest
    logit."""
    best = _row_parts(BEST, row, parts, float("-inf"), PARTS)
    won = _row_parts(WON, row, parts, n, PARTS).to(tl.int32)
    col = tl.min(tl.where(best == tl.max(best, axis=0), won, n), axis=0)
    return col, tl.max(_row_parts(TOP, row, parts, float("-inf"), PARTS), axis=0)


@triton.jit(
    do_not_specialize=["span"]
)  # varies with the batch: one compiled kernel for all (notebook 01)
def _masses_kernel(
    X,
    TEMPS,
    BEST,
    WON,
    TOP,
    SEARCHING,
    ABOVE,
    TOTAL,
    n,
    stride,
    span,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Part `part` (columns part * span, + span) of _masses, for the race's draw: into ABOVE and
    TOTAL."""
    row, part, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    if tl.load(SEARCHING + row) == 0:
        return
    t, X = tl.load(TEMPS + row), X + row.to(tl.int64) * stride
    col, m = _parts_draw(BEST, WON, TOP, row, parts, n, PARTS)
    drawn = tl.load(X + col).to(tl.float32)
    lo = part * span
    hi = tl.minimum(lo + span, n)
    above, total = _masses(X, lo, hi, n, tl.where(t > 0, t, 1.0), m, drawn, BLOCK)
    tl.store(ABOVE + row * parts + part, above)
    tl.store(TOTAL + row * parts + part, total)


@triton.jit
def _verdict(x, m, t, p, min_p, above, total):
    """Whether to draw again after drawing logit x (above, total: _masses'), and above what: (again,
    lo, incl)."""
    log_min_p = tl.log(tl.where(min_p > 0, min_p, 1.0))
    floor = tl.where(min_p > 0, m + t * log_min_p, float("-inf"))  # min-p: x >= it
    in_nucleus = (p >= 1) | (above < p * total) | (above == 0)
    again = (t > 0) & ((x < floor) | (in_nucleus == 0))
    return again, tl.where(x < floor, floor, x), (x < floor).to(tl.int32)


@triton.jit(do_not_specialize=["parts"])
def _verdict_kernel(
    X,
    TEMPS,
    TOP_PS,
    MIN_PS,
    BEST,
    WON,
    TOP,
    ABOVE,
    TOTAL,
    LO,
    INCL,
    SEARCHING,
    OUT,
    n,
    stride,
    parts,
    PARTS: tl.constexpr,
):
    """A searching row's draw (in parts) checked: OUT its token; if rejected, still SEARCHING above
    LO (INCL)."""
    row = tl.program_id(0)
    if tl.load(SEARCHING + row) == 0:
        return
    t, p, min_p, X = (
        tl.load(TEMPS + row),
        tl.load(TOP_PS + row),
        tl.load(MIN_PS + row),
        X + row.to(tl.int64) * stride,
    )
    col, m = _parts_draw(BEST, WON, TOP, row, parts, n, PARTS)
    above = tl.sum(_row_parts(ABOVE, row, parts, 0.0, PARTS), axis=0)
    total = tl.sum(_row_parts(TOTAL, row, parts, 0.0, PARTS), axis=0)
    x = tl.load(X + col).to(tl.float32)
    again, lo, incl = _verdict(x, m, t, p, min_p, above, total)
    tl.store(OUT + row, col)
    tl.store(SEARCHING + row, again.to(tl.int32))
    tl.store(LO + row, lo)
    tl.store(INCL + row, incl)


@triton.jit(do_not_specialize=["offset"])
def _nucleus_kernel(
    X,
    TEMPS,
    TOP_PS,
    MIN_PS,
    KEYS,
    LO,
    INCL,
    SEARCHING,
    OUT,
    n,
    stride,
    offset,
    BLOCK: tl.constexpr,
    FAST: tl.constexpr,
):
    """The rare row still searching after the tries in parts: draws again, alone, until a draw
    passes."""
    row = tl.program_id(0)
    searching = tl.load(SEARCHING + row) != 0
    if searching == 0:
        return
    t, p, min_p, key = (
        tl.load(TEMPS + row),
        tl.load(TOP_PS + row),
        tl.load(MIN_PS + row),
        tl.load(KEYS + row),
    )
    X, s = X + row.to(tl.int64) * stride, tl.cdiv(n, 4)
    lo, incl, col = tl.load(LO + row), tl.load(INCL + row), row * 0
    # the next try's counters (the loop's state as tensors: a while loop carries tensors)
    offset += row * 0
    # a draw among x > lo (>= lo if incl); rejected: the kept tokens all lie above it
    while searching:
        _, col, m = _draw(X, n, s, t, key, lo, incl, 0, s, offset, BLOCK, FAST)
        x = tl.load(X + col).to(tl.float32)
        t_or_1 = tl.where(t > 0, t, 1.0)
        above, total = _masses(X, 0, n, n, t_or_1, m, x, 4 * BLOCK)
        searching, lo, incl = _verdict(x, m, t, p, min_p, above, total)
        offset += s
    tl.store(OUT + row, col)


NUCLEUS_TRIES_IN_PARTS = 5  # P(a row needs more) <= (1 - p)^5 with top-p alone: 1e-5 at top-p 0.9
NUCLEUS_PARTS_MIN_ROWS = (
    32  # fewer rows: only the first try in parts (each try is 3 launches of host time)
)


def nucleus(
    x: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    keys: torch.Tensor,
    wanted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row of x (rows, vocab): the argmax where the temperature is 0, else a draw from softmax(x
    / T) with top-p then min-p applied (keep_mask's order); the first try is race's draw. wanted
    (rows,) bool: only those rows, the others' tokens left unset (default: all). Returns (rows,)
    int64."""
    (rows, n), s, block = x.shape, triton.cdiv(x.shape[1], 4), 1024
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    lo = torch.full((rows,), float("-inf"), device=x.device)  # every row searches, above no floor
    incl = torch.ones(rows, dtype=torch.int32, device=x.device)
    searching = incl.clone() if wanted is None else wanted.to(torch.int32)
    retry = (lo, incl, searching)
    # room for a row alone's parts (the most)
    pad = max(2, triton.next_power_of_2(triton.cdiv(s, 512)))
    tries = NUCLEUS_TRIES_IN_PARTS if rows >= NUCLEUS_PARTS_MIN_ROWS else 1
    for attempt in range(tries):  # try i: the numbers of counters + i * s, fresh ones
        best, won, top = race_parts(x, temperatures, keys, retry, offset=attempt * s)
        parts = best.shape[1]
        above, total = torch.empty_like(best), torch.empty_like(best)
        _masses_kernel[(rows, parts)](
            x,
            temperatures,
            best,
            won,
            top,
            searching,
            above,
            total,
            n,
            x.stride(0),
            block * triton.cdiv(triton.cdiv(n, parts), block),
            PARTS=pad,
            BLOCK=block,
        )
        _verdict_kernel[(rows,)](
            x,
            temperatures,
            top_ps,
            min_ps,
            best,
            won,
            top,
            above,
            total,
            *retry,
            out,
            n,
            x.stride(0),
            parts,
            PARTS=pad,
        )
    _nucleus_kernel[(rows,)](
        x,
        temperatures,
        top_ps,
        min_ps,
        keys,
        *retry,
        out,
        n,
        x.stride(0),
        tries * s,
        BLOCK=min(1024, triton.next_power_of_2(s)),
        FAST=x.is_cuda,
        num_warps=16,
    )
    return out


# %%
from minivllm.kernels.sampling import nucleus, race


def rows_of(value: float, n: int) -> torch.Tensor:  # a (n,) setting on the kernels' device
    return torch.full((n,), value, device=DEVICE)


# 256 rows with their own keys; CPU: interpreted
keys, cat = (torch.arange(256, device=DEVICE), cat_logits.to(DEVICE))
won = race(cat.expand(256, -1), rows_of(0.5, 256), keys).cpu()
freq = torch.bincount(won, minlength=len(words)) / 256
show_probs(freq, "race")
torch.testing.assert_close(freq, torch.softmax(cat_logits / 0.5, dim=-1), atol=0.1, rtol=0)
assert race(cat[None], rows_of(0, 1), keys[:1]).item() == 0  # temperature 0: the argmax, "mat"
# T = 1, top-p 0.7: "mat" 0.46 + "floor" 0.19 < 0.7, so "sofa" (0.11) is in the nucleus, "bed" is
# not
temperature, top_p, min_p = rows_of(1, 128), rows_of(0.7, 128), rows_of(0, 128)
drawn = nucleus(cat.expand(128, -1), temperature, top_p, min_p, keys[:128]).cpu()
show_probs(freq := torch.bincount(drawn, minlength=len(words)) / 128, "top-p")
assert set(drawn.tolist()) == {0, 1, 2}
# renormalized
torch.testing.assert_close(freq[:3], torch.softmax(cat_logits[:3], dim=-1), atol=0.1, rtol=0)

# %% [markdown]
# ### Top-k without a sort: a floor from the lanes' maxima
# With a top-k the kept tokens are few (`k` of 151,936), so find them and race only them. A sort
# finds them, but `torch.topk` of 50 took 0.63 ms of an H200 at batch 256, six times the race's one
# pass. One pass gives a **floor** at or below the `k`-th largest logit: split the row into 1,024
# *lanes* (column `c` in lane `c % 1024`) and take each lane's maximum; the `k` largest maxima are
# `k` distinct logits, so at least `k` logits are at or above the `k`-th of them. A second pass
# gathers the logits at or above the floor, the **candidates** (1.02–1.4 × `k` on random rows,
# below), into `2k` slots per row; one program per row then sorts them (largest first, the lowest id
# first on ties: what a sort of the whole row would give), applies `keep_mask`'s rules and races the
# kept ones with each token id's number, as `race_ids` does. A row with more candidates than slots
# (many ties, most logits `-inf`) finds its `k`-th logit alone, by bisection on the bits of the
# float (32 passes), and gathers the logits above it, then its ties lowest id first: the same
# tokens, slower.


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
    """Whether a row is random without a top-k: the nucleus's (in a batch mixing them), skipped
    here."""
    return (tl.load(TOP_KS + row) <= 0) & (tl.load(TEMPS + row) > 0)


@triton.jit(do_not_specialize=["span"])
def _lane_max_kernel(X, TEMPS, TOP_KS, MAXIMA, n, stride, span, LANES: tl.constexpr):
    """Part `part` (columns part * span, + span) of a row: per lane (column % LANES), its largest
    logit."""
    row, part, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    X, lanes = X + row.to(tl.int64) * stride, tl.arange(0, LANES)
    best = tl.full([LANES], float("-inf"), tl.float32)
    for start in range(part * span, tl.minimum(part * span + span, n), LANES):
        best = tl.maximum(
            best,
            tl.load(X + start + lanes, mask=start + lanes < n, other=float("-inf")).to(tl.float32),
        )
    tl.store(MAXIMA + (row * parts + part) * LANES + lanes, best)


@triton.jit
def _kth_order(orders, k):
    """The k-th largest of a block of orders (_ordered's), by bisection on the int32 range: 32
    steps."""
    lo, hi = (
        tl.full((), -(2**31), tl.int64),
        tl.full((), 2**31 - 1, tl.int64),
    )  # the k-th lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((orders >= mid).to(tl.int32), axis=0) >= k
        lo, hi = tl.where(enough, mid, lo), tl.where(enough, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["parts"])  # varies with the batch
def _floor_kernel(MAXIMA, TEMPS, TOP_KS, FLOOR, parts, LANES: tl.constexpr):
    """A row's floor (as an order): the k-th largest of its lanes' maxima (k = 1 without a top-k: a
    greedy row)."""
    row, lanes = tl.program_id(0), tl.arange(0, LANES)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    best = tl.full([LANES], float("-inf"), tl.float32)
    for part in range(parts):
        best = tl.maximum(best, tl.load(MAXIMA + (row * parts + part) * LANES + lanes))
    k = tl.load(TOP_KS + row)
    kth = _kth_order(_ordered(best), tl.where(k > 0, k, 1))
    tl.store(FLOOR + row, kth.to(tl.int32))


@triton.jit(do_not_specialize=["span"])
def _gather_kernel(
    X, TEMPS, TOP_KS, FLOOR, COUNT, CAND, n, stride, span, CAP: tl.constexpr, BLOCK: tl.constexpr
):
    """Part `part` of a row: its logits at or above the floor, as sort keys, into the row's next
    free slots (COUNT counts them)."""
    row, part = tl.program_id(0), tl.program_id(1)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    X = X + row.to(tl.int64) * stride
    floor, cols = tl.load(FLOOR + row), tl.arange(0, BLOCK)
    for start in range(part * span, tl.minimum(part * span + span, n), BLOCK):
        in_row = start + cols < n
        x = tl.load(X + start + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        take = ((_ordered(x) >= floor) & in_row).to(tl.int32)
        if tl.sum(take, axis=0) > 0:
            slots = tl.atomic_add(COUNT + row, tl.sum(take, axis=0)) + tl.cumsum(take, axis=0) - 1
            tl.store(
                CAND + row * CAP + slots,
                _candidate_key(x, start + cols),
                mask=(take != 0) & (slots < CAP),
            )


@triton.jit
def _append(X, n, CAND, count, lo, hi, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The logits with lo <= _ordered(x) <= hi, lowest column first, into slots count, ... (< CAP):
    the new count."""
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
    logits above it and its ties, lowest column first, into CAND: how many (<= CAP; CAP >= 2k: the k
    kept are in)."""
    lo = tl.full((), -(2**31), tl.int64)
    hi = tl.full((), 2**31 - 1, tl.int64)
    while lo < hi:
        mid, count = (lo + hi + 1) >> 1, tl.full((), 0, tl.int32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
            count += tl.sum(((_ordered(x) >= mid) & (cols < n)).to(tl.int32), axis=0)
        enough = count >= k  # k or more at or above mid: the k-th is there
        lo, hi = tl.where(enough, mid, lo), tl.where(enough, hi, mid - 1)
    count = _append(
        X, n, CAND, tl.full((), 0, tl.int32), lo + 1, 2**31 - 1, CAP, BLOCK
    )  # above the k-th: < k
    return _append(X, n, CAND, count, lo, lo, CAP, BLOCK)  # its ties


@triton.jit
def _top_k_kernel(
    X,
    TEMPS,
    TOP_KS,
    TOP_PS,
    MIN_PS,
    KEYS,
    COUNT,
    CAND,
    OUT,
    n,
    stride,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST: tl.constexpr,
):
    """A row's draw among its candidates: sorted, keep_mask's rules (top-k, top-p on what it left,
    min-p), the race with each token id's number; temperature 0: the largest, lowest id first."""
    row, slots = tl.program_id(0), tl.arange(0, CAP)
    if _no_top_k(TEMPS, TOP_KS, row):
        return
    X, CAND, k, count = (
        X + row.to(tl.int64) * stride,
        CAND + row * CAP,
        tl.load(TOP_KS + row),
        tl.load(COUNT + row),
    )
    if count > CAP:  # the rare row whose candidates overflowed: its exact ones
        count = _exact_candidates(X, n, tl.maximum(k, 1), CAND, CAP, BLOCK)
        tl.debug_barrier()  # the program's own stores, visible to all its threads
    keys = tl.sort(tl.load(CAND + slots, mask=slots < count, other=-(2**63)), 0, descending=True)
    valid = slots < count
    # the keys' low halves
    ids = tl.where(valid, 0x7FFFFFFF - (keys - ((keys >> 32) << 32)).to(tl.int32), 0)
    t = tl.load(TEMPS + row)
    p, min_p = tl.load(TOP_PS + row), tl.load(MIN_PS + row)
    z = tl.load(X + ids, mask=valid, other=float("-inf")).to(tl.float32) * (
        LOG2E / tl.where(t > 0, t, 1.0)
    )
    e = tl.math.exp2(z - tl.max(z, axis=0))  # relative to the most likely: 1 there
    kept = (k < 0) | (slots < k)  # top-k
    mass = tl.where(kept, e, 0.0)
    kept &= tl.cumsum(mass, axis=0) - mass < tl.where(
        p < 1, p * tl.sum(mass, axis=0), float("inf")
    )  # top-p
    kept &= valid & (e >= min_p)  # min-p
    u = _noise(tl.load(KEYS + row), ids, tl.cdiv(n, 4))
    score = tl.where(kept, z - _fast_log2(_neg_log2(u, FAST), FAST), float("-inf"))
    won = tl.min(tl.where(score == tl.max(score, axis=0), slots, CAP), axis=0)
    chosen = tl.where(t > 0, won, 0)  # temperature 0: slot 0, the largest
    token = tl.sum(tl.where(slots == chosen, ids, 0), axis=0)
    tl.store(OUT + row, token.to(tl.int64))


TOP_K_GATHERED_MAX = (
    512  # top-k up to here: candidates from the lanes' maxima; above: a sort (Sampler)
)


def top_k_sample(
    x: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    keys: torch.Tensor,
    k_max: int,
    cap: int = 0,
) -> torch.Tensor:
    """Per row of x (rows, vocab): the argmax where the temperature is 0, else a draw from softmax(x
    / T) with top-k, top-p, min-p applied (keep_mask's rules), top-k at most k_max (<= 512). A
    random row without a top-k is skipped, its token left unset (the nucleus's). cap: candidate
    slots per row (default 2 k_max, a power of two). Returns (rows,) int64."""
    # fewer lanes than k: floor -inf
    (rows, n), lanes = (x.shape, min(1024, triton.next_power_of_2(x.shape[1])))
    assert x.stride(1) == 1 and 0 < k_max <= TOP_K_GATHERED_MAX
    cap = cap or triton.next_power_of_2(2 * k_max)
    span, parts = row_parts(n, lanes, rows)
    maxima = torch.empty(rows, parts, lanes, device=x.device)
    _lane_max_kernel[(rows, parts)](
        x, temperatures, top_ks, maxima, n, x.stride(0), span, LANES=lanes
    )
    floor = torch.empty(rows, dtype=torch.int32, device=x.device)
    count = torch.zeros_like(floor)
    _floor_kernel[(rows,)](maxima, temperatures, top_ks, floor, parts, LANES=lanes)
    candidates = torch.empty(rows, cap, dtype=torch.int64, device=x.device)
    _gather_kernel[(rows, parts)](
        x,
        temperatures,
        top_ks,
        floor,
        count,
        candidates,
        n,
        x.stride(0),
        span,
        CAP=cap,
        BLOCK=lanes,
    )
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _top_k_kernel[(rows,)](
        x,
        temperatures,
        top_ks,
        top_ps,
        min_ps,
        keys,
        count,
        candidates,
        out,
        n,
        x.stride(0),
        CAP=cap,
        BLOCK=2048,
        FAST=x.is_cuda,
        num_warps=8,
    )
    return out


# %%
from minivllm.kernels.sampling import top_k_sample

# 64 random rows of Qwen3's vocabulary
rows = torch.randn(64, 151_936, generator=torch.Generator().manual_seed(0))
maxima = (
    torch.nn.functional.pad(rows, (0, -151_936 % 1024), value=float("-inf"))
    .view(64, -1, 1024)
    .amax(dim=1)
)
# how many logits reach the floor, the k-th largest of the 1,024 lanes' maxima
for k in (50, 256, 512):
    candidates = (rows >= maxima.sort(dim=1, descending=True).values[:, k - 1 : k]).sum(dim=1)
    print(
        f"top-k {k}: {candidates.float().mean():.0f} candidates on average, at most "
        f"{candidates.max()}"
    )
    # every row's top-k among them, in 2k slots
    assert (candidates >= k).all() and (candidates <= 2 * k).all()
# The cat at T = 1, top-k 2: "mat" and "floor", renormalized; a greedy row: "mat"
drawn = top_k_sample(
    cat.expand(128, -1),
    rows_of(1, 128),
    rows_of(2, 128).long(),
    rows_of(1, 128),
    rows_of(0, 128),
    keys[:128],
    k_max=2,
).cpu()
show_probs(freq := torch.bincount(drawn, minlength=len(words)) / 128, "top-k")
assert set(drawn.tolist()) == {0, 1}
torch.testing.assert_close(freq[:2], torch.softmax(cat_logits[:2], dim=-1), atol=0.1, rtol=0)

# %% [markdown]
# ## The GPU sampler
# Each row takes the cheapest exact path for its filters: none, the race; top-p or min-p, the
# nucleus; a top-k up to 512, its candidates (random rows without a top-k beside them take the
# nucleus: one `torch.where`); a larger top-k, `topk` or, beside rows without one, a sort of the
# whole row, then `race_ids`. All-greedy batches are the core `Sampler`'s; on a CPU the draw is
# too. Penalties and banned tokens edit the logits before any sampler (deep dive sampling_options),
# in float32.


# %% tags=["export"] module="minivllm.layers.gpu_sampler"
import torch

from minivllm.kernels.sampling import TOP_K_GATHERED_MAX, nucleus, race, race_ids, top_k_sample
from minivllm.layers.sampler import Sampler, SamplingTensors, keep_mask


class GPUSampler(Sampler):
    """Notebook 04's Sampler, its draw on a GPU by Triton kernels: the same tokens, no sort below a
    top-k of 513."""

    def draw(
        self, logits: torch.Tensor, t: SamplingTensors
    ) -> torch.Tensor:  # logits: (batch, vocab)
        if not logits.is_cuda:
            return super().draw(logits, t)
        if not t.filtering:  # one pass; greedy rows too (temperature 0)
            return race(logits, t.temperatures, t.keys)
        if not t.largest_top_k:  # top-p, min-p: draw, check, draw again if outside
            return nucleus(logits, t.temperatures, t.top_ps, t.min_ps, t.keys)
        if t.largest_top_k <= TOP_K_GATHERED_MAX:  # top-k rows: their candidates
            drawn = top_k_sample(
                logits, t.temperatures, t.top_ks, t.top_ps, t.min_ps, t.keys, t.largest_top_k
            )
            if t.top_k_max:  # every random row has a top-k
                return drawn
            # random rows without one: the nucleus's
            others = (t.top_ks <= 0) & (t.temperatures > 0)
            return torch.where(
                others, nucleus(logits, t.temperatures, t.top_ps, t.min_ps, t.keys, others), drawn
            )
        greedy = t.temperatures == 0  # (batch,)
        temperatures = torch.where(greedy, 1.0, t.temperatures)[:, None]  # (batch, 1) float32
        k = min(t.top_k_max, logits.shape[-1])  # a top-k above the vocabulary keeps all of it
        # largest first
        top = logits.topk(k) if t.top_k_max else logits.sort(dim=-1, descending=True)
        scaled = top.values.float() / temperatures  # (batch, candidates)
        scaled.masked_fill_(
            ~keep_mask(torch.softmax(scaled, dim=-1), t.top_ks, t.top_ps, t.min_ps), float("-inf")
        )
        sampled = race_ids(
            scaled, torch.ones_like(t.temperatures), t.keys, top.indices, logits.shape[-1]
        )
        return torch.where(greedy, logits.argmax(dim=-1), sampled) if t.any_greedy else sampled


# %% [markdown]
# On a GPU the two samplers draw the same distributions; the
# kernels draw with Philox's numbers, not PyTorch's generator, so the tokens of one seed differ
# between them. Time per call on an H200 (`python -m minivllm.benchmarks.sampler`; on a CPU, the
# committed run): `ms` is one eager call with its host work, `kernel_ms` the GPU's time alone.

# %%
from minivllm.engine.step_inputs import sampling_tensors
from minivllm.layers.gpu_sampler import GPUSampler
from minivllm.sampling_params import SamplingParams

params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9)]
# greedy: "mat"
assert GPUSampler()(cat_logits.expand(2, -1), sampling_tensors(params, [0, 0]))[0] == 0
if DEVICE == "cuda":
    from minivllm.benchmarks.sampler import run_sampler_benchmark

    sampler_data = run_sampler_benchmark(batch_sizes=(1, 256))
else:
    sampler_data = json.loads(open("../figures/sampler.json").read())
for r in sampler_data["rows"]:
    times = f"{r['ms']:.3f} ms, {r['kernel_ms']:.3f} ms of kernels"
    print(f"{r['kind']:>18} batch {r['batch']:>3}: {times}")

# %% [markdown]
# ## Warm-up: every variant compiled at start-up
# Triton compiles a kernel the first time it runs with a new *specialization*: each value of a
# `tl.constexpr`, each kind of integer argument (1, a multiple of 16, other) that
# `do_not_specialize` does not name (notebook 01), each dtype of a pointer. A compile takes a few
# hundred milliseconds (tens from Triton's disk cache), and the request that first takes a path
# waits for it: on a server, its first users. The sampler has a handful of variants:
# `top_k_sample`'s candidate slots (2 k rounded up to a power of two, 10 values for k up to 512),
# `race_ids`' block above that (1,024, 2,048 or 4,096 candidates), the race with and without a
# retry's floors, and each of them on the model's logits and on float32 ones (penalties compute in
# float32). The integers that vary with the batch or with k are not specialized, so the batch size
# adds none. `warm_up_sampler` draws once with each; the runner calls it at start-up (deep dive
# cuda_graphs' warm-up).

# %% tags=["export"] module="minivllm.engine.sampler_warm_up"
import torch

from minivllm.engine.step_inputs import sampling_tensors
from minivllm.layers.sampler import Sampler
from minivllm.sampling_params import SamplingParams

# above top_k_sample's 512: race_ids over blocks of 1,024, 2,048 and 4,096
TOP_K_WIDTHS = (513, 1025, 2049)


def warm_up_params() -> list[SamplingParams]:
    """A request's sampling per variant of the GPU sampler's kernels: the race, the nucleus,
    top_k_sample's candidate slots (2 k rounded up to a power of two: 2 to 1,024), and race_ids'
    blocks (a top-k above the vocabulary is its width, so these cover every vocabulary)."""
    top_ks = [2**i for i in range(10)] + list(TOP_K_WIDTHS)
    return [SamplingParams(), SamplingParams(top_p=0.9), *(SamplingParams(top_k=k) for k in top_ks)]


def warm_up_sampler(sampler: Sampler, logits: torch.Tensor) -> None:
    """Draw with each of warm_up_params on logits (rows, vocab) and on their float32 copy, one row
    and all rows."""
    for x in (logits, logits.float()):  # the model's dtype; penalties' float32
        for rows in sorted({1, x.shape[0]}):
            for params in warm_up_params():
                sampler(x[:rows], sampling_tensors([params] * rows, [0] * rows, x.device))


# %% [markdown]
# The variants, and on a GPU the compiles they cost (a hook Triton calls after each), once: a second
# warm-up, or a batch of any size after it, compiles nothing.

# %%
import triton

from minivllm.engine.sampler_warm_up import warm_up_params, warm_up_sampler

slots = sorted(
    {triton.next_power_of_2(2 * p.top_k) for p in warm_up_params() if 0 < p.top_k <= 512}
)
print(
    f"{len(warm_up_params())} draws per batch size and dtype; top_k_sample's candidate slots: "
    f"{slots}"
)
assert slots == [2**i for i in range(1, 11)]
if DEVICE == "cuda":
    compiled: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    vocab_logits = torch.randn(64, 151_936, device=DEVICE, dtype=torch.bfloat16)
    for attempt in ("first", "second"):
        compiled.clear()
        warm_up_sampler(GPUSampler(), vocab_logits)
        print(f"{attempt} warm-up: {len(compiled)} compiles", sorted(set(compiled)))
    # 28 rows, a new batch size
    mixed = [SamplingParams(top_k=k, top_p=0.9) for k in (7, 40, 300, 600)] * 7
    GPUSampler()(vocab_logits[:28], sampling_tensors(mixed, [0] * 28, DEVICE))
    print(f"then 28 rows of top-k 7 to 600: {len(compiled)} compiles")
    assert not compiled
    triton.knobs.runtime.jit_post_compile_hook = None

# %% [markdown]
# ## Check yourself
# 1. The race's `q = -log2(u)` for `u` near 1 is tiny. For how many float32 values `u < 1` is it
#    smaller than the GPU's `log2` error, 2^-22 (why `_neg_log2` takes a series near 1)? Answer an
#    int.
# 2. `top_k_sample` with 4 lanes instead of 1,024, on the row `[11, 1, 2, 3, 10, 4, 5, 6, 9, 0, 7,
#    8]` at top-k 3: what is its floor (the 3rd largest of the lanes' maxima), and how many
#    candidates reach it? Answer `(floor, candidates)`.

# %%
import numpy as np

from minivllm.testing import check_answer

answer1 = answer2 = None  # your answers: replace None with expressions
# 1023 floats below 1
below_one = (torch.arange(1, 2**10, dtype=torch.int32) * -1 + 0x3F800000).view(torch.float32)
expected1 = int((-torch.log2(below_one.double()) < 2**-22).sum())
check_answer(answer1, expected1, "1. floats whose q is below log2's error")
row = torch.tensor([[11.0, 1, 2, 3, 10, 4, 5, 6, 9, 0, 7, 8]], device=DEVICE)
t1, k3 = rows_of(1, 1), rows_of(3, 1).long()  # one random row, top-k 3
row_maxima, row_floor = (
    torch.empty(1, 1, 4, device=DEVICE),
    torch.empty(1, dtype=torch.int32, device=DEVICE),
)
# one part of 12 columns, 4 lanes
_lane_max_kernel[(1, 1)](row, t1, k3, row_maxima, 12, 12, 12, LANES=4)
# an int32 order: a positive float's bits
_floor_kernel[(1,)](row_maxima, t1, k3, row_floor, 1, LANES=4)
floor2 = row_floor.view(torch.float32).item()
expected2 = (floor2, int((row >= floor2).sum()))
check_answer(answer2, expected2, "2. top-k's floor and candidates")

# %% [markdown]
# Worked answers. **1.** Near 1, `q = -ln(u) / ln 2 ≈ (1 - u) log2(e)`, below 2^-22 when `1 - u <
# 2^-22 ln 2 ≈ 1.65e-7`; float32 steps there are 2^-24 ≈ 6e-8 apart: `1 - u` = 1 or 2 steps, 2
# floats. Rare per token (about 1 in 8 million draws), but a row draws 151,936 numbers: about 2 % of
# rows hold such a token, and without the series its score could be +inf. **2.** Lane `c % 4`: lane
# 0 holds 11, 10, 9 (columns 0, 4, 8), lane 1 holds 1, 4, 0, lane 2 2, 5, 7, lane 3 3, 6, 8: maxima
# 11, 4, 7, 8, the 3rd largest 7. At or above it: 11, 10, 9, 7, 8, five candidates for k = 3,
# because the three largest share lane 0 (1,024 lanes make that rare).

# %%
threshold = 2**-22 * np.log(2)  # the 1 - u whose q = -log2(u) is log2's absolute error
steps_below = [j for j in (1, 2, 3) if j * 2**-24 < threshold]  # 1 - u in steps of 2^-24
check_answer(len(steps_below), expected1, "1. floats whose q is below log2's error")
lane_maxima = [max(row[0, lane::4].tolist()) for lane in range(4)]  # [11, 4, 7, 8]
floor = sorted(lane_maxima)[-3]
check_answer(
    (floor, sum(x >= floor for x in row[0].tolist())), expected2, "2. top-k's floor and candidates"
)
