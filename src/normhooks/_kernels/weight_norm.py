r"""Exact weight normalization in one forward and one backward kernel per layer (two each way
for a layer of few long rows).

:math:`W = g\,v / d` with :math:`d = \|v\| + \epsilon` per index of ``dim`` (with
``eps == 0``, :math:`d = 1` for a zero row, which stays zero). With :math:`s = g / d` and
:math:`p = \sum W' v` per row (:math:`W'` the incoming gradient), the gradients are
:math:`\nabla g = p / d` and :math:`\nabla v = s W' - \frac{s p}{d \|v\|} v` (the second term
vanishes at a zero row, whatever :math:`\|v\|` is taken to be there).

``v`` is viewed as ``[A, C, B]`` with ``C = v.shape[dim]``: one program per index of ``C``,
or, for few long rows, one per segment of a row (see ``_common.row_plan``): then a first
launch each way writes the segments' sums of squares (of :math:`W' v`) and the second adds a
row's partial sums in a fixed order.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

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
    on_device,
    row_partials,
    row_plan,
    segment_bounds,
    sqrt,
    tl_dtype,
)
from normhooks._precision import compute_dtype


@triton.jit
def _offsets(  # type: ignore[no-untyped-def]
    row, k, count, inner, row_is_contiguous: tl.constexpr, wide: tl.constexpr
):
    """Addresses of the row's values number ``k`` in ``[A, count, inner]``."""
    if row_is_contiguous:
        return row * inner + k
    elif wide:
        # count * inner would be a 32-bit product of two 32-bit arguments.
        return (k // inner) * count * inner + row * inner + k % inner
    else:
        return (k // inner) * (count * inner) + row * inner + k % inner


@triton.jit
def _denominator(norm, eps, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    denominator = norm + as_float(eps, acc)
    # Only a zero row with eps == 0 gets here: 1 keeps it zero instead of 0/0.
    return tl.where(denominator > 0.0, denominator, 1.0).to(acc)


@triton.jit
def _sum_of_squares(  # type: ignore[no-untyped-def]
    v,
    row,
    start,
    end,
    count,
    inner,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    wide: tl.constexpr,
):
    squares = tl.zeros([block], dtype=acc)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        offsets = _offsets(row, k, count, inner, row_is_contiguous, wide)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        squares += values * values
        first += block
    return tl.sum(squares, axis=0)


@triton.jit
def _sum_of_products(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    row,
    start,
    end,
    count,
    inner,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    wide: tl.constexpr,
):
    products = tl.zeros([block], dtype=acc)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        offsets = _offsets(row, k, count, inner, row_is_contiguous, wide)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        incoming = tl.load(grad_w + offsets, mask=mask, other=0.0).to(acc)
        products += incoming * values
        first += block
    return tl.sum(products, axis=0)


@triton.jit
def _squares(  # type: ignore[no-untyped-def]
    v,
    partials,
    length,
    count,
    inner,
    segment,
    splits,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    wide: tl.constexpr,
):
    """A split row's first launch: each segment's sum of squares."""
    row = tl.program_id(0).to(tl.int64)
    start, end = segment_bounds(length, segment, wide)
    squares = _sum_of_squares(v, row, start, end, count, inner, acc, block, row_is_contiguous, wide)
    tl.store(partials + row * splits + tl.program_id(1), squares)


@triton.jit(do_not_specialize=["eps"])
def _forward(  # type: ignore[no-untyped-def]
    v,
    g,
    w,
    norms,
    partials,
    length,
    count,
    inner,
    segment,
    splits,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    split: tl.constexpr,
    partials_block: tl.constexpr,
    wide: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start, end = segment_bounds(length, segment, wide)
    if split:
        squares = row_partials(partials, row, splits, partials_block)
    else:
        squares = _sum_of_squares(
            v, row, start, end, count, inner, acc, block, row_is_contiguous, wide
        )
    norm = sqrt(squares, acc)
    scale = div(tl.load(g + row).to(acc), _denominator(norm, eps, acc), acc)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        offsets = _offsets(row, k, count, inner, row_is_contiguous, wide)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        tl.store(w + offsets, (values * scale).to(w.dtype.element_ty), mask=mask)
        first += block
    tl.store(norms + row, norm, mask=tl.program_id(1) == 0)


@triton.jit
def _products(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    partials,
    length,
    count,
    inner,
    segment,
    splits,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    wide: tl.constexpr,
):
    """A split row's first launch backward: each segment's sum of ``W' v``."""
    row = tl.program_id(0).to(tl.int64)
    start, end = segment_bounds(length, segment, wide)
    dot = _sum_of_products(
        grad_w, v, row, start, end, count, inner, acc, block, row_is_contiguous, wide
    )
    tl.store(partials + row * splits + tl.program_id(1), dot)


@triton.jit(do_not_specialize=["eps"])
def _backward(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    g,
    norms,
    partials,
    grad_v,
    grad_g,
    length,
    count,
    inner,
    segment,
    splits,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    split: tl.constexpr,
    partials_block: tl.constexpr,
    wide: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start, end = segment_bounds(length, segment, wide)
    if split:
        dot = row_partials(partials, row, splits, partials_block)
    else:
        dot = _sum_of_products(
            grad_w, v, row, start, end, count, inner, acc, block, row_is_contiguous, wide
        )
    norm = tl.load(norms + row)
    denominator = _denominator(norm, eps, acc)
    safe_norm = tl.where(norm > 0.0, norm, 1.0).to(acc)
    scale = div(tl.load(g + row).to(acc), denominator, acc)
    coefficient = -div(scale * dot, denominator * safe_norm, acc)
    grad = div(dot, denominator, acc).to(grad_g.dtype.element_ty)
    tl.store(grad_g + row, grad, mask=tl.program_id(1) == 0)
    first = start
    while first < end:
        k = first + tl.arange(0, block)
        mask = k < end
        offsets = _offsets(row, k, count, inner, row_is_contiguous, wide)
        values = tl.load(v + offsets, mask=mask, other=0.0).to(acc)
        incoming = tl.load(grad_w + offsets, mask=mask, other=0.0).to(acc)
        result = incoming * scale + values * coefficient
        tl.store(grad_v + offsets, result.to(grad_v.dtype.element_ty), mask=mask)
        first += block


class _Layout(NamedTuple):
    """Contiguous ``v`` viewed as ``[A, C, B]``, and how programs cover its ``C`` rows."""

    length: int
    rows: int
    inner: int
    row_is_contiguous: bool
    plan: RowPlan


def _layout(v: Tensor, dim: int) -> _Layout:
    count = v.shape[dim]
    inner = math.prod(v.shape[dim + 1 :])
    numel = v.numel()
    length = numel // count if count else 0
    return _Layout(length, count, inner, length == inner, row_plan(count, length, numel))


def _partials(count: int, plan: RowPlan, norms: Tensor) -> Tensor:
    """The partial sums of split rows; ``norms`` stands in (unread) when rows are whole."""
    if plan.splits == 1:
        return norms
    return torch.empty((count, plan.splits), dtype=norms.dtype, device=norms.device)


class _WeightNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, g: Tensor, v: Tensor, dim: int, eps: float, plain: Callable[..., Tensor]
    ) -> Tensor:
        ctx.dim, ctx.eps, ctx.plain = dim, eps, plain
        contiguous = v.contiguous()
        weight = torch.empty_like(contiguous)
        norms = torch.empty(v.shape[dim], dtype=compute_dtype(v.dtype), device=v.device)
        length, count, inner, row_contiguous, plan = _layout(v, dim)
        if count:
            split = plan.splits > 1
            partials = _partials(count, plan, norms)
            sizes = (length, count, inner, plan.segment, plan.splits)
            shared = {"acc": acc_dtype(v.dtype), "block": plan.block, "wide": plan.wide}
            shared["row_is_contiguous"] = row_contiguous
            grid = (count, plan.splits)
            with on_device(v.device):
                if split:
                    _squares[grid](contiguous, partials, *sizes, **shared)
                _forward[grid](
                    contiguous,
                    g.contiguous(),
                    weight,
                    norms,
                    partials,
                    *sizes,
                    bits(eps),
                    **shared,
                    split=split,
                    partials_block=plan.partials_block,
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
                torch.autograd.grad(ctx.plain(g, v, dim, eps), wanted, grad_w, create_graph=True)
            )
            return (*(next(grads) if t.requires_grad else None for t in (g, v)), None, None, None)
        contiguous = v.contiguous()
        grad_v = torch.empty_like(contiguous)
        grad_g = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        length, count, inner, row_contiguous, plan = _layout(v, dim)
        if count:
            split = plan.splits > 1
            partials = _partials(count, plan, norms)
            incoming = grad_w.contiguous()
            sizes = (length, count, inner, plan.segment, plan.splits)
            shared = {"acc": acc_dtype(v.dtype), "block": plan.block, "wide": plan.wide}
            shared["row_is_contiguous"] = row_contiguous
            grid = (count, plan.splits)
            with on_device(v.device):
                if split:
                    _products[grid](incoming, contiguous, partials, *sizes, **shared)
                _backward[grid](
                    incoming,
                    contiguous,
                    g.contiguous(),
                    norms,
                    partials,
                    grad_v,
                    grad_g,
                    *sizes,
                    bits(eps),
                    **shared,
                    split=split,
                    partials_block=plan.partials_block,
                )
        needs_g, needs_v = ctx.needs_input_grad[:2]
        return grad_g if needs_g else None, grad_v if needs_v else None, None, None, None


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


def weight_norm(
    g: Tensor, v: Tensor, dim: int, eps: float, *, plain: Callable[..., Tensor]
) -> Tensor:
    r"""``g * v / (||v|| + eps)``, norms over every axis but ``dim``, in one kernel each way
    (two for a layer of few long rows).

    With ``eps == 0`` a zero row of ``v`` divides by 1 and gives a zero row (finite
    gradients). float16/bfloat16 are computed in float32 and rounded once. Differentiable in
    ``g`` and ``v``; a double backward goes through autograd of the plain formula.

    Args:
        g: the gains: ``v.ndim`` dimensions, all 1 except ``v.shape[dim]`` at ``dim``.
        v: the directions, any layout (a non-contiguous ``v`` is copied once each way).
        dim: the axis with one norm per index (0, or 1 for transposed convolutions).
        eps: added to the norm.
        plain: the same function in differentiable torch ops, ``plain(g, v, dim, eps)``, which a
            double backward recomputes through (the caller's formula: nothing here imports
            the package above).

    Returns:
        :math:`W`, contiguous, with ``v``'s shape and dtype.
    """
    _check(g, v, dim, eps)
    result: Tensor = _WeightNorm.apply(g, v, dim % v.ndim, float(eps), plain)  # type: ignore[no-untyped-call]
    return result
