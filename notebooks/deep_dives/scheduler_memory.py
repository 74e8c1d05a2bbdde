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
# # Deep dive · The scheduler's KV memory: a block map, and what a shared prefix saves
#
# **What this adds.** Notebook 05 built the `Scheduler` and watched it on a cache of 10 blocks. Here
# we watch its KV memory on a run big enough to fill a real cache: which request owns which block at
# every step, and how much prefill work and memory prefix caching saves when many requests share a
# system prompt. Two exercises check how a prefix hit meets the token budget and chunked prefill.
#
# **Where it sits.** It follows notebook 05 and uses only notebooks 02, 03 and 05. Nothing later in
# the core path needs it. It runs the scheduler alone (every sampled token is 0: the schedule of
# requests that ignore EOS does not depend on the tokens), so it runs in seconds on any CPU.

# %%
import dataclasses
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers.utils.logging import disable_progress_bar

from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

disable_progress_bar()  # transformers' saving draws no progress bars in the outputs
plt.rcParams["axes.titlesize"] = (
    "medium"  # 10-pt panel titles: three panels side by side fit in 1,100 px
)
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
base_config = Config(
    write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0), dtype=torch.float32, max_num_seqs=64
)


def make_scheduler(num_blocks: int, **limits) -> Scheduler:
    """A scheduler over num_blocks KV blocks, with other limits than base_config's."""
    return Scheduler(dataclasses.replace(base_config, **limits), num_blocks)


def request(prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        base_config.block_size,
    )


def step(scheduler: Scheduler) -> tuple[list[int], bool]:
    """One step of the scheduler alone: the tokens it scheduled per sequence, and whether it was a
    prefill."""
    seqs, is_prefill = scheduler.schedule()
    scheduled = [seq.num_scheduled_tokens for seq in seqs]
    scheduler.postprocess(seqs, [0] * len(seqs))
    return scheduled, is_prefill


# %% [markdown]
# ## The block map over time
# Which request owns which block? We run 48 requests on 96 blocks of 16 slots, a third of them
# behind one 64-token system prompt, and take a picture of the blocks after every step: one colour
# per request, black for a block shared by several, grey for a free block that is still cached,
# white for an empty one.

# %%
SHARED, CACHED, EMPTY = -1, -2, -3


def block_owners(scheduler: Scheduler) -> np.ndarray:
    """Per block: the seq_id of the one running request holding it, SHARED, CACHED (free, still
    hashed) or EMPTY."""
    bm = scheduler.block_manager
    owners = np.full(bm.num_blocks, EMPTY)
    owners[list(bm.cached_block_ids)] = CACHED
    for seq in scheduler.running:
        for block_id in seq.block_table:
            owners[block_id] = seq.seq_id if bm.blocks[block_id].ref_count == 1 else SHARED
    return owners


def frame_colors(frame: np.ndarray) -> np.ndarray:
    """RGB per block: special states fixed, requests cycling through a qualitative palette."""
    # no greys
    palette = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]
    special = {SHARED: (0, 0, 0), CACHED: (0.8, 0.8, 0.8), EMPTY: (1, 1, 1)}
    return np.array([special.get(o, palette[o % len(palette)]) for o in frame])


map_rng = np.random.default_rng(1)
map_prompt = map_rng.integers(3, 2048, 64).tolist()
map_scheduler = make_scheduler(96, max_num_batched_tokens=256)
for i in range(48):
    prompt = (map_prompt if i % 3 == 0 else []) + map_rng.integers(
        3, 2048, int(map_rng.integers(16, 201))
    ).tolist()
    map_scheduler.add(request(prompt, int(map_rng.integers(16, 161))))
frames, usage = [], []  # per step: each block's owner; blocks used, free but cached, empty
while not map_scheduler.is_finished():
    step(map_scheduler)
    frames.append(block_owners(map_scheduler))
    bm = map_scheduler.block_manager
    usage.append((bm.num_used_blocks, bm.num_cached_free_blocks, len(bm.free_block_ids)))
frames, usage = np.array(frames), np.array(usage)  # (steps, num_blocks), (steps, 3)
print(
    f"{len(frames)} steps; peak {usage[:, 0].max()} of 96 blocks in use; "
    f"{map_scheduler.num_preemptions} preemptions"
)


def draw_blocks(ax, step: int, cols: int = 16) -> None:
    ax.imshow(frame_colors(frames[step]).reshape(-1, cols, 3), interpolation="nearest")
    used, cached, empty = usage[step]
    ax.set(xticks=[], yticks=[])
    ax.set_title(f"step {step}: {used} used, {cached} free+cached, {empty} empty", fontsize=9)


