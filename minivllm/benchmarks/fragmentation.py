"""Why PagedAttention reduces fragmentation: one workload replayed on a fixed KV memory (notebook
03).

    python -m minivllm.benchmarks.fragmentation

600 requests (prompts of 16 to 512 tokens, `max_tokens=1024`, each stopping after an exponentially
distributed number of tokens, mean 300) on 65,536 KV slots, with a contiguous reservation per
request (max length, or prompt + max_tokens placed first-fit) or paged blocks of 256, 64 and 16
slots. A miniature continuous-batching loop admits requests first come, first served while memory
allows, decodes one token per running request, and preempts the newest request when a token finds no
free block. Each step, every slot holds a token, is reserved ahead, is over-reserved (for tokens its
request never produces), is stranded in a hole too small for the next request, or is free.
"""

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

VOCAB, NUM_SLOTS, MAX_TOKENS, MAX_MODEL_LEN = 151_936, 65_536, 1024, 2048
KINDS = {
    "tokens": "tab:blue",
    "ahead": "lightsteelblue",
    "over": "tab:red",
    "stranded": "tab:orange",
    "free": "0.9",
}


def chat_workload(n: int, seed: int = 0) -> list[tuple]:
    """n (prompt token ids, real output length) pairs."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(16, 513, n)
    output_lens = np.clip(rng.exponential(300, n).astype(int), 1, MAX_TOKENS)
    return [(rng.integers(0, VOCAB, p).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


class ContiguousAllocator:
    """Blocks of one slot, but a sequence gets all its `reserve(seq)` slots up front, in one piece,
    first-fit."""

    block_size = 1
    cache_blocks = may_append = lambda self, *args: None  # no prefix caching, no blocks to add
    # the reservation already covers every token the request may produce
    can_append = lambda self, seq: True
    deallocate = lambda self, seq: self.ranges.pop(seq.seq_id)

    def __init__(self, num_slots: int, reserve):
        self.num_slots, self.reserve = num_slots, reserve
        self.ranges: dict[int, tuple[int, int]] = {}  # seq_id -> (start, size)

    def holes(self) -> list[tuple[int, int]]:
        """(start, size) of each run of free slots, in address order."""
        ends = [(0, 0), *sorted(self.ranges.values()), (self.num_slots, 0)]
        holes = []
        for (start, size), (next_start, _) in zip(ends, ends[1:]):
            if next_start > start + size:
                holes.append((start + size, next_start - start - size))
        return holes

    def can_allocate(self, seq) -> bool:
        return any(size >= self.reserve(seq) for _, size in self.holes())

    def allocate(self, seq) -> None:  # first fit: the lowest hole that is big enough
        self.ranges[seq.seq_id] = (
            next(s for s, n in self.holes() if n >= self.reserve(seq)),
            self.reserve(seq),
        )


def kv_breakdown(allocator, running: list[Sequence], waiting: deque, stop: dict[int, int]) -> dict:
    """KV slots this step that hold tokens, are reserved ahead, over-reserved, stranded in holes, or
    free."""
    # a request needs its whole reservation in one hole
    if isinstance(allocator, ContiguousAllocator):
        held = [allocator.ranges[s.seq_id][1] for s in running]
        holes, piece = (
            [n for _, n in allocator.holes()],
            allocator.reserve(waiting[0]) if waiting else 0,
        )
    else:  # paged: any free block is a piece a request can use, so no hole is too small
        held = [len(s.block_table) * allocator.block_size for s in running]
        holes, piece = (
            [allocator.block_size] * allocator.num_free_blocks,
            allocator.block_size * bool(waiting),
        )
        # every used block is someone's
        assert sum(held) == allocator.num_used_blocks * allocator.block_size
    tokens = sum(len(s) for s in running)
    stranded = sum(n for n in holes if n < piece)
    over = sum(
        max(h - s.num_prompt_tokens - stop[s.seq_id], 0) for h, s in zip(held, running)
    )  # past the end
    free = NUM_SLOTS - sum(held) - stranded
    kinds = dict(
        tokens=tokens, ahead=sum(held) - over - tokens, over=over, stranded=stranded, free=free
    )
    return kinds | dict(running=len(running), waiting=len(waiting))


def simulate(workload, allocator, block_size: int = 16, seed: int = 0) -> list[dict]:
    """Replay the workload with one allocator; one row of stats per step."""
    rng = np.random.default_rng(seed)  # the decoded tokens: random, they only take room
    waiting = deque(
        Sequence(p, SamplingParams(max_tokens=MAX_TOKENS), block_size) for p, _ in workload
    )
    # where each request meets its "EOS"
    stop = {seq.seq_id: o for seq, (_, o) in zip(waiting, workload)}
    running: list[Sequence] = []
    rows: list[dict] = []
    while waiting or running:
        while waiting and allocator.can_allocate(waiting[0]):  # admit first come, first served
            seq = waiting.popleft()
            allocator.allocate(seq)
            allocator.cache_blocks(seq, len(seq))  # the whole prompt is computed in this step
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
        assert running, "the cache cannot hold even one request"
        # after admission, before decoding
        rows.append(kv_breakdown(allocator, running, waiting, stop))
        for seq in list(running):  # decode one token each
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            seq.append_token(int(rng.integers(VOCAB)))
            if seq.num_completion_tokens == stop[seq.seq_id]:  # finished
                allocator.deallocate(seq)
                running.remove(seq)
                continue
            while not allocator.can_append(seq):  # out of blocks: preempt the newest request
                victim = running.pop()
                allocator.deallocate(victim)
                victim.status = SequenceStatus.WAITING
                waiting.appendleft(victim)
                if victim is seq:
                    break
            else:
                allocator.may_append(seq)
    return rows


SCHEMES: dict[str, Callable[[], Any]] = {  # name -> a new allocator
    "contiguous, max length": lambda: ContiguousAllocator(NUM_SLOTS, lambda s: MAX_MODEL_LEN),
    "contiguous, prompt + max_tokens": lambda: ContiguousAllocator(
        NUM_SLOTS, lambda s: len(s) + MAX_TOKENS
    ),
    **{f"paged, block {bs}": partial(BlockManager, NUM_SLOTS // bs, bs) for bs in (256, 64, 16)},
}


def run_schemes(num_requests: int = 600) -> dict[str, dict]:
    """Each scheme's rows, share of memory by kind (over the steps in which a request waits),
    occupancy (tokens over reserved slots) and mean batch size."""
    workload, runs = chat_workload(num_requests), {}
    for name, make in SCHEMES.items():
        rows = simulate(
            workload, make(), block_size=int(name.split()[-1]) if name.startswith("paged") else 16
        )
        full = [r for r in rows if r["waiting"]]  # the steps in which memory limits the batch
        share = {kind: sum(r[kind] for r in full) / (NUM_SLOTS * len(full)) for kind in KINDS}
        reserved = sum(NUM_SLOTS - r["free"] - r["stranded"] for r in rows)
        occupancy = sum(r["tokens"] for r in rows) / reserved
        runs[name] = dict(
            rows=rows, share=share, occupancy=occupancy, batch=np.mean([r["running"] for r in rows])
        )
    return runs


def print_fragmentation(runs: dict[str, dict]) -> None:
    head = "{:>32} {:>8} {:>8} {:>8} {:>8} {:>8} | {:>9} {:>5} {:>5}".format
    print(head("share of KV memory while one waits", *KINDS, "occupancy", "batch", "steps"))
    for name, r in runs.items():
        shares = (f"{s:.1%}" for s in r["share"].values())
        occupancy = f"{r['occupancy']:.1%}"
        print(head(name, *shares, occupancy, round(r["batch"]), len(r["rows"])))


def plot_fragmentation(runs: dict[str, dict]):
    """Where the KV memory is while requests wait (stacked bars), and the batch size over the
    steps."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10.8, 4.2), width_ratios=[1.1, 1])
    names, left = list(runs), np.zeros(len(runs))
    for kind, color in KINDS.items():
        widths = np.array([runs[n]["share"][kind] for n in names])
        axes[0].barh(names, widths, left=left, color=color, label=kind)
        left += widths
    axes[0].invert_yaxis()
    legend = dict(
        ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), columnspacing=1, handlelength=1.5
    )
    axes[0].legend(fontsize=8, **legend)
    axes[0].set(xlim=(0, 1), xlabel="share of KV memory, over the steps in which a request waits")
    for n, color in zip(names, ["tab:red", "tab:orange", "tab:olive", "tab:green", "tab:blue"]):
        axes[1].plot([r["running"] for r in runs[n]["rows"]], color=color, lw=1, label=n)
    axes[1].set(
        xlabel="step",
        ylabel="requests running",
        title="Batch size (workload done at the line's end)",
    )
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{NUM_SLOTS:,} KV slots: contiguous reservation vs paged blocks")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    print_fragmentation(run_schemes())
