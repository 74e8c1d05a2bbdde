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
# # 02 · Model: Qwen3 from our layers, loaded from a HuggingFace checkpoint
#
# **What this notebook builds.** Qwen3, the model the engine serves, from the layers of notebook 01; a loader that
# reads a HuggingFace checkpoint folder (config.json + safetensors) into it, tensor-parallel slices included; a
# maker of checkpoints, since this machine cannot download one; and `SamplingParams`, a request's settings.
#
# **What it assumes.** Notebook 01's layers and attention functions (PyTorch's on a CPU, our Triton kernel on a GPU).
#
# **How we know it is right.** transformers' `Qwen3ForCausalLM` is the oracle: the same checkpoint through both
# models gives the same logits, to float32 rounding; the model and the loader are checked against it.

# %%
import hashlib
import json
import os
import tempfile
from importlib import resources
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()
FIGURES = Path(os.environ.get("MINIVLLM_FIGURES", "../build/figures")).resolve()
FIGURES.mkdir(parents=True, exist_ok=True)
print(f"device: {DEVICE}, torch {torch.__version__}")

# %% [markdown]
# ## What a checkpoint is
# A model on the HuggingFace hub is a folder:
#
# * `config.json`: the architecture's name (`"architectures": ["Qwen3ForCausalLM"]`) and its sizes (layers,
#   hidden size, heads, vocabulary, RoPE base…);
# * `model.safetensors` (or shards plus `model.safetensors.index.json`): named tensors, e.g. `model.layers.0.
#   self_attn.q_proj.weight`, raw after a small JSON header, so a loader lists names and shapes without reading;
# * tokenizer files and `generation_config.json` (which tokens end a reply).
#
# There is no network here, so we make such folders with transformers' own `Qwen3ForCausalLM` and `save_pretrained`:
# the layout is exactly a real checkpoint's, and our loader later reads a downloaded Qwen3 unchanged.
#
# ## Making a checkpoint offline
# Three presets. `tiny` keeps every feature of the real model (GQA, q/k norms, tied embeddings, head_dim a power of
# two for the Triton kernel) at a size that runs the course on a laptop CPU; `tiny-text` is `tiny` trained on the
# tokenizer's text, since random weights write gibberish; `qwen3-0.6b` has Qwen3-0.6B's exact shapes, for the GPU.
#
# The tokenizer is a byte-level BPE (the kind GPT-2 and Qwen use) trained on a small text that ships with the package,
# with ChatML's special tokens and chat template. Its 2,048 tokens fit in both vocabularies. Random weights follow
# transformers' initialisation (matrices ~ N(0, 0.02)), but norm weights are drawn around 1, not exactly 1: norms all
# equal to 1 would hide a loader that swaps or skips them. One seeded generator and no timestamp in safetensors: the
# same seed writes the same bytes (`tiny-text` too: one CPU thread, seeded batches).

# %% tags=["export"] module="minivllm.checkpoint.maker"
import argparse
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from minivllm.checkpoint.train import corpus_ids, train

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        dtype="float32",
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
}
PRESETS["tiny-text"] = dict(PRESETS["tiny"])  # tiny's shapes; write_checkpoint trains it on the corpus
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TOKENIZER_VOCAB_SIZE = 2048
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def preset_config(name: str) -> Qwen3Config:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    # rope_theta: transformers 4's keyword, which 5 still takes (into rope_parameters) but no longer declares
    return Qwen3Config(**PRESETS[name], rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2)  # type: ignore[call-arg]


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the text in minivllm/data (deterministic: same text, same merges)."""
    text = resources.files("minivllm").joinpath("data/tokenizer_corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def random_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    """transformers' Qwen3 with seeded random weights, ready to save or to train."""
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    with torch.device("meta"):
        # its names and shapes are those of a real checkpoint. (mypy: transformers' `to` is a functools.wraps
        # wrapper, which mypy does not bind as a method)
        model = Qwen3ForCausalLM(config).to(dtype)  # type: ignore[arg-type]
    model.to_empty(device="cpu")  # allocate, uninitialised; this gives a tied head its own storage, so:
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # RoPE's buffers (not saved, but a forward uses them)
    generator = torch.Generator().manual_seed(seed)
    params = list(model.named_parameters())  # tied weights appear once
    total = sum(p.numel() for _, p in params)
    with (
        torch.no_grad(),
        tqdm(total=total, unit="param", unit_scale=True, desc="random weights", disable=total < 10**8) as bar,
    ):
        for name, param in params:
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1, generator=generator)
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
            bar.update(param.numel())
    return model


def write_checkpoint(
    out: str | Path, preset: str | Qwen3Config = "tiny", seed: int = 0, max_shard_size: str | int | None = None
) -> Path:
    """Write a HuggingFace checkpoint folder: config, generation config, safetensors weights, tokenizer."""
    config = preset_config(preset) if isinstance(preset, str) else preset
    tokenizer = train_tokenizer()
    tokenizer.model_max_length = config.max_position_embeddings
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"vocab_size={config.vocab_size} cannot hold the tokenizer's {len(tokenizer)} tokens")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = random_model(config, seed)
    if preset == "tiny-text":  # a few hundred steps on the corpus, so that greedy output reads as text
        train(model, corpus_ids(tokenizer), seed)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[2, 0], pad_token_id=0)
    options: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}  # {}: transformers' default
    model.save_pretrained(out, **options)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.checkpoint",
        description="Write a HuggingFace checkpoint of a named preset (random weights; tiny-text trained on text).",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = write_checkpoint(args.out, args.preset, args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out} in {time.perf_counter() - start:.1f} s")


# %% [markdown]
# `python -m minivllm.checkpoint --preset tiny --out DIR` runs `main`; here we call the function and list what it wrote.

# %%
from minivllm.checkpoint import PRESETS, write_checkpoint

tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
for f in sorted(tiny_path.iterdir()):
    print(f"{f.name:28} {f.stat().st_size:>10,} bytes")

# %% [markdown]
# The safetensors header lists every tensor with its shape. One decoder layer of the checkpoint:

# %%
from safetensors import safe_open

with safe_open(tiny_path / "model.safetensors", "pt") as f:
    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
for name, shape in shapes.items():
    if name.startswith("model.layers.0.") or not name.startswith("model.layers."):
        print(f"{name:45} {shape}")
print(f"... {len(shapes)} tensors; no lm_head.weight: the head is tied to the embedding")

# %% [markdown]
# The tokenizer round-trips any text (it is byte-level, so no character is unknown), and the chat template wraps
# messages in ChatML:

