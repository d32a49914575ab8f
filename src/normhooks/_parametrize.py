"""The parametrization layer: one lifecycle for every reparametrization of normhooks.

Every reparametrization in normhooks is a ``torch.nn.utils.parametrize`` parametrization: a
small ``nn.Module`` whose ``forward`` computes the weight, recomputed at every access exactly
like torch's own (``parametrize.cached()`` is the scoped cache). A technique describes itself
once in a :class:`Technique`: what it builds for a weight, the layers it converts by default,
what it refuses, where a baked weight goes. This module does everything around that, once:

- :func:`convert`, :func:`convert_tree`, :func:`convert_parameters`: convert one parameter, a
  model's layers or a list of parameters, where every conversion either happens or is undone
  (nothing changes when one of them is refused); a lazy layer's conversion waits for its
  first forward; torch's weight norm is taken over by the technique that does that;
- :func:`remove`: bake or restore one parameter or a whole tree, keeping Parameter objects;
- the checks every entry point shares (:func:`checked_tensor`, :func:`refuse_wrapped`, the
  layers that standardize their own weight), and the input checks of every forward
  (:func:`check_tensor`), with messages that name the parameter.
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from normhooks import _optimizer_watch, _torch_compat
from normhooks._torch_compat import ConvNd, ConvTransposeNd, own_parameters

Undo = Callable[[], None]
Step = Callable[[], Undo]
L = TypeVar("L")


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


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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


# --- registered parametrizations ------------------------------------------------------------


def parametrizations_of(module: nn.Module, name: str) -> list[nn.Module]:
    """The parametrizations registered on ``module.<name>``, innermost first."""
    if not parametrize.is_parametrized(module, name):
        return []
    return list(originals(module, name))


def parametrized_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s parametrized tensors."""
    holder = getattr(module, "parametrizations", None)
    return list(holder.keys()) if isinstance(holder, nn.ModuleDict) else []


def originals(module: nn.Module, name: str) -> parametrize.ParametrizationList:
    """The ParametrizationList of ``module.<name>``, which holds its original tensors."""
    holder = getattr(module, "parametrizations", None)
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


