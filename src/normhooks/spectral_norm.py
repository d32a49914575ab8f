r"""Spectral normalization, ``W / sigma(W)``, and σReparam, ``(gamma / sigma(W)) W``.

Implements T. Miyato, T. Kataoka, M. Koyama and Y. Yoshida, "Spectral Normalization for
Generative Adversarial Networks", arXiv:1802.05957 (2018), Algorithm 1, as Chainer's
``link_hooks.SpectralNormalization`` and ``torch.nn.utils.parametrizations.spectral_norm`` do
it: the largest singular value of the weight as a matrix (one row per index of ``dim``) is
estimated by power iteration, whose vectors ``u`` and ``v`` are buffers advanced at every
training forward. With ``scale=True`` it is σReparam (S. Zhai et al., "Stabilizing Transformer
Training by Preventing Attention Entropy Collapse", arXiv:2303.06296, 2023): a learnable scalar
gamma multiplies the normalized weight.

The file reads top down: the formula as plain functions, the :class:`SpectralNorm`
parametrization, what the shared lifecycle needs to know about it (taking over torch's
spectral norm included), then the public functions. Registering, converting a tree and
removing are ``normhooks._parametrize``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from normhooks import _checks, _parametrize, _torch_compat
from normhooks._parametrize import describe
from normhooks._torch_compat import ConvNd, TorchSpectralNorm

__all__ = ["SpectralNorm", "apply_spectral_norm", "remove_spectral_norm", "spectral_norm"]

_WHAT = "spectral normalization"
# torch's power iterations at registration, which bring u and v close to the singular
# vectors before the first forward.
_WARMUP = 15
# The start of every conversion's power iteration: pseudo-random, so that it is almost surely
# not orthogonal to the top singular vectors, and drawn from a generator of its own, so that a
# conversion is the same whatever else drew random numbers and draws none of the user's.
_SEED = 1802_05957

M = TypeVar("M", bound=nn.Module)


# --- the formula ----------------------------------------------------------------------------


def _matrix(weight: Tensor, dim: int) -> Tensor:
    """``weight`` as a matrix with one row per index of ``dim``, whose largest singular value
    is the one normalized (torch's and Chainer's layout)."""
    return (weight if dim == 0 else weight.movedim(dim, 0)).flatten(1)


def _normalized_(vector: Tensor, eps: float) -> Tensor:
    """``vector / max(||vector||, eps)`` in place (``F.normalize``, on a vector of our own)."""
    return vector.div_(torch.linalg.vector_norm(vector).clamp_min_(eps))


@torch.no_grad()
def _power_iteration(
    matrix: Tensor, v: Tensor, iterations: int, eps: float
) -> tuple[Tensor, Tensor]:
    """``iterations`` steps of the power method from ``v``, as new tensors:
    ``u = M v / ||M v||``, then ``v = M^T u / ||M^T u||``."""
    u = v  # iterations >= 1 replaces it
    for _ in range(iterations):
        u = _normalized_(torch.mv(matrix, v), eps)
        v = _normalized_(torch.mv(matrix.mT, u), eps)
    return u, v


def _sigma(matrix: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """The estimate ``u . (M v)`` of the largest singular value of ``M``; its gradient treats
    ``u`` and ``v`` as constants, as the paper's does."""
    return torch.vdot(u, torch.mv(matrix, v))


def _start(weight: Tensor, dim: int, eps: float) -> tuple[Tensor, Tensor]:
    """The vectors a conversion starts from: a fixed pseudo-random ``v``, refined by torch's
    number of power iterations on ``weight``."""
    matrix = _matrix(weight.detach(), dim)
    columns = matrix.shape[1]
    generator = torch.Generator().manual_seed(_SEED)
    drawn = torch.randn(columns, generator=generator, dtype=torch.float64)
    v = _normalized_(drawn.to(device=matrix.device, dtype=matrix.dtype), eps)
    return _power_iteration(matrix, v, _WARMUP, eps)


