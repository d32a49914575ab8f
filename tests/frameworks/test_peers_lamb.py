"""Every LAMB on docs/migrating/lamb.md against the normhooks call the page gives for it.

Each peer and its mapping train copies of one model side by side for many steps in float64,
and the weights must agree to float rounding at every step. The models include what trips
LAMBs up: zero-initialized tensors (biases, attention biases, LayerNorm betas and a zero last
layer, whose ratio falls back to 1) and gradients that are exactly zero (the whole network
behind the zero last layer at step 1, and input features that are always zero).

torch-optimizer's ``Lamb``, pytorch-lamb's ``Lamb`` and pytorch-optimizer's ``Lamb`` are the
installed packages. timm's ``Lamb``, apex's ``FusedLAMB`` and DeepSpeed's ``FusedLamb`` do
not import here (timm is not installed, the other two need CUDA): :class:`LambByHand` is
their rule written out from their sources, cited there.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import pytorch_lamb
import pytorch_optimizer
import torch
import torch_optimizer
from torch import Tensor, nn
from torch.nn import functional as F

from normhooks import TrustRatio

BETAS = (0.9, 0.999)
STEPS = 30
LR = 1e-2
DECAY = 1e-2


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """These models are tiny: intra-op threads only contend (30x slower on a loaded CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the models ---------------------------------------------------------------------------


def mlp(zero_last: bool = True) -> nn.Module:
    """An MLP with a zero first bias and (``zero_last``) a zero last weight.

    The zero last weight makes every earlier gradient exactly zero at step 1.
    """
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    ).double()
    nn.init.zeros_(net[0].bias)
    if zero_last:
        nn.init.zeros_(net[4].weight)
    return net


class Block(nn.Module):
    """A pre-norm transformer layer, a LayerNorm and a head: zero attention biases and betas."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.layer(x)).mean(dim=1))


def block() -> nn.Module:
    torch.manual_seed(0)
    return Block().double()


MODELS = {"mlp": mlp, "block": block}


def batch(name: str) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (32, 8) if name == "mlp" else (16, 5, 8)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    x[..., -2:] = 0  # features that are always zero: their weights' gradients are zero
    return x, torch.randn(shape[0], 4, generator=generator, dtype=torch.float64)


def groups(net: nn.Module, decay: float = DECAY) -> list[dict[str, Any]]:
    """BERT's split: weight decay on matrices, none on biases and LayerNorm weights."""
    matrices = [p for p in net.parameters() if p.ndim >= 2]
    others = [p for p in net.parameters() if p.ndim < 2]
    return [{"params": matrices, "weight_decay": decay}, {"params": others, "weight_decay": 0.0}]


# --- training side by side ----------------------------------------------------------------

Setup = tuple[torch.optim.Optimizer, Callable[[int], None] | None]


def largest_difference(
    model: str,
    theirs: Callable[[nn.Module], Setup],
    ours: Callable[[nn.Module], Setup],
    steps: int = STEPS,
    make: Callable[[], nn.Module] | None = None,
) -> float:
    """Trains two copies, one with each optimizer; the largest difference of any weight at
    any step. A setup's callback runs before step ``t`` (1-based)."""
    their_net = (make or MODELS[model])()
    our_net = copy.deepcopy(their_net)
    x, y = batch(model)
    sides = [(their_net, *theirs(their_net)), (our_net, *ours(our_net))]
    largest = 0.0
    for t in range(1, steps + 1):
        for net, optimizer, before_step in sides:
            optimizer.zero_grad()
            F.mse_loss(net(x), y).backward()
            if before_step is not None:
                before_step(t)
            optimizer.step()
        pairs = zip(their_net.parameters(), our_net.parameters(), strict=True)
        step_largest = max((a - b).abs().max().item() for a, b in pairs)
        # NaN compares false: without this, a NaN on both sides would pass for agreement.
        largest = max(largest, step_largest if math.isfinite(step_largest) else math.inf)
    return largest


# Float64 rounding, grown over the run by the models' own sensitivity.
ROUNDING = 1e-12


def hooked(optimizer: torch.optim.Optimizer, **settings: Any) -> torch.optim.Optimizer:
    TrustRatio(**settings).attach(optimizer)
    return optimizer


def uncorrected_eps(optimizer: torch.optim.Optimizer, eps: float) -> Callable[[int], None]:
    """Before step t, AdamW's eps at ``eps / sqrt(1 - beta2**t)``: torch adds its eps to the
    corrected ``sqrt(v / (1 - beta2**t))``, a LAMB without correction adds ``eps`` to
    ``sqrt(v)``; this makes the two denominators the same up to that factor."""

    def before_step(t: int) -> None:
        for group in optimizer.param_groups:
            group["eps"] = eps / math.sqrt(1 - group["betas"][1] ** t)

    return before_step


