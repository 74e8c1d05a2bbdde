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
# **What this notebook builds.** Every layer Qwen3 (and Llama) is made of, written the way an inference engine needs
# them: activations, RMSNorm with a fused residual add, tensor-parallel linear layers that load HuggingFace weights,
# a vocabulary-parallel embedding and LM head, rotary position embeddings read from a transformers config, a plain
# PyTorch attention we trust, and a Triton FlashAttention kernel for prefill. It assumes you know what a transformer
# block is (attention + MLP, each wrapped in a norm and a residual add) and can read PyTorch. No GPU is needed: on a
# CPU the Triton kernel runs in Triton's interpreter.
#
# **Where the code goes.** Cells tagged `export` are written into the `minivllm` package by `python tools/export.py`;
# the other cells check each layer against PyTorch or transformers before we move on.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any @triton.jit runs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
print(f"device: {DEVICE}, torch {torch.__version__}")

# %% [markdown]
# ## Activations
# Qwen3's MLP is *gated*: one projection makes two vectors, `gate` and `up`, and the output is `silu(gate) * up`.
# SiLU (also called swish) is `x · sigmoid(x)`; GELU, used by Gemma and GPT-2, is the smooth cousin `x · Φ(x)`,
# usually computed with a tanh approximation. An engine computes `gate` and `up` with one matrix multiply (one weight
# read instead of two), so the activation receives them side by side in one tensor and splits it: `SiluAndMul`.
#
# Each small layer also has a `kernel` attribute, `None` by default: its PyTorch code runs. On a GPU a fused Triton
# kernel takes its place (the deep dive `triton_layers` writes them); nothing in the core path needs one.

# %% tags=["export"] module="minivllm.layers.activation"
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input holds [gate | up] along its last dimension."""

    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None  # a fused kernel instead (set per layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, 2 * intermediate_size)
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up  # (num_tokens, intermediate_size)


# %% [markdown]
# Check: our formulas are PyTorch's; `SiluAndMul` is what transformers' Qwen3 MLP computes from `gate` and `up`.

# %%
from minivllm.layers.activation import SiluAndMul, gelu_tanh, silu

x = torch.randn(7, 64)
torch.testing.assert_close(silu(x), torch.nn.functional.silu(x))
torch.testing.assert_close(gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"))
gate, up = torch.randn(7, 32), torch.randn(7, 32)
torch.testing.assert_close(SiluAndMul()(torch.cat([gate, up], -1)), torch.nn.functional.silu(gate) * up)

# %% [markdown]
# ## RMSNorm, with the residual add fused in (as a Triton kernel: `exercises/01_triton_rmsnorm.ipynb`)
# LayerNorm centres and scales; RMSNorm only scales, by the root mean square. One reduction instead of two, and Qwen3
# was trained with it, so we must match it exactly: the sum is taken in float32 even when the model runs in bfloat16.
#
# Every block does `residual = x + residual; x = norm(residual)`. Passing the residual into the norm lets
# one function (and, compiled, one kernel) do both, reading `x` from memory once instead of twice.

# %% tags=["export"] module="minivllm.layers.layernorm"
from collections.abc import Callable

import torch
from torch import nn

Pair = tuple[torch.Tensor, torch.Tensor]
NormKernel = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor | Pair]


class RMSNorm(nn.Module):
    kernel: NormKernel | None = None  # (x, weight, eps, residual): the add and the norm as one kernel (set per layer)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_rms_forward(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        residual = (x.float() + residual.float()).to(x.dtype)  # the new residual stream
        return self.rms_forward(residual), residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | Pair:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)


# %% [markdown]
# Check: the same numbers as transformers' `Qwen3RMSNorm`, in float32 and bfloat16; the fused form is "add, then norm".

# %%
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from minivllm.layers.layernorm import RMSNorm

ref, ours = Qwen3RMSNorm(64, eps=1e-6), RMSNorm(64, eps=1e-6)
with torch.no_grad():
    ref.weight.normal_()
    ours.weight.copy_(ref.weight)
for dtype in (torch.float32, torch.bfloat16):
    x, res = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    torch.testing.assert_close(ours.to(dtype)(x), ref.to(dtype)(x), rtol=0, atol=0)
    normed, new_res = ours.to(dtype)(x, res)
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref.to(dtype)(x + res), rtol=0, atol=0)
print("RMSNorm matches Qwen3RMSNorm bit for bit")

# %% [markdown]
# ## Tensor-parallel linear layers
# With tensor parallelism (TP) each of N GPUs holds a slice of every weight matrix, cut one of two ways:
# * **Column parallel**: split the *output* features. Each rank computes its slice of `y = x Wᵀ`; no communication.
#   Used for the QKV projection and the MLP's gate/up projection.
# * **Row parallel**: split the *input* features. Each rank computes a partial sum; an all-reduce adds them. Used for
#   the attention output and the MLP's down projection, right after a column-parallel layer whose output slice is
#   exactly the input slice it needs: two all-reduces a block, whatever N is.
#
# Checkpoints store full, separate matrices (`q_proj`, `k_proj`, ...), so each parameter has a `weight_loader` that
# copies in this rank's slice, at its offset when several are packed into one of ours. A layer takes its rank from the
# `with tensor_parallel(TPGroup(...))` block it is built in (notebook 06); outside one it is whole: rank 0 of 1.

# %% tags=["export"] module="minivllm.layers.linear"
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TPGroup:
    """The ranks one model is split over: this one's rank, their number, and the process group they communicate on."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed process group (or backend) of `size` ranks


