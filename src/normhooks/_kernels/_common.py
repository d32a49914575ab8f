"""What the kernels share: dtypes, exact scalar arguments, IEEE-rounded division and roots,
and how a row kernel's rows are spread over programs.

Loops whose bounds are known only at run time are written as ``while`` loops, not
``tl.range``: Triton's interpreter (``TRITON_INTERPRET=1``, which the CPU test suite runs)
turns a run-time ``tl.range`` bound into a Python int through a 1-element array, which
NumPy 2.4 refuses; a ``while`` condition only needs its truth value. Both compile alike.

Row kernels (weight normalization, weight standardization) index in 32 bits, the fast case,
unless a tensor reaches past :data:`INT32_SAFE`: then their ``wide`` variant computes every
offset in 64 bits. A layer of few long rows would run on few SMs with one program per row,
so :func:`row_plan` splits such rows into segments, one program each: a first launch writes
each segment's partial sums, the second adds a row's partial sums in a fixed order
(deterministic, no float atomics) and writes the segment.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from normhooks._kernels._cache import KeyedCache
from normhooks._precision import compute_dtype

TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype of ``dtype``; a clear error for any dtype the kernels do not cover."""
    try:
        return TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"the Triton kernels take float16, bfloat16, float32 or float64 tensors, got {dtype}"
        ) from None


def acc_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype the kernels compute ``dtype`` tensors in (float32 for halves)."""
    return TL_DTYPES[compute_dtype(dtype)]


def bits(value: float) -> int:
    """``value``'s float64 bit pattern, for :func:`as_float`.

    Triton passes a Python float as a float32 argument, which would round ``eps=1e-9`` before a
    float64 kernel sees it; the bits travel as an int64 (in ``do_not_specialize`` arguments) and
    are rounded once, to the kernel's compute dtype, as torch rounds a scalar operand.
    """
    pattern: int = struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return pattern


# Values a row kernel reads per loop step, at most.
MAX_BLOCK = 1024
# A row is split only while its layer has fewer rows than this (programs enough to fill an
# H100/H200 a few times over), and only into segments of at least this many values.
MIN_PROGRAMS = 512
MIN_SEGMENT = 16 * 1024
# 32-bit offsets are exact up to here: every element's offset, and a loop counter that runs a
# block of masked lanes past a row's end, stay below 2**31.
INT32_SAFE = 2**31 - 1 - 2 * MAX_BLOCK


class RowPlan(NamedTuple):
    """How a row kernel covers ``count`` rows of ``length`` values."""

    block: int
    """Values per loop step: a power of two, at least 16."""
    splits: int
    """Programs per row, each over one segment."""
    segment: int
    """Values per segment: a multiple of ``block``, or ``length`` when ``splits == 1``."""
    partials_block: int
    """``splits`` rounded up to a power of two: one load reads a row's partial sums."""
    wide: bool
    """Whether offsets need 64 bits."""


def row_plan(count: int, length: int, extent: int) -> RowPlan:
    """The plan for ``count`` rows of ``length`` values whose tensors reach ``extent`` slots
    (one past the largest offset). A function of the shape only, so a layer gets the same
    programs, and the same sums, on every GPU."""
    key = (count, length, extent, MAX_BLOCK, MIN_PROGRAMS, MIN_SEGMENT, INT32_SAFE)
    return _ROW_PLANS.get_or_make(key, lambda: _row_plan(*key))


# Row plans by every argument they are computed from: valid by construction.
_ROW_PLANS: KeyedCache[tuple[int, ...], RowPlan] = KeyedCache()


