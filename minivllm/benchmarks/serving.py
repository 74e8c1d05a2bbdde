"""Online serving, as vLLM's benchmark_serving measures it: throughput and latency at several
request rates over HTTP, beside the same requests run offline.

    python -m minivllm.benchmarks.serving [--preset qwen3-0.6b] [--num-requests 512]
        [--request-rates 4 16 64 inf] [--prompt-lens 100 1024] [--output-lens 100 1024]
        [--seed 0] [--out figures] [--client-processes N]

The engine (prefix caching off: every run sends the same prompts) on the preset's random-weight
checkpoint (default qwen3-0.6b on a GPU; on a CPU tiny, 32 shorter requests). Requests: token-id
prompts and output lengths drawn from `random.Random(seed)` (nano-vllm's ranges by default),
temperature 0.6, ignore_eos, so every request's output length is its max_tokens. First offline:
every request at once through an `LLM`'s step loop, as `LLM.generate` runs them. Then, per `--cores`
(`AsyncLLM`'s engine core on a thread of the server's process, then in a process of its own, as vLLM
v1 runs it; rows carry `engine_core`), the OpenAI-compatible server (`minivllm.serve`, uvicorn on a
free port of 127.0.0.1 in a thread), and per request rate the clients (httpx, asyncio, in processes
of their own) that send them to `/v1/completions` with `"stream": true`, Poisson arrivals at that
rate (inf: all at once). Per request: TTFT (to the first streamed event), TPOT ((last event - first)
/ (max_tokens - 1)), end-to-end; per run: output tokens / wall seconds. A request is completed when
its stream ends with finish_reason "length", a usage of max_tokens tokens and [DONE]; a row's
`errors` counts the others by cause (an HTTP status, an error event's message, an exception and what
raised it).

The clients must not be what is measured. --client-processes (default: one per 64 requests)
spreads the requests round-robin over processes: httpcore's connection pool does work that grows
as the square of its connections (a client of 512 streams spent half its time there, at 100 % of
a core). They start together (a barrier), each after a warm-up on a client of its own, closed
before the run: a warm-up connection left idle in the pool is handed the burst's requests first,
and sends them one at a time. A row's `client_cpu_share`: the busiest client process's CPU
seconds (user + sys) over its wall seconds; near 1, the client held the run back.
Writes serving.json + .png.
"""

import asyncio
import collections
import itertools
import json
import math
import multiprocessing
import random
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.synchronize import Barrier

import httpx
from tqdm import tqdm

from minivllm.benchmarks.common import arg_parser, percentiles, preset_checkpoint, result, save
from minivllm.benchmarks.workloads import make_requests

MODULE = "minivllm.benchmarks.serving"
TEMPERATURE = 0.6
STREAMS_PER_CLIENT = 64  # requests a client process sends at most, by default (see above)
HANG = 600  # seconds a client process waits for the others at the start line: a hang guard
START_LINE: Barrier | None = None  # in a client process: where every client process of a run waits
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
    if math.isinf(rate):
        return [0.0] * n
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]
    return list(itertools.accumulate(gaps))


async def stream_one(
    client: httpx.AsyncClient, body: dict, at: float, bar: tqdm | None = None
) -> dict:
    """One streamed completion sent at perf_counter() `at`: its TTFT, TPOT and end-to-end
    seconds, its events, its connection's local port; or, if it did not complete, why (`cause`)."""
    await asyncio.sleep(at - time.perf_counter())
    times: list[float] = []
    cause: str | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            port = local_port(response)
            if response.status_code != 200:
                cause = f"HTTP {response.status_code}"
            else:
                events = await collect_events(response, times)
                cause = read_events(events, body["max_tokens"])
    except Exception as e:  # counted by its cause; the run goes on
        cause = cause_of(e)
    end = time.perf_counter()
    if bar is not None:
        bar.update()
    if cause is not None:
        return dict(ok=False, cause=cause)
    n, ttft = body["max_tokens"], times[0] - start
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return dict(ok=True, ttft=ttft, tpot=tpot, e2e=end - start, events=len(times), port=port)


async def collect_events(response: httpx.Response, times: list) -> list:
    """The stream's events: each `data:` line's JSON, or "[DONE]"; the time of each event with
    choices (a token or more) appended to `times`."""
    events: list = []
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            now, event = time.perf_counter(), json.loads(line.removeprefix("data: "))
            events.append(event)
            if event.get("choices"):
                times.append(now)
        elif line == "data: [DONE]":
            events.append("[DONE]")
    return events


