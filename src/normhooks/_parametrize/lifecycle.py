"""The lifecycle of a parametrization: convert a parameter, a model or a list, remove, bake.

Every conversion either happens or is undone (nothing changes when one of them is refused); a
lazy layer's conversion waits for its first forward (:mod:`~normhooks._parametrize.lazy`);
torch's weight norm is taken over by the technique that does that
(:mod:`~normhooks._parametrize.takeover`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.nn.utils import parametrize

from normhooks._parametrize.checks import (
    _refuse_ties,
    check_module,
    check_name,
    check_ndim,
    checked_tensor,
    refuse_wrapped,
)
from normhooks._parametrize.layers import (
    _joined,
    describe,
    expected_ndim,
    is_uninitialized,
    layer_name,
    layer_types,
    original,
    own_standardization,
    parametrizations_of,
    parametrized_names,
)
from normhooks._parametrize.lazy import (
    _defer,
    _deferred_hooks,
    _Pending,
    cancel_pending,
    pending_markers,
)
from normhooks._parametrize.registration import (
    Step,
    apply_all,
    bake_into,
    remove_outermost,
    remove_parametrizations,
)
from normhooks._parametrize.spec import L, Technique, _register
from normhooks._parametrize.takeover import (
    has_torch_weight_norm,
    is_torch_legacy_weight_norm,
    torch_weight_norm,
    torch_weight_norm_names,
)
from normhooks._torch_compat import ConvNd, own_parameters


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


def _conversion_step(
    technique: Technique[L], module: nn.Module, name: str, *, strict: bool
) -> Step:
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


def convert(technique: Technique[Any], module: nn.Module, name: str) -> None:
    """Converts ``module.<name>``, or raises and leaves ``module`` as it was."""
    check_module(module)
    if not isinstance(name, str) or not hasattr(module, name):
        check_name(name)
        raise ValueError(
            f"{layer_name(module)} has no parameter named {name!r}; to {technique.verb} every "
            f"layer of a model, use {technique.tree_function}(model)"
        )
    apply_all([_conversion_step(technique, module, name, strict=True)])


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
        steps.append(_conversion_step(technique, module, name, strict=strict))
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
