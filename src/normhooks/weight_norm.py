r"""Weight Normalization for whole modules, with the paper's data-dependent initialization.

Implements T. Salimans and D. P. Kingma, "Weight Normalization: A Simple Reparameterization
to Accelerate Training of Deep Neural Networks", arXiv:1602.07868 (2016), as the Chainer
converter ``convert_with_weight_normalization`` does it (every parameter with 2 or more
dimensions, unit-norm direction at conversion), and the initialization of section 3 that the
original left as a TODO.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normhooks import _checks, _parametrize, _torch_compat
from normhooks._parametrize import (
    cancel_pending,
    checked_tensor,
    describe,
    is_internal,
    is_uninitialized,
    layer_name,
    original,
    output_axis,
    parametrizations_of,
    parametrized_names,
    pending,
    refuse_wrapped,
)
from normhooks._precision import HALF_DTYPES

__all__ = [
    "WeightNorm",
    "convert_with_weight_normalization",
    "data_dependent_init",
    "remove_weight_norm",
    "weight_norm",
]

_MARKER = "weight_norm"
_ALL = "*"  # a deferred conversion of every parameter of a lazy module

M = TypeVar("M", bound=nn.Module)


def _norm_dims(ndim: int, dim: int) -> list[int]:
    return [d for d in range(ndim) if d != dim]


def _row_norms(tensor: Tensor, dim: int) -> Tensor:
    """Euclidean norms over every axis but ``dim``, kept for broadcasting; float32 for halves."""
    norms: Tensor = torch.linalg.vector_norm(
        tensor,
        dim=_norm_dims(tensor.ndim, dim),
        keepdim=True,
        dtype=torch.float32 if tensor.dtype in HALF_DTYPES else None,
    )
    return norms


def _safe_denominator(norm: Tensor, eps: float) -> Tensor:
    if eps > 0:
        return norm + eps
    # A zero row with eps=0 would give 0/0: divide it by 1 instead, so it stays zero.
    return torch.where(norm > 0, norm, torch.ones_like(norm))


def _weight_norm(g: Tensor, v: Tensor, dim: int, eps: float) -> Tensor:
    """``g * v / (||v|| + eps)`` in plain differentiable ops (any dtype, DTensors, compile)."""
    scale = g / _safe_denominator(_row_norms(v, dim), eps)
    return (v * scale).to(v.dtype)


_FAST_DTYPES = (torch.float32, torch.float64)
# Mantissa bits of each: a positive x has ulp(x) / 2 >= x * 2**-(bits + 2).
_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52}


def _eps_vanishes(smallest_norm: float, eps: float, dtype: torch.dtype) -> bool:
    """Whether ``n + eps`` rounds to ``n`` > 0 in ``dtype`` for every ``n >= smallest_norm``.

    Sufficient, not necessary: ``eps`` below a quarter of the smallest norm's unit in the last
    place leaves every larger norm unchanged too, without a tie to round.
    """
    if not smallest_norm > 0:  # also False for NaN
        return False
    return eps < math.ldexp(smallest_norm, -(_MANTISSA_BITS[dtype] + 2))


_PLAIN = (Tensor, nn.Parameter)


class _WeightNormFunction(torch.autograd.Function):
    """``g * v / (||v|| + eps)`` with its gradients in closed form, for the CPU.

    Autograd's own graph of the formula takes about six passes over v in backward; with
    ``s = g / d``, ``d = ||v|| + eps`` and ``p = sum(grad_W * v)`` per row, the gradients are
    ``grad_g = p / d`` and ``grad_v = s * grad_W - (s * p / (d * ||v||)) * v``: one reduction
    and one fused multiply-add, torch's fused weight-norm kernel where it applies (dim 0 or
    last) plus an exact correction for ``eps``. A backward that must itself be differentiable
    (double backward) recomputes through the plain formula instead.
    """

    @staticmethod
    def forward(ctx: Any, g: Tensor, v: Tensor, dim: int, eps: float) -> Tensor:
        ctx.dim, ctx.eps = dim, eps
        norm = _row_norms(v, dim)
        denominator = _safe_denominator(norm, eps)
        ctx.save_for_backward(g, v, norm, denominator)
        return v * (g / denominator)

    @staticmethod
    def backward(ctx: Any, grad_w: Tensor) -> tuple[Tensor | None, ...]:
        g, v, norm, denominator = ctx.saved_tensors
        if torch.is_grad_enabled():
            # The saved inputs carry their history, so this backward is differentiable too.
            wanted = [t for t in (g, v) if t.requires_grad]
            grads = iter(
                torch.autograd.grad(
                    _weight_norm(g, v, ctx.dim, ctx.eps), wanted, grad_w, create_graph=True
                )
            )
            return (*(next(grads) if t.requires_grad else None for t in (g, v)), None, None)
        # At a zero row v is zero, so the terms in v vanish whatever their coefficient.
        safe_norm = torch.where(norm > 0, norm, torch.ones_like(norm))
        if ctx.dim in (0, v.ndim - 1) and v.is_contiguous():
            # torch's fused kernel for g * v / ||v||, given d for ||v||: grad_g = p / d is
            # exact, and its grad_v has p / d^3 where the exact term is p / (d^2 ||v||).
            grad_v, grad_g = _torch_compat.weight_norm_interface_backward(
                grad_w.contiguous(), v, g, denominator, ctx.dim
            )
            # Where ||v|| + eps rounds to ||v||, the function computed is g * v / ||v|| and the
            # kernel's gradient is already the exact one; on the CPU that check is free.
            if ctx.eps > 0 and not torch.equal(denominator, norm):
                correction = -(g * grad_g * ctx.eps) / (denominator * denominator * safe_norm)
                correction = torch.where(denominator == norm, 0.0, correction)
                grad_v.addcmul_(v, correction)
            return grad_g, grad_v, None, None
        dot = (grad_w * v).sum(_norm_dims(v.ndim, ctx.dim), keepdim=True)
        scale = g / denominator
        coefficient = -(scale * dot) / (denominator * safe_norm)
        grad_v = torch.mul(grad_w, scale).addcmul_(v, coefficient)
        return dot / denominator, grad_v, None, None


class WeightNorm(nn.Module):
    r"""Parametrization ``(g, v) -> W = g * v / (||v|| + eps)``, norms over all axes but ``dim``.

    Its ``right_inverse`` is the original converter's decomposition of a weight :math:`W`:
    :math:`g = \|W\| + \epsilon` and :math:`v = W / (\|W\| + \epsilon)` (unit rows), so a
    module's output is unchanged by the conversion. The originals are stored where
    ``torch.nn.utils.parametrizations.weight_norm`` stores them: ``original0`` is g (shape
    with 1s except at ``dim``), ``original1`` is v. Like every parametrization, the weight is
    recomputed at each access; inside ``torch.nn.utils.parametrize.cached()`` it is computed
    once per scope.

    Args:
        dim: the output axis: one norm per index of it.
        eps: added to the norm; 0 is allowed (zero rows still give zero weights).

    Example:
        >>> from torch.nn.utils import parametrize
        >>> linear = torch.nn.Linear(3, 2)
        >>> before = linear.weight.detach().clone()
        >>> _ = parametrize.register_parametrization(linear, "weight", WeightNorm())
        >>> torch.allclose(linear.weight, before)
        True
    """

    def __init__(self, dim: int = 0, eps: float = 1e-12) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got dim={dim!r}")
        self.dim = dim
        self.eps = _checks.non_negative("eps", eps)

    def forward(self, g: Tensor, v: Tensor) -> Tensor:
        dim = self.dim % v.ndim
        if (
            not v.is_cpu
            or v.dtype not in _FAST_DTYPES
            or type(v) not in _PLAIN
            or torch.compiler.is_compiling()
        ):
            # On an accelerator a step of a model this size is bound by kernel launches and
            # Python, not memory: autograd's own graph of the formula launches about as many
            # kernels as the closed-form backward and runs no Python in backward.
            return _weight_norm(g, v, dim, self.eps)
        if dim in (0, v.ndim - 1) and v.is_contiguous():
            # torch's fused op (forward and backward) computes g * v / ||v||, which is this
            # function exactly where no row is zero and ||v|| + eps rounds to ||v||; on the CPU
            # checking that costs nothing.
            weight, norm = _torch_compat.weight_norm_interface(v, g, dim)
            if _eps_vanishes(norm.min().item(), self.eps, v.dtype):
                return weight
        result: Tensor = _WeightNormFunction.apply(g, v, dim, self.eps)  # type: ignore[no-untyped-call]
        return result

    def right_inverse(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        _checks.axis("dim", self.dim, weight.ndim, f"a weight of shape {list(weight.shape)}")
        norm = _row_norms(weight, self.dim % weight.ndim)
        denominator = _safe_denominator(norm, self.eps)
        g = denominator if self.eps > 0 else norm
        return g.to(weight.dtype), (weight / denominator).to(weight.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


class _LegacyKeys:
    """Load-state-dict pre-hook: reads ``<name>_g``/``<name>_v`` checkpoints of the legacy
    ``torch.nn.utils.weight_norm`` into the parametrization's ``original0``/``original1``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        if not _is_weight_normalized(module, self.name):
            return
        for suffix, which in (("_g", "original0"), ("_v", "original1")):
            legacy = f"{prefix}{self.name}{suffix}"
            if legacy in state_dict:
                key = f"{prefix}parametrizations.{self.name}.{which}"
                state_dict[key] = state_dict.pop(legacy)


