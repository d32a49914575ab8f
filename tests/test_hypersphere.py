"""Hypersphere: nGPT's normalization against the formula in float64 over many steps of torch's
optimizers and pytorch-optimizer's Muon, its axes and groups, zero vectors, AMP, precision,
errors. What every hook shares is in test_hook_contract.py; FSDP2 in test_distributed.py."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from helpers import assert_close_rel
from hook_kinds import on_sphere
from normhooks import (
    AdaptiveGradientClipping,
    GradientCentralization,
    GradientLARS,
    Hypersphere,
    TrustRatio,
    UpdateRMS,
)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}


def model(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """An embedding, a linear layer with a bias and a convolution: 2-D, 1-D and 4-D tensors."""
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {
            "embed": nn.Embedding(7, 5),
            "linear": nn.Linear(5, 4),
            "conv": nn.Conv2d(4, 3, 2),
        }
    ).to(dtype)


def loss_of(net: nn.Module, step: int) -> Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 7, (6,), generator=generator)
    hidden = net["linear"](net["embed"](tokens))  # type: ignore[operator]
    image = hidden.T.reshape(1, 4, 2, 3)
    return net["conv"](image).square().mean()  # type: ignore[operator, no-any-return]


def reference_step_(
    net: nn.Module, optimizer: torch.optim.Optimizer, step: int, **sphere: Any
) -> None:
    """A step of the optimizer alone, then the formula of hook_kinds.on_sphere by hand."""
    optimizer.zero_grad()
    loss_of(net, step).backward()
    optimizer.step()
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(on_sphere(param, **sphere))


def hooked_step(net: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.zero_grad()
    loss_of(net, step).backward()
    optimizer.step()


@pytest.mark.parametrize("dim", [1, 0], ids=["rows", "columns"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_many_steps_match_the_formula_in_float64(name: str, dim: int) -> None:
    hooked, reference = model(), model()
    optimizer = OPTIMIZERS[name](hooked.parameters())
    Hypersphere(dim=dim).attach(optimizer)
    plain = OPTIMIZERS[name](reference.parameters())
    for step in range(20):
        hooked_step(hooked, optimizer, step)
        reference_step_(reference, plain, step, dim=dim)
    for actual, expected in zip(hooked.parameters(), reference.parameters(), strict=True):
        assert_close_rel(actual.detach(), expected.detach(), 1e-12)


@pytest.mark.parametrize("dim", [1, 0], ids=["rows", "columns"])
def test_float32_steps_stay_within_float32_rounding_of_float64(dim: int) -> None:
    low, high = model(torch.float32), model(torch.float64)
    high.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    optimizer = torch.optim.SGD(low.parameters(), lr=0.1, momentum=0.9)
    Hypersphere(dim=dim).attach(optimizer)
    plain = torch.optim.SGD(high.parameters(), lr=0.1, momentum=0.9)
    for step in range(20):
        hooked_step(low, optimizer, step)
        reference_step_(high, plain, step, dim=dim)
    for actual, expected in zip(low.parameters(), high.parameters(), strict=True):
        assert_close_rel(actual.detach().double(), expected.detach(), 1e-5)


@pytest.mark.parametrize("dim", [1, 0], ids=["rows", "columns"])
@pytest.mark.parametrize("shape", [(6, 5), (3, 4, 2, 2)], ids=["matrix", "conv"])
def test_each_row_or_column_has_unit_norm_after_a_step(shape: tuple[int, ...], dim: int) -> None:
    param = nn.Parameter(3 * torch.randn(shape, dtype=torch.float64))
    param.grad = torch.randn(shape, dtype=torch.float64)
    optimizer = torch.optim.SGD([param], lr=0.1)
    Hypersphere(dim=dim).attach(optimizer)
    optimizer.step()
    matrix = param.detach().reshape(shape[0], -1)
    norms = torch.linalg.vector_norm(matrix, dim=dim)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-15)


def test_vectors_and_scalars_are_left_to_the_optimizer() -> None:
    params = [nn.Parameter(torch.randn(5, dtype=torch.float64)), nn.Parameter(torch.tensor(3.0))]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.SGD(params, lr=0.1)
    Hypersphere().attach(optimizer)
    before = [p.detach().clone() for p in params]
    optimizer.step()
    for param, old in zip(params, before, strict=True):
        assert torch.equal(param.detach(), old - 0.1)


def test_a_zero_row_stays_zero_and_a_tiny_one_is_divided_by_eps() -> None:
    weight = torch.randn(4, 3, dtype=torch.float64)
    weight[1] = 0.0
    weight[2] = torch.tensor([3e-13, 4e-13, 0.0])
    param = nn.Parameter(weight.clone())
    param.grad = torch.zeros_like(weight)
    optimizer = torch.optim.SGD([param], lr=0.1)
    Hypersphere(eps=1e-12).attach(optimizer)
    optimizer.step()
    assert torch.equal(param.detach()[1], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(param.detach()[2], weight[2] / 1e-12, rtol=1e-15, atol=0)
    torch.testing.assert_close(param.detach(), on_sphere(weight, eps=1e-12), rtol=1e-15, atol=0)


def test_a_zero_update_still_puts_the_weight_on_the_sphere() -> None:
    """nGPT normalizes every matrix after every step, moved or not."""
    weight = 2 * torch.randn(4, 3, dtype=torch.float64)
    param = nn.Parameter(weight.clone())
    param.grad = torch.zeros_like(weight)
    optimizer = torch.optim.SGD([param], lr=0.1)
    Hypersphere().attach(optimizer)
    optimizer.step()
    torch.testing.assert_close(param.detach(), on_sphere(weight), rtol=1e-15, atol=0)


def test_a_parameter_without_a_gradient_is_left_alone() -> None:
    stepped, idle = (nn.Parameter(2 * torch.randn(4, 3, dtype=torch.float64)) for _ in range(2))
    stepped.grad = torch.randn(4, 3, dtype=torch.float64)
    before = idle.detach().clone()
    optimizer = torch.optim.SGD([stepped, idle], lr=0.1)
    Hypersphere().attach(optimizer)
    optimizer.step()
    assert torch.equal(idle.detach(), before)


def test_groups_override_the_axis_and_eps_and_opt_out() -> None:
    weights = [3 * torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    weights[1][0] = 1e-9  # below eps=1e-3 in the group that overrides it
    params = [nn.Parameter(w.clone()) for w in weights]
    grads = [torch.randn(5, 4, dtype=torch.float64) for _ in weights]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    optimizer = torch.optim.SGD(
        [
            {"params": params[:1], "sphere_dim": 0},
            {"params": params[1:2], "sphere_eps": 1e-3},
            {"params": params[2:], "sphere": False},
        ],
        lr=0.1,
    )
    Hypersphere().attach(optimizer)
    optimizer.step()
    stepped = [w - 0.1 * g for w, g in zip(weights, grads, strict=True)]
    torch.testing.assert_close(params[0].detach(), on_sphere(stepped[0], dim=0), rtol=1e-15, atol=0)
    torch.testing.assert_close(
        params[1].detach(), on_sphere(stepped[1], eps=1e-3), rtol=1e-15, atol=0
    )
    assert torch.equal(params[2].detach(), stepped[2])


def test_a_closure_is_evaluated_once_and_the_result_is_on_the_sphere() -> None:
    hooked, reference = model(), model()
    optimizer = torch.optim.SGD(hooked.parameters(), lr=0.1)
    Hypersphere().attach(optimizer)
    calls = []

    def closure() -> Tensor:
        calls.append(torch.is_grad_enabled())
        optimizer.zero_grad()
        loss = loss_of(hooked, 0)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    reference_step_(reference, torch.optim.SGD(reference.parameters(), lr=0.1), 0)
    assert calls == [True]
    assert loss is not None
    for actual, expected in zip(hooked.parameters(), reference.parameters(), strict=True):
        assert_close_rel(actual.detach(), expected.detach(), 1e-12)


def test_matches_the_formula_after_pytorch_optimizers_muon() -> None:
    muon = pytest.importorskip("pytorch_optimizer").Muon
    hooked, reference = model(), model()

    def groups(net: nn.Module) -> list[dict[str, Any]]:
        return [
            {"params": [net["linear"].weight, net["conv"].weight], "use_muon": True},  # type: ignore[index]
            {
                "params": [net["embed"].weight, net["linear"].bias, net["conv"].bias],  # type: ignore[index]
                "use_muon": False,
            },
        ]

    optimizer = muon(groups(hooked), lr=0.02)
    Hypersphere().attach(optimizer)
    plain = muon(groups(reference), lr=0.02)
    for step in range(10):
        hooked_step(hooked, optimizer, step)
        reference_step_(reference, plain, step)
    for actual, expected in zip(hooked.parameters(), reference.parameters(), strict=True):
        assert_close_rel(actual.detach(), expected.detach(), 1e-12)


def test_after_update_rms_attached_first_the_rescaled_step_is_normalized() -> None:
    """Post-step hooks run in the order they were attached: a hook on the updates first, the
    sphere last (Muon's RMS matching, then nGPT's normalization)."""
    weight = 2 * torch.randn(6, 5, dtype=torch.float64)
    grad = torch.randn(6, 5, dtype=torch.float64)
    param = nn.Parameter(weight.clone())
    param.grad = grad.clone()
    optimizer = torch.optim.SGD([param], lr=0.1)
    UpdateRMS("match", 0.2).attach(optimizer)
    Hypersphere().attach(optimizer)
    optimizer.step()
    r = 0.2 / (grad.norm().item() / math.sqrt(grad.numel()))
    expected = on_sphere(weight - 0.1 * r * grad)
    torch.testing.assert_close(param.detach(), expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "later",
    [lambda: UpdateRMS("match"), lambda: TrustRatio()],
    ids=["update-rms", "trust-ratio"],
)
def test_a_hook_on_the_updates_attached_after_it_is_refused_at_the_step(
    later: Callable[[], Any],
) -> None:
    """Attached after the sphere, a hook on the updates would rescale the step onto the
    normalized weights and take them off the sphere: the step is refused before anything
    changes, the closure unrun."""
    weight = 2 * torch.randn(6, 5, dtype=torch.float64)
    param = nn.Parameter(weight.clone())
    param.grad = torch.randn_like(weight)
    optimizer = torch.optim.AdamW([param], lr=0.1)
    Hypersphere().attach(optimizer)
    hook = later()
    hook.attach(optimizer)
    calls = []
    name = type(hook).__name__
    with pytest.raises(RuntimeError, match=rf"{name} was attached to this AdamW after Hypersphere"):
        optimizer.step(lambda: calls.append(1))
    assert not calls
    assert torch.equal(param.detach(), weight)
    assert not optimizer.state


def test_a_hook_on_the_updates_after_it_on_other_groups_is_allowed() -> None:
    """The update hook opts out of the matrices, the sphere out of the rest: nothing the one
    rescales does the other normalize, so the order does not matter."""
    weight = 2 * torch.randn(6, 5, dtype=torch.float64)
    grad = torch.randn(6, 5, dtype=torch.float64)
    matrix = nn.Parameter(weight.clone())
    bias = nn.Parameter(torch.ones(5, dtype=torch.float64))
    matrix.grad, bias.grad = grad.clone(), torch.ones(5, dtype=torch.float64)
    groups = [{"params": [matrix], "update": False}, {"params": [bias], "sphere": False}]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    Hypersphere().attach(optimizer)
    UpdateRMS("match", 0.2).attach(optimizer)
    optimizer.step()
    torch.testing.assert_close(matrix.detach(), on_sphere(weight - 0.1 * grad))
    # The bias's update has RMS 1 per unit of lr: matched to 0.2.
    expected = torch.full((5,), 1 - 0.1 * 0.2, dtype=torch.float64)
    torch.testing.assert_close(bias.detach(), expected)


def test_attached_again_after_the_hook_on_the_updates_it_normalizes_the_rescaled_step() -> None:
    weight = 2 * torch.randn(6, 5, dtype=torch.float64)
    grad = torch.randn(6, 5, dtype=torch.float64)
    param = nn.Parameter(weight.clone())
    param.grad = grad.clone()
    optimizer = torch.optim.SGD([param], lr=0.1)
    first = Hypersphere().attach(optimizer)
    UpdateRMS("match", 0.2).attach(optimizer)
    first.remove()
    Hypersphere().attach(optimizer)
    optimizer.step()
    r = 0.2 / (grad.norm().item() / math.sqrt(grad.numel()))
    expected = on_sphere(weight - 0.1 * r * grad)
    torch.testing.assert_close(param.detach(), expected, rtol=1e-14, atol=0)


# --- AMP -----------------------------------------------------------------------------------


def scaled_step(fused: bool, overflow: bool) -> tuple[nn.Module, list[Tensor], list[Tensor]]:
    """One GradScaler step of AdamW with Hypersphere on float32 weights far from the sphere;
    the reference is the same step of AdamW alone."""
    net, twin = model(torch.float32), model(torch.float32)
    for module in (net, twin):
        with torch.no_grad():
            for param in module.parameters():
                param.mul_(3.0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)
    Hypersphere().attach(optimizer)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=fused)
    before = [p.detach().clone() for p in net.parameters()]
    for module, opt in ((net, optimizer), (twin, plain)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(loss_of(module, 0)).backward()
        if overflow:
            module["linear"].weight.grad[0, 0] = math.inf  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
    return net, before, [p.detach() for p in twin.parameters()]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_step_grad_scaler_skips_leaves_every_weight_untouched(fused: bool) -> None:
    net, before, _ = scaled_step(fused, overflow=True)
    for param, old in zip(net.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_step_grad_scaler_takes_is_normalized(fused: bool) -> None:
    net, _, stepped = scaled_step(fused, overflow=False)
    for param, plain in zip(net.parameters(), stepped, strict=True):
        expected = on_sphere(plain)
        assert_close_rel(param.detach().double(), expected, 1e-6)


def _unscale_first(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    scaler.unscale_(optimizer)  # as before torch.nn.utils.clip_grad_norm_


def _beside(hook: type) -> Callable[[torch.amp.GradScaler, torch.optim.Optimizer], None]:
    return lambda _, optimizer: hook().attach(optimizer)


SKIPPING = {
    "unscale_-first": _unscale_first,
    "beside-agc": _beside(AdaptiveGradientClipping),
    "beside-lars": _beside(GradientLARS),
    "beside-gc": _beside(GradientCentralization),
}


@pytest.mark.parametrize("before_step", list(SKIPPING.values()), ids=list(SKIPPING))
def test_a_fused_step_grad_scaler_skips_with_unscaled_gradients_leaves_every_weight_untouched(
    before_step: Callable[[torch.amp.GradScaler, torch.optim.Optimizer], None],
) -> None:
    """After scaler.unscale_ or a hook on the gradients, the fused step sees grad_scale None
    but still skips on found_inf: the weights (far from the sphere) stay as they were."""
    net = model(torch.float32)
    with torch.no_grad():
        for param in net.parameters():
            param.mul_(3.0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in net.parameters()]
    scaler.scale(loss_of(net, 0)).backward()
    net["linear"].weight.grad[0, 0] = math.inf  # type: ignore[index]
    before_step(scaler, optimizer)
    Hypersphere().attach(optimizer)
    scaler.step(optimizer)
    scaler.update()
    for param, old in zip(net.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)


# --- precision and cost --------------------------------------------------------------------


@pytest.mark.parametrize("dim", [1, 0], ids=["rows", "columns"])
def test_long_float32_vectors_on_the_cpu_are_normalized_to_float32_precision(dim: int) -> None:
    shape = (3, 20000) if dim == 1 else (20000, 3)
    weight = torch.rand(shape, dtype=torch.float32) + 1.0
    param = nn.Parameter(weight.clone())
    param.grad = torch.zeros_like(weight)
    optimizer = torch.optim.SGD([param], lr=0.1)
    Hypersphere(dim=dim).attach(optimizer)
    optimizer.step()
    norms = torch.linalg.vector_norm(param.detach().double(), dim=dim)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_weights_are_divided_in_float32_and_rounded_once(dtype: torch.dtype) -> None:
    weight = 3 * torch.randn(6, 5).to(dtype)
    param = nn.Parameter(weight.clone())
    param.grad = torch.zeros_like(weight)
    optimizer = torch.optim.SGD([param], lr=0.1)
    Hypersphere().attach(optimizer)
    optimizer.step()
    expected = (weight.float() / weight.float().norm(dim=1, keepdim=True)).to(dtype)
    assert torch.equal(param.detach(), expected)


def test_no_copy_of_the_parameters_is_kept() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    hook = Hypersphere()
    hook.attach(optimizer)
    hooked_step(net, optimizer, 0)
    units = [unit for plan in hook._plans[optimizer] for unit in plan.units]
    assert units
    assert all(unit.copies is None for unit in units)


def test_the_state_dict_is_the_optimizers_own() -> None:
    hooked, reference = model(), model()
    optimizer = torch.optim.AdamW(hooked.parameters(), lr=1e-2)
    Hypersphere().attach(optimizer)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    hooked_step(hooked, optimizer, 0)
    hooked_step(reference, plain, 0)
    assert optimizer.state_dict().keys() == plain.state_dict().keys()
    assert optimizer.state_dict()["param_groups"] == plain.state_dict()["param_groups"]


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dim": 2}, ValueError, r"dim must be 1 \(each row along dim 0 has unit norm\) or 0"),
        ({"dim": -1}, ValueError, r"got dim=-1"),
        ({"dim": True}, TypeError, r"dim must be an int, 1 \(each row .* got dim=True"),
        ({"dim": "rows"}, TypeError, r"dim must be an int, .* got dim='rows'"),
        ({"dim": 1.0}, TypeError, r"dim must be an int, .* got dim=1.0"),
        ({"eps": 0.0}, ValueError, r"eps must be positive, got eps=0.0"),
        ({"eps": -1e-12}, ValueError, r"eps must be positive"),
        ({"eps": "small"}, TypeError, r"eps must be a real number, got eps='small'"),
        ({"eps": math.nan}, ValueError, r"eps must be finite"),
    ],
    ids=[
        "dim-2",
        "dim-negative",
        "dim-bool",
        "dim-str",
        "dim-float",
        "eps-0",
        "eps-negative",
        "eps-str",
        "eps-nan",
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Hypersphere(**kwargs)


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"sphere_dim": 2}, r"param group 0: sphere_dim must be 1 .* got sphere_dim=2"),
        ({"sphere_eps": 0}, r"param group 0: sphere_eps must be positive, got sphere_eps=0"),
        ({"sphere_axis": 0}, r"param group 0: unknown key 'sphere_axis'"),
        ({"sphere": 1}, r'param group 0: "sphere" must be a bool'),
        ({"sphere_dim": 0.0}, r"param group 0: sphere_dim must be an int, .* got sphere_dim=0.0"),
    ],
    ids=["dim", "eps", "unknown-key", "opt-out-not-bool", "dim-float"],
)
def test_bad_groups_are_refused_at_attach_and_nothing_changes(
    group: dict[str, Any], match: str
) -> None:
    net = model()
    optimizer = torch.optim.SGD([{"params": list(net.parameters()), **group}], lr=0.1)
    before = copy.deepcopy(net.state_dict())
    with pytest.raises((ValueError, TypeError), match=match):
        Hypersphere().attach(optimizer)
    assert not optimizer._optimizer_step_pre_hooks
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key])


# --- sharding: which mesh dims split a normalized vector -----------------------------------


class FakeMesh:
    def __init__(self, *sizes: int) -> None:
        self._sizes = sizes

    def size(self, mesh_dim: int) -> int:
        return self._sizes[mesh_dim]


@pytest.mark.parametrize(
    ("sizes", "placements", "dim", "expected"),
    [
        ((2,), ["shard0"], 1, ()),
        ((2,), ["shard0"], 0, (0,)),
        ((2,), ["shard1"], 1, (0,)),
        ((2,), ["shard1"], 0, ()),
        ((2, 2), ["replicate", "shard0"], 0, (1,)),
        ((2, 2), ["shard0", "shard1"], 1, (1,)),
        ((2, 2), ["shard0", "shard1"], 0, (0,)),
        ((1, 2), ["shard0", "replicate"], 0, ()),
        ((2,), ["shard-1"], 1, (0,)),
    ],
    ids=[
        "fsdp-rows",
        "fsdp-columns",
        "tp-rows",
        "tp-columns",
        "hsdp-columns",
        "fsdp-tp-rows",
        "fsdp-tp-columns",
        "mesh-of-one",
        "negative-dim",
    ],
)
def test_the_mesh_dims_reduced_are_those_that_split_the_normalized_vectors(
    sizes: tuple[int, ...], placements: list[str], dim: int, expected: tuple[int, ...]
) -> None:
    from torch.distributed.tensor import Replicate, Shard

    from normhooks.hypersphere import _reduced_mesh_dims

    made = {"shard0": Shard(0), "shard1": Shard(1), "shard-1": Shard(-1), "replicate": Replicate()}
    param = type(
        "FakeDTensor",
        (),
        {"device_mesh": FakeMesh(*sizes), "placements": [made[p] for p in placements], "ndim": 3},
    )()
    assert _reduced_mesh_dims(param, dim) == expected
