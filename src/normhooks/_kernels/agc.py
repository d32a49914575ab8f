r"""Adaptive gradient clipping for every tensor of one device and dtype in two kernel launches.

A description on the multi-tensor machinery of :mod:`normhooks._kernels._multi`, with rows
along dim 0 (:data:`~normhooks._kernels._multi.DIM0`: a unit of AGC; a tensor of fewer than
two dimensions is one row), each cut into chunks of at most ``_CHUNK`` values. Launch 1 sums
the squares of :math:`W_i` and :math:`G_i` in each chunk; the program that completes a row's
sums writes the row's factor :math:`\min(1, \lambda \max(\|W_i\|, \epsilon) / \|G_i\|)` and
ratio :math:`\|G_i\| / \max(\|W_i\|, \epsilon)` into the partial-sum slots of the row's first
chunk (read by then), and each tensor's first program zeroes its largest ratio. Launch 2 runs
one program per chunk again: it multiplies the chunk by its row's factor (a factor of 1
writes nothing, unless the gradients are unscaled or checked for inf/NaN on the way), and
each row's first program raises its tensor's largest ratio with an integer atomic max on the
ratio's bits: ratios are non-negative (or a positive NaN), whose bits order as their values
do, so the result does not depend on the order programs run in.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels import _multi
from normhooks._kernels._cache import KeyedCache
from normhooks._kernels._common import (
    acc_dtype,
    as_float,
    bits,
    device_index,
    div,
    is_finite,
    on_device,
    sqrt,
)
from normhooks._kernels._common import tl_dtype as _tl_dtype
from normhooks._kernels._launch import Kernel
from normhooks._kernels._multi import KernelFailedError, chunk_at, row_sums, tensor_at
from normhooks._precision import compute_dtype

# Values per program: a chunk is at most _CHUNK values of one row, read _BLOCK at a time.
_BLOCK = 1024
_CHUNK = 32 * _BLOCK
# Partial sums added at a time by the last program of a row.
_PARTIALS_BLOCK = 128
# Triton passes an int argument as int32 when it fits, as int64 otherwise.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@triton.jit
def _inverse_scale(grad_scale, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    """``1 / grad_scale`` as GradScaler computes it (in float64, rounded to float32), in
    ``acc``: the gradients are unscaled before their norms, as the plain path unscales them,
    so a scaled sum of squares cannot overflow where the true one does not."""
    return (1.0 / tl.load(grad_scale).to(tl.float64)).to(tl.float32).to(acc)


@triton.jit(do_not_specialize=["clipping", "eps"])
def _squares_and_factors(  # type: ignore[no-untyped-def]
    w_ptrs,
    g_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    row_first_chunk,
    arrivals,
    scratch,
    maxima,
    grad_scale,
    clipping,
    eps,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    partials_block: tl.constexpr,
    scaled: tl.constexpr,
):
    chunk, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    w = tensor_at(w_ptrs, tensor, dtype)
    g = tensor_at(g_ptrs, tensor, dtype)
    if start == 0:
        # The tensor's first chunk: launch 2 raises its largest ratio from zero.
        tl.store(maxima + tensor, 0.0)
    if scaled:
        inverse = _inverse_scale(grad_scale, acc)
    w_acc = tl.zeros([block], dtype=acc)
    g_acc = tl.zeros([block], dtype=acc)
    # A row is usually far shorter than a chunk: the loop stops at the row's end (a while
    # loop: see _common on run-time bounds).
    offset = start
    while offset < stop:
        index = offset + tl.arange(0, block)
        mask = index < stop
        w_values = tl.load(w + index, mask=mask, other=0.0).to(acc)
        g_values = tl.load(g + index, mask=mask, other=0.0).to(acc)
        if scaled:
            g_values = g_values * inverse
        w_acc += w_values * w_values
        g_acc += g_values * g_values
        offset += block
    last, w_squares, g_squares = row_sums(
        tl.sum(w_acc, axis=0),
        tl.sum(g_acc, axis=0),
        chunk,
        row,
        row_first_chunk,
        arrivals,
        scratch,
        acc,
        partials_block,
    )
    if last:
        w_norm = sqrt(w_squares, acc)
        g_norm = sqrt(g_squares, acc)
        # clamp(min=eps), which keeps a NaN norm NaN (tl.maximum need not).
        floor = as_float(eps, acc)
        bounded = tl.where(w_norm < floor, floor, w_norm)
        max_norm = bounded * as_float(clipping, acc)
        # Only where ||G|| > max_norm >= 0 is ||G|| divided by, so a zero gradient never is
        # (where() computes both branches: the other divides by 1).
        clipped = g_norm > max_norm
        factor = tl.where(clipped, div(max_norm, tl.where(clipped, g_norm, 1.0), acc), 1.0)
        # 0 for a zero gradient (no 0/0 with eps=0); a zero unit with eps=0 has ratio inf.
        moved = g_norm > 0.0
        ratio = tl.where(moved, div(g_norm, tl.where(moved, bounded, 1.0), acc), 0.0)
        first = tl.load(row_first_chunk + row)
        tl.store(scratch + 2 * first, factor.to(acc))
        tl.store(scratch + 2 * first + 1, ratio.to(acc))


_SQUARES_AND_FACTORS = Kernel(_squares_and_factors)


@triton.jit
def _rescale(  # type: ignore[no-untyped-def]
    g,
    start,
    stop,
    factor,
    inverse,
    found_inf,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    scaled: tl.constexpr,
    flag_overflow: tl.constexpr,
):
    """``g[start:stop] <- factor * (g * inverse)`` (``* inverse`` only when ``scaled``),
    raising ``found_inf`` where a written value is not finite (with ``flag_overflow``)."""
    finite = tl.full([block], 1, dtype=tl.int1)
    offset = start
    while offset < stop:
        index = offset + tl.arange(0, block)
        mask = index < stop
        values = tl.load(g + index, mask=mask, other=0.0).to(acc)
        if scaled:
            values = values * inverse
        written = (values * factor).to(dtype)
        tl.store(g + index, written, mask=mask)
        if flag_overflow:
            finite = finite & is_finite(written.to(acc))
        offset += block
    if flag_overflow:
        overflow = tl.min(finite.to(tl.int32), axis=0) == 0
        tl.atomic_max(found_inf, 1.0, mask=overflow)


@triton.jit
def _clip(  # type: ignore[no-untyped-def]
    g_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    row_first_chunk,
    scratch,
    maxima,
    grad_scale,
    found_inf,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    ratio_bits: tl.constexpr,
    block: tl.constexpr,
    scaled: tl.constexpr,
    flag_overflow: tl.constexpr,
):
    chunk, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    g = tensor_at(g_ptrs, tensor, dtype)
    first = tl.load(row_first_chunk + row)
    factor = tl.load(scratch + 2 * first)
    if scaled:
        inverse = _inverse_scale(grad_scale, acc)
        _rescale(g, start, stop, factor, inverse, found_inf, dtype, acc, block, True, flag_overflow)
    elif flag_overflow:
        # Every value is checked, an unclipped row's too.
        _rescale(g, start, stop, factor, 1.0, found_inf, dtype, acc, block, False, True)
    elif factor != 1.0:
        # g * 1 is g, bit for bit (a NaN stays NaN): an unclipped row is left unwritten.
        _rescale(g, start, stop, factor, 1.0, found_inf, dtype, acc, block, False, False)
    if chunk == first:
        # |ratio|: the bits of a NaN with its sign cleared order above every other ratio's,
        # as amax puts NaN above them.
        ratio = tl.abs(tl.load(scratch + 2 * first + 1)).to(ratio_bits, bitcast=True)
        slot = maxima.to(tl.pointer_type(ratio_bits)) + tensor
        # A read first, possibly stale (never above the true maximum): only a ratio above it
        # contends for the atomic, which many rows of one tensor would otherwise all do.
        seen = tl.load(slot)
        tl.atomic_max(slot, ratio, mask=ratio > seen)


_CLIP = Kernel(_clip)


# The compiled variants of both kernels, by everything Triton specializes them on except the
# alignment of the pointers that _launch.Kernel checks at each launch.
_variants: KeyedCache[tuple[object, ...], tuple[dict[Any, Any], dict[Any, Any]]] = KeyedCache()


def _compiled(
    device: torch.device,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None,
    flag_overflow: bool,
    scalars: tuple[int, ...],
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The caches of compiled ``_squares_and_factors`` and ``_clip`` for one call signature.

    Triton keeps compiled kernels per device and specializes them on the dtype of every
    pointer (the tensors' and the scale's; the scratch, the maxima and the overflow flag
    follow from the dtype), on each constexpr (``scaled``, ``flag_overflow`` and the block
    sizes) and on whether each int argument fits 32 bits (the scalars' bit patterns:
    ``do_not_specialize`` keeps their values out, not their type). Every one of those is in
    the key.
    """
    key = (
        device,
        dtype,
        scale_dtype,
        flag_overflow,
        tuple([_INT32_MIN <= value <= _INT32_MAX for value in scalars]),
        _BLOCK,
        _PARTIALS_BLOCK,
    )
    return _variants.get_or_make(key, lambda: ({}, {}))


