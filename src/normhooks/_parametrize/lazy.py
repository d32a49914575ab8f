"""Lazy deferral: a lazy layer's conversion waits for its first forward.

The Parameters a registration will add (WN's ``g``, Scaled WS's ``gain``) are made at
conversion, uninitialized, in a child of the layer (:class:`_Pending`), so that an optimizer
built before the first forward holds them; a forward pre-hook (:class:`_Deferred`) registers
the parametrization once the layer's weight exists, materializing them in place. Both are
pickled with a pending model: their module path stays ``normhooks._parametrize``.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn
from torch.utils.hooks import RemovableHandle

from normhooks import _torch_compat
from normhooks._parametrize import optimizer_watch as _optimizer_watch
from normhooks._parametrize.layers import describe, is_uninitialized
from normhooks._parametrize.registration import Companions, Undo
from normhooks._torch_compat import own_parameters


class Deferrable(Protocol):
    """What a deferred conversion reads of its :class:`~normhooks._parametrize.spec.Technique`
    (which builds on this module, so it is named by what it offers)."""

    @property
    def marker(self) -> str: ...

    @property
    def label(self) -> str: ...

    def companions(self) -> dict[str, tuple[str, str]]: ...

    def register_materialized(
        self, module: nn.Module, name: str, companions: Companions
    ) -> None: ...


# The child module of a lazy layer that holds, until its first forward, the Parameters that
# a pending registration will add.
_PENDING = "_normhooks_pending"


class _Pending(_torch_compat.StatelessModule):
    """Holds the Parameters that pending registrations will add to a lazy layer, each still an
    ``nn.UninitializedParameter``, so that ``model.parameters()`` yields them and an optimizer
    built before the first forward holds them. State dicts leave it out: a checkpoint of the
    pending model is the lazy model's."""


def _holder(module: nn.Module) -> nn.Module | None:
    found = getattr(module, _PENDING, None)
    return found if isinstance(found, _Pending) else None


class _Deferred:
    """Forward pre-hook that registers a parametrization once a lazy weight is materialized.

    It runs after the lazy module's own pre-hook (hooks run in registration order), which
    has created the weight by then, hands the registration its companions (the placeholder
    Parameters made at conversion, found by name, so copies find their own), and removes
    itself once it has registered. A registration that fails raises from that forward and
    stays pending, so the next forward raises again instead of running the layer without its
    reparametrization.
    """

    def __init__(self, technique: Deferrable, name: str) -> None:
        self.technique = technique
        self.name = name
        self.marker = technique.marker
        self.handle: RemovableHandle | None = None

    def placeholder_names(self) -> list[str]:
        """The names of its placeholders in the module's placeholder holder."""
        return [f"{self.name}_{role}" for role in self.technique.companions()]

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if any(is_uninitialized(p) for p in module.parameters(recurse=False)):
            return
        holder = _holder(module)
        found: Companions = {}
        for role, key in zip(self.technique.companions(), self.placeholder_names(), strict=True):
            param = None if holder is None else own_parameters(holder).get(key)
            if param is None:
                raise RuntimeError(
                    f"{describe(module, self.name)} lost the Parameter {_PENDING}.{key} that "
                    f"its pending {self.marker} registration needs"
                )
            found[role] = param
        self.technique.register_materialized(module, self.name, found)
        self.cancel(module)

    def cancel(self, module: nn.Module) -> None:
        """Removes this hook and the placeholders it would have handed on."""
        if self.handle is not None:
            self.handle.remove()
        holder = _holder(module)
        if holder is None:
            return
        for key in self.placeholder_names():
            if key in own_parameters(holder):
                delattr(holder, key)
        if not own_parameters(holder):
            delattr(module, _PENDING)


def _defer(technique: Deferrable, module: nn.Module, name: str) -> Undo:
    """Converts ``module.<name>`` at the first forward, once it exists.

    The Parameters the registration will add (WN's ``g``, Scaled WS's ``gain``) are made now,
    uninitialized, in a child of ``module``, so an optimizer built before the first forward
    holds them; the registration then materializes them in place (:func:`materialized`). An
    optimizer that holds ``module.<name>`` but not them raises at its step.
    """
    lazy = own_parameters(module)[name]
    assert lazy is not None  # checked_tensor refused None
    holder = _holder(module)
    roles = technique.companions()
    if roles and holder is None:
        holder = _Pending()
        module.add_module(_PENDING, holder)
    made = []
    for role in roles:
        # torch's stubs give UninitializedParameter neither device nor dtype (2.13), which its
        # __new__ takes, and do not make it a Parameter, which it is.
        placeholder: nn.Parameter = nn.UninitializedParameter(  # type: ignore[call-arg,assignment]
            requires_grad=lazy.requires_grad, device=lazy.device, dtype=lazy.dtype
        )
        assert holder is not None
        holder.register_parameter(f"{name}_{role}", placeholder)
        made.append(placeholder)
    hook = _Deferred(technique, name)
    hook.handle = module.register_forward_pre_hook(hook)
    forget = _optimizer_watch.watch(module, name, technique.label, [lazy], made)

    def undo() -> None:
        forget()
        hook.cancel(module)

    return undo


def _deferred_hooks(module: nn.Module) -> list[_Deferred]:
    # Reading the hook dict finds pending registrations of deep copies and unpickled modules
    # too, whose handles were copied along with the dict they point into.
    return [h for h in _torch_compat.forward_pre_hooks(module) if isinstance(h, _Deferred)]


def pending(module: nn.Module, name: str, marker: str) -> bool:
    """Whether a registration of kind ``marker`` waits for ``module.<name>`` to exist."""
    return marker in pending_markers(module, name)


def pending_markers(module: nn.Module, name: str) -> set[str]:
    """The kinds of registration waiting for ``module.<name>`` to exist."""
    return {hook.marker for hook in _deferred_hooks(module) if hook.name == name}


def cancel_pending(module: nn.Module, name: str, marker: str) -> bool:
    """Removes a pending registration and its placeholders; returns whether there was one."""
    for hook in _deferred_hooks(module):
        if hook.name == name and hook.marker == marker:
            holder = _holder(module)
            if holder is not None:
                names = hook.placeholder_names()
                _optimizer_watch.forget([p for n, p in holder.named_parameters() if n in names])
            hook.cancel(module)
            return True
    return False
