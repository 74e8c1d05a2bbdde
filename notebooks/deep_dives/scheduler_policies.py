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
# # Deep dive · Scheduling policies on a clock: a cost model, bursts, decode first, token budgets
#
# **What this adds.** Notebook 05 ran both policies on one workload, on a *cost model* of a step
# fitted to steps timed on your CPU. Here the same kind of clock runs longer experiments: how a
# decode token's cost falls with the batch (against an H200's), a bursty workload's full timeline
# with its queues, KV blocks and preemptions, prefill first against decode first over a whole run,
# and both policies under token budgets of 256 and 4,096.
#
# **Where it sits.** It follows notebook 05 and uses only notebooks 02 to 05. Nothing in the core
# path needs it. Apart from the timed steps it runs the scheduler alone (every sampled token is 0:
# the schedule of requests that ignore EOS does not depend on the tokens), so it runs in seconds.

# %%
import dataclasses
import json
import os
import time
import timeit
from collections import deque
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers.utils.logging import disable_progress_bar

from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler, UnifiedScheduler
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

disable_progress_bar()  # transformers' saving draws no progress bars in the outputs
torch.set_num_threads(1)  # the tiny model gains little from a second thread
plt.rcParams["axes.titlesize"] = "medium"  # 10-pt panel titles
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
rng = np.random.default_rng(0)

# %% [markdown]
# ## The tools: notebook 05's, with more recorded per step
# `serve` is notebook 05's engine loop; its rows also record the queues, the KV blocks in use and
# the preemptions so far. `DecodeFirstScheduler` is notebook 05's comparison policy.

# %%
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


def request(prompt: list[int], max_tokens: int) -> Sequence:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(prompt, sampling, base_config.block_size)


class DecodeFirstScheduler(Scheduler):
    """Decode whenever a request can; admit new ones only when none can."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        if self.running and len(self.running[-1]) - self.running[-1].num_cached_tokens == 1:
            return self.schedule_decode(), False
        return self.schedule_prefill(), True


policies = {"prefill first": Scheduler, "unified": UnifiedScheduler}


def serve(
    scheduler: Scheduler,
    seqs: list[Sequence],
    arrivals: np.ndarray | None = None,
    cost: StepCost = lambda seqs, is_prefill: 1.0,
) -> dict:
    """Notebook 05's engine loop over seqs, arriving at `arrivals` (default all at 0), the scheduler
    alone: the clock adds cost(step) per step (default 1), and every sampled token is 0. Returns
    per-step rows and per-request times."""
    arrivals = np.zeros(len(seqs)) if arrivals is None else arrivals
    arriving = deque(np.argsort(arrivals, kind="stable"))
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    token_times: list[list[float]] = [[] for _ in seqs]  # per request: when each of its tokens came
    finished_at = np.full(len(seqs), np.nan)
    clock, rows = 0.0, []
    while arriving or not scheduler.is_finished():
        while arriving and arrivals[arriving[0]] <= clock:
            scheduler.add(seqs[arriving.popleft()])
        if scheduler.is_finished():
            clock = arrivals[arriving[0]]  # idle until the next request arrives
            continue
        batch, is_prefill = scheduler.schedule()
        duration, lens = cost(batch, is_prefill), [len(seq) for seq in batch]
        finished = scheduler.postprocess(batch, [0] * len(batch))
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
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    return dict(
        rows=rows,
        ttft=np.array([times[0] for times in token_times]) - arrivals,
        token_times=token_times,
        latency=finished_at - arrivals,
        seconds=clock,
        preemptions=scheduler.num_preemptions,
        chunks=sum(r["chunks"] for r in rows),
    )


# %% [markdown]
# ## Steps timed on this CPU
# We time real steps of the tiny model on your CPU (`runner.run`, the PyTorch reference
# attention): a few shapes of each kind, the fastest of ten runs of each.


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
    # this thread's CPU time (other programs do not count); the first run is a warm-up
    times = timeit.Timer(lambda: runner.run(seqs, is_prefill), time.thread_time).repeat(11, 1)
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
h200_rows = json.loads(Path("../figures/decode_step.json").read_text())["rows"]
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
# **A clock for the experiments.** As in notebook 05, the experiments run the real scheduler and
# add up a *cost model* of each step fitted to the timings above: a fixed cost plus a cost per
# sequence, per new token and per query × key pair, for prefill and decode apart. Here a term that
# fits negative is dropped and the others fitted again (more work cannot cost less), and if either
# fit explains less than 90% of its timings' variance (R² < 0.9), the experiments use `SHIPPED`, a
# fit from a quiet 2-core CPU, and the cell says so. The checks always use `SHIPPED`: they hold
# whatever this CPU measured.


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
# ## A bursty workload: the timeline
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
first = serve(burst_scheduler(), [request(p, n) for p, n in burst_requests[:16]], cost=step_cost)
burst_arrivals = np.repeat(np.arange(3) * 2 / 3 * first["seconds"], 16)
burst = serve(
    burst_scheduler(),
    [request(p, n) for p, n in burst_requests],
    burst_arrivals,
    step_cost,
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
fig.savefig(FIGURES / "scheduler_policies_timeline.png", dpi=120)

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
# ## Prefill first against decode first, over a whole run
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
    rate = load * len(seqs) / serve(make_scheduler(256, **limits), seqs, cost=cost)["seconds"]
    return np.cumsum(np.random.default_rng(4).exponential(1 / rate, len(seqs)))


def serve_online(requests: list, cls: type, arrivals: np.ndarray, cost: StepCost, **limits) -> dict:
    run = serve(
        make_scheduler(512, cls=cls, **limits),
        [request(p, n) for p, n in requests],
        arrivals,
        cost,
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
fig.savefig(FIGURES / "scheduler_policies_ttft.png", dpi=120)
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
# ## What chunked prefill changes: two policies, two budgets
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
fig.savefig(FIGURES / "scheduler_policies_chunked_prefill.png", dpi=120)

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
