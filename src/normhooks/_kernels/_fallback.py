"""What happens when a kernel fails on the user's machine: one warning, then the plain formula.

A kernel that fails to compile or launch (an unsupported GPU, another Triton) must neither
crash a training step nor give a wrong number. The caller catches the failure before the
kernel wrote anything the caller keeps, calls :func:`failed`, and computes the plain torch
formula instead; :func:`failed` warns once per process, naming the switch, and turns every
kernel path off (``normhooks._kernels.may_launch`` reads :func:`broken`) until the process
ends or ``normhooks.set_kernels_enabled(True)`` is called again.
"""

from __future__ import annotations

import warnings

_broken = False
_warned = False


def broken() -> bool:
    """Whether a kernel failed in this process since the kernels were last turned on."""
    return _broken


def failed(what: str, error: BaseException) -> None:
    """Records that the kernel of ``what`` failed with ``error``: the kernels are off from now."""
    global _broken, _warned
    _broken = True
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"normhooks' Triton kernel for {what} failed on this machine "
        f"({type(error).__name__}: {error}); normhooks computes the plain torch formula from "
        "now on (same numbers, slower). To skip the kernels from the start, set "
        "NORMHOOKS_KERNELS=0 or call normhooks.set_kernels_enabled(False).",
        RuntimeWarning,
        stacklevel=3,
    )


def reset() -> None:
    """Allows the kernels again (after ``set_kernels_enabled(True)``), and a new warning."""
    global _broken, _warned
    _broken = False
    _warned = False
