"""Attention kernels with flash-attn's calling convention. (The small layers' kernels,
`minivllm.kernels.small_layers`, belong to the deep dive triton_layers: import that module by name;
this package does not.)

Without CUDA, Triton kernels run in Triton's interpreter. It is chosen when `@triton.jit` runs, so
the switch must be set here, before any kernel module is imported.

`flash_attn_varlen_func` comes from a deep dive's module (deep_dives/paged_prefill), imported on
first access (PEP 562's module `__getattr__`), so importing this package imports no deep dive.
"""

import importlib
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.kernels.paged_attn import flash_attn_with_kvcache, store_kvcache  # noqa: E402
from minivllm.kernels.reference import attention_ref  # noqa: E402

# name -> the module that defines it
_LAZY = {"flash_attn_varlen_func": "minivllm.kernels.paged_prefill"}

__all__ = ["attention_ref", "flash_attn_varlen_func", "flash_attn_with_kvcache", "store_kvcache"]


def __getattr__(name: str) -> Any:
    """A lazy name's value, imported on first access and then kept here: later accesses are plain
    lookups."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)  # the public names, the lazy one included
