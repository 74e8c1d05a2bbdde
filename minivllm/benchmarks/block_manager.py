"""Block manager micro-benchmark: µs per allocate / append / free, and hashing cost per token.

    python -m minivllm.benchmarks.block_manager [--num-seqs 10000] [--block-size 16] [--out figures]

Sequences of about 1k tokens go through the block manager in waves: allocate (cache misses), 64
decode steps, free, then allocate the same prompts again (cache hits) and free. Each call must cost
time in proportion to the blocks it touches, not to the size of the cache, so the work is repeated
with caches of very different sizes (the µs-per-block columns must stay flat), and with prompts of
different lengths (µs per call must grow with the blocks, µs per block must not). Writes
block_manager.json (and .png when matplotlib is installed) to --out: ./figures by default.
"""

import time

import numpy as np

from minivllm.benchmarks.common import arg_parser, cpu_name, result, save
from minivllm.engine.block_manager import BlockManager, compute_hash
from minivllm.engine.sequence import Sequence

VOCAB = 151_936
WAVE = 32  # sequences alive at once


def run_benchmark(
    num_blocks: int,
    num_seqs: int = 10_000,
    block_size: int = 16,
    prompt_len: int = 1024,
    decode_steps: int = 64,
    seed: int = 0,
) -> dict:
    """Time every BlockManager call over `num_seqs` sequences: µs per call and per block of each
    operation."""
    rng = np.random.default_rng(seed)
    bm = BlockManager(num_blocks, block_size)
    seconds = dict(allocate=0.0, allocate_hit=0.0, append=0.0, free=0.0)
    blocks = dict(allocate=0, allocate_hit=0, free=0)
    hit_tokens = prompt_tokens = 0
    for start in range(0, num_seqs, WAVE):
        lens = rng.integers(
            prompt_len * 7 // 8, prompt_len * 9 // 8 + 1, min(WAVE, num_seqs - start)
        )
        seqs = [Sequence(rng.integers(0, VOCAB, n).tolist(), block_size=block_size) for n in lens]
        new_tokens = rng.integers(0, VOCAB, (decode_steps, len(seqs))).tolist()

        t0 = time.perf_counter()
        for seq in seqs:
            bm.allocate(seq)
            bm.cache_blocks(seq, len(seq))  # as the step that prefills the whole prompt does
        t1 = time.perf_counter()
        blocks["allocate"] += sum(seq.num_blocks for seq in seqs)
        for step in new_tokens:
            for seq, token in zip(seqs, step):
                seq.append_token(token)
                bm.may_append(seq)
        t2 = time.perf_counter()
        blocks["free"] += sum(len(seq.block_table) for seq in seqs)
        for seq in seqs:
            bm.deallocate(seq)
        t3 = time.perf_counter()
        seconds["allocate"] += t1 - t0
        seconds["append"] += t2 - t1
        seconds["free"] += t3 - t2

        again = [Sequence(seq.token_ids, block_size=block_size) for seq in seqs]
        t0 = time.perf_counter()
        for seq in again:
            bm.allocate(seq)
        seconds["allocate_hit"] += time.perf_counter() - t0
        blocks["allocate_hit"] += sum(seq.num_blocks for seq in again)
        hit_tokens += sum(seq.num_cached_tokens for seq in again)
        prompt_tokens += sum(len(seq) for seq in again)
        for seq in again:
            bm.deallocate(seq)
    assert bm.num_free_blocks == num_blocks
    us = 1e6
    return dict(
        num_blocks=num_blocks,
        num_seqs=num_seqs,
        block_size=block_size,
        prompt_len=prompt_len,
        allocate_us=seconds["allocate"] / num_seqs * us,
        allocate_us_per_block=seconds["allocate"] / blocks["allocate"] * us,
        allocate_hit_us=seconds["allocate_hit"] / num_seqs * us,
        allocate_hit_us_per_block=seconds["allocate_hit"] / blocks["allocate_hit"] * us,
        hit_rate=hit_tokens / prompt_tokens,
        append_us=seconds["append"] / (num_seqs * decode_steps) * us,
        free_us=seconds["free"] / num_seqs * us,
        free_us_per_block=seconds["free"] / blocks["free"] * us,
    )


