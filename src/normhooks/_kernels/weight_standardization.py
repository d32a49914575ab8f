r"""Row standardization of a weight matrix in one forward and one backward kernel (two each
way for a matrix of few long rows).

Per row :math:`x` of length :math:`N`: :math:`\hat x = (x - \mu)\,\rho` with
:math:`\rho = 1 / \sqrt{\sigma^2 + \epsilon}` (biased variance), times a gain :math:`\gamma`
per row when given. With :math:`y' = \gamma\,y'_{\text{in}}` the incoming gradient times the
gain, :math:`\nabla x = \rho\,(y' - \overline{y'} - \hat x\,\overline{y' \hat x})` and
:math:`\nabla \gamma = \sum y'_{\text{in}} \hat x`.

One program per row, or, for few long rows, one per segment of a row (see
``_common.row_plan``): then a first launch writes each segment's sum and squares about its own
mean (backward: its sums of :math:`y'_{\text{in}}` and :math:`y'_{\text{in}} \hat x`), and
the second combines a row's partial sums in a fixed order.

:class:`FusedPlan` standardizes many weights (one device and dtype, whole rows) in one launch
each way, every row of every weight one program, finding each weight and gain through a
table of addresses on the device (``normhooks._kernels._scope`` decides which weights).
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels import _fallback, _fused
from normhooks._kernels._cache import KeyedCache
from normhooks._kernels._common import (
    acc_dtype,
    as_float,
    bits,
    device_index,
    div,
    extent,
    row_partials,
    row_plan,
    segment_bounds,
    sqrt,
    tl_dtype,
)
from normhooks._kernels._launch import Kernel
from normhooks._precision import compute_dtype
from normhooks._torch_compat import function_apply


@triton.jit
def _sum(x_row, x_stride, start, end, acc: tl.constexpr, block: tl.constexpr):  # type: ignore[no-untyped-def]
    sums = tl.zeros([block], dtype=acc)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        sums += tl.load(x_row + k * x_stride, mask=k < end, other=0.0).to(acc)
        first += block
    return tl.sum(sums, axis=0)


@triton.jit
def _centred_squares(  # type: ignore[no-untyped-def]
    x_row, x_stride, start, end, mean, acc: tl.constexpr, block: tl.constexpr
):
    # Two passes: the squares of the centred values, which keep precision for rows whose mean
    # is large against their spread.
    squares = tl.zeros([block], dtype=acc)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        centred = tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean
        centred = tl.where(mask, centred, 0.0)
        squares += centred * centred
        first += block
    return tl.sum(squares, axis=0)


@triton.jit
def _gradient_block(  # type: ignore[no-untyped-def]
    x_row,
    dy_row,
    x_stride,
    dy_stride,
    first,
    end,
    mean,
    rstd,
    acc: tl.constexpr,
    block: tl.constexpr,
):
    """The indices and mask of the row's block of values from ``first`` (of ``[first, end)``),
    and its ``x-hat`` and ``y'_in``."""
    k = first + tl.arange(0, block)
    mask = k < end
    normalized = (tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean) * rstd
    return k, mask, normalized, tl.load(dy_row + k * dy_stride, mask=mask, other=0.0).to(acc)


@triton.jit
def _gradient_sums(  # type: ignore[no-untyped-def]
    x_row,
    dy_row,
    x_stride,
    dy_stride,
    start,
    end,
    mean,
    rstd,
    acc: tl.constexpr,
    block: tl.constexpr,
):
    """``(sum y'_in, sum y'_in x-hat)`` over ``[start, end)``."""
    incoming_sums = tl.zeros([block], dtype=acc)
    product_sums = tl.zeros([block], dtype=acc)
    first = start
    while first < end:
        _, mask, normalized, incoming = _gradient_block(
            x_row, dy_row, x_stride, dy_stride, first, end, mean, rstd, acc, block
        )
        incoming_sums += incoming
        product_sums += tl.where(mask, incoming * normalized, 0.0)
        first += block
    return tl.sum(incoming_sums, axis=0), tl.sum(product_sums, axis=0)