_building = TPGroup()  # the group of the layers being built now


@contextmanager
def tensor_parallel(tp: TPGroup) -> Iterator[TPGroup]:
    """Layers built inside this block split themselves over `tp` and keep it: each model owns its group."""
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


class Gemv(Protocol):  # one token's F.linear(x, weight, bias) as one kernel; gated: silu(gate) * up of [gate | up]
    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
    ) -> torch.Tensor: ...


class LinearBase(nn.Module):
    """y = x Wᵀ (+ b) on this rank's slice; `tp_dim` is the weight dimension that is split (None: replicated)."""

    kernel: Gemv | None = None  # a matrix-vector kernel for one token (set per layer)

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None):
        super().__init__()
        self.tp = tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.tp_dim = tp_dim
        # a hook the checkpoint loader calls (notebook 02); mypy: Parameter declares no such attribute
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        shape = list(param.shape)
        if self.tp_dim is not None and self.tp_dim < len(shape):
            shape[self.tp_dim] *= self.tp_size
        return tuple(shape)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(type(self).__name__, loaded, self.full_shape(param))
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            loaded = loaded.chunk(self.tp_size, self.tp_dim)[self.tp_rank]
        param.data.copy_(loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # x: (num_tokens, input_size)
        if self.kernel is not None and x.shape[0] == 1:  # a matrix-vector product: cuBLAS's tiles waste bandwidth
            return self.kernel(x, self.weight, bias)
        return F.linear(x, self.weight, bias)  # (num_tokens, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, input_size)
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: each computes y[:, its slice]; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_group().size), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one weight, e.g. [gate | up]; each rank keeps its slice of each."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    # the loader passes a packed layer its shard id: a signature LinearBase's loader does not have
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:  # type: ignore[override]
        full = list(self.full_shape(param))
        full[0] = self.output_sizes[shard_id]
        check_shape(f"{type(self).__name__}[{shard_id}]", loaded, tuple(full))
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.chunk(self.tp_size, 0)[self.tp_rank])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight; each rank keeps its attention heads (and their KV heads)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = tp_group().size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        self.num_kv_heads = divide(num_kv_heads, tp_size)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:  # type: ignore[override]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        full = list(param.shape)
        full[0] = size * self.tp_size
        check_shape(f"{type(self).__name__}[{shard_id}]", loaded, tuple(full))
        param.data.narrow(0, offset, size).copy_(loaded.chunk(self.tp_size, 0)[self.tp_rank])