def _is_weight_normalized(module: nn.Module, name: str) -> bool:
    return any(isinstance(p, WeightNorm) for p in parametrizations_of(module, name))


def _is_pending(module: nn.Module, name: str) -> bool:
    return pending(module, name, _MARKER) or pending(module, _ALL, _MARKER)


def _install_legacy_keys(module: nn.Module, name: str) -> None:
    for wrapped in module._load_state_dict_pre_hooks.values():
        hook = getattr(wrapped, "hook", wrapped)
        if isinstance(hook, _LegacyKeys) and hook.name == name:
            return
    module.register_load_state_dict_pre_hook(_LegacyKeys(name))  # type: ignore[no-untyped-call]


def _axis(module: nn.Module, name: str, ndim: int, dim: int | None) -> int:
    where = describe(module, name)
    if ndim < 2:
        raise ValueError(
            f"{where} has {ndim} dimension{'s' if ndim != 1 else ''}; weight normalization "
            "applies to parameters with at least 2"
        )
    if dim is None:
        return output_axis(module) if name == "weight" else 0
    return _checks.axis("dim", dim, ndim, where)


def _convert(module: nn.Module, name: str, axis: int, eps: float) -> None:
    """Registers WN on ``module.<name>``; g and v are new Parameters, the weight is left as is.

    The old Parameter keeps its values, so a module that shares (ties) it is unaffected.
    """
    parametrize.register_parametrization(module, name, WeightNorm(axis, eps))
    _install_legacy_keys(module, name)