# ``length`` is never specialized: Triton turns an int argument equal to 1 into a constant,
# and a row of one element (a depthwise 1x1 convolution) would then fail to compile.
@triton.jit(do_not_specialize=["length"])
def _moments(  # type: ignore[no-untyped-def]
    x,
    sums,
    squares,
    length,
    segment,
    splits,
    x_row_stride,
    x_stride,
    acc: tl.constexpr,
    block: tl.constexpr,
    wide: tl.constexpr,
):
    """A split row's first launch: each segment's sum, and its squares about its own mean."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * x_row_stride
    start, end = segment_bounds(length, segment, wide)
    total = _sum(x_row, x_stride, start, end, acc, block)
    mean = div(total, (end - start).to(acc), acc)
    at = row * splits + tl.program_id(1)
    tl.store(sums + at, total)
    tl.store(squares + at, _centred_squares(x_row, x_stride, start, end, mean, acc, block))


_MOMENTS = Kernel(_moments)


@triton.jit
def _times(rstd, gain, row, factor, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    """What multiplies a row's centred values: ``rstd`` times the row's gain times ``factor``,
    that product rounded to the gain's dtype as ``gain * factor`` in torch gives it (Scaled WS's
    ``gamma / sqrt(fan_in)``)."""
    scaled = tl.load(gain + row).to(acc) * as_float(factor, acc)
    return rstd * scaled.to(gain.dtype.element_ty).to(acc)


@triton.jit
def _whole_row_moments(  # type: ignore[no-untyped-def]
    x_row, x_stride, start, end, eps, acc: tl.constexpr, block: tl.constexpr
):
    """The mean and ``1 / sqrt(variance + eps)`` of a row read whole, ``[start, end)``, in one
    program."""
    length = (end - start).to(acc)
    mean = div(_sum(x_row, x_stride, start, end, acc, block), length, acc)
    spread = _centred_squares(x_row, x_stride, start, end, mean, acc, block)
    return mean, _rstd(div(spread, length, acc), eps, acc)


@triton.jit
def _rstd(variance, eps, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    return div(1.0, sqrt(variance + as_float(eps, acc), acc), acc)


@triton.jit
def _write_standardized(  # type: ignore[no-untyped-def]
    x_row,
    x_stride,
    y_row,
    stats,
    at,
    start,
    end,
    mean,
    rstd,
    times,
    acc: tl.constexpr,
    block: tl.constexpr,
):
    """``y = (x - mean) times`` over the row's values ``[start, end)``; the program of the
    row's first segment saves its mean and ``rstd`` at ``at`` in ``stats`` (every row's
    mean, then every row's ``rstd``: one ``[2, rows]`` buffer)."""
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        centred = tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean
        tl.store(y_row + k, (centred * times).to(y_row.dtype.element_ty), mask=mask)
        first += block
    first_part = tl.program_id(1) == 0
    tl.store(stats + at, mean, mask=first_part)
    tl.store(stats + tl.num_programs(0) + at, rstd, mask=first_part)


@triton.jit
def _saved_stats(stats, at):  # type: ignore[no-untyped-def]
    """The mean and ``rstd`` that :func:`_write_standardized` saved at ``at``."""
    return tl.load(stats + at), tl.load(stats + tl.num_programs(0) + at)


