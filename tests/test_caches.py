"""The speed path's one cache type and its one validity rule (normhooks._kernels._cache)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from normhooks._kernels._cache import KeyedCache, State


def test_cache_drops_the_entry_used_least_recently() -> None:
    cache: KeyedCache[str, int] = KeyedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert list(cache) == ["a", "c"]
    assert cache.get("b") is None


def test_cache_makes_a_missing_value_once() -> None:
    cache: KeyedCache[str, list[int]] = KeyedCache(4)
    made = cache.get_or_make("a", lambda: [1])
    assert cache.get_or_make("a", lambda: [2]) is made
    assert len(cache) == 1


def test_cache_never_holds_more_than_its_size() -> None:
    cache: KeyedCache[int, int] = KeyedCache(3)
    for key in range(10):
        cache.put(key, key)
    assert len(cache) == 3
    assert cache.values() == [7, 8, 9]


def _data_assignment(p: nn.Parameter) -> None:
    p.data = p.data * 1.0


def _in_place(p: nn.Parameter) -> None:
    with torch.no_grad():
        p.mul_(2.0)


def _channels_last(p: nn.Parameter) -> None:
    p.data = p.data.contiguous(memory_format=torch.channels_last)


def _dtype(p: nn.Parameter) -> None:
    p.data = p.data.double()


def _shape(p: nn.Parameter) -> None:
    p.data = p.data.reshape(2, -1)


def _offset(p: nn.Parameter) -> None:
    # Same storage, another view of it: a new address.
    base = torch.empty(p.numel() + 1)
    base[1:] = p.data.flatten()
    p.data = base[1:].view(p.shape)


def _requires_grad(p: nn.Parameter) -> None:
    p.requires_grad_(False)


CHANGES = [
    pytest.param(_data_assignment, id="data-assignment"),
    pytest.param(_in_place, id="in-place"),
    pytest.param(_channels_last, id="strides"),
    pytest.param(_dtype, id="dtype"),
    pytest.param(_shape, id="shape"),
    pytest.param(_offset, id="storage-offset"),
    pytest.param(_requires_grad, id="requires-grad"),
]


@pytest.mark.parametrize("change", CHANGES)
def test_state_sees_each_change_under_a_tensor(change: Callable[[nn.Parameter], None]) -> None:
    p = nn.Parameter(torch.randn(4, 3, 2, 2))
    state = State(p)
    assert state.holds(p)
    change(p)
    assert not state.holds(p)


def test_state_sees_another_tensor() -> None:
    p = torch.randn(3)
    assert not State(p).holds(p.clone())
    assert not State(p).holds(None)


def test_state_keeps_the_storage_so_its_address_cannot_come_back() -> None:
    p = nn.Parameter(torch.randn(64))
    state = State(p)
    old = p.data_ptr()
    for _ in range(4):
        # Each assignment frees the previous memory; the one the state recorded is kept.
        p.data = torch.randn(64)
        assert p.data_ptr() != old
    assert not state.holds(p)
