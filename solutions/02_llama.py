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
# family: Qwen3 is Llama's architecture plus a few changes, so almost every piece is already there.
#
# **Your task.** Write `LlamaForCausalLM` from minivllm's layers: the attention, the decoder layer's
# forward, the model's wiring and the checkpoint name mapping. Register it in `MODELS`, and the
# check cells load a random Llama-3.2-shaped checkpoint through `minivllm.load_model` and compare
# the logits with transformers' own Llama.
#
# **What it assumes.** Notebooks 01 (layers) and 02 (Qwen3, the loader). No GPU: everything runs in
# float32 on the CPU in well under a minute.

# %% [markdown]
# ## What changes from Qwen3, and why
#
# | | Qwen3 | Llama-3.2 | what you do |
# |---|---|---|---|
# | q/k RMSNorm per head, before RoPE | yes | **no** | drop `q_norm`, `k_norm` |
# | RoPE | plain, theta 1e6 | **`rope_type: "llama3"`** scaling, theta 5e5 | none: `get_rope` |
# | bias flags | `attention_bias` | `attention_bias` **and** `mlp_bias` (both `False`) | pass them |
# | LM head | tied in the small models | tied in 1B and 3B, untied from 8B | as in Qwen3 |
# | GQA | 16 query / 8 KV heads (0.6B) | 32 / 8 (1B), 24 / 8 (3B) | none: the layers handle it |
#
# Everything else is reused as it is: the packed `qkv_proj` and `gate_up_proj` (notebook 01),
# RMSNorm with its fused residual add, `SiluAndMul`, the vocabulary embedding and LM head, and the
# `AttentionContext` that tells attention which tokens see which (notebook 02). The checkpoint names
# are the same as Qwen3's (`model.layers.N.self_attn.q_proj.weight`, …), so the loader needs no
# change either: only a class to build.
#
# **No q/k norm.** Qwen3 normalises every query and key head before RoPE, which bounds the attention
# scores and made training more stable. Llama-3 has no such norm: the projection's output goes
# straight into RoPE. Its checkpoint holds no `q_norm`/`k_norm` tensors, so Qwen3's class cannot
# load it (the loader would say which tensors are missing).
#
# **llama3 RoPE.** Llama-3 was pretrained on 8,192-token sequences, then stretched to 128k
# positions. A RoPE frequency whose wavelength is longer than 8,192 positions never completed a turn
# in pretraining: past 8k it would reach angles the model never saw. llama3 scaling divides those
# low frequencies by `factor` (32), so long distances land on familiar angles, keeps the high
# frequencies (local word order) as trained, and blends the two in between. Notebook 01's
# `RotaryEmbedding` already implements it; below we check it against transformers.
#
# **Bias flags.** Every Llama-3 checkpoint has `attention_bias = mlp_bias = False`, but the
# architecture allows both (transformers' `LlamaConfig` declares them). A model class should honour
# its config rather than assume: with a flag set, the checkpoint holds `….bias` tensors, and our
# linears must have somewhere to load them.

# %%
import re
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from safetensors import safe_open
from torch import nn
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from minivllm import load_model
from minivllm.attention.layer import Attention, AttentionContext
from minivllm.attention.prefill import PrefillContext
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary_embedding import (
    RotaryEmbedding,
    get_rope,
    llama3_inv_freq,
    rope_parameters,
)
from minivllm.models.loader import MODELS, load_tensor, load_weights
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.testing import exercise, prompt_logits

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
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
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


def write_llama(name: str, seed: int = 0, **overrides) -> tuple[Path, HFLlamaForCausalLM]:
    """Save a random Llama (TINY_LLAMA with `overrides`) to TMP/name; return the folder and
    transformers' model."""
    hf_model = random_llama(LlamaConfig(**(TINY_LLAMA | overrides)), seed)
    path = TMP / name
    hf_model.save_pretrained(path)  # config.json + model.safetensors
    return path, hf_model


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
# ## RoPE: already there
# `get_rope(config, head_dim)` reads `config.rope_parameters` (or an older transformers'
# `rope_scaling`) and applies llama3 scaling when `rope_type` says so. Its cos/sin tables equal
# transformers' at every one of the 131,072 positions:

# %%
config = LlamaConfig(**TINY_LLAMA)
print(rope_parameters(config))
ours_rope = get_rope(config, config.head_dim)
positions = torch.arange(config.max_position_embeddings)
# (1, positions, head_dim), halves repeated
cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
half = config.head_dim // 2
assert torch.equal(ours_rope.cos, cos[0, :, :half]), "llama3 RoPE: cos differs from transformers'"
assert torch.equal(ours_rope.sin, sin[0, :, :half]), "llama3 RoPE: sin differs from transformers'"
print("llama3 RoPE: our cos/sin tables equal transformers'")

