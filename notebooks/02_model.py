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
# Qwen3 from notebook 01's layers; a loader for HuggingFace checkpoints, and a maker of them; the
# engine's settings, `Config` and `SamplingParams`. The oracle is transformers' `Qwen3ForCausalLM`:
# the same checkpoint, the same logits.

# %%
import os
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()

# %% [markdown]
# ## A checkpoint, made offline
# A HuggingFace checkpoint is a folder: `config.json` (architecture, sizes), `model.safetensors` (a
# header of names and shapes, then the tensors; or shards listed in `model.safetensors.index.json`),
# the tokenizer, a generation config. Offline, transformers' `save_pretrained` writes them from
# presets: `tiny` (Qwen3 at laptop size), `tiny-text` (`tiny` trained on text), `qwen3-0.6b`
# (Qwen3-0.6B's shapes). Norms are drawn around 1, so a loader that skipped them shows.

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

PRESET_FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads head_dim "
    "max_position_embeddings dtype"
).split()
PRESETS: dict[
    str, dict[str, Any]
] = {  # every preset ties the LM head to the embedding, as the small Qwen3s do
    name: dict(zip(PRESET_FIELDS, values), tie_word_embeddings=True)
    for name, values in {
        "tiny": (2048, 128, 384, 4, 4, 2, 32, 4096, "float32"),
        "qwen3-0.6b": (151936, 1024, 3072, 28, 16, 8, 128, 40960, "bfloat16"),
    }.items()
}
# tiny's shapes; write_checkpoint trains it on the corpus
PRESETS["tiny-text"] = dict(PRESETS["tiny"])
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def preset_config(name: str) -> Qwen3Config:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    # rope_theta: transformers 4's keyword, which 5 still takes (into rope_parameters) but no longer
    # declares
    return Qwen3Config(
        **PRESETS[name], rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2
    )  # type: ignore[call-arg]


def train_tokenizer(vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the text in minivllm/data (deterministic: same text, same
    merges)."""
    text = (
        resources.files("minivllm")
        .joinpath("data/tokenizer_corpus.txt")
        .read_text(encoding="utf-8")
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=alphabet,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def random_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    """transformers' Qwen3 with seeded random weights, ready to save or to train."""
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    with torch.device("meta"):  # a real checkpoint's names and shapes, no memory yet
        # mypy: transformers' `to` is a functools.wraps wrapper, which mypy does not bind as a
        # method
        model = Qwen3ForCausalLM(config).to(dtype)  # type: ignore[arg-type]
    # allocate, uninitialised; this gives a tied head its own storage, so:
    model.to_empty(device="cpu")
    model.tie_weights()
    # RoPE's buffers (not saved, but a forward uses them)
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    generator = torch.Generator().manual_seed(seed)
    params = list(model.named_parameters())  # tied weights appear once
    total = sum(p.numel() for _, p in params)
    bar = tqdm(
        total=total, unit="param", unit_scale=True, desc="random weights", disable=total < 10**8
    )
    with torch.no_grad(), bar:
        for name, param in params:
            mean, std = (
                (1.0, 0.1) if name.endswith("norm.weight") else (0.0, config.initializer_range)
            )
            param.normal_(mean, std, generator=generator)
            bar.update(param.numel())
    return model


def write_checkpoint(
    out: str | Path,
    preset: str | Qwen3Config = "tiny",
    seed: int = 0,
    max_shard_size: str | int | None = None,
) -> Path:
    """Write a HuggingFace checkpoint folder: config, generation config, safetensors weights,
    tokenizer."""
    config = preset_config(preset) if isinstance(preset, str) else preset
    tokenizer = train_tokenizer()
    tokenizer.model_max_length = config.max_position_embeddings
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"vocab_size={config.vocab_size} cannot hold the tokenizer's {len(tokenizer)} tokens"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = random_model(config, seed)
    # a few hundred steps on the corpus, so that greedy output reads as text
    if preset == "tiny-text":
        train(model, corpus_ids(tokenizer), seed)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[2, 0], pad_token_id=0)
    # {}: transformers' default
    options: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **options)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    description = (
        "Write a HuggingFace checkpoint of a named preset (random weights; tiny-text "
        "trained on text)."
    )
    parser = argparse.ArgumentParser(prog="python -m minivllm.checkpoint", description=description)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = write_checkpoint(args.out, args.preset, args.seed)
    seconds = time.perf_counter() - start
    print(f"wrote {args.preset} (seed {args.seed}) to {out} in {seconds:.1f} s")


# %% [markdown]
# `python -m minivllm.checkpoint --preset tiny --out DIR` calls `write_checkpoint`, as we do. The
# safetensors header gives each tensor's name and shape, no weight read:

