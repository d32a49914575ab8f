"""The one door of each reparametrization to its fast paths.

A technique's parametrization is a plain module: its ``forward`` calls its technique's
:class:`Door` (``WeightNorm.forward`` calls a :class:`WeightNormDoor`, as torch's
``_WeightNorm.forward`` calls one op), registered for its class with :func:`register` so that
a fused scope (``_scope``) finds it. Behind the door: the outcome of the technique's checks,
kept per layout (a :class:`Route`), the kernels' plan of a layer, the fused launch it can
join, the CPU's fast path, and the fallback to the plain formula when a kernel fails here.
The technique hands its door the formula in plain torch ops and its checks, so nothing here
imports a technique.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from normhooks import _kernels, _torch_compat
from normhooks._kernels import _cpu, _fallback
from normhooks._kernels._cache import KeyedCache

# Where a fused launch finds one of a layer's tensors: the dict that holds it now (a module's
# ``_parameters`` or ``_buffers``) and its key.
Source = tuple[dict[str, Any], str]

# The fused launch a layer joins: its launch function, device and dtype.
FusionGroup = tuple[Callable[..., tuple[Tensor, ...]], torch.device, torch.dtype]

# What a layer hands a fused launch: the group it joins, its kernel plan and its tensors (None
# for an optional one it lacks).
FusionInputs = tuple[FusionGroup, object, tuple[Tensor | None, ...]]


class Route:
    """What a layer's checks found for one layout (the axis, and Scaled WS's
    ``gamma / sqrt(fan_in)``), the kernels' plan (made at the first forward or scope that
    needs it), and the fused launch it can join (found at the first fused scope that meets
    it; False where it can join none)."""

    __slots__ = ("dim", "factor", "group", "plan")

    def __init__(self, dim: int | None, factor: float | None = None) -> None:
        self.dim = dim
        self.factor = factor
        self.plan: object = None
        self.group: FusionGroup | Literal[False] | None = None


# Every door's routes, by the parametrization's class, settings and its tensors' layouts.
_ROUTES: KeyedCache[tuple[object, ...], Route] = KeyedCache()


def _kernel_failed(error: Exception, what: str) -> None:
    """Lets a failure that is not the kernel's (out of memory) through; else falls back."""
    if isinstance(error, torch.OutOfMemoryError):
        raise error
    _fallback.failed(what, error)