fig = plt.figure(figsize=(10.8, 6.6))
grid = fig.add_gridspec(2, 3, height_ratios=[1.3, 1])
ax_map = fig.add_subplot(grid[0, :2])
ax_map.imshow(
    np.stack([frame_colors(f) for f in frames], axis=1), aspect="auto", interpolation="nearest"
)
ax_map.set(xlabel="step", ylabel="physical block")
ax_map.set_title(
    "Owner of each block over time (colour = request, black = shared, grey = free but cached)"
)
ax_use = fig.add_subplot(grid[0, 2])
labels, colours = ["used", "free, cached", "free, empty"], ["tab:blue", "0.75", "white"]
ax_use.stackplot(range(len(usage)), usage.T, labels=labels, colors=colours, edgecolor="0.5", lw=0.3)
ax_use.set(xlabel="step", ylabel="blocks", ylim=(0, 125), title="Blocks in use vs free")
ax_use.legend(loc="upper center", ncols=2, fontsize=8)  # above the 96 blocks
snapshots = np.linspace(0, len(frames) - 1, 5)[1:4].astype(int)
for k, snapshot in enumerate(snapshots):
    draw_blocks(fig.add_subplot(grid[1, k]), snapshot)
fig.tight_layout()
fig.savefig(FIGURES / "scheduler_memory_block_map.png", dpi=120)

# %% [markdown]
# Each column of the map is one step. Requests' blocks are scattered wherever a free block was, and
# that costs nothing: the block table is the only thing that knows the order. The black band is the
# system prompt, stored once and shared by every request that starts with it. When the cache is full
# the newest request is preempted and its blocks go back to the pool, and grey blocks (free but
# cached) are used only once the empty ones run out. Drag the slider to step through time (the
# picture is static in a rendered copy; the three snapshots above are the same view).

# %%
import ipywidgets as widgets


def show_step(step: int) -> None:
    draw_blocks(plt.subplots(figsize=(6, 3))[1], step)
    plt.show()


step_slider = widgets.IntSlider(
    value=len(frames) // 2, min=0, max=len(frames) - 1, layout=widgets.Layout(width="95%")
)
# wide: the default 120 px is under a pixel per step
slider = widgets.interact(show_step, step=step_slider)
assert usage[:, 0].max() == 96  # the run filled the cache...
# ...shared blocks, and kept freed ones cached
assert (frames == SHARED).any() and (frames == CACHED).any()
assert (usage.sum(axis=1) == 96).all()  # used + free = total, at every step

# %% [markdown]
# ## Prefix caching: work saved by a shared system prompt
# A chat service puts the same system prompt in front of every conversation. With prefix caching
# (notebook 03), only the first request with a given system prompt computes its KV; the others reuse
# those blocks and prefill only their own part. Here: 200 requests, all there at the start, each
# with one of 4 system prompts of 512 tokens (the first used by half the requests, the last by a
# tenth), 16 to 256 tokens of its own and a reply of 16 to 128. We schedule them on 2,048 blocks of
# 16, caching on and off, and count the prefill tokens and the steps.

# %%
chat_rng = np.random.default_rng(2)
system_prompts = [chat_rng.integers(3, 2048, 512).tolist() for _ in range(4)]
which = chat_rng.choice(4, size=200, p=[0.5, 0.25, 0.15, 0.1])
own_parts = [chat_rng.integers(3, 2048, int(chat_rng.integers(16, 257))).tolist() for _ in which]
chat_requests = [
    (system_prompts[w] + own, int(chat_rng.integers(16, 129))) for w, own in zip(which, own_parts)
]
prefix_runs = {}
for caching in (True, False):
    scheduler = make_scheduler(2048, max_num_seqs=256, enable_prefix_caching=caching)
    for prompt, max_tokens in chat_requests:
        scheduler.add(request(prompt, max_tokens))
    # per prefill step: (step, tokens computed); the most running at once
    prefilled, batch, steps = ([], 0, 0)
    while not scheduler.is_finished():
        scheduled, is_prefill = step(scheduler)
        steps, batch = steps + 1, max(batch, len(scheduler.running))
        if is_prefill:
            prefilled.append((steps, sum(scheduled)))
    run = prefix_runs[caching] = dict(
        steps=steps, batch=batch, preemptions=scheduler.num_preemptions
    )
    run["prefill_steps"], run["prefilled"] = np.array(prefilled).T
    run["prefilled"] = np.cumsum(run["prefilled"])
    prefill_total = run["prefilled"][-1]
    work = f"prefill computed {prefill_total:,} tokens, up to {batch} requests at once"
    ends = f"{run['preemptions']} preemptions, all done in {steps} steps"
    print(f"prefix caching {'on ' if caching else 'off'}: {work}, {ends}")
computed_on, computed_off = prefix_runs[True]["prefilled"][-1], prefix_runs[False]["prefilled"][-1]
print(
    f"prompt tokens: {sum(len(p) for p, _ in chat_requests):,}; prefill saved: "
    f"{1 - computed_on / computed_off:.0%}"
)

# %% [markdown]
# A hit needs the blocks to still be there. To see the cache's memory alone, we allocate the same
# requests one at a time and free each right after its prefill, so every hit comes from a block
# whose owner has finished and that the LRU kept. The four system prompts need 4 × 32 = 128 blocks;
# we try caches from 3/8 of that to eight times that.


