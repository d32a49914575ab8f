r"""LARS for every tensor of one device and dtype in two kernel launches.

A description on the multi-tensor machinery of :mod:`normhooks._kernels._multi` (each tensor
one row, cut into chunks of ``_CHUNK`` values): launch 1 sums the squares of :math:`w` and
:math:`g` in each chunk, and the program that completes a tensor's sums writes its rate; launch
2 runs one program per chunk again and writes :math:`g \leftarrow r\,(g / s + \beta w)`,
with :math:`s` a GradScaler's scale when given.

Both launch through :class:`~normhooks._kernels._launch.Kernel`: a call signature met before
(see :func:`_compiled`) launches its compiled kernels directly, without Triton's binder.
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
from normhooks._kernels._multi import chunk_at, row_sums, tensor_at
from normhooks._precision import compute_dtype

# Values per program: a chunk is _CHUNK values of one tensor, read _BLOCK at a time.
_BLOCK = 1024
_CHUNK = 32 * _BLOCK
# Partial sums added at a time by the last program of a tensor.
_PARTIALS_BLOCK = 128
# Triton passes an int argument as int32 when it fits, as int64 otherwise.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@triton.jit
def _rate(  # type: ignore[no-untyped-def]
    w_squares,
    g_squares,
    grad_scale,
    lr_tensor,
    threshold,
    weight_decay,
    eps,
    trust_coefficient,
    lr,
    acc: tl.constexpr,
    has_decay: tl.constexpr,
    has_trust: tl.constexpr,
    clip: tl.constexpr,
    lr_is_tensor: tl.constexpr,
    zero_denominator_is_one: tl.constexpr,
    zero_grad_is_one: tl.constexpr,
    zero_grad_is_zero: tl.constexpr,
    scaled: tl.constexpr,
):
    w_norm = sqrt(w_squares, acc)
    g_norm = sqrt(g_squares, acc)
    if scaled:
        g_norm = div(g_norm, tl.load(grad_scale).to(acc), acc)
    # The association of the eager formula: (||g|| + eps) + weight_decay * ||w||.
    denominator = g_norm + as_float(eps, acc)
    if has_decay:
        denominator = denominator + as_float(weight_decay, acc) * w_norm
    rate = div(w_norm, denominator, acc)
    if has_trust:
        rate = rate * as_float(trust_coefficient, acc)
    if clip:
        if lr_is_tensor:
            rate = div(rate, tl.load(lr_tensor).to(acc), acc)
        else:
            rate = div(rate, as_float(lr, acc), acc)
        # Not tl.minimum: a NaN rate stays NaN, as torch.clamp leaves it.
        rate = tl.where(rate > 1.0, 1.0, rate)
    keep = w_norm > as_float(threshold, acc)
    if zero_denominator_is_one:
        keep = keep & (denominator > 0.0)
    rate = tl.where(keep, rate, 1.0)
    # Where ||g|| = 0: rate 1 for zero_grad_mode="decay", 0 for "skip" (else the formula).
    if zero_grad_is_one:
        rate = tl.where(g_norm == 0.0, 1.0, rate)
    if zero_grad_is_zero:
        rate = tl.where(g_norm == 0.0, 0.0, rate)
    return rate.to(acc)


@triton.jit(do_not_specialize=["threshold", "weight_decay", "eps", "trust_coefficient", "lr"])
def _squares_and_rates(  # type: ignore[no-untyped-def]
    w_ptrs,
    g_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    row_first_chunk,
    arrivals,
    partials,
    rates,
    grad_scale,
    lr_tensor,
    threshold,
    weight_decay,
    eps,
    trust_coefficient,
    lr,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    chunk_size: tl.constexpr,
    partials_block: tl.constexpr,
    has_decay: tl.constexpr,
    has_trust: tl.constexpr,
    clip: tl.constexpr,
    lr_is_tensor: tl.constexpr,
    zero_denominator_is_one: tl.constexpr,
    zero_grad_is_one: tl.constexpr,
    zero_grad_is_zero: tl.constexpr,
    scaled: tl.constexpr,
):
    chunk, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    w = tensor_at(w_ptrs, tensor, dtype)
    g = tensor_at(g_ptrs, tensor, dtype)
    w_acc = tl.zeros([block], dtype=acc)
    g_acc = tl.zeros([block], dtype=acc)
    for offset in tl.range(0, chunk_size, block):
        index = start + offset + tl.arange(0, block)
        mask = index < stop
        w_values = tl.load(w + index, mask=mask, other=0.0).to(acc)
        g_values = tl.load(g + index, mask=mask, other=0.0).to(acc)
        w_acc += w_values * w_values
        g_acc += g_values * g_values
    last, w_squares, g_squares = row_sums(
        tl.sum(w_acc, axis=0),
        tl.sum(g_acc, axis=0),
        chunk,
        row,
        row_first_chunk,
        arrivals,
        partials,
        acc,
        partials_block,
    )
    if last:
        rate = _rate(
            w_squares,
            g_squares,
            grad_scale,
            lr_tensor,
            threshold,
            weight_decay,
            eps,
            trust_coefficient,
            lr,
            acc,
            has_decay,
            has_trust,
            clip,
            lr_is_tensor,
            zero_denominator_is_one,
            zero_grad_is_one,
            zero_grad_is_zero,
            scaled,
        )
        tl.store(rates + row, rate)


_SQUARES_AND_RATES = Kernel(_squares_and_rates)


@triton.jit(do_not_specialize=["weight_decay"])
def _scale(  # type: ignore[no-untyped-def]
    w_ptrs,
    g_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    rates,
    grad_scale,
    found_inf,
    weight_decay,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    chunk_size: tl.constexpr,
    has_decay: tl.constexpr,
    scaled: tl.constexpr,
    flag_overflow: tl.constexpr,
):
    _, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    w = tensor_at(w_ptrs, tensor, dtype)
    g = tensor_at(g_ptrs, tensor, dtype)
    rate = tl.load(rates + row)
    decay = as_float(weight_decay, acc)
    if scaled:
        scale = tl.load(grad_scale).to(acc)
    finite = tl.full([block], 1, dtype=tl.int1)
    for offset in tl.range(0, chunk_size, block):
        index = start + offset + tl.arange(0, block)
        mask = index < stop
        values = tl.load(g + index, mask=mask, other=0.0).to(acc)
        if scaled:
            values = div(values, scale, acc)
        if has_decay:
            values = values + decay * tl.load(w + index, mask=mask, other=0.0).to(acc)
        written = (rate * values).to(dtype)
        tl.store(g + index, written, mask=mask)
        if flag_overflow:
            finite = finite & is_finite(written.to(acc))
    if flag_overflow:
        overflow = tl.min(finite.to(tl.int32), axis=0) == 0
        tl.atomic_max(found_inf, 1.0, mask=overflow)


_SCALE = Kernel(_scale)


# The compiled variants of both kernels, by everything Triton specializes them on except the
# alignment of the pointers that _launch.Kernel checks at each launch.
_variants: KeyedCache[tuple[object, ...], tuple[dict[Any, Any], dict[Any, Any]]] = KeyedCache()


def _compiled(
    device: torch.device,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None,
    flags: tuple[bool, ...],
    scalars: tuple[int, ...],
    flag_overflow: bool,
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The caches of compiled ``_squares_and_rates`` and ``_scale`` for one call signature.

    Triton keeps compiled kernels per device and specializes them on the dtype of every
    pointer (the tensors' and the scale's; partials, rates, a tensor lr and the overflow flag
    follow from the dtype), on each constexpr (the flags and the block sizes) and on whether
    each int argument fits 32 bits (the scalars' bit patterns: ``do_not_specialize`` keeps
    their values out, not their type). Every one of those is in the key.
    """
    key = (
        device,
        dtype,
        scale_dtype,
        flags,
        flag_overflow,
        tuple([_INT32_MIN <= value <= _INT32_MAX for value in scalars]),
        _BLOCK,
        _CHUNK,
        _PARTIALS_BLOCK,
    )
    return _variants.get_or_make(key, lambda: ({}, {}))


