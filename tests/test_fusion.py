"""One launch for all of a model's WN (or WS) weights each way: normhooks._kernels._scope.

The tree conversions fuse the model they convert. Every test runs the kernels on CPU tensors
through Triton's interpreter (``_kernels.route_cpu_tensors()``; conftest sets
``TRITON_INTERPRET=1`` without a GPU) and compares outputs and gradients with the formulas
written out in float64 (tests/kernel_cases.py), applied to leaf copies of the model's
originals through ``torch.func.functional_call`` on the model as it was before conversion.
"""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

pytest.importorskip("triton", reason="the fused kernels need Triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "runs the kernels on CPU tensors through Triton's interpreter", allow_module_level=True
    )

from kernel_cases import wn_reference, ws_reference
from normhooks import (
    _kernels,
    _torch_compat,
    apply_weight_norm,
    apply_weight_standardization,
    remove_weight_norm,
    remove_weight_standardization,
    weight_norm,
)
from normhooks._kernels import _members, _scope
from normhooks._kernels import weight_norm as wn_kernels
from normhooks._kernels import weight_standardization as ws_kernels

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

GAMMA = 1.3


@dataclass
class Kind:
    """One technique: how a model is converted, and the formula of one weight."""

    convert: Callable[[nn.Module], nn.Module]
    formula: Callable[[nn.Module, dict[str, Tensor], str], Tensor]
    entry: str


def wn_formula(layer: nn.Module, leaves: dict[str, Tensor], prefix: str) -> Tensor:
    wn = layer.parametrizations.weight[0]
    g = leaves[f"{prefix}parametrizations.weight.original0"]
    v = leaves[f"{prefix}parametrizations.weight.original1"]
    return wn_reference(g, v, wn.dim, wn.eps)


def ws_formula(layer: nn.Module, leaves: dict[str, Tensor], prefix: str) -> Tensor:
    ws = layer.parametrizations.weight[0]
    x = leaves[f"{prefix}parametrizations.weight.original"]
    gain = leaves.get(f"{prefix}parametrizations.weight.0.gain")
    if gain is not None:
        gain = gain * (ws.gamma / (x[0].numel() ** 0.5))
    return ws_reference(x.reshape(x.shape[0], -1), gain, ws.eps).reshape(x.shape)


KINDS = [
    pytest.param(Kind(apply_weight_norm, wn_formula, "fuse_weight_norms"), id="wn"),
    pytest.param(Kind(apply_weight_standardization, ws_formula, "fuse_standardizations"), id="ws"),
    pytest.param(
        Kind(
            lambda m: apply_weight_standardization(m, scaled=True, gamma=GAMMA),
            ws_formula,
            "fuse_standardizations",
        ),
        id="scaled-ws",
    ),
]
WN = KINDS[0].values[0]


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.Conv2d(6, 6, 1, bias=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    ).double()


class Twice(nn.Module):
    """Runs one convolution twice, and holds one it never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.unused = nn.Conv2d(2, 2, 1)
        self.head = nn.Conv2d(2, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.conv(torch.relu(self.conv(x))))


def inputs() -> Tensor:
    return torch.randn(2, 2, 5, 5, dtype=torch.float64)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of the kernels' entry points: the fused ones and each layer's own."""
    counts: dict[str, int] = {}
    names = (
        "fuse_weight_norms",
        "fuse_standardizations",
        "planned_weight_norm",
        "planned_standardization",
        "fused_weight_norm",
        "standardize_rows",
    )
    for name in names:
        entry = getattr(_kernels, name)
        counts[name] = 0

        def counting(
            *args: object, _entry: Callable[..., object] = entry, _name: str = name
        ) -> object:
            counts[_name] += 1
            return _entry(*args)

        monkeypatch.setattr(_kernels, name, counting)
    return counts


def zero(calls: dict[str, int]) -> None:
    """Forgets the calls so far: the conversions' own (registration computes each weight)."""
    for name in calls:
        calls[name] = 0


