"""The machinery every gradient hook shares: attach, closure, checks, grouping, AMP, sharding.

A gradient hook rewrites each parameter's ``.grad`` in place before the optimizer's own update
runs, so it composes with any :class:`torch.optim.Optimizer`. A technique (LARS, adaptive
gradient clipping, a trust ratio) subclasses :class:`GradientHook` and supplies three things:

- its settings, a frozen dataclass, and ``_check_settings(values, prefix) -> settings``, which
  validates them (names prefixed with ``prefix`` in errors, for param-group overrides);
- its key prefix (``prefix = "lars"``: groups opt out with ``"lars": False`` and override a
  setting with ``"lars_<setting>"``) and its name in messages (``technique = "LARS"``);
- ``_unit_``: its maths for one *unit*, the parameters of one param group that share a
  device, a dtype and a sharding, as a pure function of
  ``(params, grads, settings, lr, grad_scale, found_inf)`` that rewrites ``grads`` in place
  and returns one value per parameter (LARS: its rates). ``norms`` carries the full tensors'
  norms when the tensors are shards; ``foreach`` is the user's multi-tensor switch.

Optionally ``_check_group(group, settings)`` raises for a group the technique cannot serve or
returns a warning, which the base emits once per optimizer and group.

A technique that works on the optimizer's *update* rather than on the gradients (the trust
ratio) overrides ``_before_step_(optimizer, jobs, skipped)``, which by default runs
``_unit_`` on the gradients, and ``_after_step(optimizer, args, kwargs)``, which the base then
registers with ``register_step_post_hook``; ``attach`` returns one handle for both hooks.

A unit function must honour the AMP protocol (see :class:`GradientHook`): when ``grad_scale``
is a tensor, the gradients it receives are scaled by it and what it writes must be unscaled;
when ``found_inf`` is a tensor, it sets it to 1 (never adds) where a value it wrote is not
finite, and never reads a tensor value back to the host.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from normhooks import _torch_compat as compat
from normhooks._precision import compute_dtype

__all__ = [
    "GradientHook",
    "UnitFunction",
    "apply_to_parameters_",
    "euclidean_norms",
    "row_norms",
    "sum_over_shards",
]

S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)
Lr = float | Tensor | None


class UnitFunction(Protocol[S_contra]):
    """A technique's maths for one unit: rewrites ``grads`` in place, returns a value each."""

    def __call__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        settings: S_contra,
        lr: Lr,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        *,
        norms: tuple[Tensor, Tensor] | None = None,
        foreach: bool | None = None,
    ) -> Tensor: ...


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
    if foreach is False:
        return torch.stack([torch.linalg.vector_norm(t, dtype=upcast) for t in tensors])
    return torch.stack(compat.foreach_norm(tensors, dtype=upcast))


def _cpu_norms(tensors: list[Tensor], upcast: torch.dtype | None, foreach: bool | None) -> Tensor:
    """:func:`euclidean_norms` of float32/float16/bfloat16 CPU tensors, in float32."""
    long = [i for i, t in enumerate(tensors) if t.numel() > _CPU_SHORT]
    if not long:
        if foreach is False:
            return torch.stack([torch.linalg.vector_norm(t, dtype=upcast) for t in tensors])
        return torch.stack(compat.foreach_norm(tensors, dtype=upcast))
    out = [torch.empty(0)] * len(tensors)
    short = [i for i, t in enumerate(tensors) if t.numel() <= _CPU_SHORT]
    if short:
        picked = [tensors[i] for i in short]
        norms = (
            [torch.linalg.vector_norm(t, dtype=upcast) for t in picked]
            if foreach is False
            else compat.foreach_norm(picked, dtype=upcast)
        )
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
    acc = compute_dtype(tensor.dtype)
    count, length = tensor.shape[0], math.prod(tensor.shape[1:])
    norms: Tensor
    if tensor.device.type != "cpu" or acc != torch.float32 or length <= _CPU_SHORT:
        norms = torch.linalg.vector_norm(tensor, dim=tuple(range(1, tensor.ndim)), dtype=acc)
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


