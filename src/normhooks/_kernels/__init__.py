"""Everything in normhooks that exists only for speed, behind one door per technique.

The layout (each file one concern; only the kernel modules import Triton):

- this package: the off switch (``NORMHOOKS_KERNELS=0``, :func:`set_kernels_enabled`), the
  dispatch rule (:func:`available`, :func:`may_launch`: Triton importable, plain tensors on
  CUDA, not compiling, tracing, exporting, in a ``torch.func`` transform or a dispatch mode:
  ``_torch_compat.plain_eager``, the one bypass) and the forwarders to the kernel modules,
  each imported on first call, so ``import normhooks`` never imports Triton;
- ``_door``: each reparametrization's one entry (``WeightNorm.forward`` calls its
  ``WeightNormDoor``): the checks' outcome kept per layout, the kernels' plan, the fused
  launch it joins, the CPU's fast path (``_cpu``), the fallback (``_fallback``);
- ``_scope``: the fused scopes (one launch per forward for a model's weights, served by
  ``serve``);
- ``_members``: what a model's fused launches take (its members and their groups) and
  whether the last scope's groups still hold; ``_served``: the weights a scope serves and
  when one may still be served;
- ``_cache``: the one cache type (``KeyedCache``) and the one validity rule (``State``);
- ``_fallback``: a kernel that fails here warns once and the plain formula takes over;
- ``_multi``: the one multi-tensor machinery (a table of addresses per set of tensors, rows
  cut into chunks, row sums by the last program to arrive) that the step hooks' kernels are
  descriptions on;
- the Triton kernels: ``weight_norm``, ``weight_standardization``, the step hooks' ``lars``,
  ``agc``, ``gradient_centralization`` and ``trust_ratio``, and what they share
  (``_common``, ``_fused``, ``_launch``).

:func:`route_cpu_tensors` is the one private switch that sends plain CPU tensors down the same
path, for the code around the kernels to be exercised without a GPU: the tests run the
kernels under Triton's interpreter that way, and ``benchmarks/host.py`` times the CUDA path's
host cost with a Triton driver that launches nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch import Tensor

from normhooks import _torch_compat
from normhooks._kernels import _fallback

# Process-wide, not per thread: autograd and optimizer hooks may run on other threads than
# the one that turned the switch on. Only route_cpu_tensors changes it.
_route_cpu = False

# The off switch (public as normhooks.set_kernels_enabled): False sends every technique to the
# plain torch formula and keeps Triton unimported. Read from NORMHOOKS_KERNELS once, at import.
_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")


def _from_environment() -> bool:
    value = os.environ.get("NORMHOOKS_KERNELS", "1")
    if value.strip().lower() in _OFF:
        return False
    if value.strip().lower() not in _ON:
        # A misspelt off switch must not leave the kernels on without a word; off is the
        # side that cannot give a wrong number.
        warnings.warn(
            f"NORMHOOKS_KERNELS must be one of {', '.join(_OFF)} (kernels off) or "
            f"{', '.join(v for v in _ON if v)} (on), got NORMHOOKS_KERNELS={value!r}; the "
            "kernels are off",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


_enabled = _from_environment()


@functools.cache
def _triton_found() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_importable() -> bool:
    # A kernel that failed here turns them all off (see _fallback), with one warning.
    return _enabled and not _fallback.broken() and _triton_found()


def kernels_enabled() -> bool:
    """Whether normhooks may run its Triton kernels (CUDA tensors with Triton installed).

    False where ``NORMHOOKS_KERNELS=0`` was set when normhooks was imported, or after
    :func:`set_kernels_enabled` ``(False)``: every technique then computes the plain torch
    formula, and Triton is never imported by normhooks.

    Example:
        >>> import normhooks
        >>> with normhooks.set_kernels_enabled(False):
        ...     normhooks.kernels_enabled()
        False
    """
    return _enabled


class set_kernels_enabled:  # noqa: N801 - named and used like torch.set_grad_enabled
    """Turn normhooks' Triton kernels on or off, as a call or as a context manager.

    Called, it sets the switch for the process; used in a ``with`` block, it restores the
    previous setting on leaving the block, exception or not. Off, every technique computes
    the plain torch formula (the numbers a CPU run gives); the environment variable
    ``NORMHOOKS_KERNELS=0`` sets the same switch at import.

    Args:
        mode: True to allow the kernels (the default where Triton is installed), False for
            the plain formula everywhere.

    Example:
        >>> import normhooks
        >>> _ = normhooks.set_kernels_enabled(False)
        >>> normhooks.kernels_enabled()
        False
        >>> _ = normhooks.set_kernels_enabled(True)
    """

    def __init__(self, mode: bool) -> None:
        global _enabled
        if not isinstance(mode, bool):
            raise TypeError(f"mode must be True or False, got mode={mode!r}")
        self.previous = _enabled
        _enabled = mode
        if mode:
            _fallback.reset()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        global _enabled
        _enabled = self.previous


# The dtypes the kernels are written for (_common.TL_DTYPES, without importing Triton): a
# float8 tensor passes the techniques' checks but must not be taken for a kernel's failure.
_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def available(*tensors: Tensor) -> bool:
    """Whether the kernels can run on ``tensors``."""
    for tensor in tensors:
        if not (tensor.is_cuda or (_route_cpu and tensor.is_cpu)) or tensor.dtype not in _DTYPES:
            return False
    return _torch_compat.plain_eager(*tensors) and _triton_importable()


def on_device(*tensors: Tensor) -> bool:
    """Whether ``tensors`` are plain tensors on a device the kernels take (CUDA, or the CPU
    inside :func:`route_cpu_tensors`); :func:`may_launch` says whether they may run now."""
    for tensor in tensors:
        if not (
            _torch_compat.plain_tensors(tensor)
            and (tensor.is_cuda or (_route_cpu and tensor.is_cpu))
        ):
            return False
    return True


def routing_cpu_tensors() -> bool:
    """Whether :func:`route_cpu_tensors` sends CPU tensors to the kernels now."""
    return _route_cpu


def may_launch() -> bool:
    """Whether kernels may run now: Triton importable, not compiling, tracing, exporting, in
    a ``torch.func`` transform or under a dispatch mode."""
    return _torch_compat.plain_eager() and _triton_importable()


@contextlib.contextmanager
def route_cpu_tensors() -> Iterator[None]:
    """Within the block, plain CPU tensors go to the kernels as CUDA tensors do (private).

    Only the device test changes: compiling, tracing, ``torch.func``, dispatch modes and
    tensor subclasses still get the plain formula. A CPU tensor reaches a kernel's launch
    only where Triton can take it: its interpreter (``TRITON_INTERPRET=1`` when the kernel
    modules are imported) or a driver that launches nothing (``benchmarks/_proxy.py``);
    Triton's CUDA launcher refuses a CPU pointer. Nests; on leaving, the routing is what it
    was before, exception or not. Not for use from several threads at once.
    """
    global _route_cpu
    previous = _route_cpu
    _route_cpu = True
    try:
        yield
    finally:
        _route_cpu = previous


T = TypeVar("T")


def _guarded(what: str, run: Callable[[], T]) -> T | None:
    """``run()``, a call of a multi-tensor kernel, or None where that kernel failed on this
    machine before writing anything (warned once, naming ``what``; the kernels are off from
    then on): the caller then computes the plain formula. Out of memory is the user's error,
    raised as such. Every table of addresses is dropped on a failure: a launch stopped part
    way may have left a row's count of arrived programs above zero (see ``_multi``)."""
    from normhooks._kernels import _multi

    try:
        return run()
    except _multi.KernelFailedError as failure:
        _multi.drop_tables()
        if isinstance(failure.error, torch.OutOfMemoryError):
            raise failure.error from None
        _fallback.failed(what, failure.error)
        return None