def _holds(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is a tensor a conversion would find: a registered Parameter,
    a parametrized tensor or the weight of torch's legacy weight norm."""
    return (
        own_parameters(module).get(name) is not None
        or parametrize.is_parametrized(module, name)
        or torch_weight_norm(module, name) is not None
    )


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


# --- checks ---------------------------------------------------------------------------------


def check_module(module: object, argument: str = "module") -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{argument} must be a torch.nn.Module, got {type(module).__name__}")
    return module


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got name={name!r}")
    return name


def checked_tensor(module: nn.Module, name: str, what: str) -> Tensor:
    """The tensor ``module.<name>`` after the checks every entry point shares: a Parameter
    (or a parametrized tensor, for a parametrization on top), real floating point, not sparse,
    of a module not wrapped yet. A lazy module's weight that does not exist yet is returned
    as it is, an ``nn.UninitializedParameter``, after the checks its dtype allows.
    """
    check_module(module)
    check_name(name)
    where = describe(module, name)
    parameters = own_parameters(module)
    if parametrize.is_parametrized(module, name):
        # Stacked on another parametrization: what gets reparametrized is its output.
        weight: Tensor | None = getattr(module, name)
    elif name in parameters:
        weight = parameters[name]
    elif hasattr(module, name):
        refuse_wrapped(module, what, getattr(module, name), name)
        found = type(getattr(module, name)).__name__
        raise TypeError(f"{where} must be a torch.nn.Parameter to apply {what}, got {found}")
    else:
        raise ValueError(f"{layer_name(module)} has no parameter named {name!r}")
    if weight is None:
        raise ValueError(f"{where} is None; there is no weight to {what}")
    if not is_uninitialized(weight):
        refuse_wrapped(module, what, weight, name)
    if not isinstance(weight, nn.Parameter) and not parametrize.is_parametrized(module, name):
        raise TypeError(
            f"{where} must be a torch.nn.Parameter to apply {what}, got {type(weight).__name__}"
        )
    check_dtype(where, weight.dtype, what)
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
    dtensor = _torch_compat.dtensor_type()
    if tensor is not None and dtensor is not None and isinstance(tensor, dtensor):
        raise ValueError(
            f"{describe(module, name)} is a DTensor: the model is already sharded by "
            f"fully_shard. Apply {what} before fully_shard"
        )
    if tensor is not None and _torch_compat.fsdp1_flattening(tensor) is not None:
        raise ValueError(
            f"{describe(module, name)} was flattened by FullyShardedDataParallel (FSDP1): the "
            f"model is already wrapped. Apply {what} before wrapping"
        )
    ddp = _torch_compat.ddp_type()
    fsdp1 = _torch_compat.fsdp1_type()
    for sub in module.modules():
        if ddp is not None and isinstance(sub, ddp):
            raise ValueError(
                f"{layer_name(module)} is wrapped by DistributedDataParallel. Apply {what} "
                "before wrapping: DDP only averages the gradients of the parameters it saw at "
                "construction"
            )
        if fsdp1 is not None and (
            isinstance(sub, fsdp1)
            or any(_torch_compat.fsdp1_flattening(t) is not None for t in _tensors_of(sub))
        ):
            raise ValueError(
                f"{layer_name(module)} is wrapped by FullyShardedDataParallel (FSDP1). Apply "
                f"{what} before wrapping: FSDP1 flattens the parameters it finds at "
                "construction into FlatParameters and would never manage new ones"
            )


def _tensors_of(module: nn.Module) -> list[object]:
    """A module's own parameters and plain tensor attributes (where FSDP1 leaves its views)."""
    return [*own_parameters(module).values(), *vars(module).values()]


def _refuse_ties(root: nn.Module, planned: dict[int, tuple[nn.Module, str, str]]) -> None:
    """Raises if a Parameter that a conversion is about to replace is also another module's or
    name's.

    ``planned`` maps each such Parameter to its owner, its attribute name and its path. A
    layer that the model calls twice (one module object under two paths) is not a tie.
    """
    for prefix, module in root.named_modules(remove_duplicate=False):
        for name, param in own_parameters(module).items():
            found = planned.get(id(param))
            if found is None or (found[0] is module and found[1] == name):
                continue
            raise ValueError(
                f"{found[2]} and {_joined(prefix, name)} are the same Parameter (tied weights); "
                f"converting {found[2]} would untie them. Leave its layer out (layer_types), or "
                "convert one by itself and tie the other to it yourself"
            )


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
        single = hasattr(originals(module, name), "original")
        if single:
            remove_parametrizations(module, name, leave_parametrized=False)
            return
        remove_parametrizations(module, name, leave_parametrized=True)
        delattr(module, name)
        module.register_parameter(name, before)

    return undo


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

    def __init__(self, technique: Technique[Any], name: str) -> None:
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
        _register_materialized(self.technique, module, self.name, found)
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


def _defer(technique: Technique[Any], module: nn.Module, name: str) -> Undo:
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


# --- the lifecycle --------------------------------------------------------------------------


class Technique(ABC, Generic[L]):
    """What a reparametrization tells the lifecycle; a subclass is a frozen dataclass of its
    settings, checked by the public function that makes it.

    The class attributes name the technique in messages and describe its parametrization;
    :meth:`layout` and :meth:`build` are its own, the other methods have the answers of a
    parametrization that computes the weight from the weight itself (one original, kept as
    the same Parameter) and composes with every other. ``L`` is what :meth:`layout` resolves
    from the settings for one tensor (an axis, say), once, where the tensor's rank is known.
    """

    marker: ClassVar[str]  # names its pending registrations on lazy layers
    what: ClassVar[str]  # "weight standardization"
    done: ClassVar[str]  # "standardized": "Conv2d.weight is already standardized"
    verb: ClassVar[str]  # "standardize": "nothing to standardize in Sequential"
    tree_function: ClassVar[str]  # the public function that converts a model
    parametrization: ClassVar[type[nn.Module]]  # the class its registrations are instances of
    layers: ClassVar[tuple[type[nn.Module], ...]]  # what a tree conversion converts by default
    # The original whose Parameter object a baked weight keeps: "original" for a
    # parametrization of the weight alone; for one of several tensors, the one shaped like it.
    baked_into: ClassVar[str] = "original"
    # Whether torch's own weight norm on a tensor is replaced by this technique's (take_over).
    takes_over_torch_weight_norm: ClassVar[bool] = False

    @property
    def label(self) -> str:
        """The name of a conversion in the message of an optimizer that missed it."""
        return self.what

    @property
    def replaces_weight(self) -> bool:
        """Whether a registration replaces the weight's Parameter by new originals: then it must
        be innermost, and a weight tied to another module's would be untied."""
        return self.baked_into != "original"

    @abstractmethod
    def layout(self, module: nn.Module, name: str, ndim: int) -> L:
        """The settings resolved for ``module.<name>``, of ``ndim`` >= 2 dimensions; raises with
        ``describe(module, name)`` where they do not fit it."""

    @abstractmethod
    def build(self, weight: Tensor, layout: L) -> nn.Module:
        """The parametrization of ``weight`` (its device, dtype and shape)."""

    def companions(self) -> dict[str, tuple[str, str]]:
        """The Parameters a registration adds besides new originals, by role, with where they
        end up: ``("parametrization", attribute)`` or ``("originals", "original0")``. On a lazy
        layer each is created at conversion, for an optimizer built before the first forward."""
        return {}

    def refuse(self, module: nn.Module, name: str, layout: L | None) -> None:
        """Raises where this conversion of ``module.<name>`` would be wrong; ``layout`` is None
        for a lazy tensor that does not exist yet."""

    def self_standardizing(self, own: str) -> str | None:
        """Why a layer whose forward standardizes its own weight (through the class ``own``) is
        refused; None where that forward does what this technique does, so converting it
        would only repeat it (then a tree conversion skips it, with a warning)."""
        return (
            f"the scale {self.what} gives the weight is standardized away. Leave it out "
            "(layer_types selects subclasses too: name only the classes to convert)"
        )

    def torch_counterpart(self, module: nn.Module, name: str) -> Any:
        """What of torch's own on ``module.<name>`` :meth:`take_over` is handed, or None: torch's
        weight norm (:func:`torch_weight_norm`), unless a technique looks for its own."""
        return torch_weight_norm(module, name)

    def take_over(self, module: nn.Module, name: str, found: Any, strict: bool) -> Step | None:
        """The step that replaces torch's weight norm ``found`` on ``module.<name>``, or None to
        treat it as any other parametrization. ``strict``: the settings were given for this
        parameter alone, and must then agree with torch's."""
        if is_torch_legacy_weight_norm(found):
            raise ValueError(
                f"{describe(module, name)} carries torch's legacy weight norm "
                "(torch.nn.utils.weight_norm), which recomputes the weight in a forward "
                f"pre-hook; {self.what} cannot stack on it. Remove it first "
                "(torch.nn.utils.remove_weight_norm), or leave the layer out"
            )
        return None

    def fold_torch_legacy(self, module: nn.Module, name: str, hook: Any) -> None:
        """Folds torch's legacy weight norm ``hook`` on ``module.<name>`` into a plain weight;
        the techniques that take torch's weight norm over also remove it."""
        raise NotImplementedError(f"{self.what} does not take over torch's weight norm")

    def registered(self, module: nn.Module, name: str) -> None:
        """Runs after every registration on ``module.<name>``."""

    def removed(self, module: nn.Module, name: str) -> None:
        """Runs after every removal from ``module.<name>``."""

    def applied(self, module: nn.Module, name: str) -> bool:
        """Whether ``module.<name>`` carries this technique, or will at its first forward."""
        return pending(module, name, self.marker) or any(
            isinstance(p, self.parametrization) for p in parametrizations_of(module, name)
        )


def _plan(technique: Technique[L], module: nn.Module, name: str, *, strict: bool) -> Step:
    """Checks ``module.<name>`` for ``technique`` and returns the step that converts it."""
    where = describe(module, name)
    own = own_standardization(module) if name == "weight" else None
    if own is not None:
        refusal = technique.self_standardizing(own)
        if refusal is None:
            raise ValueError(
                f"{where} is already {technique.done} by its own forward ({own}); "
                f"{technique.what} again would only repeat it"
            )
        raise ValueError(
            f"{where} is a {own}, whose forward standardizes whatever weight it is given: "
            + refusal
        )
    found = technique.torch_counterpart(module, name)
    if found is not None:
        step = technique.take_over(module, name, found, strict)
        if step is not None:
            return step
    weight = checked_tensor(module, name, technique.what)
    if technique.applied(module, name):
        raise ValueError(f"{where} is already {technique.done}")
    lazy = is_uninitialized(weight)
    if technique.replaces_weight:
        # Its registration makes new originals, which only the innermost one may.
        others = [type(p).__name__ for p in parametrizations_of(module, name)]
        if others or (lazy and pending_markers(module, name)):
            when = "" if others else " at its first forward"
            kinds = ", ".join(others or sorted(pending_markers(module, name)))
            verb = "already has" if others else "will get"
            raise ValueError(
                f"{where} {verb} another parametrization{when} ({kinds}); {technique.what} "
                "needs the plain Parameter: register it first"
            )
    if lazy:
        technique.refuse(module, name, None)
        ndim = expected_ndim(module, name)
        if ndim is not None:
            check_ndim(where, ndim, technique.what)
            technique.layout(module, name, ndim)
        return functools.partial(_defer, technique, module, name)
    check_ndim(where, weight.ndim, technique.what)
    layout = technique.layout(module, name, weight.ndim)
    technique.refuse(module, name, layout)
    return functools.partial(_register, technique, module, name, layout)


def _register(
    technique: Technique[L],
    module: nn.Module,
    name: str,
    layout: L,
    companions: Companions | None = None,
) -> Undo:
    """Converts ``module.<name>``, checked already, for ``layout``.

    On a lazy layer (``companions``: its placeholders) the Parameters an optimizer built
    before the first forward holds are kept: each placeholder becomes the Parameter the
    registration added in its role, and new originals give their place to the lazy weight,
    rewritten in place.
    """
    weight = getattr(module, name)
    parametrization = technique.build(weight, layout)
    # torch gives a parametrization its layer's mode and computes the weight once, as a check:
    # in eval mode here, so that registering never advances a parametrization's state (a
    # power iteration's), whatever the layer's mode when its conversion runs.
    training = module.training
    module.training = False
    try:
        undo = register(module, name, parametrization, technique.label, watch=companions is None)
    finally:
        module.training = training
    parametrization.train(training)
    if companions is not None:
        chain = originals(module, name)
        for role, (where, attribute) in technique.companions().items():
            owner = chain if where == "originals" else chain[-1]
            setattr(owner, attribute, materialized(companions[role], getattr(owner, attribute)))
        if technique.replaces_weight:
            with torch.no_grad():
                weight.copy_(getattr(chain, technique.baked_into))
            setattr(chain, technique.baked_into, weight)
    technique.registered(module, name)
    return undo


def _register_materialized(
    technique: Technique[Any], module: nn.Module, name: str, companions: Companions
) -> None:
    """Converts a lazy layer's ``module.<name>`` at its first forward, now that it exists."""
    weight = checked_tensor(module, name, technique.what)
    check_ndim(describe(module, name), weight.ndim, technique.what)
    layout = technique.layout(module, name, weight.ndim)
    technique.refuse(module, name, layout)
    _register(technique, module, name, layout, companions)


def convert(technique: Technique[Any], module: nn.Module, name: str) -> None:
    """Converts ``module.<name>``, or raises and leaves ``module`` as it was."""
    check_module(module)
    if not isinstance(name, str) or not hasattr(module, name):
        check_name(name)
        raise ValueError(
            f"{layer_name(module)} has no parameter named {name!r}; to {technique.verb} every "
            f"layer of a model, use {technique.tree_function}(model)"
        )
    apply_all([_plan(technique, module, name, strict=True)])


def convert_parameters(
    technique: Technique[Any],
    root: nn.Module,
    targets: Sequence[tuple[str, nn.Module, str]],
    *,
    strict: bool = True,
) -> None:
    """Converts each ``(path, module, name)`` of ``targets``, all in ``root``, or none of them.

    Every target is checked before anything changes; a Parameter that a conversion would
    replace and that another module or name of ``root`` shares is refused (it would be untied).
    """
    ties: dict[int, tuple[nn.Module, str, str]] = {}
    steps = []
    for path, module, name in targets:
        param = own_parameters(module).get(name)
        if technique.replaces_weight and param is not None:
            ties.setdefault(id(param), (module, name, path))
        steps.append(_plan(technique, module, name, strict=strict))
    _refuse_ties(root, ties)
    apply_all(steps)


def convert_tree(
    technique: Technique[Any],
    model: nn.Module,
    types: type[nn.Module] | Sequence[type[nn.Module]] | None,
) -> None:
    """Converts the ``weight`` of every layer of ``model`` that is an instance of ``types``
    (None: the technique's default), and every tensor of theirs that carries torch's weight
    norm where the technique takes it over: all of them or, when one is refused, none.

    Layers already converted are skipped, as are layers without a weight and (with a warning)
    layers whose forward does the technique itself; torch's weight norm on layers left out
    is named in a warning.
    """
    chosen = layer_types(types, technique.layers)
    check_module(model, "model")
    refuse_wrapped(model, technique.what)
    targets: list[tuple[str, nn.Module, str]] = []
    matched = already = 0
    own: list[str] = []
    left: list[str] = []
    for prefix, layer in model.named_modules():
        if is_internal(layer):
            continue
        foreign = torch_weight_norm_names(layer) if technique.takes_over_torch_weight_norm else []
        if not isinstance(layer, chosen):
            left.extend(_joined(prefix, n) for n in foreign)
            continue
        for name in dict.fromkeys([*foreign, "weight"]):
            if not _holds(layer, name):
                continue
            matched += 1
            if technique.applied(layer, name):
                already += 1
            elif name == "weight" and _repeated(technique, layer):
                own.append(prefix or layer_name(layer))
            else:
                targets.append((_joined(prefix, name), layer, name))
    if not targets:
        names = _layer_kinds(chosen)
        reason = (
            f"all {matched} matching layers are already {technique.done}"
            + (f" ({len(own)} by their own forward, as timm's StdConv2d)" if own else "")
            if matched
            else f"it has no layer of type {names} with a weight"
        )
        raise ValueError(f"nothing to {technique.verb} in {layer_name(model)}: {reason}")
    convert_parameters(technique, model, targets, strict=False)
    if own:
        warnings.warn(
            f"{technique.tree_function} skipped {', '.join(own)}: their forward standardizes "
            f"the weight itself (timm's StdConv2d and its kin), and {technique.what} again "
            "would only repeat it",
            stacklevel=3,
        )
    if left:
        warnings.warn(
            f"{technique.tree_function} left torch's weight norm on {', '.join(left)}: their "
            "layer types are not in layer_types; add them to take it over",
            stacklevel=3,
        )


def _layer_kinds(types: tuple[type[nn.Module], ...]) -> str:
    """Layer classes as messages name them: ``Linear, Conv* or ConvTranspose*``."""
    names = [
        n for t in types for n in (("Conv*", "ConvTranspose*") if t is ConvNd else (t.__name__,))
    ]
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


def _repeated(technique: Technique[Any], layer: nn.Module) -> bool:
    """Whether ``layer``'s forward standardizes its weight the way ``technique`` would."""
    own = own_standardization(layer)
    return own is not None and technique.self_standardizing(own) is None


def remove(technique: Technique[Any], module: nn.Module, name: str | None, *, bake: bool) -> None:
    """Removes ``technique`` from ``module.<name>``, or from every tensor of the tree (pending
    conversions of lazy layers included); with ``bake`` the weight keeps its current value,
    otherwise the raw weight comes back. Everything is checked before anything is removed.
    """
    check_module(module)
    if name is not None:
        check_name(name)
        if not cancel_pending(module, name, technique.marker):
            action, _ = _remover(technique, module, name, bake)
            action()
            technique.removed(module, name)
        return
    removals: list[tuple[Callable[[], object], nn.Module, str]] = []
    waiting: list[tuple[nn.Module, str]] = []
    written: dict[int, str] = {}
    for prefix, sub in module.named_modules():
        if is_internal(sub):
            continue
        waiting.extend(
            (sub, hook.name) for hook in _deferred_hooks(sub) if hook.marker == technique.marker
        )
        names = parametrized_names(sub)
        if technique.takes_over_torch_weight_norm:
            names += torch_weight_norm_names(sub)
        for param_name in dict.fromkeys(names):
            if not _carries(technique, sub, param_name):
                continue
            action, target = _remover(technique, sub, param_name, bake)
            where = _joined(prefix, param_name)
            first = where if target is None else written.setdefault(id(target), where)
            if first != where:
                # Baking writes into the shared Parameter: the second would then compute its
                # weight from what the first one baked.
                remedy = (
                    "Untie them first"
                    if technique.replaces_weight
                    else "Remove with bake=False, or untie them first"
                )
                raise ValueError(
                    f"{first} and {where} {technique.verb} the same raw Parameter "
                    f"(tied weights); baking one would change the other. {remedy}"
                )
            removals.append((action, sub, param_name))
    if not removals and not waiting:
        raise ValueError(f"{layer_name(module)} has no {technique.what} to remove")
    for sub, param_name in waiting:
        cancel_pending(sub, param_name, technique.marker)
    for action, sub, param_name in removals:
        action()
        technique.removed(sub, param_name)


def _carries(technique: Technique[Any], module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` has ``technique`` to remove: its parametrization, or torch's
    weight norm where the technique takes that over."""
    if technique.takes_over_torch_weight_norm and has_torch_weight_norm(module, name):
        return True
    return any(isinstance(p, technique.parametrization) for p in parametrizations_of(module, name))


def _remover(
    technique: Technique[Any], module: nn.Module, name: str, bake: bool
) -> tuple[Callable[[], object], Tensor | None]:
    """Checks that ``technique`` can be removed from ``module.<name>``; returns what removes it
    and the Parameter that removal writes into (None where it writes into none)."""
    chain = parametrizations_of(module, name)
    if not _carries(technique, module, name):
        kinds = ", ".join(type(p).__name__ for p in chain)
        detail = f" (its parametrizations: {kinds})" if kinds else ""
        raise ValueError(
            f"{describe(module, name)} is not {technique.done}{detail}; nothing to remove"
        )
    found = torch_weight_norm(module, name) if technique.takes_over_torch_weight_norm else None
    if found is not None and is_torch_legacy_weight_norm(found):
        return functools.partial(technique.fold_torch_legacy, module, name, found), None
    if len(chain) > 1:
        outermost = isinstance(chain[-1], technique.parametrization)
        if technique.replaces_weight or bake or not outermost:
            remedy = (
                "remove those first"
                if technique.replaces_weight
                else f"only an outermost {technique.what} can be removed, with bake=False"
            )
            raise ValueError(
                f"{describe(module, name)} has other parametrizations besides "
                f"{technique.what}; {remedy}"
            )
        return functools.partial(remove_outermost, module, name), None
    if not bake:
        return functools.partial(
            remove_parametrizations, module, name, leave_parametrized=False
        ), None
    target = original(module, name, technique.baked_into)
    return functools.partial(bake_into, module, name, technique.baked_into), target
