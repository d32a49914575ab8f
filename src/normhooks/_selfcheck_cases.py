"""What ``normhooks check`` runs on each line: the cases, their models and optimizers, sizes.

Each case builds the same setup twice from the same numbers, runs two steps with the kernels on
and off (:mod:`normhooks._selfcheck` compares them), and gives a step of normhooks' path and one
of its peer to time.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

import normhooks


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    channels: int
    spatial: int
    lars_shapes: tuple[tuple[int, ...], ...]
    repeats: int
    inner: int
    warmup: int


# A few layers of a ResNet for LARS.
LARS_SHAPES = ((64, 3, 7, 7), (64,), *[(128, 64, 3, 3)] * 4, (256, 128, 3, 3), (1000, 512))
CUDA_SIZES = Sizes(16, 32, 32, LARS_SHAPES, repeats=5, inner=20, warmup=1)
ROUTED_SIZES = Sizes(2, 2, 4, ((4, 2, 3, 3), (4,), (3, 8)), 1, 1, 0)


class _ManualStandardization(nn.Module):
    """The peer of WS: ``(w - mean) / sqrt(var + eps)`` per output channel, written out as
    models without normhooks do (Scaled WS: times a gain and ``gamma / sqrt(fan_in)``)."""

    def __init__(self, weight: Tensor, dim: int, scaled: bool, gamma: float = 1.7) -> None:
        super().__init__()
        self.dim, self.gamma = dim, gamma
        rows = weight.shape[dim]
        self.gain = nn.Parameter(weight.new_ones(rows, 1)) if scaled else None

    def forward(self, weight: Tensor) -> Tensor:
        moved = weight.transpose(0, self.dim)
        rows = moved.reshape(moved.shape[0], -1)
        mean = rows.mean(1, keepdim=True)
        var = rows.var(1, unbiased=False, keepdim=True)
        out = (rows - mean) / torch.sqrt(var + 1e-5)
        if self.gain is not None:
            out = out * self.gain * (self.gamma / math.sqrt(rows.shape[1]))
        return out.reshape(moved.shape).transpose(0, self.dim)


class _SideBySide(nn.Module):
    """Layers of each kind on the same input, outputs concatenated: one fused scope, and no
    layer's input depends on another layer's weight, so a difference of a unit in the last
    place in one weight cannot grow through the layers after it."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        c = s.channels
        self.conv = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.strided = nn.Conv2d(c, 3 * c, 3, stride=2, padding=1)
        self.transposed = nn.ConvTranspose2d(c, c, 2, stride=2)  # WS along dim=1
        self.linear = nn.Linear(c * s.spatial**2, 2 * c)  # long rows

    def forward(self, x: Tensor) -> Tensor:
        convolutions = (self.conv(x), self.strided(x), self.transposed(x))
        return torch.cat([*(y.flatten(1) for y in convolutions), self.linear(x.flatten(1))], 1)


class Case(NamedTuple):
    name: str
    technique: str  # "wn", "ws", "scaled ws", "lars", "agc", "gc" or "trust"
    fused: bool = False
    # LARS: one param group per zero_grad_mode (each compiles its own kernel variant).
    zero_grad_modes: tuple[str, ...] = ("scale",)
    # False where the technique refuses float16/bfloat16 parameters (TrustRatio: the optimizer
    # rounds its update to the parameter's dtype before the hook can read it).
    halves: bool = True

    @property
    def peer(self) -> str:
        peers = {"wn": "torch weight_norm", "lars": "SGD alone", "agc": "SGD alone"}
        peers |= {"gc": "SGD alone", "trust": "AdamW alone"}
        return peers.get(self.technique, WS_PEER)

    def ours(self, model: nn.Module) -> nn.Module:
        if self.technique == "wn":
            return (normhooks.apply_weight_norm if self.fused else normhooks.weight_norm)(model)
        scaled = self.technique == "scaled ws"
        gamma = 1.7 if scaled else 1.0
        if self.fused:
            return normhooks.apply_weight_standardization(model, scaled=scaled, gamma=gamma)
        return normhooks.weight_standardization(model, scaled=scaled, gamma=gamma)

    def theirs(self, model: nn.Module) -> nn.Module:
        for layer in list(model.modules()):
            if self.technique == "wn" and isinstance(layer, (*_CONVOLUTIONS, nn.Linear)):
                nn.utils.parametrizations.weight_norm(layer)
            elif self.technique != "wn" and isinstance(layer, _CONVOLUTIONS):
                dim = 1 if isinstance(layer, nn.ConvTranspose2d) else 0
                peer = _ManualStandardization(layer.weight, dim, self.technique == "scaled ws")
                nn.utils.parametrize.register_parametrization(layer, "weight", peer)
        return model


