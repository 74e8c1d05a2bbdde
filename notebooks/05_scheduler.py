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
# **What this notebook builds.** The `Scheduler`, which decides what the model computes at every step: which
# waiting requests join the batch, which request gives its KV blocks back when the cache is full, how a long
# prompt is cut into chunks, and when a request is done; in two policies: prefill first (each step a prefill or
# a decode, nano-vllm's) and unified (one token budget per step, vLLM v1's). Notebook 06 wraps the loop.
#
# **What it assumes.** Notebook 03's `Sequence` and `BlockManager` (blocks, prefix caching, `cache_blocks`) and
# notebook 04's `ModelRunner`: `run(seqs, is_prefill)` computes each sequence's `num_scheduled_tokens` tokens after
# its `num_cached_tokens` cached ones and samples one token per sequence.
#
# **What you will see.** The tiny model's greedy tokens equal to transformers' `generate` while requests are
# preempted, chunked and sharing prefixes; a bursty workload's timeline and a map of who owns which KV block; the
# prefill work and memory a shared system prompt saves; time to first token with and without prefill priority
# ("why does the scheduler put prefill before decode?"); TTFT and TPOT of both policies under a small and a large
# token budget ("what does chunked prefill change?"); and continuous against static batching.

# %%
import dataclasses
import json
import os
import random
import time
from collections import deque
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
plt.rcParams["axes.titlesize"] = "medium"  # 10-pt panel titles: three panels side by side fit in 1,100 px
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
# A **prefill** computes the KV of new prompts (thousands of tokens, compute-bound on a GPU) and gives each
# its first token. A **decode** computes one token for each running request (a few hundred tokens at most,
# memory-bound: notebook 03). Our steps are one kind or the other, as in nano-vllm and vLLM before v1:
#
# * each kind has its own attention path (varlen FlashAttention over new tokens, or PagedAttention with one
#   query per sequence), so a step runs one well-tuned kernel;
# * a decode step has a fixed shape (one token per sequence), which is what lets notebook 04 replay it as a
#   CUDA graph; a batch mixing a 700-token prompt with 30 decodes has a new shape every step;
# * the step's cost is easy to predict, and the scheduler stays short.
#
# The price: while a prefill step runs, every decoding request waits. **vLLM's mixed batches** (v1, and v0 with chunked
# prefill on) remove that: each step has one token budget, every running request takes one token of it, and prompt
# chunks fill the rest. One varlen attention kernel serves both (a decode is a query of length one, notebook 04 did
# exactly that for a prefix hit), decodes never stall longer than one step, and the compute-bound prefill hides under
# the memory-bound decode. It costs a kernel that handles both shapes and piecewise CUDA graphs.
#
# What does a step cost? We time `runner.run` on this CPU (the tiny model, the PyTorch reference attention)
# for decode batches and prefills of several shapes, keeping the fastest of ten runs of each:

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
base_config = Config(tiny_path, dtype=torch.float32, num_kvcache_blocks=2048, max_num_seqs=64)
runner = ModelRunner(base_config)  # one KV cache of 2,048 blocks; each scheduler below uses some of them


def step_shape(seqs: list[Sequence], is_prefill: bool) -> tuple[int, int, int]:
    """What a step's cost depends on: sequences, new tokens, and query × key pairs of attention."""
    if is_prefill:
        new = [seq.num_scheduled_tokens for seq in seqs]
        return len(seqs), sum(new), sum(n * (seq.num_cached_tokens + n) for seq, n in zip(seqs, new))
    return len(seqs), len(seqs), sum(len(seq) for seq in seqs)  # one query over each whole sequence


def time_step(num_seqs: int, num_tokens: int, is_prefill: bool) -> tuple[tuple[int, int, int], float]:
    """The shape and the fastest of ten runs (seconds) of one step over num_seqs sequences of num_tokens tokens."""
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size)
    seqs = [Sequence(list(range(num_tokens)), SamplingParams(temperature=0), bm.block_size) for _ in range(num_seqs)]
    for seq in seqs:
        bm.allocate(seq)
        seq.num_scheduled_tokens = num_tokens
    runner.run(seqs, is_prefill)  # warm-up
    times = []
    for _ in range(10):
        start = time.perf_counter()
        runner.run(seqs, is_prefill)
        times.append(time.perf_counter() - start)
    return step_shape(seqs, is_prefill), min(times)


decode_grid = [(b, n) for b in (1, 4, 16, 64) for n in (64, 512)]
prefill_grid = [(1, 16), (1, 64), (1, 256), (1, 512), (4, 16), (4, 64), (16, 16)]
measured = {(False, b, n): time_step(b, n, False) for b, n in decode_grid}
measured |= {(True, b, n): time_step(b, n, True) for b, n in prefill_grid}
for (is_prefill, b, n), (_, seconds) in measured.items():
    kind = f"prefill of {b:2d} prompts" if is_prefill else f"decode of {b:2d} sequences"
    per_token = seconds * 1e3 / (b * n if is_prefill else b)
    print(f"{kind} of {n:3d} tokens: {seconds * 1e3:5.1f} ms, {per_token:5.2f} ms per new token")

# %% [markdown]
# A step has a large fixed cost (every layer's operations are launched whatever the batch), so a decode token
# is several times cheaper in a batch of 16 than alone. On a GPU the effect is far stronger: a decode step reads
# all the weights whatever the batch. Notebook 04's measurement on an H200 (Qwen3-0.6B, CUDA graphs):

# %%
h200_rows = json.loads(Path("figures/decode_step.json").read_text())["rows"]
h200 = {r["batch"]: r["ms"] for r in h200_rows if r["impl"] == "minivllm"}
print("H200 decode step:", ", ".join(f"batch {b}: {ms:.1f} ms" for b, ms in h200.items() if b in (1, 16, 64, 256)))
cpu = {b: measured[False, b, 64][1] for b in (1, 16)}
print(f"this CPU: a decode token costs {cpu[1] * 1e3:.1f} ms alone, {cpu[16] / 16 * 1e3:.2f} ms in a batch of 16")
assert h200[64] < 3 * h200[1]  # 64 tokens in one step cost less than three steps of one (committed H200 timings)

# %% [markdown]
# The scheduler's first job is therefore to keep the batch full.
#
# **A clock for the experiments.** Time on a shared 2-core machine jitters by tens of percent, more than some
# differences we want to see, so the experiments run the real scheduler and add up a *cost model* of each step: a
# fixed cost, plus a cost per sequence, per new token and per query × key pair, for prefill and decode steps apart,
# fitted to timings like the ones above (least squares on relative error). A fit on a busy machine can be off by
# half, so they use coefficients fitted once on a quiet 2-core CPU (`SHIPPED`); compare this machine's fit, printed
# below (`REFIT = True` runs the experiments on it).


# %%
def features(shape: tuple[int, int, int], is_prefill: bool) -> np.ndarray:
    num_seqs, num_tokens, pairs = shape
    return np.array([1.0, num_seqs, num_tokens, pairs] if is_prefill else [1.0, num_seqs, pairs])


cost_coef = {}
for kind in (True, False):
    shapes, seconds = map(np.array, zip(*[v for (is_prefill, *_), v in measured.items() if is_prefill == kind]))
    x = np.stack([features(sh, kind) for sh in shapes])
    coef, *_ = np.linalg.lstsq(x / seconds[:, None], np.ones(len(seconds)), rcond=None)  # relative error
    cost_coef[kind] = np.clip(coef, 0, None)  # no negative costs
    units = ["ms", "ms/sequence", "ms/token", "ms/pair"] if kind else ["ms", "ms/sequence", "ms/pair"]
    terms = " + ".join(f"{c:.2g} {unit}" for c, unit in zip(cost_coef[kind] * 1e3, units))
    error = np.max(np.abs(x @ cost_coef[kind] / seconds - 1))
    print(f"{'prefill' if kind else 'decode '} step = {terms}; worst error {error:.0%}")


