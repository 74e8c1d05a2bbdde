"""End-to-end throughput and latency per workload and scheduling policy, in one process.

    python -m minivllm.benchmarks.throughput [--workloads nano-vllm chat long single]
        [--policies unified prefill-first]
        [--impls minivllm minivllm-eager transformers-generate-batch]
        [--preset qwen3-0.6b] [--out figures]

Workloads (token ids < 10,000 drawn from `random.Random(0)`, ignore_eos so every length is the one
asked for; every request arrives at once, when the run starts):
- `nano-vllm`: nano-vllm's bench.py (`random.seed(0)`): 256 prompts of 100-1024 tokens, outputs of
  100-1024, temperature 0.6;
- `chat`: 512 requests sharing a 1,500-token system prompt, then 50-300 user tokens; outputs of
  100-300, temperature 0.7, top-p 0.9; also run with prefix caching off;
- `long`: 32 prompts of 10k-12k tokens, outputs of 50-100, temperature 0.6;
- `single`: one 256-token prompt, 2,048 output tokens, temperature 0.6.
Each (policy, prefix caching) pair is one LLM that runs every workload, so engines start four times
at most; each workload is first run with 2 output tokens per request (`warm_up`), then timed with an
empty prefix cache. Rows carry output and total (prompt + output) tokens/s, TTFT and TPOT p50/p99
(from each RequestOutput's metrics), the share of the workload's roofline and where the run's time
goes (`StepStats`: the scheduler on the host, and the model runner's step: step inputs, forward and
sampler, waiting for the GPU). `minivllm-eager` and transformers' continuous batching
(`transformers-generate-batch`) run nano-vllm's workload only, under the first policy. The roofline:
no engine can finish a workload faster than its FLOPs at the GPU's measured bf16 matmul rate, nor
faster than its bytes (the weights once per decode step, every request's KV cache once per output
token, a prefix that all requests share once per decode step: its blocks are the same ones) at the
measured copy bandwidth. Writes throughput.json + .png.
"""

import time
from pathlib import Path

import numpy as np
import torch

from minivllm.benchmarks.common import arg_parser, machine_rates, preset_checkpoint, result, save
from minivllm.benchmarks.workloads import (
    MAX_MODEL_LEN,
    POLICIES,
    WORKLOADS,
    Workload,
    describe_workload,
    make_workload,
    run_workload,
    warm_up,
)
from minivllm.checkpoint.maker import preset_config


def roofline_tok_per_s(
    work: Workload, preset: str, max_num_seqs: int, tflops: float, tbps: float
) -> float:
    """Output tokens/s no engine can beat on this workload: max(FLOPs / matmul rate, bytes / copy
    bandwidth)."""
    from minivllm.attention.layer import Attention
    from minivllm.engine.kv_cache import kv_block_bytes
    from minivllm.models.loader import model_class
    from minivllm.models.zoo import ZOO, head_size

    config = preset_config(preset)
    with torch.device("meta"):  # shapes only; Llama and Qwen2 presets too
        model = model_class(config.architectures, ZOO)(config)
    params = sum(p.numel() for p in model.parameters())
    kv_per_token = kv_block_bytes(
        [m for m in model.modules() if isinstance(m, Attention)], 1, torch.bfloat16
    )
    lens = [(len(p), n) for p, n in zip(work.prompts, work.output_lens)]
    # a shared prefix: once
    computed = sum(p + n for p, n in lens) - work.shared_prefix * (len(lens) - 1)
    attention_width = config.num_hidden_layers * config.num_attention_heads * head_size(config)
    # QK^T and PV, causal: half of 4
    attention_flops = 2 * attention_width * sum((p + n) ** 2 for p, n in lens)
    flops = 2 * params * computed + attention_flops
    output_lens = [n for _, n in lens]
    decode_steps = max(max(output_lens), -(-sum(output_lens) // max_num_seqs))
    own = sum(
        (p - work.shared_prefix) * n + n * (n - 1) // 2 for p, n in lens
    )  # each output token, its own context
    # and the shared prefix once a step
    kv_reads = kv_per_token * (own + work.shared_prefix * decode_steps)
    seconds = max(flops / (tflops * 1e12), (2 * params * decode_steps + kv_reads) / (tbps * 1e12))
    return sum(work.output_lens) / seconds


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
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=5
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, output_lens)]
        done: dict[str, int] = {}  # request id -> generated tokens
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                done[out.request_id] = len(out.generated_tokens)
            elif out is None and not manager.is_running():
                raise RuntimeError(
                    "transformers' continuous-batching manager stopped before finishing"
                )
    seconds = time.perf_counter() - start
    output_tokens = sum(done.values())
    return dict(output_tokens=output_tokens, seconds=seconds, tok_per_s=output_tokens / seconds)


