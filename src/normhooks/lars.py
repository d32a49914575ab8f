r"""Layer-wise adaptive rate scaling (LARS) as a hook for any PyTorch optimizer.

Implements Y. You, I. Gitman and B. Ginsburg, "Large Batch Training of Convolutional
Networks", arXiv:1708.03888 (2017), with the weight-norm threshold and the ``eps`` of
"Convergence Analysis of Gradient Descent Algorithms with Proportional Updates",
arXiv:1801.03137 (2018), exactly as Chainer's ``optimizer_hooks.GradientLARS`` does it, and
LARC's clipping mode as an option.

The hook rewrites each parameter's gradient before the optimizer's own update runs, so it
composes with SGD, AdamW, RMSprop or any other :class:`torch.optim.Optimizer`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from normhooks import _checks
from normhooks._precision import HALF_DTYPES

__all__ = ["GradientLARS", "lars_", "lars_param_groups"]


# Sums of squares of tensors at least this large run as one BLAS dot each on the CPU, which is
# about twice as fast there as the reduction behind ``torch._foreach_norm``; smaller tensors
# are dispatch-bound and go through ``_foreach_norm`` in one call.
_CPU_DOT_MIN_NUMEL = 1 << 15


def _dtensor_type() -> Any:
    """torch's DTensor class, or None while nothing has imported it (so nothing is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


@dataclass(frozen=True)
class _Settings:
    threshold: float
    weight_decay: float
    eps: float
    trust_coefficient: float
    clip: bool


_OVERRIDABLE = ("threshold", "weight_decay", "eps", "trust_coefficient", "clip")


def _settings(
    threshold: object,
    weight_decay: object,
    eps: object,
    trust_coefficient: object,
    clip: object,
    prefix: str = "",
) -> _Settings:
    return _Settings(
        threshold=_checks.non_negative(prefix + "threshold", threshold),
        weight_decay=_checks.non_negative(prefix + "weight_decay", weight_decay),
        eps=_checks.non_negative(prefix + "eps", eps),
        trust_coefficient=_checks.positive(prefix + "trust_coefficient", trust_coefficient),
        clip=_checks.boolean(prefix + "clip", clip),
    )


def _check_param(param: object, where: str) -> Tensor:
    if not isinstance(param, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(param).__name__}")
    if not param.is_floating_point():
        raise TypeError(
            f"{where} must be a real floating-point tensor, got dtype {param.dtype}; LARS is "
            "defined for real parameters only"
        )
    return param


def _check_grad(param: Tensor, where: str) -> None:
    grad = param.grad
    if grad is not None and grad.layout != torch.strided:
        raise ValueError(
            f"{where} has a {grad.layout} gradient; LARS needs dense gradients "
            "(use sparse=False in nn.Embedding / nn.EmbeddingBag)"
        )


def _norms(tensors: list[Tensor]) -> Tensor:
    """Euclidean norms of ``tensors`` (one device and dtype), accumulated in at least float32."""
    dtype = tensors[0].dtype
    acc = torch.float32 if dtype in HALF_DTYPES else dtype
    if tensors[0].device.type != "cpu" or acc != dtype:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=acc if acc != dtype else None))
    big = [i for i, t in enumerate(tensors) if t.numel() >= _CPU_DOT_MIN_NUMEL]
    if not big:
        return torch.stack(torch._foreach_norm(tensors, 2))
    norms = [torch.empty(0)] * len(tensors)
    for i in big:
        flat = tensors[i].reshape(-1)
        norms[i] = torch.dot(flat, flat).sqrt_()
    small = [i for i, t in enumerate(tensors) if t.numel() < _CPU_DOT_MIN_NUMEL]
    if small:
        for i, norm in zip(small, torch._foreach_norm([tensors[i] for i in small], 2), strict=True):
            norms[i] = norm
    return torch.stack(norms)


