"""normhooks' CUDA code path on CPU tensors, launching nothing: a proxy for its GPU host time.

On a GPU a training step is bound by host time (Python, dispatch and launches) whenever the
model is small or the batch is, and the GPU's own work hides behind it. Inside
:func:`cuda_path_on_cpu`:

- ``normhooks._kernels.route_cpu_tensors()`` sends plain CPU tensors to the Triton kernels,
  the dispatch a CUDA tensor gets;
- Triton's active driver is :class:`NoOpDriver`: its target is ``GPUTarget("cuda", 90, 32)``,
  so ``JITFunction.run`` is Triton's own (argument binder, specialization, kernel caches)
  and the kernels really compile for sm_90 (ptxas ships with Triton; each specialization's
  first build lands in Triton's disk cache: warm up before timing); only loading the binary
  and launching it are no-ops, and each launch is counted.

No kernel runs, so every kernel output is uninitialized memory: time and count under the
proxy, never compare numbers. Left out of the figures: the CUDA launcher's C marshalling of
the arguments and the CUDA driver's own launch call. The kernel modules must be imported
with ``TRITON_INTERPRET`` off (Triton decides at ``@triton.jit`` time whether a kernel is
interpreted); :func:`interpreter_off` clears it before anything imports them.

Checked on Triton 3.6 (``triton.runtime.driver``, ``triton.backends.driver.DriverBase``, the
launcher's call in ``JITFunction.run`` and ``CompiledKernel._init_handles``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.backends.nvidia.driver import ty_to_cpp
from triton.runtime import driver as triton_driver

# Not a CUDA device index: each JITFunction keeps its compiled kernels per device, and this
# key keeps the proxy's (whose launcher launches nothing) apart from a real GPU's in a
# process that uses both.
PROXY_DEVICE = -1
# What CompiledKernel checks before a launch, as an H200 reports it.
_H200 = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536}
_MAX_THREADS_PER_BLOCK = 1024


def interpreter_off() -> None:
    """Turns Triton's interpreter off for kernels decorated from now on.

    The test suite sets ``TRITON_INTERPRET=1`` on machines without CUDA, under which
    ``@triton.jit`` returns an interpreted function that would compute on the CPU instead of
    going through the launcher.
    """
    os.environ.pop("TRITON_INTERPRET", None)


class _Utils:
    """The driver utilities CompiledKernel calls before its first launch."""

    def load_binary(
        self, name: str, kernel: bytes, shared: int, device: object
    ) -> tuple[int, int, int, int, int]:
        # (module, function, registers, spills, max threads): nothing is loaded.
        return 1, 1, 0, 0, _MAX_THREADS_PER_BLOCK

    def get_device_properties(self, device: object) -> dict[str, int]:
        return dict(_H200)


class _NoOpLauncher:
    """Stands in for Triton's CUDA launcher of one compiled kernel: counts, launches nothing."""

    def __init__(self, counts: Counter[str], src: Any, metadata: Any) -> None:
        self.counts = counts
        self.name = str(metadata.name)

    def __call__(
        self,
        grid_x: int,
        grid_y: int,
        grid_z: int,
        stream: int,
        function: int,
        packed_metadata: object,
        launch_metadata: object,
        enter_hook: Any,
        exit_hook: Any,
        *args: object,
    ) -> None:
        # The launch hooks (profilers) are the launcher's to call, as the C launcher does.
        if enter_hook is not None:
            enter_hook(launch_metadata)
        self.counts[self.name] += 1
        if exit_hook is not None:
            exit_hook(launch_metadata)


class NoOpDriver(DriverBase):
    """A Triton driver for an sm_90 GPU that compiles for real and launches nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.utils = _Utils()
        self.launcher_cls = functools.partial(_NoOpLauncher, self.launches)

    @classmethod
    def is_active(cls) -> bool:
        # Never picked by Triton itself; only cuda_path_on_cpu installs it.
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        return str(ty_to_cpp(ty))

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return PROXY_DEVICE

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("nothing runs under the host proxy: nothing to time")


# One for the process: each compiled kernel keeps the launcher it was first given, so the
# counts live in one place whichever proxy session launches it.
DRIVER = NoOpDriver()


def kernel_modules() -> list[ModuleType]:
    """normhooks' kernel modules (imported here)."""
    from normhooks._kernels import (
        _common,
        _multi,
        agc,
        gradient_centralization,
        lars,
        trust_ratio,
        weight_norm,
        weight_standardization,
    )

    return [
        _common,
        _multi,
        agc,
        gradient_centralization,
        lars,
        trust_ratio,
        weight_norm,
        weight_standardization,
    ]


def check_compiled_kernels() -> None:
    """Raises if a kernel of normhooks is interpreted rather than compiled."""
    from triton.runtime.interpreter import InterpretedFunction

    for module in kernel_modules():
        for name, value in vars(module).items():
            if isinstance(value, InterpretedFunction):
                raise RuntimeError(
                    f"{module.__name__}.{name} is interpreted, not a JITFunction: its module "
                    "was imported with TRITON_INTERPRET=1, and the interpreter would compute "
                    "on the CPU instead of going through the launcher. Call "
                    "_proxy.interpreter_off() before anything imports normhooks' kernels."
                )


@contextlib.contextmanager
def cuda_path_on_cpu() -> Iterator[NoOpDriver]:
    """Within the block, CPU tensors take normhooks' CUDA path and Triton launches nothing.

    Yields the driver; ``driver.launches`` counts the launches per kernel name (read it as a
    difference). On leaving, the routing and Triton's active driver are what they were.
    """
    from normhooks import _kernels

    check_compiled_kernels()
    # DriverConfig.active would build the default driver, which fails without a GPU: the
    # attribute behind it says whether one was ever made (Triton 3.6).
    previous = triton_driver._active
    triton_driver.set_active(DRIVER)
    try:
        with _kernels.route_cpu_tensors():
            yield DRIVER
    finally:
        triton_driver.set_active(previous)
