"""minivllm: a vLLM-style inference engine rebuilt from scratch, one notebook per component."""

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute) that defines it; imported on first use, so `import minivllm`
# stays light. `LLM`: notebook 06's with every production layer (deep dive fast_engine).
_LAZY = {
    "LLM": ("minivllm.production", "ProductionLLM"),
    "SamplingParams": ("minivllm.sampling_params", "SamplingParams"),
    "RequestOutput": ("minivllm.outputs", "RequestOutput"),
    "load_model": ("minivllm.models.loader", "load_model"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