class Door(abc.ABC):
    """A technique's fast paths, for the parametrization class it is registered for."""

    what: str
    # The class it was registered for (see register): a door pickles as that lookup.
    registered_for: type | None = None

    def __reduce__(self) -> tuple[Callable[..., Door | None], tuple[object]]:
        # A door holds functions of its technique's module (the formula, a Function made
        # for it); a copy of a model finds the one registered for its class instead.
        return _door_for, (self.registered_for,)

    @abc.abstractmethod
    def settings(self, parametrization: nn.Module) -> tuple[object, ...]:
        """The settings the checks' outcome and the kernels' plan depend on."""

    @abc.abstractmethod
    def resolve(self, parametrization: nn.Module, tensors: tuple[Tensor, ...]) -> Route:
        """The technique's checks of ``tensors``; raises where they do not fit."""

    @abc.abstractmethod
    def sources(self, parametrization: nn.Module, chain: nn.Module) -> tuple[Source, ...] | None:
        """Where a fused launch finds the layer's tensors, in its order; None where it cannot
        take this layer."""

    @abc.abstractmethod
    def fusion_plan(
        self, parametrization: nn.Module, tensors: tuple[Tensor | None, ...], route: Route
    ) -> object:
        """The kernels' plan of the layer where a fused launch can take it, else None."""

    @abc.abstractmethod
    def launch(self, plans: tuple[Any, ...], tensors: list[Tensor | None]) -> tuple[Tensor, ...]:
        """The weights of many layers of one device and dtype, in one launch each way."""

    def route(self, parametrization: nn.Module, tensors: tuple[Tensor, ...]) -> Route:
        """The outcome of the checks of ``tensors``: kept by everything it depends on (the
        class, settings and layouts) in eager code on plain tensors; computed as it is
        (static attribute reads) under ``torch.compile`` and for tensor subclasses."""
        if torch.compiler.is_compiling() or not _torch_compat.plain_tensors(*tensors):
            unkept = self.resolve(parametrization, tensors)
            unkept.group = False  # not a fused launch's: its tensors are not plain
            return unkept
        key: tuple[object, ...] = (type(parametrization), self.settings(parametrization))
        for tensor in tensors:
            # layout(tensor), inline: this runs at every access of a layer's weight.
            key += (type(tensor), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)
        route = _ROUTES.get(key)
        if route is None:
            route = _ROUTES.put(key, self.resolve(parametrization, tensors))
        return route

    def fusion_inputs(self, parametrization: nn.Module, chain: nn.Module) -> FusionInputs | None:
        """What a fused launch needs to compute the layer's weight with others, or None where
        the layer keeps its own path now."""
        sources = self.sources(parametrization, chain)
        if sources is None:
            return None
        tensors = tuple([owner.get(key) for owner, key in sources])
        present = tuple([t for t in tensors if t is not None])
        route = self.route(parametrization, present)
        group = route.group
        if group is None:
            group = self.fusion_group(parametrization, tensors, route)
            # Not kept where a kernel failed finding it (the fallback): the layout joins a
            # fused launch again once the kernels are turned on again.
            if not _fallback.broken():
                route.group = group
        # A route found in the cache is of plain tensors of one device, whose type was
        # checked: for the CPU the routing switch remains.
        if group is False or group is None:
            return None
        if group[1].type == "cpu" and not _kernels.routing_cpu_tensors():
            return None
        return group, route.plan, tensors

    def fusion_group(
        self, parametrization: nn.Module, tensors: tuple[Tensor | None, ...], route: Route
    ) -> FusionGroup | Literal[False]:
        """The fused launch a layer of ``route`` joins, or False where it can join none."""
        first = tensors[0]
        assert first is not None  # a weight's own tensor is never optional
        if first.device.type not in ("cuda", "cpu"):
            return False
        for tensor in tensors:
            if tensor is not None and (
                tensor.dtype != first.dtype or tensor.device != first.device
            ):
                return False
        try:
            if self.fusion_plan(parametrization, tensors, route) is None:
                return False
        except Exception as error:
            _kernel_failed(error, self.what)
            return False
        return (self.launch, first.device, first.dtype)


_DOORS: dict[type, Door] = {}


def register(parametrization: type[nn.Module], door: Door) -> None:
    """Makes ``door`` the fast path of ``parametrization``'s instances in a fused scope."""
    door.registered_for = parametrization
    _DOORS[parametrization] = door


def _door_for(parametrization: type) -> Door | None:
    return _DOORS.get(parametrization)


def door_of(parametrization: object) -> Door | None:
    """The door registered for ``parametrization``'s class (or the nearest base), or None.

    None for a subclass whose ``forward`` is not its technique's own (one defined outside the
    module of the class the door was registered for): a fused launch computes the
    technique's formula, not what that ``forward`` returns.
    """
    kind = type(parametrization)
    for cls in kind.__mro__:
        door = _DOORS.get(cls)
        if door is not None:
            forward = getattr(kind, "forward", None)
            return door if getattr(forward, "__module__", None) == cls.__module__ else None
    return None


# --- weight normalization -------------------------------------------------------------------

WeightNormFormula = Callable[[Tensor, Tensor, int | None, float], Tensor]


