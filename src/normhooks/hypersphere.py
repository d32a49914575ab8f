r"""Weights kept on the unit hypersphere after every optimizer step, as nGPT trains them.

Implements the weight normalization of I. Loshchilov, C.-P. Hsieh, S. Sun and B. Ginsburg,
"nGPT: Normalized Transformer with Representation Learning on the Hypersphere",
arXiv:2410.01131 (2024): after each step of the optimizer, every weight matrix is divided by
the L2 norm of each of its vectors along the embedding axis, as ``normalize_matrices`` in
NVIDIA/ngpt (``train.py``) does with ``x / x.norm(p=2, dim=d, keepdim=True)``, for any
optimizer.

The maths are pure functions (:func:`sphere_norms`, :func:`onto_sphere_`);
:class:`Hypersphere` puts them on :class:`~normhooks._step_hook.StepHook` as a hook run after
the step, which handles attaching, closures, param-group settings, skipped AMP steps and
sharded parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from normhooks import _checks
from normhooks import _torch_compat as compat
from normhooks._precision import compute_dtype
from normhooks._step_hook import (
    Settings,
    StepHook,
    _Bound,
    _GroupPlan,
    _hooks_on,
    _reduce_key,
    _UpdateInFlight,
    row_norms,
    setting,
)
from normhooks._step_hook.core import HookCore

__all__ = ["Hypersphere", "onto_sphere_", "sphere_norms"]


def _matrix_dim(name: str, value: object) -> int:
    expected = "1 (each row along dim 0 has unit norm) or 0 (each column: the vector along dim 0)"
    # 1.0 or True would pass a membership test in (0, 1): only an int names an axis.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, {expected}, got {name}={value!r}")
    if value not in (0, 1):
        raise ValueError(f"{name} must be {expected}, got {name}={value!r}")
    return value


@dataclass(frozen=True, eq=False)
class HypersphereSettings(Settings):
    """Hypersphere's settings; a param group overrides one with ``"sphere_<name>"``."""

    dim: int = setting(_matrix_dim)
    """The axis the norm is taken along, as in ``torch.nn.functional.normalize``: 1 for rows,
    0 for columns (of the tensor seen as a matrix of its dim 0 by the rest)."""
    eps: float = setting(_checks.positive)
    """The floor of a norm: a vector of norm below it is divided by ``eps``."""


def sphere_norms(tensor: Tensor, dim: int) -> Tensor:
    """The L2 norm of each row (``dim=1``) or column (``dim=0``) of a tensor of two or more
    dimensions seen as a matrix of its dim 0 by the rest, shaped to broadcast against it, in
    its compute dtype.

    On the CPU, float32 columns are accumulated in float64, and rows of more than 4096 values
    in float64 pieces (:func:`~normhooks._step_hook.row_norms`): float32 sums that long are
    not precise.

    Example:
        >>> sphere_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]), dim=1)
        tensor([[5.],
                [1.]])
        >>> sphere_norms(torch.tensor([[3.0, 4.0], [0.0, 3.0]]), dim=0)
        tensor([[3., 5.]])
    """
    if dim == 1:
        shape = (tensor.shape[0],) + (1,) * (tensor.ndim - 1)
        return row_norms(tensor).reshape(shape)
    acc = compute_dtype(tensor.dtype)
    if tensor.is_cpu and acc == torch.float32:
        # torch's CPU reduction along dim 0 sums each column in float32 one row after another
        # (for 768 rows, 9 units in the last place off; in float64, within rounding).
        acc = torch.float64
    norms: Tensor = torch.linalg.vector_norm(tensor, dim=0, keepdim=True, dtype=acc)
    return norms.to(compute_dtype(tensor.dtype))


def onto_sphere_(tensor: Tensor, norms: Tensor, eps: float, skip: Tensor | None = None) -> None:
    r"""``tensor /= max(norms, eps)`` in place: :math:`w \leftarrow w / \max(\|w\|, \epsilon)`.

    ``norms`` as :func:`sphere_norms` gives them; where ``skip`` (a 0-D tensor) is nonzero the
    divisor is 1 and ``tensor`` stays bit for bit what it was, with no value read back to the
    host. A float16/bfloat16 tensor is divided in float32 and rounded once.

    Example:
        >>> w = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
        >>> onto_sphere_(w, sphere_norms(w, dim=1), eps=1e-12)
        >>> w
        tensor([[0.6000, 0.8000],
                [0.0000, 0.0000]])
    """
    divisor = torch.clamp(norms, min=eps)
    if skip is not None:
        divisor = torch.where(skip.to(divisor.device) != 0, torch.ones_like(divisor), divisor)
    tensor.div_(divisor)


