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
# # Exercise 02 · Adding Llama-3.2 to minivllm
#
# Notebook 02 built Qwen3 from the layers of notebook 01 and a loader that picks the model class
# from `config.json`'s `"architectures"`. Serving another model family means writing its classes and
# adding one entry to the loader's registry, `MODELS`. Llama-3.2 (1B and 3B) is the natural second
# family: Qwen3 is Llama's architecture plus a norm on each query and key head, so most of the
# classes are Qwen3's with that norm taken out, and they are given below. Three pieces are not in
# notebook 02, and you write them:
#
# 1. `llama3_inv_freq`: Llama-3's RoPE frequency scaling, checked against transformers' own
#    frequencies and its cos/sin tables at every one of the 131,072 positions;
# 2. `checkpoint_packing`: which of the checkpoint's projections goes into which shard of our packed
#    `qkv_proj` and `gate_up_proj`, checked by where each projection's output lands;
# 3. `LlamaAttention`, checked against transformers' attention on one rank and split over two
#    (notebook 01's parallel layers, the all-reduce stubbed out).
#
# Then `minivllm.load_model` loads three random Llama checkpoints with your classes, and the logits
# must equal transformers' Llama. Three questions at the end ask you to compute with what you built.
#
# **What it assumes.** Notebooks 01 (layers, tensor parallelism) and 02 (Qwen3, the loader). No GPU:
# everything runs in float32 on the CPU in well under a minute. About an hour.

# %% [markdown]
# ## What changes from Qwen3, and why
#
# | | Qwen3 | Llama-3.2 | here |
# |---|---|---|---|
# | q/k RMSNorm per head, before RoPE | yes | **no** | given: Qwen3's classes without it |
# | RoPE | plain, theta 1e6 | **`rope_type: "llama3"`** scaling, theta 5e5 | you write the scaling |
# | bias flags | `attention_bias` | `attention_bias` **and** `mlp_bias` (both `False`) | honoured |
# | LM head | tied in the small models | tied in 1B and 3B, untied from 8B | given |
# | GQA | 16 query / 8 KV heads (0.6B) | 32 / 8 (1B), 24 / 8 (3B) | your attention, on any rank |
#
# **No q/k norm.** Qwen3 normalises every query and key head before RoPE, which bounds the attention
# scores and made training more stable. Llama-3 has no such norm: the projection's output goes
# straight into RoPE. Its checkpoint holds no `q_norm`/`k_norm` tensors, so Qwen3's class cannot
# load it (the loader would say which tensors are missing).
#
# **Bias flags.** Every Llama-3 checkpoint has `attention_bias = mlp_bias = False`, but the
# architecture allows both (transformers' `LlamaConfig` declares them). A model class should honour
# its config rather than assume: with a flag set, the checkpoint holds `….bias` tensors, and our
# linears must have somewhere to load them.

# %%
import re
import tempfile
from pathlib import Path
from unittest import mock

import matplotlib.pyplot as plt
import torch
from safetensors import safe_open
from torch import nn
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from minivllm import load_model
from minivllm.attention.layer import Attention, AttentionContext
from minivllm.attention.prefill import PrefillContext
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    tensor_parallel,
)
from minivllm.models.loader import MODELS, load_tensor
from minivllm.testing import check_answer, exercise, prompt_logits

tmp_dir = tempfile.TemporaryDirectory(prefix="minivllm-llama-")  # deleted when the kernel exits
TMP = Path(tmp_dir.name)

# %% [markdown]
# ## A Llama-3.2-shaped checkpoint
# There is no network here, so, as in notebook 02, we make the checkpoint ourselves: transformers'
# `LlamaForCausalLM` with seeded random weights, written by its own `save_pretrained`. The sizes are
# those of notebook 02's `tiny` Qwen3 (hidden 128, 4 layers, 4 query heads sharing 2 KV heads of 32
# dimensions, a 2,048-token vocabulary); everything else is Llama-3.2's: its RoPE parameters, its
# `rms_norm_eps`, its 128k-position context and a tied head.
#
# transformers initialises norm weights to exactly 1 and biases to 0, which would hide a loader that
# skips them, so every parameter is redrawn: norms around 1, everything else around 0 with a
# standard deviation of 0.05. That is wider than transformers' 0.02 on purpose: with 0.02 the
# attention scores are so small that every token attends almost uniformly to its prefix, and a model
# with the wrong RoPE would still give nearly the right logits.

# %%
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
TINY_LLAMA = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    rope_parameters=LLAMA3_ROPE,
)


