r"""The data-dependent initialization of weight-normalized layers (Salimans and Kingma, section 3).

T. Salimans and D. P. Kingma, "Weight Normalization: A Simple Reparameterization to
Accelerate Training of Deep Neural Networks", arXiv:1602.07868 (2016), section 3: set each
layer's g and bias from the statistics of its pre-activations on one batch, so that every
unit starts with zero mean and a chosen standard deviation. The Chainer original left it as a
TODO.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normhooks import _checks, _parametrize, _torch_compat
from normhooks._parametrize import layer_name
from normhooks._torch_compat import ConvNd
from normhooks.weight_norm import WeightNorm, is_pending, is_weight_normalized

__all__ = ["data_dependent_init"]

M = TypeVar("M", bound=nn.Module)

_INIT_LAYERS = (nn.Linear, ConvNd)


def _unit_axis(layer: nn.Module, output: Tensor) -> int:
    """The axis of a layer's output that indexes its units."""
    if isinstance(layer, nn.Linear):
        return output.ndim - 1
    # An unbatched convolution (C, *spatial) has its channels first.
    kernel_size: tuple[int, ...] = getattr(layer, "kernel_size", ())
    return 0 if output.ndim == len(kernel_size) + 1 else 1


def _all_reduce_(tensor: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def _moments(t: Tensor, axis: int) -> tuple[Tensor, Tensor, int]:
    """Per-unit mean and biased variance of ``t`` over every other axis, and the count.

    Two passes (mean, then squared deviations) in at least float32, summed over the default
    process group when torch.distributed is initialized, so every rank gets the moments of the
    global batch. The count is read on the host: this runs once, and every rank must agree on
    whether the batch was large enough.
    """
    acc = torch.promote_types(t.dtype, torch.float32)
    rows = t.movedim(axis, -1).reshape(-1, t.shape[axis]).to(acc)
    packed = rows.sum(0)
    _all_reduce_(packed)
    # The count travels as int64: float32 holds whole numbers exactly only up to 2**24.
    counted = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    count = int(_all_reduce_(counted).item())
    mean = packed / max(count, 1)
    variance = _all_reduce_((rows - mean).square().sum(0)) / max(count, 1)
    return mean, variance, count


class _Initializer:
    """Forward hooks that initialize each WN layer from the activations reaching it."""

    def __init__(self, scale: float, names: dict[nn.Module, str]) -> None:
        self.scale = scale
        self.names = names
        self.done: set[nn.Module] = set()
        self.values: dict[nn.Module, list[Tensor]] = {}
        self.constant: list[str] = []

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
        mean, variance, count = _moments(output, axis)
        where = self.names[layer]
        if count < 2:
            raise ValueError(
                f"data_dependent_init: {where} sees {count} value{'s' if count != 1 else ''} "
                "per unit in this batch (over the batch and spatial axes, all ranks): a unit's "
                "standard deviation needs at least 2. Pass a larger batch"
            )
        if not bool(torch.isfinite(mean).all() and torch.isfinite(variance).all()):
            raise ValueError(
                f"data_dependent_init: the pre-activations of {where} are not finite (NaN or "
                "inf) on this batch, although the batch is: an earlier layer overflowed. "
                "Nothing was changed"
            )
        std = variance.sqrt()
        constant = int((std == 0).sum())
        if constant:
            self.constant.append(f"{where}: {constant} of {std.numel()}")
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
    """The layers to initialize, after checking every one of them."""
    layers: list[tuple[str, nn.Module]] = []
    for name, layer in model.named_modules():
        if not isinstance(layer, _INIT_LAYERS):
            continue
        where = f"{name or layer_name(model)} ({layer_name(layer)})"
        if is_pending(layer, "weight"):
            raise ValueError(
                f"data_dependent_init: {where} is a lazy module whose weight does not exist "
                "yet; run one forward first"
            )
        if _parametrize.has_torch_weight_norm(layer, "weight"):
            raise ValueError(
                f"data_dependent_init: {where} carries torch's weight norm, which it does not "
                "initialize; take it over with normhooks.apply_weight_norm(model) first (same "
                "g, v and checkpoint keys)"
            )
        if not is_weight_normalized(layer, "weight"):
            continue
        if parametrize.is_parametrized(layer, "bias"):
            raise ValueError(
                f"data_dependent_init: {where}.bias has a parametrization; the initialization "
                "sets the bias itself and cannot write through one"
            )
        chain = _parametrize.parametrizations_of(layer, "weight")
        wn = chain[0]
        if len(chain) > 1 or not isinstance(wn, WeightNorm):
            raise ValueError(
                f"data_dependent_init needs weight normalization alone on {where}.weight, "
                f"found {[type(p).__name__ for p in chain]}: a parametrization on top of it "
                "would change how g scales the output"
            )
        ndim = _parametrize.original(layer, "weight", "original1").ndim
        axis = _parametrize.output_axis(layer)
        if wn.dim is None or wn.dim % ndim != axis:
            if _parametrize.is_transposed(layer):
                remedy = (
                    f"; a transposed convolution's output channels are dim=1: convert it with "
                    f"weight_norm(layer, dim=1) (dim={wn.dim} is the layout of torch and its "
                    "checkpoints, which this initialization cannot use)"
                )
            else:
                remedy = f"; convert it with dim={axis}"
            raise ValueError(
                f"data_dependent_init needs one g per output unit, but {where} is "
                f"weight-normalized along dim={wn.dim}{remedy}"
            )
        groups = getattr(layer, "groups", 1)
        if _parametrize.is_transposed(layer) and groups > 1:
            raise ValueError(
                f"data_dependent_init cannot initialize {where}: with groups={groups} "
                "each g of a transposed convolution scales one output channel per group"
            )
        layers.append((name, layer))
    return layers


def _tensors(batch: Any, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    if isinstance(batch, Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _tensors(value, f"{path}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        for index, value in enumerate(batch):
            yield from _tensors(value, f"{path}[{index}]")


def _check_batch(batch: Any, device: torch.device) -> None:
    """Refuses an empty batch, or one with NaN or inf, on every rank alike.

    Under torch.distributed the counts are summed over the default process group: a rank
    with an empty share of a non-empty global batch is fine, and a NaN on one rank stops all.
    """
    found = list(_tensors(batch))
    bad = [
        (path, int((~torch.isfinite(t)).sum()))
        for path, t in found
        if t.is_floating_point() or t.is_complex()
    ]
    bad = [(path, n) for path, n in bad if n]
    nonempty = not found or any(t.numel() > 0 for _, t in found)
    flags = torch.tensor([sum(n for _, n in bad), int(nonempty)], device=device)
    nonfinite, nonempty_ranks = (int(x) for x in _all_reduce_(flags).tolist())
    if nonempty_ranks == 0:
        shapes = ", ".join(f"{path} {list(t.shape)}" for path, t in found)
        raise ValueError(f"data_dependent_init needs a non-empty batch, got {shapes}")
    if nonfinite:
        here = ", ".join(f"{path} has {n}" for path, n in bad) or "none on this rank"
        raise ValueError(
            f"data_dependent_init needs a finite batch, got {nonfinite} NaN or inf values "
            f"({here}); nothing was changed"
        )


def _run(model: nn.Module, batch: Any) -> None:
    # A compiled model (torch.compile(model), model.compile(), compiled submodules) runs
    # code traced without the hooks above, which would never fire: run it eagerly once.
    with torch.compiler.set_stance("force_eager"):
        if isinstance(batch, Mapping):
            model(**batch)
        elif isinstance(batch, (tuple, list)):
            model(*batch)
        else:
            model(batch)


def data_dependent_init(model: M, batch: Any, *, scale: float = 1.0) -> M:
    r"""Initializes every weight-normalized Linear/Conv layer from one batch (paper, section 3).

    Runs ``model`` once on ``batch`` under ``torch.no_grad()``, in eval mode (eagerly, also
    when the model or parts of it were compiled). For each weight-normalized ``Linear``,
    ``Conv*`` or ``ConvTranspose*`` layer, in the order the forward reaches it, computes its
    pre-activation :math:`t = v \cdot x / \|v\|` (g = 1, no bias), the per-unit mean
    :math:`\mu` and biased standard deviation :math:`\sigma` of :math:`t` over the batch (and
    spatial) axes, and sets

    .. math::

        g \leftarrow \frac{\text{scale}}{\sigma}, \qquad
        b \leftarrow -\frac{\mu \cdot \text{scale}}{\sigma}

    (only g where the layer has no bias). Each layer sees the already initialized layers
    before it, so afterwards every such layer's outputs on ``batch`` have per-unit mean 0
    and standard deviation ``scale``. Under ``torch.distributed`` the moments are summed over
    the default process group, so every rank ends with identical g and b. A unit whose
    pre-activation is constant over the batch gets g = ``scale``, with a warning.
    Weight-normalized parameters of other layers (LSTM weights, ...) keep their g. The
    model's train/eval modes are restored; if the forward fails, its error propagates and the
    model is left as it was. Layers the forward never reached are named in a warning.

    g must have one entry per output unit: ``dim=0`` for Linear and Conv*, ``dim=1`` for
    ConvTranspose* (whose default ``dim=0`` follows torch's checkpoint layout, with one g per
    input channel; such a layer is refused with an error saying so).

    Args:
        model: a model with weight-normalized layers (see :func:`~normhooks.apply_weight_norm`).
        batch: the model's input: a tensor (``model(batch)``), a tuple or list
            (``model(*batch)``) or a mapping (``model(**batch)``); finite and not empty.
        scale: the standard deviation each layer's outputs get.

    Returns:
        ``model``.

    Raises:
        ValueError: the batch is empty, holds NaN or inf, or is too small to estimate a
            unit's standard deviation (fewer than 2 values per unit); a layer's
            pre-activations are not finite; a layer cannot be initialized (named, with why).
            The model is unchanged.

    References:
        Salimans and Kingma, Weight Normalization, arXiv:1602.07868, section 3.

    Example:
        >>> from normhooks import apply_weight_norm
        >>> model = apply_weight_norm(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()))
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
    target = _torch_compat.uncompiled(model)
    layers = _initializable(target)
    if not layers:
        raise ValueError(
            f"{layer_name(target)} has no weight-normalized Linear, Conv or ConvTranspose "
            "layer to initialize; convert it with apply_weight_norm first"
        )
    _check_batch(batch, _init_params(layers[0][1])[0].device)
    modes = {module: module.training for module in model.modules()}
    saved = [(layer, [p.detach().clone() for p in _init_params(layer)]) for _, layer in layers]
    names = {layer: f"{name or layer_name(target)} ({layer_name(layer)})" for name, layer in layers}
    initializer = _Initializer(scale, names)
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
    if initializer.constant:
        warnings.warn(
            "data_dependent_init: units with constant pre-activations over the batch got "
            f"g = scale ({'; '.join(initializer.constant)} units)",
            stacklevel=2,
        )
    return model


def _init_params(layer: nn.Module) -> list[Tensor]:
    """The tensors data_dependent_init sets: g, then the bias if the layer has one."""
    params: list[Tensor] = [_parametrize.original(layer, "weight", "original0")]
    bias = _torch_compat.own_parameters(layer).get("bias")
    if bias is not None:
        params.append(bias)
    return params


def _reshard(model: nn.Module) -> None:
    """Puts every FSDP2 module of ``model`` back in its sharded state."""
    fsdp_module = _torch_compat.fsdp2_module_type()
    if fsdp_module is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp_module):
            module.reshard()


def _assign_full_(param: Tensor, value: Tensor) -> None:
    """Writes the full tensor ``value`` (identical on every rank) into ``param``."""
    dtensor = _torch_compat.dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        param.copy_(value.view_as(param))
        return
    # A DTensor exists, so torch.distributed.tensor is imported already.
    from torch.distributed.tensor import distribute_tensor

    sharded: Any = param
    full = value.to(sharded.dtype).view(sharded.shape)
    try:
        # Every rank holds the full value: each keeps its own shard, no communication.
        local = distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None)
    except TypeError:  # torch without src_data_rank: scatter rank 0's (identical) copy
        local = distribute_tensor(full, sharded.device_mesh, sharded.placements)
    sharded.to_local().copy_(local.to_local())
