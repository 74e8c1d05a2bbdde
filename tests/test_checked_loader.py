"""The deep dive `checkpoints` (minivllm.models.checked_loader): `load_checked` refuses every broken folder with a
clear ValueError / FileNotFoundError before any weight is read, and loads a good one as `load_model` does;
`read_config_fast` reads a written-out config.json without the architecture's class, with AutoConfig's values."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig

import minivllm.models.checked_loader as checked
from minivllm import load_model
from minivllm.checkpoint import preset_config, write_checkpoint
from minivllm.layers.rotary_embedding import rope_parameters
from minivllm.models.checked_loader import CONFIG_FIELDS, load_checked, read_config_fast
from minivllm.models.loader import resolve_dtype
from minivllm.testing import edited_copy, prompt_logits

READ_FIELDS = CONFIG_FIELDS["Qwen3ForCausalLM"] + ("eos_token_id", "architectures")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The same weights as `tiny`, in several shards with a model.safetensors.index.json."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "sharded", "tiny", seed=0, max_shard_size="1MB"
    )


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    config = preset_config("tiny")
    config.tie_word_embeddings = False
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "untied", config, seed=2)


@pytest.fixture
def no_loading(monkeypatch):
    """Any error must come before notebook 02's loader runs: loading at all fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("load_model ran: the error came too late")

    monkeypatch.setattr(checked, "load_model", refuse)


# --- a good folder: the same model as load_model's --------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "sharded"])
def test_a_good_folder_loads_as_load_model_loads_it(tiny, sharded, name):
    path = {"tiny": tiny, "sharded": sharded}[name]
    token_ids = list(range(3, 40))
    torch.testing.assert_close(
        prompt_logits(load_checked(path), token_ids),
        prompt_logits(load_model(tiny), token_ids),
        rtol=0,
        atol=0,
    )


def test_a_tied_checkpoint_that_also_stores_lm_head_passes(tiny, tmp_path):
    path = edited_copy(
        tiny,
        tmp_path / "with_head",
        tensors_edit=lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}),
    )
    token_ids = list(range(3, 40))
    torch.testing.assert_close(
        prompt_logits(load_checked(path), token_ids), prompt_logits(load_model(tiny), token_ids)
    )


# --- broken folders: refused before any weight is read ------------------------------------------------------------

refused_early = pytest.mark.usefixtures("no_loading")


@refused_early
def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checked(tmp_path / "nowhere")


@refused_early
def test_file_instead_of_folder(tiny):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_checked(tiny / "config.json")


@refused_early
def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checked(tmp_path)