def random_llama(config: LlamaConfig, seed: int = 0) -> HFLlamaForCausalLM:
    """transformers' Llama with seeded random weights (norms ~ N(1, 0.1), everything else ~ N(0,
    0.05))."""
    torch.manual_seed(seed)
    model = HFLlamaForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head appears once
            mean, std = (1.0, 0.1) if name.endswith("norm.weight") else (0.0, 0.05)
            param.normal_(mean, std, generator=generator)
    model.config.architectures = ["LlamaForCausalLM"]  # what the loader reads to pick our class
    return model


def llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**(TINY_LLAMA | overrides))


def write_llama(name: str, seed: int = 0, **overrides) -> tuple[Path, HFLlamaForCausalLM]:
    """Save a random Llama (TINY_LLAMA with `overrides`) to TMP/name; return the folder and
    transformers' model."""
    hf_model = random_llama(llama_config(**overrides), seed)
    path = TMP / name
    hf_model.save_pretrained(path)  # config.json + model.safetensors
    return path, hf_model


config = llama_config()
llama_path, hf_llama = write_llama("llama-3.2-tiny")
with safe_open(llama_path / "model.safetensors", "pt") as f:
    for name in f.keys():
        if name.startswith("model.layers.0.") or not name.startswith("model.layers."):
            print(f"{name:45} {tuple(f.get_slice(name).get_shape())}")
print("no q_norm / k_norm, no biases, no lm_head.weight (tied)")

# %% [markdown]
# minivllm does not know this architecture yet. The loader says so, and names what it does know:

# %%
try:
    load_model(llama_path, dtype=torch.float32)
except ValueError as e:
    print(f"ValueError: {e}")

# %% [markdown]
# ## Part 1 · llama3 RoPE scaling
# RoPE rotates pair `i` of each head's features by `position · inv_freq[i]`, with `inv_freq[i] =
# rope_theta ** (-2i / head_dim)`: pair `i` turns once every `wavelength = 2π / inv_freq[i]`
# positions, from a few positions (pair 0: local word order) to hundreds of thousands.
#
# Llama-3 was pretrained on sequences of 8,192 tokens (`original_max_position_embeddings`), then
# stretched to 128k positions. A pair whose wavelength is longer than the sequences it was trained
# on never completed a turn in training: past 8k it would reach angles the model never saw. llama3
# scaling sorts the pairs by wavelength into three bands, with `factor`, `low_freq_factor` and
# `high_freq_factor` from `config.rope_parameters` (here 32, 1 and 4) and `original` for
# `original_max_position_embeddings`:
#
# * wavelength shorter than `original / high_freq_factor` (2,048 here): kept as trained;
# * wavelength longer than `original / low_freq_factor` (8,192): `inv_freq / factor`, a turn 32
#   times slower, so that 128k positions turn the pair no further than 4k did in training;
# * in between, a blend that goes smoothly from one to the other across the band: with
#   `smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)`,
#   which is 0 at the band's long end and 1 at its short end, the new frequency is
#   `(1 - smooth) · inv_freq / factor + smooth · inv_freq`.
#
# Write `llama3_inv_freq`: plain RoPE's frequencies in, llama3's out, over whole tensors (no loop
# over the pairs).


# %%
def plain_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """RoPE's frequencies, one per pair of a head's features (notebook 01): (head_dim / 2,) float32.
    On the CPU whatever the default device (the meta device builds a model without memory)."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """llama3 scaling of plain RoPE frequencies (head_dim / 2,); params: config.rope_parameters."""
    # BEGIN SOLUTION
    factor, original = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelength = 2 * torch.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, blended)
    return torch.where(wavelength < original / high, inv_freq, scaled)
    # END SOLUTION


# %% [markdown]
# ### Check 1 · the frequencies
# Three RoPE configurations go through your function and through transformers'
# (`ROPE_INIT_FUNCTIONS["llama3"]`, what `LlamaRotaryEmbedding` calls): the tiny model's,
# Llama-3.1-8B's (head_dim 128, factor 8) and a made-up one whose bands fall elsewhere. A pair that
# differs is named with its band.


# %%
def band(wavelength: float, params: dict) -> str:
    """Which of llama3's three bands a plain wavelength falls in, in words."""
    original = params["original_max_position_embeddings"]
    short, long = original / params["high_freq_factor"], original / params["low_freq_factor"]
    if wavelength < short:
        return f"shorter than {short:,.0f}: kept"
    if wavelength > long:
        return f"longer than {long:,.0f}: divided by factor {params['factor']:g}"
    return f"between {short:,.0f} and {long:,.0f}: blended"


