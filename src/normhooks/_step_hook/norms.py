"""Euclidean norms of whole tensors and of rows, precise on the CPU."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._precision import compute_dtype

# torch's CPU reductions (2.13) sum a float32 tensor in a few float32 partial sums, whose
# error grows with their length: for 2**20 equal values the norm is off by 4e-4 (3e-5 for a
# BLAS dot), for 1e8 by 4e-2. Reduced in rows of _CPU_ROW values, whose float64 sums of
# squares are then added, it stays within 1e-6 of float64; tensors of at most _CPU_SHORT
# values, within 3e-6, keep the one multi-tensor call.
_CPU_ROW = 1024
_CPU_SHORT = 4096


def euclidean_norms(tensors: list[Tensor], foreach: bool | None = None) -> Tensor:
    """Euclidean norms of ``tensors`` (one device and dtype), accumulated in at least float32.

    ``foreach=False`` takes one norm per tensor; True or None one multi-tensor call, except
    on the CPU, where tensors of more than ``_CPU_SHORT`` float32/float16/bfloat16 values are
    reduced row by row (rows of ``_CPU_ROW`` values) and added in float64, whatever
    ``foreach`` is: a single float32 reduction of a long tensor is not precise.

    Example:
        >>> euclidean_norms([torch.full((2, 2), 1.5), torch.tensor([3.0, 4.0])])
        tensor([3., 5.])
    """
    dtype = tensors[0].dtype
    acc = compute_dtype(dtype)
    upcast = acc if acc != dtype else None
    if tensors[0].device.type == "cpu" and acc == torch.float32:
        return _cpu_norms(tensors, upcast, foreach)
    return torch.stack(_plain_norms(tensors, upcast, foreach))


def _plain_norms(
    tensors: list[Tensor], upcast: torch.dtype | None, foreach: bool | None
) -> list[Tensor]:
    if foreach is False:
        return [torch.linalg.vector_norm(t, dtype=upcast) for t in tensors]
    return compat.foreach_norm(tensors, dtype=upcast)


def _cpu_norms(tensors: list[Tensor], upcast: torch.dtype | None, foreach: bool | None) -> Tensor:
    """:func:`euclidean_norms` of float32/float16/bfloat16 CPU tensors, in float32."""
    # Each size read once, in one C-level pass: this runs at every step over every tensor.
    numels = list(map(Tensor.numel, tensors))
    if max(numels) <= _CPU_SHORT:
        return torch.stack(_plain_norms(tensors, upcast, foreach))
    long = [i for i, n in enumerate(numels) if n > _CPU_SHORT]
    out = [torch.empty(0)] * len(tensors)
    short = [i for i, n in enumerate(numels) if n <= _CPU_SHORT]
    if short:
        norms = _plain_norms([tensors[i] for i in short], upcast, foreach)
        for i, norm in zip(short, norms, strict=True):
            out[i] = norm
    for i, norm in zip(long, _long_norms([tensors[i] for i in long], upcast), strict=True):
        out[i] = norm
    return torch.stack(out)


def _long_norms(tensors: list[Tensor], upcast: torch.dtype | None) -> list[Tensor]:
    """Norms of long CPU tensors: float32 norms of rows of ``_CPU_ROW`` values (and of the
    tail), whose squares are summed per tensor in float64 with one ``index_add_``."""
    parts, rows = [], []
    for tensor in tensors:
        flat = tensor.reshape(-1)
        whole = flat.numel() // _CPU_ROW * _CPU_ROW
        parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, _CPU_ROW), dim=1, dtype=upcast))
        count = whole // _CPU_ROW
        if whole < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[whole:], dtype=upcast).reshape(1))
            count += 1
        rows.append(count)
    squares = torch.cat(parts).double().square()
    owner = torch.repeat_interleave(
        torch.arange(len(tensors)), torch.tensor(rows), output_size=squares.numel()
    )
    sums = torch.zeros(len(tensors), dtype=torch.float64).index_add_(0, owner, squares)
    return list(sums.sqrt().float().unbind(0))


def row_norms(tensor: Tensor) -> Tensor:
    """The Euclidean norm of each row along dim 0 of a tensor with at least two dimensions,
    in its compute dtype; on the CPU, rows longer than ``_CPU_SHORT`` are reduced in pieces
    of ``_CPU_ROW`` values added in float64, as in :func:`euclidean_norms`.

    Example:
        >>> row_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([5., 1.])
    """
    dtype = tensor.dtype
    norms: Tensor
    if dtype is torch.float64:
        norms = torch.linalg.vector_norm(tensor, dim=_row_dims(tensor.ndim))
        return norms
    acc = torch.float32
    count, length = tensor.shape[0], math.prod(tensor.shape[1:])
    if length <= _CPU_SHORT or not tensor.is_cpu:
        # The dtype only where it differs: vector_norm's dtype= costs a little per call.
        upcast = None if dtype is acc else acc
        norms = torch.linalg.vector_norm(tensor, dim=_row_dims(tensor.ndim), dtype=upcast)
        return norms
    rows = tensor.reshape(count, length)
    whole = length // _CPU_ROW * _CPU_ROW
    pieces = rows[:, :whole].reshape(count, -1, _CPU_ROW)
    squares = torch.linalg.vector_norm(pieces, dim=2, dtype=acc).double().square().sum(1)
    if whole < length:
        tail = torch.linalg.vector_norm(rows[:, whole:], dim=1, dtype=acc)
        squares = squares + tail.double().square()
    norms = squares.sqrt().to(acc)
    return norms


_ROW_DIMS: dict[int, tuple[int, ...]] = {}


def _row_dims(ndim: int) -> tuple[int, ...]:
    """Every dim but 0, made once per number of dimensions."""
    dims = _ROW_DIMS.get(ndim)
    if dims is None:
        dims = _ROW_DIMS[ndim] = tuple(range(1, ndim))
    return dims