def _reduced_mesh_dims(param: Any, dim: int) -> tuple[int, ...]:
    """The mesh dims over which a DTensor ``param`` splits the vectors normalized along
    ``dim``: those that shard dim 0 for columns, another dim for rows."""
    mesh, placements = param.device_mesh, param.placements
    split = []
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard() or mesh.size(mesh_dim) == 1:
            continue
        along_rows = placement.dim % param.ndim != 0
        if along_rows == (dim == 1):
            split.append(mesh_dim)
    return tuple(split)


class Hypersphere(StepHook, HypersphereSettings):
    r"""Keeps every weight matrix on the unit hypersphere after each optimizer step (nGPT).

    The optimizer takes its own step; then each parameter :math:`W` of two or more dimensions,
    seen as a matrix of its dim 0 by the rest, has each of its rows (``dim=1``) or columns
    (``dim=0``) :math:`w` divided by its L2 norm:

    .. math::

        w \leftarrow \frac{w}{\max(\|w\|_2, \epsilon)}.

    For ``nn.Linear`` (weight ``[out, in]``) and ``nn.Embedding`` (``[num, embedding_dim]``),
    ``dim=1`` normalizes over the input or embedding features and ``dim=0`` over the outputs;
    nGPT normalizes along the embedding axis: ``dim=1`` for the embeddings, the output head
    and the query, key, value and first MLP matrices, ``dim=0`` for the attention's and the
    MLP's output projections (put those in a group with ``"sphere_dim": 0``). Tensors of
    fewer dimensions (biases, gains, nGPT's learned scaling vectors) are left alone.

    ``eps`` (default 1e-12, as ``torch.nn.functional.normalize``) only matters for a vector of
    norm below it: nGPT divides by the norm itself, which turns a zero vector into NaN; here a
    zero vector stays zero, and every other vector of norm at least ``eps`` is exactly
    :math:`w / \|w\|`. The norms are computed in float32 at least (on the CPU in float64 for
    float32 columns and rows of more than 4096 values); float16/bfloat16 weights are divided in
    float32 and rounded once.

    A step :class:`torch.amp.GradScaler` skips leaves the weights untouched: a non-fused
    optimizer's step does not run at all, and after a fused one the divisor is 1 wherever
    ``found_inf`` is set (no value is read back to the host), ``GradScaler.unscale_`` before
    the step or a hook on the gradients on the same optimizer included. Parameters without a
    gradient were not stepped and are left alone. The hook needs no copy of the parameters: it reads
    them only after the step. Param groups can opt out (``"sphere": False``) or override
    ``dim`` and ``eps`` with ``"sphere_dim"`` and ``"sphere_eps"``. FSDP2 (``fully_shard``,
    ``Shard(0)``): rows are whole on each rank, so ``dim=1`` needs no communication; for
    ``dim=0`` (or rows split by tensor parallelism) the squares of the local norms are summed
    over the shards, one all-reduce per set of process groups for all such parameters. One
    Hypersphere per optimizer; with a hook on the updates (:class:`~normhooks.TrustRatio`,
    :class:`~normhooks.UpdateRMS`) on the same optimizer, attach Hypersphere last: post-step
    hooks run in the order they were attached, and a step with a hook on the updates attached
    after Hypersphere on a group of the same matrices is refused (RuntimeError, before
    anything changes), since that hook would take the weights off the sphere again.

    Args:
        dim: 1 to normalize each row, 0 each column.
        eps: the floor of a norm, positive.
        foreach: accepted for symmetry with the other hooks; the norms of rows and columns
            have no multi-tensor op, so each tensor is normalized on its own.

    References:
        Loshchilov, Hsieh, Sun and Ginsburg, nGPT: Normalized Transformer with Representation
        Learning on the Hypersphere, arXiv:2410.01131 (2024), section 2.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> handle = Hypersphere(dim=1).attach(optimizer)
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> optimizer.step()
        >>> torch.linalg.vector_norm(model.weight, dim=1)
        tensor([1.0000, 1.0000], grad_fn=<LinalgVectorNormBackward0>)
        >>> handle.remove()
    """

    prefix = "sphere"
    technique = "Hypersphere"
    rewrites = "updates"
    # Rows along dim 0 are whole on each rank: the default needs no collective.
    whole_norms = False

    def __init__(self, dim: int = 1, eps: float = 1e-12, *, foreach: bool | None = None) -> None:
        super().__init__(dim=dim, eps=eps, foreach=foreach)

    def _plan(self, optimizer: torch.optim.Optimizer) -> list[_GroupPlan]:
        # Every hook's pre-step plans every hook on the optimizer before the closure and the
        # step: a hook on the updates attached after this one is refused with nothing changed.
        if not torch.compiler.is_compiling():
            _refuse_update_hooks_after(self, optimizer)
        return super()._plan(optimizer)

    # The hook reads the parameters after the step only: its pre-step keeps no copy of them
    # and its post-step takes no norm of an update.

    def _keep_old_values(
        self,
        optimizer: torch.optim.Optimizer,
        plan: Sequence[Any],
        bound: Sequence[Sequence[_Bound]],
    ) -> None:
        jobs: list[tuple[Settings | None, float | Tensor | None]] = [
            (group_plan.settings, None) for group_plan in plan
        ]
        self._pending[optimizer] = _UpdateInFlight(bound, jobs, [])

    def _after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        pending = self._pending.pop(optimizer, None)
        if pending is None:
            return
        # Not fused_grad_scaling: its grad_scale is None after GradScaler.unscale_ and after a
        # hook on the gradients has unscaled them, where the step still skips on found_inf.
        skip = compat.fused_found_inf(optimizer)
        with torch.no_grad():
            work = []
            for (settings, _), of_group in zip(pending.jobs, pending.bound, strict=True):
                for b in of_group:
                    full = dict(zip(b.unit.positions, b.unit.params, strict=True))
                    for position, local in zip(b.positions, b.params, strict=True):
                        if local.ndim >= 2:
                            work.append(
                                (local, full[position], cast(HypersphereSettings, settings))
                            )
            norms = [sphere_norms(local, settings.dim) for local, _, settings in work]
            _sum_over_shards_(work, norms)
            for (local, _, settings), norm in zip(work, norms, strict=True):
                onto_sphere_(local, norm, settings.eps, skip)