def own_calls(calls: dict[str, int]) -> int:
    """The layers' own kernel calls (not fused)."""
    return sum(n for name, n in calls.items() if not name.startswith("fuse_"))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the fused kernels' launches, forward and backward."""
    counts = {"forward": 0, "backward": 0}
    for module in (wn_kernels, ws_kernels):
        for name, way in (("_FUSED_FORWARD", "forward"), ("_FUSED_BACKWARD", "backward")):
            kernel = getattr(module, name)

            def counting(
                *args: object, _kernel: Callable[..., None] = kernel, _way: str = way
            ) -> None:
                counts[_way] += 1
                _kernel(*args)

            monkeypatch.setattr(module, name, counting)
    return counts


@pytest.fixture(autouse=True)
def routed() -> Iterator[None]:
    with _kernels.route_cpu_tensors():
        yield


def reference(
    plain: nn.Module, converted: nn.Module, kind: Kind, run: Callable[[nn.Module], Tensor]
) -> tuple[Tensor, dict[str, Tensor | None]]:
    """``run`` on ``plain`` (the model before conversion), its weights from float64 leaf
    copies of ``converted``'s originals by the formula; the output and each leaf's gradient
    (by ``converted``'s parameter names) after ``output.square().sum().backward()``."""
    leaves = {
        name: p.detach().clone().double().requires_grad_(p.requires_grad)
        for name, p in converted.named_parameters()
    }
    values = plain_values(converted, kind, leaves)

    def call(x: Tensor) -> Tensor:
        return torch.func.functional_call(plain, values, (x,))

    out = run(Call(call))  # type: ignore[arg-type]
    out.square().sum().backward()
    return out.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def plain_values(converted: nn.Module, kind: Kind, leaves: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors of the model before conversion, by its names: each parametrized weight
    by the formula from ``leaves`` (by ``converted``'s parameter names), the rest as they are."""
    values: dict[str, Tensor] = {}
    for path, layer in converted.named_modules():
        if "parametrizations" in path.split("."):
            continue
        prefix = f"{path}." if path else ""
        if parametrize.is_parametrized(layer, "weight"):
            values[f"{prefix}weight"] = kind.formula(layer, leaves, prefix)
        for name, _ in layer.named_parameters(recurse=False):
            values[f"{prefix}{name}"] = leaves[f"{prefix}{name}"]
    return values


class Call:
    """Stands for a model in ``run(model)``: calling it calls ``fn``."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        self.fn = fn

    def __call__(self, x: Tensor) -> Tensor:
        return self.fn(x)


def train(model: nn.Module, run: Callable[[nn.Module], Tensor]) -> Tensor:
    out = run(model)
    out.square().sum().backward()
    return out.detach()


def trains_like_reference(
    plain: nn.Module, model: nn.Module, kind: Kind, run: Callable[[nn.Module], Tensor]
) -> None:
    """Trains ``model`` one step on ``run`` and checks its output and gradients against
    :func:`reference`'s."""
    expected = reference(plain, model, kind, run)
    assert_matches(model, train(model, run), expected)


def assert_matches(
    model: nn.Module, out: Tensor, expected: tuple[Tensor, dict[str, Tensor | None]]
) -> None:
    want, grads = expected
    torch.testing.assert_close(out, want)
    for name, p in model.named_parameters():
        if grads[name] is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, grads[name], msg=name)


def served(model: nn.Module) -> list[object]:
    """The weights a scope still serves to the model's layers (none outside a forward)."""
    return [
        chain.__dict__["forward"]
        for layer in model.modules()
        if parametrize.is_parametrized(layer)
        for chain in layer.parametrizations.values()
        if "forward" in chain.__dict__
    ]


# --------------------------------------------------------------------------------------------
# The weights and their gradients


@pytest.mark.parametrize("kind", KINDS)
def test_a_train_step_matches_the_formula_in_one_launch_each_way(
    kind: Kind, calls: dict[str, int], launches: dict[str, int]
) -> None:
    plain = cnn()
    model = kind.convert(copy.deepcopy(plain))
    zero(calls)
    x = inputs()
    trains_like_reference(plain, model, kind, lambda m: m(x))
    assert calls[kind.entry] == 1
    assert own_calls(calls) == 0
    assert launches == {"forward": 1, "backward": 1}
    assert served(model) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_run_twice_and_one_never_run(kind: Kind, calls: dict[str, int]) -> None:
    plain = Twice().double()
    model = kind.convert(copy.deepcopy(plain))
    x = inputs()
    trains_like_reference(plain, model, kind, lambda m: m(x))
    assert calls[kind.entry] == 1
    # The unused layer's originals get no gradient, None, exactly as without fusion.
    unused = [p.grad for p in model.unused.parametrizations.weight.parameters()]
    assert unused == [None] * len(unused)


def test_layers_that_require_no_grad_get_weights_that_require_none() -> None:
    model = apply_weight_norm(cnn())
    for p in model[0].parameters():
        p.requires_grad_(False)
    seen = {}

    def record(layer: nn.Module, args: object, output: Tensor) -> None:
        seen[layer] = layer.weight.requires_grad

    for layer in (model[0], model[3]):
        layer.register_forward_hook(record)
    model(inputs())
    assert seen == {model[0]: False, model[3]: True}


def test_a_model_without_trainable_originals_gives_an_output_without_graph() -> None:
    model = apply_weight_norm(cnn()).requires_grad_(False)
    assert not model(inputs()).requires_grad


def test_double_backward_matches_the_formula() -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs()

    def second(m: Callable[[Tensor], Tensor], params: list[Tensor]) -> list[Tensor]:
        grads = torch.autograd.grad(m(x).square().sum(), params, create_graph=True)
        return list(torch.autograd.grad(sum(g.square().sum() for g in grads), params))

    ours = second(model, list(model.parameters()))
    leaves = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    values = plain_values(model, WN, leaves)
    want = second(lambda x: torch.func.functional_call(plain, values, (x,)), list(leaves.values()))
    for got, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(got, expected)


def test_half_precision_matches_the_formula_in_float32() -> None:
    plain = cnn().float()
    model = apply_weight_norm(copy.deepcopy(plain)).half()
    x = inputs().half()
    out = model(x)
    leaves = {name: p.detach().float() for name, p in model.named_parameters()}
    values = plain_values(model, WN, leaves)
    want = torch.func.functional_call(plain, values, (x.float(),))
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-3)