class RowParallelLinear(LinearBase):
    """Input features split across ranks: each computes a partial sum, then an all-reduce adds them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_group().size), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, input_size / tp)
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp.group)
        return y  # (num_tokens, output_size)


# %% [markdown]
# Check: each layer loaded from HF-shaped tensors computes `F.linear` with those tensors packed as we packed them; a
# row-parallel layer over two ranks, in this one process, gives partial sums that add up to the whole layer (the
# all-reduce, stubbed out). The test suite runs two real ranks over gloo, and checkpoint tensors of a wrong shape.

# %%
from unittest import mock

from minivllm.layers import linear
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

hidden, head_dim, num_heads, num_kv_heads = 64, 16, 4, 2
x = torch.randn(3, hidden)
wq, wk, wv = (torch.randn(heads * head_dim, hidden) for heads in (num_heads, num_kv_heads, num_kv_heads))
wg, wu = torch.randn(96, hidden), torch.randn(96, hidden)
qkv = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads)
gate_up = MergedColumnParallelLinear(hidden, [96, 96])
for layer, shards in ((qkv, zip("qkv", (wq, wk, wv))), (gate_up, enumerate((wg, wu)))):
    for shard_id, w in shards:
        layer.weight.weight_loader(layer.weight, w, shard_id)
torch.testing.assert_close(qkv(x), torch.cat([x @ wq.T, x @ wk.T, x @ wv.T], -1))
torch.testing.assert_close(gate_up(x), torch.cat([x @ wg.T, x @ wu.T], -1))

wd, b, x2 = torch.randn(hidden, 96), torch.randn(hidden), torch.randn(3, 96)
halves = []  # row parallel over 2 ranks in this process: each keeps 48 input columns and adds a partial sum
for rank in range(2):
    with linear.tensor_parallel(linear.TPGroup(rank=rank, size=2)):  # the layer each of two processes would build
        halves.append(linear.RowParallelLinear(96, hidden, bias=True))
    halves[-1].weight.weight_loader(halves[-1].weight, wd)
    halves[-1].bias.weight_loader(halves[-1].bias, b)
with mock.patch.object(torch.distributed, "all_reduce", lambda y, group=None: None):  # we add the two below
    partial = [layer(x_half) for layer, x_half in zip(halves, x2.chunk(2, dim=-1))]
torch.testing.assert_close(sum(partial), x2 @ wd.T + b)  # the bias once: only rank 0 adds it

# %% [markdown]
# ## Vocabulary-parallel embedding and LM head
# The embedding table (151,936 × 1,024 for Qwen3-0.6B, 0.16 B parameters) is split by rows: each rank owns a range
# of token ids, looks up the ids it owns, writes zeros for the others, and an all-reduce sums the pieces. The LM head
# is the same matrix used the other way round (Qwen3-0.6B *ties* them): each rank computes the logits of its
# vocabulary slice, and a gather puts them side by side.

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
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # the loader's hook, as above

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
    """Logits = hidden @ Wᵀ; each rank computes its vocabulary slice and all ranks gather the full row."""

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
# Attention by itself cannot tell positions apart. RoPE rotates each pair of query/key features by an angle
# proportional to the token's position, `θ_i = position · base^(-2i/d)`, so the dot product of a query at position m
# with a key at position n depends only on `m − n`. Qwen3 uses base θ = 1,000,000; Llama-3 also stretches the low
# frequencies ("llama3" scaling) to reach longer contexts. The parameters are in `config.rope_parameters`
# (transformers 5) or `rope_theta` + `rope_scaling` (older checkpoints): an engine reads both. `cos` and `sin` are
# computed once for every position; a layer gathers the rows of its tokens' positions.

# %% tags=["export"] module="minivllm.layers.rotary_embedding"
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minivllm.layers.layernorm import Pair, RMSNorm

Norms = tuple[RMSNorm, RMSNorm]  # Qwen3's q_norm and k_norm
RopeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Norms | None], Pair]


def rope_parameters(config: Any) -> dict:
    """RoPE settings from a transformers config of any version: {'rope_type', 'rope_theta', ...scaling keys}."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.pop("type", None) or params.get("rope_type", "default")  # "type": pre-4.45 configs
    if params["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"rope_type={params['rope_type']!r} is not supported (supported: 'default', 'llama3')")
    return params


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama-3 scaling: keep high frequencies, divide low ones by `factor`, interpolate in between."""
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
    kernel: RopeKernel | None = None  # (positions, q, k, cos, sin, norms): q and k as one kernel (set per layer)

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        # the table on the CPU, then to the default device: on the meta device, `arange` would import torch._dynamo
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim))
        if params["rope_type"] == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, params)
        freqs = torch.arange(max_position, device="cpu").float()[:, None] * inv_freq  # (max_position, head_dim / 2)
        self.register_buffer("cos", freqs.cos().to(torch.get_default_device()), persistent=False)
        self.register_buffer("sin", freqs.sin().to(torch.get_default_device()), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)  # the two halves of each head: (num_tokens, num_heads, head_dim / 2)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, norms: Norms | None = None) -> Pair:
        # positions: (num_tokens,); q, k: (num_tokens, num_heads, head_dim)
        """Rotate q and k; with `norms` (Qwen3's q_norm, k_norm), normalise each head of q and of k first."""
        if self.kernel is not None:
            return self.kernel(positions, q, k, self.cos, self.sin, norms)
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (num_tokens, 1, head_dim / 2)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))


# %% [markdown]
# Check: transformers' own RoPE (`Qwen3RotaryEmbedding`, `apply_rotary_pos_emb`) rotates q and k as ours does, for
# Qwen3's default RoPE and for Llama-3.2's scaled one.

# %%
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from minivllm.layers.rotary_embedding import get_rope

