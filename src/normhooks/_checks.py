"""Argument checks shared by the public entry points.

Every check raises where the argument enters, with a message that names the argument,
what was expected and what was received.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import TypeVar

T = TypeVar("T")


def real(name: str, value: object) -> float:
    """Returns ``value`` as a finite float, or raises a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {name}={value!r}")
    return number


def non_negative(name: str, value: object) -> float:
    number = real(name, value)
    if number < 0:
        raise ValueError(f"{name} must be non-negative, got {name}={value!r}")
    return number


def positive(name: str, value: object) -> float:
    number = real(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {name}={value!r}")
    return number


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")
    return value


def optional(check: Callable[[str, object], T]) -> Callable[[str, object], T | None]:
    """``check``, letting None through."""

    def checked(name: str, value: object) -> T | None:
        return None if value is None else check(name, value)

    return checked


def axis(name: str, value: object, ndim: int, where: str) -> int:
    """Returns ``value`` as an axis in ``range(ndim)``; negative axes count from the end."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {name}={value!r} for {where}")
    if not -ndim <= value < ndim:
        raise ValueError(
            f"{name} must be in [{-ndim}, {ndim - 1}] for {where} with {ndim} dimensions, "
            f"got {name}={value}"
        )
    return value % ndim


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {name}={value!r}")
    return value


def integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    return value