# %%
from safetensors import safe_open
from transformers import AutoTokenizer

from minivllm.checkpoint import preset_config, write_checkpoint

tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
files = sorted(tiny_path.iterdir())
listing = [f"{f.name} ({f.stat().st_size:,} B)" for f in files]
print(", ".join(listing))
with safe_open(tiny_path / "model.safetensors", "pt") as f:
    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
for name in [
    n for n in shapes if n.startswith("model.layers.0.") or not n.startswith("model.layers.")
]:
    print(f"{name:45} {shapes[name]}")
tokenizer = AutoTokenizer.from_pretrained(tiny_path)

# %% [markdown]
# ## Qwen3 from the layers
# A Qwen3 decoder layer is the textbook pre-norm block:
# ```
# q, k, v  = qkv_proj(input_layernorm(x))
# h        = x + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))
# gate, up = gate_up_proj(post_attention_layernorm(h))
# y        = h + down_proj(silu(gate) * up)
# ```
# Unlike Llama's, its **q/k norms** (an RMSNorm over each head's query and key before RoPE) keep
# attention scores from blowing up; **GQA** lets query heads share a key/value head; small models
# **tie** the LM head to the embedding. A batch is one flat run of tokens, prompts packed end to
# end; attention takes a *context* that says where each ends (ours: whole prompts, no cache).
# Notebook 04 adds a paged KV cache by passing another context, not another model. Names mirror
# transformers', `qkv_proj` and `gate_up_proj` packed; under `tensor_parallel(...)` layers keep
# `1/tp`.

# %% tags=["export"] module="minivllm.attention.layer"
from typing import Protocol

import torch
from torch import nn


class AttentionContext(Protocol):
    """How the layers of one forward pass attend: which tokens see which, which kernel, which KV
    cache."""

    def attend(
        self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class Attention(nn.Module):
    """Causal self-attention of one layer, over this rank's heads; the context does the
    attending."""

    k_cache: torch.Tensor  # this layer's paged KV cache, bound by the model runner (notebook 04):
    v_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_idx = head_dim**-0.5, layer_idx

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        # q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim)
        return context.attend(self, q, k, v)  # (num_tokens, num_heads, head_dim)


# %% tags=["export"] module="minivllm.attention.prefill"
from dataclasses import dataclass
from itertools import accumulate

import torch

from minivllm.attention.layer import Attention

# the package sets up Triton's CPU interpreter
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous
from minivllm.kernels.reference import attention_ref


@dataclass(slots=True)
class PrefillContext:
    """Whole prompts packed end to end, no KV cache: each token attends to its own prompt's tokens
    up to itself."""

    # (num_seqs + 1,) int32: prompt i is tokens cu_seqlens[i]:cu_seqlens[i + 1]
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def from_lens(cls, seq_lens: list[int], device: torch.device | str) -> "PrefillContext":
        return cls(
            torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32, device=device),
            max(seq_lens),
        )

    def attend(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cu, max_len, scale = self.cu_seqlens, self.max_seqlen, layer.scale
        if q.is_cuda:
            return flash_attn_varlen_contiguous(
                q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True
            )
        return attention_ref(q, k, v, cu, cu, softmax_scale=scale, causal=True)


# %% tags=["export"] module="minivllm.models.qwen3"
from typing import Any

import torch
from torch import nn

from minivllm.attention.layer import Attention, AttentionContext
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
        head_dim, heads, bias = (
            head_dim_of(config),
            config.num_attention_heads,
            config.attention_bias,
        )
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, heads, config.num_key_value_heads, bias=bias
        )
        # this rank's
        self.num_heads, self.num_kv_heads = (self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads)
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm, self.k_norm = (
            RMSNorm(head_dim, config.rms_norm_eps),
            RMSNorm(head_dim, config.rms_norm_eps),
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, layer_idx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        # positions: (num_tokens,); x: (num_tokens, hidden_size)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        # each head normalised, rotated
        q, k = self.rotary_emb(positions, q, k, norms=(self.q_norm, self.k_norm))
        # (num_tokens, num_heads, head_dim)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), context)
        return self.o_proj(o.flatten(1))  # (num_tokens, hidden_size)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"hidden_act={config.hidden_act!r} is not supported (supported: 'silu')"
            )
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (num_tokens, hidden_size)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        context: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual: (num_tokens, hidden_size)
        # the first layer (residual None): the residual stream is the embedding
        x, residual = (
            (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        )
        x = self.self_attn(positions, x, context)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        # transformers' layers >= max_window_layers would use it
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True: sliding-window attention is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # one cos/sin table, shared by every layer
        rotary_emb = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, rotary_emb, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (num_tokens, hidden_size)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, context)
        return self.norm(x, residual)[0]  # (num_tokens, hidden_size)


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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, context)  # (num_tokens, hidden_size)

    def compute_logits(
        self, hidden_states: torch.Tensor
    ) -> torch.Tensor:  # (num_tokens, hidden_size)
        return self.lm_head(hidden_states)  # (num_tokens, vocab_size)


