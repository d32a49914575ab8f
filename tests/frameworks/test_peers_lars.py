"""The SSL LARS family against the normhooks calls that docs/migrating/ssl-lars.md gives.

torch-optimizer 0.3's ``LARS`` is the package itself. lightly, solo-learn and pl_bolts import
torchvision, and apex and torchlars need their compiled extensions, so their rules are written
out below from their sources, one step function each, and cited:

- lightly-ai/lightly ``lightly/utils/lars.py`` (``LARS``; the same code as
  Lightning-Universe/lightning-bolts ``src/pl_bolts/optimizers/lars.py``, whose single
  condition ``weight_decay != 0 and p_norm != 0 and g_norm != 0`` is lightly's two nested
  ones), and lightly's split ``get_weight_decay_parameters`` (``lightly/models/utils.py``);
- vturrisi/solo-learn ``solo/utils/lars.py`` (``LARS``, and ``LARSWrapper`` before the
  rewrite of June 2022, commit b5a2b056);
- NVIDIA/apex ``apex/parallel/LARC.py`` (``LARC``, removed from apex in 2025, commit
  cb65b8ed; vissl wraps its optimizers in it);
- kakaobrain/torchlars ``torchlars/lars.py`` and ``torchlars/adaptive_lr.cc`` (``LARS``);
- huggingface/pytorch-image-models ``timm/optim/lars.py`` (``Lars``), for the page's table of
  zero-gradient rules.

Each run is 25 steps in float64 of a small MLP and a small conv net, both with a residual
branch behind a zero-initialized BatchNorm gain (``zero_init_residual``: the layer before it
has an exactly zero gradient at the first step) and a zero-initialized head (a zero weight),
with weight decay, momentum and nesterov, and each peer's own split of biases and norm layers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch_optimizer
from torch import Tensor, nn

from normhooks import GradientLARS, lars_param_groups

STEPS = 25
# Large enough that every rule matters, small enough that no run diverges (where rounding
# differences would grow without bound).
LR = 0.05


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These tensors are tiny: one thread is faster than several contending for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the models ----------------------------------------------------------------------------


class Residual(nn.Module):
    """``x + bn(layer(x))`` with the BatchNorm gain at zero, as ``zero_init_residual=True``."""

    def __init__(self, layer: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.layer, self.norm = layer, norm
        nn.init.zeros_(norm.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.norm(self.layer(x))


def mlp() -> nn.Module:
    head = nn.Linear(16, 1)  # a (1, 16) weight: one dimension longer than 1
    nn.init.zeros_(head.weight)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        Residual(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16)),
        nn.LayerNorm(16),
        head,
    )


def convnet() -> nn.Module:
    head = nn.Linear(6, 1)
    nn.init.zeros_(head.weight)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.Tanh(),
        Residual(nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        head,
    )


MODELS = {"mlp": (mlp, (8,)), "convnet": (convnet, (2, 5, 5))}

# --- the peers' rules, by hand ------------------------------------------------------------


def sgd_part(state: dict[str, Tensor], p: Tensor, d_p: Tensor, group: dict[str, Any]) -> None:
    """The SGD part that lightly, pl_bolts, torch-optimizer and solo-learn's LARS share."""
    momentum, dampening = group["momentum"], group.get("dampening", 0.0)
    if momentum != 0:
        if "momentum_buffer" not in state:
            buf = state["momentum_buffer"] = d_p.clone()
        else:
            buf = state["momentum_buffer"]
            buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
        d_p = d_p.add(buf, alpha=momentum) if group["nesterov"] else buf
    p.add_(d_p, alpha=-group["lr"])


