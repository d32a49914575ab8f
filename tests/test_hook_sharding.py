"""Shardings the hooks cannot serve are refused, in one process: FSDP1's flattened
parameters (both ``use_orig_params`` modes, on a 1-rank gloo group) and DeepSpeed's ZeRO
optimizers and ZeRO-3 parameters (DeepSpeed is not installed: hand-made objects carry the
classes' modules and the attributes DeepSpeed sets). tests/test_distributed.py checks FSDP1
on 2 ranks.
"""

from __future__ import annotations

import re
import socket
import sys
import types
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hook_kinds import KINDS
from normhooks import GradientLARS

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available in this build",
    ),
    pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning"),
]

FLAT = re.escape(
    "is a FlatParameter of FSDP1 (FullyShardedDataParallel with use_orig_params=False)"
)
ORIGINAL = re.escape("is a parameter of a module wrapped by FSDP1 (FullyShardedDataParallel with ")
FSDP2 = r"Shard with FSDP2 instead \(torch.distributed.fsdp.fully_shard\)"


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    yield
    dist.destroy_process_group()


def fsdp1(use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    return FullyShardedDataParallel(
        model, use_orig_params=use_orig_params, device_id=torch.device("cpu")
    )


MODES = pytest.mark.parametrize(
    ("use_orig_params", "message"), [(False, FLAT), (True, ORIGINAL)], ids=["flat", "orig-params"]
)


@MODES
@pytest.mark.parametrize("prefix", list(KINDS))
@pytest.mark.usefixtures("one_rank")
def test_fsdp1_parameters_are_refused_at_attach(
    prefix: str, use_orig_params: bool, message: str
) -> None:
    optimizer = torch.optim.SGD(fsdp1(use_orig_params).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"parameter 0 of param group 0 {message}.*{FSDP2}"):
        KINDS[prefix].make().attach(optimizer)
    assert not optimizer._optimizer_step_pre_hooks


@MODES
@pytest.mark.usefixtures("one_rank")
def test_fsdp1_parameters_added_after_attach_are_refused_at_the_step(
    use_orig_params: bool, message: str
) -> None:
    model = fsdp1(use_orig_params)
    other = nn.Parameter(torch.randn(3, 3))
    optimizer = torch.optim.SGD([other], lr=0.1)
    GradientLARS().attach(optimizer)
    optimizer.add_param_group({"params": list(model.parameters())})
    model(torch.randn(3, 4)).sum().backward()
    other.grad = torch.ones(3, 3)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"parameter 0 of param group 1 {message}"):
        optimizer.step()
    torch.testing.assert_close(other.grad, torch.ones(3, 3), rtol=0, atol=0)
    for param, grad in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


@MODES
@pytest.mark.parametrize(
    "functional",
    [kind.functional for kind in KINDS.values() if kind.functional],
    ids=[f"{name}-functional" for name, kind in KINDS.items() if kind.functional],
)
@pytest.mark.usefixtures("one_rank")
def test_functional_forms_refuse_fsdp1_parameters(
    functional: Callable[..., object], use_orig_params: bool, message: str
) -> None:
    model = fsdp1(use_orig_params)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match=rf"parameters\[0\] {message}"):
        functional(model.parameters())


@pytest.mark.usefixtures("one_rank")
def test_fsdp1_parameters_in_a_group_that_opts_out_are_left_alone() -> None:
    model = fsdp1(use_orig_params=False)
    optimizer = torch.optim.SGD([{"params": list(model.parameters()), "lars": False}], lr=0.1)
    GradientLARS().attach(optimizer)
    model(torch.randn(3, 4)).sum().backward()
    (flat,) = model.parameters()
    expected = flat.detach() - 0.1 * flat.grad
    optimizer.step()
    torch.testing.assert_close(flat.detach(), expected)


# --- DeepSpeed ---------------------------------------------------------------------------------


def deepspeed_class(name: str, module: str, base: type = object) -> type:
    cls = types.new_class(name, (base,))
    cls.__module__ = module
    return cls


def zero_optimizer(inner: torch.optim.Optimizer) -> object:
    """What ``deepspeed.initialize`` returns as its optimizer under ZeRO stage 1 or 2."""
    base = deepspeed_class("DeepSpeedOptimizer", "deepspeed.runtime.base_optimizer")
    zero = deepspeed_class("ZeROOptimizer", "deepspeed.runtime.base_optimizer", base)
    stage = deepspeed_class("DeepSpeedZeroOptimizer", "deepspeed.runtime.zero.stage_1_and_2", zero)
    optimizer = stage()
    optimizer.optimizer = inner
    optimizer.param_groups = inner.param_groups
    return optimizer


