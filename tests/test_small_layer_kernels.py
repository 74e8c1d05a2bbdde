"""The deep dive triton_layers' small-layer Triton kernels (fused residual add + RMSNorm, RoPE, SiLU-and-mul, one
token's GEMV) against the PyTorch layers they stand in for: on a CPU in Triton's interpreter, on a GPU (marked `gpu`)
in bfloat16, CUDA graphs included."""

import subprocess
import sys
from contextlib import ExitStack
from unittest import mock

import pytest
import torch

from minivllm import LLM, SamplingParams, load_model
from minivllm.kernels.small_layers import apply_rope, gemv, rms_norm, silu_and_mul
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.layers.rotary_embedding import RotaryEmbedding
from minivllm.layers.small_layer_kernels import use_small_layer_kernels
from minivllm.testing import prompt_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "minivllm.layers.small_layer_kernels"  # where the layers' subclasses find their kernels
# the modules use_small_layer_kernels switches in Qwen3 (the MLP: [gate | up] and the activation, one gemv)
SWITCHED = {
    "norm",
    "input_layernorm",
    "post_attention_layernorm",
    "q_norm",
    "k_norm",
    "rotary_emb",
    "qkv_proj",
    "o_proj",
    "gate_up_proj",
    "down_proj",
    "act_fn",
    "mlp",
}
FP32 = dict(rtol=1e-6, atol=1e-6)
# The interpreter's float32 -> bfloat16 casts truncate where a GPU rounds: up to a unit in the last place (2^-7
# relative) per rounding, and the fused add + RMSNorm rounds three times (new residual, normalised row, times weight).
BF16_CPU = dict(rtol=3 * 2**-7, atol=1e-5)
BF16_GPU = dict(
    rtol=2 * 2**-7, atol=1e-5
)  # rounding alone: the kernels sum and exponentiate in another order
# RoPE after the q/k norm in bfloat16: a unit in the last place of a normalised input (2^-6 at |x| in [2, 4)) moves an
# output by as much, however small the rotation leaves it
NORMED_ROPE_BF16 = dict(rtol=3 * 2**-7, atol=2 * 2**-6)
ROPE = dict(rope_theta=1e6, rope_type="default")
# another cos/sin table: Llama-3's base, unscaled (llama3 scaling is exercise 02_llama's)
LLAMA_BASE_ROPE = dict(rope_theta=500000.0, rope_type="default")


def random_norm(hidden: int, dtype: torch.dtype, device: str = DEVICE) -> RMSNorm:
    norm = RMSNorm(hidden).to(device, dtype)
    norm.weight.data.normal_(generator=torch.Generator(device).manual_seed(hidden))
    return norm


def bf16_tolerance(device: str = DEVICE) -> dict:
    return BF16_CPU if device == "cpu" else BF16_GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, hidden", [(1, 1024), (37, 1024), (37, 96), (5, 4096)])
def test_fused_add_rms_norm_matches_the_layer(dtype, num_tokens, hidden):
    norm = random_norm(hidden, dtype)
    x, residual = (
        torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE) * 3 for _ in range(2)
    )
    with torch.no_grad():
        expected, expected_residual = norm(x, residual)
        plain = norm(x)
    out, new_residual = rms_norm(x, norm.weight, norm.eps, residual)
    tolerance = FP32 if dtype == torch.float32 else bf16_tolerance()
    assert out.dtype == new_residual.dtype == dtype and out.shape == new_residual.shape == x.shape
    if dtype == torch.float32:  # the add is one float32 operation either way
        assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(new_residual, expected_residual, **tolerance)
    torch.testing.assert_close(out, expected, **tolerance)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), plain, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_strided_rows(dtype):
    """x and residual as column slices of wider tensors: each row read through its own stride."""
    norm = random_norm(96, dtype)
    x = torch.randn(37, 300, dtype=dtype, device=DEVICE)[:, 7:103]
    residual = torch.randn(37, 200, dtype=dtype, device=DEVICE)[:, 50:146]
    with torch.no_grad():
        expected = norm(x, residual)
    tolerance = FP32 if dtype == torch.float32 else bf16_tolerance()
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps, residual), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim",
    [(1, 16, 8, 128), (37, 4, 2, 96), (5, 4, 1, 32)],
)
def test_qk_norm_of_a_qkv_view_matches_the_layer(
    dtype, num_tokens, num_heads, num_kv_heads, head_dim
):
    """Qwen3's q_norm / k_norm: 3-D views (tokens, heads, head_dim) of the QKV projection's output, a row per head."""
    norm = random_norm(head_dim, dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=DEVICE)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    tolerance = FP32 if dtype == torch.float32 else bf16_tolerance()
    for view, heads in ((q, num_heads), (k, num_kv_heads)):
        view = view.view(num_tokens, heads, head_dim)
        with torch.no_grad():
            expected = norm(view)
        out = rms_norm(view, norm.weight, norm.eps)
        assert out.shape == view.shape and out.is_contiguous()
        torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.parametrize("num_tokens, intermediate", [(1, 3072), (37, 96), (3, 1500)])