def check_dense_grad(param: Tensor, where: str, technique: str) -> None:
    grad = param.grad
    if grad is not None and grad.layout != torch.strided:
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
    if flattening == "original":
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


def check_foreach(foreach: object) -> bool | None:
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be a bool or None, got foreach={foreach!r}")
    return foreach


# --- units: parameters that share a device, a dtype and a sharding ------------------------


@dataclass
class _Unit:
    """``params`` and ``grads`` are local tensors (a DTensor's local shard); ``reduce`` is
    the (mesh, sharded mesh dims) whose ranks hold other shards of them, or None."""

    indices: list[int]
    params: list[Tensor]
    grads: list[Tensor]
    reduce: tuple[Any, tuple[int, ...]] | None
    reduce_key: Any = None
    norms: tuple[Tensor, Tensor] | None = None


def _sharding(param: Tensor, where: str, technique: str) -> tuple[Any, tuple[int, ...]] | None:
    """The (mesh, sharded mesh dims) of a DTensor parameter, after checking its gradient."""
    dtensor = compat.dtensor_type()
    sharded: Any = param
    grad: Any = param.grad
    mesh, placements = sharded.device_mesh, sharded.placements
    if not isinstance(grad, dtensor) or (grad.device_mesh, grad.placements) != (mesh, placements):
        layout = (
            f"{grad.device_mesh} {grad.placements}"
            if isinstance(grad, dtensor)
            else f"a plain {type(grad).__name__}"
        )
        raise ValueError(
            f"{where} is a DTensor on {mesh} with placements {placements}, but its gradient "
            f"is {layout}; {technique} needs both laid out alike"
        )
    for placement in placements:
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(
                f"{where} has a {type(placement).__name__} placement ({placement}); "
                f"{technique} supports DTensors that are sharded or replicated on each mesh "
                "dimension (FSDP2, HSDP, tensor parallel), not partial ones"
            )
    dims = tuple(d for d, p in enumerate(placements) if p.is_shard() and mesh.size(d) > 1)
    return (mesh, dims) if dims else None


def _reduce_key(reduce: tuple[Any, tuple[int, ...]], cache: dict[Any, Any]) -> Any:
    """The ranks of the process groups a sharded unit is reduced over, one tuple per dim.

    ``fully_shard`` without ``mesh=`` builds a new DeviceMesh per call, all over the same
    process group: keying on the groups' ranks, not the mesh object, gives one all-reduce for
    all of them. (Meshes compare by layout, so the cache is hit once per layout per step.)
    """
    key = cache.get(reduce)
    if key is None:
        mesh, dims = reduce
        key = cache[reduce] = tuple(
            tuple(torch.distributed.get_process_group_ranks(mesh.get_group(d))) for d in dims
        )
    return key


def _units(params: Sequence[Tensor], where: Callable[[int], str], technique: str) -> list[_Unit]:
    if len(set(map(id, params))) != len(params):
        seen: dict[int, int] = {}
        for index, param in enumerate(params):
            first = seen.setdefault(id(param), index)
            if first != index:
                raise ValueError(
                    f"{where(index)} is the same tensor as {where(first)}; {technique} would "
                    "scale its gradient twice"
                )
    dtensor = compat.dtensor_type()
    units: dict[tuple[Any, ...], _Unit] = {}
    keys: dict[Any, Any] = {}
    for index, param in enumerate(params):
        grad: Any = param.grad
        local: Any = param
        reduce = None
        if dtensor is not None and isinstance(param, dtensor):
            reduce = _sharding(param, where(index), technique)
            local, grad = local.to_local(), grad.to_local()
        reduce_key = None if reduce is None else _reduce_key(reduce, keys)
        key = (local.device, local.dtype, reduce_key)
        unit = units.get(key)
        if unit is None:
            unit = units[key] = _Unit([], [], [], reduce, reduce_key)
        unit.indices.append(index)
        unit.params.append(local)
        unit.grads.append(grad)
    return list(units.values())