def check_inv_freq(case: str, llama_config: LlamaConfig) -> None:
    params, head_dim = llama_config.rope_parameters, llama_config.head_dim
    plain = plain_inv_freq(params["rope_theta"], head_dim)
    theirs = ROPE_INIT_FUNCTIONS["llama3"](llama_config)[0]  # (head_dim / 2,)
    ours = llama3_inv_freq(plain, params)
    assert isinstance(ours, torch.Tensor) and ours.shape == theirs.shape, (
        f"{case}: expected a tensor of shape {tuple(theirs.shape)}, got {ours!r}"
    )
    close = torch.isclose(ours.float(), theirs, rtol=1e-5, atol=0)
    for i in (~close).nonzero().flatten().tolist()[:1]:
        wavelength = 2 * torch.pi / plain[i].item()
        raise AssertionError(
            f"{case}: frequency pair {i} (wavelength {wavelength:,.0f} positions, "
            f"{band(wavelength, params)}): yours {ours[i].item():.6g}, transformers' "
            f"{theirs[i].item():.6g}"
        )


MADE_UP_ROPE = LLAMA3_ROPE | dict(rope_theta=1e4, factor=4.0, low_freq_factor=2.0)
MADE_UP_ROPE |= dict(high_freq_factor=8.0, original_max_position_embeddings=1024)
CONFIGS = {
    "the tiny Llama (head_dim 32, factor 32)": config,
    "Llama-3.1-8B (head_dim 128, factor 8)": llama_config(
        head_dim=128, rope_parameters=LLAMA3_ROPE | {"factor": 8.0}
    ),
    "made up (head_dim 64, theta 1e4, factor 4, low 2, high 8, original 1,024)": llama_config(
        head_dim=64, rope_parameters=MADE_UP_ROPE
    ),
}
with exercise("llama3_inv_freq"):
    for case, rope_config in CONFIGS.items():
        check_inv_freq(case, rope_config)
print("llama3_inv_freq: transformers' frequencies, in all three configurations")

# %% [markdown]
# With your frequencies, RoPE is notebook 01's: one cos/sin table for every position, built once and
# shared by every layer, and each pair of a head's two halves rotated by its angle.


# %%
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (first half, second half) of x's heads by the angles of cos, sin."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (num_tokens, num_heads, head_dim / 2) each
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat([y1, y2], dim=-1).to(x.dtype)


class Llama3RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # (max_position, head_dim / 2)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq = llama3_inv_freq(plain_inv_freq(params["rope_theta"], head_dim), params)
        angles = torch.arange(max_position, device="cpu").float()[:, None] * inv_freq
        device = torch.get_default_device()
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (num_tokens, heads, head_dim), rotated to their positions: (num_tokens,)."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return rotate(q, cos, sin), rotate(k, cos, sin)


# %% [markdown]
# ### Check 2 · the tables at every position
# The tiny model's table against transformers' `LlamaRotaryEmbedding`, at all 131,072 positions
# (transformers repeats the half for the second half of each head; we keep one).

# %%
with exercise("llama3_inv_freq"):
    ours_rope = Llama3RotaryEmbedding(config.head_dim, config.max_position_embeddings, LLAMA3_ROPE)
    all_positions = torch.arange(config.max_position_embeddings)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), all_positions[None])  # (1, P, head_dim)
    half = config.head_dim // 2
    for name, ours, theirs in (("cos", ours_rope.cos, cos[0]), ("sin", ours_rope.sin, sin[0])):
        differ = ((ours - theirs[:, :half]).abs() > 1e-4).nonzero()
        for position, pair in differ[:1].tolist():
            raise AssertionError(
                f"{name} at position {position}, pair {pair}: yours {ours[position, pair]:.6f}, "
                f"transformers' {theirs[position, pair]:.6f}"
            )
print(f"llama3 RoPE: cos and sin equal transformers' at all {len(all_positions):,} positions")

# %% [markdown]
# What the scaling does to each of the tiny head's 16 frequency pairs:

# %%
plain = plain_inv_freq(LLAMA3_ROPE["rope_theta"], config.head_dim)
fig, ax = plt.subplots(figsize=(7, 2.6))
ax.semilogy(2 * torch.pi / plain, "o-", label="plain RoPE")
ax.semilogy(2 * torch.pi / llama3_inv_freq(plain, LLAMA3_ROPE), "s--", label="llama3 scaling")
for length, text in [(2048, "8192 / high_freq_factor"), (8192, "8192 / low_freq_factor")]:
    ax.axhline(length, color="grey", lw=0.8)
    ax.text(0, length * 1.3, text, fontsize=7, color="grey")
