"""What every step hook declares and holds: its technique's declarations, settings and state.

The hook's concerns build on this one class: :class:`~normhooks._step_hook.plan.Planning`
(the plan kept between steps), :class:`~normhooks._step_hook.updates.UpdateRun` (an update
hook's copies and post-step), :class:`~normhooks._step_hook.run.Running` (the pre-step) and
:class:`~normhooks._step_hook.hook.StepHook` (attaching).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, cast

from torch import Tensor

from normhooks._step_hook.checks import check_foreach
from normhooks._step_hook.settings import Settings, UnitFunction


class HookCore:
    """A technique's declarations (see :mod:`normhooks._step_hook`), its settings and the state
    it keeps per optimizer."""

    prefix: ClassVar[str]
    technique: ClassVar[str]
    rewrites: ClassVar[Literal["gradients", "updates"]] = "gradients"
    scaled_gradients: ClassVar[bool] = False
    full_shapes: ClassVar[bool] = False
    row_wise: ClassVar[bool] = False
    whole_norms: ClassVar[bool] = True
    # Whether a steady step may replay the launches the unit function made at the last step
    # (Steady.replay) in its place: only where its kernel branch is one kernel entry's call.
    replays: ClassVar[bool] = False
    _settings_class: ClassVar[type[Settings]]
    _unit_: ClassVar[UnitFunction[Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The layer's own mixins and StepHook derive from no Settings: a technique's class does.
        found = next((base for base in cls.__mro__ if Settings in base.__bases__), None)
        if found is not None:
            cls._settings_class = found

    def __init__(self, *, foreach: bool | None = None, **settings: object) -> None:
        for name, value in self._settings_class._checked_values(settings).items():
            # The settings are frozen fields: set once, here.
            object.__setattr__(self, name, value)
        self._foreach = check_foreach(foreach)
        self._last_values: list[Tensor] = []

    def _check_group(self, group: Mapping[str, Any], settings: Any) -> str | None:
        """Raises for a param group the technique cannot serve; returns a warning or None.

        Reads the group's entries only: what concerns each parameter is in ``_check_param``.
        """
        return None

    @classmethod
    def _check_param(cls, param: Tensor, where: str) -> None:
        """Raises for a parameter the technique cannot serve (its dtype and layout)."""

    def _as_settings(self) -> Settings:
        """The hook's own settings: a hook is an instance of its settings class."""
        return cast(Settings, self)

    @property
    def foreach(self) -> bool | None:
        """True or None: multi-tensor ops; False: one tensor at a time."""
        return self._foreach

    @classmethod
    def _key(cls, name: str) -> str:
        """The param-group key that overrides the setting ``name``."""
        return name if name.startswith(cls.prefix + "_") else f"{cls.prefix}_{name}"
