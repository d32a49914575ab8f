"""composer's, timm's and pytorch-optimizer's AGC and WS against the normhooks calls that
docs/migrating/agc-ws.md gives.

pytorch-optimizer 4.1's ``agc`` is the package itself. composer and timm import torchvision,
so their rules are written out below from their sources and cited:

- mosaicml/composer ``composer/algorithms/gradient_clipping/gradient_clipping.py``
  (``GradientClipping(clipping_type="adaptive")``: ``_apply_agc`` on every parameter after
  the backward pass) and ``composer/algorithms/weight_standardization/
  weight_standardization.py`` (``WeightStandardization``: ``(W - mean) / sqrt(var + 1e-10)``
  on ``Conv1d``/``Conv2d``/``Conv3d`` through torch's parametrize, ``n_last_layers_ignore``);
- huggingface/pytorch-image-models ``timm/utils/agc.py`` (``adaptive_clip_grad``, applied by
  its train.py to ``model_parameters(model, exclude_head=True)``, all but the last two
  parameters, ``timm/models/_manipulate.py``) and ``timm/layers/std_conv.py``
  (``StdConv2d``: ``F.batch_norm`` on the weight, ``eps=1e-6``).

Each run is 25 steps in float64 of SGD with momentum on a small MLP or conv net that has a
zero-initialized row and bias (zero weights) and, at the first step, zero gradients behind
them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from pytorch_optimizer import agc as pytorch_optimizer_agc
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from normhooks import AdaptiveGradientClipping, agc_param_groups, apply_weight_standardization

STEPS = 25


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These tensors are tiny: one thread is faster than several contending for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the models ----------------------------------------------------------------------------


def with_zero_units(model: nn.Sequential) -> nn.Sequential:
    """Zeroes the first layer's second output unit and its bias: a unit whose weight norm is 0."""
    first = model[0]
    with torch.no_grad():
        first.weight[1] = 0.0
        first.bias.zero_()
    return model


def mlp() -> nn.Sequential:
    return with_zero_units(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    )


def convnet() -> nn.Sequential:
    return with_zero_units(
        nn.Sequential(
            nn.Conv2d(2, 6, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(6, 6, 3, padding=1),
            nn.Tanh(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(6, 4),
        )
    )


MODELS = {"mlp": (mlp, (8,)), "convnet": (convnet, (2, 5, 5))}

# --- the peers' AGC, by hand ---------------------------------------------------------------


def unitwise_norm(x: Tensor) -> Tensor:
    """composer's ``_unitwise_norm`` and timm's ``unitwise_norm``: the whole tensor below two
    dims, each row along dim 0 (over every other dim) otherwise."""
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


@torch.no_grad()
def composer_agc_(parameters: list[nn.Parameter], clipping_threshold: float) -> None:
    """composer: ``coeff = (||W_i|| * threshold / ||G_i||)``, NaN (0/0) to 1, at most 1."""
    for p in parameters:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p).mul_(clipping_threshold)
        p.grad.mul_(max_norm.div_(unitwise_norm(p.grad)).nan_to_num_(nan=1.0).clamp_(max=1.0))


@torch.no_grad()
def timm_agc_(parameters: list[nn.Parameter], clip_factor: float, eps: float) -> None:
    """timm: ``max_norm = max(||W_i||, eps) * clip_factor``; the gradient is kept where
    ``||G_i|| < max_norm``, else scaled by ``max_norm / max(||G_i||, 1e-6)``."""
    for p in parameters:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(p.grad)
        clipped = p.grad * (max_norm / grad_norm.clamp(min=1e-6))
        p.grad.copy_(torch.where(grad_norm < max_norm, p.grad, clipped))


@torch.no_grad()
def pytorch_optimizer_agc_(parameters: list[nn.Parameter], clip: float, eps: float) -> None:
    for p in parameters:
        if p.grad is not None:
            p.grad.copy_(pytorch_optimizer_agc(p, p.grad, agc_eps=eps, agc_clip_val=clip))


# --- training side by side ----------------------------------------------------------------


def train_side_by_side(
    model: str,
    clip_theirs: Callable[[nn.Module], None],
    make_ours: Callable[[nn.Module], torch.optim.Optimizer],
) -> tuple[nn.Module, nn.Module]:
    make_model, shape = MODELS[model]
    torch.manual_seed(0)
    theirs = make_model().double()
    ours = copy.deepcopy(theirs)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, *shape, generator=generator, dtype=torch.float64)
    y = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    our_optimizer = make_ours(ours)
    for _ in range(STEPS):
        for net, optimizer in ((theirs, their_optimizer), (ours, our_optimizer)):
            optimizer.zero_grad()
            F.mse_loss(net(x), y).backward()
            if net is theirs:
                clip_theirs(net)
            optimizer.step()
    return theirs, ours


