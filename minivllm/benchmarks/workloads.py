"""What the engine benchmarks run, and how they run it: the workloads (`throughput`, `step_kinds`,
`gpu_idle`, `tp`, `serving`), one workload on a started engine, and a decode step on a model runner
(`decode_step`, `tp`).

Workloads are token ids < 10,000 drawn from a seeded `random`, ignore_eos so every length is the one
asked for:
- `nano-vllm`: nano-vllm's bench.py (`random.seed(0)`): 256 prompts of 100-1024 tokens, outputs of
  100-1024, temperature 0.6;
- `chat`: 512 requests sharing a 1,500-token system prompt, then 50-300 user tokens; outputs of
  100-300, temperature 0.7, top-p 0.9;
- `long`: 32 prompts of 10k-12k tokens, outputs of 50-100, temperature 0.6;
- `single`: one 256-token prompt, 2,048 output tokens, temperature 0.6.

Only the standard library and the package's light modules are imported here (the serving benchmark's
client process imports this module): the engine, the runner and torch are imported where a run
starts.
"""

import contextlib
import dataclasses
import gc
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minivllm.benchmarks.common import percentiles
from minivllm.outputs import RequestOutput, StepStats
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.engine.sequence import Sequence
    from minivllm.production import ProductionLLM as LLM

WORKLOADS = ("nano-vllm", "chat", "long", "single")
POLICIES = ("unified", "prefill-first")
MAX_MODEL_LEN = 12_400  # the longest request: a 12k-token prompt and 100 outputs


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    shared_prefix: int = 0  # prompt tokens every request starts with

    @property
    def output_lens(self) -> list[int]:
        return [p.max_tokens for p in self.params]


def workload(
    num_seqs: int = 256, min_len: int = 100, max_len: int = 1024, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: prompts first, then output lengths, from one random.seed(seed) stream
    (its seed is 0)."""
    random.seed(seed)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))]
        for _ in range(num_seqs)
    ]
    output_lens = [random.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, output_lens


def make_workload(name: str, seed: int = 0) -> Workload:
    """The workload `name`; another seed gives the same shape with other prompts (the figures use
    seed 0)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randint(0, 10000) for _ in range(n)]

    def params(n: int, temperature: float = 0.6, **kw) -> SamplingParams:
        return SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n, **kw)

    if name == "nano-vllm":
        prompts, output_lens = workload(256, seed=seed)
        return Workload(name, prompts, [params(n) for n in output_lens])
    if name == "chat":
        system = ids(1500)
        prompts = [system + ids(rng.randint(50, 300)) for _ in range(512)]
        outs = [params(rng.randint(100, 300), temperature=0.7, top_p=0.9) for _ in prompts]
        return Workload(name, prompts, outs, shared_prefix=len(system))
    if name == "long":
        prompts = [ids(rng.randint(10_000, 12_000)) for _ in range(32)]
        return Workload(name, prompts, [params(rng.randint(50, 100)) for _ in prompts])
    if name == "single":
        return Workload(name, [ids(256)], [params(2048)])
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def describe_workload(work: Workload) -> str:
    lens, outs = [len(p) for p in work.prompts], work.output_lens
    p = work.params[0]
    return (
        f"{len(lens)} requests at once, prompts {min(lens)}-{max(lens)} tokens"
        + (f" ({work.shared_prefix} shared)" if work.shared_prefix else "")
        + f", outputs {min(outs)}-{max(outs)}, temperature {p.temperature}, top-p {p.top_p}, "
        f"ignore_eos"
    )


def make_requests(
    n: int, prompt_lens, output_lens, vocab: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """The serving benchmark's requests: n prompts of token ids (< 10,000 and the vocabulary) with
    lengths in prompt_lens, then n output lengths in output_lens, from `random.Random(seed)`."""
    rng = random.Random(seed)
    top = min(10_000, vocab) - 1
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)]
    return prompts, [rng.randint(*output_lens) for _ in range(n)]


