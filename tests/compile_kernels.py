"""Compiles every Triton kernel of normhooks, in every constexpr variant, for an H100/H200.

Run as a script (tests/test_kernels.py does, without ``TRITON_INTERPRET``): Triton's real
compiler and ptxas need no GPU, and they reject code that the interpreter runs happily. Each
variant that promises 64-bit index arithmetic is also read back from its Triton IR: no
integer arithmetic there may be 32-bit, so no offset can wrap at 2**31.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Iterator
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from normhooks._kernels import lars
from normhooks._kernels import weight_norm as wn
from normhooks._kernels import weight_standardization as ws

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32, "fp64": tl.float64}
# 32-bit integer arithmetic in Triton IR: the ops that compute an offset.
NARROW = re.compile(r"arith\.(addi|subi|muli|divsi|remsi)\b[^\n]*:\s*(tensor<[0-9x]*xi32|i32\b)")


def build(
    fn: Any,
    types: dict[str, str],
    constants: dict[str, Any],
    *,
    aligned: bool = True,
    ones: tuple[str, ...] = (),
) -> Any:
    """``fn`` compiled with ``types`` for its arguments and ``constants`` for its constexprs.

    ``aligned``: pointers 16-byte aligned, as the launcher specializes them for tensors fresh
    from torch's allocator. ``ones``: int arguments equal to 1, which the launcher turns into
    constants unless the kernel says ``do_not_specialize``.
    """
    missing = set(fn.arg_names) - set(types) - set(constants) - set(ones)
    if missing:
        raise KeyError(f"{fn.__name__}: no type for {sorted(missing)}")
    signature = {
        name: "constexpr" if name in constants or name in ones else types[name]
        for name in fn.arg_names
    }
    attrs = {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(fn.arg_names)
        if aligned and signature[name].startswith("*")
    }
    values = {**constants, **dict.fromkeys(ones, 1)}
    return triton.compile(ASTSource(fn, signature, values, attrs), target=TARGET)


def check_wide(kernel: Any, name: str) -> None:
    """Fails where the kernel's Triton IR does 32-bit integer arithmetic."""
    narrow = [line.strip() for line in kernel.asm["ttir"].splitlines() if NARROW.search(line)]
    if narrow:
        raise AssertionError(f"{name} computes in 32 bits:\n" + "\n".join(narrow[:5]))


def flags(names: tuple[str, ...]) -> Iterator[dict[str, bool]]:
    """Settings of boolean constexprs where each takes both values (not every combination):
    all off, all on, then each one alone on."""
    yield dict.fromkeys(names, False)
    yield dict.fromkeys(names, True)
    for name in names:
        yield {other: other == name for other in names}


def accumulator(dtype: str) -> Any:
    return tl.float64 if dtype == "fp64" else tl.float32


def sweep(names: tuple[str, ...]) -> Iterator[tuple[str, dict[str, bool]]]:
    """``(dtype, flags)`` pairs: float32 with every setting of :func:`flags`, each other dtype
    with the next setting in turn."""
    settings = list(flags(names))
    for setting in settings:
        yield "fp32", setting
    for dtype, setting in zip(
        (d for d in DTYPES if d != "fp32"), itertools.cycle(settings[1:]), strict=False
    ):
        yield dtype, setting