def read_events(events: list, max_tokens: int) -> str | None:
    """Why a stream of these events did not complete, or None: it must end with finish_reason
    "length", the usage of max_tokens tokens, and [DONE]."""
    if events and isinstance(events[-1], dict) and "error" in events[-1]:
        return f"error event: {events[-1]['error']['message']}"
    if not events or events[-1] != "[DONE]":
        return "the stream ended without [DONE]"
    reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
    if not reasons or reasons[-1] != "length":
        return f"finish_reason {reasons[-1] if reasons else None!r}"
    usage: dict = next((e["usage"] for e in events[:-1] if e.get("usage")), {})
    tokens = usage.get("completion_tokens")
    return None if tokens == max_tokens else f"{tokens} of {max_tokens} tokens (usage)"


def cause_of(error: BaseException) -> str:
    """An exception and what raised it: "ReadError (BrokenPipeError: [Errno 32] Broken pipe)"."""
    chain: list[str] = []
    inner: BaseException | None = error
    while inner is not None and len(chain) < 8:  # httpx's errors wrap httpcore's, and the socket's
        name = f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__
        if name not in chain:
            chain.append(name)
        inner = inner.__cause__ or inner.__context__
    first, *inner_names = chain
    return f"{first} ({', '.join(inner_names)})" if inner_names else first


def local_port(response: httpx.Response) -> int | None:
    """The client's port of the connection the response came on (None with no socket: a mock)."""
    stream = response.extensions.get("network_stream")
    address = stream.get_extra_info("client_addr") if stream is not None else None
    return address[1] if address else None


def new_client(url: str) -> httpx.AsyncClient:
    """A client with no queue of its own: a connection per request in flight."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=url, timeout=None, limits=limits)


def init_client(start_line: Barrier) -> None:
    """A client process's set-up: the barrier its runs start at."""
    global START_LINE
    START_LINE = start_line


async def send_share(url: str, bodies: list[dict], offsets: list[float], desc: str | None) -> dict:
    """One client process's share of a run. A warm-up on a client of its own, then closed (a
    connection it left idle in the measured client's pool would be handed the burst's requests
    first, and send them one at a time); then, once every client process is at the start line, each
    body sent at its offset (seconds from the start). Each request's result, the warm-up's, the
    run's start and end (time.time()) and this process's CPU seconds (user + sys) meanwhile."""
    warm_up = None
    if bodies:
        async with new_client(url) as client:
            warm_up = await stream_one(client, {**bodies[0], "max_tokens": 2}, 0.0)
    async with new_client(url) as client:
        if START_LINE is not None:
            await asyncio.to_thread(START_LINE.wait, HANG)
        began, cpu, start = time.time(), time.process_time(), time.perf_counter()
        with tqdm(total=len(bodies), desc=desc, disable=desc is None, dynamic_ncols=True) as bar:
            sends = [stream_one(client, b, start + at, bar) for b, at in zip(bodies, offsets)]
            results = await asyncio.gather(*sends)
        cpu = time.process_time() - cpu
    return dict(results=results, warm_up=warm_up, began=began, ended=time.time(), cpu=cpu)


def run_client(url: str, bodies: list[dict], offsets: list[float], desc: str | None) -> dict:
    """send_share on this process's own asyncio loop (a client process's task)."""
    return asyncio.run(send_share(url, bodies, offsets, desc))


def run_online(
    pool: ProcessPoolExecutor, processes: int, url: str, bodies: list[dict], rate: float, seed: int
) -> tuple[list[dict], float, float]:
    """Every request at `rate`, spread round-robin over the client processes: each request's
    result (in order), the wall seconds from the first start to the last end, and the busiest
    client process's CPU share."""
    offsets = arrival_times(len(bodies), rate, seed)
    descs = [f"rate {rate:g}/s"] + [None] * (processes - 1)  # one progress bar: the first's
    shares = [(bodies[k::processes], offsets[k::processes], descs[k]) for k in range(processes)]
    tasks = [pool.submit(run_client, url, *share) for share in shares]
    runs = [task.result() for task in tasks]
    results: list = [None] * len(bodies)
    for k, run in enumerate(runs):
        results[k::processes] = run["results"]
    seconds = max(run["ended"] for run in runs) - min(run["began"] for run in runs)
    cpu_share = max(run["cpu"] / (run["ended"] - run["began"]) for run in runs)
    return results, seconds, cpu_share


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
    """A run's row, with `errors`: each cause of failure, and how many requests it failed."""
    done = [r for r in results if r["ok"]]
    tokens = sum(n for r, n in zip(results, output_lens) if r["ok"])
    row = summary("minivllm-online", rate, len(results), done, tokens, seconds)
    # one per step at most: a client that lags gets them merged
    row["stream_events"] = sum(r["events"] for r in done)
    causes = collections.Counter(r["cause"] for r in results if not r["ok"])
    row["errors"] = dict(causes.most_common())  # none: {}
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


