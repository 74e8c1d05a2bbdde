"""Tensor parallelism 1 vs 2 (or more) on one machine: decode step time and end-to-end throughput,
in one run.

    python -m minivllm.benchmarks.tp [--tp 1 2] [--context-len 512] [--out figures]

Writes the qwen3-0.6b preset (random weights, bf16) once, then for each tensor-parallel size: the
decode step of `decode_step` (CUDA graphs; batch sizes 1..256 at one context length) and the
throughput run of `throughput` (nano-vllm's workload). Then start-up as a user meets it: a fresh
Python process that imports minivllm, makes the LLM and closes it, twice per size in turn (1, 2, 1,
2: the first start of a size may fill disk caches). NVLink multicast stays off (NCCL_NVLS_ENABLE=0
unless already set): on a shared host it can take GPUs out of service, and all-reduces of a 0.6B
model's activations gain nothing from it. Writes tp.json + .png.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from minivllm.benchmarks.common import arg_parser, preset_checkpoint, result, save
from minivllm.benchmarks.workloads import decode_step_rows, run_minivllm, workload

BATCH_SIZES = (1, 16, 64, 256)
STARTUP = """
import json, sys, time
start = time.perf_counter()
from minivllm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), max_model_len=4096)
    ready = time.perf_counter()
    llm.close()
    print(json.dumps(dict(ready_seconds=ready - start, close_seconds=time.perf_counter() - ready)))
"""


def fresh_startup(path: Path, tp: int) -> dict:
    """Seconds from a fresh process's first import to a ready LLM (and its close()), with
    tensor_parallel_size=tp."""
    out = subprocess.run(
        [sys.executable, "-c", STARTUP, str(path), str(tp)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_tp_benchmark(
    tp_sizes=(1, 2),
    context_len: int = 512,
    batch_sizes=BATCH_SIZES,
    module: str = "minivllm.benchmarks.tp",
) -> dict:
    # read by NCCL in every process the runner spawns
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    prompts, output_lens = workload(256)
    rows = []
    path = preset_checkpoint("qwen3-0.6b")
    for tp in tp_sizes:
        steps, cache = decode_step_rows(
            path, context_len, batch_sizes, impls=("minivllm",), tensor_parallel_size=tp
        )
        rows += [
            dict(
                kind="decode_step",
                tp=tp,
                batch=r["batch"],
                context_len=r["context_len"],
                ms=r["ms"],
                kv_cache_tokens=cache["kv_cache_tokens"],
            )
            for r in steps
        ]
        row, breakdown = run_minivllm(path, prompts, output_lens, tensor_parallel_size=tp)
        rows.append(dict(kind="throughput", tp=tp, **row, step_breakdown=breakdown))
        rate = f"{row['output_tokens']} tokens in {row['seconds']:.1f} s = "
        rate += f"{row['tok_per_s']:,.0f} tok/s"
        lifetime = f"start-up {row['startup_seconds']:.1f} s, close {row['close_seconds']:.2f} s"
        print(f"tp={tp}: {rate}; {lifetime}, KV cache {row['kv_cache_tokens']:,} tokens")
    for attempt in (1, 2):
        for tp in tp_sizes:
            times = fresh_startup(path, tp)
            rows.append(dict(kind="startup", tp=tp, attempt=attempt, **times))
            print(f"tp={tp}, fresh process #{attempt}: ready in {times['ready_seconds']:.1f} s")
    return result(
        module,
        rows,
        preset="qwen3-0.6b",
        dtype="bfloat16",
        num_gpus=torch.cuda.device_count(),
        nccl_nvls_enable=os.environ["NCCL_NVLS_ENABLE"],
    )


def plot_tp(data: dict):
    import matplotlib.pyplot as plt

    fig, (left, right, times) = plt.subplots(
        1, 3, figsize=(10.8, 3.6), gridspec_kw=dict(width_ratios=[3, 2, 2])
    )
    steps = [r for r in data["rows"] if r["kind"] == "decode_step"]
    for tp in sorted({r["tp"] for r in steps}):
        rows = [r for r in steps if r["tp"] == tp]
        left.plot(
            [r["batch"] for r in rows], [r["ms"] for r in rows], "o-", label=f"tensor parallel {tp}"
        )
    left.set_xscale("log", base=2)
    left.set_xlabel("batch size (sequences decoding)")
    left.set_ylabel("ms per decode step (CUDA graph)")
    left.set_title(f"decode step, context {steps[0]['context_len']}")
    left.set_ylim(bottom=0)
    left.legend()
    runs = [r for r in data["rows"] if r["kind"] == "throughput"]
    right.bar(
        [f"TP {r['tp']}" for r in runs],
        [r["tok_per_s"] for r in runs],
        color=[f"C{i}" for i in range(len(runs))],
    )
    for i, r in enumerate(runs):
        right.text(i, r["tok_per_s"], f"{r['tok_per_s']:,.0f}", ha="center", va="bottom")
    right.set_ylim(0, 1.15 * max(r["tok_per_s"] for r in runs))
    right.set_ylabel("output tokens / s")
    right.set_title("nano-vllm's workload, 256 requests")
    starts = [r for r in data["rows"] if r["kind"] == "startup"]
    sizes = sorted({r["tp"] for r in starts})
    for j, attempt in enumerate(sorted({r["attempt"] for r in starts})):
        mine = {r["tp"]: r for r in starts if r["attempt"] == attempt}
        x = [i + (j - 0.5) * 0.4 for i in range(len(sizes))]
        seconds = [mine[tp]["ready_seconds"] for tp in sizes]
        times.bar(
            x, seconds, 0.4, color=("0.65", "0.35")[j % 2], label=f"fresh process, start {attempt}"
        )
        for xi, tp in zip(x, sizes):
            times.text(
                xi,
                mine[tp]["ready_seconds"],
                f"{mine[tp]['ready_seconds']:.0f}",
                ha="center",
                va="bottom",
            )
    times.set_xticks(range(len(sizes)), [f"TP {tp}" for tp in sizes])
    times.set_ylabel("seconds from import to a ready LLM")
    times.set_title("start-up, each in a fresh process", fontsize=10)
    # room for the legend above the bars
    times.set_ylim(0, 1.4 * max(r["ready_seconds"] for r in starts))
    times.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Qwen3-0.6B, bf16, on {data['num_gpus']} × {data['device']}")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = arg_parser(__doc__, "tp")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--context-len", type=int, default=512)
    args = parser.parse_args()
    if torch.cuda.device_count() < max(args.tp):
        raise SystemExit(
            f"tensor parallel {max(args.tp)} needs as many CUDA GPUs; {torch.cuda.device_count()} "
            f"found"
        )
    data = run_tp_benchmark(args.tp, args.context_len)
    save("tp", data, plot_tp(data), args.out)


if __name__ == "__main__":
    main()
