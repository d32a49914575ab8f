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
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels._common import (
    RowPlan,
    acc_dtype,
    as_float,
    bits,
    div,
    extent,
    on_device,
    row_partials,
    row_plan,
    segment_bounds,
    sqrt,
    tl_dtype,
)
from normhooks._precision import compute_dtype


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
        k = first + tl.arange(0, block)
        mask = k < end
        normalized = (tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean) * rstd
        incoming = tl.load(dy_row + k * dy_stride, mask=mask, other=0.0).to(acc)
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


@triton.jit(do_not_specialize=["eps", "length"])
def _forward(  # type: ignore[no-untyped-def]
    x,
    gain,
    y,
    means,
    rstds,
    sums,
    squares,
    length,
    segment,
    splits,
    x_row_stride,
    x_stride,
    eps,
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
        variance = div(tl.sum(spread, axis=0), length.to(acc), acc)
    else:
        mean = div(_sum(x_row, x_stride, start, end, acc, block), length.to(acc), acc)
        spread = _centred_squares(x_row, x_stride, start, end, mean, acc, block)
        variance = div(spread, length.to(acc), acc)
    rstd = div(1.0, sqrt(variance + as_float(eps, acc), acc), acc)
    factor = rstd
    if has_gain:
        factor = rstd * tl.load(gain + row).to(acc)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        centred = tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean
        tl.store(y + row * length + k, (centred * factor).to(y.dtype.element_ty), mask=mask)
        first += block
    first_part = tl.program_id(1) == 0
    tl.store(means + row, mean, mask=first_part)
    tl.store(rstds + row, rstd, mask=first_part)


@triton.jit(do_not_specialize=["length"])
def _sums(  # type: ignore[no-untyped-def]
    grad_y,
    x,
    means,
    rstds,
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
    incoming, product = _gradient_sums(
        x + row * x_row_stride,
        grad_y + row * dy_row_stride,
        x_stride,
        dy_stride,
        start,
        end,
        tl.load(means + row),
        tl.load(rstds + row),
        acc,
        block,
    )
    at = row * splits + tl.program_id(1)
    tl.store(incoming_sums + at, incoming)
    tl.store(product_sums + at, product)


@triton.jit(do_not_specialize=["length"])
def _backward(  # type: ignore[no-untyped-def]
    grad_y,
    x,
    gain,
    means,
    rstds,
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
    mean = tl.load(means + row)
    rstd = tl.load(rstds + row)
    start, end = segment_bounds(length, segment, wide)
    if split:
        incoming_sum = row_partials(incoming_sums, row, splits, partials_block)
        product_sum = row_partials(product_sums, row, splits, partials_block)
    else:
        incoming_sum, product_sum = _gradient_sums(
            x_row, dy_row, x_stride, dy_stride, start, end, mean, rstd, acc, block
        )
    factor = rstd
    if has_gain:
        factor = rstd * tl.load(gain + row).to(acc)
        grad = product_sum.to(grad_gain.dtype.element_ty)
        tl.store(grad_gain + row, grad, mask=tl.program_id(1) == 0)
    incoming_mean = div(incoming_sum, length.to(acc), acc)
    product_mean = div(product_sum, length.to(acc), acc)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        normalized = (tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean) * rstd
        incoming = tl.load(dy_row + k * dy_stride, mask=mask, other=0.0).to(acc)
        result = factor * (incoming - incoming_mean - normalized * product_mean)
        tl.store(grad_x + row * length + k, result.to(grad_x.dtype.element_ty), mask=mask)
        first += block


def _plain(rows: Tensor, eps: float, gain: Tensor | None) -> Tensor:
    """The formula in differentiable torch ops, for a backward that must be differentiable."""
    exact = rows.to(compute_dtype(rows.dtype))
    mean = exact.mean(1, keepdim=True)
    variance = (exact - mean).square().mean(1, keepdim=True)
    result = (exact - mean) / torch.sqrt(variance + eps)
    if gain is not None:
        result = result * gain.to(result.dtype).view(-1, 1)
    return result.to(rows.dtype)


def _plan(rows: Tensor, *others: Tensor) -> RowPlan:
    """How programs cover ``rows`` (and ``others`` of its shape, any strides) and the
    contiguous result."""
    count, length = rows.shape
    reach = max(extent(tuple(t.shape), t.stride()) for t in (rows, *others))
    return row_plan(count, length, max(reach, count * length))


def _partials(count: int, plan: RowPlan, stand_in: Tensor) -> tuple[Tensor, Tensor]:
    """Two planes of partial sums for split rows; ``stand_in`` (unread) when rows are whole."""
    if plan.splits == 1:
        return stand_in, stand_in
    planes = torch.empty((2, count, plan.splits), dtype=stand_in.dtype, device=stand_in.device)
    return planes[0], planes[1]


class _Standardize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: Tensor, eps: float, gain: Tensor | None) -> Tensor:
        ctx.eps = eps
        count, length = rows.shape
        acc = compute_dtype(rows.dtype)
        result = torch.empty((count, length), dtype=rows.dtype, device=rows.device)
        means = torch.empty(count, dtype=acc, device=rows.device)
        rstds = torch.empty(count, dtype=acc, device=rows.device)
        if rows.numel():
            plan = _plan(rows)
            split = plan.splits > 1
            sums, squares = _partials(count, plan, means)
            sizes = (length, plan.segment, plan.splits, rows.stride(0), rows.stride(1))
            shared = {"acc": acc_dtype(rows.dtype), "block": plan.block, "wide": plan.wide}
            grid = (count, plan.splits)
            with on_device(rows.device):
                if split:
                    _moments[grid](rows, sums, squares, *sizes, **shared)
                _forward[grid](
                    rows,
                    gain.contiguous() if gain is not None else rows,
                    result,
                    means,
                    rstds,
                    sums,
                    squares,
                    *sizes,
                    bits(eps),
                    **shared,
                    has_gain=gain is not None,
                    split=split,
                    partials_block=plan.partials_block,
                )
        ctx.save_for_backward(rows, gain, means, rstds)
        return result

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        rows, gain, means, rstds = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph: the kernel's backward is not itself differentiable, so recompute
            # through the plain formula, whose graph is (the saved inputs keep their history).
            inputs = [t for t in (rows, gain) if t is not None and t.requires_grad]
            grads = iter(
                torch.autograd.grad(_plain(rows, ctx.eps, gain), inputs, grad_y, create_graph=True)
            )
            grad_rows = next(grads) if rows.requires_grad else None
            grad_gain = next(grads) if gain is not None and gain.requires_grad else None
            return grad_rows, None, grad_gain
        count, length = rows.shape
        grad_rows = torch.empty((count, length), dtype=rows.dtype, device=rows.device)
        grad_gain = None
        if gain is not None:
            grad_gain = torch.zeros(gain.shape, dtype=gain.dtype, device=gain.device)
        if rows.numel():
            plan = _plan(rows, grad_y)
            split = plan.splits > 1
            incoming_sums, product_sums = _partials(count, plan, means)
            sizes = (length, plan.segment, plan.splits)
            strides = (grad_y.stride(0), grad_y.stride(1), rows.stride(0), rows.stride(1))
            shared = {"acc": acc_dtype(rows.dtype), "block": plan.block, "wide": plan.wide}
            grid = (count, plan.splits)
            with on_device(rows.device):
                if split:
                    _sums[grid](
                        grad_y,
                        rows,
                        means,
                        rstds,
                        incoming_sums,
                        product_sums,
                        *sizes,
                        *strides,
                        **shared,
                    )
                _backward[grid](
                    grad_y,
                    rows,
                    gain.contiguous() if gain is not None else rows,
                    means,
                    rstds,
                    incoming_sums,
                    product_sums,
                    grad_rows,
                    grad_gain if grad_gain is not None else rows,
                    *sizes,
                    *strides,
                    **shared,
                    has_gain=gain is not None,
                    split=split,
                    partials_block=plan.partials_block,
                )
        needs_rows, _, needs_gain = ctx.needs_input_grad
        return grad_rows if needs_rows else None, None, grad_gain if needs_gain else None


def standardize_rows(rows: Tensor, eps: float, gain: Tensor | None = None) -> Tensor:
    r"""``(x - mean) / sqrt(var + eps)`` per row (biased variance), times ``gain`` per row.

    One kernel forward and one backward (two each for few long rows); float16/bfloat16 are
    computed in float32 and rounded once; any strides. A double backward goes through
    autograd of the plain formula.

    Args:
        rows: the ``[R, N]`` matrix of weight slices.
        eps: added to the variance inside the square root.
        gain: optional ``[R]`` factor per row.

    Returns:
        The standardized ``[R, N]`` matrix, contiguous, in ``rows``' dtype.
    """
    tl_dtype(rows.dtype)
    if rows.ndim != 2:
        raise ValueError(f"rows must be a 2-D matrix, got shape {list(rows.shape)}")
    if gain is not None and (gain.shape != (rows.shape[0],) or gain.device != rows.device):
        raise ValueError(
            f"gain must have shape [{rows.shape[0]}] on {rows.device}, got "
            f"{list(gain.shape)} on {gain.device}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be non-negative, got eps={eps}")
    result: Tensor = _Standardize.apply(rows, float(eps), gain)  # type: ignore[no-untyped-call]
    return result
