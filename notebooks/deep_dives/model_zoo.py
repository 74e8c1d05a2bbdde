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
# # Deep dive · Model zoo: Llama 3.x and Qwen2/2.5 beside Qwen3
#
# **What this adds.** Notebook 02 builds Qwen3 and a loader that picks our class by `config.json`'s
# `architectures`. Llama 3.x and Qwen2/2.5 are the same decoder with three differences: no norms on
# the query and key heads, biases in other places, and (Llama 3.1 onwards) RoPE frequencies scaled
# for long contexts. Here each difference is shown against transformers, then both families are
# built from the course's layers and put in a larger table of architectures, `ZOO`, which the
# production engine (`from minivllm import LLM`) loads through.
#
# **Where it sits.** It follows notebook 02 and uses only what notebooks 01 and 02 export. Do the
# exercise `exercises/02_llama` first: it asks you to build Llama yourself, checked against
# transformers; this is the package's version. The core path needs none of it: notebook 06's `LLM`
# stays Qwen3 only, and says so when handed a Llama.

# %%
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils.logging import disable_progress_bar

from minivllm import load_model
from minivllm.checkpoint import preset_config, write_checkpoint
from minivllm.layers.rotary_embedding import get_rope
from minivllm.models.loader import MODELS, read_config
from minivllm.testing import prompt_logits

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
llama_path = write_checkpoint(CHECKPOINTS / "tiny-llama", "tiny-llama", seed=0)
qwen2_path = write_checkpoint(CHECKPOINTS / "tiny-qwen2", "tiny-qwen2", seed=0)

# %% [markdown]
# ## What the core loader says
# Notebook 02's table holds Qwen3 alone, and its loader refuses anything else by name, listing what
# it supports, before a weight is read. Notebook 01's RoPE refuses a scaled RoPE by name too.

# %%
for path in (llama_path, qwen2_path):
    try:
        read_config(path)
    except ValueError as e:
        print(e)
try:
    get_rope(preset_config("tiny-llama"), 32)
except ValueError as e:
    print(e)

# %% [markdown]
# ## Llama 3's RoPE: long wavelengths slowed down
# RoPE turns each pair of a head's dimensions by `position × inv_freq`. Llama 3.1 was trained at
# 8,192 positions, then extended to 131,072 by slowing the slow pairs: a pair whose wavelength
# (`2π / inv_freq`) is longer than `original / low_freq_factor` positions turns `factor` times
# slower; one shorter than `original / high_freq_factor` keeps its speed, since it has turned many
# times within the original context; in between, a linear blend. The table of cos and sin is then
# built as in notebook 01, so notebook 01's `RotaryEmbedding` (and its Triton twin) runs it
# unchanged: a function builds one and gives it the scaled tables.

# %% tags=["export"] module="minivllm.models.zoo"
import math
from typing import Any, cast

import torch
from torch import Tensor, nn

from minivllm.attention.layer import Attention, AttentionContext
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary_embedding import RotaryEmbedding, get_rope
from minivllm.models.loader import MODELS, Models
from minivllm.models.qwen3 import Qwen3ForCausalLM


