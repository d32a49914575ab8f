"""Optimizers built before a conversion that added Parameters, caught at their step.

Weight normalization replaces a layer's weight by new Parameters g and v, and Scaled WS adds
a gain; an optimizer built before the conversion holds neither, and they would never train.
Refusing every conversion of a model whose parameters some optimizer might hold would refuse
the correct uses too (build the model, convert it, then build the optimizer), so the check is
made where the mistake shows: a global optimizer step pre-hook, installed by the first
conversion that adds a Parameter, looks at each optimizer once per shape of its param groups
(and again after each conversion) for a Parameter that a conversion replaced or added to,
without the Parameters it added.

Weight normalization's removal leaves the weight a Parameter other than the one the
conversion replaced (v's, holding the baked weight): an optimizer built before the conversion
would then step a Parameter the model no longer has, and the model would not train. Such an
optimizer is refused too, as long as the Parameter it holds is alive and the layer does not
hold it again.

The hook holds no strong reference (weak references to the tensors, the modules and the
optimizers), never reads a tensor, does nothing under ``torch.compile``, and costs a lookup
and a tuple of group lengths per step when nothing changed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle


class _Conversion:
    """One conversion: the Parameters that held ``module.<name>`` before it and those it added."""

    def __init__(
        self,
        module: nn.Module,
        name: str,
        what: str,
        before: Sequence[Tensor],
        added: Sequence[Tensor],
        retired: Sequence[Tensor],
    ) -> None:
        self.module = weakref.ref(module)
        self.name = name
        self.what = what
        # Once a tensor it names is gone, the conversion can no longer be missed.
        self.before = [weakref.ref(t, self._gone) for t in before]
        self.added = [weakref.ref(t, self._gone) for t in added]
        # Those of ``before`` the module no longer holds: an optimizer that holds one of them
        # was built before the conversion (barring a tie).
        self.retired = {id(t) for t in retired}
        self.keys = [id(t) for t in before]
        self.added_keys = [id(t) for t in added]

    def _gone(self, ref: weakref.ref[Tensor]) -> None:
        _forget(self)


# Conversions by the id of each Parameter they replaced or added to, and by the id of each
# Parameter they added; ids are checked against the live objects (an id is reused once its
# object is gone).
_conversions: dict[int, list[_Conversion]] = {}
_by_added: dict[int, list[_Conversion]] = {}
# Bumped by every conversion recorded, so that every optimizer is looked at again (one that
# was right stays right when a conversion is forgotten).
_generation = 0
# Per optimizer: the (generation, number of groups, their lengths) it was last found right at.
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]] = (
    weakref.WeakKeyDictionary()
)
# Per optimizer: the conversions whose still-live Parameters it was found to hold without
# their additions, which no optimizer looked at so far held either.
_suspected: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_Conversion]] = (
    weakref.WeakKeyDictionary()
)
_hook: RemovableHandle | None = None


def watch(
    module: nn.Module,
    name: str,
    what: str,
    before: Sequence[Tensor],
    added: Sequence[Tensor],
    retired: Sequence[Tensor] = (),
) -> Callable[[], None]:
    """Records a conversion of ``module.<name>`` that added ``added``; returns what forgets it.

    Nothing is recorded when the conversion added nothing an optimizer could miss.
    """
    global _generation, _hook
    if not added or not before:
        return lambda: None
    conversion = _Conversion(module, name, what, before, added, retired)
    for key in conversion.keys:
        _conversions.setdefault(key, []).append(conversion)
    for key in conversion.added_keys:
        _by_added.setdefault(key, []).append(conversion)
    _generation += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check)
    return lambda: _forget(conversion)


class _Removal:
    """A removed conversion that left ``module.<name>`` without the Parameters it replaced."""

    def __init__(self, conversion: _Conversion, retired: Sequence[Tensor]) -> None:
        self.module = conversion.module
        self.name = conversion.name
        self.what = conversion.what
        self.retired = [weakref.ref(t, self._gone) for t in retired]
        self.keys = [id(t) for t in retired]

    def _gone(self, ref: weakref.ref[Tensor]) -> None:
        _drop(self)

    def current(self) -> set[int] | None:
        """The ids of the Parameters ``module.<name>`` is now computed from; None once the
        module is gone."""
        module = self.module()
        if module is None:
            return None
        inside = f"parametrizations.{self.name}."
        return {
            id(p) for n, p in module.named_parameters() if n == self.name or n.startswith(inside)
        }


# Removals by the id of each Parameter their conversion replaced.
_removals: dict[int, list[_Removal]] = {}


def forget(tensors: Sequence[Tensor]) -> None:
    """Forgets the conversions that added any of ``tensors`` (they are being removed); one that
    replaced Parameters is kept as a removal, so an optimizer still holding those is refused."""
    global _generation
    for tensor in tensors:
        for conversion in list(_by_added.get(id(tensor), ())):
            if any(ref() is tensor for ref in conversion.added):
                _forget(conversion)
                retired = [
                    t
                    for ref in conversion.before
                    if (t := ref()) is not None and id(t) in conversion.retired
                ]
                if retired:
                    removal = _Removal(conversion, retired)
                    for key in removal.keys:
                        _removals.setdefault(key, []).append(removal)
                    _generation += 1


def _drop(removal: _Removal) -> None:
    for key in removal.keys:
        found = _removals.get(key, [])
        if removal in found:
            found.remove(removal)
        if not found:
            _removals.pop(key, None)


def _forget(conversion: _Conversion) -> None:
    for index, keys in ((_conversions, conversion.keys), (_by_added, conversion.added_keys)):
        for key in keys:
            found = index.get(key, [])
            if conversion in found:
                found.remove(conversion)
            if not found:
                index.pop(key, None)


def _signature(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    groups = optimizer.param_groups
    return (_generation, len(groups), *[len(group["params"]) for group in groups])


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():
        return
    signature = _signature(optimizer)
    if _checked.get(optimizer) == signature:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if _removals:
        _refuse_removed(optimizer, held)
    missed = _missed(held) if _conversions else []
    if not missed:
        _checked[optimizer] = signature
        _suspected.pop(optimizer, None)
        return
    suspected = _suspected.get(optimizer, [])
    for conversion, before, missing in missed:
        if id(before) in conversion.retired:
            raise ValueError(_message(optimizer, conversion, missing))
        if conversion in suspected:
            raise ValueError(_untrained_message(optimizer, conversion, missing))
    # Each Parameter is still the model's: another optimizer may train the additions (one
    # built for them after the conversion) and not have stepped yet. If none has by this
    # optimizer's next step, this one was built before the conversion and is alone.
    _suspected[optimizer] = [conversion for conversion, _, _ in missed]


def _missed(held: set[int]) -> list[tuple[_Conversion, Tensor, list[Tensor]]]:
    """The conversions whose replaced Parameter is ``held`` while an addition (that requires
    grad) is held neither there nor by any optimizer found right so far, with that Parameter
    and those additions."""
    found = []
    elsewhere: set[int] | None = None
    for key in held & _conversions.keys():
        for conversion in _conversions[key]:
            before = next((t for ref in conversion.before if id(t := ref()) == key), None)
            if before is None:
                continue
            added = [t for ref in conversion.added if (t := ref()) is not None]
            missing = [t for t in added if t.requires_grad and id(t) not in held]
            if missing and elsewhere is None:
                elsewhere = {
                    id(p)
                    for other in list(_checked.keys())
                    for group in other.param_groups
                    for p in group["params"]
                }
            missing = [t for t in missing if elsewhere is None or id(t) not in elsewhere]
            if missing:
                found.append((conversion, before, missing))
    return found


def _refuse_removed(optimizer: torch.optim.Optimizer, held: set[int]) -> None:
    """Raises if ``optimizer`` holds a Parameter that a removed conversion replaced, and none of
    those its layer's tensor is computed from now."""
    for key in held & _removals.keys():
        for removal in list(_removals[key]):
            retired = next((t for ref in removal.retired if id(t := ref()) == key), None)
            current = removal.current()
            if retired is None or current is None or key in current:
                # Gone, or the layer holds it again (a removal undone): nothing is missed.
                _drop(removal)
                continue
            if not current & held:
                raise ValueError(_removed_message(optimizer, removal))


