r"""Gradient centralization for every gradient of one device and dtype in one kernel launch, or two.

A description on the multi-tensor machinery of :mod:`normhooks._kernels._multi`: each row along
dim 0 cut into chunks of at most ``_CHUNK`` values, one program per chunk. A row of one chunk
(every row of ResNet-50's and ViT-B/16's weight gradients but ViT's position embedding) is its
program's alone: it sums the row, then reads it again, still in cache, and writes
:math:`g - \bar g`, with :math:`\bar g = \sum g / M` in the compute dtype. In a row of several
chunks the program that completes the row's sum (:func:`~normhooks._kernels._multi.row_sums`)
writes its mean, and a second launch, over the span of chunks that holds such rows, subtracts
it from each of their chunks: the second launch is made only where the tensors have such rows,
which their table says (a function of their shapes, so no value is read back to the host).
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels import _multi
from normhooks._kernels._cache import KeyedCache
from normhooks._kernels._common import acc_dtype, device_index, div, on_device
from normhooks._kernels._common import tl_dtype as _tl_dtype
from normhooks._kernels._launch import Kernel
from normhooks._kernels._multi import KernelFailedError, chunk_at, row_sums, tensor_at
from normhooks._precision import compute_dtype

# Values per program: a chunk is at most _CHUNK values of one row, read _BLOCK at a time.
_BLOCK = 1024
_CHUNK = 32 * _BLOCK
# Partial sums added at a time by the last program of a row of several chunks.
_PARTIALS_BLOCK = 128


@triton.jit
def _subtract(  # type: ignore[no-untyped-def]
    g, start, stop, mean, dtype: tl.constexpr, acc: tl.constexpr, block: tl.constexpr
):
    """``g[start:stop] -= mean``, computed in ``acc`` and rounded once to ``dtype``."""
    # See _common for why loops over run-time bounds are while loops.
    offset = start
    while offset < stop:
        index = offset + tl.arange(0, block)
        mask = index < stop
        values = tl.load(g + index, mask=mask, other=0.0).to(acc)
        tl.store(g + index, (values - mean).to(dtype), mask=mask)
        offset += block


@triton.jit
def _centralize(  # type: ignore[no-untyped-def]
    g_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    row_first_chunk,
    arrivals,
    partials,
    means,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    partials_block: tl.constexpr,
):
    chunk, tensor, row, start, stop = chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop)
    g = tensor_at(g_ptrs, tensor, dtype)
    sums = tl.zeros([block], dtype=acc)
    offset = start
    while offset < stop:
        index = offset + tl.arange(0, block)
        sums += tl.load(g + index, mask=index < stop, other=0.0).to(acc)
        offset += block
    total = tl.sum(sums, axis=0)
    low = tl.load(row_first_chunk + row)
    high = tl.load(row_first_chunk + row + 1)
    if high - low == 1:
        # An empty row's 0 / 0 is never written.
        _subtract(g, start, stop, div(total, (stop - start).to(acc), acc), dtype, acc, block)
    else:
        # row_sums takes two sums; the second is unused here.
        last, total, _ = row_sums(
            total, total, chunk, row, row_first_chunk, arrivals, partials, acc, partials_block
        )
        if last:
            length = tl.load(chunk_stop + high - 1) - tl.load(chunk_start + low)
            tl.store(means + row, div(total, length.to(acc), acc))


_CENTRALIZE = Kernel(_centralize)


@triton.jit(do_not_specialize=["first"])
def _subtract_means(  # type: ignore[no-untyped-def]
    g_ptrs,
    chunk_tensor,
    chunk_row,
    chunk_start,
    chunk_stop,
    row_first_chunk,
    means,
    first,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
):
    # One program per chunk from chunk ``first`` on (the table's ``long_rows``).
    _, tensor, row, start, stop = chunk_at(
        chunk_tensor + first, chunk_row + first, chunk_start + first, chunk_stop + first
    )
    # Rows of one chunk were written by the first launch.
    if tl.load(row_first_chunk + row + 1) - tl.load(row_first_chunk + row) > 1:
        g = tensor_at(g_ptrs, tensor, dtype)
        _subtract(g, start, stop, tl.load(means + row), dtype, acc, block)


_SUBTRACT_MEANS = Kernel(_subtract_means)


class _Variants(NamedTuple):
    """What a call signature of :func:`centralize_unit_` launches with."""

    first: dict[Any, Any]
    """The compiled variants of ``_centralize``, by pointer alignment (see _launch.Kernel)."""
    second: dict[Any, Any]
    """Those of ``_subtract_means``."""
    unused: Tensor
    """Where no row has several chunks, the kernel never touches partials or means: this
    tensor stands for both, so that such a call (every call for most models) allocates
    nothing."""


# By everything Triton specializes both kernels on except the alignment of the pointers that
# _launch.Kernel checks at each launch: the device, the dtype (which fixes the accumulator's,
# that of partials and means) and the constexprs. Their one int argument, the second's
# first chunk, is not specialized on, and always fits 32 bits (2**31 chunks would need a
# table of 2**31 rows).
_variants: KeyedCache[tuple[object, ...], _Variants] = KeyedCache()


def centralize_unit_(
    grads: list[Tensor],
    kept: dict[object, object] | None = None,
    allowed: Callable[[Tensor], bool] | None = None,
) -> None:
    r"""Centralizes each of ``grads`` in place along dim 0, in one launch (two where a row spans
    several chunks): every row :math:`G_i` becomes :math:`G_i - \frac{1}{M} \sum_j G_{i,j}`.

    The mean is computed in the compute dtype (float32 for float16/bfloat16) and the result
    rounded once, as the plain formula does; a tensor of fewer than two dimensions is one row.
    No host synchronization; the table of addresses is built on first use of a set of tensors
    and reused while they keep their addresses and shapes (see
    :func:`normhooks._kernels._multi.table`, which also says what happens under CUDA-graph
    capture). Tensors whose rows are not runs of memory (a transposed gradient) go through
    contiguous copies, copied back.

    Args:
        grads: the gradients, all of one device and floating dtype.
        kept: where the caller keeps what is built for exactly these tensors, or None (see
            :func:`normhooks._kernels._multi.prepared`).
        allowed: whether the kernels may run on a tensor (the package's ``available``), for
            the launch's replay kept in ``kept`` (:class:`~normhooks._kernels._multi.Replay`);
            None keeps none.

    Raises:
        KernelFailedError: the kernel failed to compile or launch, before writing a value.
    """
    if not grads:
        return
    device, dtype = grads[0].device, grads[0].dtype
    with on_device(device_index(device)):
        captured = _multi.capturing(device)
        (grads,), (copied,), table = _multi.prepared(
            [grads], ("grads",), _multi.DIM0, _CHUNK, captured, "gradient centralization", kept
        )
        acc = compute_dtype(dtype)
        variants = _variants.get_or_make(
            (device, dtype, _BLOCK, _PARTIALS_BLOCK),
            lambda: _Variants({}, {}, torch.empty(2, dtype=acc, device=device)),
        )
        _run(table, variants, dtype)
        _multi.keep_replay(
            kept,
            not copied and not captured,
            table,
            grads[0],
            lambda lr: _run(table, variants, dtype),
            allowed,
        )
    for grad, copy in copied:
        grad.copy_(copy)


def _run(table: _multi.ChunkTable, variants: _Variants, dtype: torch.dtype) -> None:
    """The scratch of :func:`centralize_unit_` made where rows span chunks, then its
    launches."""
    partials = means = variants.unused
    if table.long_rows[1]:
        acc = compute_dtype(dtype)
        device = table.storage.device
        partials = torch.empty(2 * table.chunks, dtype=acc, device=device)
        means = torch.empty(table.rows, dtype=acc, device=device)
    try:
        _launch(table, partials, means, variants, dtype)
    except Exception as error:
        # The caller computes the plain formula (normhooks._kernels.centralize_unit_).
        # A failure comes before the first write, or between the launches: then the rows
        # of one chunk are centralized twice, a projection, the same up to rounding.
        raise KernelFailedError(error) from error


def _launch(
    table: _multi.ChunkTable,
    partials: Tensor,
    means: Tensor,
    variants: _Variants,
    dtype: torch.dtype,
) -> None:
    """The launches of :func:`centralize_unit_`."""
    grid = (table.chunks, 1)
    index = device_index(table.storage.device)
    dtype_tl = _tl_dtype(dtype)
    _CENTRALIZE(
        variants.first,
        grid,
        index,
        (table.storage, partials, means),
        *table.located,
        table.row_first_chunk,
        table.arrivals,
        partials,
        means,
        dtype_tl,
        acc_dtype(dtype),
        _BLOCK,
        _PARTIALS_BLOCK,
    )
    first, count = table.long_rows
    if count:
        _SUBTRACT_MEANS(
            variants.second,
            (count, 1),
            index,
            (table.storage, means),
            *table.located,
            table.row_first_chunk,
            means,
            first,
            dtype_tl,
            acc_dtype(dtype),
            _BLOCK,
        )
