"""HuggingFace checkpoint folders of named presets, written offline with transformers: config,
generation config, safetensors weights and a byte-level BPE tokenizer trained on the text in
minivllm/data. Tooling, written by hand: the course uses these folders (notebook 02 loads them) but
does not build the maker; the deep dive `checkpoints` reads how it works.

Presets: `tiny` (Qwen3 at laptop size), `tiny-text` (tiny's shapes trained on text by
`minivllm.checkpoint.train`, so that greedy output reads as text) and `qwen3-0.6b` (Qwen3-0.6B's
shapes, random weights); the other families of the deep dive `model_zoo`: `tiny-llama` (Llama 3
with llama3 RoPE scaling, and biases on so that a loader that drops them shows), `tiny-qwen2`,
`llama-3.2-1b` and `qwen2.5-0.5b` (their real shapes, random weights). Norms are drawn around 1, so
a loader that skipped them shows."""

import argparse
import time
from importlib import resources
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

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
        "tiny-llama": (2048, 128, 384, 2, 4, 2, 32, 4096, "float32"),
        "llama-3.2-1b": (128256, 2048, 8192, 16, 32, 8, 64, 131072, "bfloat16"),
        "tiny-qwen2": (2048, 128, 384, 2, 4, 2, 32, 4096, "float32"),
        "qwen2.5-0.5b": (151936, 896, 4864, 24, 14, 2, 64, 32768, "bfloat16"),
    }.items()
}
# Llama 3.2's RoPE: theta 500,000, frequencies scaled as Llama 3.1 trained them (rope_type llama3)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0)
LLAMA3_ROPE |= dict(high_freq_factor=4.0, original_max_position_embeddings=8192)
# the tiny one scales from 512 positions, so that all three bands of its frequencies occur
TINY_LLAMA_ROPE = LLAMA3_ROPE | dict(original_max_position_embeddings=512)
LLAMA = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5)
PRESETS["tiny-llama"] |= LLAMA | dict(
    rope_parameters=TINY_LLAMA_ROPE, attention_bias=True, mlp_bias=True
)
PRESETS["llama-3.2-1b"] |= LLAMA | dict(rope_parameters=LLAMA3_ROPE)
for name in ("tiny-qwen2", "qwen2.5-0.5b"):  # q, k, v biases always; theta 1e6 as Qwen2.5's
    PRESETS[name] |= dict(architectures=["Qwen2ForCausalLM"], rope_theta=1e6, rms_norm_eps=1e-6)
# architecture -> transformers' config class and model class
FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
    "LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
    "Qwen2ForCausalLM": (Qwen2Config, Qwen2ForCausalLM),
}
# tiny's shapes; write_checkpoint trains it on the corpus
PRESETS["tiny-text"] = dict(PRESETS["tiny"])
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def preset_config(name: str) -> PretrainedConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    fields = {"rope_theta": 1e6, "rms_norm_eps": 1e-6} | PRESETS[name]
    defaults: dict[str, Any] = dict(
        architectures=["Qwen3ForCausalLM"], bos_token_id=0, eos_token_id=2
    )
    fields = defaults | fields
    config_class = FAMILIES[fields["architectures"][0]][0]
    # rope_theta: transformers 4's keyword, which 5 still takes (into rope_parameters) but no longer
    # declares
    return config_class(**fields)


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


def family_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """transformers' model class of config's architecture (Qwen3 when it names none)."""
    architecture = (getattr(config, "architectures", None) or ["Qwen3ForCausalLM"])[0]
    return FAMILIES[architecture][1]


def random_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """transformers' model of config's family with seeded random weights, ready to save or to
    train."""
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    with torch.device("meta"):  # a real checkpoint's names and shapes, no memory yet
        # mypy: transformers' `to` is a functools.wraps wrapper, which mypy does not bind as a
        # method
        model = family_class(config)(config).to(dtype)  # type: ignore[arg-type]
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
    preset: str | PretrainedConfig = "tiny",
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
        train(cast(Qwen3ForCausalLM, model), corpus_ids(tokenizer), seed)  # tiny's: a Qwen3
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
