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
# Every layer Qwen3 (and Llama) is made of, as an inference engine needs them: activations, RMSNorm
# with a fused residual add, tensor-parallel linear layers that load HuggingFace weights, a
# vocabulary-parallel embedding and LM head, rotary position embeddings, a plain PyTorch attention
# we trust, and a Triton FlashAttention prefill kernel. You need to know a transformer block
# (attention + MLP, each in a norm and a residual add) and PyTorch; no GPU (on a CPU, Triton runs in
# its interpreter). `export` cells go into the `minivllm` package (`python tools/export.py`).

# %%
import json
import os
from pathlib import Path
from unittest import mock

import matplotlib.pyplot as plt
import numpy as np
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
print(f"device: {DEVICE}, torch {torch.__version__}")

# %% [markdown]
# ## Activations
# Qwen3's MLP is *gated*: one projection makes two vectors, `gate` and `up`, and the output is
# `silu(gate) * up`, where SiLU (also called swish) is `x · sigmoid(x)`. An engine computes `gate`
# and `up` with one matrix multiply (one weight read instead of two), so `SiluAndMul` receives them
# side by side and splits them. Each small layer has a `kernel` attribute, `None` by default: on a
# GPU a fused Triton kernel can take the PyTorch code's place (deep dive `triton_layers`); the core
# path needs none.

# %% tags=["export"] module="minivllm.layers.activation"
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    kernel: Callable[[torch.Tensor], torch.Tensor] | None = (
        None  # a fused kernel instead (set per layer)
    )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, 2 * intermediate_size)
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, dim=-1)  # x holds [gate | up]
        return F.silu(gate) * up  # (num_tokens, intermediate_size)


# %% [markdown]
# Check: PyTorch's `silu` is the formula; `SiluAndMul` computes `silu(gate) * up` as transformers'
# Qwen3 MLP does.

# %%
from minivllm.layers.activation import SiluAndMul

gate, up = torch.randn(7, 32), torch.randn(7, 32)
torch.testing.assert_close(torch.nn.functional.silu(gate), gate * torch.sigmoid(gate))
silu_gate = gate * torch.sigmoid(gate)
torch.testing.assert_close(SiluAndMul()(torch.cat([gate, up], -1)), silu_gate * up)

# %% [markdown]
# ## RMSNorm, with the residual add fused in (a Triton kernel: `exercises/01_triton_rmsnorm`)
# LayerNorm centres and scales; RMSNorm only scales, by the root mean square: one reduction instead
# of two. Qwen3 was trained with it, so we match it exactly: the sum is in float32 even when the
# model runs in bfloat16. Every block does `residual = x + residual; x = norm(residual)`; passing
# the residual into the norm lets one function (and, as a kernel, one pass over memory) do both.

# %% tags=["export"] module="minivllm.layers.layernorm"
from collections.abc import Callable

import torch
from torch import nn

Pair = tuple[torch.Tensor, torch.Tensor]
NormKernel = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor | Pair]


