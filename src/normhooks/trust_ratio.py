r"""A layer-wise trust ratio on any optimizer's own update: LAMB for AdamW, and more.

Implements the trust ratio of Y. You, J. Li, S. Reddi et al., "Large Batch Optimization for
Deep Learning: Training BERT in 76 minutes", arXiv:1904.00962 (2019), for any
:class:`torch.optim.Optimizer`, the way optax composes ``scale_by_trust_ratio`` after any
transformation: the optimizer takes its step, and the hook rescales each parameter's update
by :math:`\|w\| / \|u\|`. With AdamW this is LAMB.

The maths are pure functions (:func:`trust_ratios`, :func:`rescale_updates_`);
:class:`TrustRatio` puts them on :class:`~normhooks._step_hook.StepHook` as a hook on the
updates, which handles attaching, the copy of the parameters, closures, param-group settings
and sharded parameters.
"""

from __future__ import annotations

import contextvars
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any, cast

import torch
from torch import Tensor

from normhooks import _checks, _kernels
from normhooks import _torch_compat as compat
from normhooks._step_hook import (
    Settings,
    Steady,
    StepHook,
    _Bound,
    _UpdateInFlight,
    euclidean_norms,
    setting,
)
from normhooks._step_hook.checks import all_plain
from normhooks._step_hook.copies import _Copies, _Rows
from normhooks._step_hook.settings import Lr
from normhooks._step_hook.updates import OldNorms, in_rows_order

__all__ = ["TrustRatio", "rescale_updates_", "trust_ratios"]

_EXACT_DTYPES = (torch.float32, torch.float64)


def _non_negative_or_inf(name: str, value: object) -> float:
    # math.inf never takes the ratio: with bias_correction=False, the uncorrected Adam step.
    if value == math.inf and not isinstance(value, bool):
        return math.inf
    if isinstance(value, Real) and not isinstance(value, bool) and not float(value) >= 0:
        raise ValueError(f"{name} must be non-negative or math.inf, got {name}={value!r}")
    return _checks.non_negative(name, value)


@dataclass(frozen=True, eq=False)
class TrustRatioSettings(Settings):
    """TrustRatio's settings, which a param group can override with ``"trust_<name>"``."""

    threshold: float = setting(_non_negative_or_inf)
    """Parameters whose norm is at most this keep ratio 1 (``math.inf``: all of them)."""
    eps: float = setting(_checks.non_negative)
    """Added to the update's norm in the ratio's denominator."""
    # The group key is "trust_coefficient" too: a setting that starts with the prefix keeps it.
    trust_coefficient: float = setting(_checks.positive)
    """Multiplies the ratio."""
    clip: float | None = setting(_checks.optional(_checks.positive))
    """The cap on the ratio, or None."""
    floor: float | None = setting(_checks.optional(_checks.positive))
    """The lower bound on the ratio where it is taken (not on the fallback 1), or None."""
    max_weight_norm: float | None = setting(_checks.optional(_checks.positive))
    r"""The cap on :math:`\|w\|` in the ratio (LAMB's :math:`\phi`), or None."""
    bias_correction: bool = setting(_checks.boolean)
    """False: the ratio of, and the step along, a torch Adam's update without its bias
    correction."""


def trust_ratios(w_norm: Tensor, u_norm: Tensor, settings: TrustRatioSettings) -> Tensor:
    r"""The trust ratio of each parameter from :math:`\|w\|` and :math:`\|u\| = \|\Delta\| / lr`.

    :math:`r = \min(\eta \|w\| / (\|u\| + \epsilon), \text{clip})`, and :math:`r = 1` (the
    optimizer's own update) where :math:`\|w\| \le` threshold or :math:`\|u\| = 0`. Computed
    with ``torch.where``, never a Python branch on a value: nothing is read back to the host.

    Example:
        >>> settings = TrustRatioSettings(
        ...     threshold=0.0, eps=0.0, trust_coefficient=1.0, clip=None, floor=None,
        ...     max_weight_norm=None, bias_correction=True,
        ... )
        >>> trust_ratios(torch.tensor([3.0, 0.0, 2.0]), torch.tensor([6.0, 1.0, 0.0]), settings)
        tensor([0.5000, 1.0000, 1.0000])
    """
    denominator = u_norm + settings.eps if settings.eps != 0 else u_norm
    # The fallback below tests the unclamped norm: a clamp keeps a nonzero norm nonzero.
    phi = w_norm if settings.max_weight_norm is None else w_norm.clamp(max=settings.max_weight_norm)
    ratio = phi / denominator
    if settings.trust_coefficient != 1:
        ratio = ratio * settings.trust_coefficient
    if settings.clip is not None or settings.floor is not None:
        ratio = torch.clamp(ratio, min=settings.floor, max=settings.clip)
    # A zero update stays zero whatever the ratio, and a non-finite one stays non-finite: the
    # ratio 1 leaves the optimizer's result exactly as it is (a skipped AMP step included).
    scaled = (w_norm > settings.threshold) & (u_norm > 0)
    return torch.where(scaled, ratio, torch.ones_like(ratio))


