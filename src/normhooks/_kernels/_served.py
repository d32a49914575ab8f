"""The weights a fused scope serves, and when one may still be served (``_scope.serve`` launches
them).

The member's ``ParametrizationList`` gets an instance ``forward`` (a :class:`Served`) for the
scope, which torch's parametrized property calls like any forward. It returns the fused
weight only while the scope is open and its forward still runs (its frame is on the stack: a
scope left open by a ``KeyboardInterrupt``, which ``always_call`` hooks do not run for,
closes at its next access), the tensors it was computed from still hold by the one validity
rule (``_cache.State``: same objects, versions, memory, layouts, ``requires_grad``, found in
the same dicts), its parametrization's settings are the ones it was computed with (an ``eps``
or ``gamma`` set by a pre-hook), the served weight itself was not written
(``layer.weight.data = ...``, an in-place op: without fusion these change a temporary), no
saved-tensor hooks are active (non-reentrant activation checkpointing recomputes the weight
in backward the layer's own way, and must save what the forward saved; offloading), and (on
CUDA) the current stream is the one it was computed on; otherwise it computes the weight as
the layer would. Nothing global changes. torch's own ``parametrize.cached()`` would be
cheaper to serve from, but it keys its cache by the module that registered the
parametrization, which a deep copy shares with its original (a copy inside the scope would be
served the original's weight), and a scope left open by a ``KeyboardInterrupt`` would leave
every parametrization in the process cached.

Grad mode (``_scope.serve``): where an original requires grad and autograd can record (not in
inference mode), the fused weights get their graph even under ``no_grad``, so a weight served
to code that enables grad inside the forward still trains; a member whose originals require
no grad gets a weight that requires none. One multi-output autograd node computes every
member's gradients in one launch once all have arrived (``_fused._Fused``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from normhooks import _torch_compat
from normhooks._kernels._cache import Check
from normhooks._kernels._door import Door

_top_saved_tensors_hooks = _torch_compat.top_saved_tensors_hooks


class Settled(Protocol):
    """What a served weight reads of its member (a ``_members.Member``): its door, its
    parametrization, the settings its fused inputs were found with, and how many frames
    above an access its scope's forward was found last."""

    door: Door
    parametrization: Any
    settings: tuple[object, ...] | None
    depth: int


class Level:
    """One open scope: the frame whose forward it brackets, and the weights it serves."""

    __slots__ = ("frame", "open", "served")

    def __init__(self, frame: FrameType | None) -> None:
        self.frame = frame
        self.open = frame is not None
        self.served: list[tuple[nn.Module, Served]] = []

    def close(self) -> None:
        self.open = False
        for chain, served in self.served:
            if chain.__dict__.get("forward") is served:
                del chain.__dict__["forward"]
        self.served.clear()
        self.frame = None


CLOSED = Level(None)


