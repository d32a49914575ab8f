"""pytorch-optimizer's LARS, Lamb and agc against the normhooks settings that reproduce them.

Each mapping the migration guide states is trained side by side for a few steps in float64 and
compared to float rounding; where pytorch-optimizer differs (its default Lamb, its agc's unit
for 3-D weights), the test pins down how. Its Lamb's other modes are in test_peers_lamb.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pytorch_optimizer import LARS, Lamb, agc
from torch import Tensor, nn

from normhooks import GradientLARS, TrustRatio, agc_, lars_param_groups

BETAS = (0.9, 0.999)
STEPS = 5


def model(zero_bias: bool = False) -> nn.Sequential:
    # The last weight has shape (1, 16): two dimensions, only one longer than 1.
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    if zero_bias:  # a zero weight, where LAMB's ratio falls back to 1
        nn.init.zeros_(net[0].bias)
    return net


def train_side_by_side(
    make_theirs: Callable[[nn.Module], torch.optim.Optimizer],
    make_ours: Callable[[nn.Module], torch.optim.Optimizer],
    schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    zero_bias: bool = False,
) -> tuple[nn.Module, nn.Module]:
    theirs = model(zero_bias)
    ours = copy.deepcopy(theirs)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=generator, dtype=torch.float64)
    y = torch.randn(32, 1, generator=generator, dtype=torch.float64)
    their_optimizer, our_optimizer = make_theirs(theirs), make_ours(ours)
    scheduler = None if schedule is None else schedule(our_optimizer)
    for _ in range(STEPS):
        for net, optimizer in ((theirs, their_optimizer), (ours, our_optimizer)):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return theirs, ours


def assert_trained_alike(theirs: nn.Module, ours: nn.Module) -> None:
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"lr": 0.5, "weight_decay": 1e-2, "momentum": 0.8}, id="decay"),
        pytest.param({"lr": 0.5, "trust_coefficient": 0.02, "nesterov": True}, id="nesterov"),
    ],
)
def test_lars_is_sgd_with_gradient_lars(options: dict[str, Any]) -> None:
    settings = {
        "lr": 1e-3,
        "weight_decay": 0.0,
        "momentum": 0.9,
        "dampening": 0.0,
        "trust_coefficient": 1e-3,
        "nesterov": False,
    } | options

    def ours(net: nn.Module) -> torch.optim.Optimizer:
        # pytorch-optimizer's split: tensors with more than one dimension get LARS.
        optimizer = torch.optim.SGD(
            lars_param_groups(net, exclude=lambda name, p: p.ndim <= 1),
            lr=settings["lr"],
            momentum=settings["momentum"],
            dampening=settings["dampening"],
            nesterov=settings["nesterov"],
        )
        hook = GradientLARS(
            threshold=0.0,
            weight_decay=settings["weight_decay"],
            eps=0.0,
            trust_coefficient=settings["trust_coefficient"],
        )
        hook.attach(optimizer)
        return optimizer

    assert_trained_alike(*train_side_by_side(lambda net: LARS(net.parameters(), **settings), ours))


def adam_with_trust_ratio(net: nn.Module) -> torch.optim.Optimizer:
    # Lamb never corrects its moments, and clamps each weight's norm at Lamb.clamp = 10.
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2, betas=BETAS, eps=0.0)
    TrustRatio(bias_correction=False, max_weight_norm=Lamb.clamp).attach(optimizer)
    return optimizer


def test_lamb_with_adam_debias_is_adam_with_the_uncorrected_trust_ratio() -> None:
    # Exact with eps=0 and weight_decay=0 (see the migration guide for the other cases),
    # zero weights included.
    theirs, ours = train_side_by_side(
        lambda net: Lamb(net.parameters(), lr=1e-2, betas=BETAS, eps=0.0, adam_debias=True),
        adam_with_trust_ratio,
        zero_bias=True,
    )
    assert_trained_alike(theirs, ours)


def test_lamb_moves_a_zero_weight_by_the_uncorrected_step() -> None:
    # Where the ratio falls back to 1, Lamb takes lr * m / sqrt(v), at step 1
    # lr * (1 - beta1) / sqrt(1 - beta2) per entry, where torch's Adam (and so a TrustRatio
    # that keeps its bias correction) takes lr: why bias_correction=False is needed.
    zero = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    zero.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    Lamb([zero], lr=1e-2, betas=BETAS, eps=0.0, adam_debias=True).step()
    uncorrected = 1e-2 * (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])
    torch.testing.assert_close(zero.detach(), -uncorrected * zero.grad.sign())
    corrected = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    corrected.grad = zero.grad.clone()
    optimizer = torch.optim.Adam([corrected], lr=1e-2, betas=BETAS, eps=0.0)
    TrustRatio().attach(optimizer)
    optimizer.step()
    torch.testing.assert_close(corrected.detach(), -1e-2 * zero.grad.sign())


def test_default_lamb_divides_the_learning_rate_by_the_first_moments_correction() -> None:
    # Without adam_debias, Lamb's step size is lr / (1 - beta1**t): the trust ratio has
    # already normalized the update, so this multiplies each layer's step, 10x at t = 1.
    def corrected(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 - BETAS[0] ** (s + 1)))

    theirs, ours = train_side_by_side(
        lambda net: Lamb(net.parameters(), lr=1e-2, betas=BETAS, eps=0.0),
        adam_with_trust_ratio,
        schedule=corrected,
        zero_bias=True,
    )
    assert_trained_alike(theirs, ours)


def clipped_by_hand(weight: Tensor, grad: Tensor, dims: tuple[int, ...] | None) -> Tensor:
    """AGC with units over ``dims``: ``G_i * 0.01 * max(||W_i||, 1e-3) / ||G_i||`` where the
    ratio ``||G_i|| / max(||W_i||, 1e-3)`` exceeds 0.01."""
    w_norm = weight.norm(dim=dims, keepdim=True).clamp(min=1e-3)
    g_norm = grad.norm(dim=dims, keepdim=True)
    max_norm = 0.01 * w_norm
    return torch.where(g_norm > max_norm, grad * max_norm / g_norm, grad)


def gradient_for(weight: Tensor) -> Tensor:
    """A gradient that AGC clips in some units and leaves alone in others."""
    generator = torch.Generator().manual_seed(1)
    grad = 0.01 * torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
    return grad * torch.linspace(0.01, 4.0, weight.shape[0], dtype=weight.dtype).view(
        -1, *([1] * (weight.ndim - 1))
    )


@pytest.mark.parametrize(
    "shape", [(7,), (6, 5), (6, 3, 3, 2), (4, 3, 2, 2, 2)], ids=["1d", "2d", "4d", "5d"]
)
def test_agc_clips_the_rows_normhooks_clips(shape: tuple[int, ...]) -> None:
    weight = torch.randn(shape, dtype=torch.float64)
    grad = gradient_for(weight)
    param = nn.Parameter(weight.clone())
    param.grad = grad.clone()
    agc_([param])
    theirs = agc(weight, grad)
    torch.testing.assert_close(param.grad, theirs, rtol=1e-12, atol=0.0)
    assert not torch.equal(theirs, grad)  # some units were clipped


def test_agc_units_of_a_3d_weight_are_columns_not_rows() -> None:
    # A Conv1d weight (out, in, kernel): pytorch-optimizer takes norms over dim 1 only, one
    # unit per output channel and kernel tap; normhooks (and timm, optax and the paper) one
    # unit per output channel.
    weight = torch.randn(6, 3, 4, dtype=torch.float64)
    grad = gradient_for(weight)
    param = nn.Parameter(weight.clone())
    param.grad = grad.clone()
    agc_([param])
    theirs = agc(weight, grad)
    torch.testing.assert_close(theirs, clipped_by_hand(weight, grad, dims=(1,)), rtol=1e-12, atol=0)
    torch.testing.assert_close(param.grad, clipped_by_hand(weight, grad, dims=(1, 2)))
    assert not torch.allclose(theirs, param.grad)
