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
units) is planned once per param-group layout and reused while a fingerprint of the layout
holds: the param groups and their entries (by identity), each parameter's identity, dtype and
address; it reads no tensor value. What a step brings (gradients present or not, dense or
not, new gradient tensors, the lr) is read at each step.
"""

from __future__ import annotations

import math
import operator
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from normhooks import _torch_compat as compat
from normhooks._precision import HALF_DTYPES, compute_dtype

__all__ = [
    "Settings",
    "StepHook",
    "UnitFunction",
    "euclidean_norms",
    "row_norms",
    "setting",
    "split_param_groups",
]

S = TypeVar("S", bound="Settings")
S_contra = TypeVar("S_contra", bound="Settings", contravariant=True)
Lr = float | Tensor | None

# --- settings ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Settings:
    """Base of a technique's settings: a frozen dataclass whose fields come from :func:`setting`.

    A hook class derives from its technique's settings too: its settings are its read-only
    attributes, documented where they are declared, and its ``repr``.
    """

    @classmethod
    def _names(cls) -> list[str]:
        # The fields' dict rather than dataclasses.fields(cls), which torch.compile cannot
        # trace on a class.
        return list(cls.__dataclass_fields__)

    @classmethod
    def _checked_values(
        cls, values: Mapping[str, object], name: Callable[[str], str] = str
    ) -> dict[str, Any]:
        """``values`` (one per field), each checked where it enters.

        An error names a field ``f`` as ``name(f)``: the argument, or the param-group key.
        """
        declared = cls.__dataclass_fields__
        return {key: f.metadata["check"](name(key), values[key]) for key, f in declared.items()}

    @classmethod
    def _checked(cls: type[S], values: Mapping[str, object], name: Callable[[str], str] = str) -> S:
        """The settings from ``values``, checked (see :meth:`_checked_values`)."""
        return cls(**cls._checked_values(values, name))


def setting(check: Callable[[str, Any], object]) -> Any:
    """A field of a :class:`Settings` dataclass, with the check ``check(name, value)``."""
    return field(metadata={"check": check})


# --- the unit functions --------------------------------------------------------------------


class UnitFunction(Protocol[S_contra]):
    """A technique's maths for one unit, in place; returns one value per parameter or None.

    Gradient hooks get ``(params, grads)``; update hooks ``(params, reverts)``, where
    ``params`` hold the optimizer's new values and ``reverts`` are ``w_old - w_new``.
    ``norms`` are ``(||w||, ||t||)`` of the whole tensors (``t`` the gradient; for update
    hooks, ``w`` is ``w_old`` and ``t`` the revert) where the base computed them: always
    for update hooks, for sharded units of gradient hooks; otherwise None. A gradient hook
    that declares ``scaled_gradients`` also takes ``grad_scale`` and ``found_inf``.
    """

    def __call__(
        self,
        params: list[Tensor],
        tensors: list[Tensor],
        settings: S_contra,
        lr: Lr,
        /,
        *,
        norms: tuple[Tensor, Tensor] | None,
        foreach: bool | None,
    ) -> Tensor | None: ...


# --- norms ---------------------------------------------------------------------------------

# torch's CPU reductions (2.13) sum a float32 tensor in a few float32 partial sums, whose
# error grows with their length: for 2**20 equal values the norm is off by 4e-4 (3e-5 for a
# BLAS dot), for 1e8 by 4e-2. Reduced in rows of _CPU_ROW values, whose float64 sums of
# squares are then added, it stays within 1e-6 of float64; tensors of at most _CPU_SHORT
# values, within 3e-6, keep the one multi-tensor call.
_CPU_ROW = 1024
_CPU_SHORT = 4096


def euclidean_norms(tensors: list[Tensor], foreach: bool | None = None) -> Tensor:
    """Euclidean norms of ``tensors`` (one device and dtype), accumulated in at least float32.

    ``foreach=False`` takes one norm per tensor; True or None one multi-tensor call, except
    on the CPU, where tensors of more than ``_CPU_SHORT`` float32/float16/bfloat16 values are
    reduced row by row (rows of ``_CPU_ROW`` values) and added in float64, whatever
    ``foreach`` is: a single float32 reduction of a long tensor is not precise.

    Example:
        >>> euclidean_norms([torch.full((2, 2), 1.5), torch.tensor([3.0, 4.0])])
        tensor([3., 5.])
    """
    dtype = tensors[0].dtype
    acc = compute_dtype(dtype)
    upcast = acc if acc != dtype else None
    if tensors[0].device.type == "cpu" and acc == torch.float32:
        return _cpu_norms(tensors, upcast, foreach)
    return torch.stack(_plain_norms(tensors, upcast, foreach))


def _plain_norms(
    tensors: list[Tensor], upcast: torch.dtype | None, foreach: bool | None
) -> list[Tensor]:
    if foreach is False:
        return [torch.linalg.vector_norm(t, dtype=upcast) for t in tensors]
    return compat.foreach_norm(tensors, dtype=upcast)


def _cpu_norms(tensors: list[Tensor], upcast: torch.dtype | None, foreach: bool | None) -> Tensor:
    """:func:`euclidean_norms` of float32/float16/bfloat16 CPU tensors, in float32."""
    long = [i for i, t in enumerate(tensors) if t.numel() > _CPU_SHORT]
    if not long:
        return torch.stack(_plain_norms(tensors, upcast, foreach))
    out = [torch.empty(0)] * len(tensors)
    short = [i for i, t in enumerate(tensors) if t.numel() <= _CPU_SHORT]
    if short:
        norms = _plain_norms([tensors[i] for i in short], upcast, foreach)
        for i, norm in zip(short, norms, strict=True):
            out[i] = norm
    for i, norm in zip(long, _long_norms([tensors[i] for i in long], upcast), strict=True):
        out[i] = norm
    return torch.stack(out)


def _long_norms(tensors: list[Tensor], upcast: torch.dtype | None) -> list[Tensor]:
    """Norms of long CPU tensors: float32 norms of rows of ``_CPU_ROW`` values (and of the
    tail), whose squares are summed per tensor in float64 with one ``index_add_``."""
    parts, rows = [], []
    for tensor in tensors:
        flat = tensor.reshape(-1)
        whole = flat.numel() // _CPU_ROW * _CPU_ROW
        parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, _CPU_ROW), dim=1, dtype=upcast))
        count = whole // _CPU_ROW
        if whole < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[whole:], dtype=upcast).reshape(1))
            count += 1
        rows.append(count)
    squares = torch.cat(parts).double().square()
    owner = torch.repeat_interleave(
        torch.arange(len(tensors)), torch.tensor(rows), output_size=squares.numel()
    )
    sums = torch.zeros(len(tensors), dtype=torch.float64).index_add_(0, owner, squares)
    return list(sums.sqrt().float().unbind(0))


def row_norms(tensor: Tensor) -> Tensor:
    """The Euclidean norm of each row along dim 0 of a tensor with at least two dimensions,
    in its compute dtype; on the CPU, rows longer than ``_CPU_SHORT`` are reduced in pieces
    of ``_CPU_ROW`` values added in float64, as in :func:`euclidean_norms`.

    Example:
        >>> row_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([5., 1.])
    """
    dtype = tensor.dtype
    norms: Tensor
    if dtype is torch.float64:
        norms = torch.linalg.vector_norm(tensor, dim=_row_dims(tensor.ndim))
        return norms
    acc = torch.float32
    count, length = tensor.shape[0], math.prod(tensor.shape[1:])
    if length <= _CPU_SHORT or not tensor.is_cpu:
        # The dtype only where it differs: vector_norm's dtype= costs a little per call.
        upcast = None if dtype is acc else acc
        norms = torch.linalg.vector_norm(tensor, dim=_row_dims(tensor.ndim), dtype=upcast)
        return norms
    rows = tensor.reshape(count, length)
    whole = length // _CPU_ROW * _CPU_ROW
    pieces = rows[:, :whole].reshape(count, -1, _CPU_ROW)
    squares = torch.linalg.vector_norm(pieces, dim=2, dtype=acc).double().square().sum(1)
    if whole < length:
        tail = torch.linalg.vector_norm(rows[:, whole:], dim=1, dtype=acc)
        squares = squares + tail.double().square()
    norms = squares.sqrt().to(acc)
    return norms


_ROW_DIMS: dict[int, tuple[int, ...]] = {}


def _row_dims(ndim: int) -> tuple[int, ...]:
    """Every dim but 0, made once per number of dimensions."""
    dims = _ROW_DIMS.get(ndim)
    if dims is None:
        dims = _ROW_DIMS[ndim] = tuple(range(1, ndim))
    return dims


def inverse_scale(grad_scale: Tensor, device: torch.device) -> Tensor:
    """``1 / grad_scale`` in float32 on ``device``, computed as GradScaler computes it."""
    return grad_scale.double().reciprocal().float().to(device)


def unscale_and_check_(
    tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor, foreach: bool | None
) -> None:
    """``t *= inv_scale`` and ``found_inf = 1`` where a ``t`` is not finite; no host sync."""
    if foreach is False:
        for tensor in tensors:
            compat.non_finite_check_and_unscale_([tensor], found_inf, inv_scale)
    else:
        compat.non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


# --- checks --------------------------------------------------------------------------------

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_param(param: object, where: str, technique: str) -> Tensor:
    if not isinstance(param, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(param).__name__}")
    if param.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"{where} must be a real floating-point tensor (float16, bfloat16, float32 or "
            f"float64), got dtype {param.dtype}; {technique} is defined for these only"
        )
    return param


def check_dense_grad(grad: Tensor, where: str, technique: str) -> None:
    if grad.layout != torch.strided:
        raise ValueError(
            f"{where} has a {grad.layout} gradient; {technique} needs dense gradients "
            "(use sparse=False in nn.Embedding / nn.EmbeddingBag). No gradient or parameter "
            "was changed"
        )


_USE_FSDP2 = (
    "Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard), whose DTensor parameters "
    "the hooks serve exactly: in Lightning, ModelParallelStrategy with fully_shard in "
    "configure_model; in accelerate, FullyShardedDataParallelPlugin(fsdp_version=2); in the HF "
    'Trainer, fsdp_config={"version": 2}. No gradient or parameter was changed'
)


def check_not_flattened(param: Tensor, where: str, technique: str) -> None:
    """Refuses FSDP1's and DeepSpeed ZeRO-3's flattened parameters, whose norms are wrong.

    Only called while FSDP1 or DeepSpeed is imported (``compat.fsdp1_possible``,
    ``compat.deepspeed_possible``): before that no tensor can be one.
    """
    flattening = compat.fsdp1_flattening(param)
    if flattening == "flat":
        raise ValueError(
            f"{where} is a FlatParameter of FSDP1 (FullyShardedDataParallel with "
            "use_orig_params=False): one flat tensor holding pieces of every parameter of a "
            f"wrapped module, while {technique} needs the norm of each parameter. " + _USE_FSDP2
        )
    if flattening in ("original", "view"):
        raise ValueError(
            f"{where} is a parameter of a module wrapped by FSDP1 (FullyShardedDataParallel "
            "with use_orig_params=True), a view into FSDP1's flat shard: on more than one rank "
            "each holds a flattened piece of it, whose norm is not the parameter's, and "
            f"{technique} cannot tell which ranks hold the rest. " + _USE_FSDP2
        )
    if compat.deepspeed_partitioned(param):
        raise ValueError(
            f"{where} is partitioned by DeepSpeed ZeRO-3 (it carries a ds_id): each rank holds "
            f"a flat piece of it, or of many parameters, while {technique} needs the norm of "
            "each parameter. Use DDP or FSDP2 (torch.distributed.fsdp.fully_shard), or "
            "DeepSpeed without ZeRO. No gradient or parameter was changed"
        )


def check_rows_are_local(param: Tensor, where: str, technique: str, prefix: str) -> None:
    """Refuses a DTensor whose rows along dim 0 are split across ranks.

    A Shard(0) tensor (FSDP2) holds whole rows, so a technique that works row by row needs no
    collective for them; 0-/1-D tensors are not split into rows.
    """
    dtensor = compat.dtensor_type()
    if dtensor is None or not isinstance(param, dtensor) or param.ndim < 2:
        return
    sharded: Any = param
    for mesh_dim, placement in enumerate(sharded.placements):
        dim = getattr(placement, "dim", 0)
        if placement.is_shard() and dim != 0 and sharded.device_mesh.size(mesh_dim) > 1:
            raise ValueError(
                f"{where} is a DTensor sharded on dim {dim} ({placement!r}); {technique}'s "
                "units are the rows along dim 0, which are whole on one rank only where a "
                "tensor is sharded on dim 0 (FSDP2's Shard(0)). Shard it on dim 0 or opt its "
                "param group out with "
                f'"{prefix}": False'
            )


def check_foreach(foreach: object) -> bool | None:
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be a bool or None, got foreach={foreach!r}")
    return foreach


# --- param groups for a model ---------------------------------------------------------------


def split_param_groups(
    model: object, prefix: str, leave_alone: Callable[[str, nn.Parameter], object]
) -> list[dict[str, Any]]:
    """A group of the model's parameters and one with ``{prefix: False}`` that the hook leaves
    alone: those for which ``leave_alone(name, param)`` is True. Empty groups are left out.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    taken: list[nn.Parameter] = []
    left: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        verdict = leave_alone(name, param)
        if not isinstance(verdict, bool):
            kind = type(verdict)
            raise TypeError(
                f"exclude must return a bool, got {kind.__module__}.{kind.__qualname__} for "
                f"parameter {name!r}"
            )
        (left if verdict else taken).append(param)
    groups: list[dict[str, Any]] = []
    if taken:
        groups.append({"params": taken})
    if left:
        groups.append({"params": left, prefix: False})
    return groups


