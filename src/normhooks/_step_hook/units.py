"""Units: the parameters of one param group that share a device, a dtype and a sharding.

A unit is what a technique's unit function is called on; a bound unit is a unit at one
step, its parameters with a gradient. Sharded units get the norms of their whole tensors
with one all-reduce per sharded mesh dimension for all of them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._step_hook.checks import all_plain, check_dense_grad, check_grad_placements
from normhooks._step_hook.copies import _Copies
from normhooks._step_hook.norms import euclidean_norms
from normhooks._step_hook.steady import Steady, retaken

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
    # The unit's tensors as at the last step (see steady.Steady), and how many records were
    # made in a row that no step used.
    steady: Steady | None = None
    misses: int = 0


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
    # The unit's record where it holds at this step (its parameters bound as recorded).
    steady: Steady | None = None


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


def _reduce_key(reduce: _Reduce, cache: dict[Any, Any]) -> Any:
    """The ranks of the process groups a sharded unit is reduced over, one tuple per dim.

    ``fully_shard`` without ``mesh=`` builds a new DeviceMesh per call, all over the same
    process group: keying on the groups' ranks, not the mesh object, gives one all-reduce for
    all of them. (Meshes compare by their devices and ranks, so the cache is hit once per mesh.)
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


_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")


def _all_dense(grads: list[Any]) -> bool:
    """Whether every one of ``grads`` is a dense (strided) tensor, in one C-level pass: None,
    a missing gradient, has no layout."""
    try:
        return all(map(operator.is_, map(_LAYOUT, grads), repeat(torch.strided)))
    except AttributeError:
        return False


def _bind(unit: _Unit, where: Callable[[int], str], technique: str) -> _Bound | None:
    """The unit's parameters with a gradient at this step (None if there are none).

    Read afresh at every step, never kept: which parameters have a gradient, and that each is
    dense (a kept gradient would also keep its memory after ``zero_grad()``).
    """
    positions, params = unit.positions, unit.params
    strided = torch.strided
    grads: list[Any]
    if torch.compiler.is_compiling():
        # Dynamo traces no attrgetter: the same reads, one by one.
        grads = [p.grad for p in params]
        dense = all(g is not None and g.layout is strided for g in grads)
    else:
        grads = list(map(_GRAD, params))
        dense = _all_dense(grads)
    if not dense:
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
            check_grad_placements(param, grad, where(position), technique)
        params = [p.to_local() for p in params]  # type: ignore[attr-defined]
        grads = [g.to_local() for g in grads]
    return _Bound(unit, positions, params, grads, grads)


# What steady_bind gives for a unit whose record does not hold (None: it holds, and no
# parameter of the unit has a gradient at this step).
FAILED = object()


def steady_bind(unit: _Unit) -> object:
    """The unit at this step where its record holds (its parameters bound, with the gradients
    they have now), None where it holds with none bound, else :data:`FAILED`; the unit's
    parameters must have been found by identity."""
    steady = unit.steady
    if steady is None:
        return FAILED
    grads = steady.bind(list(map(_GRAD, unit.params)))
    if grads is None:
        return FAILED
    if not grads:
        return None
    return _Bound(unit, steady.positions, steady.params, grads, grads, steady=steady)


def record(unit: _Unit, bound: _Bound | None) -> None:
    """Records ``unit`` as it is at this step (see :class:`Steady`), ``bound`` being what the
    step bound of it (None: no parameter has a gradient), and sets ``bound.steady``. The
    caller has found the unit's plan holding at this step, with its fingerprint."""
    if unit.dtensors:
        return
    if unit.steady is not None and unit.steady.bind(list(map(_GRAD, unit.params))) is not None:
        # The step took the long way for another unit or group: this record still serves.
        if bound is not None:
            bound.steady = unit.steady
        return
    again, unit.misses = retaken(unit.steady, unit.misses)
    unit.steady = None
    if bound is None:
        params, grads, positions = [], [], []
    else:
        params, grads, positions = bound.params, bound.grads, bound.positions
    if again and all_plain(params) and all_plain(grads):
        taken = set(positions)
        absent = [i for i, position in enumerate(unit.positions) if position not in taken]
        unit.steady = Steady.take(params, grads, positions, absent)
        if bound is not None:
            bound.steady = unit.steady


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
