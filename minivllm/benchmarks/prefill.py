"""Prefill attention: our Triton FlashAttention vs PyTorch SDPA (flash, cuDNN), a naive O(N²)
version, and FlashInfer's prefill (single_prefill_with_kv_cache) where the `flashinfer` package is
installed. Ours twice: `minivllm-triton`, the deep dive prefill_tuning's kernel, which the engine
runs on a GPU, and `minivllm-triton-core`, notebook 01's (the core path's) kernel.

    python -m minivllm.benchmarks.prefill [--seqlens 1024 4096 8192 16384] [--out figures] [--sweep]

One causal prompt (batch 1), 16 query / 8 KV heads, head_dim 128, bf16: Qwen3-0.6B's attention. Each
call is timed eagerly (triton.testing.do_bench), in 5 rounds that time every implementation in turn;
a row's `ms` is the median round (`ms_rounds`: all five). Writes prefill.json + prefill.png, and
prints per length how fast ours is against cuDNN (and FlashInfer): ratios in the JSON. --sweep also
times every tile configuration of the tuned kernel and prints the best.
"""

import importlib
import itertools
import statistics
from typing import Any

import torch

from minivllm.benchmarks.common import (
    HAS_FLASHINFER,
    arg_parser,
    gpu_ms,
    package_version,
    require_gpu,
    result,
    save,
)
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128


