"""What a model's fused launches take: its members, their groups, and whether the last scope's
groups still hold.

A member is a tensor parametrized by exactly one parametrization with a registered door
(``_door``: :class:`~normhooks.WeightNorm`, :class:`~normhooks.WeightStandardization`) that
the kernels can compute. Not one whose originals are not plain tensors on a device the
kernels take (FSDP2's DTensors, tensor subclasses, the CPU), nor of a layer a fused launch
cannot take (few long rows, non-contiguous weights, WN with ``dim=None`` or two dtypes, WS of
another axis or of grouped transposed convolutions, embeddings with ``max_norm``, whose
forward writes into the weight), nor one that another model's open scope serves (a layer
shared by two models): those layers compute their own weights, as without fusion.

A scope takes the last scope's groups (kernel plans, launches) again where nothing they were
found from changed (:func:`holds`): every member current, its settings, and each original the
same tensor with the same metadata (type, shape, strides, dtype, device, ``requires_grad``; a
write through ``.data`` changes these without a new version), found in the same dict (a gain
moved from the Parameters to the buffers is found again). That reads no tensor's values; the
values are the served weights' checks, read at each scope and access.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from normhooks._kernels import _fallback
from normhooks._kernels._cache import Check, State
from normhooks._kernels._door import Door, Source, door_of
from normhooks._kernels._served import replaceable
from normhooks._torch_compat import forward_hooked

_new_state = State.__new__


class Member:
    """A parametrized tensor of the model that a fused launch may compute."""

    __slots__ = (
        "chain",
        "checks",
        "depth",
        "door",
        "found",
        "holder",
        "module",
        "name",
        "parametrization",
        "settings",
        "sources",
    )

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        holder = module._modules["parametrizations"]
        assert holder is not None  # found by candidates
        chain = holder._modules[name]
        assert chain is not None
        self.holder: nn.Module = holder
        self.chain: nn.Module = chain
        self.parametrization: Any = chain._modules["0"]
        door = door_of(self.parametrization)
        assert door is not None  # found by candidates
        self.door: Door = door
        # What its fused inputs were last found from (see stamp): its settings (None before
        # the first scope), where a launch finds its tensors (None where it takes none), and
        # for each of those the dict, the key and the tensor's state (None for a tensor it
        # lacks: plain WS's gain).
        self.settings: tuple[object, ...] | None = None
        self.sources: tuple[Source, ...] | None = None
        self.found: tuple[tuple[dict[str, Any], str, State | None], ...] = ()
        # The served weight's checks: the states of the tensors it has (see _served.Served).
        self.checks: tuple[Check, ...] = ()
        # How many frames above a served access of its weight its scope's frame was found
        # last time (see _served.Served.__call__).
        self.depth = 1

    def current(self) -> bool:
        """Whether the tensor still carries the one parametrization it had when found."""
        holder = self.module._modules.get("parametrizations")
        if holder is not self.holder or self.holder._modules.get(self.name) is not self.chain:
            return False
        modules = self.chain._modules
        return (
            modules.get("0") is self.parametrization
            and "1" not in modules
            and not forward_hooked(self.parametrization)
        )


def candidates(module: nn.Module) -> Iterator[str]:
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
        first = modules.get("0")
        # A parametrization with hooks of its own is called, so that they run.
        fusable = len(modules) == 1 and first is not None and door_of(first) is not None
        if fusable and not forward_hooked(first):
            yield name


def stamp(member: Member) -> None:
    """Records what ``member``'s fused inputs are found from now: its settings, and the state
    of each tensor a launch takes (:class:`~normhooks._kernels._cache.State`: metadata and
    versions, no values)."""
    parametrization = member.parametrization
    sources = member.door.sources(parametrization, member.chain)
    found: list[tuple[dict[str, Any], str, State | None]] = []
    checks: list[Check] = []
    for owner, key in () if sources is None else sources:
        tensor = owner.get(key)
        if tensor is None:
            found.append((owner, key, None))
        else:
            check = (owner, key, State(tensor))
            found.append(check)
            checks.append(check)
    member.settings = member.door.settings(parametrization)
    member.sources = sources
    member.found = tuple(found)
    member.checks = tuple(checks)


class Group:
    """The members of one fused launch: one kind, device and dtype, and whether any of their
    originals requires grad."""

    __slots__ = ("members", "plans", "tensors")

    def __init__(self) -> None:
        self.members: list[Member] = []
        self.plans: list[object] = []
        self.tensors: list[Tensor | None] = []


# A group's key: (its launch, device, dtype), whether any of its originals requires grad,
# and which chunk of those it is.
GroupKey = tuple[tuple[Any, ...], bool, int]


class Grouping:
    """The groups of a model's last scope, and whether a scope may take them again: while
    every member is current and unchanged (:func:`holds`), under the same CPU routing."""

    __slots__ = ("groups", "reusable", "routing")

    def __init__(self, groups: dict[GroupKey, Group], routing: bool, reusable: bool) -> None:
        self.groups = groups
        self.routing = routing
        self.reusable = reusable


# Values (originals) of one fused launch at most. Every member's incoming gradient waits for
# its group's backward, which runs once all have arrived: where layers run in the order they
# were registered, groups of consecutive members hold at most one group's worth at a time.
MAX_GROUP_NUMEL = 2**25


def holds(grouping: Grouping, members: list[Member]) -> bool:
    """Whether every member is current (:meth:`Member.current`), served by no other open
    scope, and what its fused inputs were found from holds (:func:`stamp`): the same settings,
    and the same tensors in the same dicts with the same type, layout and ``requires_grad``
    (``_cache.Fields``). Where they do, each member's states are taken again with the versions
    and addresses now: its weight is computed from these. Inlined here: this runs for every
    member at every scope."""
    if not grouping.reusable:
        return False
    for member in members:
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
        if first._forward_hooks or first._forward_pre_hooks:  # _torch_compat.forward_hooked
            return False
        existing = chain.__dict__.get("forward")
        if existing is not None and not replaceable(existing):
            return False
        settings = member.settings
        if settings is None or member.door.settings(first) != settings:
            return False
        if member.sources is None:
            if member.door.sources(first, chain) is not None:
                return False
            continue
        # A tensor that moved between dicts (a gain made a buffer) is no longer where it
        # was found: the identity check sees it.
        found: list[tuple[dict[str, Any], str, State | None]] = []
        checks: list[Check] = []
        for owner, key, state in member.found:
            tensor = owner.get(key)
            if state is None:
                if tensor is not None:
                    return False
                found.append((owner, key, None))
                continue
            if tensor is not state.tensor:
                return False
            # _cache.fields_of but the version and address, compared one by one.
            old = state.fields
            if (
                type(tensor) is not old[2]
                or tensor.stride() != old[3]
                or tensor.shape != old[4]
                or tensor.dtype != old[5]
                or tensor.device != old[6]
                or tensor.requires_grad != old[7]
            ):
                return False
            # (Element by element: a slice and unpacking would build two more tuples.)
            fields = (
                tensor._version,
                tensor.data_ptr(),
                old[2],
                old[3],
                old[4],
                old[5],
                old[6],
                old[7],
            )
            # The state now, made here rather than by a call (this runs for every original
            # at every scope): the same tensor, its fields now, and its storage object taken
            # over where the address is the same (the same memory: the storage kept alive
            # holds it), rather than asked of the tensor again.
            now = _new_state(State)
            now.tensor = tensor
            now.fields = fields
            now.storage = state.storage if fields[1] == old[1] else tensor.untyped_storage()
            check = (owner, key, now)
            found.append(check)
            checks.append(check)
        member.found = tuple(found)
        member.checks = tuple(checks)
    return True


def grouped(members: list[Member]) -> tuple[dict[GroupKey, Group], bool]:
    """The groups of the members that can join a launch now, and whether the next scope may
    take them again (not where a member is served by another model's open scope)."""
    groups: dict[GroupKey, Group] = {}
    chunks: dict[tuple[tuple[Any, ...], bool], tuple[int, int]] = {}
    reusable = True
    for member in members:
        chain = member.chain
        existing = chain.__dict__.get("forward")
        if existing is not None and not replaceable(existing):
            reusable = False
            continue
        stamp(member)
        try:
            found = member.door.fusion_inputs(member.parametrization, chain)
        except Exception:
            # Its checks fail: the layer raises at its own access, where it would without
            # fusion (a layer this forward does not use never raises).
            found = None
        if found is None:
            continue
        key, plan, tensors = found
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
            group = groups[(key, needs_grad, chunk)] = Group()
        group.members.append(member)
        group.plans.append(plan)
        group.tensors.extend(tensors)
    # A kernel that failed finding a layer's launch (the fallback) left it out: found again
    # once the kernels are turned on again.
    return groups, reusable and not _fallback.broken()
