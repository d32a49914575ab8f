"""The plan kept between steps: what is checked and grouped once per state of the param groups.

Validation, settings and overrides, and the grouping into units do not change from step to
step: they are planned once and reused while the rule of :class:`_GroupPlan` holds (the
groups and their entries by identity, each parameter's identity, address and dtype), the one
statement of what makes a kept plan valid. It reads no tensor value. Under ``torch.compile``
nothing is kept: everything is planned afresh.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, cast

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._step_hook.checks import (
    all_plain,
    check_not_flattened,
    check_param,
    check_rows_are_local,
)
from normhooks._step_hook.core import HookCore
from normhooks._step_hook.settings import Settings
from normhooks._step_hook.steady import _ADDRESS
from normhooks._step_hook.units import FAILED, _Bound, _Unit, _units, record, steady_bind

_DTYPE = operator.attrgetter("dtype")


@dataclass
class _GroupPlan:
    """One param group as planned: what it was then, and its settings and units.

    What makes a kept plan valid, the one rule (checked at each step by :meth:`holds`, and by
    :meth:`Planning._plan` for the list of groups, before anything of it is used):

    - ``optimizer.param_groups`` has as many groups as planned, each the same dict object;
    - the group's entries other than ``params`` and ``lr`` are the objects planned, compared
      by identity (equality would read a tensor lr back to the host): a setting edited, a key
      added or removed is a change;
    - ``lr``, which schedulers set anew at every step, is read at each step where it is used;
      where it is another object than the one last checked, the technique's check of the
      group (``lr_check``, the plan's own ``_check_group``) runs again on it and raises for an
      lr the technique refuses; the group having an ``lr`` or not is a change;
    - for a group that takes part: its params are the tensor objects planned, in order, and
      each has the address and dtype recorded. A ``.data =`` that moves a parameter (to
      another device too), converts it or swaps its storage, and ``torch.utils.swap_tensors``,
      change one of them.

    Nothing else of a parameter is kept here (its shape is read where it is used), and nothing
    of a gradient: whether each parameter has one at this step, and a dense one, is read at
    every step (:func:`~normhooks._step_hook.units._bind`), or proved by the unit's record of
    the last step where that holds (:class:`~normhooks._step_hook.steady.Steady`, which then
    stands for the parameters' addresses and dtypes too: :meth:`steady_bound`). It reads no
    tensor value. ``addresses`` is None where the group cannot be fingerprinted (tensor
    subclasses other than plain tensors): it is then planned again at every step.

    Each part of the rule is one C-level pass (``map`` over the kept tuples), so that a step
    whose plan holds costs a few passes over the parameters and no Python per parameter.
    """

    group: Mapping[str, Any]
    params: list[Any]
    items: dict[str, object]
    settings: Settings | None
    units: list[_Unit]
    where: Callable[[int], str]
    addresses: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    lr_check: Callable[[Mapping[str, Any]], None] | None = None
    _size: int = field(init=False, repr=False)
    _keys: tuple[str, ...] = field(init=False, repr=False)
    _values: tuple[object, ...] = field(init=False, repr=False)
    _lr: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._size = len(self.group)
        self._keys = tuple(self.items)
        self._values = tuple(self.items.values())
        self._lr = self.group.get("lr", _MISSING)

    def holds(self, group: Mapping[str, Any]) -> bool:
        """Whether ``group`` is still what was planned (the rule above; no tensor value is
        read)."""
        if not self.entries_hold(group):
            return False
        return self.settings is None or self.same_params(group["params"])

    def entries_hold(self, group: Mapping[str, Any]) -> bool:
        """Whether ``group`` is the dict planned with the entries planned (the rule's first
        three parts), after checking a new ``lr``."""
        if group is not self.group or len(group) != self._size:
            return False
        found = map(group.get, self._keys, repeat(_MISSING))
        if not all(map(operator.is_, found, self._values)):
            return False
        lr = group.get("lr", _MISSING)
        if lr is not self._lr:
            if lr is _MISSING or self._lr is _MISSING:
                return False
            if self.lr_check is not None:
                self.lr_check(group)
            self._lr = lr
        return True

    def steady_bound(self, group: Mapping[str, Any]) -> list[_Bound] | None:
        """The group's units bound at this step where the plan holds by the records of its
        units (:class:`~normhooks._step_hook.steady.Steady`) and each of them holds; None
        where anything must be checked the long way.

        The group and its entries are compared as in :meth:`holds` and the parameters by
        identity; a unit's record then stands for the addresses and dtypes of the rule above
        (it was made where they held) and for the binding's checks of the gradients.
        """
        if not self.entries_hold(group):
            return None
        if self.settings is None:
            return []
        params, kept = group["params"], self.params
        if len(params) != len(kept) or not all(map(operator.is_, params, kept)):
            return None
        bound = []
        for unit in self.units:
            b = steady_bind(unit)
            if b is FAILED:
                return None
            if b is not None:
                bound.append(cast(_Bound, b))
        return bound

    def same_params(self, params: Sequence[Any]) -> bool:
        """Whether ``params`` are the planned parameters, with their addresses and dtypes."""
        kept = self.params
        return (
            self.addresses is not None
            and len(params) == len(kept)
            and all(map(operator.is_, params, kept))
            and tuple(map(_ADDRESS, params)) == self.addresses
            and tuple(map(_DTYPE, params)) == self.dtypes
        )


# What a group's entry is when it has none: nothing a group can hold.
_MISSING = object()


def _items(group: Mapping[str, Any]) -> dict[str, object]:
    """The entries a plan compares by identity: all but the parameters and the lr."""
    return {key: value for key, value in group.items() if key not in ("params", "lr")}


def _fingerprint(params: Sequence[Tensor]) -> tuple[tuple[int, ...], tuple[torch.dtype, ...]]:
    """Each parameter's address and dtype: a ``.data =`` that moves it, converts it or swaps
    its storage changes one of them."""
    return tuple(map(_ADDRESS, params)), tuple(map(_DTYPE, params))


def _namer(group_index: int) -> Callable[[int], str]:
    return lambda position: f"parameter {position} of param group {group_index}"


class Planning(HookCore):
    """The hook's planning: each optimizer's group plans, checked again where they changed."""

    def __init__(self, *, foreach: bool | None = None, **settings: object) -> None:
        super().__init__(foreach=foreach, **settings)
        self._plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_GroupPlan]] = (
            weakref.WeakKeyDictionary()
        )
        # The param groups warned about, per optimizer: each warning is given once.
        self._warned: weakref.WeakKeyDictionary[torch.optim.Optimizer, set[int]] = (
            weakref.WeakKeyDictionary()
        )

    def _plan(self, optimizer: torch.optim.Optimizer) -> list[_GroupPlan]:
        """Every param group as planned, after checking what changed since the last plan.

        Under ``torch.compile`` everything is planned afresh: the fingerprint reads tensor
        addresses, which a trace cannot.
        """
        groups = optimizer.param_groups
        if torch.compiler.is_compiling():
            return self._new_plan(optimizer, groups, [])
        old = self._plans.get(optimizer)
        if old is not None and len(old) == len(groups) and all(map(_GroupPlan.holds, old, groups)):
            return old
        plan = self._new_plan(optimizer, groups, old or [])
        self._plans[optimizer] = plan
        return plan

    def _steady_plan(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[_GroupPlan], list[list[_Bound]]] | None:
        """The plan and every group's units bound at this step, where every unit's record
        holds (:meth:`_GroupPlan.steady_bound`); None where the step takes the long way
        (:meth:`_plan`, then the binding). Never under a trace, a transform or a mode."""
        old = self._plans.get(optimizer)
        groups = optimizer.param_groups
        if old is None or len(old) != len(groups) or not compat.plain_eager():
            return None
        bound = []
        for group_plan, group in zip(old, groups, strict=True):
            found = group_plan.steady_bound(group)
            if found is None:
                return None
            bound.append(found)
        return old, bound

    @staticmethod
    def _record(plan: Sequence[_GroupPlan], bound: Sequence[Sequence[_Bound]]) -> None:
        """Records the units of ``plan``, found holding at this step with their fingerprint,
        for the next step (:func:`~normhooks._step_hook.units.record`)."""
        if not compat.plain_eager():
            return
        for group_plan, of_group in zip(plan, bound, strict=True):
            if group_plan.addresses is not None:
                by_unit = {id(b.unit): b for b in of_group}
                for unit in group_plan.units:
                    record(unit, by_unit.get(id(unit)))

    def _new_plan(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[Mapping[str, Any]],
        old: Sequence[_GroupPlan],
    ) -> list[_GroupPlan]:
        """Plans every group (reusing the units of groups whose parameters did not change),
        checks that no parameter is in two groups that take part, and changes nothing."""
        plans = []
        for index, group in enumerate(groups):
            settings = self._group_settings(optimizer, group, index)
            previous = old[index] if index < len(old) else None
            plans.append(self._plan_group(group, index, settings, previous))
        seen: dict[int, tuple[int, int]] = {}
        for index, plan in enumerate(plans):
            if plan.settings is None:
                continue
            for position, param in enumerate(plan.params):
                first = seen.setdefault(id(param), (index, position))
                if first != (index, position):
                    # torch's add_param_group refuses this, but param_groups can be edited.
                    raise ValueError(
                        f"parameter {position} of param group {index} is the same tensor as "
                        f"parameter {first[1]} of param group {first[0]}; {self.technique} "
                        "would be applied to it twice"
                    )
        return plans

    def _plan_group(
        self,
        group: Mapping[str, Any],
        index: int,
        settings: Settings | None,
        previous: _GroupPlan | None,
    ) -> _GroupPlan:
        params = list(group["params"])
        where = _namer(index)
        if settings is None:
            return _GroupPlan(group, params, _items(group), None, [], where)
        if previous is not None and previous.settings is not None and previous.same_params(params):
            return _GroupPlan(
                group,
                params,
                _items(group),
                settings,
                previous.units,
                where,
                previous.addresses,
                previous.dtypes,
                self._lr_check(index, settings),
            )
        positions = range(len(params))
        self._check_params(params, positions, where)
        units = _units(params, positions, where, self.technique)
        addresses = dtypes = None
        # A trace cannot read addresses; and under it nothing is kept from one step to the next.
        if not torch.compiler.is_compiling() and all_plain(params):
            addresses, dtypes = _fingerprint(params)
        return _GroupPlan(
            group,
            params,
            _items(group),
            settings,
            units,
            where,
            addresses,
            dtypes,
            self._lr_check(index, settings),
        )

    def _lr_check(self, index: int, settings: Settings) -> Callable[[Mapping[str, Any]], None]:
        """The technique's check of group ``index`` (``_check_group``), for a plan to run on a
        new lr; it raises as planning does (its warning was given when the group was
        planned)."""

        def check(group: Mapping[str, Any]) -> None:
            try:
                self._check_group(group, settings)
            except (TypeError, ValueError) as error:
                raise type(error)(f"param group {index}: {error}") from None

        return check

    @classmethod
    def _check_params(
        cls, params: Sequence[object], positions: Iterable[int], where: Callable[[int], str]
    ) -> None:
        foreign = compat.fsdp1_possible() or compat.deepspeed_possible()
        for position, param in zip(positions, params, strict=True):
            tensor = check_param(param, where(position), cls.technique)
            if foreign and compat.may_carry_marks(tensor):
                check_not_flattened(tensor, where(position), cls.technique)
            if cls.row_wise:
                check_rows_are_local(tensor, where(position), cls.technique, cls.prefix)
            cls._check_param(tensor, where(position))

    def _group_settings(
        self, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], index: int
    ) -> Settings | None:
        prefix = self.prefix
        enabled = group.get(prefix, True)
        if not isinstance(enabled, bool):
            raise TypeError(
                f'param group {index}: "{prefix}" must be a bool, got "{prefix}"={enabled!r}'
            )
        names = {self._key(name): name for name in self._settings_class._names()}
        overrides = {}
        for key, value in group.items():
            if key.startswith(prefix + "_"):
                if key not in names:
                    raise ValueError(
                        f"param group {index}: unknown key '{key}'; expected one of "
                        + ", ".join(f"'{k}'" for k in names)
                    )
                overrides[names[key]] = value
        if not enabled:
            return None
        settings: Settings = self._as_settings()
        try:
            if overrides:
                merged = {name: getattr(self, name) for name in self._settings_class._names()}
                settings = self._settings_class._checked(merged | overrides, self._key)
            warning = self._check_group(group, settings)
        except (TypeError, ValueError) as error:
            raise type(error)(f"param group {index}: {error}") from None
        if warning is not None:
            warned = self._warned.setdefault(optimizer, set())
            if index not in warned:
                warned.add(index)
                warnings.warn(f"param group {index}: {warning}", UserWarning, stacklevel=5)
        return settings
