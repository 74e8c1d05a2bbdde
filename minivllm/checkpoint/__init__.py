"""HuggingFace checkpoints of named presets: `python -m minivllm.checkpoint --preset tiny --out
DIR`.

Random weights, except `tiny-text`: tiny's shapes trained on the tokenizer's corpus, so that its
greedy output reads as text. Tooling the course uses but does not build, all written by hand: the
maker in `minivllm.checkpoint.maker`, the training loop in `minivllm.checkpoint.train`, the cache of
written presets in `minivllm.checkpoint.cache`. The maker's names are imported when first used: it
loads transformers' models (seconds), which `checkpoint_for` needs only to write a checkpoint.
"""

import importlib
from typing import TYPE_CHECKING, Any

from minivllm.checkpoint.cache import checkpoint_for

if TYPE_CHECKING:
    from minivllm.checkpoint.maker import (
        PRESETS,
        main,
        preset_config,
        train_tokenizer,
        write_checkpoint,
    )

__all__ = [
    "PRESETS",
    "checkpoint_for",
    "main",
    "preset_config",
    "train_tokenizer",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("minivllm.checkpoint.maker"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