def lars_kernels() -> None:
    types = dict.fromkeys(
        (
            "w_ptrs",
            "g_ptrs",
            "numels",
            "first_chunk",
            "chunk_tensor",
            "chunk_start",
            "arrivals",
        ),
        "*i64",
    )
    types |= dict.fromkeys(("threshold", "weight_decay", "eps", "trust_coefficient", "lr"), "i64")
    rate_flags = (
        "has_decay",
        "has_trust",
        "clip",
        "lr_is_tensor",
        "zero_denominator_is_one",
        "scaled",
    )
    sizes = {"block": 1024, "chunk_size": 32768}
    for fn, names, extra in (
        (lars._squares_and_rates, rate_flags, {"partials_block": 128}),
        (lars._scale, ("has_decay", "scaled", "flag_overflow"), {}),
    ):
        for dtype, setting in sweep(names):
            a = "*fp64" if dtype == "fp64" else "*fp32"
            pointers = {"partials": a, "rates": a, "lr_tensor": a}
            pointers |= {"grad_scale": "*fp32", "found_inf": "*fp32"}
            constants = {"dtype": DTYPES[dtype], "acc": accumulator(dtype), **sizes, **extra}
            kernel = build(fn, {**types, **pointers}, {**constants, **setting})
            # Offsets come from the int64 table: nothing may narrow them.
            check_wide(kernel, f"lars.{fn.__name__}")
        build(
            fn,
            {**types, **pointers},
            {**constants, **dict.fromkeys(names, True)},
            aligned=False,
        )


def weight_norm_kernels() -> None:
    scalars = {"length": "i32", "count": "i32", "inner": "i32", "eps": "i64"}
    for dtype in DTYPES:
        p, a = "*" + dtype, "*fp64" if dtype == "fp64" else "*fp32"
        for contiguous in (False, True):
            constants = {"acc": accumulator(dtype), "block": 1024, "row_is_contiguous": contiguous}
            build(wn._forward, {"v": p, "g": p, "w": p, "norms": a, **scalars}, constants)
            build(
                wn._backward,
                {"grad_w": p, "v": p, "g": p, "norms": a, "grad_v": p, "grad_g": p, **scalars},
                constants,
            )


def standardization_kernels() -> None:
    strides = dict.fromkeys(
        ("length", "x_row_stride", "x_stride", "dy_row_stride", "dy_stride"), "i32"
    )
    for dtype in DTYPES:
        p, a = "*" + dtype, "*fp64" if dtype == "fp64" else "*fp32"
        pointers = {"x": p, "gain": p, "y": p, "means": a, "rstds": a}
        pointers |= {"grad_y": p, "grad_x": p, "grad_gain": p}
        for gain in (False, True):
            constants = {"acc": accumulator(dtype), "block": 1024, "has_gain": gain}
            build(ws._forward, {**pointers, **strides, "eps": "i64"}, constants)
            build(ws._backward, {**pointers, **strides}, constants)


def ones_kernels() -> None:
    """Every kernel with each int argument that it lets be specialized equal to 1 (rows of one
    element, one row, unit strides): the launcher makes those constants."""
    p = a = "*fp32"
    wn_types = {"v": p, "g": p, "w": p, "norms": a, "grad_w": p, "grad_v": p, "grad_g": p}
    wn_types |= {"length": "i32", "count": "i32", "inner": "i32", "eps": "i64"}
    ws_types = {"x": p, "gain": p, "y": p, "means": a, "rstds": a, "grad_y": p, "grad_x": p}
    ws_types |= {"grad_gain": p, "eps": "i64"}
    ws_types |= dict.fromkeys(
        ("length", "x_row_stride", "x_stride", "dy_row_stride", "dy_stride"), "i32"
    )
    for fn, types, constants in (
        (wn._forward, wn_types, {"row_is_contiguous": False}),
        (wn._backward, wn_types, {"row_is_contiguous": False}),
        (ws._forward, ws_types, {"has_gain": True}),
        (ws._backward, ws_types, {"has_gain": True}),
    ):
        ones = tuple(
            q.name
            for q in fn.params
            if types.get(q.name) == "i32" and not q.do_not_specialize and q.name in fn.arg_names
        )
        types = {name: kind for name, kind in types.items() if name in fn.arg_names}
        build(fn, types, {"acc": tl.float32, "block": 16, **constants}, ones=ones)


def main() -> None:
    lars_kernels()
    weight_norm_kernels()
    standardization_kernels()
    ones_kernels()


if __name__ == "__main__":
    main()
    sys.exit(0)
