"""The parametrization layer: one lifecycle for every reparametrization of normhooks.

Every reparametrization in normhooks is a ``torch.nn.utils.parametrize`` parametrization: a
small ``nn.Module`` whose ``forward`` computes the weight, recomputed at every access exactly
like torch's own (``parametrize.cached()`` is the scoped cache). A technique describes itself
once in a :class:`Technique`: what it builds for a weight, the layers it converts by default,
what it refuses, where a baked weight goes. This package does everything around that, once,
one concern per module, each building on those above it:

- :mod:`~normhooks._parametrize.layers`: names for messages, what a layer is, its
  parametrizations;
- :mod:`~normhooks._parametrize.checks`: the checks every entry point shares
  (:func:`checked_tensor`, :func:`refuse_wrapped`), and those of every forward
  (:func:`check_tensor`), with messages that name the parameter;
- :mod:`~normhooks._parametrize.optimizer_watch`: optimizers built before a conversion that
  added Parameters, caught at their step;
- :mod:`~normhooks._parametrize.registration`: registering and removing one parametrization,
  each undone exactly; baking (:func:`bake_into`);
- :mod:`~normhooks._parametrize.takeover`: torch's weight norm found on a layer,
  taken over and folded, and its legacy checkpoints;
- :mod:`~normhooks._parametrize.lazy`: a lazy layer's conversion, deferred to its first
  forward;
- :mod:`~normhooks._parametrize.spec`: :class:`Technique`, what a technique tells the
  lifecycle;
- :mod:`~normhooks._parametrize.lifecycle`: :func:`convert`, :func:`convert_tree`,
  :func:`convert_parameters`, :func:`remove`, where every conversion either happens or is
  undone (nothing changes when one of them is refused).

Every name of the module this package was is importable from it.
"""

from normhooks._parametrize.checks import _refuse_ties as _refuse_ties
from normhooks._parametrize.checks import _tensors_of as _tensors_of
from normhooks._parametrize.checks import (
    check_dtype,
    check_module,
    check_name,
    check_ndim,
    check_tensor,
    checked_tensor,
    refuse_sparse,
    refuse_wrapped,
)
from normhooks._parametrize.layers import _SELF_STANDARDIZING as _SELF_STANDARDIZING
from normhooks._parametrize.layers import _joined as _joined
from normhooks._parametrize.layers import (
    describe,
    expected_ndim,
    is_transposed,
    is_uninitialized,
    layer_name,
    layer_types,
    original,
    originals,
    output_axis,
    own_standardization,
    parametrizations_of,
    parametrized_names,
)
from normhooks._parametrize.lazy import _PENDING as _PENDING
from normhooks._parametrize.lazy import _defer as _defer
from normhooks._parametrize.lazy import _Deferred as _Deferred
from normhooks._parametrize.lazy import _deferred_hooks as _deferred_hooks
from normhooks._parametrize.lazy import _holder as _holder
from normhooks._parametrize.lazy import _LoadBeforeFirstForward as _LoadBeforeFirstForward
from normhooks._parametrize.lazy import _Pending as _Pending
from normhooks._parametrize.lazy import cancel_pending, pending, pending_markers
from normhooks._parametrize.lifecycle import _carries as _carries
from normhooks._parametrize.lifecycle import _conversion_step as _conversion_step
from normhooks._parametrize.lifecycle import _holds as _holds
from normhooks._parametrize.lifecycle import _layer_kinds as _layer_kinds
from normhooks._parametrize.lifecycle import _remover as _remover
from normhooks._parametrize.lifecycle import _repeated as _repeated
from normhooks._parametrize.lifecycle import (
    convert,
    convert_parameters,
    convert_tree,
    is_internal,
    remove,
)
from normhooks._parametrize.registration import (
    Companions,
    Step,
    Undo,
    apply_all,
    bake_into,
    materialized,
    register,
    register_parametrization,
    remove_outermost,
    remove_parametrizations,
)
from normhooks._parametrize.registration import _behind as _behind
from normhooks._parametrize.spec import L, Technique
from normhooks._parametrize.spec import _register as _register
from normhooks._parametrize.spec import _register_materialized as _register_materialized
from normhooks._parametrize.takeover import (
    InertTorchHook,
    has_torch_weight_norm,
    is_torch_legacy_weight_norm,
    torch_weight_norm,
    torch_weight_norm_names,
    weight_norm_axis,
)
from normhooks._parametrize.takeover import _legacy_hooks as _legacy_hooks

# The pickle of a pending lazy model names these classes by this module's path, the one they
# had before the package split.
_Deferred.__module__ = _Pending.__module__ = _LoadBeforeFirstForward.__module__ = __name__

__all__ = [
    "Companions",
    "InertTorchHook",
    "L",
    "Step",
    "Technique",
    "Undo",
    "apply_all",
    "bake_into",
    "cancel_pending",
    "check_dtype",
    "check_module",
    "check_name",
    "check_ndim",
    "check_tensor",
    "checked_tensor",
    "convert",
    "convert_parameters",
    "convert_tree",
    "describe",
    "expected_ndim",
    "has_torch_weight_norm",
    "is_internal",
    "is_torch_legacy_weight_norm",
    "is_transposed",
    "is_uninitialized",
    "layer_name",
    "layer_types",
    "materialized",
    "original",
    "originals",
    "output_axis",
    "own_standardization",
    "parametrizations_of",
    "parametrized_names",
    "pending",
    "pending_markers",
    "refuse_sparse",
    "refuse_wrapped",
    "register",
    "register_parametrization",
    "remove",
    "remove_outermost",
    "remove_parametrizations",
    "torch_weight_norm",
    "torch_weight_norm_names",
    "weight_norm_axis",
]
