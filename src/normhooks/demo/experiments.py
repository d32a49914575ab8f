"""The demo's three experiments: one fixed recipe each, and the rule that judges its claim.

Every recipe below is fixed in code and the same for every data set, seed and device; no
number is chosen per run. The verdict rules compare measured numbers with fixed margins:

- ``ACCURACY_MARGIN``: test accuracies closer than 1 percentage point count as equal. On the
  digits' 449 test images that is 4-5 images, about one binomial standard error at 95 %
  accuracy, so a single seed cannot separate smaller differences.
- ``LOSS_MARGIN``: an early training loss must be at least 5 % lower to count as faster.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import normhooks
from normhooks.demo.models import Norm, small_cnn
from normhooks.demo.training import Configuration, RunResult

__all__ = [
    "ACCURACY_MARGIN",
    "EARLY_EPOCHS",
    "EXPERIMENTS",
    "LOSS_MARGIN",
    "Experiment",
    "ExperimentResult",
    "Verdict",
    "large_batch",
    "micro_batch",
    "weight_normalization",
]

ACCURACY_MARGIN = 0.01
LOSS_MARGIN = 0.05
# "Faster convergence in the first epochs" is judged on the mean training loss over these
# epochs: the area under the loss curve, step by step, divided by its length.
EARLY_EPOCHS = 2

# The SGD recipe shared by experiments 1 and 2: He et al.'s CIFAR recipe (lr 0.1 at batch
# 128, momentum 0.9, weight decay 5e-4) with the learning rate scaled linearly with the batch
# (Goyal et al. 2017), decayed by You et al.'s polynomial policy of power 2, no warm-up.
# Weight decay applies to weights (tensors of 2 or more dimensions) only, as LARS does.
BASE_LR = 0.1
BASE_BATCH = 128
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4


@dataclass(frozen=True)
class Verdict:
    """Whether a claim reproduced, and the measured numbers that decided it."""

    reproduced: bool
    summary: str


@dataclass(frozen=True)
class Experiment:
    """A claim, the configurations that test it, and the fixed rule that judges it.

    Attributes:
        key: the name ``--experiments`` uses.
        title: the experiment's name in the table and the plots.
        paper: the paper whose claim it tests.
        claim: the claim, in one sentence.
        epochs: epochs per configuration in a default run.
        quick_epochs: epochs per configuration with ``--quick``.
        configurations: the lines of the experiment; the first is the reference.
        rule: the verdict rule, in words, for the report.
        judge: ``{configuration name: result} -> Verdict``, applying ``rule``.
    """

    key: str
    title: str
    paper: str
    claim: str
    epochs: int
    quick_epochs: int
    configurations: tuple[Configuration, ...]
    rule: str
    judge: Callable[[Mapping[str, RunResult]], Verdict]


@dataclass(frozen=True)
class ExperimentResult:
    """An experiment's measured runs, by configuration name, and its verdict."""

    experiment: Experiment
    runs: dict[str, RunResult]
    verdict: Verdict


def _sgd_lr(batch_size: int) -> float:
    return BASE_LR * batch_size / BASE_BATCH


def _model(norm: Norm, *, standardize: bool = False) -> Callable[[int, int], nn.Module]:
    def build(in_channels: int, num_classes: int) -> nn.Module:
        model = small_cnn(in_channels, num_classes, norm)
        if standardize:
            normhooks.apply_weight_standardization(model)
        return model

    return build


