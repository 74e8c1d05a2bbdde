"""Online serving, as vLLM's benchmark_serving measures it: throughput and latency at several
request rates over HTTP, beside the same requests run offline.

    python -m minivllm.benchmarks.serving [--preset qwen3-0.6b] [--num-requests 512]
        [--request-rates 4 16 64 inf] [--prompt-lens 100 1024] [--output-lens 100 1024] [--seed 0]
        [--out figures]

The engine (prefix caching off: every run sends the same prompts) on the preset's random-weight
checkpoint (default qwen3-0.6b on a GPU; on a CPU tiny, 32 shorter requests). Requests: token-id
prompts and output lengths drawn from `random.Random(seed)` (nano-vllm's ranges by default),
temperature 0.6, ignore_eos, so every request's output length is its max_tokens. First offline:
every request at once through an `LLM`'s step loop, as `LLM.generate` runs them. Then, per `--cores`
(`AsyncLLM`'s engine core on a thread of the server's process, then in a process of its own, as vLLM
v1 runs it; rows carry `engine_core`), the OpenAI-compatible server (`minivllm.serve`, uvicorn on a
free port of 127.0.0.1 in a thread), and per request rate a client in a process of its own (httpx,
asyncio) that sends them to `/v1/completions` with `"stream": true`, Poisson arrivals at that rate
(inf: all at once). Per request: TTFT (to the first streamed event), TPOT ((last event - first) /
(max_tokens - 1)), end-to-end; per run: output tokens / wall seconds. A request counts as completed
when its last event's finish_reason is "length". Writes serving.json + .png.
"""

import asyncio
import itertools
import json
import math
import multiprocessing
import random
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
from tqdm import tqdm

from minivllm.benchmarks.common import arg_parser, percentiles, preset_checkpoint, result, save
from minivllm.benchmarks.workloads import make_requests

MODULE = "minivllm.benchmarks.serving"
TEMPERATURE = 0.6
DEFAULTS = {
    "cuda": dict(
        preset="qwen3-0.6b", num_requests=512, prompt_lens=[100, 1024], output_lens=[100, 1024]
    ),
    "cpu": dict(preset="tiny", num_requests=32, prompt_lens=[16, 128], output_lens=[16, 64]),
}


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start: a Poisson process of `rate` requests/s (exponential gaps), the first
    at 0; inf: all 0."""
    rng = random.Random(seed)
    gaps = [0.0] + [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(n - 1)]
    return list(itertools.accumulate(gaps))


async def stream_one(
    client: httpx.AsyncClient, body: dict, at: float, bar: tqdm | None = None
) -> dict:
    """One streamed completion sent at perf_counter() `at`: its TTFT, TPOT and end-to-end
    seconds."""
    await asyncio.sleep(at - time.perf_counter())
    start, times = time.perf_counter(), []
    reason: str | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"]
    except httpx.HTTPError as e:
        reason = f"{type(e).__name__}: {e}"
    end, n = time.perf_counter(), body["max_tokens"]
    if bar is not None:
        bar.update()
    if reason != "length":
        return dict(ok=False, reason=reason)
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return dict(ok=True, ttft=times[0] - start, tpot=tpot, e2e=end - start, events=len(times))


async def send_all(
    url: str, model: str, prompts, output_lens, rate: float, seed: int
) -> tuple[list[dict], float]:
    bodies = [
        dict(
            model=model,
            prompt=p,
            max_tokens=n,
            temperature=TEMPERATURE,
            ignore_eos=True,
            stream=True,
        )
        for p, n in zip(prompts, output_lens)
    ]
    # no queue on the client's side
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        # warm-up: the connection, the first route
        await stream_one(client, {**bodies[0], "max_tokens": 2}, 0.0)
        with tqdm(total=len(bodies), desc=f"rate {rate:g}/s", dynamic_ncols=True) as bar:
            start = time.perf_counter()
            at = [start + t for t in arrival_times(len(bodies), rate, seed)]
            results = await asyncio.gather(
                *(stream_one(client, b, t, bar) for b, t in zip(bodies, at))
            )
            return results, time.perf_counter() - start


def run_client(
    url: str, model: str, prompts, output_lens, rate: float, seed: int
) -> tuple[list[dict], float]:
    """Every request at `rate`, from this process's own asyncio loop: each request's timings and the
    wall seconds."""
    return asyncio.run(send_all(url, model, prompts, output_lens, rate, seed))


def summary(
    impl: str, rate: float, num_requests: int, done: list[dict], tokens: int, seconds: float
) -> dict:
    """A run's row: `done` holds each completed request's ttft, tpot (None with one token) and e2e
    seconds."""
    return dict(
        impl=impl,
        request_rate=rate if math.isfinite(rate) else "inf",  # JSON has no infinity
        num_requests=num_requests,
        completed=len(done),
        output_tokens=tokens,
        seconds=seconds,
        tok_per_s=tokens / seconds,
        **percentiles("ttft", [r["ttft"] for r in done]),
        **percentiles("tpot", [r["tpot"] for r in done if r["tpot"] is not None]),
        **percentiles("e2e", [r["e2e"] for r in done]),
    )


def online_row(rate: float, results: list[dict], seconds: float, output_lens: list[int]) -> dict:
    done = [r for r in results if r["ok"]]
    tokens = sum(n for r, n in zip(results, output_lens) if r["ok"])
    row = summary("minivllm-online", rate, len(results), done, tokens, seconds)
    # one per step at most: a client that lags gets them merged
    row["stream_events"] = sum(r["events"] for r in done)
    if failed := sorted({r["reason"] for r in results if not r["ok"]}, key=str):
        row["errors"] = failed
    return row


def timings(metrics, num_tokens: int) -> dict:
    """An offline request's TTFT, TPOT and end-to-end seconds, from its RequestMetrics."""
    e2e = metrics.finished_time - metrics.arrival_time
    return dict(
        ttft=metrics.time_to_first_token, tpot=metrics.time_per_output_token(num_tokens), e2e=e2e
    )