# %%
from minivllm.models.qwen3 import Qwen3ForCausalLM

with torch.device("meta"):  # a model with shapes but no memory: building the 0.6B costs nothing
    qwen06 = Qwen3ForCausalLM(config_06 := preset_config("qwen3-0.6b"))
# the tied head is the embedding, listed once
sizes = {name: p.numel() for name, p in qwen06.named_parameters()}
total, embedding = sum(sizes.values()), sizes["model.embed_tokens.weight"]
gb = 2 * total / 1e9  # bf16: 2 bytes a parameter
share = embedding / total
print(f"{total:,} parameters ({gb:.2f} GB in bf16), {share:.0%} of them in the embedding")

# %% [markdown]
# ## Loading a checkpoint
# 1. **Read the config**: `architectures` picks our class in `MODELS`. A config.json with every
#    `CONFIG_FIELDS` value written out (by transformers 5 or 4) becomes a plain `PretrainedConfig`;
#    `AutoConfig` imports more (see the end).
# 2. **Map names**: ours are the checkpoint's but in `packed_modules_mapping` (`…q_proj` is
#    `…qkv_proj`'s `"q"`).
# 3. **Check before building**: names against the map, then every copy rehearsed on a `meta` model
#    (no memory).
# 4. **Copy** on the device; each `weight_loader` keeps this rank's slice. A tensor in two files is
#    an error.

# %% tags=["export"] module="minivllm.models.loader"
import json
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PretrainedConfig

