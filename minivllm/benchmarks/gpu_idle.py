"""How long the GPU waits for the host between steps: the host's share of the critical path, on a
GPU.

    python -m minivllm.benchmarks.gpu_idle [--workloads nano-vllm single] [--preset qwen3-0.6b]
        [--out figures]

The engine as it runs by default (unified policy, asynchronous scheduling, CUDA graphs) on the
throughput benchmark's workloads. A CUDA event is recorded before and after each step's GPU work
(`ModelRunner.launch`: inputs, forward, sampler, the copy of the tokens); the GPU idles where one
step's end comes before the next step's start. `idle_share` is that idle time over the span from the
first step's start to the last step's end. It does not see the GPU waiting inside a step for its
kernels' launches (eager prefill steps); a decode step replays one graph. Writes gpu_idle.json (no
figure: a table says it).
"""

from unittest import mock

import torch

from minivllm.benchmarks.common import arg_parser, preset_checkpoint, require_gpu, result, save
from minivllm.benchmarks.workloads import MAX_MODEL_LEN, make_workload, run_workload
from minivllm.production import ProductionLLM as LLM
from minivllm.sampling_params import SamplingParams

Span = tuple[float, float]  # (start, end) in ms


def idle_share(spans: list[Span]) -> dict:
    """The GPU's busy time (the union of the steps' spans), its idle gaps, and the idle share of the
    whole span."""
    busy, gaps, (start, end) = 0.0, [], spans[0]  # the busy stretch so far: start..end
    for s, e in spans[1:]:
        if s > end:  # a gap: the GPU finished every step launched so far before this one began
            busy, start = busy + end - start, s
            gaps.append(s - end)
        end = max(end, e)
    busy += end - start
    span = end - spans[0][0]
    gaps.sort()
    return dict(
        steps=len(spans),
        gpu_span_ms=span,
        gpu_busy_ms=busy,
        idle_share=1 - busy / span,
        gap_p50_ms=gaps[len(gaps) // 2] if gaps else 0.0,
        gap_max_ms=gaps[-1] if gaps else 0.0,
    )


def time_steps(llm: LLM, workload: str) -> dict:
    """Run one workload with a pair of CUDA events around each step's launch; its throughput row and
    idle share."""
    runner, events = llm.engine.core.runner, []
    launch = runner.launch

    def timed_launch(seqs, is_prefill):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        output = launch(seqs, is_prefill)
        end.record()
        events.append((start, end))
        return output

    # this engine's runner only, for this run
    with mock.patch.object(runner, "launch", timed_launch):
        row = run_workload(llm, make_workload(workload))
    torch.cuda.synchronize()
    first = events[0][0]
    spans = [(first.elapsed_time(start), first.elapsed_time(end)) for start, end in events]
    return dict(row, impl="minivllm", **idle_share(spans))


def run_gpu_idle_benchmark(workloads=("nano-vllm", "single"), preset: str = "qwen3-0.6b") -> dict:
    rows = []
    with LLM(str(preset_checkpoint(preset)), max_model_len=MAX_MODEL_LEN) as llm:
        llm.generate(["Warm-up: "], SamplingParams(max_tokens=4), use_tqdm=False)
        for workload in workloads:
            rows.append(time_steps(llm, workload))
            r = rows[-1]
            gaps = f"gap p50 {r['gap_p50_ms']:.3f} ms, max {r['gap_max_ms']:.2f}"
            idle = f"GPU idle {r['idle_share']:.2%} of {r['gpu_span_ms']:,.0f} ms ({gaps})"
            print(f"{workload}: {r['tok_per_s']:,.0f} tok/s, {r['steps']} steps, {idle}")
    return result("minivllm.benchmarks.gpu_idle", rows, preset=preset)


def main() -> None:
    parser = arg_parser(__doc__, "gpu_idle", figure=False)
    parser.add_argument("--workloads", nargs="+", default=["nano-vllm", "single"])
    parser.add_argument("--preset", default="qwen3-0.6b")
    args = parser.parse_args()
    require_gpu()
    save("gpu_idle", run_gpu_idle_benchmark(args.workloads, args.preset), None, args.out)


if __name__ == "__main__":
    main()