REFIT = False  # True: the experiments below use this machine's fit instead of the shipped one
# seconds: prefill (True) = fixed + per sequence + per token + per pair; decode = fixed + per sequence + per pair
SHIPPED = {True: np.array([1.6e-3, 6.0e-4, 1.4e-5, 7.2e-8]), False: np.array([2.1e-3, 3.1e-4, 1.1e-6])}
if not REFIT:
    cost_coef = SHIPPED
print("the experiments use", "this machine's fit" if REFIT else "the shipped cost model")


def step_cost(seqs: list[Sequence], is_prefill: bool) -> float:
    """Modelled seconds of one step (call it before postprocess)."""
    return float(features(step_shape(seqs, is_prefill), is_prefill) @ cost_coef[is_prefill])


# %% [markdown]
# ## Continuous batching
# **Static batching** (what `transformers.generate` does with a list of prompts) forms a batch, runs it until
# its *longest* request ends, then forms the next. A request that finishes early leaves its seat empty, and a
# request that arrives meanwhile waits for the whole batch. **Continuous batching** (Orca, 2022) forms the batch
# anew at every step: a finished request leaves at once, and a waiting one takes its seat at the next step.
# That needs KV memory that can be handed out and taken back per request: notebook 03's blocks.
#
# The scheduler keeps two queues: `waiting` (first come, first served) and `running` (admission order). Its rules:
#
# **1. Prefill first.** If a waiting request can join (or a chunked prompt has more to compute, rule 2), the step
# is a prefill; otherwise it is a decode of every running request. Requests join in arrival order while three
# limits allow: `max_num_seqs` running requests, `max_num_batched_tokens` tokens in the step (the *token
# budget*), and free KV blocks for the whole prompt (`BlockManager.can_allocate`, asked first). The budget counts
# only tokens to compute: a prompt whose first 512 tokens are a prefix-cache hit costs only the rest. The first
# request that does not fit stops admission: a stream of small requests overtaking a big one could starve it.
#
# **2. Chunked prefill.** A prompt bigger than what is left of the budget gets what is left, and the rest in the next
# steps (where it goes first). So any prompt runs, however small the budget, and no step computes more than
# `max_num_batched_tokens` tokens, the size notebook 04 measured the activation memory for. A chunk reads the chunks
# before it as it reads a prefix hit; its sampled token is thrown away (its last token is not the prompt's end). Each
# chunk publishes only the blocks it completes (`cache_blocks`): a request arriving mid-prompt must not hit blocks
# no step has written yet.
#
# **3. Decode and preemption.** Every running request decodes one token. A token that starts a new block needs
# a free one; if there is none, the scheduler *preempts* the most recently admitted request: frees its blocks
# and puts it back at the front of `waiting`. Requests are visited oldest first and victims taken newest first,
# so the oldest request always makes progress and the engine never deadlocks. vLLM calls this preemption by
# **recompute**: the victim keeps its tokens, generated ones too, and when admitted again they are all its prompt,
# mostly from its own blocks still in the prefix cache. Its next token is exactly the one it would have produced.
#
# **4. Postprocess**, in two halves. `advance`, once the step is queued: count its computed tokens, give each
# sequence that samples a *placeholder* token, and finish those that reach `max_tokens` or `max_model_len`
# (`"length"`). `resolve`, once the tokens are known: they replace the placeholders, and a request ends on one of
# its `stop_token_ids` (`"stop"`); finished requests free their blocks at once. `postprocess` runs both in a row;
# notebook 06 schedules the next step between them. The scheduler does not know which token is the model's EOS:
# the engine puts it into each request's stop tokens unless the request says `ignore_eos` (notebook 06).
#
# **5. Admission.** Every request that reaches `add` fits, prompt plus one token, in `max_model_len` and the KV cache
# (the engine checks, notebook 06). One that outgrows the cache while running stops with `"length"`, as at the limit.
#
# **6. Abort.** `abort` drops a request wherever it is, even in the middle of a step that failed: blocks that step
# published but never wrote leave the cache with it (`BlockManager.discard`, notebook 03). `abort_all` drops every
# request and resets the block manager, for a step that failed where nothing can be trusted; so that it finds every
# request, a sequence is always in one of the two queues, even while `schedule` moves it.
#
# One consequence is worth seeing before the code. After a prefill, a request has exactly one token whose KV is not
# computed yet: the one just sampled. A chunked prompt with one token left is in the same state, so it joins the
# next decode: a decode is a prefill of one token (vLLM v1 tracks only `num_computed_tokens`, with no phases at all).

# %% tags=["export"] module="minivllm.engine.scheduler"
from collections import deque

from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.step_inputs import placeholder


