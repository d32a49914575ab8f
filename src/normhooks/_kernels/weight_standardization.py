r"""Row standardization of a weight matrix in one forward and one backward kernel.

Per row :math:`x` of length :math:`N`: :math:`\hat x = (x - \mu)\,\rho` with
:math:`\rho = 1 / \sqrt{\sigma^2 + \epsilon}` (biased variance), times a gain :math:`\gamma`
per row when given. With :math:`y' = \gamma\,y'_{\text{in}}` the incoming gradient times the
gain, :math:`\nabla x = \rho\,(y' - \overline{y'} - \hat x\,\overline{y' \hat x})` and
:math:`\nabla \gamma = \sum y'_{\text{in}} \hat x`.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels._common import acc_dtype, as_float, bits, div, on_device, sqrt, tl_dtype
from normhooks._precision import compute_dtype

_MAX_BLOCK = 1024


# ``length`` is never specialized: Triton turns an int argument equal to 1 into a constant,
# and a row of one element (a depthwise 1x1 convolution) would then fail to compile.
@triton.jit(do_not_specialize=["eps", "length"])
def _forward(  # type: ignore[no-untyped-def]
    x,
    gain,
    y,
    means,
    rstds,
    length,
    x_row_stride,
    x_stride,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    has_gain: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * x_row_stride
    sums = tl.zeros([block], dtype=acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        sums += tl.load(x_row + k * x_stride, mask=k < length, other=0.0).to(acc)
        first += block
    mean = div(tl.sum(sums, axis=0), length.to(acc), acc)
    # Two passes: the variance of the centred values, which keeps precision for rows whose
    # mean is large against their spread.
    squares = tl.zeros([block], dtype=acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
        centred = tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean
        centred = tl.where(mask, centred, 0.0)
        squares += centred * centred
        first += block
    variance = div(tl.sum(squares, axis=0), length.to(acc), acc)
    rstd = div(1.0, sqrt(variance + as_float(eps, acc), acc), acc)
    factor = rstd
    if has_gain:
        factor = rstd * tl.load(gain + row).to(acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
        centred = tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean
        tl.store(y + row * length + k, (centred * factor).to(y.dtype.element_ty), mask=mask)
        first += block
    tl.store(means + row, mean)
    tl.store(rstds + row, rstd)


@triton.jit(do_not_specialize=["length"])
def _backward(  # type: ignore[no-untyped-def]
    grad_y,
    x,
    gain,
    means,
    rstds,
    grad_x,
    grad_gain,
    length,
    dy_row_stride,
    dy_stride,
    x_row_stride,
    x_stride,
    acc: tl.constexpr,
    block: tl.constexpr,
    has_gain: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * x_row_stride
    dy_row = grad_y + row * dy_row_stride
    mean = tl.load(means + row)
    rstd = tl.load(rstds + row)
    incoming_sums = tl.zeros([block], dtype=acc)
    product_sums = tl.zeros([block], dtype=acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
        normalized = (tl.load(x_row + k * x_stride, mask=mask, other=0.0).to(acc) - mean) * rstd
        incoming = tl.load(dy_row + k * dy_stride, mask=mask, other=0.0).to(acc)
        incoming_sums += incoming
        product_sums += tl.where(mask, incoming * normalized, 0.0)
        first += block
    incoming_sum = tl.sum(incoming_sums, axis=0)
    product_sum = tl.sum(product_sums, axis=0)
    factor = rstd
    if has_gain:
        factor = rstd * tl.load(gain + row).to(acc)
        tl.store(grad_gain + row, product_sum.to(grad_gain.dtype.element_ty))
    incoming_mean = div(incoming_sum, length.to(acc), acc)
    product_mean = div(product_sum, length.to(acc), acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
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


def _block(length: int) -> int:
    return min(_MAX_BLOCK, max(16, int(triton.next_power_of_2(max(length, 1)))))


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
            with on_device(rows.device):
                _forward[(count,)](
                    rows,
                    gain.contiguous() if gain is not None else rows,
                    result,
                    means,
                    rstds,
                    length,
                    rows.stride(0),
                    rows.stride(1),
                    bits(eps),
                    acc=acc_dtype(rows.dtype),
                    block=_block(length),
                    has_gain=gain is not None,
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
            with on_device(rows.device):
                _backward[(count,)](
                    grad_y,
                    rows,
                    gain.contiguous() if gain is not None else rows,
                    means,
                    rstds,
                    grad_rows,
                    grad_gain if grad_gain is not None else rows,
                    length,
                    grad_y.stride(0),
                    grad_y.stride(1),
                    rows.stride(0),
                    rows.stride(1),
                    acc=acc_dtype(rows.dtype),
                    block=_block(length),
                    has_gain=gain is not None,
                )
        needs_rows, _, needs_gain = ctx.needs_input_grad
        return grad_rows if needs_rows else None, None, grad_gain if needs_gain else None


def standardize_rows(rows: Tensor, eps: float, gain: Tensor | None = None) -> Tensor:
    r"""``(x - mean) / sqrt(var + eps)`` per row (biased variance), times ``gain`` per row.

    One kernel forward and one backward; float16/bfloat16 are computed in float32 and
    rounded once; any strides. A double backward goes through autograd of the plain formula.

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