def llama3_inv_freq(inv_freq: Tensor, params: dict) -> Tensor:
    """Llama 3.1's scaling of RoPE's frequencies (head_dim / 2,): long waves `factor` times
    slower, short ones kept, a linear blend between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq  # positions per turn
    turns = params["original_max_position_embeddings"] / wavelen  # in the original context
    smooth = ((turns - low) / (high - low)).clamp(0, 1)  # 0: slowed, 1: kept
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def llama3_rope(head_dim: int, max_position: int, params: dict) -> RotaryEmbedding:
    """Notebook 01's RoPE with Llama 3's scaled frequencies in its cos and sin tables."""
    rope = RotaryEmbedding(head_dim, max_position, params)
    exponents = torch.arange(0, head_dim, 2, device="cpu").float() / head_dim
    inv_freq = llama3_inv_freq(1.0 / params["rope_theta"] ** exponents, params)
    freqs = torch.arange(max_position, device="cpu").float()[:, None] * inv_freq
    device = torch.get_default_device()  # (max_position, head_dim / 2) each, as notebook 01's
    rope.cos, rope.sin = freqs.cos().to(device), freqs.sin().to(device)
    return rope


def zoo_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    """Llama 3's RoPE when config.json asks for it, else notebook 01's (it refuses the rest)."""
    scaling = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(scaling or {})
    if (params.get("rope_type") or params.get("type")) != "llama3":
        return get_rope(config, head_dim)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))  # transformers 4
    return llama3_rope(head_dim, config.max_position_embeddings, params)


# %% [markdown]
# Against transformers' own Llama RoPE on the tiny preset (its original context is 512 positions,
# so that its 16 frequencies fall in all three bands): the same frequencies, and the same cos.

# %%
from minivllm.models.zoo import llama3_inv_freq, zoo_rope  # noqa: E402

llama_config = preset_config("tiny-llama")
theirs = LlamaRotaryEmbedding(llama_config)
ours = zoo_rope(llama_config, llama_config.head_dim)
base = 1.0 / 500000.0 ** (torch.arange(0, 32, 2).float() / 32)
torch.testing.assert_close(llama3_inv_freq(base, llama_config.rope_parameters), theirs.inv_freq)
positions = torch.arange(0, 4096, 97)
their_cos, _ = theirs(torch.zeros(1), positions[None])  # (1, positions, head_dim), halves repeated
torch.testing.assert_close(ours.cos[positions], their_cos[0, :, :16])
ratio = base / theirs.inv_freq
print("slowed by:", [round(r, 1) for r in ratio.tolist()])

# %% [markdown]
# ## The layers: Qwen3's, less the head norms, with each family's biases
# Qwen3 normalises each query and key head before RoPE; Llama and Qwen2 do not. Biases: Qwen2 has
# them on q, k and v (not on the output projection, not in the MLP); Llama has none in its
# released checkpoints, but its config has switches, `attention_bias` (q, k, v and o) and
# `mlp_bias`, which a loader must honour. The tiny Llama preset turns both on, so a dropped bias
# shows. The decoder layer, the model and the causal-LM shell are Qwen3's; the linear layers carry
# a bias through tensor parallelism already (notebook 01: a row-parallel layer adds it once).

# %% tags=["export"] module="minivllm.models.zoo"
Biases = tuple[bool, bool, bool]  # on q/k/v, on the output projection, in the MLP


class ZooAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int, biases: Biases):
        super().__init__()
        hidden, head_dim = config.hidden_size, head_size(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=biases[0])
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=biases[1])
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, layer_idx)

    def forward(self, positions: Tensor, x: Tensor, context: AttentionContext) -> Tensor:
        # positions: (num_tokens,); x: (num_tokens, hidden_size)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)  # rotated; no norms
        o = self.attn(q, k, v, context)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(o.flatten(1))  # (num_tokens, hidden_size)


def head_size(config: Any) -> int:
    """config.json's head_dim; Qwen2's configs leave it out: hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class ZooMLP(nn.Module):
    def __init__(self, config: Any, bias: bool):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:  # x: (num_tokens, hidden_size)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class ZooDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int, biases: Biases):
        super().__init__()
        self.self_attn = ZooAttention(config, rotary_emb, layer_idx, biases)
        self.mlp = ZooMLP(config, biases[2])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: Tensor, x: Tensor, residual: Tensor | None, context: AttentionContext
    ) -> tuple[Tensor, Tensor]:  # x, residual: (num_tokens, hidden_size); as Qwen3's layer
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, context)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class ZooModel(nn.Module):
    def __init__(self, config: Any, biases: Biases):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True: sliding-window attention is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = zoo_rope(config, head_size(config))  # one cos/sin table for every layer
        self.layers = nn.ModuleList(
            ZooDecoderLayer(config, rotary_emb, i, biases) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, context: AttentionContext) -> Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (num_tokens, hidden_size)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, context)
        return self.norm(x, residual)[0]  # (num_tokens, hidden_size)


