"""The Triton kernels: every case of tests/kernel_cases.py on Triton's interpreter, and the
checks that launch no kernel.

Without CUDA, conftest sets ``TRITON_INTERPRET=1`` and the cases run on CPU tensors (shapes
stay tiny); where CUDA exists tests/test_cuda.py runs the same cases on CUDA tensors.
``test_kernels_compile_for_sm90`` compiles every kernel with the real backend here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need Triton")

from kernel_cases import KernelCases, run_lars
from normhooks import _kernels
from normhooks._kernels import lars as lars_kernels

SRC = Path(__file__).resolve().parents[1] / "src"
on_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels on CPU tensors through Triton's interpreter",
)


@on_interpreter
class TestOnInterpreter(KernelCases):
    @pytest.fixture
    def device(self) -> str:
        return "cpu"


# --------------------------------------------------------------------------------------------
# What only the interpreter shows: the addresses a kernel reads.


class Recording:
    """Stands for a kernel and keeps the arguments of its last launch, by name."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.arguments: dict[str, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.arguments = dict(zip(self.kernel.arg_names, args, strict=False)) | kwargs
            return self.kernel[grid](*args, **kwargs)

        return launch


@on_interpreter
def test_lars_reads_each_partial_sum_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the last program of a tensor adds its partial sums: reads grow with the number of
    chunks, not with its square."""
    from triton.runtime import interpreter

    monkeypatch.setattr(lars_kernels, "_BLOCK", 16)
    monkeypatch.setattr(lars_kernels, "_CHUNK", 64)
    monkeypatch.setattr(lars_kernels, "_PARTIALS_BLOCK", 2)
    monkeypatch.setattr(lars_kernels, "_tables", type(lars_kernels._tables)())
    first_launch = Recording(lars_kernels._squares_and_rates)
    monkeypatch.setattr(lars_kernels, "_squares_and_rates", first_launch)
    read: list[np.ndarray] = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def recorded_load(builder: Any, pointers: Any, mask: Any, *rest: Any) -> Any:
        read.append(pointers.data[np.broadcast_to(mask.data, pointers.data.shape)])
        return load(builder, pointers, mask, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", recorded_load)
    shapes = [(300,), (1000,), (10,)]  # 5, 16 and 1 chunks
    params = [torch.randn(shape) for shape in shapes]
    grads = [torch.randn(shape) for shape in shapes]
    run_lars(params, grads)
    partials = first_launch.arguments["partials"]
    start, size = partials.data_ptr(), partials.element_size()
    addresses = np.concatenate(read).astype(np.int64)
    inside = addresses[(addresses >= start) & (addresses < start + partials.nbytes)]
    # Two sums for each chunk of the tensors of several chunks (the one-chunk tensor's program
    # keeps its own), each read once.
    expected = start + size * np.arange(2 * (5 + 16))
    assert sorted(inside.tolist()) == expected.tolist()


# --------------------------------------------------------------------------------------------
# Dispatch and packaging


def test_kernels_are_not_available_for_cpu_tensors() -> None:
    assert not _kernels.available(torch.ones(2))


def test_importing_normhooks_leaves_triton_unimported() -> None:
    code = (
        "import sys, torch, normhooks\n"
        "from normhooks import _kernels\n"
        "assert not _kernels.available(torch.ones(1))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_kernels_compile_for_sm90() -> None:
    """Every kernel in every dtype through Triton's real compiler, for an H100/H200.

    The interpreter runs Python, not the compiler, so a kernel can pass every other test here
    and still fail to compile; ptxas ships with Triton, so this needs no GPU.
    """
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    script = Path(__file__).with_name("compile_kernels.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_lars_table_cache_is_safe_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Optimizer steps in several threads share the cache; eviction must not break lookups.

    Tables only (Triton's interpreter is not thread-safe itself): building and finding them
    is what the threads share.
    """
    import threading

    monkeypatch.setattr(lars_kernels, "_CACHE_SIZE", 2)
    errors: list[BaseException] = []

    def lookups(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(4, generator=generator) for _ in range(8)]
        try:
            for i in range(200):
                pair = [tensors[i % 4]], [tensors[4 + i % 4]]
                lars_kernels._table(*pair, capturing=False)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=lookups, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
