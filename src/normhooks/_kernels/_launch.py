"""Launching a compiled Triton kernel again without Triton's per-call work (private Triton API).

Each call of a ``JITFunction`` binds its arguments, specializes every one of them (dtype and
16-byte alignment of a pointer, size class, 16-divisibility and equality to 1 of an int),
builds a cache key from that and from the options, looks the compiled kernel up and launches
it: most of a small kernel's host cost. The row kernels here compute their launch settings
once per layout, so :class:`Kernel` keeps each compiled kernel under a key the caller
derives from what determines that specialization (its layout and constexprs, which fix every
int argument, plus the alignment of each pointer, computed here), and launches a hit
directly through the kernel's launcher, as ``JITFunction.run`` does after its lookup.

The direct launch is used only where it was checked to be equivalent: Triton 3.6
(``JITFunction.run``, ``CompiledKernel.run``/``function``/``packed_metadata``, the
launcher's argument order), compiled kernels (not Triton's interpreter), no launch hooks
(profilers get Triton's own path, with its launch metadata), ``TRITON_DEBUG`` and Triton's
instrumentation off.
Everything else, and every first launch of a key, goes through the public ``kernel[grid](...)``.
The stream is the current one of the tensors' device, as Triton takes it at every launch.
"""

# Triton ships without type information: its modules are untyped to mypy.
# mypy: disable-error-code="import-untyped"

from __future__ import annotations

from typing import Any

import torch
import triton
from torch import Tensor
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# The Triton versions whose launch path was read and checked for the direct launch.
CHECKED_VERSIONS = ((3, 6),)
_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])


class Kernel:
    """A Triton kernel launched from caches of compiled variants that its callers keep.

    ``kernel(cache, grid, device, pointers, *args)``: ``args`` are every argument of the
    kernel in signature order, constexprs included (as Triton's binder returns them), and
    ``device`` the CUDA device of the tensors (None off CUDA), which is made current for the
    launch if it is not. ``cache`` is the caller's dict for one setting of everything that
    Triton specializes on except the alignment of the pointers in ``pointers`` (the dtypes,
    the int arguments and constexprs, the device, the alignment of every other pointer: a
    layer's plan, whose outputs come fresh from torch's allocator, aligned to 64 bytes or
    more); those are added to the key here. A cache is never shared between settings, so a
    kernel is never launched on arguments it was not compiled for. It is a plain dict, the
    one kind of kept mapping outside ``_cache.KeyedCache``: it lives as long as the plan
    that owns it (itself in a KeyedCache) and holds at most one entry per alignment pattern
    of ``pointers`` (``2 ** len(pointers)``), so it needs no eviction.
    """

    __slots__ = ("direct", "fn")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.direct = isinstance(fn, JITFunction) and _VERSION in CHECKED_VERSIONS

    def __call__(
        self,
        cache: dict[tuple[bool, ...], CompiledKernel],
        grid: tuple[int, int],
        device: int | None,
        pointers: tuple[Tensor, ...],
        *args: Any,
    ) -> None:
        if device is not None and torch.cuda.current_device() != device:
            with torch.cuda.device(device):
                self.fn[grid](*args)
            return
        runtime = knobs.runtime
        # Triton 3.6's launch hooks are chains, empty unless a profiler added to them; debug
        # and instrumentation compile other variants.
        if (
            not self.direct
            or runtime.debug
            or runtime.launch_enter_hook.calls
            or runtime.launch_exit_hook.calls
            or knobs.compilation.instrumentation_mode
        ):
            self.fn[grid](*args)
            return
        # Triton specializes a pointer on whether its address is a multiple of 16.
        aligned = tuple([t.data_ptr() % 16 == 0 for t in pointers])
        compiled = cache.get(aligned)
        if compiled is None:
            found = self.fn[grid](*args)
            if isinstance(found, CompiledKernel):
                cache[aligned] = found
            return
        active = driver.active
        stream = active.get_current_stream(
            active.get_current_device() if device is None else device
        )
        compiled.run(
            grid[0],
            grid[1],
            1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
        )
