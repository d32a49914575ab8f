"""The checks of a step hook's parameters and gradients: dtypes, layouts, foreign shardings."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from normhooks import _torch_compat as compat

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_plain(tensors: Iterable[object]) -> bool:
    """Whether every one of ``tensors`` is a plain ``Tensor`` or ``Parameter`` (no subclass).

    One C-level pass: it runs at every step over every parameter and gradient of a unit.
    """
    return compat.PLAIN_TYPES.issuperset(map(type, tensors))


def check_param(param: object, where: str, technique: str) -> Tensor:
    if not isinstance(param, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(param).__name__}")
    if param.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"{where} must be a real floating-point tensor (float16, bfloat16, float32 or "
            f"float64), got dtype {param.dtype}; {technique} is defined for these only"
        )
    return param


def check_dense_grad(grad: Tensor, where: str, technique: str) -> None:
    if grad.layout != torch.strided:
        raise ValueError(
            f"{where} has a {grad.layout} gradient; {technique} needs dense gradients "
            "(use sparse=False in nn.Embedding / nn.EmbeddingBag). No gradient or parameter "
            "was changed"
        )


_USE_FSDP2 = (
    "Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard), whose DTensor parameters "
    "the hooks serve exactly: in Lightning, ModelParallelStrategy with fully_shard in "
    "configure_model; in accelerate, FullyShardedDataParallelPlugin(fsdp_version=2); in the HF "
    'Trainer, fsdp_config={"version": 2}. No gradient or parameter was changed'
)


def check_not_flattened(param: Tensor, where: str, technique: str) -> None:
    """Refuses FSDP1's and DeepSpeed ZeRO-3's flattened parameters, whose norms are wrong.

    Only called while FSDP1 or DeepSpeed is imported (``compat.fsdp1_possible``,
    ``compat.deepspeed_possible``): before that no tensor can be one.
    """
    flattening = compat.fsdp1_flattening(param)
    if flattening == "flat":
        raise ValueError(
            f"{where} is a FlatParameter of FSDP1 (FullyShardedDataParallel with "
            "use_orig_params=False): one flat tensor holding pieces of every parameter of a "
            f"wrapped module, while {technique} needs the norm of each parameter. " + _USE_FSDP2
        )
    if flattening in ("original", "view"):
        raise ValueError(
            f"{where} is a parameter of a module wrapped by FSDP1 (FullyShardedDataParallel "
            "with use_orig_params=True), a view into FSDP1's flat shard: on more than one rank "
            "each holds a flattened piece of it, whose norm is not the parameter's, and "
            f"{technique} cannot tell which ranks hold the rest. " + _USE_FSDP2
        )
    if compat.deepspeed_partitioned(param):
        raise ValueError(
            f"{where} is partitioned by DeepSpeed ZeRO-3 (it carries a ds_id): each rank holds "
            f"a flat piece of it, or of many parameters, while {technique} needs the norm of "
            "each parameter. Use DDP or FSDP2 (torch.distributed.fsdp.fully_shard), or "
            "DeepSpeed without ZeRO. No gradient or parameter was changed"
        )


def check_rows_are_local(param: Tensor, where: str, technique: str, prefix: str) -> None:
    """Refuses a DTensor whose rows along dim 0 are split across ranks.

    A Shard(0) tensor (FSDP2) holds whole rows, so a technique that works row by row needs no
    collective for them; 0-/1-D tensors are not split into rows.
    """
    dtensor = compat.dtensor_type()
    if dtensor is None or not isinstance(param, dtensor) or param.ndim < 2:
        return
    sharded: Any = param
    for mesh_dim, placement in enumerate(sharded.placements):
        dim = getattr(placement, "dim", 0)
        if placement.is_shard() and dim != 0 and sharded.device_mesh.size(mesh_dim) > 1:
            raise ValueError(
                f"{where} is a DTensor sharded on dim {dim} ({placement!r}); {technique}'s "
                "units are the rows along dim 0, which are whole on one rank only where a "
                "tensor is sharded on dim 0 (FSDP2's Shard(0)). Shard it on dim 0 or opt its "
                "param group out with "
                f'"{prefix}": False'
            )


def check_foreach(foreach: object) -> bool | None:
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be a bool or None, got foreach={foreach!r}")
    return foreach


def check_grad_placements(param: Tensor, grad: Tensor, where: str, technique: str) -> None:
    """A DTensor parameter's gradient must be a DTensor laid out alike."""
    dtensor = compat.dtensor_type()
    sharded: Any = param
    theirs: Any = grad
    mesh, placements = sharded.device_mesh, sharded.placements
    if not isinstance(grad, dtensor) or (theirs.device_mesh, theirs.placements) != (
        mesh,
        placements,
    ):
        placed = (
            f"{theirs.device_mesh} {theirs.placements}"
            if isinstance(grad, dtensor)
            else f"a plain {type(grad).__name__}"
        )
        raise ValueError(
            f"{where} is a DTensor on {mesh} with placements {placements}, but its gradient "
            f"is {placed}; {technique} needs both laid out alike"
        )
