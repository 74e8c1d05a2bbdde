"""The cold-start benchmark on a CPU (tiny preset, two short requests of each workload): each workload runs twice in
one fresh process, the second time on other prompts, and cold_start.json carries the rows the figure reads. No
timing thresholds: a CPU's timings say nothing."""

import json

from minivllm.benchmarks.cold_start import main, make


def test_the_second_run_has_other_prompts_of_the_same_shape():
    first, second = make("chat-burst", 1, None, None), make("chat-burst", 2, None, None)
    assert (
        len(first.prompts) == len(second.prompts) == 1024
        and first.shared_prefix == second.shared_prefix == 1000
    )
    assert (
        first.prompts[0][:1000] != second.prompts[0][:1000]
    )  # another system prompt: nothing cached to find
    assert all(p.top_k == 50 and p.top_p == 0.95 for p in first.params)


def test_a_cpu_run_writes_two_runs_per_workload(tmp_path):
    main(["--max-requests", "2", "--max-tokens", "3", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "cold_start.json").read_text())
    rows = data["rows"]
    assert [(r["workload"], r["run"]) for r in rows] == [
        ("chat-burst", 1),
        ("chat-burst", 2),
        ("nano-vllm", 1),
        ("nano-vllm", 2),
    ]
    for row in rows:
        assert row["num_seqs"] == 2 and row["output_tokens"] == 6
        assert row["tok_per_s"] > 0 and row["ttft_p50_ms"] > 0 and row["startup_s"] > 0
    assert (tmp_path / "cold_start.png").stat().st_size > 0
