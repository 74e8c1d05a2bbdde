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
# The `Scheduler` decides, at every step, which waiting requests join the batch, which request
# gives its KV blocks back when the cache is full, how a long prompt is cut into chunks, and when a
# request is done: under prefill first (nano-vllm's policy) and unified (vLLM v1's).

# %%
import dataclasses
import os
import time
import timeit
from collections import deque
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
torch.set_num_threads(1)  # the tiny model gains little from a second thread
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()
rng = np.random.default_rng(0)

# %% [markdown]
# ## A step, and continuous batching
# The engine repeats one step until every request is done:
#
# ```python
# seqs, is_prefill = scheduler.schedule()         # what to compute
# token_ids = runner.run(seqs, is_prefill)        # one forward pass, one sampled token per sequence
# finished = scheduler.postprocess(seqs, token_ids)
# ```
#
# The runner (notebook 04) computes each sequence's `num_scheduled_tokens` tokens after its
# `num_cached_tokens` cached ones. A **prefill** computes new prompts' KV and gives each its first
# token; a **decode** computes one token for each running request. Static batching runs a batch
# until its longest request ends; **continuous batching** (Orca, 2022) forms it anew at every step:
# a finished request leaves at once and a waiting one takes its seat. Two queues, `waiting` (first
# come, first served) and `running` (admission order), and four rules:
#
# 1. **Prefill first.** If a waiting request can join, the step is a prefill; else it decodes every
#    running request. Requests join in order while `max_num_seqs`, the token budget
#    `max_num_batched_tokens` (a prefix-cache hit is free) and the free KV blocks allow. The first
#    that does not fit stops admission: small requests cannot starve a big one.
# 2. **Chunked prefill.** A prompt bigger than the budget left gets what is left, the rest in the
#    next steps. A chunk's sampled token is thrown away, and it publishes only the blocks it
#    completes (`cache_blocks`): nobody may hit a block whose KV is not written yet.
# 3. **Preemption.** A decode token that starts a new block needs a free one. If none is, the newest
#    request is *preempted*: its blocks are freed and it goes back to the front of `waiting`, to be
#    recomputed (mostly as hits on its own cached blocks). The oldest request always progresses.
# 4. **Postprocess.** `advance` counts a step's computed tokens and appends a *placeholder* per
#    sampled token; `resolve` writes the sampled tokens. Notebook 06 schedules the next step between
#    the two.

# %% tags=["export"] module="minivllm.engine.scheduler"
from collections import deque

from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.step_inputs import placeholder


