"""``normhooks check``: what this machine runs, and whether its kernels agree with the formula.

A GPU user runs it once. It prints normhooks', torch's and Triton's versions, the device,
whether the kernels are on (and why not) and the path each technique takes; then, on CUDA,
it runs every kernel path (Weight Normalization and (Scaled) Weight Standardization on one
layer and fused over a small model, the steps of GradientLARS, AdaptiveGradientClipping,
GradientCentralization and TrustRatio; the cases are in :mod:`normhooks._selfcheck_cases`)
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

import torch
from torch import Tensor

import normhooks
from normhooks import _kernels
from normhooks._kernels import _fallback
from normhooks._selfcheck_cases import (
    CASES,
    CUDA_SIZES,
    ROUTED_SIZES,
    SETUPS,
    Case,
    Layers,
    Sizes,
)

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
    trust = "a Triton kernel: three launches per step (one before it, two after)"
    found["TrustRatio"] = trust if on_device and enabled else plain
    return found | dict.fromkeys(_NO_KERNEL, "the plain torch formula (no kernel)")


_WEIGHTS = ("WeightNorm", "WeightStandardization", "ScaledWeightStandardization")
_NO_KERNEL = (
    "Hypersphere",
    "UpdateRMS",
)


# --- the models, their peers and one step of each ----------------------------------------


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
    fns: tuple[Callable[[], None], Callable[[], None]], device: torch.device, s: Sizes
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


def check_case(case: Case, dtype: torch.dtype, device: torch.device, s: Sizes) -> Result:
    """Compares one kernel path with the plain formula in ``dtype``, then times it."""
    result = Result(case.name, str(dtype).removeprefix("torch."), case.peer)
    result.tolerance = TOLERANCES[dtype]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            setup = SETUPS.get(case.technique, Layers)(case, s, dtype, device)
            # A kernel that fails falls back to the formula (and keeps every kernel off): its
            # numbers would then match the formula's without a kernel having run.
            _fallback.reset()
            with _float32_matmuls():
                got = setup.steps()
                if _fallback.broken():
                    raise RuntimeError("the kernel failed and fell back to the plain formula")
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
    _fallback.reset()  # the next line checks its kernel afresh
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
    sizes = ROUTED_SIZES if routed else CUDA_SIZES
    tolerances = ", ".join(f"{str(d).removeprefix('torch.')} {TOLERANCES[d]:.0e}" for d in dtypes)
    say("each kernel path, over two steps, against the plain formula (set_kernels_enabled(False))")
    say("on this device: error max|kernel - plain| / max|plain| over each output and gradient,")
    say(f"tolerance {tolerances}; time: forward+backward (LARS: the step),")
    say(f"median of {sizes.repeats}, beside its peer")
    results: list[Result] = []
    with _kernels.route_cpu_tensors() if routed else contextlib.nullcontext():
        for case in [case for case in CASES if checks is None or case.name in checks]:
            for dtype in [d for d in dtypes if case.halves or d.itemsize > 2]:
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
