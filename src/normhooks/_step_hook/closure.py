"""The closure a step hook evaluates itself and hands the optimizer, for one use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from normhooks import _torch_compat as compat


class _SingleUseClosure:
    """Hands the optimizer the loss of a closure the hook already evaluated.

    The gradients of that evaluation are the ones the hook rewrote: an optimizer that moves
    the parameters before calling its closure (SAM's two passes) expects new gradients, and
    would silently step with none. ``params`` (the parameters with a gradient) are watched
    through their version counters, which every in-place change bumps.
    """

    def __init__(
        self, loss: Any, optimizer: torch.optim.Optimizer, hook_name: str, params: list[Tensor]
    ) -> None:
        self._loss = loss
        self._optimizer_name = type(optimizer).__name__
        self._hook_name = hook_name
        self._calls = 0
        self._params = params
        self._versions = compat.versions(params)

    def __call__(self) -> Any:
        self._calls += 1
        if compat.versions(self._params) != self._versions:
            raise RuntimeError(
                f"{self._optimizer_name} changed the parameters and then called its closure "
                f"(as SAM-style optimizers do); {self._hook_name} evaluated that closure before "
                "the step, when torch runs step pre-hooks, so the loss it returns comes with no "
                f"gradients at the new parameters. The parameters are left where "
                f"{self._optimizer_name} moved them. Attach {self._hook_name} to the optimizer "
                "that takes the final step with those gradients (a SAM-style optimizer's "
                "base_optimizer)"
            )
        if self._calls > 1:
            raise RuntimeError(
                f"{self._optimizer_name} called its closure more than once in one step; "
                f"{self._hook_name} rewrites the gradients of a single evaluation, so it cannot "
                "be used with optimizers that re-evaluate the loss (such as LBFGS)"
            )
        return self._loss


def _take_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[[], Any] | None, tuple[Any, ...], dict[str, Any]]:
    """Splits ``optimizer.step``'s closure from its other arguments.

    ``args`` starts with the optimizer itself (the hook sees ``step``'s bound arguments).
    """
    kwargs = dict(kwargs)
    if "closure" in kwargs:
        return kwargs.pop("closure"), args, kwargs
    if len(args) > 1:
        return args[1], args[:1] + args[2:], kwargs
    return None, args, kwargs