# %%
def hit_rates_one_at_a_time(num_blocks: int) -> np.ndarray:
    bm = BlockManager(num_blocks, base_config.block_size)
    rates = []
    for prompt, _ in chat_requests:
        seq = request(prompt, 1)
        bm.allocate(seq)
        bm.cache_blocks(seq, len(seq))  # its prefill
        rates.append(seq.num_cached_tokens / len(seq))
        bm.deallocate(seq)
    return np.array(rates)


pool_sizes = [48, 64, 96, 128, 192, 256, 512, 1024]
mean_hit = {n: hit_rates_one_at_a_time(n).mean() for n in pool_sizes}
hit_rates = hit_rates_one_at_a_time(1024)
print("mean hit rate by cache size:", {n: f"{r:.0%}" for n, r in mean_hit.items()})

fig, axes = plt.subplots(1, 3, figsize=(10.8, 3.9))
for caching, label in ((False, "prefix caching off"), (True, "prefix caching on")):
    run = prefix_runs[caching]
    axes[0].step(run["prefill_steps"], run["prefilled"] / 1e3, where="post", label=label)
axes[0].set(xlabel="step", ylabel="prefill tokens computed (thousands)")
axes[0].set_title(f"Prefill work: {1 - computed_on / computed_off:.0%} saved")
axes[0].legend()
for w in range(4):
    idx = np.flatnonzero(which == w)
    axes[1].scatter(idx, hit_rates[idx], s=10, label=f"system prompt {w}")
axes[1].set(xlabel="request", ylabel="share of the prompt read from the cache")
axes[1].set_title("Hit rate per request (1,024 blocks, freed after prefill)")
axes[1].legend(fontsize=8, loc="lower right")
axes[2].semilogx(pool_sizes, [mean_hit[n] for n in pool_sizes], "o-", base=2)
axes[2].axvline(128, color="grey", ls=":", label="4 system prompts")
axes[2].set(
    xlabel="cache size (blocks of 16)",
    ylabel="mean hit rate",
    title="Hits need room to keep freed blocks",
)
axes[2].legend()
fig.tight_layout()
fig.savefig(FIGURES / "scheduler_memory_prefix_cache.png", dpi=120)

# %% [markdown]
# Every request after the first with its system prompt reads the 512 shared tokens (32 blocks) from
# the cache, about 80% of its prompt. The hit outlives the request that computed the blocks: a freed
# block keeps its hash and is reused last. In a cache too small for all four system prompts, the LRU
# evicts the least recently used blocks (a prompt's tail first), and the requests that needed them
# lose part or all of their hit. Sharing saves memory too: a system prompt's blocks are stored once,
# so far more requests fit at once (printed above), fewer are preempted, and the workload takes
# fewer steps.

# %%
assert computed_on < 0.4 * computed_off and prefix_runs[True]["steps"] < prefix_runs[False]["steps"]
assert prefix_runs[True]["batch"] > 1.5 * prefix_runs[False]["batch"]
firsts = {int(np.argmax(which == w)) for w in range(4)}
assert all(hit_rates[i] == 0 for i in firsts)
later = [i for i in range(200) if i not in firsts]
assert all(hit_rates[i] == 512 / len(chat_requests[i][0]) for i in later)
assert mean_hit[48] < mean_hit[128] < mean_hit[1024]

# %% [markdown]
# ## Check yourself
# Set each `answer` and run its cell: the check compares it with the objects.
#
# **1.** A 40-token prompt whose first 32 tokens are a prefix-cache hit: how much of the token
# budget does it use?

# %%
from minivllm.testing import check_answer

answer = None  # your answer: replace None with an expression
check = make_scheduler(64, max_num_batched_tokens=64)
first = request(list(range(1, 41)), 4)
second = request(list(range(1, 33)) + [9] * 8, 4)
check.add(first)
step(check)
check.add(second)
used, is_prefill = step(check)
check_answer(answer, sum(used), "1. budget after a hit")

# %% [markdown]
# Worked answer: the hit is free; only the 40 − 32 = 8 tokens after it are computed.

# %%
check_answer(40 - 32, sum(used), "1. budget after a hit")

# %% [markdown]
# **2.** A prompt chunk publishes (hashes into the prefix cache) only the blocks it completes. A
# 150-token prompt with a budget of 64: after its first step, how many of its blocks are published?

# %%
answer = None  # your answer: replace None with an expression
check = make_scheduler(64, max_num_batched_tokens=64)
check.add(long := request(list(range(1, 151)), 4))
step(check)
published = sum(check.block_manager.blocks[i].hash != -1 for i in long.block_table)
check_answer(answer, published, "2. published blocks")

# %% [markdown]
# Worked answer: 64 / 16 = 4, the blocks whose KV this step writes. The other 6 get theirs in later
# steps: published now, they could be hit by a request admitted in between, which would attend to
# keys nobody wrote: wrong logits.

# %%
check_answer(64 // 16, published, "2. published blocks")