_CONVOLUTIONS = (nn.Conv2d, nn.ConvTranspose2d)
WS_PEER = "(w-mean)/sqrt(var+eps)"
CASES = (
    Case("weight_norm", "wn"),
    Case("apply_weight_norm", "wn", fused=True),
    Case("weight_standardization", "ws"),
    Case("apply_weight_std.", "ws", fused=True),
    Case("scaled weight_std.", "scaled ws"),
    Case("apply_weight_std. scaled", "scaled ws", fused=True),
    Case("GradientLARS step", "lars"),
    Case("GradientLARS decay, skip", "lars", zero_grad_modes=("decay", "skip")),
    Case("AdaptiveGradientClipping", "agc"),
    Case("GradientCentralization", "gc"),
    Case("TrustRatio", "trust", halves=False),
)


def _random(shape: Sequence[int], seed: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    # A CPU generator: the same numbers on every device and for every dtype.
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator).to(device, dtype)


def _perturb_(params: Iterator[nn.Parameter], seed: int, scale: float, relative: bool) -> None:
    with torch.no_grad():
        for i, p in enumerate(params):
            noise = scale * _random(p.shape, seed + i, p.dtype, p.device)
            if relative:
                p.mul_(1 + noise)
            elif i % 2:
                p.add_(noise)
            else:
                # New storage, no new version: as EMA and momentum-encoder updates write.
                p.data = p.data + noise


class Layers:
    """A parametrization case: the converted model, its peer, an input and an upstream
    gradient; :meth:`steps` runs a copy, so the kernel and the formula start alike."""

    def __init__(self, case: Case, s: Sizes, dtype: torch.dtype, device: torch.device) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            c = s.channels
            base = _SideBySide(s) if case.fused else nn.Conv2d(c, 2 * c, 3, padding=1)
            base = base.to(device, dtype)
        self.ours = case.ours(copy.deepcopy(base))
        self.theirs = case.theirs(base)
        # Away from the initial values (a gain of 1, WN's unit rows), so each input counts.
        _perturb_(self.ours.parameters(), 0, 0.2, relative=True)
        self.x = _random((s.batch, s.channels, s.spatial, s.spatial), 100, dtype, device)
        with torch.no_grad():
            shape = self.theirs(self.x).shape
        self.upstream = _random(shape, 101, dtype, device)

    def steps(self) -> dict[str, Tensor]:
        """Two forwards and backwards of a copy, every parameter moved between them."""
        model = copy.deepcopy(self.ours)
        found: dict[str, Tensor] = {}
        for step in (1, 2):
            model.zero_grad(set_to_none=True)
            out = model(self.x)
            out.backward(self.upstream)
            found[f"step {step} output"] = out.detach()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    found[f"step {step} grad of {name}"] = p.grad.detach().clone()
            _perturb_(model.parameters(), 200, 0.05, relative=False)
        return found

    def timed(self) -> tuple[Callable[[], None], Callable[[], None]]:
        def step(model: nn.Module) -> Callable[[], None]:
            def one() -> None:
                model.zero_grad(set_to_none=True)
                model(self.x).backward(self.upstream)

            return one

        return step(self.ours), step(self.theirs)