@pytest.fixture
def deepspeed_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed is not installed; a stand-in marks it imported, as ``import deepspeed`` would."""
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))


def zero3_parameter(ds_id: int) -> nn.Parameter:
    """A ZeRO-3 parameter outside its gathered forward: an empty placeholder whose partition
    lives in ``ds_tensor``, with the attributes DeepSpeed's ``partition_parameters`` sets."""
    param = nn.Parameter(torch.empty(0))
    param.ds_id = ds_id  # type: ignore[attr-defined]
    param.ds_status = "NOT_AVAILABLE"  # type: ignore[attr-defined]
    param.ds_shape = torch.Size([4, 3])  # type: ignore[attr-defined]
    param.ds_numel = 12  # type: ignore[attr-defined]
    param.ds_tensor = torch.randn(6)  # type: ignore[attr-defined]
    return param


@pytest.mark.parametrize("prefix", list(KINDS))
def test_deepspeeds_zero_optimizer_is_refused_naming_deepspeed(prefix: str) -> None:
    optimizer = zero_optimizer(torch.optim.SGD([nn.Parameter(torch.randn(6))], lr=0.1))
    with pytest.raises(
        TypeError,
        match=r"optimizer is DeepSpeed's DeepSpeedZeroOptimizer, not a torch.optim.Optimizer: .* "
        r"Use DDP or FSDP2",
    ):
        KINDS[prefix].make().attach(optimizer)  # type: ignore[arg-type]


def test_deepspeeds_optimizer_inside_accelerates_wrapper_is_refused_naming_deepspeed() -> None:
    """What an HF TrainerCallback receives when the Trainer runs DeepSpeed."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState, GradientState

    Accelerator(cpu=True)
    try:
        inner = torch.optim.SGD([nn.Parameter(torch.randn(6))], lr=0.1)
        wrapper = AcceleratedOptimizer(zero_optimizer(inner), device_placement=False)
        with pytest.raises(TypeError, match="optimizer is DeepSpeed's DeepSpeedZeroOptimizer"):
            GradientLARS().attach(wrapper)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize("prefix", list(KINDS))
@pytest.mark.usefixtures("deepspeed_imported")
def test_zero3_parameters_are_refused_at_attach(prefix: str) -> None:
    optimizer = torch.optim.SGD([zero3_parameter(0), zero3_parameter(1)], lr=0.1)
    with pytest.raises(
        ValueError, match=r"parameter 0 of param group 0 is partitioned by DeepSpeed ZeRO-3"
    ):
        KINDS[prefix].make().attach(optimizer)


@pytest.mark.usefixtures("deepspeed_imported")
def test_zero3_partitions_filled_in_at_the_step_are_refused_before_any_change() -> None:
    """ZeRO-3 empties its inner optimizer's groups and fills in flat fp32 partitions, each
    with a ds_id, on the fly: attach sees nothing, the step sees them."""
    other = nn.Parameter(torch.randn(3, 3))
    optimizer = torch.optim.SGD([other], lr=0.1)
    GradientLARS().attach(optimizer)
    partition = nn.Parameter(torch.randn(10))
    partition.ds_id = 7  # type: ignore[attr-defined]
    partition.grad = torch.ones(10)
    other.grad = torch.ones(3, 3)
    optimizer.add_param_group({"params": [partition]})
    with pytest.raises(
        ValueError, match="parameter 0 of param group 1 is partitioned by DeepSpeed"
    ):
        optimizer.step()
    torch.testing.assert_close(other.grad, torch.ones(3, 3), rtol=0, atol=0)


def test_the_hook_traces_without_graph_breaks_while_fsdp1_is_imported() -> None:
    """The marks' cheap pre-test reads ``vars``, which torch.compile cannot trace."""
    # FSDP2's fully_shard lives in the package that imports FSDP1's module too.
    import torch.distributed.fsdp

    torch._dynamo.reset()
    params = [nn.Parameter(torch.full((3, 4), 2.0)), nn.Parameter(torch.full((4,), 1.0))]
    params[0].tag = "an attribute of the user's"  # type: ignore[attr-defined]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.SGD(params, lr=0.1)
    hook = GradientLARS(eps=0.0)
    hook.attach(optimizer)
    torch.compile(hook._pre_step, backend="aot_eager", fullgraph=True)(optimizer, (optimizer,), {})
    torch.testing.assert_close(hook.last_rates[0], torch.tensor([2.0, 1.0]))