def causal_tflops(seqlen: int, ms: float, batch: int = 1) -> float:
    # two matmuls, half the square is masked
    flops = 4 * batch * seqlen * seqlen * NUM_HEADS * HEAD_DIM / 2
    return flops / (ms * 1e-3) / 1e12


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:  # (1, heads, N, D)
    scores = (q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5  # (1, heads, N, N): the O(N²) tensor
    n = q.shape[-2]
    scores = scores.masked_fill(
        torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
    )
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def tuned_module() -> Any:
    """The deep dive prefill_tuning's kernel module; None on the core path alone (tools/core_only
    blocks it), where notebook 01 runs this benchmark too."""
    try:
        return importlib.import_module("minivllm.kernels.prefill_tuned")
    except ImportError:
        return None


def tuned_impl(q, k, v, cu, seqlen: int, tile: dict | None) -> dict:
    """{"minivllm-triton": the tuned kernel on this prompt}, or {} without its module."""
    if (tuned := tuned_module()) is None:
        return {}
    run = tuned.flash_attn_varlen_tuned
    return {"minivllm-triton": lambda: run(q, k, v, cu, cu, seqlen, seqlen, causal=True, tile=tile)}


def implementations(
    seqlen: int, dtype: torch.dtype = torch.bfloat16, tile: dict | None = None
) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(seqlen, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    k = torch.randn(seqlen, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    cu = torch.tensor([0, seqlen], dtype=torch.int32, device="cuda")
    group = NUM_HEADS // NUM_KV_HEADS
    # SDPA and the naive version get the KV heads already expanded (outside the timing): GQA costs
    # them nothing
    qb, kb, vb = (
        t.transpose(0, 1)[None]
        for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    )

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)

        return run

    impls = {
        **tuned_impl(q, k, v, cu, seqlen, tile),
        "minivllm-triton-core": lambda: flash_attn_varlen_contiguous(
            q, k, v, cu, cu, seqlen, seqlen, causal=True
        ),
    }
    # beside ours; batch 1, so its single-request prefill: (N, heads, D) as ours, GQA inside
    if HAS_FLASHINFER:
        flashinfer = importlib.import_module("flashinfer")
        impls["flashinfer"] = lambda: flashinfer.single_prefill_with_kv_cache(
            q, k, v, causal=True, kv_layout="NHD"
        )
    impls["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    impls["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["naive-torch"] = lambda: naive_attention(qb, kb, vb)
    reference = impls["sdpa-flash"]()[0].transpose(0, 1)
    for ours in ("minivllm-triton", "minivllm-triton-core"):
        if ours in impls:
            torch.testing.assert_close(impls[ours](), reference, atol=2e-2, rtol=2e-2)
    # checked before any timing: a wrong layout must not give a fast, bogus number
    if "flashinfer" in impls:
        torch.testing.assert_close(impls["flashinfer"](), reference, atol=2e-2, rtol=2e-2)
    return impls


def interleaved_ms(impls: dict, rounds: int) -> dict[str, list[float]]:
    """Each implementation's do_bench median, in `rounds` rounds that time them one after the other:
    a slow spell of the GPU (clocks, heat) falls on all of them alike. An implementation that
    rejects the shape is left out."""
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(rounds):
        for impl in list(times):
            try:
                times[impl].append(gpu_ms(impls[impl]))
            except (
                RuntimeError,
                torch.OutOfMemoryError,
            ) as e:  # e.g. a backend that rejects the shape
                print(f"{impl}: skipped ({str(e).splitlines()[0]})")
                del times[impl]
    return times


def run_prefill_benchmark(
    seqlens=(1024, 4096, 8192, 16384), module: str = "minivllm.benchmarks.prefill", rounds: int = 5
) -> dict:
    rows, ratios = [], []
    for seqlen in seqlens:
        ms_of = {}
        for impl, times in interleaved_ms(implementations(seqlen), rounds).items():
            ms = statistics.median(times)
            rows.append(
                dict(
                    impl=impl,
                    seqlen=seqlen,
                    batch=1,
                    ms=ms,
                    tflops=causal_tflops(seqlen, ms),
                    ms_rounds=times,
                )
            )
            ms_of[impl] = ms
            spread = f"(rounds {min(times):.3f}–{max(times):.3f})"
            tflops = rows[-1]["tflops"]
            speed = f"{ms:8.3f} ms {tflops:7.1f} TFLOP/s"
            print(f"{impl:>16} N={seqlen:>6}: {speed}  {spread}")
        for baseline in ("sdpa-cudnn", "flashinfer"):  # speedup > 1: ours is faster
            if baseline in ms_of and "minivllm-triton" in ms_of:
                ratio = ms_of[baseline] / ms_of["minivllm-triton"]
                ratios.append(dict(seqlen=seqlen, batch=1, vs=baseline, speedup=ratio))
                print(f"{'ours / ' + baseline:>16} N={seqlen:>6}: {ratio:.2f}×")
    return result(
        module,
        rows,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        causal=True,
        config=tuned_launch(),
        timing=f"eager (triton.testing.do_bench), the median of {rounds} interleaved rounds",
        flashinfer=package_version("flashinfer-python"),
        # per length, speedup: minivllm-triton's speed over the baseline's (its ms / ours)
        ratios=ratios,
    )


def tuned_launch() -> dict | None:
    """The tuned kernel's launch on a GPU (tile, warps, stages): the JSON's `config`."""
    tuned = tuned_module()
    return None if tuned is None else tuned.tuned_config(HEAD_DIM, torch.device("cuda"))


def sweep(seqlens) -> None:
    """Time the tuned kernel under every tile configuration; print the five best per length."""
    space = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3)))
    for seqlen in seqlens:
        timings = []
        for block_m, block_n, warps, stages in space:
            config = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            try:
                timings.append(
                    (gpu_ms(implementations(seqlen, tile=config)["minivllm-triton"]), config)
                )
            except Exception as e:  # out of shared memory or registers for this tile
                print(f"  {config}: {type(e).__name__}")
        for ms, config in sorted(timings, key=lambda t: t[0])[:5]:
            tflops = causal_tflops(seqlen, ms)
            print(f"sweep N={seqlen}: {config} {ms:.3f} ms {tflops:.1f} TFLOP/s")


def plot_prefill(data: dict):
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r["impl"] for r in data["rows"]))
    seqlens = sorted({r["seqlen"] for r in data["rows"]})
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        rows = {r["seqlen"]: r["tflops"] for r in data["rows"] if r["impl"] == impl}
        ax.bar(
            [j + i * width for j in range(len(seqlens))],
            [rows.get(s, 0) for s in seqlens],
            width,
            label=impl,
        )
    ticks = [j + 0.4 - width / 2 for j in range(len(seqlens))]
    ax.set_xticks(ticks, [f"{s // 1024}k" for s in seqlens])
    ax.set_xlabel("prompt length (causal, batch 1, 16/8 heads, d=128, bf16)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Prefill attention on {data['device']}")
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    parser = arg_parser(__doc__, "prefill")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument(
        "--sweep", action="store_true", help="also time every tile configuration of our kernel"
    )
    args = parser.parse_args()
    require_gpu()
    if args.sweep:
        sweep(args.seqlens)
    data = run_prefill_benchmark(args.seqlens)
    save("prefill", data, plot_prefill(data), args.out)


if __name__ == "__main__":
    main()
