"""A step hook's pre-step: the closure, the gradients bound at this step, the technique run.

A gradient hook rewrites the gradients here (under GradScaler's fused protocol, from their
unscaled values); an update hook keeps the old values for its post-step
(:mod:`normhooks._step_hook.updates`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._step_hook.amp import _unscaled_, _written_, unscale_skipped_
from normhooks._step_hook.attach import hooks_on, refuse_one_inside
from normhooks._step_hook.checks import check_dense_grad, check_foreach
from normhooks._step_hook.closure import _SingleUseClosure, _take_closure
from normhooks._step_hook.plan import Planning, _GroupPlan
from normhooks._step_hook.settings import Lr, Settings
from normhooks._step_hook.units import _bind, _Bound, _in_order, _reduce_norms_, _units
from normhooks._step_hook.updates import UpdateRun


class Running(Planning, UpdateRun):
    """The hook's run at each step."""

    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        name = type(self).__name__
        if "grad_scaler" in kwargs:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step received a grad_scaler argument (the "
                f"deprecated GradScaler protocol); {name} cannot tell whether those "
                "gradients are scaled. Use an optimizer without a grad_scaler parameter"
            )
        scaling = compat.fused_grad_scaling(optimizer)
        try:
            return self._checked_pre_step(optimizer, args, kwargs, scaling)
        except BaseException:
            if scaling is not None:
                scaling.discard()
            raise

    def _checked_pre_step(
        self,
        optimizer: torch.optim.Optimizer,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        scaling: compat.FusedGradScaling | None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # Everything that does not depend on the gradients is checked before the closure runs,
        # for every hook on this optimizer, so a bad param group leaves the model untouched
        # whichever hook it concerns (hooks run one after the other).
        if not torch.compiler.is_compiling():
            refuse_one_inside(self, optimizer)
            for _, hook in hooks_on(optimizer):
                if hook is not self:
                    cast(Planning, hook)._plan(optimizer)
        closure, args, kwargs = _take_closure(args, kwargs)
        # A steady step (no closure, every unit as recorded at the last step) is planned and
        # bound by its records; any other takes the long way, and records its units.
        steady = None if closure is not None else self._steady_plan(optimizer)
        loss = None
        if steady is not None:
            plan, bound = steady
            if scaling is None and self.replays:
                with torch.no_grad():
                    replayed = _replayed(plan, bound)
                if replayed is not None:
                    self._last_values = replayed
                    return None
        else:
            plan = self._plan(optimizer)
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            bound = []
            for group_plan in plan:
                units = [_bind(unit, group_plan.where, self.technique) for unit in group_plan.units]
                bound.append([b for b in units if b is not None])
            if closure is None:
                self._record(plan, bound)
        with torch.no_grad():
            if self.rewrites == "gradients":
                self._rewrite_gradients_(optimizer, plan, bound, scaling)
            else:
                self._keep_old_values(optimizer, plan, bound)
        if closure is None:
            return None
        watched = (
            []
            if torch.compiler.is_compiling()
            else [
                p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
            ]
        )
        kwargs["closure"] = _SingleUseClosure(loss, optimizer, type(self).__name__, watched)
        return args, kwargs

    def _rewrite_gradients_(
        self,
        optimizer: torch.optim.Optimizer,
        plan: Sequence[_GroupPlan],
        bound: Sequence[Sequence[_Bound]],
        scaling: compat.FusedGradScaling | None,
    ) -> None:
        jobs = [(group_plan.settings, group_plan.group.get("lr")) for group_plan in plan]
        self._last_values = self._run_gradients_(jobs, bound, scaling, self._foreach)
        if scaling is not None:
            skipped = [
                p
                for group_plan in plan
                if group_plan.settings is None
                for p in group_plan.group["params"]
                if p.grad is not None
            ]
            unscale_skipped_(skipped, scaling, self._foreach)
            scaling.mark_unscaled()

    @classmethod
    def _run_gradients_(
        cls,
        jobs: Sequence[tuple[Settings | None, Lr]],
        bound: Sequence[Sequence[_Bound]],
        scaling: compat.FusedGradScaling | None,
        foreach: bool | None,
    ) -> list[Tensor]:
        """The technique on every unit's gradients; each group's values, in order.

        Under the fused AMP protocol a unit function that does not take scaled gradients gets
        them unscaled (float16/bfloat16 ones as float32 copies, written back rounded once),
        and what it read and wrote is checked for inf/NaN.
        """
        flat = [b for of_group in bound for b in of_group]
        flags: dict[torch.device, Tensor] = {}

        def flag_of(b: _Bound) -> Tensor:
            device = b.grads[0].device
            if device not in flags:
                flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            return flags[device]

        handled = scaling is not None and not cls.scaled_gradients
        if scaling is not None and handled:
            for b in flat:
                b.sources = _unscaled_(b.grads, scaling.scale, flag_of(b), foreach)
        if cls.whole_norms:
            sharded = {i: (b.params, b.sources) for i, b in enumerate(flat) if b.unit.reduce}
            _reduce_norms_(flat, sharded, foreach)
        results: list[Tensor] = []
        for (settings, lr), of_group in zip(jobs, bound, strict=True):
            per_unit = []
            for b in of_group:
                # The record stands for the tensors the unit function gets, not for copies.
                extra: dict[str, Any] = {"steady": b.steady if b.sources is b.grads else None}
                if scaling is not None and cls.scaled_gradients:
                    extra |= {"grad_scale": scaling.scale, "found_inf": flag_of(b)}
                values = cls._unit_(
                    b.params, b.sources, settings, lr, norms=b.norms, foreach=foreach, **extra
                )
                if cls.replays and extra["steady"] is not None:
                    # Under GradScaler too: what the kernels left for unscaled gradients, or
                    # None, is this call's, never one of an earlier step's.
                    extra["steady"].keep_replay(settings, lr)
                if handled:
                    _written_(b.grads, b.sources, flag_of(b), foreach)
                if values is not None:
                    per_unit.append((b.positions, values))
            results.append(_in_order(per_unit) if per_unit else torch.empty(0))
        if scaling is not None and scaling.found_inf is not None:
            found_inf = scaling.found_inf
            # A max, never a sum: fused steps test found_inf == 1 and subtract it from step
            # counts.
            for flag in flags.values():
                found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
        return results

    @classmethod
    def _apply_to_parameters_(
        cls, parameters: Tensor | Iterable[Tensor], settings: Settings, foreach: bool | None
    ) -> Tensor | None:
        """The functional form of a hook on the gradients: the technique on every ``.grad``.

        Parameters without a gradient are skipped; the values come back in parameter order.
        """
        if isinstance(parameters, Tensor):
            parameters = [parameters]
        elif not isinstance(parameters, Iterable):
            raise TypeError(
                "parameters must be a tensor or an iterable of tensors, "
                f"got {type(parameters).__name__}"
            )
        check_foreach(foreach)
        given = list(parameters)

        def where(position: int) -> str:
            return f"parameters[{position}]"

        cls._check_params(given, range(len(given)), where)
        positions, with_grad = [], []
        for position, param in enumerate(given):
            if param.grad is not None:
                check_dense_grad(param.grad, where(position), cls.technique)
                positions.append(position)
                with_grad.append(param)
        seen: dict[int, int] = {}
        for position, param in zip(positions, with_grad, strict=True):
            first = seen.setdefault(id(param), position)
            if first != position:
                raise ValueError(
                    f"{where(position)} is the same tensor as {where(first)}; {cls.technique} "
                    "would be applied to it twice"
                )
        units = _units(with_grad, positions, where, cls.technique)
        bound = [b for b in (_bind(unit, where, cls.technique) for unit in units) if b is not None]
        with torch.no_grad():
            (values,) = cls._run_gradients_([(settings, None)], [bound], None, foreach)
        return values


def _replayed(plan: Sequence[_GroupPlan], bound: Sequence[Sequence[_Bound]]) -> list[Tensor] | None:
    """Each group's values where every bound unit's record holds a replay of its unit
    function for this step (``Steady.replay_for``), all of them then replayed in order; None,
    with nothing run, where any unit has none (the step takes the unit functions)."""
    replays = []
    for group_plan, of_group in zip(plan, bound, strict=True):
        lr = group_plan.group.get("lr")
        found = []
        for b in of_group:
            replay = None if b.steady is None else b.steady.replay_for(group_plan.settings, lr)
            if replay is None:
                return None
            found.append((b.positions, replay))
        replays.append((lr, found))
    results = []
    for lr, found in replays:
        per_unit = []
        for positions, replay in found:
            values = replay(lr)
            if values is not None:
                per_unit.append((positions, values))
        results.append(_in_order(per_unit) if per_unit else torch.empty(0))
    return results
