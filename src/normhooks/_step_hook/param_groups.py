"""Param groups for a model: the parameters a hook serves, and those it leaves alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def split_param_groups(
    model: object, prefix: str, leave_alone: Callable[[str, nn.Parameter], object]
) -> list[dict[str, Any]]:
    """A group of the model's parameters and one with ``{prefix: False}`` that the hook leaves
    alone: those for which ``leave_alone(name, param)`` is True. Empty groups are left out.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    taken: list[nn.Parameter] = []
    left: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        verdict = leave_alone(name, param)
        if not isinstance(verdict, bool):
            kind = type(verdict)
            raise TypeError(
                f"exclude must return a bool, got {kind.__module__}.{kind.__qualname__} for "
                f"parameter {name!r}"
            )
        (left if verdict else taken).append(param)
    groups: list[dict[str, Any]] = []
    if taken:
        groups.append({"params": taken})
    if left:
        groups.append({"params": left, prefix: False})
    return groups
