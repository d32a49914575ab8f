"""A spectral normalization for the contract suite: a parametrization with state.

T. Miyato, T. Kataoka, M. Koyama and Y. Yoshida, "Spectral Normalization for Generative
Adversarial Networks", arXiv:1802.05957 (2018), Algorithm 1: the weight divided by its
largest singular value, estimated by power iteration on the weight as a matrix (one row per
output channel), one step per training forward, with the left singular vector ``u`` kept in
a buffer from one step to the next. Written on normhooks' private lifecycle to show what a
technique with state takes there, and held to the contract of every parametrization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from normhooks import _parametrize
from normhooks._torch_compat import ConvNd


class SpectralNorm(nn.Module):
    """``W / sigma(W)``, ``sigma(W) = u . (M v)`` for ``M`` the weight with axis ``dim`` as rows,
    ``v = M^T u / ||M^T u||``; a training forward first moves ``u`` to ``M v / ||M v||``."""

    def __init__(self, weight: Tensor, dim: int, eps: float = 1e-12, warmup: int = 10) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        # The paper draws u at random; a fixed start (any not orthogonal to the top singular
        # vector converges) makes a conversion the same whatever else drew random numbers.
        start = torch.ones(weight.shape[dim], dtype=weight.dtype, device=weight.device)
        self.register_buffer("u", F.normalize(start, dim=0, eps=eps))
        with torch.no_grad():
            for _ in range(warmup):
                self._step(self._matrix(weight))

    def _matrix(self, weight: Tensor) -> Tensor:
        return weight.movedim(self.dim, 0).flatten(1)

    def _v(self, matrix: Tensor) -> Tensor:
        return F.normalize(matrix.mT @ self.u, dim=0, eps=self.eps)

    def _step(self, matrix: Tensor) -> None:
        self.u.copy_(F.normalize(matrix @ self._v(matrix), dim=0, eps=self.eps))

    def forward(self, weight: Tensor) -> Tensor:
        matrix = self._matrix(weight)
        with torch.no_grad():  # the paper's gradient treats u and v as constants
            if self.training:
                self._step(matrix)
            v = self._v(matrix)
        return weight / torch.dot(self.u, matrix @ v)


@dataclass(frozen=True)
class _SpectralNormalization(_parametrize.Technique[int]):
    marker = "spectral_norm"
    what = "spectral normalization"
    done = "spectrally normalized"
    verb = "normalize"
    tree_function = "apply_spectral_norm"
    parametrization = SpectralNorm
    layers = (nn.Linear, ConvNd)

    def layout(self, module: nn.Module, name: str, ndim: int) -> int:
        return _parametrize.output_axis(module)

    def build(self, weight: Tensor, layout: int) -> nn.Module:
        return SpectralNorm(weight, layout)


def apply_spectral_norm(
    model: nn.Module, *, layer_types: type[nn.Module] | Sequence[type[nn.Module]] | None = None
) -> nn.Module:
    _parametrize.convert_tree(_SpectralNormalization(), model, layer_types)
    return model


def remove_spectral_norm(model: nn.Module) -> nn.Module:
    _parametrize.remove(_SpectralNormalization(), model, None, bake=True)
    return model