def _rates(
    w_norm: Tensor, g_norm: Tensor, settings: _Settings, lr: float | Tensor | None
) -> Tensor:
    """The LARS rate of each parameter from the norms of the full tensors."""
    # Same association as the original: (eps + ||g||) + weight_decay * ||w||.
    denominator = g_norm + settings.eps
    if settings.weight_decay != 0:
        denominator = denominator + settings.weight_decay * w_norm
    rate = w_norm / denominator
    if settings.trust_coefficient != 1:
        rate = rate * settings.trust_coefficient
    if settings.clip and lr is not None:
        rate = torch.clamp(rate / lr, max=1.0)
    scaled = w_norm > settings.threshold
    if settings.eps == 0 and settings.weight_decay == 0:
        # A zero gradient with eps=0 gives 0/0 in the local rate; the update it scales is zero
        # whatever the rate is, so rate 1 keeps it zero instead of NaN.
        scaled = scaled & (denominator > 0)
    return torch.where(scaled, rate, torch.ones_like(rate))


def _apply_(
    params: list[Tensor],
    grads: list[Tensor],
    rates: Tensor,
    weight_decay: float,
    grad_scale: Tensor | None,
) -> None:
    """``g <- rate * (g + weight_decay * w)`` in place, for one device and dtype.

    Gradients that a GradScaler left scaled by ``grad_scale`` stay scaled: the decay is scaled
    to match, and the gradients are never divided, which would lose small float16 values.
    """
    decay: float | Tensor = weight_decay
    if grad_scale is not None:
        decay = grad_scale.to(grads[0].device, torch.float32) * weight_decay
    if grads[0].dtype in HALF_DTYPES:
        # One rounding to the low-precision dtype, as a float32 computation would give.
        for param, grad, rate in zip(params, grads, rates.unbind(0), strict=True):
            exact = grad.float()
            if weight_decay != 0:
                exact.add_(param.float() * decay)
            grad.copy_(exact.mul_(rate))
        return
    if weight_decay != 0:
        if isinstance(decay, Tensor):
            torch._foreach_add_(grads, torch._foreach_mul(params, decay.to(grads[0].dtype)))
        else:
            torch._foreach_add_(grads, params, alpha=decay)
    torch._foreach_mul_(grads, list(rates.to(grads[0].dtype).unbind(0)))


@dataclass
class _Unit:
    """Parameters that share a device, a dtype and a sharding: one set of multi-tensor ops.

    ``params`` and ``grads`` are the local tensors (a DTensor's local shard); ``reduce`` names
    the mesh dimensions whose ranks hold other shards of these tensors, or None.
    """

    indices: list[int]
    params: list[Tensor]
    grads: list[Tensor]
    reduce: tuple[Any, tuple[int, ...]] | None


def _sharding(param: Tensor, where: str) -> tuple[Any, tuple[int, ...]] | None:
    """The (mesh, sharded mesh dims) of a DTensor parameter, after checking its gradient."""
    dtensor = _dtensor_type()
    sharded: Any = param
    grad: Any = param.grad
    mesh, placements = sharded.device_mesh, sharded.placements
    if not isinstance(grad, dtensor) or (grad.device_mesh, grad.placements) != (mesh, placements):
        layout = (
            f"{grad.device_mesh} {grad.placements}"
            if isinstance(grad, dtensor)
            else f"a plain {type(grad).__name__}"
        )
        raise ValueError(
            f"{where} is a DTensor on {mesh} with placements {placements}, but its gradient "
            f"is {layout}; LARS needs both laid out alike"
        )
    for placement in placements:
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(
                f"{where} has a {type(placement).__name__} placement ({placement}); LARS "
                "supports DTensors that are sharded "
                "or replicated on each mesh dimension (FSDP2, HSDP, tensor parallel), not "
                "partial ones"
            )
    dims = tuple(d for d, p in enumerate(placements) if p.is_shard() and mesh.size(d) > 1)
    return (mesh, dims) if dims else None


def _units(params: Sequence[Tensor], where: Callable[[int], str]) -> list[_Unit]:
    if len(set(map(id, params))) != len(params):
        seen: dict[int, int] = {}
        for index, param in enumerate(params):
            first = seen.setdefault(id(param), index)
            if first != index:
                raise ValueError(
                    f"{where(index)} is the same tensor as {where(first)}; LARS would scale "
                    "its gradient twice"
                )
    dtensor = _dtensor_type()
    units: dict[tuple[Any, ...], _Unit] = {}
    for index, param in enumerate(params):
        grad: Any = param.grad
        local: Any = param
        reduce = None
        if dtensor is not None and isinstance(param, dtensor):
            reduce = _sharding(param, where(index))
            local, grad = local.to_local(), grad.to_local()
        key = (local.device, local.dtype, None if reduce is None else (id(reduce[0]), reduce[1]))
        unit = units.get(key)
        if unit is None:
            unit = units[key] = _Unit([], [], [], reduce)
        unit.indices.append(index)
        unit.params.append(local)
        unit.grads.append(grad)
    return list(units.values())


