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

from kernel_cases import KernelCases, lars_table, run_lars, ws_layout
from normhooks import _kernels
from normhooks._kernels import _common, _multi
from normhooks._kernels import lars as lars_kernels
from normhooks._kernels import weight_norm as wn_kernels
from normhooks._kernels._launch import Kernel

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
    monkeypatch.setattr(_multi, "_tables", type(_multi._tables)())
    first_launch = Recording(lars_kernels._squares_and_rates)
    monkeypatch.setattr(lars_kernels, "_SQUARES_AND_RATES", Kernel(first_launch))
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
# Row kernels' plans, decided on the host from shapes alone


@pytest.mark.parametrize(
    ("count", "length"),
    [(1, 2**24), (8, 2**20), (300, 40_000), (1, 2 * _common.MIN_SEGMENT)],
    ids=["one-row-16M", "8-rows-1M", "300-rows-40k", "shortest-split"],
)
def test_row_plan_splits_few_long_rows_across_programs(count: int, length: int) -> None:
    plan = _common.row_plan(count, length, count * length)
    assert plan.splits > 1
    # Segments tile the row, each a whole number of blocks and long enough to be worth it.
    assert (plan.splits - 1) * plan.segment < length <= plan.splits * plan.segment
    assert plan.segment % plan.block == 0
    assert plan.segment >= _common.MIN_SEGMENT
    # Enough programs to fill the GPU, unless the row runs out of segments first.
    wanted = min(_common.MIN_PROGRAMS, count * (length // _common.MIN_SEGMENT))
    assert count * plan.splits >= wanted
    assert plan.partials_block >= plan.splits
    assert plan == _common.row_plan(count, length, count * length)


@pytest.mark.parametrize(
    ("count", "length"),
    [(4096, 4096), (1, 1000), (_common.MIN_PROGRAMS, 2**20), (64, 2 * _common.MIN_SEGMENT - 1)],
    ids=["many-rows", "short-row", "rows-enough", "row-too-short"],
)
def test_row_plan_keeps_rows_whole_when_programs_or_lengths_suffice(
    count: int, length: int
) -> None:
    plan = _common.row_plan(count, length, count * length)
    assert (plan.splits, plan.segment, plan.partials_block) == (1, length, 1)


WIDE = 2**31
EXPANDED = [
    # Each is 2**31 values or 2**31 - 1 (the largest 32-bit offset is 2**31 - 1).
    pytest.param(lambda: torch.zeros(1, 1).expand(2, 2**30), True, id="2x2**30"),
    pytest.param(lambda: torch.zeros(1, 1).expand(1, WIDE), True, id="one-row-of-2**31"),
    pytest.param(lambda: torch.zeros(1, 1).expand(2, 2**29), False, id="2x2**29"),
]


@pytest.mark.parametrize(("make", "wide"), EXPANDED)
def test_weight_norm_is_64_bit_for_tensors_past_int32(make: Any, wide: bool) -> None:
    """Expanded tensors: 2**31 values in 4 bytes, so nothing is allocated."""
    v = make()
    assert wn_kernels._layout(v, 0).plan.wide == wide
    assert wn_kernels._layout(v.t(), 1).plan.wide == wide


@pytest.mark.parametrize(("make", "wide"), EXPANDED)
def test_standardization_is_64_bit_for_tensors_past_int32(make: Any, wide: bool) -> None:
    rows = make()
    # The result is contiguous: its offsets reach count * length, whatever rows' strides.
    assert ws_layout(rows).wide == wide
    assert ws_layout(rows.t()).wide == wide


def test_standardization_is_64_bit_where_strides_reach_past_int32() -> None:
    rows = torch.zeros(1, 1).expand(4, 8)
    assert not ws_layout(rows).wide
    # A row stride of 2**30: the last row starts at 3 * 2**30.
    assert _common.row_plan(4, 8, _common.extent((4, 8), (2**30, 1))).wide
    assert not _common.row_plan(4, 8, _common.extent((4, 8), (2**28, 1))).wide


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

    monkeypatch.setattr(_multi, "_tables", type(_multi._tables)(2))
    errors: list[BaseException] = []

    def lookups(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(4, generator=generator) for _ in range(8)]
        try:
            for i in range(200):
                pair = [tensors[i % 4]], [tensors[4 + i % 4]]
                lars_table(*pair)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=lookups, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
