"""Taking over torch's weight norm, and folding it: both of torch's forms, and their checkpoints.

``torch.nn.utils.parametrizations.weight_norm`` registers a ``_WeightNorm`` parametrization
whose originals are g and v; the legacy ``torch.nn.utils.weight_norm`` owns ``<name>_g`` and
``<name>_v`` and recomputes the weight in a forward pre-hook. Models built on either (HiFi-GAN,
EnCodec, DAC, wav2vec 2.0, ...) are taken over in place: the same g and v Parameters with the
same values and the same state-dict keys, computed by normhooks' weight norm instead. What
this needs beyond the shared lifecycle of ``_parametrize`` lives here:

- :func:`take_over`: the step that replaces either form, undone exactly if a later step of
  the conversion fails;
- the state-dict hooks that keep the legacy ``<name>_g``/``<name>_v`` keys, in both
  directions (:func:`install_key_hooks`);
- an inert hook of torch's legacy class, so that torch's own ``remove_weight_norm`` folds a
  takeover (as the inference code of many vocoders calls it), and :func:`fold_legacy`, the
  folding of the legacy form itself.

The weight norm that takes over is built by the technique handed in (normhooks'
``WeightNorm``, which this module does not import).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from normhooks import _torch_compat
from normhooks._parametrize.checks import check_ndim, refuse_wrapped
from normhooks._parametrize.layers import (
    describe,
    original,
    originals,
    parametrizations_of,
    parametrized_names,
)
from normhooks._parametrize.registration import (
    Step,
    Undo,
    bake_into,
    register_parametrization,
    remove_parametrizations,
)
from normhooks._torch_compat import own_parameters


class TakingOver(Protocol):
    """What a takeover reads of the weight norm's
    :class:`~normhooks._parametrize.spec.Technique` (which builds on this module, so it is
    named by what it offers)."""

    @property
    def what(self) -> str: ...

    def layout(self, module: nn.Module, name: str, ndim: int) -> int | None: ...

    def build(self, weight: Tensor, layout: int | None) -> nn.Module: ...


# --- torch's weight norm, as found on a layer ------------------------------------------------


class InertTorchHook:
    """Marks a hook that normhooks registers in one of torch's hook types, so that torch's own
    functions find it; normhooks never takes it for torch's."""


def torch_weight_norm(module: nn.Module, name: str) -> Any:
    """torch's weight norm on ``module.<name>``: its ``_WeightNorm`` parametrization, its legacy
    forward pre-hook, or None.

    ``torch.nn.utils.parametrizations.weight_norm`` registers a ``_WeightNorm``
    parametrization (always innermost: it has two originals); the legacy
    ``torch.nn.utils.weight_norm`` a forward pre-hook that owns ``<name>_g`` and ``<name>_v``.
    Both hold ``dim``, where -1 means the norm of the whole tensor.
    """
    chain = parametrizations_of(module, name)
    if chain and type(chain[0]).__name__ == "_WeightNorm":
        return chain[0]
    for hook in _legacy_hooks(module):
        if hook.name == name:
            return hook
    return None


def _legacy_hooks(module: nn.Module) -> list[Any]:
    """The hooks of torch's legacy weight norm on ``module``, not the inert ones of normhooks."""
    return [
        hook
        for hook in _torch_compat.forward_pre_hooks(module)
        if isinstance(hook, _torch_compat.LegacyWeightNorm) and not isinstance(hook, InertTorchHook)
    ]


def is_torch_legacy_weight_norm(found: object) -> bool:
    """Whether :func:`torch_weight_norm` found the legacy hook rather than a parametrization."""
    return not isinstance(found, nn.Module)


def torch_weight_norm_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s tensors that carry torch's weight norm, of either kind."""
    names = [n for n in parametrized_names(module) if torch_weight_norm(module, n) is not None]
    for hook in _legacy_hooks(module):
        if hook.name not in names:
            names.append(hook.name)
    return names


