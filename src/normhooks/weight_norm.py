r"""Weight Normalization, ``W = g * v / (||v|| + eps)``, as a ``torch.nn.utils.parametrize`` hook.

Implements T. Salimans and D. P. Kingma, "Weight Normalization: A Simple Reparameterization
to Accelerate Training of Deep Neural Networks", arXiv:1602.07868 (2016), in the layout that
torch's ``weight_norm``, the models built on it and the Chainer original all use: one norm per
index of ``dim=0`` for every layer, g and v stored where
``torch.nn.utils.parametrizations.weight_norm`` stores them. The paper's data-dependent
initialization is :func:`normhooks.data_dependent_init`.

The file reads top down: the formula as plain functions, the :class:`WeightNorm`
parametrization, what the shared lifecycle needs to know about it, then the public functions.
Registering, converting a tree and removing are ``normhooks._parametrize``'s; taking over and
folding torch's weight norm, ``normhooks._parametrize.takeover``'s; everything that exists only
for speed (the kernels, the fused launch, the CPU's fused op), ``normhooks._kernels``', behind
the one door :class:`WeightNorm` calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from normhooks import _checks, _parametrize
from normhooks._kernels import _door, _scope
from normhooks._parametrize import describe, layer_name
from normhooks._parametrize import takeover as _torch_weight_norm
from normhooks._precision import HALF_DTYPES
from normhooks._torch_compat import ConvNd, own_parameters

__all__ = [
    "WeightNorm",
    "apply_weight_norm",
    "convert_with_weight_normalization",
    "remove_weight_norm",
    "weight_norm",
]

_WHAT = "weight normalization"

M = TypeVar("M", bound=nn.Module)


# --- the formula ----------------------------------------------------------------------------


def _norm_dims(ndim: int, dim: int | None) -> list[int]:
    """The axes a norm runs over: all but ``dim`` (all of them for None)."""
    return [d for d in range(ndim) if d != dim]


def _row_norms(tensor: Tensor, dim: int | None) -> Tensor:
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


def _weight_norm(g: Tensor, v: Tensor, dim: int | None, eps: float) -> Tensor:
    """``g * v / (||v|| + eps)`` in plain differentiable ops: any dtype, device, transform,
    tracer or exporter."""
    scale = g / _safe_denominator(_row_norms(v, dim), eps)
    return (v * scale).to(v.dtype)


# --- the parametrization --------------------------------------------------------------------


class WeightNorm(nn.Module):
    r"""Parametrization ``(g, v) -> W = g * v / (||v|| + eps)``, norms over all axes but ``dim``.

    Its ``right_inverse`` is the original converter's decomposition of a weight :math:`W`:
    :math:`g = \|W\| + \epsilon` and :math:`v = W / (\|W\| + \epsilon)` (unit rows), so a
    module's output is unchanged by the conversion. The originals are stored where
    ``torch.nn.utils.parametrizations.weight_norm`` stores them: ``original0`` is g (shape
    with 1s except at ``dim``; a scalar for ``dim=None``), ``original1`` is v. Like every
    parametrization, the weight is recomputed at each access; inside
    ``torch.nn.utils.parametrize.cached()`` it is computed once per scope.

    Args:
        dim: the axis with one norm per index; None for one norm of the whole tensor.
        eps: added to the norm; 0 is allowed (zero rows still give zero weights).

    Example:
        >>> from torch.nn.utils import parametrize
        >>> linear = torch.nn.Linear(3, 2)
        >>> before = linear.weight.detach().clone()
        >>> _ = parametrize.register_parametrization(linear, "weight", WeightNorm())
        >>> torch.allclose(linear.weight, before)
        True
    """

    def __init__(self, dim: int | None = 0, eps: float = 1e-12) -> None:
        super().__init__()
        self.dim = _check_dim(dim)
        self.eps = _checks.non_negative("eps", eps)
        # Set by a takeover of the legacy torch.nn.utils.weight_norm: the module then keeps
        # saving g and v under that hook's <name>_g / <name>_v keys.
        self.legacy_keys = False

    def forward(self, g: Tensor, v: Tensor) -> Tensor:
        return _DOOR(self, g, v)

    def _check(self, g: Tensor, v: Tensor) -> int | None:
        _parametrize.check_tensor(v, "v", _WHAT)
        if not isinstance(g, Tensor):
            raise TypeError(f"g must be a torch.Tensor, got {type(g).__name__}")
        _parametrize.check_dtype("g", g.dtype, _WHAT)
        dim = self.dim
        if dim is None:
            if g.numel() != 1 or g.ndim > v.ndim:
                raise ValueError(
                    "g must be a single element for dim=None (one norm of the whole tensor), "
                    f"got g of shape {list(g.shape)}"
                )
            return None
        if not -v.ndim <= dim < v.ndim:
            _checks.axis("dim", dim, v.ndim, f"v of shape {list(v.shape)}")
        dim %= v.ndim
        rows = v.shape[dim]
        if g.ndim != v.ndim or g.shape[dim] != rows or g.numel() != rows:
            expected = [rows if d == dim else 1 for d in range(v.ndim)]
            raise ValueError(
                f"g must have shape {expected} (one entry per index of dim={self.dim} of v, "
                f"whose shape is {list(v.shape)}), got g of shape {list(g.shape)}"
            )
        return dim

    def right_inverse(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        _parametrize.check_tensor(weight, "weight", _WHAT)
        dim = None
        if self.dim is not None:
            shape = f"a weight of shape {list(weight.shape)}"
            dim = _checks.axis("dim", self.dim, weight.ndim, shape)
        norm = _row_norms(weight, dim)
        denominator = _safe_denominator(norm, self.eps)
        g = denominator if self.eps > 0 else norm
        if dim is None:
            g = g.reshape(())  # torch's layout for dim=None
        return g.to(weight.dtype), (weight / denominator).to(weight.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


# The one door to the fast paths (kernels, fused launches, the CPU's fused op): the formula
# and the checks are this file's, the rest is normhooks._kernels'.
_DOOR = _door.WeightNormDoor(_weight_norm, WeightNorm._check, _row_norms, _safe_denominator)
_door.register(WeightNorm, _DOOR)


def _check_dim(dim: object) -> int | None:
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int or None, got dim={dim!r}")
    return dim


# --- what the lifecycle needs to know -------------------------------------------------------


@dataclass(frozen=True)
class _Normalization(_parametrize.Technique[int | None]):
    """Weight normalization along ``dim`` (None: the whole tensor), checked by the public
    functions; its layout is the axis with one norm per index, resolved for each weight."""

    dim: int | None = 0
    eps: float = 1e-12

    marker = "weight_norm"
    what = _WHAT
    done = "weight-normalized"
    verb = "convert"
    tree_function = "apply_weight_norm"
    parametrization = WeightNorm
    layers = (nn.Linear, ConvNd)
    baked_into = "original1"
    takes_over_torch_weight_norm = True

    def layout(self, module: nn.Module, name: str, ndim: int) -> int | None:
        if self.dim is None:
            return None
        return _checks.axis("dim", self.dim, ndim, describe(module, name))

    def build(self, weight: Tensor, layout: int | None) -> nn.Module:
        return WeightNorm(layout, self.eps)

    def companions(self) -> dict[str, tuple[str, str]]:
        return {"g": ("originals", "original0")}

    def self_standardizing(self, own: str) -> str:
        return (
            "it would cancel g (the standardized g * v / ||v|| does not depend on g), which "
            "would then never train. Weight normalization does not compose with the layer's "
            "own standardization: leave it out (layer_types selects subclasses too, so name "
            "only the classes to convert, e.g. layer_types=torch.nn.Linear)"
        )

    def take_over(
        self, module: nn.Module, name: str, found: Any, strict: bool
    ) -> _parametrize.Step:
        return _torch_weight_norm.take_over(self, module, name, found, dim=self.dim, strict=strict)

    def fold_torch_legacy(self, module: nn.Module, name: str, hook: Any) -> None:
        _torch_weight_norm.fold_legacy(module, name, hook)

    def registered(self, module: nn.Module, name: str) -> None:
        # Checkpoints of the legacy torch.nn.utils.weight_norm load into every weight norm.
        _torch_weight_norm.install_key_hooks(module, name, WeightNorm, save_legacy=False)

    def removed(self, module: nn.Module, name: str) -> None:
        _torch_weight_norm.drop_legacy_removal(module, name)


def _technique(dim: object, eps: object) -> _Normalization:
    """The public functions' settings, checked."""
    eps = _checks.non_negative("eps", eps)
    return _Normalization(_check_dim(dim), eps)


