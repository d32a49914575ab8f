"""One launch for all of a model's reparametrized weights, each way (horizontal fusion).

A GPU training step of a small model is bound by host time, and a parametrization costs its
layer two kernel launches a step, with the Python around them. :func:`fuse` gives a model a
forward pre-hook and a forward hook (``always_call=True``) that bracket each forward in a
*scope*: at its start, the weights of every member (``_members``: a tensor parametrized by
exactly one parametrization with a registered door, found when :func:`fuse` ran) that the
kernels can compute are computed together, one launch per device, dtype and kind (and one
backward), and each is served to its layer for the rest of the forward (``_served``); at its
end, the layers compute their weights again at each access. The parametrizations, their
Parameters and the state-dict keys are the model's as before.

A scope can never outlive its forward: the closing hook runs on an exception, and a scope
left open by a ``KeyboardInterrupt`` or ``SystemExit`` (which ``always_call`` hooks do not
run for) closes at its next access or at the model's next forward, whichever comes first.

What each layer computes its own way, as without fusion: everything while compiling, tracing,
exporting, under ``torch.func`` transforms, dispatch modes, CUDA-graph capture or saved-tensor
hooks (checked once per scope, and at each access); the layers ``_members`` leaves out; and
members removed or re-parametrized since (checked by identity at each scope). A layer
parametrized after :func:`fuse` is found when :func:`fuse` runs again; lazy layers, from the
forward after their first.

A weight its layer never used gets no gradient, and its originals get None, as without
fusion; the fused backward checks its inputs again (see ``_fused._Fused``). Weights changed
inside a forward (by the forward or its hooks) are seen by the accesses after the change,
except a write into an original's values through ``.data``, which changes neither the
tensor, its version nor its memory: documented in the ``apply_*`` functions and
docs/caching.md, with ``fuse=False`` as the way out.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, TypeVar

import torch
from torch import nn

from normhooks import _kernels, _parametrize, _torch_compat
from normhooks._kernels import _fallback
from normhooks._kernels._members import (
    Group,
    Grouping,
    GroupKey,
    Member,
    candidates,
    grouped,
    holds,
)
from normhooks._kernels._served import Level, Served


class Fusion:
    """The fused scopes of one model: its members, and the scopes open now."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.members: list[Member] = []
        self.lazy: list[nn.Module] = []
        self.levels: list[Level] = []
        self.grouping: Grouping | None = None
        self.collect()

    def collect(self) -> None:
        """Finds the model's members again; layers whose weights do not exist yet (lazy ones)
        are looked at again at each scope until they do."""
        members: list[Member] = []
        lazy: list[nn.Module] = []
        for module in self.model.modules():
            if _parametrize.is_internal(module):
                continue
            members.extend(Member(module, name) for name in candidates(module))
            if any(map(_parametrize.is_uninitialized, module._parameters.values())):
                lazy.append(module)
        self.members, self.lazy = members, lazy
        self.grouping = None

    def __getstate__(self) -> dict[str, object]:
        # Open scopes belong to the running forward, not to a copy.
        return {
            "model": self.model,
            "members": self.members,
            "lazy": self.lazy,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model = state["model"]
        self.members = state["members"]
        self.lazy = state["lazy"]
        self.levels = []
        self.grouping = None

    # --- the scope ------------------------------------------------------------------------

    def open(self, module: nn.Module, frame: FrameType) -> None:
        # A module that merely shares the hooks (DataParallel's replicas share the hook dict
        # of the module they copy) has members of its own: its layers take their own path.
        if module is not self.model:
            return
        if self.levels:
            self._forget_finished()
        level = Level(frame)
        # Pushed first, so that the closing hook, which runs even if this one raises, finds it.
        self.levels.append(level)
        if not _kernels.may_launch() or _torch_compat.saved_tensors_hooked():
            return
        if not (_kernels.routing_cpu_tensors() or torch.cuda.is_available()):
            return  # no member can be on a device the kernels take
        if self.lazy:
            self._adopt_lazy()
        groups = self._groups()
        if groups:
            serve(groups, level)

    def close(self, module: nn.Module) -> None:
        if module is self.model and self.levels:
            self.levels.pop().close()

    def _groups(self) -> dict[GroupKey, Group]:
        """This scope's groups: the last scope's, where nothing they were found from changed
        (checking that reads no tensor's values), else found again."""
        if _torch_compat.global_forward_hooks():
            # Every module call runs them, a parametrization's too: each layer its own path.
            return {}
        routing = _kernels.routing_cpu_tensors()
        grouping = self.grouping
        if grouping is not None and grouping.routing == routing and holds(grouping, self.members):
            return grouping.groups
        self.members = [m for m in self.members if m.current()]
        groups, reusable = grouped(self.members)
        self.grouping = Grouping(groups, routing, reusable)
        return groups

    def _forget_finished(self) -> None:
        """Closes the scopes of forwards that ended without closing them (a KeyboardInterrupt
        or SystemExit, which ``always_call`` hooks do not run for). A scope of a forward that
        is still running (this model called inside its own forward) stays open."""
        live = _stack()
        kept = []
        for level in self.levels:
            if level.frame is not None and id(level.frame) in live:
                kept.append(level)
            else:
                level.close()
        self.levels = kept

    def _adopt_lazy(self) -> None:
        still = []
        for module in self.lazy:
            if any(map(_parametrize.is_uninitialized, module._parameters.values())):
                still.append(module)
            else:
                self.members.extend(Member(module, name) for name in candidates(module))
                self.grouping = None
        self.lazy = still


def _stack() -> set[int]:
    """The ids of the frames running now."""
    live = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        live.add(id(frame))
        frame = frame.f_back
    return live


class _Open:
    """Forward pre-hook that opens a model's fused scope."""

    def __init__(self, fusion: Fusion) -> None:
        self.fusion = fusion

    def __call__(self, module: nn.Module, args: object) -> None:
        if torch.compiler.is_compiling():
            return
        # The caller's frame runs for as long as the forward does.
        self.fusion.open(module, sys._getframe(1))


class _Close:
    """Forward hook (``always_call``) that closes it."""

    def __init__(self, fusion: Fusion) -> None:
        self.fusion = fusion

    def __call__(self, module: nn.Module, args: object, output: object) -> None:
        if torch.compiler.is_compiling():
            return
        self.fusion.close(module)


def fusion_of(model: nn.Module) -> Fusion | None:
    """The fused scopes :func:`fuse` gave ``model``, or None."""
    for hook in _torch_compat.forward_pre_hooks(model):
        if isinstance(hook, _Open):
            return hook.fusion
    return None


M = TypeVar("M", bound=nn.Module)


def fuse(model: M) -> M:
    """Computes all of ``model``'s weight-normalized and standardized weights in one launch
    per forward, and their gradients in one (per device, dtype and kind), where the kernels
    run; returns ``model``.

    Gives the model the two hooks of a fused scope the first time; each later call finds its
    members again (layers converted since, lazy layers). See the module's docstring for what
    stays on each layer's own path.
    """
    fusion = fusion_of(model)
    if fusion is not None:
        fusion.collect()
        return model
    fusion = Fusion(model)
    model.register_forward_pre_hook(_Open(fusion))
    model.register_forward_hook(_Close(fusion), always_call=True)
    return model


def unfuse(model: M) -> M:
    """Takes :func:`fuse`'s hooks off ``model``: each layer computes its own weight again."""
    fusion = fusion_of(model)
    if fusion is not None:
        for level in fusion.levels:
            level.close()
        # Found as fusion_of finds them (a Fusion unpickled has no handles to remove them by).
        _torch_compat.remove_forward_hooks(
            model, lambda hook: isinstance(hook, (_Open, _Close)) and hook.fusion is fusion
        )
    return model


def serve(groups: dict[GroupKey, Group], level: Level) -> None:
    """Computes each group's weights in one launch and serves them to its members for the
    rest of ``level``'s forward."""
    on_cuda = any(key[1].type == "cuda" for key, _, _ in groups)
    if on_cuda and torch.cuda.is_current_stream_capturing():
        # A captured graph would replay this step's tables: the layers' own kernels.
        return
    inference = torch.is_inference_mode_enabled()
    for (key, needs_grad, _), group in groups.items():
        launch = key[0]
        try:
            if needs_grad and not inference and not torch.is_grad_enabled():
                with torch.enable_grad():
                    weights = launch(tuple(group.plans), group.tensors)
            else:
                weights = launch(tuple(group.plans), group.tensors)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError):
                raise
            # Its layers compute their own weights, by the plain formula from now on.
            _fallback.failed("a fused launch", error)
            return
        device = key[1]
        stream = None
        if device.type == "cuda":
            stream = (device.index, _torch_compat.current_raw_stream(device.index))
        for member, weight in zip(group.members, weights, strict=True):
            served = Served(member.chain, level, weight, member.checks, inference, stream, member)
            member.chain.__dict__["forward"] = served
            level.served.append((member.chain, served))