def _row_plan(
    count: int,
    length: int,
    extent: int,
    max_block: int,
    min_programs: int,
    min_segment: int,
    int32_safe: int,
) -> RowPlan:
    block = min(max_block, max(16, int(triton.next_power_of_2(max(length, 1)))))
    splits, segment = 1, length
    if count < min_programs and length >= 2 * min_segment:
        wanted = min(-(-length // min_segment), -(-min_programs // max(count, 1)))
        segment = -(-length // wanted)
        segment = -(-segment // block) * block
        splits = -(-length // segment)
        if splits == 1:
            segment = length
    partials_block = int(triton.next_power_of_2(splits))
    return RowPlan(block, splits, segment, partials_block, max(extent, length) > int32_safe)


def extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """One past the largest offset of a tensor of ``shape`` and ``strides`` (0 when empty)."""
    if 0 in shape:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))


def device_index(device: torch.device) -> int | None:
    """The CUDA device a kernel on ``device`` launches on; None for a device without one
    (CPU tensors under the interpreter or the host proxy)."""
    return device.index if device.type == "cuda" else None


class on_device:  # noqa: N801 (used as a context manager, like torch.cuda.device)
    """Launches on CUDA device ``index``: Triton launches on the current device. Switches only
    when ``index`` is another device than the current one, and switches back on leaving."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.previous: int | None = None

    def __enter__(self) -> None:
        if self.index is None:
            return
        current = torch.cuda.current_device()
        if current != self.index:
            torch.cuda.set_device(self.index)
            self.previous = current

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            torch.cuda.set_device(self.previous)


def current_stream(device: torch.device) -> int | None:
    """The raw id of the current stream on ``device`` (None off CUDA), as Triton reads it for
    each launch."""
    if device.type != "cuda":
        return None
    stream: int = triton.runtime.driver.active.get_current_stream(device.index)
    return stream


class DeviceTable:
    """Rows of int64 values (addresses, sizes, offsets) copied once to ``device``, for kernels
    that find their tensors through a table.

    Its content must be a function of the key it is cached under, so that a cached table is
    never stale. :meth:`use_on` makes it safe on whatever stream launches with it.
    """

    def __init__(self, rows: Sequence[Sequence[int]], device: torch.device) -> None:
        host = torch.tensor([x for row in rows for x in row], dtype=torch.int64)
        self.stream = current_stream(device)
        self.streams: set[int] = set()
        if device.type == "cuda":
            # Built once per key; a pinned copy does not wait for the device.
            host = host.pin_memory()
        self.storage = host.to(device, non_blocking=True)
        if device.type == "cuda":
            # What another stream waits for before its first launch with this table.
            self.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.ready.record()
        self.parts = torch.split(self.storage, [len(row) for row in rows])

    def use_on(self, stream: int | None) -> None:
        """Makes the table safe to launch with on the current stream (raw id ``stream``).

        On the stream that built it, stream order does it all. Another stream first waits
        for the table's copy, and is recorded on its memory: when the cache drops the table,
        torch's allocator reuses the block only once that stream's work so far is done.
        """
        if stream == self.stream or stream in self.streams:
            return
        current = torch.cuda.current_stream(self.storage.device)
        current.wait_event(self.ready)
        self.storage.record_stream(current)
        self.streams.add(stream)  # type: ignore[arg-type]


@triton.jit
def as_float(pattern, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    return pattern.to(tl.int64).to(tl.float64, bitcast=True).to(acc)


@triton.jit
def div(x, y, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    # Triton's float32 "/" may be an approximate division; torch's is rounded to nearest.
    if acc == tl.float32:
        return tl.div_rn(x, y)
    else:
        return x / y


@triton.jit
def sqrt(x, acc: tl.constexpr):  # type: ignore[no-untyped-def]
    if acc == tl.float32:
        return tl.sqrt_rn(x)
    else:
        return tl.sqrt(x)


@triton.jit
def is_finite(x):  # type: ignore[no-untyped-def]
    # NaN fails both comparisons; +-inf fails the second.
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def segment_bounds(length, segment, wide: tl.constexpr):  # type: ignore[no-untyped-def]
    """``[start, end)`` of this program's segment of its row (``tl.program_id(1)``)."""
    if wide:
        start = tl.program_id(1).to(tl.int64) * segment
        end = tl.minimum(start + segment, length)
    else:
        start = tl.program_id(1) * segment
        # min(start + segment, length) without forming start + segment, which can pass 2**31.
        end = tl.minimum(start, length - segment) + segment
    return start, end


@triton.jit
def row_partials(partials, row, splits, block: tl.constexpr):  # type: ignore[no-untyped-def]
    """The sum of a row's ``splits`` partial sums, added in the same order by every program."""
    index = tl.arange(0, block)
    values = tl.load(partials + row * splits + index, mask=index < splits, other=0.0)
    return tl.sum(values, axis=0)
