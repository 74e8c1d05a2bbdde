# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Layers: the pieces of a transformer, and a FlashAttention kernel
#
# The layers Qwen3 is made of, and a FlashAttention prefill kernel in Triton built in three steps.
# You need PyTorch and a transformer block, no GPU (on a CPU, Triton runs in its interpreter).
# `export` cells go into the `minivllm` package.

# %%
import json
import os
from pathlib import Path

import numpy as np
import torch
import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Activations
# Qwen3's MLP is *gated*: one matrix multiply makes `[gate | up]` side by side, and the output is
# `silu(gate) * up`, where SiLU is `x · sigmoid(x)`.

# %% tags=["export"] module="minivllm.layers.activation"
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, 2 * intermediate_size)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up  # (num_tokens, intermediate_size)


# %%
from minivllm.layers.activation import SiluAndMul

gate, up = torch.randn(2, 7, 32)
silu_gate = gate * torch.sigmoid(gate)
torch.testing.assert_close(SiluAndMul()(torch.cat([gate, up], -1)), silu_gate * up)

# %% [markdown]
# ## RMSNorm, with the residual add fused in
# RMSNorm divides each row by its root mean square, in float32 even in a bfloat16 model, as Qwen3
# was trained. Every block does `residual = x + residual; x = norm(residual)`: given the residual,
# one call does both.

# %% tags=["export"] module="minivllm.layers.layernorm"
import torch
from torch import nn

Pair = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        x32 = x.float()
        mean_square = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | Pair:
        if residual is None:
            return self.rms_forward(x)
        residual = (x.float() + residual.float()).to(x.dtype)  # the new residual stream
        return self.rms_forward(residual), residual


# %%
# transformers' Qwen3RMSNorm, bit for bit in float32 and bfloat16; the fused form: add, then norm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from minivllm.layers.layernorm import RMSNorm

ref, ours = Qwen3RMSNorm(64, eps=1e-6), RMSNorm(64, eps=1e-6)
ref.weight.data = ours.weight.data = torch.randn(64)
for dtype in (torch.float32, torch.bfloat16):
    x, res = torch.randn(2, 5, 64, dtype=dtype)
    torch.testing.assert_close(ours.to(dtype)(x), ref.to(dtype)(x), rtol=0, atol=0)
    fused = (ref.to(dtype)(x + res), x + res)
    torch.testing.assert_close(ours.to(dtype)(x, res), fused, rtol=0, atol=0)

# %% [markdown]
# ## Tensor-parallel linear layers
# With tensor parallelism (TP) each of N GPUs holds a slice of every weight matrix:
# * **Column parallel** (QKV, gate/up): split the *output* features; each rank computes its slice of
#   `y = x Wᵀ`.
# * **Row parallel** (attention output, down): split the *input* features, the slice a
#   column-parallel layer computed; each rank computes a partial sum, an all-reduce adds them.
#
# Each parameter's `weight_loader` copies in this rank's slice of a checkpoint's whole matrix
# (`q_proj`, ...), at its offset when several share one of ours. A layer built in a `with
# tensor_parallel(TPGroup(...))` block takes that rank; outside one, it is rank 0 of 1.