def _full_norms(units: list[_Unit]) -> list[tuple[Tensor, Tensor]]:
    """``(||w||, ||g||)`` of the full tensors of each unit.

    For sharded units the local sums of squares of every unit on one mesh are stacked and
    summed over the sharded mesh dimensions together: one all-reduce per mesh dimension, and
    no tensor is gathered.
    """
    squares: dict[int, Tensor] = {}
    meshes: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    norms: list[tuple[Tensor, Tensor] | None] = []
    for position, unit in enumerate(units):
        if unit.reduce is None:
            norms.append((_norms(unit.params), _norms(unit.grads)))
            continue
        norms.append(None)
        squares[position] = torch.cat([_norms(unit.params), _norms(unit.grads)]).square()
        meshes.setdefault((id(unit.reduce[0]), unit.reduce[1]), []).append(position)
    for positions in meshes.values():
        mesh, dims = units[positions[0]].reduce  # type: ignore[misc]
        parts = [squares[p] for p in positions]
        common = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
        stacked = torch.cat([part.to(common) for part in parts])
        for dim in dims:
            torch.distributed.all_reduce(stacked, group=mesh.get_group(dim))
        totals = torch.split(stacked, [p.numel() for p in parts])
        for position, total in zip(positions, totals, strict=True):
            w_norm, g_norm = total.to(squares[position].dtype).sqrt().chunk(2)
            norms[position] = (w_norm, g_norm)
    return [n for n in norms if n is not None]


def _scale_grads_(
    params: Sequence[Tensor],
    settings: _Settings,
    lr: float | Tensor | None = None,
    grad_scale: Tensor | None = None,
    where: Callable[[int], str] | None = None,
) -> Tensor:
    """Applies LARS to ``params`` (all with a dense grad); returns their rates, in order."""
    if not params:
        return torch.empty(0)
    units = _units(params, where or "parameters[{}]".format)
    per_unit: list[tuple[list[int], Tensor]] = []
    for unit, (w_norm, g_norm) in zip(units, _full_norms(units), strict=True):
        if grad_scale is not None:
            # A fused optimizer under GradScaler gets scaled grads and unscales them itself:
            # the rate needs the norm of the true gradient.
            g_norm = g_norm / grad_scale.to(g_norm.device, g_norm.dtype)
        rates = _rates(w_norm, g_norm, settings, lr)
        _apply_(unit.params, unit.grads, rates, settings.weight_decay, grad_scale)
        per_unit.append((unit.indices, rates))
    if len(per_unit) == 1:
        return per_unit[0][1]
    device = per_unit[0][1].device
    dtype = torch.float64 if any(r.dtype == torch.float64 for _, r in per_unit) else torch.float32
    by_index = {
        index: rate
        for indices, rates in per_unit
        for index, rate in zip(indices, rates.to(device, dtype).unbind(0), strict=True)
    }
    return torch.stack([by_index[i] for i in range(len(params))])