def max_difference(theirs: nn.Module, ours: nn.Module) -> float:
    return max(
        (a - b).abs().max().item()
        for a, b in zip(theirs.parameters(), ours.parameters(), strict=True)
    )


def assert_trained_alike(theirs: nn.Module, ours: nn.Module) -> None:
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13, msg=name)


def sgd_with_agc(
    clipping: float, eps: float, groups: Callable[[nn.Module], object] = nn.Module.parameters
) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(groups(model), lr=0.1, momentum=0.9)  # type: ignore[arg-type]
        AdaptiveGradientClipping(clipping=clipping, eps=eps).attach(optimizer)
        return optimizer

    return make


# --- AGC -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_composer_adaptive_gradient_clipping(model: str) -> None:
    # composer: GradientClipping(clipping_type="adaptive", clipping_threshold=0.01)
    theirs, ours = train_side_by_side(
        model, lambda net: composer_agc_(list(net.parameters()), 0.01), sgd_with_agc(0.01, 0.0)
    )
    assert_trained_alike(theirs, ours)
    assert torch.equal(ours[0].weight[1], torch.zeros_like(ours[0].weight[1]))  # never moves


@pytest.mark.parametrize(
    "groups",
    [
        pytest.param(agc_param_groups, id="agc_param_groups"),
        pytest.param(nn.Module.parameters, id="default-eps"),
    ],
)
def test_composer_differs_from_the_paper_calls(groups: Callable[[nn.Module], object]) -> None:
    """Leaving the classifier alone (agc_param_groups), or the default eps=1e-3 (which lets
    the zero unit move), no longer gives composer's run."""
    eps = 0.0 if groups is agc_param_groups else 1e-3
    theirs, ours = train_side_by_side(
        "mlp",
        lambda net: composer_agc_(list(net.parameters()), 0.01),
        sgd_with_agc(0.01, eps, groups),
    )
    assert max_difference(theirs, ours) > 1e-6


@pytest.mark.parametrize("model", MODELS)
def test_timm_adaptive_clip_grad_without_the_head(model: str) -> None:
    # timm's train.py --clip-mode agc --clip-grad 0.01:
    # adaptive_clip_grad(model_parameters(model, exclude_head=True), 0.01, eps=1e-3)
    theirs, ours = train_side_by_side(
        model,
        lambda net: timm_agc_(list(net.parameters())[:-2], 0.01, 1e-3),
        sgd_with_agc(0.01, 1e-3, agc_param_groups),
    )
    assert_trained_alike(theirs, ours)


@pytest.mark.parametrize("model", MODELS)
def test_pytorch_optimizer_agc(model: str) -> None:
    # pytorch_optimizer.agc(p, grad, agc_eps=1e-3, agc_clip_val=1e-2) on every parameter
    theirs, ours = train_side_by_side(
        model,
        lambda net: pytorch_optimizer_agc_(list(net.parameters()), 1e-2, 1e-3),
        sgd_with_agc(1e-2, 1e-3),
    )
    assert_trained_alike(theirs, ours)


# --- WS ------------------------------------------------------------------------------------


class ComposerStandardizer(nn.Module):
    """composer's ``WeightStandardizer``: ``(W - mean) / sqrt(var + 1e-10)`` over all but dim 0,
    biased variance, through torch's parametrize."""

    def forward(self, weight: Tensor) -> Tensor:
        dims = list(range(1, weight.dim()))
        var, mean = torch.var_mean(weight, dim=dims, keepdim=True, unbiased=False)
        return (weight - mean) / torch.sqrt(var + 1e-10)


class TimmStdConv2d(nn.Conv2d):
    """timm's ``StdConv2d``: the weight standardized by ``F.batch_norm``, ``eps=1e-6``."""

    def forward(self, x: Tensor) -> Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None, training=True, eps=1e-6
        ).reshape_as(self.weight)
        return self._conv_forward(x, weight, self.bias)


