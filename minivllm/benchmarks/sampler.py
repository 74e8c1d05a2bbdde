"""The sampler alone: one call of `Sampler` on a batch of logits, per kind of request, on a GPU.

    python -m minivllm.benchmarks.sampler [--batch-sizes 1 64 256] [--vocab 151936] [--out figures]

Rows of one kind per batch (Qwen3's vocabulary by default, float32 logits as the runner's LM head
gives them): greedy; temperature only (the Triton race: one pass over the logits); top-p 0.9
(Triton's nucleus: draw, check, draw again above a draw outside the nucleus; no sort); top-k 50 with
top-p 0.9 (`top_k_sample`: the logits at or above a floor from 1,024 lanes' maxima, sorted and raced
in one program per row); both, row by row (top-k rows as above, the others the nucleus, one
`torch.where`); seeded top-p. `ms`: one eager call, building the `SamplingTensors` from the
requests' parameters as the runner does each step (host work included: a top-p call launches 18
kernels, 6 below 32 rows). `kernel_ms`: the GPU's time alone, the call replayed from a CUDA graph
with its tensors built beforehand, the mean over 8 steps' draws (a top-p row's retries depend on its
draw). Writes sampler.json (no figure: a table says it).
"""

import torch

from minivllm.benchmarks.common import arg_parser, gpu_ms, graph_ms, require_gpu, result, save
from minivllm.engine.step_inputs import sampling_tensors
from minivllm.layers.gpu_sampler import GPUSampler
from minivllm.layers.sampler import Sampler
from minivllm.sampling_params import SamplingParams

TOP_P, TOP_K = (
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
)
KINDS = {  # a kind's rows take its parameters in turn
    "greedy": [SamplingParams(temperature=0.0)],
    "temperature": [SamplingParams(temperature=0.6)],
    "top-p": [TOP_P],
    "top-k+top-p": [TOP_K],
    "top-k / top-p rows": [TOP_K, TOP_P],
    "seeded top-p": [SamplingParams(temperature=0.7, top_p=0.9, seed=0)],
}


def time_kind(sampler: Sampler, logits: torch.Tensor, kind: str, draws: int = 8) -> dict:
    batch = logits.shape[0]
    params = [KINDS[kind][row % len(KINDS[kind])] for row in range(batch)]
    built = [sampling_tensors(params, [step] * batch, logits.device) for step in range(draws)]
    with torch.inference_mode():
        ms = gpu_ms(lambda: sampler(logits, sampling_tensors(params, [0] * batch, logits.device)))
        kernel_ms = sum(graph_ms(lambda t=t: sampler(logits, t)) for t in built) / draws
    return dict(
        impl="minivllm", kind=kind, batch=batch, vocab=logits.shape[1], ms=ms, kernel_ms=kernel_ms
    )


def run_sampler_benchmark(batch_sizes=(1, 64, 256), vocab: int = 151_936) -> dict:
    sampler, rows = GPUSampler(), []  # the runner's on a GPU
    for batch in batch_sizes:
        logits = torch.randn(batch, vocab, device="cuda") * 3  # a spread like a real model's logits
        for kind in KINDS:
            rows.append(time_kind(sampler, logits, kind))
            r = rows[-1]
            times = f"{r['ms']:.3f} ms ({r['kernel_ms']:.3f} ms of kernels)"
            print(f"{kind:>18} batch {batch:>3}: {times}")
    return result("minivllm.benchmarks.sampler", rows)


def main() -> None:
    parser = arg_parser(__doc__, "sampler", figure=False)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=151_936)
    args = parser.parse_args()
    require_gpu()
    save("sampler", run_sampler_benchmark(args.batch_sizes, args.vocab), None, args.out)


if __name__ == "__main__":
    main()