# %% tags=["export"] module="minivllm.layers.linear"
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TPGroup:
    """The ranks one model is split over: this one's rank, their number, their process group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed process group of `size` ranks


_building = TPGroup()  # the group of the layers being built now


@contextmanager
def tensor_parallel(tp: TPGroup) -> Iterator[TPGroup]:
    """Layers built inside this block split themselves over `tp` and keep it."""
    global _building
    outer, _building = _building, tp
    try:
        yield tp
    finally:
        _building = outer


def tp_group() -> TPGroup:
    return _building


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def check_shape(name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(loaded.shape)}")


class LinearBase(nn.Module):
    """y = x Wᵀ (+ b) with this rank's slice of W: some of its rows (tp_dim=0) or columns (1)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int):
        super().__init__()
        self.tp, self.tp_dim = tp_group(), tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        for param in self.parameters():  # what the checkpoint loader (notebook 02) calls
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        split = self.tp_dim < param.dim()  # a row-parallel layer's bias is whole on every rank
        whole = list(param.shape)
        if split:
            whole[self.tp_dim] *= self.tp.size
        check_shape(type(self).__name__, loaded, tuple(whole))
        param.data.copy_(loaded.chunk(self.tp.size, self.tp_dim)[self.tp.rank] if split else loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)  # (num_tokens, output_size): this rank's product

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, input_size)
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: each computes its slice of y; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_group().size), bias, tp_dim=0)

    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | str, offset: int, size: int
    ) -> None:
        """Copy this rank's `size` rows of one packed matrix (e.g. k_proj) into ours at `offset`."""
        whole = (size * self.tp.size, *param.shape[1:])
        check_shape(f"{type(self).__name__}[{shard}]", loaded, whole)
        param.data.narrow(0, offset, size).copy_(loaded.chunk(self.tp.size, 0)[self.tp.rank])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several outputs in one weight, e.g. [gate | up]; each rank keeps its slice of each."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    # the loader passes a packed layer its shard id: a signature LinearBase's loader does not have
    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        sizes = [size // self.tp.size for size in self.output_sizes]  # this rank's rows of each
        self.load_shard(param, loaded, shard_id, sum(sizes[:shard_id]), sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one weight; each rank keeps its query heads and their KV heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        tp_size, self.head_dim = tp_group().size, head_dim
        self.num_heads = divide(num_heads, tp_size)
        self.num_kv_heads = divide(num_kv_heads, tp_size)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset = {"q": 0, "k": q_size, "v": q_size + kv_size}[shard_id]
        self.load_shard(param, loaded, shard_id, offset, q_size if shard_id == "q" else kv_size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks: each computes a partial sum; an all-reduce adds them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_group().size), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, input_size / tp_size)
        y = self.matmul(x, self.bias if self.tp.rank == 0 else None)  # the bias once, on rank 0
        if self.tp.size > 1:
            dist.all_reduce(y, group=self.tp.group)
        return y  # (num_tokens, output_size)


# %% [markdown]
# Check: loaded from HF-shaped matrices, the packed layers compute `x Wᵀ` with them. (The deep dive
# `tensor_parallel` checks two ranks' slices against the whole layers.)

# %%
from minivllm.layers import linear

hidden, head_dim = 64, 16
x, (wg, wu) = torch.randn(3, hidden), torch.randn(2, 96, hidden)
wq, wk, wv = (torch.randn(heads * head_dim, hidden) for heads in (4, 2, 2))
qkv = linear.QKVParallelLinear(hidden, head_dim, num_heads=4, num_kv_heads=2)
gate_up = linear.MergedColumnParallelLinear(hidden, [96, 96])
for layer, shards in ((qkv, zip("qkv", (wq, wk, wv))), (gate_up, enumerate((wg, wu)))):
    for shard_id, w in shards:
        layer.weight.weight_loader(layer.weight, w, shard_id)
for layer, ws in ((qkv, (wq, wk, wv)), (gate_up, (wg, wu))):
    torch.testing.assert_close(layer(x), torch.cat([x @ w.T for w in ws], -1))

# %% [markdown]
# ## Vocabulary-parallel embedding and LM head
# The embedding table (151,936 × 1,024 in Qwen3-0.6B) is a column-parallel weight: each rank holds
# some of its rows. A lookup finds the ids this rank owns, zeros for the others, and an all-reduce
# sums them. The LM head is the same matrix used the other way round (Qwen3-0.6B *ties* them): each
# rank computes its slice of the logits; a gather joins them.

# %% tags=["export"] module="minivllm.layers.embed_head"
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minivllm.layers.linear import ColumnParallelLinear


class VocabParallelEmbedding(ColumnParallelLinear):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(embedding_dim, num_embeddings)  # weight: this rank's rows of the table

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # token_ids: (num_tokens,)
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        ids = token_ids - self.tp.rank * self.weight.shape[0]  # ids in this rank's rows
        mine = (ids >= 0) & (ids < self.weight.shape[0])
        y = F.embedding(ids * mine, self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(y, group=self.tp.group)
        return y  # (num_tokens, embedding_dim)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        logits = self.matmul(x, None)  # (num_tokens, vocab_size / tp_size)
        if self.tp.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp.size)]
        dist.all_gather(parts, logits, group=self.tp.group)
        return torch.cat(parts, dim=-1)  # (num_tokens, vocab_size)


