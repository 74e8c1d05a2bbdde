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
# # 05 · The scheduler: continuous batching, prefill first, preemption, chunked prefill
#
# **What this notebook builds.** The `Scheduler`, which decides what the model computes at every
# step: which waiting requests join the batch, which request gives its KV blocks back when the cache
# is full, how a long prompt is cut into chunks, and when a request is done; in two policies:
# prefill first (each step a prefill or a decode, nano-vllm's) and unified (one token budget per
# step, vLLM v1's). Notebook 06 wraps the loop.
#
# **What it assumes.** Notebook 03's `Sequence` and `BlockManager` (blocks, prefix caching,
# `cache_blocks`) and notebook 04's `ModelRunner`: `run(seqs, is_prefill)` computes each sequence's
# `num_scheduled_tokens` tokens after its `num_cached_tokens` cached ones and samples one token per
# sequence.
#
# **What you will see.** A small cache step by step; greedy tokens equal to transformers' `generate`
# while requests are preempted, chunked and share prefixes, under both policies. Then, on step costs
# measured on your CPU: a bursty workload's timeline, prefill first against decode first, and both
# policies under a small and a large token budget. The deep dive `scheduler_memory` maps who owns
# which KV block over a run.

# %%
import dataclasses
import json
import os
import random
import timeit
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
# the tiny model gains little from a second thread, and on a busy machine threads fight
torch.set_num_threads(1)
plt.rcParams["axes.titlesize"] = (
    "medium"  # 10-pt panel titles: three panels side by side fit in 1,100 px
)
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()
random.seed(0)
rng = np.random.default_rng(0)

# %% [markdown]
# ## A step, and why it is one kind or the other
# The engine repeats one step until every request is done:
#
# ```python
# seqs, is_prefill = scheduler.schedule()         # what to compute
# token_ids = runner.run(seqs, is_prefill)        # one forward pass, one sampled token per sequence
# finished = scheduler.postprocess(seqs, token_ids)
# ```
#
# A **prefill** computes the KV of new prompts (thousands of tokens, compute-bound on a GPU) and
# gives each its first token. A **decode** computes one token for each running request
# (memory-bound: notebook 03). Our steps are one kind or the other, as in nano-vllm and vLLM before
# v1: each kind runs its own attention kernel, a decode step has a fixed shape (notebook 04 replays
# it as a CUDA graph), and the scheduler stays short. The price: while a prefill step runs, every
# decoding request waits. **vLLM v1's mixed batches** remove that (the last policy below).
#
# ## Continuous batching
# **Static batching** (`transformers.generate` on a list of prompts) runs a batch until its
# *longest* request ends: a request that finishes early leaves its seat empty, and one that arrives
# meanwhile waits for the whole batch. **Continuous batching** (Orca, 2022) forms the batch anew at
# every step: a finished request leaves at once, and a waiting one takes its seat at the next step,
# with KV memory handed out per request in notebook 03's blocks. The scheduler keeps two queues,
# `waiting` (first come, first served) and `running` (admission order). Its rules:
#
# **1. Prefill first.** If a waiting request can join (or a chunked prompt has more to compute), the
# step is a prefill; else it decodes every running request. Requests join in arrival order while
# three limits allow: `max_num_seqs` running, `max_num_batched_tokens` tokens per step (the *token
# budget*; a prefix-cache hit is free), and free KV blocks for the whole prompt. The first that does
# not fit stops admission: small ones overtaking a big one could starve it.
#
# **2. Chunked prefill.** A prompt bigger than what is left of the budget gets what is left, and the
# rest in the next steps (where it goes first). So any prompt runs, and no step computes more than
# `max_num_batched_tokens` tokens, the size notebook 04 measured the activation memory for. A
# chunk's sampled token is thrown away, and it publishes only the blocks it completes
# (`cache_blocks`): nobody may hit blocks no step has written yet.
#
# **3. Decode and preemption.** A token that starts a new block needs a free one; if there is none,
# the scheduler *preempts* the most recently admitted request: frees its blocks and puts it back at
# the front of `waiting`. Requests are visited oldest first and victims taken newest first, so the
# oldest always makes progress. This is preemption by **recompute**: the victim keeps its tokens,
# generated ones too (`tests/test_scheduler.py` checks that a reply only ever grows), and when
# admitted again they are all its prompt, mostly hits on its own cached blocks.
#
# **4. Postprocess**, in two halves. `advance`, once the step is queued: count its computed tokens,
# give each sequence that samples a *placeholder* token, and finish those that reach `max_tokens` or
# `max_model_len` (`"length"`). `resolve`, once the tokens are known: they replace the placeholders,
# and a request ends on one of its `stop_token_ids` (`"stop"`). Notebook 06 schedules the next step
# between the two halves.
#
# **5. Admission and abort.** Each request reaching `add` fits, prompt plus one token, in
# `max_model_len` and the cache (notebook 06's engine checks); one that outgrows the cache while
# running stops with `"length"`. `abort` drops a request wherever it is, forgetting blocks its
# failed step published but never wrote (`BlockManager.discard`); `abort_all` drops all and resets
# the block manager (`tests/test_scheduler.py` checks both after a failed step).
#
# A chunked prompt with one token left joins the next decode like a prefilled request: a decode is a
# one-token prefill.

# %% tags=["export"] module="minivllm.engine.scheduler"
from collections import deque

from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.step_inputs import placeholder


