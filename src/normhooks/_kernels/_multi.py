r"""Many tensors in a few launches: the table of addresses that every multi-tensor kernel uses.

A multi-tensor kernel (LARS, AGC, TrustRatio, gradient centralization) takes several lists of
tensors of one device and dtype (LARS: the parameters and their gradients) and finds them
through one table of their addresses, so a launch covers every tensor whatever their number.
Each tensor is cut into rows of equal length, and each row into chunks of at most ``chunk``
values; one program runs per chunk. A row is the whole tensor (:data:`WHOLE`: LARS's and the
trust ratio's norms) or one slice along dim 0 (:data:`DIM0`: AGC's unit-wise norms and
gradient centralization's means; a tensor of fewer than two dimensions is one row).

Reductions: a row of one chunk is reduced by its program alone; in a row of several, each
program writes its partial sums and counts itself in with an integer atomic, and the one that
arrives last adds the row's partial sums in a fixed order, so the result is deterministic, with
no float atomics, and each partial sum is read once (:func:`row_sums`). A second launch over the
same chunks then writes each value with its row's result.

A table's content is a function of its key (device, dtype, chunk size, how rows are cut, the
tensors' sizes or, for rows along dim 0, shapes, and their addresses), so a table found in the
cache is never stale: a tensor that moves or changes size makes a new key. That is the whole
validity rule of what this module keeps, with two additions: a launch that fails drops every
table (:func:`drop_tables`, called by ``normhooks._kernels._guarded``): one stopped part way
may have left a row's count of arrived programs above zero, which a later launch must not
find; and a caller that can prove its lists unchanged (a step hook's unit record) keeps their
table itself, to find it without building the key (:func:`prepared`), and may keep the
launches an entry made on them to make again without the entry's per-call work
(:class:`Replay`).
Tensors whose rows are not laid out as the kernels read them go through contiguous copies
(:func:`laid_out`), and their tables are made again at every call.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, cast

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels._cache import KeyedCache
from normhooks._kernels._common import DeviceTable, current_stream, device_index, on_device
from normhooks._kernels._common import tl_dtype as _tl_dtype
from normhooks._step_hook.steady import REPLAY

# How a tensor is cut into rows.
WHOLE = "whole"
DIM0 = "dim0"
# Tables kept for this many distinct sets of tensors (an optimizer has one per device, dtype
# and param group, for each hook; a few more cover models trained side by side).
CACHE_SIZE = 64

_shape = attrgetter("shape")


class KernelFailedError(Exception):
    """A multi-tensor kernel failed to compile or launch (``error``) before writing a value."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def drop_tables() -> None:
    """Drops every table (not those a CUDA graph captured, which its replays read): after a
    launch that failed, which may have stopped part way and left a row's count of arrived
    programs above zero. Tables kept by callers (:func:`prepared`) are dropped with them."""
    global _generation
    _generation += 1
    _tables.clear()


def row_count(shape: torch.Size, rows: str) -> int:
    """How many rows a tensor of ``shape`` is cut into (at least one: an empty tensor still has
    its row, whose result the kernel writes)."""
    if rows == DIM0 and len(shape) >= 2:
        return max(1, shape[0])
    return 1


