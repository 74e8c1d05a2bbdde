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
# # Deep dive · Tensor parallelism: one runner per GPU
#
# **What this adds.** `LLM(model, tensor_parallel_size=N)`: the model split over N GPUs, one process
# per GPU, which the engine drives as if it were one runner. It follows notebook 06 (the engine) and
# builds on notebook 04's `ModelRunner`, which already holds one rank's slice of each weight and
# meets the other ranks at the all-reduces. Nothing in the core path needs it: notebook 06's core
# refuses `tensor_parallel_size > 1`; a core whose `make_runner` returns this deep dive's
# `TPModelRunner` runs it (`minivllm.LLM` does, deep dive fast_engine).
#
# **What you will see.** Worker processes, their own process groups, Ctrl-C held until a step ends,
# the order in which to shut NCCL down; TP 2 giving TP 1's tokens on this CPU (over gloo); and,
# measured on two H200s, when it pays.

# %%
import json
import os
import signal
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()

# %% [markdown]
# ## One rank's slice of each layer
# Notebook 01's layers split themselves over the `TPGroup` they are built in. Two ranks' layers,
# both built in this process with the collectives stubbed out, show what each rank holds: a
# row-parallel layer's two partial sums add up to the whole layer, and the vocabulary-parallel
# embedding's two lookups (its rows, zeros for the ids it does not own) add up to the table's.

# %%
from unittest import mock

from minivllm.layers.embed_head import VocabParallelEmbedding
from minivllm.layers.linear import RowParallelLinear, TPGroup, tensor_parallel

wd, b, x = torch.randn(64, 96), torch.randn(64), torch.randn(3, 96)
table, ids = torch.randn(100, 32), torch.tensor([0, 49, 50, 99])
ranks = []
for rank in range(2):  # the layers each of two processes would build
    with tensor_parallel(TPGroup(rank=rank, size=2)):
        ranks.append((RowParallelLinear(96, 64, bias=True), VocabParallelEmbedding(100, 32)))
    row, emb = ranks[-1]
    row.weight.weight_loader(row.weight, wd)  # this rank's 48 input columns
    row.bias.weight_loader(row.bias, b)  # the whole bias
    emb.weight.weight_loader(emb.weight, table)  # this rank's 50 rows
with mock.patch.object(torch.distributed, "all_reduce", lambda y, group=None: None):
    partial = [row(x_half) for (row, _), x_half in zip(ranks, x.chunk(2, dim=-1))]
    lookups = [emb(ids) for _, emb in ranks]
torch.testing.assert_close(sum(partial), x @ wd.T + b)
torch.testing.assert_close(sum(lookups), table[ids])

# %% [markdown]
# ## The rules: processes that never hang
# Notebook 04's `ModelRunner` is one rank: it holds its slice of every weight and of the KV cache
# (its KV heads), and meets the other ranks at the all-reduces. With `tensor_parallel_size=N` the
# engine makes a `TPModelRunner` (vLLM's multiprocess executor): rank 0's runner, which starts N−1
# workers, each a plain `ModelRunner`. Each step, rank 0 broadcasts the `StepInputs`, all ranks run
# the same forward, and rank 0 samples (so no async scheduling: the workers never see the sampled
# tokens).
#
# Processes are where engines hang, and a hang is worse than a crash: nobody learns why. The rules
# we follow:
# * **Each engine owns its groups**, over its own `TCPStore`: `control` (gloo) for rank 0's messages
#   and `tp` for the all-reduces (NCCL on GPUs); no `torch.distributed` default group, so two
#   engines in one process never share one.
# * **Workers are `spawn`ed** (a forked CUDA context is unusable) from a module-level target, as
#   daemons ignoring Ctrl-C, each exiting if its parent is gone, even after a `kill -9` of rank 0.
# * **Rank 0 never waits blindly**: a thread watches the workers, and one that dies becomes an error
#   naming it within seconds (one dead before it started most likely ran a script without a main
#   guard: the error says so).
# * **A step is never cut in half.** Ctrl-C during a step is held until the step ends (then it
#   raises `KeyboardInterrupt` as usual), so the ranks stay in step; at an idle engine it raises at
#   once, and where the process ignores Ctrl-C (a background job, `nohup`) it stays ignored. Any
#   other failure makes the engine refuse further steps, with the reason, rather than hang in the
#   next collective.
# * **`close()` frees the CUDA graphs before the groups** (an NCCL group waits for the graphs that
#   captured its all-reduces: the other order hangs), joins the workers and hands the KV cache back
#   to the GPU.

