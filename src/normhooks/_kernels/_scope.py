"""One launch for all of a model's reparametrized weights, each way (horizontal fusion).

A GPU training step of a small model is bound by host time, and a parametrization costs its
layer two kernel launches a step, with the Python around them. :func:`fuse` gives a model a
forward pre-hook and a forward hook (``always_call=True``) that bracket each forward in a
*scope*: at its start, the weights of every member (a tensor parametrized by exactly one
parametrization with a registered door, ``_door``: :class:`~normhooks.WeightNorm`,
:class:`~normhooks.WeightStandardization`; found when :func:`fuse` ran) that the kernels can
compute are computed together, one launch per device, dtype and kind (and one backward), and
each is served to its layer for the rest of the
forward; at its end, the layers compute their weights again at each access. The
parametrizations, their Parameters and the state-dict keys are the model's as before.

How a weight is served: the member's ``ParametrizationList`` gets an instance ``forward``
(a :class:`_Served`) for the scope, which torch's parametrized property calls like any
forward. It returns the fused weight only while the scope is open and its forward still runs
(its frame is on the stack: a scope left open by a ``KeyboardInterrupt``, which
``always_call`` hooks do not run for, closes at its next access), the tensors it was computed
from still hold by the one validity rule (``_cache.State``: same objects, versions, memory,
layouts, ``requires_grad``, found in the same dicts), its parametrization's settings are the
ones it was computed with (an ``eps`` or ``gamma`` set by a pre-hook), the served weight
itself was not written (``layer.weight.data = ...``, an in-place op: without fusion these
change a temporary), and (on CUDA) the current stream is the one it was computed on;
otherwise it computes the weight as the layer would. Nothing global
changes. torch's own ``parametrize.cached()``
would be cheaper to serve from, but it keys its cache by the module that registered the
parametrization, which a deep copy shares with its original (a copy inside the scope would
be served the original's weight), and a scope left open by a ``KeyboardInterrupt`` would
leave every parametrization in the process cached.

What each layer computes its own way, as without fusion: everything while compiling,
tracing, exporting, under ``torch.func`` transforms, dispatch modes, CUDA-graph capture or
saved-tensor hooks (checked once per scope); an access under saved-tensor hooks (non-reentrant
activation checkpointing recomputes the weight in backward the layer's own way, and must save
what the forward saved; offloading); originals that are not plain tensors on a device the
kernels take (FSDP2's DTensors, tensor subclasses, the CPU); layers a fused launch cannot
take (few long rows, non-contiguous weights, WN with ``dim=None`` or two dtypes, WS of
another axis or of grouped transposed convolutions, embeddings with ``max_norm``, whose
forward writes into the weight); a member that another model's open
scope serves (a layer shared by two models); and members removed or re-parametrized since
(checked by identity at each scope). A layer parametrized after :func:`fuse` is found when
:func:`fuse` runs again; lazy layers, from the forward after their first.

A scope takes the last scope's groups (kernel plans, launches) again where nothing they were
found from changed: every member current, its settings, and each original the same tensor
with the same metadata (type, shape, strides, dtype, device, ``requires_grad``; a write
through ``.data`` changes these without a new version), found in the same dict (a gain
moved from the Parameters to the buffers is found again). That reads no tensor's values; the
values are the served weights' checks, read at each scope and access.

Grad mode: where an original requires grad and autograd can record (not in inference mode),
the fused weights get their graph even under ``no_grad``, so a weight served to code that
enables grad inside the forward still trains; a member whose originals require no grad gets
a weight that requires none. One multi-output autograd node computes every member's
gradients in one launch once all have arrived; a weight its layer never used gets none, and
its originals get None, as without fusion; its backward checks its inputs again (see
``_fused._Fused``). Weights changed inside a forward (by the forward or its hooks) are seen
by the accesses after the change, except a write into an original's values through
``.data``, which changes neither the tensor, its version nor its memory: documented in the
``apply_*`` functions and docs/caching.md, with ``fuse=False`` as the way out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from normhooks import _kernels, _parametrize, _torch_compat
from normhooks._kernels import _fallback
from normhooks._kernels._cache import taken_again
from normhooks._kernels._door import Check as _Check
from normhooks._kernels._door import Door, Source, door_of


class _Level:
    """One open scope: the frame whose forward it brackets, and the weights it serves."""

    __slots__ = ("frame", "open", "served")

    def __init__(self, frame: FrameType | None) -> None:
        self.frame = frame
        self.open = frame is not None
        self.served: list[tuple[nn.Module, _Served]] = []

    def close(self) -> None:
        self.open = False
        for chain, served in self.served:
            if chain.__dict__.get("forward") is served:
                del chain.__dict__["forward"]
        self.served.clear()
        self.frame = None


_CLOSED = _Level(None)


class _Served:
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
        level: _Level,
        weight: Tensor | None,
        checks: tuple[_Check, ...],
        inference: bool,
        stream: tuple[int, int] | None = None,
        member: _Member | None = None,
    ) -> None:
        self.chain = chain
        # The settings the weight was computed with (an eps or gamma changed inside the
        # forward, by a schedule in a pre-hook, is seen at the next access).
        self.member = member
        self.settings = None if member is None or member.stamp is None else member.stamp[0]
        self.level = level
        self.weight = weight
        # The served weight as computed: a layer's code that writes into the weight it got
        # (``layer.weight.data = ...``, an in-place op under no_grad) changes a temporary
        # without fusion, so later accesses compute the weight afresh.
        # (Inference tensors keep no version: served in inference mode only, see _current.)
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
        if _torch_compat.saved_tensors_hooked():
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

    def __reduce__(self) -> tuple[Callable[..., _Served], tuple[nn.Module]]:
        # A copy (deepcopy, pickle) of a model inside or after an interrupted scope gets one
        # that defers to the layer's own forward, and is removed at its next scope.
        return _closed, (self.chain,)


def _closed(chain: nn.Module) -> _Served:
    return _Served(chain, _CLOSED, None, (), False)


class _Member:
    """A parametrized tensor of the model that a fused launch may compute."""

    __slots__ = (
        "chain",
        "depth",
        "door",
        "holder",
        "module",
        "name",
        "parametrization",
        "stamp",
    )

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        holder = module._modules["parametrizations"]
        assert holder is not None  # found by _candidates
        chain = holder._modules[name]
        assert chain is not None
        self.holder: nn.Module = holder
        self.chain: nn.Module = chain
        self.parametrization: Any = chain._modules["0"]
        door = door_of(self.parametrization)
        assert door is not None  # found by _candidates
        self.door: Door = door
        # What its fused inputs were last found from (see _stamp).
        self.stamp: _Stamp | None = None
        # How many frames above a served access of its weight its scope's frame was found
        # last time (see _Served.__call__).
        self.depth = 1

    def current(self) -> bool:
        """Whether the tensor still carries the one parametrization it had when found."""
        holder = self.module._modules.get("parametrizations")
        if holder is not self.holder or self.holder._modules.get(self.name) is not self.chain:
            return False
        modules = self.chain._modules
        return modules.get("0") is self.parametrization and "1" not in modules


# What a member's fused inputs depend on besides the tensors' values: its settings, where a
# launch finds its tensors (None where it takes none), and, for each of them, where it lives
# (the dict: a gain as a Parameter or a buffer), the tensor (kept: its identity) and its
# metadata (:func:`_metadata`: what its route was keyed by, with whether it requires grad).
# Metadata only (a write through ``.data`` changes a tensor's layout without a new version);
# the values are the served weights' checks, read at each scope and access.
_Found = tuple[dict[str, Any], str, Tensor | None, tuple[object, ...] | None]
_Stamp = tuple[tuple[object, ...], tuple[Source, ...] | None, tuple[_Found, ...]]


def _metadata(tensor: Tensor | None) -> tuple[object, ...] | None:
    # Fusion._holds builds the same tuple inline.
    if tensor is None:
        return None
    return (
        type(tensor),
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
    )


def _stamp(member: _Member) -> _Stamp:
    parametrization = member.parametrization
    sources = member.door.sources(parametrization, member.chain)
    found: list[_Found] = []
    for owner, key in () if sources is None else sources:
        tensor = owner.get(key)
        found.append((owner, key, tensor, _metadata(tensor)))
    return member.door.settings(parametrization), sources, tuple(found)


def _candidates(module: nn.Module) -> Iterator[str]:
    """The names of ``module``'s tensors parametrized by one parametrization that has a door
    (one that knows how to join a fused launch).

    Not those of a layer whose forward writes into its weight: an embedding with
    ``max_norm`` renormalizes the rows it looks up in place (``embedding_renorm_``), which a
    fused weight, a view of one autograd node's output among several, cannot take.
    """
    holder = module._modules.get("parametrizations")
    if not isinstance(holder, nn.ModuleDict):
        return
    if getattr(module, "max_norm", None) is not None:
        return
    for name, chain in holder.items():
        modules = chain._modules
        if len(modules) == 1 and door_of(modules.get("0")) is not None:
            yield name


class _Group:
    """The members of one fused launch: one kind, device and dtype, and whether any of their
    originals requires grad."""

    __slots__ = ("checks", "members", "plans", "tensors")

    def __init__(self) -> None:
        self.members: list[_Member] = []
        self.plans: list[object] = []
        self.tensors: list[Tensor | None] = []
        self.checks: list[tuple[_Check, ...]] = []

    def check_again(self) -> None:
        """Each member's checks with its tensors' states now: the weights are computed from
        these."""
        # Their layouts are the ones found (the scope took these groups again because no
        # member's metadata changed).
        self.checks = taken_again(self.checks)


class _Layout:
    """The groups of a model's last scope, and whether a scope may take them again: while
    every member is current and unchanged (:meth:`Fusion._holds`), under the same CPU routing."""

    __slots__ = ("groups", "reusable", "routing")

    def __init__(self, groups: dict[_Key, _Group], routing: bool, reusable: bool) -> None:
        self.groups = groups
        self.routing = routing
        self.reusable = reusable


# A group's key: (its launch, device, dtype), whether any of its originals requires grad,
# and which chunk of those it is.
_Key = tuple[tuple[Any, ...], bool, int]

# Values (originals) of one fused launch at most. Every member's incoming gradient waits for
# its group's backward, which runs once all have arrived: where layers run in the order they
# were registered, groups of consecutive members hold at most one group's worth at a time.
MAX_GROUP_NUMEL = 2**25


class Fusion:
    """The fused scopes of one model: its members, and the scopes open now."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.members: list[_Member] = []
        self.lazy: list[nn.Module] = []
        self.levels: list[_Level] = []
        self.layout: _Layout | None = None
        self.handles: tuple[Any, ...] = ()
        self.collect()

    def collect(self) -> None:
        """Finds the model's members again; layers whose weights do not exist yet (lazy ones)
        are looked at again at each scope until they do."""
        members: list[_Member] = []
        lazy: list[nn.Module] = []
        for module in self.model.modules():
            if _parametrize.is_internal(module):
                continue
            members.extend(_Member(module, name) for name in _candidates(module))
            if any(map(_parametrize.is_uninitialized, module._parameters.values())):
                lazy.append(module)
        self.members, self.lazy = members, lazy
        self.layout = None

    def __getstate__(self) -> dict[str, object]:
        # Open scopes belong to the running forward, not to a copy.
        return {
            "model": self.model,
            "members": self.members,
            "lazy": self.lazy,
            "handles": self.handles,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model = state["model"]
        self.members = state["members"]
        self.lazy = state["lazy"]
        self.levels = []
        self.layout = None
        self.handles = state.get("handles", ())

    # --- the scope ------------------------------------------------------------------------

    def open(self, module: nn.Module, frame: FrameType) -> None:
        # A module that merely shares the hooks (DataParallel's replicas share the hook dict
        # of the module they copy) has members of its own: its layers take their own path.
        if module is not self.model:
            return
        if self.levels:
            self._forget_finished()
        level = _Level(frame)
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
            self._serve(groups, level)

    def close(self, module: nn.Module) -> None:
        if module is self.model and self.levels:
            self.levels.pop().close()

    def _groups(self) -> dict[_Key, _Group]:
        """This scope's groups: the last scope's, where nothing they were found from changed
        (checking that reads no tensor's values), else found again."""
        routing = _kernels.routing_cpu_tensors()
        layout = self.layout
        if layout is not None and layout.routing == routing and self._holds(layout):
            for group in layout.groups.values():
                group.check_again()
            return layout.groups
        groups, reusable = self._found()
        self.layout = _Layout(groups, routing, reusable)
        return groups

    def _holds(self, layout: _Layout) -> bool:
        """Whether every member is current (:meth:`_Member.current`), served by no other
        open scope, and what its fused inputs were found from holds: the same settings, and
        the same tensors in the same dicts with the same metadata (:func:`_metadata`). Inlined
        here: this runs for every member at every scope."""
        if not layout.reusable:
            return False
        for member in self.members:
            holder, chain = member.holder, member.chain
            if (
                member.module._modules.get("parametrizations") is not holder
                or holder._modules.get(member.name) is not chain
            ):
                return False
            modules = chain._modules
            first = modules.get("0")
            # (Never None: a member's parametrization has a door.)
            if first is None or first is not member.parametrization or "1" in modules:
                return False
            existing = chain.__dict__.get("forward")
            if existing is not None and not self._replaceable(existing):
                return False
            stamp = member.stamp
            if stamp is None:
                return False
            settings, sources, found = stamp
            if member.door.settings(member.parametrization) != settings:
                return False
            if sources is None:
                if member.door.sources(member.parametrization, chain) is not None:
                    return False
                continue
            # A tensor that moved between dicts (a gain made a buffer) is no longer where it
            # was found: the identity check sees it.
            for owner, key, tensor, meta in found:
                if owner.get(key) is not tensor:
                    return False
                if (
                    tensor is not None
                    and (
                        type(tensor),
                        tensor.shape,
                        tensor.stride(),
                        tensor.dtype,
                        tensor.device,
                        tensor.requires_grad,
                    )
                    != meta
                ):
                    return False
        return True

    def _found(self) -> tuple[dict[_Key, _Group], bool]:
        """The groups of the members that can join a launch now, and whether the next scope
        may take them again (not where a member is served by another model's open scope)."""
        groups: dict[_Key, _Group] = {}
        chunks: dict[tuple[tuple[Any, ...], bool], tuple[int, int]] = {}
        stale = False
        reusable = True
        for member in self.members:
            if not member.current():
                stale = True
                continue
            chain = member.chain
            existing = chain.__dict__.get("forward")
            if existing is not None and not self._replaceable(existing):
                reusable = False
                continue
            member.stamp = _stamp(member)
            try:
                found = member.door.fusion_inputs(member.parametrization, chain)
            except Exception:
                # Its checks fail: the layer raises at its own access, where it would
                # without fusion (a layer this forward does not use never raises).
                found = None
            if found is None:
                continue
            key, plan, tensors, checks = found
            needs_grad = False
            numel = 0
            for tensor in tensors:
                if tensor is not None:
                    needs_grad = needs_grad or tensor.requires_grad
                    numel += tensor.numel()
            kind = (key, needs_grad)
            chunk, size = chunks.get(kind, (0, 0))
            if size and size + numel > MAX_GROUP_NUMEL:
                chunk, size = chunk + 1, 0
            chunks[kind] = (chunk, size + numel)
            group = groups.get((key, needs_grad, chunk))
            if group is None:
                group = groups[(key, needs_grad, chunk)] = _Group()
            group.members.append(member)
            group.plans.append(plan)
            group.tensors.extend(tensors)
            group.checks.append(checks)
        if stale:
            self.members = [m for m in self.members if m.current()]
        # A kernel that failed finding a layer's launch (the fallback) left it out: found
        # again once the kernels are turned on again.
        return groups, reusable and not _fallback.broken()

    def _serve(self, groups: dict[_Key, _Group], level: _Level) -> None:
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
            for member, weight, checks in zip(group.members, weights, group.checks, strict=True):
                served = _Served(member.chain, level, weight, checks, inference, stream, member)
                member.chain.__dict__["forward"] = served
                level.served.append((member.chain, served))

    def _replaceable(self, existing: object) -> bool:
        """Whether another scope's weight on a member may be taken down: a closed one, or
        one whose forward is over (interrupted); not one that an open forward serves."""
        if not isinstance(existing, _Served):
            return False  # someone else's forward: not ours to replace
        if not existing.level.open:
            return True
        return existing.level.frame is not None and not _on_stack(existing.level.frame)

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
                self.members.extend(_Member(module, name) for name in _candidates(module))
                self.layout = None
        self.lazy = still


def _stack() -> set[int]:
    """The ids of the frames running now."""
    live = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        live.add(id(frame))
        frame = frame.f_back
    return live


def _on_stack(target: FrameType) -> bool:
    """Whether ``target`` runs now: a walk to it (a scope's frame is an ancestor of every
    access it serves, a few dozen frames up), without building :func:`_stack`'s set."""
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
    fusion.handles = (
        model.register_forward_pre_hook(_Open(fusion)),
        model.register_forward_hook(_Close(fusion), always_call=True),
    )
    return model


def unfuse(model: M) -> M:
    """Takes :func:`fuse`'s hooks off ``model``: each layer computes its own weight again."""
    fusion = fusion_of(model)
    if fusion is not None:
        for level in fusion.levels:
            level.close()
        for handle in fusion.handles:
            handle.remove()
    return model
