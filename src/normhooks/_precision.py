"""The one rule for low-precision tensors: compute in float32, round once at the end."""

from __future__ import annotations

import torch
from torch import Tensor

HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a computation on ``dtype`` tensors runs in: float32 for float16/bfloat16."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def upcast(tensor: Tensor) -> Tensor:
    """``tensor`` in its compute dtype (itself when that is its own dtype)."""
    return tensor.float() if tensor.dtype in HALF_DTYPES else tensor
