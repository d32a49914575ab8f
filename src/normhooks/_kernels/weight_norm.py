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
row's partial sums in a fixed order. Forward saves only g and v: backward recomputes each
row's norm in the pass that reads v anyway, summed in the order forward summed it.

:class:`FusedPlan` computes many layers (one device and dtype, whole rows) in one launch each
way, every row of every layer one program, finding each layer's tensors through a table of
addresses on the device (``normhooks._kernels._scope`` decides which layers).
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels import _fallback, _fused
from normhooks._kernels._cache import KeyedCache
from normhooks._kernels._common import (
    RowPlan,
    acc_dtype,
    as_float,
    bits,
    device_index,
    div,
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
def _row_block(  # type: ignore[no-untyped-def]
    v,
    row,
    first,
    end,
    count,
    inner,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    wide: tl.constexpr,
):
    """The offsets, mask and values (in ``acc``) of the row's block of values from ``first``
    (of ``[first, end)``)."""
    k = first + tl.arange(0, block)
    mask = k < end
    offsets = _offsets(row, k, count, inner, row_is_contiguous, wide)
    return offsets, mask, tl.load(v + offsets, mask=mask, other=0.0).to(acc)


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
        _, _, values = _row_block(
            v, row, first, end, count, inner, acc, block, row_is_contiguous, wide
        )
        squares += values * values
        first += block
    return tl.sum(squares, axis=0)


@triton.jit
def _sums_of_products(  # type: ignore[no-untyped-def]
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
    """``(sum W' v, sum v v)`` over ``[start, end)``: backward recomputes the norm in the pass
    that reads v anyway, in the order forward summed it, so forward saves nothing."""
    products = tl.zeros([block], dtype=acc)
    squares = tl.zeros([block], dtype=acc)
    first = start
    while first < end:
        offsets, mask, values = _row_block(
            v, row, first, end, count, inner, acc, block, row_is_contiguous, wide
        )
        incoming = tl.load(grad_w + offsets, mask=mask, other=0.0).to(acc)
        products += incoming * values
        squares += values * values
        first += block
    return tl.sum(products, axis=0), tl.sum(squares, axis=0)


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


_SQUARES = Kernel(_squares)


@triton.jit(do_not_specialize=["eps"])
def _forward(  # type: ignore[no-untyped-def]
    v,
    g,
    w,
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
    _write_scaled(
        v, g, w, row, start, end, count, inner, squares, eps, acc, block, row_is_contiguous, wide
    )


_FORWARD = Kernel(_forward)


@triton.jit
def _products(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    dots,
    squares,
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
    """A split row's first launch backward: each segment's sums of ``W' v`` and of ``v v``."""
    row = tl.program_id(0).to(tl.int64)
    start, end = segment_bounds(length, segment, wide)
    dot, square = _sums_of_products(
        grad_w, v, row, start, end, count, inner, acc, block, row_is_contiguous, wide
    )
    at = row * splits + tl.program_id(1)
    tl.store(dots + at, dot)
    tl.store(squares + at, square)


_PRODUCTS = Kernel(_products)


@triton.jit(do_not_specialize=["eps"])
def _backward(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    g,
    dots,
    squares,
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
        dot = row_partials(dots, row, splits, partials_block)
        square = row_partials(squares, row, splits, partials_block)
    else:
        dot, square = _sums_of_products(
            grad_w, v, row, start, end, count, inner, acc, block, row_is_contiguous, wide
        )
    _write_gradients(
        grad_w,
        v,
        g,
        grad_v,
        grad_g + row,
        row,
        start,
        end,
        count,
        inner,
        dot,
        square,
        eps,
        acc,
        block,
        row_is_contiguous,
        wide,
    )


_BACKWARD = Kernel(_backward)


@triton.jit
def _write_scaled(  # type: ignore[no-untyped-def]
    v,
    g,
    w,
    row,
    start,
    end,
    count,
    inner,
    squares,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    wide: tl.constexpr,
):
    """``w = g v / (||v|| + eps)`` over the row's values ``[start, end)``, from the row's sum
    of squares."""
    scale = div(tl.load(g + row).to(acc), _denominator(sqrt(squares, acc), eps, acc), acc)
    first = start
    while first < end:
        offsets, mask, values = _row_block(
            v, row, first, end, count, inner, acc, block, row_is_contiguous, wide
        )
        tl.store(w + offsets, (values * scale).to(w.dtype.element_ty), mask=mask)
        first += block


@triton.jit
def _write_gradients(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    g,
    grad_v,
    grad_g_row,
    row,
    start,
    end,
    count,
    inner,
    dot,
    square,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
    wide: tl.constexpr,
):
    """The row's gradients from its sums of ``W' v`` and ``v v``: ``grad_g_row`` (from the
    program of the row's first segment) and ``grad_v`` over ``[start, end)``."""
    norm = sqrt(square, acc)
    denominator = _denominator(norm, eps, acc)
    safe_norm = tl.where(norm > 0.0, norm, 1.0).to(acc)
    scale = div(tl.load(g + row).to(acc), denominator, acc)
    coefficient = -div(scale * dot, denominator * safe_norm, acc)
    grad = div(dot, denominator, acc).to(grad_g_row.dtype.element_ty)
    tl.store(grad_g_row, grad, mask=tl.program_id(1) == 0)
    first = start
    while first < end:
        offsets, mask, values = _row_block(
            v, row, first, end, count, inner, acc, block, row_is_contiguous, wide
        )
        incoming = tl.load(grad_w + offsets, mask=mask, other=0.0).to(acc)
        result = incoming * scale + values * coefficient
        tl.store(grad_v + offsets, result.to(grad_v.dtype.element_ty), mask=mask)
        first += block


@triton.jit
def _normalize_row(  # type: ignore[no-untyped-def]
    v,
    g,
    w,
    row,
    length,
    count,
    inner,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
):
    """A whole row's weight, in one program (64-bit offsets)."""
    start = length * 0
    squares = _sum_of_squares(
        v, row, start, length, count, inner, acc, block, row_is_contiguous, True
    )
    _write_scaled(
        v, g, w, row, start, length, count, inner, squares, eps, acc, block, row_is_contiguous, True
    )


@triton.jit
def _row_gradients(  # type: ignore[no-untyped-def]
    grad_w,
    v,
    g,
    grad_v,
    grad_g_row,
    row,
    length,
    count,
    inner,
    eps,
    acc: tl.constexpr,
    block: tl.constexpr,
    row_is_contiguous: tl.constexpr,
):
    """A whole row's gradients, in one program (64-bit offsets)."""
    start = length * 0
    dot, square = _sums_of_products(
        grad_w, v, row, start, length, count, inner, acc, block, row_is_contiguous, True
    )
    _write_gradients(
        grad_w,
        v,
        g,
        grad_v,
        grad_g_row,
        row,
        start,
        length,
        count,
        inner,
        dot,
        square,
        eps,
        acc,
        block,
        row_is_contiguous,
        True,
    )


@triton.jit
def _fused_entry(layers, layer, index, dtype: tl.constexpr, fields: tl.constexpr):  # type: ignore[no-untyped-def]
    """Program ``index``'s layer's entry in a fused plan's table (see
    :meth:`FusedPlan.entry`): the layer's v and g, its length, count and inner size, where its
    weight starts in the flat output, eps's bits, and the program's row of the layer."""
    entry = layers + layer * fields
    v = tl.load(entry).to(tl.pointer_type(dtype))
    g = tl.load(entry + 1).to(tl.pointer_type(dtype))
    length = tl.load(entry + 2)
    count = tl.load(entry + 3)
    inner = tl.load(entry + 4)
    at = tl.load(entry + 5)
    eps = tl.load(entry + 7)
    return v, g, length, count, inner, at, eps, index - tl.load(entry + 6)


@triton.jit
def _fused_forward(  # type: ignore[no-untyped-def]
    layers,
    row_layers,
    w,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    fields: tl.constexpr,
):
    """Every row of every layer of a fused plan, one program each, each finding its layer's
    tensors through the table ``layers`` (:func:`_fused_entry`)."""
    index = tl.program_id(0).to(tl.int64)
    layer = tl.load(row_layers + index)
    v, g, length, count, inner, at, eps, row = _fused_entry(layers, layer, index, dtype, fields)
    # Contiguous rows, the common case, index without a division.
    if length == inner:
        _normalize_row(v, g, w + at, row, length, count, inner, eps, acc, block, True)
    else:
        _normalize_row(v, g, w + at, row, length, count, inner, eps, acc, block, False)


_FUSED_FORWARD = Kernel(_fused_forward)


@triton.jit
def _fused_backward(  # type: ignore[no-untyped-def]
    layers,
    row_layers,
    grads,
    grad_v,
    grad_g,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    fields: tl.constexpr,
):
    """Backward of :func:`_fused_forward`: ``grads`` holds the address of each layer's
    incoming gradient, 0 for a weight that got none (its rows write nothing)."""
    index = tl.program_id(0).to(tl.int64)
    layer = tl.load(row_layers + index)
    address = tl.load(grads + layer)
    if address != 0:
        grad_w = address.to(tl.pointer_type(dtype))
        v, g, length, count, inner, at, eps, row = _fused_entry(layers, layer, index, dtype, fields)
        out, gain_out = grad_v + at, grad_g + index
        if length == inner:
            _row_gradients(
                grad_w, v, g, out, gain_out, row, length, count, inner, eps, acc, block, True
            )
        else:
            _row_gradients(
                grad_w, v, g, out, gain_out, row, length, count, inner, eps, acc, block, False
            )


_FUSED_BACKWARD = Kernel(_fused_backward)


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


class _Plan:
    """Everything a layer's launches need that its shapes, strides, dtypes, device, ``dim``
    and ``eps`` fix: computed once, after the checks, and found again by :func:`plan`."""

    __slots__ = (
        "backward_kernels",
        "block",
        "constexprs",
        "count",
        "device",
        "dim",
        "empty",
        "eps",
        "eps_bits",
        "first_constexprs",
        "forward_kernels",
        "g_contiguous",
        "grid",
        "inputs",
        "partials",
        "plain",
        "sizes",
        "split",
        "v_contiguous",
    )

    def __init__(
        self, g: Tensor, v: Tensor, dim: int, eps: float, plain: Callable[..., Tensor]
    ) -> None:
        length, count, inner, row_contiguous, plan = _layout(v, dim)
        self.dim, self.eps, self.plain = dim, eps, plain
        # The layouts of g and v it was made for (its key's): what a backward compares.
        self.inputs = _inputs(g, v)
        self.count, self.block = count, plan.block
        self.empty = count == 0
        self.split = plan.splits > 1
        self.grid = (count, plan.splits)
        self.sizes = (length, count, inner, plan.segment, plan.splits)
        self.eps_bits = bits(eps)
        acc = acc_dtype(v.dtype)
        self.first_constexprs = (acc, plan.block, row_contiguous, plan.wide)
        self.constexprs = (
            acc,
            plan.block,
            row_contiguous,
            self.split,
            plan.partials_block,
            plan.wide,
        )
        self.partials = (count * plan.splits, compute_dtype(v.dtype))
        self.v_contiguous = v.is_contiguous()
        self.g_contiguous = g.is_contiguous()
        self.device = device_index(v.device)
        # The compiled kernels this plan launches, by the alignment of their pointers.
        self.forward_kernels: tuple[dict[Any, Any], dict[Any, Any]] = ({}, {})
        self.backward_kernels: tuple[dict[Any, Any], dict[Any, Any]] = ({}, {})

    def apply(self, g: Tensor, v: Tensor) -> Tensor:
        """:func:`weight_norm` of a layer of this plan, on plain eager tensors."""
        result: Tensor = _APPLY(g, v, self)
        return result

    def differentiable(self, g: Tensor, v: Tensor | None) -> Tensor:
        """The layer's weight through the caller's formula in differentiable torch ops."""
        return self.plain(g, v, self.dim, self.eps)


# Plans by everything they are computed from (layouts and settings): valid by construction.
_plans: KeyedCache[tuple[object, ...], _Plan] = KeyedCache()


def plan(g: Tensor, v: Tensor, dim: int, eps: float, plain: Callable[..., Tensor]) -> _Plan:
    """The checked plan of a layer, found by what determines it (never stale: a layer that
    changes shape, layout, dtype or device gets another key). ``plain`` is the formula in
    differentiable torch ops that a double backward goes through (see :func:`weight_norm`)."""
    key: tuple[object, ...] = (v.shape, v.stride(), v.dtype, v.device, g.shape, g.stride())
    key += (g.dtype, g.device, dim, eps, plain)
    found = _plans.get(key)
    if found is None:
        _check(g, v, dim, eps)
        found = _Plan(g, v, dim % v.ndim, float(eps), plain)
        _plans.put(key, found)
    return found


def _inputs(g: Tensor, v: Tensor) -> tuple[object, ...]:
    return g.shape, g.stride(), g.dtype, g.device, v.shape, v.stride(), v.dtype, v.device


class _WeightNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: Tensor, v: Tensor, plan: _Plan) -> Tensor:
        ctx.plan = plan
        # Their layouts are the plan's (it was found for them); their types, kept.
        ctx.types = (type(g), type(v))
        ctx.save_for_backward(g, v)
        contiguous = v if plan.v_contiguous else v.contiguous()
        weight = torch.empty_like(contiguous)
        if plan.empty:
            return weight
        gains = g if plan.g_contiguous else g.contiguous()
        partials = weight
        if plan.split:
            count, dtype = plan.partials
            partials = torch.empty(count, dtype=dtype, device=v.device)
            _SQUARES(
                plan.forward_kernels[0],
                plan.grid,
                plan.device,
                (contiguous,),
                contiguous,
                partials,
                *plan.sizes,
                *plan.first_constexprs,
            )
        _FORWARD(
            plan.forward_kernels[1],
            plan.grid,
            plan.device,
            (contiguous, gains),
            contiguous,
            gains,
            weight,
            partials,
            *plan.sizes,
            plan.eps_bits,
            *plan.constexprs,
        )
        return weight

    @staticmethod
    def backward(ctx: Any, grad_w: Tensor) -> tuple[Tensor | None, ...]:
        g, v = ctx.saved_tensors
        plan: _Plan = ctx.plan
        if torch.is_grad_enabled():
            return (*_fused.differentiable_grads(plan, (g, v), grad_w), None)
        if _inputs(g, v) != plan.inputs or (type(g), type(v)) != ctx.types:
            # g or v changed layout since the forward (same values, other strides): the plan
            # was made for the old one.
            return (*_fused.formula_grads(plan, (g, v), grad_w), None)
        try:
            return _kernel_backward(ctx, g, v, plan, grad_w)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError):
                raise
            _fallback.failed("weight normalization's backward", error)
            return (*_fused.formula_grads(plan, (g, v), grad_w), None)


def _kernel_backward(
    ctx: Any, g: Tensor, v: Tensor, plan: _Plan, grad_w: Tensor
) -> tuple[Tensor | None, ...]:
    contiguous = v if plan.v_contiguous else v.contiguous()
    grad_v = torch.empty_like(contiguous)
    grad_g = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if plan.empty:
        grad_g.zero_()
    else:
        incoming = grad_w.contiguous()
        gains = g if plan.g_contiguous else g.contiguous()
        dots = squares = grad_v
        if plan.split:
            count, dtype = plan.partials
            planes = torch.empty((2, count), dtype=dtype, device=v.device)
            dots, squares = planes[0], planes[1]
            _PRODUCTS(
                plan.backward_kernels[0],
                plan.grid,
                plan.device,
                (incoming, contiguous, squares),
                incoming,
                contiguous,
                dots,
                squares,
                *plan.sizes,
                *plan.first_constexprs,
            )
        _BACKWARD(
            plan.backward_kernels[1],
            plan.grid,
            plan.device,
            # The second plane of partial sums starts wherever the first one ends.
            (incoming, contiguous, gains, squares),
            incoming,
            contiguous,
            gains,
            dots,
            squares,
            grad_v,
            grad_g,
            *plan.sizes,
            plan.eps_bits,
            *plan.constexprs,
        )
    needs_g, needs_v = ctx.needs_input_grad[:2]
    return grad_g if needs_g else None, grad_v if needs_v else None, None


_APPLY = function_apply(_WeightNorm)


# --- one launch each way for many layers ----------------------------------------------------


def fusable(plan: _Plan) -> bool:
    """Whether a layer of ``plan`` can go in a fused launch: whole rows (few long rows keep
    their own two launches), contiguous g and v, at least one value."""
    return not (plan.split or plan.empty) and plan.v_contiguous and plan.g_contiguous


class FusedPlan(_fused.FusedPlan[_Plan]):
    """Layers whose weights are computed in one launch, and their gradients in one, from
    their ``g0, v0, g1, v1, ...`` (see :class:`normhooks._kernels._fused.FusedPlan`)."""

    gain_at = 0

    def entry(
        self, plan: _Plan, g: Tensor | None, v: Tensor | None, numel: int, rows: int
    ) -> tuple[list[int], _fused.Strided, _fused.Strided]:
        """v's and g's addresses, length, count, inner, where the layer's weight starts in
        the flat output, its first row's index among all rows, eps's bits (read by
        :func:`_fused_entry`); the weight is laid out as v, as the layer's own launch gives it."""
        # Only a weight standardization's gain may be None.
        assert g is not None
        assert v is not None
        length, count, inner = plan.sizes[:3]
        entry = [v.data_ptr(), g.data_ptr(), length, count, inner, numel, rows, plan.eps_bits]
        return entry, (tuple(v.shape), v.stride()), (tuple(g.shape), g.stride())

    def kernels(self) -> tuple[Kernel, Kernel]:
        return _FUSED_FORWARD, _FUSED_BACKWARD


def fused_plan(plans: tuple[_Plan, ...], tensors: Sequence[Tensor]) -> FusedPlan:
    """The fused plan of layers of :func:`fusable` ``plans`` (one device and dtype), whose
    ``tensors`` are ``g0, v0, g1, v1, ...``."""
    found: FusedPlan = FusedPlan.find(plans, tensors)
    return found


def fused_weight_norms(plan: FusedPlan, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The weights of the layers of ``plan``, from their ``g0, v0, g1, v1, ...``, in one
    launch (their gradients in one more), on plain eager tensors."""
    return _fused.fused_results(plan, tensors)


def _check(g: Tensor, v: Tensor, dim: int, eps: float) -> None:
    tl_dtype(v.dtype)
    tl_dtype(g.dtype)
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
    ``g`` and ``v``; a double backward goes through autograd of the plain formula. Forward
    saves only g and v: backward recomputes the norms in the pass that reads v anyway.

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
    result: Tensor = plan(g, v, dim, eps, plain).apply(g, v)
    return result
