"""What the speed path must never change: a weight served or a gradient computed on the
kernels' path is the formula's, whatever happens to the originals around it.

Each scenario runs on the fused path (the tree conversions) and the per-layer path (the
one-layer functions), eager (the CPU's own path) and routed (``_kernels.route_cpu_tensors()``
with Triton's interpreter), and compares with the formulas written out in float64
(tests/kernel_cases.py) applied to float64 leaf copies of the originals as they are.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from kernel_cases import lars_reference, wn_reference, ws_reference
from normhooks import (
    ScaledWeightStandardization,
    WeightNorm,
    _kernels,
    apply_weight_norm,
    apply_weight_standardization,
    lars_,
    remove_weight_norm,
    remove_weight_standardization,
    set_kernels_enabled,
    weight_norm,
    weight_standardization,
)
from normhooks._kernels import _fallback, _scope

GAMMA = 1.3
ROUTED = os.environ.get("TRITON_INTERPRET") == "1" and _kernels._triton_found()


@dataclass(frozen=True)
class Kind:
    """A technique on one path: how a model is converted, and how it is removed (baked)."""

    convert: Callable[[nn.Module], nn.Module]
    remove: Callable[[nn.Module], nn.Module]


def _each_conv(convert: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        for layer in list(model.modules()):
            if isinstance(layer, nn.Conv2d):
                convert(layer)
        return model

    return apply


KINDS = {
    "wn-fused": Kind(apply_weight_norm, remove_weight_norm),
    "wn-layer": Kind(_each_conv(weight_norm), remove_weight_norm),
    "ws-fused": Kind(apply_weight_standardization, remove_weight_standardization),
    "ws-layer": Kind(_each_conv(weight_standardization), remove_weight_standardization),
    "scaled-fused": Kind(
        lambda m: apply_weight_standardization(m, scaled=True, gamma=GAMMA),
        remove_weight_standardization,
    ),
    "scaled-layer": Kind(
        _each_conv(lambda m: weight_standardization(m, scaled=True, gamma=GAMMA)),
        remove_weight_standardization,
    ),
}
KIND_IDS = list(KINDS)


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


def inputs() -> Tensor:
    return torch.randn(2, 2, 5, 5, dtype=torch.float64)


def chain_of(layer: nn.Module) -> nn.Module:
    chain: nn.Module = layer.parametrizations.weight
    return chain


def main_original(layer: nn.Module) -> nn.Parameter:
    """The original whose values a weight mostly follows: v for WN, the raw weight for WS."""
    chain = chain_of(layer)
    name = "original1" if isinstance(chain[0], WeightNorm) else "original"
    original: nn.Parameter = getattr(chain, name)
    return original


def formula(layer: nn.Module, tensors: dict[str, Tensor]) -> Tensor:
    """The layer's weight by the formula, from ``tensors`` (its originals, and Scaled WS's
    gain, under ``original0``/``original1``/``original``/``gain``)."""
    technique = chain_of(layer)[0]
    if isinstance(technique, WeightNorm):
        return wn_reference(tensors["original0"], tensors["original1"], 0, technique.eps)
    x = tensors["original"]
    gain = None
    if isinstance(technique, ScaledWeightStandardization):
        gain = tensors["gain"] * (technique.gamma / x[0].numel() ** 0.5)
    return ws_reference(x.reshape(x.shape[0], -1), gain, technique.eps).reshape(x.shape)


def layer_tensors(layer: nn.Module) -> dict[str, Tensor]:
    chain = chain_of(layer)
    found = {name: t for name, t in chain._parameters.items() if t is not None}
    technique = chain[0]
    gain = technique._parameters.get("gain", technique._buffers.get("gain"))
    if gain is not None:
        found["gain"] = gain
    return found


def parametrized(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (path, layer)
        for path, layer in model.named_modules()
        if parametrize.is_parametrized(layer, "weight")
    ]


def expected(
    model: nn.Module, plain: nn.Module, x: Tensor
) -> tuple[Tensor, dict[int, Tensor | None]]:
    """``plain`` (the model before conversion) on ``x`` with each converted weight by the
    formula from float64 leaf copies of ``model``'s tensors as they are now; the output and,
    after ``output.square().sum().backward()``, each original's gradient (by its id)."""
    values: dict[str, Tensor] = {}
    leaves: dict[int, Tensor] = {}
    for path, layer in parametrized(model):
        copies = {}
        for name, t in layer_tensors(layer).items():
            leaf = t.detach().clone().double().requires_grad_(t.requires_grad)
            copies[name] = leaf
            leaves[id(t)] = leaf
        values[f"{path}.weight" if path else "weight"] = formula(layer, copies)
    for name, t in plain.named_parameters():
        if name not in values:
            values[name] = dict(model.named_parameters()).get(name, t)
    out = torch.func.functional_call(plain, values, (x,))
    out.square().sum().backward()
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}