# %% tags=["export"] module="minivllm.engine.workers"
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.config import Config
from minivllm.engine.model_runner import ModelRunner, rank_device
from minivllm.engine.sampling_options import OptionsRunner
from minivllm.engine.sequence import Sequence
from minivllm.layers.linear import TPGroup

# a worker imports torch and loads its slice: minutes on a slow disk
START_TIMEOUT = timedelta(seconds=300)
# one rank may compile kernels in a first step while the others wait
STEP_TIMEOUT = timedelta(seconds=600)
SHUTDOWN_TIMEOUT = timedelta(seconds=10)  # close() ends in seconds, whatever a group waits for
MAIN_GUARD = (
    "Workers are spawned: each re-imports your main script, so a script that creates an LLM with "
    'tensor_parallel_size > 1 must do it under `if __name__ == "__main__":`.'
)


def make_groups(
    store: Any, rank: int, world_size: int, device: torch.device
) -> tuple[TPGroup, Any]:
    """This rank's groups over the engine's own store: `control` (gloo) carries rank 0's messages,
    the TPGroup's group the model's all-reduces (NCCL on GPUs; on CPUs the gloo group again)."""
    control = dist.ProcessGroupGloo(
        dist.PrefixStore("control", store), rank, world_size, STEP_TIMEOUT
    )
    if device.type != "cuda":
        return TPGroup(rank, world_size, control), control
    # torch's stub lists only the (store, rank, size, options) form; the binding also has (store,
    # rank, size[, timeout])
    nccl = dist.ProcessGroupNCCL(  # type: ignore[call-arg]
        dist.PrefixStore("nccl", store), rank, world_size
    )
    nccl.eager_connect_single_device(device)  # connect now, while rank 0 watches its workers
    return TPGroup(rank, world_size, nccl), control


def close_groups(groups: list[Any], abort: bool) -> None:
    """Shut each group down with the other ranks; abort it when one of them is gone (shutdown would
    wait), or when its shutdown has not returned in SHUTDOWN_TIMEOUT (an NCCL group waits for any
    CUDA graph that captured it)."""
    for group in dict.fromkeys(groups):
        if not abort:
            shutdown = threading.Thread(target=group.shutdown, daemon=True)
            shutdown.start()
            shutdown.join(SHUTDOWN_TIMEOUT.total_seconds())
            if not shutdown.is_alive():
                continue
        group.abort()