def _direct_targets(module: nn.Module, dim: int | None) -> Iterator[tuple[str, int]]:
    """``module``'s own parameters that the converter takes (2 or more dims), with their axis."""
    for name, param in module._parameters.items():
        if param is not None and not is_uninitialized(param) and param.ndim >= 2:
            refuse_wrapped(module, "weight normalization", param, name)
            yield name, _axis(module, name, param.ndim, dim)


def _convert_all_direct(module: nn.Module, dim: int | None, eps: float) -> None:
    for name, axis in list(_direct_targets(module, dim)):
        _convert(module, name, axis, eps)


def weight_norm(
    module: M, name: str | None = None, *, dim: int | None = None, eps: float = 1e-12
) -> M:
    r"""Reparametrizes weights as ``W = g * v / (||v|| + eps)`` (Weight Normalization).

    Like Chainer's ``convert_with_weight_normalization``, ``name=None`` converts every
    parameter with 2 or more dimensions in ``module`` and all its submodules: Linear, Conv*,
    ConvTranspose*, Embedding, every layer and direction of LSTM/GRU/RNN, MultiheadAttention's
    projections, ... At conversion :math:`v = W / (\|W\| + \epsilon)` (unit rows) and
    :math:`g = \|W\| + \epsilon`, so the module's output is unchanged.

    Unlike torch's own ``weight_norm``, which keeps :math:`v = W`, the direction starts with
    unit norm, as in the original: the gradient with respect to v is
    :math:`\frac{g}{\|v\|}(\nabla_W - \ldots)`, so with unit v an optimizer takes the same steps
    as Chainer's, and with torch's v it takes steps scaled by :math:`1/\|W\|`. The parameters
    live where torch's ``parametrizations.weight_norm`` puts them
    (``parametrizations.<name>.original0`` is g, ``original1`` is v), so state dicts load both
    ways; checkpoints of the legacy ``torch.nn.utils.weight_norm`` (``<name>_g``,
    ``<name>_v``) load too. A zero row of v gives a zero row of W, never NaN. Lazy modules are
    converted at their first forward.

    Args:
        module: the module to convert in place.
        name: one parameter of ``module`` to convert, or None for every parameter with 2 or
            more dimensions in the module tree (those already normalized are skipped).
        dim: the axis with one norm per index. None picks the output axis: 1 for the
            ``weight`` of transposed convolutions, 0 otherwise.
        eps: added to the norm (Chainer's 1e-12 by default); must be non-negative.

    Returns:
        ``module``.

    References:
        Salimans and Kingma, Weight Normalization: A Simple Reparameterization to Accelerate
        Training of Deep Neural Networks, arXiv:1602.07868.

    Example:
        >>> lstm = weight_norm(torch.nn.LSTM(4, 8, num_layers=2))
        >>> sorted(lstm.parametrizations)
        ['weight_hh_l0', 'weight_hh_l1', 'weight_ih_l0', 'weight_ih_l1']
        >>> g = lstm.parametrizations.weight_ih_l0.original0
        >>> g.shape
        torch.Size([32, 1])
    """
    eps = _checks.non_negative("eps", eps)
    if name is not None:
        _weight_norm_one(module, name, dim, eps)
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    refuse_wrapped(module, "weight normalization")
    planned: list[tuple[nn.Module, str, int]] = []
    lazy: list[nn.Module] = []
    owners: dict[int, str] = {}
    normalized = other = 0
    for prefix, sub in module.named_modules():
        if is_internal(sub):
            continue
        if any(is_uninitialized(p) for p in sub._parameters.values()):
            if not _is_pending(sub, _ALL):
                lazy.append(sub)
            continue
        for param_name, axis in _direct_targets(sub, dim):
            where = f"{prefix}.{param_name}" if prefix else param_name
            first = owners.setdefault(id(sub._parameters[param_name]), where)
            if first != where:
                raise ValueError(
                    f"{first} and {where} are the same Parameter (tied weights); converting "
                    "each would untie them. Convert one with weight_norm(module, name) and "
                    "tie the other to it yourself"
                )
            planned.append((sub, param_name, axis))
        for tensor_name in parametrized_names(sub):
            if _is_weight_normalized(sub, tensor_name):
                normalized += 1
            else:
                other += 1
    if not planned and not lazy:
        if normalized or other:
            reason = (
                f"of its parameters with 2 or more dimensions, {normalized} are already "
                f"weight-normalized and {other} have another parametrization"
            )
        else:
            reason = "it has no parameter with 2 or more dimensions"
        raise ValueError(f"nothing to convert in {layer_name(module)}: {reason}")
    for sub, param_name, axis in planned:
        _convert(sub, param_name, axis, eps)
    for sub in lazy:
        register = functools.partial(_convert_all_direct, dim=dim, eps=eps)
        _parametrize.defer(sub, _ALL, register, _MARKER)
    return module