# %% [markdown]
# What the scaling does to each of the 16 frequency pairs of a 32-dimensional head: wavelengths
# shorter than `original_max_position_embeddings / high_freq_factor` (2,048) stay; those longer than
# `original_max_position_embeddings / low_freq_factor` (8,192) become 32 times longer; one pair
# falls in between.

# %%
params = rope_parameters(config)
exponents = torch.arange(0, 2 * half, 2).float() / (2 * half)  # 0, 2/d, 4/d, ...
inv_freq = 1.0 / params["rope_theta"] ** exponents
wavelength = 2 * torch.pi / inv_freq
wavelength_llama3 = 2 * torch.pi / llama3_inv_freq(inv_freq, params)

fig, ax = plt.subplots(figsize=(7, 2.6))
ax.semilogy(wavelength, "o-", label="plain RoPE")
ax.semilogy(wavelength_llama3, "s--", label="llama3 scaling")
for length, text in [(2048, "8192 / high_freq_factor"), (8192, "8192 / low_freq_factor")]:
    ax.axhline(length, color="grey", lw=0.8)
    ax.text(0, length * 1.3, text, fontsize=7, color="grey")
ax.set_xlabel("frequency pair i (of head_dim / 2)")
ax.set_ylabel("wavelength (positions)")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# ## Your model
# The classes mirror transformers' module tree, `model.layers.N.self_attn.…`, so that checkpoint
# names map onto ours. Keep these attribute names: `self_attn.qkv_proj`, `self_attn.o_proj`,
# `mlp.gate_up_proj`, `mlp.down_proj`, `input_layernorm`, `post_attention_layernorm`,
# `model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`. Open `minivllm/models/qwen3.py`
# next to this notebook: most of what you write is a Qwen3 class with something taken out or a flag
# passed through.
#
# Each class is checked in the cell after it, against its counterpart in transformers' model: the
# check copies transformers' weights into your module (through the loader's `load_tensor`, so q/k/v
# and gate/up land in their packed shards) and feeds it the very hidden states that transformers'
# module received on a 17-token prompt. The two helpers below record those hidden states and copy
# the weights.

# %%
PROMPT = torch.randint(TINY_LLAMA["vocab_size"], (17,), generator=torch.Generator().manual_seed(1))
positions = torch.arange(len(PROMPT))  # (num_tokens,)
# one prompt, causal, no KV cache (notebook 02)
context = PrefillContext.from_lens([len(PROMPT)], "cpu")


def trace_transformers(hf_model: HFLlamaForCausalLM, token_ids: torch.Tensor) -> dict[str, tuple]:
    """Run transformers' model on one prompt; return (input, output) hidden states, (num_tokens,
    hidden_size), of every decoder layer ("layers.N") and attention ("layers.N.self_attn"); and the
    model's, "model": (token ids, final hidden states)."""
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
        if re.fullmatch(r"layers\.\d+(\.self_attn)?", n)
    ]
    handles = [m.register_forward_hook(record(n), with_kwargs=True) for n, m in modules]
    with torch.no_grad():
        trace["model"] = (token_ids, hf_model.model(token_ids[None]).last_hidden_state[0])
    for handle in handles:
        handle.remove()
    return trace


def copy_weights(ours: nn.Module, theirs: nn.Module) -> None:
    """Load transformers' module's weights into ours, the module at the same place in the tree.
    q/k/v and gate/up go into their packed shards, as `Qwen3ForCausalLM.packed_modules_mapping` says
    (the same names)."""
    packed = Qwen3ForCausalLM.packed_modules_mapping
    params, loaded = dict(ours.named_parameters()), set()
    for name, tensor in theirs.named_parameters():
        *path, module, kind = name.split(".")  # e.g. layers.0.self_attn, q_proj, weight
        target, shard_id = packed.get(module, (module, None))
        ours_name = ".".join([*path, target, kind])
        assert ours_name in params, (
            f"transformers' {name} has no place in your module: it has no {ours_name}"
        )
        try:
            load_tensor(params[ours_name], tensor.detach(), shard_id)
        except ValueError as e:
            raise AssertionError(
                f"loading transformers' {name} into your {ours_name}: {e}"
            ) from None
        loaded.add(ours_name)
    extra = sorted(params.keys() - loaded)
    assert not extra, f"your module has parameters that transformers' has not: {extra}"


