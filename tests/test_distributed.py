"""DDP and FSDP2 on real process groups: 2 gloo ranks against one process on full batches;
FSDP1, which the hooks refuse, on the same ranks.

The ranks run tests/distributed_worker.py; each scenario is spawned once per session and its
saved results are checked here, one behaviour per test.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import distributed_worker as worker
from normhooks import GradientLARS, agc_param_groups, data_dependent_init, lars_param_groups

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this build",
)

WORLD = 2
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spawn(scenario: str, out: Path) -> list[dict[str, Any]]:
    """Runs a scenario on WORLD ranks; kills every rank still alive when it returns."""
    context = mp.start_processes(
        worker.rank_entry,
        args=(WORLD, free_port(), scenario, str(out)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {scenario} ranks did not finish in {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def scenario(name: str) -> Any:
    """A module-scoped fixture ``name``: what the worker's scenario ``name`` returns on each of
    WORLD ranks."""

    def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        return spawn(name, tmp_path_factory.mktemp(name))

    return pytest.fixture(scope="module", name=name)(results)


ddp = scenario("ddp")


ddp_fused = scenario("ddp_fused")


fsdp_fused = scenario("fsdp_fused")


@pytest.fixture(scope="module")
def fused_reference() -> dict[str, Any]:
    """worker.make_fused_model trained by one process on the full batches."""
    model = worker.make_fused_model()
    _, batches = worker.data()
    worker.train_plain(model, batches, lambda t: t)
    return worker.full_parameters(model)


fsdp = scenario("fsdp")


def trained_with_lars(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """Trains ``model`` by one process on the full ``batches`` as the LARS scenarios do;
    returns each step's rates."""
    optimizer = torch.optim.SGD(lars_param_groups(model), lr=worker.LR, momentum=worker.MOMENTUM)
    hook = GradientLARS(weight_decay=worker.WEIGHT_DECAY)
    hook.attach(optimizer)
    rates = []
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        rates.append([r.clone() for r in hook.last_rates])
    return rates


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One process, full batches, the same model, init and steps."""
    model = worker.make_model()
    init, batches = worker.data()
    data_dependent_init(model, init)
    after_init = worker.wn_init_values(model)
    rates = trained_with_lars(model, batches)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "init": after_init,
        "rates": rates,
        "params": worker.full_parameters(model),
        "state": state,
    }


fsdp_mesh_per_call = scenario("fsdp_mesh_per_call")


@pytest.fixture(scope="module")
def mlp_reference() -> dict[str, Any]:
    """worker.make_mlp trained by one process on the full batches."""
    model = worker.make_mlp()
    _, batches = worker.data()
    rates = trained_with_lars(model, batches)
    return {"rates": rates, "params": worker.full_parameters(model)}


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    scale = max(expected.abs().max().item(), 1e-12) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * scale)


def assert_same_tensors(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert set(actual) == set(expected)
    for name, value in expected.items():
        assert_close_relative(actual[name], value)


@pytest.mark.parametrize("scenario", ["ddp", "fsdp"])
def test_training_matches_one_process(
    scenario: str, request: pytest.FixtureRequest, reference: dict[str, Any]
) -> None:
    for rank in request.getfixturevalue(scenario):
        assert_same_tensors(rank["params"], reference["params"])


@pytest.mark.parametrize("scenario", ["ddp", "fsdp"])
def test_lars_rates_match_one_process(
    scenario: str, request: pytest.FixtureRequest, reference: dict[str, Any]
) -> None:
    for rank in request.getfixturevalue(scenario):
        for got, expected in zip(rank["rates"], reference["rates"], strict=True):
            for got_group, expected_group in zip(got, expected, strict=True):
                assert_close_relative(got_group, expected_group)


@pytest.mark.parametrize("scenario", ["ddp", "fsdp"])
def test_data_dependent_init_identical_on_ranks_and_to_full_batch(
    scenario: str, request: pytest.FixtureRequest, reference: dict[str, Any]
) -> None:
    ranks = request.getfixturevalue(scenario)
    for name, value in ranks[0]["init"].items():
        torch.testing.assert_close(ranks[1]["init"][name], value, rtol=0, atol=0)
    assert_same_tensors(ranks[0]["init"], reference["init"])


def test_ddp_over_a_fused_model_matches_one_process(
    ddp_fused: list[dict[str, Any]], fused_reference: dict[str, Any]
) -> None:
    """Each rank fuses its forward (one launch a step), its gradients arrive at once at the
    end of backward, and DDP averages them as any others."""
    for rank in ddp_fused:
        assert rank["fused"] == worker.STEPS
        assert_same_tensors(rank["params"], fused_reference)


def test_fully_shard_over_a_fused_model_leaves_each_layer_its_own_path(
    fsdp_fused: list[dict[str, Any]], fused_reference: dict[str, Any]
) -> None:
    for rank in fsdp_fused:
        assert rank["fused"] == 0
        assert_same_tensors(rank["params"], fused_reference)


def test_hsdp_training_and_rates_match_one_process(
    fsdp: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    for rank in fsdp:
        assert_same_tensors(rank["hsdp_params"], reference["params"])
        for got, expected in zip(rank["hsdp_rates"], reference["rates"], strict=True):
            for got_group, expected_group in zip(got, expected, strict=True):
                assert_close_relative(got_group, expected_group)


def test_lars_refuses_partial_dtensors(fsdp: list[dict[str, Any]]) -> None:
    message = fsdp[0]["refused_partial"]
    assert "parameters[0] has a Partial placement" in message
    assert "not partial ones" in message


def test_lars_issues_one_collective_per_step_under_fsdp2(fsdp: list[dict[str, Any]]) -> None:
    for rank in fsdp:
        assert rank["collectives"]["step"] == 1


def test_fsdp2_eval_never_serves_stale_weights(fsdp: list[dict[str, Any]]) -> None:
    assert [rank["stale_eval_outputs"] for rank in fsdp] == [0] * WORLD


def test_fsdp2_distributed_checkpoint_round_trip(fsdp: list[dict[str, Any]]) -> None:
    for rank in fsdp:
        for name, value in rank["expected_restored"].items():
            torch.testing.assert_close(rank["restored"][name], value, rtol=0, atol=0)


def test_fsdp2_full_state_dict_matches_one_process_keys(
    fsdp: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    full = fsdp[0]["full_state"]
    assert set(full) == set(reference["state"])
    assert all(not hasattr(v, "device_mesh") for v in full.values())
    assert fsdp[1]["full_state"] == {}


def test_reparametrizing_after_wrapping_is_refused(
    ddp: list[dict[str, Any]], fsdp: list[dict[str, Any]]
) -> None:
    assert (
        "is wrapped by DistributedDataParallel. Apply weight normalization before"
        in (ddp[0]["refused_after_wrap"])
    )
    for message in fsdp[0]["refused_after_shard"].split("|"):
        assert "is a DTensor: the model is already sharded by fully_shard. Apply" in message


def test_lars_one_all_reduce_per_step_with_a_mesh_per_fully_shard_call(
    fsdp_mesh_per_call: list[dict[str, Any]],
) -> None:
    """Issue #10: grouping by mesh object gave one all-reduce per fully_shard call."""
    for rank in fsdp_mesh_per_call:
        assert rank["meshes"] == 4  # the setup this test is about: one mesh object per call
        assert rank["all_reduces"] == [1] * worker.STEPS


