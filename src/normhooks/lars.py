r"""Layer-wise adaptive rate scaling (LARS) as a hook for any PyTorch optimizer.

Implements Y. You, I. Gitman and B. Ginsburg, "Large Batch Training of Convolutional
Networks", arXiv:1708.03888 (2017), with the weight-norm threshold and the ``eps`` of
"Convergence Analysis of Gradient Descent Algorithms with Proportional Updates",
arXiv:1801.03137 (2018), exactly as Chainer's ``optimizer_hooks.GradientLARS`` does it, and
LARC's clipping mode as an option.

The maths are pure functions (:func:`lars_rates`, :func:`lars_unit_`); :class:`GradientLARS`
puts them on :class:`~normhooks._step_hook.StepHook`, which attaches to any
:class:`torch.optim.Optimizer` and handles closures, AMP and sharded parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from normhooks import _checks, _kernels
from normhooks import _torch_compat as compat
from normhooks._precision import HALF_DTYPES, upcast
from normhooks._step_hook import (
    Settings,
    Steady,
    StepHook,
    all_plain,
    euclidean_norms,
    inverse_scale,
    setting,
    split_param_groups,
    unscale_and_check_,
)

__all__ = ["GradientLARS", "lars_", "lars_param_groups"]

ZeroGradMode = Literal["scale", "decay", "skip"]
# The rate each mode gives a tensor whose gradient is exactly zero; "scale" uses the formula.
_ZERO_GRAD_RATES: dict[str, float | None] = {"scale": None, "decay": 1.0, "skip": 0.0}


def _zero_grad_mode(name: str, value: object) -> str:
    expected = ", ".join(map(repr, _ZERO_GRAD_RATES))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {expected}, got {name}={value!r}")
    if value not in _ZERO_GRAD_RATES:
        raise ValueError(f"{name} must be one of {expected}, got {name}={value!r}")
    return value


@dataclass(frozen=True, eq=False)
class LARSSettings(Settings):
    """GradientLARS's settings, which a param group can override with ``"lars_<name>"``."""

    threshold: float = setting(_checks.non_negative)
    """Parameters whose norm is at most this keep rate 1."""
    weight_decay: float = setting(_checks.non_negative)
    """The L2 decay added to each gradient before scaling."""
    eps: float = setting(_checks.non_negative)
    """Added to the denominator of the local rate."""
    trust_coefficient: float = setting(_checks.positive)
    """Multiplies the local rate."""
    clip: bool = setting(_checks.boolean)
    """Whether LARC's clipping mode is on."""
    zero_grad_mode: str = setting(_zero_grad_mode)
    """What a tensor whose gradient is exactly zero gets: ``"scale"`` (the rate), ``"decay"``
    (rate 1) or ``"skip"`` (left untouched)."""


def lars_rates(
    w_norm: Tensor, g_norm: Tensor, settings: LARSSettings, lr: float | Tensor | None
) -> Tensor:
    """The LARS rate of each parameter from the norms of its full tensors (``lr`` for clip)."""
    # Same association as the original: (eps + ||g||) + weight_decay * ||w||.
    denominator = g_norm + settings.eps
    if settings.weight_decay != 0:
        denominator = denominator + settings.weight_decay * w_norm
    rate = w_norm / denominator
    if settings.trust_coefficient != 1:
        rate = rate * settings.trust_coefficient
    if settings.clip and lr is not None:
        # A tensor lr may live on another device than this unit's norms.
        divisor = lr.to(rate.device, rate.dtype) if isinstance(lr, Tensor) else lr
        rate = torch.clamp(rate / divisor, max=1.0)
    scaled = w_norm > settings.threshold
    if settings.eps == 0 and settings.weight_decay == 0:
        # A zero gradient with eps=0 gives 0/0 in the local rate; the update it scales is zero
        # whatever the rate is, so rate 1 keeps it zero instead of NaN.
        scaled = scaled & (denominator > 0)
    rate = torch.where(scaled, rate, torch.ones_like(rate))
    fallback = _ZERO_GRAD_RATES[settings.zero_grad_mode]
    if fallback is not None:
        # Rate 0 on g + weight_decay * w leaves a zero gradient zero: no decay, no move.
        rate = torch.where(g_norm == 0, fallback, rate)
    return rate