ax.set_xlabel("frequency pair i (of head_dim / 2)")
ax.set_ylabel("wavelength (positions)")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# ## Part 2 · The checkpoint mapping
# A Llama checkpoint stores each projection as its own tensor:
# `model.layers.N.self_attn.q_proj.weight`, `k_proj`, `v_proj`, `o_proj`, and in the MLP
# `gate_proj`, `up_proj`, `down_proj`. Our layers pack some of them (notebook 01): one
# `qkv_proj` computes q, k and v in one matrix multiply, one `gate_up_proj` computes gate and up.
# The loader must know, for each of the checkpoint's projections that we pack, into which of our
# modules it goes and as which **shard**: the id the packed layer's `weight_loader` takes
# (`QKVParallelLinear`: `"q"`, `"k"` or `"v"`; `MergedColumnParallelLinear`: the index of the part,
# `0`, `1`, ...). The projections we keep whole (`o_proj`, `down_proj`) have no entry: the loader
# copies them by name.
#
# Which shard is which follows from how our forward reads the packed output: the attention splits
# `qkv_proj`'s output into q, k and v, in that order; the MLP's `SiluAndMul` computes `silu(first
# half) * second half`, and transformers' MLP is `down_proj(silu(gate_proj(x)) * up_proj(x))`.
#
# Write `checkpoint_packing`: the checkpoint's module name (`"q_proj"`) -> (our packed module's
# name, shard id). The model class below hands it to the loader as `packed_modules_mapping`.


# %%
def checkpoint_packing() -> dict[str, tuple[str, str | int]]:
    """The checkpoint's module name -> (our packed module, shard id), for each packed module."""
    # BEGIN SOLUTION
    return {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # END SOLUTION


# %% [markdown]
# ### Check 3 · where each projection lands
# Each of transformers' layer-0 projections is loaded, alone, through your entry into a packed
# module built as our layers build theirs; its output must then be in the columns where our forward
# reads it. A wrong entry is named, with the shard that would put it there.


# %%
def packed_modules(config: LlamaConfig) -> dict[str, tuple[nn.Module, dict[str, slice]]]:
    """Our packed modules, new, and the columns of each one's output where our forward reads each of
    transformers' projections."""
    head_dim, intermediate = config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    qkv = QKVParallelLinear(
        config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads
    )
    gate_up = MergedColumnParallelLinear(config.hidden_size, [intermediate] * 2)
    qkv_reads = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv)}
    qkv_reads["v_proj"] = slice(q + kv, None)
    gate_up_reads = {"gate_proj": slice(0, intermediate), "up_proj": slice(intermediate, None)}
    return {"qkv_proj": (qkv, qkv_reads), "gate_up_proj": (gate_up, gate_up_reads)}


SHARD_IDS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}  # what each weight_loader takes


def lands(hf_proj: nn.Module, target: str, shard_id, columns: slice, x: torch.Tensor) -> bool:
    """Whether hf_proj, loaded as shard_id of a new `target`, computes `columns` of its output."""
    layer = packed_modules(config)[target][0]
    with torch.no_grad():
        layer.weight.zero_()
        try:
            load_tensor(layer.weight, hf_proj.weight, shard_id)
        except (KeyError, IndexError, TypeError, ValueError):
            return False
        return torch.allclose(layer(x)[:, columns], hf_proj(x), atol=1e-5)


def check_packing(mapping: dict) -> None:
    assert isinstance(mapping, dict), f"expected a dict, got {type(mapping).__name__}"
    packed = packed_modules(config)
    reads = {n: (t, cols) for t, (_, where) in packed.items() for n, cols in where.items()}
    missing, extra = [n for n in reads if n not in mapping], [n for n in mapping if n not in reads]
    assert not missing, (
        f"{missing[0]} has no entry: the loader would look for our {missing[0]}, but ours is packed"
    )
    assert not extra, (
        f"{extra[0]} has an entry, but we keep {extra[0]} whole (the loader copies it by name): "
        f"leave it out"
    )
    hf_layer = hf_llama.model.layers[0]
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for name, (target, columns) in reads.items():
        entry = mapping[name]
        assert isinstance(entry, tuple) and len(entry) == 2, (
            f"{name} maps to {entry!r}: expected (our packed module, shard id)"
        )
        assert entry[0] == target, f"{name} maps to {entry[0]!r}, expected {target!r}"
        hf_proj = next(m for n, m in hf_layer.named_modules() if n.endswith("." + name))
        expected = next(s for s in SHARD_IDS[target] if lands(hf_proj, target, s, columns, x))
        shard, where = (
            entry[1],
            f"columns {columns.start}:{columns.stop or ''} of {target}'s output",
        )
        assert shard == expected, (
            f"{name} maps to shard {shard!r}, expected {expected!r}: as shard {shard!r}, "
            f"transformers' {name} does not compute {where}, where our forward reads it"
        )