# --- units: parameters that share a device, a dtype and a sharding ------------------------

_Reduce = tuple[Any, tuple[int, ...]]


@dataclass
class _Unit:
    """Parameters of one param group that share a device, a dtype and a sharding.

    ``positions`` are their places in the group's params list; ``reduce`` is the (mesh,
    sharded mesh dims) whose ranks hold other shards of them, or None.
    """

    positions: list[int]
    params: list[Tensor]
    dtensors: bool = False
    reduce: _Reduce | None = None
    reduce_key: Any = None
    copies: _Copies | None = None


@dataclass
class _Bound:
    """A unit at one step: its parameters with a gradient, as local tensors."""

    unit: _Unit
    positions: list[int]
    params: list[Tensor]
    grads: list[Tensor]
    # What the unit function reads and rewrites: the gradients, or their unscaled copies.
    sources: list[Tensor]
    norms: tuple[Tensor, Tensor] | None = None


def _sharding(param: Tensor, where: str, technique: str) -> _Reduce | None:
    """The (mesh, sharded mesh dims) of a DTensor parameter, after checking its placements."""
    sharded: Any = param
    mesh, placements = sharded.device_mesh, sharded.placements
    for placement in placements:
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(
                f"{where} has a {type(placement).__name__} placement ({placement}); "
                f"{technique} supports DTensors that are sharded or replicated on each mesh "
                "dimension (FSDP2, HSDP, tensor parallel), not partial ones"
            )
    dims = tuple(d for d, p in enumerate(placements) if p.is_shard() and mesh.size(d) > 1)
    return (mesh, dims) if dims else None


