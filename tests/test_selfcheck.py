"""``normhooks check``: the report, its verdicts and its exit status.

Without CUDA the command says so and exits 0. Its CUDA branch runs here on CPU tensors sent
down the CUDA path (``_kernels.route_cpu_tensors()``, through ``run(device="cpu-routed")``),
with the kernels in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1`` without CUDA)
and tiny shapes. A wrong or failing kernel is stood in for by a parametrization whose forward
goes wrong only while the kernels are on, which is where the check reads the kernel path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import normhooks
from normhooks import WeightNorm, WeightStandardization, _kernels, _selfcheck, _selfcheck_cases
from normhooks.__main__ import main
from normhooks._step_hook import StepHook

ROOT = Path(__file__).resolve().parents[1]
ROUTED = _selfcheck.ROUTED

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the check runs")
routed = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="the CUDA branch on CPU tensors needs Triton and its interpreter",
)


def _child(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter, on this checkout's normhooks, with ``args``."""
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
        capture_output=True,
        text=True,
        check=False,
    )


def _routed(**kwargs: Any) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = _selfcheck.run(device=ROUTED, **kwargs)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    """The whole CUDA branch once, routed, with ``--json``: the tests below read it."""
    path = tmp_path_factory.mktemp("check") / "check.json"
    status, printed = _routed(json_path=str(path))
    return status, printed, json.loads(path.read_text())


# --- without CUDA ---------------------------------------------------------------------------


@no_cuda
def test_main_without_cuda_says_there_is_nothing_to_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "device:    no CUDA\n" in out
    assert out.endswith(_selfcheck.NO_CUDA + "\n")


@no_cuda
def test_python_m_normhooks_check_without_cuda_exits_0() -> None:
    result = _child("-m", "normhooks", "check")
    assert result.returncode == 0, result.stderr
    assert _selfcheck.NO_CUDA in result.stdout


@no_cuda
def test_versions_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    main(["check"])
    out = capsys.readouterr().out
    assert f"normhooks: {normhooks.__version__}\n" in out
    assert f"torch:     {torch.__version__} " in out
    assert f"Triton:    {_selfcheck.triton_version()}\n" in out


@no_cuda
def test_without_triton_says_not_installed_and_why_kernels_are_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else find_spec(name, *a),
    )
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "Triton:    not installed\n" in out
    assert "kernels:   off: Triton is not installed" in out


@no_cuda
def test_json_without_cuda_has_the_header_and_no_results(tmp_path: Path) -> None:
    path = tmp_path / "check.json"
    assert main(["check", "--json", str(path)]) == 0
    document = json.loads(path.read_text())
    assert (document["device"], document["results"], document["status"]) == ("no CUDA", [], 0)
    assert document["report"][-1] == _selfcheck.NO_CUDA


# --- the CUDA branch, routed ----------------------------------------------------------------


@routed
def test_routed_check_every_line_is_ok(full_run: tuple[int, str, dict[str, Any]]) -> None:
    status, printed, _ = full_run
    lines = [line for line in printed.splitlines() if line.startswith("  ") and " ms" in line]
    halves = sum(dtype.itemsize == 2 for dtype in _selfcheck.DTYPES)
    expected = sum(len(_selfcheck.DTYPES) - (not c.halves) * halves for c in _selfcheck.CASES)
    assert len(lines) == expected
    assert all(" ok (max error " in line for line in lines), printed
    assert status == 0


@routed
def test_routed_check_covers_every_kernel_path_and_dtype(
    full_run: tuple[int, str, dict[str, Any]],
) -> None:
    seen = {(r["check"], r["dtype"]) for r in full_run[2]["results"]}
    halves = {"bfloat16", "float16"}
    expected = {
        (case.name, dtype)
        for case in _selfcheck.CASES
        for dtype in ({"float32"} | halves if case.halves else {"float32"})
    }
    assert seen == expected
    assert ("TrustRatio", "float32") in seen


@routed
def test_routed_check_times_each_path_and_its_peer(
    full_run: tuple[int, str, dict[str, Any]],
) -> None:
    results = full_run[2]["results"]
    assert all(r["ms"] > 0 and r["peer_ms"] > 0 for r in results)
    peers = {"torch weight_norm", _selfcheck_cases.WS_PEER, "SGD alone", "AdamW alone"}
    assert {r["peer"] for r in results} == peers


@routed
def test_json_holds_what_is_printed(full_run: tuple[int, str, dict[str, Any]]) -> None:
    status, printed, document = full_run
    assert document["report"] == printed.splitlines()
    assert document["status"] == status
    lines = [_selfcheck.Result(**result).line() for result in document["results"]]
    assert "\n".join(lines) in printed


