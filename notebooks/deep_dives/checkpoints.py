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
# # Deep dive · Checkpoints: how ours are made, folders that lie, config.json without the registry
#
# **What this adds.** Notebook 02's loader reads a well-formed HuggingFace folder correctly, and
# names a tensor that is missing, unexpected or of the wrong shape. Folders in the wild go wrong in
# more ways: a shard left over from an older save, an index that names a file that is not there,
# the same tensor in two files, weights only in PyTorch's `.bin` format. This deep dive reads how
# our offline checkpoints are made, then builds `load_checked`: every file of a folder checked from
# its headers before a single weight is read, each problem named in one line. Then `config.json`
# read without importing transformers' class for the architecture (seconds at start-up with some
# transformers versions), and bfloat16 against float32: rounding, or a bug?
#
# **Where it sits.** It follows notebook 02 and uses only its loader. The core path needs none of
# it: `load_checked` checks, then calls notebook 02's `load_model`, and returns the same model.

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.utils.logging import disable_progress_bar

from minivllm import load_model
from minivllm.checkpoint import PRESETS, preset_config, write_checkpoint
from minivllm.testing import edited_copy, prompt_logits

disable_progress_bar()  # transformers' saving and loading draw no progress bars in the outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHECKPOINTS = Path(os.environ.get("MINIVLLM_CHECKPOINTS", "../../build/checkpoints")).resolve()
tmp_dir = tempfile.TemporaryDirectory(prefix="minivllm-checkpoints-")  # gone with the kernel
TMP = Path(tmp_dir.name)
tiny_path = write_checkpoint(CHECKPOINTS / "tiny", "tiny", seed=0)

# %% [markdown]
# ## How our checkpoints are made
# There is no network on our machines, so `minivllm/checkpoint/maker.py` (a tool, written by hand)
# makes HuggingFace folders with transformers itself: `save_pretrained` writes them, so our loader
# meets the real format. A preset is a `Qwen3Config`; transformers' `Qwen3ForCausalLM` is built on
# the `meta` device (shapes, no memory), given memory, then seeded normal weights, norms drawn
# around 1 rather than set to 1, so that a loader that skipped a norm gives other logits. The
# tokenizer is a byte-level BPE trained on the text that ships with the package; `tiny-text` is
# `tiny` trained on that text for 250 steps (`minivllm/checkpoint/train.py`).

