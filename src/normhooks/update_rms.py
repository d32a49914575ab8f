r"""Per-layer update clipping and RMS matching on any optimizer's own update.

Two rules on the root mean square of each parameter's update, after the optimizer's step:
Adafactor's update clipping (N. Shazeer and M. Stern, "Adafactor: Adaptive Learning Rates
with Sublinear Memory Cost", arXiv:1804.04235, 2018, section 6), which divides the update by
:math:`\max(1, \mathrm{RMS}(u) / d)`, and the RMS matching that Moonlight's Muon applies
(J. Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982, 2025), which sets the
RMS of every matrix's update to that of AdamW's, 0.2.

The maths are pure functions (:func:`rms_ratios`); :class:`UpdateRMS` puts them on
:class:`~normhooks._step_hook.StepHook` as a hook on the updates, which keeps the parameters'
old values, handles closures, param-group settings and sharded parameters, and reduces each
update's norm over its shards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from normhooks import _checks
from normhooks._step_hook import Settings, StepHook, setting
from normhooks.trust_ratio import rescale_updates_

__all__ = ["UpdateRMS", "rms_ratios"]

Rule = Literal["clip", "match"]
_RULES = ("clip", "match")
# Adafactor's d (section 6) and the RMS of AdamW's update that Moonlight matches.
_PAPERS_RMS = {"clip": 1.0, "match": 0.2}


def _rule(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, 'clip' or 'match', got {name}={value!r}")
    if value not in _RULES:
        raise ValueError(f"{name} must be 'clip' or 'match', got {name}={value!r}")
    return value


@dataclass(frozen=True, eq=False)
class UpdateRMSSettings(Settings):
    """UpdateRMS's settings; a param group overrides one with ``"update_<name>"``."""

    rule: Literal["clip", "match"] = setting(_rule)
    """``"clip"``: the RMS is capped at ``rms``; ``"match"``: it is set to ``rms``."""
    rms: float | None = setting(_checks.optional(_checks.positive))
    """The cap (Adafactor's :math:`d`) or the target of the update's RMS; None: the rule's
    paper's value, 1.0 for ``"clip"`` (Adafactor) and 0.2 for ``"match"`` (Moonlight)."""

    @property
    def target(self) -> float:
        """``rms``, or the rule's paper's value where it is None."""
        return _PAPERS_RMS[self.rule] if self.rms is None else self.rms


def rms_ratios(rms: Tensor, rule: Rule, target: float) -> Tensor:
    r"""The factor of each update from its RMS :math:`\rho` (per unit of learning rate).

    ``"clip"``: :math:`1 / \max(1, \rho / d)`; ``"match"``: :math:`d / \rho`; with
    :math:`d` = ``target``, and 1 where :math:`\rho = 0` (a zero update has no RMS to set, and
    a skipped AMP step stays skipped). Computed with ``torch.where``: nothing is read back to
    the host.

    Example:
        >>> rms_ratios(torch.tensor([0.5, 4.0, 0.0]), "clip", 1.0)
        tensor([1.0000, 0.2500, 1.0000])
        >>> rms_ratios(torch.tensor([0.5, 4.0, 0.0]), "match", 0.2)
        tensor([0.4000, 0.0500, 1.0000])
    """
    # Adafactor divides by max(1, RMS / d); timm's AdafactorBigVision divided by
    # min(1, RMS * d) until huggingface/pytorch-image-models#2790.
    ratio = torch.clamp(rms / target, min=1.0).reciprocal() if rule == "clip" else target / rms
    return torch.where(rms > 0, ratio, torch.ones_like(ratio))


def update_rms_unit_(
    params: list[Tensor],
    reverts: list[Tensor],
    settings: UpdateRMSSettings,
    lr: float | Tensor | None,
    *,
    norms: tuple[Tensor, Tensor] | None,
    foreach: bool | None,
    shapes: Sequence[torch.Size] | None = None,
) -> Tensor:
    """The rule on one unit's updates, from ``norms[1] = ||w_old - w_new||`` of whole tensors.

    ``shapes`` are the whole tensors' (the base passes them: a shard's size is not the RMS's).
    """
    assert norms is not None  # the base computes them for every hook on the updates
    d_norm = norms[1]
    sizes = [math.prod(shape) for shape in (shapes or [p.shape for p in params])]
    count = torch.tensor(sizes, dtype=d_norm.dtype, device=d_norm.device).clamp(min=1)
    step = lr.to(d_norm) if isinstance(lr, Tensor) else lr
    rms = d_norm / count.sqrt() / step  # type: ignore[operator]
    ratios = rms_ratios(rms, settings.rule, settings.target)
    rescale_updates_(params, reverts, ratios, foreach)
    return ratios