class WeightNormDoor(Door):
    """Weight normalization's fast paths: the Triton kernels (one layer, or fused), the CPU's
    fused op and closed-form backward; ``formula`` everywhere else, and where a kernel fails.

    Args:
        formula: ``formula(g, v, dim, eps)`` in plain differentiable torch ops.
        check: ``check(parametrization, g, v)``: the technique's checks; returns the axis.
        row_norms: ``row_norms(v, dim)``, the formula's norms over every axis but ``dim``,
            kept for broadcasting.
        denominator: ``denominator(norm, eps)``, the formula's divisor of v for those norms.
    """

    what = "weight normalization"

    def __init__(
        self,
        formula: WeightNormFormula,
        check: Callable[[Any, Tensor, Tensor], int | None],
        row_norms: _cpu.RowNorms,
        denominator: _cpu.Denominator,
    ) -> None:
        self.formula = formula
        self.check = check
        # The closed-form CPU Function of this formula (tests compare it with the formula).
        self.closed_form = _cpu.closed_form(formula, row_norms, denominator)

    def __call__(self, parametrization: Any, g: Tensor, v: Tensor) -> Tensor:
        route = self.route(parametrization, (g, v))
        dim, eps = route.dim, parametrization.eps
        if g.dtype != v.dtype:
            # The fused kernels and torch's fused op take one dtype; the formula promotes.
            return self.formula(g, v, dim, eps)
        if dim is not None and _kernels.available(g, v):
            # CUDA with Triton: one fused kernel forward and one backward, exact.
            try:
                plan = route.plan  # (self.plan, inline where the route has one)
                if plan is None:
                    plan = self.plan(parametrization, g, v, route)
                return _kernels.planned_weight_norm(g, v, plan)
            except Exception as error:
                _kernel_failed(error, self.what)
                return self.formula(g, v, dim, eps)
        if not _cpu.takes(g, v):
            # On an accelerator without Triton, autograd's own graph of the formula launches
            # about as many kernels as the closed-form backward and runs no Python in backward.
            return self.formula(g, v, dim, eps)
        # torch's fused op and its backward take a contiguous g only ("saved_g must be
        # contiguous"); a copy is part of the graph.
        if not g.is_contiguous():
            g = g.contiguous()
        return _cpu.weight_norm(g, v, dim, eps, self.closed_form)

    def plan(self, parametrization: Any, g: Tensor, v: Tensor, route: Route) -> Any:
        """The kernels' plan of a layer of ``route`` (not ``dim=None``), made once per route."""
        if route.plan is None:
            assert route.dim is not None  # dim=None never takes the kernels
            route.plan = _kernels.weight_norm_plan(
                g, v, route.dim, parametrization.eps, self.formula
            )
        return route.plan

    def settings(self, parametrization: Any) -> tuple[object, ...]:
        return parametrization.dim, parametrization.eps

    def resolve(self, parametrization: Any, tensors: tuple[Tensor, ...]) -> Route:
        # g's shape is checked on every path: torch's fused op and the kernels index it per
        # row of v without bounds checks.
        g, v = tensors
        return Route(self.check(parametrization, g, v))

    def sources(self, parametrization: Any, chain: nn.Module) -> tuple[Source, ...] | None:
        originals = chain._parameters
        if parametrization.dim is None or originals.get("original0") is None:
            return None
        return (originals, "original0"), (originals, "original1")

    def fusion_plan(
        self, parametrization: Any, tensors: tuple[Tensor | None, ...], route: Route
    ) -> object:
        g, v = tensors
        assert g is not None  # both are WN's own originals
        assert v is not None
        plan = self.plan(parametrization, g, v, route)
        return plan if _kernels.weight_norm_fusable(plan) else None

    def launch(self, plans: tuple[Any, ...], tensors: list[Tensor | None]) -> tuple[Tensor, ...]:
        return _kernels.fuse_weight_norms(plans, tensors)  # type: ignore[arg-type]


# --- weight standardization -----------------------------------------------------------------

# formula(weight, dim, eps, groups, gain, factor): the plain torch formula.
StandardizationFormula = Callable[[Tensor, int, float, int, Tensor | None, float | None], Tensor]


