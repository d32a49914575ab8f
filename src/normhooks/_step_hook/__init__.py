"""The machinery every optimizer-step hook shares: attach, closure, checks, planning, AMP, sharding.

A step hook runs one norm-based technique inside any :class:`torch.optim.Optimizer`'s step,
so it composes with every optimizer. A technique subclasses :class:`StepHook` and declares:

- what it rewrites: ``rewrites = "gradients"`` (LARS, AGC, gradient centralization: each
  ``.grad`` in place before the optimizer's update) or ``"updates"`` (the trust ratio: each
  parameter's change after the update, from a copy of the parameters taken before it);
- its settings: a frozen dataclass deriving :class:`Settings`, each field declared with
  ``setting(check)`` and documented there. The hook class derives from it too, so the
  settings are the hook's read-only attributes and make its ``repr``; the base's
  constructor checks them, and a param group overrides field ``name`` with the key
  ``"<prefix>_<name>"`` (or ``name`` itself where it starts with ``"<prefix>_"``);
- its key prefix (``prefix = "lars"``: groups opt out with ``"lars": False``) and its name in
  messages (``technique = "LARS"``);
- ``_unit_``: its maths for one *unit*, the parameters of one param group that share a
  device, a dtype and a sharding, as a pure function (a :class:`UnitFunction`) that works in
  place and returns one value per parameter (LARS: its rates), or None.

Optionally: ``scaled_gradients = True`` (the unit function takes GradScaler's scaled
gradients itself, see below), ``full_shapes = True`` (a hook on the updates: its unit function
takes ``shapes``, each parameter's shape as a whole tensor, a DTensor's and not its shard's),
``row_wise = True`` (it works on the rows along dim 0 of
tensors with two or more dimensions: a DTensor sharded on another dim is refused),
``whole_norms = False`` (it needs no norms of whole tensors: sharded parameters then cost no
collective), ``_check_group(group, settings)`` (raises for a group it cannot serve, or
returns a warning, emitted once per optimizer and group) and ``_check_param(param, where)``.

The AMP protocol, for a fused optimizer under :class:`torch.amp.GradScaler`, is the base's:
a unit function that does not declare ``scaled_gradients`` receives unscaled gradients
(float32 copies of float16/bfloat16 ones) and its results are checked for inf/NaN by the
base. One that declares it receives the keyword arguments ``grad_scale`` and ``found_inf``: its
gradients are scaled by ``grad_scale``, what it writes must be unscaled, it sets
``found_inf`` to 1 (never adds) where a written value is not finite, and never reads a tensor
value back to the host.

What does not change from step to step (validation, settings and overrides, grouping into
units) is planned once per state of the param groups and reused while the one rule of
:class:`~normhooks._step_hook.plan._GroupPlan` holds: the param groups and their entries (by
identity), each parameter's identity, address and dtype, checked at each step in a few
C-level passes; it reads no tensor value. What a step brings (gradients present or not,
dense or not, new gradient tensors, the lr) is read at each step, and nothing of it is kept
but its layout: a steady step, whose every unit is laid out as recorded at the last step
(:class:`~normhooks._step_hook.steady.Steady`, one rule), is planned and bound by those
records in one C call and one pass over the addresses per unit. A gradient hook that
declares ``replays = True`` (its unit function's kernel branch is one kernel entry's call and
nothing else) has that step, outside GradScaler's fused protocol, replay the launches its unit
function made at the last step (``Steady.replay``), in place of the function.

The package, one concern per module, each building on those above it:

- :mod:`~normhooks._step_hook.settings`: :class:`Settings`, :func:`setting`, :class:`UnitFunction`;
- :mod:`~normhooks._step_hook.checks`: the checks of parameters, gradients and shardings;
- :mod:`~normhooks._step_hook.norms`: :func:`euclidean_norms`, :func:`row_norms`;
- :mod:`~normhooks._step_hook.amp`: GradScaler's fused protocol (unscaling, inf/NaN flags);
- :mod:`~normhooks._step_hook.steady`: :class:`Steady`, a unit's tensors as at the last step;
- :mod:`~normhooks._step_hook.units`: a group's parameters by device, dtype and sharding, and
  the all-reduce of sharded norms;
- :mod:`~normhooks._step_hook.core`: what every hook declares and holds;
- :mod:`~normhooks._step_hook.plan`: the plan kept between steps and its fingerprint;
- :mod:`~normhooks._step_hook.updates`: an update hook's copies and post-step;
- :mod:`~normhooks._step_hook.closure`: the closure evaluated once;
- :mod:`~normhooks._step_hook.run`: the pre-step, the gradients rewritten, the functional form;
- :mod:`~normhooks._step_hook.attach`: the optimizer a hook goes on, and the ones it refuses;
- :mod:`~normhooks._step_hook.hook`: :class:`StepHook`, these concerns together;
- :mod:`~normhooks._step_hook.param_groups`: :func:`split_param_groups`.

Every name of the module this package was is importable from it, private ones included, for
the code that imports them.
"""