def describe(row: dict) -> str:
    caching = "" if row["enable_prefix_caching"] else ", no prefix caching"
    share = (
        f" ({row['roofline_share']:.0%} of its roofline)"
        if row.get("roofline_share") is not None
        else ""
    )
    config = f"{row['workload']:>9} · {row['impl']} {row['policy']}{caching}"
    rates = f"{row['tok_per_s']:,.0f} output tok/s{share}, {row['total_tok_per_s']:,.0f} total"
    ttft = f"TTFT p50/p99 {row['ttft_p50_ms']:,.0f}/{row['ttft_p99_ms']:,.0f} ms"
    tpot = f"TPOT p50/p99 {row['tpot_p50_ms']:.1f}/{row['tpot_p99_ms']:.1f} ms"
    return f"{config}: {rates}; {ttft}, {tpot}; steps {row['steps']}"


def engine_rows(
    path: Path,
    preset: str,
    works: list[Workload],
    policy: str,
    caching: bool,
    rates: tuple[float, float],
    **config,
) -> list[dict]:
    """One LLM (this policy, prefix caching on or off, Config fields in `config`) running each
    workload in turn."""
    from minivllm.production import ProductionLLM as LLM  # here: notebook 06 reads the rest alone

    start = time.perf_counter()
    with LLM(str(path), scheduling_policy=policy, enable_prefix_caching=caching, **config) as llm:
        startup_seconds = time.perf_counter() - start
        rows = []
        for work in works:
            warm_up(llm, work)
            row = run_workload(llm, work)
            roofline = roofline_tok_per_s(work, preset, llm.engine.config.max_num_seqs, *rates)
            finite = np.isfinite(roofline)
            rows.append(
                dict(
                    impl="minivllm-eager" if config.get("enforce_eager") else "minivllm",
                    policy=policy,
                    enable_prefix_caching=caching,
                    startup_seconds=startup_seconds,
                    roofline_tok_per_s=float(roofline) if finite else None,
                    roofline_share=row["tok_per_s"] / roofline if finite else None,
                    **row,
                )
            )
            print(describe(rows[-1]))
    return rows


def run_throughput_benchmark(
    workloads=WORKLOADS,
    policies=POLICIES,
    impls=("minivllm",),
    preset: str = "qwen3-0.6b",
    module: str = "minivllm.benchmarks.throughput",
    **config,
) -> dict:
    """Every workload under every policy (and `chat` without prefix caching too) on the `preset`'s
    random-weight checkpoint; `config`: Config fields for every LLM (default max_model_len: the
    longest request's)."""
    works = [w if isinstance(w, Workload) else make_workload(w) for w in workloads]
    config.setdefault("max_model_len", MAX_MODEL_LEN)
    rates = machine_rates()
    rows: list[dict] = []
    path = preset_checkpoint(preset)
    if "minivllm" in impls:
        for policy in policies:
            rows += engine_rows(path, preset, works, policy, True, rates, **config)
        for policy in policies:  # chat without prefix caching: what the shared system prompt saves
            rows += engine_rows(
                path, preset, [w for w in works if w.name == "chat"], policy, False, rates, **config
            )
    nano = [w for w in works if w.name == "nano-vllm"]
    if "minivllm-eager" in impls and nano:
        rows += engine_rows(
            path, preset, nano, policies[0], True, rates, enforce_eager=True, **config
        )
    if "transformers-generate-batch" in impls and nano:
        row = run_transformers(path, nano[0].prompts, nano[0].output_lens)
        rows.append(
            dict(impl="transformers-generate-batch", workload="nano-vllm", num_seqs=256, **row)
        )
        print(f"nano-vllm · transformers-generate-batch: {row['tok_per_s']:,.0f} output tok/s")
    return result(
        module,
        rows,
        preset=preset,
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        bf16_matmul_tflops=rates[0] if np.isfinite(rates[0]) else None,
        copy_tbps=rates[1] if np.isfinite(rates[1]) else None,
        workloads={w.name: describe_workload(w) for w in works},
    )


