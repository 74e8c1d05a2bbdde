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
# # Exercise 04 · Find the bug: a prefix-cache hit that changes the answer
#
# A colleague wrote an attention context for CPU runs: the same job as notebook 04's `PagedContext`,
# with the PyTorch reference ops only. Their test passes: prompts prefilled, then decoded for ten
# steps, every logit equal to a from-scratch forward. Yet users say that with prefix caching on, the
# same prompt sometimes gets a different answer. There is exactly one bug in `SuspectContext` below.
#
# **Your task.** The way you would in a real engine: first a test that fails, then the fix.
#
# 1. Write `prefix_hit_check`, a check that exposes the bug: a second request that shares a cached
#    prefix with a first, its logits compared with `prompt_logits` (the from-scratch oracle of
#    notebook 04's "Every path gives the logits of a from-scratch forward"). It must fail on
#    `SuspectContext` and pass on minivllm's `PagedContext`.
# 2. Find the bug, and fix it in `FixedContext`, a subclass of the suspect that overrides the one
#    method at fault.
#
# **What it assumes.** Notebook 03's `BlockManager` (prefix caching: `allocate` shares the cached
# full blocks of a prompt and sets `num_cached_tokens`) and notebook 04's sections "A forward pass
# over the paged cache" and "The model runner" (`StepInputs`, `prepare_prefill`, `PagedContext`). No
# GPU: everything runs on a CPU in about 20 seconds. About 30 minutes.

# %%
import dataclasses
import random
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm.attention.layer import Attention
from minivllm.attention.paged import PagedContext
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_inputs import StepInputs, step_to_device
from minivllm.kernels.paged_reference import paged_attention_ref, store_kvcache_ref
from minivllm.kernels.reference import attention_ref
from minivllm.models.loader import load_model
from minivllm.testing import exercise, prompt_logits

tmp_dir = tempfile.TemporaryDirectory(prefix="minivllm-bug-")  # deleted when the kernel exits
tiny_path = write_checkpoint(Path(tmp_dir.name) / "tiny", "tiny", seed=0)
# for prompt_logits: no KV cache at all
reference = load_model(tiny_path, dtype=torch.float32, device="cpu")

# %% [markdown]
# ## The suspect
# `PagedContext`'s fields (notebook 04) with the colleague's `attend`: store every new token's K and
# V in its slot, then a prefill or a decode. Read it now, but do not hunt for the bug yet: write the
# test first.