with exercise("checkpoint_packing"):
    check_packing(checkpoint_packing())
print("checkpoint_packing: every projection lands where our forward reads it")

# %% [markdown]
# ## Part 3 · The attention, on any number of ranks
# The classes mirror transformers' module tree, `model.layers.N.self_attn.…`, so that checkpoint
# names map onto ours: keep the attribute names `qkv_proj` and `o_proj`.
#
# In `__init__`, create `self.qkv_proj` (a `QKVParallelLinear`: the packed q, k, v projections, with
# GQA's fewer KV heads) and `self.o_proj` (a `RowParallelLinear` back to `hidden_size`), both with
# `bias=config.attention_bias`, and set `self.num_heads`, `self.num_kv_heads` and `self.head_dim`:
# the given line after your block builds `self.attn`, the layer that hands the attending to the
# context, from them. In `forward`, project, split into q, k and v, view them as heads, rotate q and
# k with RoPE, attend through `self.attn`, and project back. Unlike Qwen3: no norm on q or k.
#
# **Over several ranks.** Built inside `with tensor_parallel(TPGroup(rank=r, size=n))` (notebook
# 01), `QKVParallelLinear` keeps only rank `r`'s heads, `num_attention_heads / n` query heads and
# `num_key_value_heads / n` KV heads, and `RowParallelLinear` its columns of `o_proj`; an all-reduce
# adds the ranks' partial outputs. The config counts every rank's heads; your attention works on
# this rank's.


# %%
class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, rotary_emb: Llama3RotaryEmbedding, layer_idx: int):
        super().__init__()
        # BEGIN SOLUTION
        head_dim, heads = config.head_dim, config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        # this rank's: qkv_proj divided them by the tensor-parallel size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        # all ranks' input features: the layer keeps this rank's
        self.o_proj = RowParallelLinear(
            heads * head_dim, config.hidden_size, bias=config.attention_bias
        )
        # END SOLUTION
        self.rotary_emb = rotary_emb  # shared by all layers: one cos/sin table
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        # positions: (num_tokens,); x: (num_tokens, hidden_size)
        # BEGIN SOLUTION
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, context)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(o.flatten(1))  # (num_tokens, hidden_size)
        # END SOLUTION


# %% [markdown]
# The checks feed your attention the very hidden states that transformers' layer 0 attention
# received on a 17-token prompt, and copy transformers' weights into it through your mapping (the
# loader's `load_tensor`: this rank's slice, into its shard). The two helpers below record those
# hidden states and copy the weights.

# %%
PROMPT = torch.randint(TINY_LLAMA["vocab_size"], (17,), generator=torch.Generator().manual_seed(1))
positions = torch.arange(len(PROMPT))  # (num_tokens,)
# one prompt, causal, no KV cache (notebook 02)
context = PrefillContext.from_lens([len(PROMPT)], "cpu")


def trace_transformers(hf_model: HFLlamaForCausalLM, token_ids: torch.Tensor) -> dict[str, tuple]:
    """Run transformers' model on one prompt; return (input, output) hidden states, (num_tokens,
    hidden_size), of every attention ("layers.N.self_attn")."""
    trace = {}

    def record(name):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            trace[name] = (x[0], y[0])  # drop the batch dimension

        return hook

    modules = [
        (n, m)
        for n, m in hf_model.model.named_modules()
        if re.fullmatch(r"layers\.\d+\.self_attn", n)
    ]
    handles = [m.register_forward_hook(record(n), with_kwargs=True) for n, m in modules]
    with torch.no_grad():
        hf_model(token_ids[None])
    for handle in handles:
        handle.remove()
    return trace