class ChunkTable(DeviceTable):
    """Addresses of several lists of tensors, their rows and their chunks, on their device.

    Attributes (1-D int64 views of the device table):
        pointers: one row of addresses per list, one per tensor.
        chunk_tensor, chunk_row, chunk_start, chunk_stop: for each chunk, its tensor, its row
            (numbered over all tensors), and the offsets in its tensor of its first value and
            one past its last.
        row_first_chunk: for each row, its first chunk, then one past the last chunk.
        arrivals: for each row, how many of its programs have written their partial sums; the
            last one resets it, so the table leaves every launch as it found it.
        chunks, rows: how many of each (the grid's size, the number of results).
        long_rows: ``(first, count)``, the span of chunks that holds every row of several
            chunks (``count`` 0 where there is none), for a launch over those rows only.
    """

    def __init__(self, lists: Sequence[Sequence[Tensor]], rows: str, chunk: int) -> None:
        chunk_tensor: list[int] = []
        chunk_row: list[int] = []
        chunk_start: list[int] = []
        chunk_stop: list[int] = []
        row_first_chunk = [0]
        long_first, long_stop = 0, 0
        for index, tensor in enumerate(lists[0]):
            count = row_count(tensor.shape, rows)
            length = tensor.numel() // count
            for row in range(count):
                begin, end = row * length, (row + 1) * length
                first = len(chunk_tensor)
                # An empty row still gets one chunk, so its result is written.
                for start in range(begin, max(end, begin + 1), chunk):
                    chunk_tensor.append(index)
                    chunk_row.append(len(row_first_chunk) - 1)
                    chunk_start.append(start)
                    chunk_stop.append(min(start + chunk, end))
                row_first_chunk.append(len(chunk_tensor))
                if len(chunk_tensor) - first > 1:
                    long_first = first if long_stop == 0 else long_first
                    long_stop = len(chunk_tensor)
        self.chunks = len(chunk_tensor)
        self.rows = len(row_first_chunk) - 1
        self.long_rows = (long_first, long_stop - long_first)
        table = [
            *[[t.data_ptr() for t in tensors] for tensors in lists],
            chunk_tensor,
            chunk_row,
            chunk_start,
            chunk_stop,
            row_first_chunk,
            [0] * self.rows,
        ]
        # Rows of even length: every part lies a multiple of 16 bytes from the storage's
        # start, so the storage's alignment (what Triton specializes a pointer on) is theirs.
        super().__init__([row + [0] * (len(row) % 2) for row in table], lists[0][0].device)
        parts = [part[: len(row)] for part, row in zip(self.parts, table, strict=True)]
        self.pointers = parts[: len(lists)]
        (
            self.chunk_tensor,
            self.chunk_row,
            self.chunk_start,
            self.chunk_stop,
            self.row_first_chunk,
            self.arrivals,
        ) = parts[len(lists) :]

    @property
    def located(self) -> tuple[Tensor, ...]:
        """Each list's addresses, then where each chunk lies: the arguments every kernel on the
        table takes first (``chunk_at``, ``tensor_at``)."""
        return (
            *self.pointers,
            self.chunk_tensor,
            self.chunk_row,
            self.chunk_start,
            self.chunk_stop,
        )

    def use_on(self, stream: int | None, capturing: bool = False) -> None:
        """Makes the table safe to launch with on the current stream (see
        :meth:`DeviceTable.use_on`). Under CUDA-graph capture the graph keeps the table's
        addresses for every replay, so the table is kept for the life of the process (a
        waiting stream cannot be captured; torch.cuda.graph synchronizes the device before
        capturing, so the copy is done).
        """
        if capturing:
            with _lock:
                if all(kept is not self for kept in _kept):
                    _kept.append(self)
            return
        super().use_on(stream)


# The tables by everything their content is a function of (device, dtype, chunk size, how rows
# are cut, the tensors' shapes and addresses): valid by construction. Shared by optimizer steps
# in several threads (one model per thread), which KeyedCache allows.
_tables: KeyedCache[tuple[object, ...], ChunkTable] = KeyedCache(CACHE_SIZE)
# Tables that a CUDA graph captured: never dropped, since any replay reads them (the one kept
# set outside a KeyedCache: its entries are pinned for the process, not evicted).
_kept: list[ChunkTable] = []
_lock = threading.Lock()
# How many times drop_tables has run: a table a caller keeps (prepared's ``kept``) is used
# only in the generation it was made in.
_generation = 0