class _LARS:
    """The LARS case: SGD with momentum over a few parameter shapes, with and without it, one
    param group per zero-gradient rule. The second tensor's gradient is exactly zero (a layer
    behind a zero-initialized gain), where the rules differ."""

    def __init__(self, case: Case, s: Sizes, dtype: torch.dtype, device: torch.device) -> None:
        self.modes = case.zero_grad_modes
        self.params = [_random(shape, i, dtype, device) for i, shape in enumerate(s.lars_shapes)]
        self.grads = [0.01 * _random(p.shape, 50 + i, dtype, device)
                      for i, p in enumerate(self.params)]  # fmt: skip
        self.grads[1].zero_()

    def _optimizer(self, hooked: bool) -> tuple[torch.optim.SGD, normhooks.GradientLARS]:
        groups = [
            {"params": [nn.Parameter(p.clone()) for p in self.params], "lars_zero_grad_mode": mode}
            for mode in self.modes
        ]
        optimizer = torch.optim.SGD(groups, lr=1e-3, momentum=0.9)
        hook = normhooks.GradientLARS(weight_decay=1e-4)
        if hooked:
            hook.attach(optimizer)
        return optimizer, hook

    def _step(self, optimizer: torch.optim.SGD) -> None:
        for group in optimizer.param_groups:
            for p, g in zip(group["params"], self.grads, strict=True):
                p.grad = g.clone()
        optimizer.step()

    def steps(self) -> dict[str, Tensor]:
        """Two steps of a fresh optimizer: the rates and the gradients LARS wrote."""
        optimizer, hook = self._optimizer(hooked=True)
        found: dict[str, Tensor] = {}
        for step in (1, 2):
            self._step(optimizer)
            for mode, group, rates in zip(
                self.modes, optimizer.param_groups, hook.last_rates, strict=True
            ):
                name = "" if len(self.modes) == 1 else f" ({mode})"
                found[f"step {step} rates{name}"] = rates.detach().clone()
                for i, p in enumerate(group["params"]):
                    found[f"step {step} LARS gradient {i}{name}"] = p.grad.detach().clone()
        return found

    def timed(self) -> tuple[Callable[[], None], Callable[[], None]]:
        ours, _ = self._optimizer(hooked=True)
        theirs, _ = self._optimizer(hooked=False)
        return (lambda: self._step(ours)), (lambda: self._step(theirs))


class _AGC:
    """The AGC case: SGD with momentum over LARS's shapes, with and without it. The second
    tensor's gradient is exactly zero and the first tensor's first row of weights too (a unit
    at the eps floor)."""

    def __init__(self, case: Case, s: Sizes, dtype: torch.dtype, device: torch.device) -> None:
        self.lars = _LARS(case, s, dtype, device)
        self.lars.params[0][0].zero_()

    def _optimizer(
        self, hooked: bool
    ) -> tuple[torch.optim.SGD, normhooks.AdaptiveGradientClipping]:
        params = [nn.Parameter(p.clone()) for p in self.lars.params]
        optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        hook = normhooks.AdaptiveGradientClipping(clipping=0.01)
        if hooked:
            hook.attach(optimizer)
        return optimizer, hook

    def steps(self) -> dict[str, Tensor]:
        """Two steps of a fresh optimizer: the ratios and the gradients AGC wrote."""
        optimizer, hook = self._optimizer(hooked=True)
        found: dict[str, Tensor] = {}
        for step in (1, 2):
            self.lars._step(optimizer)
            found[f"step {step} ratios"] = hook.last_ratios[0].detach().clone()
            for i, p in enumerate(optimizer.param_groups[0]["params"]):
                found[f"step {step} AGC gradient {i}"] = p.grad.detach().clone()
        return found

    def timed(self) -> tuple[Callable[[], None], Callable[[], None]]:
        ours, _ = self._optimizer(hooked=True)
        theirs, _ = self._optimizer(hooked=False)
        return (lambda: self.lars._step(ours)), (lambda: self.lars._step(theirs))


