"""normhooks in a training loop driven by accelerate alone, against plain torch by hand.

Each test runs the loop accelerate's documentation gives (``prepare``, ``accelerator.backward``,
``accumulate``, ``clip_grad_norm_``, ``save_state`` / ``load_state``) for a few steps on the CPU,
then the same training in plain torch with the technique's formula from ``reference``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from frameworks import reference as ref
from normhooks import (
    AdaptiveGradientClipping,
    GradientLARS,
    TrustRatio,
    apply_weight_norm,
    lars_param_groups,
)

LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4


def loader(batch_size: int = 8) -> DataLoader[Any]:
    return DataLoader(TensorDataset(*ref.regression_data(24)), batch_size=batch_size)


def assert_parameters_close(actual: nn.Module, expected: nn.Module) -> None:
    for a, b in zip(actual.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("when", ["before-prepare", "after-prepare"])
def test_lars_attached_around_prepare_matches_lars_by_hand(when: str) -> None:
    # After prepare, the optimizer is accelerate's AcceleratedOptimizer wrapping the one built.
    model = ref.mlp()
    expected = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(lars_param_groups(model), lr=LR, momentum=MOMENTUM)
    hook = GradientLARS(weight_decay=WEIGHT_DECAY)
    if when == "before-prepare":
        hook.attach(optimizer)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    if when == "after-prepare":
        hook.attach(optimizer)
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            accelerator.backward(ref.loss_of(model, x, y))
            optimizer.step()

    reference_optimizer = torch.optim.SGD(expected.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(2):
        for x, y in loader():
            reference_optimizer.zero_grad()
            ref.loss_of(expected, x, y).backward()
            ref.lars_([p for p in expected.parameters() if p.ndim > 1], weight_decay=WEIGHT_DECAY)
            reference_optimizer.step()
    assert_parameters_close(model, expected)


def test_accumulate_with_weight_norm_matches_agc_by_hand() -> None:
    plain = ref.mlp()
    expected = ref.weight_normed_mlp(plain)
    model = apply_weight_norm(copy.deepcopy(plain))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    AdaptiveGradientClipping().attach(optimizer)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(batch_size=4))
    for _ in range(2):
        for x, y in data:
            with accelerator.accumulate(model):
                accelerator.backward(ref.loss_of(model, x, y))  # divided by 2 here
                optimizer.step()  # a step on every second batch only, and the hook with it
                optimizer.zero_grad()

    reference_optimizer = torch.optim.SGD(expected.parameters(), lr=LR)
    batches = list(loader(batch_size=4))
    for _ in range(2):
        for first, second in zip(batches[::2], batches[1::2], strict=True):
            reference_optimizer.zero_grad()
            for x, y in (first, second):
                (ref.loss_of(expected, x, y) / 2).backward()
            ref.agc_(list(expected.parameters()))  # once, on the accumulated gradient
            reference_optimizer.step()
    for i in (0, 2):
        weight = model[i].parametrizations.weight
        torch.testing.assert_close(weight.original0, expected[i].g)
        torch.testing.assert_close(weight.original1, expected[i].v)
        torch.testing.assert_close(model[i].bias, expected[i].bias)


def test_clip_grad_norm_before_the_step_comes_before_the_hook() -> None:
    model = ref.mlp()
    clip = 0.05

    def by_hand(clip_first: bool) -> nn.Module:
        copied = copy.deepcopy(model)
        optimizer = torch.optim.SGD(copied.parameters(), lr=LR)
        for _ in range(2):
            for x, y in loader():
                optimizer.zero_grad()
                ref.loss_of(copied, x, y).backward()
                if clip_first:
                    torch.nn.utils.clip_grad_norm_(copied.parameters(), clip)
                ref.agc_(list(copied.parameters()))
                if not clip_first:
                    torch.nn.utils.clip_grad_norm_(copied.parameters(), clip)
                optimizer.step()
        return copied

    expected, other_order = by_hand(clip_first=True), by_hand(clip_first=False)
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    AdaptiveGradientClipping().attach(optimizer)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            accelerator.backward(ref.loss_of(model, x, y))
            accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
    assert_parameters_close(model, expected)
    with pytest.raises(AssertionError):
        assert_parameters_close(model, other_order)


def test_save_and_load_state_resume_is_bit_identical(tmp_path: Path) -> None:
    """An uninterrupted run of two epochs against one epoch, save_state, a new process's
    objects, load_state and the second epoch; AdamW's moments travel in the state."""

    def setup() -> tuple[Accelerator, nn.Module, Any, Any]:
        accelerator = Accelerator(cpu=True)
        model = ref.mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
        TrustRatio().attach(optimizer)
        return accelerator, *accelerator.prepare(model, optimizer, loader())

    def epoch(accelerator: Accelerator, model: nn.Module, optimizer: Any, data: Any) -> None:
        for x, y in data:
            optimizer.zero_grad()
            accelerator.backward(ref.loss_of(model, x, y))
            optimizer.step()

    accelerator, uninterrupted, optimizer, data = setup()
    epoch(accelerator, uninterrupted, optimizer, data)
    accelerator.save_state(tmp_path / "state")
    epoch(accelerator, uninterrupted, optimizer, data)

    accelerator, resumed, optimizer, data = setup()  # its initial weights are the state's
    accelerator.load_state(tmp_path / "state")
    epoch(accelerator, resumed, optimizer, data)
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