def label(row: dict) -> str:
    return f"{row['impl']}, {row.get('policy', '')}" + (
        "" if row.get("enable_prefix_caching", True) else ", no cache"
    )


def plot_throughput(data: dict):
    """Per workload, one bar per engine configuration: output tokens/s (with the share of the
    roofline), TTFT and TPOT (p50 bars, p99 ticks), and the host's share of the run."""
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if "ttft_p50_ms" in r]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    configs = list(dict.fromkeys(label(r) for r in rows))
    width = 0.8 / len(configs)
    fig, axes = plt.subplots(2, 2, figsize=(10.8, 7.2))
    panels = [
        (axes[0, 0], "tok_per_s", None, "output tokens / s"),
        (axes[0, 1], "ttft_p50_ms", "ttft_p99_ms", "time to first token (ms): p50 bar, p99 tick"),
        (axes[1, 0], "tpot_p50_ms", "tpot_p99_ms", "time per output token (ms): p50 bar, p99 tick"),
    ]
    for j, config in enumerate(configs):
        mine = {r["workload"]: r for r in rows if label(r) == config}
        offset = (j - (len(configs) - 1) / 2) * width
        x = [i + offset for i, name in enumerate(names) if name in mine]
        runs = [mine[name] for name in names if name in mine]
        for ax, key, p99, title in panels:
            ax.bar(x, [r[key] for r in runs], width, color=f"C{j}", label=config)
            if p99:
                ax.scatter(x, [r[p99] for r in runs], marker="_", s=200, color="black", zorder=3)
            ax.set_title(title, fontsize=10)
        for xi, r in zip(x, runs):
            if r.get("roofline_share") is not None:
                axes[0, 0].text(
                    xi,
                    r["tok_per_s"],
                    f"{r['roofline_share']:.0%}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
            host = r["step_breakdown"]["scheduler"]["seconds"] / r["seconds"]
            axes[1, 1].bar(xi, 100 * host, width, color=f"C{j}")
    axes[1, 1].set_title("% of the run in the scheduler (host; the GPU waits)", fontsize=10)
    for ax in axes.flat:
        ax.set_xticks(range(len(names)), names)
    for ax, *_ in panels:
        ax.set_yscale("log")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(configs), fontsize=9)
    axes[0, 0].set_title("output tokens / s (label: share of the workload's roofline)", fontsize=10)
    fig.suptitle(
        f"{data['preset']} ({data['dtype']}) on {data['device']}: every request arrives at once"
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the legend below
    return fig


def main() -> None:
    parser = arg_parser(__doc__, "throughput")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument(
        "--impls",
        nargs="+",
        choices=["minivllm", "minivllm-eager", "transformers-generate-batch"],
        default=["minivllm"],
    )
    parser.add_argument("--preset", default="qwen3-0.6b")
    args = parser.parse_args()
    data = run_throughput_benchmark(args.workloads, args.policies, args.impls, args.preset)
    save("throughput", data, plot_throughput(data), args.out)


if __name__ == "__main__":
    main()
