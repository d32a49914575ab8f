"""What the kernels share: dtypes, exact scalar arguments, IEEE-rounded division and roots.

Loops whose bounds are known only at run time are written as ``while`` loops, not
``tl.range``: Triton's interpreter (``TRITON_INTERPRET=1``, which the CPU test suite runs)
turns a run-time ``tl.range`` bound into a Python int through a 1-element array, which
NumPy 2.4 refuses; a ``while`` condition only needs its truth value. Both compile alike.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from normhooks._precision import compute_dtype

TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype of ``dtype``; a clear error for any dtype the kernels do not cover."""
    try:
        return TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"the Triton kernels take float16, bfloat16, float32 or float64 tensors, got {dtype}"
        ) from None


def acc_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype the kernels compute ``dtype`` tensors in (float32 for halves)."""
    return TL_DTYPES[compute_dtype(dtype)]


def bits(value: float) -> int:
    """``value``'s float64 bit pattern, for :func:`as_float`.

    Triton passes a Python float as a float32 argument, which would round ``eps=1e-9`` before a
    float64 kernel sees it; the bits travel as an int64 (in ``do_not_specialize`` arguments) and
    are rounded once, to the kernel's compute dtype, as torch rounds a scalar operand.
    """
    pattern: int = struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return pattern


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Launches on ``device``: Triton launches on the current CUDA device."""
    if device.type != "cuda" or device.index in (None, torch.cuda.current_device()):
        yield
        return
    with torch.cuda.device(device):
        yield


@triton.jit
def as_float(pattern, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    return pattern.to(tl.int64).to(tl.float64, bitcast=True).to(acc)


@triton.jit
def div(x, y, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    # Triton's float32 "/" may be an approximate division; torch's is rounded to nearest.
    if acc == tl.float32:
        return tl.div_rn(x, y)
    else:
        return x / y


@triton.jit
def sqrt(x, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    if acc == tl.float32:
        return tl.sqrt_rn(x)
    else:
        return tl.sqrt(x)


@triton.jit
def is_finite(x):  # type: ignore[no-untyped-def]
    # NaN fails both comparisons; +-inf fails the second.
    return (x == x) & (tl.abs(x) != float("inf"))
