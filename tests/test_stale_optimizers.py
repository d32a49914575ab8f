"""Optimizers built before a conversion that added Parameters are refused at their step.

Weight normalization makes g and v new Parameters and Scaled WS adds a gain: an optimizer
built before the conversion holds neither, and they would silently never train. The check is
a global optimizer step pre-hook; lazy modules keep an optimizer built before their first
forward working (tests/test_contract.py trains one against the dry-run-first flow). Each
refusal states its cause: an optimizer that holds a Parameter the model no longer has (weight
norm's old weight, also after the removal) was built before; one whose additions no optimizer
trains may have been, or their optimizer comes later.
"""

from __future__ import annotations

import copy
import functools
import gc
import importlib
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from normhooks import (
    apply_weight_norm,
    apply_weight_standardization,
    remove_weight_norm,
    remove_weight_standardization,
    weight_norm,
)

watch = importlib.import_module("normhooks._parametrize.optimizer_watch")

CONVERT: dict[str, Callable[[nn.Module], nn.Module]] = {
    "wn": apply_weight_norm,
    "scaled-ws": functools.partial(apply_weight_standardization, scaled=True),
}
# Weight norm's old weight leaves the model, so an optimizer holding it was certainly built
# before: refused at once. Scaled WS's raw weight stays the model's, and another optimizer
# might train the gains and not have stepped yet: refused at the second step.
REFUSED_AT = {"wn": 1, "scaled-ws": 2}
# The cause each refusal states: certainly built before the conversion where it holds a
# Parameter the model no longer has; otherwise, additions that no optimizer trains.
BUILT_BEFORE = (
    r"SGD holds the Parameter Conv2d\.weight had before .* the optimizer was built before"
)
UNTRAINED = (
    r"SGD holds Conv2d\.weight but not the Parameters added when .* was applied to it .* no "
    "optimizer has trained those"
)
REFUSAL = {"wn": BUILT_BEFORE, "scaled-ws": UNTRAINED, "lazy": UNTRAINED}


def model() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 2, 1))


