"""The throughput benchmark's workloads are the ones its docstring names, and a run on the CPU gives every row the
fields the figures and notebook 06 read (tiny preset, shortened workloads: the real ones are for the GPU)."""

import math

from minivllm.benchmarks.throughput import (
    plot_throughput,
    roofline_tok_per_s,
    run_throughput_benchmark,
)
from minivllm.benchmarks.workloads import POLICIES, Workload, make_workload
from minivllm.sampling_params import SamplingParams


def test_workloads_are_the_documented_ones():
    chat = make_workload("chat")
    assert len(chat.prompts) == 512 and chat.shared_prefix == 1500
    assert all(
        p[:1500] == chat.prompts[0][:1500] and 50 <= len(p) - 1500 <= 300 for p in chat.prompts
    )
    assert all(
        100 <= n <= 300 and s.temperature == 0.7 and s.top_p == 0.9
        for n, s in zip(chat.output_lens, chat.params)
    )
    long = make_workload("long")
    assert len(long.prompts) == 32 and all(10_000 <= len(p) <= 12_000 for p in long.prompts)
    assert all(50 <= n <= 100 for n in long.output_lens)
    single = make_workload("single")
    assert [len(p) for p in single.prompts] == [256] and single.output_lens == [2048]
    nano = make_workload("nano-vllm")
    assert len(nano.prompts) == 256 and all(100 <= len(p) <= 1024 for p in nano.prompts)
    assert all(p.ignore_eos for w in (chat, long, single, nano) for p in w.params)


def test_roofline_counts_a_shared_prefix_once_and_grows_with_bandwidth():
    chat = make_workload("chat")
    unshared = Workload(
        "chat", chat.prompts, chat.params
    )  # the same requests, the prefix computed by each
    compute_bound = dict(preset="qwen3-0.6b", max_num_seqs=256, tflops=1.0, tbps=1e6)
    assert roofline_tok_per_s(chat, **compute_bound) > 2 * roofline_tok_per_s(
        unshared, **compute_bound
    )
    memory_bound = dict(
        preset="qwen3-0.6b", max_num_seqs=256, tflops=1e6, tbps=1.0
    )  # its KV read once a step
    assert roofline_tok_per_s(chat, **memory_bound) > 3 * roofline_tok_per_s(
        unshared, **memory_bound
    )
    slow, fast = (roofline_tok_per_s(chat, "qwen3-0.6b", 256, 1e6, tbps) for tbps in (1.0, 2.0))
    assert math.isclose(fast, 2 * slow)  # memory-bound: twice the bandwidth, twice the bound


def test_a_cpu_run_gives_every_row_its_fields():
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True, max_tokens=n) for n in (3, 5, 4)
    ]
    prefix = list(range(1, 40))
    works = [
        Workload("chat", [prefix + [7] * n for n in (2, 9, 20)], params, shared_prefix=len(prefix)),
        Workload(
            "single", [[5] * 30], [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=6)]
        ),
    ]
    data = run_throughput_benchmark(
        works, preset="tiny", max_model_len=256, max_num_batched_tokens=32
    )
    rows = data["rows"]
    runs = {(r["workload"], r["policy"], r["enable_prefix_caching"]) for r in rows}
    assert runs == {(w, p, True) for w in ("chat", "single") for p in POLICIES} | {
        ("chat", p, False) for p in POLICIES
    }
    for row in rows:
        assert row["output_tokens"] == {"chat": 12, "single": 6}[row["workload"]]
        latencies = [row[f"{name}_{q}_ms"] for name in ("ttft", "tpot") for q in ("p50", "p99")]
        assert all(math.isfinite(ms) and ms > 0 for ms in latencies)
        if row["workload"] == "single":  # one request: both percentiles are its own value
            assert (
                row["ttft_p50_ms"] == row["ttft_p99_ms"]
                and row["tpot_p50_ms"] == row["tpot_p99_ms"]
            )
        assert row["impl"] == "minivllm" and row["roofline_share"] is None  # no GPU rates on a CPU
        assert sum(row["steps"].values()) == row["step_breakdown"]["runner.run"]["calls"]
    plot_throughput(data)