def capturing(device: torch.device) -> bool:
    """Whether the current stream (of the current device) is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def table(
    lists: Sequence[Sequence[Tensor]],
    names: Sequence[str],
    rows: str,
    chunk: int,
    captured: bool,
    technique: str,
) -> ChunkTable:
    """The table of ``lists`` (tensors of one device and dtype, of equal shapes at each
    position; ``names`` for errors), made on first use and found again while shapes and
    addresses stay.

    ``captured``: whether a CUDA graph is being captured (see :func:`capturing`), where a table
    is never made (the graph would replay its copy from freed host memory).
    """
    first = lists[0]
    device = first[0].device
    # Whole rows depend on the sizes alone (a view of the same memory is the same row); rows
    # along dim 0 on the shapes.
    sizes = tuple(map(Tensor.numel if rows == WHOLE else _shape, first))
    key = (
        device,
        first[0].dtype,
        chunk,
        rows,
        sizes,
        *[tuple(map(Tensor.data_ptr, tensors)) for tensors in lists],
    )
    found = _tables.get(key)
    if found is None:
        if captured:
            raise RuntimeError(
                f"{technique}'s Triton kernel meets these tensors for the first time inside a "
                "CUDA-graph capture, where it cannot build their table of addresses (the "
                "graph would replay its copy from freed host memory). Run a step on the same "
                "tensors before capturing, and keep the gradients where they are: clear them "
                "with optimizer.zero_grad(set_to_none=False), inside the captured step too, "
                "since gradients set to None are reallocated inside the capture. Parameters "
                "or gradients that are not dense are copied at every step, so cannot be "
                "captured with the kernel."
            )
        # Checked once per set of tensors: a set found again by address and shape has passed.
        check(lists, names)
        found = _tables.put(key, ChunkTable(lists, rows, chunk))
    found.use_on(current_stream(device), captured)
    return found


def prepared(
    lists: Sequence[list[Tensor]],
    names: Sequence[str],
    rows: str,
    chunk: int,
    captured: bool,
    technique: str,
    kept: dict[object, object] | None,
) -> tuple[list[list[Tensor]], list[list[tuple[Tensor, Tensor]]], ChunkTable]:
    """``lists`` laid out (:func:`laid_out`: the lists, and each one's (original, copy)
    pairs) and their table (:func:`table`).

    ``kept``: a dict the caller keeps for exactly these lists, valid while every tensor of
    them keeps its layout and address (a step hook's unit record, ``steady.Steady.kept``,
    which clears it otherwise), or None. Lists that needed no copy keep their table there, and
    a later call finds it without reading a tensor: while those hold, the table's key (shapes
    and addresses) is the same. A table kept before :func:`drop_tables` is not used again.
    """
    if kept is not None:
        entry = kept.get((rows, chunk, len(lists)))
        if entry is not None:
            generation, found = cast(tuple[int, ChunkTable], entry)
            if generation == _generation:
                found.use_on(current_stream(found.storage.device), captured)
                return list(lists), [[] for _ in lists], found
    laid, copied = laid_out(lists, names, rows)
    made = table(laid, names, rows, chunk, captured, technique)
    if kept is not None and not any(copied):
        kept[(rows, chunk, len(lists))] = (_generation, made)
    return laid, copied, made


class Replay:
    """The launches a kernel entry just made on the tensors that a caller's ``kept`` stands
    for (:func:`prepared`), made again by calling it, without the entry's per-call work:
    ``replay(lr)`` returns what the entry returned, for the same arguments but ``lr``.

    An entry leaves one in ``kept`` under ``REPLAY`` (``normhooks._step_hook.steady``)
    only where it copied no tensor of any list (its table then points at the tensors
    themselves, and :func:`prepared` kept it), was given no GradScaler argument, was not
    capturing a CUDA graph, and took no float ``lr`` into the launch's constants. What makes
    it valid:

    - the caller's proof that the tensors are as they were: a step hook's unit record that
      holds (its ``kept`` is cleared where a gradient moved);
    - the same arguments but ``lr``, which the caller checks: a technique's settings object,
      and an ``lr`` of the same kind (a float, a tensor or None);
    - :meth:`holds`, at each call: the tables' generation it was made in
      (:func:`drop_tables`), no capture on the tensors' device, and the kernels still allowed
      on these tensors (``allowed``, the package's ``available``: switched on, not broken,
      the CPU routed where they are CPU tensors, plain eager code).
    """

    __slots__ = ("_allowed", "_generation", "_launch", "_probe", "_table")

    def __init__(
        self,
        table: ChunkTable,
        probe: Tensor,
        launch: Callable[[Any], Tensor | None],
        allowed: Callable[[Tensor], bool],
    ) -> None:
        self._generation = _generation
        self._table = table
        self._probe = probe
        self._launch = launch
        self._allowed = allowed

    def holds(self) -> bool:
        device = self._probe.device
        with on_device(device_index(device)):  # capture is a property of that device's stream
            captured = capturing(device)
        return self._generation == _generation and not captured and self._allowed(self._probe)

    def __call__(self, lr: Any) -> Tensor | None:
        table = self._table
        table.use_on(current_stream(table.storage.device))
        try:
            return self._launch(lr)
        except KernelFailedError as failure:
            # The same launches ran at the last step: a failure now is the device's, after
            # other units may have been done. Raised, never computed again by the formula.
            drop_tables()
            raise failure.error from None


def keep_replay(
    kept: dict[object, object] | None,
    replayable: bool,
    table: ChunkTable,
    probe: Tensor,
    launch: Callable[[Any], Tensor | None],
    allowed: Callable[[Tensor], bool] | None,
) -> None:
    """Leaves in ``kept`` (an entry's, see :func:`prepared`) the :class:`Replay` of the
    launches just made, or None where they are not ``replayable`` or no ``allowed`` (the
    package's check that the kernels may run on a tensor) was given."""
    if kept is not None:
        kept[REPLAY] = (
            Replay(table, probe, launch, allowed) if replayable and allowed is not None else None
        )


def check(lists: Sequence[Sequence[Tensor]], names: Sequence[str]) -> None:
    """One device and dtype, a dtype the kernels take, equal shapes at each position (the lists
    pair up: :func:`laid_out` says so first)."""
    first = lists[0]
    device, dtype = first[0].device, first[0].dtype
    _tl_dtype(dtype)
    for index, reference in enumerate(first):
        for tensors, name in zip(lists, names, strict=True):
            tensor = tensors[index]
            if tensor.device != device or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}[{index}] is a {tensor.dtype} tensor on {tensor.device}; one call "
                    f"takes tensors of one device and dtype ({dtype} on {device})"
                )
            if tensor.shape != reference.shape:
                raise ValueError(
                    f"{name}[{index}] has shape {list(tensor.shape)}, but {names[0]}[{index}] "
                    f"has shape {list(reference.shape)}"
                )