def _sgd(lr: float, *, lars: bool = False) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """SGD with momentum; with ``lars``, GradientLARS at its defaults applies the decay."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        groups = normhooks.lars_param_groups(model)
        for group in groups:
            decays = group.get("lars", True) and not lars
            group["weight_decay"] = WEIGHT_DECAY if decays else 0.0
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM)
        if lars:
            normhooks.GradientLARS(weight_decay=WEIGHT_DECAY).attach(optimizer)
        return optimizer

    return build


def _sgd_settings(batch_size: int, *, lars: bool = False) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "optimizer": "SGD",
        "batch_size": batch_size,
        "lr": _sgd_lr(batch_size),
        "momentum": MOMENTUM,
        "weight_decay": WEIGHT_DECAY,
        "schedule": "poly2",
    }
    if lars:
        hook = normhooks.GradientLARS(weight_decay=WEIGHT_DECAY)
        settings["lars"] = {
            "threshold": hook.threshold,
            "weight_decay": hook.weight_decay,
            "eps": hook.eps,
            "trust_coefficient": hook.trust_coefficient,
            "clip": hook.clip,
        }
    return settings


def _points(accuracy: float) -> str:
    return f"{100 * accuracy:.1f}%"


# --- 1. Large batch: You, Gitman and Ginsburg 2017 -------------------------------------------

SMALL_BATCH = 16
LARGE_BATCH = 256


def _judge_large_batch(results: Mapping[str, RunResult]) -> Verdict:
    small = results["sgd-small"].final_test_accuracy
    large = results["sgd-large"].final_test_accuracy
    lars = results["lars-large"].final_test_accuracy
    lost = small - large
    numbers = (
        f"batch {SMALL_BATCH} {_points(small)}, batch {LARGE_BATCH} {_points(large)}, "
        f"batch {LARGE_BATCH} + LARS {_points(lars)}"
    )
    if lost < ACCURACY_MARGIN:
        return Verdict(False, f"the large batch lost no accuracy to recover ({numbers})")
    recovered = lars - large
    summary = f"LARS recovered {100 * recovered:.1f} of {100 * lost:.1f} points lost ({numbers})"
    return Verdict(recovered >= max(lost / 2, ACCURACY_MARGIN), summary)


def large_batch() -> Experiment:
    """Large batch with a linearly scaled learning rate, with and without GradientLARS.

    Recipe: the BatchNorm CNN, ``SMALL_BATCH`` = 16 as the baseline and ``LARGE_BATCH`` =
    256 (16 times larger, with a 16 times larger learning rate), the shared SGD recipe, 5
    epochs each, so the large batch takes 16 times fewer steps, as in the paper. The paper
    compares batches at the epoch budget that suffices for the small batch; on digits the
    baseline stops improving after about 5 epochs, and with 30 every batch size reaches the
    same 99 % test accuracy, which leaves no loss to recover. The LARS line
    is the same optimizer and learning rate with :class:`~normhooks.GradientLARS` at its
    defaults (Chainer's: trust coefficient 1, threshold 1e-2), which takes over the weight
    decay; biases and BatchNorm's parameters are left to plain SGD.
    """
    small, large = _sgd_lr(SMALL_BATCH), _sgd_lr(LARGE_BATCH)
    return Experiment(
        key="lars",
        title="Large batch",
        paper="You, Gitman and Ginsburg 2017, arXiv:1708.03888",
        claim="LARS recovers the accuracy that SGD loses at a large batch",
        epochs=5,
        quick_epochs=3,
        configurations=(
            Configuration(
                "sgd-small",
                f"SGD, batch {SMALL_BATCH}, lr {small:g}",
                SMALL_BATCH,
                _model("batch"),
                _sgd(small),
                "poly2",
                settings=_sgd_settings(SMALL_BATCH),
            ),
            Configuration(
                "sgd-large",
                f"SGD, batch {LARGE_BATCH}, lr {large:g}",
                LARGE_BATCH,
                _model("batch"),
                _sgd(large),
                "poly2",
                settings=_sgd_settings(LARGE_BATCH),
            ),
            Configuration(
                "lars-large",
                f"SGD + LARS, batch {LARGE_BATCH}, lr {large:g}",
                LARGE_BATCH,
                _model("batch"),
                _sgd(large, lars=True),
                "poly2",
                settings=_sgd_settings(LARGE_BATCH, lars=True),
            ),
        ),
        rule=(
            f"reproduced if plain SGD at batch {LARGE_BATCH} loses at least "
            f"{100 * ACCURACY_MARGIN:g} point of test accuracy against batch {SMALL_BATCH}, "
            f"and LARS at batch {LARGE_BATCH} wins back at least half of the loss "
            f"(and at least {100 * ACCURACY_MARGIN:g} point)"
        ),
        judge=_judge_large_batch,
    )


# --- 2. Micro-batch: Qiao, Wang, Liu, Shen and Yuille 2019 ----------------------------------

MICRO_BATCH = 2


def _judge_micro_batch(results: Mapping[str, RunResult]) -> Verdict:
    bn = results["bn"].final_test_accuracy
    gn = results["gn"].final_test_accuracy
    ws = results["gn-ws"].final_test_accuracy
    numbers = f"BN {_points(bn)}, GN {_points(gn)}, GN + WS {_points(ws)}"
    beats = ws - max(bn, gn) >= ACCURACY_MARGIN
    return Verdict(beats, numbers if beats else f"GN + WS is not ahead of both ({numbers})")


def micro_batch() -> Experiment:
    """Batch 2 with BatchNorm, GroupNorm, and GroupNorm with weight standardization.

    Recipe: the CNN with BatchNorm or GroupNorm (8 groups), the shared SGD recipe at batch
    ``MICRO_BATCH`` = 2 (learning rate 0.1 * 2 / 128), 6 epochs. BatchNorm is evaluated with
    its running statistics, as deployed. Weight standardization applies to every convolution
    (:func:`~normhooks.apply_weight_standardization`), as in the paper.
    """
    lr = _sgd_lr(MICRO_BATCH)
    return Experiment(
        key="ws",
        title="Micro-batch",
        paper="Qiao et al. 2019, arXiv:1903.10520",
        claim=(
            "GroupNorm + weight standardization beats BatchNorm and GroupNorm at batch "
            f"{MICRO_BATCH}"
        ),
        epochs=6,
        quick_epochs=1,
        configurations=(
            Configuration(
                "bn",
                "BatchNorm",
                MICRO_BATCH,
                _model("batch"),
                _sgd(lr),
                "poly2",
                settings=_sgd_settings(MICRO_BATCH) | {"norm": "BatchNorm2d"},
            ),
            Configuration(
                "gn",
                "GroupNorm",
                MICRO_BATCH,
                _model("group"),
                _sgd(lr),
                "poly2",
                settings=_sgd_settings(MICRO_BATCH) | {"norm": "GroupNorm"},
            ),
            Configuration(
                "gn-ws",
                "GroupNorm + WS",
                MICRO_BATCH,
                _model("group", standardize=True),
                _sgd(lr),
                "poly2",
                settings=_sgd_settings(MICRO_BATCH)
                | {"norm": "GroupNorm", "weight_standardization": True},
            ),
        ),
        rule=(
            f"reproduced if GN + WS's test accuracy is at least {100 * ACCURACY_MARGIN:g} "
            "point above both BN's and GN's"
        ),
        judge=_judge_micro_batch,
    )


# --- 3. Weight normalization: Salimans and Kingma 2016 ----------------------------------------

WN_BATCH = 100
ADAM_LR = 3e-3


def _weight_norm_model(in_channels: int, num_classes: int) -> nn.Module:
    return normhooks.weight_norm(small_cnn(in_channels, num_classes, "none"))


def _data_dependent_init(model: nn.Module, batch: Tensor) -> None:
    normhooks.data_dependent_init(model, batch)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=ADAM_LR)


def _early_loss(result: RunResult) -> float:
    early = result.train_loss[:EARLY_EPOCHS]
    return sum(early) / len(early)


def _judge_weight_norm(results: Mapping[str, RunResult]) -> Verdict:
    plain = _early_loss(results["plain"])
    faster = {
        name: _early_loss(results[name]) <= (1 - LOSS_MARGIN) * plain for name in ("wn", "wn-init")
    }
    epochs = min(EARLY_EPOCHS, len(results["plain"].train_loss))

    def line(name: str, label: str) -> str:
        verdict = "faster" if faster[name] else "not faster"
        return f"{label} {_early_loss(results[name]):.3f} ({verdict})"

    summary = (
        f"mean training loss over the first {epochs} epoch{'s' if epochs > 1 else ''}: "
        f"plain {plain:.3f}, {line('wn', 'WN')}, {line('wn-init', 'WN + init')}"
    )
    return Verdict(all(faster.values()), summary)


def weight_normalization() -> Experiment:
    """A network without normalization layers, with weight norm, and with its initialization.

    Recipe: the CNN without normalization layers, Adam with learning rate 3e-3 at batch 100
    (the paper's CIFAR-10 settings), constant learning rate, 10 epochs. Weight norm
    reparametrizes every convolution and the linear layer (:func:`~normhooks.weight_norm`);
    the data-dependent initialization (:func:`~normhooks.data_dependent_init`, the paper's
    section 3) runs on ``INIT_BATCH`` training images before the first step.
    """
    settings = {"optimizer": "Adam", "batch_size": WN_BATCH, "lr": ADAM_LR, "schedule": "constant"}
    return Experiment(
        key="wn",
        title="Weight normalization",
        paper="Salimans and Kingma 2016, arXiv:1602.07868",
        claim="weight normalization converges faster in the first epochs",
        epochs=10,
        quick_epochs=2,
        configurations=(
            Configuration(
                "plain",
                "plain",
                WN_BATCH,
                _model("none"),
                _adam,
                settings=settings,
            ),
            Configuration(
                "wn",
                "weight norm",
                WN_BATCH,
                _weight_norm_model,
                _adam,
                settings=settings | {"weight_norm": True},
            ),
            Configuration(
                "wn-init",
                "weight norm + data-dependent init",
                WN_BATCH,
                _weight_norm_model,
                _adam,
                initialize=_data_dependent_init,
                settings=settings | {"weight_norm": True, "data_dependent_init": True},
            ),
        ),
        rule=(
            "reproduced if weight norm alone and weight norm with its initialization both "
            f"reach a mean training loss over the first {EARLY_EPOCHS} epochs at least "
            f"{100 * LOSS_MARGIN:g} % below the plain network's"
        ),
        judge=_judge_weight_norm,
    )


EXPERIMENTS: dict[str, Callable[[], Experiment]] = {
    "lars": large_batch,
    "ws": micro_batch,
    "wn": weight_normalization,
}
