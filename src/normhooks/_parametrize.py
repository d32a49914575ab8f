"""The parametrization layer that weight standardization and weight normalization share.

Every reparametrization in normhooks is a ``torch.nn.utils.parametrize`` parametrization: a
small ``nn.Module`` whose ``forward`` computes the weight, recomputed at every access exactly
like torch's own (``parametrize.cached()`` is the scoped cache). This module does, once,
what each technique's registering function needs around it:

- :func:`checked_tensor`: the checks every entry point shares (module, name, Parameter,
  dtype, layout, wrap order), with messages that name the parameter;
- :func:`register`, :func:`defer`, :func:`apply_all`: registration on a materialized weight,
  deferral to the first forward of a lazy module, and conversion of many parameters that
  either all succeed or leave every module as it was;
- naming helpers for errors (:func:`describe`) and the lookups of registered
  parametrizations.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from normhooks import _optimizer_watch, _torch_compat
from normhooks._torch_compat import ConvNd, ConvTransposeNd

Undo = Callable[[], None]


# --- names for messages ---------------------------------------------------------------------


def layer_name(module: nn.Module) -> str:
    """The module's class name, without the ``Parametrized`` class parametrize wraps it in."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        cls = cls.__bases__[0]
    return cls.__name__


def describe(module: nn.Module, name: str) -> str:
    """How errors name a module's parameter: ``Conv2d.weight``."""
    return f"{layer_name(module)}.{name}"


# --- layers ---------------------------------------------------------------------------------


def expected_ndim(module: nn.Module, name: str = "weight") -> int | None:
    """The dimensions ``module.<name>`` will have, for lazy modules whose tensors do not
    exist yet; None where that is not known."""
    if not isinstance(module, (ConvNd, nn.Linear)):
        return None
    if name == "bias":
        return 1
    if name != "weight":
        return None
    return 2 + len(cast(Any, module).kernel_size) if isinstance(module, ConvNd) else 2