@triton.jit
def _write_gain_gradient(grad_gain_row, product_sum, factor, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    """d/d gain of ``gain * factor``, as torch's autograd of that product computes it: the
    gradient of the scaled gain, rounded, times factor, rounded (from the program of the
    row's first segment)."""
    dtype = grad_gain_row.dtype.element_ty
    grad = product_sum.to(dtype).to(acc) * as_float(factor, acc)
    tl.store(grad_gain_row, grad.to(dtype), mask=tl.program_id(1) == 0)


@triton.jit
def _write_gradient(  # type: ignore[no-untyped-def]
    x_row,
    dy_row,
    x_stride,
    dy_stride,
    grad_x_row,
    start,
    end,
    length,
    mean,
    rstd,
    times,
    incoming_sum,
    product_sum,
    acc: tl.constexpr,
    block: tl.constexpr,
):
    """``grad_x`` over the row's values ``[start, end)``, from the row's sums of ``y'_in``
    and ``y'_in x-hat``."""
    incoming_mean = div(incoming_sum, length.to(acc), acc)
    product_mean = div(product_sum, length.to(acc), acc)
    first = start
    while first < end:
        k, mask, normalized, incoming = _gradient_block(
            x_row, dy_row, x_stride, dy_stride, first, end, mean, rstd, acc, block
        )
        result = times * (incoming - incoming_mean - normalized * product_mean)
        tl.store(grad_x_row + k, result.to(grad_x_row.dtype.element_ty), mask=mask)
        first += block


@triton.jit(do_not_specialize=["eps", "factor", "length"])
def _forward(  # type: ignore[no-untyped-def]
    x,
    gain,
    y,
    stats,
    sums,
    squares,
    length,
    segment,
    splits,
    x_row_stride,
    x_stride,
    eps,
    factor,
    acc: tl.constexpr,
    block: tl.constexpr,
    has_gain: tl.constexpr,
    split: tl.constexpr,
    partials_block: tl.constexpr,
    wide: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * x_row_stride
    start, end = segment_bounds(length, segment, wide)
    if split:
        # Chan et al.'s pairwise update, in a fixed order: the squares about the row's mean
        # are each segment's squares about its own mean plus n (its mean - the row's)^2.
        part = tl.arange(0, partials_block)
        present = part < splits
        totals = tl.load(sums + row * splits + part, mask=present, other=0.0)
        low = part.to(tl.int64) * segment
        sizes = tl.where(present, tl.minimum(low + segment, length) - low, 1).to(acc)
        mean = div(tl.sum(totals, axis=0), length.to(acc), acc)
        deviations = div(totals, sizes, acc) - mean
        about_own = tl.load(squares + row * splits + part, mask=present, other=0.0)
        spread = tl.where(present, about_own + sizes * deviations * deviations, 0.0)
        rstd = _rstd(div(tl.sum(spread, axis=0), length.to(acc), acc), eps, acc)
    else:
        mean, rstd = _whole_row_moments(x_row, x_stride, start, end, eps, acc, block)
    times = rstd
    if has_gain:
        times = _times(rstd, gain, row, factor, acc)
    _write_standardized(
        x_row, x_stride, y + row * length, stats, row, start, end, mean, rstd, times, acc, block
    )


_FORWARD = Kernel(_forward)


@triton.jit(do_not_specialize=["length"])
def _sums(  # type: ignore[no-untyped-def]
    grad_y,
    x,
    stats,
    incoming_sums,
    product_sums,
    length,
    segment,
    splits,
    dy_row_stride,
    dy_stride,
    x_row_stride,
    x_stride,
    acc: tl.constexpr,
    block: tl.constexpr,
    wide: tl.constexpr,
):
    """A split row's first launch backward: each segment's sums of y'_in and y'_in x-hat."""
    row = tl.program_id(0).to(tl.int64)
    start, end = segment_bounds(length, segment, wide)
    mean, rstd = _saved_stats(stats, row)
    incoming, product = _gradient_sums(
        x + row * x_row_stride,
        grad_y + row * dy_row_stride,
        x_stride,
        dy_stride,
        start,
        end,
        mean,
        rstd,
        acc,
        block,
    )
    at = row * splits + tl.program_id(1)
    tl.store(incoming_sums + at, incoming)
    tl.store(product_sums + at, product)


_SUMS = Kernel(_sums)


@triton.jit(do_not_specialize=["factor", "length"])
def _backward(  # type: ignore[no-untyped-def]
    grad_y,
    x,
    gain,
    stats,
    incoming_sums,
    product_sums,
    grad_x,
    grad_gain,
    length,
    segment,
    splits,
    dy_row_stride,
    dy_stride,
    x_row_stride,
    x_stride,
    factor,
    acc: tl.constexpr,
    block: tl.constexpr,
    has_gain: tl.constexpr,
    split: tl.constexpr,
    partials_block: tl.constexpr,
    wide: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * x_row_stride
    dy_row = grad_y + row * dy_row_stride
    mean, rstd = _saved_stats(stats, row)
    start, end = segment_bounds(length, segment, wide)
    if split:
        incoming_sum = row_partials(incoming_sums, row, splits, partials_block)
        product_sum = row_partials(product_sums, row, splits, partials_block)
    else:
        incoming_sum, product_sum = _gradient_sums(
            x_row, dy_row, x_stride, dy_stride, start, end, mean, rstd, acc, block
        )
    times = rstd
    if has_gain:
        times = _times(rstd, gain, row, factor, acc)
        _write_gain_gradient(grad_gain + row, product_sum, factor, acc)
    _write_gradient(
        x_row,
        dy_row,
        x_stride,
        dy_stride,
        grad_x + row * length,
        start,
        end,
        length,
        mean,
        rstd,
        times,
        incoming_sum,
        product_sum,
        acc,
        block,
    )


_BACKWARD = Kernel(_backward)


@triton.jit
def _fused_entry(layers, layer, index, dtype: tl.constexpr, fields: tl.constexpr):  # type: ignore[no-untyped-def]
    """Program ``index``'s weight's entry in a fused plan's table (see
    :meth:`FusedPlan.entry`): the address of the program's row, the row's index in its weight,
    the gain's address (0 for none), the row length, where the row's result starts in the
    flat output, and the bits of ``eps`` and of the gain's factor."""
    entry = layers + layer * fields
    length = tl.load(entry + 2)
    row = index - tl.load(entry + 4)
    x_row = tl.load(entry).to(tl.pointer_type(dtype)) + row * length
    at = tl.load(entry + 3) + row * length
    return x_row, row, tl.load(entry + 1), length, at, tl.load(entry + 5), tl.load(entry + 6)


@triton.jit
def _fused_forward(  # type: ignore[no-untyped-def]
    layers,
    row_layers,
    y,
    stats,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    fields: tl.constexpr,
):
    """Every row of every weight of a fused plan, one program each, each finding its weight
    and gain through the table ``layers`` (:func:`_fused_entry`). ``stats``: every row's
    mean, then every row's 1/std."""
    index = tl.program_id(0).to(tl.int64)
    layer = tl.load(row_layers + index)
    x_row, row, gain, length, at, eps, factor = _fused_entry(layers, layer, index, dtype, fields)
    start = length * 0
    mean, rstd = _whole_row_moments(x_row, 1, start, length, eps, acc, block)
    times = rstd
    if gain != 0:
        times = _times(rstd, gain.to(tl.pointer_type(dtype)), row, factor, acc)
    _write_standardized(
        x_row, 1, y + at, stats, index, length * 0, length, mean, rstd, times, acc, block
    )


_FUSED_FORWARD = Kernel(_fused_forward)


@triton.jit
def _fused_backward(  # type: ignore[no-untyped-def]
    layers,
    row_layers,
    grads,
    stats,
    grad_x,
    grad_gain,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    fields: tl.constexpr,
):
    """Backward of :func:`_fused_forward`: ``grads`` holds the address of each weight's
    incoming gradient, 0 for one that got none (its rows write nothing)."""
    index = tl.program_id(0).to(tl.int64)
    layer = tl.load(row_layers + index)
    address = tl.load(grads + layer)
    if address != 0:
        x_row, row, gain, length, at, _, factor = _fused_entry(layers, layer, index, dtype, fields)
        dy_row = address.to(tl.pointer_type(dtype)) + row * length
        mean, rstd = _saved_stats(stats, index)
        start = length * 0
        incoming_sum, product_sum = _gradient_sums(
            x_row, dy_row, 1, 1, start, length, mean, rstd, acc, block
        )
        times = rstd
        if gain != 0:
            times = _times(rstd, gain.to(tl.pointer_type(dtype)), row, factor, acc)
            _write_gain_gradient(grad_gain + index, product_sum, factor, acc)
        _write_gradient(
            x_row,
            dy_row,
            1,
            1,
            grad_x + at,
            start,
            length,
            length,
            mean,
            rstd,
            times,
            incoming_sum,
            product_sum,
            acc,
            block,
        )


_FUSED_BACKWARD = Kernel(_fused_backward)


def _plain(rows: Tensor, eps: float, gain: Tensor | None, factor: float) -> Tensor:
    """The formula in differentiable torch ops, for a backward that must be differentiable."""
    exact = rows.to(compute_dtype(rows.dtype))
    mean = exact.mean(1, keepdim=True)
    variance = (exact - mean).square().mean(1, keepdim=True)
    result = (exact - mean) / torch.sqrt(variance + eps)
    if gain is not None:
        result = result * (gain * factor).to(result.dtype).view(-1, 1)
    return result.to(rows.dtype)


def _collapsed_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The one stride that walks every axis of ``shape`` in row-major order, or None where
    the axes cannot be walked with one (the tensor would have to be copied)."""
    stride = None
    expected = None
    for size, step in zip(reversed(shape), reversed(strides), strict=True):
        if size == 1:
            continue
        if expected is None:
            stride, expected = step, step * size
        elif step != expected:
            return None
        else:
            expected = step * size
    return 1 if stride is None else stride


class _Plan:
    """What a tensor's launches need that its shape, strides, dtype, device and the settings
    fix: computed once, after the checks, and found again by :func:`plan`. Row ``i`` is
    ``x[i]``, flattened: where x cannot be read that way with two strides, it is copied."""

    __slots__ = (
        "acc",
        "backward_kernels",
        "block",
        "constexprs",
        "count",
        "device",
        "empty",
        "eps",
        "eps_bits",
        "factor",
        "factor_bits",
        "first_constexprs",
        "forward_kernels",
        "gain_contiguous",
        "grid",
        "inputs",
        "layout",
        "length",
        "sizes",
        "split",
        "strides",
    )

    def __init__(self, x: Tensor, eps: float, gain: Tensor | None, factor: float) -> None:
        has_gain = gain is not None
        # The layouts of x and the gain it was made for (its key's): what a backward compares.
        self.inputs = _inputs(x, gain)
        self.gain_contiguous = gain is None or gain.is_contiguous()
        count = x.shape[0]
        length = math.prod(x.shape[1:])
        self.count, self.length = count, length
        self.empty = count * length == 0
        stride = _collapsed_stride(tuple(x.shape[1:]), x.stride()[1:])
        if stride is None:
            self.strides = None
            reach = count * length
        else:
            self.strides = (x.stride(0), stride)
            reach = max(extent(tuple(x.shape), x.stride()), count * length)
        plan = row_plan(count, length, reach)
        self.layout = plan
        self.block = plan.block
        self.split = plan.splits > 1
        self.grid = (count, plan.splits)
        self.sizes = (length, plan.segment, plan.splits)
        self.eps, self.factor = eps, factor
        self.eps_bits, self.factor_bits = bits(eps), bits(factor)
        self.acc = compute_dtype(x.dtype)
        acc = acc_dtype(x.dtype)
        self.first_constexprs = (acc, plan.block, plan.wide)
        self.constexprs = (acc, plan.block, has_gain, self.split, plan.partials_block, plan.wide)
        self.device = device_index(x.device)
        # The compiled kernels this plan launches, by the alignment of their pointers.
        self.forward_kernels: tuple[dict[Any, Any], dict[Any, Any]] = ({}, {})
        self.backward_kernels: tuple[dict[Any, Any], dict[Any, Any]] = ({}, {})

    def apply(self, x: Tensor, gain: Tensor | None) -> Tensor:
        """:func:`standardize_rows` of a tensor of this plan, on plain eager tensors."""
        result: Tensor = _APPLY(x, gain, self)
        return result

    def differentiable(self, x: Tensor, gain: Tensor | None) -> Tensor:
        """The standardized ``x`` in differentiable torch ops."""
        rows = x.reshape(self.count, self.length)
        return _plain(rows, self.eps, gain, self.factor).reshape(x.shape)

    def rows(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """``x`` as the kernels read it, and its two strides."""
        if self.strides is not None:
            return x, self.strides
        return x.reshape(self.count, self.length), (self.length, 1)


# Plans by everything they are computed from (layouts and settings): valid by construction.
_plans: KeyedCache[tuple[object, ...], _Plan] = KeyedCache()


def plan(x: Tensor, eps: float, gain: Tensor | None, factor: float) -> _Plan:
    """The checked plan of ``x``, found by what determines it (never stale: a tensor that
    changes shape, layout, dtype or device gets another key)."""
    key: tuple[object, ...] = (x.shape, x.stride(), x.dtype, x.device, eps, factor)
    if gain is not None:
        key += (gain.shape, gain.stride(), gain.dtype, gain.device)
    found = _plans.get(key)
    if found is None:
        _check(x, eps, gain)
        found = _Plan(x, float(eps), gain, float(factor))
        _plans.put(key, found)
    return found


def _partials(count: int, plan: _Plan, stand_in: Tensor) -> tuple[Tensor, Tensor]:
    """Two planes of partial sums for split rows; ``stand_in`` (unread) when rows are whole."""
    if not plan.split:
        return stand_in, stand_in
    planes = torch.empty((2, count, plan.grid[1]), dtype=plan.acc, device=stand_in.device)
    return planes[0], planes[1]


def _inputs(x: Tensor, gain: Tensor | None) -> tuple[object, ...]:
    layouts = (x.shape, x.stride(), x.dtype, x.device)
    return (
        layouts if gain is None else (*layouts, gain.shape, gain.stride(), gain.dtype, gain.device)
    )


class _Standardize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, gain: Tensor | None, plan: _Plan) -> Tensor:
        ctx.plan = plan
        # Their layouts are the plan's (it was found for them); their types, kept.
        ctx.types = (type(x), type(gain))
        result = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if plan.empty:
            ctx.save_for_backward(x, gain, None)
            return result
        rows, strides = plan.rows(x)
        stats = torch.empty(2 * plan.count, dtype=plan.acc, device=x.device)
        ctx.save_for_backward(x, gain, stats)
        gains = rows if gain is None else gain.contiguous()
        sums, squares = _partials(plan.count, plan, stats)
        if plan.split:
            _MOMENTS(
                plan.forward_kernels[0],
                plan.grid,
                plan.device,
                (rows, squares),
                rows,
                sums,
                squares,
                *plan.sizes,
                *strides,
                *plan.first_constexprs,
            )
        _FORWARD(
            plan.forward_kernels[1],
            plan.grid,
            plan.device,
            # The second plane of partial sums starts wherever the first one ends.
            (rows, gains, squares),
            rows,
            gains,
            result,
            stats,
            sums,
            squares,
            *plan.sizes,
            *strides,
            plan.eps_bits,
            plan.factor_bits,
            *plan.constexprs,
        )
        return result

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        x, gain, stats = ctx.saved_tensors
        plan: _Plan = ctx.plan
        if torch.is_grad_enabled():
            return (*_fused.differentiable_grads(plan, (x, gain), grad_y), None)
        if _inputs(x, gain) != plan.inputs or (type(x), type(gain)) != ctx.types:
            # x or the gain changed layout since the forward (same values, other strides): the
            # plan was made for the old one.
            return (*_fused.formula_grads(plan, (x, gain), grad_y), None)
        try:
            return _kernel_backward(ctx, x, gain, stats, plan, grad_y)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError):
                raise
            _fallback.failed("weight standardization's backward", error)
            return (*_fused.formula_grads(plan, (x, gain), grad_y), None)


def _kernel_backward(
    ctx: Any, x: Tensor, gain: Tensor | None, stats: Tensor, plan: _Plan, grad_y: Tensor
) -> tuple[Tensor | None, ...]:
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_gain = None
    if gain is not None:
        grad_gain = torch.empty(gain.shape, dtype=gain.dtype, device=gain.device)
        if plan.empty:
            grad_gain.zero_()
    if not plan.empty:
        rows, (row_stride, stride) = plan.rows(x)
        incoming = grad_y.contiguous()
        incoming_sums, product_sums = _partials(plan.count, plan, stats)
        strides = (plan.length, 1, row_stride, stride)
        gains = rows if gain is None else gain.contiguous()
        if plan.split:
            _SUMS(
                plan.backward_kernels[0],
                plan.grid,
                plan.device,
                (incoming, rows, stats, product_sums),
                incoming,
                rows,
                stats,
                incoming_sums,
                product_sums,
                *plan.sizes,
                *strides,
                *plan.first_constexprs,
            )
        _BACKWARD(
            plan.backward_kernels[1],
            plan.grid,
            plan.device,
            (incoming, rows, gains, stats, product_sums),
            incoming,
            rows,
            gains,
            stats,
            incoming_sums,
            product_sums,
            grad_x,
            grad_gain if grad_gain is not None else rows,
            *plan.sizes,
            *strides,
            plan.factor_bits,
            *plan.constexprs,
        )
    needs_x, needs_gain = ctx.needs_input_grad[:2]
    return grad_x if needs_x else None, grad_gain if needs_gain else None, None


_APPLY = function_apply(_Standardize)


# --- one launch each way for many weights ---------------------------------------------------


def fusable(plan: _Plan) -> bool:
    """Whether a weight of ``plan`` can go in a fused launch: whole rows (few long rows keep
    their own two launches), read in place as ``[rows, length]`` with a contiguous gain, at
    least one value."""
    return (
        not (plan.split or plan.empty) and plan.strides == (plan.length, 1) and plan.gain_contiguous
    )


class FusedPlan(_fused.FusedPlan[_Plan]):
    """Weights standardized in one launch, and their gradients computed in one, from their
    ``x0, gain0, x1, gain1, ...`` (see :class:`normhooks._kernels._fused.FusedPlan`)."""

    gain_at = 1

    def entry(
        self, plan: _Plan, x: Tensor | None, gain: Tensor | None, numel: int, rows: int
    ) -> tuple[list[int], _fused.Strided, _fused.Strided]:
        """The weight's address, its gain's (0: none), row length, where its result starts in
        the flat output, its first row's index among all rows, eps's and the gain factor's
        bits, and one unused field (read by :func:`_fused_entry`); the result is contiguous,
        as the weight's own launch gives it."""
        assert x is not None  # only gains may be None
        gain_address = 0 if gain is None else gain.data_ptr()
        entry = [x.data_ptr(), gain_address, plan.length, numel, rows]
        entry += [plan.eps_bits, plan.factor_bits, 0]
        return entry, (tuple(x.shape), _contiguous_strides(x.shape)), ((plan.count,), (1,))

    def buffers(self) -> tuple[Tensor, ...]:
        """Every row's mean, then every row's 1/std."""
        return (torch.empty(2 * self.rows, dtype=compute_dtype(self.dtype), device=self.device),)

    def kernels(self) -> tuple[Kernel, Kernel]:
        return _FUSED_FORWARD, _FUSED_BACKWARD


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def fused_plan(plans: tuple[_Plan, ...], tensors: Sequence[Tensor | None]) -> FusedPlan:
    """The fused plan of weights of :func:`fusable` ``plans`` (one device and dtype), whose
    ``tensors`` are ``x0, gain0, x1, gain1, ...`` (a gain None where there is none)."""
    found: FusedPlan = FusedPlan.find(plans, tensors)
    return found


def fused_standardizations(plan: FusedPlan, tensors: Sequence[Tensor | None]) -> tuple[Tensor, ...]:
    """The standardized weights of ``plan``, from their ``x0, gain0, x1, gain1, ...``, in
    one launch (their gradients in one more), on plain eager tensors."""
    return _fused.fused_results(plan, tensors)


def _check(x: Tensor, eps: float, gain: Tensor | None) -> None:
    tl_dtype(x.dtype)
    if x.ndim < 2:
        raise ValueError(f"rows must have at least 2 dimensions, got shape {list(x.shape)}")
    if gain is not None:
        tl_dtype(gain.dtype)
        if gain.shape != (x.shape[0],) or gain.device != x.device:
            raise ValueError(
                f"gain must have shape [{x.shape[0]}] on {x.device}, got "
                f"{list(gain.shape)} on {gain.device}"
            )
    if not eps >= 0:
        raise ValueError(f"eps must be non-negative, got eps={eps}")


def standardize_rows(
    rows: Tensor, eps: float, gain: Tensor | None = None, factor: float = 1.0
) -> Tensor:
    r"""``(x - mean) / sqrt(var + eps)`` per row (biased variance), times ``gain * factor``
    per row, row ``i`` being ``rows[i]`` flattened.

    One kernel forward and one backward (two each for few long rows); float16/bfloat16 are
    computed in float32 and rounded once; any strides (a tensor whose rows cannot be read
    with two strides is copied once each way). ``gain * factor`` is rounded to the gain's
    dtype, as torch's product would be (Scaled WS's ``gamma / sqrt(fan_in)``). A double
    backward goes through autograd of the plain formula.

    Args:
        rows: ``[R, ...]``: a weight whose first axis indexes the standardized slices.
        eps: added to the variance inside the square root.
        gain: optional ``[R]`` factor per row.
        factor: multiplies ``gain``.

    Returns:
        The standardized tensor, contiguous, in ``rows``' shape and dtype.
    """
    result: Tensor = plan(rows, eps, gain, factor).apply(rows, gain)
    return result