def _dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s values fill ``numel`` slots from its first address, once each."""
    if tensor.is_contiguous():
        return True
    expected = 1
    pairs = zip(tensor.stride(), tensor.shape, strict=True)
    for stride, size in sorted((stride, size) for stride, size in pairs if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _readable(tensor: Tensor, rows: str) -> bool:
    """Whether the kernels can read ``tensor``'s rows as runs of slots from its first address:
    dense, and with :data:`DIM0` rows, dim 0 outermost (each row one run of its length)."""
    if not _dense(tensor):
        return False
    if rows == DIM0 and tensor.ndim >= 2 and tensor.shape[0] > 1:
        return tensor.stride(0) == tensor.numel() // tensor.shape[0]
    return True


def laid_out(
    lists: Sequence[list[Tensor]], names: Sequence[str], rows: str
) -> tuple[list[list[Tensor]], list[list[tuple[Tensor, Tensor]]]]:
    """``lists`` as the kernels can read them, and for each list its (original, copy) pairs;
    ``names`` for the error where the lists do not pair up.

    At each position the tensors of every list must be laid out alike (a value is found at the
    same offset in each) and readable (:func:`_readable`); where not, each list's tensor there
    is replaced by a contiguous copy. The caller copies back the copies of the lists its
    kernel writes.
    """
    for tensors, name in zip(lists[1:], names[1:], strict=True):
        if len(tensors) != len(lists[0]):
            raise ValueError(
                f"{names[0]} and {name} must pair up, got {len(lists[0])} {names[0]} and "
                f"{len(tensors)} {name}"
            )
    copied: list[list[tuple[Tensor, Tensor]]] = [[] for _ in lists]
    if all(all(map(Tensor.is_contiguous, tensors)) for tensors in lists):
        return [list(tensors) for tensors in lists], copied
    result = [list(tensors) for tensors in lists]
    for index, reference in enumerate(lists[0]):
        column = [tensors[index] for tensors in lists]
        if _readable(reference, rows) and all(t.stride() == reference.stride() for t in column):
            continue
        for copies, pairs, tensor in zip(result, copied, column, strict=True):
            copies[index] = tensor.contiguous()
            if copies[index] is not tensor:
                pairs.append((tensor, copies[index]))
    return result, copied


@triton.jit
def chunk_at(chunk_tensor, chunk_row, chunk_start, chunk_stop):  # type: ignore[no-untyped-def]
    """This program's chunk: its index, its tensor, its row, and ``[start, stop)`` in its
    tensor."""
    chunk = tl.program_id(0).to(tl.int64)
    return (
        chunk,
        tl.load(chunk_tensor + chunk),
        tl.load(chunk_row + chunk),
        tl.load(chunk_start + chunk),
        tl.load(chunk_stop + chunk),
    )


@triton.jit
def tensor_at(pointers, tensor, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """The address of tensor ``tensor`` of a list, as a pointer to ``dtype``."""
    return tl.load(pointers + tensor).to(tl.pointer_type(dtype))


@triton.jit
def row_sums(  # type: ignore[no-untyped-def]
    a,
    b,
    chunk,
    row,
    row_first_chunk,
    arrivals,
    partials,
    acc: tl.constexpr,
    partials_block: tl.constexpr,
):
    """Whether this program completes its row, and then the row's two sums from every chunk's
    ``a`` and ``b`` (``partials``: two values per chunk of the launch, in ``acc``).

    A program alone in its row has its sums already. In a row of several chunks, every program
    writes its sums and counts itself in; the one that arrives last adds the row's partial sums
    in chunk order and resets the count for the next launch.
    """
    low = tl.load(row_first_chunk + row)
    high = tl.load(row_first_chunk + row + 1)
    last = high - low == 1
    if high - low > 1:
        tl.store(partials + 2 * chunk, a)
        tl.store(partials + 2 * chunk + 1, b)
        # Every thread's store is done before the release below publishes them to the
        # program that arrives last; that one's acquire makes them visible to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + row, 1, sem="acq_rel")
        last = arrived == high - low - 1
        if last:
            # See _common for why loops over run-time bounds are while loops.
            a_sums = tl.zeros([partials_block], dtype=acc)
            b_sums = tl.zeros([partials_block], dtype=acc)
            first = low
            while first < high:
                index = first + tl.arange(0, partials_block)
                mask = index < high
                a_sums += tl.load(partials + 2 * index, mask=mask, other=0.0)
                b_sums += tl.load(partials + 2 * index + 1, mask=mask, other=0.0)
                first += partials_block
            a = tl.sum(a_sums, axis=0)
            b = tl.sum(b_sums, axis=0)
            # Every other program of the row has arrived: the count is free for the next
            # launch, which finds it at zero.
            tl.store(arrivals + row, 0)
    return last, a, b
