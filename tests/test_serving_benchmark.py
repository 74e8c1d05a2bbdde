"""The serving benchmark: Poisson arrivals at the asked rate, and a CPU run (tiny preset, 6 short requests, a finite
rate and inf) in which every online run completes every request with the output tokens it asked for, and
serving.json + .png carry the rows the figure reads. No timing thresholds: a CPU's timings say nothing."""

import json
import math

import numpy as np
import pytest

pytest.importorskip("uvicorn")

from minivllm.benchmarks.serving import arrival_times, main  # noqa: E402
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
    main([*argv, "--prompt-lens", "8", "32", "--output-lens", "4", "12"])
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
        assert FIELDS <= row.keys() and "errors" not in row
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
    assert (tmp_path / "serving.png").stat().st_size > 0