def lars_(
    parameters: Tensor | Iterable[Tensor],
    threshold: float = 1e-2,
    weight_decay: float = 0.0,
    eps: float = 1e-9,
    *,
    trust_coefficient: float = 1.0,
) -> Tensor:
    r"""Scales every parameter's ``.grad`` in place by its layer-wise adaptive rate.

    For each parameter :math:`w` with gradient :math:`g` (Frobenius norms of whole tensors):

    .. math::

        \lambda = \frac{\|w\|}{\epsilon + \|g\| + \beta \|w\|}, \qquad
        r = \begin{cases} \eta\,\lambda & \|w\| > \text{threshold} \\
                          1 & \text{otherwise} \end{cases}, \qquad
        g \leftarrow r\,(g + \beta w)

    with :math:`\beta` = ``weight_decay`` and :math:`\eta` = ``trust_coefficient``. Norms are
    computed in one multi-tensor pass per device and dtype, accumulated in float32 for
    float16/bfloat16, and nothing is read back to the host.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        threshold: parameters whose norm is at most this keep rate 1 (arXiv:1801.03137).
        weight_decay: :math:`\beta`, L2 decay added to the gradient before scaling.
        eps: added to the denominator for numerical stability.
        trust_coefficient: :math:`\eta`, multiplies the local rate.

    Returns:
        A 1-D tensor with the rate applied to each parameter that has a gradient, in order.

    References:
        You, Gitman and Ginsburg, Large Batch Training of Convolutional Networks,
        arXiv:1708.03888. Chen et al., Convergence Analysis of Gradient Descent Algorithms
        with Proportional Updates, arXiv:1801.03137.

    Example:
        >>> w = torch.nn.Parameter(torch.full((2, 2), 3.0))
        >>> w.grad = torch.full((2, 2), 0.5)
        >>> lars_([w], eps=0.0)
        tensor([6.])
        >>> w.grad
        tensor([[3., 3.],
                [3., 3.]])
    """
    settings = _settings(threshold, weight_decay, eps, trust_coefficient, False)
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    elif not isinstance(parameters, Iterable):
        raise TypeError(
            "parameters must be a tensor or an iterable of tensors, "
            f"got {type(parameters).__name__}"
        )
    with_grad, names = [], []
    for index, param in enumerate(parameters):
        where = f"parameters[{index}]"
        _check_param(param, where)
        _check_grad(param, where)
        if param.grad is not None:
            with_grad.append(param)
            names.append(where)
    with torch.no_grad():
        return _scale_grads_(with_grad, settings, where=names.__getitem__)


