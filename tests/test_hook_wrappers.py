"""The hooks on the optimizer objects that frameworks hand over: Lightning's and accelerate's
wrappers, and optimizers that wrap another one (SAM-style two-pass optimizers, Lookahead).
What every hook does with them (unwrapping, refusing SAM and optimizers whose step runs no
hooks) is in test_hook_contract.py; here, the frameworks themselves and the wrappers' steps.

References are written out by hand: LARS on plain SGD (no momentum) is
``w <- w - lr * ||w|| / (eps + ||g||) * g`` per tensor where ``||w|| > threshold``, and so is
TrustRatio on it (with its defaults, threshold and eps 0: the update's direction is ``g``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from normhooks import AdaptiveGradientClipping, GradientLARS, TrustRatio

LR = 0.1
EPS = 1e-9


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def batches(count: int = 3) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator))
        for _ in range(count)
    ]


def loss_of(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def rated_sgd_reference(
    model: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    threshold: float = 1e-2,
    eps: float = EPS,
    lr: float = LR,
) -> list[Tensor]:
    """Plain SGD with the rate ||w|| / (eps + ||g||) of every tensor, by hand in float64."""
    for batch in data:
        model.zero_grad()
        loss_of(model, batch).backward()
        with torch.no_grad():
            for param in model.parameters():
                w_norm = param.double().norm()
                rate = w_norm / (eps + param.grad.double().norm()) if w_norm > threshold else 1.0
                param.sub_((lr * rate * param.grad.double()).to(param.dtype))
    return [p.detach().clone() for p in model.parameters()]


# --- Lightning's LightningOptimizer ----------------------------------------------------------


def lightning_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    wrapper: torch.optim.Optimizer = LightningOptimizer(optimizer)  # type: ignore[assignment]
    return wrapper


@pytest.mark.parametrize("wrapped_first", [True, False], ids=["wrapper-first", "optimizer-first"])
def test_a_second_hook_through_lightnings_wrapper_is_refused(wrapped_first: bool) -> None:
    """LightningOptimizer forwards its attributes, so both hooks would land in one hook dict
    and scale twice (what ``self.optimizers()`` and ``trainer.optimizers[0]`` return)."""
    optimizer = torch.optim.SGD(make_model().parameters(), lr=LR)
    wrapper = lightning_optimizer(optimizer)
    first, second = (wrapper, optimizer) if wrapped_first else (optimizer, wrapper)
    GradientLARS().attach(first)
    with pytest.raises(RuntimeError, match=r"another GradientLARS .* two would apply LARS twice"):
        GradientLARS().attach(second)


def test_the_same_hook_through_lightnings_wrapper_is_refused() -> None:
    optimizer = torch.optim.SGD(make_model().parameters(), lr=LR)
    hook = GradientLARS()
    hook.attach(lightning_optimizer(optimizer))
    with pytest.raises(RuntimeError, match="this GradientLARS is already attached"):
        hook.attach(optimizer)


def test_a_hook_dict_shared_by_an_unknown_wrapper_is_refused_too() -> None:
    """Any wrapper that forwards its attributes shares the optimizer's hook dict."""

    class Forwarding(torch.optim.SGD):
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.__dict__["_inner"], name)

    optimizer = torch.optim.SGD(make_model().parameters(), lr=LR)
    AdaptiveGradientClipping().attach(Forwarding(optimizer))
    with pytest.raises(RuntimeError, match="another AdaptiveGradientClipping"):
        AdaptiveGradientClipping().attach(optimizer)


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_lightning_trainer_with_the_hook_attached_through_optimizers() -> None:
    """A real Trainer: the hook attached to ``self.optimizers()`` in ``on_train_start``
    trains as plain SGD with the LARS rates written by hand."""
    import lightning.pytorch as pl

    data = batches()
    model = make_model()
    expected = rated_sgd_reference(copy.deepcopy(model), data)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
            return loss_of(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def on_train_start(self) -> None:
            GradientLARS().attach(self.optimizers())  # type: ignore[arg-type]

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dataset = torch.utils.data.TensorDataset(
        torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    )
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(dataset, batch_size=8))
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got, want)


# --- accelerate's AcceleratedOptimizer -------------------------------------------------------