from minivllm.layers.linear import check_shape
from minivllm.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[Qwen3ForCausalLM]] = {"Qwen3ForCausalLM": Qwen3ForCausalLM}
# the config.json fields each model reads (RoPE's aside): when all are written, no architecture
# class is imported
CONFIG_FIELDS = {
    "Qwen3ForCausalLM": tuple(
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
        "num_key_value_heads head_dim "
        "hidden_act rms_norm_eps attention_bias tie_word_embeddings max_position_embeddings".split()
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
    if not (config_file := path / "config.json").is_file():
        raise FileNotFoundError(f"{config_file} not found: a checkpoint folder needs a config.json")
    raw = read_json(config_file)
    architectures = raw.get("architectures") or []
    if not any(a in MODELS for a in architectures):
        raise ValueError(
            f"{config_file}: architectures={architectures} is not supported; supported "
            f"architectures: {sorted(MODELS)}"
        )
    if (
        "rope_parameters" not in raw
        and "rope_theta" in raw
        and raw.pop("rope_scaling", None) is None
    ):  # 4's form:
        # as AutoConfig reads it
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
    fields, rope = (
        CONFIG_FIELDS.get(next(a for a in architectures if a in MODELS), ()),
        raw.get("rope_parameters"),
    )
    if (
        fields
        and isinstance(rope, dict)
        and "rope_theta" in rope
        and all(raw.get(f) is not None for f in fields)
    ):
        # every field written out, RoPE's in transformers 5's form: no defaults
        return PretrainedConfig.from_dict(raw)
    from transformers import AutoConfig  # here, not at the top: importing its registry takes time

    # the architecture's class: its defaults and older keys understood
    return AutoConfig.from_pretrained(path)


def checkpoint_files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The files the index names, with its tensor name -> file map; with no index, every
    *.safetensors file, None."""
    index = path / INDEX_FILE
    if not index.is_file():
        if not (files := sorted(path.glob("*.safetensors"))):
            bins = (
                "; it holds PyTorch .bin weights; minivllm reads safetensors only"
                if any(path.glob("*.bin"))
                else ""
            )
            raise FileNotFoundError(f"no *.safetensors file in {path}{bins}")
        return files, None
    names = read_json(index).get("weight_map")
    if (
        not names
        or not isinstance(names, dict)
        or not all(isinstance(f, str) for f in names.values())
    ):
        raise ValueError(
            f"{index}: 'weight_map' must be a non-empty object of tensor name -> file name"
        )
    weight_map = {name: path / file for name, file in names.items()}
    files = sorted(set(weight_map.values()))
    if missing := [f.name for f in files if not f.is_file()]:
        raise FileNotFoundError(f"{index} names {missing}, missing from {path}")
    if (single := path / "model.safetensors").is_file() and single not in files:
        raise ValueError(
            f"{path} holds both {single.name} and {INDEX_FILE}, which does not name it: "
            f"transformers "
            "would load the first, vLLM the files the index names; delete the stale one"
        )
    return files, weight_map


def tensor_shapes(
    files: list[Path], weight_map: dict[str, Path] | None = None
) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the headers. Each in exactly one file, the one the index
    (if any) names."""
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                header = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
        if twice := sorted(header.keys() & owner.keys()):
            first, count = twice[0], len(twice)
            raise ValueError(
                f"tensor {first} is in both {owner[first]} and {file} ({count} tensor(s) "
                "in two files): a stray old shard? Keep one copy"
            )
        shapes |= header
        owner |= dict.fromkeys(header, file)
    for name, file in (weight_map or {}).items():
        if owner.get(name) != file:
            where = f"it is in {owner[name]}" if name in owner else "no file holds it"
            raise ValueError(
                f"{file.parent / INDEX_FILE} puts tensor {name} in {file.name}, but {where}"
            )
    return shapes


def checkpoint_names(model: Qwen3ForCausalLM) -> dict[str, tuple[str, ShardId]]:
    """Checkpoint tensor name -> (our parameter name, shard id), for every tensor the model
    needs."""
    sources: dict[str, list[tuple[str, str | int]]] = {}
    for hf_module, (ours, shard_id) in model.packed_modules_mapping.items():
        sources.setdefault(ours, []).append((hf_module, shard_id))
    names: dict[str, tuple[str, ShardId]] = {}
    for name, _ in model.named_parameters():  # a tied lm_head is not listed: it is the embedding
        parts = name.split(".")
        if (i := next((i for i, part in enumerate(parts) if part in sources), None)) is None:
            names[name] = (name, None)
            continue
        for hf_module, shard_id in sources[parts[i]]:
            hf_name = ".".join([*parts[:i], hf_module, *parts[i + 1 :]])
            names[hf_name] = (name, shard_id)
    return names


def is_ignored(name: str, config: PretrainedConfig) -> bool:
    """Tensors a checkpoint may hold that the model does not need."""
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and config.tie_word_embeddings
    )


def load_tensor(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
    """Copy a checkpoint tensor into param through its weight_loader (this rank's slice; shard_id:
    which part)."""
    loader: Callable[..., None] | None = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, loaded, *([] if shard_id is None else [shard_id]))
    else:  # a plain parameter: the whole tensor
        check_shape("parameter", loaded, tuple(param.shape))
        param.data.copy_(loaded)


def check_checkpoint(
    model: Qwen3ForCausalLM, shapes: dict[str, tuple[int, ...]], config: PretrainedConfig
) -> None:
    """Raise if the checkpoint lacks a tensor, has one too many, or has one of the wrong shape."""
    needed = checkpoint_names(model)
    present = {name for name in shapes if not is_ignored(name, config)}
    for names, problem in (
        (needed.keys() - present, "is missing {}"),
        (present - needed.keys(), "has {} unexpected"),
    ):
        if names:
            first_five = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(f"checkpoint {problem.format(len(names))} tensor(s): {first_five}")
    params = dict(model.named_parameters())
    # rehearse each copy on the meta device: the loaders' own shape checks
    for name in sorted(present):
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


def resolve_dtype(
    dtype: torch.dtype | str, config: PretrainedConfig, device: torch.device
) -> torch.dtype:
    """ "auto": the checkpoint's dtype on a GPU, float32 on a CPU."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = (
            getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        )
    if isinstance(dtype, str):
        # or None, or not a dtype: refused below
        dtype = cast(torch.dtype, getattr(torch, dtype, None))
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"dtype must be 'auto', torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
        )
    return dtype


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    config: PretrainedConfig | None = None,
) -> Qwen3ForCausalLM:
    """Build the model a checkpoint folder describes, with its weights (this rank's slice); `config`
    if read already."""
    path, device = Path(path), torch.device(device)
    config = config or read_config(path)
    files, weight_map = checkpoint_files(path)
    shapes = tensor_shapes(files, weight_map)
    dtype = resolve_dtype(dtype, config, device)
    # read_config checked there is one
    model_class = MODELS[next(a for a in config.architectures or [] if a in MODELS)]
    with torch.device("meta"):  # every check runs on a model that holds no memory
        check_checkpoint(model_class(config), shapes, config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the model is made in dtype, on the device
    try:
        with device:
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, files, config)
    return model.eval()


# %% [markdown]
# The map for one layer (its keys are exactly the checkpoint's tensors); then two broken copies,
# failing early:

# %%
from minivllm import load_model
from minivllm.models.loader import checkpoint_names
from minivllm.testing import edited_copy

with torch.device("meta"):
    names = checkpoint_names(Qwen3ForCausalLM(preset_config("tiny")))
assert names.keys() == shapes.keys()
for hf_name in [n for n in names if n.startswith("model.layers.0.") and "proj" in n]:
    print(f"{hf_name:40} -> {names[hf_name]}")
breaks = {
    "missing tensor": dict(tensors_edit=lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")),
    "shape mismatch": dict(
        tensors_edit=lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(9, 9)})
    ),
}
with tempfile.TemporaryDirectory() as tmp:
    for case, edit in breaks.items():
        try:
            load_model(edited_copy(tiny_path, Path(tmp) / case, **edit))
            raise AssertionError(f"{case}: loaded without an error")
        except ValueError as e:
            print(f"{case:>20}: {e}")

# %% [markdown]
# ## Parity with transformers
# The same prompts through both in float32, logits compared at every position (16, 256: KV block
# sizes to come); this one-prompt forward, `minivllm.testing.prompt_logits`, is the oracle of every
# cached path of notebooks 03–05. Two prompts packed in one batch get each its own logits; with
# trained weights (`tiny-text`), the forward writes text.

# %%
from transformers import AutoModelForCausalLM

from minivllm.attention.prefill import PrefillContext
from minivllm.testing import prompt_logits

model = load_model(tiny_path, dtype=torch.float32, device=DEVICE)
hf_model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).to(DEVICE)
text_ids = tokenizer.encode(
    resources.files("minivllm").joinpath("data/tokenizer_corpus.txt").read_text()
)
for n in (1, 15, 16, 17, 255, 256, 257, 700):
    ours = prompt_logits(model, text_ids[:n])  # (n, vocab_size)
    with torch.no_grad():
        ref = hf_model(torch.tensor([text_ids[:n]], device=DEVICE)).logits[0]
    max_diff = (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)) and max_diff < 1e-4, n
    print(f"{n:4} tokens: max |logit difference| {max_diff:.1e}, the same argmax everywhere")
a, b = text_ids[:40], text_ids[100:163]
input_ids, positions = (
    torch.tensor(a + b, device=DEVICE),
    torch.tensor([*range(len(a)), *range(len(b))], device=DEVICE),
)
with torch.inference_mode():
    packed = model.compute_logits(
        model(input_ids, positions, PrefillContext.from_lens([len(a), len(b)], DEVICE))
    )
torch.testing.assert_close(
    packed, torch.cat([prompt_logits(model, a), prompt_logits(model, b)]), rtol=1e-5, atol=1e-5
)
text_path = CHECKPOINTS / "tiny-text"
if not (text_path / "model.safetensors").is_file():  # trained once (half a minute), then kept
    write_checkpoint(text_path, "tiny-text", seed=0)
text_model = load_model(text_path, dtype=torch.float32, device=DEVICE)
token_ids = tokenizer.encode("The Earth is about")
for _ in range(24):  # greedy, with no KV cache yet: the whole text again for every new token
    token_ids.append(int(prompt_logits(text_model, token_ids)[-1].argmax()))
print(repr(tokenizer.decode(token_ids)))

# %% [markdown]
# **Tensor parallelism** needs nothing more (`tests/test_model.py`: TP=2 gives TP=1's logits). **In
# bfloat16** (8 significant bits) two correct implementations round differently, far above float32's
# 1e-7. Rounding or a bug? If ours is as close to float32 as transformers' own bfloat16 is, it is
# rounding (`python -m minivllm.checks.model_parity`).

# %%
ids = torch.tensor([text_ids[:1000]], device=DEVICE)
with torch.no_grad():
    fp32 = hf_model(ids).logits[0]
    theirs = (
        AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.bfloat16)
        .to(DEVICE)(ids)
        .logits[0]
    )
ours = prompt_logits(load_model(tiny_path, dtype=torch.bfloat16, device=DEVICE), text_ids[:1000])
bf16 = {"ours": ours.float(), "theirs": theirs.float()}
gap = {name: (logits - fp32).abs().mean().item() for name, logits in bf16.items()}
same = {
    name: (logits.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    for name, logits in bf16.items()
}
print(
    {
        name: f"mean |bf16 - fp32 logit| {gap[name]:.4f}, the same top-1 at {same[name]:.1%}"
        for name in bf16
    }
)
assert gap["ours"] <= 1.5 * gap["theirs"] and same["ours"] >= same["theirs"] - 0.02

# %% [markdown]
# ## The engine's settings
# One dataclass holds the settings of the runner (04), the scheduler (05) and the engine (06):
# vLLM's names and defaults, checked before anything is built. A `None` is resolved here
# (`max_model_len` from the checkpoint, `device` from the machine), so each field holds its declared
# type. `model` may be a Hub id, resolved as vLLM does (`hub.py`).

# %% tags=["export"] module="minivllm.config"
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minivllm.models.hub import TOKENIZER_FILES, resolve_model
from minivllm.models.loader import read_config


@dataclass(slots=True)
class Config:
    model: str | Path  # a HuggingFace checkpoint folder or a Hub id ("Qwen/Qwen3-0.6B")
    tensor_parallel_size: int = 1
    dtype: str | torch.dtype = "auto"  # the checkpoint's dtype on a GPU, float32 on a CPU
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences in one batch at most
    max_num_batched_tokens: int = 16384  # new tokens in one prefill step at most
    # prompt + completion tokens; None: the context length
    max_model_len: int = None  # type: ignore[assignment]
    num_kvcache_blocks: int | None = (
        None  # None: as many as gpu_memory_utilization allows (on a CPU: see below)
    )
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # True: no CUDA graphs
    enable_prefix_caching: bool = True
    scheduling_policy: str = (
        "unified"  # "unified": mixed prefill + decode steps (vLLM v1); or "prefill-first"
    )
    # schedule while a step runs (06); None: on 1 GPU
    async_scheduling: bool = None  # type: ignore[assignment]
    seed: int = 0
    device: str = None  # type: ignore[assignment]  # None: cuda if available, else cpu
    # a folder or a Hub id; None: the model's
    tokenizer: str | Path = None  # type: ignore[assignment]
    revision: str | None = None  # the model's Hub branch, tag or commit; None: main
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # the Hub cache to use; None: HF_HUB_CACHE
    hf_config: Any = field(init=False, repr=False)

    def __post_init__(self):
        # a folder, or a Hub id's snapshot
        self.model = resolve_model(self.model, self.revision, self.download_dir)
        self.tokenizer = self.model if self.tokenizer is None else self.tokenizer
        self.tokenizer = resolve_model(
            self.tokenizer, self.tokenizer_revision, self.download_dir, TOKENIZER_FILES
        )
        self.hf_config = read_config(self.model)  # FileNotFoundError / ValueError for a bad folder
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        context_len = self.hf_config.max_position_embeddings
        self.max_model_len = context_len if self.max_model_len is None else self.max_model_len
        if self.async_scheduling is None:
            self.async_scheduling = self.device == "cuda" and self.tensor_parallel_size == 1
        # the GPUs tensor parallelism uses
        gpus = torch.cuda.device_count() if self.device == "cuda" else float("inf")
        checks = [
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
            ("block_size", self.block_size in (16, 32, 64, 128, 256), "16, 32, 64, 128 or 256"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            (
                "max_model_len",
                1 <= self.max_model_len <= context_len,
                f"in [1, {context_len}], the context length",
            ),
            (
                "num_kvcache_blocks",
                self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
                "None or >= 1",
            ),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
            ("device", self.device in ("cpu", "cuda"), "'cpu' or 'cuda'"),
            (
                "scheduling_policy",
                self.scheduling_policy in ("unified", "prefill-first"),
                "unified or prefill-first",
            ),
            (
                "async_scheduling",
                not (self.async_scheduling and self.tensor_parallel_size > 1),
                "off under TP",
            ),
            (
                "tensor_parallel_size",
                self.tensor_parallel_size <= gpus,
                f"<= {gpus} (the GPUs present)",
            ),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")


# %%
from minivllm.config import Config

print(Config(tiny_path))
try:
    Config(tiny_path, block_size=24)
except ValueError as e:
    print(e)

# %% [markdown]
# ## Sampling parameters
# How a request picks each next token (notebook 04's sampler), and when it stops. A bad value is
# refused when the request is made, naming the field: in the sampler, a NaN (or a value float32
# cannot hold) makes garbage tokens with no error. As in vLLM, a temperature below `1e-5` is greedy
# (`0`): dividing logits by it would overflow float32.

# %% tags=["export"] module="minivllm.sampling_params"
import math
from dataclasses import dataclass, field
from typing import Any

GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # the most log-probabilities a token may ask for (vLLM's default max_logprobs)
PLAIN = {
    int: ((int,), "an int"),
    float: ((int, float), "a real number"),
    bool: ((bool,), "True or False"),
}


def scalar(value):
    """A NumPy or PyTorch 0-d value as the Python number it holds; anything else unchanged."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def as_plain(value, name: str, kind: type[int] | type[float] | type[bool]) -> Any:
    """value as a Python int, a finite float or a bool (Python, NumPy or PyTorch scalars);
    ValueError if not."""
    number, (allowed, what) = scalar(value), PLAIN[kind]
    # True is an int too
    if not isinstance(number, allowed) or (isinstance(number, bool) and kind is not bool):
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    if kind is float and not math.isfinite(number):  # ints too: float(10**400) would overflow
        raise ValueError(f"{name} must be finite, got {number}")
    return kind(number)


def as_token_ids(value, name: str) -> list[int]:
    """A list or tuple of ints, or a 1-D integer NumPy array or PyTorch tensor, as a new list of
    Python ints."""
    if getattr(value, "ndim", 1) != 1:
        raise ValueError(f"{name} must be 1-D token ids, got shape {tuple(value.shape)}")
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        value = value.tolist()  # a float or bool array gives floats or bools, refused below
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of int token ids, got {type(value).__name__}")
    if all(type(t) is int for t in value):  # the common case, fast
        return list(value)
    return [as_plain(t, f"{name}[{i}]", int) for i, t in enumerate(value)]


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of a request, and when to stop: vLLM's names and defaults,
    checked."""

    temperature: float = 1.0  # 0 is greedy; below 1e-5 is stored as 0
    top_p: float = 1.0  # keep the most likely tokens whose probabilities add up to top_p
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per time a token is already in the output
    repetition_penalty: float = (
        1.0  # divides positive logits (multiplies negative ones) of prompt and output tokens
    )
    max_tokens: int = 16  # completion tokens at most
    min_tokens: int = 0  # completion tokens before an end-of-sequence or stop token may be drawn
    ignore_eos: bool = False  # keep going after the end-of-sequence token
    seed: int | None = None  # per-request random seed; None draws from the engine's generator
    # extra tokens that finish the request (None: none)
    stop_token_ids: list[int] = field(default_factory=list)
    # strings that finish the request when in the text (None: none)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    # completions of the prompt (they share its KV blocks); with a seed, completion i uses seed + i
    n: int = 1
    logprobs: int | None = (
        None  # per completion token: its log-probability, and this many most likely tokens'
    )
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    def __post_init__(self):
        self.convert()
        checks = {  # field: (its value is allowed, what is)
            "max_tokens": (self.max_tokens >= 1, ">= 1"),
            "min_tokens": (
                0 <= self.min_tokens <= self.max_tokens,
                f"in [0, max_tokens={self.max_tokens}]",
            ),
            "temperature": (self.temperature >= 0, ">= 0 (0 is greedy)"),
            "top_p": (
                2.0**-126 <= self.top_p <= 1,
                "in (0, 1] and >= 2**-126 (float32's smallest normal number)",
            ),
            "top_k": (self.top_k == -1 or 1 <= self.top_k < 2**63, "-1 (off) or in [1, 2**63)"),
            "min_p": (0 <= self.min_p <= 1, "in [0, 1]"),
            "presence_penalty": (-2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            "frequency_penalty": (-2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            "repetition_penalty": (
                1e-6 <= self.repetition_penalty <= 1e6,
                "in [1e-6, 1e6] (1 is off)",
            ),
            "stop_token_ids": (all(t >= 0 for t in self.stop_token_ids), "token ids >= 0"),
            "stop": (all(isinstance(x, str) and x for x in self.stop), "non-empty strings"),
            "n": (self.n >= 1, ">= 1"),
            "logprobs": (
                0 <= (self.logprobs or 0) <= MAX_LOGPROBS,
                f"None or in [0, {MAX_LOGPROBS}]",
            ),
            "prompt_logprobs": (
                0 <= (self.prompt_logprobs or 0) <= MAX_LOGPROBS,
                f"None or in [0, {MAX_LOGPROBS}]",
            ),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = (
                0.0  # greedy: dividing logits by it in float32 would overflow to inf, then NaN
            )

    def convert(self) -> None:
        """Every field as a plain Python value of its type (our own copies); ValueError naming a
        field that is not."""
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            setattr(self, name, as_plain(getattr(self, name), name, float))
        for name in ("top_k", "max_tokens", "min_tokens", "n"):
            setattr(self, name, as_plain(getattr(self, name), name, int))
        for name in ("seed", "logprobs", "prompt_logprobs"):  # None, or an int
            setattr(
                self,
                name,
                None if getattr(self, name) is None else as_plain(getattr(self, name), name, int),
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            setattr(self, name, as_plain(getattr(self, name), name, bool))
        self.stop_token_ids = (
            []
            if self.stop_token_ids is None
            else as_token_ids(self.stop_token_ids, "stop_token_ids")
        )
        if not isinstance(self.stop, str | list | tuple | None):
            raise ValueError(
                f"stop must be a str or a list of str, got {self.stop!r} "
                f"({type(self.stop).__name__})"
            )
        # a str: one string
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


# %%
from minivllm.sampling_params import SamplingParams

print(SamplingParams(temperature=1e-6, stop_token_ids=None), torch.tensor(10.0) / 1e-45)
for bad in [
    dict(max_tokens=2.0),
    dict(temperature=float("nan")),
    dict(top_p=1e-300),
    dict(stop_token_ids=[[1]]),
]:
    try:
        SamplingParams(**bad)
        raise AssertionError(f"accepted {bad}")
    except ValueError as e:
        print(e)

# %% [markdown]
# ## How fast
# Start-up: `read_config` timed in a fresh Python, with the modules it imports counted (both depend
# on the transformers installed, the time on this machine too): a config.json in full, in the Hub's
# 4.x form, then with a field left out.

# %%
probe = """import sys, time
from pathlib import Path
from minivllm.models.loader import read_config
before, start = len(sys.modules), time.perf_counter()
config = read_config(Path(sys.argv[1]))
seconds, imported = time.perf_counter() - start, len(sys.modules) - before
print(f"{type(config).__name__}: {seconds:.2f} s, {imported} modules imported")"""
# the Hub's Qwen3 form
rope_4 = lambda c: c.update(rope_theta=c.pop("rope_parameters")["rope_theta"])
# no_bias: Qwen3Config's default
edits = {"rope_theta": rope_4, "no_bias": lambda c: c.pop("attention_bias")}
with tempfile.TemporaryDirectory() as tmp:
    for path in (
        tiny_path,
        *(edited_copy(tiny_path, Path(tmp) / n, config_edit=e) for n, e in edits.items()),
    ):
        run = subprocess.run(
            [sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=True
        )
        print(f"{path.name:>10}: {run.stdout.strip()}")

# %% [markdown]
# ## Check yourself
# Set each `answerN` (by hand, or computed) and run its cell: it compares your answer with the
# model's shapes. The worked answer follows.
#
# **1.** Split Qwen3-0.6B over 2 ranks: how many rows does `qkv_proj.weight` have on each? Answer a
# list, one per rank.

# %%
from minivllm.layers.linear import TPGroup, tensor_parallel
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
qkv_rows = []
for rank in range(2):
    # rank's model: shapes, no memory
    with torch.device("meta"), tensor_parallel(TPGroup(rank=rank, size=2)):
        qkv_rows.append(
            Qwen3ForCausalLM(config_06).model.layers[0].self_attn.qkv_proj.weight.shape[0]
        )
check_answer(answer1, qkv_rows, "1. qkv rows")

# %% [markdown]
# Worked answer: each rank keeps half the 16 query heads and half the 8 KV heads, the latter once
# for K and once for V, each head 128 rows: (16 + 2 × 8) × 128 / 2 = 2,048 rows of the full 4,096.

# %%
check_answer([(16 + 2 * 8) * 128 // 2] * 2, qkv_rows, "1. qkv rows")

# %% [markdown]
# **2.** How many parameters does one decoder layer of Qwen3-0.6B hold? Its sizes: hidden 1,024, 16
# query heads and 8 KV heads of 128, MLP 3,072, no biases. Count every matrix and every norm.

# %%
answer2 = None  # your answer: replace None with an expression
layer_params = sum(p.numel() for p in qwen06.model.layers[0].parameters())  # the meta model above
check_answer(answer2, layer_params, "2. layer parameters")

# %% [markdown]
# Worked answer: attention is `qkv_proj` (16 + 2 × 8) × 128 rows of 1,024 and `o_proj` 1,024 rows of
# 16 × 128; the MLP is three matrices of 3,072 × 1,024 (gate, up, down); the norms are `q_norm` and
# `k_norm` (128 each) and the two layer norms (1,024 each). 15.7 M parameters: 28 layers make 440 M,
# and the embedding most of the rest.

# %%
attention = (16 + 2 * 8) * 128 * 1024 + 1024 * 16 * 128
check_answer(attention + 3 * 3072 * 1024 + 2 * 128 + 2 * 1024, layer_params, "2. layer parameters")

# %% [markdown]
# **Exercise.** `exercises/02_llama.ipynb`: write `LlamaForCausalLM` from the same layers (no q/k
# norms), register it in `MODELS`, and check it against transformers' Llama on a random checkpoint.