def request_bodies(model: str, prompts, output_lens) -> list[dict]:
    """The streamed requests, each asking for its usage at the end (every token sent: a check)."""
    fields = dict(model=model, temperature=TEMPERATURE, ignore_eos=True, stream=True)
    usage = dict(stream_options=dict(include_usage=True))
    return [dict(fields, prompt=p, max_tokens=n, **usage) for p, n in zip(prompts, output_lens)]


def online_rows(
    url: str,
    processes: int,
    bodies: list[dict],
    outs,
    rates,
    seed: int,
    core: str,
) -> list[dict]:
    """A row per rate, the requests sent by `processes` client processes (spawned: no GIL shared
    with the server), after a warm-up of 8 short requests (the routes, each client process)."""
    spawn, rows = multiprocessing.get_context("spawn"), []
    start_line = spawn.Barrier(processes)
    setup = (spawn, init_client, (start_line,))  # each client process knows the start line
    with ProcessPoolExecutor(processes, *setup) as pool:
        warm_up = [dict(body, max_tokens=4) for body in bodies[:8]]
        run_online(pool, processes, url, warm_up, math.inf, seed)
        for rate in rates:
            results, seconds, cpu_share = run_online(pool, processes, url, bodies, rate, seed)
            row = online_row(rate, results, seconds, outs)
            row |= dict(client_processes=processes, client_cpu_share=cpu_share, engine_core=core)
            rows.append(row)
            print(serving_line(row), flush=True)
    return rows


def run_serving_benchmark(
    preset: str,
    num_requests: int,
    rates,
    prompt_lens,
    output_lens,
    seed: int = 0,
    cores=("thread", "process"),
    client_processes: int | None = None,
) -> dict:
    from minivllm.async_llm import AsyncLLM
    from minivllm.production import ProductionLLM as LLM
    from minivllm.serve.testing import serve_in_thread

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
    processes = client_processes or -(-num_requests // STREAMS_PER_CLIENT)
    bodies = request_bodies(preset, prompts, outs)
    # the engine core on a thread of the server's process, then in a process of its own
    for core in cores:
        llm = AsyncLLM(str(path), multiprocessing=core == "process", **config)
        try:
            with serve_in_thread(llm, preset) as url:
                rows += online_rows(url, processes, bodies, outs, rates, seed, core)
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


SERVING_HEADER = " ".join(
    [
        f"{'impl':>16}",
        f"{'core':>7}",
        f"{'rate':>5}",
        f"{'done':>9}",
        f"{'tok/s':>9}",
        f"{'TTFT p50/p99 ms':>17}",
        f"{'TPOT p50/p99 ms':>16}",
    ]
)


def serving_line(r: dict) -> str:
    impl, core, rate = r["impl"], r.get("engine_core", ""), float(r["request_rate"])
    done = f"{r['completed']:>4}/{r['num_requests']:<4}"
    ttft = f"{r['ttft_p50_ms']:>8,.1f}/{r['ttft_p99_ms']:<8,.1f}"
    tpot = f"{r['tpot_p50_ms']:>7.2f}/{r['tpot_p99_ms']:<8.2f}"
    head = f"{impl:>16} {core:>7} {rate:>5g} {done}"
    line = f"{head} {r['tok_per_s']:>9,.0f} {ttft} {tpot}"
    if "client_cpu_share" in r:  # the busiest client process's
        line += f" client CPU {r['client_cpu_share']:.0%} ({r['client_processes']} processes)"
    failed = [f"{count} failed: {cause}" for cause, count in r.get("errors", {}).items()]
    return "\n".join([line] + [f"{'':>17}{text}" for text in failed])


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
        "--client-processes",
        type=int,
        metavar="N",
        help=f"processes the requests are sent from (default: one per {STREAMS_PER_CLIENT})",
    )
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
    if args.client_processes is not None and args.client_processes < 1:
        parser.error("--client-processes must be positive")
    data = run_serving_benchmark(
        args.preset,
        args.num_requests,
        args.request_rates,
        args.prompt_lens,
        args.output_lens,
        args.seed,
        args.cores,
        args.client_processes,
    )
    data["command"] = " ".join(
        ["python -m", MODULE, *map(shlex.quote, sys.argv[1:] if argv is None else argv)]
    )
    save("serving", data, plot_serving(data), args.out)


if __name__ == "__main__":
    main()
