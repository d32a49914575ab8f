"""The off switch: ``NORMHOOKS_KERNELS=0`` and ``set_kernels_enabled`` send every technique to
the plain torch formula, and normhooks then never imports Triton.

torch itself may import Triton (torch 2.13 does when an optimizer is built), so what is
checked is that none of normhooks' Triton kernel modules (those of ``normhooks._kernels`` that
import it; the Triton-free ones, the door, the scopes and the caches, load with the package)
was loaded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import normhooks
from normhooks import _kernels


def _run(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


# Routed CPU tensors take the kernel path wherever kernels are allowed, so the switch decides
# whether Triton is imported; the interpreter keeps the routed launch on the CPU.
_TRAIN = """
import sys, torch, normhooks
from normhooks import _kernels
model = torch.nn.Sequential(torch.nn.Conv2d(2, 8, 3), torch.nn.Conv2d(8, 8, 3))
normhooks.apply_weight_norm(model[0])
normhooks.apply_weight_standardization(model[1])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
normhooks.GradientLARS(weight_decay=1e-4).attach(opt)
with _kernels.route_cpu_tensors():
    model(torch.randn(2, 2, 8, 8)).sum().backward()
    opt.step()
kernel_modules = [
    name for name, module in list(sys.modules.items())
    if name.startswith("normhooks._kernels.") and "triton" in vars(module)
]
print(normhooks.kernels_enabled(), bool(kernel_modules))
"""


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_environment_variable_turns_kernels_off_and_loads_no_kernel_module(value: str) -> None:
    assert _run(_TRAIN, NORMHOOKS_KERNELS=value, TRITON_INTERPRET="1") == "False False"


def test_kernels_on_by_default_load_the_kernel_modules() -> None:
    # The counterpart that makes the test above able to fail: the same run loads them.
    environment = {k: v for k, v in os.environ.items() if k != "NORMHOOKS_KERNELS"}
    result = subprocess.run(
        [sys.executable, "-c", _TRAIN],
        env={**environment, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "True True"


def test_context_manager_restores_the_previous_setting_after_an_exception() -> None:
    before = normhooks.kernels_enabled()
    seen = []

    def fail_inside() -> None:
        with normhooks.set_kernels_enabled(False):
            seen.append(normhooks.kernels_enabled())
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        fail_inside()
    assert seen == [False]
    assert normhooks.kernels_enabled() == before


def test_switched_off_routed_tensors_take_the_plain_path() -> None:
    weight = torch.randn(4, 3)
    with _kernels.route_cpu_tensors():
        assert _kernels.available(weight)
        with normhooks.set_kernels_enabled(False):
            assert not _kernels.available(weight)
            assert not _kernels.may_launch()


@pytest.mark.parametrize("mode", [0, 1, "no", None])
def test_mode_must_be_a_bool(mode: object) -> None:
    with pytest.raises(TypeError, match="mode must be True or False"):
        normhooks.set_kernels_enabled(mode)  # type: ignore[arg-type]


@pytest.mark.skipif(not _kernels._triton_found(), reason="needs Triton")
def test_a_dtype_no_kernel_is_written_for_takes_the_formula_without_a_warning() -> None:
    """A float8 layer passes the techniques' checks; the kernels must not take it (their
    refusal would read as a failure and turn every kernel off for the process)."""
    layer = normhooks.weight_standardization(nn.Conv2d(2, 3, 3))
    with _kernels.route_cpu_tensors(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _kernels.available(torch.zeros(2, dtype=torch.float8_e4m3fn))
        with torch.no_grad():
            original = layer.parametrizations.weight.original
            original.data = original.data.to(torch.float8_e4m3fn)
        with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
            _ = layer.weight  # the formula's own error, if torch has none for float8
        assert _kernels.may_launch()