# %%
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(tiny_path)
ids = tokenizer.encode("The lighthouse keeper counted 270 litres of oil. Ünïcödé works too: 東京")
assert tokenizer.decode(ids) == "The lighthouse keeper counted 270 litres of oil. Ünïcödé works too: 東京"
print(len(tokenizer), "tokens in the vocabulary;", len(ids), "tokens for that sentence")
messages = [{"role": "user", "content": "Hello!"}]
print(repr(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)))
print("eos:", tokenizer.eos_token, tokenizer.eos_token_id)

# %% [markdown]
# Same seed, same bytes: compare the file hashes of two writes. (Another seed changes the weights, not the tokenizer.)


# %%
def folder_hashes(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in sorted(path.iterdir())}


with tempfile.TemporaryDirectory() as tmp:
    a = folder_hashes(write_checkpoint(Path(tmp) / "a", "tiny", seed=0))
    b = folder_hashes(write_checkpoint(Path(tmp) / "b", "tiny", seed=0))
    c = folder_hashes(write_checkpoint(Path(tmp) / "c", "tiny", seed=1))
assert a == b == folder_hashes(tiny_path)
assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]
print(json.dumps(a, indent=1))

# %% [markdown]
# ## Qwen3 from the layers
# A Qwen3 decoder layer is the textbook pre-norm block:
#
# ```
# q, k, v  = qkv_proj(input_layernorm(x))
# h        = x + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))
# gate, up = gate_up_proj(post_attention_layernorm(h))
# y        = h + down_proj(silu(gate) * up)
# ```
#
# Two things set it apart from Llama: **q/k norms**, an RMSNorm over each head's query and key (one weight of
# `head_dim` shared by all heads) applied before RoPE (so `RotaryEmbedding` takes them: 01's kernel does both in one
# launch), which keeps attention scores from blowing up; and
# **GQA**, 16 query heads sharing 8 key/value heads in the 0.6B. The LM head is **tied** to the embedding in the
# small Qwen3 models (one matrix used both ways), untied in the large ones.
#
# ### Attention takes a context
# The model sees a batch as one flat run of tokens: `input_ids` and `positions` of shape `(num_tokens,)`, with
# the sequences packed end to end. Only attention cares where one sequence ends and the next begins, so it takes
# a *context* that says so. In this notebook the context is a batch of whole prompts: `cu_seqlens` (cumulative
# lengths) and causal attention within each prompt, with flash-attn's varlen convention from notebook 01.
#
# Why a context object rather than two tensors? Because how a layer attends changes in notebook 04 (write the new
# keys and values into a paged KV cache, read the old ones back, a different kernel for decode) while the model
# does not: the engine passes a different context with the same `attend` method, and the model stays as it is.

# %% tags=["export"] module="minivllm.attention.layer"
from typing import Protocol

import torch
from torch import nn


class AttentionContext(Protocol):
    """How the layers of one forward pass attend: which tokens see which, which kernel, which KV cache."""

    def attend(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class Attention(nn.Module):
    """Causal self-attention of one layer, over this rank's heads; the context does the attending."""

    k_cache: torch.Tensor  # this layer's paged KV cache, bound by the model runner (notebook 04):
    v_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: AttentionContext) -> torch.Tensor:
        # q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim)
        return context.attend(self, q, k, v)  # (num_tokens, num_heads, head_dim)


# %% [markdown]
# This notebook's context: whole prompts, no cache (notebook 04 adds the paged one; all live in `minivllm.attention`).

# %% tags=["export"] module="minivllm.attention.prefill"
from dataclasses import dataclass
from itertools import accumulate

import torch

from minivllm.attention.layer import Attention
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous  # the package sets up Triton's CPU interpreter
from minivllm.kernels.reference import attention_ref


@dataclass(slots=True)
class PrefillContext:
    """Whole prompts packed end to end, no KV cache: each token attends to its own prompt's tokens up to itself."""

    cu_seqlens: torch.Tensor  # (num_seqs + 1,) int32: prompt i is tokens cu_seqlens[i]:cu_seqlens[i + 1]
    max_seqlen: int

    @classmethod
    def from_lens(cls, seq_lens: list[int], device: torch.device | str) -> "PrefillContext":
        cu_seqlens = torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32, device=device)
        return cls(cu_seqlens, max(seq_lens))

    def attend(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cu = self.cu_seqlens
        if q.is_cuda:
            return flash_attn_varlen_contiguous(
                q, k, v, cu, cu, self.max_seqlen, self.max_seqlen, softmax_scale=layer.scale, causal=True
            )
        return attention_ref(q, k, v, cu, cu, softmax_scale=layer.scale, causal=True)


# %% [markdown]
# ### The model
# The classes mirror transformers' module tree (`model.layers.N.self_attn…`), so a checkpoint name maps to our parameter
# by changing at most one component. Queries, keys and values come from one packed `qkv_proj`, the MLP's gate and up
# from one `gate_up_proj` (notebook 01); `packed_modules_mapping` records which checkpoint tensors go where.
#
# RoPE's cos/sin table (40,960 positions for the 0.6B) is built once and shared by all layers. With tensor parallelism
# every rank builds the same model with `1/tp` of the heads and of the MLP columns: the layers take their rank and group
# from the `with tensor_parallel(...)` block the model is built in (notebook 01), so the model code has no TP logic.

# %% tags=["export"] module="minivllm.models.qwen3"
from typing import Any

import torch
from torch import nn

from minivllm.attention.layer import Attention, AttentionContext
from minivllm.kernels.small_layers import gemv
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary_embedding import RotaryEmbedding, get_rope


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, context: AttentionContext) -> torch.Tensor:
        # positions: (num_tokens,); x: (num_tokens, hidden_size)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        q, k = self.rotary_emb(positions, q, k, norms=(self.q_norm, self.k_norm))  # each head normalised, rotated
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), context)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(o.flatten(1))  # (num_tokens, hidden_size)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (supported: 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        if self.gate_up_proj.use_triton and x.shape[0] == 1:  # one token: the activation inside 01's GEMV
            return self.down_proj(gemv(x, self.gate_up_proj.weight, gated=True))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, context: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual: (num_tokens, hidden_size)
        if residual is None:  # the first layer: the residual stream is the embedding
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, context)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(config, head_dim_of(config))  # one cos/sin table, shared by every layer
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary_emb, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (num_tokens, hidden_size)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, context)
        x, _ = self.norm(x, residual)
        return x  # (num_tokens, hidden_size)


