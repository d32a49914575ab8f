"""What the spawned ranks of tests/test_distributed.py run (gloo, CPU).

Each scenario trains the same small CNN + MLP, with weight standardization, weight
normalization and GradientLARS, on its rank's half of every batch, and saves what the
parent test compares with one process on the full batches. Kept out of the test module so
that the children import nothing from pytest.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hook_kinds import KINDS
from normhooks import (
    AdaptiveGradientClipping,
    GradientLARS,
    Hypersphere,
    agc_,
    agc_param_groups,
    apply_weight_norm,
    data_dependent_init,
    lars_,
    lars_param_groups,
    standardize_weight,
    weight_norm,
    weight_standardization,
)

STEPS = 5
BATCH = 8
INIT_BATCH = 16
LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-3
ADAMW_LR = 1e-2


def cnn_and_mlp(seed: int) -> nn.Sequential:
    """Conv (5 filters: odd), GroupNorm, conv, linear (7 rows: odd), linear (1 row)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1),
        nn.GroupNorm(1, 5),
        nn.ReLU(),
        nn.Conv2d(5, 4, 3),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 7),
        nn.Tanh(),
        nn.Linear(7, 1),
    )


def make_model(seed: int = 0) -> nn.Module:
    """:func:`cnn_and_mlp` with WS on the first conv and WN on the other three weights."""
    model = cnn_and_mlp(seed)
    weight_standardization(model[0])
    for index in (3, 5, 7):
        weight_norm(model[index], "weight")
    return model


def data() -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1)
    init = torch.randn(INIT_BATCH, 3, 6, 6, generator=generator)
    batches = [
        (
            torch.randn(BATCH, 3, 6, 6, generator=generator),
            torch.randn(BATCH, 1, generator=generator),
        )
        for _ in range(STEPS)
    ]
    return init, batches


def half(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = tensor.shape[0] // world
    return tensor[rank * size : (rank + 1) * size]


def wn_init_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """g and bias of every WN layer, full tensors (gathered from shards under FSDP2)."""
    values = {}
    for index in (3, 5, 7):
        layer = model[index]
        for name, tensor in (
            ("g", layer.parametrizations.weight.original0),
            ("bias", layer.bias),
        ):
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            values[f"{index}.{name}"] = full.detach().clone()
    return values


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def train(
    model: nn.Module,
    params_of: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    shard: Callable[[torch.Tensor], torch.Tensor],
    on_step: Callable[[int, torch.optim.Optimizer, GradientLARS], None] | None = None,
) -> list[list[torch.Tensor]]:
    """STEPS of momentum SGD + GradientLARS; returns the hook's rates of every step."""
    optimizer = torch.optim.SGD(lars_param_groups(params_of), lr=LR, momentum=MOMENTUM)
    hook = GradientLARS(weight_decay=WEIGHT_DECAY)
    hook.attach(optimizer)
    rates = []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        if on_step is not None:
            on_step(step, optimizer, hook)
        else:
            optimizer.step()
        rates.append([r.clone() for r in hook.last_rates])
    return rates


def refused(action: Callable[[], object]) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return ""


def ddp(rank: int, world: int, out: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    wrapped = DistributedDataParallel(model)
    init, batches = data()
    data_dependent_init(wrapped, half(init, rank, world))
    after_init = wn_init_values(model)
    rates = train(wrapped, model, batches, lambda t: half(t, rank, world))
    return {
        "init": after_init,
        "rates": rates,
        "params": full_parameters(model),
        "refused_after_wrap": refused(lambda: apply_weight_norm(wrapped)),
    }


def fsdp(rank: int, world: int, out: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))

    def sharded(seed: int) -> nn.Module:
        model = make_model(seed)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = sharded(0)
    init, batches = data()
    data_dependent_init(model, half(init, rank, world))
    after_init = wn_init_values(model)
    collectives: dict[str, int] = {}

    def counted_step(step: int, optimizer: torch.optim.Optimizer, hook: GradientLARS) -> None:
        if step != 2:
            optimizer.step()
            return
        # SGD's own multi-tensor ops on DTensors communicate nothing: what is counted is LARS.
        with CommDebugMode() as comm:
            optimizer.step()
        collectives["step"] = comm.get_total_counts()

    rates = train(model, model, batches, lambda t: half(t, rank, world), counted_step)
    params = full_parameters(model)

    stale = stale_eval_outputs(mesh, fully_shard)

    # HSDP: a (replicate, shard) mesh; LARS reduces over the shard dimension only.
    hybrid = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    hsdp_model = make_model()
    for layer in hsdp_model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=hybrid)
    fully_shard(hsdp_model, mesh=hybrid)
    data_dependent_init(hsdp_model, half(init, rank, world))
    hsdp_rates = train(hsdp_model, hsdp_model, batches, lambda t: half(t, rank, world))

    from torch.distributed.tensor import DTensor, Partial

    partial = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()]))
    partial.grad = DTensor.from_local(torch.randn(4, 4), mesh, [Partial()])

    dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "checkpoint"))
    restored = sharded(7)
    state = get_model_state_dict(restored)
    dcp.load(state, checkpoint_id=str(out / "checkpoint"))
    set_model_state_dict(restored, state)
    full_state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {
        "init": after_init,
        "rates": rates,
        "params": params,
        "collectives": collectives,
        "stale_eval_outputs": stale,
        "hsdp_params": full_parameters(hsdp_model),
        "hsdp_rates": hsdp_rates,
        "refused_partial": refused(lambda: lars_([partial])),
        "restored": full_parameters(restored),
        "expected_restored": full_parameters(model),
        "full_state": full_state,
        "refused_after_shard": refused(lambda: weight_standardization(model[3]))
        + "|"
        + refused(lambda: weight_norm(fully_shard(nn.Linear(3, 3), mesh=mesh))),
    }