def _reduce_norms_(units: list[_Unit], foreach: bool | None) -> None:
    """Sets ``unit.norms`` to ``(||w||, ||g||)`` of the full tensors, for sharded units.

    The local sums of squares of every unit reduced over the same process groups are stacked
    and summed together: one all-reduce per sharded mesh dimension, and no tensor is gathered.
    """
    squares: dict[int, Tensor] = {}
    for position, unit in enumerate(units):
        if unit.reduce is None:
            continue
        squares[position] = torch.cat(
            [euclidean_norms(unit.params, foreach), euclidean_norms(unit.grads, foreach)]
        ).square()
    for position, total in sum_over_shards(units, squares).items():
        w_norm, g_norm = total.sqrt().chunk(2)
        units[position].norms = (w_norm, g_norm)


def sum_over_shards(units: Sequence[_Unit], squares: Mapping[int, Tensor]) -> dict[int, Tensor]:
    """Sums ``squares[i]``, local sums of squares of sharded ``units[i]``, over their shards.

    All the units reduced over the same process groups are stacked and summed together: one
    all-reduce per sharded mesh dimension. Each total keeps its part's dtype.
    """
    together: dict[Any, list[int]] = {}
    for position in squares:
        together.setdefault(units[position].reduce_key, []).append(position)
    totals: dict[int, Tensor] = {}
    for positions in together.values():
        mesh, dims = units[positions[0]].reduce  # type: ignore[misc]
        parts = [squares[p] for p in positions]
        common = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
        stacked = torch.cat([part.to(common) for part in parts])
        for dim in dims:
            torch.distributed.all_reduce(stacked, group=mesh.get_group(dim))
        summed = torch.split(stacked, [p.numel() for p in parts])
        for position, total in zip(positions, summed, strict=True):
            totals[position] = total.to(squares[position].dtype)
    return totals


@dataclass
class _Job(Generic[S]):
    """One param group's work: its settings, parameters with a grad, names and lr."""

    settings: S
    params: list[Tensor]
    where: Callable[[int], str]
    lr: Lr