def _weight_norm_one(module: nn.Module, name: str, dim: int | None, eps: float) -> None:
    tensor = checked_tensor(module, name, "weight normalization")
    if _is_weight_normalized(module, name) or _is_pending(module, name):
        raise ValueError(f"{describe(module, name)} is already weight-normalized")
    if parametrize.is_parametrized(module, name):
        raise ValueError(
            f"{describe(module, name)} already has another parametrization; weight "
            "normalization needs the plain Parameter"
        )
    if tensor is None:
        register = functools.partial(_convert_named, name=name, dim=dim, eps=eps)
        _parametrize.defer(module, name, register, _MARKER)
        return
    _convert(module, name, _axis(module, name, tensor.ndim, dim), eps)


def _convert_named(module: nn.Module, name: str, dim: int | None, eps: float) -> None:
    weight = module._parameters[name]
    assert weight is not None
    _convert(module, name, _axis(module, name, weight.ndim, dim), eps)


def convert_with_weight_normalization(module_cls: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """Builds ``module_cls(*args, **kwargs)`` and weight-normalizes every parameter of 2+ dims.

    The entry point of the original Chainer converter, for code ported from it.

    Example:
        >>> conv = convert_with_weight_normalization(torch.nn.Conv2d, 3, 8, kernel_size=3)
        >>> conv.parametrizations.weight.original0.shape
        torch.Size([8, 1, 1, 1])
    """
    if not callable(module_cls):
        raise TypeError(f"module_cls must be a module class, got {module_cls!r}")
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module_cls must build a torch.nn.Module, got {type(module).__name__} from "
            f"{module_cls!r}"
        )
    return weight_norm(module)