def test_gpu_idle_share_is_the_gaps_between_step_spans():
    """Steps (start, end) in ms: overlapping spans are one busy stretch; only the gaps between them are idle."""
    from minivllm.benchmarks.gpu_idle import idle_share

    r = idle_share([(0.0, 4.0), (3.0, 6.0), (8.0, 9.0), (9.0, 10.0), (12.5, 13.0)])
    assert r["steps"] == 5 and r["gpu_span_ms"] == 13.0 and r["gpu_busy_ms"] == 6.0 + 2.0 + 0.5
    assert (
        math.isclose(r["idle_share"], 4.5 / 13.0)
        and r["gap_p50_ms"] == 2.5
        and r["gap_max_ms"] == 2.5
    )
    back_to_back = idle_share([(0.0, 1.0), (1.0, 2.0)])
    assert back_to_back["idle_share"] == 0.0 and back_to_back["gap_max_ms"] == 0.0


def test_step_kinds_splits_the_run_by_kind_of_step():
    from minivllm.benchmarks.step_kinds import plot_step_kinds, run_step_kinds_benchmark

    params = [
        SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True, max_tokens=n) for n in (3, 5, 4)
    ]
    prefix = list(range(1, 40))
    chat = Workload(
        "chat", [prefix + [7] * n for n in (2, 9, 20)], params, shared_prefix=len(prefix)
    )
    data = run_step_kinds_benchmark(
        [chat], preset="tiny", repeats=2, max_model_len=256, max_num_batched_tokens=32
    )
    rows = {row["policy"]: row for row in data["rows"]}
    assert set(rows) == set(POLICIES) and not any(
        row["mixed_graphs"] for row in rows.values()
    )  # a CPU: no graphs
    assert "mixed" in rows["unified"]["kinds"] and "mixed" not in rows["prefill-first"]["kinds"]
    for row in rows.values():
        assert (
            sum(k["tokens"] for k in row["kinds"].values()) >= 39 + 2 + 9 + 20
        )  # the repeat recomputed its prompts
        decode = row["kinds"]["decode"]
        assert (
            decode["tokens"] == decode["seqs"] > 0
        )  # a decode step computes one token per sequence
        assert sum(k["seconds"] for k in row["kinds"].values()) <= row["seconds"]
    plot_step_kinds(data)


def test_cascade_figure_has_a_bar_per_way_and_shape():
    from minivllm.benchmarks.cascade import plot_cascade

    ways, shapes = ("row by row", "cascade", "cascade, no sharers"), ((16, 50), (256, 350))
    rows = [dict(impl=w, batch=b, own_tokens=o, prefix_tokens=1488, ms=0.1 + i) for i, w in enumerate(ways)
            for b, o in shapes]  # fmt: skip
    fig = plot_cascade({"device": "test", "rows": rows})
    assert len(fig.axes[0].patches) == len(ways) * len(shapes)


def test_each_timed_run_follows_a_warm_up_and_finds_nothing_cached(monkeypatch):
    from minivllm.benchmarks import throughput

    events = []  # (what, workload, prefix-cache entries at that moment)
    for name in ("warm_up", "run_workload"):
        original = getattr(throughput, name)

        def spy(llm, work, original=original, name=name):
            events.append(
                (name, work.name, len(llm.engine.core.scheduler.block_manager.hash_to_block_id))
            )
            return original(llm, work)

        monkeypatch.setattr(throughput, name, spy)
    prefix = list(range(1, 40))  # two full blocks of 16 every prompt shares
    params = [SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True, max_tokens=4)] * 3
    work = Workload(
        "chat", [prefix + [7] * n for n in (2, 9, 20)], params, shared_prefix=len(prefix)
    )
    run_throughput_benchmark(
        [work], ("unified",), preset="tiny", max_model_len=256, max_num_batched_tokens=32
    )
    assert (
        events == [("warm_up", "chat", 0), ("run_workload", "chat", 0)] * 2
    )  # with prefix caching, then without


def test_gc_pauses_counts_the_full_collections_inside():
    import gc

    from minivllm.benchmarks.workloads import gc_pauses

    with gc_pauses() as pauses:
        gc.collect()  # a full collection
        gc.collect(0)
    gc.collect()  # outside: not counted
    assert pauses["full"] == 1 and pauses["seconds"] > 0.0
