"""The techniques written out by hand, and the small models and data the framework tests train.

Each framework test trains a model with normhooks inside a framework, then trains a copy of it
in a plain torch loop where the technique is the few lines of its formula below, and compares
the two. Nothing here calls normhooks. The formulas are computed in float64 from the float32
tensors and written back, so they are an exact statement of each technique.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def convnet(conv: type[nn.Conv2d] = nn.Conv2d) -> nn.Sequential:
    return nn.Sequential(
        conv(2, 6, 3, padding=1),
        nn.Tanh(),
        conv(6, 4, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def regression_data(
    n: int, shape: tuple[int, ...] = (8,), *, scale: float = 1.0, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``n`` inputs of ``shape`` and 4 targets each, from their own generator."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=generator)
    y = torch.randn(n, 4, generator=generator) * scale
    return x, y


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(model(x), y)


# --- the gradient techniques, applied to .grad just before the optimizer's step ------------


@torch.no_grad()
def lars_(
    params: list[Tensor], *, weight_decay: float = 0.0, threshold: float = 1e-2, eps: float = 1e-9
) -> None:
    """``g <- rate * (g + wd * w)``, ``rate = ||w|| / (eps + ||g|| + wd * ||w||)`` where
    ``||w|| > threshold``, else 1 (You et al. 2017; Chainer's GradientLARS)."""
    for p in params:
        if p.grad is None:
            continue
        w, g = p.double(), p.grad.double()
        w_norm, g_norm = w.norm(), g.norm()
        rate = w_norm / (eps + g_norm + weight_decay * w_norm) if w_norm > threshold else 1.0
        p.grad.copy_(rate * (g + weight_decay * w))


@torch.no_grad()
def agc_(params: list[Tensor], *, clipping: float = 0.01, eps: float = 1e-3) -> None:
    """Each unit ``G_i <- G_i * clipping * max(||W_i||, eps) / ||G_i||`` where the ratio
    ``||G_i|| / max(||W_i||, eps)`` exceeds ``clipping``; a unit is a row along dim 0 of a
    tensor with at least two dimensions, the whole tensor otherwise (Brock et al. 2021)."""
    for p in params:
        if p.grad is None:
            continue
        w, g = p.double(), p.grad.double()
        dims = tuple(range(1, p.ndim)) if p.ndim >= 2 else None
        w_norm = w.norm(dim=dims, keepdim=True).clamp(min=eps)
        g_norm = g.norm(dim=dims, keepdim=True)
        max_norm = clipping * w_norm
        factor = torch.where(g_norm > max_norm, max_norm / g_norm, torch.ones_like(g_norm))
        p.grad.copy_(g * factor)


class TrustRatioByHand:
    """LAMB's trust ratio on an optimizer's own update: call ``before()`` just before the
    step and ``after(lr)`` just after it. ``w <- w_old + r * (w_new - w_old)`` with
    ``r = ||w_old|| / ||(w_new - w_old) / lr||`` (1 where either norm is 0)."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.olds: list[Tensor] = []

    @torch.no_grad()
    def before(self) -> None:
        self.olds = [p.detach().double() for p in self.params]

    @torch.no_grad()
    def after(self, lr: float) -> None:
        for p, old in zip(self.params, self.olds, strict=True):
            delta = p.double() - old
            w_norm, u_norm = old.norm(), (delta / lr).norm()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            p.copy_(old + ratio * delta)


# --- the weight techniques, as layers that compute their weight by hand -------------------


def standardized(weight: Tensor, eps: float = 1e-5) -> Tensor:
    """``(W_c - mean(W_c)) / sqrt(var(W_c) + eps)`` per output channel, biased variance."""
    rows = weight.flatten(1)
    mean = rows.mean(dim=1, keepdim=True)
    var = rows.var(dim=1, unbiased=False, keepdim=True)
    return ((rows - mean) / torch.sqrt(var + eps)).view_as(weight)


class StandardizedConv2d(nn.Conv2d):
    """A Conv2d that convolves with its standardized weight (Qiao et al. 2019)."""

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, standardized(self.weight), self.bias)


class WeightNormLinear(nn.Module):
    """A Linear computing ``W = g * v / (||v|| + eps)``, one norm per output row (Salimans
    and Kingma 2016), from a Linear's weight: ``g = ||W|| + eps``, ``v = W / g``."""

    def __init__(self, linear: nn.Linear, eps: float = 1e-12) -> None:
        super().__init__()
        weight = linear.weight.detach()
        norm = weight.norm(dim=1, keepdim=True) + eps
        self.eps = eps
        self.g = nn.Parameter(norm.clone())
        self.v = nn.Parameter(weight / norm)
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        weight = self.g * self.v / (self.v.norm(dim=1, keepdim=True) + self.eps)
        return F.linear(x, weight, self.bias)


def weight_normed_mlp(plain: nn.Sequential) -> nn.Sequential:
    """``plain`` with every Linear replaced by a WeightNormLinear of the same weight."""
    return nn.Sequential(
        *(WeightNormLinear(m) if isinstance(m, nn.Linear) else m for m in plain.children())
    )
