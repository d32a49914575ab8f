"""Where an update hook keeps its units' old parameter values during a step."""

from __future__ import annotations

import torch
from torch import Tensor

from normhooks import _torch_compat as compat
from normhooks._step_hook.norms import _CPU_ROW
from normhooks._step_hook.steady import Steady


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

    Float32 copies on the CPU start each view at a multiple of ``_CPU_ROW`` values (at most
    ``_CPU_ROW - 1`` values of padding per parameter), and the padding is zeros that nothing
    writes (every op and kernel writes the views only; the CPU's buffer is never released,
    whose memory would come back unzeroed): :class:`_Rows` reads the buffer whole as rows of
    one view each. Other copies lie one after the other.
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self._shapes = _shapes(tensors)
        numels = [t.numel() for t in tensors]
        device, dtype = tensors[0].device, tensors[0].dtype
        # The copies the CPU order reads as rows (see in_rows_order).
        self._in_rows = device.type == "cpu" and dtype == torch.float32
        if self._in_rows:
            # Each view starts at a multiple of _CPU_ROW values, the padding zero and never
            # written (only the views are): the buffer is then rows of one view each (_Rows).
            spans = [-(-n // _CPU_ROW) * _CPU_ROW for n in numels]
            self._flat = torch.zeros(sum(spans), dtype=dtype, device=device)
        else:
            spans = numels
            self._flat = torch.empty(sum(spans), dtype=dtype, device=device)
        self._bytes = self._flat.untyped_storage().nbytes()
        self._keep = self._flat.device.type == "cpu"
        self._views = [
            part[:n].view(t.shape)
            for part, n, t in zip(torch.split(self._flat, spans), numels, tensors, strict=True)
        ]
        self._rows: _Rows | None = None
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
        and read: the views hold each tensor's values in order, each from its offset
        (:meth:`offsets`)."""
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
            starts = [view.storage_offset() for view in self._views]
            on_device = torch.tensor(starts, dtype=torch.int64).to(self._flat.device)
            self._offsets = (on_device, self._flat.numel())
        return self._offsets

    def hold_with_norms(self, tensors: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Copies float32 CPU ``tensors`` in (one multi-tensor call); returns the views
        holding them and their norms (:meth:`_Rows.norms`)."""
        self.buffer()  # its memory back if it was released
        compat.foreach_copy_(self._views, tensors)
        return self._views, self.rows().norms()

    def release(self) -> None:
        if not self._keep:
            self._flat.untyped_storage().resize_(0)

    def rows(self) -> _Rows:
        """The CPU order's rows of the buffer of float32 CPU copies (made at the first call,
        kept with them)."""
        assert self._in_rows, "only float32 CPU copies are laid out in rows"
        if self._rows is None:
            self._rows = _Rows(self._flat, self._views)
        return self._rows


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


class _Rows:
    """A :class:`_Copies` buffer of float32 CPU values read as rows of ``_CPU_ROW`` values,
    each of one view (every view starts a row; the padding after it is zero): the norms of
    all the views in one call over the whole buffer.

    Each row's float32 norm, the squares added per view in float64: the rows of
    :func:`~normhooks._step_hook.euclidean_norms` for a long tensor (its tail row padded with
    zeros), within 1e-6 of float64 for any length, short tensors included. The buffer is one
    pass over memory per call, where norms tensor by tensor would be a few calls per tensor.
    """

    def __init__(self, flat: Tensor, views: list[Tensor]) -> None:
        self._rows = flat.view(-1, _CPU_ROW)
        counts = torch.tensor([-(-v.numel() // _CPU_ROW) for v in views], dtype=torch.long)
        self._owner = torch.repeat_interleave(
            torch.arange(len(views)), counts, output_size=self._rows.shape[0]
        )
        self._row_norms = torch.empty(self._rows.shape[0], dtype=torch.float32)
        self._sums = torch.empty(len(views), dtype=torch.float64)
        # Kept for the factors of a rescaling: views made once, not unbound at each step.
        self.factors = torch.empty(len(views), dtype=torch.float32)
        self.factor_views = list(self.factors.unbind(0))

    def norms(self) -> Tensor:
        """Each view's Euclidean norm as it holds now, in float32 (a new tensor)."""
        torch.linalg.vector_norm(self._rows, dim=1, out=self._row_norms)
        squares = self._row_norms.double().square()
        return self._sums.zero_().index_add_(0, self._owner, squares).sqrt().float()