rope32 = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
rope32["original_max_position_embeddings"] = 8192  # Llama-3.2's: 8k trained, 128k scaled by 32
qwen3_cfg = Qwen3Config(head_dim=64, num_attention_heads=4, max_position_embeddings=4096, rope_theta=1e6)
llama_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=rope32)
configs = {"qwen3": (qwen3_cfg, Qwen3RotaryEmbedding), "llama3.2": (llama_cfg, LlamaRotaryEmbedding)}
positions = torch.tensor([0, 1, 7, 100, 4095])
for name, (config, hf_rope) in configs.items():
    q, k = torch.randn(5, 4, 64), torch.randn(5, 4, 64)
    cos, sin = hf_rope(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = get_rope(config, 64)(positions, q, k)
    torch.testing.assert_close((q_ours, k_ours), (q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)))
    print(f"{name}: RoPE matches transformers ({get_rope(config, 64).cos.shape[0]} cached positions)")

# %% [markdown]
# ## Attention, the plain way
# Before writing a fast kernel we need one we trust. An engine packs the prompts of a batch end to end in one flat
# tensor (no padding) and passes `cu_seqlens`, the cumulative lengths: sequence `i` is rows
# `cu_seqlens[i]:cu_seqlens[i+1]`. This is flash-attn's *varlen* convention and we keep it everywhere. Also:
# * **GQA** (grouped-query attention): Qwen3-0.6B has 16 query heads but only 8 key/value heads; query head `h`
#   reads KV head `h // 2`. Fewer KV heads means a smaller KV cache.
# * **Causal, aligned bottom-right**: when a sequence has more keys than queries (the first keys are a cached
#   prefix), query `i` sees keys `j ≤ i + (len_k − len_q)`: prefill continues from a cached prefix (notebook 03).

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
    """Varlen attention in plain PyTorch, one sequence at a time: the reference every kernel is checked against."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = *cu_seqlens_q[i : i + 2].tolist(), *cu_seqlens_k[i : i + 2].tolist()
        qi = q[qs:qe].transpose(0, 1).float()  # (num_heads, len_q, head_dim)
        ki = k[ks:ke].transpose(0, 1).float().repeat_interleave(group, dim=0)  # (num_heads, len_k, head_dim)
        vi = v[ks:ke].transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = (qi @ ki.transpose(1, 2)) * scale  # (num_heads, len_q, len_k): the O(N²) tensor
        if causal:
            len_q, len_k = qe - qs, ke - ks
            visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(diagonal=len_k - len_q)
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key outputs zeros
        out[qs:qe] = (probs @ vi).transpose(0, 1).to(q.dtype)
    return out


# %% [markdown]
# Check: for one sequence, the reference is PyTorch's `scaled_dot_product_attention` (KV heads expanded), causal or not.

# %%
from minivllm.kernels.reference import attention_ref

q, k, v = torch.randn(37, 8, 32), torch.randn(37, 2, 32), torch.randn(37, 2, 32)
cu = torch.tensor([0, 37], dtype=torch.int32)
q_h, k_h, v_h = q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1), v.repeat_interleave(4, 1).transpose(0, 1)
for causal in (False, True):
    sdpa = torch.nn.functional.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal).transpose(0, 1)
    torch.testing.assert_close(attention_ref(q, k, v, cu, cu, causal=causal), sdpa, rtol=1e-5, atol=1e-5)

# %% [markdown]
# ### Why the plain way does not scale: O(N²) memory
# The reference materialises `scores`, one float per (head, query, key) pair. For a 16k-token prompt with Qwen3-0.6B's
# 16 heads that is 16 × 16,384² × 4 bytes = 16 GiB *per layer*, far more than the model itself. FlashAttention never
# builds it: it walks over the keys in blocks, keeping for each query row only a running maximum `m`, a running sum
# `l` and the output accumulator: O(head_dim) per row, O(N) in all. First the claim, measured: the reference builds
# a `(heads, N, N)` tensor.


# %%
seen, softmax = [], torch.softmax
torch.softmax = lambda x, dim: (seen.append(x.shape), softmax(x, dim=dim))[1]  # record the scores' shape
try:
    n = 512
    q_n, k_n, v_n = (torch.randn(n, heads, 128) for heads in (16, 8, 8))
    attention_ref(q_n, k_n, v_n, torch.tensor([0, n]), torch.tensor([0, n]), causal=True)
finally:
    torch.softmax = softmax
assert seen == [(16, n, n)], seen
print(f"scores tensor for N={n}: {seen[0]} = {16 * n * n * 4 / 2**20:.0f} MiB in fp32")

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
num_heads, head_dim, lengths = 16, 128, 2 ** np.arange(9, 16)  # Qwen3-0.6B's heads; N = 512 ... 32,768
naive_bytes = num_heads * lengths.astype(float) ** 2 * 4  # fp32 scores (the probabilities need as much again)
flash_bytes = num_heads * lengths * (head_dim * 4 + 2 * 4)  # fp32 accumulator + m + l per query row
fig, ax = plt.subplots(figsize=(6, 3.8))
ax.loglog(lengths, naive_bytes / 2**30, "o-", label="naive: scores (heads × N × N)")
ax.loglog(lengths, flash_bytes / 2**30, "s-", label="FlashAttention: acc, m, l (heads × N × d)")
ax.axhline(141e9 / 2**30, color="grey", ls=":", label="H200 memory (141 GB = 131 GiB)")
ax.set(xlabel="sequence length N", ylabel="GiB per layer", title="Attention working memory, 16 heads of 128")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.93))  # under the H200 line
fig.tight_layout()
fig.savefig(FIGURES / "01_attention_memory.png", dpi=120)
print(f"at N=32k: naive {naive_bytes[-1] / 2**30:.0f} GiB vs flash {flash_bytes[-1] / 2**30:.2f} GiB per layer")
total = 28 * naive_bytes[-1]  # Qwen3-0.6B's 28 layers
print(f"naive, all 28 layers: {total / 1e12:.1f} TB, what {total / 141e9:.0f} H200s hold")

# %% [markdown]
# ## A FlashAttention prefill kernel in Triton (try `exercises/01_online_softmax.ipynb` first)
# Prefill processes whole prompts: thousands of queries per sequence, so attention is a pair of large matrix
# multiplies, *compute-bound*. The kernel must keep the tensor cores busy and never write `scores` to memory. We
# build it in three steps, each checked against the one before: the online softmax in PyTorch, the same loop as a
# tiny Triton kernel, then the full kernel. The exercise has you write step 1 (with the causal mask, the log-sum-exp
# and split-K): try it before reading on.
#
# ### Step 1: the online softmax, in PyTorch
# Softmax divides by a sum over *all* of a row's keys, which is why the reference holds every score at once. The
# online softmax walks over the keys in blocks of `BLOCK_N`, keeping per query row a running max `m`, a running sum
# `l` and an unnormalised output `acc`:
#
# 1. `s = q · kᵀ · scale` for the block, and the new running max `m' = max(m, rowmax(s))`;
# 2. rescale what was accumulated by `α = exp(m − m')`, with `p = exp(s − m')`: `l ← l·α + rowsum(p)`,
#    `acc ← acc·α + p·v`; at the end, `out = acc / l`.
#
# The result is exactly softmax(s)·v (up to rounding), but only one block of scores ever exists. Here it is for one
# head with every key visible; `rescale=False` skips the rescaling by `α`, to show why it is there.


# %%
def online_softmax_attention(
    q: torch.Tensor,  # (num_q, head_dim)
    k: torch.Tensor,  # (num_k, head_dim)
    v: torch.Tensor,  # (num_k, head_dim)
    block_n: int,
    rescale: bool = True,
) -> torch.Tensor:  # (num_q, head_dim)
    """softmax(q kᵀ · scale) v for one head, reading the keys block_n at a time."""
    m = q.new_full((q.shape[0],), float("-inf"))  # (num_q,): running max of each row's scores
    l = q.new_zeros(q.shape[0])  # (num_q,): running Σ exp(score - m)
    acc = torch.zeros_like(q)  # (num_q, head_dim): running Σ exp(score - m) · v
    for k_blk, v_blk in zip(k.split(block_n), v.split(block_n)):  # (block_n, head_dim), fewer at the end
        s = q @ k_blk.T * q.shape[1] ** -0.5  # (num_q, block_n): the only scores that exist
        m_new = torch.maximum(m, s.amax(dim=1))
        alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)  # (num_q,): 0 on the first block
        p = torch.exp(s - m_new[:, None])  # (num_q, block_n)
        l, acc, m = l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v_blk, m_new
    return acc / l[:, None]


qh, kh, vh = (torch.randn(n, 32, device=DEVICE) for n in (64, 128, 128))  # one head: 64 queries, 128 keys
cu_qh, cu_kh = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (64, 128))
ref_h = attention_ref(qh[:, None], kh[:, None], vh[:, None], cu_qh, cu_kh)[:, 0]  # (64, 32)
for block_n in (128, 48, 16):  # one block (nothing to rescale), ragged blocks of 48, blocks of 16
    torch.testing.assert_close(online_softmax_attention(qh, kh, vh, block_n), ref_h)
wrong = (online_softmax_attention(qh, kh, vh, 16, rescale=False) - ref_h).abs().max().item()
print(f"without rescaling by α, blocks of 16: max error {wrong:.2f}")
assert wrong > 0.01  # rounding alone would give ~1e-7

# %% [markdown]
# ### Step 2: the same loop as a Triton kernel
# A Triton *program* computes on whole tiles. Ours loads a `(BLOCK_M, D)` tile of queries once, then runs step 1's
# loop over `(BLOCK_N, D)` tiles of keys and values, with `tl.dot` for both products; the grid launches one program
# per query tile, in parallel. A program only gets pointers: a tile's addresses are `base + row · row_stride +
# column`, built from `tl.arange` (for `kᵀ`, swap which offsets go down and which go across). One change of
# arithmetic: `exp2`, with `log2(e)` folded into the scale (`exp(x) = exp2(x · log2 e)`; the hardware computes `exp2`
# natively). To stay tiny it takes one head, no mask, and lengths that are multiples of the tiles.

# %%
import triton
import triton.language as tl


@triton.jit
def tiny_attention_kernel(  # Q, O: (num_q, D), K, V: (N, D), contiguous; qk_scale in log2 units
    Q, K, V, O, qk_scale, N: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's query rows
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])  # (BLOCK_M, D), loaded once
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        k_t = tl.load(K + (start + offs_n)[None, :] * D + offs_d[:, None])  # (D, BLOCK_N): kᵀ
        v = tl.load(V + (start + offs_n)[:, None] * D + offs_d[None, :])  # (BLOCK_N, D)
        s = tl.dot(q, k_t, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N), in log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], acc / l[:, None])


out_h = torch.empty_like(qh)  # contiguous (64, 32) tensors: a row's stride is D
tiny_attention_kernel[(64 // 16,)](qh, kh, vh, out_h, 32**-0.5 * math.log2(math.e), N=128, D=32, BLOCK_M=16, BLOCK_N=16)
torch.testing.assert_close(out_h, online_softmax_attention(qh, kh, vh, block_n=16))
print("the tiny Triton kernel gives step 1's result; step 1 gives the reference's")

# %% [markdown]
# ### Step 3: the kernel an engine calls
# Step 2's loop body becomes `attend_block` below, plus a mask and a guard for rows that have seen no visible key
# yet (`exp(-inf − (-inf))` is NaN). Around it the full kernel adds what a batch of real prompts needs:
#
# * **Varlen**: the grid is (query tiles, groups of query heads, sequences); a program finds its sequence's rows
#   through `cu_seqlens`, reads through strides, and masks its loads where a length is not a multiple of the tile.
# * **Causal, in two phases**: key blocks left of the diagonal are visible to every query of the tile and need no
#   mask; only the few on the diagonal do. Blocks right of it are never loaded: half the work of a square prompt.
# * **GQA**: query head `h` reads KV head `h // (num_heads // num_kv_heads)`, so one program serves the `HEADS` query
#   heads of a KV head (Qwen3's 2): `HEADS × BLOCK_M` query rows against each K/V tile, loaded once.
# * **One compile, not one per step**: Triton compiles anew for each *specialization* of an integer argument (a value
#   of 1, a multiple of 16). `num_m_blocks` changes with every batch, so `do_not_specialize` makes it a plain integer.

# %% tags=["export"] module="minivllm.kernels.flash_attn"
import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def load_tile(ptrs, mask, UPCAST: tl.constexpr):
    """Load a K or V tile; zeros where masked. The CPU interpreter computes bf16 wrongly, so it upcasts."""
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def attend_block(
    acc, m_i, l_i, q, k, v, offs_key, offs_m, k_len, shift, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One step of online softmax: fold keys `offs_key` (k: (D, BLOCK_N), v: (BLOCK_N, D)) into a query tile."""
    s = tl.dot(q, k, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), scaled below: s * qk_scale in log2 units
    if MASKED:
        visible = (offs_key < k_len)[None, :]
        if CAUSAL:
            visible = visible & (offs_key[None, :] <= offs_m[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])  # the scale and the max in one fused multiply-add
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def causal_bounds(start_m, k_len, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys [0, unmasked) are seen by every query of the tile (whole blocks); keys >= hi by none."""
    if CAUSAL:
        hi = tl.minimum(k_len, (start_m + 1) * BLOCK_M + shift)
        unmasked = tl.maximum(tl.minimum(hi, start_m * BLOCK_M + shift + 1), 0)
    else:
        hi = k_len
        unmasked = k_len
    return (unmasked // BLOCK_N) * BLOCK_N, hi


@triton.jit(do_not_specialize=["num_m_blocks"])  # changes every step: one compiled kernel for all values
def _prefill_kernel(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k, qk_scale, num_m_blocks,  # tensors, scalars
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,  # strides
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    start_m = num_m_blocks - 1 - tl.program_id(0)  # longest causal tiles first
    first_head, seq = tl.program_id(1) * HEADS, tl.program_id(2)  # HEADS query heads of one KV head
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if start_m * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k + seq)
    k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
    kv_head = first_head // GROUP

    r = tl.arange(0, HEADS * BLOCK_M)  # tile row r: position r // HEADS, query head first_head + r % HEADS
    offs_m, head = start_m * BLOCK_M + r // HEADS, first_head + r % HEADS
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]  # (ROWS, D)
    q = load_tile(q_ptrs, (offs_m < q_len)[:, None], UPCAST)
    k_ptrs = K + (k_start + offs_n)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]  # (D, BLOCK_N)
    v_ptrs = V + (k_start + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]  # (BLOCK_N, D)

    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], dtype=tl.float32)
    shift = k_len - q_len  # bottom-right causal: query i sees keys j <= i + shift
    unmasked, hi = causal_bounds(start_m, k_len, shift, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, unmasked, BLOCK_N):  # phase 1: whole blocks every query sees, no masks
        k = load_tile(k_ptrs + start_n * stride_kt, None, UPCAST)
        v = load_tile(v_ptrs + start_n * stride_vt, None, UPCAST)
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, k, v, start_n + offs_n, offs_m, k_len, shift, qk_scale, False, CAUSAL, PRECISION
        )
    for start_n in range(unmasked, hi, BLOCK_N):  # phase 2: the diagonal and the ragged end, masked
        in_range = start_n + offs_n < k_len
        k = load_tile(k_ptrs + start_n * stride_kt, in_range[None, :], UPCAST)
        v = load_tile(v_ptrs + start_n * stride_vt, in_range[:, None], UPCAST)
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, k, v, start_n + offs_n, offs_m, k_len, shift, qk_scale, True, CAUSAL, PRECISION
        )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that sees no key outputs zeros
    o_ptrs = O + (q_start + offs_m)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]  # (ROWS, D)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be (total_tokens, num_heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype must be one of {SUPPORTED_DTYPES}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be 16, 32, 64, 128 or 256 and equal for q and k, got {head_dim}, {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.dtype != torch.int32 or cu.device != q.device:
            raise ValueError(f"{name} must be 1-D int32 on {q.device}, got {cu.dtype} {tuple(cu.shape)} on {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        n_q, n_k = cu_seqlens_q.numel(), cu_seqlens_k.numel()
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {n_q} and {n_k}")


def launch_config(head_dim: int, device: torch.device) -> dict:
    if device.type == "cpu":  # the interpreter: small tiles keep it quick
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    # The fastest tile of a sweep on an H200 (python -m minivllm.benchmarks.prefill --sweep), head_dim 128, bf16
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3)


def heads_per_program(group: int, block_m: int) -> int:
    """How many query heads of one KV head a program serves: the largest power of two that divides the group and
    keeps a tile of block_m <= 128 positions at 128 rows at most (a KV tile loaded once serves them all)."""
    return math.gcd(group, max(1, 128 // block_m))


def softmax_scale_of(softmax_scale: float | None, head_dim: int) -> float:
    """The scores' scale, 1 / sqrt(head_dim) unless given. It must be positive: `attend_block` takes a row's maximum
    before scaling, and scales the masked scores' -inf."""
    if softmax_scale is None:
        return head_dim**-0.5
    if not softmax_scale > 0:  # NaN too
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    return softmax_scale


def flash_attn_varlen_contiguous(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # (total_q, num_heads, head_dim), k, v: (total_k, kv_heads, ...)
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,  # (batch + 1,) int32
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = None, causal: bool = False,
    *, tile: dict | None = None,  # BLOCK_M, BLOCK_N, num_warps, num_stages; None: launch_config's (a sweep's own)
) -> torch.Tensor:  # (total_q, num_heads, head_dim)  # fmt: skip
    """FlashAttention over packed variable-length sequences, with the signature of flash-attn's
    `flash_attn_varlen_func`, for keys and values stored contiguously. Notebook 03's `flash_attn_varlen_func`
    adds `block_table=`, for keys and values that live in a paged KV cache, and calls this one without it."""
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if max_seqlen_q < 1 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q must be >= 1 and max_seqlen_k >= 0, got {max_seqlen_q}, {max_seqlen_k}")
    head_dim = q.shape[2]
    scale = softmax_scale_of(softmax_scale, head_dim)
    out = torch.empty_like(q)
    config = tile or launch_config(head_dim, q.device)
    num_m_blocks, group = triton.cdiv(max_seqlen_q, config["BLOCK_M"]), q.shape[1] // k.shape[1]
    heads = heads_per_program(group, config["BLOCK_M"])
    grid = (num_m_blocks, q.shape[1] // heads, cu_seqlens_q.numel() - 1)
    qk_scale = scale * math.log2(math.e)  # exp2 units
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2])  # (token, head) of each
    fp32 = q.dtype == torch.float32
    upcast, precision = q.device.type == "cpu" and not fp32, "ieee" if fp32 else "tf32"  # see load_tile
    flags = dict(GROUP=group, HEADS=heads, HEAD_DIM=head_dim, CAUSAL=causal, UPCAST=upcast, PRECISION=precision)
    _prefill_kernel[grid](q, k, v, out, cu_seqlens_q, cu_seqlens_k, qk_scale, num_m_blocks, *strides, **flags, **config)
    return out