def stale_eval_outputs(mesh: Any, fully_shard: Callable[..., Any]) -> int:
    """Eval forwards under FSDP2 that disagree with a fresh computation, after updates.

    FSDP2 refills the same unsharded tensor every forward without bumping its version, so a
    cache keyed on the tensor would serve the weight of an earlier step; a wide layer makes
    the allocator hand back the same address often enough to show it.
    """
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 512), nn.ReLU(), nn.Linear(512, 3))
    weight_standardization(model[0])
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.eval()
    x = torch.randn(2, 4)
    wrong = 0
    with torch.no_grad():
        for _ in range(20):
            local = model[0].parametrizations.weight.original.to_local()
            local.add_(0.1 * torch.randn_like(local))
            output = model(x)
            model.reshard()
            weight = standardize_weight(model[0].parametrizations.weight.original.full_tensor())
            hidden = F.linear(x, weight, model[0].bias.full_tensor()).relu()
            expected = F.linear(hidden, model[2].weight.full_tensor(), model[2].bias.full_tensor())
            wrong += not torch.allclose(output, expected, atol=1e-5)
    return wrong


def make_mlp(seed: int = 0) -> nn.Module:
    """Four linear layers with odd sizes (uneven shards), for one fully_shard call each.

    lars_param_groups puts the last weight (1 row) and the biases in the group LARS skips, so
    the hook scales three sharded weights, from three meshes.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 6 * 6, 7),
        nn.Tanh(),
        nn.Linear(7, 5),
        nn.Tanh(),
        nn.Linear(5, 3),
        nn.Tanh(),
        nn.Linear(3, 1),
    )


def fsdp_mesh_per_call(rank: int, world: int, out: Path) -> dict[str, Any]:
    """GradientLARS with ``fully_shard(layer)`` per layer and no ``mesh=``.

    Each of those calls builds its own DeviceMesh over the same ranks; the all-reduces the
    hook issues are counted by wrapping ``torch.distributed.all_reduce`` during each step.
    """
    from torch.distributed.fsdp import fully_shard

    model = make_mlp()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    meshes = {id(p.device_mesh) for p in model.parameters()}  # type: ignore[attr-defined]
    _, batches = data()
    all_reduces: list[int] = []
    original = dist.all_reduce

    def counted_step(step: int, optimizer: torch.optim.Optimizer, hook: GradientLARS) -> None:
        calls: list[int] = []

        def counting(*args: Any, calls: list[int] = calls, **kwargs: Any) -> Any:
            calls.append(1)
            return original(*args, **kwargs)

        dist.all_reduce = counting  # type: ignore[assignment]
        try:
            optimizer.step()
        finally:
            dist.all_reduce = original
        all_reduces.append(len(calls))

    rates = train(model, model, batches, lambda t: half(t, rank, world), counted_step)
    return {
        "meshes": len(meshes),
        "all_reduces": all_reduces,
        "rates": rates,
        "params": full_parameters(model),
    }


AGC_CLIPPING = 0.05


def make_agc_model(seed: int = 0) -> nn.Module:
    """Convs and linears with odd sizes (uneven shards) and a 1-row weight (none on rank 1).

    agc_param_groups leaves the last Linear out, as NF-Nets do; everything else is clipped:
    weights by rows, biases as one unit each.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(5, 3, 3),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 7),
        nn.Tanh(),
        nn.Linear(7, 1),
        nn.Tanh(),
        nn.Linear(1, 1),
    )