def run_offline(engine, prompts, output_lens) -> dict:
    """`LLM.generate`'s loop, every request at once."""
    from minivllm.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n) for n in output_lens
    ]
    outputs: list = []
    start = time.perf_counter()
    with engine.lock:
        wanted = set(engine.add_requests(prompts, params))
        while len(outputs) < len(wanted):
            outputs += engine.step(wanted)[0]
    seconds = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    assert tokens == sum(output_lens), "every request runs to its max_tokens (ignore_eos)"
    done = [timings(out.metrics, len(out.outputs[0].token_ids)) for out in outputs]
    return summary("minivllm-offline", math.inf, len(prompts), done, tokens, seconds)


def run_serving_benchmark(
    preset: str,
    num_requests: int,
    rates,
    prompt_lens,
    output_lens,
    seed: int = 0,
    cores=("thread", "process"),
) -> dict:
    from minivllm.async_llm import AsyncLLM
    from minivllm.llm import LLM
    from minivllm.serve import serve_in_thread

    path = preset_checkpoint(preset)
    config = dict(enable_prefix_caching=False, max_model_len=prompt_lens[1] + output_lens[1])
    offline = LLM(str(path), **config)
    try:
        prompts, outs = make_requests(
            num_requests, prompt_lens, output_lens, offline.engine.config.hf_config.vocab_size, seed
        )
        run_offline(offline.engine, prompts[:8], [4] * len(prompts[:8]))  # warm-up
        rows = [run_offline(offline.engine, prompts, outs)]
        # each row as it is measured
        print(SERVING_HEADER, serving_line(rows[0]), sep="\n", flush=True)
    finally:
        offline.close()
    # the client's own process: no GIL shared with the server
    spawn = multiprocessing.get_context("spawn")
    # the engine core on a thread of the server's process, then in a process of its own
    for core in cores:
        llm = AsyncLLM(str(path), multiprocessing=core == "process", **config)
        try:
            with (
                serve_in_thread(llm, preset) as url,
                ProcessPoolExecutor(1, mp_context=spawn) as client,
            ):
                client.submit(
                    run_client, url, preset, prompts[:8], [4] * 8, math.inf, seed
                ).result()  # warm-up
                for rate in rates:
                    results, seconds = client.submit(
                        run_client, url, preset, prompts, outs, rate, seed
                    ).result()
                    rows.append(online_row(rate, results, seconds, outs) | {"engine_core": core})
                    print(serving_line(rows[-1]), flush=True)
        finally:
            llm.close()
    workload = dict(
        num_requests=num_requests,
        prompt_lens=list(prompt_lens),
        output_lens=list(output_lens),
        temperature=TEMPERATURE,
        ignore_eos=True,
        seed=seed,
        enable_prefix_caching=False,
    )
    return result(MODULE, rows, preset=preset, workload=workload)


