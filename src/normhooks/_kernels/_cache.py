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
    """A tensor as something was computed from it: :func:`holds` tells whether it still is.

    Keeps the tensor's storage alive, so that an address equal to the one recorded is the
    same memory (a storage freed by a ``.data`` assignment cannot be reused under it).
    """

    __slots__ = ("address", "fields", "layout", "requires_grad", "storage", "tensor", "version")

    def __init__(self, tensor: Tensor, known: Layout | None = None) -> None:
        self.tensor = tensor
        self.version = tensor._version
        self.address = tensor.data_ptr()
        self.storage = tensor.untyped_storage()
        self.layout = layout(tensor) if known is None else known
        self.requires_grad = tensor.requires_grad
        self.fields = _fields(self)

    def holds(self, tensor: Tensor | None) -> bool:
        """Whether ``tensor`` is the tensor recorded, unchanged: same object, version, memory,
        layout and ``requires_grad``."""
        # One comparison of :func:`fields_of` (the served accesses inline it); the type of the
        # same object is checked by identity.
        return tensor is self.tensor and fields_of(tensor) == self.fields


Fields = tuple[int, int, tuple[int, ...], torch.Size, torch.dtype, torch.device, bool]


def fields_of(tensor: Tensor) -> Fields:
    """What :meth:`State.holds` compares of a tensor it kept by identity, in one tuple: its
    version, address, strides, shape, dtype, device and ``requires_grad`` (a served access
    builds the same tuple inline, see ``_served.Served``)."""
    return (
        tensor._version,
        tensor.data_ptr(),
        tensor.stride(),
        tensor.shape,
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
    )


def _fields(state: State) -> Fields:
    known = state.layout
    return (
        state.version,
        state.address,
        known[2],
        known[1],
        known[3],
        known[4],
        state.requires_grad,
    )


def taken_again(
    checks: list[tuple[tuple[Any, str, State], ...]],
) -> list[tuple[tuple[Any, str, State], ...]]:
    """Each check of each layer with its tensor's state now, where its layout is known to be
    the one recorded (a scope takes every original's state again, in one call)."""
    result = []
    for layer in checks:
        now_layer = []
        for owner, key, state in layer:
            tensor = state.tensor
            address = tensor.data_ptr()
            if address != state.address:
                now = State(tensor, state.layout)
            else:
                # The same address is the same memory (the storage kept alive holds it): the
                # storage object is taken over rather than asked of the tensor again, the
                # costly read.
                now = State.__new__(State)
                now.tensor = tensor
                now.version = tensor._version
                now.address = address
                now.storage = state.storage
                now.layout = known = state.layout
                now.requires_grad = tensor.requires_grad
                now.fields = (
                    now.version,
                    address,
                    known[2],
                    known[1],
                    known[3],
                    known[4],
                    now.requires_grad,
                )
            now_layer.append((owner, key, now))
        result.append(tuple(now_layer))
    return result


def holds(states: tuple[State, ...], tensors: tuple[Tensor | None, ...]) -> bool:
    """Whether every tensor is the one its state recorded, unchanged (see :class:`State`)."""
    return all(s.holds(t) for s, t in zip(states, tensors, strict=True))