from normhooks._step_hook.amp import _unscaled_ as _unscaled_
from normhooks._step_hook.amp import _written_ as _written_
from normhooks._step_hook.amp import inverse_scale, unscale_and_check_
from normhooks._step_hook.attach import _FRAMEWORK_WRAPPERS as _FRAMEWORK_WRAPPERS
from normhooks._step_hook.attach import _held_optimizer as _held_optimizer
from normhooks._step_hook.attach import _unwrap as _unwrap
from normhooks._step_hook.attach import _wrapped as _wrapped
from normhooks._step_hook.attach import hooks_on
from normhooks._step_hook.checks import _SUPPORTED_DTYPES as _SUPPORTED_DTYPES
from normhooks._step_hook.checks import _USE_FSDP2 as _USE_FSDP2
from normhooks._step_hook.checks import (
    all_plain,
    check_dense_grad,
    check_foreach,
    check_not_flattened,
    check_param,
    check_rows_are_local,
)
from normhooks._step_hook.closure import _SingleUseClosure as _SingleUseClosure
from normhooks._step_hook.closure import _take_closure as _take_closure
from normhooks._step_hook.copies import _Copies as _Copies
from normhooks._step_hook.copies import _copy_ as _copy_
from normhooks._step_hook.copies import _fresh_copies as _fresh_copies
from normhooks._step_hook.hook import StepHook
from normhooks._step_hook.norms import _CPU_ROW as _CPU_ROW
from normhooks._step_hook.norms import _CPU_SHORT as _CPU_SHORT
from normhooks._step_hook.norms import _ROW_DIMS as _ROW_DIMS
from normhooks._step_hook.norms import _cpu_norms as _cpu_norms
from normhooks._step_hook.norms import _long_norms as _long_norms
from normhooks._step_hook.norms import _plain_norms as _plain_norms
from normhooks._step_hook.norms import _row_dims as _row_dims
from normhooks._step_hook.norms import euclidean_norms, row_norms
from normhooks._step_hook.param_groups import split_param_groups
from normhooks._step_hook.plan import _DTYPE as _DTYPE
from normhooks._step_hook.plan import _fingerprint as _fingerprint
from normhooks._step_hook.plan import _GroupPlan as _GroupPlan
from normhooks._step_hook.plan import _items as _items
from normhooks._step_hook.plan import _namer as _namer
from normhooks._step_hook.settings import Lr, S, S_contra, Settings, UnitFunction, setting
from normhooks._step_hook.steady import Steady
from normhooks._step_hook.units import _bind as _bind
from normhooks._step_hook.units import _Bound as _Bound
from normhooks._step_hook.units import _full_shapes as _full_shapes
from normhooks._step_hook.units import _in_order as _in_order
from normhooks._step_hook.units import _Reduce as _Reduce
from normhooks._step_hook.units import _reduce_key as _reduce_key
from normhooks._step_hook.units import _reduce_norms_ as _reduce_norms_
from normhooks._step_hook.units import _sharding as _sharding
from normhooks._step_hook.units import _Unit as _Unit
from normhooks._step_hook.units import _units as _units
from normhooks._step_hook.units import sum_over_shards
from normhooks._step_hook.updates import _UpdateInFlight as _UpdateInFlight

__all__ = [
    "Lr",
    "S",
    "S_contra",
    "Settings",
    "Steady",
    "StepHook",
    "UnitFunction",
    "all_plain",
    "check_dense_grad",
    "check_foreach",
    "check_not_flattened",
    "check_param",
    "check_rows_are_local",
    "euclidean_norms",
    "inverse_scale",
    "row_norms",
    "setting",
    "split_param_groups",
    "sum_over_shards",
    "unscale_and_check_",
]

_hooks_on = hooks_on