def train_agc(
    model: nn.Module,
    groups: list[dict[str, Any]],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    shard: Callable[[torch.Tensor], torch.Tensor],
    count_all_reduces: bool = False,
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """STEPS of momentum SGD + AGC; the hook's ratios of every step, and the all-reduces
    each step issued when ``count_all_reduces``."""
    optimizer = torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM)
    hook = AdaptiveGradientClipping(clipping=AGC_CLIPPING)
    hook.attach(optimizer)
    ratios, all_reduces = [], []
    original = dist.all_reduce
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        calls: list[int] = []

        def counting(*args: Any, calls: list[int] = calls, **kwargs: Any) -> Any:
            calls.append(1)
            return original(*args, **kwargs)

        if count_all_reduces:
            dist.all_reduce = counting  # type: ignore[assignment]
        try:
            optimizer.step()
        finally:
            dist.all_reduce = original
        all_reduces.append(len(calls))
        ratios.append([r.clone() for r in hook.last_ratios])
    return ratios, all_reduces


def fsdp_agc(rank: int, world: int, out: Path) -> dict[str, Any]:
    """AGC on a fully_shard-ed model (every weight Shard(0)), and what it refuses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def sharded() -> nn.Module:
        model = make_agc_model()
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    _, batches = data()
    model = sharded()
    ratios, all_reduces = train_agc(
        model, agc_param_groups(model), batches, lambda t: half(t, rank, world), True
    )
    # Only the weights, whose rows are local: AGC itself needs no collective for them.
    weights_only = sharded()
    groups = agc_param_groups(weights_only, exclude=lambda _, p: p.ndim < 2)
    weight_ratios, weight_all_reduces = train_agc(
        weights_only, groups, batches, lambda t: half(t, rank, world), True
    )

    torch.manual_seed(3)
    by_columns = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    by_columns.grad = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    hooked = torch.optim.SGD([by_columns], lr=0.1)
    return {
        "ratios": ratios,
        "params": full_parameters(model),
        "all_reduces": all_reduces,
        "weight_ratios": weight_ratios,
        "weight_params": full_parameters(weights_only),
        "weight_all_reduces": weight_all_reduces,
        "refused_shard1": refused(lambda: agc_([by_columns])),
        "refused_shard1_hook": refused(lambda: AdaptiveGradientClipping().attach(hooked)),
    }


def train_trust_ratio(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    shard: Callable[[torch.Tensor], torch.Tensor],
    count: Callable[[Callable[[], object]], int] | None = None,
) -> dict[str, Any]:
    """STEPS of AdamW + TrustRatio (LAMB); the ratios and, with ``count``, collectives."""

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=WEIGHT_DECAY)

    trained = train_hook("trust", model, batches, shard, count, make_optimizer=adamw)
    return {"ratios": trained["values"], **trained}


def fsdp_trust_ratio(rank: int, world: int, out: Path) -> dict[str, Any]:
    """TrustRatio on AdamW with every linear layer sharded by its own fully_shard call."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    model = make_mlp()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    _, batches = data()

    def count(step: Callable[[], object]) -> int:
        # AdamW's own multi-tensor ops on DTensors communicate nothing: this is TrustRatio.
        with CommDebugMode() as comm:
            step()
        return int(comm.get_total_counts())

    return train_trust_ratio(model, batches, lambda t: half(t, rank, world), count)