# --- one workload on a started engine -------------------------------------------------------------
def step_breakdown(steps: list[StepStats]) -> dict:
    """Seconds and calls per part of the engine step, summed over a run: "scheduler"
    (Scheduler.schedule and Scheduler.postprocess, two calls a step) and "runner.run"
    (ModelRunner.run: step inputs, forward, sampler)."""
    ran = [stats for stats in steps if stats.kind != "idle"]
    return {
        "scheduler": dict(
            seconds=sum(s.schedule_seconds + s.postprocess_seconds for s in ran), calls=2 * len(ran)
        ),
        "runner.run": dict(seconds=sum(s.run_seconds for s in ran), calls=len(ran)),
    }


def run_engine(llm: "LLM", prompts, params) -> tuple[list[RequestOutput], list[StepStats]]:
    """`llm.generate`'s loop, keeping each step's stats."""
    engine, outputs, steps = llm.engine, [], []
    engine.add_requests(prompts, params)
    while engine.has_unfinished_requests():
        finished, stats = engine.step()
        outputs += finished
        steps.append(stats)
    return outputs, steps


def warm_up(llm: "LLM", work: Workload) -> None:
    """The workload's prompts, two tokens each, then an empty prefix cache: the timed run starts
    with every kernel of its steps compiled and the allocator's memory reserved, as a server's
    steady state, and finds nothing cached. (The first engine of a process still measures ~2.5%
    slower on nano-vllm's workload, whichever its policy, its prefill steps included: something
    other than compiling, not found yet.)"""
    llm.generate(
        work.prompts, [dataclasses.replace(p, max_tokens=2) for p in work.params], use_tqdm=False
    )
    llm.engine.core.scheduler.block_manager.reset()


def run_workload(llm: "LLM", work: Workload) -> dict:
    """One workload on a started engine: throughput, latency percentiles, step kinds and where the
    time goes."""
    # each run starts from the same heap: a full collection left over from setup is not timed
    gc.collect()
    with gc_pauses() as pauses:
        start = time.perf_counter()
        outputs, steps = run_engine(llm, work.prompts, work.params)
        seconds = time.perf_counter() - start
    output_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    assert output_tokens == sum(work.output_lens), (
        "every request runs to its max_tokens (ignore_eos)"
    )
    prompt_tokens = sum(map(len, work.prompts))
    tpot = [out.metrics.time_per_output_token(len(out.outputs[0].token_ids)) for out in outputs]
    kinds = [s.kind for s in steps if s.kind != "idle"]
    return dict(
        workload=work.name,
        num_seqs=len(work.prompts),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        seconds=seconds,
        tok_per_s=output_tokens / seconds,
        total_tok_per_s=(prompt_tokens + output_tokens) / seconds,
        **percentiles(
            "ttft",
            [out.metrics.time_to_first_token for out in outputs],  # type: ignore[misc]
        ),
        **percentiles("tpot", [t for t in tpot if t is not None]),
        steps={kind: kinds.count(kind) for kind in ("prefill", "decode", "mixed")},
        step_breakdown=step_breakdown(steps),
        gc_seconds=pauses[
            "seconds"
        ],  # Python's garbage collections inside the run: host time the GPU may wait on
        gc_full_collections=pauses["full"],
    )


@contextlib.contextmanager
def gc_pauses() -> Iterator[dict]:
    """Yields a dict that fills while inside: `seconds` spent in Python's garbage collections,
    `full` ones counted."""
    pauses, began = {"seconds": 0.0, "full": 0}, [0.0]

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
            return
        pauses["seconds"] += time.perf_counter() - began[0]
        pauses["full"] += info["generation"] == 2

    gc.callbacks.append(hook)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(hook)