def step_size_schedule(optimizer: torch.optim.Optimizer, factor: Callable[[int], float]) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: factor(s + 1))


def corrected(t: int) -> float:
    """``sqrt(1 - beta2**t) / (1 - beta1**t)``: the step-size correction of torch-optimizer's
    ``debias=True`` and DeepSpeed's ``bias_correction=True``."""
    return math.sqrt(1 - BETAS[1] ** t) / (1 - BETAS[0] ** t)


def with_schedule(
    optimizer: torch.optim.Optimizer,
    factor: Callable[[int], float],
    before: Callable[[int], None] | None = None,
) -> Setup:
    scheduler = step_size_schedule(optimizer, factor)
    stepped = [0]

    def before_step(t: int) -> None:
        # LambdaLR set the lr for step 1 when built; advance it once per later step.
        while stepped[0] < t - 1:
            scheduler.step()
            stepped[0] += 1
        if before is not None:
            before(t)

    return optimizer, before_step


def global_clip(optimizer: torch.optim.Optimizer, max_norm: float) -> Callable[[int], None]:
    """timm's and apex's clipping: every gradient divided by ``max(||g|| / max_norm, 1)``,
    ``||g||`` the norm of all of them together (torch's ``clip_grad_norm_`` multiplies by
    ``max_norm / (||g|| + 1e-6)`` instead)."""

    def before_step(t: int) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        present = [g for g in grads if g is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))
        scale = torch.clamp(norm / max_norm, min=1.0)
        for g in present:
            g.div_(scale)

    return before_step


# --- timm, apex and DeepSpeed, written out --------------------------------------------------


