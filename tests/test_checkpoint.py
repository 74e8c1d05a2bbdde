"""`python -m minivllm.checkpoint`: a HuggingFace folder, deterministic bytes, a tokenizer that fits the model."""

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.checkpoint import PRESETS, main, preset_config, train_tokenizer, write_checkpoint
from minivllm.checkpoint.maker import random_model
from minivllm.checkpoint.train import corpus_ids, corpus_loss, train


def hashes(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def cli_tiny(tmp_path_factory):
    """The tiny preset written by the command line (the session's `tiny` is written by write_checkpoint)."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    main(["--preset", "tiny", "--out", str(out)])
    return out


def test_cli_runs_as_a_module(tmp_path):
    out = tmp_path / "cli"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "minivllm.checkpoint",
            "--preset",
            "tiny",
            "--out",
            str(out),
            "--seed",
            "3",
        ],
        check=True,
        capture_output=True,
    )
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_writes_a_huggingface_folder(cli_tiny):
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= {f.name for f in cli_tiny.iterdir()}
    config = AutoConfig.from_pretrained(cli_tiny)
    assert config.architectures == ["Qwen3ForCausalLM"]
    for key, value in PRESETS["tiny"].items():
        assert str(getattr(config, key)).removeprefix("torch.") == str(value), key
    generation = json.loads((cli_tiny / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    with safe_open(cli_tiny / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}  # nothing time-dependent
    assert "lm_head.weight" not in names  # tied, as transformers saves it
    assert len(names) == 2 + 11 * config.num_hidden_layers


def test_same_seed_same_bytes(tmp_path, cli_tiny):
    again = write_checkpoint(tmp_path / "again", "tiny", seed=0)
    other = write_checkpoint(tmp_path / "other", "tiny", seed=1)
    assert hashes(again) == hashes(cli_tiny)
    assert hashes(other)["model.safetensors"] != hashes(cli_tiny)["model.safetensors"]
    assert hashes(other)["tokenizer.json"] == hashes(cli_tiny)["tokenizer.json"]


def test_norm_weights_are_not_all_ones(tiny):
    with safe_open(tiny / "model.safetensors", "pt") as f:
        q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
        k_norm = f.get_tensor("model.layers.0.self_attn.k_norm.weight")
    assert not torch.equal(q_norm, k_norm) and (q_norm - 1).abs().max() > 0.05


def test_tokenizer_fits_the_model_and_speaks_chatml(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = AutoConfig.from_pretrained(tiny)
    assert len(tokenizer) <= config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id
    text = "Hello, world! Ünïcödé, 東京 and emoji 🙂 survive a byte-level round trip."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "Hi"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_0_6b_preset_has_the_real_shapes():
    config = preset_config("qwen3-0.6b")
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        28,
        1024,
        3072,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 128)
    assert config.vocab_size == 151936 and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e6 and config.max_position_embeddings == 40960
    assert config.dtype == torch.bfloat16


def test_tiny_preset_fits_the_kernels_and_tp2():
    config = preset_config("tiny")
    assert config.head_dim in (16, 32, 64, 128, 256)
    assert config.num_attention_heads > config.num_key_value_heads > 1  # GQA
    assert config.vocab_size % 2 == 0 and config.max_position_embeddings >= 2048


def test_unknown_preset():
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        preset_config("gpt-5")


def test_training_is_deterministic():
    """The same seed trains the same weights, bit for bit; another seed, others; the global RNG is left alone.
    (A short run: the full one is the same loop, longer.)"""
    token_ids = corpus_ids(train_tokenizer())

    def trained(seed: int) -> dict[str, torch.Tensor]:
        model = random_model(preset_config("tiny-text"), seed)
        losses = train(model, token_ids, seed, steps=12)
        assert losses[-1] < losses[0]
        return model.state_dict()

    rng = torch.get_rng_state()
    first, again, other = trained(0), trained(0), trained(1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert first.keys() == again.keys() and all(
        torch.equal(first[name], again[name]) for name in first
    )
    assert not torch.equal(first["model.norm.weight"], other["model.norm.weight"])


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
def test_tiny_text_is_tiny_trained(tiny, tiny_text):
    """The same shapes and tokenizer as tiny, and a corpus loss far below the random model's (ln 2048 = 7.6)."""
    same_files = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert {name: h for name, h in hashes(tiny_text).items() if name in same_files} == {
        name: h for name, h in hashes(tiny).items() if name in same_files
    }
    token_ids = corpus_ids(AutoTokenizer.from_pretrained(tiny_text))
    random_loss, trained_loss = (
        corpus_loss(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), token_ids)
        for path in (tiny, tiny_text)
    )
    assert random_loss > 7 and trained_loss < random_loss / 4, (random_loss, trained_loss)


@pytest.mark.slow  # the tiny_text fixture trains for half a minute
def test_tiny_text_continues_the_corpus_through_the_engine(tiny_text):
    """Greedy decoding with our engine, from 8 tokens at 10 places in the corpus: most next tokens are the corpus's."""
    token_ids = corpus_ids(AutoTokenizer.from_pretrained(tiny_text)).tolist()
    starts = range(0, len(token_ids) - 24, len(token_ids) // 10)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(tiny_text), device="cpu", num_kvcache_blocks=64) as llm:
        outputs = llm.generate(
            [token_ids[start : start + 8] for start in starts], greedy, use_tqdm=False
        )
    continuations = [token_ids[start + 8 : start + 24] for start in starts]
    same = sum(
        a == b
        for out, ref in zip(outputs, continuations)
        for a, b in zip(out.outputs[0].token_ids, ref)
    )
    assert same > 0.5 * 16 * len(starts), f"{same} of {16 * len(starts)} tokens as in the corpus"


def test_the_demo_offers_every_preset():
    from minivllm.__main__ import (
        PRESETS as DEMO_PRESETS,
    )  # a literal there, so that --help stays light

    assert sorted(DEMO_PRESETS) == sorted(PRESETS)