def remove_weight_norm(module: M, name: str | None = None) -> M:
    """Folds weight normalization back into plain Parameters.

    The output is unchanged, and the weight becomes the Parameter object that held v, so an
    optimizer that holds v keeps updating the weight.

    Args:
        module: the module.
        name: the parameter to fold back, or None for every weight normalization in the
            module tree (pending ones on lazy modules included).

    Returns:
        ``module``.

    Example:
        >>> linear = weight_norm(torch.nn.Linear(3, 2))
        >>> v = linear.parametrizations.weight.original1
        >>> linear = remove_weight_norm(linear)
        >>> linear.weight is v
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got name={name!r}")
    if name is not None:
        if cancel_pending(module, name, _MARKER):
            return module
        if pending(module, _ALL, _MARKER):
            raise ValueError(
                f"{describe(module, name)} is waiting to be converted with every parameter of "
                f"this lazy {layer_name(module)}; cancel that with remove_weight_norm(module)"
            )
        if not _is_weight_normalized(module, name):
            raise ValueError(
                f"{describe(module, name)} is not weight-normalized; nothing to remove"
            )
        _fold(module, name)
        return module
    found = False
    for sub in list(module.modules()):
        if is_internal(sub):
            continue
        found |= cancel_pending(sub, _ALL, _MARKER)
        for param_name in parametrized_names(sub):
            found |= cancel_pending(sub, param_name, _MARKER)
            if _is_weight_normalized(sub, param_name):
                _fold(sub, param_name)
                found = True
    if not found:
        raise ValueError(f"{layer_name(module)} has no weight normalization to remove")
    return module


def _fold(module: nn.Module, name: str) -> None:
    if len(parametrizations_of(module, name)) > 1:
        raise ValueError(
            f"{describe(module, name)} has other parametrizations besides weight "
            "normalization; remove those first"
        )
    v = original(module, name, "original1")
    with torch.no_grad():
        weight = getattr(module, name).clone()
    parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    with torch.no_grad():
        v.copy_(weight)
    delattr(module, name)
    module.register_parameter(name, v)


_INIT_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)


def _unit_axis(layer: nn.Module, output: Tensor) -> int:
    """The axis of a layer's output that indexes its units."""
    if isinstance(layer, nn.Linear):
        return output.ndim - 1
    assert isinstance(layer, nn.modules.conv._ConvNd)
    # An unbatched convolution (C, *spatial) has its channels first.
    return 0 if output.ndim == len(layer.kernel_size) + 1 else 1