def train_hook(
    name: str,
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    shard: Callable[[torch.Tensor], torch.Tensor],
    count: Callable[[Callable[[], object]], int] | None = None,
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> dict[str, Any]:
    """STEPS of momentum SGD (or ``make_optimizer``'s) with the hook of KINDS[name]; its values
    of every step (where it has any), the collectives each step issued (with ``count``) and
    the full parameters."""
    kind = KINDS[name]
    if make_optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    else:
        optimizer = make_optimizer(model.parameters())
    hook = kind.make()
    hook.attach(optimizer)
    values, collectives = [], []
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        if count is None:
            optimizer.step()
        else:
            collectives.append(count(optimizer.step))
        if kind.values:
            values.append([v.clone() for v in getattr(hook, kind.values)])
    return {"values": values, "collectives": collectives, "params": full_parameters(model)}


def fsdp_hooks(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Every hook of KINDS on the MLP, each linear layer sharded by its own fully_shard call."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    _, batches = data()

    def count(step: Callable[[], object]) -> int:
        # SGD's own multi-tensor ops on DTensors communicate nothing: this is the hook.
        with CommDebugMode() as comm:
            step()
        return int(comm.get_total_counts())

    results = {}
    for name in KINDS:
        model = make_mlp()
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
        results[name] = train_hook(name, model, batches, lambda t: half(t, rank, world), count)
    return results


def train_sphere_columns(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    shard: Callable[[torch.Tensor], torch.Tensor],
    count: Callable[[Callable[[], object]], int] | None = None,
) -> dict[str, Any]:
    """STEPS of momentum SGD with Hypersphere(dim=0): each column on the unit sphere."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    Hypersphere(dim=0).attach(optimizer)
    collectives = []
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        if count is None:
            optimizer.step()
        else:
            collectives.append(count(optimizer.step))
    return {"collectives": collectives, "params": full_parameters(model)}


def fsdp_sphere_columns(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Hypersphere(dim=0) on the MLP sharded per layer: Shard(0) splits every column."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    _, batches = data()

    def count(step: Callable[[], object]) -> int:
        with CommDebugMode() as comm:
            step()
        return int(comm.get_total_counts())

    model = make_mlp()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return train_sphere_columns(model, batches, lambda t: half(t, rank, world), count)


def fsdp1(rank: int, world: int, out: Path) -> dict[str, Any]:
    """What the hooks say to FSDP1 (FullyShardedDataParallel), each layer its own unit.

    Before the refusal, LARS computed one rate over each rank's piece of the flat parameter
    (use_orig_params=False) or over each rank's pieces of every parameter (True).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    results: dict[str, Any] = {}
    for use_orig_params in (False, True):
        model = FullyShardedDataParallel(
            make_mlp(),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )
        mode = "orig" if use_orig_params else "flat"
        for name, kind in KINDS.items():
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            results[f"{mode}_{name}"] = refused(lambda k=kind, o=optimizer: k.make().attach(o))
            results[f"{mode}_{name}_hooks"] = len(optimizer._optimizer_step_pre_hooks)
        _, batches = data()
        x, y = batches[0]
        F.mse_loss(model(half(x, rank, world)), half(y, rank, world)).backward()
        results[f"{mode}_functional"] = refused(lambda m=model: lars_(m.parameters()))
        # Param groups can change: the step refuses them too, before any gradient changes.
        optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2, 2))], lr=LR)
        GradientLARS().attach(optimizer)
        optimizer.add_param_group({"params": list(model.parameters())})
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results[f"{mode}_step"] = refused(optimizer.step)
        after = [p.grad for p in model.parameters() if p.grad is not None]
        results[f"{mode}_step_unchanged"] = all(
            torch.equal(a, b) for a, b in zip(grads, after, strict=True)
        )
    return results