def assert_trains_like_formula(model: nn.Module, plain: nn.Module, x: Tensor) -> None:
    """One step of ``model`` on ``x`` gives the formula's output and gradients."""
    out = model(x)
    out.square().sum().backward()
    want, grads = expected(model, plain, x)
    torch.testing.assert_close(out.detach(), want)
    for _, layer in parametrized(model):
        for name, t in layer_tensors(layer).items():
            if t.requires_grad:
                assert t.grad is not None, name
                torch.testing.assert_close(t.grad, grads[id(t)], msg=name)


def converted(kind: str, build: Callable[[], nn.Module] = cnn) -> tuple[nn.Module, nn.Module]:
    plain = build()
    return KINDS[kind].convert(copy.deepcopy(plain)), plain


# --- bug 1: a .data assignment inside the forward ------------------------------------------


class MoCo(nn.Module):
    """facebookresearch/moco's key encoder: updated by ``.data`` assignment inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.query = cnn()
        self.key = cnn()
        for p in self.key.parameters():
            p.requires_grad_(False)
        # The reference runs on the weights after the update, without updating again.
        self.update = True

    def forward(self, x: Tensor) -> Tensor:
        m = 0.5
        if not self.update:
            return self.query(x) + self.key(x)
        with torch.no_grad():
            for pq, pk in zip(self.query.parameters(), self.key.parameters(), strict=True):
                pk.data = pk.data * m + pq.data * (1 - m)
        return self.query(x) + self.key(x)


@pytest.mark.parametrize("kind", KIND_IDS)
def test_momentum_encoder_updated_by_data_assignment_runs_on_its_new_weights(
    kind: str, route: str
) -> None:
    model, plain = converted(kind, MoCo)
    plain.update = False
    for _ in range(2):
        model.zero_grad()
        assert_trains_like_formula(model, plain, inputs())


@pytest.mark.parametrize("kind", KIND_IDS)
def test_pre_hook_that_assigns_data_is_seen(kind: str, route: str) -> None:
    model, plain = converted(kind)
    original = main_original(model[2])

    def shrink(module: nn.Module, args: object) -> None:
        original.data = original.data * 0.5

    model[2].register_forward_pre_hook(shrink)
    assert_trains_like_formula(model, plain, inputs())


# --- bug 2: after an interrupted forward -------------------------------------------------------


class Interrupt(nn.Module):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error = error

    def forward(self, x: Tensor) -> Tensor:
        raise self.error("stop")


def interrupted(kind: str, error: type[BaseException]) -> tuple[nn.Module, nn.Module]:
    """A model whose last forward raised ``error`` after its first two layers."""
    model, plain = converted(kind)
    model.append(Interrupt(error))
    plain.append(nn.Identity())
    with pytest.raises(error, match="stop"):
        model(inputs())
    del model[3]
    del plain[3]
    return model, plain


def assert_weights_are_formula(model: nn.Module) -> None:
    for _, layer in parametrized(model):
        tensors = {name: t.detach().double() for name, t in layer_tensors(layer).items()}
        weight = layer.weight
        assert weight.dtype == main_original(layer).dtype
        torch.testing.assert_close(weight.detach().double(), formula(layer, tensors))


ERRORS = [pytest.param(RuntimeError, id="exception"), pytest.param(KeyboardInterrupt, id="ctrl-c")]


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("kind", KIND_IDS)
def test_after_interrupted_forward_a_data_write_is_seen(
    kind: str, error: type[BaseException], route: str
) -> None:
    model, _ = interrupted(kind, error)
    for _, layer in parametrized(model):
        with torch.no_grad():
            main_original(layer).data.mul_(3.0).add_(0.25)
    assert_weights_are_formula(model)


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("kind", KIND_IDS)
def test_after_interrupted_forward_a_dtype_change_is_seen(
    kind: str, error: type[BaseException], route: str
) -> None:
    model, _ = interrupted(kind, error)
    model.float()
    assert_weights_are_formula(model)
    model.double()
    assert_weights_are_formula(model)


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("kind", KIND_IDS)
def test_after_interrupted_forward_a_layer_called_alone_uses_its_weight_now(
    kind: str, error: type[BaseException], route: str
) -> None:
    model, _ = interrupted(kind, error)
    with torch.no_grad():
        main_original(model[0]).data.mul_(-2.0)
    layer = model[0]
    tensors = {name: t.detach() for name, t in layer_tensors(layer).items()}
    x = inputs()
    want = torch.nn.functional.conv2d(x, formula(layer, tensors), layer.bias)
    torch.testing.assert_close(layer(x), want)


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("kind", KIND_IDS)
def test_after_interrupted_forward_baking_uses_the_weights_now(
    kind: str, error: type[BaseException], route: str
) -> None:
    model, _ = interrupted(kind, error)
    wanted = []
    for _, layer in parametrized(model):
        with torch.no_grad():
            main_original(layer).data.mul_(0.5).sub_(0.1)
        tensors = {name: t.detach().clone() for name, t in layer_tensors(layer).items()}
        wanted.append((layer, formula(layer, tensors)))
    KINDS[kind].remove(model)
    for layer, want in wanted:
        torch.testing.assert_close(layer.weight.detach(), want)


# --- bug 3: an in-place edit of an original inside the forward ---------------------------------


@pytest.mark.parametrize("kind", KIND_IDS)
def test_max_norm_constraint_in_a_pre_hook_trains(kind: str, route: str) -> None:
    model, plain = converted(kind)
    original = main_original(model[2])

    def max_norm(module: nn.Module, args: object) -> None:
        with torch.no_grad():
            original.renorm_(2, 0, 0.1)

    model[2].register_forward_pre_hook(max_norm)
    assert_trains_like_formula(model, plain, inputs())


# --- bug 4: an original changes layout between forward and backward -----------------------------


def channels_last(t: Tensor) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def transposed_copy(t: Tensor) -> Tensor:
    return t.transpose(0, 1).contiguous().transpose(0, 1)


LAYOUTS = [pytest.param(channels_last, id="channels-last"), pytest.param(transposed_copy, id="t")]


@pytest.mark.parametrize("relayout", LAYOUTS)
@pytest.mark.parametrize("kind", KIND_IDS)
def test_layout_change_between_forward_and_backward_gives_the_formulas_gradients(
    kind: str, relayout: Callable[[Tensor], Tensor], route: str
) -> None:
    model, plain = converted(kind)
    x = inputs()
    out = model(x)
    for _, layer in parametrized(model):
        for t in layer_tensors(layer).values():
            if t.ndim == 4:
                t.data = relayout(t.data)
    out.square().sum().backward()
    want, grads = expected(model, plain, x)
    torch.testing.assert_close(out.detach(), want)
    for _, layer in parametrized(model):
        for name, t in layer_tensors(layer).items():
            torch.testing.assert_close(t.grad, grads[id(t)], msg=name)


# --- bug 5: Scaled WS's gain kept as a buffer ----------------------------------------------------


@pytest.mark.parametrize("kind", ["scaled-fused", "scaled-layer"])
def test_scaled_ws_gain_kept_as_a_buffer_is_applied(kind: str, route: str) -> None:
    model, plain = converted(kind)
    for _, layer in parametrized(model):
        technique = chain_of(layer)[0]
        gain = technique._parameters.pop("gain")
        technique.register_buffer("gain", gain.detach() * 1.7 + 0.2)
    assert_trains_like_formula(model, plain, inputs())


# --- bug 6: an embedding with max_norm ----------------------------------------------------------


EMBEDDING_KINDS = {
    "wn": lambda m: apply_weight_norm(m, layer_types=nn.Embedding),
    "ws": lambda m: apply_weight_standardization(m, layer_types=nn.Embedding),
}


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bounded = nn.Embedding(10, 4, max_norm=1.0)
        self.free = nn.Embedding(10, 4)

    def forward(self, indices: Tensor) -> Tensor:
        return self.free(indices) + self.bounded(indices)


@pytest.mark.parametrize("kind", list(EMBEDDING_KINDS))
def test_embedding_with_max_norm_trains_on_the_fused_path(kind: str, route: str) -> None:
    plain = Embeddings().double()
    model = EMBEDDING_KINDS[kind](copy.deepcopy(plain))
    indices = torch.tensor([1, 3, 3, 7])
    out = model(indices)
    out.square().sum().backward()
    leaves = {
        name: {n: t.detach().clone().requires_grad_() for n, t in layer_tensors(layer).items()}
        for name, layer in parametrized(model)
    }
    weights = {name: formula(dict(parametrized(model))[name], t) for name, t in leaves.items()}
    free = nn.functional.embedding(indices, weights["free"])
    bounded = nn.functional.embedding(indices, weights["bounded"], max_norm=1.0)
    want = free + bounded
    torch.testing.assert_close(out.detach(), want.detach())
    want.square().sum().backward()
    for name, layer in parametrized(model):
        for n, t in layer_tensors(layer).items():
            torch.testing.assert_close(t.grad, leaves[name][n].grad, msg=f"{name}.{n}")


# --- a kernel that fails on the user's machine -------------------------------------------------


@pytest.fixture
def fresh_fallback() -> Iterator[None]:
    """The kernels allowed, and no failure recorded, before and after the test."""
    _fallback.reset()
    yield
    _fallback.reset()


def failing(*args: object, **kwargs: object) -> None:
    raise RuntimeError("no kernel image is available for execution on the device")


SWITCH = r"NORMHOOKS_KERNELS=0 or call normhooks.set_kernels_enabled\(False\)"


def one_warning(record: list[warnings.WarningMessage]) -> None:
    found = [w for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    assert re.search(SWITCH, str(found[0].message))


@pytest.mark.skipif(not ROUTED, reason="runs the kernels through Triton's interpreter")
@pytest.mark.usefixtures("fresh_fallback")
@pytest.mark.parametrize(
    ("kind", "entry"),
    [
        pytest.param("wn-layer", "planned_weight_norm", id="wn-layer"),
        pytest.param("ws-layer", "planned_standardization", id="ws-layer"),
        pytest.param("scaled-layer", "planned_standardization", id="scaled-layer"),
        pytest.param("wn-fused", "fuse_weight_norms", id="wn-fused"),
        pytest.param("ws-fused", "fuse_standardizations", id="ws-fused"),
        pytest.param("scaled-fused", "fuse_standardizations", id="scaled-fused"),
    ],
)
def test_a_kernel_that_fails_to_launch_falls_back_to_the_formula_with_one_warning(
    kind: str, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _kernels.route_cpu_tensors():
        model, plain = converted(kind)
        monkeypatch.setattr(_kernels, entry, failing)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(2):
                model.zero_grad()
                assert_trains_like_formula(model, plain, inputs())
        one_warning(record)
        assert not _kernels.may_launch()


@pytest.mark.skipif(not ROUTED, reason="runs the kernels through Triton's interpreter")
@pytest.mark.usefixtures("fresh_fallback")
@pytest.mark.parametrize(
    ("kind", "module"),
    [
        pytest.param("wn-layer", "weight_norm", id="wn-layer"),
        pytest.param("ws-layer", "weight_standardization", id="ws-layer"),
        pytest.param("wn-fused", "weight_norm", id="wn-fused"),
        pytest.param("scaled-fused", "weight_standardization", id="scaled-fused"),
    ],
)
def test_a_backward_kernel_that_fails_falls_back_to_the_formula(
    kind: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = importlib.import_module(f"normhooks._kernels.{module}")
    with _kernels.route_cpu_tensors():
        model, plain = converted(kind)
        monkeypatch.setattr(kernels, "_BACKWARD", failing)
        monkeypatch.setattr(kernels, "_FUSED_BACKWARD", failing)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert_trains_like_formula(model, plain, inputs())
        one_warning(record)


@pytest.mark.skipif(not ROUTED, reason="runs the kernels through Triton's interpreter")
@pytest.mark.usefixtures("fresh_fallback")
def test_a_lars_kernel_that_fails_falls_back_to_the_formula_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from normhooks._kernels import lars as lars_kernels

    monkeypatch.setattr(lars_kernels, "_SQUARES_AND_RATES", failing)
    params = [torch.randn(3, 4, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    for p in params:
        p.grad = torch.randn_like(p)
    want_rates, want = lars_reference(params, [p.grad for p in params], weight_decay=1e-2)
    with _kernels.route_cpu_tensors(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rates = lars_(params, weight_decay=1e-2)
    one_warning(record)
    torch.testing.assert_close(rates.double(), want_rates)
    for p, expected_grad in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, expected_grad)


@pytest.mark.skipif(not ROUTED, reason="runs the kernels through Triton's interpreter")
@pytest.mark.usefixtures("fresh_fallback")
def test_turning_the_kernels_on_again_after_a_failure_allows_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _kernels.route_cpu_tensors():
        model, _ = converted("wn-layer")
        with monkeypatch.context() as patch:
            patch.setattr(_kernels, "planned_weight_norm", failing)
            with pytest.warns(RuntimeWarning, match=SWITCH):
                model(inputs())
        assert not _kernels.may_launch()
        set_kernels_enabled(True)
        assert _kernels.may_launch()


# --- fuse=False ---------------------------------------------------------------------------------


@pytest.mark.skipif(not ROUTED, reason="runs the kernels through Triton's interpreter")
@pytest.mark.parametrize(
    "apply",
    [
        pytest.param(apply_weight_norm, id="wn"),
        pytest.param(apply_weight_standardization, id="ws"),
    ],
)
def test_fuse_false_restores_the_per_layer_path(
    apply: Callable[..., nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = apply(cnn(), fuse=False)
    assert _scope.fusion_of(model) is None
    with monkeypatch.context() as patch:
        for entry in ("fuse_weight_norms", "fuse_standardizations"):
            patch.setattr(_kernels, entry, failing)
        with _kernels.route_cpu_tensors(), warnings.catch_warnings():
            warnings.simplefilter("error")
            model(inputs()).sum().backward()


@pytest.mark.parametrize(
    "apply",
    [
        pytest.param(apply_weight_norm, id="wn"),
        pytest.param(apply_weight_standardization, id="ws"),
    ],
)
def test_fuse_must_be_a_bool(apply: Callable[..., nn.Module]) -> None:
    model = cnn()
    with pytest.raises(TypeError, match="fuse"):
        apply(model, fuse="no")
    assert not parametrize.is_parametrized(model[0])


def test_fuse_false_takes_an_earlier_fusion_off_the_model() -> None:
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(36, 2)).double()
    apply_weight_norm(model, layer_types=nn.Conv2d)
    assert _scope.fusion_of(model) is not None
    apply_weight_norm(model, layer_types=nn.Linear, fuse=False)
    assert _scope.fusion_of(model) is None
    assert not model._forward_hooks