def hash_ns_per_token(block_size: int, num_blocks: int = 20_000) -> float:
    blocks = np.random.default_rng(0).integers(0, VOCAB, (num_blocks, block_size)).tolist()
    t0 = time.perf_counter()
    h = -1
    for token_ids in blocks:
        h = compute_hash(token_ids, h)
    return (time.perf_counter() - t0) / (num_blocks * block_size) * 1e9


def print_table(rows: list[dict]) -> None:
    header = "{:>10} {:>6} | {:>17} | {:>23} | {:>9} | {:>17}".format
    print(header("num_blocks", "prompt", "allocate (miss)", "allocate (hit)", "append", "free"))
    units = "{:>10} {:>6} | {:>8} {:>8} | {:>8} {:>8} {:>5} | {:>9} | {:>8} {:>8}".format
    per_call = ("µs/call", "µs/blk")
    print(units("", "tokens", *per_call, *per_call, "hits", "µs/token", *per_call))
    for r in rows:
        size = f"{r['num_blocks']:>10,} {r['prompt_len']:>6}"
        miss = f"{r['allocate_us']:8.1f} {r['allocate_us_per_block']:8.2f}"
        hit = f"{r['allocate_hit_us']:8.1f} {r['allocate_hit_us_per_block']:8.2f}"
        hit += f" {r['hit_rate']:5.0%}"
        append = f"{r['append_us']:9.2f}"
        free = f"{r['free_us']:8.1f} {r['free_us_per_block']:8.2f}"
        print(" | ".join([size, miss, hit, append, free]))


def plot_block_manager(data: dict):
    """µs per block of each call against the cache size and the prompt length: flat lines are the
    claim."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
    for ax, experiment, x in zip(
        axes, ("cache size", "prompt length"), ("num_blocks", "prompt_len")
    ):
        rows = [r for r in data["rows"] if r["experiment"] == experiment]
        for key, label in (
            ("allocate_us_per_block", "allocate (miss)"),
            ("allocate_hit_us_per_block", "allocate (hit)"),
            ("free_us_per_block", "free"),
        ):
            ax.plot([r[x] for r in rows], [r[key] for r in rows], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks in the cache" if x == "num_blocks" else "prompt tokens")
        ax.set_title(f"µs per block as the {experiment} grows")
    axes[0].set_ylabel("µs per block")
    axes[0].set_ylim(bottom=0)
    axes[0].legend()
    fig.suptitle(f"BlockManager bookkeeping on {data['device']} (block_size {data['block_size']})")
    fig.tight_layout()
    return fig


def figure_or_none(data: dict):
    """The figure, or None without matplotlib (it is not one of the package's dependencies)."""
    try:
        return plot_block_manager(data)
    except ImportError:
        print("matplotlib is not installed: no block_manager.png")
        return None


def main() -> None:
    parser = arg_parser(__doc__, "block_manager")
    parser.add_argument("--num-seqs", type=int, default=10_000)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    bs = args.block_size
    print(
        f"BlockManager micro-benchmark: {args.num_seqs:,} sequences of ~1k tokens (U[896, 1152]), "
        f"block_size {bs}, "
        f"{WAVE} alive at once, 64 decode steps each; 'allocate (hit)' re-allocates the same "
        f"prompts\n"
    )
    print("Cache size grows 256x; cost per block must not:")
    by_cache = [run_benchmark(n, args.num_seqs, bs) for n in (4_096, 65_536, 1_048_576)]
    print_table(by_cache)
    print(
        "\nPrompt length grows 16x at a fixed cache size; cost per call grows with the blocks, "
        "per block it does not:"
    )
    by_prompt = [
        run_benchmark(65_536, max(args.num_seqs // 4, WAVE), bs, prompt_len=n)
        for n in (256, 1024, 4096)
    ]
    print_table(by_prompt)
    print("\nHashing (xxh64 of parent hash + int64 token ids):")
    hash_ns = {size: hash_ns_per_token(size) for size in (16, 256)}
    for size, ns in hash_ns.items():
        print(f"  block_size {size:>3}: {ns:6.1f} ns per token")
    rows = [dict(impl="minivllm", experiment="cache size", **r) for r in by_cache] + [
        dict(impl="minivllm", experiment="prompt length", **r) for r in by_prompt
    ]
    data = result(
        "minivllm.benchmarks.block_manager",
        rows,
        device=cpu_name(),
        block_size=bs,
        hash_ns_per_token={str(size): ns for size, ns in hash_ns.items()},
    )
    save("block_manager", data, figure_or_none(data), args.out)


if __name__ == "__main__":
    main()