def agc_unit_(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    clipping: float,
    eps: float,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    kept: dict[object, object] | None = None,
    allowed: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    r"""Clips each row of ``grads`` in place, as :func:`normhooks.agc_` does, in two launches.

    For each row :math:`i` along dim 0 of a tensor of two or more dimensions (the whole
    tensor otherwise), with :math:`b_i = \max(\|W_i\|, \epsilon)`:
    :math:`G_i \leftarrow (\lambda b_i / \|G_i\|)\,G_i` where :math:`\|G_i\| > \lambda b_i`,
    unchanged elsewhere. With ``grad_scale`` (:math:`s`, a GradScaler's scale) the gradients
    arrive scaled: each value is unscaled as GradScaler unscales it (times :math:`1/s`
    rounded to float32) before it enters a norm or is clipped and written. With
    ``found_inf`` (a 1-element float32 tensor), it is set to 1 if any written value is not
    finite, and left alone otherwise. float16/bfloat16 are computed in float32 and rounded
    once.

    Steady state: no host synchronization; tables of addresses as in
    :func:`normhooks._kernels.lars.lars_unit_` (built on first use of a set of tensors,
    reused while they keep their addresses and shapes; tensors whose rows are not laid out
    as the kernels read them go through contiguous copies).

    Args:
        params: the parameters :math:`W`, all of one device and floating dtype.
        grads: their gradients :math:`G`, same shapes, device and dtype.
        clipping: :math:`\lambda`.
        eps: :math:`\epsilon`.
        grad_scale: the scale the gradients carry, or None.
        found_inf: the overflow flag to raise, or None.
        kept: where the caller keeps what is built for exactly these tensors, or None (see
            :func:`normhooks._kernels._multi.prepared`).
        allowed: whether the kernels may run on a tensor (the package's ``available``), for
            the launches' replay kept in ``kept`` (:class:`~normhooks._kernels._multi.Replay`);
            None keeps none.

    Returns:
        Each tensor's largest ratio :math:`\|G_i\| / b_i` before clipping (0 for a zero
        gradient), 1-D, in float32 for half dtypes and in the dtype otherwise.
    """
    if not params and not grads:
        return torch.empty(0)
    device, dtype = params[0].device, params[0].dtype
    if found_inf is not None and (found_inf.dtype != torch.float32 or found_inf.numel() != 1):
        raise ValueError(
            "found_inf must be a 1-element float32 tensor (GradScaler's flag), got "
            f"{found_inf.dtype} with {found_inf.numel()} elements"
        )
    scalars = (bits(clipping), bits(eps))
    index = device_index(device)
    with on_device(index):
        capturing = _multi.capturing(device)
        (params, grads), (param_copies, copied), table = _multi.prepared(
            [params, grads], ("params", "grads"), _multi.DIM0, _CHUNK, capturing, "AGC", kept
        )
        scale = grad_scale
        if grad_scale is not None and grad_scale.device != device:
            scale = grad_scale.to(device)
        first, second = _compiled(
            device,
            dtype,
            None if scale is None else scale.dtype,
            found_inf is not None,
            scalars,
        )
        run = functools.partial(
            _run, table, index, len(params), first, second, scalars, dtype, device
        )
        maxima = run(scale, found_inf)
        _multi.keep_replay(
            kept,
            not param_copies
            and not copied
            and scale is None
            and found_inf is None
            and not capturing,
            table,
            params[0],
            lambda lr: run(None, None),
            allowed,
        )
    for grad, copy in copied:
        grad.copy_(copy)
    return maxima


def _run(
    table: _multi.ChunkTable,
    index: int | None,
    count: int,
    first: dict[Any, Any],
    second: dict[Any, Any],
    scalars: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    scale: Tensor | None,
    found_inf: Tensor | None,
) -> Tensor:
    """The outputs of :func:`agc_unit_` made, then its two launches; returns the maxima."""
    acc = compute_dtype(dtype)
    # Two values per chunk: its partial sums, then its row's factor and ratio.
    scratch = torch.empty(2 * table.chunks, dtype=acc, device=device)
    maxima = torch.empty(count, dtype=acc, device=device)
    try:
        _launch(
            (table.chunks, 1),
            index,
            table,
            scratch,
            maxima,
            maxima if scale is None else scale,
            maxima if found_inf is None else found_inf,
            first,
            second,
            scalars,
            _tl_dtype(dtype),
            acc_dtype(dtype),
            scale is not None,
            found_inf is not None,
        )
    except Exception as error:
        # A kernel that cannot compile or launch here fails before it writes: the caller
        # computes the plain formula (normhooks._kernels.agc_unit_).
        raise KernelFailedError(error) from error
    return maxima


def _launch(
    grid: tuple[int, int],
    index: int | None,
    table: _multi.ChunkTable,
    scratch: Tensor,
    maxima: Tensor,
    scale: Tensor,
    flag: Tensor,
    first: dict[Any, Any],
    second: dict[Any, Any],
    scalars: tuple[int, ...],
    dtype_tl: Any,
    acc_tl: Any,
    scaled: bool,
    flag_overflow: bool,
) -> None:
    """The two launches of :func:`agc_unit_`."""
    _SQUARES_AND_FACTORS(
        first,
        grid,
        index,
        (table.storage, scale),
        *table.located,
        table.row_first_chunk,
        table.arrivals,
        scratch,
        maxima,
        scale,
        *scalars,
        dtype_tl,
        acc_tl,
        _BLOCK,
        _PARTIALS_BLOCK,
        scaled,
    )
    _CLIP(
        second,
        grid,
        index,
        (table.storage, scale, flag),
        table.pointers[1],
        table.chunk_tensor,
        table.chunk_row,
        table.chunk_start,
        table.chunk_stop,
        table.row_first_chunk,
        scratch,
        maxima,
        scale,
        flag,
        dtype_tl,
        acc_tl,
        tl.int64 if acc_tl == tl.float64 else tl.int32,
        _BLOCK,
        scaled,
        flag_overflow,
    )
