r"""Adaptive gradient clipping (AGC) as a hook for any PyTorch optimizer.

Implements the unit-wise clipping of A. Brock, S. De, S. L. Smith and K. Simonyan,
"High-Performance Large-Scale Image Recognition Without Normalization", arXiv:2102.06171
(2021), section 4.1, with the paper's defaults and timm's and optax's unit rule: a unit is a
row along dim 0 of a tensor with at least two dimensions, the whole tensor otherwise.

The maths are a pure function (:func:`agc_unit_`); :class:`AdaptiveGradientClipping` puts it
on :class:`~normhooks._step_hook.StepHook`, which attaches to any optimizer and handles
closures, AMP and sharded parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from normhooks import _checks, _kernels
from normhooks import _torch_compat as compat
from normhooks._precision import HALF_DTYPES
from normhooks._step_hook import (
    Settings,
    Steady,
    StepHook,
    _unscaled_,
    _written_,
    euclidean_norms,
    row_norms,
    setting,
    split_param_groups,
)
from normhooks._step_hook.checks import all_plain

__all__ = ["AdaptiveGradientClipping", "agc_", "agc_param_groups"]


@dataclass(frozen=True, eq=False)
class AGCSettings(Settings):
    """AdaptiveGradientClipping's settings; a param group overrides one with ``"agc_<name>"``."""

    clipping: float = setting(_checks.positive)
    """The largest ratio ``||G_i|| / max(||W_i||, eps)`` left unclipped."""
    eps: float = setting(_checks.non_negative)
    """The smallest weight norm a unit is compared with (0: none, a zero unit never moves)."""


def _unit_norms(tensors: list[Tensor], whole: Tensor | None, foreach: bool | None) -> Tensor:
    """The norm of every unit, in the compute dtype: first the 0-/1-D tensors, then the rows.

    ``whole`` holds the full tensors' norms (for shards); only the 0-/1-D ones are read.
    """
    flat = [i for i, t in enumerate(tensors) if t.ndim < 2]
    parts = []
    if flat:
        if whole is None:
            parts.append(euclidean_norms([tensors[i] for i in flat], foreach))
        else:
            # Picked by unbind, not whole[flat]: a list index is copied to the device.
            chosen = whole.unbind(0)
            parts.append(
                whole if len(flat) == len(tensors) else torch.stack([chosen[i] for i in flat])
            )
    for t in tensors:
        if t.ndim >= 2:
            parts.append(row_norms(t))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def agc_unit_(
    params: list[Tensor],
    grads: list[Tensor],
    settings: AGCSettings,
    lr: float | Tensor | None,
    *,
    norms: tuple[Tensor, Tensor] | None,
    foreach: bool | None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    steady: Steady | None = None,
) -> Tensor:
    """AGC on one unit (one device, dtype and sharding); returns each parameter's largest
    ratio :math:`\\|G_i\\| / \\max(\\|W_i\\|, \\epsilon)`, in order.

    On CUDA with Triton a multi-tensor kernel does all of it in two launches (sharded units
    excepted). ``grads`` may be scaled by ``grad_scale`` (a fused optimizer under GradScaler):
    the ratios and the clipping use the true gradients, the unscaled result is written, and
    ``found_inf`` is set to 1 where a gradient read or written is not finite. float16/bfloat16
    gradients are clipped in float32, by a float32 factor, and rounded once. ``norms``
    (shards) supply the 0-/1-D tensors' full norms; the rows of a tensor sharded on dim 0 are
    all local.
    """
    # available() checks the modes (compiling, tracing, ...) and the first tensor; the types
    # of all of them in one pass each (DTensors, sharded, keep the formula below).
    # A unit record that holds (steady) proves the types, as it proves what the kernels
    # keep for these tensors.
    if (
        norms is None
        and _kernels.available(params[0])
        and (steady is not None or (all_plain(params) and all_plain(grads)))
    ):
        # Two launches whatever the number of tensors, the GradScaler protocol included.
        ratios = _kernels.agc_unit_(
            params,
            grads,
            clipping=settings.clipping,
            eps=settings.eps,
            grad_scale=grad_scale,
            found_inf=found_inf,
            kept=None if steady is None else steady.kept,
        )
        if ratios is not None:  # None: the kernel failed here (warned once): the formula
            return ratios
    sources, flag = grads, found_inf
    if grad_scale is not None:
        # The base's unscaled path, taken here: float16/bfloat16 gradients as float32 copies,
        # each gradient read and written checked for inf/NaN.
        flag = torch.zeros((), device=grads[0].device) if flag is None else flag
        sources = _unscaled_(grads, grad_scale, flag, foreach)
        if norms is not None:
            norms = (norms[0], norms[1] / grad_scale.to(norms[1].device, norms[1].dtype))
    ratios = _clip_(params, sources, settings, norms, foreach)
    if flag is not None:
        _written_(grads, sources, flag, foreach)
    return ratios