# %%
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding

table, emb, head = torch.randn(100, 32), VocabParallelEmbedding(100, 32), ParallelLMHead(100, 32)
for layer in (emb, head):
    layer.weight.weight_loader(layer.weight, table)
ids = torch.tensor([0, 5, 99, 5])
torch.testing.assert_close(emb(ids), table[ids])
torch.testing.assert_close(head(emb(ids)), table[ids] @ table.T)

# %% [markdown]
# ## Rotary position embeddings (RoPE)
# Attention alone cannot tell positions apart. RoPE rotates each pair of query/key features by an
# angle proportional to the position, `θ_i = position · base^(-2i/d)`, so the dot product of a query
# at position m and a key at n depends only on `m − n`. Qwen3's base is 1,000,000, and it normalises
# each head of q and k just before, so `forward` takes those norms.

# %% tags=["export"] module="minivllm.layers.rotary_embedding"
from typing import Any

import torch
from torch import nn

from minivllm.layers.layernorm import Pair, RMSNorm


def rope_parameters(config: Any) -> dict:
    """RoPE settings of a transformers config, new or old: {'rope_type', 'rope_theta', ...}."""
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    # "type": configs before transformers 4.45
    params["rope_type"] = params.pop("type", None) or params.get("rope_type", "default")
    if params["rope_type"] != "default":
        raise ValueError(f"rope_type={params['rope_type']!r} is not supported (only 'default')")
    return params


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers, registered below: (max_position, head_dim / 2)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        # built on the CPU (on the meta device, `arange` would import torch._dynamo), then moved
        exponents = torch.arange(0, head_dim, 2, device="cpu").float() / head_dim
        inv_freq = 1.0 / params["rope_theta"] ** exponents
        freqs = torch.arange(max_position, device="cpu").float()[:, None] * inv_freq
        self.register_buffer("cos", freqs.cos().to(torch.get_default_device()), persistent=False)
        self.register_buffer("sin", freqs.sin().to(torch.get_default_device()), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)  # the two halves of each head
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.cat([y1, y2], dim=-1).to(x.dtype)

    def forward(
        self,
        positions: torch.Tensor,  # (num_tokens,)
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        norms: tuple[RMSNorm, RMSNorm] | None = None,  # Qwen3's q_norm and k_norm
    ) -> Pair:
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos = self.cos[positions][:, None]  # (num_tokens, 1, head_dim / 2)
        sin = self.sin[positions][:, None]
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))


# %%
# q and k rotated as transformers' Qwen3 rotates them
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from minivllm.layers.rotary_embedding import get_rope

config = Qwen3Config(head_dim=64, num_attention_heads=4, rope_theta=1e6)
positions = torch.tensor([0, 1, 7, 100, 4095])
q, k = torch.randn(2, 5, 4, 64)
cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
q_hf, k_hf = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # (1, heads, tokens, d)
q_ref, k_ref = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
expected = (q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1))  # back to (tokens, heads, d)
torch.testing.assert_close(get_rope(config, 64)(positions, q, k), expected)

# %% [markdown]
# ## Attention, the plain way
# First, an attention we trust. An engine packs a batch's prompts end to end, no padding, and passes
# `cu_seqlens`, the cumulative lengths: sequence `i` is rows `cu_seqlens[i]:cu_seqlens[i+1]`
# (flash-attn's *varlen* convention). **GQA**: Qwen3-0.6B has 16 query heads but 8 KV heads; query
# head `h` reads KV head `h // 2`. **Causal, aligned bottom-right**: when a sequence has more keys
# than queries (a cached prefix, notebook 03), query `i` sees keys `j ≤ i + (len_k − len_q)`.

# %% tags=["export"] module="minivllm.kernels.reference"
import torch


