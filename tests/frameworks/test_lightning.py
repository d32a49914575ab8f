"""normhooks inside Lightning's Trainer, against the same training in plain torch by hand.

Each test fits a LightningModule for a few steps, then trains a copy of its network in a plain
loop that does what Lightning does (the loss divided for accumulation, clipping, autocast, the
GradScaler) with the technique's formula from ``reference`` in place of normhooks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from frameworks import reference as ref
from normhooks import (
    AdaptiveGradientClipping,
    GradientLARS,
    TrustRatio,
    apply_weight_norm,
    apply_weight_standardization,
    lars_param_groups,
)

LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
BATCH = 8

MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


class Regression(L.LightningModule):
    """Fits ``net`` to the mean squared error, with ``make_optimizer(net)`` as its optimizer
    and ``attach(optimizer)`` called in ``configure_optimizers``, where hooks go."""

    def __init__(
        self,
        net: nn.Module,
        make_optimizer: MakeOptimizer,
        attach: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.make_optimizer = make_optimizer
        self.attach = attach

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return ref.loss_of(self.net, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = self.make_optimizer(self.net)
        if self.attach is not None:
            self.attach(optimizer)
        return optimizer


class ManualRegression(Regression):
    """The same, with manual optimization through ``self.optimizers()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(ref.loss_of(self.net, *batch))
        optimizer.step()


def fit(module: L.LightningModule, loader: DataLoader[Any], root: Path, **options: Any) -> Any:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": root,
    }
    ckpt_path = options.pop("ckpt_path", None)
    trainer = L.Trainer(**(defaults | options))
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def loader(n: int = 24, batch_size: int = BATCH, **data: Any) -> DataLoader[Any]:
    return DataLoader(TensorDataset(*ref.regression_data(n, **data)), batch_size=batch_size)


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(lars_param_groups(net), lr=LR, momentum=MOMENTUM)


def lars_by_hand(net: nn.Module) -> None:
    """LARS on the weights; biases are left to plain SGD, as lars_param_groups leaves them."""
    ref.lars_(weights(net), weight_decay=WEIGHT_DECAY)


def weights(net: nn.Module) -> list[Tensor]:
    return [p for p in net.parameters() if p.ndim > 1]


def assert_parameters_close(actual: nn.Module, expected: nn.Module) -> None:
    for a, b in zip(actual.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def train_lars_by_hand(net: nn.Module, data: DataLoader[Any], epochs: int = 2) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        for x, y in data:
            optimizer.zero_grad()
            ref.loss_of(net, x, y).backward()
            lars_by_hand(net)
            optimizer.step()


class AttachOnTrainStart(L.Callback):
    def __init__(self, through_module: bool) -> None:
        self.through_module = through_module

    def on_train_start(self, trainer: Any, pl_module: L.LightningModule) -> None:
        # pl_module.optimizers() is Lightning's LightningOptimizer wrapper;
        # trainer.optimizers[0] is the optimizer configure_optimizers returned.
        target = pl_module.optimizers() if self.through_module else trainer.optimizers[0]
        GradientLARS(weight_decay=WEIGHT_DECAY).attach(target)


@pytest.mark.parametrize(
    "where",
    ["configure_optimizers", "callback-trainer.optimizers", "callback-self.optimizers()"],
)
def test_automatic_optimization_matches_lars_by_hand(where: str, tmp_path: Path) -> None:
    net, data = ref.mlp(), loader()
    expected = copy.deepcopy(net)
    if where == "configure_optimizers":
        module = Regression(net, sgd, GradientLARS(weight_decay=WEIGHT_DECAY).attach)
        fit(module, data, tmp_path)
    else:
        callback = AttachOnTrainStart(through_module=where.endswith("self.optimizers()"))
        fit(Regression(net, sgd), data, tmp_path, callbacks=[callback])
    train_lars_by_hand(expected, data)
    assert_parameters_close(net, expected)


def test_manual_optimization_with_weight_norm_matches_agc_by_hand(tmp_path: Path) -> None:
    plain, data = ref.mlp(), loader()
    expected = ref.weight_normed_mlp(plain)
    net = apply_weight_norm(copy.deepcopy(plain))

    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=LR)

    fit(ManualRegression(net, make_optimizer, AdaptiveGradientClipping().attach), data, tmp_path)

    optimizer = torch.optim.SGD(expected.parameters(), lr=LR)
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            ref.loss_of(expected, x, y).backward()
            ref.agc_(list(expected.parameters()))
            optimizer.step()
    for i in (0, 2):
        weight = net[i].parametrizations.weight
        torch.testing.assert_close(weight.original0, expected[i].g)
        torch.testing.assert_close(weight.original1, expected[i].v)
        torch.testing.assert_close(net[i].bias, expected[i].bias)
    x, _ = next(iter(data))
    torch.testing.assert_close(net(x), expected(x))


