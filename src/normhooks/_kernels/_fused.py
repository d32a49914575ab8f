"""One launch each way for many layers: the mechanism that fused weight normalization and
fused weight standardization share.

A fused plan covers layers of one device and dtype whose rows are whole (one program each):
it lays their results end to end in one flat output, their gains' gradients in one flat
buffer of rows, and finds each layer's tensors through a table of int64 entries on the device
(:data:`FIELDS` per layer) and each row's layer through a second one. Backward finds the
incoming gradients through a table of their addresses, 0 for a result that got none (its
rows write nothing). A technique supplies its per-layer plans, its table entries and the
layouts of its results, its two kernels, and its per-layer plans' formula in differentiable
torch ops, which a double backward goes through.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from normhooks._kernels import _fallback
from normhooks._kernels._cache import KeyedCache, layout
from normhooks._kernels._cache import Layout as TensorLayout
from normhooks._kernels._common import (
    DeviceTable,
    acc_dtype,
    current_stream,
    device_index,
    tl_dtype,
)
from normhooks._kernels._launch import Kernel
from normhooks._torch_compat import function_apply

# Entries of 8 int64 fields per layer: the row table after them stays 64-byte aligned.
FIELDS = 8
# Fused plans kept per technique (each holds a table on the device), and tables of
# incoming-gradient addresses per plan: a training loop meets one set each way, the allocator
# reusing the same blocks step after step.
MAX_FUSED = 32
MAX_GRADIENT_TABLES = 8

# A tensor's sizes and strides; with its offset, its place in a flat buffer, as
# ``Tensor.as_strided`` takes it.
Strided = tuple[tuple[int, ...], tuple[int, ...]]
Layout = tuple[tuple[int, ...], tuple[int, ...], int]


class LayerPlan(Protocol):
    """What a fused plan reads from a layer's own plan."""

    @property
    def count(self) -> int:
        """The layer's rows."""

    @property
    def block(self) -> int:
        """Values its row kernels read per loop step."""

    def differentiable(self, first: Tensor, second: Tensor | None) -> Tensor:
        """The layer's result in differentiable torch ops, from its two inputs."""


P = TypeVar("P", bound=LayerPlan)


def differentiable_grads(
    plan: LayerPlan, pair: Sequence[Tensor | None], grad: Tensor | None
) -> list[Tensor | None]:
    """The gradients of a layer's two inputs, with their graph (a double backward: the
    kernels' backward is not itself differentiable, the plain formula is, and the saved
    inputs keep their history). None for an input that is None or needs none."""
    wanted = [t for t in pair if t is not None and t.requires_grad]
    if grad is None or not wanted:
        return [None, None]
    # A layer's first input is never None (only a standardization's gain, its second, may be).
    result = plan.differentiable(*pair)  # type: ignore[arg-type]
    found = iter(torch.autograd.grad(result, wanted, grad, create_graph=True))
    return [next(found) if t is not None and t.requires_grad else None for t in pair]