# %% [markdown]
# ### Check the kernel against the reference
# Lengths on and next to tile boundaries (1, 15, 16, 17, 64, …), GQA, a cached prefix (more keys than queries); then
# bad input, which gets a `ValueError` naming the argument. The test suite runs many more shapes.

# %%
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous


def random_varlen(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, device=DEVICE):
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device=device) for lens in (q_lens, k_lens))
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    k, v = torch.randn(2, sum(k_lens), num_kv_heads, head_dim, dtype=dtype, device=device)
    return q, k, v, cu_q, cu_k


q_lens = [1, 15, 16, 17, 64, 5]
k_lens = [1, 15, 16, 17, 64, 40]  # the last sequence continues after 35 cached tokens
q, k, v, cu_q, cu_k = random_varlen(q_lens, k_lens, num_heads=4, num_kv_heads=2, head_dim=32)
for causal in (True, False):
    ours = flash_attn_varlen_contiguous(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    print(f"causal={causal}: max abs error {(ours - ref).abs().max().item():.2e}")
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
for bad in (dict(k=k[:, :, :16]), dict(cu_seqlens_q=cu_q.long()), dict(v=v.double())):
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=64, max_seqlen_k=64) | bad
    try:
        flash_attn_varlen_contiguous(**args)
    except ValueError as e:
        print("ValueError:", e)
    else:
        raise AssertionError(f"accepted bad input {list(bad)}")

