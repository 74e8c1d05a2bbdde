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
# Notebook 01's layers become Qwen3, filled from a HuggingFace checkpoint folder; two dataclasses
# hold the engine's settings and a request's. The oracle: transformers' Qwen3 gives the same logits.

# %%
import os
import time
from importlib import resources
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # transformers' loading draws no progress bars in the outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../build/checkpoints")).resolve()

# %% [markdown]
# ## A checkpoint
# A HuggingFace checkpoint is a folder: `config.json` (architecture, sizes), `model.safetensors`
# (a header of names and shapes, then the tensors; or shards listed in
# `model.safetensors.index.json`) and the tokenizer. With no network, transformers writes ours
# (`python -m minivllm.checkpoint`, a tool): `tiny` is Qwen3 at laptop size, random weights.

# %%
from safetensors import safe_open
from transformers import AutoTokenizer

from minivllm.checkpoint import preset_config, write_checkpoint

tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)
print(", ".join(f.name for f in sorted(tiny_path.iterdir())))
with safe_open(tiny_path / "model.safetensors", "pt") as f:
    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
for name in [n for n in shapes if n.startswith("model.layers.0.") or "layers" not in n]:
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
# Its **q/k norms** (RMSNorm per head) keep attention scores from blowing up; **GQA** lets query
# heads share a key/value head; small models **tie** the LM head to the embedding. A batch is one
# flat run of tokens, prompts end to end; attention takes a *context* saying where each ends
# (notebook 04 passes one with a paged KV cache). `qkv_proj` and `gate_up_proj` are packed.

# %% tags=["export"] module="minivllm.attention.layer"
from typing import Protocol

from torch import Tensor, nn


class AttentionContext(Protocol):
    """How one forward pass attends: which tokens see which, with which kernel and KV cache."""

    def attend(self, layer: "Attention", q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class Attention(nn.Module):
    """Causal self-attention of one layer, over this rank's heads; the context attends."""

    k_cache: Tensor  # this layer's paged KV cache, bound by the model runner (notebook 04):
    v_cache: Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_idx = head_dim**-0.5, layer_idx

    def forward(self, q: Tensor, k: Tensor, v: Tensor, context: AttentionContext) -> Tensor:
        # q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim)
        return context.attend(self, q, k, v)  # (num_tokens, num_heads, head_dim)


# %% tags=["export"] module="minivllm.attention.prefill"
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from minivllm.attention.layer import Attention
from minivllm.kernels.flash_attn import flash_attn_varlen_contiguous
from minivllm.kernels.reference import attention_ref


@dataclass(slots=True)
class PrefillContext:
    """Whole prompts packed end to end, no KV cache: a token sees its prompt up to itself."""

    cu_seqlens: Tensor  # (num_seqs + 1,) int32: prompt i is tokens cu_seqlens[i]:[i + 1]
    max_seqlen: int

    @classmethod
    def from_lens(cls, seq_lens: list[int], device: torch.device | str) -> "PrefillContext":
        cu_seqlens = torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32, device=device)
        return cls(cu_seqlens, max(seq_lens))

    def attend(self, layer: Attention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cu, max_len, scale = self.cu_seqlens, self.max_seqlen, layer.scale
        if q.is_cuda:
            return flash_attn_varlen_contiguous(
                q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True
            )
        return attention_ref(q, k, v, cu, cu, softmax_scale=scale, causal=True)


# %% tags=["export"] module="minivllm.models.qwen3"
from typing import Any

from torch import Tensor, nn

from minivllm.attention.layer import Attention, AttentionContext
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary_embedding import RotaryEmbedding, get_rope


class Qwen3Attention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        hidden, head_dim, bias = config.hidden_size, config.head_dim, config.attention_bias
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=bias)
        # this rank's heads: all of them, but under tensor parallelism
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, layer_idx)

    def forward(self, positions: Tensor, x: Tensor, context: AttentionContext) -> Tensor:
        # positions: (num_tokens,); x: (num_tokens, hidden_size)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, norms=(self.q_norm, self.k_norm))  # normed, rotated
        o = self.attn(q, k, v, context)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(o.flatten(1))  # (num_tokens, hidden_size)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2)
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:  # x: (num_tokens, hidden_size)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: Tensor, x: Tensor, residual: Tensor | None, context: AttentionContext
    ) -> tuple[Tensor, Tensor]:  # x, residual: (num_tokens, hidden_size)
        if residual is None:  # the first layer: the residual stream is the embedding
            x, residual = self.input_layernorm(x), x
        else:  # adds x to the residual stream, then normalises it
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, context)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True: sliding-window attention is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(config, config.head_dim)  # one cos/sin table for every layer
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, rotary_emb, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, context: AttentionContext) -> Tensor:
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

    def forward(self, input_ids: Tensor, positions: Tensor, context: AttentionContext) -> Tensor:
        return self.model(input_ids, positions, context)  # (num_tokens, hidden_size)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:  # (num_tokens, hidden_size)
        return self.lm_head(hidden_states)  # (num_tokens, vocab_size)


