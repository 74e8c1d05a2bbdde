"""Models and the HuggingFace checkpoint loader, exported from notebooks/02_model.py; `hub.py` (by
hand) resolves Hub ids to folders; `checked_loader.py` (deep dive `checkpoints`) checks a folder
whole before loading.

Supported architectures are listed in `minivllm.models.loader.MODELS`.
"""
