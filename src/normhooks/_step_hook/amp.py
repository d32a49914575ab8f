"""GradScaler's fused protocol: unscaling gradients, checking them for inf/NaN, no host sync.

Under ``torch.amp.GradScaler`` a fused optimizer is handed scaled gradients with
``optimizer.grad_scale`` and ``optimizer.found_inf`` set (see :class:`StepHook`); the hook
unscales what the technique reads, and raises ``found_inf`` where a value is not finite.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._precision import HALF_DTYPES


def inverse_scale(grad_scale: Tensor, device: torch.device) -> Tensor:
    """``1 / grad_scale`` in float32 on ``device``, computed as GradScaler computes it."""
    return grad_scale.double().reciprocal().float().to(device)


def unscale_and_check_(
    tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor, foreach: bool | None
) -> None:
    """``t *= inv_scale`` and ``found_inf = 1`` where a ``t`` is not finite; no host sync."""
    if foreach is False:
        for tensor in tensors:
            compat.non_finite_check_and_unscale_([tensor], found_inf, inv_scale)
    else:
        compat.non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


def _unscaled_(
    grads: list[Tensor], scale: Tensor, flag: Tensor, foreach: bool | None
) -> list[Tensor]:
    """The true gradients of scaled ``grads``: unscaled in place, or float32 copies of
    float16/bfloat16 ones (whose small values the scale alone keeps in range); ``flag`` is
    raised where a scaled gradient is not finite."""
    inv_scale = inverse_scale(scale, grads[0].device)
    if grads[0].dtype in HALF_DTYPES:
        sources = [g.float() for g in grads]
        unscale_and_check_(sources, flag, inv_scale, foreach)
        return sources
    unscale_and_check_(grads, flag, inv_scale, foreach)
    return grads


def _written_(
    grads: list[Tensor], sources: list[Tensor], flag: Tensor, foreach: bool | None
) -> None:
    """Writes float32 results back into their gradients (rounded once), and raises ``flag``
    where a written value is not finite."""
    if sources is not grads:
        for grad, source in zip(grads, sources, strict=True):
            grad.copy_(source)
    # GradScaler's check-and-unscale op, by one: torch has no other multi-tensor check.
    unscale_and_check_(grads, flag, torch.ones_like(flag), foreach)


def unscale_skipped_(
    params: list[Tensor], scaling: compat.FusedGradScaling, foreach: bool | None
) -> None:
    """Unscales the gradients the technique left alone, since the step will not.

    As ``GradScaler.unscale_`` does: a sparse gradient's values are unscaled (float16 ones
    coalesced first, so that values summed there are checked for overflow).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    dtensor = compat.dtensor_type()
    for param in params:
        grad: Any = param.grad
        if dtensor is not None and isinstance(grad, dtensor):
            grad = grad.to_local()
        if grad.is_sparse:
            if grad.dtype == torch.float16:
                param.grad = grad = grad.coalesce()
            grad = compat.sparse_values(grad)
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), grads in groups.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        unscale_and_check_(grads, flag, inverse_scale(scaling.scale, device), foreach)
        if scaling.found_inf is not None:
            found_inf = scaling.found_inf
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