def _update_(
    params: list[Tensor],
    grads: list[Tensor],
    rates: Tensor,
    weight_decay: float,
    grad_scale: Tensor | None,
    foreach: bool | None,
) -> None:
    """``g <- rate * (g / grad_scale + weight_decay * w)`` in place, for one device and dtype."""
    if (
        weight_decay != 0
        and grad_scale is None
        and grads[0].is_cpu
        and grads[0].dtype not in HALF_DTYPES
        and compat.plain_eager(*params, *grads)
    ):
        _decayed_update_on_cpu_(params, grads, rates, weight_decay)
        return
    inv_scale = None if grad_scale is None else inverse_scale(grad_scale, grads[0].device)
    if foreach is False or grads[0].dtype in HALF_DTYPES:
        # Low precision: computed in float32 and rounded once, which no multi-tensor op does.
        for param, grad, rate in zip(params, grads, rates.unbind(0), strict=True):
            exact = upcast(grad)
            if inv_scale is not None:
                exact.mul_(inv_scale)
            if weight_decay != 0:
                exact.add_(upcast(param) * weight_decay)
            exact.mul_(rate)
            if exact is not grad:
                grad.copy_(exact)
        return
    if inv_scale is not None:
        compat.foreach_mul_(grads, inv_scale)
    if weight_decay != 0:
        compat.foreach_add_(grads, params, alpha=weight_decay)
    compat.foreach_mul_(grads, list(rates.to(grads[0].dtype).unbind(0)))


def _decayed_update_on_cpu_(
    params: list[Tensor], grads: list[Tensor], rates: Tensor, weight_decay: float
) -> None:
    """``g <- rate * g + (rate * weight_decay) * w`` in one pass over each tensor, on the CPU.

    torch has no multi-tensor op for ``a * x + b * y``, and ``add_`` then ``mul_`` are two
    passes; ``addr_`` with a one-element vector is that sum in one, with Python coefficients,
    and on the CPU reading the rates waits for no device.
    """
    one = torch.ones(1, dtype=grads[0].dtype)
    for param, grad, rate in zip(params, grads, rates.tolist(), strict=True):
        # addr_ ignores its input where beta is 0 (a non-finite gradient must stay non-finite),
        # and flat views line values up only where both tensors are contiguous.
        if rate != 0 and grad.is_contiguous() and param.is_contiguous():
            grad.view(-1, 1).addr_(param.view(-1), one, beta=rate, alpha=rate * weight_decay)
        else:
            grad.add_(param, alpha=weight_decay).mul_(rate)


