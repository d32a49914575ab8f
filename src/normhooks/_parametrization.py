"""Machinery shared by the weight standardization and weight normalization parametrizations.

- :class:`CachedParametrization`: computes the reparametrized weight once for inference and
  reuses it until one of its inputs changes.
- :func:`defer_until_materialized`: registers a parametrization on a lazy module at its first
  forward, once the weight exists.
- the argument checks and naming shared by the registration functions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook

HALF_DTYPES = (torch.float16, torch.bfloat16)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

_fsdp_seen: tuple[int, bool] = (-1, False)


def fsdp_in_use() -> bool:
    """Whether any module in this process is managed by FSDP2's ``fully_shard``."""
    global _fsdp_seen
    composable = sys.modules.get("torch.distributed._composable_state")
    if composable is None:
        return False
    states = getattr(composable, "_module_state_mapping", None)
    if states is None:  # a torch whose layout we do not know: assume FSDP, never cache
        return True
    if _fsdp_seen[0] != len(states):
        # The values are weak references to each composable API's state object.
        found = any(
            type(ref() if callable(ref) else ref).__name__ == "FSDPState"
            for ref in list(states.values())
        )
        _fsdp_seen = (len(states), found)
    return _fsdp_seen[1]


_optimizer_steps = 0
_watching_optimizers = False


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizers() -> None:
    """Counts every optimizer step of the process (a global step post-hook, installed once).

    Fused optimizers (``fused=True``) update parameters without bumping their version
    counters, so the count is what tells a cache that an optimizer may have moved them.
    """
    global _watching_optimizers
    if not _watching_optimizers:
        register_optimizer_step_post_hook(_count_step)
        _watching_optimizers = True


@dataclass
class _Entry:
    """A cached result and everything that must be unchanged for it to be served again."""

    result: Tensor
    result_version: int | None
    inputs: tuple[Tensor, ...]  # held, so their memory cannot be reused by other tensors
    versions: tuple[int, ...]
    pointers: tuple[int, ...]
    steps: int
    inference: bool

    @staticmethod
    def of(result: Tensor, inputs: tuple[Tensor, ...]) -> _Entry:
        return _Entry(
            result,
            None if result.is_inference() else result._version,
            inputs,
            tuple(t._version for t in inputs),
            tuple(t.data_ptr() for t in inputs),
            _optimizer_steps,
            torch.is_inference_mode_enabled(),
        )

    def serves(self, inputs: tuple[Tensor, ...]) -> bool:
        if (
            self.steps != _optimizer_steps
            or self.inference != torch.is_inference_mode_enabled()
            or len(inputs) != len(self.inputs)
            or (self.result_version is not None and self.result_version != self.result._version)
        ):
            return False
        # Lengths are equal (checked above), so a plain zip; this runs at every cached read.
        for tensor, held, pointer, version in zip(  # noqa: B905
            inputs, self.inputs, self.pointers, self.versions
        ):
            if tensor is not held or tensor._version != version or tensor.data_ptr() != pointer:
                return False
        return True