def _layer(module: nn.Module | None) -> str:
    return "a layer" if module is None else type(module).__name__.removeprefix("Parametrized")


def _listed(module: nn.Module | None, tensors: list[Tensor]) -> str:
    layer = _layer(module)
    names = {} if module is None else {id(p): n for n, p in module.named_parameters()}
    return ", ".join(
        f"{layer}.{names[id(t)]}" if id(t) in names else f"a Parameter of shape {list(t.shape)}"
        for t in tensors
    )


def _removed_message(optimizer: torch.optim.Optimizer, removal: _Removal) -> str:
    layer = f"{_layer(removal.module())}.{removal.name}"
    return (
        f"{type(optimizer).__name__} holds the Parameter {layer} had before {removal.what} "
        f"was applied to it, which its removal did not give back: {layer} is now another "
        f"Parameter (the one {removal.what} trained, holding the baked weight), so the "
        "optimizer was built before the conversion and would step a Parameter the model no "
        "longer uses. Build the optimizer after removing it, or give it the model's "
        "parameters again (optimizer.add_param_group, or a new optimizer)"
    )


def _untrained_message(
    optimizer: torch.optim.Optimizer, conversion: _Conversion, missing: list[Tensor]
) -> str:
    module = conversion.module()
    layer = _layer(module)
    return (
        f"{type(optimizer).__name__} holds {layer}.{conversion.name} but not the Parameters "
        f"added when {conversion.what} was applied to it ({_listed(module, missing)}), and "
        "no optimizer has trained those over two steps: they would never train. Either "
        "this optimizer was built before the conversion, or the optimizer meant for them has "
        "not stepped yet (one made after a warm-up): they cannot be told apart. Add them with "
        "optimizer.add_param_group({'params': [...]}) or to an optimizer that steps now; to "
        "train them only later, set their requires_grad=False until their optimizer starts"
    )


def _message(
    optimizer: torch.optim.Optimizer, conversion: _Conversion, missing: list[Tensor]
) -> str:
    module = conversion.module()
    layer = _layer(module)
    listed = _listed(module, missing)
    return (
        f"{type(optimizer).__name__} holds the Parameter {layer}.{conversion.name} had before "
        f"{conversion.what} was applied to it, but not what {conversion.what} added "
        f"({listed}): the optimizer was built before the conversion, and those would never "
        "train. Build the optimizer after converting the model, or add them with "
        "optimizer.add_param_group({'params': [...]}); to leave them out on purpose, set "
        "their requires_grad=False"
    )