def attention_ref(
    q: torch.Tensor,  # (total_q, num_heads, head_dim)
    k: torch.Tensor,  # (total_k, num_kv_heads, head_dim)
    v: torch.Tensor,  # (total_k, num_kv_heads, head_dim)
    cu_seqlens_q: torch.Tensor,  # (batch + 1,)
    cu_seqlens_k: torch.Tensor,  # (batch + 1,)
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """Varlen attention in plain PyTorch, one sequence at a time: every kernel's reference."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = cu_seqlens_q[i : i + 2].tolist()
        ks, ke = cu_seqlens_k[i : i + 2].tolist()
        qi = q[qs:qe].transpose(0, 1).float()  # (num_heads, len_q, head_dim)
        ki = k[ks:ke].transpose(0, 1).float().repeat_interleave(group, dim=0)  # (num_heads, ...)
        vi = v[ks:ke].transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = (qi @ ki.transpose(1, 2)) * scale  # (num_heads, len_q, len_k): the O(N²) tensor
        if causal:  # query i sees keys j <= i + len_k - len_q
            visible = torch.ones_like(scores[0], dtype=torch.bool).tril(diagonal=ke - ks - qe + qs)
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key: zeros
        out[qs:qe] = (probs @ vi).transpose(0, 1).to(q.dtype)
    return out


# %%
# one sequence: PyTorch's scaled_dot_product_attention (KV heads expanded), causal or not
from minivllm.kernels.reference import attention_ref

q, (k, v) = torch.randn(37, 8, 32), torch.randn(2, 37, 2, 32)  # 8 query heads, 2 KV heads
cu = torch.tensor([0, 37])
expanded = (t.repeat_interleave(8 // t.shape[1], 1) for t in (q, k, v))  # 8 heads each
q_h, k_h, v_h = (t.transpose(0, 1) for t in expanded)  # (heads, tokens, d)
for causal in (False, True):
    sdpa = torch.nn.functional.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal)
    ours = attention_ref(q, k, v, cu, cu, causal=causal)
    torch.testing.assert_close(ours, sdpa.transpose(0, 1), rtol=1e-5, atol=1e-5)

# %% [markdown]
# ## A FlashAttention prefill kernel in Triton (try `exercises/01_online_softmax.ipynb` first)
# `attention_ref` holds `scores`, a float per (head, query, key): for a 16k-token prompt and 16
# heads, 16 × 16,384² × 4 bytes = 16 GiB *per layer*. FlashAttention never builds it; it keeps per
# query row a running max, a running sum and the output, O(N) (deep dive `flash_attention_basics`
# plots both). Prefill attention is two large matrix multiplies, *compute-bound*: the kernel must
# keep the tensor cores busy. Three steps.
#
# ### Step 1: the online softmax, in PyTorch
# Softmax divides by a sum over *all* of a row's keys. The online softmax walks over the keys in
# blocks, keeping per query row a running max `m`, a running sum `l` and an unnormalised output
# `acc`. Each block: `s = q · kᵀ · scale`, `m' = max(m, rowmax(s))`, `p = exp(s − m')`, and what was
# accumulated is rescaled by `α = exp(m − m')`: `l ← l·α + rowsum(p)`, `acc ← acc·α + p·v`. At the
# end `out = acc / l`. `rescale=False` skips `α`, to show why it is there.


# %%
def online_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int, rescale: bool = True
) -> torch.Tensor:  # (num_q, head_dim)
    """softmax(q kᵀ · scale) v of one head, q: (num_q, D), k, v: (num_k, D), block_n keys a step."""
    m = q.new_full((q.shape[0],), float("-inf"))  # (num_q,): running max of each row's scores
    l = q.new_zeros(q.shape[0])  # (num_q,): running Σ exp(score - m)
    acc = torch.zeros_like(q)  # (num_q, head_dim): running Σ exp(score - m) · v
    for k_blk, v_blk in zip(k.split(block_n), v.split(block_n)):
        s = q @ k_blk.T * q.shape[1] ** -0.5  # (num_q, block_n): the only scores that exist
        m_new = torch.maximum(m, s.amax(dim=1))
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)  # 0 on the first block
        p = torch.exp(s - m_new[:, None])  # (num_q, block_n)
        l = l * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v_blk
        m = m_new
    return acc / l[:, None]


qh, kh, vh = (torch.randn(n, 32, device=DEVICE) for n in (64, 128, 128))  # one head
ref_h = torch.softmax(qh @ kh.T * 32**-0.5, dim=-1) @ vh  # the definition: all scores at once
for block_n in (128, 48, 16):  # one block (nothing to rescale), ragged blocks of 48, blocks of 16
    torch.testing.assert_close(online_softmax_attention(qh, kh, vh, block_n), ref_h)
wrong = (online_softmax_attention(qh, kh, vh, 16, rescale=False) - ref_h).abs().max().item()
print(f"without rescaling by α, blocks of 16: max error {wrong:.2f}")
assert wrong > 0.01  # rounding alone would give ~1e-7

# %% [markdown]
# ### Step 2: the loop body on tiles, in Triton
# A Triton *program* computes on whole tiles: ours will hold a `(BLOCK_M, D)` tile of queries and
# walk over `(BLOCK_N, D)` tiles of keys and values. `attend_block` is step 1's loop body on those
# tiles: `tl.dot` for both products, `exp2` (which the hardware has, `log2(e)` folded into
# `qk_scale`), scores outside the `visible` mask set to -inf, and a guard for rows that have seen
# no visible key yet (`exp(-inf − (-inf))` is NaN). Tile shapes are compile-time constants
# (`tl.constexpr`). Step 3's kernel runs it, and its check covers both (the deep dive
# `flash_attention_basics` puts the smallest kernel around it).

# %% tags=["export"] module="minivllm.kernels.flash_attn"
import math

import torch
import triton
import triton.language as tl


@triton.jit
def attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, PRECISION: tl.constexpr):
    """Step 1's loop body: fold K (D, BLOCK_N) and V (BLOCK_N, D) into a query tile's running max
    m_i, sum l_i and output acc. Scores where `visible` (a mask, or None: all) is False are -inf."""
    s = tl.dot(q, k, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), times qk_scale below
    if visible is not None:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


# %% [markdown]
# ### Step 3: the kernel an engine calls
# Around `attend_block`, what real prompts need, as `attention_ref` does it:
# * **Varlen**: the grid is (query tiles, query heads, sequences); a program finds its rows through
#   `cu_seqlens`, reads through strides, and masks the ends that do not fill a tile (`load_tile`
#   loads zeros there; on a CPU in float32, as the interpreter computes bfloat16 wrongly).
# * **Causal**: a query tile's loop stops at its last query's last visible key; key tiles right of
#   the diagonal are never loaded, half the work of a square prompt.
# * **GQA**: query head `h` reads KV head `h // GROUP`.
#
# The deep dive `prefill_tuning` lays this kernel out for an H200's speed.


# %% tags=["export"]
@triton.jit
def load_tile(ptrs, mask, UPCAST: tl.constexpr):
    """Load a tile, zeros where masked; UPCAST: in float32 (the CPU interpreter's bf16 is wrong)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    O,
    cu_seqlens_q,
    cu_seqlens_k,
    qk_scale,
    q_strides,  # (token, head) strides of q, then of k, v and o
    k_strides,
    v_strides,
    o_strides,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    start_m, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if start_m * BLOCK_M >= q_len:  # past this sequence's last query
        return
    k_start = tl.load(cu_seqlens_k + seq)
    k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
    kv_head = head // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # this tile's queries
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    q_rows = Q + (q_start + offs_m) * q_strides[0] + head * q_strides[1]  # (BLOCK_M,)
    q_mask = (offs_m < q_len)[:, None]  # rows of this sequence; also where o is stored
    q = load_tile(q_rows[:, None] + offs_d[None, :], q_mask, UPCAST)
    k_cols = K + (k_start + offs_n) * k_strides[0] + kv_head * k_strides[1]  # (BLOCK_N,)
    v_rows = V + (k_start + offs_n) * v_strides[0] + kv_head * v_strides[1]  # (BLOCK_N,)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = k_len - q_len  # bottom-right causal: query i sees keys j <= i + shift
    hi = k_len
    if CAUSAL:  # the tile's last query sees no key past this
        hi = tl.minimum(k_len, (start_m + 1) * BLOCK_M + shift)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + offs_n
        k_ptrs = k_cols[None, :] + start_n * k_strides[0] + offs_d[:, None]  # (D, BLOCK_N): kᵀ
        v_ptrs = v_rows[:, None] + start_n * v_strides[0] + offs_d[None, :]  # (BLOCK_N, D)
        k = load_tile(k_ptrs, (keys < k_len)[None, :], UPCAST)
        v = load_tile(v_ptrs, (keys < k_len)[:, None], UPCAST)
        visible = (keys < k_len)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None] + shift)
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, "ieee")
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that sees no key outputs zeros
    o_rows = O + (q_start + offs_m) * o_strides[0] + head * o_strides[1]  # (BLOCK_M,)
    o_ptrs = o_rows[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)


