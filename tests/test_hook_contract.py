"""The contract every normhooks step hook keeps, run over each of them.

Like optax's one test over all optimizers: the hooks of tests/hook_kinds.py, each with its
technique written out by hand in float64, and the behaviours they share: attaching and
removing, param groups (opt-out, overrides, groups added or edited later, what each step must
see again), closures, GradScaler with fused and plain optimizers, dtypes and ``foreach``
modes, refusals, framework wrappers, ``torch.compile`` and no host sync. What is one
technique's own (its maths, its settings' checks) is in its test file; FSDP2 against one
process is in tests/test_distributed.py, over the same kinds.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_close_rel, assert_compiled_training_matches_eager
from helpers import assert_grad_scaler_matches_unscaled as scaled_matches_unscaled
from hook_kinds import KINDS, ON_GRADIENTS, Kind
from normhooks._step_hook import StepHook

LR = 0.1
# A matrix, a vector, a convolution's weight and a scalar-like vector: rows and whole tensors.
SHAPES = [(6, 5), (5,), (3, 4, 2, 2), (3,)]

every_kind = pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
gradient_kinds = pytest.mark.parametrize(
    "kind", list(ON_GRADIENTS.values()), ids=list(ON_GRADIENTS)
)
functional_kinds = pytest.mark.parametrize(
    "kind",
    [kind for kind in KINDS.values() if kind.functional],
    ids=[name for name, kind in KINDS.items() if kind.functional],
)
valued_kinds = pytest.mark.parametrize(
    "kind",
    [kind for kind in KINDS.values() if kind.values],
    ids=[name for name, kind in KINDS.items() if kind.values],
)


def make_params(
    dtype: torch.dtype = torch.float64, seed: int = 0, shapes: list[tuple[int, ...]] = SHAPES
) -> list[nn.Parameter]:
    """Parameters with gradients of about a third of their size: AGC clips some units."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64))
        param.grad = 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
        params.append(nn.Parameter(param.detach().to(dtype)))
        params[-1].grad = param.grad.to(dtype)
    return params


def snapshot(params: list[nn.Parameter]) -> list[tuple[Tensor, Tensor]]:
    return [(p.detach().clone(), p.grad.clone()) for p in params]


def assert_stepped(
    kind: Kind,
    params: list[nn.Parameter],
    before: list[tuple[Tensor, Tensor]],
    lr: float = LR,
    rel: float = 1e-10,
    **settings: Any,
) -> None:
    """Each parameter is one SGD(lr) step with the hook from its values in ``before``."""
    for param, (w, g) in zip(params, before, strict=True):
        assert_close_rel(param.detach().double(), kind.stepped(w, g, lr, **settings), rel)


def hooked_sgd(
    kind: Kind, params: list[nn.Parameter], foreach: bool | None = None
) -> torch.optim.SGD:
    """SGD(lr) over ``params`` with the kind's hook attached, both with ``foreach``."""
    optimizer = torch.optim.SGD(params, lr=LR, foreach=foreach)
    kind.make(foreach=foreach).attach(optimizer)
    return optimizer


def stepped_once(
    kind: Kind, params: list[nn.Parameter], foreach: bool | None = None
) -> torch.optim.SGD:
    """:func:`hooked_sgd` after one step: planned, so that what changes next must be seen by
    the plan."""
    optimizer = hooked_sgd(kind, params, foreach)
    optimizer.step()
    return optimizer


def assert_next_step_served(
    kind: Kind,
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    lr: float = LR,
    rel: float = 1e-10,
    **settings: Any,
) -> None:
    """The next step moves each of ``params`` as one SGD(lr) step with the hook does."""
    before = snapshot(params)
    optimizer.step()
    assert_stepped(kind, params, before, lr, rel, **settings)


def assert_plain_sgd(
    params: list[nn.Parameter], before: list[tuple[Tensor, Tensor]], lr: float = LR
) -> None:
    for param, (w, g) in zip(params, before, strict=True):
        torch.testing.assert_close(param.detach(), w.add(g, alpha=-lr), rtol=0, atol=0)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 2e-5


# --- attaching and stepping ------------------------------------------------------------------


@every_kind
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_one_sgd_step_is_the_formula(kind: Kind, dtype: torch.dtype) -> None:
    params = make_params(dtype)
    optimizer = hooked_sgd(kind, params)
    assert_next_step_served(kind, optimizer, params, rel=tolerance(dtype))


