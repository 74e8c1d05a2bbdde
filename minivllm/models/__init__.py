"""Models and the HuggingFace checkpoint loader, exported from notebooks/02_model.py.

Supported architectures are listed in `minivllm.models.loader.MODELS`.
"""
