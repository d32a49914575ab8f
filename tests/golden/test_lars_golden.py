"""GradientLARS + torch.optim.SGD against Chainer's GradientLARS + MomentumSGD."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import assert_close_rel, golden_cases, load_arrays, tolerance
from normhooks import GradientLARS


@pytest.mark.parametrize("case", golden_cases("lars"))
def test_trajectory_matches_chainer(case: dict[str, Any]) -> None:
    arrays = load_arrays(case)
    n, hyper = case["n_params"], case["hyper"]
    params = [torch.nn.Parameter(arrays[f"param{i}_init"].clone()) for i in range(n)]
    optimizer = torch.optim.SGD(params, lr=case["lr"], momentum=case["momentum"])
    GradientLARS(hyper["threshold"], hyper["weight_decay"], hyper["eps"]).attach(optimizer)
    hooked: list[list[torch.Tensor]] = []
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: hooked.append([p.grad.clone() for p in params])
    )
    rel = tolerance(params[0].dtype)
    for step in range(case["steps"]):
        for i, param in enumerate(params):
            param.grad = arrays[f"grad{i}_step{step}"].clone()
        optimizer.step()
        for i, param in enumerate(params):
            assert_close_rel(hooked[-1][i], arrays[f"hooked_grad{i}_step{step}"], rel)
            assert_close_rel(param.detach(), arrays[f"param{i}_after_step{step}"], rel)
