"""Every use of a private or undocumented torch API, in one place.

Each entry names the torch versions it was checked on. The suite runs on torch 2.13 (CPU)
and 2.11 (CUDA); when torch changes one of these, this is the only file to change.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module_py
from torch.nn.utils.weight_norm import WeightNorm as _LegacyWeightNorm
from torch.utils.hooks import RemovableHandle

# torch.nn.modules.conv's base classes (2.11, 2.13): every Conv*/LazyConv* and every
# ConvTranspose*/LazyConvTranspose* layer derives from them.
ConvNd: type[nn.Module] = nn.modules.conv._ConvNd
ConvTransposeNd: type[nn.Module] = nn.modules.conv._ConvTransposeNd
# torch.nn.utils.parametrizations.spectral_norm's parametrization (2.13; there since 1.9): its power
# iteration's vectors are the buffers _u and _v, over the weight with axis dim as rows.
TorchSpectralNorm: type[nn.Module] = nn.utils.parametrizations._SpectralNorm


def foreach_norm(tensors: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    """Euclidean norms of ``tensors`` in one multi-tensor call (2.11, 2.13)."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def foreach_add_(tensors: list[Tensor], others: list[Tensor], alpha: float = 1.0) -> None:
    """``t += alpha * o`` for every pair (2.11, 2.13)."""
    torch._foreach_add_(tensors, others, alpha=alpha)


def foreach_mul_(tensors: list[Tensor], factors: list[Tensor] | Tensor | float) -> None:
    """``t *= f`` for every tensor, with one factor each or one for all (2.11, 2.13)."""
    torch._foreach_mul_(tensors, factors)


def foreach_copy_(tensors: list[Tensor], sources: list[Tensor]) -> None:
    """``t.copy_(s)`` for every pair (2.11, 2.13)."""
    torch._foreach_copy_(tensors, sources)


def foreach_sub_(tensors: list[Tensor], others: list[Tensor]) -> None:
    """``t -= o`` for every pair (2.11, 2.13)."""
    torch._foreach_sub_(tensors, others)


def foreach_addcmul_(tensors: list[Tensor], others: list[Tensor], factors: list[Tensor]) -> None:
    """``t += o * f`` for every triple, with ``f`` a 0-dim tensor per pair (2.11, 2.13).

    One factor per tensor without reading it back to the host (a ScalarList would).
    """
    torch._foreach_addcmul_(tensors, others, factors)


