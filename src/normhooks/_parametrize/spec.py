"""The technique spec: what a reparametrization tells the lifecycle about itself.

And its registration on one checked tensor (:func:`_register`), which a conversion runs at
once and a lazy layer at its first forward (:meth:`Technique.register_materialized`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import Tensor, nn

from normhooks._parametrize.checks import check_ndim, checked_tensor
from normhooks._parametrize.layers import describe, originals, parametrizations_of
from normhooks._parametrize.lazy import pending
from normhooks._parametrize.registration import Companions, Step, Undo, materialized, register
from normhooks._parametrize.takeover import is_torch_legacy_weight_norm, torch_weight_norm

L = TypeVar("L")


class Technique(ABC, Generic[L]):
    """What a reparametrization tells the lifecycle; a subclass is a frozen dataclass of its
    settings, checked by the public function that makes it.

    The class attributes name the technique in messages and describe its parametrization;
    :meth:`layout` and :meth:`build` are its own, the other methods have the answers of a
    parametrization that computes the weight from the weight itself (one original, kept as
    the same Parameter) and composes with every other. ``L`` is what :meth:`layout` resolves
    from the settings for one tensor (an axis, say), once, where the tensor's rank is known.
    """

    marker: ClassVar[str]  # names its pending registrations on lazy layers
    what: ClassVar[str]  # "weight standardization"
    done: ClassVar[str]  # "standardized": "Conv2d.weight is already standardized"
    verb: ClassVar[str]  # "standardize": "nothing to standardize in Sequential"
    tree_function: ClassVar[str]  # the public function that converts a model
    parametrization: ClassVar[type[nn.Module]]  # the class its registrations are instances of
    layers: ClassVar[tuple[type[nn.Module], ...]]  # what a tree conversion converts by default
    # The original whose Parameter object a baked weight keeps: "original" for a
    # parametrization of the weight alone; for one of several tensors, the one shaped like it.
    baked_into: ClassVar[str] = "original"
    # Whether torch's own weight norm on a tensor is replaced by this technique's (take_over).
    takes_over_torch_weight_norm: ClassVar[bool] = False

    @property
    def label(self) -> str:
        """The name of a conversion in the message of an optimizer that missed it."""
        return self.what

    @property
    def replaces_weight(self) -> bool:
        """Whether a registration replaces the weight's Parameter by new originals: then it must
        be innermost, and a weight tied to another module's would be untied."""
        return self.baked_into != "original"

    @abstractmethod
    def layout(self, module: nn.Module, name: str, ndim: int) -> L:
        """The settings resolved for ``module.<name>``, of ``ndim`` >= 2 dimensions; raises with
        ``describe(module, name)`` where they do not fit it."""

    @abstractmethod
    def build(self, weight: Tensor, layout: L) -> nn.Module:
        """The parametrization of ``weight`` (its device, dtype and shape)."""

    def companions(self) -> dict[str, tuple[str, str]]:
        """The Parameters a registration adds besides new originals, by role, with where they
        end up: ``("parametrization", attribute)`` or ``("originals", "original0")``. On a lazy
        layer each is created at conversion, for an optimizer built before the first forward."""
        return {}

    def refuse(self, module: nn.Module, name: str, layout: L | None) -> None:
        """Raises where this conversion of ``module.<name>`` would be wrong; ``layout`` is None
        for a lazy tensor that does not exist yet."""

    def self_standardizing(self, own: str) -> str | None:
        """Why a layer whose forward standardizes its own weight (through the class ``own``) is
        refused; None where that forward does what this technique does, so converting it
        would only repeat it (then a tree conversion skips it, with a warning)."""
        return (
            f"the scale {self.what} gives the weight is standardized away. Leave it out "
            "(layer_types selects subclasses too: name only the classes to convert)"
        )

    def torch_counterpart(self, module: nn.Module, name: str) -> Any:
        """What of torch's own on ``module.<name>`` :meth:`take_over` is handed, or None: torch's
        weight norm (:func:`torch_weight_norm`), unless a technique looks for its own."""
        return torch_weight_norm(module, name)

    def take_over(self, module: nn.Module, name: str, found: Any, strict: bool) -> Step | None:
        """The step that replaces torch's weight norm ``found`` on ``module.<name>``, or None to
        treat it as any other parametrization. ``strict``: the settings were given for this
        parameter alone, and must then agree with torch's."""
        if is_torch_legacy_weight_norm(found):
            raise ValueError(
                f"{describe(module, name)} carries torch's legacy weight norm "
                "(torch.nn.utils.weight_norm), which recomputes the weight in a forward "
                f"pre-hook; {self.what} cannot stack on it. Remove it first "
                "(torch.nn.utils.remove_weight_norm), or leave the layer out"
            )
        return None

    def fold_torch_legacy(self, module: nn.Module, name: str, hook: Any) -> None:
        """Folds torch's legacy weight norm ``hook`` on ``module.<name>`` into a plain weight;
        the techniques that take torch's weight norm over also remove it."""
        raise NotImplementedError(f"{self.what} does not take over torch's weight norm")

    def registered(self, module: nn.Module, name: str) -> None:
        """Runs after every registration on ``module.<name>``."""

    def removed(self, module: nn.Module, name: str) -> None:
        """Runs after every removal from ``module.<name>``."""

    def applied(self, module: nn.Module, name: str) -> bool:
        """Whether ``module.<name>`` carries this technique, or will at its first forward."""
        return pending(module, name, self.marker) or any(
            isinstance(p, self.parametrization) for p in parametrizations_of(module, name)
        )

    def register_materialized(self, module: nn.Module, name: str, companions: Companions) -> Undo:
        """Converts a lazy layer's ``module.<name>`` at its first forward, now that it exists;
        ``companions`` are the placeholders made at conversion, by role. Returns what undoes
        it."""
        return _register_materialized(self, module, name, companions)


