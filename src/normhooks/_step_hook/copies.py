"""Where an update hook keeps its units' old parameter values during a step."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._step_hook.norms import _CPU_ROW, _CPU_SHORT
from normhooks._step_hook.steady import Steady

# Values per piece of the CPU order (a multiple of _CPU_ROW): a piece stays in the last level
# of cache between the op that reads it from memory and the norm that reads it again, and
# pieces are few (each costs a handful of calls, at a few microseconds each).
_PIECE = 1024 * _CPU_ROW


class _Copies:
    """Where an update hook keeps a unit's old parameter values during a step: one flat buffer
    and a view of it shaped like each parameter.

    It is made for one device, dtype and list of shapes, and used again while the unit's
    parameters have them (:meth:`fits`, which a unit record that holds stands for); every step
    copies the values in afresh, so nothing of an earlier step is ever read. On the CPU the
    buffer is kept between steps: glibc would hand a block that large back to the system at
    each free, and the next step would fault every page in again. Elsewhere its memory goes
    back to the caching allocator after each step (the storage is resized to 0 and back, which
    keeps the views), so that between steps it costs none.
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self._shapes = _shapes(tensors)
        numels = [t.numel() for t in tensors]
        self._flat = torch.empty(sum(numels), dtype=tensors[0].dtype, device=tensors[0].device)
        self._bytes = self._flat.untyped_storage().nbytes()
        self._keep = self._flat.device.type == "cpu"
        self._views = [
            view.view(t.shape)
            for view, t in zip(torch.split(self._flat, numels), tensors, strict=True)
        ]
        self._pieces: _Pieces | None = None
        self._offsets: tuple[Tensor, int] | None = None
        # The unit record under which the parameters were last found to fit (see fits).
        self._fitted: Steady | None = None

    @property
    def views(self) -> list[Tensor]:
        return self._views

    def fits(self, tensors: list[Tensor], steady: Steady | None = None) -> bool:
        """Whether ``tensors`` have the device, dtype and shapes these copies were made for.

        ``steady``: the unit's record where it holds at this step, ``tensors`` being its
        parameters. A record that held at a step where they fitted stands for their shapes
        while it holds, so they are not read again under it.
        """
        if steady is not None and steady is self._fitted:
            return True
        fits = _shapes(tensors) == self._shapes
        self._fitted = steady if fits else None
        return fits

    def hold(self, tensors: list[Tensor], foreach: bool | None) -> list[Tensor]:
        """Copies ``tensors`` in; returns the views holding them."""
        self.buffer()  # its memory back if it was released
        _copy_(self._views, tensors, foreach)
        return self._views

    def buffer(self) -> Tensor:
        """The flat buffer (its memory back if it was released), for a kernel to copy into
        and read: the views hold each tensor's values one after the other, in order."""
        storage = self._flat.untyped_storage()
        if storage.nbytes() != self._bytes:
            storage.resize_(self._bytes)
        return self._flat

    def offsets(self) -> tuple[Tensor, int]:
        """Where each view starts in :meth:`buffer`, as an int64 tensor on its device (made
        at the first call, kept), and the buffer's size: for a kernel that finds the views
        through the buffer's address, which may change from step to step."""
        if self._offsets is None:
            if self._flat.is_cuda and torch.cuda.is_current_stream_capturing():
                # The graph would replay the copy below from freed host memory.
                raise RuntimeError(
                    "TrustRatio's Triton kernels meet these parameters for the first time "
                    "inside a CUDA-graph capture, where they cannot copy the offsets of the "
                    "old values to the device; run a step on the same parameters before "
                    "capturing"
                )
            starts = [0]
            for view in self._views:
                starts.append(starts[-1] + view.numel())
            on_device = torch.tensor(starts[:-1], dtype=torch.int64).to(self._flat.device)
            self._offsets = (on_device, starts[-1])
        return self._offsets

    def hold_with_norms(self, tensors: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Copies float32 CPU ``tensors`` in, each piece's norm taken while it is in cache;
        returns the views holding them and their norms (see :class:`_Pieces`)."""
        self.buffer()  # its memory back if it was released
        norms = self.pieces().norms_after_(tensors, Tensor.copy_, compat.foreach_copy_)
        return self._views, norms

    def release(self) -> None:
        if not self._keep:
            self._flat.untyped_storage().resize_(0)

    def pieces(self) -> _Pieces:
        """The CPU order's plan of these views (made at the first call, kept with them)."""
        if self._pieces is None:
            self._pieces = _Pieces(self._views)
        return self._pieces


def _shapes(tensors: list[Tensor]) -> tuple[object, ...]:
    return (tensors[0].device, tensors[0].dtype, *(t.shape for t in tensors))


def _fresh_copies(tensors: list[Tensor], foreach: bool | None) -> list[Tensor]:
    copies = [torch.empty_like(t) for t in tensors]
    _copy_(copies, tensors, foreach)
    return copies


def _copy_(targets: list[Tensor], sources: list[Tensor], foreach: bool | None) -> None:
    if foreach is False:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
    else:
        compat.foreach_copy_(targets, sources)


_PairOp = Callable[[Tensor, Tensor], object]
_ListOp = Callable[[list[Tensor], list[Tensor]], None]


class _Pieces:
    """Float32 CPU tensors ``olds`` (views of one contiguous buffer) cut into pieces of at
    most ``_PIECE`` values, for ops that take each piece's norm while it is in cache.

    Tensors of at most ``_CPU_SHORT`` values are taken together, in runs of at most ``_PIECE``
    values, by multi-tensor ops; longer ones piece by piece, their norms from float32 norms of
    rows of ``_CPU_ROW`` values whose squares are summed in float64: the rows, order and sums
    of :func:`~normhooks._step_hook.euclidean_norms`, so the norms are the same numbers. The
    views of ``olds`` each op and norm takes are made here, once: only the other tensors'
    are taken at each call.
    """

    def __init__(self, olds: list[Tensor]) -> None:
        numels = [t.numel() for t in olds]
        self.olds = olds
        self.count = len(numels)
        short = [i for i, n in enumerate(numels) if n <= _CPU_SHORT]
        self._runs: list[tuple[list[int], list[Tensor]]] = []
        total = 0
        for i in short:
            if not self._runs or total + numels[i] > _PIECE:
                self._runs.append(([], []))
                total = 0
            self._runs[-1][0].append(i)
            self._runs[-1][1].append(olds[i])
            total += numels[i]
        self.short = short
        self.short_index = torch.tensor(short, dtype=torch.long)
        long = [i for i, n in enumerate(numels) if n > _CPU_SHORT]
        self.long = long
        self.long_index = torch.tensor(long, dtype=torch.long)
        rows = sum(-(-numels[i] // _CPU_ROW) for i in long)
        self._rows = torch.empty(rows, dtype=torch.float32)
        # For each long tensor: its index, its rows' norms, and for each piece (start, end,
        # the piece, its whole rows and their norms' slots, its tail and the tail's slot).
        self._chunks: list[tuple[int, Tensor, list[_Piece]]] = []
        row = 0
        counts = []
        for i in long:
            flat = olds[i].view(-1)
            first = row
            chunks = []
            for start in range(0, numels[i], _PIECE):
                end = min(numels[i], start + _PIECE)
                whole = (end - start) // _CPU_ROW
                piece = flat[start:end]
                cut = whole * _CPU_ROW
                rows_view = piece[:cut].view(whole, _CPU_ROW) if whole else None
                row_slots = self._rows[row : row + whole]
                tail = piece[cut:] if cut < end - start else None
                tail_slot = self._rows[row + whole : row + whole + 1]
                chunks.append((start, end, piece, rows_view, row_slots, tail, tail_slot))
                row += whole + (tail is not None)
            self._chunks.append((i, self._rows[first:row], chunks))
            counts.append(row - first)
        self._owner = torch.repeat_interleave(
            torch.arange(len(long)), torch.tensor(counts, dtype=torch.long), output_size=rows
        )
        # Kept for the factors of a rescaling: views made once, not unbound at each step.
        self.factors = torch.empty(len(short), dtype=torch.float32)
        self.factor_views = list(self.factors.unbind(0))

    def norms_after_(self, others: list[Tensor], op: _PairOp, many: _ListOp) -> Tensor:
        """``op(olds[i], others[i])`` in place (``many`` on runs of short tensors), then the
        norms of the results, each piece's while in cache: one float32 norm per tensor.

        ``others`` may have any layout (a non-contiguous one takes ``op`` on its whole
        tensor, then the pieces' norms).
        """
        norms = torch.empty(self.count, dtype=torch.float32)
        if self.short:
            norms[self.short_index] = self.short_norms_after_(others, many)
        if self.long:
            for _ in self.long_rows_after_(others, op):
                pass
            squares = self._rows.double().square()
            sums = torch.zeros(len(self.long), dtype=torch.float64).index_add_(
                0, self._owner, squares
            )
            norms[self.long_index] = sums.sqrt().float()
        return norms

    def short_norms_after_(self, others: list[Tensor], many: _ListOp) -> Tensor:
        """:meth:`norms_after_` of the short tensors alone (in the order of ``short``)."""
        found: list[Tensor] = []
        for run, targets in self._runs:
            many(targets, [others[i] for i in run])
            found.extend(compat.foreach_norm(targets))
        return torch.stack(found)

    def long_rows_after_(self, others: list[Tensor], op: _PairOp) -> Iterator[tuple[int, Tensor]]:
        """:meth:`norms_after_` of the long tensors, one at a time: yields each one's index
        and the float32 norms of its rows once they are written, while the tensor is still
        in the last level of cache (the caller may work on it before the next is taken)."""
        vector_norm = torch.linalg.vector_norm
        olds = self.olds
        for i, own, chunks in self._chunks:
            other = others[i]
            pieces = other.is_contiguous()
            if pieces:
                other = other.view(-1)
            else:
                op(olds[i], other)
            for start, end, piece, rows_view, row_slots, tail, tail_slot in chunks:
                if pieces:
                    op(piece, other[start:end])
                if rows_view is not None:
                    vector_norm(rows_view, dim=1, out=row_slots)
                if tail is not None:
                    vector_norm(tail, dim=0, keepdim=True, out=tail_slot)
            yield i, own


_Piece = tuple[int, int, Tensor, Tensor | None, Tensor, Tensor | None, Tensor]