class _GC:
    """The gradient centralization case: SGD with momentum over the LARS case's shapes and a
    row longer than the kernel's chunk (ViT-B/16's position embedding, or the routed check's
    smaller one), with and without the hook."""

    def __init__(self, case: Case, s: Sizes, dtype: torch.dtype, device: torch.device) -> None:
        long_row = (1, 197, 768) if s is CUDA_SIZES else (1, 2, 20_000)
        shapes = (*s.lars_shapes, long_row)
        self.params = [_random(shape, i, dtype, device) for i, shape in enumerate(shapes)]
        # Rows with a mean to remove.
        self.grads = [0.01 * (_random(p.shape, 50 + i, dtype, device) + 0.5)
                      for i, p in enumerate(self.params)]  # fmt: skip

    def _optimizer(self, hooked: bool) -> torch.optim.SGD:
        params = [nn.Parameter(p.clone()) for p in self.params]
        optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        if hooked:
            normhooks.GradientCentralization().attach(optimizer)
        return optimizer

    def _step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, g in zip(optimizer.param_groups[0]["params"], self.grads, strict=True):
            p.grad = g.clone()
        optimizer.step()

    def steps(self) -> dict[str, Tensor]:
        """Two steps of a fresh optimizer: the gradients the hook wrote, and the parameters."""
        optimizer = self._optimizer(hooked=True)
        found: dict[str, Tensor] = {}
        for step in (1, 2):
            self._step(optimizer)
            for i, p in enumerate(optimizer.param_groups[0]["params"]):
                found[f"step {step} centralized gradient {i}"] = p.grad.detach().clone()
                found[f"step {step} parameter {i}"] = p.detach().clone()
        return found

    def timed(self) -> tuple[Callable[[], None], Callable[[], None]]:
        ours, theirs = self._optimizer(hooked=True), self._optimizer(hooked=False)
        return (lambda: self._step(ours)), (lambda: self._step(theirs))


class _Trust:
    """The TrustRatio case: AdamW over the LARS case's shapes, with and without it. The
    second tensor's weights are zero (the ratio's zero-weight rule)."""

    def __init__(self, case: Case, s: Sizes, dtype: torch.dtype, device: torch.device) -> None:
        self.gc = _GC(case, s, dtype, device)
        self.gc.params[1].zero_()

    def _optimizer(self, hooked: bool) -> tuple[torch.optim.AdamW, normhooks.TrustRatio]:
        params = [nn.Parameter(p.clone()) for p in self.gc.params]
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)
        hook = normhooks.TrustRatio()
        if hooked:
            hook.attach(optimizer)
        return optimizer, hook

    def steps(self) -> dict[str, Tensor]:
        """Two steps of a fresh optimizer: the ratios and the parameters."""
        optimizer, hook = self._optimizer(hooked=True)
        found: dict[str, Tensor] = {}
        for step in (1, 2):
            self.gc._step(optimizer)
            found[f"step {step} ratios"] = hook.last_ratios[0].detach().clone()
            for i, p in enumerate(optimizer.param_groups[0]["params"]):
                found[f"step {step} parameter {i}"] = p.detach().clone()
        return found

    def timed(self) -> tuple[Callable[[], None], Callable[[], None]]:
        (ours, _), (theirs, _) = self._optimizer(hooked=True), self._optimizer(hooked=False)
        return (lambda: self.gc._step(ours)), (lambda: self.gc._step(theirs))


SETUPS: dict[str, type[_LARS] | type[_AGC] | type[_GC] | type[_Trust]] = {
    "lars": _LARS,
    "agc": _AGC,
    "gc": _GC,
    "trust": _Trust,
}


# --- comparing and timing ------------------------------------------------------------------
