"""Checkpoint folders as the Hub's Qwen3 repositories hold them (config.json written by transformers 4.51, untied
heads as in Qwen3-8B, two EOS ids in generation_config.json): they load, with transformers' logits. (The fast
config.json reader of the deep dive `checkpoints`: tests/test_checked_loader.py.)"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams, load_model
from minivllm.models.loader import read_config
from minivllm.testing import edited_copy, prompt_logits

PROMPT = list(range(3, 40))


def as_transformers_4(config: dict) -> None:
    """The keys of Qwen3-0.6B's config.json on the Hub (transformers 4.51), for the tiny checkpoint's values."""
    config["torch_dtype"] = config.pop("dtype")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config.pop("layer_types")
    config.update(
        rope_scaling=None, max_window_layers=28, sliding_window=None, use_sliding_window=False
    )
    config["transformers_version"] = "4.51.0"


def untied(tensors: dict[str, torch.Tensor]) -> None:
    """A separate lm_head.weight, as Qwen3-8B has: not the embedding, so a tied head gives other logits."""
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = (
        torch.randn(embedding.shape, generator=torch.Generator().manual_seed(1)) * 0.02
    )


def with_eos(path: Path, eos_token_id: list[int]) -> Path:
    file = path / "generation_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | {"eos_token_id": eos_token_id}))
    return path


VARIANTS: dict[str, Callable[[Path, Path], Path]] = {
    "transformers-4": lambda tiny, out: edited_copy(tiny, out, config_edit=as_transformers_4),
    "transformers-4-window-off": lambda tiny, out: edited_copy(
        tiny, out, config_edit=lambda c: [as_transformers_4(c), c.update(sliding_window=4096)]
    ),
    "untied": lambda tiny, out: edited_copy(
        tiny, out, config_edit=lambda c: c.update(tie_word_embeddings=False), tensors_edit=untied
    ),
    "two-eos": lambda tiny, out: with_eos(edited_copy(tiny, out), [17, 23]),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_loads_with_transformers_logits(tiny, tmp_path, name):
    path = VARIANTS[name](tiny, tmp_path / name)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(load_model(path), PROMPT), expected, rtol=0, atol=1e-4)


def test_untied_head_is_its_own_matrix(tiny, tmp_path):
    model = load_model(VARIANTS["untied"](tiny, tmp_path / "untied"))
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_llm_stops_on_either_eos_id(tiny, tmp_path, hf_greedy):
    """Both ids of generation_config.json's eos_token_id end a request: each prompt stops on a different one."""
    first, second = [5, 6, 7], [100, 101]
    a_run, b_run = hf_greedy(first, 16), hf_greedy(second, 16)
    a = a_run[4]
    a_run = a_run[: a_run.index(a) + 1]
    b = next(t for t in b_run[2:] if t not in a_run)
    b_run = b_run[: b_run.index(b) + 1]
    assert (
        a not in b_run
    )  # each prompt's run meets only its own id (greedy on fixed weights: fixed runs)
    path = with_eos(edited_copy(tiny, tmp_path / "eos"), [a, b])
    with LLM(str(path), num_kvcache_blocks=64, max_num_seqs=4, max_model_len=256) as llm:
        assert {a, b} <= set(llm.engine.input_processor.eos_token_ids)
        outputs = llm.generate(
            [first, second], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
        )
    assert [o.outputs[0].token_ids for o in outputs] == [a_run, b_run]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_sliding_window_is_refused(tiny, tmp_path):
    edit = lambda c: [as_transformers_4(c), c.update(use_sliding_window=True, sliding_window=4096)]  # noqa: E731
    path = edited_copy(tiny, tmp_path / "window", config_edit=edit)
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        load_model(path)


def test_yarn_rope_scaling_goes_to_autoconfig_and_is_refused(tiny, tmp_path):
    """A RoPE scaling other than the default (YaRN: Qwen3's long-context setting) is AutoConfig's to read; our RoPE
    does not do YaRN, and says so before any weight is read."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    path = edited_copy(
        tiny,
        tmp_path / "yarn",
        config_edit=lambda c: [as_transformers_4(c), c.update(rope_scaling=yarn)],
    )
    assert type(read_config(path)).__name__ == "Qwen3Config"
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        load_model(path)


def test_pytorch_bin_weights_alone_are_no_checkpoint(tiny, tmp_path):
    """(`load_checked` of the deep dive `checkpoints` also names the .bin files.)"""
    path = edited_copy(tiny, tmp_path / "bin")
    (path / "model.safetensors").unlink()
    torch.save({"model.norm.weight": torch.ones(4)}, path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file in"):
        load_model(path)