# Type checkers see the kernel module's function, whose signature is written once, there; at
# run time a forwarder imports that module (and Triton) at the first call.
def lars_unit_(params: list[Tensor], grads: list[Tensor], **settings: Any) -> Tensor | None:
    """:func:`normhooks._kernels.lars.lars_unit_`, or None where the kernel failed (see
    :func:`_guarded`)."""
    from normhooks._kernels import lars

    return _guarded("LARS", lambda: lars.lars_unit_(params, grads, **settings, allowed=available))


def agc_unit_(params: list[Tensor], grads: list[Tensor], **settings: Any) -> Tensor | None:
    """:func:`normhooks._kernels.agc.agc_unit_`, or None where the kernel failed (see
    :func:`_guarded`)."""
    from normhooks._kernels import agc

    return _guarded("AGC", lambda: agc.agc_unit_(params, grads, **settings, allowed=available))


def centralize_unit_(grads: list[Tensor], kept: dict[object, object] | None = None) -> bool:
    """:func:`normhooks._kernels.gradient_centralization.centralize_unit_`; False where the
    kernel failed (see :func:`_guarded`)."""
    from normhooks._kernels import gradient_centralization

    def run() -> bool:
        gradient_centralization.centralize_unit_(grads, kept, allowed=available)
        return True

    return _guarded("gradient centralization", run) is not None