def weight_norm_interface(v: Tensor, g: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """torch's fused ``g * v / ||v||`` and the norms it divided by (2.11, 2.13)."""
    weight, norm = torch._weight_norm_interface(v, g, dim)
    return weight, norm


def weight_norm_interface_backward(
    grad_w: Tensor, v: Tensor, g: Tensor, norm: Tensor, dim: int
) -> tuple[Tensor, Tensor]:
    """The fused backward of :func:`weight_norm_interface`: ``(grad_v, grad_g)`` (2.11, 2.13)."""
    grad_v, grad_g = torch.ops.aten._weight_norm_interface_backward(grad_w, v, g, norm, dim)
    return grad_v, grad_g


def _imported(module: str, name: str) -> Any:
    """``module.name`` where something has imported ``module``, else None: a class whose
    module nothing imported has no instances, and looking it up imports nothing."""
    found = sys.modules.get(module)
    return None if found is None else getattr(found, name)


def dtensor_type() -> Any:
    """torch's DTensor class, or None while nothing has imported it (so nothing is one)."""
    return _imported("torch.distributed.tensor", "DTensor")


def non_finite_check_and_unscale_(
    tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    """``t *= inv_scale`` in place, and ``found_inf = 1`` where any ``t`` is inf or NaN.

    GradScaler's own multi-tensor op (``torch._amp_foreach_non_finite_check_and_unscale_``,
    2.11, 2.13): it computes in float32 for float16/bfloat16 tensors and rounds once, sets
    ``found_inf`` to 1 (never adds to it), and never reads a value back to the host. All
    ``tensors`` share one device and dtype; ``found_inf`` and ``inv_scale`` are one-element
    float32 tensors on that device.
    """
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


def functorch_transform_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jvp, ...) is running (2.13).

    ``torch._C._functorch.peek_interpreter_stack``. Under a transform, tensors are wrapped at a
    functorch level and ``.item()`` or a custom ``autograd.Function`` without a vmap rule
    cannot run.
    """
    return torch._C._functorch.peek_interpreter_stack() is not None


def dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode (FakeTensorMode, make_fx's proxy mode, ...) is active.

    ``torch._C._len_torch_dispatch_stack`` (2.13): such modes trace or fake every op,
    so a branch on a tensor's value would be baked into the trace or fail.
    """
    return bool(torch._C._len_torch_dispatch_stack() > 0)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped, or ``module`` itself (2.13).

    ``torch.compile`` returns an ``OptimizedModule`` whose ``_orig_mod`` is the user's model.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        original: nn.Module = module._orig_mod
        return original
    return module


def pop_forward_pre_hook(module: nn.Module, hook: object) -> Callable[[], None]:
    """Removes a forward pre-hook that torch registered without handing out a handle.

    The legacy ``torch.nn.utils.weight_norm`` keeps its hook only in the hook dict
    (``Module._forward_pre_hooks``, an OrderedDict keyed by handle id: 2.13), and its own
    ``remove_weight_norm`` deletes it from there too. Returns what puts it back, at the same
    key and in the same order among the other hooks.
    """
    hooks = module._forward_pre_hooks
    order = list(hooks)
    key = next(k for k, h in hooks.items() if h is hook)
    del hooks[key]

    def restore() -> None:
        hooks[key] = hook  # type: ignore[assignment]
        for k in order:
            if k in hooks:
                hooks[k] = hooks.pop(k)

    return restore


# The tensor types the kernels take as they are (no subclass: DTensor, FakeTensor, ...).
PLAIN_TYPES = frozenset((Tensor, nn.Parameter))


def plain_tensors(*tensors: object) -> bool:
    """Whether every one of ``tensors`` is a plain ``Tensor`` or ``Parameter``, no subclass."""
    # A loop, not all() over a generator, which costs more: this runs at every forward.
    for tensor in tensors:  # noqa: SIM110
        if type(tensor) not in PLAIN_TYPES:
            return False
    return True


@functools.cache
def _onnx_export_flags() -> Callable[[], bool]:
    """What ``torch.onnx.is_in_onnx_export`` reads, without its two imports at every call.

    torch 2.13 keeps the flags in ``torch.onnx._internal.torchscript_exporter._globals.GLOBALS
    .in_onnx_export`` and ``torch.onnx._internal.exporter._flags._is_onnx_exporting``; where
    either is missing (another torch), the public function is used.
    """
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:
        return torch.onnx.is_in_onnx_export
    if not (hasattr(GLOBALS, "in_onnx_export") and hasattr(_flags, "_is_onnx_exporting")):
        return torch.onnx.is_in_onnx_export

    def exporting() -> bool:
        return bool(GLOBALS.in_onnx_export or _flags._is_onnx_exporting)

    return exporting


def plain_eager(*tensors: Tensor) -> bool:
    """Whether ordinary eager code may run on ``tensors``: value branches, custom kernels.

    False under ``torch.compile``, tracing and exporting (TorchScript, ONNX, ``torch.export``),
    ``torch.func`` transforms and dispatch modes (fake tensors), and for tensor subclasses:
    all of these get the plain torch formula, which they can follow.
    """
    return (
        plain_tensors(*tensors)
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]
        and not _onnx_export_flags()()
        and not functorch_transform_active()
        and not dispatch_mode_active()
    )


def current_raw_stream(device_index: int) -> int:
    """The raw id of the current CUDA stream of a device, without making a ``Stream`` object
    (``torch._C._cuda_getCurrentRawStream``, what Triton launches on: 2.11, 2.13)."""
    stream: int = torch._C._cuda_getCurrentRawStream(device_index)
    return stream


