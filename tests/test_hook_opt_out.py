"""A param group that opts out (``"lars": False``, ``"agc": False``, ``"trust": False``) is
left alone: its parameters are neither checked nor changed, whatever they are, and under
GradScaler's fused protocol their gradients are unscaled as GradScaler would.

The opted-out parameters are compared with plain SGD written out by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from normhooks import AdaptiveGradientClipping, GradientLARS, TrustRatio
from normhooks._step_hook import StepHook

LR = 0.1
HOOKS: dict[str, Callable[[], StepHook[Any]]] = {
    "lars": GradientLARS,
    "agc": AdaptiveGradientClipping,
    "trust": TrustRatio,
}


class ScaleAwareSGD(torch.optim.Optimizer):
    """Plain SGD that takes GradScaler's protocol for fused optimizers: it divides by
    ``grad_scale`` itself, and skips the step where ``found_inf`` is set."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> None:  # type: ignore[override]
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.item():
            return
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = param.grad if scale is None else param.grad / scale
                    param.add_(grad, alpha=-group["lr"])


def sparse_embedding() -> nn.Embedding:
    return nn.Embedding(6, 3, sparse=True)


def indices() -> Tensor:
    return torch.tensor([0, 2, 2, 5])


def setup(prefix: str, left_alone: nn.Parameter) -> tuple[nn.Linear, list[dict[str, Any]]]:
    linear = nn.Linear(3, 2)
    groups = [{"params": list(linear.parameters())}, {"params": [left_alone], prefix: False}]
    return linear, groups


@pytest.mark.parametrize("prefix", list(HOOKS))
def test_a_sparse_embedding_in_a_group_that_opts_out_trains_as_plain_sgd(prefix: str) -> None:
    embedding = sparse_embedding()
    linear, groups = setup(prefix, embedding.weight)
    optimizer = torch.optim.SGD(groups, lr=LR)
    hook = HOOKS[prefix]()
    hook.attach(optimizer)
    linear(embedding(indices())).square().sum().backward()
    expected = embedding.weight.detach() - LR * embedding.weight.grad.to_dense()
    optimizer.step()
    torch.testing.assert_close(embedding.weight.detach(), expected)
    assert hook._last_values[0].shape == (2,)
    assert hook._last_values[1].numel() == 0


@pytest.mark.parametrize("prefix", list(HOOKS))
def test_a_complex_parameter_in_a_group_that_opts_out_trains_as_plain_sgd(prefix: str) -> None:
    phase = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    linear, groups = setup(prefix, phase)
    optimizer = torch.optim.SGD(groups, lr=LR)
    HOOKS[prefix]().attach(optimizer)
    (linear(torch.randn(4, 3)).sum() + (phase * phase.conj()).real.sum()).backward()
    expected = phase.detach() - LR * phase.grad
    optimizer.step()
    torch.testing.assert_close(phase.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("prefix", list(HOOKS))
def test_a_group_that_opts_out_added_after_attach_is_not_checked(prefix: str) -> None:
    linear = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(linear.parameters(), lr=LR)
    HOOKS[prefix]().attach(optimizer)
    integer = torch.zeros(3, dtype=torch.int64)  # no grad: the optimizer skips it
    optimizer.param_groups.append({**optimizer.defaults, "params": [integer], prefix: False})
    linear(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    torch.testing.assert_close(integer, torch.zeros(3, dtype=torch.int64), rtol=0, atol=0)


@pytest.mark.parametrize("prefix", list(HOOKS))
def test_sparse_gradients_that_opt_out_are_unscaled_under_the_fused_protocol(prefix: str) -> None:
    """The hook clears ``grad_scale`` for the fused step, so it unscales what it skips."""
    embedding = sparse_embedding()
    linear, groups = setup(prefix, embedding.weight)
    optimizer = ScaleAwareSGD(groups, lr=LR)
    HOOKS[prefix]().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(linear(embedding(indices())).square().sum()).backward()
    expected = embedding.weight.detach() - LR * embedding.weight.grad.to_dense() / 1024.0
    scaler.step(optimizer)
    torch.testing.assert_close(embedding.weight.detach(), expected)


def test_an_overflow_in_a_sparse_gradient_that_opts_out_skips_the_fused_step() -> None:
    embedding = sparse_embedding()
    linear, groups = setup("lars", embedding.weight)
    optimizer = ScaleAwareSGD(groups, lr=LR)
    GradientLARS().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(linear(embedding(indices())).square().sum()).backward()
    embedding.weight.grad._values()[0, 0] = float("inf")
    before = [p.detach().clone() for p in (*linear.parameters(), embedding.weight)]
    scaler.step(optimizer)
    for param, old in zip((*linear.parameters(), embedding.weight), before, strict=True):
        torch.testing.assert_close(param.detach(), old, rtol=0, atol=0)
