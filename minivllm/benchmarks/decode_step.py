"""A whole decode step of Qwen3-0.6B, eager vs CUDA graph, for batch sizes 1..256.

    python -m minivllm.benchmarks.decode_step [--context-len 512] [--out figures]

Writes the qwen3-0.6b preset (random weights, bf16) to a temporary folder, starts a ModelRunner,
prefills `batch` sequences of `context_len` random tokens, then times `runner.run(seqs,
is_prefill=False)`: host-side input preparation, the forward, the sampler and the copy of the tokens
back, as the engine pays it. One runner replays its CUDA graphs; a second, made with
`enforce_eager=True`, runs eagerly. Writes decode_step.json + .png, with the KV cache the runner
sized on this GPU.
"""

import torch

from minivllm.benchmarks.common import arg_parser, preset_checkpoint, require_gpu, result, save
from minivllm.benchmarks.workloads import decode_step_rows

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def run_decode_step_benchmark(
    context_len: int = 512, batch_sizes=BATCH_SIZES, module: str = "minivllm.benchmarks.decode_step"
) -> dict:
    rows, cache = decode_step_rows(preset_checkpoint("qwen3-0.6b"), context_len, batch_sizes)
    return result(
        module,
        rows,
        preset="qwen3-0.6b",
        dtype="bfloat16",
        **cache,
        gpu_memory_utilization=0.9,
        total_memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
    )


def plot_decode_step(data: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for impl, label in (
        ("minivllm", "CUDA graph"),
        ("minivllm-eager", "eager (enforce_eager=True)"),
    ):
        rows = [r for r in data["rows"] if r["impl"] == impl]
        ax.plot([r["batch"] for r in rows], [r["ms"] for r in rows], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(
        f"Qwen3-0.6B decode step on {data['device']} (context {data['rows'][0]['context_len']})"
    )
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


def main() -> None:
    parser = arg_parser(__doc__, "decode_step")
    parser.add_argument("--context-len", type=int, default=512)
    args = parser.parse_args()
    require_gpu()
    data = run_decode_step_benchmark(args.context_len)
    save("decode_step", data, plot_decode_step(data), args.out)


if __name__ == "__main__":
    main()
