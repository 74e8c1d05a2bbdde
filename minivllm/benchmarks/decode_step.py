"""A whole decode step of Qwen3-0.6B, eager vs CUDA graph, for batch sizes 1..256.

    python -m minivllm.benchmarks.decode_step [--context-len 512] [--out figures]

Writes the qwen3-0.6b preset (random weights, bf16) to a temporary folder, starts a ModelRunner, prefills
`batch` sequences of `context_len` random tokens, then times `runner.run(seqs, is_prefill=False)`: host-side
input preparation, the forward, the sampler and the copy of the tokens back, as the engine pays it. One runner
replays its CUDA graphs; a second, made with `enforce_eager=True`, runs eagerly. Writes decode_step.json + .png,
with the KV cache the runner sized on this GPU.
"""

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from minivllm.benchmarks.common import OUT, result, save
from minivllm.checkpoint import write_checkpoint
from minivllm.config import Config
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.llm_engine import make_runner
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def step_ms(runner: ModelRunner, seqs: list[Sequence], steps: int = 20) -> float:
    """Median wall time of one decode step (the token is not appended: every step is the same step)."""
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
    """Median decode-step times of a runner on checkpoint `path` (Config fields in `config`) per batch size and
    impl ("minivllm-eager": a runner made with enforce_eager=True), and the size of the (first) runner's KV cache."""
    rows, cache = [], None
    for impl in impls:
        runner = make_runner(
            Config(
                path, max_num_seqs=max(batch_sizes), max_model_len=4096, enforce_eager=impl.endswith("eager"), **config
            )
        )
        try:
            rows += [
                dict(impl=impl, batch=batch, context_len=context_len + 1, ms=ms)
                for batch, ms in runner_rows(runner, context_len, batch_sizes, impl)
            ]
            blocks, block_size = runner.num_kvcache_blocks, runner.block_size
            cache = cache or dict(num_kvcache_blocks=blocks, block_size=block_size, kv_cache_tokens=blocks * block_size)
        finally:
            runner.close()
    assert cache is not None, "impls must name at least one runner"
    return rows, cache


def runner_rows(runner: ModelRunner, context_len: int, batch_sizes, impl: str) -> list[tuple[int, float]]:
    """(batch, median ms of a decode step) for each batch size: `batch` sequences prefilled, then decoded."""
    rng = random.Random(0)
    bm = BlockManager(runner.num_kvcache_blocks, runner.block_size, enable_prefix_caching=False)
    rows = []
    for batch in batch_sizes:
        seqs = [
            Sequence(rng.choices(range(10000), k=context_len), SamplingParams(temperature=0.6), bm.block_size)
            for _ in range(batch)
        ]
        for seq in seqs:
            bm.allocate(seq)
            seq.num_scheduled_tokens = len(seq)  # the whole prompt in one prefill step
        for i in range(0, batch, 16):  # prefill, 16 sequences a step
            for seq, token in zip(seqs[i : i + 16], runner.run(seqs[i : i + 16], is_prefill=True)):
                seq.append_token(token)
                bm.may_append(seq)
        rows.append((batch, step_ms(runner, seqs)))
        print(f"{impl:>15} batch {batch:>3}: {rows[-1][1]:7.2f} ms per decode step")
        for seq in seqs:
            bm.deallocate(seq)
    return rows


def run_decode_step_benchmark(
    context_len: int = 512, batch_sizes=BATCH_SIZES, module: str = "minivllm.benchmarks.decode_step"
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "qwen3-0.6b", "qwen3-0.6b", seed=0)
        rows, cache = decode_step_rows(path, context_len, batch_sizes)
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
    for impl, label in (("minivllm", "CUDA graph"), ("minivllm-eager", "eager (enforce_eager=True)")):
        rows = [r for r in data["rows"] if r["impl"] == impl]
        ax.plot([r["batch"] for r in rows], [r["ms"] for r in rows], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Qwen3-0.6B decode step on {data['device']} (context {data['rows'][0]['context_len']})")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument(
        "--out", type=Path, default=OUT, help="folder for decode_step.json and .png (default: ./figures)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    data = run_decode_step_benchmark(args.context_len)
    save("decode_step", data, plot_decode_step(data), args.out)


if __name__ == "__main__":
    main()