class _ReuseForward(torch.autograd.Function):
    """Returns a cached result while giving the inputs the gradients of a fresh computation."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        compute: Callable[..., Tensor],
        cached: Tensor,
        *tensors: Tensor,
    ) -> Tensor:
        ctx.compute = compute  # type: ignore[attr-defined]
        ctx.save_for_backward(*tensors)
        return cached.view_as(cached)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        differentiable = torch.is_grad_enabled()
        saved = ctx.saved_tensors
        # A differentiable backward (double backward) recomputes from the saved inputs, which
        # carry their history, so second derivatives stay exact.
        inputs = (
            saved
            if differentiable
            else tuple(t.detach().requires_grad_(t.requires_grad) for t in saved)
        )
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            grads = iter(
                torch.autograd.grad(ctx.compute(*inputs), wanted, grad, create_graph=differentiable)
            )
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))


class CachedParametrization(nn.Module):
    """A parametrization whose result is reused for inference.

    Subclasses implement ``compute(*inputs, *own_parameters)``. The result is computed once
    and reused whenever no gradient can reach those tensors (``torch.no_grad()``,
    ``inference_mode``, frozen weights) or the module is in eval mode, until an input or one
    of the module's own parameters changes: another tensor object, new storage, an in-place
    write (version counter), or any optimizer step in the process (fused optimizers do not
    bump version counters). In eval mode with autograd recording, the cached value is returned
    and the backward pass recomputes the gradients from the inputs, so first and second
    derivatives stay exact.

    In-place writes through ``.data`` bypass the version counter; the cache is also dropped
    at every ``train()``/``eval()`` switch, which covers the usual train-then-evaluate loop.
    Caching is off while any module of the process is sharded by FSDP2 (``fully_shard``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._entry: _Entry | None = None
        _watch_optimizers()

    def compute(self, *tensors: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, *inputs: Tensor) -> Tensor:
        own = self._parameters
        tensors = inputs + tuple(p for p in own.values() if p is not None) if own else inputs
        if torch.compiler.is_compiling():
            return self.compute(*tensors)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.training and any(t.requires_grad for t in tensors):
            # Training: a fresh result at every forward, and nothing kept.
            self._entry = None
            return self.compute(*tensors)
        entry = self._entry
        if entry is not None and not grad_enabled and entry.serves(tensors) and not fsdp_in_use():
            # The common inference read: torch's RNNs read each weight 2-3 times per forward,
            # and on an accelerator a layer's forward is mostly this Python.
            return entry.result
        if fsdp_in_use() or any(t.is_inference() for t in tensors):
            # FSDP2 hands over the same unsharded tensor each forward, refilled without a
            # version bump, and caching it would keep a full weight that FSDP means to free.
            return self.compute(*tensors)
        if entry is None or not entry.serves(tensors):
            self._entry = None
            with torch.no_grad():
                entry = self._entry = _Entry.of(self.compute(*tensors), tensors)
        if grad_enabled and any(t.requires_grad for t in tensors):
            # Eval mode with autograd recording: the cached value, with the gradients of a
            # fresh computation.
            result: Tensor = _ReuseForward.apply(  # type: ignore[no-untyped-call]
                self.compute, entry.result, *tensors
            )
            return result
        return entry.result

    def clear_cache(self) -> None:
        self._entry = None

    def train(self, mode: bool = True) -> CachedParametrization:
        self.clear_cache()
        return super().train(mode)

    def __getstate__(self) -> dict[str, Any]:
        # Copies recompute on first use instead of carrying another module's weight.
        state = dict(super().__getstate__())  # type: ignore[no-untyped-call]
        state["_entry"] = None
        return state


def parametrizations_of(module: nn.Module, name: str) -> list[nn.Module]:
    """The parametrizations registered on ``module.<name>``, outermost last."""
    if not parametrize.is_parametrized(module, name):
        return []
    return list(originals(module, name))


def parametrized_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s parametrized tensors."""
    holder = module._modules.get("parametrizations")
    return list(holder.keys()) if isinstance(holder, nn.ModuleDict) else []


def originals(module: nn.Module, name: str) -> parametrize.ParametrizationList:
    """The ParametrizationList of ``module.<name>``, which holds its original tensors."""
    holder = module._modules["parametrizations"]
    assert isinstance(holder, nn.ModuleDict)
    return cast(parametrize.ParametrizationList, holder[name])


def original(module: nn.Module, name: str, which: str) -> nn.Parameter:
    """One original tensor of ``module.<name>``: ``original``, ``original0``, ..."""
    return cast(nn.Parameter, getattr(originals(module, name), which))


class _Deferred:
    """Forward pre-hook that registers a parametrization once a lazy weight is materialized.

    It runs after the lazy module's own pre-hook (hooks run in registration order), which
    has created the weight by then, and removes itself after it has run.
    """

    def __init__(self, name: str, register: Callable[[nn.Module], object], marker: str) -> None:
        self.name = name
        self.register = register
        self.marker = marker

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if any(is_uninitialized(p) for p in module.parameters(recurse=False)):
            return
        cancel_deferred(module, self.name, self.marker)
        self.register(module)


def defer_until_materialized(
    module: nn.Module, name: str, register: Callable[[nn.Module], object], marker: str
) -> None:
    """Runs ``register(module)`` at the first forward, when ``module.<name>`` exists."""
    module.register_forward_pre_hook(_Deferred(name, register, marker))


def deferred(module: nn.Module, name: str, marker: str) -> _Deferred | None:
    """The pending registration of kind ``marker`` for ``module.<name>``, if any."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _Deferred) and hook.name == name and hook.marker == marker:
            return hook
    return None


def cancel_deferred(module: nn.Module, name: str, marker: str) -> bool:
    """Removes a pending registration; returns whether there was one."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if isinstance(hook, _Deferred) and hook.name == name and hook.marker == marker:
            del module._forward_pre_hooks[hook_id]
            return True
    return False


def is_uninitialized(tensor: object) -> bool:
    """Whether ``tensor`` is a lazy module's parameter or buffer that does not exist yet."""
    return isinstance(tensor, (nn.UninitializedParameter, nn.UninitializedBuffer))


def layer_name(module: nn.Module) -> str:
    """The module's class name, without the ``Parametrized`` class parametrize wraps it in."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        cls = cls.__bases__[0]
    return cls.__name__


def describe(module: nn.Module, name: str) -> str:
    """How errors name a module's parameter: ``Conv2d.weight``."""
    return f"{layer_name(module)}.{name}"


def expected_ndim(module: nn.Module) -> int | None:
    """The weight's dimensions, for lazy modules whose weight does not exist yet."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return 2 + len(module.kernel_size)
    if isinstance(module, nn.Linear):
        return 2
    return None


def output_axis(module: nn.Module) -> int:
    """The axis of a layer's weight that indexes its output channels."""
    return 1 if isinstance(module, TRANSPOSED) else 0


def checked_tensor(module: nn.Module, name: str, what: str) -> Tensor | None:
    """The tensor ``module.<name>`` after the checks every entry point shares.

    Returns None for a lazy module's weight that does not exist yet.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got name={name!r}")
    if parametrize.is_parametrized(module, name):
        # Stacked on another parametrization: what gets standardized is its output.
        weight: Tensor | None = getattr(module, name)
    elif name in module._parameters:
        weight = module._parameters[name]
    elif hasattr(module, name):
        found = type(getattr(module, name)).__name__
        raise TypeError(
            f"{describe(module, name)} must be a torch.nn.Parameter to apply {what}, got {found}"
        )
    else:
        raise ValueError(f"{layer_name(module)} has no parameter named {name!r}")
    if weight is None:
        raise ValueError(f"{describe(module, name)} is None; there is no weight to {what}")
    if is_uninitialized(weight):
        return None
    refuse_wrapped(module, what, weight, name)
    if not isinstance(weight, nn.Parameter) and not parametrize.is_parametrized(module, name):
        raise TypeError(
            f"{describe(module, name)} must be a torch.nn.Parameter to apply {what}, "
            f"got {type(weight).__name__}"
        )
    if not weight.is_floating_point():
        raise TypeError(
            f"{describe(module, name)} must be a floating-point tensor for {what}, "
            f"got dtype {weight.dtype}"
        )
    return weight


def refuse_wrapped(
    module: nn.Module, what: str, tensor: Tensor | None = None, name: str = "weight"
) -> None:
    """Raises if ``module`` was already wrapped by DDP or ``fully_shard``.

    Both must come after the reparametrization: DDP attaches its gradient hooks to the
    parameters it finds at construction and would never average new ones, and FSDP2 keeps
    managing the old name while the new originals stay sharded DTensors outside forward.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    if tensor is not None and dtensor is not None and isinstance(tensor, dtensor.DTensor):
        raise ValueError(
            f"{describe(module, name)} is a DTensor: the model is already sharded by "
            f"fully_shard. Apply {what} before fully_shard"
        )
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is not None and any(
        isinstance(m, ddp.DistributedDataParallel) for m in module.modules()
    ):
        raise ValueError(
            f"{layer_name(module)} is wrapped by DistributedDataParallel. Apply {what} "
            "before wrapping: DDP only averages the gradients of the parameters it saw at "
            "construction"
        )
