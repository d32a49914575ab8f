"""Where an update hook keeps its units' old parameter values during a step."""

from __future__ import annotations

import torch
from torch import Tensor

from normhooks import _torch_compat as compat


class _Copies:
    """Where an update hook keeps a unit's old parameter values during a step: one flat buffer
    and a view of it shaped like each parameter.

    It is made for one device, dtype and list of shapes, and used again while the unit's
    parameters have them (:meth:`fits`); every step copies the values in afresh, so nothing
    of an earlier step is ever read. On the CPU the buffer is kept between steps: glibc would
    hand a block that large back to the system at each free, and the next step would fault
    every page in again. Elsewhere its memory goes back to the caching allocator after each
    step (the storage is resized to 0 and back, which keeps the views), so that between steps
    it costs none.
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

    def fits(self, tensors: list[Tensor]) -> bool:
        return _shapes(tensors) == self._shapes

    def hold(self, tensors: list[Tensor], foreach: bool | None) -> list[Tensor]:
        """Copies ``tensors`` in; returns the views holding them."""
        storage = self._flat.untyped_storage()
        if storage.nbytes() != self._bytes:
            storage.resize_(self._bytes)
        _copy_(self._views, tensors, foreach)
        return self._views

    def release(self) -> None:
        if not self._keep:
            self._flat.untyped_storage().resize_(0)


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