def _clip_(
    params: list[Tensor],
    grads: list[Tensor],
    settings: AGCSettings,
    norms: tuple[Tensor, Tensor] | None,
    foreach: bool | None,
) -> Tensor:
    """The plain formula of :func:`agc_unit_` on unscaled gradients."""
    w = _unit_norms(params, None if norms is None else norms[0], foreach)
    g = _unit_norms(grads, None if norms is None else norms[1], foreach)
    bounded = w.clamp(min=settings.eps)
    max_norm = bounded * settings.clipping
    # A branch on the tensor values would be a host sync; where() divides only where
    # ||G|| > max_norm > 0, so zero gradients stay zero and nothing divides by zero.
    factors = torch.where(g > max_norm, max_norm / g, torch.ones_like(g))
    # With eps=0 a zero unit has ratio inf (0/0 counts as 0: a zero gradient is never clipped).
    ratios = torch.where(g > 0, g / bounded, torch.zeros_like(g))
    flat = [i for i, t in enumerate(params) if t.ndim < 2]
    rows = [i for i, t in enumerate(params) if t.ndim >= 2]
    factor_of: list[Tensor] = [torch.empty(0)] * len(params)
    ratio_of: list[Tensor] = [torch.empty(0)] * len(params)
    count = len(flat)
    if flat:
        for i, factor, ratio in zip(
            flat, factors[:count].unbind(0), ratios[:count].unbind(0), strict=True
        ):
            factor_of[i], ratio_of[i] = factor, ratio
    if rows:
        sizes = [params[i].shape[0] for i in rows]
        row_factors = torch.split(factors[count:], sizes)
        # Ratios are >= 0: padding each parameter's rows with zeros, one max covers them all.
        padded = pad_sequence(list(torch.split(ratios[count:], sizes)), batch_first=True)
        row_maxima = padded.amax(1) if padded.shape[1] else padded.new_zeros(len(rows))
        for i, factor, ratio in zip(rows, row_factors, row_maxima.unbind(0), strict=True):
            factor_of[i] = factor.view((factor.shape[0],) + (1,) * (params[i].ndim - 1))
            ratio_of[i] = ratio
    if foreach is False or grads[0].dtype in HALF_DTYPES:
        # In place on float16/bfloat16 with a float32 factor: computed in float32, rounded once.
        for grad, factor in zip(grads, factor_of, strict=True):
            grad.mul_(factor)
    else:
        compat.foreach_mul_(grads, factor_of)
    return torch.stack(ratio_of)