def broadcast_object(obj: Any, group: Any, rank: int) -> Any:
    """Rank 0's `obj` on every rank (the others pass None), pickled over a gloo group."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if rank == 0 else None
    size = torch.tensor([0 if data is None else data.numel()])
    group.broadcast(size, 0).wait()
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(data, 0).wait()
    return obj if rank == 0 else pickle.loads(data.numpy().tobytes())


class HeldSigint:
    """A SIGINT handler that holds the first Ctrl-C for `handler` (the one it stands in for) and
    passes a second one on at once."""

    def __init__(self, handler: Callable):
        self.handler = handler
        self.pending = False  # a Ctrl-C came and waits for release()

    def __call__(self, signum: int, frame: Any) -> None:
        if self.pending:
            self.handler(signum, frame)
        self.pending = True

    def release(self) -> None:
        if self.pending:
            self.handler(signal.SIGINT, None)


@contextmanager
def sigint_held() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then let the handler that was there take it (Python's
    raises KeyboardInterrupt): rank 0 never leaves the other ranks halfway through a step. A second
    Ctrl-C is handled at once (the engine is then out of step and refuses further steps). Where
    Ctrl-C is ignored (a background job, `nohup`) or no Python handler takes it, it stays so."""
    handler = (
        signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    if not callable(handler):
        yield
        return
    held = HeldSigint(handler)
    signal.signal(signal.SIGINT, held)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    held.release()


class Workers:
    """Rank 0's side of the other ranks: spawns them, waits for them while watching them, says why
    one is gone."""

    def __init__(self, target: Callable, args: tuple, world_size: int, device: torch.device):
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=START_TIMEOUT,
        )
        spawn = mp.get_context("spawn")
        # set by each worker as its first act
        self.started = [spawn.Event() for _ in range(1, world_size)]
        self.processes = [
            spawn.Process(target=target, args=(*args, rank, self.store.port, started), daemon=True)
            for rank, started in enumerate(self.started, start=1)
        ]
        self.failure: str | None = None  # why the ranks can no longer work together
        self.stopping = False
        for process in self.processes:
            process.start()
        try:
            self.tp, self.control = self.wait(
                lambda: make_groups(self.store, 0, world_size, device)
            )
        except BaseException:
            self.join(timeout=0)
            raise
        threading.Thread(target=self.watch, daemon=True).start()

    def dead(self) -> str | None:
        """Why a worker is gone, if one is."""
        for rank, (process, started) in enumerate(zip(self.processes, self.started), start=1):
            if process.exitcode is None:
                continue
            if not started.is_set():
                return (
                    f"tensor-parallel worker rank {rank} exited (code {process.exitcode}) before "
                    f"it started. " + MAIN_GUARD
                )
            return (
                f"tensor-parallel worker rank {rank} (pid {process.pid}) died (exit code "
                f"{process.exitcode})"
            )
        return None

    def wait(self, fn: Callable[[], Any]) -> Any:
        """fn() (which waits for the workers) on a daemon thread; RuntimeError as soon as a worker
        is gone (the thread, blocked for good, is left behind: a daemon does not keep the process
        alive)."""
        done: list[tuple[Any, BaseException | None]] = []

        def target() -> None:
            try:
                done.append((fn(), None))
            except BaseException as e:
                done.append((None, e))

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(timeout=0.1)
            if thread.is_alive() and (reason := self.dead()):
                raise RuntimeError(reason)
        if not done:
            raise RuntimeError(f"tensor-parallel workers did not start within {START_TIMEOUT}")
        result, error = done[0]
        if error is not None:
            raise error
        return result

    def watch(self) -> None:
        """A worker that dies mid-step would leave rank 0 in a collective for ever: abort the groups
        instead."""
        while not self.stopping:
            if reason := self.dead():
                self.failure = self.failure or reason
                close_groups([self.tp.group, self.control], abort=True)
                return
            time.sleep(0.2)

    def fail(self, error: BaseException) -> bool:
        """A step broke: the ranks are out of step for good. Whether a worker died (it may take a
        moment to see)."""
        deadline = time.monotonic() + 2
        while (reason := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.failure = (
            self.failure or reason or f"a step failed on rank 0 ({type(error).__name__}: {error})"
        )
        return reason is not None

    def check(self) -> None:
        if self.failure is None:
            self.failure = self.dead()
        if self.failure is not None:
            raise RuntimeError(
                f"the tensor-parallel engine cannot run: {self.failure}. Create a new LLM."
            )

    def join(self, timeout: float = 10) -> None:
        """Wait for the workers to exit (after "exit"), killing those still there after `timeout`
        seconds."""
        self.stopping = True
        for process in self.processes:
            process.join(timeout=timeout)
            if process.is_alive():
                process.kill()
                process.join()


# %% [markdown]
# `sigint_held` in action, with a stand-in handler (a real Ctrl-C would stop this notebook): the
# first signal waits for the block's end, a second one is passed on at once.

# %%
from minivllm.engine.workers import HeldSigint

taken = []
held = HeldSigint(lambda signum, frame: taken.append(signum))
held(signal.SIGINT, None)  # Ctrl-C during a step: held
assert taken == []
held.release()  # the step ended: the handler that was there takes it
assert taken == [signal.SIGINT]
held = HeldSigint(lambda signum, frame: taken.append("twice"))
held(signal.SIGINT, None)
held(signal.SIGINT, None)  # pressed again: the user means it
print("a held Ctrl-C reaches its handler when the step ends; a second one at once:", taken)


# %% [markdown]
# A worker's life: check in (so rank 0 can tell "never started" from "died"), connect to rank 0's
# store, build its groups, load its slice into a runner (`RankRunner`: notebook 04's, whose KV cache
# is the size every rank can hold, the MIN over ranks), then run what rank 0 sends until `exit`.
# Rank 0's runner changes three more methods: `step_logits` tells the workers each step it runs
# (`call`, holding Ctrl-C until every rank is through) and checks that no worker died in it, and
# `close` sends `exit`, frees the graphs, closes the groups, joins the workers. The runner class the
# workers build is `worker_class`: a GPU runner's subclass names its own (deep dive fast_engine).


# %% tags=["export"] module="minivllm.engine.workers"
def exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)  # rank 0 is gone: nobody will send "exit"