def copy_weights(ours: nn.Module, theirs: nn.Module, case: str) -> None:
    """Load transformers' module's weights into ours, the module at the same place in the tree,
    packed as checkpoint_packing says; this rank's slice when built for one rank of several."""
    packed = checkpoint_packing()
    params, loaded = dict(ours.named_parameters()), set()
    for name, tensor in theirs.named_parameters():
        *path, module, kind = name.split(".")  # e.g. q_proj, weight
        target, shard_id = packed.get(module, (module, None))
        ours_name = ".".join([*path, target, kind])
        assert ours_name in params, (
            f"{case}: transformers' {name} has no place in your module: it has no {ours_name}"
        )
        try:
            load_tensor(params[ours_name], tensor.detach(), shard_id)
        except ValueError as e:
            raise AssertionError(
                f"{case}: loading transformers' {name} into your {ours_name}: {e}"
            ) from None
        loaded.add(ours_name)
    extra = sorted(params.keys() - loaded)
    assert not extra, f"{case}: your module has parameters that transformers' has not: {extra}"


def check_close(got: torch.Tensor, expected: torch.Tensor, case: str) -> None:
    assert got.shape == expected.shape, (
        f"{case}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{case}: {m}")


hf_trace = trace_transformers(hf_llama, PROMPT)
x0, attn0 = hf_trace["layers.0.self_attn"]  # layer 0 attention's input and output
print(f"layer 0 attention: in {tuple(x0.shape)}, out {tuple(attn0.shape)}")

# %% [markdown]
# ### Check 4 · one rank
# Your attention, with layer 0's weights, on the input transformers' layer 0 attention received,
# gives its output; and with `attention_bias=True`, both projections have a bias to load.

# %%
with exercise("LlamaAttention"):
    rope = Llama3RotaryEmbedding(config.head_dim, config.max_position_embeddings, LLAMA3_ROPE)
    attn = LlamaAttention(config, rope, layer_idx=0)
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    assert heads == (4, 2, 32), (
        f"(num_heads, num_kv_heads, head_dim) = {heads}, expected (4, 2, 32)"
    )
    norms = [name for name, _ in attn.named_parameters() if "norm" in name]
    assert not norms, f"Llama has no q/k norm, but your attention has {norms}"
    copy_weights(attn, hf_llama.model.layers[0].self_attn, "one rank")
    with torch.no_grad():
        check_close(attn(positions, x0, context), attn0, "layer 0 attention on a 17-token prompt")
    biased = LlamaAttention(llama_config(attention_bias=True), rope, layer_idx=0)
    no_bias = [name for name in ("qkv_proj", "o_proj") if getattr(biased, name).bias is None]
    assert not no_bias, (
        f"attention_bias=True, but {no_bias} have no bias: pass bias=config.attention_bias"
    )
print("LlamaAttention: the same output as transformers' layer 0 attention")

# %% [markdown]
# ### Check 5 · two ranks
# As notebook 01 checks a row-parallel layer: the attention each of two processes would build (rank
# 0 and rank 1 of 2), each loaded with its slice of transformers' weights, run on the same input in
# this one process with the all-reduce stubbed out; the two partial outputs, added here, must be
# transformers' output.

# %%
with exercise("LlamaAttention at TP=2"):
    partial = []
    expected_heads = (config.num_attention_heads // 2, config.num_key_value_heads // 2)
    for rank in range(2):
        case = f"TP=2, rank {rank}"
        with tensor_parallel(TPGroup(rank=rank, size=2)):
            attn = LlamaAttention(config, rope, layer_idx=0)
        heads = (attn.num_heads, attn.num_kv_heads)
        assert heads == expected_heads, (
            f"{case}: (num_heads, num_kv_heads) = {heads}, expected {expected_heads}: the config "
            f"counts both ranks' heads, qkv_proj keeps this rank's half"
        )
        copy_weights(attn, hf_llama.model.layers[0].self_attn, case)
        all_reduce_stubbed = mock.patch.object(
            torch.distributed, "all_reduce", lambda y, group=None: None
        )
        with torch.no_grad(), all_reduce_stubbed:
            try:
                partial.append(attn(positions, x0, context))
            except RuntimeError as e:
                raise AssertionError(
                    f"{case}: your forward failed on this rank's heads: {e}"
                ) from None
    check_close(sum(partial), attn0, "TP=2: the two ranks' partial outputs, added")
print(f"LlamaAttention at TP=2: {expected_heads} heads per rank, partial outputs add up")

# %% [markdown]
# ## The rest of the model, given
# The MLP, the decoder layer and the model are Qwen3's (notebook 02) with `mlp_bias` honoured and
# the q/k norms gone; the causal LM hands the loader your mapping. One RoPE table, built from the
# config's `rope_parameters`, is shared by every layer.


# %%
class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        sizes, bias = [config.intermediate_size] * 2, config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, sizes, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (num_tokens, hidden_size)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rotary_emb: Llama3RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        context: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual: (num_tokens, hidden_size)
        if residual is None:  # the first layer: the residual stream is the embedding
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, context)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.rope_parameters.get("rope_type") != "llama3":
            raise ValueError(f"rope_parameters={config.rope_parameters}: only llama3 is supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rope = Llama3RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_parameters
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rope, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (num_tokens, hidden_size)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, context)
        return self.norm(x, residual)[0]  # (num_tokens, hidden_size)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one matrix, used both ways

    @property
    def packed_modules_mapping(self) -> dict[str, tuple[str, str | int]]:
        return checkpoint_packing()  # what the loader packs where

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, context)  # (num_tokens, hidden_size)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # (num_tokens, vocab_size)


