"""HuggingFace checkpoints of named presets: `python -m minivllm.checkpoint --preset tiny --out DIR`.

Random weights, except `tiny-text`: tiny's shapes trained on the tokenizer's corpus, so that its greedy output
reads as text. The maker is exported from notebooks/02_model.py into `minivllm.checkpoint.maker`; the training
loop is written by hand in `minivllm.checkpoint.train`.
"""

from minivllm.checkpoint.maker import PRESETS, main, preset_config, train_tokenizer, write_checkpoint

__all__ = ["PRESETS", "main", "preset_config", "train_tokenizer", "write_checkpoint"]
