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
# # 04 · The model runner: a step on the paged cache, and sampling
#
# **What this notebook builds.** What turns a batch of `Sequence`s into next tokens: a sampler, a
# step's inputs, the attention context over notebook 03's paged kernels, and the runner, which
# sizes the KV cache. It assumes notebook 02's Qwen3 and notebook 03's `Sequence`, `BlockManager`
# and kernels.
#
# **The one rule.** Every path (a prefix hit, a chunk, a mixed step, a long decode) gives the logits
# of a from-scratch forward: a paged engine that gets this wrong does not crash, it writes other
# text. Deep dives follow: `gpu_sampler` (sampling in Triton), `sampling_options` (penalties,
# log-probabilities) and `cuda_graphs` (the runner on a GPU).

# %%
import os
import random
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
random.seed(0)

# %% [markdown]
# ## Sampling: from logits to the next token
# The sampler turns each row of logits (151,936 for Qwen3) into a token id as its `SamplingParams`
# say: **temperature** makes the probabilities `softmax(logits / T)` (`T` < 1 sharpens, `T` > 1
# flattens; `T` = 0 is **greedy**, the argmax), **filters** drop the tail, **a draw** picks from the
# rest. Example: "The cat sat on the".

# %%
words = "mat floor sofa bed chair roof table rug fence keyboard moon piano".split()
# most likely first
cat_logits = torch.tensor([4.0, 3.1, 2.6, 2.2, 1.9, 1.4, 1.2, 1.0, 0.6, 0.1, -0.5, -1.5])


def show_probs(probs: torch.Tensor, label: str) -> None:
    pairs = zip(words, probs.tolist())
    shown = [f"{w} {p:.2f}" for w, p in pairs if p >= 0.005]
    print(f"{label:>6}: " + " ".join(shown))


probs_at = {T: torch.softmax(cat_logits / T, dim=-1) for T in (0.01, 0.5, 2.0)}
for T, probs in probs_at.items():
    show_probs(probs, f"T={T}")
assert probs_at[0.01][0] > 0.999  # nearly greedy
assert probs_at[0.5][0] > probs_at[2.0][0] > probs_at[2.0][1]  # flatter, the same order

# %% [markdown]
# ### Cutting the tail: top-k, top-p, min-p (typical-p to write: `exercises/04_sampler_filters`)
# A tail of 150,000 tokens at one in a million each holds 15% of the mass; one nonsense token
# derails the text. So filters drop it before the draw, in vLLM's order: **top-k** keeps the `k`
# most likely tokens (`-1`: off); **top-p** the fewest most likely whose mass reaches `p` of what
# top-k left (`1`: off); **min-p** those at least `min_p` times as likely as the first (`0`: off).
# **One sort serves all three**: each filter is then one comparison with a per-row threshold.

# %% tags=["export"] module="minivllm.layers.sampler"
from dataclasses import dataclass

import torch
from torch import nn