class StandardizationDoor(Door):
    """Weight standardization's fast paths (plain and Scaled WS): the Triton kernels (one
    layer, or fused); ``formula`` everywhere else, and where a kernel fails.

    Args:
        formula: the plain formula, ``formula(weight, dim, eps, groups, gain, factor)``.
        check: ``check(parametrization, weight, gain)``: the technique's checks; returns the
            axis and the gain's factor (None without a gain).
        rows: ``rows(weight, dim, groups)``: the weight as one row per standardized slice,
            and what :func:`unrows` needs to undo it; ``unrows(rows, shape, dim, groups)``.
    """

    what = "weight standardization"

    def __init__(
        self,
        formula: StandardizationFormula,
        check: Callable[[Any, Tensor, Tensor | None], tuple[int, float | None]],
        rows: Callable[[Tensor, int, int], tuple[Tensor, tuple[int, ...]]],
        unrows: Callable[[Tensor, tuple[int, ...], int, int], Tensor],
    ) -> None:
        self.formula = formula
        self.check = check
        self.rows = rows
        self.unrows = unrows

    def __call__(self, parametrization: Any, weight: Tensor, gain: Tensor | None) -> Tensor:
        route = self.route(parametrization, (weight,) if gain is None else (weight, gain))
        dim, eps, groups = route.dim, parametrization.eps, parametrization.groups
        assert dim is not None  # a standardization's checks always find its axis
        return self.standardize(weight, dim, eps, groups, gain, route.factor, route)

    def standardize(
        self,
        weight: Tensor,
        dim: int,
        eps: float,
        groups: int,
        gain: Tensor | None,
        factor: float | None = None,
        route: Route | None = None,
    ) -> Tensor:
        """The formula on checked arguments (``dim`` in ``range(weight.ndim)``), through the
        kernels where they run; ``route``: a parametrization's, which keeps the plan."""
        scale = 1.0 if factor is None else factor
        try:
            if (
                dim == 0
                and groups == 1
                and weight.numel()
                and (
                    _kernels.available(weight) if gain is None else _kernels.available(weight, gain)
                )
            ):
                # One fused kernel forward and one backward, statistics in float32 for halves:
                # the kernel reads the weight's rows where they are, writes the weight's shape.
                if route is None:
                    return _kernels.standardize_rows(weight, eps, gain, scale)
                plan = route.plan  # (self._plan, inline where the route has one)
                if plan is None:
                    plan = self._plan(weight, eps, gain, scale, route)
                return _kernels.planned_standardization(weight, gain, plan)
            if _kernels.available(weight) and (gain is None or _kernels.available(gain)):
                rows, shape = self.rows(weight, dim, groups)
                if rows.numel():
                    scaled = _kernels.standardize_rows(rows, eps, gain, scale)
                    return self.unrows(scaled, shape, dim, groups)
        except Exception as error:
            _kernel_failed(error, self.what)
        return self.formula(weight, dim, eps, groups, gain, factor)

    @staticmethod
    def _plan(weight: Tensor, eps: float, gain: Tensor | None, scale: float, route: Route) -> Any:
        if route.plan is None:
            route.plan = _kernels.standardization_plan(weight, eps, gain, scale)
        return route.plan

    def settings(self, parametrization: Any) -> tuple[object, ...]:
        # Its _gamma(), 1 for plain WS: not getattr(parametrization, "gamma", 1.0), which
        # for plain WS raises and catches an AttributeError through nn.Module.__getattr__,
        # many times the cost of the rest, at every access.
        return (
            parametrization.dim,
            parametrization.groups,
            parametrization.eps,
            parametrization._gamma(),
        )

    def resolve(self, parametrization: Any, tensors: tuple[Tensor, ...]) -> Route:
        gain = tensors[1] if len(tensors) > 1 else None
        dim, factor = self.check(parametrization, tensors[0], gain)
        return Route(dim, factor)

    def sources(self, parametrization: Any, chain: nn.Module) -> tuple[Source, ...] | None:
        originals = chain._parameters
        if parametrization.groups != 1 or originals.get("original") is None:
            return None
        # A gain is found where it lives now: a Parameter, or a buffer (a frozen gain). Plain
        # WS has none: the launch gets None in its place.
        own = parametrization._parameters
        if "gain" in own:
            where = own
        elif "gain" in parametrization._buffers or "gain" not in parametrization.__dict__:
            where = parametrization._buffers
        else:
            return None  # a gain set as a plain attribute: no dict a launch can watch
        return (originals, "original"), (where, "gain")

    def fusion_plan(
        self, parametrization: Any, tensors: tuple[Tensor | None, ...], route: Route
    ) -> object:
        weight, gain = tensors
        assert weight is not None  # the raw weight, the one original
        if route.dim != 0 or not weight.numel():
            return None
        scale = 1.0 if route.factor is None else route.factor
        plan = self._plan(weight, parametrization.eps, gain, scale, route)
        return plan if _kernels.standardization_fusable(plan) else None

    def launch(self, plans: tuple[Any, ...], tensors: list[Tensor | None]) -> tuple[Tensor, ...]:
        return _kernels.fuse_standardizations(plans, tensors)