def test_lars_with_a_mesh_per_fully_shard_call_matches_one_process(
    fsdp_mesh_per_call: list[dict[str, Any]], mlp_reference: dict[str, Any]
) -> None:
    for rank in fsdp_mesh_per_call:
        assert_same_tensors(rank["params"], mlp_reference["params"])
        for got, expected in zip(rank["rates"], mlp_reference["rates"], strict=True):
            for got_group, expected_group in zip(got, expected, strict=True):
                assert_close_relative(got_group, expected_group)


# --- adaptive gradient clipping --------------------------------------------------------------


fsdp_agc = scenario("fsdp_agc")


def agc_one_process(weights_only: bool) -> dict[str, Any]:
    """worker.make_agc_model trained by one process on the full batches, as the ranks do."""
    model = worker.make_agc_model()
    _, batches = worker.data()
    exclude = (lambda _, p: p.ndim < 2) if weights_only else None
    ratios, _ = worker.train_agc(
        model, agc_param_groups(model, exclude=exclude), batches, lambda t: t
    )
    return {"ratios": ratios, "params": worker.full_parameters(model)}


@pytest.fixture(scope="module")
def agc_reference() -> dict[str, Any]:
    return agc_one_process(weights_only=False)


@pytest.fixture(scope="module")
def agc_weights_reference() -> dict[str, Any]:
    return agc_one_process(weights_only=True)