# ``torch._C._autograd._top_saved_tensors_default_hooks`` (2.11, 2.13) itself, for a check
# that runs at every access of a served weight, where a Python call around it is most of
# its cost: ``top_saved_tensors_hooks(True) is not None`` is :func:`saved_tensors_hooked`.
top_saved_tensors_hooks: Callable[[bool], object] = (
    torch._C._autograd._top_saved_tensors_default_hooks
)


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``:
    non-reentrant activation checkpointing, ``save_on_cpu``), read through
    :data:`top_saved_tensors_hooks`."""
    return top_saved_tensors_hooks(True) is not None


def function_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` without the Python layer ``torch.autograd.Function.apply`` adds over
    ``torch._C._FunctionBase.apply`` (2.13): that layer binds default arguments for a Function
    that defines ``setup_context``, and unwraps dead ``torch.func`` wrappers or defers to
    ``torch.func`` while a transform runs. For a Function without ``setup_context``, called
    only where no transform runs (the kernels' dispatch rule, :func:`plain_eager`), what is
    left is the C entry point. Where torch's classes differ, the public ``apply``.
    """
    if function.setup_context is not torch.autograd.Function.setup_context:
        return function.apply
    base = vars(torch._C._FunctionBase).get("apply")
    if base is None or not hasattr(base, "__get__"):
        return function.apply
    bound: Callable[..., Any] = base.__get__(None, function)
    return bound


def forward_pre_hooks(module: nn.Module) -> list[object]:
    """The forward pre-hooks registered on ``module``, read only (``_forward_pre_hooks``:
    2.11, 2.13)."""
    return list(module._forward_pre_hooks.values())


def forward_hooked(module: nn.Module | None) -> bool:
    """Whether ``module`` has forward hooks or pre-hooks of its own (``_forward_hooks``,
    ``_forward_pre_hooks``: 2.11, 2.13), which a computation that skips its call skips too."""
    return module is not None and bool(module._forward_hooks or module._forward_pre_hooks)


def global_forward_hooks() -> bool:
    """Whether global forward hooks or pre-hooks are registered, which every module call runs
    (torch.nn.modules.module's ``_global_forward_hooks``, ``_global_forward_pre_hooks``:
    2.11, 2.13)."""
    return bool(_module_py._global_forward_hooks or _module_py._global_forward_pre_hooks)


def remove_forward_hooks(module: nn.Module, remove: Callable[[object], bool]) -> None:
    """Removes from ``module`` every forward hook and pre-hook for which ``remove`` is true,
    as their handles would (every dict a handle clears: 2.11, 2.13)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [key for key, hook in hooks.items() if remove(hook)]:
            del hooks[key]
            for extra in (
                module._forward_pre_hooks_with_kwargs,
                module._forward_hooks_with_kwargs,
                module._forward_hooks_always_called,
            ):
                extra.pop(key, None)


def load_state_dict_pre_hooks(module: nn.Module) -> list[object]:
    """The load-state-dict pre-hooks of ``module``, unwrapped, read only (2.11, 2.13): torch
    wraps each in a ``_WrappedHook`` whose ``hook`` is the registered callable."""
    return [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]


def state_dict_hooks(module: nn.Module) -> list[object]:
    """The state-dict post-hooks of ``module``, read only (``_state_dict_hooks``: 2.11, 2.13)."""
    return list(module._state_dict_hooks.values())


# --- optimizer step hooks and the shardings they cannot serve (the step hooks' part) ----------


class FusedGradScaling:
    """What ``GradScaler.step`` hands a fused optimizer: the scale its gradients carry and the
    overflow flag its step reads (GradScaler's private protocol, 2.11, 2.13).

    For optimizers with ``_step_supports_amp_scaling``, ``GradScaler.step`` leaves the gradients
    scaled and sets ``optimizer.grad_scale`` and ``optimizer.found_inf`` (a float32 tensor that
    the step reads as 1 for "skip"); the fused step divides by ``grad_scale`` when it is a
    tensor and not when it is None. GradScaler deletes both attributes after a step that
    returns.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scale: Tensor, found_inf: Tensor | None):
        self._optimizer = optimizer
        self.scale = scale
        self.found_inf = found_inf

    def mark_unscaled(self) -> None:
        """Tells the fused step that the gradients are no longer scaled."""
        self._optimizer.grad_scale = None  # type: ignore[attr-defined]

    def discard(self) -> None:
        """Deletes both attributes, as GradScaler does after a step that returns: left behind
        by a step that raised, they would make the next step divide by the scale twice."""
        for name in ("grad_scale", "found_inf"):
            if name in vars(self._optimizer):
                delattr(self._optimizer, name)