class UpdateRMS(StepHook, UpdateRMSSettings):
    r"""Rescales each parameter's update by a rule on its RMS: clipping or matching.

    The optimizer takes its own step; then, for each parameter of :math:`N` values, with
    :math:`\Delta = w_{new} - w_{old}`, the group's learning rate :math:`lr`, the update per
    unit of learning rate :math:`u = -\Delta / lr` and
    :math:`\mathrm{RMS}(u) = \|u\|_2 / \sqrt{N}`:

    .. math::

        r = \begin{cases}
            1 / \max\!\left(1, \mathrm{RMS}(u) / d\right) & \text{rule "clip"} \\
            d / \mathrm{RMS}(u) & \text{rule "match"}
        \end{cases}, \qquad
        w \leftarrow w_{old} + r\,\Delta,

    with :math:`d` = ``rms`` (by default 1.0 for ``"clip"``, 0.2 for ``"match"``) and
    :math:`r = 1` where :math:`\mathrm{RMS}(u) = 0` (a zero
    update, a step GradScaler skipped). ``"clip"`` with ``rms=1.0`` is Adafactor's update
    clipping (section 6: :math:`\hat U_t = U_t / \max(1, \mathrm{RMS}(U_t) / d)`, applied
    before the learning rate, as :math:`u` is here). ``"match"`` with ``rms=0.2`` gives every
    update the RMS of AdamW's, Moonlight's aim: its rule
    :math:`W \leftarrow W - lr\,(0.2\sqrt{\max(A, B)}\,O + \lambda W)` scales Muon's
    orthogonalized :math:`O` of shape :math:`A \times B` by a factor whose result has RMS
    exactly 0.2 where :math:`O` is exactly semi-orthogonal (:math:`\|O\|_F^2 = \min(A, B)`).
    Newton-Schulz only approximates that, so Moonlight's update has an RMS near 0.2 and
    ``"match"`` exactly 0.2; for Moonlight's factor itself use pytorch-optimizer's
    ``Muon(use_adjusted_lr=True)`` or torch's ``Muon(adjust_lr_fn="match_rms_adamw")``.

    Weight decay: :math:`u` is the whole step direction, so an optimizer's decoupled weight
    decay (AdamW's, Muon's :math:`\lambda W`) is rescaled with it, and an L2 term in the
    gradient (Adam's, SGD's) is part of the moments anyway. In Adafactor and Moonlight the
    decay sits outside the rescaled update; the difference is :math:`(1 - r)\,lr\,\lambda W`
    per step. StableAdamW (Wortsman et al. 2023, arXiv:2304.13013) clips a different
    quantity, :math:`\sqrt{\operatorname{mean}(g^2 / \hat v)}` of the gradient against the
    second moment, not the update's RMS; it is not this rule.

    The RMS is that of the whole tensor: DTensor parameters (FSDP2, HSDP) take the norm of the
    full update, one all-reduce per set of process groups for all of them, and its full
    number of values. Float16/bfloat16 parameters are refused, as in
    :class:`~normhooks.TrustRatio` (the optimizer has rounded a small update away before the
    hook reads it). Param groups can opt out (``"update": False``) or override ``rule`` and
    ``rms`` with ``"update_rule"`` and ``"update_rms"`` (a Muon whose AdamW groups are left
    alone, for instance). The factors of the last step are in :attr:`last_ratios`. Closures
    and :class:`torch.amp.GradScaler` work as for every hook on the updates. One UpdateRMS
    per optimizer.

    Args:
        rule: ``"clip"`` (cap the RMS at ``rms``) or ``"match"`` (set it to ``rms``).
        rms: the cap :math:`d` or the target, positive; None takes the rule's paper's value:
            1.0 for ``"clip"`` (Adafactor's), 0.2 for ``"match"`` (Moonlight's).
        foreach: True or None take multi-tensor ops, False one tensor at a time.

    References:
        Shazeer and Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost,
        arXiv:1804.04235 (2018), section 6. Liu et al., Muon is Scalable for LLM Training,
        arXiv:2502.16982 (2025), section 2.2.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> hook = UpdateRMS("match")  # RMS 0.2, Moonlight's
        >>> handle = hook.attach(optimizer)
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> optimizer.step()
        >>> [tuple(r.shape) for r in hook.last_ratios]  # weight and bias
        [(2,)]
        >>> handle.remove()
    """

    prefix = "update"
    technique = "UpdateRMS"
    rewrites = "updates"
    full_shapes = True
    _unit_ = staticmethod(update_rms_unit_)

    def __init__(
        self, rule: Rule = "clip", rms: float | None = None, *, foreach: bool | None = None
    ) -> None:
        super().__init__(rule=rule, rms=rms, foreach=foreach)

    def _check_group(self, group: Mapping[str, Any], settings: UpdateRMSSettings) -> str | None:
        self._check_update_group(group)
        return None

    @classmethod
    def _check_param(cls, param: Tensor, where: str) -> None:
        cls._check_update_dtype(param, where)

    @property
    def last_ratios(self) -> list[Tensor]:
        """The factors :math:`r` of the last step: one 1-D tensor per param group (empty where
        the group opts out or has no gradient), on the parameters' device."""
        return self._last_values