def test_agc_reference_clips_some_units_and_not_others(agc_reference: dict[str, Any]) -> None:
    """The comparisons below need both branches to be taken."""
    ratios = torch.cat([torch.cat(step) for step in agc_reference["ratios"]])
    assert (ratios > worker.AGC_CLIPPING).any()
    assert (ratios < worker.AGC_CLIPPING).any()


@pytest.mark.parametrize("weights_only", [False, True], ids=["all", "weights-only"])
def test_agc_under_fsdp2_matches_one_process(
    weights_only: bool,
    fsdp_agc: list[dict[str, Any]],
    agc_reference: dict[str, Any],
    agc_weights_reference: dict[str, Any],
) -> None:
    key = "weight_params" if weights_only else "params"
    expected = agc_weights_reference if weights_only else agc_reference
    for rank in fsdp_agc:
        assert_same_tensors(rank[key], expected["params"])


@pytest.mark.parametrize("weights_only", [False, True], ids=["all", "weights-only"])
def test_agc_ratios_under_fsdp2_are_the_largest_over_the_rows_each_rank_holds(
    weights_only: bool,
    fsdp_agc: list[dict[str, Any]],
    agc_reference: dict[str, Any],
    agc_weights_reference: dict[str, Any],
) -> None:
    """0-/1-D units are whole on every rank; a Shard(0) weight's value is its rank's rows',
    so the largest over ranks is the one-process value."""
    key = "weight_ratios" if weights_only else "ratios"
    expected = agc_weights_reference if weights_only else agc_reference
    for step, expected_step in enumerate(expected["ratios"]):
        for group, expected_group in enumerate(expected_step):
            per_rank = torch.stack([rank[key][step][group] for rank in fsdp_agc])
            assert_close_relative(per_rank.amax(0), expected_group)


def test_agc_under_fsdp2_communicates_only_through_the_base(
    fsdp_agc: list[dict[str, Any]],
) -> None:
    """One all-reduce a step: the base's, of every sharded unit's whole-tensor norms, which
    AGC reads for the biases only. Shard(0) rows are local, but the base reduces the weights'
    whole norms too (AGC cannot tell it not to), so the weights-only run issues one as well."""
    for rank in fsdp_agc:
        assert rank["all_reduces"] == [1] * worker.STEPS
        assert rank["weight_all_reduces"] == [1] * worker.STEPS


@pytest.mark.parametrize(
    ("key", "where"),
    [("refused_shard1", "parameters[0]"), ("refused_shard1_hook", "parameter 0 of param group 0")],
    ids=["functional", "hook"],
)
def test_agc_refuses_dtensors_sharded_on_another_dim(
    key: str, where: str, fsdp_agc: list[dict[str, Any]]
) -> None:
    message = fsdp_agc[0][key]
    assert message.startswith(f"{where} is a DTensor sharded on dim 1 (Shard(dim=1)); AGC's")
    assert 'opt its param group out with "agc": False' in message


# --- TrustRatio ----------------------------------------------------------------------------


fsdp_trust_ratio = scenario("fsdp_trust_ratio")


@pytest.fixture(scope="module")
def trust_ratio_reference() -> dict[str, Any]:
    """worker.make_mlp trained with AdamW + TrustRatio by one process on the full batches."""
    _, batches = worker.data()
    return worker.train_trust_ratio(worker.make_mlp(), batches, lambda t: t)


def test_trust_ratio_under_fsdp2_matches_one_process(
    fsdp_trust_ratio: list[dict[str, Any]], trust_ratio_reference: dict[str, Any]
) -> None:
    for rank in fsdp_trust_ratio:
        assert_same_tensors(rank["params"], trust_ratio_reference["params"])
        for got, expected in zip(rank["ratios"], trust_ratio_reference["ratios"], strict=True):
            for got_group, expected_group in zip(got, expected, strict=True):
                assert_close_relative(got_group, expected_group)


def test_trust_ratio_one_collective_per_step_under_fsdp2(
    fsdp_trust_ratio: list[dict[str, Any]],
) -> None:
    """The norms of all four sharded layers (one mesh each) go in one all-reduce."""
    for rank in fsdp_trust_ratio:
        assert rank["collectives"] == [1] * worker.STEPS


# --- every hook: the contract's FSDP2 part -------------------------------------------------------


fsdp_hooks = scenario("fsdp_hooks")