def _run_(
    jobs: Sequence[_Job[S] | None],
    unit_function: UnitFunction[S],
    technique: str,
    foreach: bool | None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> list[Tensor]:
    """Applies ``unit_function`` to every job's units; returns each job's values, in order.

    A job of None (a group that opts out) gets no values. Every unit is formed (and every
    parameter checked) before any gradient changes.
    """
    planned = [
        _units(job.params, job.where, technique) if job is not None and job.params else []
        for job in jobs
    ]
    _reduce_norms_([unit for units in planned for unit in units], foreach)
    flags: dict[torch.device, Tensor] = {}
    results = []
    for job, units in zip(jobs, planned, strict=True):
        if job is None or not units:
            results.append(torch.empty(0))
            continue
        per_unit = []
        for unit in units:
            flag = None
            if found_inf is not None:
                device = unit.grads[0].device
                flag = flags.get(device)
                if flag is None:
                    flag = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            values = unit_function(
                unit.params,
                unit.grads,
                job.settings,
                job.lr,
                grad_scale,
                flag,
                norms=unit.norms,
                foreach=foreach,
            )
            per_unit.append((unit.indices, values))
        results.append(_in_order(per_unit, len(job.params)))
    if found_inf is not None:
        # A max, never a sum: fused steps test found_inf == 1 and subtract it from step counts.
        for flag in flags.values():
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
    return results


def _in_order(per_unit: list[tuple[list[int], Tensor]], count: int) -> Tensor:
    """The units' values as one tensor in parameter order, on the first unit's device."""
    if len(per_unit) == 1:
        return per_unit[0][1]
    device = per_unit[0][1].device
    dtype = torch.float64 if any(v.dtype == torch.float64 for _, v in per_unit) else torch.float32
    by_index = {
        index: value
        for indices, values in per_unit
        for index, value in zip(indices, values.to(device, dtype).unbind(0), strict=True)
    }
    return torch.stack([by_index[i] for i in range(count)])


def apply_to_parameters_(
    parameters: Tensor | Iterable[Tensor],
    settings: S,
    unit_function: UnitFunction[S],
    *,
    technique: str,
    foreach: bool | None,
) -> Tensor:
    """The functional form of a hook: applies ``unit_function`` to every ``.grad``.

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
    foreign = compat.fsdp1_possible() or compat.deepspeed_possible()
    with_grad, names = [], []
    for index, param in enumerate(parameters):
        where = f"parameters[{index}]"
        check_param(param, where, technique)
        if foreign and compat.may_carry_marks(param):
            check_not_flattened(param, where, technique)
        check_dense_grad(param, where, technique)
        if param.grad is not None:
            with_grad.append(param)
            names.append(where)
    with torch.no_grad():
        (values,) = _run_(
            [_Job(settings, with_grad, names.__getitem__, None)],
            unit_function,
            technique,
            foreach,
        )
    return values


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


def _hooks_on(optimizer: torch.optim.Optimizer) -> list[tuple[int, GradientHook[Any]]]:
    """The gradient hooks whose pre-step is in ``optimizer``'s hook dict, with their handle ids.

    The dict, not the Python object, is what a step runs: a wrapper that forwards its
    attributes shares the dict of the optimizer it wraps.
    """
    found = []
    for key, hook in compat.step_pre_hooks(optimizer):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, GradientHook) and getattr(hook, "__name__", None) == "_pre_step":
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


class GradientHook(Generic[S]):
    r"""Base of the gradient hooks: an optimizer step pre-hook that rewrites ``.grad``.

    A subclass sets ``prefix`` and ``technique``, implements ``_check_settings`` and
    ``_unit_``, and may implement ``_check_group``; see the module docstring.

    What the base does, the same for every technique:

    - :meth:`attach` unwraps accelerate's and Lightning's optimizer wrappers, registers the
      hook with ``register_step_pre_hook`` and returns the
      :class:`~torch.utils.hooks.RemovableHandle`. Refused: LBFGS (it evaluates its closure
      many times per step); optimizers that step a ``base_optimizer`` (SAM and its kin: the
      hook belongs on ``base_optimizer``); for a technique with a post-step, optimizers that
      step the one they hold in ``.optimizer`` (Lookahead); DeepSpeed's optimizers; and a
      second hook of the same technique in the optimizer's step-hook dict or in that of an
      optimizer it wraps (it would apply the technique twice).
    - Every param group that takes part, and its parameters, is checked when attaching and
      again before each step (groups may be added later), with one function, before anything
      changes; a group that opts out is left alone. FSDP1's flattened parameters and
      DeepSpeed ZeRO-3's partitions are refused: their norms are not the parameters'.
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
      The hook then computes from the scaled gradients divided by the scale, in float32, and
      writes the *unscaled* result into ``.grad`` (rounded once); it unscales the gradients of
      groups that opt out too; then it sets ``optimizer.grad_scale = None``, so the fused step
      does not divide again, and sets ``optimizer.found_inf`` to 1 where a written value is
      not finite, so that a genuine overflow still skips the step. (That overflow is in the
      hook's result, not in the scaled gradients, so the scaler does not lower its scale for
      it.) This is GradScaler's private protocol, reached through ``_torch_compat``. Ordinary
      optimizers under GradScaler see unscaled gradients and need none of it.
    - ``foreach``: None and True take ``torch._foreach_*`` ops, False one tensor at a time
      (for tensor types the multi-tensor ops refuse).
    - Nothing is read back to the host: the hook traces under ``torch.compile(fullgraph=True)``.
    - A technique on the update instead of the gradients overrides ``_before_step_`` and
      ``_after_step`` (a step post-hook, registered next to the pre-hook); everything above
      still applies to it.
    """

    prefix: ClassVar[str]
    technique: ClassVar[str]

    def __init__(self, settings: S, *, foreach: bool | None = None) -> None:
        self._settings = settings
        self._foreach = check_foreach(foreach)
        self._last_values: list[Tensor] = []
        self._warned: weakref.WeakKeyDictionary[torch.optim.Optimizer, set[int]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def _check_settings(cls, values: Mapping[str, object], prefix: str) -> S:
        """Validates ``values`` (every field of the settings) and builds the settings.

        Errors name each setting as ``prefix + name``.
        """
        raise NotImplementedError

    def _unit_(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        settings: S,
        lr: Lr,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        *,
        norms: tuple[Tensor, Tensor] | None = None,
        foreach: bool | None = None,
    ) -> Tensor:
        """The technique on one unit; a :class:`UnitFunction`."""
        raise NotImplementedError

    def _check_group(self, group: Mapping[str, Any], settings: S) -> str | None:
        """Raises for a param group the technique cannot serve; returns a warning or None."""
        return None

    @property
    def foreach(self) -> bool | None:
        return self._foreach

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
            The handle of the registered pre-hook; for a technique with a post-step, one
            handle whose ``remove()`` removes both hooks.
        """
        target = self._optimizer_to_hook(optimizer)
        self._refuse_a_second_one(target)
        self._check_optimizer(target)
        handle = target.register_step_pre_hook(self._pre_step)
        if self._has_post_step():
            handle = _HookPair(handle, target.register_step_post_hook(self._after_step))
        return handle

    @classmethod
    def _has_post_step(cls) -> bool:
        return cls._after_step is not GradientHook._after_step

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
        if inner and self._has_post_step():
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

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> list[S | None]:
        """Every param group's settings (None where it opts out), after checking the params
        of the groups that take part; a group that opts out is left alone, params and all."""
        settings_of = []
        seen: dict[int, tuple[int, int]] = {}
        foreign = compat.fsdp1_possible() or compat.deepspeed_possible()
        for index, group in enumerate(optimizer.param_groups):
            settings = self._group_settings(optimizer, group, index)
            settings_of.append(settings)
            if settings is None:
                continue
            for position, param in enumerate(group["params"]):
                if not isinstance(param, Tensor) or param.dtype not in _SUPPORTED_DTYPES:
                    check_param(
                        param, f"parameter {position} of param group {index}", self.technique
                    )
                if foreign and compat.may_carry_marks(param):
                    check_not_flattened(
                        param, f"parameter {position} of param group {index}", self.technique
                    )
                first = seen.setdefault(id(param), (index, position))
                if first != (index, position):
                    # torch's add_param_group refuses this, but param_groups can be edited.
                    raise ValueError(
                        f"parameter {position} of param group {index} is the same tensor as "
                        f"parameter {first[1]} of param group {first[0]}; {self.technique} "
                        "would scale its gradient twice"
                    )
        return settings_of

    def _group_settings(
        self, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], index: int
    ) -> S | None:
        prefix = self.prefix
        enabled = group.get(prefix, True)
        if not isinstance(enabled, bool):
            raise TypeError(
                f'param group {index}: "{prefix}" must be a bool, got "{prefix}"={enabled!r}'
            )
        overrides = {}
        for key, value in group.items():
            if key.startswith(prefix + "_"):
                overrides[key[len(prefix) + 1 :]] = value
        current: Any = self._settings
        names = [field.name for field in fields(current)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(
                f"param group {index}: unknown key '{prefix}_{unknown[0]}'; expected one of "
                + ", ".join(f"'{prefix}_{name}'" for name in names)
            )
        if not enabled:
            return None
        settings = self._settings
        try:
            if overrides:
                merged = {name: getattr(current, name) for name in names} | overrides
                settings = self._check_settings(merged, prefix + "_")
            warning = self._check_group(group, settings)
        except (TypeError, ValueError) as error:
            raise type(error)(f"param group {index}: {error}") from None
        if warning is not None:
            warned = self._warned.setdefault(optimizer, set())
            if index not in warned:
                warned.add(index)
                warnings.warn(f"param group {index}: {warning}", UserWarning, stacklevel=4)
        return settings

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
        try:
            return self._checked_pre_step(optimizer, args, kwargs)
        except BaseException:
            # GradScaler deletes the attributes it set on a fused optimizer only after a step
            # that returns; left behind, they would make the next step divide by the scale
            # twice.
            compat.drop_grad_scaler_attributes(optimizer)
            raise

    def _checked_pre_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        name = type(self).__name__
        # Everything that does not depend on the gradients is checked before the closure runs,
        # for every hook on this optimizer, so a bad param group leaves the model untouched
        # whichever hook it concerns (hooks run one after the other).
        if not torch.compiler.is_compiling():
            self._refuse_one_inside(optimizer)
            for _, hook in _hooks_on(optimizer):
                if hook is not self:
                    hook._check_optimizer(optimizer)
        settings_of = self._check_optimizer(optimizer)
        closure, args, kwargs = _take_closure(args, kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs: list[_Job[S] | None] = []
        skipped: list[Tensor] = []
        with_grad: list[Tensor] = []
        for index, (group, settings) in enumerate(
            zip(optimizer.param_groups, settings_of, strict=True)
        ):
            if settings is None:
                params = [param for param in group["params"] if param.grad is not None]
                skipped.extend(params)
                jobs.append(None)
                with_grad.extend(params)
                continue
            params, positions = [], []
            for position, param in enumerate(group["params"]):
                if param.grad is not None:
                    if param.grad.layout != torch.strided:
                        check_dense_grad(
                            param, f"parameter {position} of param group {index}", self.technique
                        )
                    params.append(param)
                    positions.append(position)
            jobs.append(_Job(settings, params, _namer(index, positions), group.get("lr")))
            with_grad.extend(params)
        with torch.no_grad():
            self._before_step_(optimizer, jobs, skipped)
        if closure is None:
            return None
        watched = [] if torch.compiler.is_compiling() else with_grad
        kwargs["closure"] = _SingleUseClosure(loss, optimizer, name, watched)
        return args, kwargs

    def _before_step_(
        self, optimizer: torch.optim.Optimizer, jobs: list[_Job[S] | None], skipped: list[Tensor]
    ) -> None:
        """The technique's work before the step, with fresh gradients, under ``no_grad``.

        ``jobs`` has one entry per param group (None where the group opts out), ``skipped``
        the parameters with a gradient in groups that opt out. By default: ``_unit_`` on the
        gradients, with the AMP protocol.
        """
        grad_scale, found_inf = compat.grad_scale(optimizer), compat.found_inf(optimizer)
        self._last_values = _run_(
            jobs, self._unit_, self.technique, self._foreach, grad_scale, found_inf
        )
        if grad_scale is not None:
            self._unscale_skipped_(skipped, grad_scale, found_inf)
            compat.clear_grad_scale(optimizer)

    def _after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A step post-hook; registered only for subclasses that override it."""

    def _unscale_skipped_(
        self, params: list[Tensor], grad_scale: Tensor, found_inf: Tensor | None
    ) -> None:
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
            unscale_and_check_(grads, flag, inverse_scale(grad_scale, device), self._foreach)
            if found_inf is not None:
                found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))


class _HookPair(RemovableHandle):
    """The pre-hook's handle (same id), also removing the post-hook.

    A subclass of torch's handle rather than an edit of the optimizer's hook dicts.
    """

    def __init__(self, pre: RemovableHandle, post: RemovableHandle) -> None:
        self.hooks_dict_ref = pre.hooks_dict_ref
        self.id = pre.id
        self.extra_dict_ref = pre.extra_dict_ref
        self._post = post

    def remove(self) -> None:
        super().remove()
        self._post.remove()


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


def _namer(group_index: int, positions: list[int]) -> Callable[[int], str]:
    """Names the i-th parameter with a gradient by its place in the optimizer, on demand."""
    return lambda i: f"parameter {positions[i]} of param group {group_index}"


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
