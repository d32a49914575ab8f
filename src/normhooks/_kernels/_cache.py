"""What the speed path keeps across calls, and the one rule of whether a kept thing holds.

Every cache of the speed path is a :class:`KeyedCache`: a bounded mapping that drops its least
recently used entry when full. A cache is valid by construction when its key holds everything
its value was computed from (a kernel plan keyed by the tensors' :func:`layout` and the
settings; a table of addresses keyed by the addresses); what is kept by identity instead (a
weight served inside a forward, a fused backward's inputs) is checked against a
:func:`state` taken when it was computed, by :func:`holds`. That rule covers what can change
under a tensor without a new object: its version (any in-place op), its storage (a ``.data``
assignment, which keeps the tensor's identity and version), its shape, strides, dtype and
device (``model.double()``, ``p.data = p.data.contiguous(memory_format=...)``), and whether it
requires grad. Where a technique's inputs live (a gain as a Parameter or a buffer) is checked
by the caller, which keeps the dict it found each one in (see ``_members``).

What no rule here can see: a write into a tensor's values through ``.data`` (``p.data.mul_(2)``
bumps the version of the ``.data`` alias, not of ``p``). Outside a forward nothing is served,
so it is always seen; inside one, the speed path documents it (``docs/caching.md``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

K = TypeVar("K")
V = TypeVar("V")

# Entries a cache keeps unless it says otherwise: a model has a few dozen layouts; a process
# that keeps making new ones drops the oldest rather than grow.
DEFAULT_SIZE = 4096


class KeyedCache(Generic[K, V]):
    """A mapping of at most ``size`` entries that drops the least recently used one.

    A hit moves its entry to the most recent end; inserts (and evictions) take a lock, so
    threads (optimizer steps of models trained side by side) may share a cache; a hit needs
    none.
    """

    __slots__ = ("_entries", "_lock", "size")

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        entries = self._entries
        found = entries.get(key)
        if found is not None:
            # A try, not contextlib.suppress: a hit runs at every access of a layer's route.
            try:  # noqa: SIM105
                entries.move_to_end(key)
            except KeyError:  # dropped by another thread since: nothing to move
                pass
        return found

    def put(self, key: K, value: V) -> V:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        found = self.get(key)
        return self.put(key, make()) if found is None else found

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def values(self) -> list[V]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._entries))


# --- the validity rule ------------------------------------------------------------------------


Layout = tuple[type, torch.Size, tuple[int, ...], torch.dtype, torch.device]


def layout(tensor: Tensor) -> Layout:
    """What a kernel plan of ``tensor`` is computed from: its type, shape, strides, dtype and
    device (a plan keyed by these is never stale)."""
    return type(tensor), tensor.shape, tensor.stride(), tensor.dtype, tensor.device


class State:
    """A tensor as something was computed from it: :meth:`holds` tells whether it still is.

    Keeps the tensor's storage alive, so that an address equal to the one recorded is the
    same memory (a storage freed by a ``.data`` assignment cannot be reused under it).
    """

    __slots__ = ("fields", "storage", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        self.fields = fields_of(tensor)

    def holds(self, tensor: Tensor | None) -> bool:
        """Whether ``tensor`` is the tensor recorded, unchanged: same object, version, memory,
        type, layout and ``requires_grad``."""
        # One comparison of :func:`fields_of` (the served accesses inline it).
        return tensor is self.tensor and fields_of(tensor) == self.fields


# A served weight's validity check: the dict that holds a tensor it was computed from (a
# module's ``_parameters`` or ``_buffers``), its key, and the tensor's state then.
Check = tuple[dict[str, Any], str, State]


# What :meth:`State.holds` compares, in one flat tuple: a kept tensor's version, its address
# (a ``.data`` assignment changes the address, not the version), then what can change under
# it without a version either: its type, strides, shape, dtype, device (a ``.data``
# assignment) and whether it requires grad.
Fields = tuple[int, int, type, tuple[int, ...], torch.Size, torch.dtype, torch.device, bool]


def fields_of(tensor: Tensor) -> Fields:
    """A tensor's :data:`Fields` now (a served access builds the same tuple inline, see
    ``_served.Served``; a scope compares them one by one, see ``_members.holds``)."""
    return (
        tensor._version,
        tensor.data_ptr(),
        type(tensor),
        tensor.stride(),
        tensor.shape,
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
    )