class Scheduler:
    """Continuous batching: every step is a prefill (first, if any request can join) or a decode of
    all running requests; chunked prefill for prompts beyond the token budget; preemption by
    recompute when blocks run out."""

    def __init__(self, config: Config, num_kvcache_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = BlockManager(
            num_kvcache_blocks, config.block_size, config.enable_prefix_caching
        )
        # tokens a sequence may hold
        self.max_len = min(config.max_model_len, self.block_manager.num_slots)
        # first come, first served; the preempted go back in front
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request. The engine has checked that it can run (notebook 06)."""
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, (
            f"sequence {seq.seq_id} was added before"
        )
        assert len(seq) + 1 <= self.max_len, (
            f"a prompt of {len(seq)} tokens can never run (max_len {self.max_len})"
        )
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """This step's sequences, and whether it is a prefill."""
        if seqs := self.schedule_prefill():
            return seqs, True
        return self.schedule_decode(), False

    def schedule_prefill(self) -> list[Sequence]:
        budget, seqs = self.max_num_batched_tokens, []
        if self.running and len(self.running[-1]) - self.running[-1].num_cached_tokens > 1:
            # a prompt part-way through a chunked prefill goes on first
            seqs.append(self.running[-1])
            budget -= self.schedule_chunk(self.running[-1], budget)
        return seqs + self.admit(budget)

    def admit(self, budget: int) -> list[Sequence]:
        """Waiting requests, in order, while a seat, the token budget and the KV blocks of the
        prompt allow."""
        seqs: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq) or seq.last_token < 0:
                # no overtaking: the head of the queue waits for blocks (or its placeholder token,
                # notebook 06)
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            seqs.append(seq)
            budget -= self.schedule_chunk(seq, budget)
        return seqs

    def schedule_chunk(self, seq: Sequence, budget: int) -> int:
        """Schedule as many of seq's uncomputed tokens as the budget allows; publish the blocks they
        complete."""
        seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
        self.block_manager.cache_blocks(seq, seq.num_cached_tokens + seq.num_scheduled_tokens)
        return seq.num_scheduled_tokens

    def schedule_decode(self) -> list[Sequence]:
        seqs = []
        for seq in list(self.running):  # oldest first
            if seq.status == SequenceStatus.WAITING:
                continue  # preempted below, to make room for an older one
            assert len(seq) - seq.num_cached_tokens == 1, (
                "a decode computes exactly the newest token"
            )
            if self.reserve(seq):
                seqs.append(seq)
        assert seqs, "the oldest request always fits once the others are preempted"
        return seqs

    def reserve(self, seq: Sequence) -> bool:
        """Room for seq's newest token, preempting the newest requests (seq itself last) until there
        is: whether seq is still running (then it is scheduled for that one token)."""
        # its newest token needs a block and none is free
        while not self.block_manager.can_append(seq):
            # the most recently admitted one; seq itself once it is the newest
            self.preempt(self.running.pop())
            if seq.status == SequenceStatus.WAITING:
                return False
        self.block_manager.may_append(seq)
        seq.num_scheduled_tokens = 1
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks, queue it first, keep its tokens. The caller took it out
        of `running`."""
        self.block_manager.deallocate(seq)  # also resets num_cached_tokens
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Record a step that ran: computed tokens, sampled ones; free and return the sequences that
        finished."""
        assert len(token_ids) == len(seqs), "one sampled token per sequence"
        return self.resolve(seqs, self.advance(seqs), token_ids)

    def advance(self, seqs: list[Sequence]) -> list[int]:
        """A step is queued: count its computed tokens; a sequence that samples gets a placeholder
        token for its row (the runner reads that row of the step's sampled ids) until `resolve`, and
        ends now if it ends by length."""
        rows = []
        for row, seq in enumerate(seqs):
            if seq.is_finished:
                continue  # aborted since it was scheduled
            seq.num_cached_tokens += seq.num_scheduled_tokens
            if seq.num_cached_tokens < len(seq):
                continue  # a chunk short of the prompt's end: its sample means nothing
            seq.append_token(placeholder(row))
            rows.append(row)
            if self.finish_reason(seq, -1) is not None:
                self.finish(seq, "length")
        return rows

    def resolve(
        self, seqs: list[Sequence], rows: list[int], token_ids: list[int]
    ) -> list[Sequence]:
        """A step's tokens are known: they replace its placeholders. Free and return the sequences
        that finished."""
        finished = []
        for seq, token_id in ((seqs[row], token_ids[row]) for row in rows):
            if seq.finish_reason == "abort":
                continue
            seq.token_ids[-1] = seq.last_token = token_id
            self.block_manager.token_known(seq)
            if (reason := self.finish_reason(seq, token_id)) is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(
        self, seq: Sequence, reason: str
    ) -> None:  # seq may be waiting: preempted while its step ran (06)
        if not seq.is_finished:
            (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
            if seq.block_table:
                self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        # the engine's EOS ids are among them unless ignore_eos
        if token_id in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or len(seq) >= self.max_len:
            return "length"
        return None

    def abort(self, seq: Sequence) -> None:
        """Drop a request, waiting or running, even one whose step failed part-way: free its blocks,
        and forget the cached ones whose KV that step may not have written."""
        if seq.status == SequenceStatus.FINISHED:
            return
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.block_manager.discard(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"

    def abort_all(self) -> None:
        """Drop every request and reset the block manager: safe after a failure anywhere, as nothing
        is kept."""
        for seq in (*self.waiting, *self.running):
            seq.block_table.clear()
            seq.num_cached_tokens = 0
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.waiting.clear()
        self.running.clear()
        self.block_manager.reset()


# %% [markdown]
# ## Watch it: a small cache, step by step
# Five requests on a cache of 10 blocks of 16 tokens (160 token slots), a budget of 48 tokens per
# step. Request 0 has a 100-token prompt, so it is prefilled in chunks; requests 2, 3 and 4 start
# with the same 32 tokens. `serve` is the engine loop: it adds each request once the clock passes
# its arrival time (all at once here), steps until everything is done, and records each step; its
# clock counts steps, or adds up a cost per step (the last section). With `log=True` it prints each
# sequence as `request:tokens computed` (`+`: a prompt chunk short of the end), and the queues after
# the step; decode steps that change nothing else are skipped.

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams

tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
base_config = Config(tiny_path, dtype=torch.float32, num_kvcache_blocks=2048, max_num_seqs=64)
# one KV cache of 2,048 blocks; each scheduler below uses some of them
runner = ModelRunner(base_config)
# seconds of a step, from its sequences before postprocess
StepCost = Callable[[list[Sequence], bool], float]


def make_scheduler(num_blocks: int, cls: type = Scheduler, **limits) -> Scheduler:
    """A scheduler over the first num_blocks blocks of the runner's cache, with other limits than
    base_config's."""
    return cls(dataclasses.replace(base_config, **limits), num_blocks)


def request(prompt: list[int], max_tokens: int, **params) -> Sequence:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    # the block size of every scheduler's block manager here
    return Sequence(prompt, sampling, base_config.block_size)


def serve(
    scheduler: Scheduler,
    seqs: list[Sequence],
    arrivals: np.ndarray | None = None,
    cost: StepCost | None = None,
    model: bool = True,
    log: bool = False,
) -> dict:
    """The engine loop over seqs, arriving at `arrivals` (default all at 0). The clock adds
    cost(step) per step, or 1 without a cost. With model=False the runner is skipped and every
    sampled token is 0 (the schedule of ignore_eos requests does not depend on the tokens). Returns
    per-step rows and per-request times."""
    arrivals = np.zeros(len(seqs)) if arrivals is None else arrivals
    arriving = deque(np.argsort(arrivals, kind="stable"))
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    ids = lambda queue: [index[seq.seq_id] for seq in queue]
    token_times: list[list[float]] = [[] for _ in seqs]  # per request: when each of its tokens came
    finished_at = np.full(len(seqs), np.nan)
    clock, rows, hit_tokens, last = 0.0, [], 0, None
    while arriving or not scheduler.is_finished():
        while arriving and arrivals[arriving[0]] <= clock:
            scheduler.add(seqs[arriving.popleft()])
        if scheduler.is_finished():
            clock = arrivals[arriving[0]]  # idle until the next request arrives
            continue
        waiting = set(ids(scheduler.waiting))
        batch, is_prefill = scheduler.schedule()
        hit_tokens += sum(
            seq.num_cached_tokens for seq in batch if is_prefill and index[seq.seq_id] in waiting
        )
        duration, lens = cost(batch, is_prefill) if cost else 1.0, [len(seq) for seq in batch]
        token_ids = runner.run(batch, is_prefill) if model else [0] * len(batch)
        finished = scheduler.postprocess(batch, token_ids)
        clock += duration
        # a prompt chunk short of the end: no token
        unfinished = [len(seq) == n for seq, n in zip(batch, lens)]
        for seq in (seq for seq, u in zip(batch, unfinished) if not u):
            token_times[index[seq.seq_id]].append(clock)
        for seq in finished:
            finished_at[index[seq.seq_id]] = clock
        rows.append(
            dict(
                time=clock,
                duration=duration,
                is_prefill=is_prefill,
                num_seqs=len(batch),
                num_tokens=sum(seq.num_scheduled_tokens for seq in batch),
                chunks=sum(unfinished),
                running=len(scheduler.running),
                waiting=len(scheduler.waiting),
                used_blocks=scheduler.block_manager.num_used_blocks,
                preemptions=scheduler.num_preemptions,
            )
        )
        state = (
            ids(scheduler.running),
            ids(scheduler.waiting),
            scheduler.block_manager.num_free_blocks,
        )
        if log and (is_prefill or state != last):
            done = " ".join(
                f"{index[s.seq_id]}:{s.num_scheduled_tokens}{'+' * u}"
                for s, u in zip(batch, unfinished)
            )
            kind = "prefill" if is_prefill else "decode "
            head = f"step {len(rows):2d} {kind}"
            queues = f"running {state[0]}, waiting {state[1]}, free blocks {state[2]}"
            print(f"{head} {done:<20} {queues}, preemptions {scheduler.num_preemptions}")
        last = state
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks, (
        "KV blocks leaked"
    )
    return dict(
        rows=rows,
        ttft=np.array([times[0] for times in token_times]) - arrivals,
        token_times=token_times,
        latency=finished_at - arrivals,
        seconds=clock,
        preemptions=scheduler.num_preemptions,
        hit_tokens=hit_tokens,
        chunks=sum(r["chunks"] for r in rows),
    )


shared = random.choices(range(3, 2048), k=32)
small_seqs = [
    request(random.choices(range(3, 2048), k=100), 8),
    request(random.choices(range(3, 2048), k=20), 24),
    request(shared + [5, 6, 7], 24),
    request(shared + [8, 9], 30),
    request(shared + [10], 30),
]
small = serve(make_scheduler(10, max_num_batched_tokens=48), small_seqs, log=True)

# %% [markdown]
# * Steps 1 and 2 spend the whole budget on request 0's first 96 tokens. Step 3 computes its last 4
#   and admits request 1. Request 2 needs 3 blocks and only one is free: it waits, and so does
#   everyone behind it.
# * Request 0 finishes and frees 7 blocks; the next step admits requests 2, 3 and 4 together.
#   Request 2 publishes its two full blocks in that same step, so 3 and 4 hit the shared 32 tokens
#   and compute only 2 and 1 tokens (every layer writes request 2's KV before any attention reads
#   it).
# * When a token needs a new block and none is free, the newest request (4) is preempted. It rejoins
#   at the next step with its prompt *and* its generated tokens, and computes a single one: the rest
#   are its own cached blocks.
#
# Every block is free at the end (`serve` asserts it); the tokens equal transformers', checked
# below.

# %%
assert [r["num_tokens"] for r in small["rows"][:3]] == [48, 48, 24]
assert small["preemptions"] == 1
# requests 3 and 4 on request 2's blocks, then 4 on its own
assert small["hit_tokens"] == 2 * 32 + 48
assert all(
    s.finish_reason == "length" and s.num_completion_tokens == s.sampling_params.max_tokens
    for s in small_seqs
)

# %% [markdown]
# ## One token budget per step: mixed batches (vLLM v1)
# Under prefill first, every running request waits out each prefill step, and a long prompt chunked
# by the budget is several such steps in a row. vLLM v1 has one kind of step: a budget of
# `max_num_batched_tokens`, spent first on the running requests, oldest first (a token each to
# decode, or a prompt's next chunk), then on waiting prompts, all in one forward. Notebook 04's
# runner sends a step's leading one-token rows through the decode kernel (far cheaper for them), so
# this policy lists the decode rows first; a step of decode rows only still takes the decode path
# and its CUDA graphs. The engine uses this policy unless `scheduling_policy="prefill-first"`.


# %% tags=["export"] module="minivllm.engine.scheduler"
class UnifiedScheduler(Scheduler):
    """vLLM v1's policy: one token budget per step, for the running requests first, then waiting
    prompts."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        """This step's sequences, decode rows first, and whether it needs the prefill path."""
        budget, decodes, chunks = self.max_num_batched_tokens, [], []
        for seq in list(self.running):  # oldest first
            if budget == 0:
                break
            if seq.status == SequenceStatus.WAITING:
                continue  # preempted below, to make room for an older one
            if len(seq) - seq.num_cached_tokens > 1:  # a prompt part-way through: its next chunk
                budget -= self.schedule_chunk(seq, budget)
                chunks.append(seq)
            elif self.reserve(seq):  # its newest token
                budget -= 1
                decodes.append(seq)
        chunks += self.admit(budget)
        assert decodes or chunks, "the oldest request always fits once the others are preempted"
        decode_only = all(
            seq.num_scheduled_tokens == 1 and seq.num_cached_tokens + 1 == len(seq)
            for seq in chunks
        )
        return decodes + chunks, not decode_only


# %% [markdown]
# The unified policy changes which rows share a step, not what a row computes: both policies must
# give the same tokens.
#
# ## The same tokens as transformers, under pressure
# The oracle is transformers' `generate` on the same checkpoint, greedy, float32. 16 requests go
# through each policy with every hazard at once: 12 KV blocks (192 token slots), so requests are
# preempted again and again; a budget of 32 tokens, so most prompts are chunked; a third of the
# prompts start with one 32-token system prompt, so the prefix cache hits. Every request must
# produce exactly the tokens `generate` produces for it alone.

# %%
from transformers import Qwen3ForCausalLM

from minivllm.engine.scheduler import UnifiedScheduler

hf_model = Qwen3ForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
hf_model.generation_config.eos_token_id = None  # ignore_eos: always max_new_tokens tokens
hf_model.generation_config.pad_token_id = 0


def hf_generate(prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(prompt) :].tolist()


system_prompt = random.choices(range(3, 2048), k=32)
prompts = []
for i in range(16):
    prefix = system_prompt if i % 3 == 0 else []
    prompts.append(prefix + random.choices(range(3, 2048), k=random.randint(4, 64)))
max_tokens = [random.randint(4, 16) for _ in prompts]
expected = [hf_generate(p, n) for p, n in zip(prompts, max_tokens)]
policies = {"prefill first": Scheduler, "unified": UnifiedScheduler}
parity = {}
for name, cls in policies.items():
    seqs = [request(p, n) for p, n in zip(prompts, max_tokens)]
    run = parity[name] = serve(
        make_scheduler(12, cls=cls, max_num_seqs=8, max_num_batched_tokens=32), seqs
    )
    run["matches"] = sum(seq.completion_token_ids == e for seq, e in zip(seqs, expected))
    counts = f"{len(run['rows'])} steps, {run['preemptions']} preemptions"
    chunks = f"{run['chunks']} prompt chunks short of the end"
    hits = f"{run['hit_tokens']} prompt tokens from the prefix cache"
    same = f"{run['matches']} of {len(prompts)} requests give exactly transformers' tokens"
    print(f"{name:>13}: {counts}, {chunks}, {hits}; {same}")

# %%
for run in parity.values():
    assert run["matches"] == len(prompts)
    assert run["preemptions"] >= 3 and run["chunks"] >= 5 and run["hit_tokens"] >= 100

# %% [markdown]
# ## Why prefill first? Turn the rule around
# **Decode first** admits new requests only when nobody can decode; with one kind of batch per step,
# that is when the batch is empty. So decode first *is* static batching: a new request waits for the
# longest reply in flight. Prefill first admits it at the next step, and the running requests pay:
# in a prefill step they produce no token. Check 1 counts the steps; the last section puts the two
# orders on a clock measured on your CPU.


# %%
class DecodeFirstScheduler(Scheduler):
    """Decode whenever a request can; admit new ones only when none can (this notebook's comparison
    only)."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        if self.running and len(self.running[-1]) - self.running[-1].num_cached_tokens == 1:
            return self.schedule_decode(), False
        return self.schedule_prefill(), True


# %% [markdown]
# ## Check yourself
# Set each `answer` and run its cell: the check compares it with the objects. `step` runs the
# scheduler alone.
#
# **1.** With decode first, `a` (4 tokens to generate) and `b` (10) are decoding when `c` arrives.
# How many decode steps run before `c`'s prefill? (And with prefill first?)


# %%
from minivllm.testing import check_answer


def step(scheduler: Scheduler) -> tuple[list[int], bool]:
    seqs, is_prefill = scheduler.schedule()
    scheduled = [seq.num_scheduled_tokens for seq in seqs]
    scheduler.postprocess(seqs, [0] * len(seqs))
    return scheduled, is_prefill


def decode_steps_before_c(cls: type) -> int:
    scheduler = make_scheduler(64, cls=cls, max_num_seqs=4)
    for max_tokens in (4, 10):
        scheduler.add(request([max_tokens] * 8, max_tokens))
    step(scheduler)  # a's and b's prefill: each has its first token
    scheduler.add(request([3] * 8, 4))
    waited = 0
    while not step(scheduler)[1]:
        waited += 1
    return waited


answer = None  # your answer: replace None with an expression
check_answer(answer, decode_steps_before_c(DecodeFirstScheduler), "1. decode first")

# %% [markdown]
# Worked answer: decode first admits only into an empty batch, so `c` waits for the longest reply in
# flight, `b`'s 10 − 1 tokens left. Prefill first admits `c` at the very next step.

# %%
check_answer(10 - 1, decode_steps_before_c(DecodeFirstScheduler), "1. decode first")
assert decode_steps_before_c(Scheduler) == 0

# %% [markdown]
# **2.** Unified policy, a budget of 256: 16 requests are decoding when a 1,000-token prompt
# arrives. How many of its tokens does the next step compute? (And under prefill first?)


# %%
def first_chunk(cls: type) -> int:
    scheduler = make_scheduler(128, cls=cls, max_num_batched_tokens=256)
    for i in range(16):
        scheduler.add(request([i + 3] * 8, 8))
    step(scheduler)  # their prefills: each has its first token
    scheduler.add(request(list(range(3, 1003)), 4))
    return step(scheduler)[0][-1]  # tokens scheduled in the next step for the prompt, admitted last


answer = None  # your answer: replace None with an expression
check_answer(answer, first_chunk(UnifiedScheduler), "2. a chunk beside decodes")

# %% [markdown]
# Worked answer: the decodes take their token each first, the prompt gets what is left: 256 − 16
# = 240. Prefill first gives it all 256, and the 16 wait out the step (and the three after it).

# %%
check_answer(256 - 16, first_chunk(UnifiedScheduler), "2. a chunk beside decodes")
assert first_chunk(Scheduler) == 256

# %% [markdown]
# ## How fast, on this CPU
# Everything so far counted steps and tokens. For time, we time real steps of the tiny model on your
# CPU (`runner.run`, the PyTorch reference attention): a few shapes of each kind, the fastest of ten
# runs of each.


# %%
def step_shape(seqs: list[Sequence], is_prefill: bool) -> tuple[int, int, int]:
    """What a step's cost depends on: sequences, new tokens, and query × key pairs of attention."""
    if is_prefill:
        new = [seq.num_scheduled_tokens for seq in seqs]
        return (
            len(seqs),
            sum(new),
            sum(n * (seq.num_cached_tokens + n) for seq, n in zip(seqs, new)),
        )
    return len(seqs), len(seqs), sum(len(seq) for seq in seqs)  # one query over each whole sequence


def time_step(
    num_seqs: int, num_tokens: int, is_prefill: bool
) -> tuple[tuple[int, int, int], float]:
    """The shape and the fastest of ten runs (seconds) of one step over num_seqs sequences of
    num_tokens tokens."""
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    seqs = [
        Sequence(list(range(num_tokens)), SamplingParams(temperature=0), bm.block_size)
        for _ in range(num_seqs)
    ]
    for seq in seqs:
        bm.allocate(seq)
        seq.num_scheduled_tokens = num_tokens
    # the first is a warm-up
    times = timeit.repeat(lambda: runner.run(seqs, is_prefill), number=1, repeat=11)
    return step_shape(seqs, is_prefill), min(times[1:])


decode_grid = [(b, n) for b in (1, 4, 16) for n in (32, 256)]
prefill_grid = [(1, 16), (1, 64), (1, 256), (1, 1024)]  # one prompt of each length
prefill_grid += [(4, 16), (4, 64), (16, 16)]  # and batches of them
measured = {(False, b, n): time_step(b, n, False) for b, n in decode_grid}
measured |= {(True, b, n): time_step(b, n, True) for b, n in prefill_grid}
for (is_prefill, b, n), (_, seconds) in measured.items():
    kind = f"prefill of {b:2d} prompts" if is_prefill else f"decode of {b:2d} sequences"
    print(f"{kind} of {n:4d} tokens: {seconds * 1e3:5.1f} ms")

# %% [markdown]
# A step has a fixed cost (every layer's operations are launched whatever the batch), so a decode
# token costs less in a batch than alone; on a GPU far less, as a decode step reads all the weights
# whatever the batch (notebook 04's H200 measurement, Qwen3-0.6B with CUDA graphs, beside this
# CPU's):

# %%
h200_rows = json.loads(Path("figures/decode_step.json").read_text())["rows"]
h200 = {r["batch"]: r["ms"] / 1e3 for r in h200_rows if r["impl"] == "minivllm"}
cpu = {b: measured[False, b, 32][1] for b in (1, 16)}
for where, alone, batch, size in (
    ("H200", h200[1], h200[64], 64),
    ("this CPU", cpu[1], cpu[16], 16),
):
    alone_ms, batched_ms, speedup = alone * 1e3, batch / size * 1e3, size * alone / batch
    costs = f"{alone_ms:.2f} ms alone, {batched_ms:.3f} ms in a batch of {size}"
    print(f"{where:>8}: a decode token costs {costs}: {speedup:.1f}x cheaper")
# 64 tokens in one step cost less than three steps of one (committed H200 timings)
assert h200[64] < 3 * h200[1]

# %% [markdown]
# So the scheduler's first job is to keep the batch full.
#
# **A clock for the experiments.** Timing whole runs on a shared machine would mix the policies'
# differences with its jitter. So the experiments run the real scheduler and add up a *cost model*
# of each step fitted to the timings above: a fixed cost plus a cost per sequence, per new token and
# per query × key pair, for prefill and decode apart (a term that fits negative is dropped: more
# work cannot cost less). If either fit explains less than 90% of its timings' variance (R² < 0.9),
# the experiments use `SHIPPED`, a fit from a quiet 2-core CPU, and the cell says so.


# %%
def features(shape: tuple[int, int, int], is_prefill: bool) -> np.ndarray:
    num_seqs, num_tokens, pairs = shape
    return np.array([1.0, num_seqs, num_tokens, pairs] if is_prefill else [1.0, num_seqs, pairs])


def fit(is_prefill: bool) -> tuple[np.ndarray, float]:
    """Seconds per unit of each feature (least squares on relative error, negative terms dropped),
    and R²."""
    shapes, seconds = map(
        np.array, zip(*[v for (kind, *_), v in measured.items() if kind == is_prefill])
    )
    x = np.stack([features(shape, is_prefill) for shape in shapes])
    kept = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(len(kept))
        coef[kept] = np.linalg.lstsq(
            x[:, kept] / seconds[:, None], np.ones(len(seconds)), rcond=None
        )[0]
        if (coef >= 0).all():
            return coef, 1 - np.sum((x @ coef - seconds) ** 2) / np.sum(
                (seconds - seconds.mean()) ** 2
            )
        kept &= coef > 0


def terms(coef: np.ndarray, is_prefill: bool) -> str:
    units = (
        ["ms", "ms/sequence", "ms/token", "ms/pair"]
        if is_prefill
        else ["ms", "ms/sequence", "ms/pair"]
    )
    coef_ms = coef * 1e3
    return " + ".join(f"{c:.2g} {unit}" for c, unit in zip(coef_ms, units))


# seconds: prefill (True) = fixed + per sequence + per token + per pair; decode = fixed + per
# sequence + per pair
SHIPPED = {
    True: np.array([1.6e-3, 6.0e-4, 1.4e-5, 7.2e-8]),
    False: np.array([2.1e-3, 3.1e-4, 1.1e-6]),
}
fits = {kind: fit(kind) for kind in (True, False)}
for kind, (coef, r2) in fits.items():
    name = "prefill" if kind else "decode "
    print(
        f"{name} step, this CPU: {terms(coef, kind)} (R² {r2:.2f}); shipped: "
        f"{terms(SHIPPED[kind], kind)}"
    )
noisy = [("prefill" if kind else "decode") for kind, (_, r2) in fits.items() if r2 < 0.9]
cost_coef = SHIPPED if noisy else {kind: coef for kind, (coef, _) in fits.items()}
verdict = (
    f"too noisy ({' and '.join(noisy)}: R² < 0.9), so the shipped fit"
    if noisy
    else "this CPU's fit"
)
print(verdict, "clocks the experiments below")


def cost_model(coef: dict[bool, np.ndarray]) -> StepCost:
    """Modelled seconds of a step, from its sequences before postprocess (as `serve` calls it)."""
    return lambda seqs, is_prefill: float(
        features(step_shape(seqs, is_prefill), is_prefill) @ coef[is_prefill]
    )


step_cost, shipped_cost = cost_model(cost_coef), cost_model(SHIPPED)

# %% [markdown]
# ### A bursty workload: the timeline
# Three bursts of 16 requests (prompts of 16 to 200 tokens, one in ten of 400 to 600; replies of 16
# to 96), each arriving when the one before it is two-thirds served; 128 KV blocks, at most 16
# running, 256 tokens per step. Each step is one bar, as wide as its modelled time; below it, the
# queues, the KV blocks in use and the preemptions.

# %%
lens = [
    int(rng.integers(400, 601)) if rng.random() < 0.1 else int(rng.integers(16, 201))
    for _ in range(48)
]
burst_requests = [(rng.integers(3, 2048, k).tolist(), int(rng.integers(16, 97))) for k in lens]
burst_scheduler = lambda: make_scheduler(128, max_num_seqs=16, max_num_batched_tokens=256)
first = serve(
    burst_scheduler(), [request(p, n) for p, n in burst_requests[:16]], cost=step_cost, model=False
)
burst_arrivals = np.repeat(np.arange(3) * 2 / 3 * first["seconds"], 16)
burst = serve(
    burst_scheduler(),
    [request(p, n) for p, n in burst_requests],
    burst_arrivals,
    step_cost,
    model=False,
)
steps = burst["rows"]
t, is_prefill, duration, num_tokens = (
    np.array([r[k] for r in steps]) for k in ("time", "is_prefill", "duration", "num_tokens")
)
timing = f"{len(steps)} steps ({is_prefill.sum()} prefill) in {burst['seconds']:.2f} s"
counts = f"{burst['preemptions']} preemptions; {burst['chunks']} prompt chunks short of the end"
median_ttft_ms = np.median(burst["ttft"]) * 1e3
print(f"{timing}; {counts}; median time to first token {median_ttft_ms:.0f} ms")

fig, axes = plt.subplots(3, 1, figsize=(10.8, 7.8), sharex=True)
for kind, color, label in (
    (True, "tab:blue", "prefill step"),
    (False, "tab:orange", "decode step"),
):
    m = is_prefill == kind
    axes[0].bar(t[m], num_tokens[m], width=-duration[m], align="edge", color=color, label=label)
axes[0].set(
    yscale="log",
    ylim=(0.7, 4e3),
    ylabel="tokens computed",
    title="One bar per step, as wide as it takes",
)
axes[1].step(t, [r["running"] for r in steps], where="pre", color="tab:green", label="running")
axes[1].step(t, [r["waiting"] for r in steps], where="pre", color="tab:red", label="waiting")
axes[1].set(ylabel="requests")
used = [r["used_blocks"] for r in steps]
axes[2].fill_between(t, used, step="pre", color="tab:purple", alpha=0.5, label="KV blocks in use")
axes[2].axhline(128, color="k", ls=":", lw=1)
preempted = np.diff(np.concatenate([[0], [r["preemptions"] for r in steps]])) > 0
axes[2].plot(t[preempted], np.full(preempted.sum(), 132), "rv", ms=5, label="a preemption")
axes[2].set(
    ylim=(0, 180), ylabel="blocks (of 128)", xlabel="time (s, modelled from the step costs)"
)
for ax in axes:
    ax.legend(loc="upper right", ncols=2)  # above the bars
    for a in np.unique(burst_arrivals):
        ax.axvline(a, color="grey", lw=0.8, ls="--")
fig.suptitle(
    "Three bursts of 16 requests (dashed lines): continuous batching, prefill first, preemption"
)
fig.tight_layout()
fig.savefig(FIGURES / "05_timeline.png", dpi=120)

# %% [markdown]
# **Reading the timeline.** Each burst starts with prefill steps (blue) that fill the batch, a long
# prompt over several chunks; then decode steps (orange). When a request finishes, a waiting one
# joins at the next step (a thin blue bar among the orange): the queue drains request by request.
# When the KV blocks reach the ceiling, decodes preempt the newest requests. The checks use the
# first burst alone, whose schedule does not depend on the clock.

# %%
assert max(num_tokens) <= 256
assert (
    first["preemptions"] > 0
    and first["chunks"] > 0
    and max(r["running"] for r in first["rows"]) > 8
)

# %% [markdown]
# ### Why does the scheduler put prefill before decode?
# 120 requests (prompts and replies of 16 to 128 tokens) arrive at random (Poisson) at half the rate
# the engine serves them (measured first, all there at once), under prefill first and under decode
# first. For each request: its **time to first token** (TTFT: arrival to first token) and **time per
# output token** (TPOT).

# %%
online_requests = []
for _ in range(120):
    prompt = rng.integers(3, 2048, int(rng.integers(16, 129))).tolist()
    online_requests.append((prompt, int(rng.integers(16, 129))))  # and its output length
limits = dict(max_num_seqs=16, max_num_batched_tokens=512)


def poisson_arrivals(cost: StepCost, load: float) -> np.ndarray:
    """Arrival times at `load` times the rate the engine, under cost, serves online_requests all at
    once."""
    seqs = [request(p, n) for p, n in online_requests]
    rate = (
        load
        * len(seqs)
        / serve(make_scheduler(256, **limits), seqs, cost=cost, model=False)["seconds"]
    )
    return np.cumsum(np.random.default_rng(4).exponential(1 / rate, len(seqs)))


def serve_online(requests: list, cls: type, arrivals: np.ndarray, cost: StepCost, **limits) -> dict:
    run = serve(
        make_scheduler(512, cls=cls, **limits),
        [request(p, n) for p, n in requests],
        arrivals,
        cost,
        False,
    )
    decode_tokens = np.array([n - 1 for _, n in requests])  # the tokens after the first
    run["tpot"] = (run["latency"] - run["ttft"]) / decode_tokens
    run["tpot_p99"], run["max_step"] = (
        np.percentile(run["tpot"], 99),
        max(r["duration"] for r in run["rows"]),
    )
    run["max_wait"] = max(np.diff(times).max() for times in run["token_times"])
    return run


def compare_orders(cost: StepCost) -> dict[str, dict]:
    arrivals = poisson_arrivals(cost, load=0.5)
    orders = {"prefill first": Scheduler, "decode first": DecodeFirstScheduler}
    return {
        name: serve_online(online_requests, cls, arrivals, cost, **limits)
        for name, cls in orders.items()
    }


orders = compare_orders(step_cost)
fig, axes = plt.subplots(1, 2, figsize=(10.8, 3.8))
for (name, run), color in zip(orders.items(), ("tab:blue", "tab:red")):
    ttft_ms = np.sort(run["ttft"] * 1e3)
    cdf = np.arange(1, len(ttft_ms) + 1) / len(ttft_ms)
    axes[0].plot(ttft_ms, cdf, color=color, label=name)
    decode_rows = [(r["time"], r["num_seqs"]) for r in run["rows"] if not r["is_prefill"]]
    axes[1].step(*zip(*decode_rows), where="pre", color=color, lw=0.8, label=name)
axes[0].set(
    xscale="log",
    xlabel="time to first token (ms, log scale)",
    ylabel="share of requests",
    title="TTFT",
)
end = orders["prefill first"]["seconds"]
axes[1].set(xlim=(0.4 * end, 0.6 * end), xlabel="time (s)", ylabel="sequences per decode step")
axes[1].set_title("Decode batch size (a fifth of the run)")
for ax in axes:
    ax.legend()
fig.suptitle(
    f"{len(online_requests)} requests at half the engine's rate: prefill first vs decode first"
)
fig.tight_layout()
fig.savefig(FIGURES / "05_ttft.png", dpi=120)
(pf_ttft, df_ttft), (pf_tpot, df_tpot) = (
    [np.median(run[k]) * 1e3 for run in orders.values()] for k in ("ttft", "tpot")
)
print(
    f"A new request waits {pf_ttft:.0f} ms (median) for its first token when prefills go first, "
    f"{df_ttft:.0f} ms when "
    f"decodes go first ({df_ttft / pf_ttft:.1f}x). A running request's time per output token "
    f"(median): "
    f"{pf_tpot:.1f} ms with prefill first, {df_tpot:.1f} ms with decode first."
)

# %% [markdown]
# **The answer, in these numbers.** Prefill first runs a new request's prefill at the next step,
# whenever it arrives. Decode first makes it wait until every running request has finished its whole
# reply, from nothing to a hundred steps by luck of timing, and the batch drains to one straggler
# before anyone may join (right). The running requests pay for prefill first: in a prefill step they
# produce no token, so their time per output token rises. The checks run the same comparison on the
# shipped cost model, so they hold whatever this CPU measured.

# %%
pf, df = compare_orders(shipped_cost).values()
assert np.median(df["ttft"]) > 5 * np.median(pf["ttft"])
assert np.percentile(df["ttft"], 90) > 5 * np.percentile(pf["ttft"], 90)
assert np.median(pf["tpot"]) >= np.median(df["tpot"])

# %% [markdown]
# ### What chunked prefill changes
# Two knobs: the policy, and the budget `max_num_batched_tokens` (256 chunks every long prompt,
# 4,096 never does). The requests: the 120 above, one prompt in ten made long (1k to 3k tokens),
# arriving at a quarter of the rate the engine serves short ones. Per run: TTFT and TPOT, the
# longest step, the longest wait of any request between two tokens.

# %%
long_rng = np.random.default_rng(3)  # its own draws
grid_requests = [
    (
        long_rng.integers(3, 2048, int(long_rng.integers(1000, 3001))).tolist()
        if i % 10 == 5
        else p,
        n,
    )
    for i, (p, n) in enumerate(online_requests)
]


def budget_grid(cost: StepCost) -> dict[tuple[str, int], dict]:
    arrivals, grid = (
        poisson_arrivals(cost, load=0.25),
        [(name, budget) for budget in (256, 4096) for name in policies],
    )
    return {
        (name, budget): serve_online(
            grid_requests,
            policies[name],
            arrivals,
            cost,
            **dict(limits, max_num_batched_tokens=budget),
        )
        for name, budget in grid
    }


grid_runs = budget_grid(step_cost)
fig, axes = plt.subplots(1, 2, figsize=(10.8, 3.8))
for (name, budget), run in grid_runs.items():
    t50, t99 = np.percentile(run["ttft"], [50, 99]) * 1e3
    p50, p99 = np.percentile(run["tpot"], [50, 99]) * 1e3
    step_ms, wait_ms = run["max_step"] * 1e3, run["max_wait"] * 1e3
    config = f"{name:>13}, budget {budget:4d}"
    ttft = f"TTFT p50 {t50:3.0f} ms, p99 {t99:3.0f} ms"
    tpot = f"TPOT p50 {p50:3.1f} ms, p99 {p99:4.1f} ms"
    longest = f"longest step {step_ms:3.0f} ms, longest wait {wait_ms:3.0f} ms"
    print(f"{config}: {ttft}; {tpot}; {longest}")
    style = dict(
        color="tab:blue" if name == "unified" else "tab:red", ls="-" if budget == 256 else "--"
    )
    for ax, key in zip(axes, ("ttft", "tpot")):
        ax.plot(
            np.sort(run[key] * 1e3),
            np.arange(1, 121) / 120,
            **style,
            label=f"{name}, budget {budget:,}",
        )
axes[0].set(
    xscale="log",
    xlabel="time to first token (ms, log scale)",
    ylabel="share of requests",
    title="TTFT",
)
axes[1].set(xlabel="time per output token (ms)", title="TPOT")
axes[1].legend(loc="lower right", fontsize=8)
fig.suptitle(
    "The same requests (one prompt in ten of 1,000 to 3,000 tokens), two policies × two budgets"
)
fig.tight_layout()
fig.savefig(FIGURES / "05_chunked_prefill.png", dpi=120)

# %% [markdown]
# **What chunking changes.** With a budget of 4,096 a 3,000-token prompt is one step (the longest
# step printed above) that every running request waits out; with 256 no step computes more than 256
# tokens. Under prefill first the chunks run back to back and the running requests sit out every one
# (the longest wait). Under the unified policy every chunk step carries their tokens too: nobody
# waits more than one short step. The checks run on the shipped cost model.

# %%
shipped = budget_grid(shipped_cost)
for name in policies:
    assert shipped[name, 256]["max_step"] < shipped[name, 4096]["max_step"] / 5
    assert shipped[name, 256]["tpot_p99"] < shipped[name, 4096]["tpot_p99"]
assert shipped["unified", 256]["tpot_p99"] < shipped["prefill first", 256]["tpot_p99"]
assert shipped["unified", 256]["max_wait"] < shipped["prefill first", 256]["max_wait"] / 3
