r"""The trust ratio for every tensor of one device and dtype in three kernel launches per step.

A description on the multi-tensor machinery of :mod:`normhooks._kernels._multi` (each tensor
one row, cut into chunks of ``_CHUNK`` values). Before the optimizer's step, launch 1 copies
every parameter into the hook's flat buffer and sums the squares of :math:`w_{old}` on the way
(:func:`copy_and_squares`). After it, launch 2 reads :math:`w_{old}` and :math:`w_{new}` and
sums the squares of :math:`d = w_{old} - w_{new}`, without writing :math:`d`; the program that
completes a tensor's sums writes its ratio. Launch 3 writes :math:`w \leftarrow w_{new} + (1 -
r)\,d` (:func:`rescale_updates`). Two launches after the step are what the maths allows: the
ratio needs the whole tensor's norm before any value can be written.

The old values are found as one flat buffer and each tensor's offset in it, not through the
table: the buffer goes back to the caching allocator between steps and may come back at
another address, while the parameters' table stays valid. The parameters must be contiguous
(the flat buffer holds them in their logical order, which eager code reads as well); the
caller checks that, and keeps the offsets with the buffer. All three launch through
:class:`~normhooks._kernels._launch.Kernel`.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

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
    on_device,
    sqrt,
)
from normhooks._kernels._common import tl_dtype as _tl_dtype
from normhooks._kernels._launch import Kernel
from normhooks._kernels._multi import chunk_at, row_sums, tensor_at
from normhooks._precision import compute_dtype

# Values per program: a chunk is _CHUNK values of one tensor, read _BLOCK at a time.
_BLOCK = 1024
_CHUNK = 32 * _BLOCK
# Partial sums added at a time by the last program of a tensor.
_PARTIALS_BLOCK = 128
# Triton passes an int argument as int32 when it fits, as int64 otherwise.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_TECHNIQUE = "TrustRatio"


@triton.jit
def _copy_squares(  # type: ignore[no-untyped-def]
    p_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    row_first_chunk,
    arrivals,
    partials,
    olds,
    offsets,
    squares,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    chunk_size: tl.constexpr,
    partials_block: tl.constexpr,
):
    chunk, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    p = tensor_at(p_ptrs, tensor, dtype)
    old = olds + tl.load(offsets + tensor)
    total = tl.zeros([block], dtype=acc)
    for offset in tl.range(0, chunk_size, block):
        index = start + offset + tl.arange(0, block)
        mask = index < stop
        values = tl.load(p + index, mask=mask, other=0.0)
        tl.store(old + index, values, mask=mask)
        wide = values.to(acc)
        total += wide * wide
    last, sums, _ = row_sums(
        tl.sum(total, axis=0),
        # row_sums adds two sums: the second is unused here, a zero of the same type.
        tl.full((), 0.0, dtype=acc),
        chunk,
        row,
        row_first_chunk,
        arrivals,
        partials,
        acc,
        partials_block,
    )
    if last:
        tl.store(squares + row, sums)


_COPY_SQUARES = Kernel(_copy_squares)


@triton.jit
def _ratio(  # type: ignore[no-untyped-def]
    w_squares,
    d_squares,
    lr_tensor,
    lr,
    threshold,
    eps,
    trust_coefficient,
    clip,
    floor,
    max_weight_norm,
    acc: tl.constexpr,
    lr_is_tensor: tl.constexpr,
    has_eps: tl.constexpr,
    has_trust: tl.constexpr,
    has_clip: tl.constexpr,
    has_floor: tl.constexpr,
    has_max: tl.constexpr,
):
    """:func:`normhooks.trust_ratio.trust_ratios` of one tensor, in its order of operations."""
    w_norm = sqrt(w_squares, acc)
    d_norm = sqrt(d_squares, acc)
    if lr_is_tensor:
        u_norm = div(d_norm, tl.load(lr_tensor).to(acc), acc)
    else:
        u_norm = div(d_norm, as_float(lr, acc), acc)
    denominator = u_norm
    if has_eps:
        denominator = u_norm + as_float(eps, acc)
    phi = w_norm
    if has_max:
        # Not tl.minimum: a NaN norm stays NaN, as torch.clamp leaves it.
        cap = as_float(max_weight_norm, acc)
        phi = tl.where(w_norm > cap, cap, w_norm)
    ratio = div(phi, denominator, acc)
    if has_trust:
        ratio = ratio * as_float(trust_coefficient, acc)
    if has_floor:
        low = as_float(floor, acc)
        ratio = tl.where(ratio < low, low, ratio)
    if has_clip:
        high = as_float(clip, acc)
        ratio = tl.where(ratio > high, high, ratio)
    scaled = (w_norm > as_float(threshold, acc)) & (u_norm > 0.0)
    return tl.where(scaled, ratio, 1.0).to(acc)


@triton.jit(
    do_not_specialize=[
        "lr",
        "threshold",
        "eps",
        "trust_coefficient",
        "clip",
        "floor",
        "max_weight_norm",
    ]
)
def _update_squares_and_ratios(  # type: ignore[no-untyped-def]
    p_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    row_first_chunk,
    arrivals,
    partials,
    olds,
    offsets,
    w_squares,
    ratios,
    lr_tensor,
    lr,
    threshold,
    eps,
    trust_coefficient,
    clip,
    floor,
    max_weight_norm,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    chunk_size: tl.constexpr,
    partials_block: tl.constexpr,
    lr_is_tensor: tl.constexpr,
    has_eps: tl.constexpr,
    has_trust: tl.constexpr,
    has_clip: tl.constexpr,
    has_floor: tl.constexpr,
    has_max: tl.constexpr,
):
    chunk, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    p = tensor_at(p_ptrs, tensor, dtype)
    old = olds + tl.load(offsets + tensor)
    total = tl.zeros([block], dtype=acc)
    for offset in tl.range(0, chunk_size, block):
        index = start + offset + tl.arange(0, block)
        mask = index < stop
        # The difference rounded to the parameters' dtype, as the eager w_old - w_new is
        # (taken in acc: a no-op for float32 and float64, and halves' arithmetic is float32's).
        old_values = tl.load(old + index, mask=mask, other=0.0).to(acc)
        new_values = tl.load(p + index, mask=mask, other=0.0).to(acc)
        wide = (old_values - new_values).to(dtype).to(acc)
        total += wide * wide
    last, d_squares, _ = row_sums(
        tl.sum(total, axis=0),
        # row_sums adds two sums: the second is unused here, a zero of the same type.
        tl.full((), 0.0, dtype=acc),
        chunk,
        row,
        row_first_chunk,
        arrivals,
        partials,
        acc,
        partials_block,
    )
    if last:
        ratio = _ratio(
            tl.load(w_squares + row),
            d_squares,
            lr_tensor,
            lr,
            threshold,
            eps,
            trust_coefficient,
            clip,
            floor,
            max_weight_norm,
            acc,
            lr_is_tensor,
            has_eps,
            has_trust,
            has_clip,
            has_floor,
            has_max,
        )
        tl.store(ratios + row, ratio)


_UPDATE_SQUARES_AND_RATIOS = Kernel(_update_squares_and_ratios)


@triton.jit
def _rescale(  # type: ignore[no-untyped-def]
    p_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    olds,
    offsets,
    ratios,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    chunk_size: tl.constexpr,
):
    _, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    p = tensor_at(p_ptrs, tensor, dtype)
    old = olds + tl.load(offsets + tensor)
    # 1 - r rounded to the parameters' dtype, as the eager factor is: r = 1 leaves w_new as
    # it is, bit for bit.
    factor = (1.0 - tl.load(ratios + row)).to(dtype).to(acc)
    for offset in tl.range(0, chunk_size, block):
        index = start + offset + tl.arange(0, block)
        mask = index < stop
        new = tl.load(p + index, mask=mask, other=0.0).to(acc)
        d = (tl.load(old + index, mask=mask, other=0.0).to(acc) - new).to(dtype).to(acc)
        tl.store(p + index, (new + d * factor).to(dtype), mask=mask)


_RESCALE = Kernel(_rescale)


# The compiled variants, by everything Triton specializes them on except the alignment of the
# pointers that _launch.Kernel checks at each launch.
_variants: KeyedCache[tuple[object, ...], tuple[dict[Any, Any], ...]] = KeyedCache()


def _compiled(
    device: torch.device, dtype: torch.dtype, flags: tuple[bool, ...], scalars: tuple[int, ...]
) -> tuple[dict[Any, Any], ...]:
    """The caches of the compiled kernels for one call signature: the device, the dtype
    (every pointer's dtype follows from it), the constexprs and whether each int argument
    fits 32 bits."""
    key = (
        device,
        dtype,
        flags,
        tuple([_INT32_MIN <= value <= _INT32_MAX for value in scalars]),
        _BLOCK,
        _CHUNK,
        _PARTIALS_BLOCK,
    )
    return _variants.get_or_make(key, lambda: ({}, {}, {}))


def _table(
    params: list[Tensor],
    flat: Tensor,
    offsets: Tensor,
    total: int,
    capturing: bool,
    kept: dict[object, object] | None = None,
) -> _multi.ChunkTable:
    """The parameters' table, after the checks that cost nothing per tensor (the caller keeps
    ``offsets`` and ``total`` with ``flat``, made once from its views' places); ``kept``
    as in :func:`normhooks._kernels._multi.prepared`."""
    if flat.dtype != params[0].dtype or flat.device != params[0].device:
        raise ValueError(
            f"the flat buffer is a {flat.dtype} tensor on {flat.device}; the parameters are "
            f"{params[0].dtype} on {params[0].device}"
        )
    if not flat.is_contiguous() or flat.numel() != total or offsets.numel() != len(params):
        raise ValueError(
            f"the flat buffer must be contiguous with {total} values and one offset per "
            f"parameter, got {flat.numel()} values and {offsets.numel()} offsets for "
            f"{len(params)} parameters"
        )
    if kept is None:
        return _multi.table([params], ("params",), _multi.WHOLE, _CHUNK, capturing, _TECHNIQUE)
    return _multi.prepared(
        [params], ("params",), _multi.WHOLE, _CHUNK, capturing, _TECHNIQUE, kept
    )[2]


def copy_and_squares(
    params: list[Tensor],
    flat: Tensor,
    offsets: Tensor,
    total: int,
    kept: dict[object, object] | None = None,
) -> Tensor:
    r"""Copies ``params`` into ``flat`` (each from its offset) and returns each one's
    :math:`\sum w^2`, in one launch.

    The sums are in the parameters' compute dtype (float32 for halves), on their device; no
    host synchronization. Raises :class:`~normhooks._kernels._multi.KernelFailedError` where
    the kernel failed to compile or launch (before :func:`rescale_updates` could use it).

    Args:
        params: the parameters, contiguous, of one device and floating dtype.
        flat: a contiguous buffer of their dtype and device, at least as long as their
            sizes added (the hook's pads each parameter to a row on the CPU).
        offsets: where each parameter starts in ``flat`` (int64, on the device), the
            parameters' places not overlapping.
        total: ``flat``'s size.
        kept: where the caller keeps what is built for exactly these parameters, or None
            (see :func:`normhooks._kernels._multi.prepared`). The rescale after the step
            takes none: the optimizer's step came in between.
    """
    device, dtype = params[0].device, params[0].dtype
    acc = compute_dtype(dtype)
    with on_device(device_index(device)):
        capturing = _multi.capturing(device)
        table = _table(params, flat, offsets, total, capturing, kept)
        partials = torch.empty(2 * table.chunks, dtype=acc, device=device)
        squares = torch.empty(len(params), dtype=acc, device=device)
        cache = _compiled(device, dtype, (), ())[0]
        try:
            _COPY_SQUARES(
                cache,
                (table.chunks, 1),
                device_index(device),
                (table.storage, flat, offsets),
                *table.located,
                table.row_first_chunk,
                table.arrivals,
                partials,
                flat,
                offsets,
                squares,
                _tl_dtype(dtype),
                acc_dtype(dtype),
                _BLOCK,
                _CHUNK,
                _PARTIALS_BLOCK,
            )
        except Exception as error:
            raise _multi.KernelFailedError(error) from error
    return squares


def rescale_updates(
    params: list[Tensor],
    flat: Tensor,
    offsets: Tensor,
    total: int,
    w_squares: Tensor,
    *,
    lr: float | Tensor,
    threshold: float,
    eps: float,
    trust_coefficient: float,
    clip: float | None,
    floor: float | None,
    max_weight_norm: float | None,
) -> Tensor:
    r"""Rescales each parameter's update by its trust ratio, in two launches; returns the ratios.

    With :math:`w_{old}` in ``flat`` (from :func:`copy_and_squares`, whose sums are
    ``w_squares``), :math:`d = w_{old} - w_{new}` rounded to the dtype, :math:`\|u\| = \|d\| /
    lr` and :math:`\phi = \min(\|w_{old}\|, \text{max\_weight\_norm})`:
    :math:`r = \operatorname{clamp}(\eta\,\phi / (\|u\| + \epsilon), \text{floor}, \text{clip})`,
    and 1 where :math:`\|w_{old}\| \le` ``threshold`` or :math:`\|u\| = 0`; then
    :math:`w \leftarrow w_{new} + (1 - r)\,d` (``1 - r`` rounded to the dtype). The formula of
    :func:`normhooks.trust_ratio.trust_ratios` and
    :func:`normhooks.trust_ratio.rescale_updates_`, in their order of operations. No host
    synchronization; ``lr`` may be a 1-element tensor (a scheduler's, read at the launch).

    Raises :class:`~normhooks._kernels._multi.KernelFailedError` where a kernel failed to
    compile or launch; the first launch writes no parameter, and a failure of the second
    leaves the table dropped and the caller to compute the formula from ``flat``, which
    neither launch writes.
    """
    device, dtype = params[0].device, params[0].dtype
    acc = compute_dtype(dtype)
    lr_is_tensor = isinstance(lr, Tensor)
    scalars = (
        0 if lr_is_tensor else bits(lr),  # type: ignore[arg-type]
        bits(threshold),
        bits(eps),
        bits(trust_coefficient),
        bits(0.0 if clip is None else clip),
        bits(0.0 if floor is None else floor),
        bits(0.0 if max_weight_norm is None else max_weight_norm),
    )
    flags = (
        lr_is_tensor,
        eps != 0,
        trust_coefficient != 1,
        clip is not None,
        floor is not None,
        max_weight_norm is not None,
    )
    with on_device(device_index(device)):
        capturing = _multi.capturing(device)
        if capturing and not lr_is_tensor:
            raise TypeError(
                "the trust ratio divides the update by lr, and a float lr would be fixed into "
                "the CUDA graph being captured (a scheduler's later lr would be ignored on "
                "replay); under capture give lr as a 1-element tensor on the device, got "
                f"lr={lr!r}"
            )
        table = _table(params, flat, offsets, total, capturing)
        partials = torch.empty(2 * table.chunks, dtype=acc, device=device)
        ratios = torch.empty(len(params), dtype=acc, device=device)
        lr_tensor = ratios
        if isinstance(lr, Tensor):
            lr_tensor = lr if lr.device == device and lr.dtype == acc else lr.to(device, acc)
        squares = w_squares if w_squares.device == device else w_squares.to(device)
        _, ratios_cache, rescale_cache = _compiled(device, dtype, flags, scalars)
        dtype_tl, acc_tl = _tl_dtype(dtype), acc_dtype(dtype)
        grid = (table.chunks, 1)
        index = device_index(device)
        try:
            _UPDATE_SQUARES_AND_RATIOS(
                ratios_cache,
                grid,
                index,
                (table.storage, flat, offsets, lr_tensor, squares),
                *table.located,
                table.row_first_chunk,
                table.arrivals,
                partials,
                flat,
                offsets,
                squares,
                ratios,
                lr_tensor,
                *scalars,
                dtype_tl,
                acc_tl,
                _BLOCK,
                _CHUNK,
                _PARTIALS_BLOCK,
                *flags,
            )
            _RESCALE(
                rescale_cache,
                grid,
                index,
                (table.storage, flat, offsets),
                *table.located,
                flat,
                offsets,
                ratios,
                dtype_tl,
                acc_tl,
                _BLOCK,
                _CHUNK,
            )
        except Exception as error:
            raise _multi.KernelFailedError(error) from error
    return ratios
