"""The launches of a multi-tensor kernel that does nothing: the floor of a hook's kernel.

A multi-tensor kernel (one program per chunk of every tensor, its tables of pointers, sizes
and chunks kept per layout) costs the host, per step, little more than its launches: Triton
binds and specializes each argument, looks the compiled kernel up and calls the launcher.
:func:`launcher` launches a kernel with the arguments such a kernel takes, and an empty
body, so that ``launches`` of it are the least any kernel implementation of a hook costs.

Import this module only once Triton's interpreter is off (``_proxy.interpreter_off()``):
Triton decides at ``@triton.jit`` whether a kernel is interpreted, and an interpreted one
would not go through the launcher. :func:`launcher` refuses one.
"""

# Triton ships without type information.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

# The arguments of LARS's first kernel, in kind: tables of pointers, sizes and chunks, the
# partial sums it writes, a float setting and an int.
TABLE = 8


@triton.jit
def _nothing(pointers, numels, chunks, partials, setting, count):  # type: ignore[no-untyped-def]
    pass


def launcher(device: torch.device) -> Callable[[], None]:
    """One launch of the empty kernel on ``device``'s tensors per call (a CUDA device, or the
    CPU under the host proxy)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(_nothing, InterpretedFunction):
        raise RuntimeError(
            "benchmarks/_floor.py was imported with TRITON_INTERPRET=1: its kernel is "
            "interpreted and would not go through Triton's launcher"
        )
    pointers = torch.zeros(TABLE, dtype=torch.int64, device=device)
    numels = torch.zeros(TABLE, dtype=torch.int64, device=device)
    chunks = torch.zeros(TABLE, dtype=torch.int32, device=device)
    partials = torch.empty(TABLE, dtype=torch.float32, device=device)

    def launch() -> None:
        _nothing[(1,)](pointers, numels, chunks, partials, 1e-4, TABLE)

    return launch
