"""Random-weight HuggingFace checkpoints of named presets: `python -m minivllm.checkpoint --preset tiny --out DIR`.

The code is exported from notebooks/02_model.py into `minivllm.checkpoint.maker`.
"""

from minivllm.checkpoint.maker import PRESETS, main, preset_config, train_tokenizer, write_checkpoint

__all__ = ["PRESETS", "main", "preset_config", "train_tokenizer", "write_checkpoint"]
