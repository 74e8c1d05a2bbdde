"""minivllm: a vLLM-style inference engine rebuilt from scratch, one notebook per component."""

import importlib

__version__ = "0.1.0"

# public name -> module that defines it; imported on first use, so `import minivllm` stays light
_LAZY = {
    "LLM": "minivllm.llm",
    "SamplingParams": "minivllm.sampling_params",
    "RequestOutput": "minivllm.outputs",
    "load_model": "minivllm.models.loader",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