def _advances(training: bool) -> bool:
    """Whether a forward advances the power iteration: in training mode, as torch's does at
    every such forward, except under a ``torch.func`` transform, whose functions may not write
    into a module's buffers (torch's raises there); ``torch.compile`` records the writes."""
    return training and (
        torch.compiler.is_compiling() or not _torch_compat.functorch_transform_active()
    )


# --- the parametrization --------------------------------------------------------------------


class SpectralNorm(nn.Module):
    r"""Parametrization ``W -> W / sigma(W)``, or ``(gamma / sigma(W)) W`` with ``scale=True``.

    .. math::

        \hat W = \frac{\gamma}{\sigma(W)} W, \qquad \sigma(W) \approx u^\top M v

    where :math:`M` is the weight with axis ``dim`` as rows and the rest flattened, and
    :math:`u`, :math:`v` are the power iteration's estimates of its top singular vectors, kept
    in the buffers ``_u`` and ``_v`` (where torch's ``_SpectralNorm`` keeps them). Each
    forward in training mode first runs ``n_power_iterations`` steps
    :math:`u \leftarrow Mv / \|Mv\|`, :math:`v \leftarrow M^\top u / \|M^\top u\|`, as torch's
    does, except inside ``torch.func`` transforms; an eval forward leaves them. The gradient
    treats :math:`u` and :math:`v` as constants. :math:`\gamma` is 1 without ``scale``; with
    it, a scalar Parameter ``gamma`` initialised to :math:`\sigma(W)`, so the weight is
    unchanged at conversion (σReparam).

    Args:
        weight: the weight it will normalize, for the shapes of ``u`` and ``v`` and the start
            of their power iteration (and gamma's initial value).
        dim: the axis of the weight with one row of :math:`M` per index.
        n_power_iterations: power-iteration steps per training forward.
        eps: the smallest norm a vector of the power iteration is divided by.
        scale: σReparam's learnable gamma.
        start: ``(u, v)`` to keep as the buffers, as they are; None starts from a fixed
            pseudo-random ``v`` refined by 15 power iterations (torch's number).

    Example:
        >>> from torch.nn.utils import parametrize
        >>> linear = torch.nn.Linear(4, 3)
        >>> sn = SpectralNorm(linear.weight)
        >>> _ = parametrize.register_parametrization(linear, "weight", sn)
        >>> sorted(name for name, _ in sn.named_buffers())
        ['_u', '_v']
    """

    _u: Tensor
    _v: Tensor
    gamma: nn.Parameter | None

    def __init__(
        self,
        weight: Tensor,
        *,
        dim: int = 0,
        n_power_iterations: int = 1,
        eps: float = 1e-12,
        scale: bool = False,
        start: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        super().__init__()
        _parametrize.check_tensor(weight, "weight", _WHAT)
        where = f"a weight of shape {list(weight.shape)}"
        self.dim = _checks.axis("dim", dim, weight.ndim, where)
        self.n_power_iterations = _checks.positive_int("n_power_iterations", n_power_iterations)
        self.eps = _checks.positive("eps", eps)
        scale = _checks.boolean("scale", scale)
        _refuse_zeros("weight", weight)
        matrix = _matrix(weight.detach(), self.dim)
        u, v = _start(weight, self.dim, self.eps) if start is None else start
        _check_vectors(matrix, u, v, self.dim)
        self.register_buffer("_u", u)
        self.register_buffer("_v", v)
        self.gamma = None
        if scale:
            with torch.no_grad():
                self.gamma = nn.Parameter(_sigma(matrix, u, v).clone())

    def forward(self, weight: Tensor) -> Tensor:
        matrix = _matrix(weight, self.dim)
        if matrix.shape != (self._u.shape[0], self._v.shape[0]):
            _check_vectors(matrix, self._u, self._v, self.dim)
        if _advances(self.training):
            # New tensors, so those saved for backward stay valid when a later training
            # forward (the fake batch of a GAN step, say) writes into the buffers.
            u, v = _power_iteration(matrix.detach(), self._v, self.n_power_iterations, self.eps)
            with torch.no_grad():
                self._u.copy_(u)
                self._v.copy_(v)
        else:
            u, v = self._u.clone(), self._v.clone()
        sigma = _sigma(matrix, u, v)
        if self.gamma is None:
            return weight / sigma
        # Exactly W where gamma is sigma (a conversion) and exactly torch's W / sigma where
        # gamma is 1 (a takeover of torch's).
        return weight / (sigma / self.gamma)

    def right_inverse(self, weight: Tensor) -> Tensor:
        # As torch's: assigning to the parametrized weight sets the raw weight.
        return weight

    def extra_repr(self) -> str:
        scale = ", scale=True" if self.gamma is not None else ""
        return (
            f"dim={self.dim}, n_power_iterations={self.n_power_iterations}, eps={self.eps}{scale}"
        )


def _refuse_zeros(where: str, weight: Tensor) -> None:
    """Raises for a weight of zeros, whose sigma is 0: torch's gives NaN from then on, since
    the power iteration's vectors become zero and stay there."""
    if weight.device.type != "meta" and not bool(weight.detach().any()):
        raise ValueError(
            f"{where} is all zeros: its largest singular value is 0, and {_WHAT} would divide "
            "by it. Initialize the weight first"
        )


def _check_vectors(matrix: Tensor, u: object, v: object, dim: int) -> None:
    """Raises unless ``u`` and ``v`` are vectors of the matrix's row and column counts."""
    rows, columns = matrix.shape
    for name, vector, size in (("u", u, rows), ("v", v, columns)):
        if not isinstance(vector, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(vector).__name__}")
        if vector.shape != (size,):
            raise ValueError(
                f"{name} must have shape [{size}] for a weight whose matrix along dim={dim} "
                f"is {rows} x {columns}, got {name} of shape {list(vector.shape)}"
            )


# --- what the lifecycle needs to know -------------------------------------------------------


@dataclass(frozen=True)
class _SpectralNormalization(_parametrize.Technique[int]):
    """Spectral normalization with these settings, checked by the public functions; its
    layout is the axis of the matrix's rows (None: the output axis of each layer)."""

    n_power_iterations: int = 1
    eps: float = 1e-12
    dim: int | None = None
    scale: bool = False

    marker = "spectral_norm"
    what = _WHAT
    done = "spectrally normalized"
    verb = "normalize"
    tree_function = "apply_spectral_norm"
    parametrization = SpectralNorm
    layers = (nn.Linear, nn.Bilinear, ConvNd)

    @property
    def label(self) -> str:
        return "SigmaReparam" if self.scale else _WHAT

    def layout(self, module: nn.Module, name: str, ndim: int) -> int:
        if self.dim is None:
            return _parametrize.output_axis(module)
        return _checks.axis("dim", self.dim, ndim, describe(module, name))

    def build(self, weight: Tensor, layout: int) -> nn.Module:
        return SpectralNorm(
            weight,
            dim=layout,
            n_power_iterations=self.n_power_iterations,
            eps=self.eps,
            scale=self.scale,
        )

    def companions(self) -> dict[str, tuple[str, str]]:
        return {"gamma": ("parametrization", "gamma")} if self.scale else {}

    def refuse(self, module: nn.Module, name: str, layout: int | None) -> None:
        if layout is not None:  # checked before anything changes, not only when built
            _refuse_zeros(describe(module, name), getattr(module, name))

    def torch_counterpart(self, module: nn.Module, name: str) -> Any:
        for found in _parametrize.parametrizations_of(module, name):
            if isinstance(found, TorchSpectralNorm):
                return found
        return super().torch_counterpart(module, name)

    def take_over(
        self, module: nn.Module, name: str, found: Any, strict: bool
    ) -> _parametrize.Step | None:
        """The step that replaces torch's spectral norm ``found`` by ours, in place: same
        Parameter, the same ``_u`` and ``_v`` tensors, the same state-dict keys."""
        if not isinstance(found, TorchSpectralNorm):
            return super().take_over(module, name, found, strict)
        theirs: Any = found  # torch's attributes are untyped
        where = describe(module, name)
        chain = _parametrize.originals(module, name)
        if chain[0] is not found:
            raise ValueError(
                f"{where} carries torch's spectral_norm after other parametrizations; "
                f"{_WHAT} takes over only an innermost one: remove the others first"
            )
        weight = chain.original
        _parametrize.refuse_wrapped(module, _WHAT, weight, name)
        _parametrize.check_ndim(where, weight.ndim, _WHAT)  # torch's normalizes a vector
        torch_dim = int(theirs.dim)
        if strict and self.dim is not None and self.layout(module, name, weight.ndim) != torch_dim:
            raise ValueError(
                f"{where} carries torch's spectral_norm along dim={torch_dim}; spectral_norm "
                f"takes it over with its u and v as they are: pass dim={torch_dim} (or None), "
                f"got dim={self.dim}"
            )
        # One parameter's settings apply to it; a tree's apply to the layers it converts, and
        # those taken over keep torch's.
        iterations = self.n_power_iterations if strict else int(theirs.n_power_iterations)
        eps = self.eps if strict else float(theirs.eps)

        def step() -> _parametrize.Undo:
            ours = SpectralNorm(
                weight,
                dim=torch_dim,
                n_power_iterations=iterations,
                eps=eps,
                scale=self.scale,
                start=(theirs._u, theirs._v),
            ).train(found.training)
            if ours.gamma is not None:
                # The output was W / sigma already: gamma starts at 1 to keep it.
                with torch.no_grad():
                    ours.gamma.fill_(1.0)
            chain[0] = ours

            def undo() -> None:
                chain[0] = found

            return undo

        return step


def _technique(
    n_power_iterations: object, eps: object, dim: object, scale: object
) -> _SpectralNormalization:
    """The public functions' settings, checked."""
    return _SpectralNormalization(
        _checks.positive_int("n_power_iterations", n_power_iterations),
        _checks.positive("eps", eps),
        None if dim is None else _checks.integer("dim", dim),
        _checks.boolean("scale", scale),
    )


# --- public functions -----------------------------------------------------------------------


def spectral_norm(
    module: M,
    name: str = "weight",
    *,
    n_power_iterations: int = 1,
    eps: float = 1e-12,
    dim: int | None = None,
    scale: bool = False,
) -> M:
    r"""Reparametrizes ``module.<name>`` as ``W / sigma(W)`` (spectral normalization), or as
    ``(gamma / sigma(W)) W`` with ``scale=True`` (σReparam).

    .. math::

        \hat W = \frac{\gamma}{\sigma(W)} W, \qquad
        \sigma(W) = \max_{h \ne 0} \frac{\|M h\|_2}{\|h\|_2} \approx u^\top M v

    with :math:`M` the weight with axis ``dim`` as rows, and :math:`\sigma` estimated by power
    iteration (see :class:`SpectralNorm`). Registers a :class:`SpectralNorm` in torch's layout:
    the raw weight stays the same Parameter, at ``parametrizations.<name>.original``, and
    ``u``, ``v`` are the buffers ``parametrizations.<name>.0._u`` and ``._v``, so state dicts
    load both ways with ``torch.nn.utils.parametrizations.spectral_norm`` (σReparam adds
    ``.0.gamma``). Every forward in training mode advances ``u`` and ``v`` by
    ``n_power_iterations`` steps, as torch's does (both forwards of a GAN step included),
    except inside ``torch.func`` transforms, which compute with them as they are; an eval
    forward never advances them. They are buffers, so DDP broadcasts rank 0's at every forward
    and the ranks stay in step. A weight of all zeros is refused: its sigma is 0.

    A parameter that carries torch's spectral norm is taken over in place (the same
    Parameter, the same ``_u`` and ``_v`` tensors, the same keys and outputs); ``dim`` must
    then be torch's, or None.

    Args:
        module: the layer that owns the parameter; changed in place.
        name: the parameter's name.
        n_power_iterations: power-iteration steps per training forward (torch's 1).
        eps: the smallest norm a vector of the power iteration is divided by.
        dim: the axis of rows. None picks it as torch does: 1 for ``ConvTranspose*``, whose
            weight holds the output channels there, 0 for every other layer.
        scale: σReparam: a learnable scalar ``gamma``, a Parameter of the parametrization
            initialised to :math:`\sigma(W)`, so the output is unchanged at conversion.
            Build the optimizer after converting, or add the gammas to it.

    Returns:
        ``module``.

    References:
        Miyato et al., Spectral Normalization for Generative Adversarial Networks,
        arXiv:1802.05957. Zhai et al., Stabilizing Transformer Training by Preventing
        Attention Entropy Collapse, arXiv:2303.06296.

    Example:
        >>> linear = spectral_norm(torch.nn.Linear(20, 40))
        >>> for _ in range(50):
        ...     _ = linear(torch.randn(1, 20))  # training forwards advance u and v
        >>> round(torch.linalg.matrix_norm(linear.weight.detach(), 2).item(), 3)
        1.0
    """
    _parametrize.convert(_technique(n_power_iterations, eps, dim, scale), module, name)
    return module


def apply_spectral_norm(
    model: M,
    *,
    layer_types: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
    n_power_iterations: int = 1,
    eps: float = 1e-12,
    scale: bool = False,
) -> M:
    """Spectrally normalizes the ``weight`` of every matching layer in ``model``.

    The whole tree is checked before anything changes: either every matching layer is
    converted, or the call raises and the model is left as it was. Matching layers that
    carry torch's spectral norm (``torch.nn.utils.parametrizations.spectral_norm``) are taken
    over in place, with torch's ``dim``, ``n_power_iterations`` and ``eps`` and their ``u``
    and ``v``: same keys, same outputs, so a checkpoint of a model built on torch's loads
    unchanged. Each layer's ``dim`` is torch's default (1 for ``ConvTranspose*``, else 0).

    Args:
        model: the model; changed in place.
        layer_types: the layer classes to convert (subclasses included). None means
            ``Linear``, ``Bilinear``, every ``Conv*`` and every ``ConvTranspose*``, lazy ones
            included; embeddings are converted when named here (``torch.nn.Embedding``).
        n_power_iterations: see :func:`spectral_norm`; for the layers converted.
        eps: see :func:`spectral_norm`; for the layers converted.
        scale: see :func:`spectral_norm`. A layer taken over keeps its output: its gamma
            starts at 1.

    Returns:
        ``model``. Layers already spectrally normalized are skipped, and so are matching
        layers without a ``weight`` Parameter.

    Raises:
        ValueError: nothing to convert, a weight of zeros, a layer whose own forward
            standardizes its weight (timm's ``StdConv2d`` family), or a bad weight (named).
        TypeError: a matching weight that is not a real floating-point Parameter.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ConvTranspose2d(8, 4, 2))
        >>> model = apply_spectral_norm(model, scale=True)
        >>> [layer.parametrizations.weight[0].dim for layer in model]
        [0, 1]
    """
    _parametrize.convert_tree(_technique(n_power_iterations, eps, None, scale), model, layer_types)
    return model


def remove_spectral_norm(module: M, name: str | None = None, *, bake: bool = True) -> M:
    """Removes spectral normalization from ``module.<name>``, or from the whole tree.

    Args:
        module: the layer, or a model when ``name`` is None.
        name: the parameter's name, or None for every spectral normalization in the module
            tree (pending ones on lazy modules included).
        bake: True leaves the normalized weight (times gamma, for σReparam) as a plain
            Parameter, computed with ``u`` and ``v`` as they are (what an eval forward
            computes; torch's removal in training mode runs one more power iteration);
            False restores the raw weight. Either way it is the same Parameter object as
            the raw weight, so an existing optimizer keeps working.

    Returns:
        ``module``.

    Example:
        >>> linear = spectral_norm(torch.nn.Linear(3, 2)).eval()
        >>> before = linear(torch.ones(1, 3))
        >>> linear = remove_spectral_norm(linear)
        >>> torch.allclose(linear(torch.ones(1, 3)), before)
        True
    """
    bake = _checks.boolean("bake", bake)
    _parametrize.check_module(module)
    found = [p for p in module.modules() if isinstance(p, SpectralNorm)]
    modes = [p.training for p in found]
    for parametrization in found:
        parametrization.eval()
    try:
        _parametrize.remove(_SpectralNormalization(), module, name, bake=bake)
    finally:
        for parametrization, mode in zip(found, modes, strict=True):
            parametrization.train(mode)
    return module