# --- registering one checked tensor -------------------------------------------------------


def _register(
    technique: Technique[L],
    module: nn.Module,
    name: str,
    layout: L,
    companions: Companions | None = None,
) -> Undo:
    """Converts ``module.<name>``, checked already, for ``layout``.

    On a lazy layer (``companions``: its placeholders) the Parameters an optimizer built
    before the first forward holds are kept: each placeholder becomes the Parameter the
    registration added in its role, and new originals give their place to the lazy weight,
    rewritten in place.
    """
    weight = getattr(module, name)
    parametrization = technique.build(weight, layout)
    # torch gives a parametrization its layer's mode and computes the weight once, as a check:
    # in eval mode here, so that registering never advances a parametrization's state (a
    # power iteration's), whatever the layer's mode when its conversion runs.
    training = module.training
    module.training = False
    try:
        undo = register(module, name, parametrization, technique.label, watch=companions is None)
    finally:
        module.training = training
    parametrization.train(training)
    if companions is not None:
        chain = originals(module, name)
        for role, (where, attribute) in technique.companions().items():
            owner = chain if where == "originals" else chain[-1]
            setattr(owner, attribute, materialized(companions[role], getattr(owner, attribute)))
        if technique.replaces_weight:
            with torch.no_grad():
                weight.copy_(getattr(chain, technique.baked_into))
            setattr(chain, technique.baked_into, weight)
    technique.registered(module, name)
    return undo


def _register_materialized(
    technique: Technique[Any], module: nn.Module, name: str, companions: Companions
) -> Undo:
    """Converts a lazy layer's ``module.<name>`` at its first forward, now that it exists."""
    weight = checked_tensor(module, name, technique.what)
    check_ndim(describe(module, name), weight.ndim, technique.what)
    layout = technique.layout(module, name, weight.ndim)
    technique.refuse(module, name, layout)
    return _register(technique, module, name, layout, companions)
