"""Fixtures shared by every test."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when @triton.jit decorates, so it is set before anything imports a
    # kernel module: without a GPU, tests/test_kernels.py runs the kernels on CPU tensors
    # through Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
