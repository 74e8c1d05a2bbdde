"""Hub ids resolved to folders, as transformers and vLLM resolve them: a local folder of that name
wins; else `huggingface_hub.snapshot_download` returns the id's snapshot in the Hub cache,
downloading only the files the engine reads (`MODEL_FILES`). `HF_HUB_OFFLINE=1` with a cached
snapshot works; every miss is one line saying what to do."""

from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# what the engine reads from a Hub repo: the tokenizer (and its chat template), then the config and
# the weights
TOKENIZER_FILES = [
    "tokenizer*",
    "vocab.*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
]
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    *TOKENIZER_FILES,
]


def resolve_model(
    model: str | Path,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    files=MODEL_FILES,
) -> Path:
    """A local folder as it is; else a Hub id's snapshot folder, from the Hub cache or downloaded
    into it."""
    if (folder := Path(model).expanduser()).is_dir():
        return folder
    name, cache = str(model), download_dir or constants.HF_HUB_CACHE
    try:
        snapshot = Path(
            snapshot_download(name, revision=revision, cache_dir=download_dir, allow_patterns=files)
        )
    except HFValidationError:
        raise FileNotFoundError(f"{name}: no such folder, and not a Hub id (ORG/NAME)") from None
    except GatedRepoError:
        raise PermissionError(
            f"{name} is gated: accept its terms on huggingface.co/{name}, then `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{name}: no such folder, and no such Hub repo (a private one needs `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{name}: the Hub repo has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        at = f" at revision {revision}" if revision else ""
        raise FileNotFoundError(
            f"{name}: no such folder, not in the Hub cache {cache}{at}, and {why}: download it "
            f"where there is a "
            "network (`hf download`), or pass a folder"
        ) from None
    if files is MODEL_FILES and not any(snapshot.glob("*.safetensors")):
        raise ValueError(
            f"{name} has no *.safetensors weights: minivllm reads safetensors, not PyTorch .bin "
            f"files"
        )
    return snapshot


def load_error_line(error: Exception, model: str, tokenizer: str | None = None) -> str:
    """A command line's one line for an engine that could not start: the error's first line, naming
    the model (or the tokenizer) as the user gave it with its flag: `--model ORG/NAME: no such
    folder, ...`."""
    message = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    named = [("--model", model), ("--tokenizer", tokenizer or "")]
    # the longer first: a/b-tok before a/b
    for flag, name in sorted(named, key=lambda pair: -len(pair[1])):
        if name and message.startswith(name):
            return f"{flag} {message}"
    return f"--model {model}: {message}"
