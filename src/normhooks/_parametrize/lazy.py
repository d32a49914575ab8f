"""Lazy deferral: a lazy layer's conversion waits for its first forward.

The Parameters a registration will add (WN's ``g``, Scaled WS's ``gain``) are made at
conversion, uninitialized, in a child of the layer (:class:`_Pending`), so that an optimizer
built before the first forward holds them; a forward pre-hook (:class:`_Deferred`) registers
the parametrization once the layer's weight exists, materializing them in place. Both are
pickled with a pending model: their module path stays ``normhooks._parametrize``.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from normhooks import _torch_compat
from normhooks._parametrize import optimizer_watch as _optimizer_watch
from normhooks._parametrize.layers import describe, is_uninitialized, originals
from normhooks._parametrize.registration import Companions, Undo
from normhooks._torch_compat import own_parameters


class Deferrable(Protocol):
    """What a deferred conversion reads of its :class:`~normhooks._parametrize.spec.Technique`
    (which builds on this module, so it is named by what it offers)."""

    @property
    def marker(self) -> str: ...

    @property
    def label(self) -> str: ...

    @property
    def what(self) -> str: ...

    @property
    def baked_into(self) -> str: ...

    def companions(self) -> dict[str, tuple[str, str]]: ...

    def register_materialized(
        self, module: nn.Module, name: str, companions: Companions
    ) -> Undo: ...


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

    # What a checkpoint loaded before the first forward holds for the registration (the
    # state dict of ``parametrizations.<name>``), and whether it was loaded strictly; a class
    # attribute, so that the hooks of models pickled before it existed have it too.
    loaded: tuple[dict[str, Tensor], bool] | None = None
    load_handle: RemovableHandle | None = None

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
        undo = self.technique.register_materialized(module, self.name, found)
        if self.loaded is not None:
            self._load_(module, undo, *self.loaded)
        self.cancel(module)

    def _load_(self, module: nn.Module, undo: Undo, state: dict[str, Tensor], strict: bool) -> None:
        """Loads the checkpoint kept at ``load_state_dict`` into the registration just made."""
        try:
            originals(module, self.name).load_state_dict(state, strict=strict)
        except RuntimeError as error:
            undo()
            raise ValueError(
                f"{describe(module, self.name)}: the checkpoint loaded into this pending model "
                f"before its first forward does not fit its {self.technique.what} ({error}). "
                "Convert the model as the checkpoint's model was converted (the same technique "
                "and settings) before loading it"
            ) from None
        self.loaded = None

    def cancel(self, module: nn.Module) -> None:
        """Removes this hook and the placeholders it would have handed on."""
        if self.handle is not None:
            self.handle.remove()
        if self.load_handle is not None:
            self.load_handle.remove()
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
    # torch's stubs leave register_load_state_dict_pre_hook untyped (2.13).
    loads: Any = module.register_load_state_dict_pre_hook
    hook.load_handle = loads(_LoadBeforeFirstForward(name))
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


class _LoadBeforeFirstForward:
    """Load-state-dict pre-hook of a pending layer: takes a checkpoint of the converted model.

    torch's lazy modules load a checkpoint before their first forward, materializing their
    weights to its shapes; a pending conversion does the same with a checkpoint saved after
    it, whose ``parametrizations.<name>.*`` keys the pending layer does not have yet. The
    original that the layer's weight Parameter becomes (``technique.baked_into``: v for WN,
    the raw weight for WS) is loaded into that weight, materialized to its shape; the whole
    ``parametrizations.<name>`` state (WN's g, Scaled WS's gain, any state a parametrization
    keeps) is kept by the pending registration, which loads it into what it registers at the
    first forward. The outputs are then those of the saved model.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        *args: Any,
    ) -> None:
        waiting = [hook for hook in _deferred_hooks(module) if hook.name == self.name]
        head = f"{prefix}parametrizations.{self.name}."
        keys = [key for key in state_dict if key.startswith(head)]
        if not waiting or not keys:
            return
        # Registrations stacked on one tensor run innermost first: the last one to run loads
        # the state of them all.
        hook = waiting[-1]
        inner = waiting[0].technique
        source = state_dict.get(head + inner.baked_into)
        where = describe(module, self.name)
        if not isinstance(source, Tensor):
            found = ", ".join(key[len(prefix) :] for key in keys)
            raise ValueError(
                f"{where} waits for its first forward to get {inner.what}, which keeps the "
                f"weight in parametrizations.{self.name}.{inner.baked_into}; the checkpoint "
                f"holds {found} instead: it was saved from a model converted otherwise. "
                "Convert the model as the checkpoint's model was converted before loading it"
            )
        weight = own_parameters(module).get(self.name)
        if weight is not None and is_uninitialized(weight):
            cast(nn.UninitializedParameter, weight).materialize(source.shape)
        state = {key[len(head) :]: state_dict.pop(key).detach().clone() for key in keys}
        hook.loaded = (state, strict)
        state_dict[prefix + self.name] = source
