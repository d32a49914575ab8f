"""Registering and removing one parametrization, each undone exactly where a conversion fails.

``register`` and the removals wrap torch's, so that a deep copy's class is never touched,
and tell the optimizer watch what a conversion added and what a removal takes away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normhooks import _torch_compat
from normhooks._parametrize import optimizer_watch as _optimizer_watch
from normhooks._parametrize.layers import original, originals
from normhooks._torch_compat import own_parameters

Undo = Callable[[], None]
Step = Callable[[], Undo]

Companions = dict[str, nn.Parameter]

# --- registration ---------------------------------------------------------------------------


def register_parametrization(module: nn.Module, name: str, parametrization: nn.Module) -> None:
    """torch's ``register_parametrization``, without touching a deep copy's original.

    A new parametrized name adds a property to the module's class, which a deep copy shares
    with the module it was copied from (see ``_torch_compat.own_parametrized_class``).
    """
    if parametrize.is_parametrized(module) and not parametrize.is_parametrized(module, name):
        _torch_compat.own_parametrized_class(module)
    parametrize.register_parametrization(module, name, parametrization)


def remove_parametrizations(module: nn.Module, name: str, *, leave_parametrized: bool) -> None:
    """torch's ``remove_parametrizations``, without breaking the module a deep copy was made
    from (or the copies made from it): removal deletes a property of the shared class.

    The conversions that added the Parameters removed here are no longer watched for.
    """
    if parametrize.is_parametrized(module, name):
        _optimizer_watch.forget(list(originals(module, name).parameters()))
        _torch_compat.own_parametrized_class(module)
    parametrize.remove_parametrizations(module, name, leave_parametrized=leave_parametrized)


def remove_outermost(module: nn.Module, name: str) -> None:
    """Removes the outermost of several parametrizations of ``module.<name>``."""
    chain = originals(module, name)
    _optimizer_watch.forget(list(chain[-1].parameters()))
    del chain[-1]


def bake_into(module: nn.Module, name: str, into: str) -> None:
    """Leaves ``module.<name>`` a plain Parameter holding its current value: the Parameter
    object of the original ``into``, overwritten in place (so with its own memory layout,
    whatever layout the computed weight had), so an optimizer that holds it keeps working."""
    keep = original(module, name, into)
    with torch.no_grad():
        value = getattr(module, name).clone()
    single = into == "original"
    # torch can restore the original of a parametrization of one tensor; one of several it
    # can only leave as a new Parameter, which ``keep`` then replaces.
    remove_parametrizations(module, name, leave_parametrized=not single)
    if not single:
        delattr(module, name)
        module.register_parameter(name, keep)
    with torch.no_grad():
        keep.copy_(value)


def _behind(module: nn.Module, name: str) -> list[Tensor]:
    """The Parameters that ``module.<name>`` is computed from: itself, or the originals of its
    parametrizations and their own Parameters."""
    if parametrize.is_parametrized(module, name):
        return list(originals(module, name).parameters())
    found = own_parameters(module).get(name)
    return [] if found is None else [found]


def register(
    module: nn.Module, name: str, parametrization: nn.Module, what: str, *, watch: bool = True
) -> Undo:
    """Registers ``parametrization`` on ``module.<name>``; returns what undoes it exactly.

    The undo puts back the very Parameter object that was there (and its values), so a
    conversion that fails half way leaves optimizers and tied modules as they were. With
    ``watch``, an optimizer that holds the Parameters ``module.<name>`` had but not those the
    registration added (a gain, new originals) raises at its step: it was built before.
    """
    stacked = parametrize.is_parametrized(module, name)
    order = list(own_parameters(module))
    before = own_parameters(module).get(name)
    held = _behind(module, name)
    register_parametrization(module, name, parametrization)
    forget = None
    if watch:
        now = _behind(module, name)
        held_ids, now_ids = {id(t) for t in held}, {id(t) for t in now}
        added = [t for t in now if id(t) not in held_ids]
        retired = [t for t in held if id(t) not in now_ids]
        forget = _optimizer_watch.watch(module, name, what, held, added, retired)

    def undo() -> None:
        if forget is not None:
            forget()
        if stacked:
            remove_outermost(module, name)
            return
        if hasattr(originals(module, name), "original"):
            remove_parametrizations(module, name, leave_parametrized=False)
        else:
            remove_parametrizations(module, name, leave_parametrized=True)
            delattr(module, name)
            module.register_parameter(name, before)
        _reorder(module, order)

    return undo


def _reorder(module: nn.Module, order: list[str]) -> None:
    """Registers ``module``'s own Parameters again in ``order``, their order before a
    registration: torch's removal registers the restored one last, which would change the
    order of ``model.parameters()`` (and of an optimizer's state built from it)."""
    found = own_parameters(module)
    if list(found) == order:
        return
    for key in order:
        if key in found:
            delattr(module, key)
            module.register_parameter(key, found[key])


def apply_all(steps: Sequence[Step]) -> None:
    """Runs every step, or none: if one raises, the ones before it are undone, last first.

    Callers validate the whole tree before building ``steps``; this is the guarantee for
    what validation cannot foresee (an error inside torch, a KeyboardInterrupt).
    """
    undos: list[Undo] = []
    try:
        for step in steps:
            undos.append(step())
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise


def materialized(placeholder: nn.Parameter, value: Tensor) -> nn.Parameter:
    """``placeholder``, the same Parameter object, now holding a copy of ``value``.

    Materializing in place is what keeps an optimizer that already holds it working, as
    torch's lazy modules do with their own weights.
    """
    with torch.no_grad():
        if isinstance(placeholder, nn.UninitializedParameter):
            placeholder.materialize(value.shape, device=value.device, dtype=value.dtype)
        else:  # materialized by an earlier registration that failed after it
            placeholder.data = torch.empty_like(value)
        placeholder.copy_(value)
    return placeholder