# %%
class SuspectContext(PagedContext):
    """How one step attends, on a CPU: PagedContext's fields, the PyTorch reference ops."""

    def attend(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim)
        # each new token's KV, in its slot
        store_kvcache_ref(k, v, layer.k_cache, layer.v_cache, self.slot_mapping)
        if self.is_prefill:
            return self.prefill(layer, q, k, v)
        return self.decode(layer, q)

    def decode(self, layer: Attention, q: torch.Tensor) -> torch.Tensor:
        """One new token per sequence: it attends to its sequence's whole cache, itself included."""
        # a decode step has both
        assert self.context_lens is not None and self.block_tables is not None
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        cu_k = F.pad(self.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return paged_attention_ref(
            q, layer.k_cache, layer.v_cache, cu_q, cu_k, self.block_tables, layer.scale
        )

    def prefill(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Each sequence's new tokens, packed end to end: causal attention among them."""
        cu_q = self.cu_seqlens_q
        assert cu_q is not None  # a prefill step has it
        return attention_ref(q, k, v, cu_q, cu_q, layer.scale, causal=True)


# %% [markdown]
# A runner that attends through any context class: notebook 04's `ModelRunner` with its `execute`
# rebuilt around `context_cls`. `runner.context_cls = SuspectContext` runs every step of the model
# through the suspect; `runner.context_cls = PagedContext` through minivllm's own. `admit` is the
# scheduler's part (notebook 05) for a prompt prefilled in one step: allocate its blocks (sharing
# any cached prefix), cache its full blocks, schedule the tokens that are not cached yet.


# %%
class ContextRunner(ModelRunner):
    """ModelRunner (one rank, CPU, PyTorch's ops) whose steps attend through `context_cls`."""

    context_cls: type[PagedContext] = PagedContext

    @torch.inference_mode()
    def execute(
        self, step: StepInputs
    ) -> torch.Tensor:  # (num_seqs, vocab_size): each sequence's last row
        assert self.model is not None, "the runner is closed"
        input_ids, positions, paged = step_to_device(step, self.device, use_triton=False)
        context = self.context_cls(
            **{f.name: getattr(paged, f.name) for f in dataclasses.fields(paged)}
        )
        hidden = self.model(input_ids, positions, context)  # (num_tokens, hidden_size)
        if step.is_prefill:
            assert context.cu_seqlens_q is not None  # a prefill step has it
            hidden = hidden[context.cu_seqlens_q[1:] - 1]
        return self.model.compute_logits(hidden)


def admit(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq)
    bm.cache_blocks(seq, len(seq))
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens


runner = ContextRunner(
    Config(tiny_path, dtype=torch.float32, num_kvcache_blocks=64, max_num_seqs=8, device="cpu")
)
print(f"tiny model, {runner.num_kvcache_blocks} KV blocks of {runner.block_size} tokens")

# %% [markdown]
# ### The colleague's test, which passes
# Five random prompts (so no two share a block), prefilled in one step, then ten greedy decode
# steps; at every step each sequence's logits are compared with `prompt_logits` over its whole
# sequence.


# %%
def decode_errors(
    context_cls: type[PagedContext], prompts: list[list[int]], num_decode_steps: int
) -> float:
    """Prefill the prompts in one step, then decode greedily: the worst |logit error| vs
    prompt_logits."""
    runner.context_cls = context_cls
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    seqs = [Sequence(p, block_size=runner.block_size) for p in prompts]
    for seq in seqs:
        admit(bm, seq)
    history: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(num_decode_steps + 1):
        for seq, row, rows in zip(seqs, runner.step_logits(seqs, is_prefill=step == 0), history):
            rows.append(row)
            seq.append_token(int(row.argmax()))
            bm.may_append(seq)
    worst = 0.0
    # one forward over the whole sequence: every step's logits at once
    for seq, rows in zip(seqs, history):
        expected = prompt_logits(reference, seq.token_ids)[seq.num_prompt_tokens - 1 : -1]
        worst = max(worst, (torch.stack(rows) - expected).abs().max().item())
    for seq in seqs:
        bm.deallocate(seq)
    return worst


prompts = [random.Random(n).choices(range(2048), k=n) for n in (1, 15, 16, 17, 40)]
worst = decode_errors(SuspectContext, prompts, num_decode_steps=10)
print(f"SuspectContext, 5 prompts + 10 decode steps: worst logit error {worst:.1e}")
assert worst < 1e-4

# %% [markdown]
# ## Part 1 · A test that fails
# The one path this test never takes: a prefill that finds part of its prompt in the prefix cache.
# Write `prefix_hit_check(runner)`:
#
# 1. a fresh `BlockManager(runner.num_kvcache_blocks, runner.block_size)` (prefix caching is on by
#    default);
# 2. a first request, `prefix + [a few tokens]`, admitted and prefilled (`runner.step_logits([...],
#    is_prefill=True)`): its full blocks are now cached;
# 3. a second request, the same `prefix` and different tokens after it, admitted with the same block
#    manager: `allocate` finds the prefix's blocks, so `num_cached_tokens > 0` and its prefill
#    computes only the rest;
# 4. its prefill's logits (one row: its last position) compared with `prompt_logits(reference,
#    token_ids)[-1]`.
#
# Return `(num_cached_tokens of the second request, the largest |logit difference|)`: the check cell
# asserts that the hit happened and that the error is large on the suspect, small on `PagedContext`.
# Deallocate both requests at the end. The cache reuses **full** blocks only, and never the block
# holding a prompt's last token (that token must be computed to give the prompt's logits): so share
# at least a block and a token, better a few blocks (say 48 tokens, three blocks of 16).


# %%
def prefix_hit_check(runner: ContextRunner) -> tuple[int, float]:
    """A second request after a first that shares its prefix: (its cached tokens, its worst logit
    error)."""
    # BEGIN SOLUTION
    rng = random.Random(0)
    prefix = rng.choices(range(2048), k=48)  # three full blocks of 16
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    first = Sequence(prefix + [1, 2, 3], block_size=runner.block_size)
    admit(bm, first)
    runner.step_logits([first], is_prefill=True)
    second = Sequence(prefix + rng.choices(range(2048), k=5), block_size=runner.block_size)
    admit(bm, second)
    logits = runner.step_logits([second], is_prefill=True)[0]
    error = (logits - prompt_logits(reference, second.token_ids)[-1]).abs().max().item()
    cached = second.num_cached_tokens
    for seq in (first, second):
        bm.deallocate(seq)
    return cached, error
    # END SOLUTION


# %% [markdown]
# ### Check 1
# Your check, on the suspect (it must find an error well above float32 rounding) and on minivllm's
# `PagedContext` (it must not: a test that fails on correct code is no test).

# %%
with exercise("prefix_hit_check"):
    for context_cls, should_fail in ((SuspectContext, True), (PagedContext, False)):
        runner.context_cls = context_cls
        result = prefix_hit_check(runner)
        assert isinstance(result, tuple) and len(result) == 2, (
            f"return (cached tokens, error), got {result!r}"
        )
        cached, error = result
        name = context_cls.__name__
        print(f"{name:>14}: {cached} tokens from the prefix cache, worst logit error {error:.1e}")
        assert cached > 0, (
            f"{name}: the second request found nothing in the prefix cache (num_cached_tokens = "
            f"{cached}): share at "
            "least one full block plus a token, and admit both requests with the same BlockManager"
        )
        if should_fail:
            assert error > 1e-2, (
                f"{name}: worst logit error {error:.1e}, your check does not expose the bug"
            )
        else:
            assert error < 1e-4, (
                f"{name}: worst logit error {error:.1e} on correct code: is the comparison right?"
            )
print("prefix_hit_check exposes the bug, and passes minivllm's PagedContext")

# %% [markdown]
# ## Part 2 · Find it, fix it
#
# **Narrow it down.** The cell below runs the suspect on four paths and prints the worst error of
# each: whole prompts (the colleague's test), a prefix-cache hit, a prompt prefilled in two chunks
# (notebook 05's chunked prefill: the second chunk's queries attend to the first chunk, already in
# the cache), and a batch that mixes a hit with a plain prompt. Which paths fail, and what do they
# have in common that the passing ones lack? Which fields of the context differ on those steps
# (print `self` inside `SuspectContext.prefill` if you like)?


# %%
def path_errors(context_cls: type[PagedContext]) -> dict[str, float]:
    """The worst |logit error| vs prompt_logits of four ways to prefill."""
    rng = random.Random(3)
    errors = {
        "whole prompts, then 3 decode steps": decode_errors(
            context_cls, [rng.choices(range(2048), k=n) for n in (40, 17)], 3
        )
    }
    runner.context_cls = context_cls
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)

    def error(logits: torch.Tensor, seq: Sequence) -> float:
        return (logits - prompt_logits(reference, seq.token_ids)[-1]).abs().max().item()

    prefix = rng.choices(range(2048), k=40)
    first = Sequence(prefix, block_size=runner.block_size)
    admit(bm, first)
    runner.step_logits([first], is_prefill=True)  # caches its two full blocks: tokens 0..31
    hit = Sequence(prefix[:35] + [7, 7, 7, 7], block_size=runner.block_size)
    plain = Sequence(rng.choices(range(2048), k=20), block_size=runner.block_size)
    admit(bm, hit)
    admit(bm, plain)
    # one step: 7 new tokens, then 20
    hit_row, plain_row = runner.step_logits([hit, plain], is_prefill=True)
    errors[f"prefix-cache hit ({hit.num_cached_tokens} of {len(hit)} tokens cached)"] = error(
        hit_row, hit
    )
    errors["plain prompt, in the same step as that hit"] = error(plain_row, plain)

    chunked = Sequence(rng.choices(range(2048), k=45), block_size=runner.block_size)
    bm.allocate(chunked)
    for end in (20, 45):  # two steps: tokens 0..19, then 20..44
        bm.cache_blocks(chunked, end)
        chunked.num_scheduled_tokens = end - chunked.num_cached_tokens
        last_row = runner.step_logits([chunked], is_prefill=True)[0]
        chunked.num_cached_tokens = end  # the step has run: these tokens' KV is in the cache
    errors["chunked prefill: 20 tokens, then 25"] = error(last_row, chunked)
    for seq in (first, hit, plain, chunked):
        bm.deallocate(seq)
    return errors


for path, error in path_errors(SuspectContext).items():
    print(f"SuspectContext, {path:>42}: worst logit error {error:.1e}")

# %% [markdown]
# **Fix it.** The failing paths are all prefills, so the bug is in `SuspectContext.prefill`: what
# does it read, and what should it? Write the corrected `prefill` in `FixedContext` below.
# Everything you need is in the context's fields (notebook 04's `PagedContext` documents them:
# `cu_seqlens_k` counts cached + new tokens per sequence; `block_tables` is `None` when nothing in
# the batch is cached) and in the reference ops imported above: `paged_attention_ref(q, k_cache,
# v_cache, cu_seqlens_q, cu_seqlens_k, block_table, scale)` attends each sequence's new queries to
# the first `cu_seqlens_k` tokens of its cache, causally, bottom-right aligned. Keep the fast path:
# with nothing cached, `attention_ref` over the new `k`, `v` is right, and reads no cache.


# %%
class FixedContext(SuspectContext):
    def prefill(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Each sequence's new tokens attend causally to its cached tokens and to each other."""
        # BEGIN SOLUTION
        cu_q, cu_k = self.cu_seqlens_q, self.cu_seqlens_k
        assert cu_q is not None and cu_k is not None  # a prefill step has both
        # nothing cached in this batch: the new tokens are whole prompts
        if self.block_tables is None:
            return attention_ref(q, k, v, cu_q, cu_q, layer.scale, causal=True)
        # the cached prefix and the new tokens (stored by attend, just before) are all in the cache
        return paged_attention_ref(
            q, layer.k_cache, layer.v_cache, cu_q, cu_k, self.block_tables, layer.scale
        )
        # END SOLUTION


# %% [markdown]
# ### Check 2
# Your own check first, then the four paths above, then the colleague's test: all must now equal
# `prompt_logits`. (`PagedContext`'s own `prefill` is notebook 04's answer: during this check it
# refuses to run, so the fix must be yours.)


# %%
def handed_over(self: PagedContext, *args, **kwargs):
    raise AssertionError(
        "FixedContext.prefill called PagedContext's prefill, notebook 04's answer: write the fix "
        "with the reference ops (attention_ref, paged_attention_ref) and the context's fields"
    )


with exercise("FixedContext.prefill"):
    answer = PagedContext.prefill
    PagedContext.prefill = handed_over  # during this check only
    try:
        runner.context_cls = FixedContext
        cached, error = prefix_hit_check(runner)
        assert cached > 0 and error < 1e-4, (
            f"FixedContext, your check: {cached} cached tokens, worst logit error {error:.1e}"
        )
        for path, error in path_errors(FixedContext).items():
            print(f"FixedContext, {path:>42}: worst logit error {error:.1e}")
            assert error < 1e-4, (
                f"FixedContext, {path}: worst logit error {error:.1e}, expected < 1e-4"
            )
        worst = decode_errors(FixedContext, prompts, num_decode_steps=10)
        assert worst < 1e-4, f"FixedContext, the colleague's test: worst logit error {worst:.1e}"
    finally:
        PagedContext.prefill = answer
print("FixedContext: every path equals prompt_logits")

# %% [markdown]
# **Why the colleague's test could not see it.** With whole prompts, "the new tokens" *are* the
# whole sequence, so attending among them is attending to everything. After a hit (or a first chunk)
# they are only the tail: the keys and values of the prefix were computed by an earlier step, and
# live only in the cache, in the blocks the block table lists. No error is raised: the model just
# reads a shorter text than it was given, and writes something else.
#
# ## What's next
# * Notebook 04's question, "why may a prefill with a prefix-cache hit *not* use notebook 01's
#   kernel on the new tokens' `k` and `v`?", is this bug. Its Triton path passes `block_table` to
#   `flash_attn_varlen_func`, which then reads the keys through the table, exactly as
#   `paged_attention_ref` does here.
# * The lesson for testing an engine: the oracle (`prompt_logits`) is cheap, so compare every *path*
#   against it, not just the common one. Hits, chunks, preemption and recompute (notebook 05),
#   shuffled block tables, CUDA graphs: each reads the cache a different way, and each has a test in
#   `tests/test_model_runner.py`.
