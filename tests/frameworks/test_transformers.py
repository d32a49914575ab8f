"""normhooks inside the Hugging Face Trainer (on accelerate), against plain torch by hand.

Each test trains for a few steps with ``Trainer.train`` (sequential batches, no logging, no
progress bar, on the CPU), then trains a copy of the model in a plain loop that does what the
Trainer does (the loss divided for accumulation, ``max_grad_norm`` clipping, the scheduler's
step after the optimizer's) with the technique's formula from ``reference``.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from frameworks import reference as ref
from normhooks import AdaptiveGradientClipping, GradientLARS, TrustRatio, lars_param_groups

LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
BATCH = 8


class Regressor(nn.Module):
    """A model as the Trainer expects one: a forward that takes the labels and returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ref.mlp()

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def samples(n: int = 24, scale: float = 1.0) -> list[dict[str, Tensor]]:
    x, y = ref.regression_data(n, scale=scale)
    return [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]


def batches(data: list[dict[str, Tensor]], size: int) -> list[tuple[Tensor, Tensor]]:
    """The Trainer's batches under train_sampling_strategy="sequential", in order."""
    return [
        (
            torch.stack([s["x"] for s in data[i : i + size]]),
            torch.stack([s["labels"] for s in data[i : i + size]]),
        )
        for i in range(0, len(data), size)
    ]


def arguments(output_dir: Path, **options: Any) -> TrainingArguments:
    defaults: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": 6,
        "per_device_train_batch_size": BATCH,
        "train_sampling_strategy": "sequential",
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
        "remove_unused_columns": False,
        "dataloader_pin_memory": False,
    }
    return TrainingArguments(**(defaults | options))