# %% [markdown]
# On the `meta` device a module has shapes but no memory: Qwen3-0.6B costs nothing to build.

# %%
from minivllm.models.qwen3 import Qwen3ForCausalLM

with torch.device("meta"):
    qwen06 = Qwen3ForCausalLM(config_06 := preset_config("qwen3-0.6b"))
sizes = {name: p.numel() for name, p in qwen06.named_parameters()}  # the tied head listed once
total = sum(sizes.values())
gb, share = 2 * total / 1e9, sizes["model.embed_tokens.weight"] / total  # bf16: 2 bytes each
print(f"{total:,} parameters, {gb:.2f} GB in bf16, {share:.0%} of them in the embedding")

# %% [markdown]
# ## Loading a checkpoint
# 1. **Read the config** (transformers' `AutoConfig`): `architectures` picks our class in `MODELS`.
# 2. **Map names**: ours are the checkpoint's, but for the packed modules (`…q_proj` is
#    `…qkv_proj`'s shard `"q"`).
# 3. **Copy** each tensor through its parameter's `weight_loader` (it checks the shape); a tensor
#    unexpected, misshapen or missing is named (the deep dive `checkpoints` shows each).

# %% tags=["export"] module="minivllm.models.loader"
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from minivllm.layers.linear import check_shape
from minivllm.models.qwen3 import Qwen3ForCausalLM

Models = dict[str, type[Qwen3ForCausalLM]]  # config.json's architecture -> our class
MODELS: Models = {"Qwen3ForCausalLM": Qwen3ForCausalLM}
ShardId = str | int | None  # which part of a packed parameter: "q", "k", "v", 0, 1; None: whole


def model_class(architectures: list[str] | None, models: Models = MODELS) -> type[Qwen3ForCausalLM]:
    """Our class for the first of `architectures` in `models`; else a ValueError naming both."""
    for name in architectures or []:
        if name in models:
            return models[name]
    supported = f"supported architectures: {sorted(models)}"
    raise ValueError(f"architectures={architectures} is not supported; {supported}")


def read_config(path: Path, models: Models = MODELS) -> PretrainedConfig:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} not found: a checkpoint folder has one")
    config = AutoConfig.from_pretrained(path)
    model_class(config.architectures, models)  # refused here, before any weight is read
    return config


def checkpoint_files(path: Path) -> list[Path]:
    """The shards the index names (tensor name -> file), else every safetensors file there."""
    if (index := path / "model.safetensors.index.json").is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / file for file in weight_map.values()})
    if not (files := sorted(path.glob("*.safetensors"))):
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    return files


def checkpoint_names(model: Qwen3ForCausalLM) -> dict[str, tuple[str, ShardId]]:
    """Checkpoint tensor name -> (our parameter's name, shard id), for every tensor needed."""
    packed: dict[str, list[tuple[str, ShardId]]] = {}  # our module -> the checkpoint's modules
    for hf_module, (ours, part) in model.packed_modules_mapping.items():
        packed.setdefault(ours, []).append((hf_module, part))
    names: dict[str, tuple[str, ShardId]] = {}
    for name, _ in model.named_parameters():  # a tied lm_head is not listed: it is the embedding
        *prefix, module, kind = name.split(".")  # [model, layers, 0, mlp], gate_up_proj, weight
        for hf_module, shard_id in packed.get(module, [(module, None)]):
            names[".".join([*prefix, hf_module, kind])] = (name, shard_id)
    return names