class Qwen3ForCausalLM(nn.Module):
    # checkpoint module name -> (our packed module, shard id): what the loader packs where
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one matrix, used both ways

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext) -> torch.Tensor:
        return self.model(input_ids, positions, context)  # (num_tokens, hidden_size)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (num_tokens, hidden_size)
        return self.lm_head(hidden_states)  # (num_tokens, vocab_size)


# %% [markdown]
# ### Where the parameters go
# Build both presets on PyTorch's `meta` device: the modules and shapes exist, the memory does not, so counting
# the 0.6B costs nothing. transformers' model, built the same way, has the same total.

# %%
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from minivllm.checkpoint import preset_config
from minivllm.models.qwen3 import Qwen3ForCausalLM


def component(name: str) -> str:
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norms"
    return "attention" if ".self_attn." in name else "MLP"


param_table = {}
for preset in ("tiny", "qwen3-0.6b"):  # (tiny-text has tiny's shapes)
    config = preset_config(preset)
    with torch.device("meta"):
        ours, theirs = Qwen3ForCausalLM(config), HFQwen3ForCausalLM(config)
    counts = dict.fromkeys(["embedding", "attention", "MLP", "norms"], 0)
    for name, p in ours.named_parameters():  # a tied head is the embedding: counted once
        counts[component(name)] += p.numel()
    assert sum(counts.values()) == sum(p.numel() for p in theirs.parameters()), preset
    param_table[preset] = counts

print(f"{'':10}" + "".join(f"{preset:>26}" for preset in param_table))
for part in ["embedding", "attention", "MLP", "norms", "total"]:
    cells = []
    for counts in param_table.values():
        n = sum(counts.values()) if part == "total" else counts[part]
        cells.append(f"{n:>16,} ({100 * n / sum(counts.values()):5.1f}%)")
    print(f"{part:10}" + "".join(f"{c:>26}" for c in cells))

# %%
fig, ax = plt.subplots(figsize=(8, 2.2))
colors = {"embedding": "tab:blue", "attention": "tab:orange", "MLP": "tab:green", "norms": "tab:red"}
for row, counts in enumerate(param_table.values()):
    total, left = sum(counts.values()), 0.0
    for part, n in counts.items():
        ax.barh(row, 100 * n / total, left=left, color=colors[part], label=part if row == 0 else None)
        left += 100 * n / total
ax.set_yticks(range(len(param_table)), [f"{p}\n{sum(c.values()) / 1e6:,.1f} M" for p, c in param_table.items()])
ax.set_xlabel("% of parameters")
ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 1.35))
fig.tight_layout()
fig.savefig(FIGURES / "02_parameters.png", dpi=120)

# %% [markdown]
# Read it: in the 0.6B, 44% of the weights are MLP, 30% attention and 26% the embedding, which is also the LM head
# (tied): every decoded token reads a 151,936 × 1,024 matrix to score the vocabulary. Each decode step reads *all*
# these weights (1.2 GB in bfloat16): hence decode is memory-bound, and batching many sequences per step pays.

# %% [markdown]
# ## Loading a checkpoint
# Four jobs, in this order:
#
# 1. **Read the config** and pick our class from `config.architectures`. transformers' `AutoConfig` understands
#    every version's keys (`rope_theta` vs `rope_parameters`, `torch_dtype` vs `dtype`) and fills in the
#    architecture's defaults. But in some transformers versions, importing an architecture's config class
#    (`Qwen3Config`) imports the whole generation stack with it: with transformers 5.17, on our GPU machine, 2,048
#    modules in 8.4 s (Python keeps no bytecode there; 1,701 modules in 2.4 s on a CPU machine that does), the largest
#    part of the engine's start-up. So when config.json writes out every field our model reads, as transformers 5
#    writes it, transformers' base `PretrainedConfig` holds the fields as written; any other config.json (a field
#    missing, RoPE in transformers 4's form, an architecture without a field list in `CONFIG_FIELDS`) goes through
#    `AutoConfig`. On that machine, `python -m minivllm` printed its first outputs 14.7–22.8 s after launch with
#    `AutoConfig` for every file, 6.6–9.5 s with the base class.
# 2. **Map names.** Our parameter names are the checkpoint's except for packed modules:
#    `…self_attn.q_proj.weight` goes into `…self_attn.qkv_proj.weight` as shard `"q"`. We derive the map from
#    the model itself, by unpacking each of its parameter names with `packed_modules_mapping`.
# 3. **Check before building.** Compare the checkpoint's names with the map (missing? unexpected?), then
#    rehearse every copy on a `meta` model: the same `weight_loader` calls, with the same shape checks, but no
#    memory and no data. Every error is raised here, before a real tensor exists.
# 4. **Copy.** Build the model in the requested dtype directly on the device and hand each tensor to its
#    parameter's `weight_loader`, which keeps this rank's slice (notebook 01).
#
# Which files: those a sharded checkpoint's `model.safetensors.index.json` names, else every `*.safetensors` in the
# folder; each tensor in exactly one, where the index says (a stray old shard is an error, not a coin toss). Skipped on
# purpose: `lm_head.weight` when the head is tied, and the `rotary_emb.inv_freq` buffers older transformers saved.
#
# The supported architectures are a dictionary from the config's name to our class. Adding Llama means writing
# `LlamaForCausalLM` (Qwen3 without the q/k norms) and one line in `MODELS`.

# %% tags=["export"] module="minivllm.models.loader"
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PretrainedConfig

from minivllm.layers.linear import check_shape
from minivllm.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[Qwen3ForCausalLM]] = {"Qwen3ForCausalLM": Qwen3ForCausalLM}
# the config.json fields each model reads (RoPE's aside): when all are written, no architecture class is imported
CONFIG_FIELDS = {
    "Qwen3ForCausalLM": (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "attention_bias",
        "tie_word_embeddings",
        "max_position_embeddings",
    )
}
INDEX_FILE = "model.safetensors.index.json"
ShardId = str | int | None


def read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(raw).__name__}")
    return raw


def read_config(path: Path) -> PretrainedConfig:
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist or is not a folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a checkpoint folder needs a config.json")
    raw = read_json(config_file)
    architectures = raw.get("architectures") or []
    if not any(a in MODELS for a in architectures):
        raise ValueError(
            f"{config_file}: architectures={architectures} is not supported; supported architectures: {sorted(MODELS)}"
        )
    fields = CONFIG_FIELDS.get(supported(architectures), ())
    if fields and written_out(raw, fields):
        return PretrainedConfig.from_dict(raw)  # the fields as written; no class, so no defaults needed
    from transformers import AutoConfig  # here: AutoConfig's registry alone takes 0.4 s to import

    return AutoConfig.from_pretrained(path)  # the architecture's class: its defaults and older keys understood