class Scheduler:
    """Continuous batching: every step is a prefill (first, if any request can join) or a decode of all running
    requests; chunked prefill for prompts beyond the token budget; preemption by recompute when blocks run out."""

    def __init__(self, config: Config, num_kvcache_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = BlockManager(num_kvcache_blocks, config.block_size, config.enable_prefix_caching)
        assert config.max_model_len is not None  # Config resolved it
        self.max_len = min(config.max_model_len, self.block_manager.num_slots)  # tokens a sequence may hold
        self.waiting: deque[Sequence] = deque()  # first come, first served; the preempted go back in front
        self.running: deque[Sequence] = deque()  # admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request. The engine has checked that it can run (notebook 06)."""
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, f"sequence {seq.seq_id} was added before"
        assert len(seq) + 1 <= self.max_len, f"a prompt of {len(seq)} tokens can never run (max_len {self.max_len})"
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
            seqs.append(self.running[-1])  # a prompt part-way through a chunked prefill goes on first
            budget -= self.schedule_chunk(self.running[-1], budget)
        return seqs + self.admit(budget)

    def admit(self, budget: int) -> list[Sequence]:
        """Waiting requests, in order, while a seat, the token budget and the KV blocks of the prompt allow."""
        seqs: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq) or seq.last_token < 0:
                break  # no overtaking: the head of the queue waits for blocks (or its placeholder token, notebook 06)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            seqs.append(seq)
            budget -= self.schedule_chunk(seq, budget)
        return seqs

    def schedule_chunk(self, seq: Sequence, budget: int) -> int:
        """Schedule as many of seq's uncomputed tokens as the budget allows; publish the blocks they complete."""
        seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
        self.block_manager.cache_blocks(seq, seq.num_cached_tokens + seq.num_scheduled_tokens)
        return seq.num_scheduled_tokens

    def schedule_decode(self) -> list[Sequence]:
        seqs = []
        for seq in list(self.running):  # oldest first
            if seq.status == SequenceStatus.WAITING:
                continue  # preempted below, to make room for an older one
            assert len(seq) - seq.num_cached_tokens == 1, "a decode computes exactly the newest token"
            if self.reserve(seq):
                seqs.append(seq)
        assert seqs, "the oldest request always fits once the others are preempted"
        return seqs

    def reserve(self, seq: Sequence) -> bool:
        """Room for seq's newest token, preempting the newest requests (seq itself last) until there is: whether
        seq is still running (then it is scheduled for that one token)."""
        while not self.block_manager.can_append(seq):  # its newest token needs a block and none is free
            self.preempt(self.running.pop())  # the most recently admitted one; seq itself once it is the newest
            if seq.status == SequenceStatus.WAITING:
                return False
        self.block_manager.may_append(seq)
        seq.num_scheduled_tokens = 1
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks and queue it first. Its tokens, the generated ones too, are kept. The
        caller has taken it out of `running`."""
        self.block_manager.deallocate(seq)  # also resets num_cached_tokens
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Record a step that ran: computed tokens, sampled ones; free and return the sequences that finished."""
        assert len(token_ids) == len(seqs), "one sampled token per sequence"
        return self.resolve(seqs, self.advance(seqs), token_ids)

    def advance(self, seqs: list[Sequence]) -> list[int]:
        """A step is queued: count its computed tokens; a sequence that samples gets a placeholder token for its row
        (the runner reads that row of the step's sampled ids) until `resolve`, and ends now if it ends by length."""
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

    def resolve(self, seqs: list[Sequence], rows: list[int], token_ids: list[int]) -> list[Sequence]:
        """A step's tokens are known: they replace its placeholders. Free and return the sequences that finished."""
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

    def finish(self, seq: Sequence, reason: str) -> None:  # seq may be waiting: preempted while its step ran (06)
        if not seq.is_finished:
            (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
            if seq.block_table:
                self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        assert params.stop_token_ids is not None  # SamplingParams made it a list
        if token_id in params.stop_token_ids:  # the engine's EOS ids are among them unless ignore_eos
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or len(seq) >= self.max_len:
            return "length"
        return None

    def abort(self, seq: Sequence) -> None:
        """Drop a request, waiting or running, even one whose step failed part-way: free its blocks, and forget the
        cached ones whose KV that step may not have written."""
        if seq.status == SequenceStatus.FINISHED:
            return
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.block_manager.discard(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"

    def abort_all(self) -> None:
        """Drop every request and reset the block manager: safe after a step that failed anywhere, even half-way
        through the block manager's bookkeeping, since nothing of it is kept. Only cached prefixes are lost."""
        for seq in (*self.waiting, *self.running):
            seq.block_table.clear()
            seq.num_cached_tokens = 0
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.waiting.clear()
        self.running.clear()
        self.block_manager.reset()


# %% [markdown]
# ## Watch it: a small cache, step by step
# Five requests on a cache of 10 blocks of 16 tokens (160 token slots), a budget of 48 tokens per step.
# Request 0 has a 100-token prompt, so it is prefilled in chunks; requests 2, 3 and 4 start with the same 32
# tokens. `serve` is the engine loop: it adds each request once the clock passes its arrival time (all arrive at
# once here), steps until everything is done, and records each step. With `log=True` it prints a step's kind,
# each sequence as `request:tokens computed` (`+` for a prompt chunk short of the end), and the queues after it;
# decode steps that change nothing else are skipped.

# %%
from minivllm.engine.scheduler import Scheduler


def make_scheduler(num_blocks: int, cls: type = Scheduler, **limits) -> Scheduler:
    """A scheduler over the first num_blocks blocks of the runner's cache, with other limits than base_config's."""
    return cls(dataclasses.replace(base_config, **limits), num_blocks)


def request(prompt: list[int], max_tokens: int, **params) -> Sequence:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return Sequence(prompt, sampling, base_config.block_size)  # the block size of every scheduler's block manager here


def serve(
    scheduler: Scheduler,
    seqs: list[Sequence],
    arrivals: np.ndarray | None = None,
    model: bool = True,
    log: bool = False,
) -> dict:
    """The engine loop over seqs, arriving at `arrivals` (seconds; default all at 0), timed by the cost model. With
    model=False the runner is skipped and every sampled token is 0 (the schedule of ignore_eos requests does not
    depend on the tokens). Returns per-step rows and per-request times."""
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
        hit_tokens += sum(seq.num_cached_tokens for seq in batch if is_prefill and index[seq.seq_id] in waiting)
        duration, lens = step_cost(batch, is_prefill), [len(seq) for seq in batch]
        decodes = sum(seq.num_completion_tokens > 0 and seq.num_scheduled_tokens == 1 for seq in batch)
        token_ids = runner.run(batch, is_prefill) if model else [0] * len(batch)
        finished = scheduler.postprocess(batch, token_ids)
        clock += duration
        unfinished = [len(seq) == n for seq, n in zip(batch, lens)]  # a prompt chunk short of the end: no token
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
                decode_tokens=decodes,  # rows of a request that is generating; the rest are prompt tokens
                chunks=sum(unfinished),
                running=len(scheduler.running),
                waiting=len(scheduler.waiting),
                used_blocks=scheduler.block_manager.num_used_blocks,
                preemptions=scheduler.num_preemptions,
            )
        )
        state = (ids(scheduler.running), ids(scheduler.waiting), scheduler.block_manager.num_free_blocks)
        if log and (is_prefill or state != last):
            done = " ".join(f"{index[s.seq_id]}:{s.num_scheduled_tokens}{'+' * u}" for s, u in zip(batch, unfinished))
            print(
                f"step {len(rows):2d} {'prefill' if is_prefill else 'decode '} {done:<20} running {state[0]}, "
                f"waiting {state[1]}, free blocks {state[2]}, preemptions {scheduler.num_preemptions}"
            )
        last = state
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks, "KV blocks leaked"
    return dict(
        rows=rows,
        ttft=np.array([times[0] for times in token_times]) - arrivals,
        token_times=token_times,
        latency=finished_at - arrivals,
        seconds=clock,
        tok_per_s=sum(seq.num_completion_tokens for seq in seqs) / clock,
        preemptions=scheduler.num_preemptions,
        hit_tokens=hit_tokens,
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
# Read it from the top:
#
# * Steps 1 and 2 spend the whole budget on request 0's first 96 tokens. Step 3 computes its last 4 and admits
#   request 1. Request 2 needs 3 blocks and only one is free: it waits, and so does everyone behind it.
# * Request 0 finishes and frees 7 blocks; the next step admits requests 2, 3 and 4 together. Request 2 publishes
#   its two full blocks in that same step, so 3 and 4 hit the shared 32 tokens and compute only 2 and 1 tokens.
#   (Within the step, every layer writes request 2's KV before any attention reads it.)
# * When a token needs a new block and none is free, the newest request (4) is preempted. It rejoins at the next
#   step with a prefill of its prompt *and* its generated tokens, of which it computes a single one: the rest
#   are its own blocks, still in the prefix cache.
#
# Every block is free at the end (`serve` asserts it), and no token was lost: the same tokens as transformers,
# checked next.

# %%
rows = small["rows"]
assert [r["num_tokens"] for r in rows[:3]] == [48, 48, 24] and small["preemptions"] == 1
assert small["hit_tokens"] == 2 * 32 + 48  # requests 3 and 4 on request 2's blocks, then 4 on its own
assert all(
    seq.finish_reason == "length" and seq.num_completion_tokens == seq.sampling_params.max_tokens for seq in small_seqs
)

# %% [markdown]
# `abort_all` drops everything at once: here after two steps, with one prompt half-way through its chunks and two
# requests still waiting. Afterwards nothing is queued, every block is free, and nothing is cached.

# %%
busy = make_scheduler(10, max_num_batched_tokens=48)
dropped = [request(random.choices(range(3, 2048), k=n), 8) for n in (100, 20, 35)]
for seq in dropped:
    busy.add(seq)
for _ in range(2):
    batch, is_prefill = busy.schedule()
    busy.postprocess(batch, [0] * len(batch))
state = lambda: (len(busy.running), len(busy.waiting), busy.block_manager.num_used_blocks)
print("before: (running, waiting, used blocks) =", state())
busy.abort_all()
print("after:  (running, waiting, used blocks) =", state())
assert busy.is_finished() and busy.block_manager.num_free_blocks == 10 == busy.block_manager.num_blocks
assert busy.block_manager.num_cached_free_blocks == 0
assert all(seq.finish_reason == "abort" and seq.is_finished and not seq.block_table for seq in dropped)

# %% [markdown]
# ## The same tokens as transformers, under pressure
# The oracle is transformers' `generate` on the same checkpoint, greedy, float32. We run 48 requests through
# one scheduler with every hazard at once: a KV cache of 24 blocks (384 token slots) so requests are preempted
# again and again, a budget of 64 tokens so most prompts are chunked, and a third of the prompts starting with
# the same 48-token system prompt so the prefix cache hits. Every request must produce exactly the tokens
# `generate` produces for it alone.

# %%
from transformers import Qwen3ForCausalLM

hf_model = Qwen3ForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
hf_model.generation_config.eos_token_id = None  # ignore_eos: always max_new_tokens tokens


def hf_generate(prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    mask = torch.ones_like(input_ids)
    out = hf_model.generate(
        input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


system_prompt = random.choices(range(3, 2048), k=48)
prompts = [
    (system_prompt if i % 3 == 0 else []) + random.choices(range(3, 2048), k=random.randint(4, 150)) for i in range(48)
]
max_tokens = [random.randint(8, 48) for _ in prompts]
expected = [hf_generate(p, n) for p, n in zip(prompts, max_tokens)]
parity_seqs = [request(p, n) for p, n in zip(prompts, max_tokens)]
parity = serve(make_scheduler(24, max_num_seqs=16, max_num_batched_tokens=64), parity_seqs)
matches = sum(seq.completion_token_ids == e for seq, e in zip(parity_seqs, expected))
print(
    f"{len(parity['rows'])} steps, {parity['preemptions']} preemptions, "
    f"{sum(r['chunks'] for r in parity['rows'])} prompt chunks short of the end, "
    f"{parity['hit_tokens']} prompt tokens read from the prefix cache"
)
print(f"{matches} of {len(prompts)} requests give exactly transformers' tokens")

# %%
assert matches == len(prompts)
assert parity["preemptions"] >= 10 and sum(r["chunks"] for r in parity["rows"]) >= 20 and parity["hit_tokens"] >= 500

# %% [markdown]
# Why must a preempted request keep its generated tokens? Try the slip of treating it as new: recompute its prompt
# only. Greedy decoding regenerates the very same tokens, so the replies do not even change; but every dropped token
# costs a decode step again, and a client streaming the reply has shown tokens that sampling may not regenerate. As
# this bug hides from a greedy comparison, `tests/test_scheduler.py` also checks that a reply only ever grows.


# %%
class ForgetfulScheduler(Scheduler):
    """A wrong preemption, for this demonstration only: the victim loses its generated tokens."""

    def preempt(self, seq: Sequence) -> None:
        super().preempt(seq)
        del seq.token_ids[seq.num_prompt_tokens :]
        seq.num_tokens, seq.last_token = seq.num_prompt_tokens, seq.token_ids[-1]


forgetful_seqs = [request(p, n) for p, n in zip(prompts, max_tokens)]
forgetful_scheduler = make_scheduler(24, cls=ForgetfulScheduler, max_num_seqs=16, max_num_batched_tokens=64)
forgetful = serve(forgetful_scheduler, forgetful_seqs)
same = sum(seq.completion_token_ids == e for seq, e in zip(forgetful_seqs, expected))
decoded = lambda run: sum(r["num_tokens"] for r in run["rows"] if not r["is_prefill"])
decode_tokens = {"keep": decoded(parity), "drop": decoded(forgetful)}
print(
    f"dropping generated tokens: {same} of {len(prompts)} greedy replies unchanged, but {decode_tokens['drop']} "
    f"decode tokens computed instead of {decode_tokens['keep']}"
)
assert same == len(prompts) and decode_tokens["drop"] > decode_tokens["keep"]

# %% [markdown]
# ## A bursty workload: the timeline
# Three bursts of 16 requests, one second apart (prompts of 16 to 200 tokens, one in ten of 400 to 600; replies
# of 16 to 96 tokens), on a cache of 128 blocks (2,048 token slots), at most 16 running, 256 tokens per step.
# Each step is one bar, as wide as its modelled time: the tokens it computed (prefill or decode), then the
# queues, then the KV blocks in use and the preemptions.


# %%
def bursty_workload(num_bursts: int = 3, per_burst: int = 16, gap: float = 1.0) -> tuple[list[Sequence], np.ndarray]:
    n = num_bursts * per_burst
    lens = [int(rng.integers(400, 601)) if rng.random() < 0.1 else int(rng.integers(16, 201)) for _ in range(n)]
    seqs = [request(rng.integers(3, 2048, k).tolist(), int(rng.integers(16, 97))) for k in lens]
    return seqs, np.repeat(np.arange(num_bursts) * gap, per_burst) + rng.uniform(0, 0.05, n)


burst_seqs, burst_arrivals = bursty_workload()
burst = serve(make_scheduler(128, max_num_seqs=16, max_num_batched_tokens=256), burst_seqs, burst_arrivals, model=False)
steps = burst["rows"]
t = np.array([r["time"] for r in steps])
is_prefill = np.array([r["is_prefill"] for r in steps])
print(
    f"{len(steps)} steps ({is_prefill.sum()} prefill) in {burst['seconds']:.2f} s; {burst['preemptions']} "
    f"preemptions; {sum(r['chunks'] for r in steps)} prompt chunks short of the end; "
    f"median time to first token {np.median(burst['ttft']) * 1e3:.0f} ms"
)

# %%
fig, axes = plt.subplots(3, 1, figsize=(10.8, 7.8), sharex=True)
duration, num_tokens = (np.array([r[key] for r in steps]) for key in ("duration", "num_tokens"))
for kind, color, label in ((True, "tab:blue", "prefill step"), (False, "tab:orange", "decode step")):
    m = is_prefill == kind
    axes[0].bar(t[m], num_tokens[m], width=-duration[m], align="edge", color=color, label=label)
axes[0].set(yscale="log", ylim=(0.7, 4e3), ylabel="tokens computed", title="One bar per step, as wide as it takes")
axes[0].legend(loc="upper right", ncols=2)  # above the bars
axes[1].step(t, [r["running"] for r in steps], where="pre", color="tab:green", label="running")
axes[1].step(t, [r["waiting"] for r in steps], where="pre", color="tab:red", label="waiting")
axes[1].set(ylabel="requests")
axes[1].legend(loc="upper right")
axes[2].fill_between(
    t, [r["used_blocks"] for r in steps], step="pre", color="tab:purple", alpha=0.5, label="KV blocks in use"
)
axes[2].axhline(128, color="k", ls=":", lw=1)
preempted = np.diff(np.concatenate([[0], [r["preemptions"] for r in steps]])) > 0
axes[2].plot(t[preempted], np.full(preempted.sum(), 132), "rv", ms=5, label="a preemption")
axes[2].set(ylim=(0, 180), ylabel="blocks (of 128)", xlabel="time (s, modelled)")
axes[2].legend(loc="upper right", ncols=2)
for ax in axes:
    for a in np.unique(np.round(burst_arrivals, 1)):
        ax.axvline(a, color="grey", lw=0.8, ls="--")
fig.suptitle("Three bursts of 16 requests (dashed lines): continuous batching, prefill first, preemption")
fig.tight_layout()
fig.savefig(FIGURES / "05_timeline.png", dpi=120)

# %% [markdown]
# **Reading the timeline.** Each burst starts with prefill steps (blue) that fill the batch, a long prompt over
# several budget-sized chunks; then decode steps (orange). When a request finishes, a waiting one joins at the very
# next step (a thin blue bar among the orange): the queue drains request by request, not batch by batch. When the
# KV blocks reach the ceiling, decodes preempt the newest requests, which rejoin as soon as blocks come free.
#
# Chunking keeps every step at most 256 tokens, and a prompt longer than the budget runs at all; but with one
# kind of step the running requests sit out every chunk. That stall is what vLLM's mixed batches remove.

# %%
assert max(r["num_tokens"] for r in steps) <= 256
assert burst["preemptions"] > 0 and sum(r["chunks"] for r in steps) > 0
assert max(r["running"] for r in steps) > 8

# %% [markdown]
# ## The block map over time
# Which request owns which block? We run the scheduler alone (every sampled token is 0, as with `model=False`)
# on 96 blocks of 16 slots and 48 requests, a third of them behind one 64-token system prompt, and take a picture
# of the blocks after every step: one colour per request, black for a block shared by several, grey for a free
# block that is still cached, white for an empty one.

# %%
SHARED, CACHED, EMPTY = -1, -2, -3


def block_owners(scheduler: Scheduler) -> np.ndarray:
    """Per block: the seq_id of the one running request holding it, SHARED, CACHED (free, still hashed) or EMPTY."""
    bm = scheduler.block_manager
    owners = np.full(bm.num_blocks, EMPTY)
    owners[list(bm.cached_block_ids)] = CACHED
    for seq in scheduler.running:
        for block_id in seq.block_table:
            owners[block_id] = seq.seq_id if bm.blocks[block_id].ref_count == 1 else SHARED
    return owners


map_rng = np.random.default_rng(1)  # its own draws, so the sections below keep theirs
map_prompt = map_rng.integers(3, 2048, 64).tolist()
map_scheduler = make_scheduler(96, max_num_batched_tokens=256)
for i in range(48):
    prompt = (map_prompt if i % 3 == 0 else []) + map_rng.integers(3, 2048, int(map_rng.integers(16, 201))).tolist()
    map_scheduler.add(request(prompt, int(map_rng.integers(16, 161))))
frames, usage = [], []  # per step: each block's owner; blocks used, free but cached, empty
while not map_scheduler.is_finished():
    batch, _ = map_scheduler.schedule()
    map_scheduler.postprocess(batch, [0] * len(batch))
    frames.append(block_owners(map_scheduler))
    bm = map_scheduler.block_manager
    usage.append((bm.num_used_blocks, bm.num_cached_free_blocks, len(bm.free_block_ids)))
frames, usage = np.array(frames), np.array(usage)  # (steps, num_blocks), (steps, 3)
print(f"{len(frames)} steps; peak {usage[:, 0].max()} of 96 blocks in use; {map_scheduler.num_preemptions} preemptions")


def frame_colors(frame: np.ndarray) -> np.ndarray:
    """RGB per block: special states fixed, requests cycling through a qualitative palette."""
    palette = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]  # no greys
    special = {SHARED: (0, 0, 0), CACHED: (0.8, 0.8, 0.8), EMPTY: (1, 1, 1)}
    return np.array([special.get(o, palette[o % len(palette)]) for o in frame])


def draw_blocks(ax, step: int, cols: int = 16) -> None:
    ax.imshow(frame_colors(frames[step]).reshape(-1, cols, 3), interpolation="nearest")
    used, cached, empty = usage[step]
    ax.set(xticks=[], yticks=[])
    ax.set_title(f"step {step}: {used} used, {cached} free+cached, {empty} empty", fontsize=9)


fig = plt.figure(figsize=(10.8, 6.6))
grid = fig.add_gridspec(2, 3, height_ratios=[1.3, 1])
ax_map = fig.add_subplot(grid[0, :2])
ax_map.imshow(np.stack([frame_colors(f) for f in frames], axis=1), aspect="auto", interpolation="nearest")
ax_map.set(xlabel="step", ylabel="physical block")
ax_map.set_title("Owner of each block over time (colour = request, black = shared, grey = free but cached)")
ax_use = fig.add_subplot(grid[0, 2])
labels, colours = ["used", "free, cached", "free, empty"], ["tab:blue", "0.75", "white"]
ax_use.stackplot(range(len(usage)), usage.T, labels=labels, colors=colours, edgecolor="0.5", lw=0.3)
ax_use.set(xlabel="step", ylabel="blocks", ylim=(0, 125), title="Blocks in use vs free")
ax_use.legend(loc="upper center", ncols=2, fontsize=8)  # above the 96 blocks
for k, step in enumerate(np.linspace(0, len(frames) - 1, 5)[1:4].astype(int)):
    draw_blocks(fig.add_subplot(grid[1, k]), step)
fig.tight_layout()
fig.savefig(FIGURES / "05_block_map.png", dpi=120)

# %% [markdown]
# Each column of the map is one step. Requests' blocks are scattered wherever a free block was, and that costs nothing:
# the block table is the only thing that knows the order. The black band is the system prompt, stored once and shared by
# every request that starts with it. When the cache is full the newest request is preempted and its blocks go back to
# the pool, and grey blocks (free but cached) are used only once the empty ones run out. Drag the slider to step through
# time (the picture is static in a rendered copy; the three snapshots above are the same view).

# %%
import ipywidgets as widgets


def show_step(step: int) -> None:
    draw_blocks(plt.subplots(figsize=(6, 3))[1], step)
    plt.show()


step_slider = widgets.IntSlider(value=len(frames) // 2, min=0, max=len(frames) - 1, layout=widgets.Layout(width="95%"))
slider = widgets.interact(show_step, step=step_slider)  # wide: the default 120 px is under a pixel per step
assert usage[:, 0].max() == 96  # the run filled the cache...
assert (frames == SHARED).any() and (frames == CACHED).any()  # ...shared blocks, and kept freed ones cached
assert (usage.sum(axis=1) == 96).all()  # used + free = total, at every step

# %% [markdown]
# ## Prefix caching: work saved by a shared system prompt
# A chat service puts the same system prompt in front of every conversation. With prefix caching (notebook 03),
# only the first request with a given system prompt computes its KV; the others reuse those blocks and prefill
# only their own part. Here: 200 requests, all there at the start, each with one of 4 system prompts of 512
# tokens (the first used by half the requests, the last by a tenth), 16 to 256 tokens of its own and a reply of
# 16 to 128. We serve them on 2,048 blocks of 16, caching on and off, and count the prefill tokens computed.

# %%
chat_rng = np.random.default_rng(2)  # its own draws, so the sections below keep theirs
system_prompts = [chat_rng.integers(3, 2048, 512).tolist() for _ in range(4)]
which = chat_rng.choice(4, size=200, p=[0.5, 0.25, 0.15, 0.1])
own_parts = [chat_rng.integers(3, 2048, int(chat_rng.integers(16, 257))).tolist() for _ in which]
chat_requests = [(system_prompts[w] + own, int(chat_rng.integers(16, 129))) for w, own in zip(which, own_parts)]
prefix_runs = {}
for caching in (True, False):
    scheduler = make_scheduler(2048, max_num_seqs=256, enable_prefix_caching=caching)
    prefix_runs[caching] = run = serve(scheduler, [request(p, n) for p, n in chat_requests], model=False)
    prefill_rows = [r for r in run["rows"] if r["is_prefill"]]
    run["prefilled"] = np.cumsum([r["num_tokens"] for r in prefill_rows])
    run["prefill_time"] = [r["time"] for r in prefill_rows]
    run["batch"] = max(r["running"] for r in run["rows"])
    print(
        f"prefix caching {'on ' if caching else 'off'}: prefill computed {run['prefilled'][-1]:,} tokens, up to "
        f"{run['batch']} requests at once, {run['preemptions']} preemptions, all done at {run['seconds']:.1f} s"
    )
computed_on, computed_off = prefix_runs[True]["prefilled"][-1], prefix_runs[False]["prefilled"][-1]
print(f"prompt tokens: {sum(len(p) for p, _ in chat_requests):,}; prefill saved: {1 - computed_on / computed_off:.0%}")

# %% [markdown]
# A hit needs the blocks to still be there. To see the cache's memory alone, we allocate the same requests one at a time
# and free each right after its prefill, so every hit comes from a block whose owner has finished and that the LRU kept.
# The four system prompts need 4 × 32 = 128 blocks; we try caches from 3/8 of that to eight times that.


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
    axes[0].step(run["prefill_time"], run["prefilled"] / 1e3, where="post", label=label)
axes[0].set(xlabel="time (s, modelled)", ylabel="prefill tokens computed (thousands)")
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
axes[2].set(xlabel="cache size (blocks of 16)", ylabel="mean hit rate", title="Hits need room to keep freed blocks")
axes[2].legend()
fig.tight_layout()
fig.savefig(FIGURES / "05_prefix_cache.png", dpi=120)

# %% [markdown]
# Every request after the first with its system prompt reads the 512 shared tokens (32 blocks) from the cache,
# about 80% of its prompt. The hit outlives the request that computed the blocks: a freed block keeps its hash and
# is reused last. In a cache too small for all four system prompts, the LRU evicts the least recently used blocks
# (a prompt's tail first), and the requests that needed them lose part or all of their hit. Sharing saves memory
# too: a system prompt's blocks are stored once, so far more requests fit at once (printed above), fewer are
# preempted, and the workload is done sooner.

# %%
assert computed_on < 0.4 * computed_off and prefix_runs[True]["seconds"] < prefix_runs[False]["seconds"]
assert prefix_runs[True]["batch"] > 1.5 * prefix_runs[False]["batch"]
firsts = {int(np.argmax(which == w)) for w in range(4)}
assert all(hit_rates[i] == 0 for i in firsts)
assert all(hit_rates[i] == 512 / len(chat_requests[i][0]) for i in range(200) if i not in firsts)
assert mean_hit[48] < mean_hit[128] < mean_hit[1024]

# %% [markdown]
# ## Why does the scheduler put prefill before decode?
# Turn the rule around: **decode first**, admitting new requests only when nobody can decode, i.e. when the batch
# is empty: decode first *is* static batching. Requests arrive at random (Poisson), on average at half the rate
# the modelled engine can serve (measured first, all requests there at once). For both orders we measure each
# request's **time to first token** (TTFT: arrival to first token) and **time per output token** (TPOT).


# %%
class DecodeFirstScheduler(Scheduler):
    """Decode whenever a request can; admit new ones only when none can (this notebook's comparison only)."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        if self.running and len(self.running[-1]) - self.running[-1].num_cached_tokens == 1:
            return self.schedule_decode(), False
        return self.schedule_prefill(), True


online_requests = [
    (rng.integers(3, 2048, int(rng.integers(16, 129))).tolist(), int(rng.integers(16, 129))) for _ in range(120)
]
limits = dict(max_num_seqs=16, max_num_batched_tokens=512)
all_at_once = serve(make_scheduler(256, **limits), [request(p, n) for p, n in online_requests], model=False)
capacity = len(online_requests) / all_at_once["seconds"]
arrival_rate = 0.5 * capacity  # requests per second: half of what the engine can serve
print(f"the modelled engine serves {capacity:.1f} requests/s; they arrive at {arrival_rate:.1f}/s (load 0.5)")
online_arrivals = np.cumsum(rng.exponential(1 / arrival_rate, len(online_requests)))
orders = {}
for name, cls in (("prefill first", Scheduler), ("decode first", DecodeFirstScheduler)):
    scheduler = make_scheduler(256, cls=cls, **limits)
    run = serve(scheduler, [request(p, n) for p, n in online_requests], online_arrivals, model=False)
    run["tpot"] = (run["latency"] - run["ttft"]) / np.array([n - 1 for _, n in online_requests])
    orders[name] = run
    print(
        f"{name:>13}: TTFT median {np.median(run['ttft']) * 1e3:5.0f} ms, p90 {np.percentile(run['ttft'], 90) * 1e3:5.0f} ms; "
        f"TPOT median {np.median(run['tpot']) * 1e3:4.1f} ms; {run['tok_per_s']:4.0f} output tokens/s; "
        f"all done at {run['seconds']:.1f} s"
    )

# %%
fig, axes = plt.subplots(1, 3, figsize=(10.8, 4))
colors = {"prefill first": "tab:blue", "decode first": "tab:red"}
for name, run in orders.items():
    ttft_ms = np.sort(run["ttft"] * 1e3)
    axes[0].plot(ttft_ms, np.arange(1, len(ttft_ms) + 1) / len(ttft_ms), color=colors[name], label=name)
    axes[1].scatter(online_arrivals, run["ttft"] * 1e3, s=8, color=colors[name], label=name)
    decode_rows = [(r["time"], r["num_seqs"]) for r in run["rows"] if not r["is_prefill"]]
    axes[2].step(*zip(*decode_rows), where="pre", color=colors[name], lw=0.8, label=name)
axes[0].set(xscale="log", xlabel="time to first token (ms, log scale)", ylabel="share of requests", title="TTFT")
axes[1].set(xlabel="arrival time (s)", ylabel="TTFT (ms)", title="TTFT of each request")
axes[2].set(xlim=(0.4 * online_arrivals[-1], 0.6 * online_arrivals[-1]), xlabel="time (s)")
axes[2].set(ylabel="sequences per decode step", title="Decode batch size (a fifth of the run)")
axes[0].legend()
axes[2].legend()
fig.suptitle(f"{len(online_requests)} requests arriving at {arrival_rate:.1f}/s: prefill first vs decode first")
fig.tight_layout()
fig.savefig(FIGURES / "05_ttft.png", dpi=120)

# %%
pf, df = orders["prefill first"], orders["decode first"]
ttft_ratio = np.median(df["ttft"]) / np.median(pf["ttft"])
print(
    f"Why prefill first? A new request waits {np.median(pf['ttft']) * 1e3:.0f} ms (median) for its first token "
    f"when prefills go first, {np.median(df['ttft']) * 1e3:.0f} ms when decodes go first: {ttft_ratio:.0f}x longer. "
    f"The price: a running request's time per output token is {np.median(pf['tpot']) * 1e3:.1f} ms instead of "
    f"{np.median(df['tpot']) * 1e3:.1f} ms, because prefill steps interrupt its decodes."
)

# %% [markdown]
# **The answer, in these numbers.** Until its prefill runs, a new request has nothing to show. Prefill first runs
# it at the next step: every TTFT is about one decode step plus its own prefill, whenever it arrives (the flat blue
# band in the middle). Decode first makes it wait until every running request has finished its whole reply: from
# nothing to a hundred steps, by luck of timing; and the batch drains to a single straggler before anyone new may
# join (right panel), which also costs throughput (next section).
#
# The price is paid by the running requests: in a prefill step they produce no token, so their time per output
# token rises, the more so with long prompts. The next two sections measure what mixed batches and chunks change.

# %%
assert ttft_ratio > 5
assert np.percentile(df["ttft"], 90) > 5 * np.percentile(pf["ttft"], 90)
assert np.median(pf["tpot"]) >= np.median(df["tpot"])

# %% [markdown]
# ## One token budget per step: mixed batches (vLLM v1)
# Under prefill first, every running request waits out each prefill step, and a long prompt chunked by the
# budget is several such steps in a row. vLLM v1 has one kind of step: a budget of `max_num_batched_tokens`,
# spent first on the running requests, oldest first (a token each to decode, or a prompt's next chunk), then on
# waiting prompts with what is left, all in one forward. A decode row is a one-token chunk after its cached
# ones: notebook 04's prefill path over the paged cache computes any mix, but its runner sends a step's leading
# one-token rows through the decode kernel (far cheaper for them), so this policy lists the decode rows first. A step
# of decode rows only still takes the decode path and its CUDA graphs. The engine uses this policy unless
# `scheduling_policy="prefill-first"`.


# %% tags=["export"] module="minivllm.engine.scheduler"
class UnifiedScheduler(Scheduler):
    """vLLM v1's policy: one token budget per step, spent on the running requests first (a decode token each, or
    a prompt's next chunk), oldest first, then on waiting prompts; the rows of a step mix prefill and decode."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        """This step's sequences, decode rows first (the runner's decode kernel takes those, 04), and whether it
        needs the prefill path (False: every row decodes one token)."""
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
        decode_only = all(seq.num_scheduled_tokens == 1 and seq.num_cached_tokens + 1 == len(seq) for seq in chunks)
        return decodes + chunks, not decode_only


# %% [markdown]
# Watch the difference on a stall: eight requests are decoding when a prompt of 1,500 tokens arrives (at 0.05 s),
# with a budget of 512 tokens a step. Prefill first spends three steps on its chunks while the eight wait; the
# unified policy gives each of those steps the eight decode tokens too (and 504 prompt tokens instead of 512).
# Each bar is one step, as wide as its modelled time: the token mix over time.

# %%
policies = {"prefill first": Scheduler, "unified": UnifiedScheduler}
rng_mix = np.random.default_rng(5)
stall_prompts = [rng_mix.integers(3, 2048, 32).tolist() for _ in range(8)] + [rng_mix.integers(3, 2048, 1500).tolist()]
stalls = {}
for name, cls in policies.items():  # limits: 16 requests, 512 tokens a step, as in the previous section
    seqs = [request(p, 24 if len(p) == 32 else 8) for p in stall_prompts]
    stalls[name] = serve(make_scheduler(512, cls=cls, **limits), seqs, np.array([0.0] * 8 + [0.05]), model=False)
fig, axes = plt.subplots(1, 2, figsize=(10.8, 3.6), sharex=True, sharey=True)
for ax, (name, run) in zip(axes, stalls.items()):
    col = {k: np.array([r[k] for r in run["rows"]]) for k in ("time", "duration", "decode_tokens", "num_tokens")}
    prompt, bar = col["num_tokens"] - col["decode_tokens"], dict(width=-col["duration"], align="edge", ec="w", lw=0.5)
    ax.bar(col["time"], prompt, color="tab:orange", label="prompt tokens", **bar)
    ax.bar(col["time"], col["decode_tokens"] * 40, bottom=prompt, color="tab:blue", label="decode tokens × 40", **bar)
    ax.set(title=f"{name}: {run['seconds']:.2f} s in all", xlabel="time (s, modelled)")
axes[0].set_ylabel("tokens computed in the step")
axes[0].legend(loc="upper right")
fig.tight_layout()
fig.savefig(FIGURES / "05_unified_steps.png", dpi=120)
for name, run in stalls.items():  # the long prompt's chunk steps, and the eight's longest wait for a token
    chunks = [r["decode_tokens"] for r in run["rows"] if r["num_tokens"] - r["decode_tokens"] > 300]
    run["stall"] = max(np.diff(times).max() for times in run["token_times"][:8])
    print(f"{name:>13}: decode tokens in chunk steps {chunks}; longest wait for a token {run['stall'] * 1e3:.0f} ms")
    assert len(chunks) >= 3 and (all(chunks) if name == "unified" else not any(chunks))
assert stalls["unified"]["stall"] < stalls["prefill first"]["stall"]  # modelled times: the same on every run

# %% [markdown]
# The same requests give the same tokens under both policies (the real model here, greedy): a row's logits do
# not depend on what else is in its step.

# %%
same = [(rng_mix.integers(3, 2048, int(n)).tolist(), 12) for n in (40, 300, 7, 120, 64)]
tokens = {}
for name, cls in policies.items():
    seqs = [request(p, n) for p, n in same]
    serve(make_scheduler(64, cls=cls, max_num_seqs=4, max_num_batched_tokens=128), seqs, np.arange(5) * 0.05)
    tokens[name] = [seq.completion_token_ids for seq in seqs]
print("the same tokens under both policies:", tokens["unified"] == tokens["prefill first"])
assert tokens["unified"] == tokens["prefill first"]

# %% [markdown]
# ## What chunked prefill changes
# Two knobs, on the same requests: the policy, and the budget `max_num_batched_tokens`: 256 cuts every long
# prompt into chunks, 4,096 never does. The requests are the online workload above, one prompt in ten made long
# (1,000 to 3,000 tokens), arriving at half the rate. Per run: the distributions of TTFT and TPOT, the longest
# step, and the longest any request waits between two of its tokens.

# %%
long_rng = np.random.default_rng(3)  # its own draws, so the sections below keep theirs
grid_requests = [
    (long_rng.integers(3, 2048, int(long_rng.integers(1000, 3001))).tolist() if i % 10 == 5 else p, n)
    for i, (p, n) in enumerate(online_requests)
]
grid_runs = {}  # (policy, budget) -> run
for budget in (256, 4096):
    for name, cls in policies.items():
        scheduler = make_scheduler(512, cls=cls, max_num_seqs=16, max_num_batched_tokens=budget)
        seqs = [request(p, n) for p, n in grid_requests]
        run = grid_runs[name, budget] = serve(scheduler, seqs, 2 * online_arrivals, model=False)  # at half the rate
        run["tpot"] = (run["latency"] - run["ttft"]) / np.array([n - 1 for _, n in grid_requests])
        run["tpot_p99"], run["max_step"] = np.percentile(run["tpot"], 99), max(r["duration"] for r in run["rows"])
        run["max_wait"] = max(np.diff(times).max() for times in run["token_times"])
        (t50, t99), (p50, p99) = (np.percentile(run[key], [50, 99]) * 1e3 for key in ("ttft", "tpot"))
        print(
            f"{name:>13}, budget {budget:4d}: TTFT p50 {t50:3.0f} ms, p99 {t99:3.0f} ms; TPOT p50 {p50:3.1f} ms, p99 "
            f"{p99:4.1f} ms; longest step {run['max_step'] * 1e3:3.0f} ms, longest wait {run['max_wait'] * 1e3:3.0f} ms"
        )

# %%
fig, axes = plt.subplots(1, 3, figsize=(10.8, 4.2), width_ratios=[1, 1, 1.3])
colors = {"prefill first": "tab:blue", "unified": "tab:green"}
for (name, budget), run in grid_runs.items():
    style = dict(color=colors[name], ls="-" if budget == 256 else "--", label=f"{name}, budget {budget:,}")
    for ax, key in zip(axes, ("ttft", "tpot")):
        ax.plot(np.sort(run[key] * 1e3), np.arange(1, len(run[key]) + 1) / len(run[key]), **style)
axes[1].legend(loc="lower right", fontsize=8)  # the same lines in both panels; in TTFT's it would cover them
axes[0].set(xscale="log", xlabel="time to first token (ms, log scale)", ylabel="share of requests", title="TTFT")
axes[1].set(xlabel="time per output token (ms)", ylabel="share of requests", title="TPOT")
metrics = {"max_step": "longest step", "max_wait": "longest wait for a token", "tpot_p99": "p99 TPOT"}
for k, (key, label) in enumerate(metrics.items()):
    axes[2].bar(np.arange(4) + 0.27 * (k - 1), [run[key] * 1e3 for run in grid_runs.values()], width=0.27, label=label)
axes[2].set_xticks(range(4), [f"{name}\n{budget:,}" for name, budget in grid_runs], fontsize=8)
axes[2].set(yscale="log", ylim=(3, 3e4), ylabel="ms (log scale)", title="What the budget and the policy change")
axes[2].legend(loc="upper left", fontsize=8)  # above the bars
fig.suptitle("The same requests (one prompt in ten of 1,000 to 3,000 tokens) under two policies × two budgets")
fig.tight_layout()
fig.savefig(FIGURES / "05_chunked_prefill.png", dpi=120)

# %% [markdown]
# **What chunking changes.** With a budget of 4,096 a 3,000-token prompt is one step of over half a second that every
# running request waits out; with 256 no step computes more than 256 tokens. Under prefill first the chunks run
# back to back and the running requests sit out every one. Under the unified policy every chunk step carries their
# tokens too: nobody waits more than one short step, and TPOT is the lowest of the four, for a little TTFT. (Chunks
# also finish a long prompt sooner here, p99 TTFT: the reference attention computes the masked half of each query ×
# key matrix, smaller in a chunk; FlashAttention skips it.)

# %%
for name in policies:  # modelled times: the same on every run
    assert grid_runs[name, 256]["max_step"] < grid_runs[name, 4096]["max_step"] / 5
    assert grid_runs[name, 256]["tpot_p99"] < grid_runs[name, 4096]["tpot_p99"]
assert grid_runs["unified", 256]["tpot_p99"] < grid_runs["prefill first", 256]["tpot_p99"]
assert grid_runs["unified", 256]["max_wait"] < grid_runs["prefill first", 256]["max_wait"] / 3

# %% [markdown]
# ## Continuous vs static batching on the same requests
# Now an offline job: 128 requests all there at the start, with replies of 8 to 160 tokens. Static batching (the
# decode-first scheduler above) fills the batch, runs it until its longest reply is done, then fills it again;
# continuous batching refills every seat the step after it empties. We compare output tokens per second for
# batches of up to 4, 8, 16 and 32 requests.

# %%
offline_requests = [
    (rng.integers(3, 2048, int(rng.integers(16, 65))).tolist(), int(rng.integers(8, 161))) for _ in range(128)
]
batching = {}
for name, cls in (("continuous", Scheduler), ("static", DecodeFirstScheduler)):
    for max_num_seqs in (4, 8, 16, 32):
        scheduler = make_scheduler(512, cls=cls, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
        run = serve(scheduler, [request(p, n) for p, n in offline_requests], model=False)
        mean_batch = np.mean([r["num_seqs"] for r in run["rows"] if not r["is_prefill"]])
        batching[name, max_num_seqs] = dict(tok_per_s=run["tok_per_s"], steps=len(run["rows"]), batch=mean_batch)
        print(
            f"{name:>10}, up to {max_num_seqs:2d}: {run['tok_per_s']:5.0f} tokens/s, {len(run['rows']):4d} steps, "
            f"{mean_batch:4.1f} sequences per decode step on average"
        )

# %%
fig, axes = plt.subplots(1, 2, figsize=(10.8, 3.8))
sizes = (4, 8, 16, 32)
for name, color in (("continuous", "tab:blue"), ("static", "tab:red")):
    axes[0].plot(sizes, [batching[name, s]["tok_per_s"] for s in sizes], "o-", color=color, label=name)
    axes[1].plot(sizes, [batching[name, s]["batch"] for s in sizes], "o-", color=color, label=name)
axes[1].plot(sizes, sizes, ":", color="grey", label="max_num_seqs")
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set(xticks=sizes, xticklabels=[str(s) for s in sizes], xlabel="max_num_seqs")
    ax.legend()
axes[0].set(ylabel="output tokens / s", title="Throughput (the tiny model's step costs on a 2-core CPU)")
axes[1].set(ylabel="sequences per decode step", title="Average decode batch")
fig.suptitle("128 requests, replies of 8 to 160 tokens: continuous vs static batching")
fig.tight_layout()
fig.savefig(FIGURES / "05_batching.png", dpi=120)

# %% [markdown]
# Static batching keeps its seats filled only until the first reply ends; from then on its batch shrinks towards
# the one longest reply, so on average it runs well below `max_num_seqs` and needs more steps for the same
# tokens. Continuous batching keeps the batch at `max_num_seqs` until the queue runs out. On a CPU a decode
# step's cost grows with the batch (the reference attention loops over sequences), so the gap in tokens per
# second is smaller than the gap in batch size; on a GPU, where a decode step costs nearly the same for 1 or 64
# sequences (the H200 numbers above), throughput follows the batch size.

# %%
for size in (8, 16, 32):
    assert batching["continuous", size]["batch"] > 1.2 * batching["static", size]["batch"]
    assert batching["continuous", size]["tok_per_s"] > batching["static", size]["tok_per_s"]

# %% [markdown]
# ## Check yourself
# Set each `answer` and run its cell: the check compares it with the objects. `step` runs the scheduler alone.
#
# **1.** With `max_num_batched_tokens=64`, nothing cached and nothing else running, a 150-token prompt is prefilled
# in how many steps, computing how many tokens each? Answer the list of tokens per prefill step.


# %%
from minivllm.testing import check_answer


def step(scheduler: Scheduler) -> tuple[list[int], bool]:
    seqs, is_prefill = scheduler.schedule()
    scheduled = [seq.num_scheduled_tokens for seq in seqs]
    scheduler.postprocess(seqs, [0] * len(seqs))
    return scheduled, is_prefill


answer = None  # your answer: replace None with an expression
check = make_scheduler(64, max_num_batched_tokens=64)
check.add(long := request(list(range(1, 151)), 4))
chunks = []
while not long.completion_token_ids:  # its first token comes with its last chunk
    (tokens,), is_prefill = step(check)
    chunks.append(tokens)
check_answer(answer, chunks, "1. chunks")

# %% [markdown]
# Worked answer: the budget caps each step at 64 tokens: 64, 64, and the 150 − 128 = 22 left.

# %%
check_answer([64, 64, 150 - 2 * 64], chunks, "1. chunks")

# %% [markdown]
# **2.** A 40-token prompt whose first 32 tokens are a prefix-cache hit: how much of the token budget does it use?

# %%
answer = None  # your answer: replace None with an expression
check = make_scheduler(64, max_num_batched_tokens=64)
first, second = request(list(range(1, 41)), 4), request(list(range(1, 33)) + [9] * 8, 4)
check.add(first)
step(check)
check.add(second)
used, is_prefill = step(check)
check_answer(answer, sum(used), "2. budget after a hit")

# %% [markdown]
# Worked answer: the hit is free; only the 40 − 32 = 8 tokens after it are computed.

# %%
check_answer(40 - 32, sum(used), "2. budget after a hit")

# %% [markdown]
# **3.** `a`, `b`, `c` were admitted in that order; the cache is full and `a`'s next token starts a block. After that
# decode step: the waiting queue, and how many generated tokens does `c` hold? Answer like `([c], 0)`.

# %%
answer = None  # your answer: replace None with an expression
check = make_scheduler(3, max_num_seqs=3)
a, b, c = (request([i] * 16, 8) for i in (1, 2, 3))  # one full block each: the next token needs a new block
for seq in (a, b, c):
    check.add(seq)
step(check)  # prefill of all three; each appends its first token
decoded, is_prefill = step(check)
check_answer(answer, (list(check.waiting), c.num_completion_tokens), "3. preemption")

# %% [markdown]
# Worked answer: the newest goes first, `c`, then `b`, as `a` still has no room (the oldest always runs). Both go back
# to the front of the queue, blocks freed, tokens kept: readmitted, they prefill prompt and reply as one prompt.

# %%
check_answer(([b, c], 1), (list(check.waiting), c.num_completion_tokens), "3. preemption")
assert decoded == [1] and c.block_table == [] and check.num_preemptions == 2

# %% [markdown]
# **4.** A prompt chunk publishes (hashes into the prefix cache) only the blocks it completes. A 150-token prompt with
# a budget of 64: after its first step, how many of its blocks are published?

# %%
answer = None  # your answer: replace None with an expression
check = make_scheduler(64, max_num_batched_tokens=64)
check.add(long := request(list(range(1, 151)), 4))
step(check)
published = sum(check.block_manager.blocks[i].hash != -1 for i in long.block_table)
check_answer(answer, published, "4. published blocks")

# %% [markdown]
# Worked answer: 64 / 16 = 4, the blocks whose KV this step writes. The other 6 get theirs in later steps: published
# now, they could be hit by a request admitted in between, which would attend to keys nobody wrote: wrong logits.

# %%
check_answer(64 // 16, published, "4. published blocks")

# %% [markdown]
# **5.** With decode first, `a` (4 tokens to generate) and `b` (10) are decoding when `c` arrives. How many decode
# steps run before `c`'s prefill? (And with prefill first?)


# %%
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
check_answer(answer, decode_steps_before_c(DecodeFirstScheduler), "5. decode first")

# %% [markdown]
# Worked answer: decode first admits only when nobody can decode, and with one kind of batch per step that is when the
# batch is empty: `c` waits for the longest reply in flight, `b`'s 10 − 1 tokens left. That is static batching.
# Prefill first admits `c` at the very next step.

# %%
check_answer(10 - 1, decode_steps_before_c(DecodeFirstScheduler), "5. decode first")
assert decode_steps_before_c(Scheduler) == 0

# %% [markdown]
# **6.** Unified policy, a budget of 256: 16 requests are decoding when a 1,000-token prompt arrives. How many of its
# tokens does the next step compute? (And under prefill first?)


# %%
def first_chunk(cls: type) -> int:
    scheduler = make_scheduler(128, cls=cls, max_num_batched_tokens=256)
    for i in range(16):
        scheduler.add(request([i + 3] * 8, 8))
    step(scheduler)  # their prefills: each has its first token
    scheduler.add(request(list(range(3, 1003)), 4))
    return step(scheduler)[0][-1]  # tokens scheduled in the next step for the prompt, admitted last


answer = None  # your answer: replace None with an expression
check_answer(answer, first_chunk(UnifiedScheduler), "6. a chunk beside decodes")

# %% [markdown]
# Worked answer: the decodes take their token each first, the prompt gets what is left: 256 − 16 = 240. Prefill
# first gives it all 256, and the 16 wait out the step (and the three after it).

# %%
check_answer(256 - 16, first_chunk(UnifiedScheduler), "6. a chunk beside decodes")
assert first_chunk(Scheduler) == 256
