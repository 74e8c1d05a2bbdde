"""A server's first users: the same workload twice in a fresh process, with fresh prompts the second
time.

    python -m minivllm.benchmarks.cold_start [--preset qwen3-0.6b]
        [--workloads chat-burst nano-vllm] [--max-requests N] [--max-tokens N] [--out figures]

Per workload, a new Python process starts an `LLM` on the preset's random-weight checkpoint (default
qwen3-0.6b on a GPU, tiny on a CPU) and runs the workload at once, then again with prompts from
another seed (nothing to find in the prefix cache): run 1 pays for whatever the engine compiles or
captures on first use, run 2 should not. Workloads: `chat-burst`, 1,024 requests behind one
1,000-token system prompt (then 50-300 user tokens; outputs of 100-300, temperature 0.7, top-k 50,
top-p 0.95), and nano-vllm's (`minivllm.benchmarks.workloads`). `--max-requests` keeps the first N
requests of each and `--max-tokens` caps their outputs (a CPU's quick run). Rows: `workload`, `run`
(1 or 2), `tok_per_s`, `ttft_p50_ms` and the rest of `run_workload`'s fields, and `startup_s` (the
`LLM()` call). Writes cold_start.json + .png.
"""

import argparse
import json
import random
import subprocess
import sys
from dataclasses import replace

from minivllm.benchmarks.common import arg_parser, preset_checkpoint, result, save
from minivllm.benchmarks.workloads import Workload, make_workload, run_workload
from minivllm.sampling_params import SamplingParams

MODULE = "minivllm.benchmarks.cold_start"
WORKLOADS = ("chat-burst", "nano-vllm")


def chat_burst(seed: int) -> Workload:
    rng = random.Random(seed)
    ids = lambda n: [rng.randint(0, 10000) for _ in range(n)]  # noqa: E731
    system = ids(1000)
    prompts = [system + ids(rng.randint(50, 300)) for _ in range(1024)]
    params = [
        SamplingParams(
            temperature=0.7, top_k=50, top_p=0.95, ignore_eos=True, max_tokens=rng.randint(100, 300)
        )
        for _ in prompts
    ]
    return Workload("chat-burst", prompts, params, shared_prefix=len(system))


def make(name: str, seed: int, max_requests: int | None, max_tokens: int | None) -> Workload:
    work = chat_burst(seed) if name == "chat-burst" else make_workload(name, seed)
    params = [
        replace(p, max_tokens=min(p.max_tokens, max_tokens or p.max_tokens)) for p in work.params
    ]
    return Workload(
        work.name, work.prompts[:max_requests], params[:max_requests], work.shared_prefix
    )


def child(preset: str, name: str, max_requests: int | None, max_tokens: int | None) -> list[dict]:
    """In the fresh process: start the engine, run the workload with seed 1, then with seed 2."""
    import time

    from minivllm.production import ProductionLLM as LLM

    runs = [make(name, seed, max_requests, max_tokens) for seed in (1, 2)]
    start = time.perf_counter()
    llm = LLM(
        str(preset_checkpoint(preset)),
        max_model_len=max(len(p) for w in runs for p in w.prompts) + 1024,
    )
    startup = time.perf_counter() - start
    # ids < 10,000: a small preset's vocabulary may be smaller
    vocab = llm.engine.config.hf_config.vocab_size
    runs = [
        Workload(w.name, [[t % vocab for t in p] for p in w.prompts], w.params, w.shared_prefix)
        for w in runs
    ]
    rows = [
        dict(run_workload(llm, work), run=run, startup_s=startup)
        for run, work in enumerate(runs, 1)
    ]
    llm.close()
    return rows


def plot_cold_start(data: dict):
    import matplotlib.pyplot as plt

    rows = data["rows"]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.8))
    for run, offset in ((1, -0.2), (2, 0.2)):
        of_run = {r["workload"]: r for r in reversed(rows) if r["run"] == run}  # the first
        mine = [of_run[n] for n in names]
        x = [i + offset for i in range(len(names))]
        left.bar(x, [r["tok_per_s"] for r in mine], 0.4, label=f"run {run}")
        right.bar(x, [r["ttft_p50_ms"] for r in mine], 0.4, label=f"run {run}")
    for ax, title in ((left, "output tokens / s"), (right, "TTFT p50 (ms)")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=9)
    fig.suptitle(f"{data['preset']} on {data['device']}: a fresh process, the same workload twice")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = arg_parser(__doc__, "cold_start")
    parser.add_argument("--preset", default="qwen3-0.6b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--max-requests", type=int, default=None, help="the first N requests of each workload"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="at most N output tokens a request"
    )
    parser.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args(argv)
    if args.child:  # the fresh process: rows as JSON on the last line of stdout
        print(json.dumps(child(args.preset, args.child, args.max_requests, args.max_tokens)))
        return
    rows = []
    for name in args.workloads:
        command = [sys.executable, "-m", MODULE, "--child", name, "--preset", args.preset]
        for flag, value in (
            ("--max-requests", args.max_requests),
            ("--max-tokens", args.max_tokens),
        ):
            command += [] if value is None else [flag, str(value)]
        # its stderr: ours
        out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])
        for row in rows[-2:]:
            print(
                f"{name} run {row['run']}: {row['tok_per_s']:,.0f} output tok/s, TTFT p50 "
                f"{row['ttft_p50_ms']:,.0f} ms"
            )
    data = result(MODULE, rows, preset=args.preset)
    save("cold_start", data, plot_cold_start(data), args.out)


if __name__ == "__main__":
    main()