def written_out(raw: dict, fields: tuple[str, ...]) -> bool:
    """Does config.json give every field a value, and RoPE's in transformers 5's form (rope_parameters)?"""
    rope = raw.get("rope_parameters")
    return isinstance(rope, dict) and "rope_theta" in rope and all(raw.get(f) is not None for f in fields)


def supported(architectures: list[str]) -> str:
    """The first of config.json's architectures that MODELS builds (read_config has checked there is one)."""
    return next(a for a in architectures if a in MODELS)


def model_class(config: PretrainedConfig) -> type[Qwen3ForCausalLM]:
    assert config.architectures is not None, "read_config checks the architectures"
    return MODELS[supported(config.architectures)]


def read_index(path: Path) -> dict[str, Path] | None:
    """A sharded checkpoint's index: tensor name -> the file that holds it; None when there is no index."""
    index = path / INDEX_FILE
    if not index.is_file():
        return None
    weight_map = read_json(index).get("weight_map")
    if not weight_map or not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file name")
    return {name: path / file for name, file in weight_map.items()}


def checkpoint_files(path: Path, weight_map: dict[str, Path] | None = None) -> list[Path]:
    """The safetensors files: exactly those the index names (a sharded checkpoint), else every *.safetensors file."""
    if weight_map is None:
        files = sorted(path.glob("*.safetensors"))
    else:
        files = sorted(set(weight_map.values()))
        if missing := [f.name for f in files if not f.is_file()]:
            raise FileNotFoundError(f"{path / INDEX_FILE} names {missing}, missing from {path}")
        if (single := path / "model.safetensors").is_file() and single not in files:
            raise ValueError(
                f"{path} holds both {single.name} and {INDEX_FILE}, which does not name it: transformers "
                "would load the first, vLLM the files the index names; delete the stale one"
            )
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    return files


def tensor_shapes(files: list[Path], weight_map: dict[str, Path] | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the safetensors headers (no weight is read). Each tensor must be in
    exactly one file, the one the index (if any) names: otherwise which copy wins would be an accident."""
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                header = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
        if twice := sorted(header.keys() & owner.keys()):
            raise ValueError(
                f"tensor {twice[0]} is in both {owner[twice[0]]} and {file} ({len(twice)} tensor(s) "
                "in two files): a stray old shard? Keep one copy"
            )
        shapes |= header
        owner |= dict.fromkeys(header, file)
    for name, file in (weight_map or {}).items():
        if owner.get(name) != file:
            where = f"it is in {owner[name]}" if name in owner else "no file holds it"
            raise ValueError(f"{file.parent / INDEX_FILE} puts tensor {name} in {file.name}, but {where}")
    return shapes


def checkpoint_names(model: Qwen3ForCausalLM) -> dict[str, tuple[str, ShardId]]:
    """Checkpoint tensor name -> (our parameter name, shard id), for every tensor the model needs."""
    sources: dict[str, list[tuple[str, str | int]]] = {}
    for hf_module, (ours, shard_id) in model.packed_modules_mapping.items():
        sources.setdefault(ours, []).append((hf_module, shard_id))
    names: dict[str, tuple[str, ShardId]] = {}
    for name, _ in model.named_parameters():  # a tied lm_head is not listed: it is the embedding
        parts = name.split(".")
        packed = [i for i, part in enumerate(parts) if part in sources]
        if not packed:
            names[name] = (name, None)
            continue
        i = packed[0]
        for hf_module, shard_id in sources[parts[i]]:
            names[".".join([*parts[:i], hf_module, *parts[i + 1 :]])] = (name, shard_id)
    return names


def is_ignored(name: str, config: PretrainedConfig) -> bool:
    """Tensors a checkpoint may hold that the model does not need."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    check_shape("parameter", loaded, tuple(param.shape))
    param.data.copy_(loaded)


def load_tensor(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
    loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
    if shard_id is None:
        loader(param, loaded)
    else:
        loader(param, loaded, shard_id)


def check_checkpoint(model: Qwen3ForCausalLM, shapes: dict[str, tuple[int, ...]], config: PretrainedConfig) -> None:
    """Raise if the checkpoint lacks a tensor, has one too many, or has one of the wrong shape."""
    needed = checkpoint_names(model)
    present = {name for name in shapes if not is_ignored(name, config)}
    if missing := sorted(needed.keys() - present):
        raise ValueError(
            f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}"
            + (", ..." if len(missing) > 5 else "")
        )
    if unexpected := sorted(present - needed.keys()):
        raise ValueError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:5])}"
            + (", ..." if len(unexpected) > 5 else "")
        )
    params = dict(model.named_parameters())
    for name in sorted(present):  # rehearse each copy on the meta device: the loaders' own shape checks
        param_name, shard_id = needed[name]
        try:
            load_tensor(params[param_name], torch.empty(shapes[name], device="meta"), shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name}: {e}") from None


def load_weights(model: Qwen3ForCausalLM, files: list[Path], config: PretrainedConfig) -> None:
    needed, params = checkpoint_names(model), dict(model.named_parameters())
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if not is_ignored(name, config):
                    param_name, shard_id = needed[name]
                    load_tensor(params[param_name], f.get_tensor(name), shard_id)