class Served:
    """A member's ``ParametrizationList.forward`` while its scope serves its fused weight."""

    __slots__ = (
        "address",
        "chain",
        "checks",
        "inference",
        "level",
        "member",
        "settings",
        "stream",
        "version",
        "weight",
    )

    def __init__(
        self,
        chain: nn.Module,
        level: Level,
        weight: Tensor | None,
        checks: tuple[Check, ...],
        inference: bool,
        stream: tuple[int, int] | None = None,
        member: Settled | None = None,
    ) -> None:
        self.chain = chain
        # The settings the weight was computed with (an eps or gamma changed inside the
        # forward, by a schedule in a pre-hook, is seen at the next access).
        self.member = member
        self.settings = None if member is None else member.settings
        self.level = level
        self.weight = weight
        # The served weight as computed: a layer's code that writes into the weight it got
        # (``layer.weight.data = ...``, an in-place op under no_grad) changes a temporary
        # without fusion, so later accesses compute the weight afresh.
        # (Inference tensors keep no version: served in inference mode only, see below.)
        self.address = 0 if weight is None else weight.data_ptr()
        self.version = -1 if weight is None or inference else weight._version
        self.checks = checks
        self.inference = inference
        self.stream = stream

    def __call__(self) -> Tensor:
        # Every check inline, in one function: this runs at every access of every served
        # weight. Any failing check computes the weight as the layer would.
        weight = self.weight
        if (
            weight is None
            # A parametrization registered on the tensor inside the forward: the whole chain.
            or "1" in self.chain._modules
            or (not self.inference and weight._version != self.version)
            or weight.data_ptr() != self.address
        ):
            return self._own()
        # Each original: the same object in the same dict, with the fields its state recorded
        # (``_cache.fields_of``, built inline).
        for owner, key, state in self.checks:
            tensor = owner.get(key)
            if (
                tensor is not state.tensor
                or (
                    tensor._version,
                    tensor.data_ptr(),
                    type(tensor),
                    tensor.stride(),
                    tensor.shape,
                    tensor.dtype,
                    tensor.device,
                    tensor.requires_grad,
                )
                != state.fields
            ):
                return self._own()
        member = self.member
        if member is not None and member.door.settings(member.parametrization) != self.settings:
            return self._own()
        # Under saved-tensor hooks (non-reentrant checkpointing) the layer computes its
        # weight itself, as the recomputation in backward will, which must save what the
        # forward saved.
        if _top_saved_tensors_hooks(True) is not None:  # _torch_compat.saved_tensors_hooked()
            return self._own()
        # A CUDA weight was computed on one stream: another one would read it unsynchronized.
        stream = self.stream
        if stream is not None and _torch_compat.current_raw_stream(stream[0]) != stream[1]:
            return self._own()
        # Inference tensors cannot enter a graph: served only in inference mode.
        if self.inference and not torch.is_inference_mode_enabled():
            return self._own()
        # The forward it was computed for still runs: a scope left open by a
        # KeyboardInterrupt (which ``always_call`` hooks do not run for) closes at its next
        # access, and never serves.
        level = self.level
        if not level.open:
            return self._own()
        frame = level.frame
        # First where its frame was found last time for this member: a frame the level holds
        # is never freed, so finding that very object on this stack means its forward still
        # runs (a confirmation only; anything else takes the whole walk).
        if member is not None:
            try:
                if sys._getframe(member.depth) is frame:
                    return weight
            except ValueError:  # a shallower stack
                pass
        depth = -1 if frame is None else _depth(frame)
        if depth < 0:
            level.close()
            return self._own()
        if member is not None:
            member.depth = depth
        return weight

    def _own(self) -> Tensor:
        result: Tensor = type(self.chain).forward(self.chain)
        return result

    def __reduce__(self) -> tuple[Callable[..., Served], tuple[nn.Module]]:
        # A copy (deepcopy, pickle) of a model inside or after an interrupted scope gets one
        # that defers to the layer's own forward, and is removed at its next scope.
        return _closed, (self.chain,)


def _closed(chain: nn.Module) -> Served:
    return Served(chain, CLOSED, None, (), False)


def replaceable(existing: object) -> bool:
    """Whether another scope's weight on a member may be taken down: a closed one, or one
    whose forward is over (interrupted); not one that an open forward serves."""
    if not isinstance(existing, Served):
        return False  # someone else's forward: not ours to replace
    if not existing.level.open:
        return True
    return existing.level.frame is not None and not _on_stack(existing.level.frame)


def _on_stack(target: FrameType) -> bool:
    """Whether ``target`` runs now: a walk to it (a scope's frame is an ancestor of every
    access it serves, a few dozen frames up), without building a set of the stack's frames."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


def _depth(target: FrameType) -> int:
    """How many frames above its caller ``target`` runs (``sys._getframe(depth)`` there), or
    -1 where it runs no more: a walk to it (a scope's frame is an ancestor of every access it
    serves)."""
    frame: FrameType | None = sys._getframe(1)
    depth = 0
    while frame is not None:
        if frame is target:
            return depth
        frame = frame.f_back
        depth += 1
    return -1
