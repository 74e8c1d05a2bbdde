"""The presets' checkpoints, written once and kept: `python -m minivllm` and `python -m
minivllm.serve` run them."""

import os
from pathlib import Path


def checkpoint_for(preset: str) -> Path:
    """The preset's checkpoint folder (seed 0) under $MINIVLLM_CHECKPOINTS, or
    ~/.cache/minivllm/checkpoints: written the first time it is asked for."""
    root = Path(
        os.environ.get("MINIVLLM_CHECKPOINTS", Path.home() / ".cache" / "minivllm" / "checkpoints")
    )
    path = root / preset
    if not (path / "config.json").is_file():
        # imports transformers' models (seconds): only to write
        from minivllm.checkpoint.maker import write_checkpoint

        print(f"writing the {preset} preset to {path}")
        write_checkpoint(path, preset, seed=0)
    return path