def ws_net(conv: type[nn.Conv2d] = nn.Conv2d) -> nn.Sequential:
    return nn.Sequential(
        conv(2, 6, 3, padding=1),
        nn.GroupNorm(2, 6),
        nn.Tanh(),
        nn.ConvTranspose2d(6, 6, 3),
        nn.Tanh(),
        conv(6, 4, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def train_ws_side_by_side(theirs: nn.Module, ours: nn.Module) -> tuple[nn.Module, nn.Module]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, 6, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (theirs, ours)]
    for _ in range(STEPS):
        for net, optimizer in zip((theirs, ours), optimizers, strict=True):
            optimizer.zero_grad()
            F.mse_loss(net(x), y).backward()
            optimizer.step()
    return theirs, ours


def composer_ws_(model: nn.Module, n_last_layers_ignore: int = 0) -> None:
    convs = [m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    for conv in convs[: len(convs) - n_last_layers_ignore]:
        parametrize.register_parametrization(conv, "weight", ComposerStandardizer())


def raw_weight(layer: nn.Module) -> Tensor:
    if parametrize.is_parametrized(layer, "weight"):
        return layer.parametrizations.weight.original  # type: ignore[union-attr,return-value]
    return layer.weight  # type: ignore[return-value]


def assert_ws_alike(theirs: nn.Module, ours: nn.Module) -> None:
    """The trained raw weights and biases are the same."""
    for a, b in zip(theirs.children(), ours.children(), strict=True):
        if isinstance(a, (nn.Conv2d, nn.ConvTranspose2d)):
            torch.testing.assert_close(raw_weight(b), raw_weight(a), rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(b.bias, a.bias, rtol=1e-12, atol=1e-13)


def test_composer_weight_standardization() -> None:
    torch.manual_seed(0)
    theirs = ws_net().double()
    ours = copy.deepcopy(theirs)
    composer_ws_(theirs)  # composer: WeightStandardization()
    apply_weight_standardization(ours, eps=1e-10, layer_types=(nn.Conv1d, nn.Conv2d, nn.Conv3d))
    assert not parametrize.is_parametrized(ours[3])  # the ConvTranspose2d, as composer
    assert_ws_alike(*train_ws_side_by_side(theirs, ours))


def test_composer_weight_standardization_ignoring_the_last_layer() -> None:
    torch.manual_seed(0)
    theirs = ws_net().double()
    ours = copy.deepcopy(theirs)
    composer_ws_(theirs, n_last_layers_ignore=1)  # WeightStandardization(n_last_layers_ignore=1)
    convs = [m for m in ours.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    for conv in convs[:-1]:
        apply_weight_standardization(conv, eps=1e-10)
    assert not parametrize.is_parametrized(ours[5])
    assert_ws_alike(*train_ws_side_by_side(theirs, ours))


def test_default_layer_types_standardize_the_transposed_convolution_composer_skips() -> None:
    torch.manual_seed(0)
    theirs = ws_net().double()
    ours = copy.deepcopy(theirs)
    composer_ws_(theirs)
    apply_weight_standardization(ours, eps=1e-10)
    assert parametrize.is_parametrized(ours[3])
    theirs, ours = train_ws_side_by_side(theirs, ours)
    assert (raw_weight(theirs[3]) - raw_weight(ours[3])).abs().max() > 1e-3


def test_timm_std_conv2d() -> None:
    torch.manual_seed(0)
    theirs = ws_net(TimmStdConv2d).double()
    ours = ws_net().double()
    ours.load_state_dict(theirs.state_dict())
    # timm's StdConv2d(eps=1e-6) layers become plain Conv2d layers, standardized with its eps;
    # the model's ConvTranspose2d is a plain layer in timm, so it is left out here too.
    apply_weight_standardization(ours, eps=1e-6, layer_types=nn.Conv2d)
    assert not parametrize.is_parametrized(ours[3])
    assert_ws_alike(*train_ws_side_by_side(theirs, ours))


def test_a_composer_checkpoint_loads_into_the_normhooks_model() -> None:
    torch.manual_seed(0)
    theirs = ws_net().double()
    ours = copy.deepcopy(theirs)
    composer_ws_(theirs)
    apply_weight_standardization(ours, eps=1e-10, layer_types=(nn.Conv1d, nn.Conv2d, nn.Conv3d))
    theirs, _ = train_ws_side_by_side(theirs, copy.deepcopy(ours))
    state = theirs.state_dict()
    assert list(ours.state_dict()) == list(state)
    ours.load_state_dict(state)
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-13)
