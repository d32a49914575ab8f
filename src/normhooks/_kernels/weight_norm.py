r"""Exact weight normalization in one forward and one backward kernel per layer.

:math:`W = g\,v / d` with :math:`d = \|v\| + \epsilon` per index of ``dim`` (with
``eps == 0``, :math:`d = 1` for a zero row, which stays zero). With :math:`s = g / d` and
:math:`p = \sum W' v` per row (:math:`W'` the incoming gradient), the gradients are
:math:`\nabla g = p / d` and :math:`\nabla v = s W' - \frac{s p}{d \|v\|} v` (the second term
vanishes at a zero row, whatever :math:`\|v\|` is taken to be there).

``v`` is viewed as ``[A, C, B]`` with ``C = v.shape[dim]``: one program per index of ``C``.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels._common import acc_dtype, as_float, bits, div, on_device, sqrt, tl_dtype
from normhooks._precision import compute_dtype
from normhooks.weight_norm import _weight_norm as plain_weight_norm

_MAX_BLOCK = 1024


@triton.jit
def _offsets(row, k, count, inner, row_is_contiguous: tl.constexpr):  # type: ignore[no-untyped-def]
    """Addresses of the row's values number ``k`` in ``[A, count, inner]``."""
    if row_is_contiguous:
        return row * inner + k
    else:
        return (k // inner) * (count * inner) + row * inner + k % inner


@triton.jit
def _denominator(norm, eps, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    denominator = norm + as_float(eps, acc)
    # Only a zero row with eps == 0 gets here: 1 keeps it zero instead of 0/0.
    return tl.where(denominator > 0.0, denominator, 1.0).to(acc)


@triton.jit(do_not_specialize=["eps"])
def _forward(  # type: ignore[no-untyped-def]
    v,
    g,
    w,
    norms,
    length,
    count,
    inner,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    squares = tl.zeros([block], dtype=acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
        offsets = _offsets(row, k, count, inner, row_is_contiguous)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        squares += values * values
        first += block
    norm = sqrt(tl.sum(squares, axis=0), acc)
    scale = div(tl.load(g + row).to(acc), _denominator(norm, eps, acc), acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
        offsets = _offsets(row, k, count, inner, row_is_contiguous)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        tl.store(w + offsets, (values * scale).to(w.dtype.element_ty), mask=mask)
        first += block
    tl.store(norms + row, norm)


@triton.jit(do_not_specialize=["eps"])
def _backward(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    g,
    norms,
    grad_v,
    grad_g,
    length,
    count,
    inner,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    products = tl.zeros([block], dtype=acc)
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
        offsets = _offsets(row, k, count, inner, row_is_contiguous)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        incoming = tl.load(grad_w + offsets, mask=mask, other=0.0).to(acc)
        products += incoming * values
        first += block
    dot = tl.sum(products, axis=0)
    norm = tl.load(norms + row)
    denominator = _denominator(norm, eps, acc)
    safe_norm = tl.where(norm > 0.0, norm, 1.0).to(acc)
    scale = div(tl.load(g + row).to(acc), denominator, acc)
    coefficient = -div(scale * dot, denominator * safe_norm, acc)
    tl.store(grad_g + row, div(dot, denominator, acc).to(grad_g.dtype.element_ty))
    first = 0
    while first < length:
        k = first + tl.arange(0, block)
        mask = k < length
        offsets = _offsets(row, k, count, inner, row_is_contiguous)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        incoming = tl.load(grad_w + offsets, mask=mask, other=0.0).to(acc)
        result = incoming * scale + values * coefficient
        tl.store(grad_v + offsets, result.to(grad_v.dtype.element_ty), mask=mask)
        first += block


def _layout(v: Tensor, dim: int) -> tuple[int, int, int, int, bool]:
    """``(row length, C, B, block, row contiguous)`` of contiguous ``v`` viewed as ``[A, C, B]``."""
    count = v.shape[dim]
    inner = math.prod(v.shape[dim + 1 :])
    length = v.numel() // count if count else 0
    block = min(_MAX_BLOCK, max(16, int(triton.next_power_of_2(max(length, 1)))))
    return length, count, inner, block, length == inner


class _WeightNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: Tensor, v: Tensor, dim: int, eps: float) -> Tensor:
        ctx.dim, ctx.eps = dim, eps
        contiguous = v.contiguous()
        weight = torch.empty_like(contiguous)
        norms = torch.empty(v.shape[dim], dtype=compute_dtype(v.dtype), device=v.device)
        length, count, inner, block, row_contiguous = _layout(contiguous, dim)
        if count:
            with on_device(v.device):
                _forward[(count,)](
                    contiguous,
                    g.contiguous(),
                    weight,
                    norms,
                    length,
                    count,
                    inner,
                    bits(eps),
                    acc=acc_dtype(v.dtype),
                    block=block,
                    row_is_contiguous=row_contiguous,
                )
        ctx.save_for_backward(g, v, norms)
        return weight

    @staticmethod
    def backward(ctx: Any, grad_w: Tensor) -> tuple[Tensor | None, ...]:
        g, v, norms = ctx.saved_tensors
        dim, eps = ctx.dim, ctx.eps
        if torch.is_grad_enabled():
            # create_graph: the kernel's backward is not itself differentiable, so recompute
            # through the plain formula, whose graph is (the saved inputs keep their history).
            wanted = [t for t in (g, v) if t.requires_grad]
            grads = iter(
                torch.autograd.grad(
                    plain_weight_norm(g, v, dim, eps), wanted, grad_w, create_graph=True
                )
            )
            return (*(next(grads) if t.requires_grad else None for t in (g, v)), None, None)
        contiguous = v.contiguous()
        grad_v = torch.empty_like(contiguous)
        grad_g = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        length, count, inner, block, row_contiguous = _layout(contiguous, dim)
        if count:
            with on_device(v.device):
                _backward[(count,)](
                    grad_w.contiguous(),
                    contiguous,
                    g.contiguous(),
                    norms,
                    grad_v,
                    grad_g,
                    length,
                    count,
                    inner,
                    bits(eps),
                    acc=acc_dtype(v.dtype),
                    block=block,
                    row_is_contiguous=row_contiguous,
                )
        needs_g, needs_v = ctx.needs_input_grad[:2]
        return grad_g if needs_g else None, grad_v if needs_v else None, None, None


def _check(g: Tensor, v: Tensor, dim: int, eps: float) -> None:
    tl_dtype(v.dtype)
    if not -v.ndim <= dim < v.ndim:
        raise ValueError(
            f"dim must be in [{-v.ndim}, {v.ndim - 1}] for v of shape "
            f"{list(v.shape)}, got dim={dim}"
        )
    expected = [n if d == dim % v.ndim else 1 for d, n in enumerate(v.shape)]
    if list(g.shape) != expected:
        raise ValueError(
            f"g must have shape {expected} (v's shape {list(v.shape)} with 1s except at "
            f"dim={dim}), got {list(g.shape)}"
        )
    if g.device != v.device:
        raise ValueError(f"g and v must be on one device, got {g.device} and {v.device}")
    if not eps >= 0:
        raise ValueError(f"eps must be non-negative, got eps={eps}")


def weight_norm(g: Tensor, v: Tensor, dim: int, eps: float) -> Tensor:
    r"""``g * v / (||v|| + eps)``, norms over every axis but ``dim``, in one kernel each way.

    With ``eps == 0`` a zero row of ``v`` divides by 1 and gives a zero row (finite
    gradients). float16/bfloat16 are computed in float32 and rounded once. Differentiable in
    ``g`` and ``v``; a double backward goes through autograd of the plain formula.

    Args:
        g: the gains: ``v.ndim`` dimensions, all 1 except ``v.shape[dim]`` at ``dim``.
        v: the directions, any layout (a non-contiguous ``v`` is copied once each way).
        dim: the axis with one norm per index (0, or 1 for transposed convolutions).
        eps: added to the norm.

    Returns:
        :math:`W`, contiguous, with ``v``'s shape and dtype.
    """
    _check(g, v, dim, eps)
    result: Tensor = _WeightNorm.apply(g, v, dim % v.ndim, float(eps))  # type: ignore[no-untyped-call]
    return result
