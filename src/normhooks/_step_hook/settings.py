"""A step hook's settings: the frozen dataclass each technique declares, and its unit function."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from torch import Tensor

S = TypeVar("S", bound="Settings")
S_contra = TypeVar("S_contra", bound="Settings", contravariant=True)
Lr = float | Tensor | None


@dataclass(frozen=True, eq=False)
class Settings:
    """Base of a technique's settings: a frozen dataclass whose fields come from :func:`setting`.

    A hook class derives from its technique's settings too: its settings are its read-only
    attributes, documented where they are declared, and its ``repr``.
    """

    @classmethod
    def _names(cls) -> list[str]:
        # The fields' dict rather than dataclasses.fields(cls), which torch.compile cannot
        # trace on a class.
        return list(cls.__dataclass_fields__)

    @classmethod
    def _checked_values(
        cls, values: Mapping[str, object], name: Callable[[str], str] = str
    ) -> dict[str, Any]:
        """``values`` (one per field), each checked where it enters.

        An error names a field ``f`` as ``name(f)``: the argument, or the param-group key.
        """
        declared = cls.__dataclass_fields__
        return {key: f.metadata["check"](name(key), values[key]) for key, f in declared.items()}

    @classmethod
    def _checked(cls: type[S], values: Mapping[str, object], name: Callable[[str], str] = str) -> S:
        """The settings from ``values``, checked (see :meth:`_checked_values`)."""
        return cls(**cls._checked_values(values, name))


def setting(check: Callable[[str, Any], object]) -> Any:
    """A field of a :class:`Settings` dataclass, with the check ``check(name, value)``."""
    return field(metadata={"check": check})


# --- the unit functions --------------------------------------------------------------------


class UnitFunction(Protocol[S_contra]):
    """A technique's maths for one unit, in place; returns one value per parameter or None.

    Gradient hooks get ``(params, grads)``; update hooks ``(params, reverts)``, where
    ``params`` hold the optimizer's new values and ``reverts`` are ``w_old - w_new``.
    ``norms`` are ``(||w||, ||t||)`` of the whole tensors (``t`` the gradient; for update
    hooks, ``w`` is ``w_old`` and ``t`` the revert) where the base computed them: always
    for update hooks, for sharded units of gradient hooks; otherwise None. A gradient hook
    that declares ``scaled_gradients`` also takes ``grad_scale`` and ``found_inf``. Every
    gradient hook also takes ``steady``: the unit's record where it holds at this step and the
    function gets the very tensors it stands for (:class:`~normhooks._step_hook.steady.Steady`,
    whose ``kept`` is the kernels'), else None.
    """

    def __call__(
        self,
        params: list[Tensor],
        tensors: list[Tensor],
        settings: S_contra,
        lr: Lr,
        /,
        *,
        norms: tuple[Tensor, Tensor] | None,
        foreach: bool | None,
    ) -> Tensor | None: ...