def check_close(got: torch.Tensor, expected: torch.Tensor, case: str) -> None:
    assert got.shape == expected.shape, (
        f"{case}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{case}: {m}")


hf_trace = trace_transformers(hf_llama, PROMPT)
for name, (x, y) in hf_trace.items():
    if name.startswith("layers.0") or name == "model":
        print(f"{name:18} in {tuple(x.shape)}, out {tuple(y.shape)}")

# %% [markdown]
# The MLP is given, as an example of a bias flag: Qwen3's MLP with `bias=config.mlp_bias` on its
# linears.


# %%
class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"hidden_act={config.hidden_act!r} is not supported (supported: 'silu')"
            )
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (num_tokens, hidden_size)


# %% [markdown]
# ### Attention
# In `__init__`, create `self.qkv_proj` (a `QKVParallelLinear`: the packed q, k, v projections, with
# GQA's fewer KV heads), `self.o_proj` (a `RowParallelLinear` back to `hidden_size`), both with
# `bias=config.attention_bias`, and set `self.num_heads`, `self.num_kv_heads` (this rank's: read
# them from `qkv_proj`, which divided them by the tensor-parallel size) and `self.head_dim`.
#
# In `forward`, project, split into q, k and v, view them as heads, rotate q and k with RoPE, attend
# through `self.attn` (which hands the work to the context), and project back. Unlike Qwen3: no norm
# on q or k.


# %%
class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        head_dim = config.head_dim
        # BEGIN SOLUTION
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        # this rank's
        self.num_heads, self.num_kv_heads = (self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads)
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=config.attention_bias
        )
        # END SOLUTION
        self.rotary_emb = rotary_emb  # shared by all layers: one cos/sin table
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, layer_idx)

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
# Check: your attention, with layer 0's weights, on the input transformers' layer 0 attention
# received, gives its output; and with `attention_bias=True`, both projections have a bias to load.

# %%
with exercise("LlamaAttention"):
    rotary_emb = get_rope(config, config.head_dim)
    attn = LlamaAttention(config, rotary_emb, layer_idx=0)
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    assert heads == (4, 2, 32), (
        f"(num_heads, num_kv_heads, head_dim) = {heads}, expected (4, 2, 32)"
    )
    norms = [name for name, _ in attn.named_parameters() if "norm" in name]
    assert not norms, f"Llama has no q/k norm, but your attention has {norms}"
    copy_weights(attn, hf_llama.model.layers[0].self_attn)
    x, expected = hf_trace["layers.0.self_attn"]
    with torch.no_grad():
        check_close(attn(positions, x, context), expected, "layer 0 attention on a 17-token prompt")
    biased = LlamaAttention(
        LlamaConfig(**(TINY_LLAMA | {"attention_bias": True})), rotary_emb, layer_idx=0
    )
    no_bias = [name for name in ("qkv_proj", "o_proj") if getattr(biased, name).bias is None]
    assert not no_bias, (
        f"attention_bias=True, but {no_bias} have no bias: pass bias=config.attention_bias"
    )
print("LlamaAttention: the same output as transformers' layer 0 attention")

# %% [markdown]
# ### Decoder layer
# The decoder layer is the pre-norm block of notebook 02:
#
# ```
# h = x + self_attn(input_layernorm(x))
# y = h + mlp(post_attention_layernorm(h))
# ```
#
# written, as in Qwen3, with the fused residual: `RMSNorm(x, residual)` adds `x` to the residual
# stream, normalises the sum and returns both. The layer returns `(mlp output, residual stream)`,
# whose sum is `y`. The first layer gets `residual=None` and starts the stream with its input, the
# embedding. Write `LlamaDecoderLayer.forward`.


# %%
class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rotary_emb: RotaryEmbedding, layer_idx: int):
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
        # BEGIN SOLUTION
        if residual is None:  # the first layer: the residual stream is the embedding
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, context)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
        # END SOLUTION


# %% [markdown]
# Check: layers 0 and 1 with transformers' weights, layer 0 on the embedding (`residual=None`),
# layer 1 on layer 0's `(x, residual)`. After each, `x + residual` is transformers' layer output
# `y`, and `residual` is `h`.

# %%
with exercise("LlamaDecoderLayer"):
    layers = [LlamaDecoderLayer(config, rotary_emb, i) for i in range(2)]
    x, residual = hf_trace["layers.0"][0], None  # the embedding of the prompt
    for i, layer in enumerate(layers):
        copy_weights(layer, hf_llama.model.layers[i])
        layer_in, layer_out = hf_trace[f"layers.{i}"]
        with torch.no_grad():
            x, residual = layer(positions, x, residual, context)
        case = f"layer {i} ({'residual=None' if i == 0 else 'residual from layer 0'})"
        check_close(
            residual,
            layer_in + hf_trace[f"layers.{i}.self_attn"][1],
            f"{case}: residual, h = x + attn",
        )
        check_close(x + residual, layer_out, f"{case}: x + residual, the layer's output")
