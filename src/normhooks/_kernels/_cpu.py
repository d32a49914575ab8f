"""Weight normalization's fast CPU path: torch's fused ``_weight_norm_interface`` where it
computes the same function, and a closed-form backward elsewhere.

Speed only: the plain formula (``normhooks.weight_norm._weight_norm``) gives the same numbers
through autograd's own graph, which takes about six passes over v in backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from normhooks import _torch_compat

Formula = Callable[[Tensor, Tensor, int | None, float], Tensor]
# The formula's parts, as the technique writes them: the norms over every axis but ``dim``
# (kept for broadcasting) and the denominators they give with ``eps``.
RowNorms = Callable[[Tensor, int | None], Tensor]
Denominator = Callable[[Tensor, float], Tensor]

_FAST_DTYPES = (torch.float32, torch.float64)
# Mantissa bits of each: a positive x has ulp(x) / 2 >= x * 2**-(bits + 2).
_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52}


def eps_vanishes(smallest_norm: float, eps: float, dtype: torch.dtype) -> bool:
    """Whether ``n + eps`` rounds to ``n`` > 0 in ``dtype`` for every ``n >= smallest_norm``.

    Sufficient, not necessary: ``eps`` below a quarter of the smallest norm's unit in the last
    place leaves every larger norm unchanged too, without a tie to round.
    """
    if not smallest_norm > 0:  # also False for NaN
        return False
    return eps < math.ldexp(smallest_norm, -(_MANTISSA_BITS[dtype] + 2))


def takes(g: Tensor, v: Tensor) -> bool:
    """Whether the CPU fast path may run: eager ops on plain float32/float64 CPU tensors.

    It branches on a tensor's value (``.item()``) and uses a custom autograd Function, which
    neither ``torch.compile``, tracing and exporting, ``torch.func`` transforms nor fake
    tensors can follow; all of them get the plain formula.
    """
    return v.is_cpu and v.dtype in _FAST_DTYPES and _torch_compat.plain_eager(g, v)


def closed_form(
    formula: Formula, row_norms: RowNorms, denominator_of: Denominator
) -> type[torch.autograd.Function]:
    """The closed-form Function of ``formula`` (the plain formula, which a double backward
    goes through), from its parts ``row_norms(v, dim)`` and ``denominator_of(norm, eps)``:
    ``apply(g, v, dim, eps)``."""

    class _WeightNormFunction(torch.autograd.Function):
        """``g * v / (||v|| + eps)`` with its gradients in closed form, for the CPU.

        With ``s = g / d``, ``d = ||v|| + eps`` and ``p = sum(grad_W * v)`` per row, the gradients
        are ``grad_g = p / d`` and ``grad_v = s * grad_W - (s * p / (d * ||v||)) * v``: one
        reduction and one fused multiply-add, torch's fused weight-norm kernel where it applies
        (dim 0 or last) plus an exact correction for ``eps``. A backward that must itself be
        differentiable (double backward) recomputes through the plain formula instead.
        """

        @staticmethod
        def forward(ctx: Any, g: Tensor, v: Tensor, dim: int | None, eps: float) -> Tensor:
            ctx.dim, ctx.eps = dim, eps
            norm = row_norms(v, dim)
            denominator = denominator_of(norm, eps)
            ctx.save_for_backward(g, v, norm, denominator)
            return v * (g / denominator)

        @staticmethod
        def backward(ctx: Any, grad_w: Tensor) -> tuple[Tensor | None, ...]:
            g, v, norm, denominator = ctx.saved_tensors
            if torch.is_grad_enabled():
                wanted = [t for t in (g, v) if t.requires_grad]
                grads = iter(
                    torch.autograd.grad(
                        formula(g, v, ctx.dim, ctx.eps), wanted, grad_w, create_graph=True
                    )
                )
                found = (next(grads) if t.requires_grad else None for t in (g, v))
                return (*found, None, None)
            # At a zero row v is zero, so the terms in v vanish whatever their coefficient.
            safe_norm = torch.where(norm > 0, norm, torch.ones_like(norm))
            # torch's fused kernel divides by the row count: a layer without rows stays off it.
            if ctx.dim in (0, v.ndim - 1) and v.is_contiguous() and v.shape[ctx.dim] > 0:
                # torch's fused kernel for g * v / ||v||, given d for ||v||: grad_g = p / d is
                # exact, and its grad_v has p / d^3 where the exact term is p / (d^2 ||v||).
                grad_v, grad_g = _torch_compat.weight_norm_interface_backward(
                    grad_w.contiguous(), v, g, denominator, ctx.dim
                )
                # Where ||v|| + eps rounds to ||v||, the function computed is g * v / ||v|| and the
                # kernel's gradient is already the exact one; on the CPU that check is free.
                if ctx.eps > 0 and not torch.equal(denominator, norm):
                    correction = -(g * grad_g * ctx.eps) / (denominator * denominator * safe_norm)
                    correction = torch.where(denominator == norm, 0.0, correction)
                    grad_v.addcmul_(v, correction)
                return grad_g, grad_v, None, None
            # Summed over the axes the norms run over.
            dot = (grad_w * v).sum_to_size(norm.shape)
            scale = g / denominator
            coefficient = -(scale * dot) / (denominator * safe_norm)
            grad_v = torch.mul(grad_w, scale).addcmul_(v, coefficient)
            return (dot / denominator).reshape(g.shape), grad_v, None, None

    return _WeightNormFunction


def weight_norm(
    g: Tensor, v: Tensor, dim: int | None, eps: float, function: type[torch.autograd.Function]
) -> Tensor:
    """The formula on plain eager float32/float64 CPU tensors (:func:`takes`), faster: torch's
    fused op where it computes this function exactly, else ``function`` (its
    :func:`closed_form`)."""
    if dim in (0, v.ndim - 1) and v.is_contiguous() and v.shape[dim] > 0:
        # torch's fused op (forward and backward) computes g * v / ||v||, which is this
        # function exactly where no row is zero and ||v|| + eps rounds to ||v||; on the CPU
        # checking that costs nothing.
        weight, norm = _torch_compat.weight_norm_interface(v, g, dim)
        if eps_vanishes(norm.min().item(), eps, v.dtype):
            return weight
    result: Tensor = function.apply(g, v, dim, eps)  # type: ignore[no-untyped-call]
    return result
