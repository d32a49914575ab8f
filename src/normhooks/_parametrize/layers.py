"""What the lifecycle reads off a layer: names for messages, its kind, its parametrizations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from torch import nn
from torch.nn.utils import parametrize

from normhooks._torch_compat import ConvNd, ConvTransposeNd

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
