"""End-to-end throughput on nano-vllm's benchmark workload: minivllm (CUDA graphs and eager) vs transformers.

    python -m minivllm.benchmarks.throughput [--num-seqs 256] [--preset qwen3-0.6b] [--out figures]

The workload (nano-vllm's bench.py, `random.seed(0)`): `num_seqs` prompts of random token ids < 10,000 with
lengths uniform in [100, 1024], each generating a length uniform in [100, 1024] (temperature 0.6, ignore_eos).
The preset is written with random weights in bf16. Throughput counts output tokens. For minivllm it also
reports where the run's time goes, from the `StepStats` each engine step returns: the scheduler (host: schedule
and postprocess) and the model runner's step (step inputs, forward and sampler; it waits for the GPU). transformers runs the same requests through its continuous-batching
manager (`generate_batch`'s machinery, with per-request `max_new_tokens`). Writes throughput.json + .png.
"""

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from minivllm.benchmarks.common import OUT, result, save
from minivllm.checkpoint import write_checkpoint
from minivllm.llm import LLM
from minivllm.outputs import RequestOutput, StepStats
from minivllm.sampling_params import SamplingParams


def workload(num_seqs: int = 256, min_len: int = 100, max_len: int = 1024) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: prompts first, then output lengths, from one random.seed(0) stream."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))] for _ in range(num_seqs)]
    output_lens = [random.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, output_lens


def step_breakdown(steps: list[StepStats]) -> dict:
    """Seconds and calls per part of the engine step, summed over a run: "scheduler" (Scheduler.schedule and
    Scheduler.postprocess, two calls a step) and "runner.run" (ModelRunner.run: step inputs, forward, sampler)."""
    ran = [stats for stats in steps if stats.kind != "idle"]
    return {
        "scheduler": dict(seconds=sum(s.schedule_seconds + s.postprocess_seconds for s in ran), calls=2 * len(ran)),
        "runner.run": dict(seconds=sum(s.run_seconds for s in ran), calls=len(ran)),
    }


def run_engine(llm: LLM, prompts, params) -> tuple[list[RequestOutput], list[StepStats]]:
    """`llm.generate`'s loop, keeping each step's stats."""
    engine, outputs, steps = llm.engine, [], []
    engine.add_requests(prompts, params)
    while engine.has_unfinished_requests():
        finished, stats = engine.step()
        outputs += finished
        steps.append(stats)
    return outputs, steps


def run_minivllm(path: Path, prompts, output_lens, **config) -> tuple[dict, dict]:
    """Output tokens/s of an LLM on checkpoint `path` (Config fields in `config`), and its step breakdown; also
    how long the LLM took to start and to close, and the tokens its KV cache holds."""
    start = time.perf_counter()
    llm = LLM(str(path), max_model_len=4096, **config)
    startup_seconds = time.perf_counter() - start
    try:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
        start = time.perf_counter()
        outputs, steps = run_engine(llm, prompts, params)
        seconds = time.perf_counter() - start
        kv_cache_tokens = llm.engine.scheduler.block_manager.num_slots
    finally:
        start = time.perf_counter()
        llm.close()
        close_seconds = time.perf_counter() - start
    output_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    assert output_tokens == sum(output_lens)
    breakdown = step_breakdown(steps)
    return dict(
        output_tokens=output_tokens,
        seconds=seconds,
        tok_per_s=output_tokens / seconds,
        startup_seconds=startup_seconds,
        close_seconds=close_seconds,
        kv_cache_tokens=kv_cache_tokens,
    ), breakdown


def run_transformers(path: Path, prompts, output_lens) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    # mypy: transformers' `to` is a functools.wraps wrapper, which mypy does not bind as a method
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(
        "cuda" if torch.cuda.is_available() else "cpu"  # type: ignore[arg-type]
    )
    config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max(output_lens),
        eos_token_id=None,
        pad_token_id=0,
    )
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, output_lens)]
        done: dict[str, int] = {}  # request id -> generated tokens
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                done[out.request_id] = len(out.generated_tokens)
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous-batching manager stopped before finishing")
    seconds = time.perf_counter() - start
    output_tokens = sum(done.values())
    return dict(output_tokens=output_tokens, seconds=seconds, tok_per_s=output_tokens / seconds)


def run_throughput_benchmark(
    num_seqs: int = 256,
    preset: str = "qwen3-0.6b",
    impls=("minivllm", "minivllm-eager", "transformers-generate-batch"),
    module: str = "minivllm.benchmarks.throughput",
) -> dict:
    prompts, output_lens = workload(num_seqs)
    rows, breakdowns = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / preset, preset, seed=0)
        for impl in impls:
            if impl == "transformers-generate-batch":
                row = run_transformers(path, prompts, output_lens)
            else:
                row, breakdowns[impl] = run_minivllm(path, prompts, output_lens, enforce_eager=impl.endswith("eager"))
            rows.append(dict(impl=impl, num_seqs=num_seqs, **row))
            print(
                f"{impl:>28}: {row['output_tokens']} tokens in {row['seconds']:.1f} s = {row['tok_per_s']:,.0f} tok/s"
            )
            for key, part in breakdowns.get(impl, {}).items():
                print(f"{'':>30}{key}: {part['seconds']:.2f} s over {part['calls']} calls")
    return result(
        module,
        rows,
        preset=preset,
        dtype="bfloat16",
        workload="nano-vllm bench.py: random.seed(0), "
        "prompt and output lengths uniform in [100, 1024], token ids < 10000, temperature 0.6, ignore_eos",
        step_breakdown=breakdowns,
    )


def plot_throughput(data: dict):
    """Output tokens/s per implementation; beside it, where minivllm's run time goes."""
    import matplotlib.pyplot as plt

    fig, (ax, split) = plt.subplots(1, 2, figsize=(11, 3.5), gridspec_kw=dict(width_ratios=[3, 2]))
    rows = data["rows"]
    ax.barh([r["impl"] for r in rows], [r["tok_per_s"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    for i, r in enumerate(rows):
        ax.text(r["tok_per_s"], i, f" {r['tok_per_s']:,.0f}", va="center")
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"{rows[0]['num_seqs']} requests, {data['preset']} ({data['device']})")
    ax.invert_yaxis()
    for i, (impl, parts) in enumerate(data.get("step_breakdown", {}).items()):
        total = next(r["seconds"] for r in rows if r["impl"] == impl)
        prepare = parts.get("prepare (in runner.run)", {}).get("seconds")  # only in JSON made before StepStats
        host = parts["scheduler"]["seconds"] + (prepare or 0.0)
        gpu = parts["runner.run"]["seconds"] - (prepare or 0.0)
        labels = (
            ("scheduler + step inputs (host)", "forward + sampler")
            if prepare is not None
            else ("scheduler (host)", "runner.run (step inputs, forward, sampler)")
        )
        left = 0.0
        for j, (label, sec) in enumerate([(labels[0], host), (labels[1], gpu), ("rest (engine)", total - host - gpu)]):
            split.barh(impl, sec / total, left=left, color=f"C{j + 4}", label=label if i == 0 else None)
            left += sec / total
    split.set_xlabel("share of the run's wall time")
    split.invert_yaxis()
    split.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--impls", nargs="+", default=["minivllm", "minivllm-eager", "transformers-generate-batch"])
    parser.add_argument(
        "--out", type=Path, default=OUT, help="folder for throughput.json and .png (default: ./figures)"
    )
    args = parser.parse_args()
    data = run_throughput_benchmark(args.num_seqs, args.preset, args.impls)
    save("throughput", data, plot_throughput(data), args.out)


if __name__ == "__main__":
    main()
