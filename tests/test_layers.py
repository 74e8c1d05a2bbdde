"""Every layer of notebook 01 against PyTorch / transformers, and tensor parallel 2 (gloo) against 1."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from distributed import run_on_ranks
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from minivllm.kernels.reference import attention_ref
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.layers.rotary_embedding import get_rope, rope_parameters


def test_silu_and_mul_matches_torch():
    gate, up = torch.randn(9, 64), torch.randn(9, 64)
    torch.testing.assert_close(SiluAndMul()(torch.cat([gate, up], -1)), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_qwen3_bitwise(dtype):
    ref, ours = Qwen3RMSNorm(96, eps=1e-6), RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
        ours.weight.copy_(ref.weight)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x, residual = torch.randn(11, 96, dtype=dtype) * 3, torch.randn(11, 96, dtype=dtype)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref(x + residual), rtol=0, atol=0)


def test_linears_load_hf_tensors():
    hidden, head_dim, heads, kv_heads = 64, 16, 8, 2
    x = torch.randn(5, hidden)
    wq, wk, wv = (
        torch.randn(heads * head_dim, hidden),
        torch.randn(kv_heads * head_dim, hidden),
        torch.randn(kv_heads * head_dim, hidden),
    )
    qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
    for shard_id, w in zip("qkv", (wq, wk, wv)):
        qkv.weight.weight_loader(qkv.weight, w, shard_id)
    torch.testing.assert_close(qkv(x), torch.cat([x @ wq.T, x @ wk.T, x @ wv.T], -1))

    wg, wu = torch.randn(48, hidden), torch.randn(48, hidden)
    gate_up = MergedColumnParallelLinear(hidden, [48, 48])
    gate_up.weight.weight_loader(gate_up.weight, wg, 0)
    gate_up.weight.weight_loader(gate_up.weight, wu, 1)
    torch.testing.assert_close(gate_up(x), torch.cat([x @ wg.T, x @ wu.T], -1))

    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(hidden, 32, bias=True)
        w, b = torch.randn(32, hidden), torch.randn(32)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_loaders_reject_mis_shaped_tensors():
    qkv = QKVParallelLinear(64, 16, 4, 2)
    with pytest.raises(ValueError, match=r"QKVParallelLinear\[k\].*\(32, 64\).*\(16, 64\)"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(16, 64), "k")
    with pytest.raises(ValueError, match="RowParallelLinear"):
        row = RowParallelLinear(64, 32)
        row.weight.weight_loader(row.weight, torch.randn(64, 32))
    with pytest.raises(ValueError, match="VocabParallelEmbedding"):
        emb = VocabParallelEmbedding(100, 8)
        emb.weight.weight_loader(emb.weight, torch.randn(99, 8))


def test_embedding_and_lm_head():
    table = torch.randn(64, 16)
    emb, head = VocabParallelEmbedding(64, 16), ParallelLMHead(64, 16)
    emb.weight.weight_loader(emb.weight, table)
    head.weight.weight_loader(head.weight, table)
    ids = torch.tensor([0, 63, 7, 7, 32])
    torch.testing.assert_close(emb(ids), table[ids])
    torch.testing.assert_close(head(table[ids]), table[ids] @ table.T)


# --- tensor parallel: world size 2 over gloo gives what world size 1 gives -------------------------------------

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER, VOCAB = 32, 8, 4, 2, 48, 64


def tp_forward(seed: int) -> dict:
    """Build the layers on this rank from the same full HF-shaped tensors and run them; full outputs per layer."""
    gen = torch.Generator().manual_seed(seed)
    w = {
        name: torch.randn(*shape, generator=gen)
        for name, shape in dict(
            q=(HEADS * HEAD_DIM, HIDDEN),
            k=(KV_HEADS * HEAD_DIM, HIDDEN),
            v=(KV_HEADS * HEAD_DIM, HIDDEN),
            o=(HIDDEN, HEADS * HEAD_DIM),
            gate=(INTER, HIDDEN),
            up=(INTER, HIDDEN),
            down=(HIDDEN, INTER),
            embed=(VOCAB, HIDDEN),
            col=(24, HIDDEN),
        ).items()
    }
    x = torch.randn(6, HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (10,), generator=gen)

    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
    for shard_id in "qkv":
        qkv.weight.weight_loader(qkv.weight, w[shard_id], shard_id)
    o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN)
    o_proj.weight.weight_loader(o_proj.weight, w["o"])
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
    gate_up.weight.weight_loader(gate_up.weight, w["gate"], 0)
    gate_up.weight.weight_loader(gate_up.weight, w["up"], 1)
    down = RowParallelLinear(INTER, HIDDEN)
    down.weight.weight_loader(down.weight, w["down"])
    col = ColumnParallelLinear(HIDDEN, 24)
    col.weight.weight_loader(col.weight, w["col"])
    emb, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
    emb.weight.weight_loader(emb.weight, w["embed"])
    head.weight.weight_loader(head.weight, w["embed"])

    with torch.no_grad():
        q_size = qkv.num_heads * HEAD_DIM
        q = qkv(x)[:, :q_size]  # this rank's query heads: the input of its slice of o_proj
        return dict(
            attn_out=o_proj(q),  # column then row parallel: all-reduced, full on every rank
            mlp=down(SiluAndMul()(gate_up(x))),
            col=col(x),  # this rank's output slice
            embed=emb(ids),
            logits=head(x),
        )


@pytest.mark.slow
def test_tensor_parallel_2_equals_1():
    single = tp_forward(0)
    ranks = run_on_ranks(tp_forward, 2, 0)
    for name in ("attn_out", "mlp", "embed", "logits"):
        for result in ranks:
            # partial sums add in another order
            torch.testing.assert_close(result[name], single[name], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.cat([r["col"] for r in ranks], -1), single["col"])
    assert ranks[0]["col"].shape[-1] == 12  # each rank really held half


# --- RoPE ------------------------------------------------------------------------------------------------


def hf_rotate(config, rope_cls, q, k, positions):
    cos, sin = rope_cls(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rope_matches_qwen3(head_dim):
    config = Qwen3Config(
        head_dim=head_dim, num_attention_heads=4, max_position_embeddings=8192, rope_theta=1e6
    )
    positions = torch.tensor([0, 1, 2, 511, 4096, 8191])
    q, k = torch.randn(6, 4, head_dim), torch.randn(6, 2, head_dim)
    q_ref, k_ref = hf_rotate(config, Qwen3RotaryEmbedding, q, k, positions)
    q_ours, k_ours = get_rope(config, head_dim)(positions, q, k)
    torch.testing.assert_close(q_ours, q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(k_ours, k_ref, rtol=0, atol=1e-6)


def test_rope_reads_old_and_new_config_styles():
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling=None, max_position_embeddings=128)
    older = SimpleNamespace(
        rope_theta=500000.0, rope_scaling={"type": "default"}, max_position_embeddings=128
    )
    new = SimpleNamespace(
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        max_position_embeddings=128,
    )
    bare = SimpleNamespace(max_position_embeddings=128)
    expected = {"rope_theta": 500000.0, "rope_type": "default"}
    assert rope_parameters(old) == rope_parameters(new) == rope_parameters(older) == expected
    assert rope_parameters(bare) == {"rope_theta": 10000.0, "rope_type": "default"}
    torch.testing.assert_close(get_rope(old, 64).cos, get_rope(new, 64).cos)


@pytest.mark.parametrize("rope_type", ["yarn", "llama3"])
def test_rope_refuses_scaled_ropes(rope_type):
    """Plain RoPE only: Llama-3's scaling is exercise 02_llama's (tests/test_exercises.py)."""
    with pytest.raises(ValueError, match=f"rope_type='{rope_type}' is not supported"):
        rope_parameters(SimpleNamespace(rope_scaling={"rope_type": rope_type, "factor": 4.0}))


# --- reference attention ----------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention_ref_matches_sdpa(causal, group):
    lens = [5, 1, 33]
    cu = torch.tensor([0, 5, 6, 39], dtype=torch.int32)
    q, k, v = (
        torch.randn(39, 8, 32),
        torch.randn(39, 8 // group, 32),
        torch.randn(39, 8 // group, 32),
    )
    out = attention_ref(q, k, v, cu, cu, causal=causal)
    for i, n in enumerate(lens):
        s = slice(cu[i].item(), cu[i].item() + n)
        expand = lambda t, s=s: t[s].repeat_interleave(group, 1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(
            q[s].transpose(0, 1), expand(k), expand(v), is_causal=causal
        )
        torch.testing.assert_close(out[s], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_attention_ref_bottom_right_causal():
    """2 new queries after 3 cached keys: query 0 sees keys 0..3, query 1 sees 0..4 (flash-attn's convention)."""
    q, k = (
        torch.zeros(2, 1, 16),
        torch.zeros(5, 1, 16),
    )  # equal scores: the output is the mean of visible values
    v = torch.arange(5, dtype=torch.float32)[:, None, None].expand(5, 1, 16).contiguous()
    out = attention_ref(q, k, v, torch.tensor([0, 2]), torch.tensor([0, 5]), causal=True)
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([1.5, 2.0]))