def launch_config(head_dim: int, device: torch.device) -> dict:
    """Tiles of 64 queries × 64 keys on a GPU; of 16 × 16 in the CPU interpreter, quick there."""
    block = 16 if device.type == "cpu" else 64
    return dict(BLOCK_M=block, BLOCK_N=block)


def softmax_scale_of(softmax_scale: float | None, head_dim: int) -> float:
    """1 / sqrt(head_dim) unless given; > 0, as `attend_block` scales a row's max and the -inf."""
    if softmax_scale is None:
        return head_dim**-0.5
    if not softmax_scale > 0:  # NaN too
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    return softmax_scale


def flash_attn_varlen_contiguous(
    q: torch.Tensor,  # (total_q, num_heads, head_dim)
    k: torch.Tensor,  # (total_k, num_kv_heads, head_dim)
    v: torch.Tensor,  # (total_k, num_kv_heads, head_dim)
    cu_seqlens_q: torch.Tensor,  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor,  # (batch + 1,) int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    tile: dict | None = None,  # BLOCK_M, BLOCK_N (num_warps, ...); None: launch_config's
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """flash-attn's `flash_attn_varlen_func` for keys and values stored contiguously."""
    head_dim, out = q.shape[2], torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qk_scale = softmax_scale_of(softmax_scale, head_dim) * math.log2(math.e)  # exp2 units
    config = tile or launch_config(head_dim, q.device)
    grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), q.shape[1], cu_seqlens_q.numel() - 1)
    strides = [t.stride()[:2] for t in (q, k, v, out)]
    upcast = q.device.type == "cpu" and q.dtype != torch.float32  # see load_tile
    flags = dict(GROUP=q.shape[1] // k.shape[1], HEAD_DIM=head_dim, CAUSAL=causal, UPCAST=upcast)
    tensors = (q, k, v, out, cu_seqlens_q, cu_seqlens_k)
    _prefill_kernel[grid](*tensors, qk_scale, *strides, **flags, **config)
    return out


# %%
# the reference's results: lengths at tile edges, GQA, a sequence after 35 cached tokens
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous

q_lens, k_lens = [1, 15, 16, 17, 64, 5], [1, 15, 16, 17, 64, 40]
cu_q, cu_k = (
    torch.tensor([0, *np.cumsum(n)], dtype=torch.int32, device=DEVICE) for n in (q_lens, k_lens)
)
q = torch.randn(sum(q_lens), 4, 32, device=DEVICE)  # 4 query heads
k, v = torch.randn(2, sum(k_lens), 2, 32, device=DEVICE)  # 2 KV heads
for causal in (True, False):
    ours = flash_attn_varlen_contiguous(q, k, v, cu_q, cu_k, 64, 64, causal=causal)
    torch.testing.assert_close(ours, attention_ref(q, k, v, cu_q, cu_k, causal=causal))

# %% [markdown]
# ### How fast is it?
# `python -m minivllm.benchmarks.prefill` times a causal prompt of 1k to 16k tokens: this kernel
# (`minivllm-triton-core`), the deep dive's (`minivllm-triton`), SDPA, FlashInfer and naive
# attention. A GPU re-measures 1k and 4k; else the cell shows the committed H200 results.

# %%
from minivllm.benchmarks.prefill import plot_prefill, run_prefill_benchmark

if DEVICE == "cuda":
    prefill = run_prefill_benchmark(seqlens=(1024, 4096))
else:
    prefill = json.loads(Path("figures/prefill.json").read_text())
plot_prefill(prefill).savefig(FIGURES / "01_prefill.png", dpi=120)
for row in prefill["rows"]:
    speed = f"{row['tflops']:6.1f} TFLOP/s ({row['ms']:.3f} ms)"
    print(f"{row['impl']:>20} N={row['seqlen']:>6}: {speed}")

# %% [markdown]
# ## Check yourself
# Set each `answerN` and run its cell: it checks your answer against the kernel; the worked answer
# follows.
#
# **1.** A prompt of 100 tokens continues after 60 cached tokens: its sequence has 160 keys. Which
# keys does its first query see? Answer the list of their indices. (Zero queries weigh every visible
# key equally, and key `j`'s value is 1 in feature `j` only: a nonzero output feature is a key
# seen.)

# %%
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
cu_q1, cu_k1 = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (100, 160))
zeros = torch.zeros(160, 2, 128, dtype=torch.bfloat16, device=DEVICE)  # queries and keys
v1 = torch.eye(160, 256, dtype=torch.bfloat16, device=DEVICE).view(160, 2, 128)  # key j: feature j
out1 = flash_attn_varlen_contiguous(zeros[:100], zeros, v1, cu_q1, cu_k1, 100, 160, causal=True)
seen_keys = out1[0].flatten().nonzero().flatten().tolist()  # query 0's two heads, side by side
check_answer(answer1, seen_keys, "1. keys seen")