def lars_unit_(
    params: list[Tensor],
    grads: list[Tensor],
    settings: LARSSettings,
    lr: float | Tensor | None,
    *,
    norms: tuple[Tensor, Tensor] | None,
    foreach: bool | None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    steady: Steady | None = None,
) -> Tensor:
    """LARS on one unit (one device, dtype and sharding); returns the rates, in order.

    This is the whole per-unit computation. On CUDA with Triton, a fused kernel does all of
    it (sharded units excepted: their norms need an all-reduce between its two launches).
    ``grads`` may be scaled by ``grad_scale`` (a fused optimizer under GradScaler): the rates
    use the true gradient's norm and the unscaled result is written. ``found_inf`` is set to
    1 where a written value is not finite. ``norms`` are ``(||w||, ||g||)`` of the full
    tensors when ``params`` are shards; otherwise they are computed here.
    """
    # available() checks the modes (compiling, tracing, ...) and the first tensor; the types
    # of the rest in one pass each.
    # A unit record that holds (steady) proves the types, as it proves what the kernels
    # keep for these tensors.
    if (
        norms is None
        and _kernels.available(params[0])
        and (steady is not None or (all_plain(params) and all_plain(grads)))
    ):
        # Two launches whatever the number of tensors, the GradScaler protocol included.
        rates = _kernels.lars_unit_(
            params,
            grads,
            threshold=settings.threshold,
            weight_decay=settings.weight_decay,
            eps=settings.eps,
            trust_coefficient=settings.trust_coefficient,
            lr=lr,
            clip=settings.clip,
            zero_grad_mode=settings.zero_grad_mode,
            grad_scale=grad_scale,
            found_inf=found_inf,
            kept=None if steady is None else steady.kept,
        )
        if rates is not None:  # None: the kernel failed here (warned once): the formula
            return rates
    if norms is None:
        w_norm, g_norm = euclidean_norms(params, foreach), euclidean_norms(grads, foreach)
    else:
        w_norm, g_norm = norms
    if grad_scale is not None:
        g_norm = g_norm / grad_scale.to(g_norm.device, g_norm.dtype)
    rates = lars_rates(w_norm, g_norm, settings, lr)
    _update_(params, grads, rates, settings.weight_decay, grad_scale, foreach)
    if found_inf is not None:
        # GradScaler's check-and-unscale op, by one: torch has no other multi-tensor check.
        unscale_and_check_(grads, found_inf, torch.ones_like(found_inf), foreach)
    return rates