# Layers whose own forward standardizes the weight they hold, whatever a parametrization makes
# of it: timm's timm/layers/std_conv.py (timm.models.layers.std_conv before timm 0.9; BiT,
# ViT hybrids, NF-Nets) and transformers' BiT port. They are known by class name along the
# MRO, under their package's modules, so subclasses are caught and neither is imported.
_SELF_STANDARDIZING = {
    "timm.": frozenset({"StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "ScaledStdConv2dSame"}),
    "transformers.models.bit.": frozenset({"WeightStandardizedConv2d"}),
}


def own_standardization(module: nn.Module) -> str | None:
    """The class through which ``module``'s forward standardizes its own weight, as
    ``timm.layers.std_conv.ScaledStdConv2d``; None for every other layer."""
    for cls in type(module).__mro__:
        for package, names in _SELF_STANDARDIZING.items():
            if cls.__name__ in names and cls.__module__.startswith(package):
                return f"{cls.__module__}.{cls.__qualname__}"
    return None


def is_transposed(module: nn.Module) -> bool:
    return isinstance(module, ConvTransposeNd)


def output_axis(module: nn.Module) -> int:
    """The axis of a layer's weight that indexes its output channels."""
    return 1 if is_transposed(module) else 0


def is_uninitialized(tensor: object) -> bool:
    """Whether ``tensor`` is a lazy module's parameter or buffer that does not exist yet."""
    return isinstance(tensor, (nn.UninitializedParameter, nn.UninitializedBuffer))


# --- registered parametrizations ------------------------------------------------------------


def parametrizations_of(module: nn.Module, name: str) -> list[nn.Module]:
    """The parametrizations registered on ``module.<name>``, innermost first."""
    if not parametrize.is_parametrized(module, name):
        return []
    return list(originals(module, name))


def parametrized_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s parametrized tensors."""
    holder = module._modules.get("parametrizations")
    return list(holder.keys()) if isinstance(holder, nn.ModuleDict) else []


def originals(module: nn.Module, name: str) -> parametrize.ParametrizationList:
    """The ParametrizationList of ``module.<name>``, which holds its original tensors."""
    holder = module._modules["parametrizations"]
    if not isinstance(holder, nn.ModuleDict):
        raise TypeError(f"{layer_name(module)}.parametrizations is not a ModuleDict")
    return cast(parametrize.ParametrizationList, holder[name])


def original(module: nn.Module, name: str, which: str) -> nn.Parameter:
    """One original tensor of ``module.<name>``: ``original``, ``original0``, ..."""
    return cast(nn.Parameter, getattr(originals(module, name), which))


def is_internal(module: nn.Module) -> bool:
    """Modules that hold the originals of parametrizations, or a lazy layer's placeholders,
    which are never converted."""
    return isinstance(module, (parametrize.ParametrizationList, _Pending))


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


def has_torch_weight_norm(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` carries torch's weight norm, either of its two forms."""
    return torch_weight_norm(module, name) is not None


def layer_types(
    types: type[nn.Module] | Sequence[type[nn.Module]] | None,
    default: tuple[type[nn.Module], ...],
) -> tuple[type[nn.Module], ...]:
    """The ``layer_types`` argument of a tree conversion as a tuple of module classes."""
    if types is None:
        return default
    found = (types,) if isinstance(types, type) else tuple(types)
    for layer_type in found:
        if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
            raise TypeError(
                f"layer_types must be nn.Module subclasses, got {layer_type!r} in "
                f"layer_types={types!r}"
            )
    return found


# --- checks ---------------------------------------------------------------------------------


def check_module(module: object, argument: str = "module") -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{argument} must be a torch.nn.Module, got {type(module).__name__}")
    return module


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got name={name!r}")
    return name


def checked_tensor(module: nn.Module, name: str, what: str) -> Tensor | None:
    """The tensor ``module.<name>`` after the checks every entry point shares.

    Returns None for a lazy module's weight that does not exist yet.
    """
    check_module(module)
    check_name(name)
    if parametrize.is_parametrized(module, name):
        # Stacked on another parametrization: what gets reparametrized is its output.
        weight: Tensor | None = getattr(module, name)
    elif name in module._parameters:
        weight = module._parameters[name]
    elif hasattr(module, name):
        refuse_wrapped(module, what, getattr(module, name), name)
        found = type(getattr(module, name)).__name__
        raise TypeError(
            f"{describe(module, name)} must be a torch.nn.Parameter to apply {what}, got {found}"
        )
    else:
        raise ValueError(f"{layer_name(module)} has no parameter named {name!r}")
    if weight is None:
        raise ValueError(f"{describe(module, name)} is None; there is no weight to {what}")
    if is_uninitialized(weight):
        return None
    refuse_wrapped(module, what, weight, name)
    if not isinstance(weight, nn.Parameter) and not parametrize.is_parametrized(module, name):
        raise TypeError(
            f"{describe(module, name)} must be a torch.nn.Parameter to apply {what}, "
            f"got {type(weight).__name__}"
        )
    check_dtype(describe(module, name), weight.dtype, what)
    refuse_sparse(module, what)
    return weight


def check_dtype(where: str, dtype: torch.dtype, what: str) -> None:
    """Raises unless ``dtype`` is a real floating-point dtype; ``where`` names the tensor."""
    if not dtype.is_floating_point:
        kind = "complex" if dtype.is_complex else "integer"
        raise TypeError(
            f"{where} must be a real floating-point tensor for {what}, got {kind} dtype {dtype}"
        )


def check_ndim(where: str, ndim: int, what: str) -> None:
    """Raises unless a tensor of ``ndim`` dimensions has the 2 or more that both techniques
    need: one axis of rows, and at least one more to take statistics over."""
    if ndim < 2:
        raise ValueError(
            f"{where} has {ndim} dimension{'s' if ndim != 1 else ''}; {what} needs a tensor "
            "with at least 2"
        )


def check_tensor(tensor: object, where: str, what: str) -> Tensor:
    """``tensor`` if it is a real floating-point tensor with at least 2 dimensions.

    The checks of every public function and parametrization forward: a few attribute reads,
    cheap enough for each forward, and static under ``torch.compile`` (dtypes and ranks).
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
    check_dtype(where, tensor.dtype, what)
    check_ndim(where, tensor.ndim, what)
    return tensor


def refuse_sparse(module: nn.Module, what: str) -> None:
    """Sparse embeddings produce sparse gradients that no parametrization can pass through."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
        raise ValueError(
            f"{layer_name(module)} has sparse=True; {what} computes the weight from its "
            "originals, whose gradients are dense. Use sparse=False"
        )


def refuse_wrapped(
    module: nn.Module, what: str, tensor: object = None, name: str = "weight"
) -> None:
    """Raises if ``module`` was already wrapped by DDP, FSDP1 or ``fully_shard`` (FSDP2).

    All three must come after the reparametrization: DDP attaches its gradient hooks to the
    parameters it finds at construction and would never average new ones, FSDP1 flattens
    the parameters it finds into FlatParameters and leaves the layers views of them, and
    FSDP2 keeps managing the old name while the new originals stay sharded DTensors outside
    forward.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    if tensor is not None and dtensor is not None and isinstance(tensor, dtensor.DTensor):
        raise ValueError(
            f"{describe(module, name)} is a DTensor: the model is already sharded by "
            f"fully_shard. Apply {what} before fully_shard"
        )
    if tensor is not None and _torch_compat.is_fsdp1_flattened(tensor):
        raise ValueError(
            f"{describe(module, name)} was flattened by FullyShardedDataParallel (FSDP1): the "
            f"model is already wrapped. Apply {what} before wrapping"
        )
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    ddp_type = None if ddp is None else ddp.DistributedDataParallel
    fsdp1 = _torch_compat.fsdp1_type()
    for sub in module.modules():
        if ddp_type is not None and isinstance(sub, ddp_type):
            raise ValueError(
                f"{layer_name(module)} is wrapped by DistributedDataParallel. Apply {what} "
                "before wrapping: DDP only averages the gradients of the parameters it saw at "
                "construction"
            )
        if fsdp1 is not None and (
            isinstance(sub, fsdp1)
            or any(_torch_compat.is_fsdp1_flattened(t) for t in _tensors_of(sub))
        ):
            raise ValueError(
                f"{layer_name(module)} is wrapped by FullyShardedDataParallel (FSDP1). Apply "
                f"{what} before wrapping: FSDP1 flattens the parameters it finds at "
                "construction into FlatParameters and would never manage new ones"
            )


def _tensors_of(module: nn.Module) -> list[object]:
    """A module's own parameters and plain tensor attributes (where FSDP1 leaves its views)."""
    return [*module._parameters.values(), *vars(module).values()]


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


def _behind(module: nn.Module, name: str) -> list[Tensor]:
    """The Parameters that ``module.<name>`` is computed from: itself, or the originals of its
    parametrizations and their own Parameters."""
    if parametrize.is_parametrized(module, name):
        return list(originals(module, name).parameters())
    found = module._parameters.get(name)
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
    before = module._parameters.get(name)
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
        single = hasattr(originals(module, name), "original")
        if single:
            remove_parametrizations(module, name, leave_parametrized=False)
            return
        remove_parametrizations(module, name, leave_parametrized=True)
        delattr(module, name)
        module.register_parameter(name, before)

    return undo


def apply_all(steps: Sequence[Callable[[], Undo]]) -> None:
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


# --- lazy modules ---------------------------------------------------------------------------

# The child module of a lazy layer that holds, until its first forward, the Parameters that
# a pending registration will add.
_PENDING = "_normhooks_pending"

Companions = dict[str, nn.Parameter]


class _Pending(_torch_compat.StatelessModule):
    """Holds the Parameters that pending registrations will add to a lazy layer, each still an
    ``nn.UninitializedParameter``, so that ``model.parameters()`` yields them and an optimizer
    built before the first forward holds them. State dicts leave it out: a checkpoint of the
    pending model is the lazy model's."""


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


class _Deferred:
    """Forward pre-hook that registers a parametrization once a lazy weight is materialized.

    It runs after the lazy module's own pre-hook (hooks run in registration order), which
    has created the weight by then, hands the registration its companions (the placeholder
    Parameters made at conversion, found by name, so copies find their own), and removes
    itself once it has registered. A registration that fails raises from that forward and
    stays pending, so the next forward raises again instead of running the layer without its
    reparametrization.
    """

    def __init__(
        self,
        name: str,
        register: Callable[..., object],
        marker: str,
        companions: tuple[str, ...],
    ) -> None:
        self.name = name
        self.register = register
        self.marker = marker
        self.companions = companions
        self.handle: RemovableHandle | None = None

    def placeholder_names(self) -> list[str]:
        """The names of its placeholders in the module's placeholder holder."""
        return [f"{self.name}_{role}" for role in self.companions]

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if any(is_uninitialized(p) for p in module.parameters(recurse=False)):
            return
        holder = module._modules.get(_PENDING)
        found: Companions = {}
        for role, key in zip(self.companions, self.placeholder_names(), strict=True):
            param = None if holder is None else holder._parameters.get(key)
            if param is None:
                raise RuntimeError(
                    f"{describe(module, self.name)} lost the Parameter {_PENDING}.{key} that "
                    f"its pending {self.marker} registration needs"
                )
            found[role] = param
        self.register(module, companions=found)
        self.cancel(module)

    def cancel(self, module: nn.Module) -> None:
        """Removes this hook and the placeholders it would have handed on."""
        if self.handle is not None:
            self.handle.remove()
        holder = module._modules.get(_PENDING)
        if holder is None:
            return
        for key in self.placeholder_names():
            holder._parameters.pop(key, None)
        if not holder._parameters:
            del module._modules[_PENDING]


def defer(
    module: nn.Module,
    name: str,
    register: Callable[..., object],
    marker: str,
    what: str,
    companions: Sequence[str] = (),
) -> Undo:
    """Runs ``register(module, companions=...)`` at the first forward, once ``module.<name>``
    exists.

    ``companions`` names the Parameters the registration will add (WN's ``g``, Scaled WS's
    ``gain``): each is made now, uninitialized, in a child of ``module``, so an optimizer
    built before the first forward holds it, and handed to ``register`` by role, for it to
    materialize in place (:func:`materialized`). An optimizer that holds ``module.<name>``
    but not them raises at its step.
    """
    lazy = module._parameters[name]
    assert lazy is not None  # checked_tensor refused None
    holder = module._modules.get(_PENDING)
    if companions and holder is None:
        holder = _Pending()
        module.add_module(_PENDING, holder)
    made = []
    for role in companions:
        # torch's stubs give UninitializedParameter neither device nor dtype (2.13), which its
        # __new__ takes, and do not make it a Parameter, which it is.
        placeholder: nn.Parameter = nn.UninitializedParameter(  # type: ignore[call-arg,assignment]
            requires_grad=lazy.requires_grad, device=lazy.device, dtype=lazy.dtype
        )
        assert holder is not None
        holder.register_parameter(f"{name}_{role}", placeholder)
        made.append(placeholder)
    hook = _Deferred(name, register, marker, tuple(companions))
    hook.handle = module.register_forward_pre_hook(hook)
    forget = _optimizer_watch.watch(module, name, what, [lazy], made)

    def undo() -> None:
        forget()
        hook.cancel(module)

    return undo


def pending(module: nn.Module, name: str, marker: str) -> bool:
    """Whether a registration of kind ``marker`` waits for ``module.<name>`` to exist."""
    return _find_deferred(module, name, marker) is not None


def pending_markers(module: nn.Module, name: str) -> set[str]:
    """The kinds of registration waiting for ``module.<name>`` to exist."""
    return {
        hook.marker
        for hook in _torch_compat.forward_pre_hooks(module)
        if isinstance(hook, _Deferred) and hook.name == name
    }


def cancel_pending(module: nn.Module, name: str, marker: str) -> bool:
    """Removes a pending registration and its placeholders; returns whether there was one."""
    hook = _find_deferred(module, name, marker)
    if hook is None:
        return False
    holder = module._modules.get(_PENDING)
    if holder is not None:
        names = hook.placeholder_names()
        _optimizer_watch.forget([p for n, p in holder.named_parameters() if n in names])
    hook.cancel(module)
    return True


def _find_deferred(module: nn.Module, name: str, marker: str) -> _Deferred | None:
    # Reading the hook dict finds pending registrations of deep copies and unpickled modules
    # too, whose handles were copied along with the dict they point into.
    for hook in _torch_compat.forward_pre_hooks(module):
        if isinstance(hook, _Deferred) and hook.name == name and hook.marker == marker:
            return hook
    return None
