"""What a step asks of the host, counted: aten ops, Triton launches, autograd nodes."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from normhooks import _torch_compat

# Ops that only allocate: what a kernel's outputs cost the host before its launch.
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


class AtenOps(TorchDispatchMode):
    """Counts the aten ops that reach the backends (after autograd and the decomposition of
    composite ops) in three kinds: allocations, views, and the others (``ops``: those that
    compute, on a GPU about one kernel launch each); ``by_name`` counts every op by overload,
    other namespaces' too."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.ops = 0
        self.allocations = 0
        self.views = 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.by_name[str(func)] += 1
        # Other namespaces are the optimizers' record_function markers (profiler.*): no work.
        if func.namespace == "aten":
            if func._overloadpacket.__name__ in ALLOCATIONS:
                self.allocations += 1
            elif func.is_view:
                self.views += 1
            else:
                self.ops += 1
        return func(*args, **(kwargs or {}))


def _other_modes_active() -> bool:
    return any(not isinstance(m, AtenOps) for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def counting_ops() -> Iterator[AtenOps]:
    """Counts the aten ops of the block, whose dispatch stays what it is without the counter.

    normhooks gives the plain formula to code under a dispatch mode (fake tensors, tracing
    modes): while counting, the dispatch rule is told of every mode but this counter, so the
    block takes the path it takes when timed (``step_counts`` checks that through the launch
    counts).
    """
    counter = AtenOps()
    with mock.patch.object(_torch_compat, "dispatch_mode_active", _other_modes_active), counter:
        yield counter


def autograd_nodes(root: torch.Tensor) -> tuple[int, int]:
    """``(nodes, Python nodes)`` of the graph behind ``root``: every node backward will run,
    and those of them that run Python (custom ``autograd.Function`` backwards)."""
    seen: set[torch.autograd.graph.Node] = set()
    stack = [root.grad_fn] if root.grad_fn is not None else []
    python = 0
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            python += 1
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return len(seen), python


@dataclass
class Counts:
    """What one call asked of the host."""

    ops: int  # aten ops that compute (on a GPU, about one launch each)
    allocations: int  # aten ops that only allocate
    views: int  # aten ops that make views
    launches: int  # Triton launches
    nodes: int = 0  # autograd nodes of the loss's graph
    python_nodes: int = 0  # of which run Python in backward


def count(call: Callable[[], torch.Tensor | None], launches: Callable[[], int]) -> Counts:
    """Counts one ``call()``; where it returns a loss, its graph is walked and its backward
    runs under the counter too. ``launches()`` reads the Triton launch counter.

    Runs ``call`` once more without the op counter first and raises if the launch counts
    differ: counting must not change the path the call takes.
    """

    first = launches()
    loss = call()
    if loss is not None:
        loss.backward()
    uncounted = launches() - first
    nodes = python = 0
    with counting_ops() as counter:
        first = launches()
        loss = call()
        if loss is not None:
            nodes, python = autograd_nodes(loss)
            loss.backward()
        counted = launches() - first
    if counted != uncounted:
        raise RuntimeError(
            f"the op counter changed the path: {counted} Triton launches with it against "
            f"{uncounted} without it"
        )
    return Counts(counter.ops, counter.allocations, counter.views, counted, nodes, python)