# %% [markdown]
# Worked answer: causal attention aligned bottom-right lets query `i` see keys `j ≤ i + (len_k −
# len_q)`; for `i = 0` that is `j ≤ 160 − 100 = 60`: the 60 cached tokens and its own, 61 keys.

# %%
check_answer(list(range(0 + (160 - 100) + 1)), seen_keys, "1. keys seen")

# %% [markdown]
# **2.** A prompt of 40 tokens after 60 cached ones (100 keys), in tiles of 16 queries and 16 keys,
# has 3 query tiles and 7 key tiles. How many key tiles does each query tile's program load? Answer
# a list, one count per query tile. (The cell poisons: copy `j` of the sequence has NaN values in
# key tile `j`, and a program that loads it outputs NaN, even where the mask hides them.)

# %%
answer2 = None  # your answer: replace None with an expression
n_q, n_k, d, tile = 40, 100, 16, dict(BLOCK_M=16, BLOCK_N=16)  # the CPU's tiles, on any device
n_tiles = triton.cdiv(n_k, 16)  # key tiles
poison = torch.arange(n_k, device=DEVICE) // 16 == torch.arange(n_tiles, device=DEVICE)[:, None]
v2 = torch.zeros(n_tiles * n_k, 1, d, device=DEVICE)  # the copies end to end
v2[poison.flatten()] = torch.nan  # copy j: NaN values in key tile j
q2, k2 = torch.zeros(n_tiles * n_q, 1, d, device=DEVICE), torch.zeros_like(v2)
cu_q2, cu_k2 = (
    torch.arange(0, n_tiles * n + 1, n, dtype=torch.int32, device=DEVICE) for n in (n_q, n_k)
)
out2 = flash_attn_varlen_contiguous(q2, k2, v2, cu_q2, cu_k2, n_q, n_k, causal=True, tile=tile)
loaded = out2.view(n_tiles, n_q, d).isnan().any(-1)  # (copy j, query): it loaded key tile j
tiles_read = loaded[:, ::16].sum(0).tolist()  # a query tile's first row speaks for it
check_answer(answer2, tiles_read, "2. key tiles read")

# %% [markdown]
# Worked answer: query `i` sees keys `j ≤ i + 60`, so query tile `t` (queries `16t` to `16t + 15`)
# needs keys up to `16t + 75`, in key tile `t + 4`: tiles 0 to `t + 4`, at most all 7. That is 5, 6
# and 7: 18 tiles, where non-causal attention loads 21.

# %%
last_key = [min(16 * t + 75, 100 - 1) for t in range(3)]  # seen by each query tile's last query
check_answer([j // 16 + 1 for j in last_key], tiles_read, "2. key tiles read")

# %% [markdown]
# **Exercises**: `exercises/01_online_softmax.ipynb` (a sliding window, split-K) and
# `exercises/01_triton_rmsnorm.ipynb` (fused add + RMSNorm in Triton). **Next:** notebook 02 builds
# Qwen3 from these layers. Optional: the deep dives `flash_attention_basics`, `triton_layers` and
# `prefill_tuning`.