class FusedLARS:
    """lightly / pl_bolts / torch-optimizer (``solo=False``) and solo-learn (``solo=True``)
    ``LARS``: SGD with the rate fused in. lightly's family scales a tensor only where the
    group's ``weight_decay != 0``; solo-learn's only where ``p.ndim != 1`` or its
    ``exclude_bias_n_norm`` is off, and clips with ``clip_lr``. Both leave a tensor alone
    (no rate, no decay) where ``||w|| = 0`` or ``||g|| = 0``."""

    def __init__(self, groups: list[dict[str, Any]], solo: bool, **defaults: Any) -> None:
        self.groups = [defaults | group for group in groups]
        self.solo = solo
        self.state: dict[int, dict[str, Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                d_p = p.grad
                p_norm, g_norm = torch.norm(p), torch.norm(p.grad)
                # solo-learn: its exclusion; lightly's family: weight decay or no LARS.
                scaled = (p.ndim != 1 or not group["exclude_bias_n_norm"]) if self.solo else wd != 0
                if scaled and p_norm != 0 and g_norm != 0:
                    lars_lr = p_norm / (g_norm + p_norm * wd + group["eps"])
                    lars_lr *= group["trust_coefficient"]
                    if self.solo and group["clip_lr"]:
                        lars_lr = min(lars_lr / group["lr"], 1)
                    d_p = d_p.add(p, alpha=wd)
                    d_p *= lars_lr
                sgd_part(self.state.setdefault(id(p), {}), p, d_p, group)

    def zero_grad(self) -> None:
        for group in self.groups:
            for p in group["params"]:
                p.grad = None


class TimmLars(FusedLARS):
    """timm's ``Lars``: the rate where ``weight_decay != 0`` (or ``always_adapt``), 1 where
    ``||w|| = 0`` or ``||g|| = 0``, and the decay always added; then the same SGD part."""

    @torch.no_grad()
    def step(self) -> None:
        for group in self.groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                grad = p.grad
                if wd != 0:
                    w_norm, g_norm = p.norm(2.0), grad.norm(2.0)
                    ratio = group["trust_coefficient"] * w_norm / (g_norm + w_norm * wd + 1e-8)
                    ratio = torch.where(w_norm > 0, torch.where(g_norm > 0, ratio, 1.0), 1.0)
                    grad.add_(p, alpha=wd)
                    grad.mul_(ratio)
                sgd_part(self.state.setdefault(id(p), {}), p, grad, group)


class WrapperLARS:
    """apex ``LARC`` (``torchlars=False``, ``exclude_ndim1=False``), solo-learn's old
    ``LARSWrapper`` (``exclude_ndim1`` its ``exclude_bias_n_norm``) and torchlars' ``LARS``
    (``torchlars=True``) around any optimizer: each takes the groups' ``weight_decay`` out of
    the optimizer for its step and folds it into the rate. apex and solo-learn leave a tensor
    alone where ``||w|| = 0`` or ``||g|| = 0``; torchlars gives it rate 1 but still adds the
    decay, and multiplies the trust coefficient last."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        trust_coefficient: float,
        eps: float = 1e-8,
        clip: bool = False,
        exclude_ndim1: bool = False,
        torchlars: bool = False,
    ) -> None:
        self.optim = optimizer
        self.trust, self.eps, self.clip = trust_coefficient, eps, clip
        self.exclude_ndim1, self.torchlars = exclude_ndim1, torchlars

    @torch.no_grad()
    def step(self) -> None:
        decays = []
        for group in self.optim.param_groups:
            wd = group.get("weight_decay", 0)
            decays.append(wd)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None or (self.exclude_ndim1 and p.ndim == 1):
                    continue
                p_norm, g_norm = torch.norm(p), torch.norm(p.grad)
                if self.torchlars:
                    rate = torch.ones_like(p_norm)
                    if p_norm > 0 and g_norm > 0:
                        rate = p_norm / (g_norm + wd * p_norm + self.eps) * self.trust
                    p.grad.add_(p, alpha=wd)
                    p.grad.mul_(rate)
                elif p_norm != 0 and g_norm != 0:
                    rate = self.trust * p_norm / (g_norm + p_norm * wd + self.eps)
                    if self.clip:
                        rate = min(rate / group["lr"], 1)
                    p.grad += wd * p
                    p.grad *= rate
        self.optim.step()
        for group, wd in zip(self.optim.param_groups, decays, strict=True):
            group["weight_decay"] = wd

    def zero_grad(self) -> None:
        self.optim.zero_grad()


# --- the normhooks calls of the migration page ---------------------------------------------


def lightly_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """lightly's recipes: ``get_weight_decay_parameters`` puts norm layers and biases in a
    group with ``weight_decay=0.0``."""
    scaled, alone = lars_param_groups(model, by="module")
    return [
        {"params": scaled["params"], "weight_decay": weight_decay},
        {"params": alone["params"], "weight_decay": 0.0},
    ]


def decay_to_lars_(optimizer: torch.optim.Optimizer, *, no_decay_no_lars: bool) -> None:
    """The page's loop: each group's decay moves into the hook (``"lars_weight_decay"``);
    for lightly's family a group without decay leaves LARS."""
    for group in optimizer.param_groups:
        wd = group["weight_decay"]
        if no_decay_no_lars and wd == 0:
            group["lars"] = False
        else:
            group.update(weight_decay=0.0, lars_weight_decay=wd)


def solo_groups(model: nn.Module) -> list[dict[str, Any]]:
    return lars_param_groups(model, exclude=lambda name, p: p.ndim == 1)


OPTIONS = [
    pytest.param({"momentum": 0.9}, id="momentum"),
    pytest.param({"momentum": 0.9, "nesterov": True}, id="nesterov"),
]


def train_side_by_side(
    make_model: Callable[[], nn.Module],
    shape: tuple[int, ...],
    theirs: Callable[[nn.Module], Any],
    ours: Callable[[nn.Module], torch.optim.Optimizer],
) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    their_model = make_model().double()
    our_model = copy.deepcopy(their_model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, *shape, generator=generator, dtype=torch.float64)
    y = torch.randn(16, 1, generator=generator, dtype=torch.float64)
    their_optimizer, our_optimizer = theirs(their_model), ours(our_model)
    for _ in range(STEPS):
        for model, optimizer in ((their_model, their_optimizer), (our_model, our_optimizer)):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return their_model, our_model


def max_difference(theirs: nn.Module, ours: nn.Module) -> float:
    return max(
        (a - b).abs().max().item()
        for a, b in zip(theirs.parameters(), ours.parameters(), strict=True)
    )


def assert_trained_alike(theirs: nn.Module, ours: nn.Module) -> None:
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13, msg=name)


# Each peer: its call by hand, the normhooks call, by name (the page's rows).
def lightly(options: dict[str, Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    # lightly.utils.lars.LARS(groups, lr, momentum, weight_decay=1e-2, nesterov)
    def theirs(model: nn.Module) -> FusedLARS:
        groups = lightly_groups(model, 1e-2)
        defaults = {"lr": LR, "dampening": 0.0, "nesterov": False, "trust_coefficient": 1e-3}
        return FusedLARS(groups, solo=False, **defaults | {"eps": 1e-8} | options)

    def ours(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(lightly_groups(model, 1e-2), lr=LR, **options)
        decay_to_lars_(optimizer, no_decay_no_lars=True)
        GradientLARS(threshold=0.0, eps=1e-8, trust_coefficient=1e-3, zero_grad_mode="skip").attach(
            optimizer
        )
        return optimizer

    return theirs, ours


def solo_learn(
    options: dict[str, Any], clip: bool, weight_decay: float = 1e-2
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    # solo.utils.lars.LARS(model.parameters(), lr, momentum, weight_decay, eta=0.02,
    #                      clip_lr=clip, exclude_bias_n_norm=True)
    def theirs(model: nn.Module) -> FusedLARS:
        settings = {"lr": LR, "weight_decay": weight_decay, "nesterov": False, "eps": 1e-8}
        settings |= {"trust_coefficient": 0.02, "clip_lr": clip, "exclude_bias_n_norm": True}
        return FusedLARS([{"params": list(model.parameters())}], solo=True, **settings | options)

    def ours(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(solo_groups(model), lr=LR, **options)
        GradientLARS(
            threshold=0.0,
            weight_decay=weight_decay,
            eps=1e-8,
            trust_coefficient=0.02,
            clip=clip,
            zero_grad_mode="skip",
        ).attach(optimizer)
        return optimizer

    return theirs, ours


def wrapped(
    options: dict[str, Any], inner: str, peer: str
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """apex ``LARC(optimizer, trust_coefficient=0.02, clip=True)`` (its defaults), solo-learn's
    ``LARSWrapper(optimizer, eta=0.02, exclude_bias_n_norm=True)`` and torchlars'
    ``LARS(optimizer, trust_coef=1e-3)``, around SGD or Adam with lightly's split."""
    trust = 1e-3 if peer == "torchlars" else 0.02
    clip = peer == "apex"

    def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        groups = lightly_groups(model, 1e-2) if peer != "solo-learn" else solo_groups(model)
        for group in groups:
            group.setdefault("weight_decay", 1e-2)
        if inner == "adam":
            return torch.optim.Adam(groups, lr=1e-2)
        return torch.optim.SGD(groups, lr=LR, **options)

    def theirs(model: nn.Module) -> WrapperLARS:
        return WrapperLARS(
            inner_optimizer(model),
            trust_coefficient=trust,
            clip=clip,
            exclude_ndim1=peer == "solo-learn",
            torchlars=peer == "torchlars",
        )

    def ours(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = inner_optimizer(model)
        decay_to_lars_(optimizer, no_decay_no_lars=False)
        GradientLARS(
            threshold=0.0,
            eps=1e-8,
            trust_coefficient=trust,
            clip=clip,
            zero_grad_mode="decay" if peer == "torchlars" else "skip",
        ).attach(optimizer)
        return optimizer

    return theirs, ours


# --- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("options", OPTIONS)
def test_lightly_and_pl_bolts(model: str, options: dict[str, Any]) -> None:
    assert_trained_alike(*train_side_by_side(*MODELS[model], *lightly(options)))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("clip", [False, True], ids=["scale", "clip"])
def test_solo_learn(model: str, options: dict[str, Any], clip: bool) -> None:
    assert_trained_alike(*train_side_by_side(*MODELS[model], *solo_learn(options, clip)))


def test_solo_learn_still_scales_without_weight_decay() -> None:
    # Unlike lightly's family: weight_decay=0 keeps the rate (and the hook's decay is 0).
    assert_trained_alike(
        *train_side_by_side(*MODELS["mlp"], *solo_learn({"momentum": 0.9}, False, 0.0))
    )


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("peer", ["apex", "solo-learn", "torchlars"])
def test_wrappers(model: str, inner: str, peer: str) -> None:
    options = {"momentum": 0.9, "nesterov": True}
    assert_trained_alike(*train_side_by_side(*MODELS[model], *wrapped(options, inner, peer)))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("options", OPTIONS)
def test_torch_optimizer(model: str, options: dict[str, Any]) -> None:
    # torch_optimizer.LARS(groups, lr, momentum, weight_decay, nesterov): its defaults,
    # trust_coefficient=0.01 and eps=1e-8.
    def theirs(net: nn.Module) -> torch.optim.Optimizer:
        return torch_optimizer.LARS(lightly_groups(net, 1e-2), lr=LR, **options)

    def ours(net: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(lightly_groups(net, 1e-2), lr=LR, **options)
        decay_to_lars_(optimizer, no_decay_no_lars=True)
        GradientLARS(threshold=0.0, eps=1e-8, trust_coefficient=0.01, zero_grad_mode="skip").attach(
            optimizer
        )
        return optimizer

    assert_trained_alike(*train_side_by_side(*MODELS[model], theirs, ours))


@pytest.mark.parametrize("mode", ["scale", "decay"])
def test_the_zero_gradient_rule_is_what_makes_them_agree(mode: str) -> None:
    """Without "skip" the same call drifts from lightly's rule: the residual layer's zero
    gradient at step 1 gets decayed (the counterpart that lets the tests above fail)."""
    theirs, _ = lightly(OPTIONS[0].values[0])

    def ours(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(lightly_groups(model, 1e-2), lr=LR, momentum=0.9)
        decay_to_lars_(optimizer, no_decay_no_lars=True)
        GradientLARS(
            threshold=0.0,
            eps=1e-8,
            trust_coefficient=1e-3,
            zero_grad_mode=mode,  # type: ignore[arg-type]
        ).attach(optimizer)
        return optimizer

    assert max_difference(*train_side_by_side(*MODELS["mlp"], theirs, ours)) > 1e-6


def test_lars_param_groups_by_shape_leaves_out_the_head_lightly_scales() -> None:
    """The default split leaves the (1, 16) head to plain SGD where lightly scales it."""
    theirs, _ = lightly(OPTIONS[0].values[0])

    def ours(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(lars_param_groups(model), lr=LR, momentum=0.9)
        GradientLARS(
            threshold=0.0,
            weight_decay=1e-2,
            eps=1e-8,
            trust_coefficient=1e-3,
            zero_grad_mode="skip",
        ).attach(optimizer)
        return optimizer

    assert max_difference(*train_side_by_side(*MODELS["mlp"], theirs, ours)) > 1e-3


@pytest.mark.parametrize("model", MODELS)
def test_timm_lars_takes_the_decay_mode(model: str) -> None:
    # timm.optim.Lars(groups, lr, momentum=0.9, weight_decay, trust_coeff=1e-3)
    def theirs(net: nn.Module) -> TimmLars:
        settings = {"lr": LR, "momentum": 0.9, "nesterov": False, "trust_coefficient": 1e-3}
        return TimmLars(lightly_groups(net, 1e-2), solo=False, **settings)

    def ours(net: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(lightly_groups(net, 1e-2), lr=LR, momentum=0.9)
        decay_to_lars_(optimizer, no_decay_no_lars=True)
        GradientLARS(
            threshold=0.0, eps=1e-8, trust_coefficient=1e-3, zero_grad_mode="decay"
        ).attach(optimizer)
        return optimizer

    assert_trained_alike(*train_side_by_side(*MODELS[model], theirs, ours))