def test_silu_and_mul_matches_the_layer(num_tokens, intermediate):
    x = torch.randn(num_tokens, 2 * intermediate, device=DEVICE) * 4
    # float32: not bit for bit, since exp() differs by an ulp between libraries
    torch.testing.assert_close(silu_and_mul(x), SiluAndMul()(x), **FP32)
    x16 = x.bfloat16()
    out = silu_and_mul(x16)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, intermediate)
    torch.testing.assert_close(out, SiluAndMul()(x16), **bf16_tolerance())
    wide = torch.randn(num_tokens, 2 * intermediate + 40, device=DEVICE)[
        :, 8 : 8 + 2 * intermediate
    ]  # strided rows
    torch.testing.assert_close(silu_and_mul(wide), SiluAndMul()(wide), **FP32)


@pytest.mark.parametrize(
    "n, k", [(37, 96), (4100, 700), (24, 2100)]
)  # both BLOCK_N and BLOCK_K choices, ragged
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(n, k, with_bias):
    w = torch.randn(n + 3, k, device=DEVICE)[
        :n
    ]  # a weight that is a view: its rows read through its stride
    x, bias = torch.randn(1, k, device=DEVICE), torch.randn(n, device=DEVICE) if with_bias else None
    out = gemv(x, w, bias)
    assert out.shape == (1, n) and out.dtype == x.dtype
    torch.testing.assert_close(
        out, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-4
    )  # sums reordered
    x16, w16 = x.bfloat16(), w.bfloat16()
    out16 = gemv(x16, w16)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, torch.nn.functional.linear(x16, w16), **bf16_tolerance())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_is_gemv_then_silu_and_mul(dtype):
    w = (torch.randn(2 * 300, 700, device=DEVICE) / 10).to(dtype)  # [gate | up], 300 each
    x = torch.randn(1, 700, device=DEVICE).to(dtype)
    out = gemv(x, w, gated=True)
    assert out.shape == (1, 300) and out.dtype == dtype
    assert torch.equal(out, silu_and_mul(gemv(x, w)))  # the same sums, the same roundings