def lazy_model() -> nn.Sequential:
    return nn.Sequential(nn.LazyConv2d(4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.LazyConv2d(2, 1))


X = torch.randn(2, 3, 6, 6)


def step(net: nn.Module, *optimizers: torch.optim.Optimizer) -> None:
    for optimizer in optimizers:
        optimizer.zero_grad()
    net(X).square().mean().backward()
    for optimizer in optimizers:
        optimizer.step()


def snapshot(net: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    return params, copy.deepcopy(optimizer.state_dict())


def assert_same(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    for key, value in before[0].items():
        torch.testing.assert_close(after[0][key], value, rtol=0, atol=0)
    assert repr(after[1]) == repr(before[1])


@pytest.mark.parametrize("lazy", [False, True], ids=["built", "lazy"])
@pytest.mark.parametrize("kind", list(CONVERT))
def test_an_optimizer_built_before_converting_is_refused_at_its_step(kind: str, lazy: bool) -> None:
    net = lazy_model() if lazy else model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    CONVERT[kind](net)
    refused_at = 2 if lazy else REFUSED_AT[kind]
    for _ in range(refused_at - 1):
        step(net, optimizer)
    before = snapshot(net, optimizer)
    with pytest.raises(ValueError, match=REFUSAL[kind if not lazy else "lazy"]):
        step(net, optimizer)
    assert_same(before, snapshot(net, optimizer))


def test_conversions_elsewhere_between_the_steps_do_not_postpone_the_refusal() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    apply_weight_standardization(net, scaled=True)
    step(net, optimizer)
    others = [apply_weight_standardization(model(), scaled=True) for _ in range(40)]
    del others[::2]
    gc.collect()
    with pytest.raises(ValueError, match=UNTRAINED):
        step(net, optimizer)


def test_the_message_names_what_is_missing_and_the_fix() -> None:
    net = model()
    optimizer = torch.optim.Adam(net.parameters())
    apply_weight_norm(net)
    with pytest.raises(ValueError, match="built before the conversion") as error:
        step(net, optimizer)
    message = str(error.value)
    assert "Conv2d.parametrizations.weight.original0" in message
    assert "Conv2d.parametrizations.weight.original1" in message
    assert "Build the optimizer after converting the model" in message
    assert "optimizer.add_param_group" in message
    assert "requires_grad=False" in message


def test_plain_ws_keeps_an_earlier_optimizer_working() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    apply_weight_standardization(net)
    raw = net[0].parametrizations.weight.original.detach().clone()
    for _ in range(3):
        step(net, optimizer)
    assert not torch.equal(net[0].parametrizations.weight.original, raw)


@pytest.mark.parametrize("kind", list(CONVERT))
def test_adding_the_new_parameters_is_enough(kind: str) -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    known = {id(p) for p in net.parameters()}
    CONVERT[kind](net)
    optimizer.add_param_group({"params": [p for p in net.parameters() if id(p) not in known]})
    for _ in range(3):
        step(net, optimizer)


@pytest.mark.parametrize("kind", list(CONVERT))
def test_new_parameters_frozen_on_purpose_are_not_asked_for(kind: str) -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    known = {id(p) for p in net.parameters()}
    CONVERT[kind](net)
    for p in net.parameters():
        if id(p) not in known:
            p.requires_grad_(False)
    for _ in range(3):
        step(net, optimizer)


def test_a_second_optimizer_that_trains_the_gains_is_enough() -> None:
    net = model()
    weights = torch.optim.SGD(net.parameters(), lr=0.1)
    apply_weight_standardization(net, scaled=True)
    gains = torch.optim.Adam([p for n, p in net.named_parameters() if n.endswith("gain")])
    before = net[0].parametrizations.weight[0].gain.detach().clone()
    for _ in range(3):
        step(net, weights, gains)
    assert not torch.equal(net[0].parametrizations.weight[0].gain, before)


def test_training_on_with_a_second_optimizer_for_the_gains_is_enough() -> None:
    """The weights' optimizer stepped before the conversion; the gains get their own."""
    weight_norm(nn.Linear(2, 2))  # any conversion installs the hook that sees the first step
    net = model()
    weights = torch.optim.SGD(net.parameters(), lr=0.1)
    step(net, weights)
    apply_weight_standardization(net, scaled=True)
    gains = torch.optim.Adam([p for n, p in net.named_parameters() if n.endswith("gain")])
    for _ in range(3):
        step(net, weights, gains)


@pytest.mark.parametrize(
    ("convert", "remove"),
    [
        (apply_weight_norm, remove_weight_norm),
        (
            functools.partial(apply_weight_standardization, scaled=True),
            remove_weight_standardization,
        ),
        (
            functools.partial(apply_weight_standardization, scaled=True),
            functools.partial(remove_weight_standardization, bake=False),
        ),
    ],
    ids=["wn", "scaled-ws-bake", "scaled-ws-restore"],
)
@pytest.mark.parametrize("lazy", [False, True], ids=["built", "pending"])
def test_an_optimizer_built_after_removal_is_not_refused(
    convert: Callable[[nn.Module], nn.Module], remove: Callable[[nn.Module], nn.Module], lazy: bool
) -> None:
    net = convert(lazy_model() if lazy else model())
    remove(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        step(net, optimizer)


def test_an_optimizer_built_before_weight_norm_and_its_removal_is_refused() -> None:
    """The removal leaves the weight v's Parameter: the one the optimizer holds is no longer
    the model's, and the model would not train."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    apply_weight_norm(net)
    remove_weight_norm(net)
    before = snapshot(net, optimizer)
    with pytest.raises(ValueError, match="which its removal did not give back") as error:
        step(net, optimizer)
    assert_same(before, snapshot(net, optimizer))
    assert "Build the optimizer after removing it" in str(error.value)


def test_after_weight_norm_and_its_removal_a_new_optimizer_trains() -> None:
    net = model()
    torch.optim.SGD(net.parameters(), lr=0.1)  # built before, then replaced
    apply_weight_norm(net)
    remove_weight_norm(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    before = net[0].weight.detach().clone()
    step(net, optimizer)
    assert not torch.equal(net[0].weight, before)


@pytest.mark.parametrize(
    "remove",
    [remove_weight_standardization, functools.partial(remove_weight_standardization, bake=False)],
    ids=["bake", "restore"],
)
def test_scaled_ws_and_its_removal_keep_an_earlier_optimizer_working(
    remove: Callable[[nn.Module], nn.Module],
) -> None:
    """Scaled WS keeps the weight's Parameter, and its removal gives it back."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    remove(apply_weight_standardization(net, scaled=True))
    before = net[0].weight.detach().clone()
    for _ in range(3):
        step(net, optimizer)
    assert not torch.equal(net[0].weight, before)


def warm_up_optimizers(net: nn.Module) -> torch.optim.Optimizer:
    """The weights' optimizer, built after the conversion, without the gains."""
    return torch.optim.SGD([p for n, p in net.named_parameters() if "gain" not in n], lr=0.1)


def test_gains_left_to_an_optimizer_after_a_warm_up_are_refused_for_what_they_are() -> None:
    """The weights' optimizer was built after the conversion: the cause stated is that nothing
    trains the gains, not that the optimizer came first."""
    net = apply_weight_standardization(model(), scaled=True)
    weights = warm_up_optimizers(net)
    step(net, weights)
    with pytest.raises(ValueError, match=UNTRAINED) as error:
        step(net, weights)
    message = str(error.value)
    assert "Conv2d.parametrizations.weight.0.gain" in message
    assert "the optimizer meant for them has not stepped yet" in message
    assert "requires_grad=False until their optimizer starts" in message


def test_gains_frozen_for_a_warm_up_then_given_their_optimizer_train() -> None:
    net = apply_weight_standardization(model(), scaled=True)
    gains = [p for n, p in net.named_parameters() if "gain" in n]
    for gain in gains:
        gain.requires_grad_(False)
    weights = warm_up_optimizers(net)
    for _ in range(3):
        step(net, weights)
    for gain in gains:
        gain.requires_grad_(True)
    late = torch.optim.Adam(gains)
    before = [g.detach().clone() for g in gains]
    for _ in range(2):
        step(net, weights, late)
    assert all(not torch.equal(g, old) for g, old in zip(gains, before, strict=True))


@pytest.mark.parametrize("kind", list(CONVERT))
def test_a_conversion_that_failed_is_not_watched(kind: str) -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1))
    net[1].weight = nn.Parameter(torch.ones(2, 4, 1, 1, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match="must be a real floating-point tensor"):
        CONVERT[kind](net)
    del net[1]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        step(net, optimizer)


def test_the_watch_keeps_neither_model_nor_optimizer_alive() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    apply_weight_norm(net)
    with pytest.raises(ValueError, match="built before the conversion"):
        step(net, optimizer)
    refs = [weakref.ref(net), weakref.ref(optimizer)]
    ids = {id(p) for p in optimizer.param_groups[0]["params"]}
    del net, optimizer
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert not ids & watch._conversions.keys()


def test_each_layout_of_an_optimizer_is_looked_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    net = apply_weight_standardization(model(), scaled=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    calls = []
    original = watch._missed

    def counting(held: set[int]) -> Any:
        calls.append(len(held))
        return original(held)

    monkeypatch.setattr(watch, "_missed", counting)
    for _ in range(3):
        step(net, optimizer)
    assert len(calls) == 1
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    step(net, optimizer)
    assert len(calls) == 2


def test_under_torch_compile_the_check_is_left_out() -> None:
    """A compiled step traces the hook as a no-op: no graph of host-side checks."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    apply_weight_norm(net)
    net(X).square().mean().backward()
    torch._dynamo.reset()
    torch.compile(optimizer.step, backend="aot_eager")()
    with pytest.raises(ValueError, match="built before the conversion"):
        optimizer.step()
