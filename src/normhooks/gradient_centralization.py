r"""Gradient centralization (GC) as a hook for any PyTorch optimizer.

Implements H. Yong, J. Huang, X. Hua and L. Zhang, "Gradient Centralization: A New
Optimization Technique for Deep Neural Networks", ECCV 2020, arXiv:2004.01461: each weight
gradient of two or more dimensions loses its mean over every axis but dim 0, as the paper's
code, pytorch-optimizer's ``centralize_gradient`` and MindSpore's optimizers compute it.

The maths is a pure function (:func:`centralize_unit_`); :class:`GradientCentralization` puts
it on :class:`~normhooks._step_hook.StepHook`, which attaches to any optimizer and handles
closures, AMP and sharded parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from normhooks import _checks, _kernels
from normhooks import _torch_compat as compat
from normhooks._precision import HALF_DTYPES, compute_dtype
from normhooks._step_hook import Settings, Steady, StepHook, setting
from normhooks._step_hook.checks import all_plain
from normhooks._step_hook.steady import NOTHING, REPLAY

__all__ = ["GradientCentralization", "centralize_gradients_"]


@dataclass(frozen=True, eq=False)
class GCSettings(Settings):
    """GradientCentralization's settings; a param group overrides one with ``"gc_<name>"``."""

    conv_only: bool = setting(_checks.boolean)
    """Whether only gradients of four or more dimensions are centralized (the paper's GCC)."""


def _row_means(grad: Tensor) -> Tensor:
    """The mean of each row along dim 0, shaped to broadcast, in the compute dtype.

    torch sums in cascades (a float32 mean of 2**20 equal values is within 4 units in the last
    place), unlike its float32 norms, which need the base's row-wise ones on the CPU.
    """
    means: Tensor = torch.mean(
        grad, dim=tuple(range(1, grad.ndim)), keepdim=True, dtype=compute_dtype(grad.dtype)
    )
    return means


def centralize_unit_(
    params: list[Tensor],
    grads: list[Tensor],
    settings: GCSettings,
    lr: float | Tensor | None,
    *,
    norms: tuple[Tensor, Tensor] | None,
    foreach: bool | None,
    steady: Steady | None = None,
) -> None:
    """GC on one unit (one device, dtype and sharding), in place; no value per parameter.

    The rows of a tensor sharded on dim 0 are all local, so a shard is centralized alone. On
    CUDA with Triton a kernel centralizes every chosen gradient in one launch.
    """
    least = 4 if settings.conv_only else 2
    kept = None
    if steady is None:
        chosen = [grad for grad in grads if grad.ndim >= least]
    else:
        # A unit record that holds fixes every gradient's number of dims, so which are
        # chosen is kept with it, once per setting; what the kernel keeps is for those.
        kept = cast(dict[object, object], steady.kept.get(("chosen", least)))
        if kept is None:
            kept = steady.kept[("chosen", least)] = {
                "positions": [i for i, grad in enumerate(grads) if grad.ndim >= least]
            }
        positions = cast(list[int], kept["positions"])
        chosen = list(map(grads.__getitem__, positions))
    if not chosen:
        if steady is not None:
            steady.kept[REPLAY] = NOTHING  # none chosen, whatever the kernels' state
        return
    # available() checks the process-wide conditions (not compiling, no transform or mode)
    # once; every tensor must be plain (DTensors, sharded, keep the formula below), which a
    # record that holds proves.
    if (
        _kernels.available(chosen[0])
        and (steady is not None or all_plain(chosen))
        and _kernels.centralize_unit_(chosen, kept)  # False: the kernel failed here (warned)
    ):
        if steady is not None and kept is not None and REPLAY in kept:
            steady.kept[REPLAY] = kept.pop(REPLAY)  # what the record replays (keep_replay)
        return
    if foreach is False or chosen[0].is_cpu or chosen[0].dtype in HALF_DTYPES:
        # One tensor at a time, its mean then its subtraction: on the CPU the second pass
        # finds the tensor still in cache, where all means before all subtractions read every
        # gradient from memory twice. In place on float16/bfloat16 with a float32 mean:
        # computed in float32, rounded once.
        for grad in chosen:
            grad.sub_(_row_means(grad))
    else:
        compat.foreach_sub_(chosen, [_row_means(grad) for grad in chosen])


