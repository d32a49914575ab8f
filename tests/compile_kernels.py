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
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from normhooks._kernels import agc, lars
from normhooks._kernels import gradient_centralization as gc
from normhooks._kernels import trust_ratio as tr
from normhooks._kernels import weight_norm as wn
from normhooks._kernels import weight_standardization as ws
from normhooks._kernels._launch import Kernel

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


# The multi-tensor table's parts (normhooks._kernels._multi.ChunkTable), as every
# multi-tensor kernel takes them.
CHUNK_TABLE = dict.fromkeys(
    ("chunk_tensor", "chunk_row", "chunk_start", "chunk_stop", "row_first_chunk", "arrivals"),
    "*i64",
)


def lars_kernels() -> None:
    types = {**CHUNK_TABLE, "w_ptrs": "*i64", "g_ptrs": "*i64"}
    types |= dict.fromkeys(("threshold", "weight_decay", "eps", "trust_coefficient", "lr"), "i64")
    rate_flags = (
        "has_decay",
        "has_trust",
        "clip",
        "lr_is_tensor",
        "zero_denominator_is_one",
        "zero_grad_is_one",
        "zero_grad_is_zero",
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


def agc_kernels() -> None:
    types = {**CHUNK_TABLE, "w_ptrs": "*i64", "g_ptrs": "*i64", "clipping": "i64", "eps": "i64"}
    sizes = {"block": 1024}
    for fn, names, extra in (
        (agc._squares_and_factors, ("scaled",), {"partials_block": 128}),
        (agc._clip, ("scaled", "flag_overflow"), {}),
    ):
        for dtype, setting in sweep(names):
            a = "*fp64" if dtype == "fp64" else "*fp32"
            pointers = {"scratch": a, "maxima": a, "grad_scale": "*fp32", "found_inf": "*fp32"}
            constants = {"dtype": DTYPES[dtype], "acc": accumulator(dtype), **sizes, **extra}
            if fn is agc._clip:
                constants["ratio_bits"] = tl.int64 if dtype == "fp64" else tl.int32
            kernel = build(fn, {**types, **pointers}, {**constants, **setting})
            # Offsets come from the int64 table: nothing may narrow them.
            check_wide(kernel, f"agc.{fn.__name__}")
        build(
            fn,
            {**types, **pointers},
            {**constants, **dict.fromkeys(names, True)},
            aligned=False,
        )


def gc_kernels() -> None:
    """Both of gradient centralization's kernels in every dtype, aligned or not: every offset
    comes from the int64 table."""
    for dtype in DTYPES:
        a = "*fp64" if dtype == "fp64" else "*fp32"
        types = {**CHUNK_TABLE, "g_ptrs": "*i64", "partials": a, "means": a, "first": "i32"}
        constants = {"dtype": DTYPES[dtype], "acc": accumulator(dtype), "block": 1024}
        for fn, extra in ((gc._centralize, {"partials_block": 128}), (gc._subtract_means, {})):
            for aligned in (True, False):
                kernel = build(fn, types, {**constants, **extra}, aligned=aligned)
                check_wide(kernel, f"gradient_centralization.{fn.__name__} ({dtype})")


class CheckedKernel(Kernel):
    """A :class:`Kernel` that, after each launch, asks Triton's own binder which compiled
    kernel these arguments take, and fails unless it is the one the caller's cache holds."""

    __slots__ = ("hits",)

    def __init__(self, kernel: Kernel) -> None:
        super().__init__(kernel.fn)
        self.hits = 0

    def __call__(
        self,
        cache: dict[tuple[bool, ...], Any],
        grid: tuple[int, int],
        device: int | None,
        pointers: tuple[torch.Tensor, ...],
        *args: Any,
    ) -> None:
        aligned = tuple([t.data_ptr() % 16 == 0 for t in pointers])
        cached = cache.get(aligned)
        super().__call__(cache, grid, device, pointers, *args)
        if cached is None:
            return
        chosen = self.fn.run(*args, grid=grid, warmup=True)
        if chosen is not cached:
            names = dict(zip(self.fn.arg_names, args, strict=True))
            raise AssertionError(
                f"{self.fn.__name__} launched directly a kernel compiled for "
                f"other arguments than {names}"
            )
        self.hits += 1


def lars_direct_launches() -> None:
    """Every call signature of LARS's kernels launches, from its cache, the compiled kernel
    Triton's binder picks for its arguments (through benchmarks/_proxy.py's driver, which
    compiles for sm_90 and launches nothing: no number is computed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _proxy

    def view(dtype: torch.dtype, aligned: bool) -> torch.Tensor:
        # One element 16 bytes into a fresh buffer, or one element into it (misaligned).
        buffer = torch.ones(16, dtype=dtype)
        return buffer[16 // buffer.element_size() if aligned else 1].view(1)

    settings: list[dict[str, Any]] = [
        {},
        # A scalar's bit pattern travels as int32 where it fits (0.0; 5e-324, whose bits
        # are 1), as int64 otherwise.
        {"eps": 0.0},
        {"eps": 0.0, "weight_decay": 0.0, "threshold": 0.0},
        {"weight_decay": 1e-4, "trust_coefficient": 1e-3, "threshold": -1.0},
        {"clip": True, "lr": 0.1},
        {"clip": True, "lr": 5e-324},
        {"clip": True, "lr": view(torch.float32, True)},
        {"clip": True, "lr": view(torch.float32, False)},
        {"clip": True, "lr": view(torch.float64, False)},
        # Each differs from the one before in one pointer's dtype or alignment.
        {"grad_scale": view(torch.float32, True)},
        {"grad_scale": view(torch.float64, True)},
        {"grad_scale": view(torch.float16, True)},
        {"grad_scale": view(torch.float16, False)},
        {"grad_scale": view(torch.float32, True), "found_inf": view(torch.float32, True)},
        {"grad_scale": view(torch.float32, True), "found_inf": view(torch.float32, False)},
    ]
    checked = CheckedKernel(lars._SQUARES_AND_RATES), CheckedKernel(lars._SCALE)
    lars._SQUARES_AND_RATES, lars._SCALE = checked
    calls = 0
    with _proxy.cuda_path_on_cpu():
        for dtype in (torch.float32, torch.float64, torch.float16):
            params = [torch.ones(3, dtype=dtype), torch.ones(2, 5, dtype=dtype)]
            grads = [torch.ones_like(p) for p in params]
            for setting in settings:
                arguments: dict[str, Any] = {
                    "threshold": 1e-2,
                    "weight_decay": 0.0,
                    "eps": 1e-9,
                    "trust_coefficient": 1.0,
                    "lr": None,
                    "clip": False,
                    "grad_scale": None,
                    "found_inf": None,
                }
                # Twice: the second call of a signature finds its kernels cached.
                for _ in range(2):
                    lars.lars_unit_(params, grads, **(arguments | setting))
                    calls += 1
    if any(kernel.hits < calls // 2 for kernel in checked):
        raise AssertionError(f"direct launches checked: {[k.hits for k in checked]} of {calls}")


def agc_direct_launches() -> None:
    """Every call signature of AGC's kernels launches, from its cache, the compiled kernel
    Triton's binder picks for its arguments (as :func:`lars_direct_launches`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _proxy

    def view(dtype: torch.dtype, aligned: bool) -> torch.Tensor:
        buffer = torch.ones(16, dtype=dtype)
        return buffer[16 // buffer.element_size() if aligned else 1].view(1)

    settings: list[dict[str, Any]] = [
        {},
        {"eps": 0.0},
        {"clipping": 5e-324, "eps": 1.0},
        {"grad_scale": view(torch.float32, True)},
        {"grad_scale": view(torch.float32, False)},
        {"grad_scale": view(torch.float64, True)},
        {"grad_scale": view(torch.float32, True), "found_inf": view(torch.float32, True)},
        {"grad_scale": view(torch.float32, True), "found_inf": view(torch.float32, False)},
    ]
    checked = CheckedKernel(agc._SQUARES_AND_FACTORS), CheckedKernel(agc._CLIP)
    agc._SQUARES_AND_FACTORS, agc._CLIP = checked
    calls = 0
    with _proxy.cuda_path_on_cpu():
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            params = [torch.ones(3, dtype=dtype), torch.ones(2, 5, dtype=dtype)]
            grads = [torch.ones_like(p) for p in params]
            for setting in settings:
                arguments: dict[str, Any] = {"clipping": 0.01, "eps": 1e-3}
                arguments |= {"grad_scale": None, "found_inf": None}
                for _ in range(2):
                    agc.agc_unit_(params, grads, **(arguments | setting))
                    calls += 1
    if any(kernel.hits < calls // 2 for kernel in checked):
        raise AssertionError(f"direct launches checked: {[k.hits for k in checked]} of {calls}")


def gc_direct_launches() -> None:
    """Every call signature of gradient centralization's kernels launches, from its cache,
    the compiled kernel Triton's binder picks (see :func:`lars_direct_launches`): each dtype,
    with rows of one chunk only (one launch, partials and means one kept tensor) and with a
    row of several (two launches, both fresh)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _proxy

    checked = CheckedKernel(gc._CENTRALIZE), CheckedKernel(gc._SUBTRACT_MEANS)
    gc._CENTRALIZE, gc._SUBTRACT_MEANS = checked
    with _proxy.cuda_path_on_cpu():
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for shapes in ([(3, 4), (2, 5, 3, 3)], [(3, 4), (2, gc._CHUNK + 1)]):
                grads = [torch.ones(shape, dtype=dtype) for shape in shapes]
                # Twice: the second call of a signature finds its kernels cached.
                for _ in range(2):
                    gc.centralize_unit_(grads)
    # Each kernel compiles once per dtype (the pointers are aligned alike), then is found: 16
    # first launches, 8 second ones (the calls with a long row).
    if [kernel.hits for kernel in checked] != [16 - 4, 8 - 4]:
        raise AssertionError(f"direct launches checked: {[k.hits for k in checked]}")


class RowKernel(NamedTuple):
    """A row kernel and what its arguments are: ``values`` point to the tensor's dtype,
    ``sums`` to its accumulator dtype, ``ints`` are sizes and strides."""

    fn: Any
    values: tuple[str, ...]
    sums: tuple[str, ...]
    ints: tuple[str, ...]
    flags: tuple[str, ...]
    first_launch: bool


WN_INTS = ("length", "count", "inner", "segment", "splits")
WS_INTS = ("length", "segment", "splits")
ROW_KERNELS = [
    RowKernel(wn._squares, ("v",), ("partials",), WN_INTS, ("row_is_contiguous",), True),
    RowKernel(
        wn._forward,
        ("v", "g", "w"),
        ("partials",),
        WN_INTS,
        ("row_is_contiguous", "split"),
        False,
    ),
    RowKernel(
        wn._products, ("grad_w", "v"), ("dots", "squares"), WN_INTS, ("row_is_contiguous",), True
    ),
    RowKernel(
        wn._backward,
        ("grad_w", "v", "g", "grad_v", "grad_g"),
        ("dots", "squares"),
        WN_INTS,
        ("row_is_contiguous", "split"),
        False,
    ),
    RowKernel(
        ws._moments, ("x",), ("sums", "squares"), (*WS_INTS, "x_row_stride", "x_stride"), (), True
    ),
    RowKernel(
        ws._forward,
        ("x", "gain", "y"),
        ("stats", "sums", "squares"),
        (*WS_INTS, "x_row_stride", "x_stride"),
        ("has_gain", "split"),
        False,
    ),
    RowKernel(
        ws._sums,
        ("grad_y", "x"),
        ("stats", "incoming_sums", "product_sums"),
        (*WS_INTS, "dy_row_stride", "dy_stride", "x_row_stride", "x_stride"),
        (),
        True,
    ),
    RowKernel(
        ws._backward,
        ("grad_y", "x", "gain", "grad_x", "grad_gain"),
        ("stats", "incoming_sums", "product_sums"),
        (*WS_INTS, "dy_row_stride", "dy_stride", "x_row_stride", "x_stride"),
        ("has_gain", "split"),
        False,
    ),
]


def build_row(
    kernel: RowKernel, dtype: str, setting: dict[str, bool], ints: str = "i32", **options: Any
) -> Any:
    a = "*fp64" if dtype == "fp64" else "*fp32"
    types = dict.fromkeys(kernel.values, "*" + dtype) | dict.fromkeys(kernel.sums, a)
    types |= dict.fromkeys(kernel.ints, ints) | {"eps": "i64", "factor": "i64"}
    split = setting.get("split", kernel.first_launch)
    constants: dict[str, Any] = {"acc": accumulator(dtype), "block": 1024, **setting}
    if "split" in kernel.flags:
        constants["partials_block"] = 128 if split else 1
    compiled = build(kernel.fn, types, constants, **options)
    if setting["wide"]:
        check_wide(compiled, f"{kernel.fn.__module__}.{kernel.fn.__name__} (wide, {ints} sizes)")
    return compiled


def row_kernels() -> None:
    for kernel in ROW_KERNELS:
        for dtype, setting in sweep((*kernel.flags, "wide")):
            build_row(kernel, dtype, setting)
        # 64-bit sizes: a row, or the tensor's extent, past 2**31.
        every = dict.fromkeys((*kernel.flags, "wide"), True)
        build_row(kernel, "fp32", every, ints="i64")
        build_row(kernel, "fp32", every, aligned=False)


def ones_kernels() -> None:
    """Every row kernel with each int argument that it lets be specialized equal to 1 (rows of
    one element, one row, unit strides, whole rows): the launcher makes those constants. A
    split row has two segments or more, of a block or more."""
    for kernel in ROW_KERNELS:
        for setting in flags((*kernel.flags, "wide")):
            split = setting.get("split", kernel.first_launch)
            names = {q.name for q in kernel.fn.params if not q.do_not_specialize}
            ones = tuple(
                name
                for name in kernel.ints
                if name in names and not (split and name in ("segment", "splits", "length"))
            )
            a = "*fp32"
            types = dict.fromkeys((*kernel.values, *kernel.sums), a)
            types |= dict.fromkeys(kernel.ints, "i32") | {"eps": "i64", "factor": "i64"}
            constants: dict[str, Any] = {"acc": tl.float32, "block": 16, **setting}
            if "split" in kernel.flags:
                constants["partials_block"] = 2 if split else 1
            build(kernel.fn, types, constants, ones=ones)


def fused_kernels() -> None:
    """The kernels that compute many layers in one launch, in every dtype: their tensors are
    found through int64 tables, and every offset is 64-bit."""
    tables = {"layers": "*i64", "row_layers": "*i64", "grads": "*i64"}
    for dtype in DTYPES:
        value = "*" + dtype
        a = "*fp64" if dtype == "fp64" else "*fp32"
        constants = {"dtype": DTYPES[dtype], "acc": accumulator(dtype), "block": 1024}
        constants["fields"] = 8
        kernels = [
            (wn._fused_forward, {"w": value}),
            (wn._fused_backward, {"grad_v": value, "grad_g": value}),
            (ws._fused_forward, {"y": value, "stats": a}),
            (ws._fused_backward, {"stats": a, "grad_x": value, "grad_gain": value}),
        ]
        for fn, pointers in kernels:
            types = {name: tables[name] for name in fn.arg_names if name in tables}
            compiled = build(fn, types | pointers, constants)
            check_wide(compiled, f"{fn.__module__}.{fn.__name__} ({dtype})")


def trust_ratio_kernels() -> None:
    """TrustRatio's three kernels, every flag on and off, in every dtype."""
    scalars = ("lr", "threshold", "eps", "trust_coefficient", "clip", "floor", "max_weight_norm")
    ratio_flags = ("lr_is_tensor", "has_eps", "has_trust", "has_clip", "has_floor", "has_max")
    sizes = {"block": 1024, "chunk_size": 32768}
    for fn, names, extra in (
        (tr._copy_squares, (), {"partials_block": 128}),
        (tr._update_squares_and_ratios, ratio_flags, {"partials_block": 128}),
        (tr._rescale, (), {}),
    ):
        for dtype, setting in sweep(names):
            a = "*fp64" if dtype == "fp64" else "*fp32"
            types = {**CHUNK_TABLE, "p_ptrs": "*i64", "offsets": "*i64", "olds": "*" + dtype}
            types |= dict.fromkeys(scalars, "i64")
            types |= dict.fromkeys(("partials", "squares", "w_squares", "ratios", "lr_tensor"), a)
            constants = {"dtype": DTYPES[dtype], "acc": accumulator(dtype), **sizes, **extra}
            kernel = build(fn, types, {**constants, **setting})
            check_wide(kernel, f"trust_ratio.{fn.__name__} ({dtype})")


def main() -> None:
    lars_kernels()
    trust_ratio_kernels()
    lars_direct_launches()
    agc_kernels()
    agc_direct_launches()
    gc_kernels()
    gc_direct_launches()
    row_kernels()
    ones_kernels()
    fused_kernels()


if __name__ == "__main__":
    main()
    sys.exit(0)