# %% [markdown]
# The loader picks the class from `config.json`'s `"architectures"` through the `MODELS` dict.
# Adding an entry is all it takes (in the package this line would sit next to Qwen3's in
# `minivllm/models/loader.py`):

# %%
MODELS["LlamaForCausalLM"] = LlamaForCausalLM
print(sorted(MODELS))

# %% [markdown]
# ## Check 6 · the logits
# Each checkpoint goes through `minivllm.load_model` (our classes, your mapping, the loader's checks
# of every tensor's name and shape) and through transformers; the same prompts (random token ids;
# lengths 1, 17 and 300) through both, in float32. They must agree to float32 rounding and pick the
# same top token at every position. Three checkpoints: Llama-3.2's shape (tied head), an untied head
# (the loader then copies `lm_head.weight`), and both bias flags set.


# %%
def check_against_transformers(
    path: Path, hf_model: HFLlamaForCausalLM, lengths=(1, 17, 300)
) -> float:
    """Load `path` with minivllm, compare prompt logits with transformers'; return the worst
    |difference|."""
    try:
        model = load_model(path, dtype=torch.float32)
    except ValueError as e:
        raise AssertionError(f"{path.name}: the loader refused it: {e}") from None
    n_ours, n_theirs = (sum(p.numel() for p in m.parameters()) for m in (model, hf_model))
    assert n_ours == n_theirs, f"{n_ours:,} parameters, transformers' model has {n_theirs:,}"
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    for n in lengths:
        token_ids = torch.randint(hf_model.config.vocab_size, (n,), generator=generator).tolist()
        ours = prompt_logits(model, token_ids)  # (n, vocab_size)
        with torch.no_grad():
            ref = hf_model(torch.tensor([token_ids])).logits[0]
        error = (ours - ref).abs().max().item()
        worst = max(worst, error)
        differ = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
        assert not differ, (
            f"{path.name}, {n} tokens: the top token differs at positions {differ[:10]}"
        )
        print(f"  {n:4} tokens: max |logit difference| {error:.1e}, the same top tokens")
    assert worst < 1e-4, f"{path.name}: max |logit difference| {worst:.1e}, expected < 1e-4"
    return worst


variants = {
    "Llama-3.2 shape, tied head": (llama_path, hf_llama),
    "untied head": write_llama("llama-untied", seed=1, tie_word_embeddings=False),
    "attention_bias and mlp_bias": write_llama(
        "llama-bias", seed=2, attention_bias=True, mlp_bias=True
    ),
}
with safe_open(variants["untied head"][0] / "model.safetensors", "pt") as f:
    assert "lm_head.weight" in f.keys(), "the untied checkpoint should hold lm_head.weight"
worst = {}
with exercise("LlamaForCausalLM"):
    for name, (path, hf_model) in variants.items():
        print(name)
        worst[name] = check_against_transformers(path, hf_model)
print(f"all match transformers' Llama; worst |logit difference| {max(worst.values()):.1e}")

# %% [markdown]
# ## Check yourself
# Set each `answerN` (by hand, or computed with what you wrote) and run its cell: it compares your
# answer with what the objects say. The worked answer follows.
#
# **1.** Llama-3.2-1B's heads have 64 dimensions, so 32 frequency pairs, with theta 500,000 and the
# scaling above (factor 32, low 1, high 4, original 8,192). How many pairs does llama3 scaling keep,
# blend and divide by 32? Answer a tuple `(kept, blended, divided)`.

