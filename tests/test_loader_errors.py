"""Every bad checkpoint gets a clear ValueError / FileNotFoundError from notebook 02's loader, naming what is wrong.
(The deep dive `checkpoints` checks a folder whole before any weight is read: tests/test_checked_loader.py.)"""

import json

import pytest
import torch

from minivllm import load_model
from minivllm.testing import edited_copy


@pytest.mark.parametrize("where", ["nowhere", "file", "empty"])
def test_no_config_json(tiny, tmp_path, where):
    path = {"nowhere": tmp_path / "nowhere", "file": tiny / "config.json", "empty": tmp_path}[where]
    with pytest.raises(FileNotFoundError, match="config.json") as e:
        load_model(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("architectures", [["LlamaForCausalLM"], ["MambaForCausalLM"], None])
def test_unknown_architecture_names_the_supported_ones(tiny, tmp_path, architectures):
    path = edited_copy(
        tiny, tmp_path / "broken", config_edit=lambda c: c.update(architectures=architectures)
    )
    with pytest.raises(
        ValueError, match=r"not supported; supported architectures: \['Qwen3ForCausalLM'\]"
    ):
        load_model(path)


def test_no_safetensors(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(path)


def test_index_names_a_missing_shard(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(path)


def test_missing_tensor(tiny, tmp_path):
    path = edited_copy(
        tiny,
        tmp_path / "broken",
        tensors_edit=lambda t: t.pop("model.layers.2.mlp.gate_proj.weight"),
    )
    with pytest.raises(ValueError, match="missing 1 tensor.*model.layers.2.mlp.gate_proj.weight"):
        load_model(path)


def test_untied_config_needs_lm_head(tiny, tmp_path):
    path = edited_copy(
        tiny, tmp_path / "broken", config_edit=lambda c: c.update(tie_word_embeddings=False)
    )
    with pytest.raises(ValueError, match="missing 1 tensor.*lm_head.weight"):
        load_model(path)


def test_unexpected_tensor(tiny, tmp_path):
    path = edited_copy(
        tiny,
        tmp_path / "broken",
        tensors_edit=lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}),
    )
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.0.mlp.extra.weight"):
        load_model(path)


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("model.layers.1.self_attn.v_proj.weight", (32, 128), (64, 128)),
        ("model.layers.0.mlp.up_proj.weight", (384, 64), (384, 128)),
        ("model.layers.3.mlp.down_proj.weight", (128, 385), (128, 384)),
        ("model.layers.0.self_attn.q_norm.weight", (16,), (32,)),
        ("model.embed_tokens.weight", (2000, 128), (2048, 128)),
    ],
)
def test_shape_mismatch_names_tensor_and_shapes(tiny, tmp_path, name, shape, expected):
    path = edited_copy(
        tiny, tmp_path / "broken", tensors_edit=lambda t: t.update({name: torch.zeros(shape)})
    )
    with pytest.raises(ValueError) as e:
        load_model(path)
    assert (
        name in str(e.value)
        and f"expected shape {expected}" in str(e.value)
        and f"got {shape}" in str(e.value)
    )


@pytest.mark.parametrize("dtype", [torch.int8, "int8", "no_such_dtype"])
def test_bad_dtype(tiny, dtype):
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(tiny, dtype=dtype)


def test_unsupported_config_values(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken", config_edit=lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_model(path)