def agc_(
    parameters: Tensor | Iterable[Tensor],
    clipping: float = 0.01,
    eps: float = 1e-3,
    *,
    foreach: bool | None = None,
) -> Tensor:
    r"""Clips every parameter's ``.grad`` in place, unit by unit, relative to its weight.

    For each unit :math:`i` of a parameter :math:`W` with gradient :math:`G` (a row along
    dim 0 when :math:`W` has at least two dimensions: an output unit of ``nn.Linear`` and
    ``nn.ConvNd``; the whole tensor for 0-/1-D parameters):

    .. math::

        G_i \leftarrow \begin{cases}
            \lambda \frac{\max(\|W_i\|, \epsilon)}{\|G_i\|} G_i
                & \frac{\|G_i\|}{\max(\|W_i\|, \epsilon)} > \lambda \\
            G_i & \text{otherwise}
        \end{cases}

    with :math:`\lambda` = ``clipping``. This is timm's ``adaptive_clip_grad`` and optax's
    ``adaptive_grad_clip``: zero weights count as :math:`\epsilon`, zero gradients are left
    alone. (Both divide by :math:`\max(\|G_i\|, 10^{-6})`, which differs from the formula
    only where :math:`\lambda\epsilon < 10^{-6}`; here the division only happens where
    :math:`\|G_i\| > \lambda \max(\|W_i\|, \epsilon) > 0`, so no floor is needed.) Dim 0 is
    the input axis of ``nn.ConvTranspose`` weights, as in timm. Norms are per device and dtype,
    float16/bfloat16 computed in float32 and rounded once; on the CPU, units of more than 4096
    values are reduced in pieces whose sums of squares are added in float64 (a single float32
    reduction of a long unit is not precise). On CUDA with Triton, two kernel launches clip
    every parameter of a device and dtype, whatever their number (DTensor shards excepted).
    Nothing is read back to the host.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        clipping: :math:`\lambda`, the largest allowed ratio of gradient to weight norm.
        eps: :math:`\epsilon`, the smallest weight norm a unit is given, so that zero-initialized
            weights can still move. ``eps=0`` (composer's adaptive ``GradientClipping``) sets
            no floor: a unit whose weights are all zero then has its gradient clipped to zero
            and never moves, and its ratio is inf.
        foreach: True or None take multi-tensor ops, False one tensor at a time.

    Returns:
        A 1-D tensor with, for each parameter that has a gradient, the largest ratio
        :math:`\|G_i\| / \max(\|W_i\|, \epsilon)` over its units before clipping (the
        parameter was clipped where it exceeds ``clipping``). For a DTensor sharded on dim 0
        it is the largest over the rows this process holds (0 if none).

    References:
        Brock, De, Smith and Simonyan, High-Performance Large-Scale Image Recognition Without
        Normalization, arXiv:2102.06171.

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
        >>> w.grad = torch.tensor([[3.0, 4.0], [0.0, 0.5]])
        >>> agc_(w, clipping=0.1, eps=1.0)
        tensor([1.])
        >>> w.grad
        tensor([[0.3000, 0.4000],
                [0.0000, 0.1000]])
    """
    settings = AGCSettings._checked({"clipping": clipping, "eps": eps})
    return cast(
        Tensor, AdaptiveGradientClipping._apply_to_parameters_(parameters, settings, foreach)
    )


