"""minivllm: a vLLM-style inference engine rebuilt from scratch, one notebook per component."""

__version__ = "0.1.0"