def load_tensor(param: nn.Parameter, loaded: Tensor, shard_id: ShardId) -> None:
    """Copy a checkpoint tensor into param, through its weight_loader (this rank's slice)."""
    if (weight_loader := getattr(param, "weight_loader", None)) is not None:
        weight_loader(param, loaded, *([] if shard_id is None else [shard_id]))
    else:  # a plain parameter: the whole tensor
        check_shape("parameter", loaded, tuple(param.shape))
        param.data.copy_(loaded)


def load_weights(model: Qwen3ForCausalLM, files: list[Path]) -> None:
    needed, params, loaded = checkpoint_names(model), dict(model.named_parameters()), set()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # the embedding's copy
    for file in files:
        with safe_open(file, "pt") as f:
            for name in set(f.keys()) - tied:
                if name not in needed:
                    raise ValueError(f"checkpoint has an unexpected tensor: {name}")
                param_name, shard_id = needed[name]
                try:
                    load_tensor(params[param_name], f.get_tensor(name), shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name}: {e}") from None
                loaded.add(name)
    if missing := sorted(needed.keys() - loaded):
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:5]}")


def resolve_dtype(dtype: torch.dtype | str, config: Any, device: torch.device) -> torch.dtype:
    """ "auto": the checkpoint's dtype on a GPU, float32 on a CPU."""
    if dtype == "auto":  # transformers 4 called it torch_dtype
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = saved if saved and device.type != "cpu" else torch.float32
    if isinstance(dtype, str):  # "bfloat16": torch.bfloat16
        dtype = getattr(torch, dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be 'auto', float32, bfloat16 or float16, got {dtype}")
    return dtype


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = "auto",
    device: Any = "cpu",
    config: Any = None,
    models: Models = MODELS,
) -> Qwen3ForCausalLM:
    """The model a checkpoint folder describes, with its weights; `config` if read already;
    `models`: the architectures to choose from (a deep dive passes more)."""
    path, device = Path(path), torch.device(device)
    config = config or read_config(path, models)
    files, dtype = checkpoint_files(path), resolve_dtype(dtype, config, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the model is made in dtype, on the device
    try:
        with device:
            model = model_class(config.architectures, models)(config)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, files)
    return model.eval()


# %% [markdown]
# The map for one layer's projections; it names every tensor of the checkpoint:

# %%
from minivllm.models.loader import checkpoint_names

with torch.device("meta"):
    names = checkpoint_names(Qwen3ForCausalLM(preset_config("tiny")))
assert names.keys() == shapes.keys()
for hf_name in [n for n in names if n.startswith("model.layers.0.") and "proj" in n]:
    print(f"{hf_name:40} -> {names[hf_name]}")

# %% [markdown]
# ## Parity with transformers
# Float32 logits at every position, for lengths around the KV block sizes to come (16, 256). This
# forward of one prompt, `minivllm.testing.prompt_logits`, is the oracle of notebooks 03–05. Two
# prompts packed in one batch each get their own logits.

# %%
from transformers import AutoModelForCausalLM

from minivllm import load_model
from minivllm.attention.prefill import PrefillContext
from minivllm.testing import prompt_logits

model = load_model(tiny_path, dtype=torch.float32, device=DEVICE)
hf_model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).to(DEVICE)
corpus = resources.files("minivllm").joinpath("data/tokenizer_corpus.txt").read_text()
text_ids = tokenizer.encode(corpus)
for n in (1, 15, 16, 17, 255, 256, 257, 700):
    ours = prompt_logits(model, text_ids[:n])  # (n, vocab_size)
    with torch.no_grad():
        ref = hf_model(torch.tensor([text_ids[:n]], device=DEVICE)).logits[0]
    max_diff = (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)) and max_diff < 1e-4, n
    print(f"{n:4} tokens: max |logit difference| {max_diff:.1e}, the same argmax everywhere")
