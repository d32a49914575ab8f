"""A hostile review of the speed path: a model on normhooks' kernel path (fused or per
layer, eager and routed through ``_kernels.route_cpu_tensors()`` with Triton's interpreter)
trains exactly as the same model with the kernels off (``set_kernels_enabled(False)``: the
plain torch formula), in scenarios beyond issue 23's eight.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from kernel_cases import wn_reference
from normhooks import (
    WeightNorm,
    WeightStandardization,
    _kernels,
    apply_weight_norm,
    apply_weight_standardization,
    set_kernels_enabled,
)
from normhooks._kernels import _door, _scope, _served
from normhooks._kernels._cache import KeyedCache

ROUTED = os.environ.get("TRITON_INTERPRET") == "1" and _kernels._triton_found()


@pytest.fixture(params=["eager", "routed"])
def route(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "eager":
        yield "eager"
        return
    if not ROUTED:
        pytest.skip("runs the kernels on CPU tensors through Triton's interpreter")
    with _kernels.route_cpu_tensors():
        yield "routed"


def cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 3, 1)).double()


def train(model: nn.Module, steps: int = 2) -> list[Tensor]:
    """``steps`` SGD steps on fixed inputs; the outputs."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(torch.randn(2, 2, 5, 5, dtype=torch.float64, generator=generator))
        out.square().sum().backward()
        optimizer.step()
        outputs.append(out.detach())
    return outputs


def assert_trains_as_without_kernels(
    build: Callable[[], nn.Module], run: Callable[[nn.Module], list[Tensor]] = train
) -> None:
    """``run`` of ``build()`` gives the outputs, gradients and Parameters that it gives with
    the kernels off (the same model, built from the same seed)."""
    torch.manual_seed(0)
    model = build()
    got = run(model)
    torch.manual_seed(0)
    plain = build()
    with set_kernels_enabled(False):
        want = run(plain)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, msg=f"output of step {step}")
    theirs = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, theirs[name], msg=name)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, theirs[name].grad, msg=f"{name}.grad")


# --- a subclass of a technique that overrides its forward -------------------------------------


class DoubledWeightNorm(WeightNorm):
    def forward(self, g: Tensor, v: Tensor) -> Tensor:
        return super().forward(g, v) * 2.0


class ShiftedStandardization(WeightStandardization):
    def forward(self, weight: Tensor) -> Tensor:
        return super().forward(weight) + 0.25


@pytest.mark.parametrize(
    "parametrization",
    [DoubledWeightNorm, ShiftedStandardization],
    ids=["wn-subclass", "ws-subclass"],
)
def test_a_subclass_overriding_forward_is_not_fused_as_its_base(
    parametrization: type[nn.Module], route: str
) -> None:
    def build() -> nn.Module:
        model = cnn()
        for layer in (model[0], model[2]):
            parametrize.register_parametrization(layer, "weight", parametrization(), unsafe=True)
        return _scope.fuse(model)

    assert_trains_as_without_kernels(build)


def test_a_subclass_overriding_forward_gets_its_own_formula(route: str) -> None:
    model = _scope.fuse(cnn())
    parametrize.register_parametrization(model[2], "weight", DoubledWeightNorm(), unsafe=True)
    _scope.fuse(model)
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    chain = model[2].parametrizations.weight
    expected = 2.0 * wn_reference(chain.original0.detach(), chain.original1.detach(), 0, 1e-12)
    seen = []
    model[2].register_forward_hook(lambda m, a, o: seen.append(m.weight.detach()))
    model(x)
    torch.testing.assert_close(seen[0], expected)


# --- a layer's code that writes into the weight it got ----------------------------------------

CONVERT = {
    "wn-fused": apply_weight_norm,
    "ws-fused": apply_weight_standardization,
    "scaled-fused": lambda m: apply_weight_standardization(m, scaled=True, gamma=1.3),
}


def with_pre_hook(
    convert: Callable[[nn.Module], nn.Module], hook: Callable[..., None]
) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = convert(cnn())
        model[2].register_forward_pre_hook(hook)
        return model

    return build


def assign_weight_data(module: nn.Module, args: object) -> None:
    # An old max-norm constraint written for unparametrized layers (braindecode's
    # Conv2dWithConstraint renormalizes self.weight.data in its forward): on a parametrized
    # layer it writes into a temporary, which the next access computes afresh.
    module.weight.data = module.weight.data * 0.5


def write_weight_data(module: nn.Module, args: object) -> None:
    module.weight.data.mul_(0.5)


def write_weight_in_place(module: nn.Module, args: object) -> None:
    with torch.no_grad():
        module.weight.mul_(0.5)


@pytest.mark.parametrize("kind", list(CONVERT))
def test_assigning_the_computed_weights_data_in_a_pre_hook_is_discarded_as_without_fusion(
    kind: str, route: str
) -> None:
    assert_trains_as_without_kernels(with_pre_hook(CONVERT[kind], assign_weight_data))


ROUTED_XFAIL = [
    "eager",
    pytest.param(
        "routed",
        marks=pytest.mark.xfail(
            strict=True,
            reason="the fused scope serves one tensor per forward: a write into its values "
            "through .data reaches the layer's later accesses, unlike a fresh weight",
        ),
    ),
]


@pytest.fixture
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "eager":
        yield "eager"
        return
    if not ROUTED:
        pytest.skip("runs the kernels on CPU tensors through Triton's interpreter")
    with _kernels.route_cpu_tensors():
        yield "routed"


@pytest.mark.parametrize("path", ROUTED_XFAIL, indirect=True)
@pytest.mark.parametrize("kind", list(CONVERT))
def test_writing_into_the_computed_weights_data_in_a_pre_hook_is_discarded(
    kind: str, path: str
) -> None:
    assert_trains_as_without_kernels(with_pre_hook(CONVERT[kind], write_weight_data))


