"""Attaching a step hook: the optimizer it goes on, unwrapped, and the optimizers it refuses."""

from __future__ import annotations

import torch

from normhooks import _torch_compat as compat
from normhooks._step_hook.core import HookCore

# The optimizer wrappers that frameworks hand to user code, by the module and name of a class
# in their MRO (so subclasses count, accelerate's DeepSpeedOptimizerWrapper included), and the
# attribute holding the optimizer whose step they run. Matched by name: nothing is imported.
_FRAMEWORK_WRAPPERS = {
    ("accelerate.optimizer", "AcceleratedOptimizer"): "optimizer",
    ("lightning.pytorch.core.optimizer", "LightningOptimizer"): "_optimizer",
    ("pytorch_lightning.core.optimizer", "LightningOptimizer"): "_optimizer",
}


def _unwrap(optimizer: object) -> object:
    """The optimizer inside accelerate's and Lightning's wrappers (nested ones too)."""
    while True:
        attribute = next(
            (
                _FRAMEWORK_WRAPPERS[key]
                for cls in type(optimizer).__mro__
                if (key := (cls.__module__, cls.__qualname__)) in _FRAMEWORK_WRAPPERS
            ),
            None,
        )
        inner = None if attribute is None else getattr(optimizer, attribute, None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner


def hooks_on(optimizer: torch.optim.Optimizer) -> list[tuple[int, HookCore]]:
    """The step hooks whose pre-step is in ``optimizer``'s hook dict, with their handle ids.

    The dict, not the Python object, is what a step runs: a wrapper that forwards its
    attributes shares the dict of the optimizer it wraps.
    """
    found = []
    for key, hook in compat.step_pre_hooks(optimizer):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, HookCore) and getattr(hook, "__name__", None) == "_pre_step":
            found.append((key, owner))
    return found


def _wrapped(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that ``optimizer`` holds in ``.optimizer`` and steps, innermost last.

    pytorch_optimizer's Lookahead and ScheduleFreeWrapper, for instance, hold the optimizer
    they step there.
    """
    chain: list[torch.optim.Optimizer] = []
    current: object = optimizer
    while True:
        inner = getattr(current, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer or inner in chain:
            return chain
        chain.append(inner)
        current = inner


def _held_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`` (its .name, a Class)`` for an optimizer that ``optimizer`` holds, or ''."""
    for name, value in vars(optimizer).items():
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer:
            return f" (its .{name}, a {type(value).__name__})"
    return ""


def optimizer_to_hook(hook: HookCore, given: object) -> torch.optim.Optimizer:
    """``given`` unwrapped, after refusing the optimizers whose step the hook cannot
    serve."""
    name = type(hook).__name__
    optimizer = _unwrap(given)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if compat.is_deepspeed(optimizer):
            raise TypeError(
                f"optimizer is DeepSpeed's {type(optimizer).__name__}, not a "
                "torch.optim.Optimizer: DeepSpeed's ZeRO and fp16/bf16 optimizers step "
                "flat tensors that hold pieces of many parameters, so the norms "
                f"{name} needs do not exist there, and attaching to the torch optimizer "
                "inside it (its .optimizer) would be silently wrong. Use DDP or FSDP2 "
                "(torch.distributed.fsdp.fully_shard), or DeepSpeed without ZeRO and "
                "without its fp16/bf16 modes, where the engine steps your own optimizer"
            )
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(given).__name__}")
    if not compat.step_runs_hooks(optimizer):
        raise TypeError(
            f"{name} cannot be attached to {type(optimizer).__name__}: its step runs no "
            "step hooks (torch.optim.Optimizer.__init__, which wraps a class's step so "
            f"that it runs them, was never called for it), so {name} would be silently "
            f"ignored. Attach {name} to the optimizer it wraps and steps"
            f"{_held_optimizer(optimizer)}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            f"{name} cannot be attached to LBFGS: LBFGS evaluates its closure many times "
            "per step, and the hook can only rewrite the gradients of one evaluation"
        )
    base = getattr(optimizer, "base_optimizer", None)
    if isinstance(base, torch.optim.Optimizer) and base is not optimizer:
        raise TypeError(
            f"{name} cannot be attached to {type(optimizer).__name__}, which steps a "
            f"base_optimizer ({type(base).__name__}): like SAM, it moves the parameters, "
            "evaluates its closure there and then has base_optimizer step with those "
            f"gradients, which the hook would never see. Attach {name} to "
            "optimizer.base_optimizer: its step takes exactly those gradients, at the "
            "restored parameters"
        )
    inner = _wrapped(optimizer)
    if inner and hook.rewrites == "updates":
        raise TypeError(
            f"{name} cannot be attached to {type(optimizer).__name__}, which steps the "
            f"{type(inner[0]).__name__} it wraps (its .optimizer) and may move the "
            f"parameters itself (as Lookahead does): {name} rescales the change of the "
            "parameters over the whole step and would rescale that too. Attach it to "
            "optimizer.optimizer"
        )
    return optimizer


def refuse_a_second_one(hook: HookCore, optimizer: torch.optim.Optimizer) -> None:
    """Raises if a hook of this technique is on ``optimizer``'s hook dict already, or on
    that of an optimizer it wraps (which its step steps: both would apply).

    Keyed by the technique's prefix, so a subclass cannot slip in a second one either.
    """
    name = type(hook).__name__
    for _, other in hooks_on(optimizer):
        if other.prefix != hook.prefix:
            continue
        if other is hook:
            raise RuntimeError(
                f"this {name} is already attached to this {type(optimizer).__name__}; "
                "remove the first handle before attaching it again"
            )
        raise RuntimeError(
            f"another {name} ({other!r}) is already attached to this "
            f"{type(optimizer).__name__}; two would apply {hook.technique} twice. Remove "
            "the first one with its handle's remove() before attaching this one"
        )
    refuse_one_inside(hook, optimizer)


def refuse_one_inside(hook: HookCore, optimizer: torch.optim.Optimizer) -> None:
    """Raises if a hook of this technique is on an optimizer that ``optimizer`` wraps.

    Checked again at each step: the inner hook may be attached after the outer one.
    """
    inner = _wrapped(optimizer)
    if not inner:
        return
    own = {key for key, _ in hooks_on(optimizer)}
    for wrapped in inner:
        for key, other in hooks_on(wrapped):
            if key not in own and other.prefix == hook.prefix:
                raise RuntimeError(
                    f"a {type(other).__name__} is attached to the "
                    f"{type(wrapped).__name__} that {type(optimizer).__name__} wraps and "
                    f"steps (its .optimizer), and a {type(hook).__name__} to "
                    f"{type(optimizer).__name__} itself: the two would apply "
                    f"{hook.technique} twice. Keep one of them"
                )
