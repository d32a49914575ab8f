"""The base of the step hooks: the technique's declarations, attached to an optimizer."""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from normhooks import _torch_compat as compat
from normhooks._step_hook.attach import optimizer_to_hook, refuse_a_second_one
from normhooks._step_hook.run import Running


class StepHook(Running):
    r"""Base of the step hooks: a technique run in any optimizer's step, through its hooks.

    A subclass derives from its technique's :class:`Settings` too, declares what it
    rewrites, ``prefix`` and ``technique``, and implements ``_unit_``; see the package
    docstring (:mod:`normhooks._step_hook`).

    What the base does, the same for every technique:

    - :meth:`attach` unwraps accelerate's and Lightning's optimizer wrappers, registers the
      hook with ``register_step_pre_hook`` (and, for a hook on the updates,
      ``register_step_post_hook``) and returns the
      :class:`~torch.utils.hooks.RemovableHandle`. Refused: optimizers whose ``step`` runs no
      step hook (a subclass that skips ``Optimizer.__init__``, like timm's ``Lookahead``);
      LBFGS (it evaluates its closure many times per step); optimizers that step a
      ``base_optimizer`` (SAM and its kin: the hook belongs on ``base_optimizer``); for a hook
      on the updates, optimizers that step the one they hold in ``.optimizer`` (Lookahead);
      DeepSpeed's optimizers; and a second hook of the same technique in the optimizer's
      step-hook dict or in that of an optimizer it wraps (it would apply the technique twice).
    - Every param group that takes part, and its parameters, is checked when attaching and
      again before each step where the group changed (groups may be added, their settings
      and params edited), with one function, before anything changes; a group that opts out
      is left alone. FSDP1's flattened parameters and DeepSpeed ZeRO-3's partitions are
      refused: their norms are not the parameters'. Validation, grouping and settings are
      planned once per state of the param groups and reused while nothing of it changed: the
      groups and their entries (by identity), each parameter's identity, dtype and address.
    - ``step(closure)``: the hook evaluates the closure itself, rewrites the fresh gradients
      and hands the optimizer a closure that returns that loss once, and raises if the
      optimizer calls it after changing the parameters (SAM's second pass would get no
      gradients).
    - Parameters are grouped per param group, device, dtype and sharding; DTensor parameters
      (FSDP2, HSDP, tensor parallel) get the norms of their full tensors, with one all-reduce
      per sharded mesh dimension for all of them. On the CPU, long tensors are reduced in
      rows whose sums of squares are added in float64 (:func:`euclidean_norms`).
    - AMP with a fused optimizer: ``GradScaler.step`` sets ``optimizer.grad_scale`` and
      ``optimizer.found_inf`` and leaves the gradients scaled, for the fused step to unscale.
      A hook on the gradients then computes from the scaled gradients divided by the scale,
      in float32, and writes the *unscaled* result into ``.grad`` (rounded once); it
      unscales the gradients of groups that opt out too; then it sets
      ``optimizer.grad_scale = None``, so the fused step does not divide again, and sets
      ``optimizer.found_inf`` to 1 where a value it read or wrote is not finite, so that an
      overflow still skips the step. (An overflow in the hook's result, not in the scaled
      gradients, does not lower the scaler's scale.) This is GradScaler's private protocol,
      reached through ``_torch_compat``. A hook on the updates leaves it to the fused step.
      Ordinary optimizers under GradScaler see unscaled gradients and need none of it.
    - ``foreach``: None and True take ``torch._foreach_*`` ops, False one tensor at a time
      (for tensor types the multi-tensor ops refuse).
    - Nothing is read back to the host: the hook traces under ``torch.compile(fullgraph=True)``.
    """

    # --- attaching ---------------------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Registers the hook with ``optimizer.register_step_pre_hook``.

        The optimizer's class, ``state_dict`` and LR schedulers are untouched; remove the hook
        with the returned handle's ``remove()``. The wrappers that frameworks hand to user
        code are unwrapped, and the hook is registered on the optimizer whose step they run:
        accelerate's ``AcceleratedOptimizer`` (what an HF ``TrainerCallback`` receives) and
        Lightning's ``LightningOptimizer`` (what ``LightningModule.optimizers()`` returns).

        Args:
            optimizer: any instance of :class:`torch.optim.Optimizer`, or one of the
                wrappers above.

        Returns:
            The handle of the registered pre-hook; for a hook on the updates, one handle
            whose ``remove()`` removes both its hooks.
        """
        target = optimizer_to_hook(self, optimizer)
        refuse_a_second_one(self, target)
        self._plan(target)
        handle = target.register_step_pre_hook(self._pre_step)
        if self.rewrites == "updates":
            handle = compat.joined_handle(handle, target.register_step_post_hook(self._after_step))
        return handle