@refused_early
def test_unreadable_config(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_checked(path)


@refused_early
def test_config_that_is_not_an_object(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object"):
        load_checked(path)


@refused_early
@pytest.mark.parametrize("architectures", [["LlamaForCausalLM"], ["MambaForCausalLM"], None])
def test_unknown_architecture_names_the_supported_ones(tiny, tmp_path, architectures):
    path = edited_copy(
        tiny, tmp_path / "broken", config_edit=lambda c: c.update(architectures=architectures)
    )
    with pytest.raises(
        ValueError, match=r"not supported; supported architectures: \['Qwen3ForCausalLM'\]"
    ):
        load_checked(path)


@refused_early
def test_pytorch_bin_weights_are_named(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "bin")
    (path / "model.safetensors").unlink()
    torch.save({"model.norm.weight": torch.ones(4)}, path / "pytorch_model.bin")
    with pytest.raises(
        FileNotFoundError, match="holds PyTorch .bin weights; minivllm reads safetensors only"
    ):
        load_checked(path)


@refused_early
def test_index_names_a_missing_shard(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_checked(path)


def shards(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return index, sorted(set(index["weight_map"].values()))


def edit_index(path, edit):
    index, _ = shards(path)
    edit(index)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@refused_early
def test_unreadable_index(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not readable JSON"):
        load_checked(path)


@refused_early
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
        load_checked(path)


@refused_early
def test_tensor_in_two_files_names_both(tiny, tmp_path):
    """A stray file beside the weights (an old copy, another run's shard) must not silently override them."""
    path = edited_copy(tiny, tmp_path / "broken")
    save_file(
        {"model.norm.weight": torch.zeros(128)}, path / "old.safetensors", metadata={"format": "pt"}
    )
    with pytest.raises(ValueError) as e:
        load_checked(path)
    assert "model.norm.weight" in str(e.value)
    assert "old.safetensors" in str(e.value) and "model.safetensors" in str(e.value).replace(
        "old.safetensors", ""
    )


@refused_early
def test_shards_without_index_beside_an_old_single_file(sharded, tiny, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    (path / "model.safetensors.index.json").unlink()
    shutil.copy(tiny / "model.safetensors", path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model-0000\d-of-0000\d.safetensors") as e:
        load_checked(path)
    assert "/model.safetensors" in str(e.value)


@refused_early
def test_index_beside_a_single_file_it_does_not_name(sharded, tiny, tmp_path):
    """transformers would load model.safetensors, vLLM the indexed shards: no silent pick between the two."""
    path = edited_copy(sharded, tmp_path / "broken")
    shutil.copy(tiny / "model.safetensors", path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors.*model.safetensors.index.json"):
        load_checked(path)


@refused_early
def test_two_indexed_shards_hold_one_tensor(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    index, files = shards(path)
    first, last = path / files[0], path / files[-1]
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    tensors = load_file(last)
    tensors[name] = load_file(first)[name]
    save_file(tensors, last, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}.*{files[0]}.*{files[-1]}"):
        load_checked(path)


@refused_early
def test_index_puts_a_tensor_in_the_wrong_file(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    index, files = shards(path)
    elsewhere = next(f for f in files if f != index["weight_map"]["model.norm.weight"])
    edit_index(path, lambda i: i["weight_map"].update({"model.norm.weight": elsewhere}))
    with pytest.raises(ValueError, match=r"index.json.*model.norm.weight"):
        load_checked(path)


@refused_early
def test_index_names_a_tensor_no_file_holds(sharded, tmp_path):
    path = edited_copy(sharded, tmp_path / "broken")
    _, files = shards(path)
    edit_index(
        path, lambda i: i["weight_map"].update({"model.layers.0.mlp.extra.weight": files[0]})
    )
    with pytest.raises(ValueError, match=r"index.json.*model.layers.0.mlp.extra.weight"):
        load_checked(path)


@refused_early
def test_unreadable_safetensors(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken")
    (path / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_checked(path)


@refused_early
def test_missing_tensor(tiny, tmp_path):
    path = edited_copy(
        tiny,
        tmp_path / "broken",
        tensors_edit=lambda t: t.pop("model.layers.2.mlp.gate_proj.weight"),
    )
    with pytest.raises(ValueError, match="missing 1 tensor.*model.layers.2.mlp.gate_proj.weight"):
        load_checked(path)


@refused_early
def test_untied_config_needs_lm_head(tiny, tmp_path):
    path = edited_copy(
        tiny, tmp_path / "broken", config_edit=lambda c: c.update(tie_word_embeddings=False)
    )
    with pytest.raises(ValueError, match="missing 1 tensor.*lm_head.weight"):
        load_checked(path)


@refused_early
def test_unexpected_tensor(tiny, tmp_path):
    path = edited_copy(
        tiny,
        tmp_path / "broken",
        tensors_edit=lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}),
    )
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.0.mlp.extra.weight"):
        load_checked(path)


@refused_early
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
        load_checked(path)
    message = str(e.value)
    assert name in message and f"expected shape {expected}" in message and f"got {shape}" in message


@refused_early
def test_unsupported_config_values(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "broken", config_edit=lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_checked(path)


# --- read_config_fast: AutoConfig's values without the architecture's class -----------------------------------------


def as_transformers_4(config: dict) -> None:
    """The keys of Qwen3-0.6B's config.json on the Hub (transformers 4.51)."""
    config["torch_dtype"] = config.pop("dtype")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config.pop("layer_types")
    config.update(
        rope_scaling=None, max_window_layers=28, sliding_window=None, use_sliding_window=False
    )
    config["transformers_version"] = "4.51.0"


def assert_same_config(fast, full, fields=READ_FIELDS):
    assert {f: getattr(fast, f) for f in fields} == {f: getattr(full, f) for f in fields}
    assert rope_parameters(fast) == rope_parameters(full)
    for device in ("cpu", "cuda"):  # resolve_dtype reads only the device's type: no GPU needed
        assert resolve_dtype("auto", fast, torch.device(device)) == resolve_dtype(
            "auto", full, torch.device(device)
        )


@pytest.mark.parametrize("name", ["tiny", "untied"])
def test_written_out_config_skips_the_architecture_class(tiny, untied, name):
    """config.json as transformers 5 writes it: the base class holds every field the model reads, equal to
    AutoConfig's (Qwen3Config's), and RoPE and the dtype resolve the same."""
    path = {"tiny": tiny, "untied": untied}[name]
    fast, full = read_config_fast(path), AutoConfig.from_pretrained(path)
    assert type(fast) is PretrainedConfig and type(full).__name__ == "Qwen3Config"
    assert_same_config(fast, full)


@pytest.mark.parametrize("torch_dtype", ["float32", "bfloat16"])
def test_transformers_4_config_takes_the_fast_path(tiny, tmp_path, torch_dtype):
    """RoPE from the top-level rope_theta, the dtype from torch_dtype; the same logits."""
    edit = lambda c: [as_transformers_4(c), c.update(torch_dtype=torch_dtype)]  # noqa: E731
    path = edited_copy(tiny, tmp_path / "t4", config_edit=edit)
    fast, full = read_config_fast(path), AutoConfig.from_pretrained(path)
    assert type(fast) is PretrainedConfig and type(full).__name__ == "Qwen3Config"
    assert_same_config(fast, full, READ_FIELDS + ("use_sliding_window",))
    assert rope_parameters(fast) == {"rope_type": "default", "rope_theta": 1e6}
    assert resolve_dtype("auto", fast, torch.device("cuda")) == getattr(torch, torch_dtype)
    token_ids = list(range(3, 33))
    torch.testing.assert_close(
        prompt_logits(load_model(path, dtype=torch.float32, config=fast), token_ids),
        prompt_logits(load_model(tiny), token_ids),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("field", CONFIG_FIELDS["Qwen3ForCausalLM"])
def test_config_without_a_field_takes_the_class_defaults(untied, tmp_path, field):
    """A field missing from config.json is Qwen3Config's default, as AutoConfig gives it (layer_types goes too:
    Qwen3Config checks it against num_hidden_layers)."""
    path = edited_copy(untied, tmp_path / "c", lambda c: [c.pop(field), c.pop("layer_types")])
    config = read_config_fast(path)
    assert type(config).__name__ == "Qwen3Config"
    assert getattr(config, field) == getattr(AutoConfig.from_pretrained(path), field)


def test_untied_config_without_tie_field_stays_untied(untied, tmp_path):
    """Qwen3Config's tie_word_embeddings defaults to False, the base class's to True."""
    path = edited_copy(untied, tmp_path / "c", lambda c: c.pop("tie_word_embeddings"))
    assert read_config_fast(path).tie_word_embeddings is False


def test_yarn_rope_scaling_goes_to_autoconfig_and_is_refused(tiny, tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    path = edited_copy(
        tiny,
        tmp_path / "yarn",
        config_edit=lambda c: [as_transformers_4(c), c.update(rope_scaling=yarn)],
    )
    assert type(read_config_fast(path)).__name__ == "Qwen3Config"
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        load_checked(path)