def resolve_dtype(dtype: torch.dtype | str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """ "auto": the checkpoint's dtype on a GPU, float32 on a CPU."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = cast(torch.dtype, getattr(torch, dtype, None))  # or None, or not a dtype: refused below
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be 'auto', torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    return dtype


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    config: PretrainedConfig | None = None,
) -> Qwen3ForCausalLM:
    """Build the model a HuggingFace checkpoint folder describes and load its weights (this rank's slice).
    `config`: the folder's config.json, when the caller has read it already (the engine's Config has)."""
    path, device = Path(path), torch.device(device)
    config, weight_map = config or read_config(path), read_index(path)
    files = checkpoint_files(path, weight_map)
    shapes = tensor_shapes(files, weight_map)
    dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):  # every check runs on a model that holds no memory
        check_checkpoint(model_class(config)(config), shapes, config)
    with default_dtype(dtype), device:
        model = model_class(config)(config)
    load_weights(model, files, config)
    return model.eval()


# %% [markdown]
# The map from checkpoint names to ours, for one layer of the tiny model:

# %%
from minivllm.models.loader import checkpoint_names

with torch.device("meta"):
    names = checkpoint_names(Qwen3ForCausalLM(preset_config("tiny")))
for hf_name, (ours_name, shard_id) in names.items():
    if hf_name.startswith("model.layers.0.") or not hf_name.startswith("model.layers."):
        print(f"{hf_name:45} -> {ours_name}" + (f" [{shard_id!r}]" if shard_id is not None else ""))
assert names.keys() == shapes.keys()  # exactly the tensors the checkpoint holds

# %% [markdown]
# ### Bad checkpoints fail early, with a clear message
# A folder that is not there, an architecture we do not know, a tensor missing, one too many, one in two files, or
# one of the wrong shape: each is a `ValueError` or `FileNotFoundError` naming the culprit, raised before the model
# is built. We break copies of the tiny checkpoint in each of these ways.

# %%
from safetensors.torch import save_file

from minivllm import load_model
from minivllm.testing import edited_copy  # copytree, then config.json's dict and the tensors edited in place


def with_stray_file(tmp: Path) -> Path:  # an old file beside the weights, holding another model.norm.weight
    path = edited_copy(tiny_path, Path(tmp) / "e")
    save_file({"model.norm.weight": torch.zeros(128)}, path / "old.safetensors")
    return path


cases = {
    "missing folder": lambda tmp: Path(tmp) / "nowhere",
    "unknown architecture": lambda tmp: edited_copy(
        tiny_path, Path(tmp) / "a", config_edit=lambda c: c.update(architectures=["MambaForCausalLM"])
    ),
    "missing tensor": lambda tmp: edited_copy(
        tiny_path, Path(tmp) / "b", tensors_edit=lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")
    ),
    "unexpected tensor": lambda tmp: edited_copy(
        tiny_path,
        Path(tmp) / "c",
        tensors_edit=lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}),
    ),
    "shape mismatch": lambda tmp: edited_copy(
        tiny_path,
        Path(tmp) / "d",
        tensors_edit=lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 128)}),
    ),
    "tensor in two files": with_stray_file,
}
with tempfile.TemporaryDirectory() as tmp:
    for case, make in cases.items():
        try:
            load_model(make(tmp))
        except (ValueError, FileNotFoundError) as e:
            print(f"{case:>20}: {type(e).__name__}: {e}")
        else:
            raise AssertionError(f"{case}: loaded without an error")

# %% [markdown]
# Which reader does a config.json get? Two files below: the tiny checkpoint's, as transformers 5 wrote it, and the
# same file in transformers 4's form (`rope_theta` at the top, as the Hub's Qwen3 folders still hold it). From step
# 1's rule, predict the class `read_config` returns for each before you run the cell; it also checks that the fast
# reader's fields equal `AutoConfig`'s.

# %%
from transformers import AutoConfig

from minivllm.models.loader import CONFIG_FIELDS, read_config

fields = CONFIG_FIELDS["Qwen3ForCausalLM"]
assert {f: getattr(read_config(tiny_path), f) for f in fields} == {
    f: getattr(AutoConfig.from_pretrained(tiny_path), f) for f in fields
}
with tempfile.TemporaryDirectory() as tmp:
    old = edited_copy(
        tiny_path, Path(tmp) / "old", config_edit=lambda c: c.update(rope_theta=c.pop("rope_parameters")["rope_theta"])
    )
    print("transformers 5's config.json:", type(read_config(tiny_path)).__name__)
    print("transformers 4's config.json:", type(read_config(old)).__name__)

# %% [markdown]
# ## Parity with transformers
# The real test: load the tiny checkpoint with our loader and with transformers, run the same prompts through
# both in float32, compare the logits at every position. Prompt lengths: 1, around 16 and 256 (block sizes the
# KV cache will use), and a few hundred.
#
# `minivllm.testing.prompt_logits(model, token_ids)` is the one-prompt forward, with the prompt checked first (not
# empty, inside the vocabulary and the context): `positions = arange(len)`, one `PrefillContext`, `compute_logits` at
# every position. With no KV cache it is the oracle that every cached path of notebooks 03–05 is compared with. It lives
# in `testing`, with the helpers that tests and notebooks share, not on the model: the engine never calls it.

# %%
from transformers import AutoModelForCausalLM

from minivllm.testing import prompt_logits

model = load_model(tiny_path, dtype=torch.float32, device=DEVICE)
hf_model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).to(DEVICE)
corpus = resources.files("minivllm").joinpath("data/tokenizer_corpus.txt").read_text()
text_ids = tokenizer.encode(corpus)  # 3,969 tokens of the tokenizer's own training text

worst = 0.0
for n in (1, 15, 16, 17, 255, 256, 257, 700):
    token_ids = text_ids[:n]
    ours = prompt_logits(model, token_ids)  # (n, vocab_size)
    with torch.no_grad():
        ref = hf_model(torch.tensor([token_ids], device=DEVICE)).logits[0]
    error = (ours - ref).abs().max().item()
    worst = max(worst, error)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), n
    print(f"{n:4} tokens: max |logit difference| {error:.1e}, argmax identical at every position")
assert worst < 1e-4, worst

# %% [markdown]
# Packing works too: two prompts in one flat batch give each prompt's own logits, because the context keeps each
# token's attention inside its prompt (and `positions` restart at 0 for each). And with trained weights (the
# `tiny-text` preset) the same forward writes text:

# %%
from minivllm.attention.prefill import PrefillContext

a, b = text_ids[:40], text_ids[100:163]
input_ids = torch.tensor(a + b, device=DEVICE)
positions = torch.tensor(list(range(len(a))) + list(range(len(b))), device=DEVICE)
with torch.inference_mode():
    packed = model.compute_logits(model(input_ids, positions, PrefillContext.from_lens([len(a), len(b)], DEVICE)))
torch.testing.assert_close(packed[: len(a)], prompt_logits(model, a), rtol=1e-5, atol=1e-5)
torch.testing.assert_close(packed[len(a) :], prompt_logits(model, b), rtol=1e-5, atol=1e-5)
print("packed batch of 2 prompts == each prompt alone")
text_model = load_model(write_checkpoint(CHECKPOINTS / "tiny-text", "tiny-text"), dtype=torch.float32, device=DEVICE)
token_ids = tokenizer.encode("The Earth is about")
for _ in range(24):  # greedy, with no KV cache yet: the whole text again for every new token
    token_ids.append(int(prompt_logits(text_model, token_ids)[-1].argmax()))
print(repr(tokenizer.decode(token_ids)))

# %% [markdown]
# ### Tensor parallelism
# With two ranks each process builds the same model with half the heads and half the MLP columns; the loader
# hands every weight to its `weight_loader`, which keeps this rank's slice. For the tiny model, rank 0 holds:

# %%
tp, config = 2, preset_config("tiny")
print(
    f"query heads {config.num_attention_heads // tp} of {config.num_attention_heads}, "
    f"KV heads {config.num_key_value_heads // tp} of {config.num_key_value_heads}, "
    f"MLP columns {config.intermediate_size // tp} of {config.intermediate_size}, "
    f"vocabulary rows {config.vocab_size // tp} of {config.vocab_size}"
)

# %% [markdown]
# Running two processes needs `torch.distributed` and a spawn target defined in a module, so that check lives in
# `tests/test_model.py`: TP=2 over gloo on the CPU gives the logits of TP=1.

# %% [markdown]
# ### In bfloat16
# Inference runs in bfloat16, which keeps 8 significant bits: every matrix multiply and norm rounds, and two correct
# implementations round differently (other kernels, other summation orders). Logits then differ by about 1e-2, not
# 1e-7. Is a difference of 1e-2 rounding or a bug? The yardstick is transformers itself: how far is its bfloat16
# model from its float32 one? If ours is as close to float32 as theirs is, what is left is rounding.

# %%
from minivllm.benchmarks.model_parity import compare

token_ids = text_ids[:1000]
ours_bf16 = prompt_logits(load_model(tiny_path, dtype=torch.bfloat16, device=DEVICE), token_ids)
hf_bf16 = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.bfloat16).to(DEVICE)
with torch.no_grad():
    ref_bf16 = hf_bf16(torch.tensor([token_ids], device=DEVICE)).logits[0]
    ref_fp32 = hf_model(torch.tensor([token_ids], device=DEVICE)).logits[0]
top2 = ref_fp32.float().topk(2, dim=-1).values
decisive = top2[:, 0] - top2[:, 1] > 0.1  # positions where fp32's winner leads by more than rounding moves a logit
bf16_rows = {
    "minivllm bf16 vs transformers bf16": compare(ours_bf16, ref_bf16, decisive),
    "minivllm bf16 vs transformers fp32": compare(ours_bf16, ref_fp32, decisive),
    "transformers bf16 vs transformers fp32": compare(ref_bf16, ref_fp32, decisive),
}
for name, row in bf16_rows.items():
    print(
        f"{name:>40}: max |Δ| {row['max_abs_logit_error']:.4f}, mean |Δ| {row['mean_abs_logit_error']:.5f}, "
        f"top-1 agreement {100 * row['top1_agreement']:.1f}% "
        f"({100 * row['top1_agreement_decisive']:.1f}% at the {int(decisive.sum())} decisive positions)"
    )
ours, theirs = bf16_rows["minivllm bf16 vs transformers fp32"], bf16_rows["transformers bf16 vs transformers fp32"]
assert ours["mean_abs_logit_error"] <= 1.5 * theirs["mean_abs_logit_error"]
assert ours["top1_agreement"] >= theirs["top1_agreement"] - 0.02

# %% [markdown]
# Even transformers does not pick the same top-1 token in bfloat16 and float32 at every position. Random weights
# make logits nearly flat (the top two of the 0.6B's 151,936 differ by about 0.1 at the median), so rounding
# decides some argmaxes; a trained model's logits are peaked, and agreement is higher.
#
# On a GPU the model uses our Triton kernel instead of the reference attention. `python -m
# minivllm.benchmarks.model_parity` writes the `qwen3-0.6b` preset, loads it with our loader and with transformers,
# and makes the same comparison over a 1,024-token prompt (teacher forcing: every position scored at once). The
# committed H200 result:

# %%
parity_file = Path("figures/model_parity.json")
if parity_file.exists():
    parity = json.loads(parity_file.read_text())
    print(f"{parity['device']}: {parity['command']}")
    print(
        f"write the checkpoint {parity['write_checkpoint_s']} s, load it (bf16) {parity['load_model_bf16_s']} s; "
        f"median gap between the top two fp32 logits {parity['reference_top1_margin_median']:.3f}"
    )
    for row in parity["rows"]:
        print(
            f"{row['impl']:>18} vs {row['reference']:<18}: max |Δ| {row['max_abs_logit_error']:.4f}, "
            f"mean |Δ| {row['mean_abs_logit_error']:.5f}, top-1 agreement {100 * row['top1_agreement']:.1f}% "
            f"({100 * row['top1_agreement_decisive']:.1f}% at {parity['decisive_positions']} decisive positions)"
        )
else:
    print("no GPU result yet: run `python -m minivllm.benchmarks.model_parity` on a GPU")

# %% [markdown]
# ## The engine's settings
# One dataclass holds the settings of the runner (notebook 04), the scheduler (05) and the engine (06), with vLLM's
# names and defaults. It reads config.json once (`read_config`); everything downstream is built from
# `config.hf_config`. It checks every value before anything is built, naming the field and what it may be. A `None`
# is resolved here (`max_model_len` from the checkpoint, `device` from the machine), so later code never meets one.

# %% tags=["export"] module="minivllm.config"
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minivllm.models.loader import read_config


@dataclass(slots=True)
class Config:
    """The engine's settings. A None is resolved when the Config is made: then each field holds its declared type."""

    model: str | Path  # a HuggingFace checkpoint folder
    tensor_parallel_size: int = 1
    dtype: str | torch.dtype = "auto"  # the checkpoint's dtype on a GPU, float32 on a CPU
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences in one batch at most
    max_num_batched_tokens: int = 16384  # new tokens in one prefill step at most
    max_model_len: int = None  # type: ignore[assignment]  # prompt + completion tokens; None: the context length
    num_kvcache_blocks: int | None = None  # None: as many as gpu_memory_utilization allows (on a CPU: see below)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # True: no CUDA graphs
    enable_prefix_caching: bool = True
    scheduling_policy: str = "unified"  # "unified": mixed prefill + decode steps (vLLM v1); or "prefill-first"
    async_scheduling: bool = None  # type: ignore[assignment]  # schedule while a step runs (06); None: on 1 GPU
    seed: int = 0
    device: str = None  # type: ignore[assignment]  # None: cuda if available, else cpu
    hf_config: Any = field(init=False, repr=False)

    def __post_init__(self):
        self.model = Path(self.model)
        self.hf_config = read_config(self.model)  # FileNotFoundError / ValueError for a bad folder
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        context_len = self.hf_config.max_position_embeddings
        self.max_model_len = context_len if self.max_model_len is None else self.max_model_len
        if self.async_scheduling is None:
            self.async_scheduling = self.device == "cuda" and self.tensor_parallel_size == 1
        checks = {
            "tensor_parallel_size": (self.tensor_parallel_size >= 1, ">= 1"),
            "block_size": (self.block_size in (16, 32, 64, 128, 256), "16, 32, 64, 128 or 256"),
            "max_num_seqs": (self.max_num_seqs >= 1, ">= 1"),
            "max_num_batched_tokens": (self.max_num_batched_tokens >= 1, ">= 1"),
            "max_model_len": (1 <= self.max_model_len <= context_len, f"in [1, {context_len}], the context length"),
            "num_kvcache_blocks": (self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1, "None or >= 1"),
            "gpu_memory_utilization": (0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
            "device": (self.device in ("cpu", "cuda"), "'cpu' or 'cuda'"),
            "scheduling_policy": (self.scheduling_policy in ("unified", "prefill-first"), "unified or prefill-first"),
            "async_scheduling": (not (self.async_scheduling and self.tensor_parallel_size > 1), "off under TP"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size must be <= {torch.cuda.device_count()} (the GPUs present), "
                f"got {self.tensor_parallel_size}"
            )


# %%
from minivllm.config import Config

print(Config(tiny_path, max_model_len=1024))
try:
    Config(tiny_path, block_size=24)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ## Sampling parameters: what a request does with the logits
# The model ends in logits over the vocabulary; a request says how to pick its next token from them (the sampler
# of notebook 04) and when to stop. Each request carries its own settings, so one batch can mix greedy and
# creative requests. We keep vLLM's names and defaults (`temperature=0` is greedy: always the most likely token)
# and reject bad values *when the request is made*, naming the field and the allowed range. "Bad" includes the
# wrong kind of number: `2.0`, `True` or `"3"` as a count is refused rather than guessed at (a NumPy or PyTorch
# integer scalar is fine), and a NaN or infinity would reach the sampler as garbage tokens, without an error.
#
# **Tiny temperatures are greedy.** The sampler divides the logits by the temperature in float32: below about
# 1e-38 the logits become infinite (softmax of them is NaN), and long before that the distribution is one-hot. So,
# as vLLM does, any temperature below `1e-5` is stored as `0`: greedy, exactly and cheaply, never a NaN.

# %% tags=["export"] module="minivllm.sampling_params"
import math
from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_INT64 = 2**63 - 1  # top_k travels to the sampler as int64
MAX_LOGPROBS = 20  # the most log-probabilities a token may ask for (vLLM's default max_logprobs)


def scalar(value):
    """A NumPy or PyTorch 0-d value as the Python number it holds; anything else unchanged."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def as_int(value, name: str) -> int:
    """value as a Python int: ints and NumPy/PyTorch integer scalars. Floats, bools, None, text: ValueError."""
    number = scalar(value)
    if not isinstance(number, int) or isinstance(number, bool):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return number


def as_real(value, name: str) -> float:
    """value as a finite Python float: ints, floats and NumPy/PyTorch real scalars. NaN, infinities: ValueError."""
    number = scalar(value)
    if not isinstance(number, int | float) or isinstance(number, bool):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(number):  # ints too: float(10**400) would overflow
        raise ValueError(f"{name} must be finite, got {number}")
    return float(number)


def as_bool(value, name: str) -> bool:
    number = scalar(value)
    if not isinstance(number, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return number


def as_token_ids(value, name: str) -> list[int]:
    """A list or tuple of ints, or a 1-D integer NumPy array or PyTorch tensor, as a new list of Python ints."""
    if getattr(value, "ndim", 1) != 1:
        raise ValueError(f"{name} must be 1-D token ids, got shape {tuple(value.shape)}")
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        value = value.tolist()  # a float or bool array gives floats or bools, refused below
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of int token ids, got {type(value).__name__}")
    if all(type(t) is int for t in value):  # the common case, fast
        return list(value)
    return [as_int(t, f"{name}[{i}]") for i, t in enumerate(value)]


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of a request, and when to stop (vLLM's names and defaults). Every field is
    checked and converted to a plain Python value when it is made (and again by `dataclasses.replace`)."""

    temperature: float = 1.0  # 0 is greedy; below 1e-5 is stored as 0
    top_p: float = 1.0  # keep the most likely tokens whose probabilities add up to top_p
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per time a token is already in the output
    repetition_penalty: float = 1.0  # divides positive logits (multiplies negative ones) of prompt and output tokens
    max_tokens: int = 16  # completion tokens at most
    min_tokens: int = 0  # completion tokens before an end-of-sequence or stop token may be drawn
    ignore_eos: bool = False  # keep going after the end-of-sequence token
    seed: int | None = None  # per-request random seed; None draws from the engine's generator
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that finish the request (None: none)
    stop: list[str] | None = None  # strings that finish the request when the text contains one (a str: one string)
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    n: int = 1  # completions of the prompt (they share its KV blocks); with a seed, completion i uses seed + i
    logprobs: int | None = None  # per completion token: its log-probability, and this many most likely tokens'
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    def __post_init__(self):
        self.convert()
        checks = {  # field: (its value is allowed, what is)
            "max_tokens": (self.max_tokens >= 1, ">= 1"),
            "min_tokens": (0 <= self.min_tokens <= self.max_tokens, f"in [0, max_tokens={self.max_tokens}]"),
            "temperature": (self.temperature >= 0, ">= 0 (0 is greedy)"),
            "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (self.top_k == -1 or 1 <= self.top_k <= MAX_INT64, "-1 (off) or in [1, 2**63)"),
            "min_p": (0 <= self.min_p <= 1, "in [0, 1]"),
            "presence_penalty": (-2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            "frequency_penalty": (-2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            "repetition_penalty": (self.repetition_penalty > 0, "> 0 (1 is off)"),
            "stop_token_ids": (all(t >= 0 for t in self.stop_token_ids), "token ids >= 0"),
            "stop": (all(isinstance(x, str) and x for x in self.stop), "non-empty strings"),
            "n": (self.n >= 1, ">= 1"),
            "logprobs": (0 <= (self.logprobs or 0) <= MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]"),
            "prompt_logprobs": (0 <= (self.prompt_logprobs or 0) <= MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # greedy: dividing logits by it in float32 would overflow to inf, then NaN

    def convert(self) -> None:
        """Every field as a plain Python value of its type (our own copies); ValueError naming a field that is not."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, as_real(getattr(self, name), name))
        for name in ("top_k", "max_tokens", "min_tokens", "n"):
            setattr(self, name, as_int(getattr(self, name), name))
        for name in ("seed", "logprobs", "prompt_logprobs"):  # None, or an int
            setattr(self, name, None if getattr(self, name) is None else as_int(getattr(self, name), name))
        self.ignore_eos = as_bool(self.ignore_eos, "ignore_eos")
        self.include_stop_str_in_output = as_bool(self.include_stop_str_in_output, "include_stop_str_in_output")
        self.stop_token_ids = [] if self.stop_token_ids is None else as_token_ids(self.stop_token_ids, "stop_token_ids")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# %%
from minivllm.sampling_params import SamplingParams

print(SamplingParams(temperature=0, max_tokens=64))
with np.errstate(over="ignore"):
    print(f"a logit of 10 over a temperature of 1e-45, in float32: {np.float32(10) / np.float32(1e-45)}")
print(SamplingParams(temperature=1e-6), "<- a temperature below 1e-5 is greedy")
nan, inf = float("nan"), float("inf")
bad_values = [dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_k=0), dict(min_p=1.5)]
bad_values += [dict(max_tokens=2.0), dict(temperature=nan), dict(top_p=inf), dict(stop_token_ids=[[1]])]
bad_values += [dict(min_tokens=17), dict(repetition_penalty=0), dict(presence_penalty=3), dict(stop=[""])]
bad_values += [dict(n=0), dict(logprobs=21), dict(prompt_logprobs=-1)]
for bad in bad_values:
    try:
        SamplingParams(**bad)
    except ValueError as e:
        print("ValueError:", e)
    else:
        raise AssertionError(f"accepted {bad}")

# %% [markdown]
# ## Check yourself
# Replace `None` in each `answer = None` with your answer (by hand, or computed from the objects above) and run the
# cell: the check compares it with what the objects say. The worked answer follows.
#
# **1.** Which checkpoint tensors, with which shard ids, load into `model.layers.3.mlp.gate_up_proj.weight`? A dict.

# %%
import re

from minivllm.layers.linear import TPGroup, tensor_parallel
from minivllm.models.loader import check_checkpoint
from minivllm.testing import check_answer

answer = None  # your answer: replace None with an expression
gate_up = {hf: s for hf, (ours, s) in names.items() if ours == "model.layers.3.mlp.gate_up_proj.weight"}
check_answer(answer, gate_up, "1. gate_up")

# %% [markdown]
# Worked answer: `packed_modules_mapping` packs `gate_proj` as shard 0 and `up_proj` as shard 1, one above the other;
# the rest of the name, layer index included, carries over.

# %%
check_answer({"model.layers.3.mlp.gate_proj.weight": 0, "model.layers.3.mlp.up_proj.weight": 1}, gate_up, "1. gate_up")

# %% [markdown]
# **2.** Split Qwen3-0.6B over 2 ranks: how many rows does `qkv_proj.weight` have on each? Answer a list, one per rank.

# %%
answer = None  # your answer: replace None with an expression
config_06 = preset_config("qwen3-0.6b")
qkv_rows = []
for rank in range(2):
    with torch.device("meta"), tensor_parallel(TPGroup(rank=rank, size=2)):  # rank's model: shapes, no memory
        qkv_rows.append(Qwen3ForCausalLM(config_06).model.layers[0].self_attn.qkv_proj.weight.shape[0])
check_answer(answer, qkv_rows, "2. qkv rows")

# %% [markdown]
# Worked answer: each rank keeps half the 16 query heads and half the 8 KV heads, the latter once for K and once for
# V, each head 128 rows: (16 + 2 × 8) × 128 / 2 = 2,048 rows of the full 4,096.

# %%
check_answer([(16 + 2 * 8) * 128 // 2] * 2, qkv_rows, "2. qkv rows")

# %% [markdown]
# **3.** The tiny checkpoint is tied and holds no `lm_head.weight`. Which of our model's parameters does its LM head
# use? Answer its name, as `model.named_parameters()` lists it.

# %%
answer = None  # your answer: replace None with an expression
head_name = next(name for name, p in model.named_parameters() if p is model.lm_head.weight)
check_answer(answer, head_name, "3. tied head")

# %% [markdown]
# Worked answer: tied means one matrix at both ends: the LM head scores the vocabulary with the embedding table itself
# (a token's logit is its embedding · the hidden state). The checkpoint stores it once, under the embedding's name.

# %%
check_answer("model.embed_tokens.weight", head_name, "3. tied head")
assert "lm_head.weight" not in shapes  # the tiny checkpoint's tensors

# %% [markdown]
# **4.** A 0.6B checkpoint whose layer-5 `v_proj.weight` was made for 4 KV heads instead of 8: which shape does the
# loader expect, and which does it say it got? Answer `(expected, got)`, two shape tuples.

# %%
answer = None  # your answer: replace None with an expression
with torch.device("meta"):  # transformers' model lists a real checkpoint's tensors and shapes
    shapes_06 = {name: tuple(t.shape) for name, t in HFQwen3ForCausalLM(config_06).state_dict().items()}
    qwen06 = Qwen3ForCausalLM(config_06)
try:
    with torch.device("meta"):
        check_checkpoint(qwen06, shapes_06 | {"model.layers.5.self_attn.v_proj.weight": (4 * 128, 1024)}, config_06)
    raise AssertionError("a mis-shaped v_proj was accepted")
except ValueError as e:
    reported = tuple((int(a), int(b)) for a, b in re.findall(r"\((\d+), (\d+)\)", str(e)))  # the shapes it names
check_answer(answer, reported, "4. v_proj shapes")

# %% [markdown]
# Worked answer: `v_proj` maps the 1,024 hidden features to 8 KV heads × 128 dims, (1024, 1024); made for 4 heads it
# is (512, 1024). The loader rehearses every copy on the meta device, so it says so before reading any weight.

# %%
check_answer(((8 * 128, 1024), (4 * 128, 1024)), reported, "4. v_proj shapes")

# %% [markdown]
# **Exercise.** `exercises/02_llama.ipynb`: write `LlamaForCausalLM` from the same layers (no q/k norms),
# register it in `MODELS`, and check it against transformers' Llama on a random checkpoint.