class RMSNorm(nn.Module):
    kernel: NormKernel | None = (
        None  # (x, weight, eps, residual): the add and the norm as one kernel (set per layer)
    )

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        x32 = x.float()
        mean_square = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype)

    def add_rms_forward(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        residual = (x.float() + residual.float()).to(x.dtype)  # the new residual stream
        return self.rms_forward(residual), residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | Pair:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        return self.rms_forward(x) if residual is None else self.add_rms_forward(x, residual)


# %% [markdown]
# Check: the same numbers as transformers' `Qwen3RMSNorm`, in float32 and bfloat16; the fused form
# is "add, then norm".

# %%
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from minivllm.layers.layernorm import RMSNorm

ref, ours = Qwen3RMSNorm(64, eps=1e-6), RMSNorm(64, eps=1e-6)
ref.weight.data = ours.weight.data = torch.randn(64)  # one random weight for both
for dtype in (torch.float32, torch.bfloat16):
    x, res = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    torch.testing.assert_close(ours.to(dtype)(x), ref.to(dtype)(x), rtol=0, atol=0)
    fused = (ref.to(dtype)(x + res), x + res)  # the norm of the sum, and the sum
    torch.testing.assert_close(ours.to(dtype)(x, res), fused, rtol=0, atol=0)
print("RMSNorm matches Qwen3RMSNorm bit for bit")

# %% [markdown]
# ## Tensor-parallel linear layers
# With tensor parallelism (TP) each of N GPUs holds a slice of every weight matrix, cut one of two
# ways:
# * **Column parallel** (QKV, the MLP's gate/up): split the *output* features; each rank computes
#   its slice of `y = x Wᵀ`, with no communication.
# * **Row parallel** (attention output, MLP down): split the *input* features; each rank computes a
#   partial sum and an all-reduce adds them. Its input slice is exactly the column-parallel layer's
#   output: two all-reduces a block.
#
# Checkpoints store full, separate matrices (`q_proj`, `k_proj`, ...), so each parameter has a
# `weight_loader` that copies in this rank's slice, at its offset when several are packed into one
# of ours. A layer takes its rank from the `with tensor_parallel(TPGroup(...))` block it is built in
# (deep dive `tensor_parallel`); outside one, rank 0 of 1.

# %% tags=["export"] module="minivllm.layers.linear"
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
# the ranks one model is split over: this one's rank, their number, the group they communicate on
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed process group (or backend) of `size` ranks


_building = TPGroup()  # the group of the layers being built now


@contextmanager
def tensor_parallel(tp: TPGroup) -> Iterator[TPGroup]:
    """Layers built inside this block split themselves over `tp` and keep it: each model owns its
    group."""
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
    """y = x Wᵀ (+ b) with this rank's slice of W: a slice of its rows (tp_dim=0) or of its columns
    (tp_dim=1)."""

    # one token's F.linear(x, weight, bias) as one kernel (set per layer); gated=True: silu(gate) *
    # up of [gate | up]
    kernel: Callable[..., torch.Tensor] | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int):
        super().__init__()
        self.tp = tp_group()
        self.tp_rank, self.tp_size, self.tp_dim = self.tp.rank, self.tp.size, tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        # a hook the checkpoint loader calls (notebook 02), unknown to mypy
        for param in self.parameters():
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        split = self.tp_dim < param.dim()  # a row-parallel layer's bias is whole on every rank
        full = tuple(
            n * self.tp_size if split and d == self.tp_dim else n for d, n in enumerate(param.shape)
        )
        check_shape(type(self).__name__, loaded, full)
        param.data.copy_(loaded.chunk(self.tp_size, self.tp_dim)[self.tp_rank] if split else loaded)

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:  # x: (num_tokens, input_size)
        # a matrix-vector product: cuBLAS's tiles waste bandwidth
        if self.kernel is not None and x.shape[0] == 1:
            return self.kernel(x, self.weight, bias)
        return F.linear(x, self.weight, bias)  # (num_tokens, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, input_size)
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: each computes y[:, its slice]; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_group().size), bias, tp_dim=0)

    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | str, offset: int, size: int
    ) -> None:
        """Copy this rank's `size` rows of one packed matrix (e.g. k_proj) into ours at row
        `offset`."""
        full_shape = (size * self.tp_size, *param.shape[1:])
        check_shape(f"{type(self).__name__}[{shard}]", loaded, full_shape)
        param.data.narrow(0, offset, size).copy_(loaded.chunk(self.tp_size, 0)[self.tp_rank])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one weight, e.g. [gate | up]; each rank keeps its
    slice of each."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    # the loader passes a packed layer its shard id: a signature LinearBase's loader does not have
    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        sizes = [size // self.tp_size for size in self.output_sizes]  # this rank's rows of each
        self.load_shard(param, loaded, shard_id, sum(sizes[:shard_id]), sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight; each rank keeps its attention heads (and their KV
    heads)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        tp_size, self.head_dim = tp_group().size, head_dim
        self.num_heads, self.num_kv_heads = (
            divide(num_heads, tp_size),
            divide(num_kv_heads, tp_size),
        )
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        self.load_shard(param, loaded, shard_id, offset, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks: each computes a partial sum, then an all-reduce adds
    them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_group().size), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, input_size / tp)
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp.group)
        return y  # (num_tokens, output_size)


# %% [markdown]
# Check: layers loaded from HF-shaped tensors compute `F.linear` with them, packed as we packed
# them; a row-parallel layer over two ranks in this one process gives partial sums that add up to
# the whole layer (all-reduce stubbed out).

# %%
from minivllm.layers import linear
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

hidden, head_dim, num_heads, num_kv_heads = 64, 16, 4, 2
x, (wg, wu) = torch.randn(3, hidden), torch.randn(2, 96, hidden)
wq, wk, wv = (
    torch.randn(heads * head_dim, hidden) for heads in (num_heads, num_kv_heads, num_kv_heads)
)
qkv = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads)
gate_up = MergedColumnParallelLinear(hidden, [96, 96])
for layer, shards in ((qkv, zip("qkv", (wq, wk, wv))), (gate_up, enumerate((wg, wu)))):
    for shard_id, w in shards:
        layer.weight.weight_loader(layer.weight, w, shard_id)
q_k_v = [x @ w.T for w in (wq, wk, wv)]
torch.testing.assert_close(qkv(x), torch.cat(q_k_v, -1))
gate_and_up = [x @ w.T for w in (wg, wu)]
torch.testing.assert_close(gate_up(x), torch.cat(gate_and_up, -1))

wd, b, x2 = torch.randn(hidden, 96), torch.randn(hidden), torch.randn(3, 96)
# row parallel over 2 ranks in this process: each keeps 48 input columns and adds a partial sum
halves = []
for rank in range(2):
    # the layer each of two processes would build
    with linear.tensor_parallel(linear.TPGroup(rank=rank, size=2)):
        halves.append(row := linear.RowParallelLinear(96, hidden, bias=True))
    for param, full in ((row.weight, wd), (row.bias, b)):
        # each rank keeps its slice of the weight, and the whole bias
        param.weight_loader(param, full)
# we add the two below
with mock.patch.object(torch.distributed, "all_reduce", lambda y, group=None: None):
    partial = [layer(x_half) for layer, x_half in zip(halves, x2.chunk(2, dim=-1))]
torch.testing.assert_close(sum(partial), x2 @ wd.T + b)  # the bias once: only rank 0 adds it