def _check_grad_layout(param: Tensor, grad: Tensor, where: str, technique: str) -> None:
    """A DTensor parameter's gradient must be a DTensor laid out alike."""
    dtensor = compat.dtensor_type()
    sharded: Any = param
    theirs: Any = grad
    mesh, placements = sharded.device_mesh, sharded.placements
    if not isinstance(grad, dtensor) or (theirs.device_mesh, theirs.placements) != (
        mesh,
        placements,
    ):
        layout = (
            f"{theirs.device_mesh} {theirs.placements}"
            if isinstance(grad, dtensor)
            else f"a plain {type(grad).__name__}"
        )
        raise ValueError(
            f"{where} is a DTensor on {mesh} with placements {placements}, but its gradient "
            f"is {layout}; {technique} needs both laid out alike"
        )


def _reduce_key(reduce: _Reduce, cache: dict[Any, Any]) -> Any:
    """The ranks of the process groups a sharded unit is reduced over, one tuple per dim.

    ``fully_shard`` without ``mesh=`` builds a new DeviceMesh per call, all over the same
    process group: keying on the groups' ranks, not the mesh object, gives one all-reduce for
    all of them. (Meshes compare by layout, so the cache is hit once per layout.)
    """
    key = cache.get(reduce)
    if key is None:
        mesh, dims = reduce
        key = cache[reduce] = tuple(
            tuple(torch.distributed.get_process_group_ranks(mesh.get_group(d))) for d in dims
        )
    return key


def _units(
    params: Sequence[Tensor], positions: Sequence[int], where: Callable[[int], str], technique: str
) -> list[_Unit]:
    """``params`` (at ``positions``) grouped by device, dtype and sharding, in order."""
    dtensor = compat.dtensor_type()
    units: dict[tuple[Any, ...], _Unit] = {}
    keys: dict[Any, Any] = {}
    for position, param in zip(positions, params, strict=True):
        reduce = None
        is_dtensor = dtensor is not None and isinstance(param, dtensor)
        if is_dtensor:
            reduce = _sharding(param, where(position), technique)
        reduce_key = None if reduce is None else _reduce_key(reduce, keys)
        local: Any = param.to_local() if is_dtensor else param  # type: ignore[attr-defined]
        key = (local.device, local.dtype, is_dtensor, reduce_key)
        unit = units.get(key)
        if unit is None:
            unit = units[key] = _Unit([], [], is_dtensor, reduce, reduce_key)
        unit.positions.append(position)
        unit.params.append(param)
    return list(units.values())


def _bind(unit: _Unit, where: Callable[[int], str], technique: str) -> _Bound | None:
    """The unit's parameters with a gradient at this step (None if there are none)."""
    grads: list[Any] = [p.grad for p in unit.params]
    positions, params = unit.positions, unit.params
    strided = torch.strided
    # One pass in the usual case: every parameter has a dense gradient.
    if any(g is None or g.layout is not strided for g in grads):
        kept = [i for i, g in enumerate(grads) if g is not None]
        if not kept:
            return None
        positions = [positions[i] for i in kept]
        params = [params[i] for i in kept]
        grads = [grads[i] for i in kept]
        for position, grad in zip(positions, grads, strict=True):
            if grad.layout is not strided:
                check_dense_grad(grad, where(position), technique)
    if unit.dtensors:
        for position, param, grad in zip(positions, params, grads, strict=True):
            _check_grad_layout(param, grad, where(position), technique)
        params = [p.to_local() for p in params]  # type: ignore[attr-defined]
        grads = [g.to_local() for g in grads]
    return _Bound(unit, positions, params, grads, grads)


def sum_over_shards(bound: Sequence[_Bound], squares: Mapping[int, Tensor]) -> dict[int, Tensor]:
    """Sums ``squares[i]``, local sums of squares of sharded ``bound[i]``, over their shards.

    All the units reduced over the same process groups are stacked and summed together: one
    all-reduce per sharded mesh dimension. Each total keeps its part's dtype.
    """
    together: dict[Any, list[int]] = {}
    for position in squares:
        together.setdefault(bound[position].unit.reduce_key, []).append(position)
    totals: dict[int, Tensor] = {}
    for positions in together.values():
        mesh, dims = bound[positions[0]].unit.reduce  # type: ignore[misc]
        parts = [squares[p] for p in positions]
        common = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
        stacked = torch.cat([part.to(common) for part in parts])
        for dim in dims:
            torch.distributed.all_reduce(stacked, group=mesh.get_group(dim))
        summed = torch.split(stacked, [p.numel() for p in parts])
        for position, total in zip(positions, summed, strict=True):
            totals[position] = total.to(squares[position].dtype)
    return totals


def _reduce_norms_(
    bound: Sequence[_Bound],
    pairs: Mapping[int, tuple[list[Tensor], list[Tensor]]],
    foreach: bool | None,
) -> None:
    """Sets ``bound[i].norms`` to the whole tensors' ``(||a||, ||b||)`` of ``pairs[i]``.

    The local sums of squares of every unit reduced over the same process groups are stacked
    and summed together: one all-reduce per sharded mesh dimension, and no tensor is gathered.
    """
    squares = {
        i: torch.cat([euclidean_norms(a, foreach), euclidean_norms(b, foreach)]).square()
        for i, (a, b) in pairs.items()
    }
    for i, total in sum_over_shards(bound, squares).items():
        first, second = total.sqrt().chunk(2)
        bound[i].norms = (first, second)


def _full_shapes(bound: _Bound) -> list[torch.Size]:
    """The shapes of ``bound``'s parameters as whole tensors (a DTensor's, not its shard's)."""
    full = dict(zip(bound.unit.positions, bound.unit.params, strict=True))
    return [full[position].shape for position in bound.positions]