def _all_reduce_(tensor: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def _moments(t: Tensor, axis: int) -> tuple[Tensor, Tensor]:
    """Per-unit mean and biased variance of ``t`` over every other axis, across ranks.

    Two passes (mean, then squared deviations) in at least float32, summed over the default
    process group when torch.distributed is initialized, so every rank gets the moments of the
    global batch.
    """
    acc = torch.promote_types(t.dtype, torch.float32)
    rows = t.movedim(axis, -1).reshape(-1, t.shape[axis]).to(acc)
    packed = torch.cat([rows.sum(0), rows.new_tensor([rows.shape[0]])])
    _all_reduce_(packed)
    count = packed[-1]
    mean = packed[:-1] / count
    variance = _all_reduce_((rows - mean).square().sum(0)) / count
    return mean, variance


class _Initializer:
    """Forward hooks that initialize each WN layer from the activations reaching it."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.done: set[nn.Module] = set()
        self.values: dict[nn.Module, list[Tensor]] = {}

    def before(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if layer in self.done:
            return
        # g = 1 and no bias make the layer's output the paper's pre-activation t = v.x/||v||.
        g, *bias = _init_params(layer)
        g.fill_(1.0)
        for b in bias:
            b.zero_()

    def after(self, layer: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        if layer in self.done:
            return None
        self.done.add(layer)
        axis = _unit_axis(layer, output)
        mean, variance = _moments(output, axis)
        std = variance.sqrt()
        # A unit whose pre-activation is constant over the batch has no scale to set.
        g = torch.where(std > 0, self.scale / std, torch.full_like(std, self.scale))
        g_param, *bias = _init_params(layer)
        values = [g.view(g_param.shape)]
        shape = [1] * output.ndim
        shape[axis] = -1
        initialized = output * g.view(shape)
        if bias:
            b = -mean * g
            values.append(b)
            initialized = initialized + b.view(shape)
        # Written now for a layer the forward calls again, and after the forward for good
        # (FSDP2 may already have put the sharded parameters back by now).
        for param, value in zip(_init_params(layer), values, strict=True):
            _assign_full_(param, value)
        self.values[layer] = values
        # What the layer now outputs, so that the layers after it see initialized inputs.
        return initialized.to(output.dtype)


def _initializable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers: list[tuple[str, nn.Module]] = []
    for name, layer in model.named_modules():
        if isinstance(layer, _INIT_LAYERS) and _is_pending(layer, "weight"):
            raise ValueError(
                f"data_dependent_init: {name or layer_name(model)} ({layer_name(layer)}) is a "
                "lazy module whose weight does not exist yet; run one forward first"
            )
        if not (isinstance(layer, _INIT_LAYERS) and _is_weight_normalized(layer, "weight")):
            continue
        where = f"{name or layer_name(model)} ({layer_name(layer)})"
        chain = parametrizations_of(layer, "weight")
        wn = chain[0]
        if len(chain) > 1 or not isinstance(wn, WeightNorm):
            raise ValueError(
                f"data_dependent_init needs weight normalization alone on {where}.weight, "
                f"found {[type(p).__name__ for p in chain]}: a parametrization on top of it "
                "would change how g scales the output"
            )
        if wn.dim % original(layer, "weight", "original1").ndim != output_axis(layer):
            raise ValueError(
                f"data_dependent_init needs one g per output unit, but {where} is "
                f"weight-normalized along dim={wn.dim}"
            )
        if isinstance(layer, nn.modules.conv._ConvTransposeNd) and layer.groups > 1:
            raise ValueError(
                f"data_dependent_init cannot initialize {where}: with groups={layer.groups} "
                "each g of a transposed convolution scales one output channel per group"
            )
        layers.append((name, layer))
    return layers


def _run(model: nn.Module, batch: Any) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def data_dependent_init(model: M, batch: Any, *, scale: float = 1.0) -> M:
    r"""Initializes every weight-normalized Linear/Conv layer from one batch (paper, section 3).

    Runs ``model`` once on ``batch`` under ``torch.no_grad()``, in eval mode. For each
    weight-normalized ``Linear``, ``Conv*`` or ``ConvTranspose*`` layer, in the order the
    forward reaches it, computes its pre-activation :math:`t = v \cdot x / \|v\|` (g = 1, no
    bias), the per-unit mean :math:`\mu` and biased standard deviation :math:`\sigma` of
    :math:`t` over the batch (and spatial) axes, and sets

    .. math::

        g \leftarrow \frac{\text{scale}}{\sigma}, \qquad
        b \leftarrow -\frac{\mu \cdot \text{scale}}{\sigma}

    (only g where the layer has no bias). Each layer sees the already initialized layers
    before it, so afterwards every such layer's outputs on ``batch`` have per-unit mean 0
    and standard deviation ``scale``. Under ``torch.distributed`` the moments are summed over
    the default process group, so every rank ends with identical g and b. Weight-normalized
    parameters of other layers (LSTM weights, ...) keep their g. The model's train/eval
    modes are restored; if the forward fails, its error propagates and the model is left as
    it was. Layers the forward never reached are named in a warning.

    Args:
        model: a model with weight-normalized layers (see :func:`weight_norm`).
        batch: the model's input: a tensor (``model(batch)``), a tuple or list
            (``model(*batch)``) or a mapping (``model(**batch)``).
        scale: the standard deviation each layer's outputs get.

    Returns:
        ``model``.

    References:
        Salimans and Kingma, Weight Normalization, arXiv:1602.07868, section 3.

    Example:
        >>> model = weight_norm(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()))
        >>> x = torch.randn(256, 4)
        >>> model = data_dependent_init(model, x)
        >>> y = model[0](x)
        >>> torch.allclose(y.mean(0), torch.zeros(3), atol=1e-5)
        True
        >>> torch.allclose(y.std(0, unbiased=False), torch.ones(3), atol=1e-5)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    scale = _checks.positive("scale", scale)
    layers = _initializable(model)
    if not layers:
        raise ValueError(
            f"{layer_name(model)} has no weight-normalized Linear, Conv or ConvTranspose "
            "layer to initialize; convert it with weight_norm first"
        )
    modes = {module: module.training for module in model.modules()}
    saved = [(layer, [p.detach().clone() for p in _init_params(layer)]) for _, layer in layers]
    initializer = _Initializer(scale)
    handles = []
    try:
        for _, layer in layers:
            handles.append(layer.register_forward_pre_hook(initializer.before))
            handles.append(layer.register_forward_hook(initializer.after))
        model.eval()
        with torch.no_grad():
            _run(model, batch)
        # Under FSDP2 the forward wrote into unsharded copies: write the sharded originals.
        _reshard(model)
        with torch.no_grad():
            for layer, values in initializer.values.items():
                for param, value in zip(_init_params(layer), values, strict=True):
                    _assign_full_(param, value)
    except BaseException:
        _reshard(model)
        with torch.no_grad():
            for layer, values in saved:
                for param, value in zip(_init_params(layer), values, strict=True):
                    param.copy_(value)
        raise
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    missed = [name for name, layer in layers if layer not in initializer.done]
    if missed:
        warnings.warn(
            "data_dependent_init: the forward never reached "
            + ", ".join(missed)
            + "; their g and bias keep their values",
            stacklevel=2,
        )
    return model


def _init_params(layer: nn.Module) -> list[Tensor]:
    """The tensors data_dependent_init sets: g, then the bias if the layer has one."""
    params: list[Tensor] = [original(layer, "weight", "original0")]
    bias = layer._parameters.get("bias")
    if bias is not None:
        params.append(bias)
    return params


def _reshard(model: nn.Module) -> None:
    """Puts every FSDP2 module of ``model`` back in its sharded state."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def _assign_full_(param: Tensor, value: Tensor) -> None:
    """Writes the full tensor ``value`` (identical on every rank) into ``param``."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(param, dtensor.DTensor):
        param.copy_(value.view_as(param))
        return
    sharded: Any = param
    full = value.to(sharded.dtype).view(sharded.shape)
    try:
        # Every rank holds the full value: each keeps its own shard, no communication.
        local = dtensor.distribute_tensor(
            full, sharded.device_mesh, sharded.placements, src_data_rank=None
        )
    except TypeError:  # torch without src_data_rank: scatter rank 0's (identical) copy
        local = dtensor.distribute_tensor(full, sharded.device_mesh, sharded.placements)
    sharded.to_local().copy_(local.to_local())
