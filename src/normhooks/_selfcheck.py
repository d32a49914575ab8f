"""``normhooks check``: what this machine runs, and whether its kernels agree with the formula.

A GPU user runs it once. It prints normhooks', torch's and Triton's versions, the device,
whether the kernels are on (and why not) and the path each technique takes; then, on CUDA,
it runs every kernel path (Weight Normalization and (Scaled) Weight Standardization on one
layer and fused over a small model, the steps of GradientLARS and GradientCentralization)
in float32, bfloat16 and float16, over two steps with the parameters changed between them,
and compares the forward values and the gradients with the plain torch formula on the same device
(``normhooks.set_kernels_enabled(False)``). Each is timed against the peer a user would pick
instead. ``--json`` writes the same report, which is how GPU figures come back to the project.

Only the public API, the off switch and ``_kernels.route_cpu_tensors`` are used, so the check
holds whatever the speed code does underneath; ``run(device="cpu-routed")`` sends CPU tensors
down the CUDA path (the tests, with Triton's interpreter and tiny shapes).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

import normhooks
from normhooks import _kernels

ROUTED = "cpu-routed"
PLAIN_HERE = "normhooks uses the plain torch formula here; nothing to check"
NO_CUDA = f"no CUDA device: {PLAIN_HERE}"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The error of a tensor is max |kernel - plain| / max |plain|. Kernel and formula both compute
# in float32 and round to the dtype, the formula at a step or two more than the kernel (Scaled
# WS rounds gain * gamma / sqrt(fan_in) first), in another order of summation: where both are
# right they differ by a few units in the last place (float32 2**-24, float16 2**-11,
# bfloat16 2**-8 of the largest value, up to twice that): about 4 are allowed in the halves.
# A wrong kernel is off by far more.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Slower than its peer by more than this is said on the line (informational: no failure).
SLOWER = 1.05
_OFF_VALUES = ("0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class _Sizes:
    batch: int
    channels: int
    spatial: int
    lars_shapes: tuple[tuple[int, ...], ...]
    repeats: int
    inner: int
    warmup: int


# A few layers of a ResNet for LARS.
_LARS_SHAPES = ((64, 3, 7, 7), (64,), *[(128, 64, 3, 3)] * 4, (256, 128, 3, 3), (1000, 512))
_CUDA_SIZES = _Sizes(16, 32, 32, _LARS_SHAPES, repeats=5, inner=20, warmup=1)
_ROUTED_SIZES = _Sizes(2, 2, 4, ((4, 2, 3, 3), (4,), (3, 8)), 1, 1, 0)


@dataclasses.dataclass
class Result:
    """One line of the report: a kernel path in one dtype, its verdict and its time."""

    check: str
    dtype: str
    peer: str
    verdict: str = "ok"
    max_error: float | None = None
    tolerance: float | None = None
    worst: str | None = None
    exception: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    ms: float | None = None
    peer_ms: float | None = None

    def line(self) -> str:
        if self.verdict == "FAILED":
            verdict = f"FAILED (exception {self.exception})"
        elif self.verdict == "MISMATCH":
            verdict = f"MISMATCH (max error {self.max_error:.1e} > tol {self.tolerance:.0e}"
            verdict += f", in {self.worst})"
        else:
            verdict = f"ok (max error {self.max_error:.1e} <= {self.tolerance:.0e})"
        timing = ""
        if self.ms is not None and self.peer_ms:
            ratio = self.ms / self.peer_ms
            timing = f"; {self.ms:.3f} ms, {self.peer} {self.peer_ms:.3f} ms ({ratio:.2f}x"
            timing += ", slower than peer)" if ratio > SLOWER else ")"
        notes = "".join(f"\n      warning: {text}" for text in self.warnings)
        return f"  {self.check:<26} {self.dtype:<9} {verdict}{timing}{notes}"


# --- what is installed, and which path each technique takes -----------------------------


def triton_version() -> str:
    """Triton's version from its distribution's metadata: finding it imports nothing."""
    if importlib.util.find_spec("triton") is None:
        return "not installed"
    for distribution in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(distribution)
    return "installed (version unknown)"


def kernels_state() -> tuple[bool, str]:
    """Whether the kernels may run, and the reason in words."""
    if not normhooks.kernels_enabled():
        value = os.environ.get("NORMHOOKS_KERNELS", "")
        if value.strip().lower() in _OFF_VALUES:
            return False, f"off: NORMHOOKS_KERNELS={value} was set when normhooks was imported"
        return False, "off: normhooks.set_kernels_enabled(False) was called"
    if importlib.util.find_spec("triton") is None:
        return False, "off: Triton is not installed (it ships with CUDA builds of torch)"
    return True, "on"


def _device_line(routed: bool) -> str:
    if routed:
        return "CPU tensors routed to the kernels (Triton's interpreter; test mode)"
    if not torch.cuda.is_available():
        return "no CUDA"
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} (cuda:{index}, sm_{major}{minor})"


def paths(on_device: bool, enabled: bool) -> dict[str, str]:
    """The path each technique takes here (``on_device``: CUDA, or routed CPU tensors)."""
    plain = "the plain torch formula (" + ("kernels off)" if on_device else "no CUDA)")
    weights = "Triton kernels: one per layer, one fused launch per model (apply_*)"
    lars = "a Triton kernel: two launches per step"
    found = {name: weights if on_device and enabled else plain for name in _WEIGHTS}
    found["GradientLARS"] = lars if on_device and enabled else plain
    found["AdaptiveGradientClipping"] = lars if on_device and enabled else plain
    gc = "a Triton kernel: one launch per step (two where a row spans several chunks)"
    found["GradientCentralization"] = gc if on_device and enabled else plain
    return found | dict.fromkeys(_NO_KERNEL, "the plain torch formula (no kernel)")


_WEIGHTS = ("WeightNorm", "WeightStandardization", "ScaledWeightStandardization")
_NO_KERNEL = (
    "TrustRatio",
    "Hypersphere",
    "UpdateRMS",
)


# --- the models, their peers and one step of each ----------------------------------------


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

    def __init__(self, s: _Sizes) -> None:
        super().__init__()
        c = s.channels
        self.conv = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.strided = nn.Conv2d(c, 3 * c, 3, stride=2, padding=1)
        self.transposed = nn.ConvTranspose2d(c, c, 2, stride=2)  # WS along dim=1
        self.linear = nn.Linear(c * s.spatial**2, 2 * c)  # long rows

    def forward(self, x: Tensor) -> Tensor:
        convolutions = (self.conv(x), self.strided(x), self.transposed(x))
        return torch.cat([*(y.flatten(1) for y in convolutions), self.linear(x.flatten(1))], 1)


class _Case(NamedTuple):
    name: str
    technique: str  # "wn", "ws", "scaled ws" or "lars"
    fused: bool = False
    # LARS: one param group per zero_grad_mode (each compiles its own kernel variant).
    zero_grad_modes: tuple[str, ...] = ("scale",)

    @property
    def peer(self) -> str:
        peers = {"wn": "torch weight_norm", "lars": "SGD alone", "agc": "SGD alone"}
        peers["gc"] = "SGD alone"
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
    _Case("weight_norm", "wn"),
    _Case("apply_weight_norm", "wn", fused=True),
    _Case("weight_standardization", "ws"),
    _Case("apply_weight_std.", "ws", fused=True),
    _Case("scaled weight_std.", "scaled ws"),
    _Case("apply_weight_std. scaled", "scaled ws", fused=True),
    _Case("GradientLARS step", "lars"),
    _Case("GradientLARS decay, skip", "lars", zero_grad_modes=("decay", "skip")),
    _Case("AdaptiveGradientClipping", "agc"),
    _Case("GradientCentralization", "gc"),
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


class _Layers:
    """A parametrization case: the converted model, its peer, an input and an upstream
    gradient; :meth:`steps` runs a copy, so the kernel and the formula start alike."""

    def __init__(self, case: _Case, s: _Sizes, dtype: torch.dtype, device: torch.device) -> None:
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

    def __init__(self, case: _Case, s: _Sizes, dtype: torch.dtype, device: torch.device) -> None:
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

    def __init__(self, case: _Case, s: _Sizes, dtype: torch.dtype, device: torch.device) -> None:
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

    def __init__(self, case: _Case, s: _Sizes, dtype: torch.dtype, device: torch.device) -> None:
        long_row = (1, 197, 768) if s is _CUDA_SIZES else (1, 2, 20_000)
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

    def _step(self, optimizer: torch.optim.SGD) -> None:
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


_SETUPS: dict[str, type[_LARS] | type[_AGC] | type[_GC]] = {"lars": _LARS, "agc": _AGC, "gc": _GC}


# --- comparing and timing ------------------------------------------------------------------


def _error(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want|: inf where one is not finite and the other is, or where
    their shapes or dtypes differ."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return math.inf
    got, want = got.double(), want.double()
    same = (got == want) | (got.isnan() & want.isnan())
    diff = torch.where(same, 0.0, (got - want).abs())
    finite = want[want.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    error = float(diff.max()) / max(scale, 1e-30) if diff.numel() else 0.0
    return math.inf if math.isnan(error) else error


def _elapsed_ms(fn: Callable[[], None], device: torch.device, calls: int) -> float:
    if device.type != "cuda":
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - began) * 1e3 / calls
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / calls


def _median_ms(
    fns: tuple[Callable[[], None], Callable[[], None]], device: torch.device, s: _Sizes
) -> tuple[float, float]:
    """Each function's median time per call in ms, the two measured in turn (side by side)
    after a warm-up call each (compiling, planning, allocating)."""
    for fn in fns * s.warmup:
        fn()
    times = [[_elapsed_ms(fn, device, s.inner) for fn in fns] for _ in range(s.repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


@contextlib.contextmanager
def _float32_matmuls() -> Iterator[None]:
    # TF32 convolutions (cuDNN's default) would round both paths' weights to 10 bits.
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


def check_case(case: _Case, dtype: torch.dtype, device: torch.device, s: _Sizes) -> Result:
    """Compares one kernel path with the plain formula in ``dtype``, then times it."""
    result = Result(case.name, str(dtype).removeprefix("torch."), case.peer)
    result.tolerance = TOLERANCES[dtype]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            setup = _SETUPS.get(case.technique, _Layers)(case, s, dtype, device)
            with _float32_matmuls():
                got = setup.steps()
                with normhooks.set_kernels_enabled(False):
                    want = setup.steps()
            if got.keys() != want.keys():
                raise RuntimeError(f"the kernel path computed {sorted(got)}, not {sorted(want)}")
            errors = {name: _error(got[name], want[name]) for name in want}
            result.worst = max(errors, key=errors.__getitem__)
            result.max_error = errors[result.worst]
            if not result.max_error <= result.tolerance:
                result.verdict = "MISMATCH"
            result.ms, result.peer_ms = _median_ms(setup.timed(), device, s)
        except Exception as error:  # reported on its line; the check goes on
            result.verdict, result.exception = "FAILED", _one_line(error)
    for warning in caught:
        text = f"{warning.category.__name__}: {warning.message}"
        if text not in result.warnings:
            result.warnings.append(text)
    return result


# --- the command -------------------------------------------------------------------------


def _check_all(
    routed: bool,
    checks: Sequence[str] | None,
    dtypes: Sequence[torch.dtype],
    say: Callable[[str], None],
) -> list[Result]:
    device = torch.device("cpu") if routed else torch.device("cuda", torch.cuda.current_device())
    sizes = _ROUTED_SIZES if routed else _CUDA_SIZES
    tolerances = ", ".join(f"{str(d).removeprefix('torch.')} {TOLERANCES[d]:.0e}" for d in dtypes)
    say("each kernel path, over two steps, against the plain formula (set_kernels_enabled(False))")
    say("on this device: error max|kernel - plain| / max|plain| over each output and gradient,")
    say(f"tolerance {tolerances}; time: forward+backward (LARS: the step),")
    say(f"median of {sizes.repeats}, beside its peer")
    results: list[Result] = []
    with _kernels.route_cpu_tensors() if routed else contextlib.nullcontext():
        for case in [case for case in CASES if checks is None or case.name in checks]:
            for dtype in dtypes:
                results.append(check_case(case, dtype, device, sizes))
                say(results[-1].line())
    counts = {v: sum(r.verdict == v for r in results) for v in ("ok", "MISMATCH", "FAILED")}
    slower = sum(r.ms is not None and r.ms > SLOWER * (r.peer_ms or math.inf) for r in results)
    say(f"{len(results)} checks: {counts['ok']} ok, {counts['MISMATCH']} mismatch, "
        f"{counts['FAILED']} failed; {slower} slower than peer (informational)")  # fmt: skip
    return results


def run(
    json_path: str | None = None,
    *,
    device: str | None = None,
    checks: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = DTYPES,
) -> int:
    """Prints the report, writes it to ``json_path`` if given, and returns the exit status:
    0 when every kernel path matches the plain formula (or there is nothing to check), 1 on
    any mismatch or failure.

    ``device``, ``checks`` (names of :data:`CASES`) and ``dtypes`` are for the tests:
    ``device="cpu-routed"`` runs the CUDA branch on CPU tensors through
    ``_kernels.route_cpu_tensors()``, with tiny shapes (Triton's interpreter must have been
    set, ``TRITON_INTERPRET=1``, before the kernels were imported).
    """
    if device not in (None, ROUTED):
        raise ValueError(f"device must be None or {ROUTED!r}, got device={device!r}")
    if json_path is not None and (
        not json_path
        or os.path.isdir(json_path)
        or not os.path.isdir(os.path.dirname(os.path.abspath(json_path)))
    ):
        # Said before the check runs, not when the report is written after it.
        raise ValueError(
            f"json_path must name a file in a directory that exists, got json_path={json_path!r}"
        )
    routed = device == ROUTED
    report: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        report.append(text)

    enabled, reason = kernels_state()
    on_device = routed or torch.cuda.is_available()
    build = f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"
    header = {
        "normhooks": normhooks.__version__,
        "torch": torch.__version__ + build,
        "Triton": triton_version(),
        "device": _device_line(routed),
        "kernels": reason if on_device or not enabled else "on (for CUDA tensors; none here)",
    }
    for key, value in header.items():
        say(f"{key + ':':<11}{value}")
    say("paths:")
    technique_paths = paths(on_device, enabled)
    for technique, path in technique_paths.items():
        say(f"  {technique:<29} {path}")
    results: list[Result] = []
    if not on_device:
        say(NO_CUDA)
    elif not enabled:
        say(f"the kernels are {reason}; {PLAIN_HERE}")
    else:
        results = _check_all(routed, checks, dtypes, say)
    status = 0 if all(r.verdict == "ok" for r in results) else 1
    if json_path is not None:
        document = {
            **header,
            "paths": technique_paths,
            "tolerances": {str(d).removeprefix("torch."): TOLERANCES[d] for d in dtypes},
            "results": [dataclasses.asdict(r) for r in results],
            "status": status,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "report": report,
        }
        with open(json_path, "w") as file:
            json.dump(document, file, indent=2)
            file.write("\n")
    return status