def _in_order(per_unit: list[tuple[list[int], Tensor]]) -> Tensor:
    """The units' values as one tensor in the order of their positions, on the first unit's
    device."""
    if len(per_unit) == 1:
        return per_unit[0][1]
    device = per_unit[0][1].device
    dtype = torch.float64 if any(v.dtype == torch.float64 for _, v in per_unit) else torch.float32
    by_position = {
        position: value
        for positions, values in per_unit
        for position, value in zip(positions, values.to(device, dtype).unbind(0), strict=True)
    }
    return torch.stack([by_position[p] for p in sorted(by_position)])


# --- the plan: what is checked and grouped once per param-group layout -------------------------


_DTYPE = operator.attrgetter("dtype")
_PLAIN = (Tensor, nn.Parameter)


@dataclass
class _GroupPlan:
    """One param group as planned: what it was then, and its settings and units.

    ``fingerprint`` is None where the group cannot be fingerprinted (tensor subclasses other
    than plain tensors): it is then planned again at every step.
    """

    group: Mapping[str, Any]
    params: list[Any]
    items: dict[str, object]
    settings: Settings | None
    units: list[_Unit]
    where: Callable[[int], str]
    fingerprint: tuple[list[torch.dtype], list[int]] | None = None

    def holds(self, group: Mapping[str, Any]) -> bool:
        """Whether ``group`` is still what was planned (no tensor value is read)."""
        if group is not self.group or not _same_items(group, self.items):
            return False
        return self.settings is None or self.same_params(group["params"])

    def same_params(self, params: Sequence[Any]) -> bool:
        """Whether ``params`` are the planned parameters, with their dtypes and addresses."""
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return False
        return self.fingerprint is not None and self.fingerprint == _fingerprint(params)


def _items(group: Mapping[str, Any]) -> dict[str, object]:
    return {key: value for key, value in group.items() if key != "params"}


def _same_items(group: Mapping[str, Any], items: Mapping[str, object]) -> bool:
    """The group's entries other than params are the objects planned (compared by identity:
    equality would read a tensor lr back to the host)."""
    if len(group) != len(items) + 1:
        return False
    missing = object()
    return all(group.get(key, missing) is value for key, value in items.items())


def _fingerprint(params: Sequence[Tensor]) -> tuple[list[torch.dtype], list[int]]:
    """Each parameter's dtype and address: a ``.data =`` that moves it, converts it or swaps
    its storage changes one of them."""
    return list(map(_DTYPE, params)), list(map(Tensor.data_ptr, params))


def _namer(group_index: int) -> Callable[[int], str]:
    return lambda position: f"parameter {position} of param group {group_index}"


# --- the hook ------------------------------------------------------------------------------

# The optimizer wrappers that frameworks hand to user code, by the module and name of a class
# in their MRO (so subclasses count, accelerate's DeepSpeedOptimizerWrapper included), and the
# attribute holding the optimizer whose step they run. Matched by name: nothing is imported.
_FRAMEWORK_WRAPPERS = {
    ("accelerate.optimizer", "AcceleratedOptimizer"): "optimizer",
    ("lightning.pytorch.core.optimizer", "LightningOptimizer"): "_optimizer",
    ("pytorch_lightning.core.optimizer", "LightningOptimizer"): "_optimizer",
}


def _unwrap(optimizer: object) -> object:
    """The optimizer inside accelerate's and Lightning's wrappers (nested ones too)."""
    while True:
        attribute = next(
            (
                _FRAMEWORK_WRAPPERS[key]
                for cls in type(optimizer).__mro__
                if (key := (cls.__module__, cls.__qualname__)) in _FRAMEWORK_WRAPPERS
            ),
            None,
        )
        inner = None if attribute is None else getattr(optimizer, attribute, None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner


def _hooks_on(optimizer: torch.optim.Optimizer) -> list[tuple[int, StepHook]]:
    """The step hooks whose pre-step is in ``optimizer``'s hook dict, with their handle ids.

    The dict, not the Python object, is what a step runs: a wrapper that forwards its
    attributes shares the dict of the optimizer it wraps.
    """
    found = []
    for key, hook in compat.step_pre_hooks(optimizer):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, StepHook) and getattr(hook, "__name__", None) == "_pre_step":
            found.append((key, owner))
    return found