def test_large_models_are_fused_in_groups_of_bounded_size(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every member's incoming gradient waits for its group's backward."""
    monkeypatch.setattr(_members, "MAX_GROUP_NUMEL", 300)
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    zero(calls)
    x = inputs()
    trains_like_reference(plain, model, WN, lambda m: m(x))
    # 76 + 222 values (g and v), then 42 + 21: two groups.
    assert calls["fuse_weight_norms"] == 2
    assert own_calls(calls) == 0


def test_two_dtypes_take_one_launch_each(calls: dict[str, int]) -> None:
    model = apply_weight_norm(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    model[0].double()
    model.register_forward_pre_hook(lambda m, args: (args[0].double(),))
    model[1].register_forward_pre_hook(lambda m, args: (args[0].float(),))
    model(torch.randn(2, 3))
    assert calls["fuse_weight_norms"] == 2


# --------------------------------------------------------------------------------------------
# Grad modes, checkpointing, caching


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "eval"])
def test_forwards_without_grad_match_the_formula(mode: str, calls: dict[str, int]) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs()
    want, _ = reference(plain, model, WN, lambda m: m(x))
    if mode == "eval":
        model.eval()
    context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with context:
        out = model(x)
    assert calls["fuse_weight_norms"] == 1
    torch.testing.assert_close(out, want)


def test_grad_enabled_inside_a_forward_under_no_grad_still_trains() -> None:
    class Inside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3)

        def forward(self, x: Tensor) -> Tensor:
            with torch.enable_grad():
                return self.conv(x)

    plain = Inside().double()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs()
    expected = reference(plain, model, WN, lambda m: m(x))
    with torch.no_grad():
        out = model(x)
    out.square().sum().backward()
    assert_matches(model, out.detach(), expected)


class Checkpointed(nn.Module):
    """A block under activation checkpointing between two layers (``reentrant``: None runs
    it without checkpointing)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.first = nn.Conv2d(2, 3, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU())
        self.last = nn.Conv2d(3, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.first(x)
        if self.reentrant is None:
            y = self.block(y)
        else:
            y = checkpoint(self.block, y, use_reentrant=self.reentrant)
        return self.last(y)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_matches_the_formula(reentrant: bool) -> None:
    # The reference runs the block without checkpointing, whose result is the same (and
    # whose functional_call would not reach the recomputation, after it returned).
    plain = Checkpointed(None).double()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs().requires_grad_()
    expected = reference(plain, model, WN, lambda m: m(x))
    model.reentrant = reentrant
    out = train(model, lambda m: m(x))
    assert_matches(model, out, expected)


def test_a_users_cached_scope_keeps_the_weight_it_computed_first() -> None:
    model = apply_weight_norm(cnn())
    seen = []
    model[3].register_forward_pre_hook(lambda layer, args: seen.append(layer.weight))
    with torch.no_grad(), parametrize.cached():
        before = model[3].weight
        model(inputs())
    assert seen[0] is before


# --------------------------------------------------------------------------------------------
# Where fusion steps aside


def test_compile_takes_each_layers_own_path(calls: dict[str, int]) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs()
    want, _ = reference(plain, model, WN, lambda m: m(x))
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager")(x)
    assert calls["fuse_weight_norms"] == 0
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_takes_each_layers_own_path(strict: bool, calls: dict[str, int]) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs()
    want, _ = reference(plain, model, WN, lambda m: m(x))
    zero(calls)
    exported = torch.export.export(model, (x,), strict=strict)
    assert calls["fuse_weight_norms"] == 0
    torch.testing.assert_close(exported.module()(x), want)


def test_torch_func_transforms_take_each_layers_own_path(calls: dict[str, int]) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs()
    _, grads = reference(plain, model, WN, lambda m: m(x))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(params: dict[str, Tensor]) -> Tensor:
        return torch.func.functional_call(model, params, (x,)).square().sum()

    found = torch.func.grad(loss)(params)
    assert calls["fuse_weight_norms"] == 0
    for name, grad in found.items():
        torch.testing.assert_close(grad, grads[name])


def test_functional_call_without_a_transform_fuses_the_given_originals(
    calls: dict[str, int],
) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    swapped = {name: p.detach() * 1.5 for name, p in model.named_parameters()}
    x = inputs()
    target = apply_weight_norm(copy.deepcopy(plain))
    with torch.no_grad():
        for name, p in target.named_parameters():
            p.copy_(swapped[name])
    want, _ = reference(plain, target, WN, lambda m: m(x))
    out = torch.func.functional_call(model, swapped, (x,))
    assert calls["fuse_weight_norms"] == 1
    torch.testing.assert_close(out, want)


def test_a_dispatch_mode_takes_each_layers_own_path(calls: dict[str, int]) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    model = apply_weight_norm(cnn())
    with Passing():
        model(inputs())
    assert calls["fuse_weight_norms"] == 0


def test_cpu_tensors_outside_the_routing_take_each_layers_own_path(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    x = inputs()
    want, _ = reference(plain, model, WN, lambda m: m(x))
    monkeypatch.setattr(_kernels, "_route_cpu", False)
    out = model(x)
    assert calls["fuse_weight_norms"] == 0
    torch.testing.assert_close(out, want)


def test_a_forward_outside_the_routing_does_not_keep_the_next_ones_from_fusing(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = apply_weight_norm(cnn())
    with monkeypatch.context() as outside:
        outside.setattr(_kernels, "_route_cpu", False)
        model(inputs())
    assert calls["fuse_weight_norms"] == 0
    model(inputs())
    assert calls["fuse_weight_norms"] == 1


class Marked(torch.Tensor):
    """A tensor subclass, as FSDP2's DTensor is one."""


def test_an_original_that_is_a_tensor_subclass_takes_its_own_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = apply_weight_norm(cnn())
    chain = model[3].parametrizations.weight
    g = chain.original0
    chain._parameters["original0"] = nn.Parameter(g.detach().as_subclass(Marked))
    fused: list[int] = []
    entry = _kernels.fuse_weight_norms

    def recording(plans: tuple[object, ...], tensors: list[Tensor]) -> tuple[Tensor, ...]:
        fused.append(len(plans))
        return entry(plans, tensors)

    monkeypatch.setattr(_kernels, "fuse_weight_norms", recording)
    model(inputs())
    assert fused == [3]  # of its 4 members


@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_weights_keep_their_own_path(kind: Kind, calls: dict[str, int]) -> None:
    plain = cnn()
    model = kind.convert(copy.deepcopy(plain))
    model[3].to(memory_format=torch.channels_last)
    zero(calls)
    x = inputs()
    trains_like_reference(plain, model, kind, lambda m: m(x))
    assert calls[kind.entry] == 1
    assert own_calls(calls) == 1


def test_weight_norm_of_the_whole_tensor_keeps_its_own_path(calls: dict[str, int]) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    model[0].parametrizations.weight[0].dim = None
    g = model[0].parametrizations.weight.original0
    model[0].parametrizations.weight.original0 = nn.Parameter(g.detach().norm().reshape(()))
    x = inputs()
    trains_like_reference(plain, model, WN, lambda m: m(x))
    assert calls["fuse_weight_norms"] == 1


def weight_shaped(chain: nn.Module) -> Tensor:
    """The original of a chain that is shaped like its weight: WN's v, WS's raw weight."""
    return chain.original1 if "original1" in chain._parameters else chain.original


def replace_it(chain: nn.Module) -> None:
    name = "original1" if "original1" in chain._parameters else "original"
    setattr(chain, name, nn.Parameter(weight_shaped(chain).detach() * 2))


def restride_it(chain: nn.Module) -> None:
    # A write through .data changes the strides without a new version.
    original = weight_shaped(chain)
    original.data = original.data.to(memory_format=torch.channels_last)


def move_it(chain: nn.Module) -> None:
    # New storage of the same shape, strides and dtype, other values, through .data: nothing
    # a scope's groups are found from changes, only the addresses a launch reads.
    original = weight_shaped(chain)
    original.data = original.data * 2


def freeze_it(chain: nn.Module) -> None:
    for p in chain.parameters():
        p.requires_grad_(False)


def change_its_eps(chain: nn.Module) -> None:
    chain[0].eps = 0.25


# Each change, the fused launches of the next forward (a layer whose originals require no
# grad gets a launch of its own), and how many layers then compute their weight on their own
# (a non-contiguous weight does).
CHANGES = {
    "an original replaced": (replace_it, 1, 0),
    "strides changed through .data": (restride_it, 1, 1),
    "moved to new storage through .data": (move_it, 1, 0),
    "requires_grad switched off": (freeze_it, 2, 0),
    "eps changed": (change_its_eps, 1, 0),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("change", "fused", "own"), CHANGES.values(), ids=CHANGES.keys())
def test_a_change_between_two_forwards_is_seen_by_the_next(
    kind: Kind, change: Callable[[nn.Module], None], fused: int, own: int, calls: dict[str, int]
) -> None:
    plain = cnn()
    model = kind.convert(copy.deepcopy(plain))
    x = inputs()
    model(x)  # a scope finds the groups, which the next ones take while nothing changes
    change(model[3].parametrizations.weight)
    zero(calls)
    trains_like_reference(plain, model, kind, lambda m: m(x))
    assert (calls[kind.entry], own_calls(calls)) == (fused, own)


def regather_storage(p: Tensor) -> None:
    # FSDP1 frees a parameter's storage after the forward and gathers it again for backward.
    kept = p.detach().clone()
    p.untyped_storage().resize_(0)
    torch.full((4096,), 1e3, dtype=p.dtype)  # an allocation that may reuse the freed memory
    p.untyped_storage().resize_(kept.numel() * kept.element_size())
    p.data.copy_(kept)


def regather_data(p: Tensor) -> None:
    # ZeRO-3 swaps a parameter's .data for a placeholder and back for a gathered copy.
    kept = p.detach().clone()
    p.data = torch.empty(0, dtype=p.dtype)
    torch.full((4096,), 1e3, dtype=p.dtype)
    p.data = kept


REGATHERS = {"storage freed and regrown": regather_storage, ".data swapped": regather_data}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("regather", REGATHERS.values(), ids=REGATHERS.keys())
def test_originals_in_new_memory_at_backward_are_read_there(
    kind: Kind, regather: Callable[[Tensor], None], calls: dict[str, int]
) -> None:
    plain = cnn()
    model = kind.convert(copy.deepcopy(plain))
    x = inputs()

    def run(m: nn.Module) -> Tensor:
        out = m(x)
        if isinstance(m, nn.Module):  # not the reference's stand-in
            for p in m.parameters():
                regather(p)
        return out

    trains_like_reference(plain, model, kind, run)
    assert calls[kind.entry] == 1


# --------------------------------------------------------------------------------------------
# Membership: removal, re-parametrization, lazy layers, shared layers


def test_a_removed_layer_leaves_the_others_fused(calls: dict[str, int]) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    remove_weight_norm(model[3], "weight")
    x = inputs()
    trains_like_reference(plain, model, WN, lambda m: m(x))
    assert calls["fuse_weight_norms"] == 1


def test_a_parametrization_removed_by_hand_leaves_the_others_fused(calls: dict[str, int]) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    parametrize.remove_parametrizations(model[0], "weight")
    zero(calls)
    x = inputs()
    trains_like_reference(plain, model, WN, lambda m: m(x))
    assert calls["fuse_weight_norms"] == 1
    assert own_calls(calls) == 0
    assert len(_scope.fusion_of(model).members) == 3  # type: ignore[union-attr]


def test_a_model_whose_layers_are_all_removed_runs_plain(calls: dict[str, int]) -> None:
    model = remove_weight_standardization(apply_weight_standardization(cnn()))
    model(inputs())
    assert calls["fuse_standardizations"] == 0


def test_a_layer_parametrized_again_by_hand_takes_its_own_path_until_fused_again(
    calls: dict[str, int],
) -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    remove_weight_norm(model[4], "weight")
    weight_norm(model[4])
    zero(calls)
    x = inputs()
    trains_like_reference(plain, model, WN, lambda m: m(x))
    assert calls["planned_weight_norm"] == 1
    _scope.fuse(model)
    model(x)
    assert calls["planned_weight_norm"] == 1


def test_lazy_layers_join_from_the_forward_after_their_first(calls: dict[str, int]) -> None:
    model = apply_weight_norm(
        nn.Sequential(nn.LazyConv2d(3, 3), nn.ReLU(), nn.LazyConv2d(2, 1)).double()
    )
    x = inputs()
    model(x)
    first = dict(calls)
    model(x)
    assert calls["planned_weight_norm"] == first["planned_weight_norm"]
    assert (first["fuse_weight_norms"], calls["fuse_weight_norms"]) == (0, 1)


def test_a_layer_shared_by_two_fused_models_is_computed_once(calls: dict[str, int]) -> None:
    inner = apply_weight_norm(nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU()).double())
    outer = apply_weight_norm(nn.Sequential(inner, nn.Conv2d(3, 2, 1).double()))
    zero(calls)
    x = inputs()
    out = outer(x)
    assert calls["fuse_weight_norms"] == 1  # the outer scope serves the inner model too
    assert own_calls(calls) == 0
    w_inner = wn_formula(inner[0], dict(inner[0].named_parameters()), "")
    w_outer = wn_formula(outer[1], dict(outer[1].named_parameters()), "")
    want = F.conv2d(torch.relu(F.conv2d(x, w_inner, inner[0].bias)), w_outer, outer[1].bias)
    torch.testing.assert_close(out, want)


# --------------------------------------------------------------------------------------------
# Copies, checkpoints, exceptions, changes inside a forward


def test_a_deep_copy_is_fused_on_its_own() -> None:
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    x = inputs()
    for m in (model, twin):
        trains_like_reference(plain, m, WN, lambda r: r(x))


def test_a_deep_copy_inside_the_same_forward_gets_its_own_weights() -> None:
    """torch's parametrize.cached() keys its cache by the module that registered a
    parametrization, which a deep copy shares with its original."""

    class StudentTeacher(nn.Module):
        def __init__(self, student: nn.Module) -> None:
            super().__init__()
            self.student = student
            self.teacher = copy.deepcopy(student)

        def forward(self, x: Tensor) -> Tensor:
            return self.student(x) - self.teacher(x)

    model = apply_weight_norm(StudentTeacher(cnn()))
    with torch.no_grad():
        for p in model.teacher.parameters():
            p.mul_(0.5)
    x = inputs()
    plain = StudentTeacher(cnn())
    trains_like_reference(plain, model, WN, lambda m: m(x))


def test_the_scope_pickles_with_its_model() -> None:
    """torch refuses to pickle parametrized modules; once the parametrizations are removed,
    the model pickles with its fused scope's hooks, which hold no lambda."""
    model = remove_weight_norm(apply_weight_norm(cnn()))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    fusion = _scope.fusion_of(loaded)
    assert fusion is not None
    assert fusion.model is loaded
    x = inputs()
    torch.testing.assert_close(loaded(x), model(x))


def test_fusion_adds_nothing_to_the_state_dict() -> None:
    model = apply_weight_standardization(cnn(), scaled=True)
    keys = list(model.state_dict())
    model._forward_pre_hooks.clear()
    model._forward_hooks.clear()
    assert keys == list(model.state_dict())


def test_an_exception_in_a_forward_closes_its_scope(calls: dict[str, int]) -> None:
    model = apply_weight_norm(cnn())
    with pytest.raises(RuntimeError, match="channels"):
        model(torch.randn(2, 3, 5, 5, dtype=torch.float64))
    assert served(model) == []
    assert _scope.fusion_of(model).levels == []  # type: ignore[union-attr]


class Interrupting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.interrupt = False

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        if self.interrupt:
            raise KeyboardInterrupt
        return y


def test_an_interrupted_scope_never_serves_a_stale_weight() -> None:
    """``always_call`` hooks do not run for a KeyboardInterrupt: the scope stays open until
    the model's next forward, and its weight is served only while its originals are
    unchanged."""
    model = apply_weight_norm(Interrupting().double())
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(inputs())
    layer = model.conv
    with torch.no_grad():
        layer.parametrizations.weight.original1.mul_(-1.0)
    leaves = dict(layer.named_parameters())
    torch.testing.assert_close(layer.weight, wn_formula(layer, leaves, ""))
    model.interrupt = False
    model(inputs())
    assert served(model) == []
    assert _scope.fusion_of(model).levels == []  # type: ignore[union-attr]


def test_a_weight_is_not_served_on_another_stream_than_it_was_computed_on(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA each weight remembers its stream; the CPU has none, so one is given here."""
    plain = cnn()
    model = apply_weight_norm(copy.deepcopy(plain))
    monkeypatch.setattr(_torch_compat, "current_raw_stream", lambda index: 2)

    def on_another_stream(layer: nn.Module, args: object) -> None:
        served = layer.parametrizations.weight.__dict__["forward"]
        served.stream = (0, 1)

    model[3].register_forward_pre_hook(on_another_stream)
    zero(calls)
    x = inputs()
    trains_like_reference(plain, model, WN, lambda m: m(x))
    assert (calls["fuse_weight_norms"], calls["planned_weight_norm"]) == (1, 1)


def test_a_weight_changed_in_place_inside_the_forward_is_seen() -> None:
    class Changing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3)

        def forward(self, x: Tensor) -> Tensor:
            with torch.no_grad():
                self.conv.parametrizations.weight.original0.mul_(2.0)
            return self.conv(x)

    model = apply_weight_norm(Changing().double())
    g = model.conv.parametrizations.weight.original0.detach().clone()
    x = inputs()
    out = model(x)
    leaves = dict(model.conv.named_parameters())
    assert torch.equal(leaves["parametrizations.weight.original0"], 2 * g)
    want = F.conv2d(x, wn_formula(model.conv, leaves, ""), model.conv.bias)
    torch.testing.assert_close(out, want)
