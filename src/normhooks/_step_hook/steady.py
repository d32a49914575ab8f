"""A unit's tensors as they were at the last step: what lets a steady step skip re-reading them.

From one step to the next a training loop keeps its parameters where they are and gets its
gradients from backward laid out as before, usually at the same addresses. A unit's
:class:`Steady` records that once; at the next step one C-level check of every parameter and
gradient (:func:`normhooks._torch_compat.layout_check`) and one pass over their addresses
stand for the plan's fingerprint, the binding's checks of the gradients, and the kernels'
checks of layouts and their table lookup.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, Protocol, cast

from torch import Tensor

from normhooks import _torch_compat as compat

_ADDRESS = Tensor.data_ptr
_IS_NOT_NONE = functools.partial(operator.is_not, None)
# Records made again without a step between that used one: past this many, the unit's
# tensors change at every step and a record costs more than it saves.
_MAX_MISSES = 3
# The key in Steady.kept under which a kernel entry leaves the launches it just made on the
# record's tensors, to be replayed in place of the unit function (Steady.keep_replay).
REPLAY = "replay"


class Replayable(Protocol):
    """What a kernel entry leaves under ``REPLAY`` (``normhooks._kernels._multi.Replay``)."""

    def holds(self) -> bool: ...

    def __call__(self, lr: Any) -> Tensor | None: ...


class _Nothing:
    """The replay of a unit function that does nothing to these tensors, whatever the kernels'
    state (a technique that chooses none of them)."""

    def holds(self) -> bool:
        return True

    def __call__(self, lr: Any) -> None:
        return None


NOTHING = _Nothing()


class Steady:
    """One unit's parameters and gradients as recorded at a step (kept on its ``_Unit``).

    What makes it valid, the one rule (:meth:`bind`, called at a step whose plan found the
    group, its entries and its parameters by identity as planned: ``_GroupPlan.steady_bound``):

    - the parameters that had no gradient (``absent``, by their place in the unit) have none,
      and the others (:attr:`params`) have one;
    - each of those parameters and gradients has the Python type, dtype, device, sizes,
      strides, dispatch keys and ``requires_grad`` recorded (one C call): a gradient made
      sparse, replaced by a subclass, laid out otherwise, converted, and a ``.data =`` that
      changes a parameter's shape, strides or dtype, all fail it;
    - each of those parameters has the address recorded: a ``.data =`` that moves it (or
      swaps its storage for another of the same layout) and ``torch.utils.swap_tensors`` fail
      it. (A parameter without a gradient is not read at the step.)

    A record is made only where the plan's fingerprint held at that step (the addresses and
    dtypes it planned for) and each gradient there was dense, of a plain type as its parameter
    is, so a record that holds proves all of that again. The gradients' addresses are read at
    every step: where backward put them elsewhere the record takes the new ones and clears
    :attr:`kept`.

    ``kept`` is what the techniques and their kernels derive from exactly these tensors (a
    table of addresses, which gradients a technique chooses, whether all are contiguous;
    keyed as each chooses): valid while the record holds and the gradients stay where they
    are, and cleared here otherwise, with :attr:`replay`.

    :attr:`replay` is what the unit function did at the last step that ran it, where that
    was one kernel entry's launches and nothing else (:meth:`keep_replay`): a steady step
    replays it in its place (:meth:`replay_for`) where the record holds, the technique's
    settings object is the one it was made under, the lr of the same kind, and the replay
    itself holds (its own conditions: see ``normhooks._kernels._multi.Replay``).
    """

    __slots__ = (
        "_absent",
        "_check",
        "_grad_addresses",
        "_param_addresses",
        "kept",
        "params",
        "positions",
        "replay",
        "used",
    )

    def __init__(
        self,
        check: Callable[..., bool],
        params: list[Tensor],
        grads: list[Tensor],
        positions: list[int],
        absent: tuple[int, ...],
    ) -> None:
        self._check = check
        # The parameters with a gradient, their places in their group, and the places in
        # the unit of those without.
        self.params = params
        self.positions = positions
        self._absent = absent
        self._param_addresses = tuple(map(_ADDRESS, params))
        self._grad_addresses = tuple(map(_ADDRESS, grads))
        self.kept: dict[object, object] = {}
        # (settings, the kind of lr, the replay): see keep_replay.
        self.replay: tuple[object, type, Replayable] | None = None
        # Whether a step has found the record holding since it was made.
        self.used = False

    @classmethod
    def take(
        cls, params: list[Tensor], grads: list[Tensor], positions: list[int], absent: Sequence[int]
    ) -> Steady | None:
        """A record of ``params`` (at ``positions`` of their group) and their ``grads``
        (dense, plain tensors) as they are now, the unit's other parameters (at ``absent`` in
        the unit) having no gradient; None where this torch has no check to make one with."""
        check = compat.layout_check([*params, *grads])
        return None if check is None else cls(check, params, grads, positions, tuple(absent))

    def bind(self, grads: list[Any]) -> list[Tensor] | None:
        """The gradients of :attr:`params` where the rule above holds for ``grads`` (each
        parameter's of the unit, read at this step), else None."""
        absent = self._absent
        if absent:
            if not all(map(operator.is_, map(grads.__getitem__, absent), repeat(None))):
                return None
            grads = list(filter(_IS_NOT_NONE, grads))
            if len(grads) != len(self.params):
                return None
        return grads if self.holds(grads) else None

    def holds(self, grads: list[Any]) -> bool:
        """Whether :attr:`params` and ``grads`` (theirs, read at this step) are as recorded;
        takes the gradients' addresses where they moved."""
        params = self.params
        if not (
            self._check(*params, *grads) and tuple(map(_ADDRESS, params)) == self._param_addresses
        ):
            return False
        addresses = tuple(map(_ADDRESS, grads))
        if addresses != self._grad_addresses:
            self._grad_addresses = addresses
            self.kept.clear()
            self.replay = None
        self.used = True
        return True

    def keep_replay(self, settings: object, lr: object) -> None:
        """Takes what the unit function just left under ``REPLAY`` in :attr:`kept` (run
        under ``settings`` and ``lr``; nothing: it cannot be replayed) as :attr:`replay`."""
        replay = self.kept.pop(REPLAY, None)
        self.replay = None if replay is None else (settings, type(lr), cast(Replayable, replay))

    def replay_for(self, settings: object, lr: object) -> Replayable | None:
        """:attr:`replay` where it stands for the unit function under ``settings`` and ``lr``
        at this step (the record holding, which the caller has found), else None."""
        replay = self.replay
        if replay is None or replay[0] is not settings or replay[1] is not type(lr):
            return None
        return replay[2] if replay[2].holds() else None


def retaken(previous: Steady | None, misses: int) -> tuple[bool, int]:
    """Whether to make a new record where ``previous`` did not hold (or there was none), and
    the unit's new count of records made in a row that no step used (``misses``). Past
    ``_MAX_MISSES`` the unit is given up on for its life (a new plan makes new units)."""
    if misses > _MAX_MISSES:
        return False, misses
    misses = misses + 1 if previous is not None and not previous.used else 0
    return misses <= _MAX_MISSES, misses