class LambByHand(torch.optim.Optimizer):
    """LAMB as timm, apex and DeepSpeed compute it, from their sources, in float64.

    - huggingface/pytorch-image-models ``timm/optim/lamb.py`` (``Lamb``): moments
      ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` of the globally clipped gradient
      (``g / max(||g|| / max_grad_norm, 1)``); with ``bias_correction`` the update is
      ``(m / bc1) / (sqrt(v) / sqrt(bc2) + eps)``, else ``m / (sqrt(v) + eps)``; plus
      ``wd * w``; ratio ``||w|| / ||u||`` (1 where either is 0), only where ``wd != 0`` unless
      ``always_adapt``, capped at 1 by ``trust_clip``; ``w -= lr * r * u``.
    - NVIDIA/apex ``apex/optimizers/fused_lamb.py`` with ``csrc/multi_tensor_lamb.cu``
      (``FusedLAMB``): the same (``use_nvlamb`` for ``always_adapt``), and
      ``adam_w_mode=False`` adds ``wd * w`` to the clipped gradient before the moments.
    - microsoft/DeepSpeed ``deepspeed/ops/lamb/fused_lamb.py`` with
      ``csrc/lamb/fused_lamb_cuda_kernel.cu`` (``FusedLamb``): moments never corrected,
      ``u = m / (sqrt(v) + eps) + wd * w``, ratio ``||w|| / ||u||`` clamped to
      ``[min_coeff, max_coeff]`` where both are nonzero (else 1), and with
      ``bias_correction`` the step size ``lr * sqrt(bc2) / bc1``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        *,
        weight_decay: float,
        eps: float,
        corrected_moments: bool = True,
        corrected_step: bool = False,
        decay_in_moments: bool = False,
        always_adapt: bool = False,
        bounds: tuple[float | None, float | None] = (None, None),
        max_grad_norm: float | None = None,
    ) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "eps": eps}
        super().__init__(params, defaults)
        self.corrected_moments, self.corrected_step = corrected_moments, corrected_step
        self.decay_in_moments, self.always_adapt = decay_in_moments, always_adapt
        self.bounds, self.max_grad_norm = bounds, max_grad_norm

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        b1, b2 = BETAS
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        scale = torch.ones((), dtype=torch.float64)
        if self.max_grad_norm is not None:
            norm = torch.stack([p.grad.norm() for p in params]).norm()  # type: ignore[union-attr]
            scale = torch.clamp(norm / self.max_grad_norm, min=1.0)
        for group in self.param_groups:
            wd, eps = group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                t, m, v = state["t"], state["m"], state["v"]
                g = p.grad / scale
                if self.decay_in_moments:
                    g = g + wd * p
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                if self.corrected_moments:
                    u = (m / (1 - b1**t)) / (v.sqrt() / math.sqrt(1 - b2**t) + eps)
                else:
                    u = m / (v.sqrt() + eps)
                if not self.decay_in_moments:
                    u = u + wd * p
                ratio = torch.ones((), dtype=torch.float64)
                w_norm, u_norm = p.norm(), u.norm()
                if (wd != 0 or self.always_adapt) and w_norm > 0 and u_norm > 0:
                    ratio = w_norm / u_norm
                    low, high = self.bounds
                    if low is not None or high is not None:
                        ratio = torch.clamp(ratio, min=low, max=high)
                size = group["lr"] * (
                    math.sqrt(1 - b2**t) / (1 - b1**t) if self.corrected_step else 1.0
                )
                p.sub_(size * ratio * u)


def adamw_hooked(net: nn.Module, adam_eps: float, opt_out: bool = True, **settings: Any) -> Any:
    """AdamW on the BERT split with TrustRatio; ``opt_out``: no ratio on undecayed groups
    (without bias correction, they still take the uncorrected step: a threshold of inf)."""
    param_groups = groups(net)
    if opt_out and settings.get("bias_correction", True):
        param_groups[1]["trust"] = False
    elif opt_out:
        param_groups[1]["trust_threshold"] = math.inf
    return hooked(torch.optim.AdamW(param_groups, lr=LR, betas=BETAS, eps=adam_eps), **settings)


# timm Lamb / apex FusedLAMB, bias-corrected (their defaults) -------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_timm_and_apex_defaults_are_adamw_with_trust_ratio(model: str) -> None:
    difference = largest_difference(
        model,
        lambda net: (LambByHand(groups(net), LR, weight_decay=DECAY, eps=1e-6), None),
        lambda net: (adamw_hooked(net, adam_eps=1e-6), None),
    )
    assert difference < ROUNDING


@pytest.mark.parametrize("model", list(MODELS))
def test_timm_and_apex_gradient_clipping_is_a_division_before_the_step(model: str) -> None:
    def ours(net: nn.Module) -> Setup:
        optimizer = adamw_hooked(net, adam_eps=1e-6)
        return optimizer, global_clip(optimizer, 0.1)

    theirs = lambda net: (  # noqa: E731
        LambByHand(groups(net), LR, weight_decay=DECAY, eps=1e-6, max_grad_norm=0.1),
        None,
    )
    assert largest_difference(model, theirs, ours) < ROUNDING


@pytest.mark.parametrize(
    ("options", "settings"),
    [
        pytest.param({"always_adapt": True}, {"opt_out": False}, id="always-adapt"),
        pytest.param({"bounds": (None, 1.0)}, {"clip": 1.0}, id="trust-clip"),
    ],
)
def test_timm_options(options: dict[str, Any], settings: dict[str, Any]) -> None:
    difference = largest_difference(
        "block",
        lambda net: (LambByHand(groups(net), LR, weight_decay=DECAY, eps=1e-6, **options), None),
        lambda net: (adamw_hooked(net, adam_eps=1e-6, **settings), None),
    )
    assert difference < ROUNDING


def test_apex_adam_mode_is_adam_with_l2_decay() -> None:
    def ours(net: nn.Module) -> Setup:
        param_groups = groups(net)
        param_groups[1]["trust"] = False
        return hooked(torch.optim.Adam(param_groups, lr=LR, betas=BETAS, eps=1e-6)), None

    theirs = lambda net: (  # noqa: E731
        LambByHand(groups(net), LR, weight_decay=DECAY, eps=1e-6, decay_in_moments=True),
        None,
    )
    assert largest_difference("block", theirs, ours) < ROUNDING


@pytest.mark.parametrize("model", list(MODELS))
def test_timm_and_apex_without_bias_correction(model: str) -> None:
    def ours(net: nn.Module) -> Setup:
        optimizer = adamw_hooked(net, adam_eps=1e-6, bias_correction=False)
        return optimizer, uncorrected_eps(optimizer, 1e-6)

    theirs = lambda net: (  # noqa: E731
        LambByHand(groups(net), LR, weight_decay=DECAY, eps=1e-6, corrected_moments=False),
        None,
    )
    assert largest_difference(model, theirs, ours) < ROUNDING


# DeepSpeed FusedLamb -----------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("bias_correction", [True, False], ids=["corrected-step", "plain"])
def test_deepspeed_lamb(model: str, bias_correction: bool) -> None:
    def ours(net: nn.Module) -> Setup:
        optimizer = adamw_hooked(
            net, adam_eps=1e-8, opt_out=False, bias_correction=False, clip=10.0, floor=0.01
        )
        eps = uncorrected_eps(optimizer, 1e-8)
        return with_schedule(optimizer, corrected if bias_correction else lambda t: 1.0, eps)

    theirs = lambda net: (  # noqa: E731
        LambByHand(
            groups(net),
            LR,
            weight_decay=DECAY,
            eps=1e-8,
            corrected_moments=False,
            corrected_step=bias_correction,
            always_adapt=True,
            bounds=(0.01, 10.0),
        ),
        None,
    )
    assert largest_difference(model, theirs, ours) < ROUNDING


# torch-optimizer (jettify) Lamb ------------------------------------------------------------


def torch_optimizer_mapping(
    net: nn.Module, eps: float, clamp_value: float, debias: bool, **settings: Any
) -> Setup:
    optimizer = adamw_hooked(
        net,
        adam_eps=eps,
        opt_out=False,
        bias_correction=False,
        max_weight_norm=clamp_value,
        **settings,
    )
    return with_schedule(
        optimizer, corrected if debias else lambda t: 1.0, uncorrected_eps(optimizer, eps)
    )


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("debias", [False, True], ids=["plain", "debias"])
def test_torch_optimizer_lamb(model: str, debias: bool) -> None:
    difference = largest_difference(
        model,
        lambda net: (
            torch_optimizer.Lamb(groups(net), lr=LR, betas=BETAS, eps=1e-6, debias=debias),
            None,
        ),
        lambda net: torch_optimizer_mapping(net, 1e-6, 10.0, debias),
    )
    assert difference < ROUNDING


def test_torch_optimizer_clamp_value_caps_the_weight_norm() -> None:
    # A clamp of 1 binds on every matrix of the block (their norms are 2 to 4).
    difference = largest_difference(
        "block",
        lambda net: (torch_optimizer.Lamb(groups(net), lr=LR, eps=1e-6, clamp_value=1.0), None),
        lambda net: torch_optimizer_mapping(net, 1e-6, 1.0, debias=False),
    )
    assert difference < ROUNDING


def test_torch_optimizer_adam_mode_is_adam_without_correction() -> None:
    # adam=True forces the ratio to 1: so does an infinite threshold.
    difference = largest_difference(
        "block",
        lambda net: (torch_optimizer.Lamb(groups(net), lr=LR, eps=1e-6, adam=True), None),
        lambda net: torch_optimizer_mapping(net, 1e-6, 10.0, debias=False, threshold=math.inf),
    )
    assert difference < ROUNDING


# pytorch-lamb (cybertronai) Lamb ------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:This overload of add_ is deprecated")
def test_pytorch_lamb_never_moves_a_zero_weight() -> None:
    # Its ratio is ||w|| / ||u|| unguarded: 0 for a tensor that starts at zero, forever (and
    # NaN where the update is zero, which this model avoids: decay on every group, nonzero
    # gradients). Leaving such tensors out of the optimizer reproduces it.
    def make() -> nn.Module:
        return mlp(zero_last=False)

    def ours(net: nn.Module) -> Setup:
        moving = [p for p in net.parameters() if p.count_nonzero() > 0]
        optimizer = torch.optim.AdamW(moving, lr=LR, betas=BETAS, eps=1e-6, weight_decay=DECAY)
        hooked(optimizer, bias_correction=False, max_weight_norm=10.0)
        return optimizer, uncorrected_eps(optimizer, 1e-6)

    difference = largest_difference(
        "mlp",
        lambda net: (pytorch_lamb.Lamb(net.parameters(), lr=LR, weight_decay=DECAY), None),
        ours,
        make=make,
    )
    assert difference < ROUNDING


# pytorch-optimizer (kozistr) Lamb ------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("adam_debias", [False, True], ids=["default", "adam-debias"])
def test_pytorch_optimizer_lamb_with_coupled_decay(model: str, adam_debias: bool) -> None:
    # weight_decouple=False: the decay is added to the update, as in the paper. Its eps is
    # also added to the update's norm in the ratio: TrustRatio's eps.
    def theirs(net: nn.Module) -> Setup:
        optimizer = pytorch_optimizer.Lamb(
            groups(net), lr=LR, betas=BETAS, weight_decouple=False, adam_debias=adam_debias
        )
        return optimizer, None

    def ours(net: nn.Module) -> Setup:
        optimizer = adamw_hooked(
            net, adam_eps=1e-6, opt_out=False, bias_correction=False, max_weight_norm=10.0, eps=1e-6
        )
        first_moment = (lambda t: 1.0) if adam_debias else (lambda t: 1 / (1 - BETAS[0] ** t))
        return with_schedule(optimizer, first_moment, uncorrected_eps(optimizer, 1e-6))

    assert largest_difference(model, theirs, ours) < ROUNDING
