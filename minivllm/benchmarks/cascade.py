"""Decode attention of rows that share a system prompt: each row reading every key vs the shared
prefix read once (cascade attention: the deep dive notebooks/deep_dives/cascade_attention, after
03).

    python -m minivllm.benchmarks.cascade [--out figures]

Qwen3-0.6B's attention (16 query / 8 KV heads, head_dim 128, bf16, blocks of 16). Every row begins
with the same 1,488 cached tokens (the chat workload's system prompt in whole blocks), then 1 to 2 ×
`own` tokens of its own. Three ways per shape: `row by row` (no prefix given), `cascade` (the prefix
given), and `cascade, no sharers` (the kernel told that no row shares it: what a CUDA graph captured
with the prefix kernel costs in a step without one). Each call is timed from a CUDA graph. Writes
cascade.json + cascade.png.
"""

import random

import torch

from minivllm.benchmarks.common import arg_parser, graph_ms, result, save
from minivllm.kernels.cascade import flash_attn_with_kvcache
from minivllm.testing import scatter_into_cache

PREFIX, BLOCK_SIZE = 1488, 16
# (rows, mean tokens of each row's own)
SHAPES = [(16, 50), (64, 50), (64, 350), (256, 50), (256, 350)]


def shared_inputs(batch: int, own: int) -> dict:
    rng = random.Random(batch * own)
    seq_lens = [PREFIX + rng.randint(1, 2 * own) for _ in range(batch)]
    k_cache, v_cache, table, *_ = scatter_into_cache(
        seq_lens, 8, 128, BLOCK_SIZE, "cuda", torch.bfloat16
    )
    # every row: the same prefix blocks
    table[1:, : PREFIX // BLOCK_SIZE] = table[0, : PREFIX // BLOCK_SIZE]
    return dict(
        q=torch.randn(batch, 1, 16, 128, device="cuda", dtype=torch.bfloat16),
        k_cache=k_cache,
        v_cache=v_cache,
        cache_seqlens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=table,
        prefix_blocks=table[0, : PREFIX // BLOCK_SIZE].contiguous(),
        prefix_lens=torch.full((batch,), PREFIX, dtype=torch.int32, device="cuda"),
    )


def run_cascade_benchmark(shapes=SHAPES) -> dict:
    rows = []
    for batch, own in shapes:
        x = shared_inputs(batch, own)
        plain = {k: x[k] for k in ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")}
        ways = {
            "row by row": plain,
            "cascade": x,
            "cascade, no sharers": {**x, "prefix_lens": torch.zeros_like(x["prefix_lens"])},
        }
        ref = flash_attn_with_kvcache(**plain)
        for way, kwargs in ways.items():
            # before timing
            torch.testing.assert_close(flash_attn_with_kvcache(**kwargs), ref, atol=2e-2, rtol=2e-2)
            ms = graph_ms(lambda kwargs=kwargs: flash_attn_with_kvcache(**kwargs))
            rows.append(dict(impl=way, batch=batch, own_tokens=own, prefix_tokens=PREFIX, ms=ms))
            us = ms * 1e3
            shape = f"rows={batch:>3} own≈{own:>3}"
            print(f"{way:>20} {shape}: {us:7.1f} µs")
    return result(
        "minivllm.benchmarks.cascade",
        rows,
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        timing="CUDA graph replay (triton.testing.do_bench_cudagraph)",
    )


def plot_cascade(data: dict):
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["batch"], r["own_tokens"]) for r in data["rows"]))
    ways = list(dict.fromkeys(r["impl"] for r in data["rows"]))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(ways)
    for i, way in enumerate(ways):
        mine = [r for r in data["rows"] if r["impl"] == way]
        us = {(r["batch"], r["own_tokens"]): r["ms"] * 1e3 for r in mine}
        ax.bar(
            [j + i * width for j in range(len(shapes))], [us[s] for s in shapes], width, label=way
        )
    middle = width * (len(ways) - 1) / 2
    ax.set_xticks([j + middle for j in range(len(shapes))])
    ax.set_xticklabels([f"{b} rows\n~{o} own tokens" for b, o in shapes])
    ax.set_ylabel("µs per layer (decode attention)")
    ax.set_title(f"Rows sharing a {PREFIX:,}-token prefix, {data['device']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    args = arg_parser(__doc__, "cascade").parse_args()
    data = run_cascade_benchmark()
    save("cascade", data, plot_cascade(data), args.out)


if __name__ == "__main__":
    main()