class FusedPlan(abc.ABC, Generic[P]):
    """Layers of one device and dtype computed in one launch each way, from their inputs
    ``first0, second0, first1, second1, ...``: their tables on the device, where each result
    and each gain's gradient lies in its flat buffer, and the tables of incoming-gradient
    addresses met so far.

    Its content is a function of the key it is found under (:meth:`find`: the layers' plans
    and their inputs' addresses), so it is never stale. A technique's subclass says which of a
    layer's two inputs is the gain and defines :meth:`entry`, :meth:`buffers` and
    :meth:`kernels`.
    """

    gain_at: ClassVar[int]
    """Which of a layer's two inputs is its gain (one value per row); the other is the
    tensor whose values the flat output's layout follows."""
    _found: ClassVar[KeyedCache[tuple[object, ...], Any]]

    def __init_subclass__(cls) -> None:
        cls._found = KeyedCache(MAX_FUSED)

    def __init__(self, plans: tuple[P, ...], tensors: Sequence[Tensor | None]) -> None:
        entries: list[int] = []
        row_layers: list[int] = []
        self.outputs: list[Layout] = []
        self.gains: list[Layout] = []
        numel = rows = block = 0
        for layer, plan in enumerate(plans):
            first, second = tensors[2 * layer], tensors[2 * layer + 1]
            entry, (shape, strides), (gain_shape, gain_strides) = self.entry(
                plan, first, second, numel, rows
            )
            entries += entry
            row_layers += [layer] * plan.count
            self.outputs.append((shape, strides, numel))
            self.gains.append((gain_shape, gain_strides, rows))
            numel += math.prod(shape)
            rows += plan.count
            block = max(block, plan.block)
        values = tensors[1 - self.gain_at]
        assert values is not None  # only gains may be None
        self.dtype, self.device = values.dtype, values.device
        self.device_index = device_index(values.device)
        self.numel, self.rows = numel, rows
        self.grid = (rows, 1)
        self.table = DeviceTable([entries, row_layers], values.device)
        self.layers, self.row_layers = self.table.parts
        self.constexprs = (tl_dtype(values.dtype), acc_dtype(values.dtype), block, FIELDS)
        self.plans = plans
        # The inputs' layouts, which the layers' plans were made for (a backward whose inputs
        # changed layout since cannot use them).
        self.layouts: tuple[TensorLayout | None, ...] = tuple(
            [None if t is None else layout(t) for t in tensors]
        )
        # Where the inputs were when this plan was found (set by find): its table's addresses.
        self.addresses: tuple[int, ...] = ()
        # The compiled kernels this plan launches, by the alignment of their pointers.
        self.forward_kernels: dict[Any, Any] = {}
        self.backward_kernels: dict[Any, Any] = {}
        self.gradient_tables: KeyedCache[tuple[int, ...], DeviceTable] = KeyedCache(
            MAX_GRADIENT_TABLES
        )

    @abc.abstractmethod
    def entry(
        self, plan: P, first: Tensor | None, second: Tensor | None, numel: int, rows: int
    ) -> tuple[list[int], Strided, Strided]:
        """A layer's :data:`FIELDS` table fields, given where its result starts in the flat
        output (``numel``) and its first row's index among all rows; the sizes and strides of
        its result, then of its gain's gradient."""

    def buffers(self) -> tuple[Tensor, ...]:
        """What the forward kernel writes besides the results, for backward to read."""
        return ()

    @abc.abstractmethod
    def kernels(self) -> tuple[Kernel, Kernel]:
        """The forward and backward kernels, as the technique's module holds them now."""

    @classmethod
    def find(cls, plans: tuple[P, ...], tensors: Sequence[Tensor | None]) -> Any:
        """The fused plan of ``plans``' layers, whose inputs are ``tensors``."""
        addresses = _addresses(tensors)
        key = (plans, addresses)
        found = cls._found.get(key)
        if found is None:
            found = cls(plans, tensors)
            found.addresses = addresses
            cls._found.put(key, found)
        return found

    def gradient_table(self, addresses: tuple[int, ...]) -> Tensor:
        """The table of incoming-gradient ``addresses``, safe on the current stream."""
        table = self.gradient_tables.get(addresses)
        if table is None:
            table = self.gradient_tables.put(addresses, DeviceTable([addresses], self.device))
        table.use_on(current_stream(self.device))
        return table.storage


def formula_grads(
    plan: LayerPlan, pair: Sequence[Tensor | None], grad: Tensor | None
) -> list[Tensor | None]:
    """:func:`differentiable_grads` without a graph of their own, from inside a backward:
    the gradients of the plain formula, where the kernels cannot be trusted (the inputs
    changed layout since the forward) or failed here."""
    with torch.enable_grad():
        wanted = [t for t in pair if t is not None and t.requires_grad]
        if grad is None or not wanted:
            return [None, None]
        result = plan.differentiable(*pair)  # type: ignore[arg-type]
        found = iter(torch.autograd.grad(result, wanted, grad))
        return [next(found) if t is not None and t.requires_grad else None for t in pair]


def check_unmodified(inputs: Sequence[tuple[Tensor | None, int]]) -> None:
    """Raises autograd's own error where an input needed for a gradient was written in place
    since the forward (the fused node keeps its inputs itself, see :class:`_Fused`): each
    input with its version at the forward."""
    for tensor, version in inputs:
        if tensor is not None and tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
                f"{tensor._version}; expected version {version} instead (an original "
                "of a weight that normhooks' fused launch computed, written after that weight "
                "was used)"
            )