class RankRunner(OptionsRunner):
    """One rank's runner (sampling options included): every rank sizes its KV cache, and all take
    the smallest (one block manager serves them all)."""

    def num_kv_blocks(self, block_bytes: int) -> int:
        agreed = torch.tensor([super().num_kv_blocks(block_bytes)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.control)
        return int(agreed.item())


def worker_main(
    config: Config, runner_class: type[ModelRunner], rank: int, port: int, started: Any
) -> None:
    started.set()  # this module imported: rank 0 can tell "died" from "never started"
    # Ctrl-C is rank 0's to handle: it tells the workers to exit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=START_TIMEOUT
    )
    tp, control = make_groups(store, rank, config.tensor_parallel_size, device)
    aborted = True
    try:
        runner = runner_class(config, rank, (tp, control))
        try:
            while (message := broadcast_object(None, control, rank))[0] != "exit":
                method, args = message
                getattr(runner, method)(*args)
            aborted = False
        finally:
            runner.close()  # the CUDA graphs before the groups
    finally:
        close_groups([tp.group, control], aborted)


class TPModelRunner(RankRunner):
    """Rank 0 of `tensor_parallel_size` ranks: starts the others, tells them every step, never
    hangs on them."""

    worker_class: type[ModelRunner] = RankRunner  # what the other ranks run

    def __init__(self, config: Config):
        device = rank_device(config, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        args = (config, self.worker_class)
        self.workers = Workers(worker_main, args, config.tensor_parallel_size, device)
        try:
            super().__init__(config, 0, (self.workers.tp, self.workers.control))
        except BaseException as e:
            self.close(abort=True)
            if self.workers.failure:
                raise RuntimeError(self.workers.failure) from e
            raise

    def call(self, method: str, *args):
        self.workers.check()
        with sigint_held():  # Ctrl-C lands between steps, with every rank in step
            try:
                broadcast_object((method, args), self.control, 0)
                return getattr(self, method)(*args)
            except BaseException as e:
                # the step broke because a worker died: say that, not "connection reset"
                if self.workers.fail(e):
                    raise RuntimeError(self.workers.failure) from e
                raise

    def step_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        logits = self.call("execute", self.prepare(seqs, is_prefill))
        if logits.is_cuda:  # wait for the step: a worker that died in it leaves junk logits
            torch.cuda.synchronize(logits.device)
        self.workers.check()
        return logits

    def close(self, abort: bool = False) -> None:
        if self.closed:
            return
        self.workers.stopping = True
        abort = abort or self.workers.failure is not None or self.workers.dead() is not None
        if not abort:
            broadcast_object(("exit", ()), self.control, 0)
        # the CUDA graphs before the groups: an NCCL group waits for the graphs that captured it
        super().close()
        close_groups([self.tp.group, self.control], abort)
        self.workers.join()


# %% [markdown]
# ## TP 2 gives TP 1's tokens
# On a CPU the same code runs over gloo. Notebook 06's classes take the runner from outside: a core
# whose `make_runner` returns a `TPModelRunner`, an engine whose `make_core` makes that core, an
# `LLM` whose `make_engine` makes that engine (`minivllm.LLM` is built the same way, with every
# production layer). Greedy decoding must give the tokens of one rank (float32: the all-reduces add
# the partial sums in another order, far below what changes a greedy pick on these prompts).

# %%
import multiprocessing

from minivllm.checkpoint import write_checkpoint
from minivllm.engine.core import EngineCore
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.workers import TPModelRunner
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams


class TPCore(EngineCore):  # notebook 06's core, this deep dive's runner
    def make_runner(self) -> ModelRunner:
        if self.config.tensor_parallel_size > 1:
            return TPModelRunner(self.config)
        return super().make_runner()


class TPEngine(LLMEngine):
    def make_core(self) -> EngineCore:
        return TPCore(self.config)


class TPLLM(LLM):
    def make_engine(self, model: str, **kwargs) -> LLMEngine:
        return TPEngine(model, **kwargs)


path = CHECKPOINTS / "tiny"
if not (path / "model.safetensors").is_file():
    write_checkpoint(path, "tiny", seed=0)
config = dict(
    device="cpu", dtype=torch.float32, num_kvcache_blocks=128, max_num_seqs=8, max_model_len=1024
)
prompts, greedy = (
    [list(range(1, 40)), [3] * 17, [5, 6, 7]],
    SamplingParams(temperature=0, max_tokens=12),
)
with TPLLM(str(path), **config) as one:
    expected = [out.outputs[0].token_ids for out in one.generate(prompts, greedy, use_tqdm=False)]
with TPLLM(str(path), tensor_parallel_size=2, **config) as two:
    assert (
        isinstance(two.engine.core.runner, TPModelRunner)
        and len(two.engine.core.runner.workers.processes) == 1
    )
    assert [
        out.outputs[0].token_ids for out in two.generate(prompts, greedy, use_tqdm=False)
    ] == expected
    worker = two.engine.core.runner.workers.processes[0]
    print(
        f"TP 2 on the CPU: rank 0 here (pid {os.getpid()}), rank 1 in pid {worker.pid}; same "
        f"tokens as TP 1"
    )
assert not multiprocessing.active_children()  # close() sent "exit" and joined the worker


# %% [markdown]
# ## On two H200s: when does it pay?
# `python -m minivllm.benchmarks.tp` runs the same decode step and throughput workload on one GPU
# and split over two: each GPU reads half the weights and KV, but every layer adds two all-reduces.
# Which wins for a 0.6B model?

# %%
from minivllm.benchmarks.tp import plot_tp

# needs two GPUs to re-measure: the committed run
tp_data = json.loads(Path("../figures/tp.json").read_text())
plot_tp(tp_data).savefig(FIGURES / "tensor_parallel_tp.png", dpi=120)
decode_rows = [r for r in tp_data["rows"] if r["kind"] == "decode_step"]
step = {(r["tp"], r["batch"]): r["ms"] for r in decode_rows}
run = {r["tp"]: r for r in tp_data["rows"] if r["kind"] == "throughput"}
for batch in sorted({b for _, b in step}):
    tp1_ms, tp2_ms = step[1, batch], step[2, batch]
    print(f"decode step, batch {batch:>3}: TP 1 {tp1_ms:.2f} ms, TP 2 {tp2_ms:.2f} ms")
for tp, r in run.items():
    kv_mtokens = r["kv_cache_tokens"] / 1e6
    print(f"TP {tp}: {r['tok_per_s']:,.0f} output tok/s, KV cache {kv_mtokens:.2f} M tokens")
# python -c "LLM(...)": import to ready
for r in (r for r in tp_data["rows"] if r["kind"] == "startup"):
    ready = f"ready in {r['ready_seconds']:.0f} s"
    print(f"TP {r['tp']}, fresh process, start {r['attempt']}: {ready}")

# %% [markdown]
# Work it out: a TP-2 forward makes 2 × 28 all-reduces (plus the embedding's and LM head's gathers,
# and rank 0's message). At batch 1, when the step is all latency, what is the most one all-reduce
# can cost?

# %%
added_ms = step[2, 1] - step[1, 1]
per_allreduce_us = added_ms / (2 * 28) * 1e3  # 2 all-reduces per layer, 28 layers
# the H200's copy bandwidth
copy_tbps = json.loads(Path("../figures/decode.json").read_text())["copy_tbps"]
weight_read_ms = 596e6 * 2 / (copy_tbps * 1e12) * 1e3  # 596 M bf16 parameters, read once
print(f"TP 2 adds {added_ms:.2f} ms at batch 1: at most {per_allreduce_us:.0f} µs per all-reduce")
print(
    f"one GPU reads all the weights in {weight_read_ms:.2f} ms, {weight_read_ms / added_ms:.0%} "
    f"of what TP 2 adds"
)

# %% [markdown]
# For a 0.6B model TP 2 does not pay in speed: one GPU reads all 1.2 GB of weights in under 0.3 ms,
# a fifth of what the communication adds; every step gets slower, most at small batches. What it
# buys is memory (each GPU holds half of the KV heads: twice the tokens), at a slower start. TP pays
# when weights or KV cache do not fit one GPU.
