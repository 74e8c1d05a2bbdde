"""pytest set-up for tests/, notebooks/ and solutions/ (nbval)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton decides interpreter-or-GPU when @triton.jit runs: set it before any kernel module is imported.
    # Notebook kernels started by nbval inherit this environment.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
