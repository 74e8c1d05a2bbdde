"""Paged decode attention: our Triton kernel vs a naive gather + SDPA, vs our prefill kernel used
for decode, and vs FlashInfer's paged decode where the `flashinfer` package is installed.

    python -m minivllm.benchmarks.decode [--out figures]

Qwen3-0.6B's attention (16 query / 8 KV heads, head_dim 128, bf16), one new query per sequence, the
context spread over a shuffled block table. Bandwidth counts the bytes of K and V read: batch ×
context × 8 × 128 × 2 × 2. Each call is timed from a CUDA graph, as the engine's decode step runs
(FlashInfer's plan runs before, outside the graph). Writes decode.json + decode.png, with the
device's copy bandwidth (read + write) as the ceiling, and prints per shape how fast ours is against
FlashInfer (ratios in the JSON).
"""

import importlib

import torch

from minivllm.benchmarks.common import (
    HAS_FLASHINFER,
    arg_parser,
    copy_tbps,
    graph_ms,
    package_version,
    require_gpu,
    result,
    save,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
# (batch, context_len)
SHAPES = [(1, 16384), (8, 8192), (32, 2048), (64, 4096), (256, 1024), (256, 512)]


def paged_inputs(batch: int, context_len: int, block_size: int, dtype=torch.bfloat16) -> dict:
    blocks_per_seq = context_len // block_size
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(
        num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda"
    )
    arange = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return dict(
        context_len=context_len,
        cu_seqlens_q=arange,
        cu_seqlens_k=arange * context_len,
        q=torch.randn(batch, 1, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda"),
        k_cache=k_cache,
        v_cache=torch.randn_like(k_cache),
        block_table=torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int(),
        cache_seqlens=torch.full((batch,), context_len, dtype=torch.int32, device="cuda"),
    )


def naive_gather_sdpa(x: dict) -> torch.Tensor:
    """Copy each sequence's blocks into a contiguous tensor, then PyTorch SDPA (all sequences
    equally long)."""
    q, k_cache, v_cache, block_table = x["q"], x["k_cache"], x["v_cache"], x["block_table"]
    batch = q.shape[0]
    # (batch, kv_heads, ctx, D)
    k = k_cache[block_table].view(batch, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = v_cache[block_table].view(batch, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, enable_gqa=True
    )


def prefill_kernel_as_decode(x: dict) -> torch.Tensor:
    """Notebook 01's design used for decode: a tile of 64 positions holding 1 query per head."""
    # the paged prefill deep dive's: on a GPU only
    from minivllm.kernels import flash_attn_varlen_func

    return flash_attn_varlen_func(
        x["q"][:, 0],
        x["k_cache"],
        x["v_cache"],
        x["cu_seqlens_q"],
        x["cu_seqlens_k"],
        1,
        x["context_len"],
        causal=True,
        block_table=x["block_table"],
    )


def minivllm_decode(x: dict) -> torch.Tensor:
    """Notebook 03's decode kernel as the engine runs it on a GPU: its split count in SM waves."""
    # the deep dive cascade_attention's: on a GPU only
    from minivllm.kernels.cascade import flash_attn_with_kvcache

    return flash_attn_with_kvcache(
        x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["block_table"]
    )


IMPLS = {
    "minivllm-triton": minivllm_decode,
    "minivllm-prefill-kernel": prefill_kernel_as_decode,
    "naive-gather-sdpa": naive_gather_sdpa,
}


def flashinfer_decode(x: dict):
    """FlashInfer's paged decode (BatchDecodeWithPagedKVCacheWrapper, NHD pages = our cache blocks)
    over the same cache and block table, planned here, once, outside the timing. Its CUDA-graph
    mode, as engines capture it: fixed index buffers, plan before capture, run() alone is
    replayed."""
    flashinfer = importlib.import_module("flashinfer")
    block_table = x["block_table"]
    batch, blocks_per_seq = block_table.shape
    block_size = x["k_cache"].shape[1]
    # sequence i: its row
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * blocks_per_seq
    # the pages of sequence i, in order: indices[indptr[i]:indptr[i + 1]]
    indices = block_table.flatten()
    # tokens in each last page (1..block_size)
    last_page_len = x["cache_seqlens"] - (blocks_per_seq - 1) * block_size
    # FlashInfer's advice: 128 MB, zeroed
    workspace = torch.zeros(128 * 1024**2, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        kv_layout="NHD",
        use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty_like(indices),
        paged_kv_last_page_len_buffer=torch.empty_like(last_page_len),
    )
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        block_size,
        pos_encoding_mode="NONE",
        q_data_type=x["q"].dtype,
        kv_data_type=x["k_cache"].dtype,
    )
    # (batch, num_heads, head_dim)
    return lambda x: wrapper.run(x["q"][:, 0], (x["k_cache"], x["v_cache"]))


def impls_for(x: dict) -> dict:
    """IMPLS, plus FlashInfer planned for x's shape where it is installed (beside ours, in the
    figure too)."""
    if not HAS_FLASHINFER:
        return dict(IMPLS)
    ours, *others = IMPLS.items()
    return dict([ours, ("flashinfer", flashinfer_decode(x)), *others])


def run_decode_benchmark(
    shapes=SHAPES, block_sizes=(16, 256), module: str = "minivllm.benchmarks.decode"
) -> dict:
    rows, ratios = [], []
    for block_size in block_sizes:
        for batch, context_len in shapes:
            x = paged_inputs(batch, context_len, block_size)
            ref = naive_gather_sdpa(x).transpose(1, 2)
            nbytes = 2 * batch * context_len * NUM_KV_HEADS * HEAD_DIM * x["k_cache"].element_size()
            ms_of = {}
            for impl, fn in impls_for(x).items():
                # before any timing
                torch.testing.assert_close(fn(x).view_as(ref), ref, atol=2e-2, rtol=2e-2)
                ms = graph_ms(lambda fn=fn, x=x: fn(x))
                rows.append(
                    dict(
                        impl=impl,
                        batch=batch,
                        context_len=context_len,
                        block_size=block_size,
                        ms=ms,
                        tbps=nbytes / (ms * 1e-3) / 1e12,
                    )
                )
                ms_of[impl] = ms
                shape = f"bs={block_size:>3} batch={batch:>3} ctx={context_len:>5}"
                us, tbps = ms * 1e3, rows[-1]["tbps"]
                speed = f"{us:8.1f} µs {tbps:5.2f} TB/s"
                print(f"{impl:>24} {shape}: {speed}")
            if "flashinfer" in ms_of:  # > 1: ours is faster
                ratio = ms_of["flashinfer"] / ms_of["minivllm-triton"]
                ratios.append(
                    dict(
                        batch=batch,
                        context_len=context_len,
                        block_size=block_size,
                        vs="flashinfer",
                        speedup=ratio,
                    )
                )
                print(
                    f"{'ours / flashinfer':>24} bs={block_size:>3} batch={batch:>3} "
                    f"ctx={context_len:>5}: {ratio:.2f}×"
                )
            del x
    return result(
        module,
        rows,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        copy_tbps=copy_tbps(),
        timing="CUDA graph replay (triton.testing.do_bench_cudagraph)",
        flashinfer=package_version("flashinfer-python"),
        # per shape, speedup: minivllm-triton's speed over flashinfer's (its ms / ours); [] without
        # it
        ratios=ratios,
    )


def shape_label(batch: int, context_len: int) -> str:
    """'4×2k' for 4 sequences of 2048 tokens each."""
    context = f"{context_len // 1024}k" if context_len % 1024 == 0 else f"{context_len}"
    return f"{batch}×{context}"


def plot_decode(data: dict):
    import matplotlib.pyplot as plt

    block_sizes = sorted({r["block_size"] for r in data["rows"]})
    impls = list(dict.fromkeys(r["impl"] for r in data["rows"]))
    fig, axes = plt.subplots(
        1, len(block_sizes), figsize=(5.4 * len(block_sizes), 4.2), sharey=True, squeeze=False
    )
    axes = axes[0]
    for ax, block_size in zip(axes, block_sizes):
        rows = [r for r in data["rows"] if r["block_size"] == block_size]
        shapes = list(dict.fromkeys((r["batch"], r["context_len"]) for r in rows))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            tbps = {(r["batch"], r["context_len"]): r["tbps"] for r in rows if r["impl"] == impl}
            ax.bar(
                [j + i * width for j in range(len(shapes))],
                [tbps.get(s, 0) for s in shapes],
                width,
                label=impl,
            )
        ax.axhline(
            data["copy_tbps"],
            color="grey",
            ls=":",
            label=f"copy bandwidth {data['copy_tbps']:.2f} TB/s",
        )
        ticks = [shape_label(batch, context_len) for batch, context_len in shapes]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], ticks)
        ax.set_xlabel("batch × context")
        ax.set_title(f"block size {block_size}")
    axes[0].set_ylabel("TB/s of K and V read")
    # below the bars: inside, it would cover the tallest
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=len(labels), fontsize=8)
    fig.suptitle(f"Paged decode attention on {data['device']} (16/8 heads, d=128, bf16)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def main() -> None:
    args = arg_parser(__doc__, "decode").parse_args()
    require_gpu()
    data = run_decode_benchmark()
    save("decode", data, plot_decode(data), args.out)


if __name__ == "__main__":
    main()