def _wrapped(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that ``optimizer`` holds in ``.optimizer`` and steps, innermost last.

    pytorch_optimizer's Lookahead and ScheduleFreeWrapper, for instance, hold the optimizer
    they step there.
    """
    chain: list[torch.optim.Optimizer] = []
    current: object = optimizer
    while True:
        inner = getattr(current, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer or inner in chain:
            return chain
        chain.append(inner)
        current = inner


def _held_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`` (its .name, a Class)`` for an optimizer that ``optimizer`` holds, or ''."""
    for name, value in vars(optimizer).items():
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer:
            return f" (its .{name}, a {type(value).__name__})"
    return ""


@dataclass
class _Pending:
    """What an update hook's pre-step keeps for its post-step: each group's units at this
    step (their ``sources`` the old values) and each group's settings and lr."""

    bound: Sequence[Sequence[_Bound]]
    jobs: list[tuple[Settings | None, Lr]]
    held: list[_Copies]


class StepHook:
    r"""Base of the step hooks: a technique run in any optimizer's step, through its hooks.

    A subclass derives from its technique's :class:`Settings` too, declares what it
    rewrites, ``prefix`` and ``technique``, and implements ``_unit_``; see the module
    docstring.

    What the base does, the same for every technique:

    - :meth:`attach` unwraps accelerate's and Lightning's optimizer wrappers, registers the
      hook with ``register_step_pre_hook`` (and, for a hook on the updates,
      ``register_step_post_hook``) and returns the
      :class:`~torch.utils.hooks.RemovableHandle`. Refused: optimizers whose ``step`` runs no
      step hook (a subclass that skips ``Optimizer.__init__``, like timm's ``Lookahead``);
      LBFGS (it evaluates its closure many times per step); optimizers that step a
      ``base_optimizer`` (SAM and its kin: the hook belongs on ``base_optimizer``); for a hook
      on the updates, optimizers that step the one they hold in ``.optimizer`` (Lookahead);
      DeepSpeed's optimizers; and a second hook of the same technique in the optimizer's
      step-hook dict or in that of an optimizer it wraps (it would apply the technique twice).
    - Every param group that takes part, and its parameters, is checked when attaching and
      again before each step where the group changed (groups may be added, their settings
      and params edited), with one function, before anything changes; a group that opts out
      is left alone. FSDP1's flattened parameters and DeepSpeed ZeRO-3's partitions are
      refused: their norms are not the parameters'. Validation, grouping and settings are
      planned once per param-group layout and reused while nothing of it changed: the
      groups and their entries (by identity), each parameter's identity, dtype and address.
    - ``step(closure)``: the hook evaluates the closure itself, rewrites the fresh gradients
      and hands the optimizer a closure that returns that loss once, and raises if the
      optimizer calls it after changing the parameters (SAM's second pass would get no
      gradients).
    - Parameters are grouped per param group, device, dtype and sharding; DTensor parameters
      (FSDP2, HSDP, tensor parallel) get the norms of their full tensors, with one all-reduce
      per sharded mesh dimension for all of them. On the CPU, long tensors are reduced in
      rows whose sums of squares are added in float64 (:func:`euclidean_norms`).
    - AMP with a fused optimizer: ``GradScaler.step`` sets ``optimizer.grad_scale`` and
      ``optimizer.found_inf`` and leaves the gradients scaled, for the fused step to unscale.
      A hook on the gradients then computes from the scaled gradients divided by the scale,
      in float32, and writes the *unscaled* result into ``.grad`` (rounded once); it
      unscales the gradients of groups that opt out too; then it sets
      ``optimizer.grad_scale = None``, so the fused step does not divide again, and sets
      ``optimizer.found_inf`` to 1 where a value it read or wrote is not finite, so that an
      overflow still skips the step. (An overflow in the hook's result, not in the scaled
      gradients, does not lower the scaler's scale.) This is GradScaler's private protocol,
      reached through ``_torch_compat``. A hook on the updates leaves it to the fused step.
      Ordinary optimizers under GradScaler see unscaled gradients and need none of it.
    - ``foreach``: None and True take ``torch._foreach_*`` ops, False one tensor at a time
      (for tensor types the multi-tensor ops refuse).
    - Nothing is read back to the host: the hook traces under ``torch.compile(fullgraph=True)``.
    """

    prefix: ClassVar[str]
    technique: ClassVar[str]
    rewrites: ClassVar[Literal["gradients", "updates"]] = "gradients"
    scaled_gradients: ClassVar[bool] = False
    full_shapes: ClassVar[bool] = False
    row_wise: ClassVar[bool] = False
    whole_norms: ClassVar[bool] = True
    _settings_class: ClassVar[type[Settings]]
    _unit_: ClassVar[UnitFunction[Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._settings_class = next(base for base in cls.__mro__ if Settings in base.__bases__)

    def __init__(self, *, foreach: bool | None = None, **settings: object) -> None:
        for name, value in self._settings_class._checked_values(settings).items():
            # The settings are frozen fields: set once, here.
            object.__setattr__(self, name, value)
        self._foreach = check_foreach(foreach)
        self._last_values: list[Tensor] = []
        self._warned: weakref.WeakKeyDictionary[torch.optim.Optimizer, set[int]] = (
            weakref.WeakKeyDictionary()
        )
        self._plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_GroupPlan]] = (
            weakref.WeakKeyDictionary()
        )
        self._pending: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Pending] = (
            weakref.WeakKeyDictionary()
        )

    def _check_group(self, group: Mapping[str, Any], settings: Any) -> str | None:
        """Raises for a param group the technique cannot serve; returns a warning or None.

        Reads the group's entries only: what concerns each parameter is in ``_check_param``.
        """
        return None

    @classmethod
    def _check_param(cls, param: Tensor, where: str) -> None:
        """Raises for a parameter the technique cannot serve (its dtype and layout)."""

    def _as_settings(self) -> Settings:
        """The hook's own settings: a hook is an instance of its settings class."""
        return cast(Settings, self)

    @property
    def foreach(self) -> bool | None:
        """True or None: multi-tensor ops; False: one tensor at a time."""
        return self._foreach

    @classmethod
    def _key(cls, name: str) -> str:
        """The param-group key that overrides the setting ``name``."""
        return name if name.startswith(cls.prefix + "_") else f"{cls.prefix}_{name}"

    # --- attaching ---------------------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Registers the hook with ``optimizer.register_step_pre_hook``.

        The optimizer's class, ``state_dict`` and LR schedulers are untouched; remove the hook
        with the returned handle's ``remove()``. The wrappers that frameworks hand to user
        code are unwrapped, and the hook is registered on the optimizer whose step they run:
        accelerate's ``AcceleratedOptimizer`` (what an HF ``TrainerCallback`` receives) and
        Lightning's ``LightningOptimizer`` (what ``LightningModule.optimizers()`` returns).

        Args:
            optimizer: any instance of :class:`torch.optim.Optimizer`, or one of the
                wrappers above.

        Returns:
            The handle of the registered pre-hook; for a hook on the updates, one handle
            whose ``remove()`` removes both its hooks.
        """
        target = self._optimizer_to_hook(optimizer)
        self._refuse_a_second_one(target)
        self._plan(target)
        handle = target.register_step_pre_hook(self._pre_step)
        if self.rewrites == "updates":
            handle = compat.joined_handle(handle, target.register_step_post_hook(self._after_step))
        return handle

    def _optimizer_to_hook(self, given: object) -> torch.optim.Optimizer:
        """``given`` unwrapped, after refusing the optimizers whose step the hook cannot
        serve."""
        name = type(self).__name__
        optimizer = _unwrap(given)
        if not isinstance(optimizer, torch.optim.Optimizer):
            if compat.is_deepspeed(optimizer):
                raise TypeError(
                    f"optimizer is DeepSpeed's {type(optimizer).__name__}, not a "
                    "torch.optim.Optimizer: DeepSpeed's ZeRO and fp16/bf16 optimizers step "
                    "flat tensors that hold pieces of many parameters, so the norms "
                    f"{name} needs do not exist there, and attaching to the torch optimizer "
                    "inside it (its .optimizer) would be silently wrong. Use DDP or FSDP2 "
                    "(torch.distributed.fsdp.fully_shard), or DeepSpeed without ZeRO and "
                    "without its fp16/bf16 modes, where the engine steps your own optimizer"
                )
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(given).__name__}"
            )
        if not compat.step_runs_hooks(optimizer):
            raise TypeError(
                f"{name} cannot be attached to {type(optimizer).__name__}: its step runs no "
                "step hooks (torch.optim.Optimizer.__init__, which wraps a class's step so "
                f"that it runs them, was never called for it), so {name} would be silently "
                f"ignored. Attach {name} to the optimizer it wraps and steps"
                f"{_held_optimizer(optimizer)}"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                f"{name} cannot be attached to LBFGS: LBFGS evaluates its closure many times "
                "per step, and the hook can only rewrite the gradients of one evaluation"
            )
        base = getattr(optimizer, "base_optimizer", None)
        if isinstance(base, torch.optim.Optimizer) and base is not optimizer:
            raise TypeError(
                f"{name} cannot be attached to {type(optimizer).__name__}, which steps a "
                f"base_optimizer ({type(base).__name__}): like SAM, it moves the parameters, "
                "evaluates its closure there and then has base_optimizer step with those "
                f"gradients, which the hook would never see. Attach {name} to "
                "optimizer.base_optimizer: its step takes exactly those gradients, at the "
                "restored parameters"
            )
        inner = _wrapped(optimizer)
        if inner and self.rewrites == "updates":
            raise TypeError(
                f"{name} cannot be attached to {type(optimizer).__name__}, which steps the "
                f"{type(inner[0]).__name__} it wraps (its .optimizer) and may move the "
                f"parameters itself (as Lookahead does): {name} rescales the change of the "
                "parameters over the whole step and would rescale that too. Attach it to "
                "optimizer.optimizer"
            )
        return optimizer

    def _refuse_a_second_one(self, optimizer: torch.optim.Optimizer) -> None:
        """Raises if a hook of this technique is on ``optimizer``'s hook dict already, or on
        that of an optimizer it wraps (which its step steps: both would apply).

        Keyed by the technique's prefix, so a subclass cannot slip in a second one either.
        """
        name = type(self).__name__
        for _, other in _hooks_on(optimizer):
            if other.prefix != self.prefix:
                continue
            if other is self:
                raise RuntimeError(
                    f"this {name} is already attached to this {type(optimizer).__name__}; "
                    "remove the first handle before attaching it again"
                )
            raise RuntimeError(
                f"another {name} ({other!r}) is already attached to this "
                f"{type(optimizer).__name__}; two would apply {self.technique} twice. Remove "
                "the first one with its handle's remove() before attaching this one"
            )
        self._refuse_one_inside(optimizer)

    def _refuse_one_inside(self, optimizer: torch.optim.Optimizer) -> None:
        """Raises if a hook of this technique is on an optimizer that ``optimizer`` wraps.

        Checked again at each step: the inner hook may be attached after the outer one.
        """
        inner = _wrapped(optimizer)
        if not inner:
            return
        own = {key for key, _ in _hooks_on(optimizer)}
        for wrapped in inner:
            for key, other in _hooks_on(wrapped):
                if key not in own and other.prefix == self.prefix:
                    raise RuntimeError(
                        f"a {type(other).__name__} is attached to the "
                        f"{type(wrapped).__name__} that {type(optimizer).__name__} wraps and "
                        f"steps (its .optimizer), and a {type(self).__name__} to "
                        f"{type(optimizer).__name__} itself: the two would apply "
                        f"{self.technique} twice. Keep one of them"
                    )

    # --- planning ----------------------------------------------------------------------

    def _plan(self, optimizer: torch.optim.Optimizer) -> list[_GroupPlan]:
        """Every param group as planned, after checking what changed since the last plan.

        Under ``torch.compile`` everything is planned afresh: the fingerprint reads tensor
        addresses, which a trace cannot.
        """
        groups = optimizer.param_groups
        if torch.compiler.is_compiling():
            return self._new_plan(optimizer, groups, [])
        old = self._plans.get(optimizer)
        if (
            old is not None
            and len(old) == len(groups)
            and all(plan.holds(group) for plan, group in zip(old, groups, strict=True))
        ):
            return old
        plan = self._new_plan(optimizer, groups, old or [])
        self._plans[optimizer] = plan
        return plan

    def _new_plan(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[Mapping[str, Any]],
        old: Sequence[_GroupPlan],
    ) -> list[_GroupPlan]:
        """Plans every group (reusing the units of groups whose parameters did not change),
        checks that no parameter is in two groups that take part, and changes nothing."""
        plans = []
        for index, group in enumerate(groups):
            settings = self._group_settings(optimizer, group, index)
            previous = old[index] if index < len(old) else None
            plans.append(self._plan_group(group, index, settings, previous))
        seen: dict[int, tuple[int, int]] = {}
        for index, plan in enumerate(plans):
            if plan.settings is None:
                continue
            for position, param in enumerate(plan.params):
                first = seen.setdefault(id(param), (index, position))
                if first != (index, position):
                    # torch's add_param_group refuses this, but param_groups can be edited.
                    raise ValueError(
                        f"parameter {position} of param group {index} is the same tensor as "
                        f"parameter {first[1]} of param group {first[0]}; {self.technique} "
                        "would be applied to it twice"
                    )
        return plans

    def _plan_group(
        self,
        group: Mapping[str, Any],
        index: int,
        settings: Settings | None,
        previous: _GroupPlan | None,
    ) -> _GroupPlan:
        params = list(group["params"])
        where = _namer(index)
        if settings is None:
            return _GroupPlan(group, params, _items(group), None, [], where)
        if previous is not None and previous.settings is not None and previous.same_params(params):
            return _GroupPlan(
                group, params, _items(group), settings, previous.units, where, previous.fingerprint
            )
        positions = range(len(params))
        self._check_params(params, positions, where)
        units = _units(params, positions, where, self.technique)
        fingerprint = None
        # A trace cannot read addresses; and under it nothing is kept from one step to the next.
        if not torch.compiler.is_compiling() and all(type(p) in _PLAIN for p in params):
            fingerprint = _fingerprint(params)
        return _GroupPlan(group, params, _items(group), settings, units, where, fingerprint)

    @classmethod
    def _check_params(
        cls, params: Sequence[object], positions: Iterable[int], where: Callable[[int], str]
    ) -> None:
        foreign = compat.fsdp1_possible() or compat.deepspeed_possible()
        for position, param in zip(positions, params, strict=True):
            tensor = check_param(param, where(position), cls.technique)
            if foreign and compat.may_carry_marks(tensor):
                check_not_flattened(tensor, where(position), cls.technique)
            if cls.row_wise:
                check_rows_are_local(tensor, where(position), cls.technique, cls.prefix)
            cls._check_param(tensor, where(position))

    def _group_settings(
        self, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], index: int
    ) -> Settings | None:
        prefix = self.prefix
        enabled = group.get(prefix, True)
        if not isinstance(enabled, bool):
            raise TypeError(
                f'param group {index}: "{prefix}" must be a bool, got "{prefix}"={enabled!r}'
            )
        names = {self._key(name): name for name in self._settings_class._names()}
        overrides = {}
        for key, value in group.items():
            if key.startswith(prefix + "_"):
                if key not in names:
                    raise ValueError(
                        f"param group {index}: unknown key '{key}'; expected one of "
                        + ", ".join(f"'{k}'" for k in names)
                    )
                overrides[names[key]] = value
        if not enabled:
            return None
        settings: Settings = self._as_settings()
        try:
            if overrides:
                merged = {name: getattr(self, name) for name in self._settings_class._names()}
                settings = self._settings_class._checked(merged | overrides, self._key)
            warning = self._check_group(group, settings)
        except (TypeError, ValueError) as error:
            raise type(error)(f"param group {index}: {error}") from None
        if warning is not None:
            warned = self._warned.setdefault(optimizer, set())
            if index not in warned:
                warned.add(index)
                warnings.warn(f"param group {index}: {warning}", UserWarning, stacklevel=5)
        return settings

    # --- the step ----------------------------------------------------------------------

    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        name = type(self).__name__
        if "grad_scaler" in kwargs:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step received a grad_scaler argument (the "
                f"deprecated GradScaler protocol); {name} cannot tell whether those "
                "gradients are scaled. Use an optimizer without a grad_scaler parameter"
            )
        scaling = compat.fused_grad_scaling(optimizer)
        try:
            return self._checked_pre_step(optimizer, args, kwargs, scaling)
        except BaseException:
            if scaling is not None:
                scaling.discard()
            raise

    def _checked_pre_step(
        self,
        optimizer: torch.optim.Optimizer,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        scaling: compat.FusedGradScaling | None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # Everything that does not depend on the gradients is checked before the closure runs,
        # for every hook on this optimizer, so a bad param group leaves the model untouched
        # whichever hook it concerns (hooks run one after the other).
        if not torch.compiler.is_compiling():
            self._refuse_one_inside(optimizer)
            for _, hook in _hooks_on(optimizer):
                if hook is not self:
                    hook._plan(optimizer)
        plan = self._plan(optimizer)
        closure, args, kwargs = _take_closure(args, kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bound: list[list[_Bound]] = []
        for group_plan in plan:
            units = [_bind(unit, group_plan.where, self.technique) for unit in group_plan.units]
            bound.append([b for b in units if b is not None])
        with torch.no_grad():
            if self.rewrites == "gradients":
                self._rewrite_gradients_(optimizer, plan, bound, scaling)
            else:
                self._keep_old_values(optimizer, plan, bound)
        if closure is None:
            return None
        watched = (
            []
            if torch.compiler.is_compiling()
            else [
                p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
            ]
        )
        kwargs["closure"] = _SingleUseClosure(loss, optimizer, type(self).__name__, watched)
        return args, kwargs

    def _rewrite_gradients_(
        self,
        optimizer: torch.optim.Optimizer,
        plan: Sequence[_GroupPlan],
        bound: Sequence[Sequence[_Bound]],
        scaling: compat.FusedGradScaling | None,
    ) -> None:
        jobs = [(group_plan.settings, group_plan.group.get("lr")) for group_plan in plan]
        self._last_values = self._run_gradients_(jobs, bound, scaling, self._foreach)
        if scaling is not None:
            skipped = [
                p
                for group_plan in plan
                if group_plan.settings is None
                for p in group_plan.group["params"]
                if p.grad is not None
            ]
            self._unscale_skipped_(skipped, scaling)
            scaling.mark_unscaled()

    @classmethod
    def _run_gradients_(
        cls,
        jobs: Sequence[tuple[Settings | None, Lr]],
        bound: Sequence[Sequence[_Bound]],
        scaling: compat.FusedGradScaling | None,
        foreach: bool | None,
    ) -> list[Tensor]:
        """The technique on every unit's gradients; each group's values, in order.

        Under the fused AMP protocol a unit function that does not take scaled gradients gets
        them unscaled (float16/bfloat16 ones as float32 copies, written back rounded once),
        and what it read and wrote is checked for inf/NaN.
        """
        flat = [b for of_group in bound for b in of_group]
        flags: dict[torch.device, Tensor] = {}

        def flag_of(b: _Bound) -> Tensor:
            device = b.grads[0].device
            if device not in flags:
                flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            return flags[device]

        handled = scaling is not None and not cls.scaled_gradients
        if scaling is not None and handled:
            for b in flat:
                b.sources = _unscaled_(b.grads, scaling.scale, flag_of(b), foreach)
        if cls.whole_norms:
            sharded = {i: (b.params, b.sources) for i, b in enumerate(flat) if b.unit.reduce}
            _reduce_norms_(flat, sharded, foreach)
        results: list[Tensor] = []
        for (settings, lr), of_group in zip(jobs, bound, strict=True):
            per_unit = []
            for b in of_group:
                extra: dict[str, Any] = {}
                if scaling is not None and cls.scaled_gradients:
                    extra = {"grad_scale": scaling.scale, "found_inf": flag_of(b)}
                values = cls._unit_(
                    b.params, b.sources, settings, lr, norms=b.norms, foreach=foreach, **extra
                )
                if handled:
                    _written_(b.grads, b.sources, flag_of(b), foreach)
                if values is not None:
                    per_unit.append((b.positions, values))
            results.append(_in_order(per_unit) if per_unit else torch.empty(0))
        if scaling is not None and scaling.found_inf is not None:
            found_inf = scaling.found_inf
            # A max, never a sum: fused steps test found_inf == 1 and subtract it from step
            # counts.
            for flag in flags.values():
                found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
        return results

    def _keep_old_values(
        self,
        optimizer: torch.optim.Optimizer,
        plan: Sequence[_GroupPlan],
        bound: Sequence[Sequence[_Bound]],
    ) -> None:
        """An update hook's pre-step: the old value of every parameter that takes part, in its
        unit's buffer."""
        held = []
        compiling = torch.compiler.is_compiling()
        for of_group in bound:
            for b in of_group:
                if compiling:
                    # Nothing outlives a trace, and it cannot read a storage's size.
                    b.sources = _fresh_copies(b.params, self._foreach)
                    continue
                copies = b.unit.copies
                if copies is None or not copies.fits(b.params):
                    copies = b.unit.copies = _Copies(b.params)
                b.sources = copies.hold(b.params, self._foreach)
                held.append(copies)
        jobs = [(group_plan.settings, group_plan.group.get("lr")) for group_plan in plan]
        self._pending[optimizer] = _Pending(bound, jobs, held)

    def _after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """An update hook's post-step: every unit's norms (the old parameters', then the
        revert's), one all-reduce for all the sharded units, then the technique."""
        pending = self._pending.pop(optimizer, None)
        if pending is None:
            return
        flat = [b for of_group in pending.bound for b in of_group]
        foreach = self._foreach
        with torch.no_grad():
            squares = {}
            for i, b in enumerate(flat):
                olds = b.sources
                w_norm = euclidean_norms(olds, foreach)
                if foreach is False:
                    for old, param in zip(olds, b.params, strict=True):
                        old.sub_(param)
                else:
                    compat.foreach_sub_(olds, b.params)
                b.norms = (w_norm, euclidean_norms(olds, foreach))
                if b.unit.reduce:
                    squares[i] = torch.cat(b.norms).square()
            for i, total in sum_over_shards(flat, squares).items():
                w_norm, d_norm = total.sqrt().chunk(2)
                flat[i].norms = (w_norm, d_norm)
            results = []
            for (settings, lr), of_group in zip(pending.jobs, pending.bound, strict=True):
                per_unit = []
                for b in of_group:
                    extra = {"shapes": _full_shapes(b)} if self.full_shapes else {}
                    values = type(self)._unit_(
                        b.params, b.sources, settings, lr, norms=b.norms, foreach=foreach, **extra
                    )
                    if values is not None:
                        per_unit.append((b.positions, values))
                results.append(_in_order(per_unit) if per_unit else torch.empty(0))
            self._last_values = results
        for copies in pending.held:
            copies.release()

    def _unscale_skipped_(self, params: list[Tensor], scaling: compat.FusedGradScaling) -> None:
        """Unscales the gradients the technique left alone, since the step will not.

        As ``GradScaler.unscale_`` does: a sparse gradient's values are unscaled (float16 ones
        coalesced first, so that values summed there are checked for overflow).
        """
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        dtensor = compat.dtensor_type()
        for param in params:
            grad: Any = param.grad
            if dtensor is not None and isinstance(grad, dtensor):
                grad = grad.to_local()
            if grad.is_sparse:
                if grad.dtype == torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = compat.sparse_values(grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in groups.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            unscale_and_check_(grads, flag, inverse_scale(scaling.scale, device), self._foreach)
            if scaling.found_inf is not None:
                found_inf = scaling.found_inf
                found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))

    # --- the functional form -----------------------------------------------------------

    @classmethod
    def _apply_to_parameters_(
        cls, parameters: Tensor | Iterable[Tensor], settings: Settings, foreach: bool | None
    ) -> Tensor | None:
        """The functional form of a hook on the gradients: the technique on every ``.grad``.

        Parameters without a gradient are skipped; the values come back in parameter order.
        """
        if isinstance(parameters, Tensor):
            parameters = [parameters]
        elif not isinstance(parameters, Iterable):
            raise TypeError(
                "parameters must be a tensor or an iterable of tensors, "
                f"got {type(parameters).__name__}"
            )
        check_foreach(foreach)
        given = list(parameters)

        def where(position: int) -> str:
            return f"parameters[{position}]"

        cls._check_params(given, range(len(given)), where)
        positions, with_grad = [], []
        for position, param in enumerate(given):
            if param.grad is not None:
                check_dense_grad(param.grad, where(position), cls.technique)
                positions.append(position)
                with_grad.append(param)
        seen: dict[int, int] = {}
        for position, param in zip(positions, with_grad, strict=True):
            first = seen.setdefault(id(param), position)
            if first != position:
                raise ValueError(
                    f"{where(position)} is the same tensor as {where(first)}; {cls.technique} "
                    "would be applied to it twice"
                )
        units = _units(with_grad, positions, where, cls.technique)
        bound = [b for b in (_bind(unit, where, cls.technique) for unit in units) if b is not None]
        with torch.no_grad():
            (values,) = cls._run_gradients_([(settings, None)], [bound], None, foreach)
        return values


