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

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need Triton")

from kernel_cases import KernelCases
from normhooks import _kernels
from normhooks._kernels import lars as lars_kernels

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels on CPU tensors through Triton's interpreter",
)
class TestOnInterpreter(KernelCases):
    @pytest.fixture
    def device(self) -> str:
        return "cpu"


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


COMPILE_ALL = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from normhooks._kernels import lars, weight_norm as wn, weight_standardization as ws

def build(fn, pointers, scalars, constants):
    signature = {name: "constexpr" if name in constants else pointers.get(name, scalars.get(name))
                 for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32))

for name, flag in (("fp32", False), ("fp16", True), ("bf16", False), ("fp64", True)):
    dtype = getattr(tl, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
                         "fp64": "float64"}[name])
    acc = tl.float64 if name == "fp64" else tl.float32
    a = "*fp64" if name == "fp64" else "*fp32"
    tables = {n: "*i64" for n in ("w_ptrs", "g_ptrs", "numels", "first_chunk", "chunk_tensor",
                                  "chunk_start")}
    sizes = {"block": 1024, "chunk_size": 32768}
    build(lars._partial_squares, {**tables, "partials": a}, {},
          {"dtype": dtype, "acc": acc, **sizes})
    build(lars._scale,
          {**tables, "partials": a, "rates": a, "grad_scale": "*fp32", "lr_tensor": a,
           "found_inf": "*fp32"},
          {n: "i64" for n in ("threshold", "weight_decay", "eps", "trust_coefficient", "lr")},
          {"dtype": dtype, "acc": acc, **sizes, "partials_block": 128, "has_decay": flag,
           "has_trust": flag, "clip": flag, "lr_is_tensor": flag,
           "zero_denominator_is_one": not flag, "scaled": flag, "flag_overflow": flag})
    p = "*" + name
    rows = {"length": "i32", "count": "i32", "inner": "i32", "eps": "i64"}
    build(wn._forward, {"v": p, "g": p, "w": p, "norms": a}, rows,
          {"acc": acc, "block": 1024, "row_is_contiguous": flag})
    build(wn._backward,
          {"grad_w": p, "v": p, "g": p, "norms": a, "grad_v": p, "grad_g": p}, rows,
          {"acc": acc, "block": 1024, "row_is_contiguous": not flag})
    strides = {n: "i32" for n in ("length", "x_row_stride", "x_stride", "dy_row_stride",
                                  "dy_stride")} | {"eps": "i64"}
    build(ws._forward, {"x": p, "gain": p, "y": p, "means": a, "rstds": a}, strides,
          {"acc": acc, "block": 1024, "has_gain": flag})
    build(ws._backward,
          {"grad_y": p, "x": p, "gain": p, "means": a, "rstds": a, "grad_x": p,
           "grad_gain": p}, strides, {"acc": acc, "block": 1024, "has_gain": not flag})

# The launcher turns an int argument equal to 1 into a constant unless told not to: every
# kernel must compile with each of its int arguments that it lets be specialized equal to 1
# (rows of one element, one row, unit strides).
p = a = "*fp32"
ws_pointers = {"x": p, "gain": p, "y": p, "means": a, "rstds": a, "grad_y": p, "grad_x": p,
               "grad_gain": p}
for fn, pointers, scalars in (
    (wn._forward, {"v": p, "g": p, "w": p, "norms": a}, rows),
    (wn._backward, {"grad_w": p, "v": p, "g": p, "norms": a, "grad_v": p, "grad_g": p}, rows),
    (ws._forward, ws_pointers, strides),
    (ws._backward, ws_pointers, strides),
):
    ones = {q.name: 1 for q in fn.params
            if scalars.get(q.name) == "i32" and not q.do_not_specialize}
    flags = {"row_is_contiguous": False} if fn in (wn._forward, wn._backward) else {
        "has_gain": True}
    build(fn, pointers, scalars, {"acc": tl.float32, "block": 16, **flags, **ones})
"""


def test_kernels_compile_for_sm90() -> None:
    """Every kernel in every dtype through Triton's real compiler, for an H100/H200.

    The interpreter runs Python, not the compiler, so a kernel can pass every other test here
    and still fail to compile; ptxas ships with Triton, so this needs no GPU.
    """
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True, text=True, check=False
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
                lars_kernels._table(*pair)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=lookups, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