def lars_sgd(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(lars_param_groups(model), lr=LR, momentum=MOMENTUM)
    GradientLARS(weight_decay=WEIGHT_DECAY).attach(optimizer)
    return optimizer


def lars_by_hand(model: nn.Module) -> None:
    ref.lars_([p for p in model.parameters() if p.ndim > 1], weight_decay=WEIGHT_DECAY)


def assert_parameters_close(actual: nn.Module, expected: nn.Module) -> None:
    for a, b in zip(actual.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def tiny_llama() -> LlamaForCausalLM:
    # No biases: an attention key bias has a zero gradient in exact arithmetic (softmax
    # ignores a shift shared by all keys), and Adam would turn its rounding noise into steps.
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8,
    )
    return LlamaForCausalLM(config)


def test_optimizers_argument_with_a_causal_lm_matches_lamb_by_hand(tmp_path: Path) -> None:
    model = tiny_llama()
    expected = copy.deepcopy(model)
    tokens = torch.randint(32, (12, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]

    def groups(m: nn.Module) -> list[dict[str, Any]]:
        params = list(m.parameters())
        return [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "trust": False},
        ]

    def warmup(step: int) -> float:
        return min(1.0, (step + 1) / 3)

    optimizer = torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=1e-2)
    TrustRatio().attach(optimizer)  # AdamW + TrustRatio: LAMB
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path, per_device_train_batch_size=4),
        train_dataset=data,
        optimizers=(optimizer, scheduler),
    )
    trainer.train()

    expected.train()
    optimizer = torch.optim.AdamW(groups(expected), lr=1e-2, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    trust = ref.TrustRatioByHand([p for p in expected.parameters() if p.ndim > 1])
    for _ in range(2):
        for i in range(0, len(tokens), 4):
            optimizer.zero_grad()
            expected(input_ids=tokens[i : i + 4], labels=tokens[i : i + 4]).loss.backward()
            lr = optimizer.param_groups[0]["lr"]
            trust.before()
            optimizer.step()
            trust.after(lr)
            scheduler.step()
    assert_parameters_close(model, expected)


def lars_groups_(optimizer: torch.optim.Optimizer) -> None:
    """The Trainer's no-decay group (biases, norm layers) opts out of LARS; the decay of the
    other moves into the hook, which scales it with the gradient."""
    for group in optimizer.param_groups:
        if group["weight_decay"] == 0:
            group["lars"] = False
        else:
            group["lars_weight_decay"], group["weight_decay"] = group["weight_decay"], 0.0


class AttachLARS(TrainerCallback):
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs["optimizer"]  # accelerate's AcceleratedOptimizer, after prepare
        lars_groups_(optimizer)
        GradientLARS().attach(optimizer)


class LARSTrainer(Trainer):
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:  # the Trainer calls this again on a second train()
            super().create_optimizer(model)
            lars_groups_(self.optimizer)
            GradientLARS().attach(self.optimizer)
        return self.optimizer


@pytest.mark.parametrize("where", ["callback-on_train_begin", "create_optimizer"])
def test_trainers_own_optimizer_matches_lars_by_hand(where: str, tmp_path: Path) -> None:
    model, data = Regressor(), samples()
    expected = copy.deepcopy(model)
    args = arguments(
        tmp_path,
        optim="sgd",
        optim_args=f"momentum={MOMENTUM}",
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
    )
    if where == "create_optimizer":
        LARSTrainer(model=model, args=args, train_dataset=data).train()
    else:
        Trainer(model=model, args=args, train_dataset=data, callbacks=[AttachLARS()]).train()

    optimizer = torch.optim.SGD(expected.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(2):
        for x, y in batches(data, BATCH):
            optimizer.zero_grad()
            expected(x, y)["loss"].backward()
            lars_by_hand(expected)
            optimizer.step()
    assert_parameters_close(model, expected)


def test_gradient_accumulation_steps_matches_lars_by_hand(tmp_path: Path) -> None:
    model, data = Regressor(), samples()
    expected = copy.deepcopy(model)
    args = arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    Trainer(model=model, args=args, train_dataset=data, optimizers=(lars_sgd(model), None)).train()

    optimizer = torch.optim.SGD(expected.parameters(), lr=LR, momentum=MOMENTUM)
    pieces = batches(data, 4)
    for _ in range(2):
        for first, second in zip(pieces[::2], pieces[1::2], strict=True):
            optimizer.zero_grad()
            for x, y in (first, second):
                (expected(x, y)["loss"] / 2).backward()
            lars_by_hand(expected)  # once, on the accumulated gradient
            optimizer.step()
    assert_parameters_close(model, expected)


def test_max_grad_norm_clips_before_the_hook(tmp_path: Path) -> None:
    # The Trainer clips every step unless max_grad_norm=0, before the optimizer's step and so
    # before any hook. AGC's result for a unit it clips does not depend on the gradient's scale:
    # the global clipping shows in the units AGC leaves alone, which clipping=0.4 makes many.
    assert {f.name: f.default for f in dataclasses.fields(TrainingArguments)}[
        "max_grad_norm"
    ] == 1.0
    model, data = Regressor(), samples(scale=5.0)

    def by_hand(clip_first: bool) -> nn.Module:
        copied = copy.deepcopy(model)
        optimizer = torch.optim.SGD(copied.parameters(), lr=LR)
        for _ in range(2):
            for x, y in batches(data, BATCH):
                optimizer.zero_grad()
                copied(x, y)["loss"].backward()
                if clip_first:
                    torch.nn.utils.clip_grad_norm_(copied.parameters(), 1.0)
                ref.agc_(list(copied.parameters()), clipping=0.4)
                if not clip_first:
                    torch.nn.utils.clip_grad_norm_(copied.parameters(), 1.0)
                optimizer.step()
        return copied

    expected, other_order = by_hand(clip_first=True), by_hand(clip_first=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    AdaptiveGradientClipping(clipping=0.4).attach(optimizer)
    args = arguments(tmp_path, max_grad_norm=1.0)
    Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None)).train()
    assert_parameters_close(model, expected)
    with pytest.raises(AssertionError):
        assert_parameters_close(model, other_order)


class RecordGradients(TrainerCallback):
    """The gradients ``on_pre_optimizer_step`` sees, and those ``on_optimizer_step`` sees."""

    def __init__(self) -> None:
        self.before: list[Tensor] = []
        self.after: list[Tensor] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.before = [p.grad.clone() for p in kwargs["model"].parameters()]

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.after = [p.grad.clone() for p in kwargs["model"].parameters()]


def test_callbacks_see_the_gradients_before_and_after_the_hook(tmp_path: Path) -> None:
    model, data = Regressor(), samples()
    expected = copy.deepcopy(model)
    record = RecordGradients()
    args = arguments(tmp_path, max_steps=1)
    optimizers = (lars_sgd(model), None)
    trainer = Trainer(
        model=model, args=args, train_dataset=data, optimizers=optimizers, callbacks=[record]
    )
    trainer.train()

    x, y = batches(data, BATCH)[0]
    expected(x, y)["loss"].backward()
    raw = [p.grad.clone() for p in expected.parameters()]
    lars_by_hand(expected)
    for seen, grad in zip(record.before, raw, strict=True):
        torch.testing.assert_close(seen, grad)
    for seen, param in zip(record.after, expected.parameters(), strict=True):
        torch.testing.assert_close(seen, param.grad)


def test_resume_from_checkpoint_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    data = samples()

    def train(output_dir: Path, resume: Path | None = None) -> nn.Module:
        model = Regressor()  # a resumed run's initial weights are the checkpoint's
        args = arguments(output_dir, save_strategy="steps", save_steps=3)
        trainer = Trainer(
            model=model, args=args, train_dataset=data, optimizers=(lars_sgd(model), None)
        )
        trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
        return model

    uninterrupted = train(tmp_path / "first")
    resumed = train(tmp_path / "resumed", resume=tmp_path / "first" / "checkpoint-3")
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