@pytest.fixture(scope="module")
def hooks_one_process() -> dict[str, dict[str, Any]]:
    """worker.make_mlp trained with each hook by one process on the full batches."""
    _, batches = worker.data()
    return {
        name: worker.train_hook(name, worker.make_mlp(), batches, lambda t: t)
        for name in worker.KINDS
    }


@pytest.mark.parametrize("name", list(worker.KINDS))
def test_every_hook_under_fsdp2_trains_as_one_process(
    name: str, fsdp_hooks: list[dict[str, Any]], hooks_one_process: dict[str, dict[str, Any]]
) -> None:
    for rank in fsdp_hooks:
        assert_same_tensors(rank[name]["params"], hooks_one_process[name]["params"])


@pytest.mark.parametrize("name", [name for name, kind in worker.KINDS.items() if kind.values])
def test_every_hooks_values_under_fsdp2_are_one_process_s(
    name: str, fsdp_hooks: list[dict[str, Any]], hooks_one_process: dict[str, dict[str, Any]]
) -> None:
    """The largest over ranks: a value taken over the rows each rank holds (AGC's) is the
    largest of the full tensor's there."""
    for step, expected_step in enumerate(hooks_one_process[name]["values"]):
        for group, expected_group in enumerate(expected_step):
            per_rank = torch.stack([rank[name]["values"][step][group] for rank in fsdp_hooks])
            assert_close_relative(per_rank.amax(0), expected_group)


@pytest.mark.parametrize("name", list(worker.KINDS))
def test_every_hook_under_fsdp2_issues_one_collective_per_step_if_it_needs_whole_norms(
    name: str, fsdp_hooks: list[dict[str, Any]]
) -> None:
    """One all-reduce for the whole-tensor norms of all four sharded layers; none for a hook
    that works on local rows only."""
    expected = 1 if worker.KINDS[name].hook.whole_norms else 0
    for rank in fsdp_hooks:
        assert rank[name]["collectives"] == [expected] * worker.STEPS


fsdp_sphere_columns = scenario("fsdp_sphere_columns")


def test_hypersphere_columns_under_fsdp2_train_as_one_process(
    fsdp_sphere_columns: list[dict[str, Any]],
) -> None:
    _, batches = worker.data()
    expected = worker.train_sphere_columns(worker.make_mlp(), batches, lambda t: t)
    for rank in fsdp_sphere_columns:
        assert_same_tensors(rank["params"], expected["params"])


def test_hypersphere_columns_under_fsdp2_issue_one_collective_per_step(
    fsdp_sphere_columns: list[dict[str, Any]],
) -> None:
    """Shard(0) splits each column over the ranks: its norm's square is summed over them, in
    one all-reduce for all four layers."""
    for rank in fsdp_sphere_columns:
        assert rank["collectives"] == [1] * worker.STEPS


# --- FSDP1 (FullyShardedDataParallel): refused ------------------------------------------------


fsdp1 = scenario("fsdp1")


FSDP1_MESSAGES = {
    "flat": "is a FlatParameter of FSDP1 (FullyShardedDataParallel with use_orig_params=False)",
    "orig": "is a parameter of a module wrapped by FSDP1 (FullyShardedDataParallel with "
    "use_orig_params=True)",
}


@pytest.mark.parametrize("mode", ["flat", "orig"], ids=["flat", "orig-params"])
@pytest.mark.parametrize("hook", list(worker.KINDS))
def test_fsdp1_is_refused_at_attach_on_every_rank(
    hook: str, mode: str, fsdp1: list[dict[str, Any]]
) -> None:
    for rank in fsdp1:
        message = rank[f"{mode}_{hook}"]
        assert message.startswith(f"parameter 0 of param group 0 {FSDP1_MESSAGES[mode]}")
        assert "Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard)" in message
        assert rank[f"{mode}_{hook}_hooks"] == 0


@pytest.mark.parametrize("mode", ["flat", "orig"], ids=["flat", "orig-params"])
def test_fsdp1_is_refused_by_the_functional_form_and_at_the_step(
    mode: str, fsdp1: list[dict[str, Any]]
) -> None:
    for rank in fsdp1:
        assert rank[f"{mode}_functional"].startswith(f"parameters[0] {FSDP1_MESSAGES[mode]}")
        assert rank[f"{mode}_step"].startswith(
            f"parameter 0 of param group 1 {FSDP1_MESSAGES[mode]}"
        )
        assert rank[f"{mode}_step_unchanged"]