# %% [markdown]
# ### How fast is it?
# `python -m minivllm.benchmarks.prefill` times the kernel on a GPU against PyTorch's SDPA (FlashAttention-2 and
# cuDNN), FlashInfer's and a naive O(N²) attention, for one 16-head causal prompt of 1k to 16k tokens. On a GPU this
# cell re-measures 1k and 4k; without one it shows the committed H200 results (`figures/prefill.json`): the bars to
# reach are cuDNN's and FlashInfer's, 1.13-1.28× faster than ours from 4k on.

# %%
import json

from minivllm.benchmarks.prefill import plot_prefill, run_prefill_benchmark

if DEVICE == "cuda":
    prefill = run_prefill_benchmark(seqlens=(1024, 4096))
else:
    prefill = json.loads(Path("figures/prefill.json").read_text())
plot_prefill(prefill).savefig(FIGURES / "01_prefill.png", dpi=120)
print(prefill["device"])
for row in prefill["rows"]:
    print(f"{row['impl']:>16} N={row['seqlen']:>6}: {row['tflops']:7.1f} TFLOP/s ({row['ms']:.3f} ms)")

# %% [markdown]
# ## Check yourself
# A prompt of 100 tokens continues after 60 cached tokens, so its sequence has 160 keys. Which keys does its first
# query see? Replace `None` with the list of their indices and run the cell: the check compares it with what the
# kernel says. (It runs with zero queries, which weigh every visible key equally, and key `j`'s value is 1 in feature
# `j` only: the output is nonzero where a key was seen.) The worked answer follows.