def _refuse_update_hooks_after(sphere: Hypersphere, optimizer: torch.optim.Optimizer) -> None:
    """Raises if a hook on the updates was attached to ``optimizer`` after ``sphere`` and
    rescales the update of a weight that ``sphere`` normalizes.

    Post-step hooks run in the order they were attached, and each StepHook registers its
    pre- and post-step together, so the order of the pre-steps is that of the post-steps. A
    hook on the updates after the sphere would rescale the step from the old weights to the
    normalized ones, which takes them off the sphere.
    """
    attached = False
    for _, hook in _hooks_on(optimizer):
        if hook is sphere:
            attached = True
        elif attached and hook.rewrites == "updates" and _share_a_matrix(sphere, hook, optimizer):
            name = type(hook).__name__
            raise RuntimeError(
                f"{name} was attached to this {type(optimizer).__name__} after Hypersphere; "
                "post-step hooks run in the order they were attached, so it would rescale the "
                "update after Hypersphere has put the weights on the sphere and move them off "
                f"it. Remove Hypersphere with its handle's remove() and attach it again, after "
                f"{name}"
            )


def _share_a_matrix(sphere: HookCore, other: HookCore, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a param group that neither hook opts out of holds a tensor of two or more
    dimensions (the opt-out flags are checked as bools when each hook plans the group)."""
    return any(
        group.get(sphere.prefix, True) is not False
        and group.get(other.prefix, True) is not False
        and any(param.ndim >= 2 for param in group["params"])
        for group in optimizer.param_groups
    )


def _sum_over_shards_(
    work: list[tuple[Tensor, Tensor, HypersphereSettings]], norms: list[Tensor]
) -> None:
    """Replaces the local norms of vectors split across ranks by their whole norms: the squares
    of all those reduced over the same process groups are summed in one all-reduce per mesh
    dim."""
    dtensor = compat.dtensor_type()
    if dtensor is None:
        return
    together: dict[Any, list[int]] = {}
    meshes: dict[Any, tuple[Any, tuple[int, ...]]] = {}
    keys: dict[Any, Any] = {}
    for i, (_, param, settings) in enumerate(work):
        if not isinstance(param, dtensor):
            continue
        sharded: Any = param
        dims = _reduced_mesh_dims(sharded, settings.dim)
        if dims:
            key = _reduce_key((sharded.device_mesh, dims), keys)
            together.setdefault(key, []).append(i)
            meshes[key] = (sharded.device_mesh, dims)
    for key, positions in together.items():
        mesh, dims = meshes[key]
        parts = [norms[i].double().square().reshape(-1) for i in positions]
        stacked = torch.cat(parts)
        for dim in dims:
            torch.distributed.all_reduce(stacked, group=mesh.get_group(dim))
        for i, total in zip(
            positions, torch.split(stacked, [p.numel() for p in parts]), strict=True
        ):
            norms[i] = total.sqrt().reshape(norms[i].shape).to(norms[i].dtype)