a, b = text_ids[:40], text_ids[100:163]
input_ids = torch.tensor(a + b, device=DEVICE)
positions = torch.tensor([*range(len(a)), *range(len(b))], device=DEVICE)
with torch.inference_mode():
    hidden = model(input_ids, positions, PrefillContext.from_lens([len(a), len(b)], DEVICE))
    packed = model.compute_logits(hidden)  # (len(a) + len(b), vocab_size)
expected = torch.cat([prompt_logits(model, a), prompt_logits(model, b)])
torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)

# %% [markdown]
# `tiny-text` is `tiny` trained on a corpus (once, then kept): greedy decoding writes text.

# %%
text_path = CHECKPOINTS / "tiny-text"
if not (text_path / "model.safetensors").is_file():  # trained once, then kept
    write_checkpoint(text_path, "tiny-text", seed=0)
text_model = load_model(text_path, dtype=torch.float32, device=DEVICE)
token_ids = tokenizer.encode("The Earth is about")
for _ in range(24):
    token_ids.append(int(prompt_logits(text_model, token_ids)[-1].argmax()))
print(repr(tokenizer.decode(token_ids)))

# %% [markdown]
# ## The engine's settings
# For the runner (04), the scheduler (05) and the engine (06): vLLM's names and defaults, checked
# before anything is built; a `None` is resolved here. `model` may be a Hub id (`models/hub.py`).
# The deep dive `settings` runs both dataclasses of this notebook, value by value.

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
    max_num_batched_tokens: int = 16384  # new tokens in one step at most
    max_model_len: int = None  # type: ignore[assignment]  # prompt + completion; None: the model's
    num_kvcache_blocks: int | None = None  # None: as many as gpu_memory_utilization allows
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # True: no CUDA graphs
    enable_prefix_caching: bool = True
    scheduling_policy: str = "unified"  # mixed prefill + decode steps (vLLM v1); or prefill-first
    async_scheduling: bool = None  # type: ignore[assignment]  # schedule while a step runs
    seed: int = 0
    device: str = None  # type: ignore[assignment]  # None: cuda if available, else cpu
    tokenizer: str | Path = None  # type: ignore[assignment]  # a folder or a Hub id; None: model's
    revision: str | None = None  # the model's Hub branch, tag or commit; None: main
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # the Hub cache to use; None: HF_HUB_CACHE
    hf_config: Any = field(init=False, repr=False)

    def read_hf_config(self) -> Any:
        return read_config(Path(self.model))  # transformers' AutoConfig, checked

    def __post_init__(self):
        self.model = resolve_model(self.model, self.revision, self.download_dir)  # a folder
        tokenizer, revision = self.tokenizer or self.model, self.tokenizer_revision
        self.tokenizer = resolve_model(tokenizer, revision, self.download_dir, TOKENIZER_FILES)
        self.hf_config = self.read_hf_config()
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        context_len = self.hf_config.max_position_embeddings
        self.max_model_len = context_len if self.max_model_len is None else self.max_model_len
        if self.async_scheduling is None:  # on by default on one GPU (notebook 06)
            self.async_scheduling = self.device == "cuda" and self.tensor_parallel_size == 1
        gpus = torch.cuda.device_count() if self.device == "cuda" else float("inf")
        tp, blocks = self.tensor_parallel_size, self.num_kvcache_blocks
        policies = ("unified", "prefill-first")
        checks = {  # field: (its value is allowed, what is)
            "tensor_parallel_size": (1 <= tp <= gpus, f"in [1, {gpus}], the GPUs present"),
            "block_size": (self.block_size in (16, 32, 64, 128, 256), "16, 32, 64, 128 or 256"),
            "max_num_seqs": (self.max_num_seqs >= 1, ">= 1"),
            "max_num_batched_tokens": (self.max_num_batched_tokens >= 1, ">= 1"),
            "max_model_len": (1 <= self.max_model_len <= context_len, f"in [1, {context_len}]"),
            "num_kvcache_blocks": (blocks is None or blocks >= 1, "None or >= 1"),
            "gpu_memory_utilization": (0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
            "device": (self.device in ("cpu", "cuda"), "'cpu' or 'cuda'"),
            "scheduling_policy": (self.scheduling_policy in policies, " or ".join(policies)),
            "async_scheduling": (not self.async_scheduling or tp == 1, "off under TP"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")


# %% [markdown]
# ## Sampling parameters
# How a request picks each next token (notebook 04), and when it stops. A bad value is refused
# here, by name: in the sampler, a NaN would make garbage tokens and no error.

# %% tags=["export"] module="minivllm.sampling_params"
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # the most log-probabilities a token may ask for (vLLM's default max_logprobs)
FLOATS = "temperature top_p min_p presence_penalty frequency_penalty repetition_penalty".split()
INTS = ["top_k", "max_tokens", "min_tokens", "n"]
OPTIONAL_INTS = ["seed", "logprobs", "prompt_logprobs"]  # None, or an int
BOOLS = ["ignore_eos", "include_stop_str_in_output"]


def scalar(value):
    """A NumPy or PyTorch 0-d value as the Python number it holds; anything else unchanged."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def as_plain(value, name: str, kind: type) -> Any:
    """value (NumPy's or PyTorch's too) as a Python int, bool or finite float, else ValueError."""
    number = scalar(value)
    is_kind = isinstance(number, (int, float) if kind is float else kind)
    if not is_kind or (isinstance(number, bool) and kind is not bool):  # True is an int to Python
        raise ValueError(f"{name} must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    if kind is float and not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    return kind(number)


def as_token_ids(value, name: str) -> list[int]:
    """A list or tuple of ints, or a 1-D NumPy array or PyTorch tensor of them, as a new list."""
    if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
        value = value.tolist()  # a float or bool array gives floats or bools, refused below
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of int token ids, got {type(value).__name__}")
    if all(type(t) is int for t in value):  # the common case, fast
        return list(value)
    return [as_plain(t, f"{name}[{i}]", int) for i, t in enumerate(value)]


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of a request, and when to stop: vLLM's names and defaults."""

    temperature: float = 1.0  # 0 is greedy; below 1e-5 is stored as 0
    top_p: float = 1.0  # keep the most likely tokens whose probabilities add up to top_p
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of each token in the output
    frequency_penalty: float = 0.0  # subtracted once per time a token is in the output
    repetition_penalty: float = 1.0  # divides positive logits of prompt and output tokens
    max_tokens: int = 16  # completion tokens at most
    min_tokens: int = 0  # completion tokens before an end-of-sequence or stop token may come
    ignore_eos: bool = False  # keep going after the end-of-sequence token
    seed: int | None = None  # the request's own random seed; None: the engine's generator
    stop_token_ids: list[int] = field(default_factory=list)  # more tokens that finish it
    stop: list[str] = field(default_factory=list)  # strings that finish it, in the text
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    n: int = 1  # completions of the prompt, sharing its KV blocks; completion i seeds seed + i
    logprobs: int | None = None  # per completion token: its log-probability, and this many more
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    def __post_init__(self):
        for kind, names in ((float, FLOATS), (int, INTS + OPTIONAL_INTS), (bool, BOOLS)):
            for name in names:  # our own plain copy of each value
                if (value := getattr(self, name)) is not None or name not in OPTIONAL_INTS:
                    setattr(self, name, as_plain(value, name, kind))
        stop_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = as_token_ids(stop_ids, "stop_token_ids")
        if not isinstance(self.stop, str | list | tuple | None):
            raise ValueError(f"stop must be a str or a list of str, got {self.stop!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs = f"None or in [0, {MAX_LOGPROBS}]"
        checks = {  # field: (its value is allowed, what is)
            "max_tokens": (self.max_tokens >= 1, ">= 1"),
            "min_tokens": (0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            "temperature": (self.temperature >= 0, ">= 0 (0 is greedy)"),
            "top_p": (2.0**-126 <= self.top_p <= 1, "in [2**-126, 1], float32's normal numbers"),
            "top_k": (self.top_k == -1 or 1 <= self.top_k < 2**63, "-1 (all) or in [1, 2**63)"),
            "min_p": (0 <= self.min_p <= 1, "in [0, 1]"),
            "presence_penalty": (-2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            "frequency_penalty": (-2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            "repetition_penalty": (1e-6 <= self.repetition_penalty <= 1e6, "in [1e-6, 1e6]"),
            "stop_token_ids": (all(t >= 0 for t in self.stop_token_ids), "token ids >= 0"),
            "stop": (all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            "n": (self.n >= 1, ">= 1"),
            "logprobs": (0 <= (self.logprobs or 0) <= MAX_LOGPROBS, logprobs),
            "prompt_logprobs": (0 <= (self.prompt_logprobs or 0) <= MAX_LOGPROBS, logprobs),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.temperature < 1e-5:  # vLLM's _SAMPLING_EPS: logits / temperature overflows
            self.temperature = 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0, 0, 1)


# %% [markdown]
# ## How fast
# With no KV cache, token n + 1 costs a forward over all n before it:

# %%
for n in (64, 256, 1024):
    start = time.perf_counter()
    prompt_logits(model, text_ids[:n])
    ms = 1e3 * (time.perf_counter() - start)
    print(f"{n:5} tokens: {ms:6.1f} ms, the price of token {n + 1} with no cache")

# %% [markdown]
# Notebook 03 keeps every layer's keys and values, so a new token costs one token's work.
#
# ## Check yourself
# Set each `answerN` and run its cell; the worked answer follows.
#
# **1.** Split Qwen3-0.6B over 2 ranks (`tensor_parallel`): how many rows does `qkv_proj.weight`
# have on each? A list, one per rank.

# %%
from minivllm.layers.linear import TPGroup, tensor_parallel
from minivllm.testing import check_answer

answer1 = None  # your answer: replace None with an expression
qkv_rows = []
for rank in range(2):
    with torch.device("meta"), tensor_parallel(TPGroup(rank=rank, size=2)):  # rank's shapes
        layer = Qwen3ForCausalLM(config_06).model.layers[0]
    qkv_rows.append(layer.self_attn.qkv_proj.weight.shape[0])
check_answer(answer1, qkv_rows, "1. qkv rows")

# %% [markdown]
# Worked answer: each rank keeps half the 16 query heads and half the 8 KV heads (for K and for
# V), 128 rows a head: (16 + 2 × 8) × 128 / 2 = 2,048 rows.

# %%
check_answer([(16 + 2 * 8) * 128 // 2] * 2, qkv_rows, "1. qkv rows")

# %% [markdown]
# **2.** How many parameters does one decoder layer of Qwen3-0.6B hold? Hidden 1,024, 16 query
# heads and 8 KV heads of 128, MLP 3,072, no biases.

# %%
answer2 = None  # your answer: replace None with an expression
layer_params = sum(p.numel() for p in qwen06.model.layers[0].parameters())  # the meta model above
check_answer(answer2, layer_params, "2. layer parameters")

# %% [markdown]
# Worked answer: `qkv_proj` (16 + 2 × 8) × 128 rows of 1,024, `o_proj` 1,024 rows of 16 × 128;
# three MLP matrices of 3,072 × 1,024; norms of 128, 128, 1,024 and 1,024. 15.7 M: 28 layers make
# 440 M, the embedding most of the rest.

# %%
attention = (16 + 2 * 8) * 128 * 1024 + 1024 * 16 * 128
check_answer(attention + 3 * 3072 * 1024 + 2 * 128 + 2 * 1024, layer_params, "2. layer parameters")

# %% [markdown]
# **Exercise.** `exercises/02_llama.ipynb`: Llama-3.2 from the same layers (its llama3 RoPE
# scaling, its checkpoint mapping, an attention on one tensor-parallel rank's heads), checked
# against transformers. **Deep dives.** `deep_dives/checkpoints.ipynb`: how our checkpoints are
# made, broken folders, a fast `config.json`, bfloat16's rounding; `deep_dives/settings.ipynb`.