def trust_ratio_copy(
    params: list[Tensor],
    flat: Tensor,
    offsets: Tensor,
    total: int,
    kept: dict[object, object] | None = None,
) -> Tensor | None:
    """:func:`normhooks._kernels.trust_ratio.copy_and_squares`, or None where the kernel failed
    (see :func:`_guarded`): the caller then copies the parameters itself."""
    from normhooks._kernels import trust_ratio

    return _guarded(
        "TrustRatio",
        lambda: trust_ratio.copy_and_squares(params, flat, offsets, total, kept),
    )


def trust_ratio_rescale(
    params: list[Tensor],
    flat: Tensor,
    offsets: Tensor,
    total: int,
    w_squares: Tensor,
    **settings: Any,
) -> Tensor | None:
    """:func:`normhooks._kernels.trust_ratio.rescale_updates`, or None where a kernel failed
    before writing a parameter (see :func:`_guarded`): the caller then computes the plain
    formula from the old values in ``flat``."""
    from normhooks._kernels import trust_ratio

    return _guarded(
        "TrustRatio",
        lambda: trust_ratio.rescale_updates(params, flat, offsets, total, w_squares, **settings),
    )


@functools.cache
def _weight_norm() -> ModuleType:
    # Imported at the first call (not with the package: that would import Triton), then
    # found in this cache.
    from normhooks._kernels import weight_norm

    return weight_norm


@functools.cache
def _weight_standardization() -> ModuleType:
    from normhooks._kernels import weight_standardization

    return weight_standardization


def fused_weight_norm(
    g: Tensor, v: Tensor, dim: int, eps: float, *, plain: Callable[..., Tensor]
) -> Tensor:
    """See :func:`normhooks._kernels.weight_norm.weight_norm` (a different name here: importing
    that submodule binds ``weight_norm`` in this package to the module)."""
    result: Tensor = _weight_norm().weight_norm(g, v, dim, eps, plain=plain)
    return result


def weight_norm_plan(
    g: Tensor, v: Tensor, dim: int, eps: float, plain: Callable[..., Tensor]
) -> object:
    """See :func:`normhooks._kernels.weight_norm.plan`."""
    return _weight_norm().plan(g, v, dim, eps, plain)


def planned_weight_norm(g: Tensor, v: Tensor, plan: Any) -> Tensor:
    """:func:`fused_weight_norm` with the layer's plan (:func:`weight_norm_plan`), on plain
    eager tensors that :func:`available` accepts."""
    result: Tensor = plan.apply(g, v)
    return result


def standardize_rows(
    rows: Tensor, eps: float, gain: Tensor | None = None, factor: float = 1.0
) -> Tensor:
    """See :func:`normhooks._kernels.weight_standardization.standardize_rows`."""
    result: Tensor = _weight_standardization().standardize_rows(rows, eps, gain, factor)
    return result


def standardization_plan(rows: Tensor, eps: float, gain: Tensor | None, factor: float) -> object:
    """See :func:`normhooks._kernels.weight_standardization.plan`."""
    return _weight_standardization().plan(rows, eps, gain, factor)


def planned_standardization(rows: Tensor, gain: Tensor | None, plan: Any) -> Tensor:
    """:func:`standardize_rows` with the tensor's plan (:func:`standardization_plan`), on
    plain eager tensors that :func:`available` accepts."""
    result: Tensor = plan.apply(rows, gain)
    return result


def weight_norm_fusable(plan: Any) -> bool:
    """See :func:`normhooks._kernels.weight_norm.fusable`."""
    fusable: bool = _weight_norm().fusable(plan)
    return fusable


def fuse_weight_norms(plans: tuple[Any, ...], tensors: list[Tensor]) -> tuple[Tensor, ...]:
    """The weights of layers of :func:`weight_norm_fusable` ``plans`` (one device and dtype)
    from their ``g0, v0, g1, v1, ...``, in one launch each way."""
    module = _weight_norm()
    weights: tuple[Tensor, ...] = module.fused_weight_norms(
        module.fused_plan(plans, tensors), tensors
    )
    return weights


def standardization_fusable(plan: Any) -> bool:
    """See :func:`normhooks._kernels.weight_standardization.fusable`."""
    fusable: bool = _weight_standardization().fusable(plan)
    return fusable


def fuse_standardizations(
    plans: tuple[Any, ...], tensors: list[Tensor | None]
) -> tuple[Tensor, ...]:
    """The standardized weights of :func:`standardization_fusable` ``plans`` (one device and
    dtype) from their ``x0, gain0, x1, gain1, ...``, in one launch each way."""
    module = _weight_standardization()
    results: tuple[Tensor, ...] = module.fused_standardizations(
        module.fused_plan(plans, tensors), tensors
    )
    return results