def centralize_gradients_(
    parameters: Tensor | Iterable[Tensor], conv_only: bool = False, *, foreach: bool | None = None
) -> None:
    r"""Centralizes every parameter's ``.grad`` in place: each row's mean is subtracted.

    For a gradient :math:`G` of two or more dimensions (of four or more with ``conv_only``), with
    :math:`G_i` its row along dim 0 (the output axis of ``nn.Linear`` and ``nn.ConvNd``) and
    :math:`M` the number of values in a row:

    .. math::

        G_i \leftarrow G_i - \frac{1}{M} \sum_j G_{i,j}

    Tensors of fewer dimensions (biases, normalization layers' affine parameters) are left
    alone. ``conv_only=True`` is the paper's GCC, as its code and pytorch-optimizer's
    ``gc_conv_only`` have it: the tensors of four or more dimensions, the weights of
    ``nn.Conv2d``, ``nn.Conv3d`` and their transposed versions; ``nn.Conv1d``'s weights have
    three and ``nn.Linear``'s two, and are left alone. The hook sees tensors, not layers, so
    dim 0 is the axis for every tensor, as in the paper and pytorch-optimizer: for a
    ``nn.ConvTranspose*`` weight (shape ``[in, out / groups, *kernel]``) that is the input
    axis, whose rows are then centralized. float16/bfloat16 gradients are computed in float32
    and rounded once. Nothing is read back to the host. On CUDA with Triton a kernel
    centralizes every chosen gradient of one device and dtype in one launch (two where a row
    is longer than 32768 values), whatever ``foreach`` says.

    Args:
        parameters: a tensor or an iterable of tensors; those without ``.grad`` are skipped.
        conv_only: centralize only the gradients of four or more dimensions (GCC).
        foreach: without the kernel, True or None take one multi-tensor op for the
            subtraction on an accelerator (on the CPU a tensor's mean and subtraction run
            together, while it is in cache), False one tensor at a time.

    References:
        Yong, Huang, Hua and Zhang, Gradient Centralization: A New Optimization Technique for
        Deep Neural Networks, ECCV 2020, arXiv:2004.01461.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 3))
        >>> w.grad = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]])
        >>> centralize_gradients_(w)
        >>> w.grad
        tensor([[-1.,  0.,  1.],
                [-1., -1.,  2.]])
    """
    settings = GCSettings._checked({"conv_only": conv_only})
    GradientCentralization._apply_to_parameters_(parameters, settings, foreach)


class GradientCentralization(StepHook, GCSettings):
    r"""Gradient centralization as a step pre-hook for any PyTorch optimizer.

    Before every ``optimizer.step()``, each gradient of two or more dimensions (four or more
    with ``conv_only``) loses the mean of each of its rows along dim 0, as in
    :func:`centralize_gradients_`:

    .. math::

        G_i \leftarrow G_i - \operatorname{mean}(G_i).

    Param groups can opt out (``"gc": False``) or override ``conv_only`` with
    ``"gc_conv_only"``: to centralize ``nn.Conv1d`` weights but no ``nn.Linear`` ones, keep
    ``conv_only=False`` and put the linear weights in a group that opts out. ``step(closure)``
    works, and so does :class:`torch.amp.GradScaler` with fused optimizers (the gradients are
    centralized unscaled and an inf/NaN still skips the step; see
    :class:`~normhooks._step_hook.StepHook`). FSDP2 (``fully_shard``): a parameter sharded on
    dim 0 holds whole rows, so GC needs no communication; DTensors sharded on another dim
    are refused. One GradientCentralization per optimizer.

    Args:
        conv_only: centralize only the gradients of four or more dimensions (the paper's GCC).
        foreach: as in :func:`centralize_gradients_`.

    References:
        Yong, Huang, Hua and Zhang, Gradient Centralization: A New Optimization Technique for
        Deep Neural Networks, ECCV 2020, arXiv:2004.01461.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
        ...                             torch.nn.LazyLinear(2))
        >>> model(torch.ones(1, 3, 5, 5)).sum().backward()
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> handle = GradientCentralization().attach(optimizer)
        >>> optimizer.step()
        >>> handle.remove()
    """

    prefix = "gc"
    technique = "gradient centralization"
    row_wise = True
    # Rows along dim 0 are whole on each rank: no norm of a whole tensor, no collective.
    whole_norms = False
    _unit_ = staticmethod(centralize_unit_)
    # The kernel branch of the unit function is one kernel entry's call and nothing else.
    replays = True

    def __init__(self, conv_only: bool = False, *, foreach: bool | None = None) -> None:
        super().__init__(conv_only=conv_only, foreach=foreach)