# %%
answer1 = None  # your answer: replace None with an expression
# one layer and a short RoPE table: the questions are about shapes
SHORT = dict(num_hidden_layers=1, max_position_embeddings=16384)
SIZES_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, head_dim=64)
config_1b = llama_config(**SIZES_1B, num_attention_heads=32, num_key_value_heads=8, **SHORT)
ratio = ROPE_INIT_FUNCTIONS["llama3"](config_1b)[0] / plain_inv_freq(500000.0, 64)
kept = int(torch.isclose(ratio, torch.tensor(1.0)).sum())
divided = int(torch.isclose(ratio, torch.tensor(1 / 32)).sum())
bands_1b = (kept, len(ratio) - kept - divided, divided)
check_answer(answer1, bands_1b, "1. llama3 bands of Llama-3.2-1B")

# %% [markdown]
# Worked answer: pair `i`'s wavelength is `2π · 500000 ** (2i / 64)`, about 6.28 · 1.51^i. It passes
# 2,048 between pairs 14 and 15 (i > log(2048 / 2π) / log(1.51) = 14.1) and 8,192 between 17 and
# 18 (17.5): pairs 0-14 kept, 15-17 blended, 18-31 divided.

# %%
wavelengths = 2 * torch.pi * 500000.0 ** (torch.arange(32) * 2 / 64)
kept, divided = int((wavelengths < 2048).sum()), int((wavelengths > 8192).sum())
check_answer((kept, 32 - kept - divided, divided), bands_1b, "1. llama3 bands of Llama-3.2-1B")

# %% [markdown]
# **2.** Llama-3.2-3B: hidden 3,072, 24 query heads and 8 KV heads of 128, MLP 8,192, vocabulary
# 128,256. Over how many ranks at most (up to 16) can minivllm split it? Our layers need each
# split they make to be exact.

# %%
answer2 = None  # your answer: replace None with an expression
SIZES_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, head_dim=128)
config_3b = llama_config(**SIZES_3B, num_attention_heads=24, num_key_value_heads=8, **SHORT)


def splits(config: LlamaConfig, size: int) -> bool:
    """Whether the model builds as rank 0 of `size` (on the meta device: shapes, no memory)."""
    try:
        with torch.device("meta"), tensor_parallel(TPGroup(rank=0, size=size)):
            LlamaForCausalLM(config)
    except ValueError:
        return False
    return True


max_tp_3b = max(size for size in range(1, 17) if splits(config_3b, size))
check_answer(answer2, max_tp_3b, "2. largest tensor-parallel size of Llama-3.2-3B")

# %% [markdown]
# Worked answer: each rank keeps whole heads, so the size must divide the 24 query heads and the 8
# KV heads; 8 does, and also 8,192 (the MLP) and 128,256 = 2⁸ · 501 (the vocabulary). 16 would
# leave each rank half a KV head. (vLLM goes further by copying KV heads onto several ranks.)

# %%
divides_heads = [s for s in range(1, 17) if 24 % s == 0 and 8 % s == 0]
check_answer(max(divides_heads), max_tp_3b, "2. largest tensor-parallel size of Llama-3.2-3B")

# %% [markdown]
# **3.** Llama-3.2-1B (vocabulary 128,256, hidden 2,048) ties its LM head to its embedding. How many
# bytes of bfloat16 weights does tying save?

# %%
answer3 = None  # your answer: replace None with an expression
with torch.device("meta"):
    untied, tied = (
        LlamaForCausalLM(llama_config(**SIZES_1B, tie_word_embeddings=tied, **SHORT))
        for tied in (False, True)
    )
n_untied, n_tied = (sum(p.numel() for p in model.parameters()) for model in (untied, tied))
extra = n_untied - n_tied
saved = extra * torch.tensor([], dtype=torch.bfloat16).element_size()
check_answer(answer3, saved, "3. bytes saved by tying")

# %% [markdown]
# Worked answer: one 128,256 × 2,048 matrix fewer, 2 bytes an element: 525,336,576 bytes, half a
# gigabyte, about a fifth of the 1B model's 2.5 GB.

# %%
check_answer(128256 * 2048 * 2, saved, "3. bytes saved by tying")

# %% [markdown]
# **Going further.** Llama-3.2 now runs through everything the later notebooks build on top of a
# model: the KV cache, the model runner and the engine only talk to `forward(input_ids, positions,
# context)` and `compute_logits`, so nothing else changes. To make it permanent, move these classes
# into `minivllm/models/llama.py` (exported from a notebook) and add the entry to `MODELS` in the
# loader.