# %%
for name, fields in PRESETS.items():
    print(f"{name:10}", {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")})
with safe_open(tiny_path / "model.safetensors", "pt") as f:
    norm = f.get_tensor("model.layers.0.input_layernorm.weight")
print(f"a norm's weights: mean {norm.mean():.3f}, std {norm.std():.3f}")

# %% [markdown]
# A model too large for one file is written in shards, and `model.safetensors.index.json` maps each
# tensor's name to its shard. `max_shard_size` asks transformers for small shards:

# %%
sharded = write_checkpoint(TMP / "sharded", "tiny", seed=0, max_shard_size="1MB")
index = json.loads((sharded / "model.safetensors.index.json").read_text())
shards = sorted(set(index["weight_map"].values()))
print(f"{len(shards)} shards: {shards[0]} … {shards[-1]}")
print(dict(list(index["weight_map"].items())[:3]))
same = (
    prompt_logits(load_model(sharded), [1, 2, 3]),
    prompt_logits(load_model(tiny_path), [1, 2, 3]),
)
torch.testing.assert_close(*same, rtol=0, atol=0)

# %% [markdown]
# ## Folders that lie
# Notebook 02's `load_model` follows the index when there is one, and copies each tensor as it
# reads it; an error stops it half way, after the model's memory is spent. Worse, some broken
# folders load without an error: with no index, a tensor in two files is copied twice and the last
# copy wins; a `model.safetensors` beside an index that does not name it is skipped, where
# transformers would load it. `load_checked` reads every header first:
#
# 1. **The files**: the index must be readable and name files that exist; a single file beside an
#    index that does not name it is refused (which one did the writer mean?); no safetensors file
#    but PyTorch `.bin` files says so.
# 2. **The headers**: each tensor in exactly one file, the one the index names.
# 3. **The model**: built on `meta`, each tensor's shape copied through its `weight_loader`: the
#    same checks as loading, with no memory and no weights read.
#
# Then it calls `load_model`.

# %% tags=["export"] module="minivllm.models.checked_loader"
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig

from minivllm.models.loader import (
    MODELS,
    Models,
    checkpoint_names,
    load_model,
    load_tensor,
    model_class,
    read_config,
)
from minivllm.models.qwen3 import Qwen3ForCausalLM

INDEX_FILE = "model.safetensors.index.json"


def read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(raw).__name__}")
    return raw


def checked_files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The files the index names, with its tensor name -> file map; with no index, every
    *.safetensors file, and None."""
    index = path / INDEX_FILE
    if not index.is_file():
        if not (files := sorted(path.glob("*.safetensors"))):
            bins = any(path.glob("*.bin"))
            why = "; it holds PyTorch .bin weights; minivllm reads safetensors only" if bins else ""
            raise FileNotFoundError(f"no *.safetensors file in {path}{why}")
        return files, None
    names = read_json(index).get("weight_map")
    if (
        not names
        or not isinstance(names, dict)
        or not all(isinstance(f, str) for f in names.values())
    ):
        raise ValueError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file")
    weight_map = {name: path / file for name, file in names.items()}
    files = sorted(set(weight_map.values()))
    if missing := [f.name for f in files if not f.is_file()]:
        raise FileNotFoundError(f"{index} names {missing}, missing from {path}")
    if (single := path / "model.safetensors").is_file() and single not in files:
        raise ValueError(
            f"{path} holds both {single.name} and {INDEX_FILE}, which does not name it: "
            "transformers would load the first, vLLM the files the index names; delete one"
        )
    return files, weight_map


def tensor_shapes(files: list[Path], weight_map: dict[str, Path] | None) -> dict[str, tuple]:
    """Every tensor's name and shape, from the headers; each in exactly one file, the one the index
    (if any) names."""
    shapes: dict[str, tuple] = {}
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
                f"tensor {first} is in both {owner[first]} and {file} ({count} tensor(s) in two "
                "files): a stray old shard? Keep one copy"
            )
        shapes |= header
        owner |= dict.fromkeys(header, file)
    for name, file in (weight_map or {}).items():
        if owner.get(name) != file:
            where = f"it is in {owner[name]}" if name in owner else "no file holds it"
            raise ValueError(
                f"{file.parent / INDEX_FILE} puts tensor {name} in {file.name}, {where}"
            )
    return shapes


def check_checkpoint(model: Qwen3ForCausalLM, shapes: dict[str, tuple]) -> None:
    """Raise if the checkpoint lacks a tensor, has one too many, or has one of the wrong shape:
    each copy rehearsed on the model's meta tensors, through its weight_loader."""
    needed, tied = checkpoint_names(model), model.config.tie_word_embeddings
    present = {n for n in shapes if not (tied and n == "lm_head.weight")}
    for names, problem in (
        (needed.keys() - present, "is missing {}"),
        (present - needed.keys(), "has {} unexpected"),
    ):
        if names:
            first = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(f"checkpoint {problem.format(len(names))} tensor(s): {first}")
    params = dict(model.named_parameters())
    for name in sorted(present):
        param_name, shard_id = needed[name]
        try:
            load_tensor(params[param_name], torch.empty(shapes[name], device="meta"), shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name}: {e}") from None


def load_checked(
    path: str | Path,
    dtype: torch.dtype | str = "auto",
    device: Any = "cpu",
    config: Any = None,
    models: Models = MODELS,
) -> Qwen3ForCausalLM:
    """load_model's model, after the folder is checked whole from its headers: every error before
    any weight is read; `models` as load_model's."""
    if not (path := Path(path)).is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist or is not a folder")
    config = config or read_config_fast(path, models)
    files, weight_map = checked_files(path)
    shapes = tensor_shapes(files, weight_map)
    with torch.device("meta"):  # a model that holds no memory
        check_checkpoint(model_class(config.architectures, models)(config), shapes)
    return load_model(path, dtype, device, config, models)


# %% [markdown]
# (`read_config_fast` is the last section's.) Each broken copy, through both loaders: the core's
# error, or `loaded` where it loads without one; then `load_checked`'s. The first is one the core
# names too, once it has copied the tensors before it.

# %%
from minivllm.models.checked_loader import load_checked


def wrong_shape(path: Path) -> None:  # a tensor of another shape than config.json gives
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.ones(9)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def another_file(path: Path) -> None:  # a tensor again, in a file of its own
    save_file({"model.norm.weight": torch.zeros(128)}, path / "old.safetensors")


def single_beside_index(path: Path) -> None:  # a sharded save over an older single-file one
    (path / "model.safetensors").write_bytes((tiny_path / "model.safetensors").read_bytes())


def bin_only(path: Path) -> None:
    (path / "model.safetensors").rename(path / "pytorch_model.bin")


def broken_json(path: Path) -> None:
    (path / "config.json").write_text("{not json")


def lost_shard(path: Path) -> None:
    (path / shards[-1]).unlink()


breaks = {  # case: (the folder it breaks, how)
    "a tensor misshapen": (tiny_path, wrong_shape),
    "tensor in two files": (tiny_path, another_file),
    "single file beside an index": (sharded, single_beside_index),
    "a shard gone": (sharded, lost_shard),
    "only .bin weights": (tiny_path, bin_only),
    "config.json not JSON": (tiny_path, broken_json),
}
refused = {}  # (case, loader): the error's type, or None where it loaded
for case, (source, edit) in breaks.items():
    edit(path := edited_copy(source, TMP / case.replace(" ", "-")))
    print(f"{case}:")
    for loader in (load_model, load_checked):
        try:
            loader(path)
            refused[case, loader.__name__] = None
            print(f"  {loader.__name__:12} loaded")
        except (ValueError, OSError) as e:
            refused[case, loader.__name__] = type(e)
            first_line = str(e).splitlines()[0].replace(f"{TMP}/", "")[:150]
            print(f"  {loader.__name__:12} {type(e).__name__}: {first_line}")
assert refused["a tensor misshapen", "load_model"] is ValueError
assert all(refused[case, "load_checked"] for case in breaks)

# %% [markdown]
# Two of the six load without an error in the core: one with the shards where transformers would
# load the single file, one with a wrong weight, the zeros of `old.safetensors`:

# %%
print(load_model(TMP / "tensor-in-two-files").model.norm.weight.abs().max())

# %% [markdown]
# `load_checked` refuses both before any weight is read.
#
# ## config.json without the architecture's class
# Notebook 02 reads `config.json` with `AutoConfig`, which imports the architecture's config class.
# With some transformers versions that import pulls in the generation stack: with transformers 5.17
# on the H200 machine, about 1,700 modules and seconds of the first `LLM()` (measured when this
# reader was written; the cell below counts them on yours). When `config.json` gives every field
# the model reads a value, and RoPE's in transformers 5's form (`rope_parameters`; transformers 4's
# top-level `rope_theta` is moved there), transformers' base `PretrainedConfig` can hold them as
# written. Any other file (a field missing or null, RoPE scaling, an architecture without a field
# list) goes to `AutoConfig`, whose class fills in its defaults: Qwen3Config's
# `tie_word_embeddings` defaults to False, the base class's to True.

# %% tags=["export"] module="minivllm.models.checked_loader"
# the config.json fields each model reads (RoPE's aside): when all are written, no class is imported
CONFIG_FIELDS = {
    "Qwen3ForCausalLM": tuple(
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
        "num_key_value_heads head_dim "
        "hidden_act rms_norm_eps attention_bias tie_word_embeddings max_position_embeddings".split()
    )
}


def read_config_fast(path: Path, models: Models = MODELS) -> PretrainedConfig:
    """read_config's fields, from a plain PretrainedConfig when config.json writes them all out;
    ValueError for a config.json that is not JSON or names no supported architecture."""
    if not (config_file := path / "config.json").is_file():
        raise FileNotFoundError(f"{config_file} not found: a checkpoint folder needs a config.json")
    raw = read_json(config_file)
    architectures = raw.get("architectures") or []
    try:
        model_class(architectures, models)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    no_scaling = raw.pop("rope_scaling", None) is None
    if "rope_parameters" not in raw and "rope_theta" in raw and no_scaling:  # transformers 4's form
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
    fields = CONFIG_FIELDS.get(next(a for a in architectures if a in models), ())
    rope = raw.get("rope_parameters")
    written = fields and all(raw.get(f) is not None for f in fields)
    if written and isinstance(rope, dict) and "rope_theta" in rope:
        return PretrainedConfig.from_dict(raw)
    return read_config(
        path, models
    )  # the architecture's class: its defaults and older keys understood


# %% [markdown]
# Each in a fresh Python, timed, with the modules it imports counted (both depend on the
# transformers installed, the time on this machine too): our config.json in full, in the Hub's
# transformers 4 form, then with a field left out (which goes to `AutoConfig`).

# %%
probe = """import sys, time
from pathlib import Path
from minivllm.models.checked_loader import read_config_fast
from minivllm.models.loader import read_config
reader = {"read_config": read_config, "read_config_fast": read_config_fast}[sys.argv[2]]
before, start = len(sys.modules), time.perf_counter()
config = reader(Path(sys.argv[1]))
seconds, imported = time.perf_counter() - start, len(sys.modules) - before
print(f"{type(config).__name__}: {seconds:.2f} s, {imported} modules imported")"""
rope_4 = lambda c: c.update(rope_theta=c.pop("rope_parameters")["rope_theta"])  # the Hub's form
edits = {"rope_theta": rope_4, "no_bias": lambda c: c.pop("attention_bias")}
paths = [tiny_path, *(edited_copy(tiny_path, TMP / n, config_edit=e) for n, e in edits.items())]
for path in paths:
    for reader in ("read_config", "read_config_fast"):
        command = [sys.executable, "-c", probe, str(path), reader]
        run = subprocess.run(command, capture_output=True, text=True, check=True)
        print(f"{path.name:>10} {reader:>17}: {run.stdout.strip()}")

# %% [markdown]
# The fields each reader gives agree, and so do the logits of the models built from them:

# %%
from minivllm.models.checked_loader import CONFIG_FIELDS, read_config_fast
from minivllm.models.loader import read_config

for path in paths:
    fast, full = read_config_fast(path), read_config(path)
    fields = CONFIG_FIELDS["Qwen3ForCausalLM"]
    assert {f: getattr(fast, f) for f in fields} == {f: getattr(full, f) for f in fields}, path
    logits = [prompt_logits(load_model(path, config=c), [5, 6, 7]) for c in (fast, full)]
    torch.testing.assert_close(*logits, rtol=0, atol=0)
    kinds = type(fast).__name__, type(full).__name__
    print(f"{path.name:>10}: {kinds[0]} and {kinds[1]} agree")

# %% [markdown]
# ## bfloat16: rounding or a bug?
# In bfloat16 (8 significant bits) two correct implementations round differently, far above
# float32's 1e-7, so "close to transformers' bfloat16" is no test. If ours is as close to float32
# as transformers' own bfloat16 is, the difference is rounding (on a GPU, on the 0.6B preset:
# `python -m minivllm.checks.model_parity`).

# %%
from importlib import resources

from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(tiny_path)
corpus = resources.files("minivllm").joinpath("data/tokenizer_corpus.txt").read_text()
ids = torch.tensor([tokenizer.encode(corpus)[:1000]], device=DEVICE)
logits = {}
for dtype in (torch.float32, torch.bfloat16):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=dtype).to(DEVICE)
    with torch.no_grad():
        logits[dtype] = hf_model(ids).logits[0]
fp32, theirs = logits[torch.float32], logits[torch.bfloat16]
ours = prompt_logits(load_model(tiny_path, dtype=torch.bfloat16, device=DEVICE), ids[0].tolist())
top1, gap, same = fp32.argmax(-1), {}, {}
for name, x in {"ours": ours.float(), "theirs": theirs.float()}.items():
    gap[name] = (x - fp32).abs().mean().item()
    same[name] = (x.argmax(-1) == top1).float().mean().item()
    print(
        f"{name:>6}: mean |bf16 - fp32 logit| {gap[name]:.4f}, the same top-1 at {same[name]:.1%}"
    )
assert gap["ours"] <= 1.5 * gap["theirs"] and same["ours"] >= same["theirs"] - 0.02

# %% [markdown]
# ## Where it plugs in
# `load_checked(path, dtype, device, config)` takes `load_model`'s arguments and returns its model:
# a caller that wants the checks calls it instead, and `read_config_fast` can stand where
# `read_config` stood. Neither changes a weight, so every parity check of the course holds with
# either. The tests: `tests/test_checked_loader.py`.
