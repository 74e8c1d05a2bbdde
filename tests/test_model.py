"""Our Qwen3 + loader against transformers' Qwen3 on the same checkpoint; tensor parallel 2 (gloo) against 1."""

import json
import subprocess
import sys

import pytest
import torch
from distributed import run_on_ranks
from transformers import AutoModelForCausalLM

from minivllm import load_model
from minivllm.attention.prefill import PrefillContext
from minivllm.checkpoint import preset_config, write_checkpoint
from minivllm.testing import edited_copy, prompt_logits

LENGTHS = [1, 15, 16, 17, 255, 256, 257, 400]  # around block sizes 16 and 256, and a few hundred


def variant(tie: bool, num_kv_heads: int, dtype: torch.dtype = torch.float32):
    config = preset_config("tiny")
    config.tie_word_embeddings, config.num_key_value_heads, config.dtype = tie, num_kv_heads, dtype
    return config


VARIANTS = {
    "tied-gqa": variant(tie=True, num_kv_heads=2),
    "untied-mqa": variant(tie=False, num_kv_heads=1),
    "untied-gqa": variant(tie=False, num_kv_heads=2),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: write_checkpoint(root / name, config, seed=i)
        for i, (name, config) in enumerate(VARIANTS.items())
    }


def hf_logits(path, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_equal_transformers(checkpoints, name):
    model = load_model(checkpoints[name], dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    for n in LENGTHS:
        token_ids = prompt(n, seed=n)
        ours = prompt_logits(model, token_ids)
        with torch.no_grad():
            ref = hf(torch.tensor([token_ids])).logits[0]
        assert ours.shape == (n, VARIANTS[name].vocab_size)
        assert (ours - ref).abs().max().item() < 1e-4, (name, n)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), (name, n)


def test_tied_head_is_the_embedding(checkpoints):
    tied, untied = load_model(checkpoints["tied-gqa"]), load_model(checkpoints["untied-gqa"])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_packed_prompts_equal_separate_prompts(checkpoints):
    model = load_model(checkpoints["tied-gqa"])
    lens = [5, 1, 37, 16]
    prompts = [prompt(n, seed=i) for i, n in enumerate(lens)]
    input_ids = torch.tensor(sum(prompts, []))
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        packed = model.compute_logits(
            model(input_ids, positions, PrefillContext.from_lens(lens, "cpu"))
        )
    for p, logits in zip(prompts, packed.split(lens), strict=True):
        torch.testing.assert_close(logits, prompt_logits(model, p), rtol=1e-5, atol=1e-5)


def test_sharded_checkpoint_with_index_loads(checkpoints, tmp_path):
    sharded = write_checkpoint(
        tmp_path / "sharded", VARIANTS["tied-gqa"], seed=0, max_shard_size="1MB"
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert (
        len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    )
    assert not (sharded / "model.safetensors").exists()
    token_ids = prompt(50)
    torch.testing.assert_close(
        prompt_logits(load_model(sharded), token_ids),
        prompt_logits(load_model(checkpoints["tied-gqa"]), token_ids),
        rtol=0,
        atol=0,
    )


def test_sharded_checkpoint_follows_its_index(checkpoints, tmp_path):
    """A stray file beside indexed shards (here: other weights) is not read, by us or by transformers."""
    sharded = write_checkpoint(
        tmp_path / "sharded", VARIANTS["tied-gqa"], seed=0, max_shard_size="1MB"
    )
    other = write_checkpoint(tmp_path / "other", VARIANTS["tied-gqa"], seed=7)
    (sharded / "model-00009-of-00009.safetensors").write_bytes(
        (other / "model.safetensors").read_bytes()
    )
    token_ids = prompt(50)
    ours = prompt_logits(load_model(sharded), token_ids)
    torch.testing.assert_close(
        ours, prompt_logits(load_model(checkpoints["tied-gqa"]), token_ids), rtol=0, atol=0
    )
    torch.testing.assert_close(ours, hf_logits(sharded, token_ids), rtol=1e-4, atol=1e-4)


def test_tied_checkpoint_that_also_stores_lm_head_loads(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "with_head"
    path.mkdir()
    for f in checkpoints["tied-gqa"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    token_ids = prompt(20)
    torch.testing.assert_close(
        prompt_logits(load_model(path), token_ids), hf_logits(path, token_ids), rtol=1e-4, atol=1e-4
    )


def test_untied_checkpoint_without_tie_field_stays_untied(checkpoints, tmp_path):
    """Qwen3Config's tie_word_embeddings defaults to False, the base class's to True: a config.json that leaves the
    field out must load an untied head, with transformers' logits."""
    path = edited_copy(
        checkpoints["untied-gqa"], tmp_path / "c", lambda c: c.pop("tie_word_embeddings")
    )
    token_ids = prompt(17)
    torch.testing.assert_close(
        prompt_logits(load_model(path), token_ids), hf_logits(path, token_ids), rtol=1e-4, atol=1e-4
    )


def test_transformers_4_config_keys_load(checkpoints, tmp_path):
    """A config.json as transformers 4.5x wrote it (rope_theta at the top, torch_dtype, no layer_types), as the Hub's
    Qwen3 folders hold it: the same logits (AutoConfig reads the old keys)."""

    def as_transformers_4(config: dict) -> None:
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
        config["rope_scaling"] = None
        config["torch_dtype"] = config.pop("dtype")
        config.pop("layer_types", None)
        config["transformers_version"] = "4.51.0"

    path = edited_copy(checkpoints["untied-gqa"], tmp_path / "old_config", as_transformers_4)
    token_ids = prompt(30)
    torch.testing.assert_close(
        prompt_logits(load_model(path), token_ids),
        prompt_logits(load_model(checkpoints["untied-gqa"]), token_ids),
        rtol=0,
        atol=0,
    )


def test_bfloat16_checkpoint_upcasts_to_float32(tmp_path):
    path = write_checkpoint(
        tmp_path / "bf16", variant(tie=True, num_kv_heads=2, dtype=torch.bfloat16), seed=5
    )
    model = load_model(path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (
        load_model(path, dtype="auto", device="cpu").lm_head.weight.dtype == torch.float32
    )  # auto on CPU: fp32
    assert load_model(path, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16
    token_ids = prompt(64)
    ours, ref = prompt_logits(model, token_ids), hf_logits(path, token_ids)
    assert (ours - ref).abs().max().item() < 1e-4 and torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_default_dtype_is_restored(checkpoints):
    load_model(checkpoints["tied-gqa"], dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(
    "token_ids, match",
    [
        ([], "empty"),
        ([0, 2048], "2048 is outside the vocabulary"),
        ([-1], "-1 is outside"),
        ([1] * 4097, "max_position_embeddings"),
    ],
)
def test_bad_prompts(checkpoints, token_ids, match):
    model = load_model(checkpoints["tied-gqa"])
    with pytest.raises(ValueError, match=match):
        prompt_logits(model, token_ids)


def test_import_minivllm_is_light():
    code = "import sys, minivllm; assert 'transformers' not in sys.modules; assert callable(minivllm.load_model)"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- tensor parallel: world size 2 over gloo gives what world size 1 gives -------------------------------------

TP_VARIANTS = ["tied-gqa", "untied-gqa"]  # MQA's single KV head cannot be split over 2 ranks
TP_PROMPT = prompt(70)


def tp_run(paths: dict, token_ids: list[int]) -> dict:
    """On one rank: each checkpoint's logits and the shapes of this rank's parameters."""
    results = {}
    for name, path in paths.items():
        model = load_model(path, dtype=torch.float32)
        results[name] = (
            prompt_logits(model, token_ids),
            {n: tuple(p.shape) for n, p in model.named_parameters()},
        )
    return results


@pytest.fixture(scope="module")
def tp2(checkpoints):
    return run_on_ranks(
        tp_run, 2, {name: checkpoints[name] for name in TP_VARIANTS}, TP_PROMPT
    )  # one spawn


@pytest.mark.parametrize("name", TP_VARIANTS)
def test_tensor_parallel_2_equals_1(checkpoints, tp2, name):
    expected = prompt_logits(load_model(checkpoints[name]), TP_PROMPT)
    for rank in tp2:
        torch.testing.assert_close(rank[name][0], expected, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_2_holds_half_of_each_layer(tp2):
    shapes = [rank["untied-gqa"][1] for rank in tp2]
    assert shapes[0] == shapes[1]
    assert shapes[0]["model.layers.0.self_attn.qkv_proj.weight"] == ((4 + 2 * 2) * 32 // 2, 128)
    assert shapes[0]["model.layers.0.self_attn.o_proj.weight"] == (128, 4 * 32 // 2)
    assert shapes[0]["model.layers.0.mlp.gate_up_proj.weight"] == (384, 128)
    assert shapes[0]["model.layers.0.mlp.down_proj.weight"] == (128, 192)
    assert shapes[0]["model.embed_tokens.weight"] == shapes[0]["lm_head.weight"] == (1024, 128)


# --- GPU: the qwen3-0.6b preset in bfloat16 against transformers (python -m minivllm.checks.model_parity) ------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_0_6b_bfloat16_parity_on_gpu():
    from minivllm.checks.model_parity import run_model_parity

    result = run_model_parity("qwen3-0.6b", num_tokens=1024)
    rows = {(row["impl"], row["reference"]): row for row in result["rows"]}
    ours, theirs = (
        rows["minivllm-bf16", "transformers-fp32"],
        rows["transformers-bf16", "transformers-fp32"],
    )
    print(json.dumps(result, indent=2))
    assert result["rope_theta"] == 1e6
    # float32: the same function, up to summation order
    assert rows["minivllm-fp32", "transformers-fp32"]["max_abs_logit_error"] < 1e-2
    # bfloat16: random weights give nearly flat logits, so rounding alone flips some argmaxes (transformers' own
    # bf16 model agrees with its fp32 one on ~96% of positions). We must be as close to fp32 as transformers is.
    assert ours["top1_agreement"] >= theirs["top1_agreement"] - 0.03
    assert ours["mean_abs_logit_error"] <= 1.5 * theirs["mean_abs_logit_error"]
    assert ours["max_abs_logit_error"] <= 2 * theirs["max_abs_logit_error"]
    assert rows["minivllm-bf16", "transformers-bf16"]["top1_agreement"] >= 0.9