def lars_(
    parameters: Tensor | Iterable[Tensor],
    threshold: float = 1e-2,
    weight_decay: float = 0.0,
    eps: float = 1e-9,
    *,
    trust_coefficient: float = 1.0,
    zero_grad_mode: ZeroGradMode = "scale",
    foreach: bool | None = None,
) -> Tensor:
    r"""Scales every parameter's ``.grad`` in place by its layer-wise adaptive rate.

    For each parameter :math:`w` with gradient :math:`g` (Frobenius norms of whole tensors):

    .. math::

        \lambda = \frac{\|w\|}{\epsilon + \|g\| + \beta \|w\|}, \qquad
        r = \begin{cases} \eta\,\lambda & \|w\| > \text{threshold} \\
                          1 & \text{otherwise} \end{cases}, \qquad
        g \leftarrow r\,(g + \beta w)

    with :math:`\beta` = ``weight_decay`` and :math:`\eta` = ``trust_coefficient``. A tensor
    whose gradient is exactly zero (:math:`\|g\| = 0`: a layer behind a zero-initialized
    gain, ``zero_init_residual=True``, at the first step) gets, by ``zero_grad_mode``:

    - ``"scale"`` (the default, Chainer's): the rate above,
      :math:`\eta\|w\| / (\epsilon + \beta\|w\|)`, so it decays by about :math:`\eta w`;
    - ``"decay"``: :math:`r = 1`, the plain decay :math:`g \leftarrow \beta w` (timm's
      ``Lars``, torchlars);
    - ``"skip"``: :math:`r = 0`, so its gradient stays zero and it does not move, weight decay
      included (lightly, solo-learn, apex's ``LARC``, torch-optimizer and pl_bolts: their rate
      1 without the decay term).

    Parameters are taken per device and dtype. On accelerators the norms are one multi-tensor
    call; on the CPU, tensors of more than 4096 values are reduced in rows whose sums of
    squares are added in float64 (a single float32 reduction of a long tensor is not
    precise), and the rest in one multi-tensor call. The update is two multi-tensor calls,
    except for float16/bfloat16, whose norms and update are computed in float32 (the update
    one tensor at a time) and rounded once, and for float32/float64 CPU tensors with weight
    decay, whose update is one pass per tensor, :math:`r g + (r\beta) w`, with the rates
    read as Python numbers (on the CPU that waits for no device). Elsewhere nothing is read
    back to the host.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        threshold: parameters whose norm is at most this keep rate 1 (arXiv:1801.03137).
        weight_decay: :math:`\beta`, L2 decay added to the gradient before scaling.
        eps: added to the denominator for numerical stability.
        trust_coefficient: :math:`\eta`, multiplies the local rate.
        zero_grad_mode: ``"scale"``, ``"decay"`` or ``"skip"``, the rule for a tensor whose
            gradient is exactly zero (above).
        foreach: True or None take multi-tensor ops as above, False one tensor at a time.

    Returns:
        A 1-D tensor with the rate applied to each parameter that has a gradient, in order
        (0 for a tensor ``"skip"`` leaves untouched).

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
    settings = LARSSettings._checked(
        {
            "threshold": threshold,
            "weight_decay": weight_decay,
            "eps": eps,
            "trust_coefficient": trust_coefficient,
            "clip": False,
            "zero_grad_mode": zero_grad_mode,
        }
    )
    return cast(Tensor, GradientLARS._apply_to_parameters_(parameters, settings, foreach))


def lars_param_groups(
    model: nn.Module,
    *,
    exclude: Callable[[str, nn.Parameter], bool] | None = None,
    by: Literal["shape", "module"] = "shape",
) -> list[dict[str, Any]]:
    """Splits a model's parameters into a LARS group and a group the hook leaves alone.

    The parameters left alone go into a group with ``"lars": False``: the hook neither scales
    nor decays them, as is usual for LARS (You et al. 2017, section 5). Which they are:

    - ``by="shape"`` (the default): every parameter with at most one dimension longer than 1:
      biases, the affine parameters of normalization layers, weight normalization's g (shape
      ``[C, 1, 1, 1]``), scaled weight standardization's gain, and also the weight of a layer
      with one output or one input (``nn.Linear(32, 1)``'s ``[1, 32]``);
    - ``by="module"``: the parameters of normalization layers (batch, instance, layer, group
      and RMS norm) and those whose name ends in ``bias``, as lightly's
      ``get_weight_decay_parameters`` splits them for its SimCLR, BYOL and Barlow Twins recipes
      (except RMS norm, which lightly's list lacks and so scales): every other weight is
      scaled, ``[1, 32]`` included, and so is weight normalization's g.

    Empty groups are left out.

    Args:
        model: the module whose parameters to split.
        exclude: a predicate ``(name, param) -> bool`` that replaces either rule; the
            parameters for which it returns True go into the ``"lars": False`` group
            (solo-learn's ``exclude_bias_n_norm`` is ``lambda name, p: p.ndim == 1``).
        by: ``"shape"`` or ``"module"``, the rule above.

    Returns:
        A list of param group dicts for any ``torch.optim`` optimizer.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.LayerNorm(1))
        >>> [(len(g["params"]), g.get("lars", True)) for g in lars_param_groups(model)]
        [(4, False)]
        >>> groups = lars_param_groups(model, by="module")
        >>> [(len(g["params"]), g.get("lars", True)) for g in groups]
        [(1, True), (3, False)]
    """
    if exclude is not None and not callable(exclude):
        raise TypeError(
            "exclude must be a callable (name, param) -> bool or None, "
            f"got {type(exclude).__name__}"
        )
    if by not in ("shape", "module"):
        raise ValueError(f"by must be 'shape' or 'module', got by={by!r}")
    if exclude is not None and by != "shape":
        raise ValueError(f"exclude replaces the rule that by={by!r} names: pass one of them")
    if exclude is None and by == "module":
        left = _norm_and_bias_parameters(model)

        def exclude(_: str, param: nn.Parameter) -> bool:
            return id(param) in left

    return split_param_groups(model, "lars", exclude or (lambda _, param: _is_gain_like(param)))


# The normalization layers whose affine parameters LARS leaves alone (lightly's list, in the
# public classes: the lazy ones derive from none of the others), and RMS norm, which lightly's
# list predates: its weight is a norm layer's gain like LayerNorm's.
_NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)


def _norm_and_bias_parameters(model: object) -> set[int]:
    """The ids of the parameters of normalization layers and of those named ``*bias``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    left: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, _NORM_LAYERS) or name.endswith("bias"):
                left.add(id(param))
    return left


def _is_gain_like(param: Tensor) -> bool:
    """Biases and per-channel gains: at most one dimension longer than 1.

    That covers biases, normalization layers' affine parameters, weight normalization's g
    (shape ``[C, 1, 1, 1]``) and scaled weight standardization's gain.
    """
    return sum(size > 1 for size in param.shape) <= 1


class GradientLARS(StepHook, LARSSettings):
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
    ``"lars_trust_coefficient"``, ``"lars_clip"`` or ``"lars_zero_grad_mode"``. A group that
    keeps the optimizer's own ``weight_decay`` under a hook with ``weight_decay`` gets a
    warning: both would decay it. The rates applied in the last step are in
    :attr:`last_rates`, one 1-D tensor per param group (empty for a group the hook skips),
    left on the parameters' device. One GradientLARS per optimizer: attaching a second is
    refused.

    ``step(closure)`` works: the hook evaluates the closure itself, scales the fresh gradients,
    and hands the optimizer the loss. Fused optimizers under :class:`torch.amp.GradScaler`
    receive scaled gradients: the hook computes from the gradients divided by the scale in
    float32, writes the unscaled result, sets ``optimizer.grad_scale = None`` so that the
    fused step does not divide again, and raises ``optimizer.found_inf`` where the result is
    not finite, so that the step is skipped as for an overflow (GradScaler's private protocol
    for fused optimizers; details in :class:`~normhooks._step_hook.StepHook`). The result
    is the same as without AMP.

    Args:
        threshold: parameters whose norm is at most this keep rate 1 (arXiv:1801.03137).
        weight_decay: :math:`\beta`, L2 decay added to the gradient before scaling; use it
            instead of the optimizer's own ``weight_decay``, which would be added unscaled.
        eps: added to the denominator for numerical stability.
        trust_coefficient: :math:`\eta`, multiplies the local rate.
        clip: LARC's clipping mode (the rate never exceeds 1 after dividing by the lr).
        zero_grad_mode: what a tensor whose gradient is exactly zero gets, as in
            :func:`lars_`: ``"scale"`` (Chainer's), ``"decay"`` (timm, torchlars) or
            ``"skip"`` (lightly, solo-learn, apex's LARC, torch-optimizer).
        foreach: as in :func:`lars_`.

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

    prefix = "lars"
    technique = "LARS"
    # The fused kernel reads scaled gradients and writes unscaled ones in one pass.
    scaled_gradients = True
    _unit_ = staticmethod(lars_unit_)
    # The kernel branch of the unit function is one kernel entry's call and nothing else.
    replays = True

    def __init__(
        self,
        threshold: float = 1e-2,
        weight_decay: float = 0.0,
        eps: float = 1e-9,
        *,
        trust_coefficient: float = 1.0,
        clip: bool = False,
        zero_grad_mode: ZeroGradMode = "scale",
        foreach: bool | None = None,
    ) -> None:
        super().__init__(
            threshold=threshold,
            weight_decay=weight_decay,
            eps=eps,
            trust_coefficient=trust_coefficient,
            clip=clip,
            zero_grad_mode=zero_grad_mode,
            foreach=foreach,
        )

    def _check_group(self, group: Mapping[str, Any], settings: LARSSettings) -> str | None:
        if settings.clip and not isinstance(group.get("lr"), (float, int, Tensor)):
            raise ValueError(
                "clip=True divides by the group's learning rate, but the group has "
                f'"lr"={group.get("lr")!r}'
            )
        own = group.get("weight_decay", 0)
        if settings.weight_decay > 0 and isinstance(own, (int, float)) and own > 0:
            return (
                f"the optimizer's \"weight_decay\"={own} and GradientLARS's "
                f"weight_decay={settings.weight_decay} both decay these parameters, so decay "
                "would be applied twice; set the optimizer's to 0 (the hook's is the one LARS "
                "scales), or opt the group out of one of them"
            )
        return None

    @property
    def last_rates(self) -> list[Tensor]:
        """The rates of the last step: one 1-D tensor per param group, on device."""
        return self._last_values