print("LlamaDecoderLayer: layers 0 and 1 give transformers' hidden states")

# %% [markdown]
# ### Model
# Wire `LlamaModel.__init__`: the token embedding (`VocabParallelEmbedding`), **one** RoPE table
# from `get_rope(config, head_dim)` shared by every layer, `config.num_hidden_layers` decoder layers
# in an `nn.ModuleList`, and the final norm. Its `forward` is given.


# %%
class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        # BEGIN SOLUTION
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # one cos/sin table, shared by every layer
        rotary_emb = get_rope(config, config.head_dim)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # END SOLUTION

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (num_tokens, hidden_size)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, context)
        x, _ = self.norm(x, residual)
        return x  # (num_tokens, hidden_size)


# %%
with exercise("LlamaModel"):
    llama_model = LlamaModel(config)
    n_layers = len(getattr(llama_model, "layers", []))
    assert n_layers == config.num_hidden_layers, (
        f"{n_layers} layers, expected {config.num_hidden_layers}"
    )
    tables = {id(layer.self_attn.rotary_emb) for layer in llama_model.layers}
    assert len(tables) == 1, (
        f"{len(tables)} RoPE tables: build one with get_rope and give it to every layer"
    )
    copy_weights(llama_model, hf_llama.model)
    with torch.no_grad():
        check_close(
            llama_model(PROMPT, positions, context),
            hf_trace["model"][1],
            "final hidden states, 17 tokens",
        )
print("LlamaModel: the same final hidden states as transformers' LlamaModel")

# %% [markdown]
# ### The causal LM, and its checkpoint names
# `LlamaForCausalLM` inherits `forward` and `compute_logits` from Qwen3's class (so `prompt_logits`
# works on it): they only use `self.model`, `self.lm_head` and `self.config`. Its `__init__` skips
# Qwen3's (which would build a Qwen3 model) and builds ours: store the config, create `self.model`
# and `self.lm_head` (a `ParallelLMHead`), and tie the head to the embedding when
# `config.tie_word_embeddings` says so.
#
# `packed_modules_mapping` tells the loader which checkpoint module goes into which of our packed
# modules, and as which shard: `q_proj` into `qkv_proj` as `"q"`, … , `gate_proj` into
# `gate_up_proj` as shard 0, `up_proj` as 1. Write it out (rather than inherit Qwen3's): it is this
# class's contract with Llama checkpoints. (Here it is a property, so that the class can be defined
# before you write it; in a module it would be a class attribute.)


# %%
class LlamaForCausalLM(Qwen3ForCausalLM):
    @property
    def packed_modules_mapping(self) -> dict[str, tuple[str, str | int]]:
        """checkpoint module name -> (our packed module, shard id)"""
        # BEGIN SOLUTION
        return {
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        # END SOLUTION

    def __init__(self, config: LlamaConfig):
        nn.Module.__init__(self)  # not Qwen3ForCausalLM.__init__: that would build a Qwen3 model
        # BEGIN SOLUTION
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one matrix, used both ways
        # END SOLUTION


# %% [markdown]
# ### Register it
# The loader picks the class from `config.json`'s `"architectures"` through the `MODELS` dict.
# Adding an entry is all it takes (in the package this line would sit next to Qwen3's in
# `minivllm/models/loader.py`):

# %%
MODELS["LlamaForCausalLM"] = LlamaForCausalLM
print(sorted(MODELS))

# %% [markdown]
# ## Check
# First the names and shapes, without memory: build the model on the `meta` device and let the
# loader copy the checkpoint into it (`load_weights`; a copy into `meta` stores nothing). A misnamed
# attribute or a wrong mapping shows up here as a missing or unexpected tensor, a wrong size as a
# shape mismatch.

# %%
with exercise("LlamaForCausalLM"):
    with torch.device("meta"):
        meta_llama = LlamaForCausalLM(config)
    load_weights(meta_llama, [llama_path / "model.safetensors"])
    n_ours = sum(p.numel() for p in meta_llama.parameters())
    n_theirs = sum(p.numel() for p in hf_llama.parameters())
    assert n_ours == n_theirs, f"{n_ours:,} parameters, transformers' model has {n_theirs:,}"
print(f"every checkpoint tensor has its place; {n_ours:,} parameters, as in transformers' model")

# %% [markdown]
# Now the logits. Each checkpoint goes through `minivllm.load_model` (our class, our loader) and
# through transformers; the same prompts (random token ids; lengths 1, 17 and 300) through both, in
# float32. They must agree to float32 rounding and pick the same top token at every position. Three
# checkpoints: Llama-3.2's shape (tied head), an untied head (the loader then copies
# `lm_head.weight`), and both bias flags set.


# %%
def check_against_transformers(
    path: Path, hf_model: HFLlamaForCausalLM, lengths=(1, 17, 300)
) -> float:
    """Load `path` with minivllm, compare prompt logits with transformers'; return the worst
    |difference|."""
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM), (
        f"load_model built a {type(model).__name__}, not LlamaForCausalLM"
    )
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == hf_model.config.tie_word_embeddings, (
        f"lm_head tied: {tied}, but tie_word_embeddings={hf_model.config.tie_word_embeddings}"
    )
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
        print(
            f"  {n:4} tokens: max |logit difference| {error:.1e}, argmax identical at every "
            f"position"
        )
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
# * Why can't Qwen3's class load a Llama checkpoint, and how many parameters is the difference? (Its
#   q/k norms: one `head_dim` weight each, per layer.)
# * Which frequency pairs of this 32-dimensional head does llama3 scaling leave alone, and which
#   does it slow down 32 times?
# * Would the logit check notice a model that used plain RoPE instead? It compares against prompts
#   of at most 300 positions, far below 8,192: is the scaling visible there?
# * Llama-3.2-1B ties a 128,256 × 2,048 embedding. How many bytes does tying save in bfloat16?
#
# The cells below assert the answers.

