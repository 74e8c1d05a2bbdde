"""The serving benchmark: Poisson arrivals at the asked rate, and a CPU run (tiny preset, 6 short requests, a finite
rate and inf) in which every online run completes every request with the output tokens it asked for, and
serving.json + .png carry the rows the figure reads. No timing thresholds: a CPU's timings
say nothing. The run has two client processes; a failed request is counted by its cause; a burst
does not queue on the warm-up's connection."""

import asyncio
import json
import math

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.benchmarks.serving import (  # noqa: E402
    arrival_times,
    main,
    online_row,
    send_share,
    stream_one,
)
from minivllm.benchmarks.workloads import make_requests  # noqa: E402
from minivllm.checkpoint.maker import preset_config  # noqa: E402

FIELDS = {
    "impl",
    "request_rate",
    "num_requests",
    "completed",
    "output_tokens",
    "seconds",
    "tok_per_s",
}
LATENCIES = ("ttft", "tpot", "e2e")


def test_arrivals_are_poisson_at_the_rate_and_all_at_once_at_inf():
    times = arrival_times(4000, 20.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(
        1 / 20, rel=0.05
    )  # exponential gaps: mean 1/rate, std 1/rate
    assert gaps.std() == pytest.approx(1 / 20, rel=0.1)
    assert arrival_times(4000, 20.0, seed=1) == times  # seeded
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_a_cpu_run_completes_every_request(tmp_path):
    lens = dict(prompt_lens=(8, 32), output_lens=(4, 12))
    argv = [
        "--preset",
        "tiny",
        "--num-requests",
        "6",
        "--request-rates",
        "50",
        "inf",
        "--out",
        str(tmp_path),
    ]
    main([*argv, "--prompt-lens", "8", "32", "--output-lens", "4", "12", "--client-processes", "2"])
    data = json.loads((tmp_path / "serving.json").read_text())
    assert data["device"] == "cpu" and data["command"].startswith(
        "python -m minivllm.benchmarks.serving --preset tiny"
    )
    rows = data["rows"]
    assert [(r["impl"], r.get("engine_core"), r["request_rate"]) for r in rows] == [
        ("minivllm-offline", None, "inf"),
        ("minivllm-online", "thread", 50.0),
        ("minivllm-online", "thread", "inf"),
        ("minivllm-online", "process", 50.0),
        ("minivllm-online", "process", "inf"),
    ]
    prompts, output_lens = make_requests(6, vocab=preset_config("tiny").vocab_size, **lens)
    assert all(8 <= len(p) <= 32 for p in prompts) and all(4 <= n <= 12 for n in output_lens)
    for row in rows:
        assert FIELDS <= row.keys() and row.get("errors", {}) == {}
        assert row["num_requests"] == row["completed"] == 6
        assert row["output_tokens"] == sum(
            output_lens
        )  # ignore_eos: each request ran to its max_tokens
        for (
            name
        ) in LATENCIES:  # TPOT may be 0: a client that fell behind got all its tokens in one event
            assert all(
                math.isfinite(row[f"{name}_{q}_ms"]) and row[f"{name}_{q}_ms"] >= 0
                for q in ("p50", "p99")
            )
            assert name == "tpot" or row[f"{name}_p50_ms"] > 0
    for row in rows[1:]:
        assert (
            row["completed"] <= row["stream_events"] <= sum(output_lens)
        )  # one per step, fewer for a slow client
        assert row["client_processes"] == 2 and row["client_cpu_share"] > 0
    assert (tmp_path / "serving.png").stat().st_size > 0


def sse(*events: dict | str) -> bytes:
    lines = [e if isinstance(e, str) else json.dumps(e) for e in events]
    return "".join(f"data: {line}\n\n" for line in lines).encode()


def chunk(finish_reason: str | None) -> dict:
    choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": finish_reason}
    return {"choices": [choice], "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
DIED = {"error": {"message": "the engine core died"}}


def reply(request: httpx.Request) -> httpx.Response:
    """What a server might answer, by the request's prompt."""
    kind = json.loads(request.content)["prompt"]
    if kind == "busy":
        return httpx.Response(503, json={"error": {"message": "the server is busy"}})
    if kind == "dies":
        return httpx.Response(200, content=sse(chunk(None), DIED))
    if kind == "cut":
        return httpx.Response(200, content=sse(chunk(None)))
    if kind == "closed":
        raise httpx.ReadError("") from BrokenPipeError(32, "Broken pipe")
    return httpx.Response(200, content=sse(chunk(None), chunk("length"), USAGE, "[DONE]"))


def test_a_failed_request_is_counted_by_its_cause():
    """A row's errors: each cause (an HTTP status, an error event's message, an exception and
    what raised it, a stream cut short) and how many requests it failed. Before: a list of
    distinct reasons, some empty, and an error event crashed the client."""
    prompts = ["busy", "busy", "dies", "cut", "closed", "fine"]

    async def send_all() -> list[dict]:
        transport = httpx.MockTransport(reply)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            bodies = [dict(model="m", prompt=p, max_tokens=2, stream=True) for p in prompts]
            return [await stream_one(client, body, 0.0) for body in bodies]

    results = asyncio.run(send_all())
    row = online_row(math.inf, results, 1.0, [2] * len(prompts))
    assert row["completed"] == 1 and row["output_tokens"] == 2
    assert row["errors"] == {
        "HTTP 503": 2,
        "error event: the engine core died": 1,
        "the stream ended without [DONE]": 1,
        "ReadError (BrokenPipeError: [Errno 32] Broken pipe)": 1,
    }


def test_a_burst_does_not_queue_on_the_warm_up_connection(server):
    """A client warmed up on the connection it then sends a burst on hands that one idle
    connection to the burst's requests first (httpcore's pool): "all at once" went out one at a
    time. The warm-up runs on a client of its own, closed before the burst: no request of the
    burst goes out on its connection."""
    body = dict(model="tiny", prompt=[5, 6, 7], max_tokens=3, ignore_eos=True, stream=True)
    body["stream_options"] = dict(include_usage=True)  # as the benchmark's requests: a check
    share = asyncio.run(send_share(server[0], [body] * 4, [0.0] * 4, None))
    assert all(r["ok"] for r in share["results"]) and share["warm_up"]["ok"]
    assert share["warm_up"]["port"] not in {r["port"] for r in share["results"]}
