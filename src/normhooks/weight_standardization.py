r"""Weight Standardization for every weighted layer, as a ``torch.nn.utils.parametrize`` hook.

Implements S. Qiao, H. Wang, C. Liu, W. Shen and A. Yuille, "Micro-Batch Training with
Batch-Channel Normalization and Weight Standardization", arXiv:1903.10520 (2019), as
Chainer's ``link_hooks.WeightStandardization`` does it (group normalization of the weight
with one group), and the Scaled WS of NF-Nets (A. Brock, S. De, S. L. Smith and K. Simonyan,
"High-Performance Large-Scale Image Recognition Without Normalization", arXiv:2102.06171).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normhooks import _checks, _fusion, _kernels, _parametrize, _torch_compat
from normhooks._parametrize import describe, output_axis
from normhooks._precision import upcast
from normhooks._torch_compat import ConvNd

__all__ = [
    "ScaledWeightStandardization",
    "WeightStandardization",
    "apply_weight_standardization",
    "remove_weight_standardization",
    "standardize_weight",
    "weight_standardization",
]

_MARKER = "weight_standardization"
_WHAT = "weight standardization"


def _rows(weight: Tensor, dim: int, groups: int) -> tuple[Tensor, tuple[int, ...]]:
    """``weight`` as a matrix with one row per standardized slice, and how to undo it.

    With ``groups > 1``, ``dim`` is the output axis of a grouped transposed convolution
    (``in_channels x out_channels / groups x kernel``): output filter ``j`` of group ``k``
    spans only the input channels of group ``k``, so its row holds just those.
    """
    # Explicit row lengths: reshape(n, -1) cannot infer one for a weight with no rows.
    if groups == 1:
        moved = weight if dim == 0 else weight.movedim(dim, 0)
        return moved.reshape(moved.shape[0], math.prod(moved.shape[1:])), tuple(moved.shape)
    shape = weight.shape
    per_group = weight.reshape(groups, shape[0] // groups, *shape[1:]).movedim(dim + 1, 1)
    rows = groups * shape[dim]
    return per_group.reshape(rows, math.prod(per_group.shape[2:])), tuple(per_group.shape)


def _unrows(rows: Tensor, shape: tuple[int, ...], dim: int, groups: int) -> Tensor:
    if groups == 1:
        restored = rows.reshape(shape)
        return restored if dim == 0 else restored.movedim(0, dim)
    per_group = rows.reshape(shape).movedim(1, dim + 1)
    return per_group.reshape(-1, *per_group.shape[2:])


def standardize_weight(
    weight: Tensor,
    dim: int = 0,
    eps: float = 1e-5,
    *,
    groups: int = 1,
    gain: Tensor | None = None,
) -> Tensor:
    r"""Standardizes every slice of ``weight`` along ``dim`` to zero mean and unit variance.

    .. math::

        \hat W_{c} = \frac{W_{c} - \operatorname{mean}(W_{c})}{\sqrt{\operatorname{var}(W_{c})
        + \epsilon}}

    for each index :math:`c` of axis ``dim``, with statistics over all other axes and the
    biased variance: one normalization kernel over the reshaped weight (``group_norm`` on the
    CPU; on CUDA a fused Triton kernel, or ``layer_norm`` without Triton). float16/bfloat16
    weights are standardized in float32 and the result is rounded once.

    Args:
        weight: a tensor with at least 2 dimensions.
        dim: the axis whose slices are standardized one by one (the output channels).
        eps: added to the variance inside the square root.
        groups: for the output axis of a grouped transposed convolution, the number of
            input-channel groups: each output slice then spans its own group only.
        gain: optional factor per standardized slice, applied afterwards: shape
            ``[weight.shape[dim] * groups]``, ordered like the layer's output channels.

    Returns:
        The standardized weight, same shape and dtype as ``weight``.

    References:
        Qiao et al., Micro-Batch Training with Batch-Channel Normalization and Weight
        Standardization, arXiv:1903.10520.

    Example:
        >>> w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]])
        >>> standardize_weight(w)
        tensor([[-1.2247,  0.0000,  1.2247],
                [ 0.0000,  0.0000,  0.0000]])
    """
    weight = _parametrize.check_tensor(weight, "weight", _WHAT)
    axis = _checks.axis("dim", dim, weight.ndim, f"a weight of shape {list(weight.shape)}")
    eps = _checks.positive("eps", eps)
    groups = _checks.positive_int("groups", groups)
    _check_groups(weight, axis, groups)
    if gain is not None:
        _check_gain("gain", gain, weight, axis, groups)
    return _standardize(weight, axis, eps, groups, gain)


def _check_groups(weight: Tensor, dim: int, groups: int) -> None:
    if groups > 1 and (dim == 0 or weight.shape[0] % groups):
        raise ValueError(
            f"groups={groups} splits axis 0 (a transposed convolution's input channels) into "
            f"groups for the output axis dim; it needs dim >= 1 and axis 0 divisible by "
            f"groups, got dim={dim} for a weight of shape {list(weight.shape)}"
        )


def _check_gain(where: str, gain: object, weight: Tensor, dim: int, groups: int) -> Tensor:
    """``gain`` if it has one real floating-point entry per standardized slice.

    Every path reads the gain by row (the kernel without bounds checks, the formula by
    broadcasting, which would spread a single entry over every row).
    """
    if not isinstance(gain, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(gain).__name__}")
    _parametrize.check_dtype(where, gain.dtype, _WHAT)
    channels = weight.shape[dim] * groups
    if gain.ndim != 1 or gain.shape[0] != channels:
        grouped = f" with groups={groups}" if groups > 1 else ""
        raise ValueError(
            f"{where} must have shape [{channels}], one entry per output channel of a weight of "
            f"shape {list(weight.shape)} along dim={dim}{grouped}, got {where} of shape "
            f"{list(gain.shape)}"
        )
    return gain


def _standardize(
    weight: Tensor,
    dim: int,
    eps: float,
    groups: int,
    gain: Tensor | None,
    factor: float | None = None,
    route: _Route | None = None,
) -> Tensor:
    """:func:`standardize_weight` on checked arguments, ``dim`` in ``range(weight.ndim)``,
    with the gain scaled by ``factor`` (Scaled WS's ``gamma / sqrt(fan_in)``) when given.
    ``route``: a parametrization's, which keeps the kernels' plan."""
    if (
        dim == 0
        and groups == 1
        and weight.numel()
        and (_kernels.available(weight) if gain is None else _kernels.available(weight, gain))
    ):
        # One fused kernel forward and one backward, statistics in float32 for halves: the
        # kernel reads the weight's rows where they are, and writes the weight's shape.
        scale = 1.0 if factor is None else factor
        if route is None:
            return _kernels.standardize_rows(weight, eps, gain, scale)
        if route.plan is None:
            route.plan = _kernels.standardization_plan(weight, eps, gain, scale)
        return _kernels.planned_standardization(weight, gain, route.plan)
    rows, shape = _rows(weight, dim, groups)
    if rows.numel() == 0:
        return weight.clone()
    if _kernels.available(rows) and (gain is None or _kernels.available(gain)):
        scaled = _kernels.standardize_rows(rows, eps, gain, 1.0 if factor is None else factor)
        return _unrows(scaled, shape, dim, groups)
    if gain is not None and factor is not None:
        gain = gain * factor
    exact = upcast(rows)
    if exact.device.type == "cpu":
        # Each row as one sample of a one-group group norm, which is how Chainer computes it;
        # on the CPU its kernel is several times faster than layer_norm's for rows this long.
        standardized = torch.group_norm(exact.unsqueeze(1), 1, None, None, eps).squeeze(1)
    else:
        # Without Triton on a GPU: both are launch-bound for weights, and layer_norm launches
        # fewer kernels.
        standardized = torch.layer_norm(exact, exact.shape[1:], None, None, eps)
    if gain is not None:
        standardized = standardized * gain.to(standardized.dtype).view(-1, 1)
    return _unrows(standardized.to(weight.dtype), shape, dim, groups)


class _Route:
    """Where a parametrization's weight is computed: the standardized axis after the checks,
    Scaled WS's ``gamma / sqrt(fan_in)``, and the kernels' plan, made at the first forward
    that runs them."""

    __slots__ = ("dim", "factor", "group", "plan")

    def __init__(self, dim: int, factor: float | None = None) -> None:
        self.dim = dim
        self.factor = factor
        self.plan: object = None
        # The fused launch it can join, found at the first fused scope that meets it; False
        # where it can join none.
        self.group: FusionGroup | Literal[False] | None = None


# The fused launch a weight joins: its entry point in normhooks._kernels, device, dtype.
FusionGroup = tuple[str, torch.device, torch.dtype]

# What a parametrization hands a fused launch (see WeightStandardization._fusion_inputs): the
# group it joins, its kernel plan, its tensors, and (dict, key, tensor, version) for each.
FusionInputs = tuple[
    "FusionGroup",
    object,
    tuple[Tensor | None, ...],
    tuple[tuple[dict[str, Any], str, Tensor, int], ...],
]

# The device types whose tensors the kernels take (the CPU's only inside
# _kernels.route_cpu_tensors()).
_KERNEL_DEVICES = ("cuda", "cpu")

# The parametrizations' routes, by what they depend on (see WeightStandardization._route).
_ROUTES: dict[tuple[object, ...], _Route] = {}
_MAX_ROUTES = 4096


class WeightStandardization(nn.Module):
    r"""Parametrization ``W -> (W - mean) / sqrt(var + eps)``, statistics per slice of ``dim``.

    Register it with :func:`weight_standardization`, or directly with
    ``torch.nn.utils.parametrize.register_parametrization(module, "weight", ...)``. Like
    every parametrization, the weight is recomputed at each access; inside
    ``torch.nn.utils.parametrize.cached()`` it is computed once per scope.

    Args:
        eps: added to the variance inside the square root; must be positive.
        dim: the axis whose slices are standardized (the output channels).
        groups: input-channel groups of a grouped transposed convolution, when ``dim`` is its
            output axis (see :func:`standardize_weight`).

    Example:
        >>> from torch.nn.utils import parametrize
        >>> conv = torch.nn.Conv2d(3, 8, 3)
        >>> _ = parametrize.register_parametrization(conv, "weight", WeightStandardization())
        >>> w = conv.weight.flatten(1)
        >>> torch.allclose(w.mean(1), torch.zeros(8), atol=1e-6)
        True
    """

    def __init__(self, eps: float = 1e-5, dim: int = 0, *, groups: int = 1) -> None:
        super().__init__()
        self.eps = _checks.positive("eps", eps)
        self.dim = _checks.integer("dim", dim)
        self.groups = _checks.positive_int("groups", groups)

    def _axis(self, weight: Tensor) -> int:
        """The standardized axis of ``weight``, after the checks of :func:`standardize_weight`
        that its arguments need (the settings were checked at construction)."""
        return self._route(weight).dim

    def _route(self, weight: Tensor, gain: Tensor | None = None) -> _Route:
        """The outcome of the checks of ``weight`` (and of ``gain``, for Scaled WS): the
        standardized axis, and where the kernels run, their plan.

        In eager code on plain tensors, the outcome is kept by everything it depends on
        (shapes, strides, dtypes, devices and the settings), so a layer pays for its checks
        once and finds its kernel plan with them; under ``torch.compile`` they run as they
        are, static attribute reads.
        """
        plain = (
            _torch_compat.plain_tensors(weight)
            if gain is None
            else _torch_compat.plain_tensors(weight, gain)
        )
        if torch.compiler.is_compiling() or not plain:
            unkept = self._new_route(weight, gain)
            unkept.group = False  # not a fused launch's: its tensors are not plain
            return unkept
        key: tuple[object, ...] = (weight.shape, weight.stride(), weight.dtype, weight.device)
        key += (type(self), self.dim, self.groups, self.eps)
        if gain is not None:
            key += (gain.shape, gain.stride(), gain.dtype, gain.device, self._gamma())
        route = _ROUTES.get(key)
        if route is None:
            route = self._new_route(weight, gain)
            if len(_ROUTES) >= _MAX_ROUTES:
                _ROUTES.clear()
            _ROUTES[key] = route
        return route

    def _gamma(self) -> float:
        return 1.0

    def _gain(self) -> Tensor | None:
        return None

    def _fusion_inputs(self, chain: nn.Module) -> FusionInputs | None:
        """What a fused launch (:mod:`normhooks._fusion`) needs to compute this weight with
        others, or None where the layer keeps its own path now."""
        originals = chain._parameters
        weight = originals.get("original")
        if weight is None or self.groups != 1:
            return None
        gain = self._gain()
        route = self._route(weight, gain)
        group = route.group
        if group is None:
            group = route.group = self._fusion_group(weight, gain, route)
        # A route found in the cache is of plain tensors of one device, whose type was
        # checked: for the CPU the routing switch remains.
        if group is False or group is None:
            return None
        if group[1].type == "cpu" and not _kernels.routing_cpu_tensors():
            return None
        checks: tuple[tuple[dict[str, Any], str, Tensor, int], ...]
        checks = ((originals, "original", weight, weight._version),)
        if gain is not None:
            checks += ((self._parameters, "gain", gain, gain._version),)
        return group, route.plan, (weight, gain), checks

    def _fusion_group(
        self, weight: Tensor, gain: Tensor | None, route: _Route
    ) -> FusionGroup | Literal[False]:
        """The fused launch a weight of ``route`` joins (where its tensors are on a device
        the kernels take), or False where it can join none."""
        if route.dim != 0 or not weight.numel() or weight.device.type not in _KERNEL_DEVICES:
            return False
        # Whether the kernels take the device depends, for the CPU, on the private routing
        # switch, checked at each scope.
        if gain is not None and (gain.dtype != weight.dtype or gain.device != weight.device):
            return False
        if route.plan is None:
            scale = 1.0 if route.factor is None else route.factor
            route.plan = _kernels.standardization_plan(weight, self.eps, gain, scale)
        if not _kernels.standardization_fusable(route.plan):
            return False
        return ("fuse_standardizations", weight.device, weight.dtype)

    def _new_route(self, weight: Tensor, gain: Tensor | None) -> _Route:
        _parametrize.check_tensor(weight, "weight", _WHAT)
        dim = self.dim
        if not -weight.ndim <= dim < weight.ndim:
            _checks.axis("dim", dim, weight.ndim, f"a weight of shape {list(weight.shape)}")
        dim %= weight.ndim
        if self.groups > 1:
            _check_groups(weight, dim, self.groups)
        if gain is None:
            return _Route(dim)
        _check_gain("gain", gain, weight, dim, self.groups)
        fan_in = weight.numel() // gain.shape[0] if gain.shape[0] else 0
        return _Route(dim, self._gamma() / math.sqrt(fan_in) if fan_in else None)

    def forward(self, weight: Tensor) -> Tensor:
        route = self._route(weight)
        return _standardize(weight, route.dim, self.eps, self.groups, None, route=route)

    def extra_repr(self) -> str:
        groups = f", groups={self.groups}" if self.groups != 1 else ""
        return f"eps={self.eps}, dim={self.dim}{groups}"


class ScaledWeightStandardization(WeightStandardization):
    r"""Scaled WS (NF-Nets): a learnable gain per output channel on top of standardization.

    .. math::

        W' = \text{gain} \cdot \frac{\gamma}{\sqrt{N}} \cdot
             \frac{W - \operatorname{mean}(W)}{\sqrt{\operatorname{var}(W) + \epsilon}}

    where :math:`N` is the fan-in (elements per output channel) and the gain, a Parameter of
    this module initialised to 1, has one entry per output channel.

    Args:
        num_channels: the number of output channels: the size of ``dim`` times ``groups``.
        eps: added to the variance inside the square root; must be positive.
        dim: the output-channel axis.
        groups: see :class:`WeightStandardization`.
        gamma: fixed factor for the activation function (NF-Nets' :math:`\gamma`).

    References:
        Brock et al., High-Performance Large-Scale Image Recognition Without Normalization,
        arXiv:2102.06171.
    """

    def __init__(
        self,
        num_channels: int,
        eps: float = 1e-5,
        dim: int = 0,
        *,
        groups: int = 1,
        gamma: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(eps, dim, groups=groups)
        _checks.positive_int("num_channels", num_channels)
        self.gamma = _checks.positive("gamma", gamma)
        self.gain = nn.Parameter(torch.ones(num_channels, device=device, dtype=dtype))

    def right_inverse(self, weight: Tensor) -> Tensor:
        # Not an inverse (standardization loses each slice's mean and scale): registration
        # keeps the raw weight as the original, and this is where its channel count is
        # checked against the gain's, with a message instead of a broadcasting error.
        channels = weight.shape[self._axis(weight)] * self.groups
        if channels != self.gain.numel():
            raise ValueError(
                f"ScaledWeightStandardization has num_channels={self.gain.numel()}, but the "
                f"weight of shape {list(weight.shape)} has {channels} output channels along "
                f"dim={self.dim}" + (f" with groups={self.groups}" if self.groups > 1 else "")
            )
        return weight

    def _gamma(self) -> float:
        return self.gamma

    def _gain(self) -> Tensor | None:
        return self._parameters.get("gain")

    def forward(self, weight: Tensor) -> Tensor:
        gain = self.gain
        route = self._route(weight, gain)
        return _standardize(weight, route.dim, self.eps, self.groups, gain, route.factor, route)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gamma={self.gamma}, num_channels={self.gain.numel()}"


def _is_standardized(module: nn.Module, name: str) -> bool:
    return _parametrize.pending(module, name, _MARKER) or any(
        isinstance(p, WeightStandardization) for p in _parametrize.parametrizations_of(module, name)
    )


def _resolve(module: nn.Module, name: str, ndim: int, dim: int | None) -> tuple[int, int]:
    """The standardized axis and the input-channel groups its slices span."""
    where = describe(module, name)
    _parametrize.check_ndim(where, ndim, _WHAT)
    axis = output_axis(module) if dim is None else _checks.axis("dim", dim, ndim, where)
    groups = getattr(module, "groups", 1)
    spans_groups = _parametrize.is_transposed(module) and axis == 1 and groups > 1
    return axis, groups if spans_groups else 1


def _check_options(eps: object, scaled: object, gamma: object) -> tuple[float, bool, float]:
    eps = _checks.positive("eps", eps)
    scaled = _checks.boolean("scaled", scaled)
    gamma = _checks.positive("gamma", gamma)
    if gamma != 1.0 and not scaled:
        raise ValueError(
            f"gamma={gamma} scales only Scaled WS; pass scaled=True with it, or leave gamma at 1"
        )
    return eps, scaled, gamma


def _plan(
    module: nn.Module, name: str, eps: float, dim: int | None, scaled: bool, gamma: float
) -> Callable[[], _parametrize.Undo]:
    """Checks ``module.<name>`` and returns the step that standardizes it."""
    weight = _parametrize.checked_tensor(module, name, _WHAT)
    if _is_standardized(module, name):
        raise ValueError(f"{describe(module, name)} is already standardized")
    own = _parametrize.own_standardization(module) if name == "weight" else None
    if own is not None and scaled:
        remedy = (
            "it applies Scaled WS itself, with its own gain and gamma: use it as it is"
            if "Scaled" in own
            else "it applies plain WS itself: keep it that way (plain WS leaves it alone), or "
            "build the model with plain convolutions for Scaled WS"
        )
        raise ValueError(
            f"{describe(module, name)} is a {own}, whose forward standardizes whatever weight "
            "it is given: it would cancel the gain of Scaled WS, which would then never train; "
            + remedy
        )
    if own is not None:
        raise ValueError(
            f"{describe(module, name)} is already standardized by its own forward ({own}); "
            "standardizing it again would only repeat it"
        )
    _refuse_weight_norm_underneath(module, name, weight, dim)
    if weight is None:
        ndim = _parametrize.expected_ndim(module, name)
        if ndim is not None:
            _resolve(module, name, ndim, dim)
        register = functools.partial(
            _register, name=name, eps=eps, dim=dim, scaled=scaled, gamma=gamma
        )
        companions = ("gain",) if scaled else ()
        return lambda: _parametrize.defer(
            module, name, register, _MARKER, _what(scaled), companions
        )
    return functools.partial(_register, module, name, eps, dim, scaled, gamma)


def _what(scaled: bool) -> str:
    return "Scaled WS" if scaled else _WHAT


def _refuse_weight_norm_underneath(
    module: nn.Module, name: str, weight: Tensor | None, dim: int | None
) -> None:
    """Raises where standardization would cancel the g of a weight norm beneath it.

    Standardizing a slice removes its scale, so a g that is one number over each standardized
    slice (the usual layout: g per output channel, or one g for the whole tensor) has no
    effect on the weight, and a gradient of about zero: it would never train.
    """
    pending_wn = "weight_norm" in _parametrize.pending_markers(module, name)
    found, wn_axis = _parametrize.weight_norm_axis(module, name)
    if not (found or pending_wn):
        return
    if found and weight is not None:
        axis, _ = _resolve(module, name, weight.ndim, dim)
        if wn_axis is not None and wn_axis != axis:
            return  # g varies within each standardized slice: nothing cancels it
    raise ValueError(
        f"{describe(module, name)} is weight-normalized"
        + (" at its first forward" if pending_wn and not found else "")
        + "; standardizing g * v / ||v|| slice by slice would cancel g, which would then never "
        "train. Use one of the two, or remove the weight norm first (remove_weight_norm)"
    )


def _register(
    module: nn.Module,
    name: str,
    eps: float,
    dim: int | None,
    scaled: bool,
    gamma: float,
    companions: _parametrize.Companions | None = None,
) -> _parametrize.Undo:
    """Standardizes ``module.<name>``, which exists (a lazy module's, by its first forward).

    On a lazy module, Scaled WS's gain is the placeholder made at conversion
    (``companions``), so an optimizer built before the first forward trains it.
    """
    weight = _parametrize.checked_tensor(module, name, _WHAT)
    if weight is None:
        raise ValueError(f"{describe(module, name)} is still uninitialized")
    axis, groups = _resolve(module, name, weight.ndim, dim)
    parametrization: WeightStandardization
    if scaled:
        parametrization = ScaledWeightStandardization(
            weight.shape[axis] * groups,
            eps,
            axis,
            groups=groups,
            gamma=gamma,
            device=weight.device,
            dtype=weight.dtype,
        )
        if companions is not None:
            parametrization.gain = _parametrize.materialized(
                companions["gain"], parametrization.gain
            )
    else:
        parametrization = WeightStandardization(eps, axis, groups=groups)
    return _parametrize.register(
        module, name, parametrization, _what(scaled), watch=companions is None
    )


def weight_standardization(
    module: nn.Module,
    name: str = "weight",
    *,
    eps: float = 1e-5,
    dim: int | None = None,
    scaled: bool = False,
    gamma: float = 1.0,
) -> nn.Module:
    r"""Standardizes ``module.<name>`` at every forward (Weight Standardization).

    Registers a :class:`WeightStandardization` (or, with ``scaled=True``, a
    :class:`ScaledWeightStandardization`) parametrization on the parameter. The raw weight
    stays the same Parameter object, under ``module.parametrizations.<name>.original``, so an
    existing optimizer keeps updating it. Scaled WS adds a Parameter, the gain, which an
    optimizer built before the conversion does not hold: build the optimizer after
    converting (or add the gains with ``optimizer.add_param_group``); an optimizer that holds
    the raw weight and no optimizer the gain raises at its second step. On a lazy module
    (``LazyConv2d``, ``LazyLinear``, ...) the parametrization is registered at the first
    forward, once the weight exists; the gain is created at conversion, uninitialized, so an
    optimizer built before the first forward trains it. To convert a whole model, use
    :func:`apply_weight_standardization`.

    Args:
        module: the layer that owns the weight.
        name: the parameter's name.
        eps: added to the variance inside the square root; must be positive.
        dim: the axis of output channels, whose slices are standardized one by one. None
            picks it: 1 for ``ConvTranspose1d/2d/3d`` (with ``groups > 1`` each output filter's
            statistics span its own input-channel group), 0 for every other layer. ``dim=0``
            on a transposed convolution standardizes per input channel, as Chainer does.
        scaled: Scaled WS (NF-Nets): multiply by a learnable per-channel gain (initialised to
            1) and by ``gamma / sqrt(fan_in)``.
        gamma: NF-Nets' activation gain; only with ``scaled=True``.

    Returns:
        ``module``.

    References:
        Qiao et al., Micro-Batch Training with Batch-Channel Normalization and Weight
        Standardization, arXiv:1903.10520. Brock et al., High-Performance Large-Scale Image
        Recognition Without Normalization, arXiv:2102.06171.

    Example:
        >>> conv = weight_standardization(torch.nn.Conv2d(3, 8, 3))
        >>> w = conv.weight.flatten(1)
        >>> torch.allclose(w.std(1, unbiased=False), torch.ones(8), atol=1e-3)
        True
    """
    eps, scaled, gamma = _check_options(eps, scaled, gamma)
    _parametrize.check_module(module)
    if not isinstance(name, str) or not hasattr(module, name):
        _parametrize.check_name(name)
        raise ValueError(
            f"{_parametrize.layer_name(module)} has no parameter named {name!r}; to "
            "standardize every layer of a model, use apply_weight_standardization(model)"
        )
    _plan(module, name, eps, dim, scaled, gamma)()
    return module


def apply_weight_standardization(
    model: nn.Module,
    *,
    layer_types: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
    eps: float = 1e-5,
    scaled: bool = False,
    gamma: float = 1.0,
) -> nn.Module:
    """Standardizes the ``weight`` of every matching layer in ``model``.

    The whole tree is checked before anything changes: either every matching layer is
    standardized, or the call raises and the model is left as it was.

    Args:
        model: the model; changed in place.
        layer_types: the layer classes to standardize (subclasses included). None means every
            convolution and transposed convolution, lazy ones included: the paper's use.
        eps: see :func:`weight_standardization`.
        scaled: see :func:`weight_standardization`.
        gamma: see :func:`weight_standardization`.

    Returns:
        ``model``. Layers already standardized are skipped; matching layers without a
        ``weight`` Parameter (a bias-free container, say) are skipped too. So are, with a
        warning, layers whose own forward standardizes their weight (timm's ``StdConv2d``,
        ``StdConv2dSame``, ``ScaledStdConv2d``, ``ScaledStdConv2dSame`` and subclasses,
        transformers' BiT ``WeightStandardizedConv2d``): standardizing again would repeat it.

    Raises:
        ValueError: no layer of ``model`` matches, or every match is already standardized;
            ``scaled=True`` on a layer that standardizes its own weight, which would cancel
            the gain (it would never train).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8))
        >>> model = apply_weight_standardization(model)
        >>> type(model[0]).__name__
        'ParametrizedConv2d'
    """
    eps, scaled, gamma = _check_options(eps, scaled, gamma)
    types = _parametrize.layer_types(layer_types, (ConvNd,))
    _parametrize.check_module(model, "model")
    _parametrize.refuse_wrapped(model, _WHAT)
    steps = []
    matched = already = 0
    own: list[str] = []
    for prefix, layer in model.named_modules():
        if _parametrize.is_internal(layer) or not isinstance(layer, types):
            continue
        torch_wn = _parametrize.torch_weight_norm(layer, "weight")
        if torch_wn is not None and _parametrize.is_torch_legacy_weight_norm(torch_wn):
            raise ValueError(
                f"{describe(layer, 'weight')} carries torch's legacy weight norm "
                "(torch.nn.utils.weight_norm), which recomputes the weight in a forward "
                "pre-hook; weight standardization cannot stack on it (and would cancel its g). "
                "Remove it first (torch.nn.utils.remove_weight_norm), or leave the layer out"
            )
        if "weight" not in layer._parameters and not parametrize.is_parametrized(layer, "weight"):
            continue
        matched += 1
        if _is_standardized(layer, "weight"):
            already += 1
            continue
        if not scaled and _parametrize.own_standardization(layer) is not None:
            # Its forward standardizes the weight already; _plan refuses Scaled WS on it.
            own.append(prefix or _parametrize.layer_name(layer))
            continue
        steps.append(_plan(layer, "weight", eps, None, scaled, gamma))
    if not steps:
        names = ", ".join(t.__name__ for t in types)
        reason = (
            f"all {matched} matching layers are already standardized"
            + (f" ({len(own)} by their own forward, as timm's StdConv2d)" if own else "")
            if matched
            else f"it has no layer of type {names} with a weight"
        )
        raise ValueError(f"nothing to standardize in {_parametrize.layer_name(model)}: {reason}")
    _parametrize.apply_all(steps)
    if own:
        warnings.warn(
            f"apply_weight_standardization skipped {', '.join(own)}: their forward standardizes "
            "the weight itself (timm's StdConv2d and its kin), and standardizing it again "
            "would only repeat it",
            stacklevel=2,
        )
    return _fusion.fuse(model)


def remove_weight_standardization(
    module: nn.Module, name: str | None = None, *, bake: bool = True
) -> nn.Module:
    """Removes weight standardization from ``module.<name>``, or from the whole tree.

    Args:
        module: the layer, or a model when ``name`` is None.
        name: the parameter's name, or None for every standardization in the module tree
            (pending ones on lazy modules included).
        bake: True leaves the standardized weight (times the gain, for Scaled WS) as a plain
            contiguous Parameter, for inference and export with an unchanged output; False
            restores the raw weight. Either way it is the same Parameter object as before, so
            an existing optimizer keeps working. Baking writes into that Parameter: the tree
            form refuses layers that share (tie) one raw weight; with a ``name``, bake a tied
            weight only where no other layer standardizes it.

    Returns:
        ``module``.

    Example:
        >>> conv = weight_standardization(torch.nn.Conv2d(3, 8, 3))
        >>> before = conv(torch.ones(1, 3, 5, 5))
        >>> conv = remove_weight_standardization(conv)
        >>> torch.allclose(conv(torch.ones(1, 3, 5, 5)), before, atol=1e-6)
        True
    """
    bake = _checks.boolean("bake", bake)
    _parametrize.check_module(module)
    if name is not None:
        _parametrize.check_name(name)
        if _parametrize.cancel_pending(module, name, _MARKER):
            return module
        _check_removable(module, name, bake)
        _remove(module, name, bake)
        return module
    targets = []
    found = False
    owners: dict[int, str] = {}
    for prefix, sub in module.named_modules():
        if _parametrize.is_internal(sub):
            continue
        for param_name in _parametrize.parametrized_names(sub):
            if _is_standardized(sub, param_name):
                _check_removable(sub, param_name, bake)
                targets.append((sub, param_name))
                raw = getattr(_parametrize.originals(sub, param_name), "original", None)
                where = f"{prefix}.{param_name}" if prefix else param_name
                first = owners.setdefault(id(raw), where)
                if bake and raw is not None and first != where:
                    # Baking writes into the shared raw weight: the second layer would then
                    # standardize what the first one baked.
                    raise ValueError(
                        f"{first} and {where} standardize the same raw Parameter (tied "
                        "weights); baking one would change the other. Remove with bake=False, "
                        "or untie them first"
                    )
        found |= _parametrize.pending(sub, "weight", _MARKER)
    if not targets and not found:
        raise ValueError(
            f"{_parametrize.layer_name(module)} has no weight standardization to remove"
        )
    for sub in module.modules():
        _parametrize.cancel_pending(sub, "weight", _MARKER)
    for sub, param_name in targets:
        _remove(sub, param_name, bake)
    return module


def _check_removable(module: nn.Module, name: str, bake: bool) -> None:
    chain = _parametrize.parametrizations_of(module, name)
    if not any(isinstance(p, WeightStandardization) for p in chain):
        raise ValueError(f"{describe(module, name)} is not standardized; nothing to remove")
    if len(chain) > 1 and (bake or not isinstance(chain[-1], WeightStandardization)):
        raise ValueError(
            f"{describe(module, name)} has other parametrizations besides weight "
            "standardization; only an outermost standardization can be removed, with "
            "bake=False"
        )


def _remove(module: nn.Module, name: str, bake: bool) -> None:
    chain = _parametrize.parametrizations_of(module, name)
    if len(chain) > 1:
        _parametrize.remove_outermost(module, name)
        return
    _parametrize.remove_parametrizations(module, name, leave_parametrized=bake)
    if bake:
        weight = module._parameters[name]
        if weight is not None and not weight.is_contiguous():
            # A transposed layer's standardized weight comes back permuted; a plain layer's
            # weight is contiguous, and parameters_to_vector and friends expect that.
            weight.data = weight.data.contiguous()