def _unscaled_(
    grads: list[Tensor], scale: Tensor, flag: Tensor, foreach: bool | None
) -> list[Tensor]:
    """The true gradients of scaled ``grads``: unscaled in place, or float32 copies of
    float16/bfloat16 ones (whose small values the scale alone keeps in range); ``flag`` is
    raised where a scaled gradient is not finite."""
    inv_scale = inverse_scale(scale, grads[0].device)
    if grads[0].dtype in HALF_DTYPES:
        sources = [g.float() for g in grads]
        unscale_and_check_(sources, flag, inv_scale, foreach)
        return sources
    unscale_and_check_(grads, flag, inv_scale, foreach)
    return grads


def _written_(
    grads: list[Tensor], sources: list[Tensor], flag: Tensor, foreach: bool | None
) -> None:
    """Writes float32 results back into their gradients (rounded once), and raises ``flag``
    where a written value is not finite."""
    if sources is not grads:
        for grad, source in zip(grads, sources, strict=True):
            grad.copy_(source)
    # GradScaler's check-and-unscale op, by one: torch has no other multi-tensor check.
    unscale_and_check_(grads, flag, torch.ones_like(flag), foreach)


class _Copies:
    """Where an update hook keeps a unit's old parameter values during a step: one flat buffer
    and a view of it shaped like each parameter.

    It is made for one device, dtype and list of shapes, and used again while the unit's
    parameters have them (:meth:`fits`); every step copies the values in afresh, so nothing
    of an earlier step is ever read. On the CPU the buffer is kept between steps: glibc would
    hand a block that large back to the system at each free, and the next step would fault
    every page in again. Elsewhere its memory goes back to the caching allocator after each
    step (the storage is resized to 0 and back, which keeps the views), so that between steps
    it costs none.
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self._layout = _layout(tensors)
        numels = [t.numel() for t in tensors]
        self._flat = torch.empty(sum(numels), dtype=tensors[0].dtype, device=tensors[0].device)
        self._bytes = self._flat.untyped_storage().nbytes()
        self._keep = self._flat.device.type == "cpu"
        self._views = [
            view.view(t.shape)
            for view, t in zip(torch.split(self._flat, numels), tensors, strict=True)
        ]

    def fits(self, tensors: list[Tensor]) -> bool:
        return _layout(tensors) == self._layout

    def hold(self, tensors: list[Tensor], foreach: bool | None) -> list[Tensor]:
        """Copies ``tensors`` in; returns the views holding them."""
        storage = self._flat.untyped_storage()
        if storage.nbytes() != self._bytes:
            storage.resize_(self._bytes)
        _copy_(self._views, tensors, foreach)
        return self._views

    def release(self) -> None:
        if not self._keep:
            self._flat.untyped_storage().resize_(0)


def _layout(tensors: list[Tensor]) -> tuple[object, ...]:
    return (tensors[0].device, tensors[0].dtype, *(t.shape for t in tensors))


def _fresh_copies(tensors: list[Tensor], foreach: bool | None) -> list[Tensor]:
    copies = [torch.empty_like(t) for t in tensors]
    _copy_(copies, tensors, foreach)
    return copies


def _copy_(targets: list[Tensor], sources: list[Tensor], foreach: bool | None) -> None:
    if foreach is False:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
    else:
        compat.foreach_copy_(targets, sources)


class _SingleUseClosure:
    """Hands the optimizer the loss of a closure the hook already evaluated.

    The gradients of that evaluation are the ones the hook rewrote: an optimizer that moves
    the parameters before calling its closure (SAM's two passes) expects new gradients, and
    would silently step with none. ``params`` (the parameters with a gradient) are watched
    through their version counters, which every in-place change bumps.
    """

    def __init__(
        self, loss: Any, optimizer: torch.optim.Optimizer, hook_name: str, params: list[Tensor]
    ) -> None:
        self._loss = loss
        self._optimizer_name = type(optimizer).__name__
        self._hook_name = hook_name
        self._calls = 0
        self._params = params
        self._versions = compat.versions(params)

    def __call__(self) -> Any:
        self._calls += 1
        if compat.versions(self._params) != self._versions:
            raise RuntimeError(
                f"{self._optimizer_name} changed the parameters and then called its closure "
                f"(as SAM-style optimizers do); {self._hook_name} evaluated that closure before "
                "the step, when torch runs step pre-hooks, so the loss it returns comes with no "
                f"gradients at the new parameters. The parameters are left where "
                f"{self._optimizer_name} moved them. Attach {self._hook_name} to the optimizer "
                "that takes the final step with those gradients (a SAM-style optimizer's "
                "base_optimizer)"
            )
        if self._calls > 1:
            raise RuntimeError(
                f"{self._optimizer_name} called its closure more than once in one step; "
                f"{self._hook_name} rewrites the gradients of a single evaluation, so it cannot "
                "be used with optimizers that re-evaluate the loss (such as LBFGS)"
            )
        return self._loss


def _take_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[[], Any] | None, tuple[Any, ...], dict[str, Any]]:
    """Splits ``optimizer.step``'s closure from its other arguments.

    ``args`` starts with the optimizer itself (the hook sees ``step``'s bound arguments).
    """
    kwargs = dict(kwargs)
    if "closure" in kwargs:
        return kwargs.pop("closure"), args, kwargs
    if len(args) > 1:
        return args[1], args[:1] + args[2:], kwargs
    return None, args, kwargs