# %%
from minivllm.testing import check_answer

answer = None  # your answer: replace None with an expression
q2, k2, _, cu_q2, cu_k2 = random_varlen([100], [160], 2, 2, 128, dtype=torch.bfloat16)
v2 = torch.eye(160, 256, dtype=torch.bfloat16, device=DEVICE).view(160, 2, 128)  # key j: 1 in feature j of 2 × 128
out2 = flash_attn_varlen_contiguous(torch.zeros_like(q2), k2, v2, cu_q2, cu_k2, 100, 160, causal=True)
seen_keys = out2[0].flatten().nonzero().flatten().tolist()  # query 0: its heads' features side by side
check_answer(answer, seen_keys, "keys seen")

# %% [markdown]
# Worked answer: causal attention aligned bottom-right lets query `i` see keys `j ≤ i + (len_k − len_q)`; for `i = 0`
# that is `j ≤ 160 − 100 = 60`: the 60 cached tokens and its own, 61 keys.

# %%
check_answer(list(range(0 + (160 - 100) + 1)), seen_keys, "keys seen")

# %% [markdown]
# **Exercises** (solutions in `solutions/`): `exercises/01_online_softmax.ipynb` (the online softmax and split-K in
# PyTorch) and `exercises/01_triton_rmsnorm.ipynb` (vLLM's fused add + RMSNorm as a Triton kernel). **Next:**
# notebook 02 builds Qwen3 from these layers; optional before it, the deep dive `deep_dives/triton_layers.ipynb`:
# the small layers as fused GPU kernels, and why `torch.compile` is not enough.