def test_bf16_mixed_matches_lars_by_hand_under_autocast(tmp_path: Path) -> None:
    net, data = ref.mlp(), loader()
    expected = copy.deepcopy(net)
    module = Regression(net, sgd, GradientLARS(weight_decay=WEIGHT_DECAY).attach)
    fit(module, data, tmp_path, precision="bf16-mixed")

    optimizer = torch.optim.SGD(expected.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                loss = ref.loss_of(expected, x, y)
            loss.backward()
            lars_by_hand(expected)
            optimizer.step()
    assert_parameters_close(net, expected)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
def test_16_mixed_with_grad_scaler_matches_lars_by_hand(fused: bool, tmp_path: Path) -> None:
    # On the CPU, precision="16-mixed" becomes bf16-mixed; float16 autocast with a GradScaler
    # is Lightning's MixedPrecision plugin. A fused optimizer unscales in its own step, so
    # Lightning leaves the gradients scaled for it and the hook takes GradScaler's protocol.
    net, data = ref.mlp(), loader(scale=3.0)
    expected, initial = copy.deepcopy(net), copy.deepcopy(net)

    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(lars_param_groups(module), lr=LR, momentum=MOMENTUM, fused=fused)

    plugin = MixedPrecision("16-mixed", device="cpu")
    module = Regression(net, make_optimizer, GradientLARS(weight_decay=WEIGHT_DECAY).attach)
    fit(module, data, tmp_path, plugins=[plugin])

    optimizer = torch.optim.SGD(expected.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                loss = ref.loss_of(expected, x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            lars_by_hand(expected)
            scaler.step(optimizer)
            scaler.update()
    assert plugin.scaler is not None
    assert plugin.scaler.get_scale() == scaler.get_scale()
    assert not torch.equal(net[0].weight, initial[0].weight)  # not every step was skipped
    assert_parameters_close(net, expected)


def test_fused_adamw_with_weight_standardization_matches_lamb_by_hand(tmp_path: Path) -> None:
    plain, data = ref.convnet(), loader(shape=(2, 5, 5))
    expected = ref.convnet(ref.StandardizedConv2d)
    expected.load_state_dict(plain.state_dict())
    net = apply_weight_standardization(plain)

    def groups(module: nn.Module) -> list[dict[str, Any]]:
        # LAMB's usual split: no decay and no trust ratio for biases.
        params = list(module.parameters())
        return [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "trust": False},
        ]

    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups(module), lr=1e-2, weight_decay=1e-2, fused=True)

    fit(Regression(net, make_optimizer, TrustRatio().attach), data, tmp_path)

    optimizer = torch.optim.AdamW(groups(expected), lr=1e-2, weight_decay=1e-2)
    trust = ref.TrustRatioByHand(weights(expected))
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            ref.loss_of(expected, x, y).backward()
            trust.before()
            optimizer.step()
            trust.after(lr=1e-2)
    for i in (0, 2):
        torch.testing.assert_close(net[i].parametrizations.weight.original, expected[i].weight)
        torch.testing.assert_close(net[i].bias, expected[i].bias)
    x, _ = next(iter(data))
    torch.testing.assert_close(net(x), expected(x))


def test_accumulate_grad_batches_matches_lars_by_hand(tmp_path: Path) -> None:
    net, data = ref.mlp(), loader(batch_size=4)
    expected = copy.deepcopy(net)
    module = Regression(net, sgd, GradientLARS(weight_decay=WEIGHT_DECAY).attach)
    fit(module, data, tmp_path, accumulate_grad_batches=2)

    optimizer = torch.optim.SGD(expected.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(2):
        batches = list(data)
        for first, second in zip(batches[::2], batches[1::2], strict=True):
            optimizer.zero_grad()
            for x, y in (first, second):
                (ref.loss_of(expected, x, y) / 2).backward()
            lars_by_hand(expected)  # once, on the accumulated gradient
            optimizer.step()
    assert_parameters_close(net, expected)


def test_gradient_clip_val_clips_before_the_hook(tmp_path: Path) -> None:
    net, data = ref.mlp(), loader()
    clip = 0.05

    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=LR)

    def by_hand(clip_first: bool) -> nn.Module:
        model = copy.deepcopy(net)
        optimizer = make_optimizer(model)
        for _ in range(2):
            for x, y in data:
                optimizer.zero_grad()
                ref.loss_of(model, x, y).backward()
                if clip_first:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                ref.agc_(list(model.parameters()))
                if not clip_first:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
        return model

    expected, other_order = by_hand(clip_first=True), by_hand(clip_first=False)
    module = Regression(net, make_optimizer, AdaptiveGradientClipping().attach)
    fit(module, data, tmp_path, gradient_clip_val=clip)
    assert_parameters_close(net, expected)
    with pytest.raises(AssertionError):
        assert_parameters_close(net, other_order)


# The resumed run writes its checkpoints next to those it resumes from.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_checkpoint_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    data = loader()

    def module() -> Regression:
        return Regression(ref.mlp(), sgd, GradientLARS(weight_decay=WEIGHT_DECAY).attach)

    uninterrupted = module()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    fit(uninterrupted, data, tmp_path, callbacks=[checkpoints], enable_checkpointing=True)
    [first_epoch] = (tmp_path / "ckpt").glob("epoch=0-*.ckpt")

    resumed = module()  # its initial weights are overwritten by the checkpoint's
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    fit(
        resumed,
        data,
        tmp_path,
        callbacks=[checkpoints],
        enable_checkpointing=True,
        ckpt_path=first_epoch,
    )
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class RecordGradients(L.Callback):
    """The gradients ``on_before_optimizer_step`` sees, and those left after the step."""

    def __init__(self) -> None:
        self.before: list[Tensor] = []
        self.after: list[Tensor] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.before = [p.grad.clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.after = [p.grad.clone() for p in pl_module.parameters()]


def test_on_before_optimizer_step_sees_the_gradients_before_the_hook(tmp_path: Path) -> None:
    net, data = ref.mlp(), loader()
    expected = copy.deepcopy(net)
    record = RecordGradients()
    module = Regression(net, sgd, GradientLARS(weight_decay=WEIGHT_DECAY).attach)
    fit(module, data, tmp_path, max_steps=1, callbacks=[record])

    x, y = next(iter(data))
    ref.loss_of(expected, x, y).backward()
    raw = [p.grad.clone() for p in expected.parameters()]
    lars_by_hand(expected)
    for seen, grad in zip(record.before, raw, strict=True):
        torch.testing.assert_close(seen, grad)
    for seen, param in zip(record.after, expected.parameters(), strict=True):
        torch.testing.assert_close(seen, param.grad)


class AttachTwice(L.Callback):
    def __init__(self, wrapper_first: bool) -> None:
        self.wrapper_first = wrapper_first

    def on_train_start(self, trainer: Any, pl_module: L.LightningModule) -> None:
        targets = [pl_module.optimizers(), trainer.optimizers[0]]
        for target in targets if self.wrapper_first else targets[::-1]:
            GradientLARS(weight_decay=WEIGHT_DECAY).attach(target)


@pytest.mark.parametrize("wrapper_first", [True, False], ids=["wrapper-first", "optimizer-first"])
def test_second_lars_through_the_lightning_optimizer_is_refused(
    wrapper_first: bool, tmp_path: Path
) -> None:
    # self.optimizers() wraps trainer.optimizers[0] and shares its step hooks: a GradientLARS
    # attached through each would scale every gradient twice.
    net = ref.mlp()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(RuntimeError, match="already attached"):
        fit(Regression(net, sgd), loader(), tmp_path, callbacks=[AttachTwice(wrapper_first)])
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name])