def run_minivllm(path: Path, prompts, output_lens, **config) -> tuple[dict, dict]:
    """nano-vllm's workload on a fresh LLM (Config fields in `config`): output tokens/s and its step
    breakdown; also how long the LLM took to start and to close, and the tokens its KV cache
    holds."""
    from minivllm.production import ProductionLLM as LLM

    start = time.perf_counter()
    llm = LLM(str(path), max_model_len=4096, **config)
    startup_seconds = time.perf_counter() - start
    try:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
        params = [
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens
        ]
        row = run_workload(llm, Workload("nano-vllm", prompts, params))
        kv_cache_tokens = llm.engine.core.scheduler.block_manager.num_slots
    finally:
        start = time.perf_counter()
        llm.close()
        close_seconds = time.perf_counter() - start
    breakdown = row.pop("step_breakdown")
    return dict(
        output_tokens=row["output_tokens"],
        seconds=row["seconds"],
        tok_per_s=row["tok_per_s"],
        startup_seconds=startup_seconds,
        close_seconds=close_seconds,
        kv_cache_tokens=kv_cache_tokens,
    ), breakdown


# --- a decode step on a model runner --------------------------------------------------------------
def step_ms(runner: "ModelRunner", seqs: "list[Sequence]", steps: int = 20) -> float:
    """Median wall time of one decode step (the token is not appended: every step is the same
    step)."""
    import torch

    times = []
    for _ in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.run(seqs, is_prefill=False)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[3:])[steps // 2]


def decode_step_rows(
    path: Path, context_len: int, batch_sizes, impls=("minivllm", "minivllm-eager"), **config
) -> tuple[list[dict], dict]:
    """Median decode-step times of a runner on checkpoint `path` (Config fields in `config`) per
    batch size and impl ("minivllm-eager": a runner made with enforce_eager=True), and the size of
    the (first) runner's KV cache."""
    from minivllm.config import Config
    from minivllm.engine.production import make_runner

    rows, cache = [], None
    for impl in impls:
        eager = impl.endswith("eager")
        runner_config = Config(
            path, max_num_seqs=max(batch_sizes), max_model_len=4096, enforce_eager=eager, **config
        )
        runner = make_runner(runner_config)  # as the engine makes it
        try:
            rows += [
                dict(impl=impl, batch=batch, context_len=context_len + 1, ms=ms)
                for batch, ms in runner_rows(runner, context_len, batch_sizes, impl)
            ]
            blocks, block_size = runner.num_kvcache_blocks, runner.block_size
            cache = cache or dict(
                num_kvcache_blocks=blocks,
                block_size=block_size,
                kv_cache_tokens=blocks * block_size,
            )
        finally:
            runner.close()
    assert cache is not None, "impls must name at least one runner"
    return rows, cache


def runner_rows(
    runner: "ModelRunner", context_len: int, batch_sizes, impl: str
) -> list[tuple[int, float]]:
    """(batch, median ms of a decode step) for each batch size: `batch` sequences prefilled, then
    decoded."""
    from minivllm.engine.block_manager import BlockManager
    from minivllm.engine.sequence import Sequence

    rng = random.Random(0)
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size, enable_prefix_caching=False)
    rows = []
    for batch in batch_sizes:
        seqs = [
            Sequence(
                rng.choices(range(10000), k=context_len),
                SamplingParams(temperature=0.6),
                bm.block_size,
            )
            for _ in range(batch)
        ]
        for seq in seqs:
            bm.allocate(seq)
            seq.num_scheduled_tokens = len(seq)  # the whole prompt in one prefill step
        for i in range(0, batch, 16):  # prefill, 16 sequences a step
            chunk = seqs[i : i + 16]
            for seq, token in zip(chunk, runner.run(chunk, is_prefill=True)):
                seq.append_token(token)
                bm.may_append(seq)
        rows.append((batch, step_ms(runner, seqs)))
        ms = rows[-1][1]
        print(f"{impl:>15} batch {batch:>3}: {ms:7.2f} ms per decode step")
        for seq in seqs:
            bm.deallocate(seq)
    return rows