def rescale_updates_(
    params: list[Tensor], reverts: list[Tensor], ratios: Tensor, foreach: bool | None = None
) -> None:
    r"""``w += (1 - r) * d`` in place, where ``d = w_old - w_new``: :math:`w = w_{old} + r\Delta`.

    Written around the new value, so that :math:`r = 1` leaves it bit for bit unchanged.

    Example:
        >>> w = torch.tensor([1.5, 2.0])  # after a step from [1.0, 1.0]
        >>> rescale_updates_([w], [torch.tensor([1.0, 1.0]) - w], torch.tensor([0.5]))
        >>> w
        tensor([1.2500, 1.5000])
    """
    factors = list((1 - ratios).to(params[0].dtype).unbind(0))
    if foreach is False:
        for param, revert, factor in zip(params, reverts, factors, strict=True):
            param.addcmul_(revert, factor)
    else:
        compat.foreach_addcmul_(params, reverts, factors)


def trust_ratio_unit_(
    params: list[Tensor],
    reverts: list[Tensor],
    settings: TrustRatioSettings,
    lr: float | Tensor | None,
    *,
    norms: tuple[Tensor, Tensor] | None,
    foreach: bool | None,
) -> Tensor:
    """The trust ratio on one unit's update, from ``norms = (||w_old||, ||w_old - w_new||)``."""
    assert norms is not None  # the base computes them for every hook on the updates
    w_norm, d_norm = norms
    step = lr.to(d_norm) if isinstance(lr, Tensor) else lr
    if not settings.bias_correction:
        return _uncorrected_unit_(params, reverts, settings, step, norms, foreach)
    ratios = trust_ratios(w_norm, d_norm / step, settings)  # type: ignore[operator]
    rescale_updates_(params, reverts, ratios, foreach)
    return ratios


def _rescale_in_rows_order_(
    rows: _Rows,
    olds: list[Tensor],
    params: list[Tensor],
    w_norm: Tensor,
    settings: TrustRatioSettings,
    lr: float | Tensor | None,
) -> Tensor:
    """:func:`trust_ratio_unit_` of float32 CPU tensors whose old values ``olds`` (the views
    of ``rows``' buffer) have the norms ``w_norm``: the difference left in ``olds`` in one
    multi-tensor call, its norms in one pass over the buffer, the rescaling in one call (its
    factors' views kept with the rows: unbinding 1 - r at each step would cost a view per
    tensor). The formula of :func:`trust_ratio_unit_`, with the norms of :class:`_Rows`.
    """
    assert lr is not None  # _check_group refuses a group without a learning rate
    step = lr.to(torch.float32) if isinstance(lr, Tensor) else lr
    compat.foreach_sub_(olds, params)
    ratios = trust_ratios(w_norm, rows.norms() / step, settings)
    rows.factors.copy_(1 - ratios)
    compat.foreach_addcmul_(params, olds, rows.factor_views)
    return ratios


# The optimizer whose step the hook is finishing, for the units that read its state.
_STEPPING: contextvars.ContextVar[torch.optim.Optimizer] = contextvars.ContextVar("stepping")


