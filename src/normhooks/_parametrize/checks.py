"""The checks every entry point shares, and the input checks of every forward."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normhooks import _torch_compat
from normhooks._parametrize.layers import _joined, describe, is_uninitialized, layer_name
from normhooks._torch_compat import own_parameters

# --- checks ---------------------------------------------------------------------------------


def check_module(module: object, argument: str = "module") -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{argument} must be a torch.nn.Module, got {type(module).__name__}")
    return module


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got name={name!r}")
    return name


def checked_tensor(module: nn.Module, name: str, what: str) -> Tensor:
    """The tensor ``module.<name>`` after the checks every entry point shares: a Parameter
    (or a parametrized tensor, for a parametrization on top), real floating point, not sparse,
    of a module not wrapped yet. A lazy module's weight that does not exist yet is returned
    as it is, an ``nn.UninitializedParameter``, after the checks its dtype allows.
    """
    check_module(module)
    check_name(name)
    where = describe(module, name)
    parameters = own_parameters(module)
    if parametrize.is_parametrized(module, name):
        # Stacked on another parametrization: what gets reparametrized is its output.
        weight: Tensor | None = getattr(module, name)
    elif name in parameters:
        weight = parameters[name]
    elif hasattr(module, name):
        refuse_wrapped(module, what, getattr(module, name), name)
        found = type(getattr(module, name)).__name__
        raise TypeError(f"{where} must be a torch.nn.Parameter to apply {what}, got {found}")
    else:
        raise ValueError(f"{layer_name(module)} has no parameter named {name!r}")
    if weight is None:
        raise ValueError(f"{where} is None; there is no weight to {what}")
    if not is_uninitialized(weight):
        refuse_wrapped(module, what, weight, name)
    if not isinstance(weight, nn.Parameter) and not parametrize.is_parametrized(module, name):
        raise TypeError(
            f"{where} must be a torch.nn.Parameter to apply {what}, got {type(weight).__name__}"
        )
    check_dtype(where, weight.dtype, what)
    refuse_sparse(module, what)
    return weight


def check_dtype(where: str, dtype: torch.dtype, what: str) -> None:
    """Raises unless ``dtype`` is a real floating-point dtype; ``where`` names the tensor."""
    if not dtype.is_floating_point:
        kind = "complex" if dtype.is_complex else "integer"
        raise TypeError(
            f"{where} must be a real floating-point tensor for {what}, got {kind} dtype {dtype}"
        )


def check_ndim(where: str, ndim: int, what: str) -> None:
    """Raises unless a tensor of ``ndim`` dimensions has the 2 or more that both techniques
    need: one axis of rows, and at least one more to take statistics over."""
    if ndim < 2:
        raise ValueError(
            f"{where} has {ndim} dimension{'s' if ndim != 1 else ''}; {what} needs a tensor "
            "with at least 2"
        )


def check_tensor(tensor: object, where: str, what: str) -> Tensor:
    """``tensor`` if it is a real floating-point tensor with at least 2 dimensions.

    The checks of every public function and parametrization forward: a few attribute reads,
    cheap enough for each forward, and static under ``torch.compile`` (dtypes and ranks).
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
    check_dtype(where, tensor.dtype, what)
    check_ndim(where, tensor.ndim, what)
    return tensor


def refuse_sparse(module: nn.Module, what: str) -> None:
    """Sparse embeddings produce sparse gradients that no parametrization can pass through."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
        raise ValueError(
            f"{layer_name(module)} has sparse=True; {what} computes the weight from its "
            "originals, whose gradients are dense. Use sparse=False"
        )


def refuse_wrapped(
    module: nn.Module, what: str, tensor: object = None, name: str = "weight"
) -> None:
    """Raises if ``module`` was already wrapped by DDP, FSDP1 or ``fully_shard`` (FSDP2).

    All three must come after the reparametrization: DDP attaches its gradient hooks to the
    parameters it finds at construction and would never average new ones, FSDP1 flattens
    the parameters it finds into FlatParameters and leaves the layers views of them, and
    FSDP2 keeps managing the old name while the new originals stay sharded DTensors outside
    forward.
    """
    dtensor = _torch_compat.dtensor_type()
    if tensor is not None and dtensor is not None and isinstance(tensor, dtensor):
        raise ValueError(
            f"{describe(module, name)} is a DTensor: the model is already sharded by "
            f"fully_shard. Apply {what} before fully_shard"
        )
    if tensor is not None and _torch_compat.fsdp1_flattening(tensor) is not None:
        raise ValueError(
            f"{describe(module, name)} was flattened by FullyShardedDataParallel (FSDP1): the "
            f"model is already wrapped. Apply {what} before wrapping"
        )
    ddp = _torch_compat.ddp_type()
    fsdp1 = _torch_compat.fsdp1_type()
    for sub in module.modules():
        if ddp is not None and isinstance(sub, ddp):
            raise ValueError(
                f"{layer_name(module)} is wrapped by DistributedDataParallel. Apply {what} "
                "before wrapping: DDP only averages the gradients of the parameters it saw at "
                "construction"
            )
        if fsdp1 is not None and (
            isinstance(sub, fsdp1)
            or any(_torch_compat.fsdp1_flattening(t) is not None for t in _tensors_of(sub))
        ):
            raise ValueError(
                f"{layer_name(module)} is wrapped by FullyShardedDataParallel (FSDP1). Apply "
                f"{what} before wrapping: FSDP1 flattens the parameters it finds at "
                "construction into FlatParameters and would never manage new ones"
            )


def _tensors_of(module: nn.Module) -> list[object]:
    """A module's own parameters and plain tensor attributes (where FSDP1 leaves its views)."""
    return [*own_parameters(module).values(), *vars(module).values()]


def _refuse_ties(root: nn.Module, replaced: dict[int, tuple[nn.Module, str, str]]) -> None:
    """Raises if a Parameter that a conversion is about to replace is also another module's or
    name's.

    ``replaced`` maps each such Parameter to its owner, its attribute name and its path. A
    layer that the model calls twice (one module object under two paths) is not a tie.
    """
    for prefix, module in root.named_modules(remove_duplicate=False):
        for name, param in own_parameters(module).items():
            found = replaced.get(id(param))
            if found is None or (found[0] is module and found[1] == name):
                continue
            raise ValueError(
                f"{found[2]} and {_joined(prefix, name)} are the same Parameter (tied weights); "
                f"converting {found[2]} would untie them. Leave its layer out (layer_types), or "
                "convert one by itself and tie the other to it yourself"
            )