@pytest.mark.parametrize(
    "make",
    [
        lambda: RowParallelLinear(96, 40, bias=True),
        lambda: ColumnParallelLinear(96, 40),
        lambda: MergedColumnParallelLinear(96, [20, 20]),
        lambda: QKVParallelLinear(96, 8, 3, 1),
    ],
    ids=["row", "column", "merged", "qkv"],
)
def test_linear_layers_run_gemv_for_one_token_only(make):
    layer = make().to(DEVICE)
    for param in layer.parameters():
        param.data.normal_()
    one, five = torch.randn(1, 96, device=DEVICE), torch.randn(5, 96, device=DEVICE)
    with torch.no_grad(), mock.patch(f"{KERNELS}.gemv", wraps=gemv) as spy:
        expected = layer(one), layer(five)
        assert spy.call_count == 0  # the PyTorch layer
        use_small_layer_kernels(layer)
        got = layer(one), layer(five)
    assert spy.call_count == 1  # switched on, at one token
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def qkv_views(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
):
    """q and k as the model makes them: strided views of one QKV projection's output."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("params", [ROPE, LLAMA_BASE_ROPE], ids=["qwen3", "theta-5e5"])
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim",
    [(1, 16, 8, 128), (37, 16, 8, 128), (37, 4, 1, 96), (6, 2, 2, 64)],
)
def test_rope_matches_the_layer(params, num_tokens, num_heads, num_kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 8192, params).to(DEVICE)
    positions = torch.randperm(8192, generator=torch.Generator().manual_seed(num_tokens))[
        :num_tokens
    ].to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, DEVICE)
        q_before, k_before = q.clone(), k.clone()
        q_out, k_out = apply_rope(positions, q, k, rope.cos, rope.sin)
        q_ref, k_ref = rope(positions, q, k)
        assert torch.equal(q, q_before) and torch.equal(k, k_before), (
            "the inputs must stay as they were"
        )
        assert (
            q_out.shape == q.shape
            and k_out.shape == k.shape
            and q_out.dtype == k_out.dtype == dtype
        )
        if (
            dtype == torch.float32 and DEVICE == "cpu"
        ):  # the same float32 operations, one by one: bit for bit
            assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
        tolerance = FP32 if dtype == torch.float32 else bf16_tolerance()
        torch.testing.assert_close(q_out, q_ref, **tolerance)
        torch.testing.assert_close(k_out, k_ref, **tolerance)
        norms = random_norm(head_dim, dtype), random_norm(head_dim, dtype)
        norms[1].weight.data.mul_(-0.5)  # q's and k's norms differ
        with torch.no_grad():
            expected = rope(positions, q, k, norms)
        tolerance = FP32 if dtype == torch.float32 else NORMED_ROPE_BF16
        torch.testing.assert_close(
            apply_rope(positions, q, k, rope.cos, rope.sin, norms), expected, **tolerance
        )


def kernel_spies():
    """The three kernels, wrapped where the layers' subclasses call them: each spy counts the calls of the layers
    switched onto them."""
    return (
        mock.patch(f"{KERNELS}.rms_norm", wraps=rms_norm),
        mock.patch(f"{KERNELS}.apply_rope", wraps=apply_rope),
        mock.patch(f"{KERNELS}.silu_and_mul", wraps=silu_and_mul),
    )


def test_the_layers_switch_to_their_kernel_subclasses_and_back():
    norm, rope, act = (
        random_norm(96, torch.float32),
        RotaryEmbedding(32, 512, ROPE).to(DEVICE),
        SiluAndMul(),
    )
    x, residual = torch.randn(5, 96, device=DEVICE), torch.randn(5, 96, device=DEVICE)
    q, k = qkv_views(5, 4, 2, 32, torch.float32, DEVICE)
    positions = torch.tensor([3, 0, 511, 7, 7], device=DEVICE)
    patches = kernel_spies()
    with torch.no_grad(), patches[0] as norm_spy, patches[1] as rope_spy, patches[2] as act_spy:
        expected = norm(x, residual), norm(x), rope(positions, q, k), act(x)
        assert (norm_spy.call_count, rope_spy.call_count, act_spy.call_count) == (
            0,
            0,
            0,
        )  # off: PyTorch ops
        params = [list(layer.parameters()) for layer in (norm, rope, act)]
        for layer, plain in ((norm, RMSNorm), (rope, RotaryEmbedding), (act, SiluAndMul)):
            assert type(layer) is plain  # the PyTorch layer, as notebook 01 builds it
            use_small_layer_kernels(layer)
            assert type(layer) is not plain and isinstance(layer, plain)  # its kernel subclass
        got = norm(x, residual), norm(x), rope(positions, q, k), act(x)
        assert (norm_spy.call_count, rope_spy.call_count, act_spy.call_count) == (
            2,
            1,
            1,
        )  # on: the kernels
        for layer in (norm, rope, act):
            use_small_layer_kernels(layer, enabled=False)
        again = norm(x, residual), norm(x), rope(positions, q, k), act(x)
        assert (norm_spy.call_count, rope_spy.call_count, act_spy.call_count) == (2, 1, 1)  # off
    assert [type(layer) for layer in (norm, rope, act)] == [RMSNorm, RotaryEmbedding, SiluAndMul]
    assert [list(layer.parameters()) for layer in (norm, rope, act)] == params  # the same objects
    torch.testing.assert_close(got, expected, **FP32)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_the_core_imports_no_small_layer_kernels():
    """The kernels belong to a deep dive: the package, the model and the core engine (notebook 06's `LLM`) import
    none of them; `minivllm.LLM` composes them (deep dive fast_engine)."""
    code = (
        "import sys, minivllm, minivllm.kernels, minivllm.models.qwen3; from minivllm.llm import LLM; "
        "from minivllm.engine.model_runner import ModelRunner; print([m for m in sys.modules if 'small_layers' in m])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("token_ids", [[5, 99, 1023, 7, 42], [99]])
def test_model_forward_with_the_kernels_equals_without(tiny, token_ids):
    """The tiny model through prompt_logits: the switch the runner turns on a GPU, here in the interpreter."""
    model = load_model(tiny, dtype=torch.float32, device=DEVICE)
    patches = (*kernel_spies(), mock.patch(f"{KERNELS}.gemv", wraps=gemv))
    classes = {name: type(m) for name, m in model.named_modules()}
    params = dict(model.named_parameters())

    def gemv_calls(gated: bool) -> int:
        return sum(call.kwargs.get("gated", False) == gated for call in gemv_spy.call_args_list)

    with torch.no_grad(), ExitStack() as stack:
        norm_spy, rope_spy, act_spy, gemv_spy = (stack.enter_context(patch) for patch in patches)
        expected = prompt_logits(model, token_ids)
        assert gemv_spy.call_count == norm_spy.call_count == 0  # off: the PyTorch layers
        use_small_layer_kernels(model)
        got = prompt_logits(model, token_ids)
        calls = (
            norm_spy.call_count,
            rope_spy.call_count,
            act_spy.call_count,
            gemv_calls(gated=False),
        )
        switched = {name for name, m in model.named_modules() if type(m) is not classes[name]}
        use_small_layer_kernels(model, enabled=False)
        again = prompt_logits(model, token_ids)
    assert {
        name: type(m) for name, m in model.named_modules()
    } == classes  # the PyTorch layers again
    assert all(p is params[name] for name, p in model.named_parameters())  # never copied
    assert {name.rsplit(".", 1)[-1] for name in switched} == SWITCHED  # the Qwen3 MLP's too
    layers, one = model.config.num_hidden_layers, len(token_ids) == 1
    # 2 norms (input, post-attention) a layer and the final one; q's and k's in RoPE's kernel. At one token, gemv:
    # qkv, o and down through the linear layers, [gate | up] with the activation from the MLP
    assert calls == (2 * layers + 1, layers, 0 if one else layers, 3 * layers if one else 0)
    assert (
        gemv_calls(gated=True) == (layers if one else 0) and norm_spy.call_count == calls[0]
    )  # only while on
    assert torch.equal(again, expected)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_tokens_with_the_kernels_equal_those_without(tiny):
    """The engine's steps (a prefill, then one-token decodes: gemv, the MLP's gated gemv), with the kernels switched
    into the runner's loaded model as the GPU runner switches them: the same greedy tokens, and back again."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = [[5, 99, 1023, 7, 42]]  # one sequence: its decode steps are one token
    with LLM(str(tiny), device="cpu", max_model_len=64, enable_prefix_caching=False) as llm:
        model = llm.engine.core.runner.model

        def tokens() -> list[int]:
            return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

        plain = tokens()
        with mock.patch(f"{KERNELS}.gemv", wraps=gemv) as gemv_spy:
            use_small_layer_kernels(model)
            fast = tokens()
            use_small_layer_kernels(model, enabled=False)
            again = tokens()
    assert fast == plain == again
    layers = model.config.num_hidden_layers
    # 2 decode steps of one token, each: qkv, o, down through the linear layers, [gate | up] with the activation
    assert gemv_spy.call_count == 2 * 4 * layers


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 16384])
def test_kernels_match_the_layers_in_bf16_on_gpu(num_tokens):
    """Qwen3-0.6B's shapes in bfloat16: hidden 1,024, 16 / 8 heads of 128, intermediate 3,072."""
    norm, q_norm = (
        random_norm(1024, torch.bfloat16, "cuda"),
        random_norm(128, torch.bfloat16, "cuda"),
    )
    x, residual = (
        torch.randn(num_tokens, 1024, dtype=torch.bfloat16, device="cuda") * 3 for _ in range(2)
    )
    q, k = qkv_views(num_tokens, 16, 8, 128, torch.bfloat16, "cuda")
    rope = RotaryEmbedding(128, 40960, ROPE).to("cuda")
    positions = torch.randint(0, 40960, (num_tokens,), device="cuda")
    gate_up = torch.randn(num_tokens, 2 * 3072, dtype=torch.bfloat16, device="cuda") * 4
    with torch.no_grad():
        pairs = [
            (rms_norm(x, norm.weight, norm.eps, residual), norm(x, residual)),
            (rms_norm(x, norm.weight, norm.eps), norm(x)),
            (rms_norm(q, q_norm.weight, q_norm.eps), q_norm(q)),
            (rms_norm(k, q_norm.weight, q_norm.eps), q_norm(k)),
            (apply_rope(positions, q, k, rope.cos, rope.sin), rope(positions, q, k)),
            (silu_and_mul(gate_up), SiluAndMul()(gate_up)),
        ]
        normed_rope = apply_rope(positions, q, k, rope.cos, rope.sin, (q_norm, q_norm))
        expected_normed_rope = rope(positions, q, k, (q_norm, q_norm))
    for got, expected in pairs:
        torch.testing.assert_close(got, expected, **BF16_GPU)
    torch.testing.assert_close(
        normed_rope, expected_normed_rope, **NORMED_ROPE_BF16
    )  # sums of squares in two halves


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n, k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
)  # qkv, o, gate_up, down
def test_gemv_matches_linear_in_bf16_on_gpu(n, k):
    x, w = (
        torch.randn(1, k, dtype=torch.bfloat16, device="cuda"),
        torch.randn(n, k, device="cuda").bfloat16() / 30,
    )
    torch.testing.assert_close(gemv(x, w), torch.nn.functional.linear(x, w), **BF16_GPU)
    if n == 6144:  # [gate | up]: the activation in the same pass, as gemv then silu_and_mul
        assert torch.equal(gemv(x, w, gated=True), silu_and_mul(gemv(x, w)))


