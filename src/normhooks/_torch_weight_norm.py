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
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from normhooks import _parametrize, _torch_compat
from normhooks._parametrize import Step, Technique, Undo, describe
from normhooks._torch_compat import own_parameters

# The legacy keys of g and v, and the originals they are.
_LEGACY_SUFFIXES = (("_g", "original0"), ("_v", "original1"))


def _innermost(module: nn.Module, name: str, kind: type[nn.Module]) -> nn.Module | None:
    chain = _parametrize.parametrizations_of(module, name)
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


class _LegacyRemoval(_torch_compat.LegacyWeightNorm, _parametrize.InertTorchHook):
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
            _parametrize.bake_into(module, self.name, "original1")

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
    technique: Technique[int | None],
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
    legacy = _parametrize.is_torch_legacy_weight_norm(found)
    v = (
        own_parameters(module)[f"{name}_v"]
        if legacy
        else _parametrize.original(module, name, "original1")
    )
    assert v is not None  # the legacy hook registered it
    _parametrize.refuse_wrapped(module, technique.what, v, name)
    _parametrize.check_ndim(describe(module, name), v.ndim, technique.what)
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
    chain = _parametrize.originals(module, name)
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
        _parametrize.register_parametrization(module, name, ours)
        chain = _parametrize.originals(module, name)
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
        _parametrize.remove_parametrizations(module, name, leave_parametrized=True)
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
