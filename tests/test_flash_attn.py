"""The Triton prefill kernels against the reference attention, under the interpreter on CPU, in bf16 on a GPU:
notebook 01's (`flash_attn_varlen_contiguous`), the deep dive prefill_tuning's (`flash_attn_varlen_tuned`, with the
same signature) and the flash-attn entry point `flash_attn_varlen_func` (the tuned kernel, its inputs checked)."""

import random

import pytest
import torch

from minivllm.kernels import attention_ref, flash_attn_varlen_func
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous, launch_config
from minivllm.kernels.prefill_tuned import flash_attn_varlen_tuned, heads_per_program, tuned_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = {
    "core": flash_attn_varlen_contiguous,
    "tuned": flash_attn_varlen_tuned,
    "func": flash_attn_varlen_func,
}
BOUNDARY_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128]


def varlen_batch(
    q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, device=DEVICE, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    cu = lambda lens: torch.tensor(
        [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    make = lambda n, h: torch.randn(n, h, head_dim, generator=gen).to(dtype=dtype, device=device)
    return (
        make(sum(q_lens), num_heads),
        make(sum(k_lens), num_kv_heads),
        make(sum(k_lens), num_kv_heads),
        cu(q_lens),
        cu(k_lens),
    )


def check(
    q_lens,
    k_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    causal,
    dtype=torch.float32,
    tol=2e-5,
    seed=0,
    kernel="func",
):
    q, k, v, cu_q, cu_k = varlen_batch(
        q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, seed=seed
    )
    attention = KERNELS[kernel]
    out = attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", ["core", "func"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_kernel_matches_reference_on_random_varlen_batches(group, head_dim, causal, kernel):
    rng = random.Random(f"{group}-{head_dim}-{causal}")
    q_lens = rng.sample(BOUNDARY_LENGTHS, 3) + [rng.randint(1, 128)]
    check(
        q_lens,
        q_lens,
        num_heads=8,
        num_kv_heads=8 // group,
        head_dim=head_dim,
        causal=causal,
        kernel=kernel,
    )


def test_the_tuned_kernel_keeps_the_cores_query_tiles():
    """The runner sizes the paged prefill kernel's query tiles by launch_config: the tuned launch must not move
    them."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        assert tuned_config(128, device)["BLOCK_M"] == launch_config(128, device)["BLOCK_M"]


@pytest.mark.parametrize(
    "group, block_m, heads",
    [(1, 64, 1), (2, 64, 2), (8, 64, 2), (3, 64, 1), (6, 16, 2), (8, 16, 8)],
)
def test_a_program_serves_the_heads_of_one_kv_head_in_a_tile_of_128_rows_at_most(
    group, block_m, heads
):
    assert heads_per_program(group, block_m) == heads


@pytest.mark.parametrize(
    "num_heads", [6, 12]
)  # groups of 3 (a program per head) and 6 (two heads a program)
def test_groups_that_are_not_powers_of_two_match_the_reference(num_heads):
    check([40, 7], [40, 7], num_heads=num_heads, num_kv_heads=2, head_dim=32, causal=True)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_with_cached_prefix_and_fewer_keys_than_queries(causal, kernel):
    """len_k > len_q: a prompt continuing after cached tokens; len_k < len_q: early queries see no key (zeros)."""
    check(
        [5, 17, 1, 40],
        [40, 17, 100, 3],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        causal=causal,
        kernel=kernel,
    )


@pytest.mark.parametrize("kernel", ["core", "tuned"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision(dtype, kernel):
    check(
        [33, 16, 7],
        [33, 16, 7],
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        causal=True,
        dtype=dtype,
        tol=2e-2,
        kernel=kernel,
    )


@pytest.mark.parametrize("kernel", ["core", "tuned"])
@pytest.mark.parametrize("block_m, block_n", [(32, 16), (16, 64)])
def test_a_tile_given_by_the_caller_is_used_and_exact(block_m, block_n, kernel):
    """The benchmark's sweep and notebook 01's question pass tiles: each must give the same attention."""
    q_lens = [1, 40, 17]
    q, k, v, cu_q, cu_k = varlen_batch(q_lens, q_lens, 4, 2, 32)
    tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1, num_stages=1)
    out = KERNELS[kernel](q, k, v, cu_q, cu_k, 40, 40, causal=True, tile=tile)
    torch.testing.assert_close(
        out, attention_ref(q, k, v, cu_q, cu_k, causal=True), rtol=2e-5, atol=2e-5
    )
    with pytest.raises(
        KeyError
    ):  # the tile really reaches the launch: one without BLOCK_M cannot run
        KERNELS[kernel](q, k, v, cu_q, cu_k, 40, 40, causal=True, tile=dict(BLOCK_N=16))


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_softmax_scale_and_strided_inputs(kernel):
    qkv = torch.randn(
        50, 4 + 2 + 2, 32, device=DEVICE
    )  # q, k, v packed as one projection output, as in a model
    q, k, v = qkv.split([4, 2, 2], dim=1)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32, device=DEVICE)
    out = KERNELS[kernel](q, k, v, cu, cu, 30, 30, softmax_scale=0.3, causal=True)
    torch.testing.assert_close(
        out, attention_ref(q, k, v, cu, cu, softmax_scale=0.3, causal=True), rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize(
    "bad, argument",
    [
        (dict(q=torch.randn(10, 4, 32)[..., None]), "q must be"),
        (dict(k=torch.randn(10, 2, 64), v=torch.randn(10, 2, 64)), "head_dim"),
        (
            dict(q=torch.randn(10, 4, 48), k=torch.randn(10, 2, 48), v=torch.randn(10, 2, 48)),
            "head_dim",
        ),
        (dict(q=torch.randn(10, 3, 32)), "num_heads"),
        (dict(v=torch.randn(10, 2, 32, dtype=torch.float64)), "v.dtype"),
        (dict(k=torch.randn(10, 2, 32, dtype=torch.float16)), "share a dtype"),
        (dict(v=torch.randn(9, 2, 32)), "same shape"),
        (dict(cu_seqlens_q=torch.tensor([0, 10])), "cu_seqlens_q"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32)), "same length"),
        (dict(max_seqlen_q=0), "max_seqlen_q"),
        (
            dict(softmax_scale=0.0),
            "softmax_scale",
        ),  # the kernels scale a row's maximum and the masked -inf
        (dict(softmax_scale=-0.1), "softmax_scale"),
        (dict(softmax_scale=float("nan")), "softmax_scale"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(bad, argument):
    args = (
        dict(
            q=torch.randn(10, 4, 32),
            k=torch.randn(10, 2, 32),
            v=torch.randn(10, 2, 32),
            cu_seqlens_q=torch.tensor([0, 10], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32),
            max_seqlen_q=10,
            max_seqlen_k=10,
        )
        | bad
    )
    with pytest.raises(ValueError, match=argument):
        flash_attn_varlen_func(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["core", "tuned"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_bf16_on_gpu(group, head_dim, causal, kernel):
    rng = random.Random(f"gpu-{group}-{head_dim}-{causal}")
    q_lens = BOUNDARY_LENGTHS + [rng.randint(129, 3000) for _ in range(4)]
    k_lens = [
        n + rng.choice([0, 0, 7, 300]) for n in q_lens
    ]  # some sequences continue after a cached prefix
    check(
        q_lens,
        k_lens,
        num_heads=16,
        num_kv_heads=16 // group,
        head_dim=head_dim,
        causal=causal,
        dtype=torch.bfloat16,
        tol=2e-2,
        kernel=kernel,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["core", "tuned"])
def test_kernel_fp32_on_gpu_is_exact_not_tf32(kernel):
    check(
        [300, 1000],
        [300, 1000],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        causal=True,
        tol=1e-4,
        kernel=kernel,
    )