def fused_grad_scaling(optimizer: torch.optim.Optimizer) -> FusedGradScaling | None:
    """The GradScaler state on a fused optimizer's gradients, or None where there is none."""
    scale = getattr(optimizer, "grad_scale", None)
    if not isinstance(scale, Tensor):
        return None
    flag = getattr(optimizer, "found_inf", None)
    return FusedGradScaling(optimizer, scale, flag if isinstance(flag, Tensor) else None)


def fused_found_inf(optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The overflow flag ``GradScaler.step`` hands a fused optimizer's step, or None.

    Set with ``grad_scale`` (:class:`FusedGradScaling`) and kept where ``grad_scale`` is None:
    after ``GradScaler.unscale_``, and after a hook on the gradients has unscaled them itself
    (:meth:`FusedGradScaling.mark_unscaled`). The step it skips leaves the parameters as they
    were (GradScaler's private protocol, 2.11, 2.13).
    """
    flag = getattr(optimizer, "found_inf", None)
    return flag if isinstance(flag, Tensor) else None


def step_runs_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` runs the step hooks registered on it (2.11, 2.13).

    ``Optimizer.__init__`` (through ``_patch_step_function``) wraps the class's ``step`` in
    ``profile_hook_step``, which runs the pre- and post-hooks, and marks the wrapper
    ``hooked = True``. A subclass that never calls it (timm's ``Lookahead``) keeps its own
    ``step``, which runs no hook.
    """
    return bool(getattr(type(optimizer).step, "hooked", False))


class _JoinedHandle(RemovableHandle):
    """``first``'s handle (its id and dicts), whose ``remove()`` also removes ``second``.

    ``RemovableHandle`` (2.11, 2.13) keeps ``hooks_dict_ref``, ``id`` and ``extra_dict_ref``:
    copied here, so that ``first``'s own ``remove`` and this one do the same.
    """

    def __init__(self, first: RemovableHandle, second: RemovableHandle) -> None:
        self.hooks_dict_ref = first.hooks_dict_ref
        self.id = first.id
        self.extra_dict_ref = first.extra_dict_ref
        self._second = second

    def remove(self) -> None:
        super().remove()
        self._second.remove()


def joined_handle(first: RemovableHandle, second: RemovableHandle) -> RemovableHandle:
    """One handle for two hooks: removing it removes both."""
    return _JoinedHandle(first, second)


def step_pre_hooks(optimizer: torch.optim.Optimizer) -> list[tuple[int, object]]:
    """The step pre-hooks registered on ``optimizer`` with their handle ids, in order, read
    only (2.11, 2.13).

    ``Optimizer._optimizer_step_pre_hooks`` is an OrderedDict keyed by handle id (unique
    across all dicts), which ``step`` runs after the global pre-hooks. A wrapper that
    forwards its attributes to the optimizer it holds (Lightning's ``LightningOptimizer``)
    reads, and registers into, that optimizer's dict: the hooks found here are the ones its
    step runs.
    """
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    return [] if hooks is None else list(hooks.items())


def versions(tensors: list[Tensor]) -> list[int]:
    """The version counters of ``tensors`` (``Tensor._version``: 2.11, 2.13).

    Every in-place change of a tensor (``add_``, ``copy_``, an optimizer's update) bumps its
    counter; reading it is a host-side integer, never a device sync.
    """
    return [tensor._version for tensor in tensors]


def layout_check(tensors: Sequence[Tensor]) -> Callable[..., bool] | None:
    """A check of ``tensors``' metadata in one C call, or None where torch offers none here.

    ``check(*others)`` is True when each of ``others`` (as many as ``tensors``) has the exact
    Python type, dtype, device, sizes, strides, dispatch keys (layout, conjugate and negative
    bits, the backend) and ``requires_grad`` that the tensor at its place has now; False for
    anything else, None included. It reads no address and no value.

    Dynamo's ``TensorGuards`` (``torch._C._dynamo.guards``, 2.11, 2.13), with every size and
    stride given (a None would leave that dimension unchecked). It is used only after
    :func:`_layout_check_works` has seen it refuse each kind of change on this torch.
    """
    if not _layout_check_works():
        return None
    return _tensor_guards(tensors)


def _tensor_guards(tensors: Sequence[Tensor]) -> Callable[..., bool] | None:
    # torch's stub of TensorGuards does not match what it takes at run time.
    module: Any = torch._C._dynamo.guards
    try:
        guards = module.TensorGuards(
            *tensors,
            tensor_check_names=[f"tensors[{i}]" for i in range(len(tensors))],
            dynamic_dims_sizes=[list(tensor.shape) for tensor in tensors],
            dynamic_dims_strides=[list(tensor.stride()) for tensor in tensors],
        )
    except (AttributeError, TypeError, RuntimeError):
        return None
    check: Callable[..., bool] = guards.check
    return check


@functools.cache
def _layout_check_works() -> bool:
    """Whether :func:`_tensor_guards` refuses every change the step hooks' records rely on it
    to see: checked once per process on small CPU tensors, so that another torch whose guard
    checks less turns the records off instead of letting a stale one through."""
    base = nn.Parameter(torch.zeros(2, 3))
    grad = torch.zeros(2, 3)
    check = _tensor_guards([base, grad])
    if check is None:
        return False
    with torch.no_grad():
        changed = [
            torch.zeros(2, 3, dtype=torch.float64),  # dtype
            torch.zeros(3, 2),  # sizes
            torch.zeros(3, 2).t(),  # strides
            torch.zeros(2, 3).to_sparse(),  # layout
            torch.zeros(2, 3, device="meta"),  # device
            torch.zeros(2, 3, requires_grad=True),  # requires_grad
            torch.zeros(2, 3)._neg_view(),  # a lazy negation
            nn.Parameter(torch.zeros(2, 3)),  # the Python type
            None,
        ]
    try:
        return check(base, torch.zeros(2, 3)) and not any(check(base, other) for other in changed)
    except (TypeError, RuntimeError):
        return False


def sparse_values(tensor: Tensor) -> Tensor:
    """The values of a sparse COO tensor, coalesced or not, as a dense view (2.11, 2.13).

    ``Tensor._values`` is what ``GradScaler`` unscales in place for a sparse gradient.
    """
    return tensor._values()


def fsdp1_possible() -> bool:
    """Whether FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) may have run.

    Its ``FlatParameter`` lives in ``torch.distributed.fsdp._flat_param``; while nothing has
    imported that module, no tensor can be one (and nothing here imports it).
    """
    return "torch.distributed.fsdp._flat_param" in sys.modules


def fsdp1_flattening(tensor: object) -> str | None:
    """How FSDP1 flattened ``tensor``: ``"flat"``, ``"original"``, ``"view"`` or None (2.11,
    2.13).

    FSDP1 (``torch/distributed/fsdp/_flat_param.py``) marks each ``FlatParameter`` with
    ``_is_flat_param`` (which ``isinstance(t, FlatParameter)`` reads) and with
    ``_fsdp_flattened`` (``_common_utils.FSDP_FLATTENED``); with ``use_orig_params=True`` it
    marks the original parameters it flattens with ``_fsdp_flattened`` too, and leaves each
    of them a view of this rank's piece of the flat shard. Both are instance attributes. With
    ``use_orig_params=False`` the layers keep plain tensor views of the FlatParameter, whose
    ``_base`` carries the mark.
    """
    if not isinstance(tensor, Tensor):
        return None
    if getattr(tensor, "_is_flat_param", False):
        return "flat"
    if getattr(tensor, "_fsdp_flattened", False):
        return "original"
    base = tensor._base
    if base is not None and getattr(base, "_fsdp_flattened", False):
        return "view"
    return None


def deepspeed_possible() -> bool:
    """Whether DeepSpeed is imported: its partitioned parameters cannot exist before that."""
    return "deepspeed" in sys.modules


def deepspeed_partitioned(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a ZeRO-3 parameter or partition of DeepSpeed (checked on its source).

    ZeRO-3 gives every parameter it partitions an integer ``ds_id`` (with ``ds_status``,
    ``ds_tensor``, ``ds_shape``, ...), and its flat fp32 partitions a ``ds_id`` as well
    (``deepspeed/runtime/zero/partition_parameters.py``, ``stage3.py``).
    """
    return getattr(tensor, "ds_id", None) is not None


def may_carry_marks(tensor: Tensor) -> bool:
    """Whether ``tensor`` may carry FSDP1's or DeepSpeed's marks, which are attributes set on
    the tensor itself: most tensors have none, and an empty ``__dict__`` is a cheap test.
    (``torch.compile`` cannot trace ``vars``; there the marks are read one by one.)"""
    return torch.compiler.is_compiling() or bool(vars(tensor))


def is_deepspeed(obj: object) -> bool:
    """Whether a class in ``obj``'s MRO is defined in a ``deepspeed`` module.

    DeepSpeed's ZeRO and fp16/bf16 optimizers (``DeepSpeedZeroOptimizer``,
    ``DeepSpeedZeroOptimizer_Stage3``, ``BF16_Optimizer``, ``FP16_Optimizer``) derive from
    ``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``, a plain ``object``.
    """
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module == "deepspeed" or module.startswith("deepspeed."):
            return True
    return False


# --- wrapped models, lazy modules and torch's legacy weight norm (the parametrizations) -------


def ddp_type() -> Any:
    """``DistributedDataParallel``, or None while nothing has imported it (so nothing is one)."""
    return _imported("torch.nn.parallel.distributed", "DistributedDataParallel")


def fsdp2_module_type() -> Any:
    """FSDP2's ``FSDPModule`` (what ``fully_shard`` makes a module), or None while nothing has
    imported ``torch.distributed.fsdp``."""
    return _imported("torch.distributed.fsdp", "FSDPModule")


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own registered parameters by name, None entries included (a layer built
    with ``bias=False`` registers ``bias`` as None), as a copy to read
    (``Module._parameters``: 2.11, 2.13). Add and delete them with ``register_parameter``
    and ``delattr``."""
    return dict(module._parameters)


def fsdp1_type() -> Any:
    """FSDP1's ``FullyShardedDataParallel`` class, or None while nothing has imported it."""
    return _imported(
        "torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"
    )


# The hook class of the legacy ``torch.nn.utils.weight_norm`` (2.11, 2.13): a forward pre-hook
# object with ``name`` and ``dim``, whose ``remove(module)`` torch's ``remove_weight_norm``
# calls on the first such hook with the parameter's name before deleting it from
# ``module._forward_pre_hooks`` by its key.
LegacyWeightNorm = _LegacyWeightNorm


def own_parametrized_class(module: nn.Module) -> None:
    """Gives a parametrized module a ``Parametrized<Class>`` class of its own (2.11, 2.13).

    ``torch.nn.utils.parametrize`` keeps one property per parametrized tensor on the class it
    swaps in, and adds or deletes them on ``module.__class__``; a deep copy shares that class
    object with the module it was copied from (the class's ``__deepcopy__`` builds the copy
    with ``self.__class__``). Removing a parametrization from a copy would then delete the
    property of the original too, and break its next forward.
    """
    cls = type(module)
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    module.__class__ = type(cls.__name__, cls.__bases__, namespace)


class StatelessModule(nn.Module):
    """A module that state dicts leave out: it saves nothing and loads nothing (2.11, 2.13).

    ``state_dict`` and ``load_state_dict`` call ``_save_to_state_dict`` and
    ``_load_from_state_dict`` on every submodule for its own tensors (``LazyModuleMixin``
    overrides them too); its children, if any, still save and load their own.
    """

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        return None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None