def keep_mask(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Which tokens top-k, then top-p, then min-p keep; each row of sorted_probs is sorted largest
    first."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)  # (vocab,)
    keep = (top_ks[:, None] < 0) | (ranks < top_ks[:, None])  # top-k  (batch, vocab)
    cum = (sorted_probs * keep).cumsum(dim=-1)  # (batch, vocab), running mass of what top-k kept
    # mass of the more likely tokens
    before = torch.nn.functional.pad(cum[:, :-1], (1, 0))
    # top-p of what top-k kept; p = 1 keeps all, even the tail a float32 sum no longer sees
    p_mass = top_ps[:, None] * cum[:, -1:]  # (batch, 1)
    keep &= (before < p_mass) | (top_ps[:, None] >= 1)
    # min-p, relative to the most likely token
    keep &= sorted_probs >= min_ps[:, None] * sorted_probs[:, :1]
    return keep


def filter_probs(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    k_max: int = 0,
) -> torch.Tensor:
    """probs (batch, vocab), the filters' drops set to 0; one sort, or topk if no row keeps over
    k_max > 0 tokens."""
    sort = probs.topk(min(k_max, probs.shape[-1])) if k_max else probs.sort(dim=-1, descending=True)
    keep = keep_mask(sort.values, top_ks, top_ps, min_ps)  # (batch, vocab or k_max)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, sort.indices, keep)  # vocab order
    return probs.masked_fill(~keep, 0.0)


# %%
from minivllm.layers.sampler import filter_probs, keep_mask

# by hand: top-p 0.8 keeps two tokens, as 0.5 + 0.3 *reaches* 0.8; after top-k 3, 0.5 + 0.3 is 0.84
# of what is left
hand = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def num_kept(top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> int:
    settings = (torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return int(keep_mask(hand, *settings).sum())


assert num_kept() == 4 and num_kept(top_k=3) == 3 and num_kept(top_k=1) == 1
assert num_kept(top_p=0.8) == 2 and num_kept(top_p=0.81) == 3 and num_kept(top_p=0.01) == 1
assert num_kept(top_p=0.82) == 3 and num_kept(top_k=3, top_p=0.82) == 2  # of what top-k left
assert num_kept(min_p=0.3) == 3 and num_kept(min_p=0.31) == 2  # keep p ≥ min_p × 0.5
cat_probs = torch.softmax(cat_logits, dim=-1)
# (top-k, top-p, min-p) a row
settings = [(3, 1.0, 0.0), (-1, 0.8, 0.0), (-1, 1.0, 0.1)]
settings.append((-1, 1.0, 0.0))  # none
filtered = filter_probs(cat_probs.expand(4, -1), *map(torch.tensor, zip(*settings)))
for name, row in zip(["top-k", "top-p", "min-p", "none"], filtered):
    show_probs(row, name)
assert (filtered > 0).sum(dim=-1).tolist() == [3, 4, 5, 12]
assert torch.equal(filtered[3], cat_probs)

# %% [markdown]
# ### Drawing a token: the exponential race, seeded per row
# `torch.multinomial` makes a GPU's host wait and draws every row from one generator. Instead, give
# token `i` an exponential alarm clock ringing after `q_i / p_i` seconds, `q_i ~ Exp(1)`: clock `i`
# rings first with probability `p_i / Σ_j p_j`, so the token is `argmax(p / q)` (`p` need not sum to
# 1; `p = 0` never wins). A seeded request gives the same tokens whatever its batch and row: each
# row's noise has **its own generator**, seeded `noise_seed(seed, step)`, the step being the token's
# index (`seq.num_completion_tokens`); without a seed, a fresh draw.

# %% tags=["export"]
# odd: distinct seeds start apart; above any step: one seed's steps never collide
NOISE_SEED_MULTIPLIER = 1_000_003


def noise_seed(seed: int, step: int) -> int:
    """The generator seed for the noise of token `step` of a request seeded with `seed`."""
    return (seed * NOISE_SEED_MULTIPLIER + step) % 2**63


def exponential_noise(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise shaped like probs (batch, vocab); row r's from a generator seeded with
    keys[r]."""
    q = torch.empty_like(probs)
    for row, key in enumerate(keys.tolist()):
        q[row].exponential_(generator=torch.Generator(probs.device).manual_seed(key))
    return q.clamp_min_(1e-10)  # a 0 would make p / q infinite, or NaN for a dropped token


# %%
from minivllm.layers.sampler import exponential_noise, noise_seed

p = torch.tensor([0.1, 0.0, 0.3, 0.2])  # unnormalized, one token dropped
# 200,000 races
q = torch.empty(200_000, 4).exponential_(generator=torch.Generator().manual_seed(0))
freq = torch.bincount((p / q).argmax(dim=-1), minlength=4) / len(q)
expected = (p / p.sum()).numpy().round(3)
print(f"frequencies: {freq.numpy().round(3)}, p / sum(p): {expected}")
assert freq[1] == 0
torch.testing.assert_close(freq, p / p.sum(), atol=0.005, rtol=0)
# seed 42 at step 7: the same noise in row 0 of one batch and row 2 of another; seed 5 at step 7,
# seed 42 at 8 differ
keys = torch.tensor([noise_seed(42, 7), noise_seed(42, 8)])
step7, step8 = exponential_noise(torch.ones(2, 1000), keys)
batch = exponential_noise(torch.ones(3, 1000), torch.tensor([123, noise_seed(5, 7), keys[0]]))
assert torch.equal(step7, batch[2]) and not torch.equal(batch[1], batch[2])
assert not torch.equal(step7, step8)

# %% [markdown]
# ### The sampler
# It gets the batch's parameters as `SamplingTensors`, a row each, with host-side flags that skip
# work (`filtering`, `all_greedy`, `any_greedy`), built by `sampling_tensors` from pinned memory
# while the GPU computes. (On a GPU: `GPUSampler`, deep dive `gpu_sampler`; vLLM's penalties,
# `min_tokens` and log-probabilities: deep dive `sampling_options`.)


# %% tags=["export"]
@dataclass(slots=True)
class SamplingTensors:
    """The batch's sampling parameters, one entry per row."""

    temperatures: torch.Tensor  # (batch,) float32; 0 = greedy
    top_ks: torch.Tensor  # (batch,) int64; -1 = off
    top_ps: torch.Tensor  # (batch,) float32; 1 = off
    min_ps: torch.Tensor  # (batch,) float32; 0 = off
    # (batch,) int64: noise_seed(seed, tokens generated so far), a fresh draw; empty if all greedy
    keys: torch.Tensor
    # some random row uses top-k, top-p or min-p; if none does, the sort is skipped
    filtering: bool = True
    # > 0: every random row has a top-k, this the largest: filter_probs sorts only that many
    top_k_max: int = 0
    # the largest top-k of a random row, 0 if none has one (on a GPU: the candidates' slots)
    largest_top_k: int = 0
    any_greedy: bool = True  # some row has temperature 0
    all_greedy: bool = False  # every row has: no random draw at all


class Sampler(nn.Module):
    """One token id per row of logits: the argmax where temperature is 0, else a draw from the
    filtered distribution."""

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:  # (batch, vocab)
        return logits.argmax(dim=-1) if t.all_greedy else self.draw(logits, t)

    def draw(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Temperature, the filters, the exponential race; greedy rows: the argmax."""
        greedy = t.temperatures == 0  # (batch,)
        temperatures = torch.where(greedy, 1.0, t.temperatures)[:, None]  # (batch, 1) float32
        probs = torch.softmax(logits / temperatures, dim=-1)  # (batch, vocab) float32
        if t.filtering:
            probs = filter_probs(probs, t.top_ks, t.top_ps, t.min_ps, t.top_k_max)
        sampled = probs.div_(exponential_noise(probs, t.keys)).argmax(dim=-1)  # (batch,)
        return torch.where(greedy, logits.argmax(dim=-1), sampled) if t.any_greedy else sampled


# a token's log-probabilities, as vLLM returns them: token id -> (log-probability, rank from 1)
TokenLogprobs = dict[int, tuple[float, int]]


# %% tags=["export"] module="minivllm.engine.step_inputs"
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from minivllm.attention.paged import PagedContext
from minivllm.engine.sequence import Sequence
from minivllm.layers.sampler import SamplingTensors, noise_seed
from minivllm.sampling_params import SamplingParams


def sampling_tensors(
    params: list[SamplingParams], steps: list[int], device: torch.device | str = "cpu"
) -> SamplingTensors:
    """A row per request: its parameters, and its noise's key from the tokens generated so far."""
    pin = torch.device(device).type == "cuda"

    def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    temperatures = [p.temperature for p in params]
    fresh = torch.randint(2**62, (len(params),)).tolist() if any(temperatures) else []
    seeds = [p.seed for p in params]
    keys = [k if s is None else noise_seed(s, n) for s, n, k in zip(seeds, steps, fresh)]
    random_top_ks = [p.top_k for p in params if p.temperature > 0]
    filters = [(p.top_k > 0) | (p.top_p < 1) | (p.min_p > 0) for p in params]
    filtering = any(f for f, t in zip(filters, temperatures) if t > 0)
    return SamplingTensors(
        temperatures=to_device(temperatures, torch.float32),
        top_ks=to_device([p.top_k for p in params], torch.int64),
        top_ps=to_device([p.top_p for p in params], torch.float32),
        min_ps=to_device([p.min_p for p in params], torch.float32),
        keys=to_device(keys, torch.int64),  # greedy draws no noise: empty
        filtering=filtering,
        top_k_max=max(random_top_ks) if min(random_top_ks, default=-1) > 0 else 0,
        largest_top_k=max([0, *random_top_ks]),
        any_greedy=0 in temperatures,
        all_greedy=not any(temperatures),
    )


# %%
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import sampling_tensors
from minivllm.layers.sampler import Sampler, SamplingTensors
from minivllm.sampling_params import SamplingParams


def tensors_of(seqs: list[Sequence]) -> SamplingTensors:  # what the runner does for its batch
    params, steps = [s.sampling_params for s in seqs], [s.num_completion_tokens for s in seqs]
    return sampling_tensors(params, steps, "cpu")


seqs = [
    Sequence([1, 2, 3], SamplingParams(temperature=0)),
    Sequence([4, 5], SamplingParams(top_k=20, seed=7)),
]
seqs[1].append_token(6)  # the second request has generated one token
print(sampling := tensors_of(seqs))
assert sampling.top_ks.dtype == torch.int64 and sampling.keys[1] == noise_seed(7, 1)
assert sampling.filtering and sampling.any_greedy and not sampling.all_greedy
assert not tensors_of(seqs[1:]).any_greedy
assert not tensors_of(seqs[:1]).filtering and tensors_of(seqs[:1]).all_greedy
sampler = Sampler()
# each word as often as softmax says
many = [Sequence([0], SamplingParams(temperature=0.5)) for _ in range(20_000)]
freq = torch.bincount(sampler(cat_logits.expand(20_000, -1), tensors_of(many)), minlength=12)
show_probs(freq := freq / 20_000, "T=0.5")
torch.testing.assert_close(freq, torch.softmax(cat_logits / 0.5, dim=-1), atol=0.01, rtol=0)
mixed = [Sequence([0], SamplingParams(temperature=T, top_p=0.5)) for T in (0.0, 1.5, 0.0, 3.0)]
drawn = sampler(cat_logits.expand(4, -1), tensors_of(mixed))
assert drawn[[0, 2]].tolist() == [0, 0]  # greedy rows say "mat"

# %% [markdown]
# ## A step's inputs (a speculative verify step to write: `exercises/04_verify_step`)
# The runner **prepares** a step on the host, in NumPy (a loop per token costs more than the GPU's
# step): for a prefill, each sequence's `num_scheduled_tokens` after its `num_cached_tokens`,
# packed, with positions, slots, `cu_seqlens_q` (new tokens), `cu_seqlens_k` (cached + new), block
# tables if something is cached; for a decode, each last token's. A **placeholder** id
# `placeholder(row)` stands for a token the previous step sampled, not on the host yet (06).


# %% tags=["export"]
def placeholder(row: int) -> int:
    """The token id that stands for row `row` of the previous step's sampled tokens (negative: no
    real id)."""
    return -1 - row


def placeholder_row(token_ids: torch.Tensor) -> torch.Tensor:
    """The rows that placeholder ids stand for (placeholder's inverse); a real id (>= 0) gives row
    0."""
    return (-1 - token_ids).clamp_min(0)


@dataclass(slots=True)
class StepInputs:
    """One step's inputs as host arrays."""

    is_prefill: bool
    input_ids: np.ndarray  # (num_tokens,) int64
    positions: np.ndarray  # (num_tokens,) int64
    slot_mapping: np.ndarray  # (num_tokens,) int64
    # (num_seqs, max_blocks) int32; None: a prefill with nothing cached
    block_tables: np.ndarray | None
    cu_seqlens_q: np.ndarray | None = None  # prefill: (num_seqs + 1,) int32
    cu_seqlens_k: np.ndarray | None = None  # prefill: (num_seqs + 1,) int32
    context_lens: np.ndarray | None = None  # decode: (num_seqs,) int32
    # prefill: (num_rows,) int64, the rows whose logits the step returns; None: each sequence's last
    logits_rows: np.ndarray | None = None


def block_tables_array(seqs: list[Sequence]) -> np.ndarray:  # (num_seqs, max_blocks) int32
    tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    return tables


def slots_of(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int):
    """The cache slot of each token: its sequence's block at that position, and the offset."""
    blocks = tables[rows, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def prepare_prefill(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Each sequence's scheduled tokens, those after its cached ones, packed end to end."""
    starts = np.array([seq.num_cached_tokens for seq in seqs], dtype=np.int64)
    lens = np.array([seq.num_scheduled_tokens for seq in seqs], dtype=np.int64)
    ends = starts + lens
    assert all(s < e <= len(seq) for seq, s, e in zip(seqs, starts, ends)), (
        "a prefill computes 1..len - cached tokens"
    )
    cu_q = np.cumsum([0, *lens], dtype=np.int32)
    seq_of = np.repeat(np.arange(len(seqs)), lens)  # (num_tokens,): each new token's sequence
    positions = np.arange(cu_q[-1]) - cu_q[seq_of] + starts[seq_of]
    tables = block_tables_array(seqs)
    token_ids = chain.from_iterable(seq.token_ids[s:e] for seq, s, e in zip(seqs, starts, ends))
    return StepInputs(
        is_prefill=True,
        input_ids=np.fromiter(token_ids, dtype=np.int64, count=int(cu_q[-1])),
        positions=positions,
        slot_mapping=slots_of(tables, seq_of, positions, block_size),
        block_tables=tables if starts.any() else None,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=np.cumsum([0, *ends], dtype=np.int32),
    )


def prepare_decode(seqs: list[Sequence], block_size: int) -> StepInputs:
    """Each sequence's newest token, which attends to its whole cache (itself included)."""
    context_lens = np.array([len(seq) for seq in seqs], dtype=np.int32)
    tables = block_tables_array(seqs)
    last = context_lens.astype(np.int64) - 1  # the new token's position
    slots = slots_of(tables, np.arange(len(seqs)), last, block_size)
    input_ids = np.array([seq.last_token for seq in seqs], dtype=np.int64)
    return StepInputs(False, input_ids, last, slots, tables, context_lens=context_lens)


# %% [markdown]
# ## A forward pass over the paged cache
# Notebook 02's attention layers hand `q`, `k`, `v` to an `AttentionContext`: paging is one new
# context per step, and each layer's cache hangs on its `Attention` module (`k_cache`, `v_cache`).
# Every step first stores its new tokens' KV in their slots. Then a **decode** runs 03's kernel over
# each sequence's cache; a **prefill** runs 01's kernel, over the new `k`, `v` alone when nothing is
# cached, else over each sequence's keys and values read back from its blocks. A **mixed** step
# (05's decode rows beside prompt chunks) is a prefill whose decode rows have one new token each.
# (Deep dives `paged_prefill` and `cuda_graphs` read the blocks inside the kernels; decode rows
# anywhere: `exercises/04_mixed_attention.ipynb`.)

# %% tags=["export"] module="minivllm.attention.paged"
from dataclasses import dataclass

import torch

from minivllm.attention.layer import Attention
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous
from minivllm.kernels.paged_attn import flash_attn_with_kvcache, store_kvcache
from minivllm.kernels.paged_reference import gather_kv, paged_attention_ref, store_kvcache_ref
from minivllm.kernels.reference import attention_ref


@dataclass(slots=True)
class PagedContext:
    """How one step attends: where its new tokens' KV goes, and which cached KV they read."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # (num_tokens,): cache slot of each new token's KV; -1 = padding
    block_tables: torch.Tensor | None  # (num_seqs, max_blocks) int32; None: nothing cached yet
    cu_seqlens_q: torch.Tensor | None = None  # prefill: (num_seqs + 1,) int32, new tokens
    cu_seqlens_k: torch.Tensor | None = None  # prefill: (num_seqs + 1,) int32, cached + new
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: torch.Tensor | None = None  # decode: (num_seqs,) int32, the new token included
    use_triton: bool = True  # False: the PyTorch reference ops (quicker on a CPU)

    def attend(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim)
        store = store_kvcache if self.use_triton else store_kvcache_ref
        store(k, v, layer.k_cache, layer.v_cache, self.slot_mapping)
        if self.is_prefill:
            return self.prefill(layer, q, k, v)
        return self.decode(layer, q)

    def decode(self, layer: Attention, q: torch.Tensor) -> torch.Tensor:
        """One new token per sequence, over its whole cache."""
        lens, tables = self.context_lens, self.block_tables
        assert lens is not None and tables is not None  # a decode step has both
        if self.use_triton:
            kv = (layer.k_cache, layer.v_cache)
            return flash_attn_with_kvcache(q[:, None], *kv, lens, tables, layer.scale)[:, 0]
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        cu_k = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        return paged_attention_ref(q, layer.k_cache, layer.v_cache, cu_q, cu_k, tables, layer.scale)

    def prefill(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """New tokens over the keys before them: their own, and those of any cached prefix."""
        cu_q, cu_k = self.cu_seqlens_q, self.cu_seqlens_k
        assert cu_q is not None and cu_k is not None  # a prefill step has both
        if self.block_tables is not None:  # a prefix is cached: read every key back, in order
            lens = (cu_k[1:] - cu_k[:-1]).tolist()
            rows = list(zip(self.block_tables, lens))
            k = torch.cat([gather_kv(layer.k_cache, table, n) for table, n in rows])
            v = torch.cat([gather_kv(layer.v_cache, table, n) for table, n in rows])
        max_q, max_k = self.max_seqlen_q, self.max_seqlen_k
        if self.use_triton:
            return flash_attn_varlen_contiguous(
                q, k, v, cu_q, cu_k, max_q, max_k, layer.scale, True
            )
        return attention_ref(q, k, v, cu_q, cu_k, layer.scale, causal=True)


# %% tags=["export"] module="minivllm.engine.step_inputs"
def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device: through pinned memory, without waiting, on a GPU."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def step_to_device(
    step: StepInputs, device: torch.device, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor, PagedContext]:  # ids, positions, context
    """The step's arrays on the device, in a PagedContext."""

    def put(a: np.ndarray) -> torch.Tensor:
        return to_device(a, device)

    def maybe(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else put(a)

    context = PagedContext(step.is_prefill, put(step.slot_mapping), maybe(step.block_tables))
    context.context_lens, context.use_triton = maybe(step.context_lens), use_triton
    if step.is_prefill:
        assert step.cu_seqlens_q is not None and step.cu_seqlens_k is not None
        context.cu_seqlens_q, context.cu_seqlens_k = put(step.cu_seqlens_q), put(step.cu_seqlens_k)
        context.max_seqlen_q = int(np.diff(step.cu_seqlens_q).max())
        context.max_seqlen_k = int(np.diff(step.cu_seqlens_k).max())
    return put(step.input_ids), put(step.positions), context


# %% [markdown]
# ## The model runner
# ### How big can the KV cache be?
# A cached token holds a key and a value per KV head and layer (`kv_block_bytes`). On a GPU, what
# `gpu_memory_utilization` leaves after the weights and the largest step's peak becomes KV blocks;
# on a CPU, ≤ 1 GiB.


# %% tags=["export"] module="minivllm.engine.kv_cache"
import torch

from minivllm.attention.layer import Attention
from minivllm.attention.prefill import PrefillContext
from minivllm.config import Config
from minivllm.engine.step_inputs import sampling_tensors
from minivllm.layers.sampler import Sampler
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.sampling_params import SamplingParams


def kv_block_bytes(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block in every layer: the unit the cache is sized in."""
    token_bytes = 2 * sum(layer.num_kv_heads * layer.head_dim for layer in layers) * dtype.itemsize
    return block_size * token_bytes  # each token: a key and a value per KV head and layer


@torch.inference_mode()
def profile_step(
    model: Qwen3ForCausalLM, sampler: Sampler, config: Config, device: torch.device
) -> None:
    """The largest step the engine will run: a full prefill, then sampling for max_num_seqs rows."""
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    full, rest = divmod(num_tokens, config.max_model_len)  # prompts at max_model_len, one shorter
    lens = [config.max_model_len] * full + [rest] * (rest > 0)
    input_ids = torch.zeros(sum(lens), dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(input_ids, positions, PrefillContext.from_lens(lens, device))
    logits = model.compute_logits(hidden[-1:].expand(config.max_num_seqs, -1))
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * config.max_num_seqs
    sampler(logits, sampling_tensors(params, [0] * config.max_num_seqs, device))


def gpu_free_blocks(block_bytes: int, gpu_memory_utilization: float) -> int:
    """KV blocks that fit in the GPU's share, after the weights and the peak of the profiling step
    just run."""
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    step_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    # PyTorch's, free to reuse
    cached = stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]
    used = total - free - cached
    return int(total * gpu_memory_utilization - used - step_peak) // block_bytes


def bind_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, dtype, device) -> None:
    """One tensor for the whole cache; each layer gets its K and V views, (num_blocks, block_size,
    kv_heads, d)."""
    shape = (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    kv = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]


# %% [markdown]
# ### Putting it together
# `ModelRunner(config)` loads the model (one tensor-parallel rank's slice, given its groups) and
# sizes the KV cache. `launch(seqs, is_prefill)` prepares the step, runs the model, samples, and
# returns a function that gives the step's output; `run` calls it at once. Each part is a method of
# its own, so a deep dive changes one part in a subclass (the GPU fast paths, sampling options,
# tensor parallelism, async scheduling); nothing here imports them.

# %% tags=["export"] module="minivllm.engine.model_runner"
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.attention.layer import Attention
from minivllm.config import Config
from minivllm.engine.kv_cache import bind_kv_cache, gpu_free_blocks, kv_block_bytes, profile_step
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import (
    StepInputs,
    prepare_decode,
    prepare_prefill,
    sampling_tensors,
    step_to_device,
    to_device,
)
from minivllm.layers.linear import TPGroup, tensor_parallel
from minivllm.layers.sampler import Sampler, TokenLogprobs
from minivllm.models.loader import load_model
from minivllm.models.qwen3 import Qwen3ForCausalLM

PromptLogprobs = tuple[int, list[TokenLogprobs]]  # the first prompt position scored, a row each


@dataclass(slots=True)
class StepOutput:
    """What a step gives each sequence: its next token and, where its parameters ask,
    log-probabilities."""

    token_ids: list[int]  # (num_seqs,)
    logprobs: list[TokenLogprobs | None]  # of the next token (SamplingParams.logprobs)
    prompt_logprobs: list[PromptLogprobs | None]  # (SamplingParams.prompt_logprobs)


def rank_device(config: Config, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}" if config.device == "cuda" else "cpu")


# %% tags=["export"]
class ModelRunner:
    """One rank's runner: the whole model (`groups=None`), or given a tensor-parallel rank's groups,
    its slice. Every step runs eagerly."""

    def __init__(self, config: Config, rank: int = 0, groups: tuple[TPGroup, Any] | None = None):
        if groups is None and config.tensor_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size > 1 needs one process per rank: use minivllm.LLM (the deep "
                "dive tensor_parallel's runner)"
            )
        self.config, self.rank, self.block_size = config, rank, config.block_size
        self.world_size = config.tensor_parallel_size
        self.device = rank_device(config, rank)
        self.use_triton = self.device.type == "cuda"  # on a CPU, PyTorch's reference ops
        self.control: Any  # the gloo group that carries rank 0's messages (TP); None for one rank
        self.tp, self.control = groups or (TPGroup(), None)
        self.model: Qwen3ForCausalLM | None = None  # None once the GPU memory is freed
        self.closed = False
        self.startup_seconds: dict[str, float] = {}  # `python -m minivllm` prints the phases
        try:
            self.start()
        except BaseException:
            self.free_gpu_memory()
            raise

    def start(self) -> None:
        """Load the model, then size and allocate the KV cache."""
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.seed)
        self.model = self.load()
        self.dtype = self.model.lm_head.weight.dtype
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = self.make_sampler()
        loaded = time.perf_counter()
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.startup_seconds = {"load": loaded - start, "KV cache": time.perf_counter() - loaded}

    def load(self) -> Qwen3ForCausalLM:
        config = self.config
        with tensor_parallel(self.tp):  # the layers keep this engine's group
            return load_model(config.model, config.dtype, self.device, config.hf_config)

    def make_sampler(self) -> Sampler:
        return Sampler()

    def close(self) -> None:
        """Free the GPU memory: the weights and the KV cache."""
        if not self.closed:
            self.closed = True
            self.free_gpu_memory()

    def free_gpu_memory(self) -> None:
        """Give the weights and the KV cache back to the GPU: a next engine sizes its own cache."""
        if self.device.type != "cuda":
            return
        for layer in getattr(self, "attention_layers", []):
            layer.k_cache = layer.v_cache = None
        self.model = None
        gc.collect()
        torch.cuda.empty_cache()

    def num_kv_blocks(self, block_bytes: int) -> int:
        """As many blocks as every sequence at its longest needs, if the memory allows."""
        config = self.config
        wanted = config.max_num_seqs * -(-config.max_model_len // self.block_size)
        if config.num_kvcache_blocks:
            return config.num_kvcache_blocks
        if self.device.type != "cuda":
            return min(wanted, 2**30 // block_bytes)  # a CPU: at most 1 GiB
        torch.cuda.reset_peak_memory_stats(self.device)
        assert self.model is not None  # loaded before the cache is sized
        profile_step(self.model, self.sampler, config, self.device)
        return min(gpu_free_blocks(block_bytes, config.gpu_memory_utilization), wanted)

    def allocate_kv_cache(self) -> int:
        block_bytes = kv_block_bytes(self.attention_layers, self.block_size, self.dtype)
        num_blocks = self.num_kv_blocks(block_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"no room for a KV cache: gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization} leaves less than one block ({block_bytes} "
                f"bytes) after the weights and activations"
            )
        layers, dtype = self.attention_layers, self.dtype
        bind_kv_cache(layers, num_blocks, self.block_size, dtype, self.device)
        return num_blocks

    # --- a step -----------------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], is_prefill: bool) -> StepInputs:
        return (prepare_prefill if is_prefill else prepare_decode)(seqs, self.block_size)

    def device_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return step_to_device(step, self.device, self.use_triton)  # ids, positions, context

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Any):
        assert self.model is not None, "the runner is closed"
        return self.model(input_ids, positions, context)  # (num_tokens, hidden_size)

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:  # (num_rows, vocab_size) logits
        input_ids, positions, context = self.device_inputs(step)
        hidden = self.forward(input_ids, positions, context)  # (num_tokens, hidden_size)
        if step.is_prefill:  # each sequence's last token, or the rows logits_rows names
            assert step.cu_seqlens_q is not None  # a prefill step has it
            last = step.cu_seqlens_q[1:] - 1
            rows = last if step.logits_rows is None else step.logits_rows
            # to_device: a plain .to() would wait for the GPU to finish the step
            hidden = hidden[to_device(rows, hidden.device)]  # (num_rows, hidden_size)
        assert self.model is not None
        return self.model.compute_logits(hidden)

    def step_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        return self.execute(self.prepare(seqs, is_prefill))

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:  # (num_seqs,)
        params, steps = [s.sampling_params for s in seqs], [s.num_completion_tokens for s in seqs]
        return self.sampler(logits, sampling_tensors(params, steps, self.device))

    def to_host(self, token_ids: torch.Tensor) -> Callable[[], list[int]]:
        """A function that gives the sampled ids as a list (here: they are copied at once)."""
        ids = token_ids.tolist()
        return lambda: ids

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One step for these sequences: the next token of each."""
        return self.launch(seqs, is_prefill)().token_ids

    def launch(self, seqs: list[Sequence], is_prefill: bool) -> Callable[[], StepOutput]:
        """Run a step; a function that gives its output (here no log-probabilities)."""
        token_ids = self.sample(seqs, self.step_logits(seqs, is_prefill))  # (num_seqs,)
        return self.deliver(token_ids, StepOutput([], [None] * len(seqs), [None] * len(seqs)))

    def deliver(self, token_ids: torch.Tensor, out: StepOutput) -> Callable[[], StepOutput]:
        """A function that gives `out` with the sampled ids, once they are on the host."""
        host_ids = self.to_host(token_ids)

        def output() -> StepOutput:
            out.token_ids = host_ids()
            return out

        return output


# %% [markdown]
# ## Every path gives a from-scratch forward's logits (a bug to find: `exercises/04_find_the_bug`)
# On notebook 02's tiny checkpoint: prompts prefilled, then decoded through shuffled block tables;
# at every step the logits equal `prompt_logits` of the whole sequence. Then a prefix-cache hit and
# a chunked prefill (05), each chunk in a mixed step with a decode row.

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.step_inputs import prepare_decode, prepare_prefill
from minivllm.models.loader import load_model
from minivllm.testing import prompt_logits

CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()
tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
reference = load_model(tiny_path, dtype=torch.float32, device=DEVICE)


def admit(bm: BlockManager, seq: Sequence) -> None:  # notebook 05's scheduler, in short
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))  # the full blocks go into the prefix cache
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens


def error_of(logits: torch.Tensor, token_ids: list[int]) -> float:  # vs a from-scratch forward
    return (logits - prompt_logits(reference, token_ids)[-1]).abs().max().item()


def check_steps(runner: ModelRunner, prompts: list[list[int]], num_decode_steps: int) -> float:
    """Prefill `prompts`, decode greedily; the worst error of every step's logits."""
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    random.shuffle(bm.free_block_ids)  # block tables far from contiguous
    seqs = [Sequence(p, block_size=runner.block_size) for p in prompts]
    for seq in seqs:
        admit(bm, seq)
    worst = 0.0
    for step in range(num_decode_steps + 1):
        for seq, row in zip(seqs, runner.step_logits(seqs, is_prefill=step == 0)):
            worst = max(worst, error_of(row, seq.token_ids))
            seq.append_token(int(row.argmax()))
            bm.may_append(seq)
    return worst


runner = ModelRunner(Config(tiny_path, num_kvcache_blocks=64, dtype=torch.float32, max_num_seqs=8))
prompts = [random.choices(range(2048), k=n) for n in (1, 15, 16, 17, 100)]
worst = check_steps(runner, prompts, num_decode_steps=40)
print(f"5 prompts, prefill + 40 decode steps, shuffled blocks: worst logit error {worst:.1e}")
assert worst < 1e-4
# the same through the Triton kernels (on a CPU, in the interpreter, so fewer steps)
runner.use_triton = True
worst = check_steps(runner, prompts[:3], num_decode_steps=3)
print(f"Triton kernels: worst logit error {worst:.1e}")
assert worst < 1e-4
runner.use_triton = DEVICE == "cuda"
system_prompt = random.choices(range(2048), k=48)  # three full blocks of 16
bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
first = Sequence(system_prompt + [1, 2, 3], block_size=16)
second = Sequence(system_prompt + [4, 5, 6, 7], block_size=16)
admit(bm, first)
runner.step_logits([first], is_prefill=True)
admit(bm, second)
assert second.num_cached_tokens == 48  # three blocks reused: prefill computes 4 tokens, not 52
# its 4 tokens' positions and slots; its keys: cached + new
step = prepare_prefill([second], block_size=16)
assert list(step.cu_seqlens_q) == [0, 4] and list(step.cu_seqlens_k) == [0, 52]
assert step.positions.tolist() == [48, 49, 50, 51]
assert step.block_tables is not None and step.slot_mapping[0] == second.block_table[3] * 16
error = error_of(runner.step_logits([second], is_prefill=True)[0], second.token_ids)
print(f"prefix-cache hit: 48 of {len(second)} tokens reused, logit error {error:.1e}")
assert error < 1e-4
long = Sequence(random.choices(range(2048), k=100), block_size=16)
bm.allocate(long)
# three mixed steps: `first` decodes a token, `long` computes tokens 0..36, 37..63, 64..99
for end in (37, 64, 100):
    first.append_token(7)
    bm.may_append(first)
    # a decode row (05 puts them first)
    first.num_cached_tokens, first.num_scheduled_tokens = len(first) - 1, 1
    bm.cache_blocks(long, end)
    long.num_scheduled_tokens = end - long.num_cached_tokens
    decoded, logits = runner.step_logits([first, long], is_prefill=True)
    long.num_cached_tokens = end  # the step has run: these tokens' KV is in the cache
    error = max(error_of(decoded, first.token_ids), error_of(logits, long.token_ids[:end]))
    assert error < 1e-4
print(f"100 tokens in chunks of 37, 27, 36, each beside a decode row: logit error {error:.1e}")

# %% [markdown]
# ### How fast: a whole decode step
# `python -m minivllm.benchmarks.decode_step` times `runner.run(seqs, is_prefill=False)`, 0.6B,
# eager and with graphs.

# %%
import json

from minivllm.benchmarks.decode_step import run_decode_step_benchmark

saved = Path("figures/decode_step.json")  # an H200 run's, shown on a CPU
if DEVICE == "cuda":
    step_data = run_decode_step_benchmark(batch_sizes=(1, 8, 64))
else:
    step_data = json.loads(saved.read_text())
cache = f"{step_data['kv_cache_tokens'] / 1e6:.2f} M tokens"
print(f"KV cache on {step_data['device']}: {cache}; ms per step:")
ms_per_step = {f"{r['impl']}, batch {r['batch']}": r["ms"] for r in step_data["rows"]}
print({name: round(ms, 2) for name, ms in ms_per_step.items()})

# %% [markdown]
# ## Check yourself
# Set each `answerN` and run its cell; the worked answer follows.
#
# **1.** A mixed step of three rows: `a` decodes its 41st token (40 in its cache); `b`, a 70-token
# prompt, found its first 48 tokens in the prefix cache; `c`, a 30-token prompt, computes a first
# chunk of 20. What are the step's `cu_seqlens_q` and `cu_seqlens_k`? Answer two lists,
# `(cu_q, cu_k)`.

# %%
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
bm = BlockManager(num_blocks=16, block_size=16)
rows = [Sequence(random.choices(range(2048), k=n), block_size=16) for n in (41, 70, 30)]  # a, b, c
for seq, cached, new in zip(rows, (40, 48, 0), (1, 22, 20)):  # as notebook 05's scheduler sets them
    bm.allocate(seq)
    seq.num_cached_tokens, seq.num_scheduled_tokens = cached, new
mixed_step = prepare_prefill(rows, block_size=16)
expected1 = (mixed_step.cu_seqlens_q.tolist(), mixed_step.cu_seqlens_k.tolist())
check_answer(answer1, expected1, "1. a mixed step's cu_seqlens")

# %% [markdown]
# Worked answer: the new tokens are 1, 70 − 48 = 22 and 20: `cu_seqlens_q` is `[0, 1, 23, 43]`. The
# keys are the cached and the new ones: 41, 70 and 20 (the chunk sees only itself), so
# `cu_seqlens_k` is `[0, 41, 111, 131]`.

# %%
cu_q = [0, 1, 1 + 22, 23 + 20]  # running sums of the new tokens
cu_k = [0, 41, 41 + 70, 111 + 20]  # and of the keys, cached and new
check_answer((cu_q, cu_k), expected1, "1. a mixed step's cu_seqlens")

# %% [markdown]
# **2.** The runner sizes the KV cache of Qwen3-0.6B (bfloat16, blocks of 16) on a GPU of 80 GiB
# with `gpu_memory_utilization=0.9`. After loading, 2 GiB are in use (weights, CUDA context); the
# profiling step peaked 3 GiB above that. How many KV blocks does it get? (The cell stands in for
# `torch.cuda`'s memory queries, so it runs on any machine.)

# %%
from unittest import mock

from minivllm.attention.layer import Attention
from minivllm.checkpoint import preset_config
from minivllm.engine.kv_cache import gpu_free_blocks, kv_block_bytes
from minivllm.models.qwen3 import Qwen3ForCausalLM

answer2 = None  # your answer: replace None with an expression
with torch.device("meta"):  # shapes only
    qwen06 = Qwen3ForCausalLM(preset_config("qwen3-0.6b"))
layers = [m for m in qwen06.modules() if isinstance(m, Attention)]
GiB = 2**30
memory = (78 * GiB, 80 * GiB)  # free, total: 2 GiB in use
stats = {"allocated_bytes.all.current": 2 * GiB, "reserved_bytes.all.current": 2 * GiB}
stats["allocated_bytes.all.peak"] = 5 * GiB  # the profiling step's peak, 3 GiB above
with (
    mock.patch.object(torch.cuda, "mem_get_info", lambda: memory),
    mock.patch.object(torch.cuda, "memory_stats", lambda: stats),
):
    kv_blocks = gpu_free_blocks(kv_block_bytes(layers, 16, torch.bfloat16), 0.9)
check_answer(answer2, kv_blocks, "2. KV blocks")

# %% [markdown]
# Worked answer: a block is 16 tokens × 2 (K and V) × 28 layers × 8 KV heads × 128 × 2 bytes
# = 1.75 MiB (notebook 03's 112 KiB a token, 16 times). The cache gets 0.9 × 80 GiB less the 2 GiB
# in use and the step's 3 GiB: 67 GiB, or 67 × 1,024 / 1.75 = 39,204 blocks, 627,264 tokens.

# %%
block_bytes = 16 * 2 * 28 * 8 * 128 * 2
cache_bytes = 0.9 * 80 * GiB - 2 * GiB - 3 * GiB  # the share, less what is in use, less the peak
check_answer(int(cache_bytes) // block_bytes, kv_blocks, "2. KV blocks")