class Scheduler:
    """Continuous batching, prefill first; chunked prefill; preemption by recompute."""

    def __init__(self, config: Config, num_kvcache_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = BlockManager(
            num_kvcache_blocks, config.block_size, config.enable_prefix_caching
        )
        self.max_len = min(config.max_model_len, self.block_manager.num_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request. The engine has checked that it can run (notebook 06)."""
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, f"{seq} added twice"
        assert len(seq) < self.max_len, f"{len(seq)} tokens can never run (max_len {self.max_len})"
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
        """Waiting requests, in order, while a seat, the budget and the prompt's blocks allow."""
        seqs: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq) or seq.last_token < 0:
                # no overtaking: the head waits for blocks (or its placeholder token, notebook 06)
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            seqs.append(seq)
            budget -= self.schedule_chunk(seq, budget)
        return seqs

    def schedule_chunk(self, seq: Sequence, budget: int) -> int:
        """Schedule what the budget allows of seq's tokens; publish the blocks they complete."""
        seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
        self.block_manager.cache_blocks(seq, seq.num_cached_tokens + seq.num_scheduled_tokens)
        return seq.num_scheduled_tokens

    def schedule_decode(self) -> list[Sequence]:
        seqs = []
        for seq in list(self.running):  # oldest first
            if seq.status == SequenceStatus.WAITING:
                continue  # preempted below, to make room for an older one
            assert len(seq) - seq.num_cached_tokens == 1, "a decode computes the newest token"
            if self.reserve(seq):
                seqs.append(seq)
        assert seqs, "the oldest request always fits once the others are preempted"
        return seqs

    def reserve(self, seq: Sequence) -> bool:
        """Room for seq's newest token, preempting the newest requests (seq itself last) until there
        is: whether seq is still running (then it is scheduled for that one token)."""
        while not self.block_manager.can_append(seq):
            self.preempt(self.running.pop())
            if seq.status == SequenceStatus.WAITING:
                return False
        self.block_manager.may_append(seq)
        seq.num_scheduled_tokens = 1
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks, queue it first, keep its tokens (out of `running`)."""
        self.block_manager.deallocate(seq)  # also resets num_cached_tokens
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Record a step that ran; free and return the sequences that finished."""
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
        """The step's tokens replace its placeholders; free and return the finished sequences."""
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

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq, running or waiting (preempted while its step ran, notebook 06)."""
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
        """Drop every request and reset the block manager: safe after any failure."""
        for seq in (*self.waiting, *self.running):
            seq.block_table.clear()
            seq.num_cached_tokens = 0
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.waiting.clear()
        self.running.clear()
        self.block_manager.reset()


# %% [markdown]
# ## Watch it: a small cache, step by step
# Five requests on 10 blocks of 16 tokens, 48 tokens per step. Request 0's prompt has 100 tokens;
# requests 2, 3 and 4 share their first 32. `serve` is the engine loop: it adds each request when
# the clock passes its arrival, and steps until all are done; the clock counts steps (or adds up a
# step `cost`, the model skipped). `log=True` prints `request:tokens computed` and the queues.

# %%
from minivllm.checkpoint import write_checkpoint
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams

tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
base_config = Config(tiny_path, dtype=torch.float32, num_kvcache_blocks=2048, max_num_seqs=64)
runner = ModelRunner(base_config)


def make_scheduler(num_blocks: int, cls: type = Scheduler, **limits) -> Scheduler:
    """A scheduler over the first num_blocks blocks of the runner's cache."""
    return cls(dataclasses.replace(base_config, **limits), num_blocks)


def request(prompt: list[int], max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(prompt, params, base_config.block_size)


def serve(scheduler: Scheduler, seqs: list[Sequence], arrivals=None, cost=None, log=False) -> dict:
    """A row per step, and when each request got each token. With a cost every token is 0: the
    schedule of requests that ignore EOS does not depend on them."""
    arrivals = np.zeros(len(seqs)) if arrivals is None else arrivals
    arriving = deque(np.argsort(arrivals, kind="stable"))
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    token_times: list[list[float]] = [[] for _ in seqs]
    clock, rows, before = 0.0, [], None
    while arriving or not scheduler.is_finished():
        while arriving and arrivals[arriving[0]] <= clock:
            scheduler.add(seqs[arriving.popleft()])
        if scheduler.is_finished():
            clock = arrivals[arriving[0]]  # idle until the next request arrives
            continue
        batch, is_prefill = scheduler.schedule()
        new = [seq.num_scheduled_tokens for seq in batch]
        # False: a prompt chunk short of the end, whose sampled token is thrown away
        samples = [seq.num_cached_tokens + n == len(seq) for seq, n in zip(batch, new)]
        duration = cost(batch, is_prefill) if cost else 1
        token_ids = [0] * len(batch) if cost else runner.run(batch, is_prefill)
        clock += duration
        scheduler.postprocess(batch, token_ids)
        for seq in (seq for seq, sampled in zip(batch, samples) if sampled):
            token_times[index[seq.seq_id]].append(clock)
        rows.append(dict(time=clock, duration=duration, is_prefill=is_prefill, new=new))
        rows[-1] |= dict(tokens=sum(new), sampled=sum(samples))
        queues = [[index[seq.seq_id] for seq in q] for q in (scheduler.running, scheduler.waiting)]
        if log and (is_prefill or queues != before):
            ids = [index[seq.seq_id] for seq in batch]
            ran = " ".join(f"{i}:{n}" for i, n in zip(ids, new))
            head = f"step {len(rows):2d} {'prefill' if is_prefill else 'decode '} {ran:<20}"
            print(head, f"running {queues[0]}, waiting {queues[1]}")
        before = queues
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    return dict(rows=rows, token_times=token_times, arrivals=arrivals)


def random_prompt(n: int) -> list[int]:
    return rng.integers(3, 2048, n).tolist()


shared = random_prompt(32)
small_requests = [(random_prompt(100), 8), (random_prompt(20), 24)]
tails = [[5, 6, 7], [8, 9], [10]]
small_requests += [(shared + tail, n) for tail, n in zip(tails, (24, 30, 30))]
small_seqs = [request(p, n) for p, n in small_requests]
small_scheduler = make_scheduler(10, max_num_batched_tokens=48)
small = serve(small_scheduler, small_seqs, log=True)

# %% [markdown]
# * Steps 1 and 2 spend the budget on request 0's first 96 tokens; step 3 computes its last 4 and
#   admits request 1. Request 2 needs 3 blocks, one is free: it waits, and everyone behind it.
# * Request 0 finishes and frees 7 blocks: requests 2, 3 and 4 join in one step. Request 2 publishes
#   its two full blocks in that step, so 3 and 4 hit the shared 32 tokens and compute 2 and 1.
# * When a token needs a block and none is free, the newest request (4) is preempted. It rejoins
#   with its prompt *and* generated tokens, and computes one: the rest are cached.

# %%
prefills = [sum(r["new"]) for r in small["rows"] if r["is_prefill"]]
# 0 in chunks; 2, 3 and 4 after 32 hits; 4 again after 48 hits on its own blocks
assert prefills == [48, 48, 100 - 96 + 20, 35 + (34 - 32) + (33 - 32), 1]
assert small_scheduler.num_preemptions == 1

# %% [markdown]
# ## One token budget per step: mixed batches (vLLM v1)
# vLLM v1 spends each step's token budget on the running requests first (a token each, or a prompt's
# next chunk), then on waiting prompts, in one forward: a long prompt's chunks no longer stall the
# decodes. Decode rows go first, for notebook 04's decode kernel. It is the engine's default.


# %% tags=["export"] module="minivllm.engine.scheduler"
class UnifiedScheduler(Scheduler):
    """vLLM v1's policy: one token budget per step, running requests first, then waiting ones."""

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
        # a prompt with one token left is a decode row too: a step of those takes the decode path
        return decodes + chunks, any(len(seq) - seq.num_cached_tokens > 1 for seq in chunks)


# %% [markdown]
# ## The same tokens as transformers
# A policy changes which rows share a step, never what a row computes: under both, the five
# requests above give exactly the tokens of transformers' `generate` (greedy, float32).

# %%
from transformers import Qwen3ForCausalLM

from minivllm.engine.scheduler import UnifiedScheduler

hf_model = Qwen3ForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
hf_model.generation_config.eos_token_id = None  # ignore_eos: always max_new_tokens tokens
expected = []
for prompt, n in small_requests:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, pad_token_id=0)
    expected.append(out[0, len(prompt) :].tolist())
unified_seqs = [request(p, n) for p, n in small_requests]
serve(make_scheduler(10, UnifiedScheduler, max_num_batched_tokens=48), unified_seqs)
for name, seqs in (("prefill first", small_seqs), ("unified", unified_seqs)):
    same = sum(seq.completion_token_ids == e for seq, e in zip(seqs, expected))
    print(f"{name:>13}: {same} of 5 requests give exactly transformers' tokens")
    assert same == 5

# %% [markdown]
# ## Why prefill first? Turn the rule around
# **Decode first**, the opposite rule, admits new requests only when nobody can decode: into an
# empty batch. That is static batching again.


# %%
class DecodeFirstScheduler(Scheduler):
    def schedule(self) -> tuple[list[Sequence], bool]:
        if self.running and len(self.running[-1]) - self.running[-1].num_cached_tokens == 1:
            return self.schedule_decode(), False
        return self.schedule_prefill(), True


# %% [markdown]
# ## Check yourself
# Set each `answer` and run its cell.
#
# **1.** With decode first, `a` (4 tokens to generate) and `b` (10) are decoding when `c` arrives.
# How many decode steps run before `c`'s prefill? (And with prefill first?)


# %%
from minivllm.testing import check_answer


def decode_steps_before_c(cls: type) -> int:
    abc = [request([n] * 8, n) for n in (4, 10, 4)]
    # c arrives after the first step, a's and b's prefill
    run = serve(make_scheduler(64, cls), abc, np.array([0, 0, 1]))
    return [r["is_prefill"] for r in run["rows"]].index(True, 1) - 1


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
    seqs = [request([i + 3] * 8, 8) for i in range(16)]
    seqs.append(request(list(range(3, 1003)), 4))
    # the prompt arrives after the first step, the 16 prefills
    run = serve(make_scheduler(128, cls, max_num_batched_tokens=256), seqs, np.eye(17)[16])
    return run["rows"][1]["new"][-1]  # the prompt's tokens in the second step: it was admitted last


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
# We time a few real steps of each kind on your CPU (the fastest of ten runs) and fit a *cost
# model*: a fixed cost plus costs per sequence, per token and per query × key pair. The scheduler
# then runs on that clock: timing whole runs would mix in the machine's jitter.


# %%
def step_shape(seqs: list[Sequence]) -> np.ndarray:
    """A step's terms: 1, sequences, tokens past each one's first, query × key pairs."""
    new = np.array([seq.num_scheduled_tokens for seq in seqs])
    keys = new + [seq.num_cached_tokens for seq in seqs]
    return np.array([1, len(seqs), new.sum() - len(seqs), new @ keys], dtype=float)


def time_step(num_seqs: int, num_tokens: int, is_prefill: bool) -> tuple[np.ndarray, float]:
    scheduler = make_scheduler(2048)
    for _ in range(num_seqs):
        scheduler.add(request(random_prompt(num_tokens), 2))
    seqs, _ = scheduler.schedule()
    if not is_prefill:
        scheduler.postprocess(seqs, [0] * num_seqs)
        seqs, _ = scheduler.schedule()
    # this thread's CPU time: other programs on the machine do not count
    times = timeit.Timer(lambda: runner.run(seqs, is_prefill), time.thread_time).repeat(11, 1)
    return step_shape(seqs), min(times[1:])  # the first run warms up


def fit(shapes: list[np.ndarray], seconds: list[float]) -> tuple[np.ndarray, float]:
    """Seconds per unit of each term (a negative one set to 0), and R²."""
    x, t = np.array(shapes), np.array(seconds)
    relative = x / t[:, None]  # each row over its time: least squares on the relative error
    coef = np.linalg.lstsq(relative, np.ones(len(t)))[0].clip(min=0)
    return coef, 1 - np.mean((x @ coef - t) ** 2) / t.var()


shapes = [(b, n) for b in (1, 4, 16) for n in (16, 64, 256) if b * n <= 1024]
timings = {kind: [time_step(b, n, kind) for b, n in shapes] for kind in (True, False)}
fits = {kind: fit(*zip(*steps)) for kind, steps in timings.items()}
for kind, (coef, r2) in fits.items():
    ms = ", ".join(f"{c * 1e3:.2g}" for c in coef)
    print(f"{'prefill' if kind else 'decode'}: {ms} ms per step/sequence/token/pair, R² {r2:.2f}")


def step_cost(seqs: list[Sequence], is_prefill: bool) -> float:
    return float(step_shape(seqs) @ fits[is_prefill][0])


# %% [markdown]
# 48 requests, one in eight with a long prompt, arrive at random at 80% of the rate prefill first
# serves them all at once. A bar per step: as wide as it takes, as high as the tokens it computes;
# the line counts the tokens it produces. Per request: **TTFT** (arrival to first token), **TPOT**
# (first to last token, per token), and the longest wait between two of its tokens.

# %%
long_prompt = [i % 8 == 3 for i in range(48)]
prompt_lens = [rng.integers(600, 1501) if long else rng.integers(16, 201) for long in long_prompt]
workload = [(random_prompt(n), int(rng.integers(16, 97))) for n in prompt_lens]
arrival_times = np.cumsum(rng.exponential(1, len(workload)))  # one a second, on average
policies = {"prefill first": Scheduler, "unified": UnifiedScheduler}


def serve_workload(cls: type, cost) -> dict:
    limits = dict(max_num_seqs=16, max_num_batched_tokens=256)
    fresh = lambda: [request(p, n) for p, n in workload]
    all_at_once = serve(make_scheduler(512, **limits), fresh(), cost=cost)
    rate = 0.8 * len(workload) / all_at_once["rows"][-1]["time"]
    return serve(make_scheduler(512, cls, **limits), fresh(), arrival_times / rate, cost)


def latencies(run: dict) -> tuple[np.ndarray, np.ndarray, float]:
    times = run["token_times"]
    ttft = np.array([t[0] for t in times]) - run["arrivals"]
    tpot = np.array([np.diff(t).mean() for t in times])
    return ttft, tpot, max(np.diff(t).max() for t in times)


timed = {name: serve_workload(cls, step_cost) for name, cls in policies.items()}
fig, axes = plt.subplots(2, 1, figsize=(10.8, 6), sharex=True)
for ax, name in zip(axes, timed):
    rows, columns = timed[name]["rows"], ("time", "duration", "tokens", "sampled", "is_prefill")
    t, duration, computed, produced, is_prefill = (np.array([r[k] for r in rows]) for k in columns)
    for kind, color, label in ((True, "tab:blue", "prompts"), (False, "tab:orange", "decode")):
        m = is_prefill == kind
        ax.bar(t[m], computed[m], width=-duration[m], align="edge", color=color, label=label)
    ax.step(t, produced, where="pre", color="k", lw=0.6, label="tokens produced")
    ax.set(yscale="log", ylim=(0.7, 2e3), ylabel="tokens per step", title=name)
    ax.legend(loc="upper right", ncols=3)
axes[1].set(xlabel="time (s, modelled from the steps timed on this CPU)")
fig.tight_layout()
fig.savefig(FIGURES / "05_timeline.png", dpi=120)
row = "{:>13}: TTFT p50, p99 {:3.0f}, {:4.0f} ms; TPOT {:4.1f}, {:4.1f} ms; longest wait {:3.0f} ms"
for name, run in timed.items():
    ms = np.concatenate([np.percentile(x, [50, 99]) * 1e3 for x in latencies(run)])
    print(row.format(name, *ms[:5]))

# %% [markdown]
# **The answer, in these numbers.** Prefill first starts a new request at the next step, but a long
# prompt's chunks run back to back, producing almost no token (the line drops): TPOT and the longest
# wait grow. The unified policy carries the running requests' tokens in those steps: no wait is
# longer than a step. The checks count steps, the same on every machine. (Decode first over a whole
# run: deep dive `scheduler_policies`.)

# %%
steps = {name: latencies(serve_workload(cls, lambda *_: 1.0)) for name, cls in policies.items()}
(_, pf_tpot, pf_wait), (_, u_tpot, u_wait) = steps.values()
assert round(u_wait) == 1 and pf_wait >= 1500 // 256  # a long prompt's chunks, back to back
assert np.percentile(u_tpot, 99) < np.percentile(pf_tpot, 99)