ROUTED_CRASH = [
    "eager",
    pytest.param(
        "routed",
        marks=pytest.mark.xfail(
            strict=True,
            raises=RuntimeError,
            reason="a served weight is a view of one multi-output autograd node's output: "
            "autograd refuses an in-place op on it at backward",
        ),
    ),
]


@pytest.mark.parametrize("path", ROUTED_CRASH, indirect=True)
@pytest.mark.parametrize("kind", list(CONVERT))
def test_an_in_place_op_on_the_computed_weight_under_no_grad_trains(kind: str, path: str) -> None:
    assert_trains_as_without_kernels(with_pre_hook(CONVERT[kind], write_weight_in_place))


# --- a setting changed inside the forward -------------------------------------------------------

SETTINGS = [
    pytest.param("wn-fused", "eps", 1e6, id="wn-eps"),
    pytest.param("ws-fused", "eps", 1e6, id="ws-eps"),
    pytest.param("scaled-fused", "eps", 1e6, id="scaled-eps"),
    pytest.param("scaled-fused", "gamma", 2.0, id="scaled-gamma"),
]


@pytest.mark.parametrize(("kind", "setting", "factor"), SETTINGS)
def test_a_setting_changed_in_a_pre_hook_is_used_by_that_forward(
    kind: str, setting: str, factor: float, route: str
) -> None:
    # A schedule that anneals eps (or gamma) at each forward, from a layer's pre-hook.
    def anneal(module: nn.Module, args: object) -> None:
        technique = module.parametrizations.weight[0]
        setattr(technique, setting, getattr(technique, setting) * factor)

    assert_trains_as_without_kernels(with_pre_hook(CONVERT[kind], anneal))


# --- a gain of weight normalization that is not contiguous --------------------------------------


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "per-layer"])
def test_weight_norm_with_a_non_contiguous_g_trains(fuse: bool, route: str) -> None:
    def build() -> nn.Module:
        model = apply_weight_norm(cnn(), fuse=fuse)
        g = model[2].parametrizations.weight.original0
        storage = torch.linspace(0.5, 1.5, 2 * g.numel(), dtype=torch.float64)
        g.data = storage.as_strided(g.shape, (2,) + (1,) * (g.ndim - 1))
        assert not g.is_contiguous()
        return model

    assert_trains_as_without_kernels(build)


# --- turning the kernels on again after a fallback ----------------------------------------------


def test_a_layout_whose_fused_plan_failed_is_fused_again_once_the_kernels_are_on_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not ROUTED:
        pytest.skip("runs the kernels on CPU tensors through Triton's interpreter")
    # Layouts met by other tests keep what they found: this one meets its layout first.
    monkeypatch.setattr(_door, "_ROUTES", KeyedCache())
    model = apply_weight_norm(cnn())
    served: list[bool] = []
    model[0].register_forward_hook(
        lambda m, a, o: served.append(
            isinstance(m.parametrizations.weight.__dict__.get("forward"), _served.Served)
        )
    )
    fusable = _kernels.weight_norm_fusable

    def fails_once(plan: object) -> bool:
        monkeypatch.setattr(_kernels, "weight_norm_fusable", fusable)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(_kernels, "weight_norm_fusable", fails_once)
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    try:
        with _kernels.route_cpu_tensors(), pytest.warns(RuntimeWarning, match="no kernel here"):
            model(x)
        set_kernels_enabled(True)
        with _kernels.route_cpu_tensors():
            model(x)
    finally:
        set_kernels_enabled(True)
    assert served == [False, True]


# --- what the fused scope must not skip (review of 2026-12-02) ----------------------------------


class Doubled(nn.Module):
    def forward(self, weight: Tensor) -> Tensor:
        return 2.0 * weight


def test_a_parametrization_added_inside_the_forward_is_applied(route: str) -> None:
    """A pre-hook registering a second parametrization on the weight: the layer's access gets
    the whole chain, not the first parametrization's fused weight."""

    def add_second(module: nn.Module, args: object) -> None:
        if len(module.parametrizations.weight) == 1:
            parametrize.register_parametrization(module, "weight", Doubled())

    def build() -> nn.Module:
        model = apply_weight_norm(cnn())
        model[2].register_forward_pre_hook(add_second)
        return model

    assert_trains_as_without_kernels(build)


def test_hooks_on_the_parametrization_run_on_the_fused_path(route: str) -> None:
    def double(module: nn.Module, args: object, output: Tensor) -> Tensor:
        return 2.0 * output

    def build() -> nn.Module:
        model = apply_weight_standardization(cnn())
        model[0].parametrizations.weight[0].register_forward_hook(double)
        return model

    assert_trains_as_without_kernels(build)


def test_global_forward_hooks_run_on_the_fused_path(route: str) -> None:
    def shift(module: nn.Module, args: object, output: object) -> object:
        if isinstance(module, (WeightNorm, WeightStandardization)):
            return output + 0.5  # type: ignore[operator]
        return None

    handle = nn.modules.module.register_module_forward_hook(shift)
    try:
        assert_trains_as_without_kernels(lambda: apply_weight_norm(cnn()))
    finally:
        handle.remove()


def test_a_scaled_gain_set_as_a_plain_attribute_is_used(route: str) -> None:
    """``del ws.gain; ws.gain = t``: the gain is neither a Parameter nor a buffer, which a
    fused launch cannot watch; the layer computes its own weight with it."""

    def build() -> nn.Module:
        model = apply_weight_standardization(cnn(), scaled=True, gamma=1.3)
        technique = model[0].parametrizations.weight[0]
        gain = technique.gain.detach() * 3.0
        del technique.gain
        technique.gain = gain
        return model

    assert_trains_as_without_kernels(build)