# %% [markdown]
# ## Vocabulary-parallel embedding and LM head
# The embedding table (151,936 × 1,024 for Qwen3-0.6B) is split by rows: each rank looks up the
# token ids it owns, writes zeros for the others, and an all-reduce sums the pieces. The LM head is
# the same matrix used the other way round (Qwen3-0.6B *ties* them): each rank computes its
# vocabulary slice's logits; a gather puts them side by side.

# %% tags=["export"] module="minivllm.layers.embed_head"
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.layers.linear import check_shape, divide, tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp = tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.num_embeddings = num_embeddings
        per_rank = divide(num_embeddings, self.tp_size)
        self.vocab_start, self.vocab_end = self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))
        # the loader's hook, as above
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(type(self).__name__, loaded, (self.num_embeddings, param.shape[1]))
        param.data.copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # token_ids: (num_tokens,)
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        y = F.embedding((token_ids - self.vocab_start) * mine, self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(y, group=self.tp.group)
        return y  # (num_tokens, embedding_dim)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ Wᵀ; each rank computes its vocabulary slice and all ranks gather the full
    row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        logits = F.linear(x, self.weight)  # (num_tokens, vocab_size / tp)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
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
# Attention by itself cannot tell positions apart. RoPE rotates each pair of query/key features by
# an angle proportional to the token's position, `θ_i = position · base^(-2i/d)`, so the dot product
# of a query at position m with a key at position n depends only on `m − n`. Qwen3 uses base
# 1,000,000; Llama-3 also stretches the low frequencies ("llama3" scaling). The settings are in
# `config.rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older); `cos` and
# `sin` are computed once for every position.

# %% tags=["export"] module="minivllm.layers.rotary_embedding"
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minivllm.layers.layernorm import Pair, RMSNorm

Norms = tuple[RMSNorm, RMSNorm]  # Qwen3's q_norm and k_norm
RopeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Norms | None], Pair
]


def rope_parameters(config: Any) -> dict:
    """RoPE settings from a transformers config of any version: {'rope_type', 'rope_theta',
    ...scaling keys}."""
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    # "type": pre-4.45 configs
    params["rope_type"] = params.pop("type", None) or params.get("rope_type", "default")
    if params["rope_type"] not in ("default", "llama3"):
        raise ValueError(
            f"rope_type={params['rope_type']!r} is not supported (supported: 'default', 'llama3')"
        )
    return params


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama-3 scaling: keep high frequencies, divide low ones by `factor`, interpolate in
    between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers, registered below: (max_position, head_dim / 2)
    sin: torch.Tensor
    kernel: RopeKernel | None = (
        None  # (positions, q, k, cos, sin, norms): q and k as one kernel (set per layer)
    )

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        # the table on the CPU, then to the default device: on the meta device, `arange` would
        # import torch._dynamo
        inv_freq = 1.0 / (
            params["rope_theta"] ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
        )
        if params["rope_type"] == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, params)
        # (max_position, head_dim / 2)
        freqs = torch.arange(max_position, device="cpu").float()[:, None] * inv_freq
        self.register_buffer("cos", freqs.cos().to(torch.get_default_device()), persistent=False)
        self.register_buffer("sin", freqs.sin().to(torch.get_default_device()), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # the two halves of each head: (num_tokens, num_heads, head_dim / 2)
        x1, x2 = x.float().chunk(2, dim=-1)
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.cat([y1, y2], dim=-1).to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, norms: Norms | None = None
    ) -> Pair:
        """Rotate q, k: (num_tokens, num_heads, head_dim) to their positions: (num_tokens,). With
        `norms` (Qwen3's q_norm, k_norm), normalise each head of q and of k first."""
        if self.kernel is not None:
            return self.kernel(positions, q, k, self.cos, self.sin, norms)
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        # (num_tokens, 1, head_dim / 2)
        cos, sin = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))


# %% [markdown]
# Check: ours rotates q and k as transformers' RoPE does (Qwen3's default, and Llama-3.2's scaled
# one).

# %%
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from minivllm.layers.rotary_embedding import get_rope

rope32 = dict(
    rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0
)
rope32["original_max_position_embeddings"] = 8192  # Llama-3.2's: 8k trained, 128k scaled by 32
qwen3_cfg = Qwen3Config(
    head_dim=64, num_attention_heads=4, max_position_embeddings=4096, rope_theta=1e6
)
llama_cfg = LlamaConfig(
    hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=rope32
)
configs = {
    "qwen3": (qwen3_cfg, Qwen3RotaryEmbedding),
    "llama3.2": (llama_cfg, LlamaRotaryEmbedding),
}
positions = torch.tensor([0, 1, 7, 100, 4095])
for name, (config, hf_rope) in configs.items():
    q, k = torch.randn(5, 4, 64), torch.randn(5, 4, 64)
    cos, sin = hf_rope(config)(q, positions[None])
    q_hf, k_hf = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # (1, heads, tokens, dim)
    q_ref, k_ref = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    q_ours, k_ours = get_rope(config, 64)(positions, q, k)
    torch.testing.assert_close(
        (q_ours, k_ours), (q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1))
    )
    print(
        f"{name}: RoPE matches transformers ({get_rope(config, 64).cos.shape[0]} cached positions)"
    )

