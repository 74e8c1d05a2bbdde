"""Every bad checkpoint gets a clear ValueError / FileNotFoundError, raised before any weight is loaded."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import minivllm.models.loader as loader
from minivllm import load_model
from minivllm.checkpoint import write_checkpoint
from minivllm.testing import edited_copy


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The same weights as `tiny`, in several shards with a model.safetensors.index.json."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "sharded", "tiny", seed=0, max_shard_size="1MB"
    )


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    """Any error must come before the first weight is copied: loading at all fails these tests."""

    def refuse(*args, **kwargs):
        raise AssertionError("load_weights ran: the error came too late")

    monkeypatch.setattr(loader, "load_weights", refuse)


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_file_instead_of_folder(tiny):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_model(tiny / "config.json")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unreadable_config(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_model(path)


@pytest.mark.parametrize("architectures", [["LlamaForCausalLM"], ["MambaForCausalLM"], None])
def test_unknown_architecture_names_the_supported_ones(tiny, tmp_path, architectures):
    path = edited_copy(
        tiny, tmp_path / "broken", config_edit=lambda c: c.update(architectures=architectures)
    )
    with pytest.raises(
        ValueError, match=r"not supported; supported architectures: \['Qwen3ForCausalLM'\]"
    ):
        load_model(path)


def test_config_that_is_not_an_object(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object"):
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


def shards(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return index, sorted(set(index["weight_map"].values()))


def edit_index(path, edit):
    index, _ = shards(path)
    edit(index)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_unreadable_index(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not readable JSON"):
        load_model(path)


@pytest.mark.parametrize(
    "index",
    [
        {"metadata": {}},
        {"weight_map": []},
        {"weight_map": {}},
        {"weight_map": {"model.norm.weight": 3}},
        ["weight_map"],
    ],
)
def test_index_without_a_weight_map(sharded, tmp_path, index):
    path = edited_copy(sharded, tmp_path / "broken")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json"):
        load_model(path)


def test_tensor_in_two_files_names_both(tiny, tmp_path):
    """A stray file beside the weights (an old copy, another run's shard) must not silently override them."""
    path = edited_copy(tiny, tmp_path / "broken")
    save_file(
        {"model.norm.weight": torch.zeros(128)}, path / "old.safetensors", metadata={"format": "pt"}
    )
    with pytest.raises(ValueError) as e:
        load_model(path)
    assert "model.norm.weight" in str(e.value)
    assert "old.safetensors" in str(e.value) and "model.safetensors" in str(e.value).replace(
        "old.safetensors", ""
    )


def test_shards_without_index_beside_an_old_single_file(sharded, tiny, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    (path / "model.safetensors.index.json").unlink()
    shutil.copy(tiny / "model.safetensors", path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model-0000\d-of-0000\d.safetensors") as e:
        load_model(path)
    assert "/model.safetensors" in str(e.value)


def test_index_beside_a_single_file_it_does_not_name(sharded, tiny, tmp_path):
    """transformers would load model.safetensors, vLLM the indexed shards: no silent pick between the two."""
    path = edited_copy(sharded, tmp_path / "broken")
    shutil.copy(tiny / "model.safetensors", path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors.*model.safetensors.index.json"):
        load_model(path)


def test_two_indexed_shards_hold_one_tensor(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    index, files = shards(path)
    first, last = path / files[0], path / files[-1]
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    tensors = load_file(last)
    tensors[name] = load_file(first)[name]
    save_file(tensors, last, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}.*{files[0]}.*{files[-1]}"):
        load_model(path)


def test_index_puts_a_tensor_in_the_wrong_file(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    index, files = shards(path)
    elsewhere = next(f for f in files if f != index["weight_map"]["model.norm.weight"])
    edit_index(path, lambda i: i["weight_map"].update({"model.norm.weight": elsewhere}))
    with pytest.raises(ValueError, match=r"index.json.*model.norm.weight"):
        load_model(path)


def test_index_names_a_tensor_no_file_holds(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    _, files = shards(path)
    edit_index(
        path, lambda i: i["weight_map"].update({"model.layers.0.mlp.extra.weight": files[0]})
    )
    with pytest.raises(ValueError, match=r"index.json.*model.layers.0.mlp.extra.weight"):
        load_model(path)


def test_unreadable_safetensors(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    (path / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
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


def test_bad_dtype(tiny):
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(tiny, dtype=torch.int8)


def test_unsupported_config_values(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken", config_edit=lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_model(path)