def _wrong_while_kernels_on(monkeypatch: pytest.MonkeyPatch, cls: type, change: Any) -> None:
    forward = cls.forward

    def patched(self: Any, *args: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = forward(self, *args)
        return change(weight) if normhooks.kernels_enabled() else weight

    monkeypatch.setattr(cls, "forward", patched)


@routed
def test_a_kernel_off_by_a_little_is_a_mismatch_and_exit_status_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _wrong_while_kernels_on(monkeypatch, WeightNorm, lambda weight: weight * (1 + 1e-3))
    status, printed = _routed(checks=["weight_norm"], dtypes=[torch.float32])
    assert re.search(
        r"\n  weight_norm +float32 +MISMATCH \(max error \S+ > tol 1e-04, in ", printed
    )
    assert status == 1


@routed
@pytest.mark.parametrize("forced", ["scale", "decay", "skip"])
def test_a_lars_kernel_with_another_zero_gradient_rule_is_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, forced: str
) -> None:
    """The LARS lines see the zero-gradient rule: a kernel path that applied one rule to every
    group disagrees with the formula on the groups of the other rules."""
    launch = _kernels.lars_unit_

    def one_rule(*args: Any, **kwargs: Any) -> torch.Tensor:
        return launch(*args, **{**kwargs, "zero_grad_mode": forced})

    monkeypatch.setattr(_kernels, "lars_unit_", one_rule)
    status, printed = _routed(checks=["GradientLARS decay, skip"], dtypes=[torch.float32])
    assert re.search(r"GradientLARS decay, skip +float32 +MISMATCH \(max error", printed), printed
    assert status == 1


@routed
def test_a_kernel_that_falls_back_to_the_formula_fails_its_line_and_not_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its numbers would match the formula's without a kernel having run; the next line runs
    its own kernel again."""
    from normhooks._kernels import agc as agc_kernels

    def fail(*args: Any) -> None:
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(agc_kernels, "_launch", fail)
    centralize, ran = _kernels.centralize_unit_, []

    def recorded(grads: list[torch.Tensor], kept: dict[object, object] | None = None) -> bool:
        ran.append(centralize(grads, kept))
        return ran[-1]

    monkeypatch.setattr(_kernels, "centralize_unit_", recorded)
    checks = ["AdaptiveGradientClipping", "GradientCentralization"]
    status, printed = _routed(checks=checks, dtypes=[torch.float32])
    assert re.search(r"AdaptiveGradientClipping +float32 +FAILED \(exception .*fell back", printed)
    assert re.search(r"GradientCentralization +float32 +ok \(max error", printed), printed
    assert status == 1
    assert ran  # the next line's kernel ran, and did not fall back
    assert all(ran)
    assert not _kernels._fallback.broken()


@routed
def test_an_agc_kernel_clipping_a_little_harder_is_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launch = _kernels.agc_unit_

    def harder(*args: Any, **kwargs: Any) -> torch.Tensor:
        return launch(*args, **{**kwargs, "clipping": kwargs["clipping"] * (1 - 1e-3)})

    monkeypatch.setattr(_kernels, "agc_unit_", harder)
    status, printed = _routed(checks=["AdaptiveGradientClipping"], dtypes=[torch.float32])
    assert re.search(r"AdaptiveGradientClipping +float32 +MISMATCH \(max error", printed), printed
    assert status == 1


@routed
def test_the_agc_line_passes_on_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counterpart that makes the test above able to fail: the kernel itself agrees."""
    calls: list[int] = []
    launch = _kernels.agc_unit_

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(_kernels, "agc_unit_", counted)
    status, printed = _routed(checks=["AdaptiveGradientClipping"], dtypes=[torch.float32])
    assert re.search(r"AdaptiveGradientClipping +float32 +ok \(max error", printed), printed
    assert calls
    assert status == 0


def test_a_gradient_centralization_kernel_off_by_a_little_is_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launch = _kernels.centralize_unit_

    def off(grads: list[torch.Tensor], kept: dict[object, object] | None = None) -> bool:
        done = launch(grads, kept)
        for grad in grads:
            grad.mul_(1 + 1e-3)
        return done

    monkeypatch.setattr(_kernels, "centralize_unit_", off)
    status, printed = _routed(checks=["GradientCentralization"], dtypes=[torch.float32])
    assert re.search(r"GradientCentralization +float32 +MISMATCH \(max error", printed), printed
    assert status == 1


def test_every_hook_has_a_path_line() -> None:
    hooks = {
        name
        for name in normhooks.__all__
        if isinstance(getattr(normhooks, name), type)
        and issubclass(getattr(normhooks, name), StepHook)
    }
    assert hooks <= set(_selfcheck.paths(on_device=False, enabled=True))


