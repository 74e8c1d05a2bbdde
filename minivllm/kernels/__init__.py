"""Attention kernels with flash-attn's calling convention. (The small layers' kernels, `minivllm.kernels.small_layers`,
belong to the deep dive triton_layers: import that module by name; this package does not.)

Without CUDA, Triton kernels run in Triton's interpreter. It is chosen when `@triton.jit` runs, so the
switch must be set here, before any kernel module is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.kernels.paged_attn import flash_attn_varlen_func, flash_attn_with_kvcache, store_kvcache  # noqa: E402
from minivllm.kernels.reference import attention_ref  # noqa: E402

__all__ = ["attention_ref", "flash_attn_varlen_func", "flash_attn_with_kvcache", "store_kvcache"]