def plot_serving(data: dict):
    """Output tokens/s against the request rate, offline as a line; TTFT and TPOT p50 and p99
    against the rate."""
    import matplotlib.pyplot as plt

    online = [r for r in data["rows"] if r["impl"] == "minivllm-online"]
    offline = next(r for r in data["rows"] if r["impl"] == "minivllm-offline")
    rates = list(dict.fromkeys(float(r["request_rate"]) for r in online))
    x, labels = range(len(rates)), [f"{rate:g}" for rate in rates]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.8, 4.2))
    for core, marker in (("thread", "s"), ("process", "o")):
        rows = [r for r in online if r.get("engine_core") == core]
        if not rows:
            continue
        xs = [rates.index(float(r["request_rate"])) for r in rows]
        left.plot(
            xs,
            [r["tok_per_s"] for r in rows],
            f"{marker}-",
            label=f"online, engine core on a {core}",
        )
        for name, color in (("ttft", "C0"), ("tpot", "C1")):
            right.plot(
                xs,
                [r[f"{name}_p50_ms"] for r in rows],
                f"{marker}-",
                color=color,
                label=f"{name.upper()} p50, {core}",
            )
    left.axhline(
        offline["tok_per_s"], ls="--", color="gray", label="offline: the same requests at once"
    )
    right.axhline(offline["tpot_p50_ms"], ls="--", color="C1", alpha=0.5, label="TPOT p50 offline")
    left.set_ylim(bottom=0)
    left.set_title("output tokens / s", fontsize=10)
    left.legend(fontsize=9)
    right.set_yscale("log")
    right.set_title("latency (ms)", fontsize=10)
    right.legend(fontsize=9)
    for ax in (left, right):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (requests / s; inf: all at once)")
    fig.suptitle(
        f"{data['preset']} on {data['device']}: {offline['num_requests']} requests, prefix "
        f"caching off"
    )
    fig.tight_layout()
    return fig


SERVING_HEADER = (
    f"{'impl':>16} {'core':>7} {'rate':>5} {'done':>9} {'tok/s':>9} "
    f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>16}"
)


def serving_line(r: dict) -> str:
    return (
        f"{r['impl']:>16} {r.get('engine_core', ''):>7} {float(r['request_rate']):>5g} "
        f"{r['completed']:>4}/{r['num_requests']:<4} {r['tok_per_s']:>9,.0f} "
        f"{r['ttft_p50_ms']:>8,.1f}/{r['ttft_p99_ms']:<8,.1f} "
        f"{r['tpot_p50_ms']:>7.2f}/{r['tpot_p99_ms']:<8.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = arg_parser(__doc__, "serving")
    parser.add_argument("--preset", help="default: qwen3-0.6b on a GPU, tiny on a CPU")
    parser.add_argument("--num-requests", type=int, help="default: 512 on a GPU, 32 on a CPU")
    parser.add_argument("--request-rates", type=float, nargs="+", default=[4, 16, 64, math.inf])
    parser.add_argument(
        "--prompt-lens",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="default: 100 1024 (CPU: 16 128)",
    )
    parser.add_argument(
        "--output-lens",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="default: 100 1024 (CPU: 16 64)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cores",
        nargs="+",
        choices=["thread", "process"],
        default=["thread", "process"],
        help="where the server's engine core runs: a thread of its process (before), a process of "
        "its own (after)",
    )
    parser.set_defaults(**DEFAULTS["cuda" if torch.cuda.is_available() else "cpu"])
    args = parser.parse_args(argv)
    if (
        min(args.request_rates) <= 0
        or args.num_requests < 1
        or min(args.prompt_lens + args.output_lens) < 1
    ):
        parser.error("request rates, --num-requests and lengths must be positive")
    data = run_serving_benchmark(
        args.preset,
        args.num_requests,
        args.request_rates,
        args.prompt_lens,
        args.output_lens,
        args.seed,
        args.cores,
    )
    data["command"] = " ".join(
        ["python -m", MODULE, *map(shlex.quote, sys.argv[1:] if argv is None else argv)]
    )
    save("serving", data, plot_serving(data), args.out)


if __name__ == "__main__":
    main()
