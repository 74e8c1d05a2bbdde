"""Paged KV-cache kernels (notebook 03, its deep dives cascade_attention and paged_prefill) against the reference
attention, under the interpreter and on a GPU."""

import random

import pytest
import torch

from minivllm.attention.fast_paged import query_tiles
from minivllm.kernels import (
    attention_ref,
    cascade,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    store_kvcache,
)
from minivllm.kernels.flash_attn import launch_config
from minivllm.testing import scatter_into_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check_decode(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    tol=1e-4,
    decode=flash_attn_with_kvcache,
    **kwargs,
):
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(
        seq_lens, num_kv_heads, head_dim, block_size, DEVICE, dtype
    )
    q = torch.randn(len(seq_lens), 1, num_heads, head_dim, device=DEVICE).to(dtype)
    seqlens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode(q, k_cache, v_cache, seqlens, block_table, **kwargs)
    cu_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = attention_ref(q[:, 0], k, v, cu_q, cu_k)
    torch.testing.assert_close(out[:, 0].float(), ref.float(), rtol=tol, atol=tol)


def test_store_kvcache_writes_slots_and_skips_padding():
    k_cache = torch.zeros(3, 16, 2, 8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(4, 2, 8, device=DEVICE), torch.randn(4, 2, 8, device=DEVICE)
    store_kvcache(k, v, k_cache, v_cache, torch.tensor([47, -1, 0, 16], device=DEVICE))
    flat_k, flat_v = k_cache.view(48, 2, 8), v_cache.view(48, 2, 8)
    for slot, i in ((47, 0), (0, 2), (16, 3)):
        torch.testing.assert_close(flat_k[slot], k[i])
        torch.testing.assert_close(flat_v[slot], v[i])
    assert flat_k.abs().sum(dim=(1, 2)).count_nonzero() == 3


@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_decode_matches_reference(block_size, group):
    rng = random.Random(f"{block_size}-{group}")
    seq_lens = [1, block_size, block_size + 1] + [rng.randint(1, 300) for _ in range(3)]
    check_decode(seq_lens, num_heads=8, num_kv_heads=8 // group, head_dim=32, block_size=block_size)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_decode_split_k_combines_exactly(monkeypatch, num_splits):
    """Split-K (the deep dive cascade_attention's) at any number of splits, including splits that
    get no tokens."""
    monkeypatch.setattr(cascade, "decode_num_splits", lambda *_: num_splits)
    check_decode([1, 5, 100, 257], 4, 2, 32, 16, decode=cascade.flash_attn_with_kvcache)


def test_cascade_without_a_prefix_is_the_core_kernel_with_its_split_count(monkeypatch):
    """The deep dive's kernel, no prefix given, at the split counts decode_num_splits picks."""
    for splits in (1, 5):
        monkeypatch.setattr(cascade, "decode_num_splits", lambda *_, n=splits: n)
        check_decode([1, 5, 100, 257], 4, 2, 32, 16, decode=cascade.flash_attn_with_kvcache)


def test_decode_num_splits_fills_one_wave_of_the_sms(monkeypatch):
    monkeypatch.setattr(cascade, "num_sms", lambda device: 132)
    gpu = torch.device("cuda")
    splits = [cascade.decode_num_splits(batch, 8, gpu) for batch in (1, 8, 64, 66, 67, 256)]
    assert splits == [66, 8, 1, 1, 2, 2]  # a wave: 4 programs per SM; 2 past it
    assert (
        cascade.decode_num_splits(1, 1, gpu) == 128
        and cascade.decode_num_splits(1, 8, torch.device("cpu")) == 1
    )


def test_decode_half_precision():
    check_decode(
        [33, 100],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        tol=2e-2,
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(
    "group", [1, 2, 3]
)  # a program per query head, per KV head's two, per head again (3)
def test_paged_prefill_attends_to_the_cached_prefix(block_size, causal, group):
    k_lens, q_lens = (
        [40, 17, 300, 1],
        [5, 17, 64, 1],
    )  # cached prefix + new tokens; none cached; ...
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(
        k_lens, 2, 32, block_size, DEVICE
    )
    q = torch.randn(sum(q_lens), 2 * group, 32, device=DEVICE)
    cu_q = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    out = flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_q,
        cu_k,
        max(q_lens),
        max(k_lens),
        causal=causal,
        block_table=block_table,
    )
    torch.testing.assert_close(
        out, attention_ref(q, k, v, cu_q, cu_k, causal=causal), rtol=1e-4, atol=1e-4
    )
    rest = torch.full_like(
        q, 7.0
    )  # out=: the last two sequences' rows only, through sliced index tensors
    flash_attn_varlen_func(q, k_cache, v_cache, cu_q[2:], cu_k[2:], 64, 300, causal=causal, block_table=block_table[2:],
                           out=rest)  # fmt: skip
    torch.testing.assert_close(rest[22:], out[22:])
    assert (rest[:22] == 7.0).all()


def test_paged_prefill_computes_the_listed_tiles_only():
    """A tile list (the engine's, padded with -1 as in a CUDA graph): each listed (sequence, query tile) is computed,
    the rest of `out` is left as it was; and the list query_tiles makes covers each sequence after the first ones."""
    k_lens, q_lens = [40, 70, 33, 300], [1, 40, 33, 64]
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(k_lens, 2, 32, 16, DEVICE)
    q = torch.randn(sum(q_lens), 4, 32, device=DEVICE)
    cu_q = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    block_m = launch_config(32, q.device)["BLOCK_M"]
    tiles = query_tiles(cu_q.cpu().numpy(), cu_k.cpu().numpy(), 1, block_m)  # sequences 1, 2, 3
    assert sorted(map(tuple, tiles.tolist())) == [
        (s, m) for s in (1, 2, 3) for m in range(-(-q_lens[s] // block_m))
    ]
    keys = [k_lens[s] - q_lens[s] + min((m + 1) * block_m, q_lens[s]) for s, m in tiles.tolist()]
    assert keys == sorted(keys, reverse=True)  # the tiles that see the most keys first
    padded = torch.tensor([*tiles.tolist(), [-1, -1], [-1, -1]], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, 7.0)
    flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 64, 300, causal=True, block_table=block_table, out=out,
                           tiles=padded)  # fmt: skip
    assert (out[:1] == 7.0).all()  # sequence 0 is not in the list
    torch.testing.assert_close(out[1:], ref[1:], rtol=1e-4, atol=1e-4)
    none = torch.zeros(
        0, 2, dtype=torch.int32, device=DEVICE
    )  # a step of decode rows only: no tiles
    kept = torch.full_like(q, 7.0)
    assert flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 64, 300, block_table=block_table, out=kept,
                                  tiles=none) is kept  # fmt: skip
    assert (kept == 7.0).all()
    with pytest.raises(
        ValueError, match="need block_table"
    ):  # the contiguous kernel would ignore them
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 300, causal=True, out=out)


def test_decode_leaves_rows_with_an_empty_cache_alone():
    """A CUDA graph's decode rows past the step's decode rows have an empty cache: their output rows are not
    written (in a mixed step they are prompt tokens' rows): the GPU runner's kernel, deep dive cascade_attention."""
    decode = cascade.flash_attn_with_kvcache
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache([30, 5], 2, 32, 16, DEVICE)
    q = torch.randn(3, 1, 4, 32, device=DEVICE)
    lens = torch.tensor([30, 0, 5], dtype=torch.int32, device=DEVICE)
    tables = torch.stack([block_table[0], block_table[0], block_table[1]])
    out = torch.full_like(q, 7.0)
    decode(q, k_cache, v_cache, lens, tables, out=out)
    assert (out[1] == 7.0).all()
    cu_q = torch.arange(3, dtype=torch.int32, device=DEVICE)
    ref = attention_ref(q[[0, 2], 0], k, v, cu_q, cu_k)
    torch.testing.assert_close(out[[0, 2], 0], ref, rtol=1e-4, atol=1e-4)


def check_shared_prefix(
    seq_lens, sharers, prefix_blocks, num_heads, num_kv_heads, block_size, dtype, tol
):
    """Rows `sharers` begin with row 0's first prefix_blocks blocks; with the prefix given, each row's output is
    what the decode kernel gives reading every key row by row (checked against the reference above)."""
    k_cache, v_cache, block_table, _, _, _ = scatter_into_cache(seq_lens, num_kv_heads, 128 if dtype != torch.float32
                                                                else 32, block_size, DEVICE, dtype)  # fmt: skip
    block_table[sharers, :prefix_blocks] = block_table[0, :prefix_blocks]
    prefix_lens = torch.zeros(len(seq_lens), dtype=torch.int32, device=DEVICE)
    prefix_lens[[0, *sharers]] = prefix_blocks * block_size
    q = torch.randn(len(seq_lens), 1, num_heads, k_cache.shape[-1], device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    row_by_row = cascade.flash_attn_with_kvcache(q, k_cache, v_cache, lens, block_table)
    out = cascade.flash_attn_with_kvcache(q, k_cache, v_cache, lens, block_table,
                                          prefix_blocks=block_table[0, :prefix_blocks], prefix_lens=prefix_lens)  # fmt: skip
    torch.testing.assert_close(out.float(), row_by_row.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("splits", [(1, 1), (2, 3), (5, 2)])
def test_shared_prefix_gives_the_row_by_row_output(monkeypatch, group, splits):
    """Cascade attention (deep dive cascade_attention): the prefix kernel's partial results are more splits of each
    row. Rows that do not share the prefix, a row whose keys are all prefix, splits with no keys, and GQA groups that
    are not powers of 2."""
    monkeypatch.setattr(cascade, "decode_num_splits", lambda *_: splits[0])
    monkeypatch.setattr(cascade, "prefix_num_splits", lambda *_: splits[1])
    check_shared_prefix(
        [70, 49, 100, 48, 33, 200], [1, 2, 3, 5], 3, 2 * group, 2, 16, torch.float32, 1e-4
    )


def test_bad_decode_input_raises_value_error():
    k_cache = torch.zeros(2, 16, 2, 32)
    q, seqlens, table = (
        torch.randn(1, 1, 4, 32),
        torch.tensor([5], dtype=torch.int32),
        torch.zeros(1, 2, dtype=torch.int32),
    )
    # the public drop-in checks its inputs; notebook 03's kernel trusts the engine's
    checked = cascade.flash_attn_with_kvcache
    with pytest.raises(ValueError, match="q must be"):
        checked(q[0], k_cache, k_cache, seqlens, table)
    with pytest.raises(
        ValueError, match="go together"
    ):  # a shared prefix's blocks, and who shares them
        cascade.flash_attn_with_kvcache(q, k_cache, k_cache, seqlens, table, prefix_blocks=table[0])
    with pytest.raises(ValueError, match="one row per sequence"):
        cascade.flash_attn_with_kvcache(q, k_cache, k_cache, seqlens, table, prefix_blocks=table[0],
                                        prefix_lens=torch.zeros(2, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="k_cache"):
        checked(q, k_cache.half(), k_cache, seqlens, table)
    with pytest.raises(ValueError, match="cache_seqlens"):
        checked(q, k_cache, k_cache, seqlens.long(), table)
    with pytest.raises(ValueError, match="block_table"):
        checked(q, k_cache, k_cache, seqlens, None)
    with pytest.raises(ValueError, match="softmax_scale"):
        checked(q, k_cache, k_cache, seqlens, table, softmax_scale=0.0)
    with pytest.raises(ValueError, match="softmax_scale"):  # notebook 03's kernel too
        flash_attn_with_kvcache(q, k_cache, k_cache, seqlens, table, softmax_scale=0.0)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="softmax_scale"):  # the paged prefill kernel too
        flash_attn_varlen_func(q[0, :1].expand(5, -1, -1), k_cache, k_cache, cu, cu, 5, 5, softmax_scale=-1.0,
                               block_table=table)  # fmt: skip
    with pytest.raises(ValueError, match="out must be"):
        checked(q, k_cache, k_cache, seqlens, table, out=torch.empty(1, 1, 4, 16))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(
            torch.randn(3, 2, 32),
            torch.randn(3, 2, 32),
            k_cache,
            k_cache,
            torch.zeros(2, dtype=torch.long),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_bf16_on_gpu(batch, group, block_size):
    rng = random.Random(f"gpu-{batch}-{group}-{block_size}")
    seq_lens = [rng.randint(1, 5000) for _ in range(batch)]
    check_decode(
        seq_lens,
        num_heads=16,
        num_kv_heads=16 // group,
        head_dim=128,
        block_size=block_size,
        dtype=torch.bfloat16,
        tol=2e-2,
    )


@pytest.mark.gpu
def test_paged_prefill_bf16_on_gpu():
    k_lens, q_lens = [3000, 700, 129], [1000, 700, 1]
    k_cache, v_cache, block_table, k, v, cu_k = scatter_into_cache(
        k_lens, 8, 128, 16, DEVICE, torch.bfloat16
    )
    q = torch.randn(sum(q_lens), 16, 128, device=DEVICE, dtype=torch.bfloat16)
    cu_q = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    out = flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_q,
        cu_k,
        max(q_lens),
        max(k_lens),
        causal=True,
        block_table=block_table,
    )
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_shared_prefix_bf16_on_gpu(block_size):
    """A chat step's shape: 200 rows, 190 of which share a 1,536-token prefix, with the engine's split counts."""
    rng = random.Random(block_size)
    seq_lens = [rng.randint(1600, 2200) for _ in range(200)]
    prefix_blocks = 1536 // block_size
    check_shared_prefix(
        seq_lens, list(range(1, 190)), prefix_blocks, 16, 8, block_size, torch.bfloat16, 2e-2
    )