def uncorrection_factors(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> Tensor:
    r"""``(1 - beta1**t) / sqrt(1 - beta2**t)`` for each parameter, after its step ``t``.

    The factor that turns torch Adam's bias-corrected step direction back into the
    uncorrected one: with ``eps = 0``, :math:`\hat m / \sqrt{\hat v} = c\, m / \sqrt v` with
    :math:`c = \sqrt{1 - \beta_2^t} / (1 - \beta_1^t)`, and this is :math:`1 / c`. Computed
    from the state's ``step`` tensors where they live, in float64 (as torch computes the
    correction on the host), without reading a value back.
    """
    first = params[0]
    group = next(g for g in optimizer.param_groups if any(p is first for p in g["params"]))
    steps = [optimizer.state[p]["step"] for p in params]
    t = torch.stack([torch.as_tensor(s).to(torch.float64) for s in steps])
    # Python betas straight to float64: through a float32 tensor, 0.999 would become 0.99900001.
    beta1, beta2 = (
        torch.as_tensor(b, dtype=torch.float64, device=t.device) for b in group["betas"]
    )
    return (1 - beta1**t) / torch.sqrt(1 - beta2**t)


def _uncorrected_unit_(
    params: list[Tensor],
    reverts: list[Tensor],
    settings: TrustRatioSettings,
    lr: float | Tensor | None,
    norms: tuple[Tensor, Tensor],
    foreach: bool | None,
) -> Tensor:
    r"""The trust ratio on the step a torch Adam would take without bias correction.

    With :math:`\rho = w_{old} - w_{new} = lr\,(wd\,w_{old} + c\,a)` (decoupled decay;
    :math:`wd = 0` for L2 decay, which is inside :math:`a`) and :math:`k = 1 / c`,
    :math:`\delta = k\rho + lr\,wd\,(1 - k)\,w_{old} = lr\,(a + wd\,w_{old})`, and
    :math:`w = w_{old} - r\delta` with :math:`r` from :math:`\|\delta\| / lr`. Works in
    place: ``params`` become :math:`w_{old}`, ``reverts`` :math:`\delta`, then the result.
    """
    assert lr is not None  # _check_group refuses a group without a learning rate
    optimizer = _STEPPING.get()
    group = next(g for g in optimizer.param_groups if any(p is params[0] for p in g["params"]))
    w_norm, d_norm = norms
    # A zero update (a skipped fused AMP step, whose step count is back at t - 1, maybe 0
    # where the factor is 0 / 0) stays zero: k = 1 leaves it, decay term and all.
    k = torch.where(d_norm > 0, uncorrection_factors(optimizer, params).to(w_norm), 1.0)
    decay = group["weight_decay"] if group.get("decoupled_weight_decay", False) else 0.0
    if foreach is False:
        for param, revert, factor in zip(params, reverts, k.unbind(0), strict=True):
            param.add_(revert)
            revert.mul_(factor)
            if decay != 0:
                revert.add_(param * (lr * decay * (1 - factor)))
    else:
        compat.foreach_add_(params, reverts)
        compat.foreach_mul_(reverts, list(k.unbind(0)))
        if decay != 0:
            compat.foreach_addcmul_(reverts, params, list((lr * decay * (1 - k)).unbind(0)))
    ratios = trust_ratios(w_norm, euclidean_norms(reverts, foreach) / lr, settings)
    factors = list((-ratios).to(params[0].dtype).unbind(0))
    if foreach is False:
        for param, revert, factor in zip(params, reverts, factors, strict=True):
            param.addcmul_(revert, factor)
    else:
        compat.foreach_addcmul_(params, reverts, factors)
    return ratios


def norms_and_reverts_(olds: list[Tensor], params: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``(||w_old||, ||w_old - w_new||)`` of float32 CPU tensors, the difference left in ``olds``.

    The norms of the CPU order (:class:`~normhooks._step_hook.copies._Rows`: float32 norms
    of rows of ``_CPU_ROW`` values, their squares added in float64), taken over copies laid
    out in rows; the hook itself takes the old values' norms with their copy, before the step
    (:meth:`~normhooks._step_hook.copies._Copies.hold_with_norms`).

    Example:
        >>> olds, news = [torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 2.0])]
        >>> norms_and_reverts_(olds, news), olds
        ((tensor([5.]), tensor([2.])), [tensor([0., 2.])])
    """
    if not olds:
        return torch.empty(0), torch.empty(0)
    copies = _Copies(olds)
    held, w_norm = copies.hold_with_norms(olds)
    compat.foreach_sub_(held, params)
    d_norm = copies.rows().norms()
    compat.foreach_copy_(olds, held)
    return w_norm, d_norm


def _plain_and_contiguous(params: list[Tensor], steady: Steady | None) -> bool:
    """Whether ``params`` are plain and contiguous, as the kernel's copy takes them: read once
    per unit record (which fixes every type and layout while it holds), or at each call."""
    if steady is None:
        return all_plain(params) and all(map(Tensor.is_contiguous, params))
    found = steady.kept.get("plain and contiguous")
    if found is None:
        found = steady.kept["plain and contiguous"] = all_plain(params) and all(
            map(Tensor.is_contiguous, params)
        )
    return bool(found)


class TrustRatio(StepHook, TrustRatioSettings):
    r"""Rescales the update of any optimizer by a layer-wise trust ratio (LAMB's).

    The optimizer takes its own step; then, for each parameter, with
    :math:`\Delta = w_{new} - w_{old}` and the param group's learning rate :math:`lr`:

    .. math::

        u = -\Delta / lr, \qquad
        r = \operatorname{clamp}\!\left(\frac{\eta\,\phi(\|w_{old}\|)}{\|u\| + \epsilon},
            \text{floor}, \text{clip}\right), \qquad
        w \leftarrow w_{old} + r\,\Delta,

    with :math:`\phi(z) = \min(z, \text{max\_weight\_norm})` (LAMB's :math:`\phi`; the
    identity by default), and :math:`r = 1` (the optimizer's update, untouched) where
    :math:`\|w_{old}\| \le` ``threshold`` or :math:`\|u\| = 0` (a zero update, a skipped AMP
    step), and norms of whole tensors (of the full tensor for DTensor shards).
    :math:`u` is the optimizer's step direction, decoupled weight decay included; dividing by
    ``lr`` makes the ratio, and ``eps`` with it, independent of the schedule, as in optax's
    ``scale_by_trust_ratio`` (where the update has not been multiplied by the lr yet).
    ``eps`` is added to :math:`\|u\|`. ``lr`` is read at each step, so LR schedulers work;
    ``lr = 0`` with a nonzero update gives :math:`r = 0`.

    With ``torch.optim.AdamW(weight_decay=wd)``,
    :math:`u = \hat m / (\sqrt{\hat v} + \epsilon_{Adam}) + wd\, w`, and this is LAMB as
    timm's ``Lamb`` and apex's ``FusedLAMB`` compute it (their defaults; groups with
    ``weight_decay=0`` opt out with ``"trust": False``). The LAMBs that never correct the
    moments (the paper's v3, torch-optimizer's and pytorch-lamb's ``Lamb``, DeepSpeed's
    ``FusedLamb``, pytorch-optimizer's) take ``bias_correction=False``, which works on
    ``torch.optim.Adam`` and ``AdamW`` only: it reads each parameter's ``step`` from the
    optimizer's state and the group's ``betas``, and takes the ratio of, and the step along,

    .. math::

        \delta = \frac{\rho}{c} + lr\, wd \left(1 - \frac{1}{c}\right) w_{old}
               = lr\left(\frac{m}{\sqrt v + \epsilon_{Adam}\sqrt{1 - \beta_2^t}}
                 + wd\, w_{old}\right),
        \qquad c = \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t},

    with :math:`\rho = -\Delta` (:math:`wd` the decoupled decay; 0 for Adam's L2 decay, which
    is inside :math:`m` and :math:`v`): :math:`w \leftarrow w_{old} - r\delta`, :math:`r`
    from :math:`\|\delta\| / lr`, and :math:`r = 1` still where the ratio falls back, so a
    zero weight takes the uncorrected Adam step those LAMBs take. ``eps`` cannot be mapped
    after the fact: the peers add theirs to :math:`\sqrt v`, so an ``AdamW`` eps of
    :math:`\epsilon / \sqrt{1 - \beta_2^t}` at step :math:`t` (or ``eps=0``) reproduces them.
    docs/migrating/lamb.md gives the call for each peer, with the differences measured.

    With ``torch.optim.SGD(momentum)`` it is optax's ``chain(trace(momentum),
    scale_by_trust_ratio(), scale(-lr))``.

    Cost: one copy of the parameters taking part, one flat buffer per device and dtype: kept
    between steps on the CPU (where freeing and allocating it again would fault every page
    in at each step), given back to the caching allocator after each step elsewhere. On CUDA
    with Triton, three kernel launches per step whatever the number of tensors: the copy with
    the old weights' norms before the step, the update's norm with the ratio and the
    rescaling after it (:mod:`normhooks._kernels.trust_ratio`; sharded units and
    ``bias_correction=False`` groups take the multi-tensor ops). On the CPU, float32 tensors
    are copied into a buffer laid out in rows, whose norms one call takes over the whole
    buffer: the copy, the difference and the rescaling are one multi-tensor op each, and
    each set of norms one pass. Elsewhere the copy, the norms and the rescaling are
    multi-tensor ops (``foreach``). Nothing is read back to the host. The optimizer's
    ``state_dict`` is untouched.

    Precision: the update is read as a difference of parameters after the optimizer has
    rounded :math:`w_{new}`, whose rounding error (half a unit in the last place) the ratio
    then multiplies, in :math:`\Delta` and in :math:`\|\Delta\|`: per step the result stays
    within about :math:`r + 1` units in the last place of :math:`\max |w|` of a LAMB that
    never rounds :math:`w_{new}` (tests/test_trust_ratio.py measures it against float64). The
    usual ratios are below a few units. Float16/bfloat16 parameters are refused: an optimizer
    that keeps float32 master weights for them would overwrite the hook's result at its next
    step, and one that does not has already rounded a small update away. Keep float32
    parameters and train in low precision under ``torch.autocast``.

    Param groups can opt out (``"trust": False``) or override a setting for themselves with
    ``"trust_threshold"``, ``"trust_eps"``, ``"trust_coefficient"``, ``"trust_clip"``,
    ``"trust_floor"``, ``"trust_max_weight_norm"`` or ``"trust_bias_correction"``. The
    ratios of the last step are in :attr:`last_ratios`. Closures work (the hook evaluates
    the closure, as every :class:`~normhooks._step_hook.StepHook` does); under
    :class:`torch.amp.GradScaler` a skipped step stays skipped: a non-fused optimizer's step
    does not run at all, a fused one leaves the parameters unchanged and the ratio is 1.
    DTensor parameters (FSDP2, HSDP) get the norms of their full tensors, one all-reduce per
    set of process groups for all of them. One TrustRatio per optimizer.

    Args:
        threshold: parameters whose norm is at most this keep the optimizer's update (r = 1);
            ``math.inf`` for every parameter.
        eps: added to :math:`\|u\|` in the denominator.
        trust_coefficient: :math:`\eta`, multiplies the ratio.
        clip: an upper bound on the ratio (timm's ``trust_clip=True`` is ``clip=1.0``), or
            None for no bound.
        floor: a lower bound on the ratio where it is taken (DeepSpeed's ``min_coeff``), or
            None; at most ``clip``.
        max_weight_norm: the cap on :math:`\|w\|` in the ratio (torch-optimizer's
            ``clamp_value``, pytorch-lamb's and pytorch-optimizer's 10), or None. The paper
            bounds :math:`\phi` below too (:math:`\gamma_l`), which no PyTorch peer does and
            this does not offer.
        bias_correction: False takes the ratio of the update ``torch.optim.Adam``/``AdamW``
            would take without bias correction, and steps along it (see above).
        foreach: True or None take multi-tensor ops, False one tensor at a time; the norms
            of long CPU tensors are taken row by row either way (see :func:`~normhooks.lars_`).

    References:
        You et al., Large Batch Optimization for Deep Learning: Training BERT in 76 Minutes,
        arXiv:1904.00962 (v1 corrects the moments, v3 does not, v5 does again; v3 and v5
        bound the weight norm by :math:`\phi`).

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
        >>> hook = TrustRatio()
        >>> handle = hook.attach(optimizer)
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> optimizer.step()
        >>> [tuple(r.shape) for r in hook.last_ratios]  # weight and bias
        [(2,)]
        >>> handle.remove()
    """

    prefix = "trust"
    technique = "TrustRatio"
    rewrites = "updates"
    _unit_ = staticmethod(trust_ratio_unit_)

    def __init__(
        self,
        threshold: float = 0.0,
        eps: float = 0.0,
        *,
        trust_coefficient: float = 1.0,
        clip: float | None = None,
        floor: float | None = None,
        max_weight_norm: float | None = None,
        bias_correction: bool = True,
        foreach: bool | None = None,
    ) -> None:
        super().__init__(
            threshold=threshold,
            eps=eps,
            trust_coefficient=trust_coefficient,
            clip=clip,
            floor=floor,
            max_weight_norm=max_weight_norm,
            bias_correction=bias_correction,
            foreach=foreach,
        )
        _check_bounds(self, "floor", "clip")
        # The optimizers whose state a unit reads (bias_correction=False in some group).
        self._reads_state: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def _group_settings(
        self, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], index: int
    ) -> Any:
        settings = super()._group_settings(optimizer, group, index)
        if isinstance(settings, TrustRatioSettings) and not settings.bias_correction:
            _check_adam(optimizer, group, index)
            self._reads_state.add(optimizer)
        return settings

    def _after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        token = _STEPPING.set(optimizer) if optimizer in self._reads_state else None
        try:
            super()._after_step(optimizer, args, kwargs)
        finally:
            if token is not None:
                _STEPPING.reset(token)

    def _copy_in(self, b: _Bound, copies: _Copies) -> tuple[list[Tensor], OldNorms | None]:
        """The copy, with the old values' norms on the way where it can: one kernel launch
        for a CUDA unit (sums of squares), one pass over the copies' rows on the CPU."""
        params, steady = b.params, b.steady
        if (
            not b.unit.reduce
            and _kernels.available(params[0])
            and _plain_and_contiguous(params, steady)
        ):
            kept = None if steady is None else steady.kept
            squares = _kernels.trust_ratio_copy(
                params, copies.buffer(), *copies.offsets(), kept=kept
            )
            if squares is not None:  # None: the kernel failed here (warned once)
                return copies.views, OldNorms(True, squares)
        if self._foreach is not False and in_rows_order(b):
            views, norms = copies.hold_with_norms(params)
            return views, OldNorms(False, norms)
        return super()._copy_in(b, copies)

    def _finish_units(self, pending: _UpdateInFlight, flat: list[_Bound]) -> dict[int, Tensor]:
        """The kernel's units whose group takes it (two launches each), and on the CPU every
        unit with its norms from its copy's, the difference's from one pass over the
        copies' rows, and its factors' views kept with the rows."""
        done: dict[int, Tensor] = {}
        index = 0
        for (settings, lr), of_group in zip(pending.jobs, pending.bound, strict=True):
            for b in of_group:
                old = pending.old_norms[index] if pending.old_norms else None
                if old is not None and old.kernel:
                    ratios = self._kernel_rescale(b, settings, lr, old.values)
                    if ratios is not None:
                        done[index] = ratios
                elif old is not None and in_rows_order(b):
                    assert b.unit.copies is not None  # it took the copy that gave ``old``
                    rows = b.unit.copies.rows()
                    tr = cast(TrustRatioSettings, settings)
                    if tr.bias_correction:
                        done[index] = _rescale_in_rows_order_(
                            rows, b.sources, b.params, old.values, tr, lr
                        )
                    else:
                        compat.foreach_sub_(b.sources, b.params)
                        b.norms = (old.values, rows.norms())
                index += 1
        return done

    @staticmethod
    def _kernel_rescale(b: _Bound, settings: Any, lr: Lr, w_squares: Tensor) -> Tensor | None:
        """The kernel's rescaling of unit ``b``, or None where its group or state does not
        take it (the base's eager formula then reads the copy the kernel made)."""
        tr = cast(TrustRatioSettings, settings)
        copies = b.unit.copies
        # The pre-step checked the parameters (plain, contiguous) for the copy it launched;
        # a step does not change their layout.
        if not (
            tr.bias_correction
            and lr is not None
            and copies is not None
            and _kernels.available(b.params[0])
        ):
            return None
        return _kernels.trust_ratio_rescale(
            b.params,
            copies.buffer(),
            *copies.offsets(),
            w_squares,
            lr=lr,
            threshold=tr.threshold,
            eps=tr.eps,
            trust_coefficient=tr.trust_coefficient,
            clip=tr.clip,
            floor=tr.floor,
            max_weight_norm=tr.max_weight_norm,
        )

    def _check_group(self, group: Mapping[str, Any], settings: TrustRatioSettings) -> str | None:
        _check_bounds(settings, "trust_floor", "trust_clip")
        self._check_update_group(group)
        return None

    @classmethod
    def _check_param(cls, param: Tensor, where: str) -> None:
        cls._check_update_dtype(param, where)

    @property
    def last_ratios(self) -> list[Tensor]:
        """The ratios of the last step: one 1-D tensor per param group (empty where the
        group opts out or has no gradient), on the parameters' device."""
        return self._last_values


def _check_bounds(settings: TrustRatioSettings, floor: str, clip: str) -> None:
    if settings.floor is not None and settings.clip is not None and settings.floor > settings.clip:
        raise ValueError(
            f"{floor} must be at most {clip}, got {floor}={settings.floor} and "
            f"{clip}={settings.clip}"
        )


def _check_adam(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], index: int) -> None:
    """``bias_correction=False`` undoes torch Adam's own correction: refuse anything else."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise ValueError(
            f"param group {index}: bias_correction=False undoes the bias correction of "
            "torch.optim.Adam or AdamW, whose step rule it inverts, but the optimizer is "
            f"{type(optimizer).__name__}"
        )
    dtensor = compat.dtensor_type()
    if dtensor is not None and any(isinstance(p, dtensor) for p in group["params"]):
        raise ValueError(
            f"param group {index}: bias_correction=False takes the norms of local tensors "
            'and does not support DTensor parameters; set "trust_bias_correction": True'
        )