@pytest.fixture
def accelerator() -> Iterator[Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_a_second_hook_through_accelerates_optimizer_is_refused(accelerator: Any) -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    _, optimizer = accelerator.prepare(model, inner)
    GradientLARS().attach(optimizer)
    with pytest.raises(RuntimeError, match="another GradientLARS"):
        GradientLARS().attach(inner)


# --- optimizers that wrap another one --------------------------------------------------------


def test_the_technique_on_lookahead_after_its_optimizer_is_refused_at_attach() -> None:
    """Lookahead's step steps its ``.optimizer``: a hook on each would scale twice."""
    from pytorch_optimizer import Lookahead

    inner = torch.optim.SGD(make_model().parameters(), lr=LR)
    outer = Lookahead(inner, k=2)
    GradientLARS().attach(inner)
    with pytest.raises(RuntimeError, match="the two would apply LARS twice"):
        GradientLARS().attach(outer)


def test_the_technique_on_lookaheads_optimizer_after_lookahead_is_refused_at_the_step() -> None:
    """Attaching to the inner optimizer cannot see the outer one: the outer hook's step does,
    before any gradient changes."""
    from pytorch_optimizer import Lookahead

    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    outer = Lookahead(inner, k=2)
    GradientLARS().attach(outer)
    GradientLARS().attach(inner)
    loss_of(model, batches(1)[0]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="is attached to the SGD that Lookahead wraps"):
        outer.step()
    for param, grad in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


def test_gradient_hooks_on_lookahead_scale_the_gradients_its_optimizer_steps_with() -> None:
    """Lookahead with k larger than the steps taken is its inner optimizer's trajectory."""
    from pytorch_optimizer import Lookahead

    data = batches()
    model = make_model()
    expected = rated_sgd_reference(copy.deepcopy(model), data)
    optimizer = Lookahead(torch.optim.SGD(model.parameters(), lr=LR), k=len(data) + 1)
    GradientLARS().attach(optimizer)
    for batch in data:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got, want)


# --- SAM-style two-pass optimizers -----------------------------------------------------------

RHO = 0.05


def sam_lars_reference(model: nn.Module, data: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """SAM (Foret et al. 2021) with SGD and LARS on its base step, written out in float64:
    perturb by rho * g / (||g|| + 1e-12) with the global gradient norm, take the gradient
    there, restore the weights and step with the LARS rate of that gradient."""
    params = list(model.parameters())
    for batch in data:
        model.zero_grad()
        loss_of(model, batch).backward()
        with torch.no_grad():
            norm = torch.stack([p.grad.double().norm() for p in params]).norm() + 1e-12
            old = [p.detach().clone() for p in params]
            for param in params:
                param.add_((RHO / norm * param.grad.double()).to(param.dtype))
        model.zero_grad()
        loss_of(model, batch).backward()
        with torch.no_grad():
            for param, start in zip(params, old, strict=True):
                w_norm = start.double().norm()
                rate = w_norm / (EPS + param.grad.double().norm()) if w_norm > 1e-2 else 1.0
                param.copy_(start - (LR * rate * param.grad.double()).to(param.dtype))
    return [p.detach().clone() for p in params]


def test_lars_on_sams_base_optimizer_is_sam_with_lars_on_the_second_gradients() -> None:
    from pytorch_optimizer import SAM

    data = batches()
    model = make_model()
    expected = sam_lars_reference(copy.deepcopy(model), data)
    optimizer = SAM(model.parameters(), torch.optim.SGD, rho=RHO, lr=LR)
    GradientLARS().attach(optimizer.base_optimizer)
    for batch in data:

        def closure(batch: tuple[Tensor, Tensor] = batch) -> Tensor:
            optimizer.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            return loss

        closure()
        optimizer.step(closure)
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got, want)


def closure_for(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], Tensor]:
    batch = batches(1)[0]

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        return loss

    return closure


def test_bayesian_sam_is_told_why_the_closure_cannot_serve_it() -> None:
    """pytorch_optimizer's BSAM has no base_optimizer and calls its closure twice, each
    time after moving the parameters."""
    from pytorch_optimizer import BSAM

    model = make_model()
    optimizer = BSAM(model.parameters(), num_data=8, lr=LR)
    GradientLARS().attach(optimizer)
    with pytest.raises(RuntimeError, match="BSAM changed the parameters and then called"):
        optimizer.step(closure_for(model, optimizer))


def test_trust_ratio_on_lookahead_is_refused_with_a_pointer_to_its_optimizer() -> None:
    """Lookahead moves the weights after its optimizer's step: TrustRatio would rescale that."""
    from pytorch_optimizer import Lookahead

    optimizer = Lookahead(torch.optim.SGD(make_model().parameters(), lr=LR))
    with pytest.raises(TypeError, match=r"steps the SGD it wraps .*optimizer\.optimizer"):
        TrustRatio().attach(optimizer)


def test_trust_ratio_on_lookaheads_optimizer_is_lookahead_of_the_rescaled_steps() -> None:
    """Lookahead(k=2, alpha=0.5) written out around trust-ratio SGD (ratio ||w|| / ||g||)."""
    from pytorch_optimizer import Lookahead

    data = batches(4)
    model = make_model()
    reference = copy.deepcopy(model)
    optimizer = Lookahead(torch.optim.SGD(model.parameters(), lr=LR), k=2, alpha=0.5)
    TrustRatio().attach(optimizer.optimizer)
    slow = [p.detach().clone() for p in reference.parameters()]
    for step, batch in enumerate(data, start=1):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
        rated_sgd_reference(reference, [batch], threshold=0.0, eps=0.0)
        if step % 2 == 0:
            with torch.no_grad():
                for param, anchor in zip(reference.parameters(), slow, strict=True):
                    param.copy_(anchor + 0.5 * (param - anchor))
                    anchor.copy_(param)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