def is_pending(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` waits for its lazy module's first forward to be converted."""
    return _parametrize.pending(module, name, _Normalization.marker)


def is_weight_normalized(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` carries normhooks' weight norm, or will at its first forward."""
    return _Normalization().applied(module, name)


# --- public functions -----------------------------------------------------------------------


def weight_norm(module: M, name: str = "weight", *, dim: int | None = 0, eps: float = 1e-12) -> M:
    r"""Reparametrizes ``module.<name>`` as ``W = g * v / (||v|| + eps)`` (Weight Normalization).

    Registers a :class:`WeightNorm` parametrization, like
    ``torch.nn.utils.parametrizations.weight_norm`` and with its layout: g is
    ``module.parametrizations.<name>.original0``, v ``original1``, so state dicts load both
    ways, and checkpoints of the legacy ``torch.nn.utils.weight_norm`` (``<name>_g``,
    ``<name>_v``) load too. At conversion :math:`v = W / (\|W\| + \epsilon)` (unit rows, as
    in the Chainer original, so an optimizer takes its steps; torch keeps :math:`v = W`) and
    :math:`g = \|W\| + \epsilon`: the module's output is unchanged. A zero row of v gives a
    zero row of W, never NaN. g and v are new Parameters, like torch's, which an optimizer
    built before the conversion does not hold: build the optimizer after converting; one that
    still holds the old weight raises at its step. On a lazy module the parametrization is
    registered at the first forward, once the weight exists, and an optimizer built before
    then keeps working: g is created at conversion, uninitialized, and v is the lazy weight
    itself, rewritten in place. To convert a whole model, use :func:`apply_weight_norm`.

    A parameter that already carries torch's weight norm (either form) is taken over in
    place: same g and v Parameters, same values, same state-dict keys; only the formula
    becomes normhooks' (``eps`` is added to the norm, where torch adds none, and a zero row
    gives zeros where torch gives NaN). Its ``dim`` must then be the one torch's runs along.

    Args:
        module: the layer that owns the parameter; changed in place.
        name: the parameter's name.
        dim: the axis with one norm per index: 0, the output axis of Linear and Conv* and the
            input axis of ConvTranspose* (pass 1 there for one norm per output channel), as in
            torch and the Chainer original. None: one norm for the whole tensor. Negative
            values count from the end (torch's own ``weight_norm`` treats -1 as None).
        eps: added to the norm (Chainer's 1e-12 by default); must be non-negative.

    Returns:
        ``module``.

    References:
        Salimans and Kingma, Weight Normalization: A Simple Reparameterization to Accelerate
        Training of Deep Neural Networks, arXiv:1602.07868.

    Example:
        >>> conv = weight_norm(torch.nn.Conv1d(4, 8, 3))
        >>> conv.parametrizations.weight.original0.shape
        torch.Size([8, 1, 1])
        >>> lstm = weight_norm(torch.nn.LSTM(4, 8), "weight_hh_l0")
        >>> lstm.parametrizations.weight_hh_l0.original0.shape
        torch.Size([32, 1])
    """
    _parametrize.convert(_technique(dim, eps), module, name)
    return module


def apply_weight_norm(
    model: M,
    *,
    layer_types: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
    dim: int | None = 0,
    eps: float = 1e-12,
    fuse: bool = True,
) -> M:
    """Weight-normalizes the ``weight`` of every matching layer in ``model``.

    The whole tree is checked before anything changes: either every matching layer is
    converted, or the call raises and the model is left as it was. Matching layers that carry
    torch's weight norm (``torch.nn.utils.parametrizations.weight_norm`` or the legacy
    ``torch.nn.utils.weight_norm``, on any of their parameters) are taken over in place, along
    the ``dim`` they have: same g, same v, same state-dict keys, so a checkpoint of a model
    built on torch's weight norm (Hugging Face's EnCodec, DAC, HiFi-GAN, wav2vec 2.0, ...)
    loads unchanged. What changes numerically is the formula: ``eps`` is added to the norm
    (torch computes ``g * v / ||v||``), and a zero row of v gives zeros where torch gives NaN.
    torch's weight norm on layers that do not match is left in place, with a warning.

    Args:
        model: the model; changed in place.
        layer_types: the layer classes to convert (subclasses included). None means
            ``Linear``, every ``Conv*`` and every ``ConvTranspose*``, lazy ones included; gain
            vectors, embeddings and recurrent matrices are left alone unless named here or
            converted one by one with :func:`weight_norm`.
        dim: see :func:`weight_norm`; applies to the layers converted, not to those taken over.
        eps: see :func:`weight_norm`.
        fuse: on CUDA with Triton, compute every converted weight of ``model`` in one launch
            per forward (and their gradients in one), served to the layers for the forward
            (see docs/caching.md). One thing a fused forward cannot see: a write into an
            original's values through ``.data`` inside the forward (``v.data.mul_(2)`` in a
            forward pre-hook) after the scope opened; a ``.data`` assignment, an in-place op
            or a change of dtype or layout is seen. False: each layer computes its own weight
            at each access, as torch's parametrizations do.

    Returns:
        ``model``. Layers already weight-normalized by normhooks are skipped, and so are
        matching layers without a ``weight`` Parameter.

    Raises:
        ValueError: nothing to convert, tied weights (converting one would untie them), a
            matching weight with another parametrization, a layer whose own forward
            standardizes its weight (timm's ``StdConv2d`` family, transformers' BiT
            convolution: it would cancel g, which would never train), or a bad weight (named).
        TypeError: a matching weight that is not a real floating-point Parameter.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3), torch.nn.PReLU(4))
        >>> model = apply_weight_norm(model)
        >>> sorted(model[0].parametrizations), hasattr(model[1], "parametrizations")
        (['weight'], False)
    """
    technique = _technique(dim, eps)
    fuse = _checks.boolean("fuse", fuse)
    _parametrize.convert_tree(technique, model, layer_types)
    return _scope.fuse(model) if fuse else _scope.unfuse(model)


def convert_with_weight_normalization(module_cls: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """Builds ``module_cls(*args, **kwargs)`` and weight-normalizes every parameter of 2+ dims.

    The entry point of the original Chainer converter, for code ported from it: every
    parameter with 2 or more dimensions in the module tree (LSTM and GRU matrices, attention
    projections, embeddings included), along dim 0, with eps 1e-12. Like the original, it
    does not take lazy modules; :func:`apply_weight_norm` does.

    Example:
        >>> conv = convert_with_weight_normalization(torch.nn.Conv2d, 3, 8, kernel_size=3)
        >>> conv.parametrizations.weight.original0.shape
        torch.Size([8, 1, 1, 1])
        >>> lstm = convert_with_weight_normalization(torch.nn.LSTM, 4, 8, num_layers=2)
        >>> sorted(lstm.parametrizations)
        ['weight_hh_l0', 'weight_hh_l1', 'weight_ih_l0', 'weight_ih_l1']
    """
    if not callable(module_cls):
        raise TypeError(f"module_cls must be a module class, got {module_cls!r}")
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module_cls must build a torch.nn.Module, got {type(module).__name__} from "
            f"{module_cls!r}"
        )
    targets = []
    for prefix, sub in module.named_modules():
        for name, param in own_parameters(sub).items():
            if param is None:
                continue
            if _parametrize.is_uninitialized(param):
                raise ValueError(
                    f"{describe(sub, name)} does not exist yet (a lazy module); like the "
                    "original converter, convert_with_weight_normalization needs it: use "
                    "apply_weight_norm(module), which converts at the first forward"
                )
            if param.ndim >= 2:
                targets.append((f"{prefix}.{name}" if prefix else name, sub, name))
    if not targets:
        raise ValueError(
            f"nothing to convert in {layer_name(module)}: it has no parameter with 2 or more "
            "dimensions"
        )
    _parametrize.convert_parameters(_Normalization(0, 1e-12), module, targets)
    return module


def remove_weight_norm(module: M, name: str | None = None) -> M:
    """Folds weight normalization back into plain Parameters: normhooks' and torch's (both forms).

    The output is unchanged, and the weight becomes the Parameter object that held v, so an
    optimizer that holds v keeps updating the weight.

    Args:
        module: the layer, or a model when ``name`` is None.
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
    _parametrize.remove(_Normalization(), module, name, bake=True)
    return module