@every_kind
@pytest.mark.parametrize("foreach", [None, True, False], ids=["auto", "foreach", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_every_foreach_mode_is_the_formula(
    kind: Kind, foreach: bool | None, dtype: torch.dtype
) -> None:
    # 70 x 70 is above the size the CPU norms take in one multi-tensor call.
    params = make_params(dtype, shapes=[*SHAPES, (70, 70)])
    optimizer = hooked_sgd(kind, params, foreach)
    assert_next_step_served(kind, optimizer, params, rel=tolerance(dtype))


@gradient_kinds
@pytest.mark.parametrize("foreach", [None, True, False], ids=["auto", "foreach", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_precision_is_computed_in_float32_and_rounded_once(
    kind: Kind, foreach: bool | None, dtype: torch.dtype
) -> None:
    params = make_params(dtype, shapes=[(6, 5), (7,), (70, 70)])
    before = snapshot(params)
    optimizer = torch.optim.SGD(params, lr=0.0)
    hook = kind.make(foreach=foreach)
    hook.attach(optimizer)
    optimizer.step()
    for param, (w, g) in zip(params, before, strict=True):
        expected = kind.gradient(w, g, 0.0, **kind.settings).to(dtype)  # type: ignore[misc]
        # Rounded once from float32: within one unit in the last place of the float64 result.
        ulp = torch.finfo(dtype).eps * expected.float().abs().max().item()
        torch.testing.assert_close(param.grad.float(), expected.float(), rtol=0, atol=ulp)
    if kind.values:
        assert getattr(hook, kind.values)[0].dtype == torch.float32


@every_kind
def test_parameters_of_two_dtypes_in_one_group(kind: Kind) -> None:
    params = make_params(torch.float64)
    params[1] = nn.Parameter(params[1].detach().float())
    params[1].grad = torch.randn(params[1].shape)
    before = snapshot(params)
    optimizer = torch.optim.SGD(params, lr=LR, foreach=False)
    hook = kind.make()
    hook.attach(optimizer)
    optimizer.step()
    for param, (w, g) in zip(params, before, strict=True):
        rel = tolerance(param.dtype)
        assert_close_rel(param.detach().double(), kind.stepped(w, g, LR), rel)
    if kind.values:
        (values,) = getattr(hook, kind.values)
        assert values.dtype == torch.float64
        expected = [kind.expected_value(w, g, LR) for w, g in before]
        torch.testing.assert_close(
            values, torch.tensor(expected, dtype=torch.float64), rtol=2e-6, atol=0
        )


@valued_kinds
def test_the_values_of_the_last_step_per_group_in_parameter_order(kind: Kind) -> None:
    params = make_params()
    params[2].grad = None
    before = snapshot([p for p in params if p.grad is not None])
    optimizer = torch.optim.SGD(
        [{"params": params[:3]}, {"params": params[3:], kind.prefix: False}], lr=LR
    )
    hook = kind.make()
    assert getattr(hook, kind.values) == []
    hook.attach(optimizer)
    optimizer.step()
    values = getattr(hook, kind.values)
    expected = [kind.expected_value(w, g, LR) for w, g in before[:2]]
    assert [v.shape for v in values] == [(2,), (0,)]
    torch.testing.assert_close(
        values[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=0
    )


@every_kind
def test_parameters_without_a_gradient_are_left_alone(kind: Kind) -> None:
    params = make_params()
    params[0].grad = None
    untouched = params[0].detach().clone()
    assert_next_step_served(kind, hooked_sgd(kind, params), params[1:])
    assert params[0].grad is None
    torch.testing.assert_close(params[0].detach(), untouched, rtol=0, atol=0)


@functional_kinds
def test_the_functional_form_takes_a_tensor_or_an_iterable_and_skips_missing_gradients(
    kind: Kind,
) -> None:
    params = make_params()
    params[1].grad = None
    before = snapshot([params[0], *params[2:]])
    values = kind.functional(p for p in params)  # type: ignore[misc]
    assert params[1].grad is None
    for param, (w, g) in zip([params[0], *params[2:]], before, strict=True):
        assert_close_rel(param.grad.double(), kind.gradient(w, g, 0.0), 1e-10)  # type: ignore[misc]
    single = make_params(seed=1)[0]
    w, g = single.detach().clone(), single.grad.clone()
    one = kind.functional(single)  # type: ignore[misc]
    assert_close_rel(single.grad.double(), kind.gradient(w, g, 0.0), 1e-10)  # type: ignore[misc]
    if kind.values:
        assert values.shape == (3,)
        assert one.shape == (1,)
        assert kind.functional(nn.Parameter(torch.ones(2))).shape == (0,)  # type: ignore[misc]


@every_kind
def test_the_settings_are_read_only_attributes_and_make_the_repr(kind: Kind) -> None:
    hook = kind.make()
    _, value, name = kind.override
    changed = kind.make(**{name: value})
    assert getattr(changed, name) == value
    fields = dataclasses.fields(hook)
    expected = ", ".join(f"{f.name}={getattr(hook, f.name)!r}" for f in fields)
    assert repr(hook) == f"{kind.hook.__name__}({expected})"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(hook, name, value)
    assert hook.foreach is None


@every_kind
def test_removing_the_handle_restores_the_plain_optimizer(kind: Kind) -> None:
    params = make_params()
    before = snapshot(params)
    optimizer = torch.optim.SGD(params, lr=LR)
    kind.make().attach(optimizer).remove()
    optimizer.step()
    assert_plain_sgd(params, before)
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks


@every_kind
def test_a_hook_attaches_again_after_its_removal_and_to_two_optimizers(kind: Kind) -> None:
    first, second = make_params(seed=1), make_params(seed=2)
    hook = kind.make()
    optimizer = torch.optim.SGD(first, lr=LR)
    hook.attach(optimizer).remove()
    hook.attach(optimizer)
    other = torch.optim.SGD(second, lr=LR)
    hook.attach(other)
    before = snapshot(first) + snapshot(second)
    optimizer.step()
    other.step()
    assert_stepped(kind, first + second, before)


class PlainSGD(torch.optim.Optimizer):
    """An optimizer from "another library": a minimal subclass."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


@every_kind
def test_a_third_party_optimizer_subclass(kind: Kind) -> None:
    params = make_params()
    optimizer = PlainSGD(params, lr=LR)
    kind.make().attach(optimizer)
    assert_next_step_served(kind, optimizer, params)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd-nesterov-loop": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, foreach=False
    ),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}


@gradient_kinds
@pytest.mark.parametrize("make_optimizer", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
def test_on_the_gradients_any_optimizer_steps_with_the_rewritten_gradients(
    kind: Kind, make_optimizer: Callable[[Any], torch.optim.Optimizer]
) -> None:
    """Three steps: the hook equals the same optimizer fed the formula's gradients."""
    params, plain = make_params(seed=3), make_params(seed=3)
    optimizer, plain_optimizer = make_optimizer(params), make_optimizer(plain)
    kind.make().attach(optimizer)
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        for param, twin in zip(params, plain, strict=True):
            grad = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            param.grad = grad.clone()
            twin.grad = kind.gradient(twin.detach(), grad, LR, **kind.settings)  # type: ignore[misc]
        optimizer.step()
        plain_optimizer.step()
    for got, want in zip(params, plain, strict=True):
        assert_close_rel(got.detach(), want.detach(), 1e-10)


@every_kind
def test_the_optimizers_state_dict_is_untouched_and_resumes(kind: Kind) -> None:
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    plain_keys = torch.optim.SGD(make_params(), lr=LR, momentum=0.9).state_dict()
    kind.make().attach(optimizer)
    optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    assert [sorted(g) for g in state["param_groups"]] == [
        sorted(g) for g in plain_keys["param_groups"]
    ]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = torch.optim.SGD(twins, lr=LR, momentum=0.9)
    resumed.load_state_dict(state)
    kind.make().attach(resumed)
    for param, twin in zip(params, twins, strict=True):
        twin.grad = param.grad.clone()
    optimizer.step()
    resumed.step()
    for a, b in zip(params, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@every_kind
def test_an_lr_scheduler_drives_the_lr_the_hook_reads(kind: Kind) -> None:
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=LR)
    kind.make().attach(optimizer)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    for lr in (LR, LR / 2, LR / 4):
        before = snapshot(params)
        optimizer.step()
        scheduler.step()
        assert_stepped(kind, params, before, lr=lr)


# --- param groups ----------------------------------------------------------------------------


@every_kind
def test_a_group_opts_out_and_a_group_overrides_a_setting(kind: Kind) -> None:
    params = make_params()
    key, value, name = kind.override
    optimizer = torch.optim.SGD(
        [
            {"params": params[:2], key: value},
            {"params": params[2:3]},
            {"params": params[3:], kind.prefix: False},
        ],
        lr=LR,
    )
    before = snapshot(params)
    kind.make().attach(optimizer)
    optimizer.step()
    assert_stepped(kind, params[:2], before[:2], **{name: value})
    assert_stepped(kind, params[2:3], before[2:3])
    assert_plain_sgd(params[3:], before[3:])
    # The override changes the matrix's step, so the comparisons above tell the groups apart.
    w, g = before[0]
    assert not torch.allclose(kind.stepped(w, g, LR), kind.stepped(w, g, LR, **{name: value}))


@every_kind
def test_a_param_group_added_after_attach_is_served(kind: Kind) -> None:
    first, later = make_params(seed=1)[:2], make_params(seed=2)[2:]
    optimizer = hooked_sgd(kind, first)
    optimizer.add_param_group({"params": later})
    assert_next_step_served(kind, optimizer, first + later)


@every_kind
def test_an_unknown_group_key_and_a_bad_override_are_refused_at_attach(kind: Kind) -> None:
    optimizer = torch.optim.SGD([{"params": make_params(), f"{kind.prefix}_typo": 1.0}], lr=LR)
    with pytest.raises(
        ValueError, match=rf"param group 0: unknown key '{kind.prefix}_typo'; expected one of"
    ):
        kind.make().attach(optimizer)
    key, value, match = kind.bad_override
    optimizer = torch.optim.SGD([{"params": make_params(), key: value}], lr=LR)
    with pytest.raises((TypeError, ValueError), match=match):
        kind.make().attach(optimizer)
    optimizer = torch.optim.SGD([{"params": make_params(), kind.prefix: "no"}], lr=LR)
    with pytest.raises(
        TypeError,
        match=rf'param group 0: "{kind.prefix}" must be a bool, got "{kind.prefix}"=\'no\'',
    ):
        kind.make().attach(optimizer)
    assert not optimizer._optimizer_step_pre_hooks


@every_kind
@pytest.mark.parametrize("bad", ["value", "key"])
def test_a_bad_group_added_later_is_refused_before_the_closure_and_nothing_changes(
    kind: Kind, bad: str
) -> None:
    params = make_params()
    optimizer = torch.optim.SGD(params[:2], lr=LR)
    kind.make().attach(optimizer)
    key, value, match = kind.bad_override
    if bad == "key":
        key, value = f"{kind.prefix}_typo", 1.0
        match = f"param group 1: unknown key '{key}'"
    optimizer.add_param_group({"params": params[2:], key: value})
    before = snapshot(params)
    calls = []

    def closure() -> Tensor:
        calls.append(1)
        return torch.zeros(())

    with pytest.raises((TypeError, ValueError), match=match):
        optimizer.step(closure)
    assert calls == []
    for param, (w, g) in zip(params, before, strict=True):
        assert torch.equal(param.detach(), w)
        assert torch.equal(param.grad, g)


# --- what each step must see again ------------------------------------------------------------


def count_planning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts how often the parameters of a group are checked and grouped."""
    calls: list[int] = []
    original = StepHook._check_params.__func__  # type: ignore[attr-defined]

    def counting(cls: type[StepHook], *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(cls, *args, **kwargs)

    monkeypatch.setattr(StepHook, "_check_params", classmethod(counting))
    return calls


@every_kind
def test_parameters_are_checked_once_while_nothing_changes(
    kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_planning(monkeypatch)
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=LR)
    kind.make().attach(optimizer)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param)  # new gradient tensors, as zero_grad() leaves
        optimizer.step()
    assert calls == [1]


@every_kind
def test_a_parameter_replaced_in_its_group_is_served(kind: Kind) -> None:
    params = make_params()
    optimizer = stepped_once(kind, params)
    replacement = make_params(seed=5)[0]
    optimizer.param_groups[0]["params"][0] = replacement
    served = [replacement, *params[1:]]
    assert_next_step_served(kind, optimizer, served)


@every_kind
def test_gradients_that_appear_and_disappear_are_seen(kind: Kind) -> None:
    params = make_params()
    grads = [p.grad for p in params]
    optimizer = torch.optim.SGD(params, lr=LR)
    hook = kind.make()
    hook.attach(optimizer)
    for present in ([0, 2], [0, 1, 2, 3], [1]):
        for i, param in enumerate(params):
            param.grad = grads[i].clone() if i in present else None
        before = snapshot([params[i] for i in present])
        untouched = [params[i].detach().clone() for i in range(len(params)) if i not in present]
        optimizer.step()
        assert_stepped(kind, [params[i] for i in present], before)
        left = [params[i].detach() for i in range(len(params)) if i not in present]
        for param, old in zip(left, untouched, strict=True):
            assert torch.equal(param, old)
        if kind.values:
            assert getattr(hook, kind.values)[0].shape == (len(present),)


@every_kind
def test_a_gradient_replaced_by_a_new_tensor_is_read(kind: Kind) -> None:
    params = make_params()
    optimizer = stepped_once(kind, params)
    for param in params:
        param.grad = 2.0 * torch.randn_like(param)
    assert_next_step_served(kind, optimizer, params)


@every_kind
def test_a_parameter_moved_with_data_is_served(kind: Kind) -> None:
    """``.data =`` keeps the Parameter object and changes what it holds (here its values and
    its shape): the plan must not serve the old tensor."""
    params = make_params()
    optimizer = stepped_once(kind, params)
    params[0].data = torch.randn(4, 7, dtype=torch.float64)
    params[0].grad = torch.randn(4, 7, dtype=torch.float64)
    assert_next_step_served(kind, optimizer, params)


@every_kind
def test_a_parameter_reshaped_in_its_storage_is_served(kind: Kind) -> None:
    """``.data = p.data.view(...)`` keeps the address and the dtype: only the shape changes."""
    params = make_params()
    optimizer = stepped_once(kind, params)
    for param, shape in zip(params, [(5, 6), (1, 5), (3, 16), (3, 1)], strict=True):
        param.data = param.data.view(shape)
        param.grad = 0.3 * torch.randn(shape, dtype=torch.float64)
    assert_next_step_served(kind, optimizer, params)


@every_kind
def test_a_change_of_dtype_is_seen(kind: Kind) -> None:
    params = make_params(torch.float32)
    optimizer = stepped_once(kind, params, foreach=False)
    for param in params[:2]:  # as module.double() does: the same Parameters, converted
        param.data = param.data.double()
        param.grad = torch.randn_like(param)
    for param in params[2:]:
        param.grad = torch.randn_like(param)
    before = snapshot(params)
    optimizer.step()
    assert [p.dtype for p in params] == [torch.float64] * 2 + [torch.float32] * 2
    for param, (w, g) in zip(params, before, strict=True):
        assert_close_rel(param.detach().double(), kind.stepped(w, g, LR), tolerance(param.dtype))


@every_kind
def test_a_parameter_converted_to_a_dtype_it_refuses_is_refused_at_the_next_step(
    kind: Kind,
) -> None:
    params = make_params()
    optimizer = stepped_once(kind, params)
    params[1].data = params[1].data.to(torch.complex128)
    params[1].grad = None
    with pytest.raises(TypeError, match="parameter 1 of param group 0 must be a real floating"):
        optimizer.step()


@every_kind
def test_a_change_of_device_is_seen(kind: Kind) -> None:
    """Parameters built on the meta device and materialized later in place, as
    ``module.to_empty`` does with ``torch.__future__.set_swap_module_params_on_conversion``."""
    params = [nn.Parameter(torch.empty(s, device="meta", dtype=torch.float64)) for s in SHAPES]
    optimizer = torch.optim.SGD(params, lr=LR)
    kind.make().attach(optimizer)
    for param, source in zip(params, make_params(), strict=True):
        torch.utils.swap_tensors(param, source)
    assert all(p.device.type == "cpu" for p in optimizer.param_groups[0]["params"])
    assert_next_step_served(kind, optimizer, params)


@every_kind
def test_a_changed_override_is_used_and_a_bad_one_refused_at_the_next_step(kind: Kind) -> None:
    params = make_params()
    optimizer = stepped_once(kind, params)
    key, value, name = kind.override
    optimizer.param_groups[0][key] = value
    assert_next_step_served(kind, optimizer, params, **{name: value})
    key, value, match = kind.bad_override
    optimizer.param_groups[0][key] = value
    with pytest.raises((TypeError, ValueError), match=match):
        optimizer.step()


@every_kind
def test_a_changed_lr_is_used(kind: Kind) -> None:
    params = make_params()
    optimizer = stepped_once(kind, params)
    optimizer.param_groups[0]["lr"] = 0.03
    assert_next_step_served(kind, optimizer, params, lr=0.03)


# --- closures ----------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@every_kind
@pytest.mark.parametrize("positional", [True, False], ids=["positional", "keyword"])
def test_a_closure_is_evaluated_once_by_the_hook_with_grad_enabled(
    kind: Kind, positional: bool
) -> None:
    model = mlp()
    twin = copy.deepcopy(model)
    x = torch.randn(16, 5, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=LR, momentum=0.9)
    kind.make().attach(optimizer)
    kind.make().attach(twin_optimizer)
    calls = []

    def closure() -> Tensor:
        calls.append(1)
        optimizer.zero_grad(set_to_none=True)  # no gradient exists before the closure runs
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(3):
        with torch.no_grad():  # the hook must enable grad for the closure itself
            loss = optimizer.step(closure) if positional else optimizer.step(closure=closure)
        twin_optimizer.zero_grad()
        twin_loss = twin(x).square().mean()
        twin_loss.backward()
        twin_optimizer.step()
        torch.testing.assert_close(loss, twin_loss)
    assert calls == [1, 1, 1]
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class TwiceClosureSGD(PlainSGD):
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        assert closure is not None
        with torch.enable_grad():
            closure()
            return closure()


@every_kind
def test_an_optimizer_calling_its_closure_twice_gets_a_clear_error(kind: Kind) -> None:
    model = mlp()
    optimizer = TwiceClosureSGD(model.parameters(), lr=LR)
    kind.make().attach(optimizer)

    def closure() -> Tensor:
        loss = model(torch.ones(2, 5, dtype=torch.float64)).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="TwiceClosureSGD called its closure more than once"):
        optimizer.step(closure)


class TwoPass(torch.optim.Optimizer):
    """A SAM-like optimizer without a base_optimizer: it moves the parameters, calls the
    closure for the gradients there, moves them back and takes an SGD step with those."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]

    def step(self, closure: Callable[[], Tensor] | None = None) -> None:  # type: ignore[override]
        assert closure is not None
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        with torch.no_grad():
            shifts = [0.05 * p.grad for p in params]
            for param, shift in zip(params, shifts, strict=True):
                param.add_(shift)
        with torch.enable_grad():
            closure()
        with torch.no_grad():
            for param, shift in zip(params, shifts, strict=True):
                param.sub_(shift)
                if param.grad is not None:
                    param.sub_(self.param_groups[0]["lr"] * param.grad)


@every_kind
def test_a_closure_called_after_the_parameters_moved_raises(kind: Kind) -> None:
    """Its loss came with no gradients there: the step silently did nothing."""
    model = mlp()
    optimizer = TwoPass(model.parameters(), lr=LR)
    kind.make().attach(optimizer)
    x = torch.randn(8, 5, dtype=torch.float64)

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="TwoPass changed the parameters and then called"):
        optimizer.step(closure)


# --- AMP ---------------------------------------------------------------------------------------


def split_groups(model: nn.Module, prefix: str) -> list[dict[str, Any]]:
    """The weights, and the biases in a group that opts out."""
    return [
        {"params": [p for p in model.parameters() if p.ndim > 1]},
        {"params": [p for p in model.parameters() if p.ndim <= 1], prefix: False},
    ]


def assert_grad_scaler_matches_unscaled(
    kind: Kind, make: Callable[..., torch.optim.Optimizer], fused: bool, foreach: bool | None
) -> None:
    """Three steps through GradScaler equal three plain steps of a copy, both groups (the
    hooked one and the one that opts out) included."""

    def build(fused: bool) -> Callable[[nn.Module], torch.optim.Optimizer]:
        def attached(model: nn.Module) -> torch.optim.Optimizer:
            optimizer = make(split_groups(model, kind.prefix), fused=fused)
            kind.make(foreach=foreach).attach(optimizer)
            return optimizer

        return attached

    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    scaled_matches_unscaled(
        model, torch.randn(16, 5), build(fused), build(False), rtol=1e-5, atol=1e-6
    )


FUSED_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda groups, fused=False: torch.optim.Adam(groups, lr=1e-2, fused=fused),
    "adamw": lambda groups, fused=False: torch.optim.AdamW(
        groups, lr=1e-2, weight_decay=1e-2, fused=fused
    ),
    "sgd": lambda groups, fused=False: torch.optim.SGD(groups, lr=0.1, momentum=0.9, fused=fused),
}


@every_kind
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", list(FUSED_OPTIMIZERS))
def test_grad_scaler_gives_the_unscaled_result(kind: Kind, name: str, fused: bool) -> None:
    assert_grad_scaler_matches_unscaled(kind, FUSED_OPTIMIZERS[name], fused, None)


@every_kind
def test_grad_scaler_with_the_per_tensor_fallback(kind: Kind) -> None:
    assert_grad_scaler_matches_unscaled(kind, FUSED_OPTIMIZERS["adam"], True, False)


def fused_step_with(
    kind: Kind, bad: float | None
) -> tuple[nn.Parameter, torch.optim.Optimizer, float]:
    """One fused Adam step through GradScaler, with ``bad`` in a gradient (or none)."""
    param = nn.Parameter(torch.ones(4, 4))
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    kind.make().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((param * torch.randn(4, 4)).sum()).backward()
    if bad is not None:
        param.grad[0, 0] = bad
    scaler.step(optimizer)
    scaler.update()
    return param, optimizer, scaler.get_scale()


@every_kind
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_non_finite_gradient_skips_the_fused_step_once(kind: Kind, bad: float) -> None:
    """found_inf is raised with a max: 2 would make fused Adam's step count -1."""
    param, optimizer, scale = fused_step_with(kind, bad)
    torch.testing.assert_close(param.detach(), torch.ones(4, 4), rtol=0, atol=0)
    assert optimizer.state[param]["step"].item() == 0
    assert scale == 512.0


@every_kind
def test_a_finite_gradient_takes_the_fused_step(kind: Kind) -> None:
    param, optimizer, scale = fused_step_with(kind, None)
    assert optimizer.state[param]["step"].item() == 1
    assert scale == 1024.0
    assert not torch.equal(param.detach(), torch.ones(4, 4))


@gradient_kinds
def test_the_fused_protocol_keeps_small_half_precision_gradients(kind: Kind) -> None:
    """True gradients below float16's range are unscaled in float32, not in the grad's dtype."""
    param = nn.Parameter(torch.full((2, 6), 0.5, dtype=torch.float16))
    scale = torch.tensor(65536.0)
    # From below float16's smallest subnormal, 6e-8, to a little above, within each row.
    true_grad = torch.linspace(1e-8, 9e-8, 12).view(2, 6)
    param.grad = (true_grad * scale).to(torch.float16)
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.grad_scale = scale  # type: ignore[attr-defined]  # what GradScaler sets
    hook = kind.make()
    hook.attach(optimizer)
    expected = kind.gradient(param.float(), param.grad.float() / scale, 0.1, **kind.settings)  # type: ignore[misc]
    hook._pre_step(optimizer, (optimizer,), {})
    assert optimizer.grad_scale is None  # type: ignore[attr-defined]
    assert expected.abs().max() > 0
    torch.testing.assert_close(param.grad, expected.to(torch.float16), rtol=0, atol=0)


@gradient_kinds
def test_fp16_fused_adam_under_grad_scaler_is_the_float32_formula(kind: Kind) -> None:
    embedding = nn.Embedding(100, 16).half()
    start = embedding.weight.detach().float().clone()
    optimizer = torch.optim.Adam(embedding.parameters(), lr=1e-3, fused=True)
    kind.make().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    scale = scaler.get_scale()
    tokens = torch.randint(0, 100, (64,))
    scaler.scale(embedding(tokens).float().square().mean()).backward()
    true_grad = embedding.weight.grad.float() / scale
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == scale  # the step was not skipped
    expected = nn.Parameter(start.clone())
    rewritten = kind.gradient(start, true_grad, 1e-3, **kind.settings)  # type: ignore[misc]
    expected.grad = rewritten.half().float()  # rounded once to the gradient's dtype
    torch.optim.Adam([expected], lr=1e-3).step()
    torch.testing.assert_close(embedding.weight.detach(), expected.detach().half(), rtol=0, atol=0)


@gradient_kinds
def test_a_bf16_model_trains_like_float32_within_rounding(kind: Kind) -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    low = copy.deepcopy(model).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    low_optimizer = torch.optim.SGD(low.parameters(), lr=LR)
    kind.make().attach(optimizer)
    kind.make().attach(low_optimizer)
    for param, low_param in zip(model.parameters(), low.parameters(), strict=True):
        low_param.grad = torch.randn_like(param).to(torch.bfloat16)
        param.grad = low_param.grad.float()
        with torch.no_grad():
            param.copy_(low_param.float())
    optimizer.step()
    low_optimizer.step()
    for param, low_param in zip(model.parameters(), low.parameters(), strict=True):
        torch.testing.assert_close(low_param.float(), param, rtol=1.6e-2, atol=1e-2)


@every_kind
def test_the_deprecated_grad_scaler_argument_is_refused(kind: Kind) -> None:
    optimizer = torch.optim.SGD(make_params(), lr=LR)
    kind.make().attach(optimizer)
    with pytest.raises(RuntimeError, match="grad_scaler argument"):
        optimizer.step(grad_scaler=object())


@every_kind
def test_an_error_inside_grad_scaler_step_leaves_no_scale_for_the_next_step(kind: Kind) -> None:
    """GradScaler deletes what it set on a fused optimizer only after a step that returns."""
    w, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD(
        [{"params": [w]}, {"params": [b], kind.prefix: False}], lr=1.0, fused=True
    )
    kind.make().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(4, 3)

    def backward() -> None:
        optimizer.zero_grad()
        scaler.scale((x @ w + b).square().mean()).backward()

    key, value, match = kind.bad_override
    optimizer.param_groups[0][key] = value
    backward()
    with pytest.raises((TypeError, ValueError), match=match):
        scaler.step(optimizer)
    assert "grad_scale" not in vars(optimizer)
    del optimizer.param_groups[0][key]
    backward()
    expected = b.detach() - b.grad / 1024.0
    scaler.step(optimizer)
    torch.testing.assert_close(b.detach(), expected)


@every_kind
def test_grad_scaler_with_a_float64_default_dtype(kind: Kind) -> None:
    """The flags made for GradScaler's op are float32 whatever the default dtype."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = nn.Linear(3, 2).float()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        kind.make().attach(optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        scaler.scale(model(torch.randn(4, 3, dtype=torch.float32)).sum()).backward()
        scaler.step(optimizer)
    finally:
        torch.set_default_dtype(default)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- refusals ----------------------------------------------------------------------------------


@every_kind
def test_foreach_must_be_a_bool_or_none(kind: Kind) -> None:
    with pytest.raises(TypeError, match="foreach must be a bool or None, got foreach='yes'"):
        kind.make(foreach="yes")


@functional_kinds
def test_the_functional_forms_foreach_must_be_a_bool_or_none(kind: Kind) -> None:
    params = make_params()
    before = snapshot(params)
    with pytest.raises(TypeError, match="foreach must be a bool or None, got foreach=1"):
        kind.functional(params, foreach=1)  # type: ignore[misc]
    for param, (_, g) in zip(params, before, strict=True):
        assert torch.equal(param.grad, g)


@every_kind
def test_attach_refuses_what_is_not_an_optimizer_and_lbfgs(kind: Kind) -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got list"):
        kind.make().attach([])
    name = kind.hook.__name__
    with pytest.raises(TypeError, match=f"{name} cannot be attached to LBFGS"):
        kind.make().attach(torch.optim.LBFGS(make_params()))


@every_kind
def test_one_hook_of_a_kind_per_optimizer(kind: Kind) -> None:
    params = make_params()
    before = snapshot(params)
    optimizer = torch.optim.SGD(params, lr=LR)
    hook = kind.make()
    first = hook.attach(optimizer)
    name = kind.hook.__name__
    with pytest.raises(RuntimeError, match=f"this {name} is already attached to this SGD"):
        hook.attach(optimizer)
    with pytest.raises(
        RuntimeError,
        match=rf"another {name} \({name}\(.*\)\) is already attached to this SGD; two would "
        rf"apply {kind.hook.technique} twice",
    ):
        kind.make().attach(optimizer)

    class Subclass(kind.hook):  # type: ignore[name-defined,misc]
        pass

    with pytest.raises(RuntimeError, match="is already attached"):
        Subclass().attach(optimizer)
    optimizer.step()  # once: the refused hooks registered nothing
    assert_stepped(kind, params, before)
    first.remove()
    kind.make().attach(optimizer)


def lightning_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    wrapper: torch.optim.Optimizer = LightningOptimizer(optimizer)  # type: ignore[assignment]
    return wrapper


@every_kind
def test_a_second_hook_through_a_frameworks_wrapper_is_refused(kind: Kind) -> None:
    optimizer = torch.optim.SGD(make_params(), lr=LR)
    kind.make().attach(lightning_optimizer(optimizer))
    with pytest.raises(RuntimeError, match=f"another {kind.hook.__name__}"):
        kind.make().attach(optimizer)


@every_kind
@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn], ids=["complex", "float8"])
def test_a_parameter_of_another_dtype_is_refused_at_attach(kind: Kind, dtype: torch.dtype) -> None:
    param = nn.Parameter(torch.ones(2, 2).to(dtype), requires_grad=False)
    with pytest.raises(
        TypeError,
        match=r"parameter 0 of param group 0 must be a real floating-point tensor \(float16, "
        r"bfloat16, float32 or float64\)",
    ):
        kind.make().attach(torch.optim.SGD([param], lr=0.1))


@every_kind
def test_a_sparse_gradient_in_a_later_group_is_refused_and_nothing_changes(kind: Kind) -> None:
    """The error names the fix, and no gradient, parameter or state changes."""
    dense = make_params()[0]
    embedding = nn.Embedding(10, 3, sparse=True).double()
    optimizer = torch.optim.Adam([{"params": [dense]}, {"params": [embedding.weight]}], lr=0.1)
    kind.make().attach(optimizer)
    optimizer.step()  # state for the dense parameter
    state = copy.deepcopy(optimizer.state_dict())
    embedding(torch.tensor([1, 2])).sum().backward()
    before = [t.detach().clone() for t in (dense, dense.grad, embedding.weight)]
    with pytest.raises(
        ValueError,
        match=r"parameter 0 of param group 1 has a torch\.sparse_coo gradient; "
        rf"{kind.hook.technique} needs dense gradients \(use sparse=False in nn\.Embedding / "
        r"nn\.EmbeddingBag\)\. No gradient or parameter was changed",
    ):
        optimizer.step()
    for tensor, old in zip((dense, dense.grad, embedding.weight), before, strict=True):
        torch.testing.assert_close(tensor.detach(), old, rtol=0, atol=0)
    assert str(optimizer.state_dict()) == str(state)


@every_kind
def test_a_tensor_twice_in_the_optimizer_is_refused_by_its_place(kind: Kind) -> None:
    unused, param = nn.Parameter(torch.ones(2)), make_params()[0]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        optimizer = torch.optim.SGD([unused, param, param], lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"parameter 2 of param group 0 is the same tensor as parameter 1 of param group 0",
    ):
        kind.make().attach(optimizer)
    optimizer = torch.optim.SGD([param], lr=0.1)
    kind.make().attach(optimizer)
    optimizer.param_groups.append({**optimizer.param_groups[0], "params": [param]})
    grad = param.grad.clone()
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 is the same tensor"):
        optimizer.step()
    torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


@functional_kinds
def test_the_functional_form_refuses_a_tensor_twice_and_what_is_not_a_tensor(kind: Kind) -> None:
    param = make_params()[0]
    grad = param.grad.clone()
    with pytest.raises(ValueError, match=r"parameters\[1\] is the same tensor as parameters\[0\]"):
        kind.functional([param, param])
    torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)
    with pytest.raises(TypeError, match="parameters must be a tensor or an iterable of tensors"):
        kind.functional(3)
    with pytest.raises(TypeError, match=r"parameters\[1\] must be a torch.Tensor, got str"):
        kind.functional([param, "w"])
    complex_param = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    complex_param.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"parameters\[0\] must be a real floating.*complex"):
        kind.functional([complex_param])
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"parameters\[1\] has a torch.sparse_coo gradient"):
        kind.functional([param, embedding.weight])
    torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


def sam_optimizers() -> dict[str, Callable[[nn.Module], torch.optim.Optimizer]]:
    import pytorch_optimizer as po

    sgd = torch.optim.SGD
    return {
        "SAM": lambda m: po.SAM(m.parameters(), sgd, lr=LR),
        "ASAM": lambda m: po.SAM(m.parameters(), sgd, adaptive=True, lr=LR),
        "WSAM": lambda m: po.WSAM(m, m.parameters(), sgd, lr=LR),
        "LookSAM": lambda m: po.LookSAM(m.parameters(), sgd, lr=LR),
        "FriendlySAM": lambda m: po.FriendlySAM(m.parameters(), sgd, lr=LR),
        "GSAM": lambda m: po.GSAM(
            m.parameters(),
            sgd(m.parameters(), lr=LR),
            m,
            po.ProportionScheduler(
                torch.optim.lr_scheduler.LambdaLR(sgd(m.parameters(), lr=LR), lambda _: 1.0),
                max_lr=LR,
                min_lr=LR,
            ),
        ),
    }


@every_kind
@pytest.mark.parametrize("sam", ["SAM", "ASAM", "WSAM", "LookSAM", "FriendlySAM", "GSAM"])
def test_optimizers_stepping_a_base_optimizer_are_refused(kind: Kind, sam: str) -> None:
    """The hook would see the first pass's gradients only; SAM's weights never moved."""
    optimizer = sam_optimizers()[sam](mlp())
    with pytest.raises(
        TypeError, match=r"steps a base_optimizer \(SGD\).*optimizer\.base_optimizer"
    ):
        kind.make().attach(optimizer)
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer.base_optimizer._optimizer_step_pre_hooks


class UnhookedLookahead(torch.optim.Optimizer):
    """timm's Lookahead in miniature: an Optimizer subclass that never calls
    ``Optimizer.__init__``, so its own ``step`` runs no step hooks."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = base.state
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()

    def step(self, closure: Callable[[], Tensor] | None = None) -> None:  # type: ignore[override]
        self._base_optimizer.step(closure)


@every_kind
def test_an_optimizer_whose_step_runs_no_hooks_is_refused(kind: Kind) -> None:
    """The hook was registered and silently never ran (LARS: w = 3 stepped to 2.5, not 0)."""
    params = make_params()
    optimizer = UnhookedLookahead(torch.optim.SGD(params, lr=1.0))
    with pytest.raises(
        TypeError,
        match=r"cannot be attached to UnhookedLookahead: its step runs no step hooks .* Attach "
        r".* to the optimizer it wraps and steps \(its \._base_optimizer, a SGD\)",
    ):
        kind.make().attach(optimizer)
    assert not optimizer._optimizer_step_pre_hooks


@every_kind
def test_the_hook_on_the_optimizer_such_a_wrapper_steps_runs(kind: Kind) -> None:
    params = make_params()
    before = snapshot(params)
    optimizer = UnhookedLookahead(torch.optim.SGD(params, lr=LR))
    kind.make().attach(optimizer._base_optimizer)
    optimizer.step()
    assert_stepped(kind, params, before)


# --- framework wrappers -----------------------------------------------------------------------


@pytest.fixture
def accelerator() -> Iterator[Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@every_kind
@pytest.mark.parametrize("wrapper", ["lightning", "accelerate"])
def test_attach_unwraps_the_frameworks_optimizer_wrappers(
    kind: Kind, wrapper: str, request: pytest.FixtureRequest
) -> None:
    """What ``LightningModule.optimizers()`` returns and an HF TrainerCallback receives."""
    params = make_params()
    inner = torch.optim.SGD(params, lr=LR)
    if wrapper == "lightning":
        wrapped = lightning_optimizer(inner)
    else:
        from accelerate.optimizer import AcceleratedOptimizer

        request.getfixturevalue("accelerator")
        wrapped = AcceleratedOptimizer(inner, device_placement=False)
    kind.make().attach(wrapped)
    before = snapshot(params)
    inner.step()  # what the framework's step calls
    assert_stepped(kind, params, before)


# --- param groups that opt out -------------------------------------------------------------


class ScaleAwareSGD(torch.optim.Optimizer):
    """Plain SGD that takes GradScaler's protocol for fused optimizers: it divides by
    ``grad_scale`` itself, and skips the step where ``found_inf`` is set."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> None:  # type: ignore[override]
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.item():
            return
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = param.grad if scale is None else param.grad / scale
                    param.add_(grad, alpha=-group["lr"])


def with_one_left_alone(prefix: str, left_alone: nn.Parameter) -> tuple[nn.Linear, list[Any]]:
    linear = nn.Linear(3, 2)
    groups = [{"params": list(linear.parameters())}, {"params": [left_alone], prefix: False}]
    return linear, groups


def sparse_embedding() -> nn.Embedding:
    return nn.Embedding(6, 3, sparse=True)


INDICES = torch.tensor([0, 2, 2, 5])


@every_kind
def test_a_sparse_embedding_in_a_group_that_opts_out_trains_as_plain_sgd(kind: Kind) -> None:
    embedding = sparse_embedding()
    linear, groups = with_one_left_alone(kind.prefix, embedding.weight)
    optimizer = torch.optim.SGD(groups, lr=LR)
    hook = kind.make()
    hook.attach(optimizer)
    linear(embedding(INDICES)).square().sum().backward()
    expected = embedding.weight.detach() - LR * embedding.weight.grad.to_dense()
    optimizer.step()
    torch.testing.assert_close(embedding.weight.detach(), expected)
    if kind.values:
        values = getattr(hook, kind.values)
        assert [v.numel() for v in values] == [2, 0]


@every_kind
def test_a_complex_parameter_in_a_group_that_opts_out_trains_as_plain_sgd(kind: Kind) -> None:
    phase = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    linear, groups = with_one_left_alone(kind.prefix, phase)
    optimizer = torch.optim.SGD(groups, lr=LR)
    kind.make().attach(optimizer)
    (linear(torch.randn(4, 3)).sum() + (phase * phase.conj()).real.sum()).backward()
    expected = phase.detach() - LR * phase.grad
    optimizer.step()
    torch.testing.assert_close(phase.detach(), expected, rtol=0, atol=0)


@every_kind
def test_a_group_that_opts_out_added_after_attach_is_not_checked(kind: Kind) -> None:
    linear = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(linear.parameters(), lr=LR)
    kind.make().attach(optimizer)
    integer = torch.zeros(3, dtype=torch.int64)  # no grad: the optimizer skips it
    optimizer.param_groups.append({**optimizer.defaults, "params": [integer], kind.prefix: False})
    linear(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    torch.testing.assert_close(integer, torch.zeros(3, dtype=torch.int64), rtol=0, atol=0)


@every_kind
def test_sparse_gradients_that_opt_out_are_unscaled_under_the_fused_protocol(
    kind: Kind,
) -> None:
    """A hook on the gradients clears ``grad_scale`` for the fused step, so it unscales what
    it skips; a hook on the updates leaves both to the step."""
    embedding = sparse_embedding()
    linear, groups = with_one_left_alone(kind.prefix, embedding.weight)
    optimizer = ScaleAwareSGD(groups, lr=LR)
    kind.make().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(linear(embedding(INDICES)).square().sum()).backward()
    expected = embedding.weight.detach() - LR * embedding.weight.grad.to_dense() / 1024.0
    scaler.step(optimizer)
    torch.testing.assert_close(embedding.weight.detach(), expected)


@every_kind
def test_an_overflow_in_a_sparse_gradient_that_opts_out_skips_the_fused_step(kind: Kind) -> None:
    embedding = sparse_embedding()
    linear, groups = with_one_left_alone(kind.prefix, embedding.weight)
    optimizer = ScaleAwareSGD(groups, lr=LR)
    kind.make().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(linear(embedding(INDICES)).square().sum()).backward()
    embedding.weight.grad._values()[0, 0] = float("inf")
    before = [p.detach().clone() for p in (*linear.parameters(), embedding.weight)]
    scaler.step(optimizer)
    for param, old in zip((*linear.parameters(), embedding.weight), before, strict=True):
        torch.testing.assert_close(param.detach(), old, rtol=0, atol=0)


# --- torch.compile and no host sync -----------------------------------------------------------


@every_kind
def test_a_compiled_training_step_matches_eager(kind: Kind) -> None:
    def make(m: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(split_groups(m, kind.prefix), lr=LR, momentum=0.9)
        kind.make().attach(optimizer)
        return optimizer

    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    assert_compiled_training_matches_eager(model, torch.randn(16, 5), make, rtol=1e-5, atol=1e-6)


@every_kind
def test_the_hook_traces_without_graph_breaks(kind: Kind) -> None:
    """fullgraph=True fails on .item() or Python branches on tensor values."""
    torch._dynamo.reset()
    params = make_params(torch.float32)
    before = snapshot(params)
    optimizer = torch.optim.SGD(params, lr=LR)
    hook = kind.make()
    hook.attach(optimizer)
    torch.compile(hook._pre_step, backend="aot_eager", fullgraph=True)(optimizer, (optimizer,), {})
    with torch.no_grad():
        for param in params:
            param.sub_(LR * param.grad)  # the optimizer's step, by hand
    if kind.on_updates:
        torch.compile(hook._after_step, backend="aot_eager", fullgraph=True)(
            optimizer, (optimizer,), {}
        )
    assert_stepped(kind, params, before, rel=2e-5)


@functional_kinds
def test_the_functional_form_traces_without_graph_breaks(kind: Kind) -> None:
    torch._dynamo.reset()
    params = make_params(torch.float32)
    before = snapshot(params)
    torch.compile(kind.functional, backend="aot_eager", fullgraph=True)(params, **kind.settings)
    for param, (w, g) in zip(params, before, strict=True):
        expected = kind.gradient(w, g, LR, **kind.settings)  # type: ignore[misc]
        assert_close_rel(param.grad.double(), expected, 2e-5)


class NoHostSync(TorchDispatchMode):
    """Raises on every op that reads a tensor value back to the host."""

    SYNCS = frozenset(
        {
            torch.ops.aten._local_scalar_dense.default,  # .item(), bool(), float(), .tolist()
            torch.ops.aten.is_nonzero.default,
            torch.ops.aten.equal.default,
            torch.ops.aten.nonzero.default,
        }
    )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.SYNCS:
            raise AssertionError(f"{func} reads a tensor value back to the host")
        return func(*args, **(kwargs or {}))


@every_kind
@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "per-tensor"])
def test_a_step_reads_no_tensor_value_back_to_the_host(kind: Kind, foreach: bool | None) -> None:
    params = make_params(torch.float32, shapes=[*SHAPES, (70, 70)])
    before = snapshot(params)
    optimizer = torch.optim.SGD(params, lr=LR, foreach=foreach)
    kind.make(foreach=foreach).attach(optimizer)
    with NoHostSync():
        optimizer.step()
    assert_stepped(kind, params, before, rel=2e-5)


def test_the_host_sync_check_catches_a_sync() -> None:
    with NoHostSync(), pytest.raises(AssertionError, match="reads a tensor value back"):
        bool(torch.ones(()) > 0)