# %% [markdown]
# ## Attention, the plain way
# Before writing a fast kernel we need one we trust. An engine packs a batch's prompts end to end in
# one flat tensor (no padding) and passes `cu_seqlens`, the cumulative lengths: sequence `i` is rows
# `cu_seqlens[i]:cu_seqlens[i+1]` (flash-attn's *varlen* convention, kept everywhere). **GQA**:
# Qwen3-0.6B has 16 query heads but only 8 key/value heads (a smaller KV cache); query head `h`
# reads KV head `h // 2`. **Causal, aligned bottom-right**: when a sequence has more keys than
# queries (a cached prefix, notebook 03), query `i` sees keys `j ≤ i + (len_k − len_q)`.

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
    """Varlen attention in plain PyTorch, one sequence at a time: the reference every kernel is
    checked against."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = cu_seqlens_q[i : i + 2].tolist()
        ks, ke = cu_seqlens_k[i : i + 2].tolist()
        qi = q[qs:qe].transpose(0, 1).float()  # (num_heads, len_q, head_dim)
        # (num_heads, len_k, head_dim)
        ki = k[ks:ke].transpose(0, 1).float().repeat_interleave(group, dim=0)
        vi = v[ks:ke].transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = (qi @ ki.transpose(1, 2)) * scale  # (num_heads, len_q, len_k): the O(N²) tensor
        if causal:
            len_q, len_k = qe - qs, ke - ks
            visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(
                diagonal=len_k - len_q
            )
            scores = scores.masked_fill(~visible, float("-inf"))
        # a row that sees no key outputs zeros
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[qs:qe] = (probs @ vi).transpose(0, 1).to(q.dtype)
    return out


# %% [markdown]
# Check: for one sequence, the reference is PyTorch's `scaled_dot_product_attention` (KV heads
# expanded), causal or not.

# %%
from minivllm.kernels.reference import attention_ref

q, (k, v), cu = (
    torch.randn(37, 8, 32),
    torch.randn(2, 37, 2, 32),
    torch.tensor([0, 37], dtype=torch.int32),
)
q_h, k_h, v_h = (
    q.transpose(0, 1),
    k.repeat_interleave(4, 1).transpose(0, 1),
    v.repeat_interleave(4, 1).transpose(0, 1),
)
for causal in (False, True):
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q_h, k_h, v_h, is_causal=causal
    ).transpose(0, 1)
    torch.testing.assert_close(
        attention_ref(q, k, v, cu, cu, causal=causal), sdpa, rtol=1e-5, atol=1e-5
    )

# %% [markdown]
# ### Why the plain way does not scale: O(N²) memory
# The reference materialises `scores`, one float per (head, query, key): for a 16k-token prompt and
# Qwen3-0.6B's 16 heads, 16 × 16,384² × 4 bytes = 16 GiB *per layer*. FlashAttention never builds
# it: walking over the keys in blocks, it keeps per query row a running max `m`, a running sum `l`
# and the output accumulator, O(N) in all. Measured:

# %%
seen, softmax, n, cu_n = [], torch.softmax, 512, torch.tensor([0, 512])
with mock.patch.object(
    torch, "softmax", lambda x, dim: (seen.append(x.shape), softmax(x, dim=dim))[1]
):
    # 16 q, 8 kv heads
    attention_ref(*(torch.randn(n, heads, 128) for heads in (16, 8, 8)), cu_n, cu_n, causal=True)
assert seen == [(16, n, n)], seen
mib = 16 * n * n * 4 / 2**20  # 16 heads of N × N scores, 4 bytes each
print(f"scores tensor for N={n}: {seen[0]} = {mib:.0f} MiB in fp32")

# Qwen3-0.6B's heads; N = 512 ... 32,768
num_heads, head_dim, lengths = (16, 128, 2 ** np.arange(9, 16))
# fp32 scores (the probabilities need as much again)
naive_bytes = num_heads * lengths.astype(float) ** 2 * 4
flash_bytes = num_heads * lengths * (head_dim * 4 + 2 * 4)  # fp32 accumulator + m + l per query row
fig, ax = plt.subplots(figsize=(6, 3.8), layout="tight")
ax.loglog(lengths, naive_bytes / 2**30, "o-", label="naive: scores (heads × N × N)")
ax.loglog(lengths, flash_bytes / 2**30, "s-", label="FlashAttention: acc, m, l (heads × N × d)")
ax.axhline(141e9 / 2**30, color="grey", ls=":", label="H200 memory (141 GB = 131 GiB)")
ax.set(
    xlabel="sequence length N",
    ylabel="GiB per layer",
    title="Attention working memory, 16 heads of 128",
)
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.93))  # under the H200 line
fig.savefig(FIGURES / "01_attention_memory.png", dpi=120)
naive_gib = naive_bytes[-1] / 2**30
flash_gib = flash_bytes[-1] / 2**30
print(f"at N=32k: naive {naive_gib:.0f} GiB vs flash {flash_gib:.2f} GiB per layer")
print(f"naive, all 28 layers of Qwen3-0.6B: {28 * naive_bytes[-1] / 141e9:.0f} H200s' memory")

# %% [markdown]
# ## A FlashAttention prefill kernel in Triton (try `exercises/01_online_softmax.ipynb` first)
# Prefill processes whole prompts: thousands of queries per sequence, so attention is a pair of
# large matrix multiplies, *compute-bound*. The kernel must keep the tensor cores busy and never
# write `scores` to memory. We build it in three steps, each checked against the one before: the
# online softmax in PyTorch, the same loop as a tiny Triton kernel, then the full kernel. The
# exercise has you write step 1 yourself, for a causal sliding window that reads only the key blocks
# it reaches, and then split-K: try it before reading on.
#
# ### Step 1: the online softmax, in PyTorch
# Softmax divides by a sum over *all* of a row's keys, which is why the reference holds every score
# at once. The online softmax walks over the keys in blocks, keeping per query row a running max
# `m`, a running sum `l` and an unnormalised output `acc`. For each block: `s = q · kᵀ · scale`,
# `m' = max(m, rowmax(s))`, `p = exp(s − m')`, and what was accumulated is rescaled by `α = exp(m −
# m')`: `l ← l·α + rowsum(p)`, `acc ← acc·α + p·v`. At the end `out = acc / l`: softmax(s)·v up to
# rounding, yet only one block of scores ever exists. Here it is for one head, every key visible;
# `rescale=False` skips `α`, to show why it is there.


# %%
def online_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int, rescale: bool = True
) -> torch.Tensor:  # (num_q, head_dim)
    """softmax(q kᵀ · scale) v for one head, q: (num_q, D), k, v: (num_k, D), reading the keys
    block_n at a time."""
    m = q.new_full((q.shape[0],), float("-inf"))  # (num_q,): running max of each row's scores
    l = q.new_zeros(q.shape[0])  # (num_q,): running Σ exp(score - m)
    acc = torch.zeros_like(q)  # (num_q, head_dim): running Σ exp(score - m) · v
    # (block_n, head_dim), fewer at the end
    for k_blk, v_blk in zip(k.split(block_n), v.split(block_n)):
        s = q @ k_blk.T * q.shape[1] ** -0.5  # (num_q, block_n): the only scores that exist
        m_new = torch.maximum(m, s.amax(dim=1))
        # (num_q,): 0 on the first block
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        p = torch.exp(s - m_new[:, None])  # (num_q, block_n)
        l = l * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v_blk
        m = m_new
    return acc / l[:, None]


# one head: 64 queries, 128 keys
qh, kh, vh = (torch.randn(n, 32, device=DEVICE) for n in (64, 128, 128))
# (64, 32): the definition, all scores at once
ref_h = torch.softmax(qh @ kh.T * 32**-0.5, dim=-1) @ vh
for block_n in (128, 48, 16):  # one block (nothing to rescale), ragged blocks of 48, blocks of 16
    torch.testing.assert_close(online_softmax_attention(qh, kh, vh, block_n), ref_h)
wrong = (online_softmax_attention(qh, kh, vh, 16, rescale=False) - ref_h).abs().max().item()
print(f"without rescaling by α, blocks of 16: max error {wrong:.2f}")
assert wrong > 0.01  # rounding alone would give ~1e-7

# %% [markdown]
# ### Step 2: the same loop as a Triton kernel
# A Triton *program* computes on whole tiles. Ours loads a `(BLOCK_M, D)` tile of queries once, then
# runs step 1's loop over `(BLOCK_N, D)` tiles of keys and values, `tl.dot` for both products; the
# grid launches one program per query tile. A program only gets pointers: a tile's addresses are
# `base + row · row_stride + column`, built from `tl.arange` (for `kᵀ`, swap which offsets go down
# and which across). It computes `exp2`, which the hardware has, with `log2(e)` folded into the
# scale. To stay tiny: one head, no mask, lengths that are multiples of the tiles.


# %%
@triton.jit
def tiny_attention_kernel(  # Q, O: (num_q, D), K, V: (N, D), contiguous; qk_scale in log2 units
    Q,
    K,
    V,
    O,
    qk_scale,
    N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's query rows
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])  # (BLOCK_M, D), loaded once
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        keys = start + offs_n  # this block's key rows
        k_t = tl.load(K + keys[None, :] * D + offs_d[:, None])  # (D, BLOCK_N): kᵀ
        v = tl.load(V + keys[:, None] * D + offs_d[None, :])  # (BLOCK_N, D)
        s = tl.dot(q, k_t, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N), in log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l, acc, m = (
            l * alpha + tl.sum(p, 1),
            acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee"),
            m_new,
        )
    o_ptrs = O + offs_m[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, acc / l[:, None])


out_h = torch.empty_like(qh)  # contiguous (64, 32) tensors: a row's stride is D
tiny_attention_kernel[(64 // 16,)](
    qh, kh, vh, out_h, 32**-0.5 * math.log2(math.e), N=128, D=32, BLOCK_M=16, BLOCK_N=16
)
torch.testing.assert_close(out_h, online_softmax_attention(qh, kh, vh, block_n=16))
print("the tiny Triton kernel gives step 1's result, and step 1 the definition's")

# %% [markdown]
# ### Step 3: the kernel an engine calls
# Step 2's loop body becomes `attend_block`, plus a mask and a guard for rows that have seen no
# visible key yet (`exp(-inf − (-inf))` is NaN). Around it the kernel adds what a batch of real
# prompts needs:
# * **Varlen**: the grid is (query tiles, groups of query heads, sequences); a program finds its
#   rows through `cu_seqlens`, reads through strides, and masks its loads where a length is not a
#   multiple of the tile.
# * **Causal, in two phases**: key blocks left of the diagonal are seen by every query of the tile:
#   no mask. Only those on the diagonal need one; those right of it are never loaded, half the work
#   of a square prompt.
# * **GQA**: query head `h` reads KV head `h // (num_heads // num_kv_heads)`, so one program serves
#   the `HEADS` query heads of a KV head: `HEADS × BLOCK_M` query rows against each K/V tile, loaded
#   once.
# * **One compile**: Triton compiles anew for each *specialization* of an integer argument (1, a
#   multiple of 16); `num_m_blocks` changes every batch, so `do_not_specialize` makes it a plain
#   integer.

# %% tags=["export"] module="minivllm.kernels.flash_attn"
import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def load_tile(ptrs, mask, UPCAST: tl.constexpr):
    """Load a K or V tile; zeros where masked. The CPU interpreter computes bf16 wrongly, so it
    upcasts."""
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def attend_block(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    offs_key,
    offs_m,
    k_len,
    shift,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One step of online softmax: fold keys `offs_key` (k: (D, BLOCK_N), v: (BLOCK_N, D)) into a
    query tile."""
    # (BLOCK_M, BLOCK_N), scaled below: s * qk_scale in log2 units
    s = tl.dot(q, k, input_precision=PRECISION)
    if MASKED:
        visible = (offs_key < k_len)[None, :]
        if CAUSAL:
            visible = visible & (offs_key[None, :] <= offs_m[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    # the scale and the max in one fused multiply-add
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def causal_bounds(
    start_m, k_len, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr
):
    """Keys [0, unmasked) are seen by every query of the tile (whole blocks); keys >= hi by none."""
    if CAUSAL:
        hi = tl.minimum(k_len, (start_m + 1) * BLOCK_M + shift)
        unmasked = tl.maximum(tl.minimum(hi, start_m * BLOCK_M + shift + 1), 0)
    else:
        hi, unmasked = k_len, k_len
    return (unmasked // BLOCK_N) * BLOCK_N, hi


@triton.jit(
    do_not_specialize=["num_m_blocks"]
)  # changes every step: one compiled kernel for all values
def _prefill_kernel(
    Q,
    K,
    V,
    O,
    cu_seqlens_q,
    cu_seqlens_k,
    qk_scale,
    num_m_blocks,  # tensors, scalars
    # strides
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = num_m_blocks - 1 - tl.program_id(0)  # longest causal tiles first
    first_head, seq = tl.program_id(1) * HEADS, tl.program_id(2)  # HEADS query heads of one KV head
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if start_m * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k + seq)
    k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
    kv_head = first_head // GROUP

    # tile row r: position r // HEADS, query head first_head + r % HEADS
    r = tl.arange(0, HEADS * BLOCK_M)
    offs_m, head = start_m * BLOCK_M + r // HEADS, first_head + r % HEADS
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    q_row_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + head[:, None] * stride_qh
    q_ptrs = q_row_ptrs + offs_d[None, :]  # (ROWS, D)
    q = load_tile(q_ptrs, (offs_m < q_len)[:, None], UPCAST)
    k_col_ptrs = K + (k_start + offs_n)[None, :] * stride_kt + kv_head * stride_kh
    k_ptrs = k_col_ptrs + offs_d[:, None]  # (D, BLOCK_N)
    v_row_ptrs = V + (k_start + offs_n)[:, None] * stride_vt + kv_head * stride_vh
    v_ptrs = v_row_ptrs + offs_d[None, :]  # (BLOCK_N, D)

    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = k_len - q_len  # bottom-right causal: query i sees keys j <= i + shift
    unmasked, hi = causal_bounds(start_m, k_len, shift, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, unmasked, BLOCK_N):  # phase 1: whole blocks every query sees, no masks
        k = load_tile(k_ptrs + start_n * stride_kt, None, UPCAST)
        v = load_tile(v_ptrs + start_n * stride_vt, None, UPCAST)
        acc, m_i, l_i = attend_block(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            start_n + offs_n,
            offs_m,
            k_len,
            shift,
            qk_scale,
            False,
            CAUSAL,
            PRECISION,
        )
    for start_n in range(unmasked, hi, BLOCK_N):  # phase 2: the diagonal and the ragged end, masked
        in_range = start_n + offs_n < k_len
        k = load_tile(k_ptrs + start_n * stride_kt, in_range[None, :], UPCAST)
        v = load_tile(v_ptrs + start_n * stride_vt, in_range[:, None], UPCAST)
        acc, m_i, l_i = attend_block(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            start_n + offs_n,
            offs_m,
            k_len,
            shift,
            qk_scale,
            True,
            CAUSAL,
            PRECISION,
        )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that sees no key outputs zeros
    o_row_ptrs = O + (q_start + offs_m)[:, None] * stride_ot + head[:, None] * stride_oh
    o_ptrs = o_row_ptrs + offs_d[None, :]  # (ROWS, D)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be (total_tokens, num_heads, head_dim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES or t.dtype != q.dtype:
            raise ValueError(
                f"{name}.dtype {t.dtype}: q, k, v must share a dtype of {SUPPORTED_DTYPES} (q: "
                f"{q.dtype})"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(
            f"head_dim must be 16, 32, 64, 128 or 256 and equal for q and k, got {head_dim}, "
            f"{k.shape[2]}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})"
        )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.dtype != torch.int32 or cu.device != q.device:
            raise ValueError(
                f"{name} must be 1-D int32 on {q.device}, got {cu.dtype} {tuple(cu.shape)} on "
                f"{cu.device}"
            )
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        n_q, n_k = cu_seqlens_q.numel(), cu_seqlens_k.numel()
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {n_q} and "
            f"{n_k}"
        )


def launch_config(head_dim: int, device: torch.device) -> dict:
    if device.type == "cpu":  # the interpreter: small tiles keep it quick
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    # The fastest tile of a sweep on an H200 (python -m minivllm.benchmarks.prefill --sweep),
    # head_dim 128, bf16
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3)


def heads_per_program(group: int, block_m: int) -> int:
    """How many query heads of one KV head a program serves: the largest power of two that divides
    the group and keeps a tile of block_m <= 128 positions at 128 rows at most (a KV tile loaded
    once serves them all)."""
    return math.gcd(group, max(1, 128 // block_m))


def softmax_scale_of(softmax_scale: float | None, head_dim: int) -> float:
    """1 / sqrt(head_dim) unless given; > 0, as `attend_block` scales a row's maximum and the masked
    scores' -inf."""
    if softmax_scale is None:
        return head_dim**-0.5
    if not softmax_scale > 0:  # NaN too
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    return softmax_scale


def flash_attn_varlen_contiguous(
    # (total_q, num_heads, head_dim), k, v: (total_k, kv_heads, ...)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,  # (batch + 1,) int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    # BLOCK_M, BLOCK_N, num_warps, num_stages; None: launch_config's (a sweep's own)
    *,
    tile: dict | None = None,
) -> torch.Tensor:  # (total_q, num_heads, head_dim)
    """FlashAttention over packed variable-length sequences, with the signature of flash-attn's
    `flash_attn_varlen_func`, for keys and values stored contiguously. Notebook 03's
    `flash_attn_varlen_func` adds `block_table=`, for keys and values that live in a paged KV cache,
    and calls this one without it."""
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if max_seqlen_q < 1 or max_seqlen_k < 0:
        raise ValueError(
            f"max_seqlen_q must be >= 1 and max_seqlen_k >= 0, got {max_seqlen_q}, {max_seqlen_k}"
        )
    head_dim, out = q.shape[2], torch.empty_like(q)
    qk_scale = softmax_scale_of(softmax_scale, head_dim) * math.log2(math.e)  # exp2 units
    config = tile or launch_config(head_dim, q.device)
    num_m_blocks, group = triton.cdiv(max_seqlen_q, config["BLOCK_M"]), q.shape[1] // k.shape[1]
    heads = heads_per_program(group, config["BLOCK_M"])
    grid = (num_m_blocks, q.shape[1] // heads, cu_seqlens_q.numel() - 1)
    strides = (
        *q.stride()[:2],
        *k.stride()[:2],
        *v.stride()[:2],
        *out.stride()[:2],
    )  # (token, head) of each
    fp32 = q.dtype == torch.float32
    # see load_tile
    upcast, precision = (q.device.type == "cpu" and not fp32, "ieee" if fp32 else "tf32")
    flags = dict(
        GROUP=group,
        HEADS=heads,
        HEAD_DIM=head_dim,
        CAUSAL=causal,
        UPCAST=upcast,
        PRECISION=precision,
    )
    _prefill_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        qk_scale,
        num_m_blocks,
        *strides,
        **flags,
        **config,
    )
    return out


# %% [markdown]
# ### Check the kernel against the reference
# Lengths on and next to tile boundaries (1, 15, 16, 17, 64, …), GQA, a cached prefix (more keys
# than queries). The test suite runs many more shapes, and bad inputs, each rejected with a
# `ValueError` naming the argument.

# %%
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous

# the last sequence continues after 35 cached tokens
q_lens, k_lens = ([1, 15, 16, 17, 64, 5], [1, 15, 16, 17, 64, 40])
cu_q, cu_k = (
    torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device=DEVICE)
    for lens in (q_lens, k_lens)
)
q, (k, v) = (
    torch.randn(sum(q_lens), 4, 32, device=DEVICE),
    torch.randn(2, sum(k_lens), 2, 32, device=DEVICE),
)  # GQA
for causal in (True, False):
    ours = flash_attn_varlen_contiguous(
        q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal
    )
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    print(f"causal={causal}: max abs error {(ours - ref).abs().max().item():.2e}")
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ### How fast is it?
# `python -m minivllm.benchmarks.prefill` times the kernel against SDPA (FlashAttention-2, cuDNN),
# FlashInfer and naive O(N²) attention, on one 16-head causal prompt of 1k to 16k tokens. On a GPU
# this cell re-measures 1k and 4k; else it shows the committed H200 results
# (`figures/prefill.json`): from 4k on, cuDNN and FlashInfer beat ours by 1.13-1.28×.

# %%
from minivllm.benchmarks.prefill import plot_prefill, run_prefill_benchmark

if DEVICE == "cuda":
    prefill = run_prefill_benchmark(seqlens=(1024, 4096))
else:
    prefill = json.loads(Path("figures/prefill.json").read_text())
plot_prefill(prefill).savefig(FIGURES / "01_prefill.png", dpi=120)
print(prefill["device"])
for row in prefill["rows"]:
    speed = f"{row['tflops']:7.1f} TFLOP/s ({row['ms']:.3f} ms)"
    print(f"{row['impl']:>16} N={row['seqlen']:>6}: {speed}")

# %% [markdown]
# ## Check yourself
# Set each `answerN` and run its cell: it compares your answer with what the kernel does. The worked
# answer follows.
#
# **1.** A prompt of 100 tokens continues after 60 cached tokens: its sequence has 160 keys. Which
# keys does its first query see? Answer the list of their indices. (Zero queries weigh every visible
# key equally, and key `j`'s value is 1 in feature `j` only: a nonzero output feature is a key
# seen.)

# %%
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
cu_q2, cu_k2 = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (100, 160))
# zero queries and keys: equal scores
zeros = torch.zeros(160, 2, 128, dtype=torch.bfloat16, device=DEVICE)
# key j: 1 in feature j of 2 × 128
v2 = torch.eye(160, 256, dtype=torch.bfloat16, device=DEVICE).view(160, 2, 128)
out2 = flash_attn_varlen_contiguous(zeros[:100], zeros, v2, cu_q2, cu_k2, 100, 160, causal=True)
# query 0: its heads' features side by side
seen_keys = out2[0].flatten().nonzero().flatten().tolist()
check_answer(answer1, seen_keys, "1. keys seen")

# %% [markdown]
# Worked answer: causal attention aligned bottom-right lets query `i` see keys `j ≤ i + (len_k −
# len_q)`; for `i = 0` that is `j ≤ 160 − 100 = 60`: the 60 cached tokens and its own, 61 keys.

# %%
check_answer(list(range(0 + (160 - 100) + 1)), seen_keys, "1. keys seen")

# %% [markdown]
# **2.** Causal attention never loads the key tiles right of the diagonal: half the work of a square
# prompt. A prompt of 40 tokens after 60 cached ones (100 keys), in tiles of 16 queries and 16 keys,
# has 3 query tiles and 7 key tiles (the last one ragged). How many key tiles does each query tile's
# program load? Answer a list, one count per query tile.
#
# The cell finds out by poisoning: copy `j` of the sequence has NaN values in key tile `j`. A
# program that loads that tile outputs NaN even where the mask hides its keys (weight 0, and 0 × NaN
# is NaN).

# %%
answer2 = None  # your answer: replace None with an expression
tile = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)  # the CPU's tiles, on any device
n_q, n_k, d = 40, 100, 16  # 40 new queries after 60 cached tokens; one head of 16 features
n_tiles = triton.cdiv(n_k, tile["BLOCK_N"])  # key tiles
tile_of_key = torch.arange(n_k, device=DEVICE) // tile["BLOCK_N"]
poison = tile_of_key == torch.arange(n_tiles, device=DEVICE)[:, None]  # (copy j, key)
v3 = torch.zeros(n_tiles * n_k, 1, d, device=DEVICE)
v3[poison.flatten()] = torch.nan  # copy j: NaN values in key tile j
q3, k3 = torch.zeros(n_tiles * n_q, 1, d, device=DEVICE), torch.zeros_like(v3)  # copies end to end
cu_q3 = torch.arange(0, n_tiles * n_q + 1, n_q, dtype=torch.int32, device=DEVICE)
cu_k3 = torch.arange(0, n_tiles * n_k + 1, n_k, dtype=torch.int32, device=DEVICE)
out3 = flash_attn_varlen_contiguous(q3, k3, v3, cu_q3, cu_k3, n_q, n_k, causal=True, tile=tile)
loaded = out3.view(n_tiles, n_q, d).isnan().any(-1)  # (copy j, query): loaded key tile j
tiles_read = loaded[:, :: tile["BLOCK_M"]].sum(0).tolist()  # a query tile's first row speaks for it
check_answer(answer2, tiles_read, "2. key tiles read")

# %% [markdown]
# Worked answer: query `i` sees keys `j ≤ i + 60`, so query tile `t` (queries `16t` to `16t + 15`)
# needs keys up to `16t + 75`, in key tile `(16t + 75) // 16 = t + 4`: tiles 0 to `t + 4`, at most
# all 7. That is 5, 6 and 7: 18 tiles loaded, where non-causal attention loads 21. Query tile 0
# loads key tile 4 (keys 64 to 79) for its last query, which sees key 75; its first query, which
# sees keys up to 60, gets NaN from it too: the mask hides keys, but a program loads whole tiles.

# %%
last_key = [min(16 * t + 75, 100 - 1) for t in range(3)]  # seen by each query tile's last query
check_answer([j // 16 + 1 for j in last_key], tiles_read, "2. key tiles read")

# %% [markdown]
# **Exercises** (solutions in `solutions/`): `exercises/01_online_softmax.ipynb` (the online softmax
# in PyTorch, for a causal sliding window that reads only the key blocks it reaches, then split-K);
# `exercises/01_triton_rmsnorm.ipynb` (vLLM's fused add + RMSNorm in Triton). **Next:** notebook 02
# builds Qwen3 from these layers; optional before it, `deep_dives/triton_layers.ipynb`: the small
# layers as fused GPU kernels, and why `torch.compile` is not enough.