@no_cuda
def test_the_docs_show_the_path_lines_printed_without_cuda(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["check"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    page = (ROOT / "docs" / "check.md").read_text()
    shown = page.split("paths:\n", 1)[1].split("\nno CUDA device", 1)[0].splitlines()
    assert shown == printed


@routed
def test_a_kernel_that_raises_is_failed_and_exit_status_1(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("launch failed: no kernel image")

    _wrong_while_kernels_on(monkeypatch, WeightStandardization, fail)
    status, printed = _routed(checks=["weight_standardization"], dtypes=[torch.bfloat16])
    assert "bfloat16  FAILED (exception RuntimeError: launch failed: no kernel image)" in printed
    assert "0 ok, 0 mismatch, 1 failed" in printed
    assert status == 1


@routed
def test_a_warning_on_the_kernel_path_is_printed_on_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def warn(weight: torch.Tensor) -> torch.Tensor:
        warnings.warn("the kernel fell back to the plain formula", stacklevel=1)
        return weight

    _wrong_while_kernels_on(monkeypatch, WeightNorm, warn)
    status, printed = _routed(checks=["weight_norm"], dtypes=[torch.float16])
    line = "\n      warning: UserWarning: the kernel fell back to the plain formula\n"
    assert " ok (max error " in printed.split(line)[0].splitlines()[-1]
    assert status == 0


@routed
def test_switched_off_there_is_nothing_to_check() -> None:
    with normhooks.set_kernels_enabled(False):
        status, printed = _routed()
    assert "kernels:   off: normhooks.set_kernels_enabled(False) was called\n" in printed
    assert "GradientLARS                  the plain torch formula (kernels off)\n" in printed
    assert printed.endswith("here; nothing to check\n")
    assert status == 0


_IMPORTS = """
import sys, torch
from normhooks import _selfcheck
status = _selfcheck.run(device="cpu-routed", checks=["GradientLARS step"], dtypes=[torch.float32])
# The kernel modules that import Triton; the package's Triton-free speed modules load with it.
print(status, any(
    name.startswith("normhooks._kernels.") and "triton" in vars(module)
    for name, module in list(sys.modules.items())
))
"""


@routed
def test_kernels_off_by_environment_says_so_and_imports_no_kernel_module() -> None:
    result = _child("-c", _IMPORTS, NORMHOOKS_KERNELS="0", TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    assert (
        "kernels:   off: NORMHOOKS_KERNELS=0 was set when normhooks was imported" in result.stdout
    )
    assert result.stdout.endswith("nothing to check\n0 False\n")


@routed
def test_kernels_on_the_same_run_imports_kernel_modules() -> None:
    # The counterpart that makes the test above able to fail.
    result = _child("-c", _IMPORTS, NORMHOOKS_KERNELS="1", TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("0 True\n")


# --- pieces ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("got", "want", "error"),
    [
        ([1.0, 2.0], [1.0, 2.0], 0.0),
        ([1.0, 2.5], [1.0, 2.0], 0.25),
        ([math.nan, 2.0], [1.0, 2.0], math.inf),
        ([math.nan, 2.0], [math.nan, 2.0], 0.0),
        ([math.inf, 2.0], [1.0, 2.0], math.inf),
        ([[1.0], [2.0]], [1.0, 2.0], math.inf),
    ],
    ids=["equal", "relative-to-largest", "nan-from-kernel", "nan-in-both", "inf-from-kernel",
         "other-shape"],
)  # fmt: skip
def test_error_is_relative_to_the_largest_value(
    got: list[float], want: list[float], error: float
) -> None:
    assert _selfcheck._error(torch.tensor(got), torch.tensor(want)) == error


def test_error_of_another_dtype_is_infinite() -> None:
    same = torch.tensor([1.0, 2.0])
    assert _selfcheck._error(same.bfloat16(), same) == math.inf


def test_json_into_a_missing_directory_is_refused_before_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--json", str(tmp_path / "missing" / "check.json")])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "normhooks check: error: --json " in captured.err
    assert "its directory does not exist" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    "path", ["", ".", "no-such-directory/check.json"], ids=["empty", "a-directory", "no-parent"]
)
def test_json_path_that_names_no_file_is_refused_before_the_check(
    path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=re.escape(f"that exists, got json_path='{path}'")):
        _selfcheck.run(path)
    assert capsys.readouterr().out == ""


def test_device_must_be_none_or_routed() -> None:
    with pytest.raises(ValueError, match="device must be None or 'cpu-routed', got device='cuda'"):
        _selfcheck.run(device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_kernel_path_matches(tmp_path: Path) -> None:
    path = tmp_path / "check.json"
    status = main(["check", "--json", str(path)])
    results = json.loads(path.read_text())["results"]
    assert [r for r in results if r["verdict"] != "ok"] == []
    assert status == 0
