"""The contract every normhooks parametrization keeps, run over each of them.

Like optax's shared optimizer tests: one suite, every technique. Each kind converts a model,
bakes it back, names its parametrization class and declares whether it keeps state; the
tests below hold for all of them. Spectral normalization, whose power iteration keeps its
vectors in buffers, is the kind with state.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from helpers import assert_compiled_training_matches_eager, small_cnn
from normhooks import (
    ScaledWeightStandardization,
    SpectralNorm,
    WeightNorm,
    WeightStandardization,
    _kernels,
    apply_spectral_norm,
    apply_weight_norm,
    apply_weight_standardization,
    remove_spectral_norm,
    remove_weight_norm,
    remove_weight_standardization,
)


@dataclass(frozen=True)
class Kind:
    apply: Callable[..., nn.Module]  # (model, *, layer_types=None) -> model
    bake: Callable[[nn.Module], nn.Module]
    parametrization: type[nn.Module]
    # A training forward advances state that the parametrization keeps in buffers (a power
    # iteration's u), so two training forwards compute different weights: outputs are
    # compared in eval mode, and so are torch.func's, under which a training forward leaves
    # the state as it is.
    stateful: bool = False


KINDS = {
    "ws": Kind(apply_weight_standardization, remove_weight_standardization, WeightStandardization),
    "scaled-ws": Kind(
        functools.partial(apply_weight_standardization, scaled=True, gamma=1.5),
        remove_weight_standardization,
        ScaledWeightStandardization,
    ),
    "wn": Kind(apply_weight_norm, remove_weight_norm, WeightNorm),
    "spectral": Kind(apply_spectral_norm, remove_spectral_norm, SpectralNorm, stateful=True),
    "sigma-reparam": Kind(
        functools.partial(apply_spectral_norm, scale=True),
        remove_spectral_norm,
        SpectralNorm,
        stateful=True,
    ),
}
STATEFUL = [name for name, kind in KINDS.items() if kind.stateful]


@pytest.fixture(params=list(KINDS), ids=list(KINDS))
def kind(request: pytest.FixtureRequest) -> Kind:
    return KINDS[request.param]


def converted(kind: Kind, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = small_cnn().to(dtype)
    model(torch.randn(1, 3, 8, 8, dtype=dtype))  # materializes the lazy head
    return kind.apply(model)


def parametrized_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if parametrize.is_parametrized(m, "weight")]


def x_for(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, dtype=dtype)


def comparable(kind: Kind, model: nn.Module) -> nn.Module:
    """``model`` in the mode in which its forwards compute the same weights from the same
    Parameters: eval for a kind with state, whose training forwards advance it."""
    return model.eval() if kind.stateful else model


def dry_run(kind: Kind, model: nn.Module, x: torch.Tensor) -> None:
    """One forward that materializes and converts lazy layers, and leaves any state as it is."""
    training = model.training
    comparable(kind, model)(x)
    model.train(training)


@contextmanager
def counting(kind: Kind) -> Iterator[list[int]]:
    """Counts forwards of ``kind``'s parametrization class: weights actually computed."""
    calls = [0]
    original = kind.parametrization.forward

    def counted(self: nn.Module, *tensors: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        result: torch.Tensor = original(self, *tensors)
        return result

    kind.parametrization.forward = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        kind.parametrization.forward = original  # type: ignore[method-assign]


# --- state dicts, copies, baking ------------------------------------------------------------


def test_state_dict_round_trip_through_torch_save(kind: Kind) -> None:
    model = converted(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = converted(kind)
    fresh.load_state_dict(torch.load(buffer))
    x = x_for()
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_deepcopy_is_independent(kind: Kind) -> None:
    model = comparable(kind, converted(kind))
    clone = copy.deepcopy(model)
    x = x_for()
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    before = model(x).detach()
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(-1.5)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    assert not torch.allclose(clone(x), before)


@pytest.mark.parametrize("baked", ["copy", "original"])
def test_baking_one_of_two_deep_copies_leaves_the_other_converted(kind: Kind, baked: str) -> None:
    """torch's removal deletes a property of the class, which deep copies share."""
    model = comparable(kind, converted(kind))
    clone = copy.deepcopy(model)
    x = x_for()
    expected = model(x).detach()
    kind.bake(clone if baked == "copy" else model)
    kept = model if baked == "copy" else clone
    assert len(parametrized_layers(kept)) == len(parametrized_layers(converted(kind)))
    torch.testing.assert_close(kept(x), expected, rtol=0, atol=0)
    torch.testing.assert_close((clone if baked == "copy" else model)(x), expected)


def test_baked_model_loads_into_the_plain_model(kind: Kind) -> None:
    model = comparable(kind, converted(kind))
    x = x_for()
    expected = model(x).detach()
    kind.bake(model)
    assert not parametrized_layers(model)
    plain = comparable(kind, small_cnn())
    plain(torch.randn(1, 3, 8, 8))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(plain(x), expected, rtol=1e-5, atol=1e-6)
    for param in model.parameters():
        assert param.is_contiguous()


def test_baking_keeps_the_output_and_a_parameter_the_optimizer_holds(kind: Kind) -> None:
    """The baked weight is one of the converted layer's Parameters (WS's raw weight, WN's v),
    overwritten in place: an optimizer built after the conversion trains it on."""
    model = comparable(kind, converted(kind))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 0.1 * torch.rand_like(p))
    x = x_for()
    with torch.no_grad():
        expected = model(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held = {id(p) for p in optimizer.param_groups[0]["params"]}
    kind.bake(model)
    assert not parametrized_layers(model)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert all(id(layer.weight) in held for layer in layers)
    torch.testing.assert_close(model(x), expected)
    before = [layer.weight.detach().clone() for layer in layers]
    model(x).square().mean().backward()
    optimizer.step()
    assert all(
        not torch.equal(layer.weight, old) for layer, old in zip(layers, before, strict=True)
    )


def test_the_weight_follows_load_state_dict(kind: Kind) -> None:
    model = comparable(kind, converted(kind))
    other = comparable(kind, converted(kind))
    x = x_for()
    with torch.no_grad():
        model(x)
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(model(x), other(x), rtol=0, atol=0)


def test_a_layer_called_twice_is_not_a_tie(kind: Kind) -> None:
    """One module object under two paths is converted once, and runs."""
    shared = nn.Linear(3, 3)
    model = comparable(
        kind, kind.apply(nn.Sequential(shared, nn.Tanh(), shared), layer_types=nn.Linear)
    )
    assert parametrized_layers(model) == [shared]
    model(torch.randn(2, 3)).sum().backward()


def test_compiled_training_step_matches_eager(kind: Kind) -> None:
    assert_compiled_training_matches_eager(
        converted(kind), x_for(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    )


def test_lazy_model_is_converted_at_its_first_forward(kind: Kind) -> None:
    x = torch.randn(1, 3, 8, 8)
    torch.manual_seed(1)
    lazy = kind.apply(small_cnn())
    first = lazy(x)  # materializes the head, then converts it
    torch.manual_seed(1)
    eager = small_cnn()
    eager(x)
    torch.testing.assert_close(first, kind.apply(eager)(x), rtol=0, atol=0)
    assert len(parametrized_layers(lazy)) == len(parametrized_layers(eager))


def lazy_cnn() -> nn.Sequential:
    """Every lazy layer kind the reparametrizations convert by default."""
    return nn.Sequential(
        nn.LazyConv2d(4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.LazyConvTranspose2d(4, 2, stride=2),
        nn.Flatten(),
        nn.LazyLinear(2),
    )


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


@pytest.mark.parametrize("make_optimizer", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
def test_an_optimizer_built_before_the_first_forward_trains_like_one_built_after_it(
    kind: Kind, make_optimizer: Callable[..., torch.optim.Optimizer]
) -> None:
    """torch materializes lazy parameters in place, so their optimizer may come first; the
    Parameters a conversion adds (WN's g, Scaled WS's gain) are created at conversion too."""
    x = torch.randn(2, 3, 6, 6)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for _ in range(3):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()

    early = kind.apply(lazy_cnn())
    early_optimizer = make_optimizer(early.parameters())
    torch.manual_seed(1)
    train(early, early_optimizer)
    late = kind.apply(lazy_cnn())
    torch.manual_seed(1)
    dry_run(kind, late, x)  # the optimizer sees the converted layers
    train(late, make_optimizer(late.parameters()))
    trained, expected = dict(early.named_parameters()), dict(late.named_parameters())
    assert list(trained) == list(expected)
    for name, param in expected.items():
        torch.testing.assert_close(trained[name], param, rtol=0, atol=0)


def test_a_pending_lazy_model_saves_and_loads_like_the_lazy_model(kind: Kind) -> None:
    pending = kind.apply(lazy_cnn())
    assert list(pending.state_dict()) == list(lazy_cnn().state_dict())
    plain = lazy_cnn()
    x = torch.randn(2, 3, 6, 6)
    plain(x)
    expected = kind.apply(copy.deepcopy(plain))
    pending.load_state_dict(plain.state_dict())  # materializes the weights
    torch.testing.assert_close(pending(x), expected(x))  # converts them
    assert list(pending.state_dict()) == list(expected.state_dict())


def trained_checkpoint(kind: Kind, x: torch.Tensor) -> tuple[nn.Module, io.BytesIO]:
    """A converted lazy model trained two steps (so that WN's g is no longer ``||v||`` and
    Scaled WS's gain no longer 1), and its state dict saved with ``torch.save``."""
    saved = kind.apply(lazy_cnn())
    optimizer = torch.optim.SGD(saved.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        saved(x).square().mean().backward()
        optimizer.step()
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    return saved, buffer


@pytest.mark.parametrize("routed", [False, True], ids=["eager", "routed"])
def test_a_pending_lazy_model_resumes_from_a_checkpoint_of_the_converted_model(
    kind: Kind, routed: bool
) -> None:
    """Rebuilt, converted and loaded before its first forward, as torch's lazy modules load;
    on the plain path and on the kernels' (CPU tensors routed to them)."""
    x = torch.randn(2, 3, 6, 6)
    saved, checkpoint = trained_checkpoint(kind, x)
    resumed = kind.apply(lazy_cnn())
    resumed.load_state_dict(torch.load(checkpoint))
    with _kernels.route_cpu_tensors() if routed else contextlib.nullcontext():
        torch.testing.assert_close(
            comparable(kind, resumed)(x), comparable(kind, saved)(x), rtol=0, atol=0
        )
    expected, found = saved.state_dict(), resumed.state_dict()
    assert list(found) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, rtol=0, atol=0)


def test_an_optimizer_built_before_resuming_a_pending_model_holds_its_parameters(
    kind: Kind,
) -> None:
    x = torch.randn(2, 3, 6, 6)
    _, checkpoint = trained_checkpoint(kind, x)
    resumed = kind.apply(lazy_cnn())
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed.load_state_dict(torch.load(checkpoint))
    resumed(x).square().mean().backward()
    optimizer.step()
    held = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert all(id(p) in held for p in resumed.parameters())


@pytest.mark.parametrize(
    ("saved_as", "pending_as"),
    [("wn", "ws"), ("scaled-ws", "wn")],
    ids=["wn-into-ws", "ws-into-wn"],
)
def test_a_checkpoint_of_another_technique_is_refused_at_loading(
    saved_as: str, pending_as: str
) -> None:
    x = torch.randn(2, 3, 6, 6)
    _, checkpoint = trained_checkpoint(KINDS[saved_as], x)
    pending = KINDS[pending_as].apply(lazy_cnn())
    with pytest.raises(ValueError, match="was saved from a model converted otherwise"):
        pending.load_state_dict(torch.load(checkpoint))


def test_a_checkpoint_with_other_settings_is_refused_at_the_first_forward() -> None:
    """Scaled WS's checkpoint holds a gain that plain WS does not make: the conversion is undone
    and stays pending, so every forward raises until the model is converted as it was saved."""
    x = torch.randn(2, 3, 6, 6)
    _, checkpoint = trained_checkpoint(KINDS["scaled-ws"], x)
    pending = KINDS["ws"].apply(lazy_cnn())
    pending.load_state_dict(torch.load(checkpoint))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"(?s)does not fit its weight.*0\.gain"):
            pending(x)
    assert not parametrized_layers(pending)


def test_a_complex_lazy_weight_is_refused_at_entry(kind: Kind) -> None:
    model = nn.Sequential(nn.LazyLinear(2, dtype=torch.complex64))
    match = r"LazyLinear\.weight must be a real floating-point tensor .* complex dtype"
    with pytest.raises(TypeError, match=match):
        kind.apply(model, layer_types=nn.Linear)
    model(torch.randn(2, 3, dtype=torch.complex64))
    assert type(model[0]) is nn.Linear  # nothing pending: a plain Linear, as before the call


def test_a_pending_conversion_that_fails_keeps_failing(kind: Kind) -> None:
    """A lazy weight's rank is known at the first forward only; a registration that fails there
    stays pending, so the layer never runs without it, until the conversion is removed."""
    model = kind.apply(nn.Sequential(nn.LazyBatchNorm1d()), layer_types=nn.LazyBatchNorm1d)
    x = torch.randn(4, 3)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"BatchNorm1d\.weight has 1 dimension"):
            model(x)
    kind.bake(model)
    model(x)
    assert not parametrized_layers(model)


def test_a_deep_copy_of_a_pending_model_trains_its_own_parameters(kind: Kind) -> None:
    pending = kind.apply(lazy_cnn())
    clone = copy.deepcopy(pending)
    optimizer = torch.optim.SGD(clone.parameters(), lr=0.1)
    x = torch.randn(2, 3, 6, 6)
    for _ in range(2):
        optimizer.zero_grad()
        clone(x).square().mean().backward()
        optimizer.step()
    held = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert all(id(p) in held for p in clone.parameters())
    assert not any(id(p) in held for p in pending.parameters())


def test_removing_a_pending_conversion_leaves_the_plain_lazy_model(kind: Kind) -> None:
    pending = kind.apply(lazy_cnn())
    kind.bake(pending)
    names = [n for n, _ in pending.named_parameters()]
    assert names == [n for n, _ in lazy_cnn().named_parameters()]
    pending(torch.randn(2, 3, 6, 6))
    assert not parametrized_layers(pending)


def test_a_compiled_first_forward_converts_a_pending_lazy_model(kind: Kind) -> None:
    torch._dynamo.reset()
    pending = kind.apply(lazy_cnn())
    optimizer = torch.optim.SGD(pending.parameters(), lr=0.1)
    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(pending, backend="aot_eager")
    compiled(x).square().mean().backward()
    optimizer.step()
    held = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert parametrized_layers(pending)
    assert all(id(p) in held for p in pending.parameters())


# --- weights are recomputed at every access; cached only inside parametrize.cached() ----------


def test_every_eval_forward_recomputes(kind: Kind) -> None:
    model = converted(kind).eval()
    layers = len(parametrized_layers(model))
    with counting(kind) as calls, torch.no_grad():
        model(x_for())
        model(x_for())
    assert calls[0] == 2 * layers


def test_parametrize_cached_computes_each_weight_once_per_scope(kind: Kind) -> None:
    model = converted(kind).eval()
    layers = len(parametrized_layers(model))
    x = x_for()
    with torch.no_grad():
        expected = model(x)
    with counting(kind) as calls, torch.no_grad(), parametrize.cached():
        first, second = model(x), model(x)
    assert calls[0] == layers
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.half().float(),
        lambda m: [p.data.mul_(1.5) for p in m.parameters()],
        lambda m: [p.mul_(1.5) for p in m.parameters()],
    ],
    ids=["half-float", "data-write", "in-place"],
)
def test_eval_forward_after_a_weight_change_is_never_stale(
    kind: Kind, change: Callable[[nn.Module], object]
) -> None:
    model = converted(kind).eval()
    x = x_for()
    with torch.no_grad():
        model(x)
        change(model)
        served = model(x)
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(served, fresh(x), rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_eval_forward_sees_every_optimizer_step(kind: Kind, fused: bool) -> None:
    model = converted(kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    x = x_for()
    for _ in range(2):
        model.train()
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            served = model(x)
        with torch.no_grad():
            torch.testing.assert_close(served, copy.deepcopy(model)(x), rtol=0, atol=0)


def test_gradcheck_in_eval_mode(kind: Kind) -> None:
    """gradcheck perturbs its inputs in place; an eval forward must see each perturbation."""
    model = converted(kind, torch.float64).eval()
    x = x_for(torch.float64)[:1]
    params = tuple(p for p in model.parameters() if p.ndim > 1)[:2]
    assert torch.autograd.gradcheck(lambda *p: model(x), params)


# --- torch.func -----------------------------------------------------------------------------


FUNC_CASES = [
    pytest.param(name, mode, id=f"{name}-{mode}")
    for name, kind in KINDS.items()
    for mode in ("train", "eval")
    if mode == "eval" or not kind.stateful
]


@pytest.mark.parametrize(("name", "mode"), FUNC_CASES)
def test_torch_func_per_sample_gradients(name: str, mode: str) -> None:
    kind = KINDS[name]
    model = converted(kind, torch.float64).train(mode == "train")
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = x_for(torch.float64), torch.randn(4, 2, dtype=torch.float64)

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (xi.unsqueeze(0),))
        return (out - yi).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(len(x)):
        model.zero_grad()
        loss(dict(model.named_parameters()), x[i], y[i]).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(per_sample[name][i], param.grad)


def test_torch_func_ensemble_and_jvp(kind: Kind) -> None:
    models = [converted(kind, torch.float64).eval() for _ in range(3)]
    params, buffers = torch.func.stack_module_state(models)
    x = x_for(torch.float64)
    base = copy.deepcopy(models[0]).to("meta")
    outputs = torch.func.vmap(lambda p, b: torch.func.functional_call(base, (p, b), (x,)))(
        params, buffers
    )
    with torch.no_grad():
        for i, m in enumerate(models):
            torch.testing.assert_close(outputs[i], m(x))
    model = models[0]
    raw = {k: v.detach() for k, v in model.named_parameters()}
    tangent = {k: torch.randn_like(v) for k, v in raw.items()}

    def run(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    _, directional = torch.func.jvp(run, (raw,), (tangent,))
    step = 1e-6
    with torch.no_grad():
        ahead = run({k: v + step * tangent[k] for k, v in raw.items()})
        behind = run({k: v - step * tangent[k] for k, v in raw.items()})
    torch.testing.assert_close(directional, (ahead - behind) / (2 * step), rtol=1e-6, atol=1e-6)


# --- errors leave the model unchanged -------------------------------------------------------


def assert_unchanged(model: nn.Module, params: list[nn.Parameter]) -> None:
    assert not parametrized_layers(model)
    assert list(model.parameters()) == params


@pytest.mark.parametrize(
    ("dtype", "word"),
    [(torch.int64, "integer"), (torch.complex64, "complex")],
    ids=["int", "complex"],
)
def test_a_bad_layer_anywhere_leaves_the_whole_model_unchanged(
    kind: Kind, dtype: torch.dtype, word: str
) -> None:
    model = small_cnn()
    model(torch.randn(1, 3, 8, 8))
    model[-1].weight = nn.Parameter(torch.ones(2, 16, dtype=dtype), requires_grad=False)
    params = list(model.parameters())
    bad_layer_types = (nn.Conv2d, nn.Linear)
    match = rf"Linear\.weight must be a real floating-point tensor .* {word} dtype"
    with pytest.raises(TypeError, match=match):
        kind.apply(model, layer_types=bad_layer_types)
    assert_unchanged(model, params)


def test_a_registration_that_fails_rolls_back_the_layers_before_it(
    kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What validation cannot foresee (here the third layer's parametrization raising inside
    torch's registration) still leaves every layer with its own Parameter and values."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.Conv2d(4, 2, 3))
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    original = kind.parametrization.forward
    calls = [0]

    def failing(self: nn.Module, *tensors: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("inside torch")
        result: torch.Tensor = original(self, *tensors)
        return result

    monkeypatch.setattr(kind.parametrization, "forward", failing)
    with pytest.raises(RuntimeError, match="inside torch"):
        kind.apply(model)
    assert_unchanged(model, params)
    for param, value in zip(params, values, strict=True):
        torch.testing.assert_close(param, value, rtol=0, atol=0)


def test_converting_twice_is_refused_and_changes_nothing(kind: Kind) -> None:
    model = converted(kind)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"nothing to \w+ in Sequential: all \d+ matching layers"):
        kind.apply(model)
    assert model.state_dict().keys() == state.keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)


def test_removing_what_is_not_there_is_refused(kind: Kind) -> None:
    with pytest.raises(ValueError, match=r"^Sequential has no [\w ]+ to remove$"):
        kind.bake(nn.Sequential(nn.Linear(3, 2)))


def test_sparse_embedding_is_refused_at_registration(kind: Kind) -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"Embedding has sparse=True.*Use sparse=False"):
        kind.apply(model, layer_types=nn.Embedding)
    assert_unchanged(model, params)


def test_wrapped_in_ddp_is_refused_with_the_order_to_follow(kind: Kind) -> None:
    """DDP would never average the gradients of parameters created after it was built."""
    ddp = pytest.importorskip("torch.nn.parallel")
    model = converted(kind)
    fake = ddp.DistributedDataParallel.__new__(ddp.DistributedDataParallel)
    nn.Module.__init__(fake)
    fake.module = small_cnn()
    params = list(fake.parameters())
    with pytest.raises(ValueError, match=r"wrapped by DistributedDataParallel\. Apply .* before"):
        kind.apply(fake)
    assert_unchanged(fake, params)
    assert parametrized_layers(model)


@pytest.fixture
def single_process_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group, enough to build FSDP1 on the CPU."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without a process group already running")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")
@pytest.mark.parametrize("orig_params", [False, True], ids=["flat", "use-orig-params"])
@pytest.mark.parametrize(
    "target",
    [lambda wrapped: wrapped, lambda wrapped: wrapped.module, lambda wrapped: wrapped.module[0]],
    ids=["root", "inner-model", "layer"],
)
def test_wrapped_in_fsdp1_is_refused_with_the_order_to_follow(
    kind: Kind,
    orig_params: bool,
    target: Callable[[nn.Module], nn.Module],
    single_process_group: None,
) -> None:
    """FSDP1 flattens the parameters it finds into FlatParameters and never sees new ones."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    wrapped = FullyShardedDataParallel(
        model, device_id=torch.device("cpu"), use_orig_params=orig_params
    )
    module = target(wrapped)
    params = list(wrapped.parameters())
    x = torch.randn(1, 3, 6, 6)
    expected = wrapped(x).detach()
    match = r"(wrapped by|flattened by) FullyShardedDataParallel \(FSDP1\).* Apply .* before"
    with pytest.raises(ValueError, match=match):
        kind.apply(module, layer_types=nn.Conv2d)
    assert_unchanged(wrapped, params)
    torch.testing.assert_close(wrapped(x), expected, rtol=0, atol=0)


# --- kinds with state -----------------------------------------------------------------------


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers()}


@pytest.mark.parametrize("name", STATEFUL)
def test_a_training_forward_advances_the_state_and_an_eval_forward_leaves_it(name: str) -> None:
    model = converted(KINDS[name])
    before = state_of(model)
    assert before  # the state is in buffers, where state dicts and copies find it
    with torch.no_grad():
        model.eval()(x_for())
    for key, value in state_of(model).items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    model.train()(x_for())
    assert any(not torch.equal(value, before[k]) for k, value in state_of(model).items())


@pytest.mark.parametrize("name", STATEFUL)
def test_the_state_travels_with_the_state_dict(name: str) -> None:
    kind = KINDS[name]
    model = converted(kind)
    for _ in range(3):
        model(x_for())
    fresh = converted(kind).eval()
    x = x_for()
    with torch.no_grad():
        expected = model.eval()(x)
        assert not torch.equal(fresh(x), expected)  # the state changes the weights
        fresh.load_state_dict(model.state_dict())
        torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", STATEFUL)
def test_a_training_forward_under_torch_func_computes_with_the_state_as_it_is(name: str) -> None:
    """torch.func's functions may not write into a module's buffers: under a transform, a
    training forward leaves the state, and computes what an eval forward does."""
    model = converted(KINDS[name], torch.float64).train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = x_for(torch.float64)
    before = state_of(model)

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).sum()

    grads = torch.func.grad(loss)(params)
    for key, value in state_of(model).items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    model.eval()(x).sum().backward()
    for key, param in model.named_parameters():
        torch.testing.assert_close(grads[key], param.grad)


def test_the_spectral_norm_divides_by_the_largest_singular_value() -> None:
    """The stateful kind's technique is what it claims: after enough training forwards, each
    weight has spectral norm 1 (torch.linalg's singular values as the reference)."""
    model = apply_spectral_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(36, 2)))
    model = model.double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    for _ in range(200):
        model(x)
    for layer in (model[0], model[2]):
        largest = torch.linalg.svdvals(layer.weight.detach().flatten(1))[0]
        torch.testing.assert_close(largest, torch.tensor(1.0, dtype=torch.float64))