def agc_param_groups(
    model: nn.Module, *, exclude: str | Callable[[str, nn.Parameter], bool] | None = None
) -> list[dict[str, Any]]:
    """Splits a model's parameters into an AGC group and a group the hook leaves alone.

    By default the weight and bias of the model's last ``nn.Linear`` (in the order of
    ``model.modules()``, the order layers were registered in: the classifier of torchvision's
    and timm's models) go into a group with ``"agc": False``, since NF-Nets do not clip the
    final linear layer (Brock et al. 2021, section 4.1). Empty groups are left out.

    Args:
        model: the module whose parameters to split.
        exclude: the name of the submodule to leave alone (``"head"``), or a predicate
            ``(name, param) -> bool`` that returns True for the parameters to leave alone.

    Returns:
        A list of param group dicts for any ``torch.optim`` optimizer.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
        ...                             torch.nn.LazyLinear(10))
        >>> [(len(g["params"]), g.get("agc", True)) for g in agc_param_groups(model)]
        [(2, True), (2, False)]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    left_out: set[int] = set()
    if exclude is None:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError(
                "model has no nn.Linear, so there is no final linear layer to leave unclipped; "
                "name the classifier with exclude='<module name>' or pass a predicate"
            )
        left_out = {id(p) for p in linears[-1].parameters()}
    elif isinstance(exclude, str):
        try:
            module = model.get_submodule(exclude)
        except AttributeError:
            names = [name for name, _ in model.named_children()]
            raise ValueError(
                f"exclude={exclude!r} names no submodule of the model; its children are {names}"
            ) from None
        left_out = {id(p) for p in module.parameters()}
    elif not callable(exclude):
        raise TypeError(
            "exclude must be a module name, a callable (name, param) -> bool or None, "
            f"got {type(exclude).__name__}"
        )
    leave_alone = exclude if callable(exclude) else (lambda _, param: id(param) in left_out)
    return split_param_groups(model, "agc", leave_alone)


class AdaptiveGradientClipping(StepHook, AGCSettings):
    r"""Adaptive gradient clipping as a step pre-hook for any PyTorch optimizer.

    Before every ``optimizer.step()``, each parameter's gradient is clipped in place unit by
    unit, as in :func:`agc_`:

    .. math::

        G_i \leftarrow \min\left(1, \frac{\lambda \max(\|W_i\|, \epsilon)}{\|G_i\|}\right) G_i.

    Param groups can opt out (``"agc": False``; :func:`agc_param_groups` puts the final
    linear layer there, as NF-Nets do) or override a setting with ``"agc_clipping"`` or
    ``"agc_eps"``. The largest ratio :math:`\|G_i\| / \max(\|W_i\|, \epsilon)` of each
    parameter in the last step is in :attr:`last_ratios`, one 1-D tensor per param group
    (empty for a group the hook skips), left on the parameters' device. One
    AdaptiveGradientClipping per optimizer: attaching a second is refused.

    ``step(closure)`` works, and so does :class:`torch.amp.GradScaler` with fused optimizers
    (the result is written unscaled and an inf/NaN gradient still skips the step; see
    :class:`~normhooks._step_hook.StepHook`). FSDP2 (``fully_shard``): the rows of a
    parameter sharded on dim 0 are all on one rank, so their norms need no communication;
    0-/1-D parameters take their whole norms from the base's one all-reduce per step.
    DTensors sharded on another dim are refused; :attr:`last_ratios` of a Shard(0) parameter
    are over the rows this rank holds.

    Args:
        clipping: :math:`\lambda`, the largest allowed ratio of gradient to weight norm.
        eps: :math:`\epsilon`, the smallest weight norm a unit is given; 0 sets none, so a
            unit whose weights are all zero never moves (composer's rule, see :func:`agc_`).
        foreach: as in :func:`agc_`.

    References:
        Brock, De, Smith and Simonyan, High-Performance Large-Scale Image Recognition Without
        Normalization, arXiv:2102.06171.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 2))
        >>> optimizer = torch.optim.SGD(agc_param_groups(model), lr=0.1, momentum=0.9)
        >>> hook = AdaptiveGradientClipping(clipping=0.01)
        >>> handle = hook.attach(optimizer)
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> optimizer.step()
        >>> [tuple(r.shape) for r in hook.last_ratios]  # 2 clipped, the classifier's 2 not
        [(2,), (0,)]
        >>> handle.remove()
    """

    prefix = "agc"
    technique = "AGC"
    row_wise = True
    scaled_gradients = True
    _unit_ = staticmethod(agc_unit_)
    # The kernel branch of the unit function is one kernel entry's call and nothing else.
    replays = True

    def __init__(
        self, clipping: float = 0.01, eps: float = 1e-3, *, foreach: bool | None = None
    ) -> None:
        super().__init__(clipping=clipping, eps=eps, foreach=foreach)

    @property
    def last_ratios(self) -> list[Tensor]:
        """Each parameter's largest ratio of the last step: a 1-D tensor per param group."""
        return self._last_values