def lars_unit_(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    threshold: float,
    weight_decay: float,
    eps: float,
    trust_coefficient: float,
    lr: float | Tensor | None,
    clip: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    zero_grad_mode: str = "scale",
    kept: dict[object, object] | None = None,
    allowed: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    r"""Rewrites each ``grads[i]`` in place as :math:`r_i\,(g_i / s + \beta w_i)`, in two launches.

    The rate is the eager one: :math:`\lambda = \|w\| / ((\|g\| + \epsilon) + \beta \|w\|)`
    times ``trust_coefficient``, then :math:`\min(\lambda / lr, 1)` with ``clip``, and 1
    where :math:`\|w\| \le` ``threshold`` or, with ``eps == weight_decay == 0``, where the
    denominator is 0; where :math:`\|g\| = 0`, ``zero_grad_mode="decay"`` makes it 1 and
    ``"skip"`` 0 (a zero gradient stays zero). With ``grad_scale`` (:math:`s`, a GradScaler's
    scale) the gradients arrive scaled: norms use :math:`g / s` and the written gradients are
    unscaled. With ``found_inf`` (a 1-element float32 tensor), it is set to 1 if any written
    value is not finite, and left alone otherwise. float16/bfloat16 are computed in float32 and
    rounded once.

    Steady state: no host synchronization. The table of addresses is built on first use of a
    set of tensors (one host-to-device copy, from pinned memory) and reused while the tensors
    keep their addresses and shapes. Tensors that are not dense, or whose gradient is laid out
    unlike the parameter, go through contiguous copies (and their tables are rebuilt each call).
    A table is safe on any stream (see :meth:`normhooks._kernels._multi.ChunkTable.use_on`).
    Under CUDA-graph capture a table is never built (the tensors must have been seen before
    capturing) and ``clip`` needs a tensor ``lr``: a float would be fixed into the graph.

    Args:
        params: the parameters :math:`w`, all of one device and floating dtype.
        grads: their gradients :math:`g`, same shapes, device and dtype.
        threshold: tensors with :math:`\|w\|` at most this keep rate 1.
        weight_decay: :math:`\beta`.
        eps: added to :math:`\|g\|` in the denominator.
        trust_coefficient: multiplies the rate.
        lr: the learning rate ``clip`` divides by (a float or a 1-element tensor).
        clip: LARC's clipping mode; ignored when ``lr`` is None.
        grad_scale: the scale the gradients carry, or None.
        found_inf: the overflow flag to raise, or None.
        zero_grad_mode: ``"scale"``, ``"decay"`` or ``"skip"``, as in :func:`normhooks.lars_`.
        kept: where the caller keeps what is built for exactly these tensors, or None (see
            :func:`normhooks._kernels._multi.prepared`).
        allowed: whether the kernels may run on a tensor (the package's ``available``), for
            the launches' replay kept in ``kept`` (:class:`~normhooks._kernels._multi.Replay`);
            None keeps none.

    Returns:
        The rates, 1-D, one per tensor, in float32 for half dtypes and in the dtype otherwise.
    """
    if not params and not grads:
        return torch.empty(0)
    device, dtype = params[0].device, params[0].dtype
    if found_inf is not None and (found_inf.dtype != torch.float32 or found_inf.numel() != 1):
        raise ValueError(
            "found_inf must be a 1-element float32 tensor (GradScaler's flag), got "
            f"{found_inf.dtype} with {found_inf.numel()} elements"
        )
    lr_is_tensor = isinstance(lr, Tensor)
    clipping = clip and lr is not None
    scalars = (
        bits(threshold),
        bits(weight_decay),
        bits(eps),
        bits(trust_coefficient),
        bits(lr) if clipping and not lr_is_tensor else 0,  # type: ignore[arg-type]
    )
    has_decay = weight_decay != 0
    flags = (
        has_decay,
        trust_coefficient != 1,
        clipping,
        lr_is_tensor,
        eps == 0 and weight_decay == 0,
        zero_grad_mode == "decay",
        zero_grad_mode == "skip",
        grad_scale is not None,
    )
    with on_device(device_index(device)):
        capturing = _multi.capturing(device)
        if capturing and clipping and not lr_is_tensor:
            raise TypeError(
                "clip=True divides the rates by lr, and a float lr would be fixed into the "
                "CUDA graph being captured (a scheduler's later lr would be ignored on "
                "replay); under capture give lr as a 1-element tensor on the device, which "
                f"schedulers update in place, got lr={lr!r}"
            )
        (params, grads), (param_copies, copied), table = _multi.prepared(
            [params, grads], ("params", "grads"), _multi.WHOLE, _CHUNK, capturing, "LARS", kept
        )
        scale = grad_scale
        if grad_scale is not None and grad_scale.device != device:
            scale = grad_scale.to(device)
        squares_and_rates, scale_kernel = _compiled(
            device,
            dtype,
            None if scale is None else scale.dtype,
            flags,
            scalars,
            found_inf is not None,
        )
        run = functools.partial(
            _run,
            table,
            device_index(device),
            len(params),
            squares_and_rates,
            scale_kernel,
            scalars,
            flags,
            dtype,
            device,
        )
        rates = run(scale, lr, found_inf)
        # A float lr that clipping divides by is one of the launch's constants: not replayed.
        _multi.keep_replay(
            kept,
            not param_copies
            and not copied
            and scale is None
            and found_inf is None
            and not capturing
            and not (clipping and not lr_is_tensor),
            table,
            params[0],
            lambda lr: run(None, lr, None),
            allowed,
        )
    for grad, copy in copied:
        grad.copy_(copy)
    return rates


def _run(
    table: _multi.ChunkTable,
    index: int | None,
    count: int,
    squares_and_rates: dict[Any, Any],
    scale_kernel: dict[Any, Any],
    scalars: tuple[int, ...],
    flags: tuple[bool, ...],
    dtype: torch.dtype,
    device: torch.device,
    scale: Tensor | None,
    lr: float | Tensor | None,
    found_inf: Tensor | None,
) -> Tensor:
    """The outputs of :func:`lars_unit_` made, then its two launches; returns the rates."""
    acc = compute_dtype(dtype)
    partials = torch.empty(2 * table.chunks, dtype=acc, device=device)
    rates = torch.empty(count, dtype=acc, device=device)
    lr_tensor = rates
    if isinstance(lr, Tensor):
        lr_tensor = lr if lr.device == device and lr.dtype == acc else lr.to(device, acc)
    try:
        _launch(
            (table.chunks, 1),
            index,
            table,
            partials,
            rates,
            rates if scale is None else scale,
            lr_tensor,
            rates if found_inf is None else found_inf,
            squares_and_rates,
            scale_kernel,
            scalars,
            flags,
            _tl_dtype(dtype),
            acc_dtype(dtype),
            found_inf is not None,
        )
    except Exception as error:
        # A kernel that cannot compile or launch here fails before it writes: the caller
        # computes the plain formula (normhooks._kernels.lars_unit_).
        raise _multi.KernelFailedError(error) from error
    return rates


def _launch(
    grid: tuple[int, int],
    index: int | None,
    table: _multi.ChunkTable,
    partials: Tensor,
    rates: Tensor,
    scale: Tensor,
    lr_tensor: Tensor,
    flag: Tensor,
    squares_and_rates: dict[Any, Any],
    scale_kernel: dict[Any, Any],
    scalars: tuple[int, ...],
    flags: tuple[bool, ...],
    dtype_tl: Any,
    acc_tl: Any,
    flag_overflow: bool,
) -> None:
    """The two launches of :func:`lars_unit_`."""
    _SQUARES_AND_RATES(
        squares_and_rates,
        grid,
        index,
        (table.storage, scale, lr_tensor),
        *table.located,
        table.row_first_chunk,
        table.arrivals,
        partials,
        rates,
        scale,
        lr_tensor,
        *scalars,
        dtype_tl,
        acc_tl,
        _BLOCK,
        _CHUNK,
        _PARTIALS_BLOCK,
        *flags,
    )
    _SCALE(
        scale_kernel,
        grid,
        index,
        (table.storage, scale, flag),
        *table.located,
        rates,
        scale,
        flag,
        scalars[1],
        dtype_tl,
        acc_tl,
        _BLOCK,
        _CHUNK,
        flags[0],
        flags[-1],
        flag_overflow,
    )