def make_fused_model(seed: int = 0) -> nn.Module:
    """:func:`cnn_and_mlp` weight-normalized as a tree: its four weights fused."""
    return apply_weight_norm(cnn_and_mlp(seed))


def train_plain(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    shard: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """STEPS of momentum SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        optimizer.step()


def ddp_fused(rank: int, world: int, out: Path) -> dict[str, Any]:
    """DDP over a fused model, its kernels on the CPU through Triton's interpreter (the
    parent's TRITON_INTERPRET=1 reaches the ranks)."""
    from torch.nn.parallel import DistributedDataParallel

    from normhooks import _kernels

    model = make_fused_model()
    wrapped = DistributedDataParallel(model)
    _, batches = data()
    count, undo = counting_fused_launches()
    try:
        with _kernels.route_cpu_tensors():
            train_plain(wrapped, batches, lambda t: half(t, rank, world))
    finally:
        undo()
    return {"params": full_parameters(model), "fused": count[0]}


def counting_fused_launches() -> tuple[list[int], Callable[[], None]]:
    """Counts the calls of the fused WN entry point; returns the count and what undoes it."""
    from normhooks import _kernels

    count = [0]
    entry = _kernels.fuse_weight_norms

    def counting(*args: Any) -> Any:
        count[0] += 1
        return entry(*args)

    _kernels.fuse_weight_norms = counting  # type: ignore[assignment]

    def undo() -> None:
        _kernels.fuse_weight_norms = entry  # type: ignore[assignment]

    return count, undo


def fsdp_fused(rank: int, world: int, out: Path) -> dict[str, Any]:
    """fully_shard over a model whose weights the tree conversion fused: the originals are
    DTensors when the model's scope opens, so every layer takes its own path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from normhooks import _kernels

    mesh = init_device_mesh("cpu", (world,))
    model = make_fused_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _, batches = data()
    count, undo = counting_fused_launches()
    try:
        with _kernels.route_cpu_tensors():
            train_plain(model, batches, lambda t: half(t, rank, world))
    finally:
        undo()
    return {"params": full_parameters(model), "fused": count[0]}


SCENARIOS: dict[str, Callable[[int, int, Path], dict[str, Any]]] = {
    "fsdp_fused": fsdp_fused,
    "ddp": ddp,
    "ddp_fused": ddp_fused,
    "fsdp": fsdp,
    "fsdp_mesh_per_call": fsdp_mesh_per_call,
    "fsdp_agc": fsdp_agc,
    "fsdp_trust_ratio": fsdp_trust_ratio,
    "fsdp_hooks": fsdp_hooks,
    "fsdp_sphere_columns": fsdp_sphere_columns,
    "fsdp1": fsdp1,
}


def rank_entry(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    """One rank: run the scenario, save its results, leave without interpreter shutdown."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    finished = False
    try:
        out = Path(out_dir)
        results = SCENARIOS[scenario](rank, world, out)
        torch.save(results, out / f"{scenario}-rank{rank}.pt")
        dist.barrier()
        finished = True
    finally:
        dist.destroy_process_group()
    if finished:
        # gloo's worker threads can outlive the process group and abort the interpreter's
        # shutdown; a rank that has saved its results has nothing left to clean up.
        os._exit(0)
