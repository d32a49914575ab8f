"""An update hook's run: the old values kept during the step, and the post-step.

A hook that rewrites the updates (the trust ratio) copies every parameter that takes part
before the optimizer's step and, after it, rescales each parameter's change from the revert
``w_old - w_new``, with the norms of the old values and of the revert.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._step_hook.checks import all_plain
from normhooks._step_hook.copies import _Copies, _fresh_copies
from normhooks._step_hook.core import HookCore
from normhooks._step_hook.norms import euclidean_norms
from normhooks._step_hook.plan import _GroupPlan
from normhooks._step_hook.settings import Lr, Settings
from normhooks._step_hook.units import _Bound, _full_shapes, _in_order, sum_over_shards


class OldNorms(NamedTuple):
    """What a pre-step took with a unit's copy for its post-step: on the CPU, the old values'
    norms (``kernel`` False); from a kernel, each tensor's sum of squares, on its device."""

    kernel: bool
    values: Tensor


@dataclass
class _UpdateInFlight:
    """What an update hook's pre-step keeps for its post-step: each group's units at this
    step (their ``sources`` the old values), each group's settings and lr, and what each
    unit's copy gave (:meth:`UpdateRun._copy_in`), in the order of ``bound`` flattened."""

    bound: Sequence[Sequence[_Bound]]
    jobs: list[tuple[Settings | None, Lr]]
    held: list[_Copies]
    old_norms: list[OldNorms | None] = field(default_factory=list)


def in_rows_order(b: _Bound) -> bool:
    """Whether unit ``b`` takes the CPU order of :class:`~normhooks._step_hook.copies._Rows`
    over its copies' views: local float32 CPU tensors of plain types in eager code (float64
    ones keep float64 norms, the rest the base's order). The views, contiguous and plain as
    :class:`~normhooks._step_hook.copies._Copies` makes them, need no check."""
    first = b.params[0]
    return (
        not b.unit.reduce
        and first.is_cpu
        and first.dtype == torch.float32
        and compat.plain_eager()
        and all_plain(b.params)
    )


class UpdateRun(HookCore):
    """An update hook's pre-step copies and post-step."""

    def __init__(self, *, foreach: bool | None = None, **settings: object) -> None:
        super().__init__(foreach=foreach, **settings)
        self._pending: weakref.WeakKeyDictionary[torch.optim.Optimizer, _UpdateInFlight] = (
            weakref.WeakKeyDictionary()
        )

    def _keep_old_values(
        self,
        optimizer: torch.optim.Optimizer,
        plan: Sequence[_GroupPlan],
        bound: Sequence[Sequence[_Bound]],
    ) -> None:
        """An update hook's pre-step: the old value of every parameter that takes part, in its
        unit's buffer."""
        held = []
        old_norms: list[OldNorms | None] = []
        compiling = torch.compiler.is_compiling()
        for of_group in bound:
            for b in of_group:
                if compiling:
                    # Nothing outlives a trace, and it cannot read a storage's size.
                    b.sources = _fresh_copies(b.params, self._foreach)
                    old_norms.append(None)
                    continue
                copies = b.unit.copies
                if copies is None or not copies.fits(b.params, b.steady):
                    copies = b.unit.copies = _Copies(b.params)
                b.sources, norms = self._copy_in(b, copies)
                old_norms.append(norms)
                held.append(copies)
        jobs = [(group_plan.settings, group_plan.group.get("lr")) for group_plan in plan]
        self._pending[optimizer] = _UpdateInFlight(bound, jobs, held, old_norms)

    def _copy_in(self, b: _Bound, copies: _Copies) -> tuple[list[Tensor], OldNorms | None]:
        """Unit ``b``'s parameters copied into ``copies``: the views holding them, and what
        the copy gave for the post-step (nothing here; a hook may take norms on the way)."""
        return copies.hold(b.params, self._foreach), None

    def _finish_units(self, pending: _UpdateInFlight, flat: list[_Bound]) -> dict[int, Tensor]:
        """Units ``flat[i]`` a hook finishes itself (their values by ``i``), or whose norms it
        sets, before the base takes the rest: none here."""
        return {}

    def _after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """An update hook's post-step: the units a hook finishes itself, then every other
        unit's norms (the old parameters', then the revert's), one all-reduce for all the
        sharded units, then the technique."""
        pending = self._pending.pop(optimizer, None)
        if pending is None:
            return
        flat = [b for of_group in pending.bound for b in of_group]
        foreach = self._foreach
        with torch.no_grad():
            done = self._finish_units(pending, flat)
            squares = {}
            for i, b in enumerate(flat):
                if i in done or b.norms is not None:
                    continue
                olds = b.sources
                w_norm = euclidean_norms(olds, foreach)
                if foreach is False:
                    for old, param in zip(olds, b.params, strict=True):
                        old.sub_(param)
                else:
                    compat.foreach_sub_(olds, b.params)
                b.norms = (w_norm, euclidean_norms(olds, foreach))
                if b.unit.reduce:
                    squares[i] = torch.cat(b.norms).square()
            for i, total in sum_over_shards(flat, squares).items():
                w_norm, d_norm = total.sqrt().chunk(2)
                flat[i].norms = (w_norm, d_norm)
            self._rescale_updates(pending, done)

    def _rescale_updates(self, pending: _UpdateInFlight, done: Mapping[int, Tensor]) -> None:
        """The technique on every unit not ``done`` (whose norms are set), the values of all
        kept per group (as ``last_*``), and the old values' copies released for the next
        step."""
        foreach = self._foreach
        results = []
        index = 0
        for (settings, lr), of_group in zip(pending.jobs, pending.bound, strict=True):
            per_unit = []
            for b in of_group:
                values = done.get(index)
                index += 1
                if values is None:
                    extra = {"shapes": _full_shapes(b)} if self.full_shapes else {}
                    values = type(self)._unit_(
                        b.params, b.sources, settings, lr, norms=b.norms, foreach=foreach, **extra
                    )
                if values is not None:
                    per_unit.append((b.positions, values))
            results.append(_in_order(per_unit) if per_unit else torch.empty(0))
        self._last_values = results
        for copies in pending.held:
            copies.release()

    @classmethod
    def _check_update_group(cls, group: Mapping[str, Any]) -> None:
        """Refuses a group whose lr the update cannot be divided by (the update is read as
        ``w_old - w_new``, the optimizer's step times its lr)."""
        lr = group.get("lr")
        if not isinstance(lr, Tensor) and (
            isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < float("inf")
        ):
            raise ValueError(
                f"{cls.__name__} divides the update by the group's learning rate, which must be "
                f'a non-negative finite number or a tensor, but the group has "lr"={lr!r}'
            )

    @classmethod
    def _check_update_dtype(cls, param: Tensor, where: str) -> None:
        """Refuses a half-precision parameter, whose update the optimizer has already rounded
        away by the time the hook reads it."""
        if param.dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"{where} is {param.dtype}; {cls.__name__} needs float32 or float64 parameters: "
                "the optimizer rounds its update to the parameter's dtype before the hook "
                "reads it, and in half precision that loses most of a small update. Keep "
                "float32 parameters and use torch.autocast, or opt the group out with "
                f'"{cls.prefix}": False'
            )