class LlamaForCausalLM(nn.Module):
    """Llama 2 and 3.x: grouped-query attention, llama3 RoPE scaling, biases as config.json says,
    the LM head tied to the embedding when it says so (3.2-1B and 3B)."""

    packed_modules_mapping = Qwen3ForCausalLM.packed_modules_mapping  # the same checkpoint names

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = ZooModel(config, self.biases(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one matrix, used both ways

    def biases(self, config: Any) -> Biases:
        attention = getattr(config, "attention_bias", False)
        return attention, attention, getattr(config, "mlp_bias", False)

    def forward(self, input_ids: Tensor, positions: Tensor, context: AttentionContext) -> Tensor:
        return self.model(input_ids, positions, context)  # (num_tokens, hidden_size)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:  # (num_tokens, hidden_size)
        return self.lm_head(hidden_states)  # (num_tokens, vocab_size)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 and Qwen2.5: Llama's layout with biases on q, k and v (and the small ones tied)."""

    def biases(self, config: Any) -> Biases:
        return True, False, False


# The loader's table with the zoo's families. Typed as the loader's: the engine calls on each model
# only what Qwen3's class has (config, packed_modules_mapping, forward, compute_logits, lm_head).
ZOO_ONLY = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM}
ZOO: Models = {**MODELS, **cast(Models, ZOO_ONLY)}


# %% [markdown]
# ## Against transformers
# Both tiny checkpoints through notebook 02's `load_model`, given the zoo's table: the logits of
# every position of a prompt, against transformers' own Llama and Qwen2 on the same folder.

# %%
from minivllm.models.zoo import ZOO  # noqa: E402

prompt = [5, 17, 300, 42, 7, 999, 3, 128, 64, 11, 2000, 9]
for path in (llama_path, qwen2_path):
    ours = load_model(path, torch.float32, models=ZOO)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prompt_logits(ours, prompt), expected, rtol=1e-4, atol=1e-4)
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight
    print(f"{type(ours).__name__}: logits match transformers'; LM head tied: {tied}")

# %% [markdown]
# Each difference matters: drop a bias of the Llama, or its RoPE scaling, and the logits move by
# more than the tolerance above (RoPE's little, on random weights that attend almost evenly; over
# a longer prompt, since slowed waves have barely turned by position 12).

# %%
long_prompt = prompt * 8  # 96 tokens
llama = load_model(llama_path, torch.float32, models=ZOO)
with torch.no_grad():
    reference = prompt_logits(llama, long_prompt)
    layer = llama.model.layers[0]
    layer.mlp.down_proj.bias.zero_()  # a loader that dropped one bias
    no_bias = (prompt_logits(llama, long_prompt) - reference).abs().max().item()
llama = load_model(llama_path, torch.float32, models=ZOO)
rope = llama.model.layers[0].self_attn.rotary_emb
plain = get_rope(preset_config("tiny"), 32)  # notebook 01's RoPE, theta 1e6, unscaled
rope.cos, rope.sin = plain.cos, plain.sin
with torch.no_grad():
    unscaled = prompt_logits(llama, long_prompt)
print(f"without a bias: {no_bias:.3f}; with plain RoPE: {(unscaled - reference).abs().max():.3f}")
assert no_bias > 1e-3 and (unscaled - reference).abs().max() > 1e-3

# %% [markdown]
# ## In the engine
# This notebook follows notebook 02, so it cannot run the engine (notebooks 03 to 06 build it). The
# engine needs nothing more than the table: `from minivllm import LLM` (the production engine of
# the deep dive `fast_engine`) reads `config.json` and loads the weights through `ZOO`, so a Llama
# or Qwen2 folder, or Hub id, runs on every path of the engine; `tests/test_model_zoo.py` checks
# each path, token for token, against transformers' `generate`. Notebook 06's simple `LLM` keeps
# notebook 02's table and refuses both, as `read_config` did above.

# %% [markdown]
# ## Check yourself
# 1. Llama-3.2-1B (preset `llama-3.2-1b`: theta 500,000, head_dim 64, original context 8,192,
#    `low_freq_factor` 1, `high_freq_factor` 4) has 32 RoPE frequencies. How many are slowed by the
#    full `factor`, how many kept, how many blended? Answer `(slowed, kept, blended)`.

# %%
from minivllm.testing import check_answer  # noqa: E402

answer1 = None  # your answer: replace None with a tuple of three ints
params_1b = preset_config("llama-3.2-1b").rope_parameters
base_1b = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
ratio_1b = base_1b / llama3_inv_freq(base_1b, params_1b)
slowed, kept = int((ratio_1b > 31.999).sum()), int((ratio_1b < 1.001).sum())
expected1 = (slowed, kept, len(ratio_1b) - slowed - kept)
check_answer(answer1, expected1, "1. Llama 3.2's RoPE bands")

# %% [markdown]
# Worked answer. Pair i's wavelength is `2π · 500000^(i/32)` positions. It is kept while shorter
# than 8192 / 4 = 2,048 positions: `500000^(i/32) < 326` holds for i ≤ 14 (15 kept). It is slowed
# 32 times once longer than 8,192: `500000^(i/32) > 1304` from i = 18 (14 slowed); the 3 between
# are blended.

# %%
check_answer((14, 15, 3), expected1, "1. Llama 3.2's RoPE bands")