class _Fused(torch.autograd.Function):
    """The fused launch as one autograd node.

    It keeps its inputs with their versions instead of saving them for backward: a layer
    whose original is written in place inside the forward before its weight is used (a
    max-norm constraint in a pre-hook) computes its weight itself, and its fused weight gets
    no gradient; autograd's saved-tensor check would refuse the whole node for it. The check
    is done here (the validity rule of ``_cache``: version, memory, layout), per layer, for
    the layers whose weights got a gradient.
    """

    @staticmethod
    def forward(ctx: Any, plan: FusedPlan[Any], *tensors: Tensor | None) -> tuple[Tensor, ...]:
        # A result that no layer used gets no gradient: None, not zeros, so its inputs get
        # none either, exactly as without fusion.
        ctx.set_materialize_grads(False)
        ctx.plan = plan
        output = torch.empty(plan.numel, dtype=plan.dtype, device=plan.device)
        buffers = plan.buffers()
        ctx.save_for_backward(*buffers)
        ctx.inputs = tensors
        # The versions now; the layouts are the plan's (its layers' plans were made for them).
        ctx.versions = tuple([0 if t is None else t._version for t in tensors])
        plan.table.use_on(current_stream(plan.device))
        forward, _ = plan.kernels()
        forward(
            plan.forward_kernels,
            plan.grid,
            plan.device_index,
            (plan.row_layers,),
            plan.layers,
            plan.row_layers,
            output,
            *buffers,
            *plan.constexprs,
        )
        view = output.as_strided
        return tuple([view(*layout) for layout in plan.outputs])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        buffers = ctx.saved_tensors
        tensors = ctx.inputs
        plan: FusedPlan[Any] = ctx.plan
        # One pass over the inputs: where each is now (its address, 0 for None), and, of the
        # layers whose weights got a gradient, each input unmodified since the forward (the
        # first that is not raises, as check_unmodified of all of them would) and whether any
        # changed layout (``_cache.layout``, inline).
        versions, layouts = ctx.versions, plan.layouts
        relaid = False
        now = [0] * len(tensors)
        for layer, g in enumerate(grads):
            for i in (2 * layer, 2 * layer + 1):
                tensor = tensors[i]
                if tensor is None:
                    continue
                now[i] = tensor.data_ptr()
                if g is None:
                    continue
                if tensor._version != versions[i]:
                    check_unmodified(((tensor, versions[i]),))  # raises autograd's error
                if (
                    type(tensor),
                    tensor.shape,
                    tensor.stride(),
                    tensor.dtype,
                    tensor.device,
                ) != layouts[i]:
                    relaid = True
        result: list[Tensor | None] = [None]
        if torch.is_grad_enabled() or relaid:
            # create_graph: through the plain formula, layer by layer; the same where an input
            # changed layout since the forward (same values, other strides), which the layers'
            # plans and the forward's buffers were made for.
            grads_of = differentiable_grads if torch.is_grad_enabled() else formula_grads
            for layer, grad in enumerate(grads):
                pair = tensors[2 * layer : 2 * layer + 2]
                result += grads_of(plan.plans[layer], pair, grad)
            return tuple(result)
        if tuple(now) != plan.addresses:
            # An input kept its identity and layout but got new memory since the forward
            # (FSDP1 frees and regathers parameters, ZeRO-3 swaps their .data): the table the
            # forward launched with points at the old memory. The plan of where they are now.
            plan = type(plan).find(plan.plans, tensors)
        try:
            return _kernel_backward(ctx, plan, grads, buffers)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError):
                raise
            _fallback.failed("a fused launch's backward", error)
            for layer, grad in enumerate(grads):
                pair = tensors[2 * layer : 2 * layer + 2]
                result += formula_grads(plan.plans[layer], pair, grad)
            return tuple(result)


def _kernel_backward(
    ctx: Any, plan: FusedPlan[Any], grads: tuple[Tensor | None, ...], buffers: tuple[Tensor, ...]
) -> tuple[Tensor | None, ...]:
    result: list[Tensor | None] = [None]
    incoming = [None if grad is None else grad.contiguous() for grad in grads]
    addresses = tuple([0 if grad is None else grad.data_ptr() for grad in incoming])
    grad_values = torch.empty(plan.numel, dtype=plan.dtype, device=plan.device)
    grad_gains = torch.empty(plan.rows, dtype=plan.dtype, device=plan.device)
    _, backward = plan.kernels()
    backward(
        plan.backward_kernels,
        plan.grid,
        plan.device_index,
        (plan.row_layers,),
        plan.layers,
        plan.row_layers,
        plan.gradient_table(addresses),
        *buffers,
        grad_values,
        grad_gains,
        *plan.constexprs,
    )
    values_view, gains_view = grad_values.as_strided, grad_gains.as_strided
    # A None input (a weight without a gain) needs no gradient.
    needs = ctx.needs_input_grad
    gain_at = plan.gain_at
    for layer, grad in enumerate(grads):
        if grad is None:
            result += [None, None]
            continue
        at = 2 * layer + 1
        for side in (0, 1):
            if not needs[at + side]:
                result.append(None)
            elif side == gain_at:
                result.append(gains_view(*plan.gains[layer]))
            else:
                result.append(values_view(*plan.outputs[layer]))
    return tuple(result)


def _addresses(tensors: Sequence[Tensor | None]) -> tuple[int, ...]:
    return tuple([0 if t is None else t.data_ptr() for t in tensors])


_APPLY = function_apply(_Fused)


def fused_results(plan: FusedPlan[Any], tensors: Sequence[Tensor | None]) -> tuple[Tensor, ...]:
    """The results of the layers of ``plan``, from their inputs, in one launch (their
    gradients in one more), on plain eager tensors."""
    results: tuple[Tensor, ...] = _APPLY(plan, *tensors)
    return results
