"""Hub ids through the Python API, with no network: a Hub cache laid out on disk (conftest's `hub_cache`, the tiny
checkpoint as `minivllm/tiny`) and offline mode. An id gives the same tokens as its snapshot folder; a local folder
of that name wins; revisions, a separate tokenizer and download_dir work; every miss is one line naming the id."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.checkpoint import write_checkpoint
from minivllm.checks.model_parity import greedy_agreement
from minivllm.testing import edited_copy, lay_out_hub_cache

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3], [7] * 20, list(range(40, 90))]
SMALL = dict(num_kvcache_blocks=64, max_num_seqs=8)


def tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """What HF_HUB_OFFLINE=1 sets when huggingface_hub is imported: these tests never ask the network."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tiny_tokens(tiny: Path) -> list[list[int]]:
    return tokens(LLM(str(tiny), **SMALL))


@pytest.fixture(scope="module")
def seed1(tmp_path_factory) -> Path:
    """Another checkpoint of the tiny preset (seed 1): other weights, so other greedy tokens."""
    return write_checkpoint(tmp_path_factory.mktemp("seed1") / "tiny", "tiny", seed=1)


def test_an_id_with_HF_HUB_CACHE_gives_its_snapshot_s_tokens(hub_cache, tiny_tokens):
    """As a user runs it: a fresh Python with HF_HUB_CACHE and HF_HUB_OFFLINE=1 in its environment."""
    script = (
        "import json; from minivllm import LLM, SamplingParams; "
        f"llm = LLM('minivllm/tiny', num_kvcache_blocks=64, max_num_seqs=8); p = {PROMPTS!r}; "
        "outs = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False); "
        "print(json.dumps([o.outputs[0].token_ids for o in outs]))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == tiny_tokens


def test_an_id_resolves_to_the_snapshot_folder(hub_cache, tiny_tokens):
    llm = LLM("minivllm/tiny", download_dir=str(hub_cache), **SMALL)
    assert llm.engine.config.model.parent.parent.name == "models--minivllm--tiny"
    assert tokens(llm) == tiny_tokens


def test_a_local_folder_of_that_name_wins(hub_cache, seed1, tiny_tokens, tmp_path, monkeypatch):
    shutil.copytree(seed1, tmp_path / "minivllm" / "tiny")
    monkeypatch.chdir(tmp_path)
    from_folder = tokens(LLM("minivllm/tiny", download_dir=str(hub_cache), **SMALL))
    assert from_folder == tokens(LLM(str(seed1), **SMALL)) != tiny_tokens


def test_a_revision_picks_its_snapshot(seed1, tiny, tmp_path):
    lay_out_hub_cache(tiny, tmp_path, "minivllm/tiny")
    lay_out_hub_cache(seed1, tmp_path, "minivllm/tiny", commit="1" * 40, ref="v1")
    main = tokens(LLM("minivllm/tiny", download_dir=str(tmp_path), **SMALL))
    v1 = tokens(LLM("minivllm/tiny", revision="v1", download_dir=str(tmp_path), **SMALL))
    assert v1 == tokens(LLM(str(seed1), **SMALL)) != main


def test_a_tokenizer_from_another_id(tiny, hub_cache, tmp_path):
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny / name, weights_only / name)
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(str(weights_only), **SMALL).generate("text", GREEDY, use_tqdm=False)
    llm = LLM(str(weights_only), tokenizer="minivllm/tiny", download_dir=str(hub_cache), **SMALL)
    text = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0]
    assert text.prompt_token_ids == LLM(str(tiny), **SMALL).get_tokenizer().encode(
        "Once upon a time"
    )


@pytest.mark.parametrize(
    "model, revision, error, words",
    [
        ("minivllm/not-there", None, FileNotFoundError, ["minivllm/not-there", "HF_HUB_OFFLINE"]),
        ("minivllm/tiny", "v9", FileNotFoundError, ["minivllm/tiny", "revision v9"]),
        ("not/a/hub/id", None, FileNotFoundError, ["not/a/hub/id", "not a Hub id"]),
    ],
)
def test_a_miss_is_one_line_naming_the_id(hub_cache, model, revision, error, words):
    with pytest.raises(error) as raised:
        LLM(model, revision=revision, download_dir=str(hub_cache), **SMALL)
    message = str(raised.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_a_repo_without_safetensors_says_so(tiny, tmp_path):
    bin_only = tmp_path / "bin-only"
    shutil.copytree(tiny, bin_only)
    (bin_only / "model.safetensors").rename(bin_only / "pytorch_model.bin")
    lay_out_hub_cache(bin_only, tmp_path / "hub", "someone/bin-only")
    with pytest.raises(ValueError, match=r"someone/bin-only has no \*\.safetensors weights.*\.bin"):
        LLM("someone/bin-only", download_dir=str(tmp_path / "hub"), **SMALL)


def test_an_unsupported_architecture_is_named(tiny, tmp_path):
    mixtral = edited_copy(
        tiny,
        tmp_path / "mixtral",
        config_edit=lambda c: c.update(architectures=["MixtralForCausalLM"]),
    )
    lay_out_hub_cache(mixtral, tmp_path / "hub", "someone/mixtral")
    with pytest.raises(ValueError, match=r"MixtralForCausalLM.*not supported.*Qwen3ForCausalLM"):
        LLM("someone/mixtral", download_dir=str(tmp_path / "hub"), **SMALL)


def test_chat_template_kwargs_reach_the_template(tiny, tmp_path):
    """Qwen3's template writes an empty think block when enable_thinking is False; a template like it here."""
    folder = edited_copy(tiny, tmp_path / "thinking")
    template = (folder / "chat_template.jinja").read_text()
    switch = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    (folder / "chat_template.jinja").write_text(template + switch)
    llm = LLM(str(folder), **SMALL)
    chat = [{"role": "user", "content": "Hello"}]
    on, off = (
        llm.chat(chat, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": thinking})[
            0
        ]
        for thinking in (True, False)
    )
    decode = llm.get_tokenizer().decode
    assert decode(on.prompt_token_ids).endswith("assistant\n")
    assert decode(off.prompt_token_ids) == decode(on.prompt_token_ids) + "<think></think>"


def test_greedy_agreement_counts_transformers_choices(tiny, tiny_tokens):
    """The teacher-forced check notebook 06 runs on the real model: in float32 every greedy token is transformers'
    choice; a token changed by hand is caught."""
    outputs = LLM(str(tiny), **SMALL).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert greedy_agreement(tiny, outputs, dtype=torch.float32)["agreement"] == 1.0
    wrong = outputs[1].outputs[0].token_ids  # its last token: no later token is conditioned on it
    wrong[-1] = (wrong[-1] + 1) % 2048
    agreement = greedy_agreement(tiny, outputs, dtype=torch.float32)
    assert agreement["agreement"] == 1 - 1 / agreement["tokens"] and agreement["tokens"] == 3 * 12


@pytest.mark.gpu
def test_an_id_on_a_gpu_in_bfloat16(hub_cache, tiny):
    """On a GPU: an id gives its folder's tokens, and they are transformers' choices wherever rounding cannot flip one."""
    by_id = LLM("minivllm/tiny", dtype="bfloat16", download_dir=str(hub_cache), **SMALL)
    outputs = by_id.generate(PROMPTS, GREEDY, use_tqdm=False)
    by_id.close()
    assert [o.outputs[0].token_ids for o in outputs] == tokens(
        LLM(str(tiny), dtype="bfloat16", **SMALL)
    )
    assert greedy_agreement(tiny, outputs)["agreement_clear_cut"] == 1.0