# %%
with torch.device("meta"):
    meta_qwen3 = Qwen3ForCausalLM(config)  # Qwen3's classes, Llama's sizes
try:
    load_weights(meta_qwen3, [llama_path / "model.safetensors"])
except ValueError as e:
    assert "missing" in str(e) and "_norm.weight" in str(e), f"expected missing q/k norms, got: {e}"
    print(f"Qwen3ForCausalLM: {e}")
else:
    raise AssertionError("Qwen3's class accepted a Llama checkpoint")
n_qwen3 = sum(p.numel() for p in meta_qwen3.parameters())
assert (
    n_qwen3 - n_ours == 2 * config.head_dim * config.num_hidden_layers
), (  # q_norm + k_norm in every layer
    f"Qwen3 has {n_qwen3 - n_ours} parameters more, expected "
    f"{2 * config.head_dim * config.num_hidden_layers}"
)

slowdown = wavelength_llama3 / wavelength  # per frequency pair
assert torch.allclose(slowdown[wavelength < 2048], torch.tensor(1.0)), (
    f"short wavelengths changed: {slowdown}"
)
assert torch.allclose(slowdown[wavelength > 8192], torch.tensor(32.0)), (
    f"long wavelengths not 32x: {slowdown}"
)
blended = ((slowdown > 1) & (slowdown < 32)).sum().item()
# the one pair in between is blended
assert blended == 1, f"{blended} pairs between 1x and 32x, expected 1"
print(
    "unchanged pairs:",
    (slowdown == 1).nonzero().flatten().tolist(),
    "slowed 32x:",
    (slowdown > 31.99).nonzero().flatten().tolist(),
)

plain = LlamaConfig(
    **(TINY_LLAMA | {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
)
hf_plain = HFLlamaForCausalLM(plain).eval()
hf_plain.load_state_dict(hf_llama.state_dict())  # the same weights, plain RoPE
token_ids = torch.randint(config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    rope_gap = (hf_plain(token_ids).logits - hf_llama(token_ids).logits).abs().max().item()
# the pairs slowed 32x turn by visibly different angles within 300 positions
assert rope_gap > 10 * 1e-4, f"plain and llama3 RoPE differ by only {rope_gap:.1e}"
print(f"plain vs llama3 RoPE, same weights, 300 tokens: max |logit difference| {rope_gap:.1e}")

# about 0.5 GB: one matrix, read both at the embedding and at the head
assert 128256 * 2048 * 2 == 525_336_576, "bytes of a bf16 128,256 x 2,048 matrix"

# %% [markdown]
# **Going further.** Llama-3.2 now runs through everything the later notebooks build on top of a
# model: the KV cache, the model runner and the engine only talk to `forward(input_ids, positions,
# context)` and `compute_logits`, so nothing else changes. To make it permanent, move these classes
# into `minivllm/models/llama.py` (exported from a notebook) and add the entry to `MODELS` in the
# loader.