@pytest.mark.gpu
def test_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers: what the runner's decode graphs do."""
    norm, rope = (
        random_norm(1024, torch.bfloat16, "cuda"),
        RotaryEmbedding(128, 4096, ROPE).to("cuda"),
    )
    x, residual = torch.randn(2, 8, 1024, dtype=torch.bfloat16, device="cuda")
    q, k = qkv_views(8, 16, 8, 128, torch.bfloat16, "cuda")
    positions = torch.arange(8, device="cuda")
    gate_up = torch.randn(8, 2 * 3072, dtype=torch.bfloat16, device="cuda")

    def step() -> tuple:
        normed = rms_norm(x, norm.weight, norm.eps, residual)
        return (
            normed,
            apply_rope(positions, q, k, rope.cos, rope.sin),
            silu_and_mul(gate_up),
            gemv(x[:1], residual),
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for tensor in (x, residual, q, k, gate_up):
        tensor.copy_(torch.randn_like(tensor))
    positions.copy_(torch.randperm(4096, device="cuda")[:8])
    graph.replay()
    torch.testing.assert_close(outputs, step(), rtol=0, atol=0)


@pytest.mark.gpu
def test_model_forward_with_the_kernels_in_bf16_on_gpu(tiny):
    model = load_model(tiny, dtype=torch.bfloat16, device="cuda")
    token_ids = list(range(3, 300))
    with torch.no_grad():
        expected = prompt_logits(model, token_ids).float()
        use_small_layer_kernels(model)
        got = prompt_logits(model, token_ids).float()
    assert (got - expected).abs().max().item() < 0.1
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.95
