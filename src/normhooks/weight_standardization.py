r"""Weight Standardization for every weighted layer, as a ``torch.nn.utils.parametrize`` hook.

Implements S. Qiao, H. Wang, C. Liu, W. Shen and A. Yuille, "Micro-Batch Training with
Batch-Channel Normalization and Weight Standardization", arXiv:1903.10520 (2019), as
Chainer's ``link_hooks.WeightStandardization`` does it (group normalization of the weight
with one group), and the Scaled WS of NF-Nets (A. Brock, S. De, S. L. Smith and K. Simonyan,
"High-Performance Large-Scale Image Recognition Without Normalization", arXiv:2102.06171).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from normhooks import _checks, _parametrize
from normhooks._kernels import _door, _scope
from normhooks._parametrize import describe
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
    # Through the kernels where they run (a fused kernel each way, the statistics in float32
    # for halves).
    return _DOOR.standardize(weight, axis, eps, groups, gain)


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


def _formula(
    weight: Tensor,
    dim: int,
    eps: float,
    groups: int,
    gain: Tensor | None,
    factor: float | None = None,
) -> Tensor:
    """:func:`standardize_weight` on checked arguments, ``dim`` in ``range(weight.ndim)``,
    with the gain scaled by ``factor`` (Scaled WS's ``gamma / sqrt(fan_in)``) when given, in
    plain torch ops."""
    rows, shape = _rows(weight, dim, groups)
    if rows.numel() == 0:
        return weight.clone()
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
        return _DOOR.route(self, (weight,)).dim  # type: ignore[return-value]

    def _gamma(self) -> float:
        return 1.0

    def _check(self, weight: Tensor, gain: Tensor | None) -> tuple[int, float | None]:
        """The axis of ``weight``, and with ``gain`` its factor ``gamma / sqrt(fan_in)``
        (None for a weight without values); raises where they do not fit."""
        _parametrize.check_tensor(weight, "weight", _WHAT)
        dim = self.dim
        if not -weight.ndim <= dim < weight.ndim:
            _checks.axis("dim", dim, weight.ndim, f"a weight of shape {list(weight.shape)}")
        dim %= weight.ndim
        if self.groups > 1:
            _check_groups(weight, dim, self.groups)
        if gain is None:
            return dim, None
        gain = _check_gain("gain", gain, weight, dim, self.groups)
        fan_in = weight.numel() // gain.shape[0] if gain.shape[0] else 0
        return dim, self._gamma() / math.sqrt(fan_in) if fan_in else None

    def forward(self, weight: Tensor) -> Tensor:
        return _DOOR(self, weight, None)

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

    def forward(self, weight: Tensor) -> Tensor:
        return _DOOR(self, weight, self.gain)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gamma={self.gamma}, num_channels={self.gain.numel()}"


# The one door to the fast paths (kernels, fused launches): the formula and the checks are
# this file's, the rest is normhooks._kernels'.
_DOOR = _door.StandardizationDoor(_formula, WeightStandardization._check, _rows, _unrows)
_door.register(WeightStandardization, _DOOR)


# --- what the lifecycle needs to know -------------------------------------------------------


@dataclass(frozen=True)
class _Standardization(_parametrize.Technique[tuple[int, int]]):
    """Weight standardization (Scaled WS with ``scaled``) along ``dim`` (None: the output axis),
    checked by the public functions; its layout is the standardized axis and the
    input-channel groups each of its slices spans, resolved for each weight."""

    eps: float = 1e-5
    dim: int | None = None
    scaled: bool = False
    gamma: float = 1.0

    marker = "weight_standardization"
    what = _WHAT
    done = "standardized"
    verb = "standardize"
    tree_function = "apply_weight_standardization"
    parametrization = WeightStandardization
    layers = (ConvNd,)

    @property
    def label(self) -> str:
        return "Scaled WS" if self.scaled else _WHAT

    def layout(self, module: nn.Module, name: str, ndim: int) -> tuple[int, int]:
        if self.dim is None:
            axis = _parametrize.output_axis(module)
        else:
            axis = _checks.axis("dim", self.dim, ndim, describe(module, name))
        groups = getattr(module, "groups", 1)
        spans_groups = _parametrize.is_transposed(module) and axis == 1 and groups > 1
        return axis, groups if spans_groups else 1

    def build(self, weight: Tensor, layout: tuple[int, int]) -> nn.Module:
        axis, groups = layout
        if not self.scaled:
            return WeightStandardization(self.eps, axis, groups=groups)
        return ScaledWeightStandardization(
            weight.shape[axis] * groups,
            self.eps,
            axis,
            groups=groups,
            gamma=self.gamma,
            device=weight.device,
            dtype=weight.dtype,
        )

    def companions(self) -> dict[str, tuple[str, str]]:
        return {"gain": ("parametrization", "gain")} if self.scaled else {}

    def self_standardizing(self, own: str) -> str | None:
        if not self.scaled:
            return None  # plain WS is what the layer does already
        remedy = (
            "it applies Scaled WS itself, with its own gain and gamma: use it as it is"
            if "Scaled" in own
            else "it applies plain WS itself: keep it that way (plain WS leaves it alone), or "
            "build the model with plain convolutions for Scaled WS"
        )
        return f"it would cancel the gain of Scaled WS, which would then never train; {remedy}"

    def refuse(self, module: nn.Module, name: str, layout: tuple[int, int] | None) -> None:
        """Raises where standardization would cancel the g of a weight norm beneath it.

        Standardizing a slice removes its scale, so a g that is one number over each
        standardized slice (the usual layout: g per output channel, or one g for the whole
        tensor) has no effect on the weight, and a gradient of about zero: it would never
        train.
        """
        pending_wn = "weight_norm" in _parametrize.pending_markers(module, name)
        found, wn_axis = _parametrize.weight_norm_axis(module, name)
        if not (found or pending_wn):
            return
        if found and layout is not None and wn_axis is not None and wn_axis != layout[0]:
            return  # g varies within each standardized slice: nothing cancels it
        raise ValueError(
            f"{describe(module, name)} is weight-normalized"
            + (" at its first forward" if pending_wn and not found else "")
            + "; standardizing g * v / ||v|| slice by slice would cancel g, which would then "
            "never train. Use one of the two, or remove the weight norm first "
            "(remove_weight_norm)"
        )


def _technique(eps: object, dim: object, scaled: object, gamma: object) -> _Standardization:
    """The public functions' settings, checked."""
    eps = _checks.positive("eps", eps)
    if dim is not None:
        dim = _checks.integer("dim", dim)
    scaled = _checks.boolean("scaled", scaled)
    gamma = _checks.positive("gamma", gamma)
    if gamma != 1.0 and not scaled:
        raise ValueError(
            f"gamma={gamma} scales only Scaled WS; pass scaled=True with it, or leave gamma at 1"
        )
    return _Standardization(eps, dim, scaled, gamma)


# --- public functions -----------------------------------------------------------------------


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
    _parametrize.convert(_technique(eps, dim, scaled, gamma), module, name)
    return module


def apply_weight_standardization(
    model: nn.Module,
    *,
    layer_types: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
    eps: float = 1e-5,
    scaled: bool = False,
    gamma: float = 1.0,
    fuse: bool = True,
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
        fuse: on CUDA with Triton, compute every standardized weight of ``model`` in one
            launch per forward (and their gradients in one), served to the layers for the
            forward (see docs/caching.md). One thing a fused forward cannot see: a write into
            a raw weight's values through ``.data`` inside the forward (``w.data.mul_(2)`` in a
            forward pre-hook) after the scope opened; a ``.data`` assignment, an in-place op
            or a change of dtype or layout is seen. False: each layer computes its own weight
            at each access, as torch's parametrizations do.

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
    technique = _technique(eps, None, scaled, gamma)
    fuse = _checks.boolean("fuse", fuse)
    _parametrize.convert_tree(technique, model, layer_types)
    return _scope.fuse(model) if fuse else _scope.unfuse(model)


def remove_weight_standardization(
    module: nn.Module, name: str | None = None, *, bake: bool = True
) -> nn.Module:
    """Removes weight standardization from ``module.<name>``, or from the whole tree.

    Args:
        module: the layer, or a model when ``name`` is None.
        name: the parameter's name, or None for every standardization in the module tree
            (pending ones on lazy modules included).
        bake: True leaves the standardized weight (times the gain, for Scaled WS) as a plain
            Parameter laid out like the raw weight (contiguous, where that was), for inference
            and export with an unchanged output; False
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
    _parametrize.remove(_Standardization(), module, name, bake=_checks.boolean("bake", bake))
    return module