def has_torch_weight_norm(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` carries torch's weight norm, either of its two forms."""
    return torch_weight_norm(module, name) is not None


def weight_norm_axis(module: nn.Module, name: str) -> tuple[bool, int | None]:
    """Whether ``module.<name>`` is computed by a weight norm, torch's or normhooks', and the
    axis of the weight its g runs along (None: one g for the whole tensor).

    Both register a parametrization with two originals, g and v, innermost; torch's stores
    ``dim=-1`` for the whole tensor, normhooks' ``None`` (a negative ``dim`` counts from the
    end there).
    """
    chain = parametrizations_of(module, name)
    if not chain or not hasattr(originals(module, name), "original1"):
        return False, None
    dim = getattr(chain[0], "dim", None)
    ndim = original(module, name, "original1").ndim
    if dim is None or (dim == -1 and torch_weight_norm(module, name) is not None):
        return True, None
    return True, int(dim) % ndim


# The legacy keys of g and v, and the originals they are.
_LEGACY_SUFFIXES = (("_g", "original0"), ("_v", "original1"))


def _innermost(module: nn.Module, name: str, kind: type[nn.Module]) -> nn.Module | None:
    chain = parametrizations_of(module, name)
    return chain[0] if chain and isinstance(chain[0], kind) else None


# --- checkpoints of the legacy torch.nn.utils.weight_norm ------------------------------------


class _LegacyKeys:
    """A state-dict hook of ``module.<name>`` that renames the keys of g and v while a weight
    norm of ``kind`` computes it, and does nothing otherwise."""

    def __init__(self, name: str, kind: type[nn.Module]) -> None:
        self.name = name
        self.kind = kind

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        wn = _innermost(module, self.name, self.kind)
        if wn is not None:
            self.rename(module, wn, state_dict, prefix)

    def rename(
        self, module: nn.Module, wn: nn.Module, state_dict: dict[str, Any], prefix: str
    ) -> None:
        raise NotImplementedError


class _LoadLegacyKeys(_LegacyKeys):
    """Load-state-dict pre-hook: reads ``<name>_g``/``<name>_v`` checkpoints of the legacy
    ``torch.nn.utils.weight_norm`` into ``parametrizations.<name>.original0``/``original1``."""

    def rename(
        self, module: nn.Module, wn: nn.Module, state_dict: dict[str, Any], prefix: str
    ) -> None:
        for suffix, which in _LEGACY_SUFFIXES:
            legacy = f"{prefix}{self.name}{suffix}"
            current = f"{prefix}parametrizations.{self.name}.{which}"
            # A checkpoint with both styles keeps its current keys, and a <name>_g that the
            # module itself owns is never taken for g.
            owned = hasattr(module, self.name + suffix)
            if legacy in state_dict and current not in state_dict and not owned:
                state_dict[current] = state_dict.pop(legacy)


class _SaveLegacyKeys(_LegacyKeys):
    """State-dict post-hook: saves a taken-over legacy weight norm under its own keys."""

    def rename(
        self, module: nn.Module, wn: nn.Module, state_dict: dict[str, Any], prefix: str
    ) -> None:
        if not getattr(wn, "legacy_keys", False):
            return
        for suffix, which in _LEGACY_SUFFIXES:
            key = f"{prefix}parametrizations.{self.name}.{which}"
            if key in state_dict:
                state_dict[f"{prefix}{self.name}{suffix}"] = state_dict.pop(key)


def install_key_hooks(
    module: nn.Module, name: str, kind: type[nn.Module], *, save_legacy: bool
) -> None:
    """Installs the legacy-key hooks of ``module.<name>`` once; they are inert unless a weight
    norm of ``kind`` computes it.

    They decide at each call from the parametrization itself, so copies and unpickled
    modules behave alike, and removing the weight norm needs no hook bookkeeping.
    """
    loads = _torch_compat.load_state_dict_pre_hooks(module)
    if not any(isinstance(h, _LoadLegacyKeys) and h.name == name for h in loads):
        module.register_load_state_dict_pre_hook(_LoadLegacyKeys(name, kind))  # type: ignore[no-untyped-call]
    saves = _torch_compat.state_dict_hooks(module)
    if save_legacy and not any(isinstance(h, _SaveLegacyKeys) and h.name == name for h in saves):
        module.register_state_dict_post_hook(_SaveLegacyKeys(name, kind))  # type: ignore[no-untyped-call]


# --- torch's legacy remove_weight_norm after a takeover --------------------------------------


class _LegacyRemoval(_torch_compat.LegacyWeightNorm, InertTorchHook):
    """What torch's legacy ``remove_weight_norm`` finds on a layer whose legacy weight norm
    normhooks took over: an inert forward pre-hook of torch's hook type.

    Inference code of models built on ``torch.nn.utils.weight_norm`` (HiFi-GAN, MelGAN and
    many vocoders) folds the weight norm with ``torch.nn.utils.remove_weight_norm``, which
    looks for that hook and calls its ``remove``: here that folds normhooks' weight norm, as
    ``normhooks.remove_weight_norm`` does. The parametrization computes the weight, so the hook
    does nothing at a forward, except remove itself once the parametrization is gone (folded by
    ``torch.nn.utils.parametrize.remove_parametrizations``), so that torch's weight norm can
    be applied again.
    """

    def __init__(self, name: str, dim: int | None, kind: type[nn.Module]) -> None:
        super().__init__(name, -1 if dim is None else dim)
        self.kind = kind
        self.handle: RemovableHandle | None = None

    def compute_weight(self, module: nn.Module) -> Tensor:
        weight: Tensor = getattr(module, self.name)
        return weight

    def remove(self, module: nn.Module) -> None:
        # torch deletes this hook from the module's hook dict right after.
        if _innermost(module, self.name, self.kind) is not None:
            bake_into(module, self.name, "original1")

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        if not parametrize.is_parametrized(module, self.name) and self.handle is not None:
            self.handle.remove()


def drop_legacy_removal(module: nn.Module, name: str) -> None:
    """Removes the inert hook of a takeover of ``module.<name>``, if there is one."""
    for hook in _torch_compat.forward_pre_hooks(module):
        if isinstance(hook, _LegacyRemoval) and hook.name == name and hook.handle is not None:
            hook.handle.remove()


# --- taking over ----------------------------------------------------------------------------


def take_over(
    technique: TakingOver,
    module: nn.Module,
    name: str,
    found: Any,
    *,
    dim: int | None,
    strict: bool,
) -> Step:
    """The step that replaces torch's weight norm ``found`` on ``module.<name>`` by the weight
    norm ``technique`` builds (``technique.build(v, axis)``), along torch's axis.

    g and v stay the same Parameter objects with the same values and state-dict keys; only
    the formula changes. With ``strict`` the caller's ``dim`` (resolved by
    ``technique.layout``) must be the axis torch's runs along.
    """
    legacy = is_torch_legacy_weight_norm(found)
    v = own_parameters(module)[f"{name}_v"] if legacy else original(module, name, "original1")
    assert v is not None  # the legacy hook registered it
    refuse_wrapped(module, technique.what, v, name)
    check_ndim(describe(module, name), v.ndim, technique.what)
    # torch's weight norm computes the norm of the whole tensor for dim=-1 (and for None,
    # which it stores as -1), and along that axis for any other dim.
    axis = None if found.dim == -1 else int(found.dim) % v.ndim
    if strict and technique.layout(module, name, v.ndim) != axis:
        kind = "torch.nn.utils." + ("weight_norm" if legacy else "parametrizations.weight_norm")
        raise ValueError(
            f"{describe(module, name)} carries torch's weight norm ({kind}) along dim={axis}; "
            f"weight_norm takes it over with its g and v as they are: pass dim={axis}, got "
            f"dim={dim}"
        )

    def step() -> Undo:
        # In the layer's mode, as torch's registration would set it (a parametrization that
        # replaces torch's in place is not registered).
        ours = technique.build(v, axis).train(module.training)
        if legacy:
            return _take_over_legacy(module, name, found, ours, axis)
        return _take_over_parametrization(module, name, ours)

    return step


def _take_over_parametrization(module: nn.Module, name: str, ours: nn.Module) -> Undo:
    chain = originals(module, name)
    theirs = chain[0]
    chain[0] = ours
    install_key_hooks(module, name, type(ours), save_legacy=False)

    def undo() -> None:
        chain[0] = theirs

    return undo


def _take_over_legacy(
    module: nn.Module, name: str, hook: Any, ours: nn.Module, axis: int | None
) -> Undo:
    g_name, v_name = f"{name}_g", f"{name}_v"
    g, v = own_parameters(module)[g_name], own_parameters(module)[v_name]
    assert g is not None  # the legacy hook registered both
    assert v is not None
    restore_hook = _torch_compat.pop_forward_pre_hook(module, hook)
    # The weight the hook computed at the last forward, a plain attribute: it goes, since
    # the parametrization computes the weight from now on.
    stale = vars(module).pop(name, None)
    delattr(module, g_name)
    delattr(module, v_name)
    try:
        # Registered on a stand-in of the right shape; the originals it derives are then
        # replaced by the very g and v Parameters, so optimizers that hold them keep working.
        module.register_parameter(name, nn.Parameter(v.detach().clone(), v.requires_grad))
        # The module keeps saving g and v under the legacy hook's <name>_g / <name>_v keys.
        cast(Any, ours).legacy_keys = True
        register_parametrization(module, name, ours)
        chain = originals(module, name)
        chain.original0, chain.original1 = g, v
        install_key_hooks(module, name, type(ours), save_legacy=True)
        removal = _LegacyRemoval(name, axis, type(ours))
        removal.handle = module.register_forward_pre_hook(removal)
    except BaseException:
        _untake_legacy(module, name, g, v, stale, restore_hook)
        raise

    def undo() -> None:
        _untake_legacy(module, name, g, v, stale, restore_hook)

    return undo


def _untake_legacy(
    module: nn.Module,
    name: str,
    g: nn.Parameter,
    v: nn.Parameter,
    stale: Tensor | None,
    restore_hook: Callable[[], None],
) -> None:
    if parametrize.is_parametrized(module, name):
        remove_parametrizations(module, name, leave_parametrized=True)
    drop_legacy_removal(module, name)
    if name in own_parameters(module):
        delattr(module, name)
    module.register_parameter(f"{name}_g", g)
    module.register_parameter(f"{name}_v", v)
    if stale is not None:
        setattr(module, name, stale)
    restore_hook()


# --- folding torch's legacy form --------------------------------------------------------------


def fold_legacy(module: nn.Module, name: str, hook: Any) -> None:
    """Folds torch's legacy weight norm on ``module.<name>``: the weight becomes the Parameter
    that held v, with the value the hook computes."""
    v = own_parameters(module)[f"{name}_v"]
    assert v is not None  # the legacy hook registered it
    with torch.no_grad():
        weight = hook.compute_weight(module)
    _torch_compat.pop_forward_pre_hook(module, hook)
    vars(module).pop(name, None)
    delattr(module, f"{name}_g")
    delattr(module, f"{name}_v")
    with torch.no_grad():
        v.copy_(weight)
    module.register_parameter(name, v)