def lars_param_groups(
    model: nn.Module, *, exclude: Callable[[str, nn.Parameter], bool] | None = None
) -> list[dict[str, Any]]:
    """Splits a model's parameters into a LARS group and a group the hook leaves alone.

    By default every parameter with at most one dimension longer than 1 (biases, the affine
    parameters of normalization layers, weight normalization's g, scaled weight
    standardization's gain) goes into a group with ``"lars": False``: the hook neither scales
    nor decays it, as is usual for LARS (You et al. 2017, section 5). Empty groups are left out.

    Args:
        model: the module whose parameters to split.
        exclude: a predicate ``(name, param) -> bool`` that replaces the default rule; the
            parameters for which it returns True go into the ``"lars": False`` group.

    Returns:
        A list of param group dicts for any ``torch.optim`` optimizer.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        >>> groups = lars_param_groups(model)
        >>> [(len(g["params"]), g.get("lars", True)) for g in groups]
        [(1, True), (3, False)]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if exclude is not None and not callable(exclude):
        raise TypeError(
            "exclude must be a callable (name, param) -> bool or None, "
            f"got {type(exclude).__name__}"
        )
    scaled: list[nn.Parameter] = []
    skipped: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        leave_alone = _is_gain_like(param) if exclude is None else exclude(name, param)
        if not isinstance(leave_alone, bool):
            kind = type(leave_alone)
            raise TypeError(
                f"exclude must return a bool, got {kind.__module__}.{kind.__qualname__} for "
                f"parameter {name!r}"
            )
        (skipped if leave_alone else scaled).append(param)
    groups: list[dict[str, Any]] = []
    if scaled:
        groups.append({"params": scaled})
    if skipped:
        groups.append({"params": skipped, "lars": False})
    return groups


def _is_gain_like(param: Tensor) -> bool:
    """Biases and per-channel gains: at most one dimension longer than 1.

    That covers biases, normalization layers' affine parameters, weight normalization's g
    (shape ``[C, 1, 1, 1]``) and scaled weight standardization's gain.
    """
    return sum(size > 1 for size in param.shape) <= 1


class _SingleUseClosure:
    """Hands the optimizer the loss of a closure the hook already evaluated."""

    def __init__(self, loss: Any, optimizer: torch.optim.Optimizer) -> None:
        self._loss = loss
        self._optimizer_name = type(optimizer).__name__
        self._calls = 0

    def __call__(self) -> Any:
        self._calls += 1
        if self._calls > 1:
            raise RuntimeError(
                f"{self._optimizer_name} called its closure more than once in one step; "
                "GradientLARS rescales the gradients of a single evaluation, so it cannot be "
                "used with optimizers that re-evaluate the loss (such as LBFGS)"
            )
        return self._loss


class GradientLARS:
    r"""Layer-wise adaptive rate scaling as a step pre-hook for any PyTorch optimizer.

    Before every ``optimizer.step()``, each parameter's gradient is rewritten in place as in
    :func:`lars_`:

    .. math::

        g \leftarrow r\,(g + \beta w), \quad
        r = \eta \frac{\|w\|}{\epsilon + \|g\| + \beta \|w\|} \text{ if } \|w\| > \text{threshold}
        \text{ else } 1.

    With ``clip=True`` (LARC's clipping mode), :math:`r = \min(\eta \lambda / lr, 1)`, where
    ``lr`` is the param group's learning rate: the effective step size becomes
    :math:`\min(lr, \eta \lambda)`. With the defaults and ``torch.optim.SGD(lr, momentum)``
    this reproduces Chainer's ``GradientLARS`` with ``MomentumSGD``.

    Param groups can opt out (``"lars": False``) or override a setting for themselves with
    ``"lars_threshold"``, ``"lars_weight_decay"``, ``"lars_eps"``,
    ``"lars_trust_coefficient"`` or ``"lars_clip"``. The rates applied in the last step are in
    :attr:`last_rates`, one 1-D tensor per param group (empty for a group the hook skips),
    left on the parameters' device.

    ``step(closure)`` works: the hook evaluates the closure itself, scales the fresh gradients,
    and hands the optimizer the loss. Fused optimizers under :class:`torch.amp.GradScaler`
    receive scaled gradients; the hook unscales them for its norms and leaves them scaled, so
    the result is the same as without AMP.

    Args:
        threshold: parameters whose norm is at most this keep rate 1 (arXiv:1801.03137).
        weight_decay: :math:`\beta`, L2 decay added to the gradient before scaling; use it
            instead of the optimizer's own ``weight_decay``, which would be added unscaled.
        eps: added to the denominator for numerical stability.
        trust_coefficient: :math:`\eta`, multiplies the local rate.
        clip: LARC's clipping mode (the rate never exceeds 1 after dividing by the lr).

    References:
        You, Gitman and Ginsburg, Large Batch Training of Convolutional Networks,
        arXiv:1708.03888. Chen et al., Convergence Analysis of Gradient Descent Algorithms
        with Proportional Updates, arXiv:1801.03137.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> optimizer = torch.optim.SGD(lars_param_groups(model), lr=0.1, momentum=0.9)
        >>> handle = GradientLARS(weight_decay=5e-4).attach(optimizer)
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> optimizer.step()
        >>> handle.remove()
    """

    def __init__(
        self,
        threshold: float = 1e-2,
        weight_decay: float = 0.0,
        eps: float = 1e-9,
        *,
        trust_coefficient: float = 1.0,
        clip: bool = False,
    ) -> None:
        self._settings = _settings(threshold, weight_decay, eps, trust_coefficient, clip)
        self._handles: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = (
            weakref.WeakKeyDictionary()
        )
        self.last_rates: list[Tensor] = []

    @property
    def threshold(self) -> float:
        return self._settings.threshold

    @property
    def weight_decay(self) -> float:
        return self._settings.weight_decay

    @property
    def eps(self) -> float:
        return self._settings.eps

    @property
    def trust_coefficient(self) -> float:
        return self._settings.trust_coefficient

    @property
    def clip(self) -> bool:
        return self._settings.clip

    def __repr__(self) -> str:
        s = self._settings
        return (
            f"GradientLARS(threshold={s.threshold}, weight_decay={s.weight_decay}, "
            f"eps={s.eps}, trust_coefficient={s.trust_coefficient}, clip={s.clip})"
        )

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Registers the hook with ``optimizer.register_step_pre_hook``.

        The optimizer's class, ``state_dict`` and LR schedulers are untouched; remove the hook
        with the returned handle's ``remove()``.

        Args:
            optimizer: any instance of :class:`torch.optim.Optimizer`.

        Returns:
            The handle of the registered pre-hook.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "GradientLARS cannot be attached to LBFGS: LBFGS evaluates its closure many "
                "times per step, and the hook can only rescale the gradients of one evaluation"
            )
        previous = self._handles.get(optimizer)
        if previous is not None and _is_registered(previous):
            raise RuntimeError(
                f"this GradientLARS is already attached to this {type(optimizer).__name__}; "
                "remove the first handle before attaching it again"
            )
        for index, group in enumerate(optimizer.param_groups):
            self._group_settings(group, index)
            for position, param in enumerate(group["params"]):
                _check_param(param, f"parameter {position} of param group {index}")
        handle = optimizer.register_step_pre_hook(self._pre_step)
        self._handles[optimizer] = handle
        return handle

    def _group_settings(self, group: Mapping[str, Any], index: int) -> _Settings | None:
        """The settings for one param group, or None if the group opts out."""
        enabled = group.get("lars", True)
        if not isinstance(enabled, bool):
            raise TypeError(f'param group {index}: "lars" must be a bool, got "lars"={enabled!r}')
        overrides = {}
        for key, value in group.items():
            if not key.startswith("lars_"):
                continue
            setting = key[len("lars_") :]
            if setting not in _OVERRIDABLE:
                raise ValueError(
                    f"param group {index}: unknown key {key!r}; expected one of "
                    + ", ".join(f"'lars_{s}'" for s in _OVERRIDABLE)
                )
            overrides[setting] = value
        if not enabled:
            return None
        if not overrides:
            settings = self._settings
        else:
            merged = replace(self._settings, **overrides)
            try:
                settings = _settings(
                    merged.threshold,
                    merged.weight_decay,
                    merged.eps,
                    merged.trust_coefficient,
                    merged.clip,
                    prefix="lars_",
                )
            except (TypeError, ValueError) as error:
                raise type(error)(f"param group {index}: {error}") from None
        if settings.clip and not isinstance(group.get("lr"), (float, int, Tensor)):
            raise ValueError(
                f"param group {index}: clip=True divides by the group's learning rate, but "
                f'the group has "lr"={group.get("lr")!r}'
            )
        return settings

    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if "grad_scaler" in kwargs:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step received a grad_scaler argument (the "
                "deprecated GradScaler protocol); GradientLARS cannot tell whether those "
                "gradients are scaled. Use an optimizer without a grad_scaler parameter"
            )
        # Everything that does not depend on the gradients is checked before the closure runs,
        # so a bad param group leaves the model untouched.
        settings_of = []
        for index, group in enumerate(optimizer.param_groups):
            settings_of.append(self._group_settings(group, index))
            for position, param in enumerate(group["params"]):
                if not isinstance(param, Tensor) or not param.is_floating_point():
                    _check_param(param, f"parameter {position} of param group {index}")
        closure, args, kwargs = _take_closure(args, kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = []
        for index, (group, settings) in enumerate(
            zip(optimizer.param_groups, settings_of, strict=True)
        ):
            params, positions = [], []
            for position, param in enumerate(group["params"]):
                grad = param.grad
                if grad is not None:
                    if grad.layout != torch.strided:
                        _check_grad(param, f"parameter {position} of param group {index}")
                    params.append(param)
                    positions.append(position)
            plan.append((settings, params, _namer(index, positions), group.get("lr")))
        grad_scale = getattr(optimizer, "grad_scale", None)
        rates = []
        with torch.no_grad():
            for settings, params, names, lr in plan:
                if settings is None or not params:
                    rates.append(torch.empty(0))
                    continue
                rates.append(_scale_grads_(params, settings, lr, grad_scale, names))
        self.last_rates = rates
        if closure is None:
            return None
        kwargs["closure"] = _SingleUseClosure(loss, optimizer)
        return args, kwargs


def _namer(group_index: int, positions: list[int]) -> Callable[[int], str]:
    """Names the i-th parameter with a gradient by its place in the optimizer, on demand."""
    return lambda i: f"parameter {positions[i]} of param group {group_index}"


def _take_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[[], Any] | None, tuple[Any, ...], dict[str, Any]]:
    """Splits ``optimizer.step``'s closure from its other arguments.

    ``args`` starts with the optimizer itself (the hook sees ``step``'s bound arguments).
    """
    kwargs = dict(kwargs)
    if "closure" in kwargs:
        return kwargs.pop("closure"), args, kwargs
    if len(args) > 1:
        return args[1], args[:1] + args[2:], kwargs
    return None, args, kwargs


def _is_registered(handle: RemovableHandle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks
