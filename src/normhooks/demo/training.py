"""One configuration's training run: seeded, timed, with a per-epoch record of its curves."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from normhooks.demo.data import Dataset

__all__ = [
    "INIT_BATCH",
    "Configuration",
    "Progress",
    "RunResult",
    "evaluate",
    "lr_factor",
    "train",
    "warm_up",
]

# Samples handed to a data-dependent initialization: Salimans & Kingma use one minibatch.
INIT_BATCH = 256
_EVAL_BATCH = 1024
# Seeds the data-dependent initialization's batch apart from the batch order.
_INIT_SEED_OFFSET = 1_000_003

Schedule = Literal["constant", "poly2"]


class Progress(Protocol):
    """What the training loop needs from a progress bar (tqdm's interface)."""

    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Configuration:
    """One line of an experiment: how to build, initialize and optimize a model.

    Attributes:
        name: stable key in ``results.json``.
        label: human-readable name for the table and the plots.
        batch_size: samples per step; the last incomplete batch of an epoch is dropped.
        build_model: ``(in_channels, num_classes) -> model``.
        build_optimizer: ``model -> optimizer``, with any hook already attached.
        schedule: ``"constant"``, or ``"poly2"``: the learning rate decays per step as
            ``(1 - step / total_steps) ** 2`` (You et al. 2017's polynomial policy), after
            the warm-up if there is one (see :func:`lr_factor`).
        warmup_epochs: epochs over which the learning rate first rises linearly from
            ``1 / warmup_steps`` of its value to all of it (Goyal et al. 2017's gradual
            warm-up, which You et al. use at large batch); 0 for none.
        initialize: ``(model, batch) -> None``, run once on ``INIT_BATCH`` training samples
            before training, or None.
        settings: the recipe's numbers, copied into ``results.json``.
    """

    name: str
    label: str
    batch_size: int
    build_model: Callable[[int, int], nn.Module]
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    schedule: Schedule = "constant"
    warmup_epochs: int = 0
    initialize: Callable[[nn.Module, Tensor], object] | None = None
    settings: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class RunResult:
    """What one configuration measured; the lists have one entry per finished epoch.

    ``train_loss[e]`` is the mean loss over epoch ``e``'s training steps (in train mode, so
    it is the area under that epoch's loss curve); the test numbers are measured in eval mode
    after the epoch. ``diverged`` is True when the training loss stopped being finite; the
    run stops after that epoch.
    """

    configuration: Configuration
    epochs: int
    steps_per_epoch: int
    train_loss: list[float]
    test_loss: list[float]
    test_accuracy: list[float]
    wall_time_s: float
    diverged: bool

    @property
    def final_train_loss(self) -> float:
        return self.train_loss[-1]

    @property
    def final_test_accuracy(self) -> float:
        return self.test_accuracy[-1]


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``, in eval mode."""
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device, dtype=torch.long)
    for start in range(0, len(y), _EVAL_BATCH):
        logits = model(x[start : start + _EVAL_BATCH])
        targets = y[start : start + _EVAL_BATCH]
        total_loss += F.cross_entropy(logits, targets, reduction="sum")
        correct += (logits.argmax(dim=1) == targets).sum()
    model.train(was_training)
    return total_loss.item() / len(y), correct.item() / len(y)


def warm_up() -> None:
    """Pays torch's one-time costs before any configuration's clock starts.

    Building the first optimizer of a process imports ``torch._dynamo`` (about 1.5 s on a
    CPU), which would otherwise be charged to whichever configuration runs first.
    """
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)


def _rng_devices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def train(
    configuration: Configuration,
    data: Dataset,
    *,
    epochs: int,
    seed: int,
    progress: Callable[[int], Progress] | None = None,
) -> RunResult:
    """Trains ``configuration`` on ``data`` (already on its device) for ``epochs`` epochs.

    The model's initialization and the order of the batches come from ``seed`` alone, so two
    configurations of an experiment start from the same draw where their models match; the
    global random state is restored afterwards.

    Args:
        configuration: what to train.
        data: the split, on the device to train on.
        epochs: passes over the training set.
        seed: seeds the initialization, the batch order and the data-dependent
            initialization's batch (each from its own generator, so configurations that
            differ only there still see the same batches).
        progress: ``total_steps -> progress bar``; called once, updated every step, closed at
            the end; None for no progress display.
    """
    device = data.train_x.device
    samples = len(data.train_y)
    batch_size = min(configuration.batch_size, samples)
    steps_per_epoch = samples // batch_size
    total_steps = epochs * steps_per_epoch
    train_loss: list[float] = []
    test_loss: list[float] = []
    test_accuracy: list[float] = []
    diverged = False
    start = time.perf_counter()
    warmup_steps = min(configuration.warmup_epochs * steps_per_epoch, total_steps)
    bar = progress(total_steps) if progress is not None else _Silent()
    try:
        with torch.random.fork_rng(devices=_rng_devices(device)):
            torch.manual_seed(seed)
            order = torch.Generator().manual_seed(seed)
            model = configuration.build_model(data.channels, data.num_classes).to(device)
            if configuration.initialize is not None:
                init_order = torch.Generator().manual_seed(seed + _INIT_SEED_OFFSET)
                batch = torch.randperm(samples, generator=init_order)[:INIT_BATCH].to(device)
                configuration.initialize(model, data.train_x[batch])
            optimizer = configuration.build_optimizer(model)
            schedule = configuration.schedule

            def factor(step: int) -> float:
                return lr_factor(schedule, step, total_steps=total_steps, warmup=warmup_steps)

            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
            for _ in range(epochs):
                permutation = torch.randperm(samples, generator=order).to(device)
                batches = permutation[: steps_per_epoch * batch_size].view(steps_per_epoch, -1)
                train_loss.append(_epoch(model, optimizer, scheduler, data, batches, bar))
                loss, accuracy = evaluate(model, data.test_x, data.test_y)
                test_loss.append(loss)
                test_accuracy.append(accuracy)
                diverged = not math.isfinite(train_loss[-1])
                bar.set_postfix_str(
                    "diverged: the training loss is not finite"
                    if diverged
                    else f"train loss {train_loss[-1]:.3f}, test acc {100 * accuracy:.1f}%"
                )
                if diverged:
                    break
    finally:
        bar.close()
    return RunResult(
        configuration=configuration,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        train_loss=train_loss,
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        wall_time_s=time.perf_counter() - start,
        diverged=diverged,
    )


def _epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: Dataset,
    batches: Tensor,
    bar: Progress,
) -> float:
    """One pass over ``batches`` (one row of training indices each); the mean loss."""
    model.train()
    total = torch.zeros((), device=batches.device)
    for batch in batches:
        loss = F.cross_entropy(model(data.train_x[batch]), data.train_y[batch])
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        optimizer.step()
        scheduler.step()
        total += loss.detach()
        bar.update(1)
    return total.item() / len(batches)


def lr_factor(schedule: Schedule, step: int, *, total_steps: int, warmup: int = 0) -> float:
    """The learning rate of step ``step`` (from 0) as a fraction of the configured one.

    The first ``warmup`` steps rise linearly, ``(step + 1) / warmup``; after them, ``"poly2"``
    decays as ``(1 - (step - warmup) / (total_steps - warmup)) ** 2`` and ``"constant"``
    stays at 1.

    Example:
        >>> [lr_factor("poly2", s, total_steps=6, warmup=2) for s in range(6)]
        [0.5, 1.0, 1.0, 0.5625, 0.25, 0.0625]
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup, 1)
    return (1.0 - min(step - warmup, decay_steps) / decay_steps) ** 2


class _Silent:
    """A progress display that shows nothing."""

    def update(self, n: int = 1) -> object:
        return None

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        return None

    def close(self) -> None:
        return None
