"""Where a workload's time goes, per kind of engine step, under each scheduling policy, with and
without the CUDA graphs of prefill and mixed steps (notebook 04's `MixedGraphs`).

    python -m minivllm.benchmarks.step_kinds [--workloads chat nano-vllm] [--out DIR]

The workloads are the throughput benchmark's; scheduling is synchronous (`async_scheduling=False`),
so that each engine step's wall time is that step's own: scheduling, inputs, forward, sampling, and
waiting for its tokens. Each workload runs `--repeats` times per engine and the fastest run is kept
(a synchronous step also waits for the host, whose jitter moves a run by a few %). Per run and kind
of step (prefill, decode, mixed): steps, seconds, tokens computed, sequences. On a CPU there are no
graphs, and the runs without them are the only ones. Writes step_kinds.json + .png.
"""

import time
from collections import defaultdict

import torch

from minivllm.benchmarks.common import arg_parser, preset_checkpoint, result, save
from minivllm.benchmarks.workloads import (
    MAX_MODEL_LEN,
    POLICIES,
    WORKLOADS,
    Workload,
    make_workload,
)
from minivllm.engine.gpu_runner import GPUModelRunner
from minivllm.engine.input_processor import Prompt
from minivllm.production import ProductionLLM as LLM
from minivllm.sampling_params import SamplingParams

KINDS = ("prefill", "mixed", "decode")


def run_kinds(llm: LLM, work: Workload) -> dict:
    """One workload, step by step: seconds, tokens and sequences per kind of step."""
    engine = llm.engine
    # forget cached prefixes: a repeat computes its prompts again
    engine.core.scheduler.block_manager.reset()
    engine.add_requests(list[Prompt](work.prompts), list[SamplingParams | None](work.params))
    kinds: dict[str, dict] = defaultdict(lambda: dict(steps=0, seconds=0.0, tokens=0, seqs=0))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        _, stats = engine.step()
        if stats.kind == "idle":
            continue
        kind = kinds[stats.kind]
        kind["steps"] += 1
        kind["seconds"] += time.perf_counter() - begin
        kind["tokens"] += stats.num_tokens
        kind["seqs"] += stats.num_seqs
    seconds = time.perf_counter() - start
    return dict(
        workload=work.name,
        seconds=seconds,
        tok_per_s=sum(work.output_lens) / seconds,
        kinds=dict(kinds),
    )


def run_step_kinds_benchmark(
    workloads=("chat", "nano-vllm"), preset: str = "qwen3-0.6b", repeats: int = 1, **config
) -> dict:
    works = [w if isinstance(w, Workload) else make_workload(w) for w in workloads]
    config.setdefault("max_model_len", MAX_MODEL_LEN)
    rows = []
    path = preset_checkpoint(preset)
    for policy in POLICIES:
        for graphs in (True, False) if torch.cuda.is_available() else (False,):
            with LLM(str(path), scheduling_policy=policy, async_scheduling=False, **config) as llm:
                runner = llm.engine.core.runner
                if not graphs and isinstance(runner, GPUModelRunner):  # a GPU's
                    runner.mixed_graphs = None  # prefill and mixed steps run eagerly
                # warm-up
                llm.generate(["Benchmark: "], SamplingParams(max_tokens=4), use_tqdm=False)
                for work in works:
                    fastest = min(
                        (run_kinds(llm, work) for _ in range(repeats)),
                        key=lambda run: run["seconds"],
                    )
                    rows.append(dict(policy=policy, mixed_graphs=graphs, **fastest))
                    print(describe_kinds(rows[-1]))
    return result("minivllm.benchmarks.step_kinds", rows, preset=preset, repeats=repeats)


def describe_kinds(row: dict) -> str:
    parts = []
    for name, k in sorted(row["kinds"].items(), key=lambda item: KINDS.index(item[0])):
        steps, seconds = k["steps"], k["seconds"]
        ms_per_step = seconds / steps * 1e3
        parts.append(f"{steps} {name} {seconds:.2f} s ({ms_per_step:.1f} ms)")
    kinds = ", ".join(parts)
    graphs = "graphs" if row["mixed_graphs"] else "eager"
    rate = f"{row['tok_per_s']:,.0f} output tok/s"
    config = f"{row['workload']:>9} · {row['policy']}, {graphs}"
    return f"{config}: {rate}; {kinds}"


def plot_step_kinds(data: dict):
    """Per workload, one stacked bar per (policy, graphs): seconds in each kind of step."""
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(names), figsize=(5.4 * len(names), 4.2), squeeze=False)
    colors = {"prefill": "tab:orange", "mixed": "tab:purple", "decode": "tab:blue"}
    for ax, name in zip(axes[0], names):
        rows = [r for r in data["rows"] if r["workload"] == name]
        labels = [f"{r['policy']}\n{'graphs' if r['mixed_graphs'] else 'eager'}" for r in rows]
        bottom = [0.0] * len(rows)
        for kind in KINDS:
            seconds = [r["kinds"].get(kind, {}).get("seconds", 0.0) for r in rows]
            ax.bar(labels, seconds, bottom=bottom, color=colors[kind], label=kind)
            bottom = [b + s for b, s in zip(bottom, seconds)]
        ax.set(title=name, ylabel="seconds (synchronous scheduling)")
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].legend()
    fig.suptitle(
        f"{data['preset']} on {data['device']}: seconds per kind of step, prefill and mixed steps "
        f"eager or graphed"
    )
    fig.tight_layout()
    return fig


def main() -> None:
    parser = arg_parser(__doc__, "step_kinds")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["chat", "nano-vllm"])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each workload per engine; the fastest is kept",
    )
    args = parser.parse_args()
    data = run_step_kinds_benchmark(args.workloads, args.preset, args.repeats)
    save("step_kinds", data, plot_step_kinds(data), args.out)


if __name__ == "__main__":
    main()
