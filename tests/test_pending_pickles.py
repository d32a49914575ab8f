"""Pending lazy models pickled before the private layers became packages still load.

``tests/golden/pickles/`` holds ``torch.save`` of two lazy models converted before their first
forward, written by normhooks at commit 993faff (torch 2.13), when ``_parametrize`` was one
module: their pickles name ``normhooks._parametrize._Deferred`` (the pending registration,
a forward pre-hook) and ``normhooks._parametrize._Pending`` (the holder of the Parameters it
will add). They were made with::

    torch.manual_seed(0)
    torch.save(apply_weight_norm(nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.LazyLinear(2))),
               "pending_lazy_weight_norm.pt")
    torch.save(apply_weight_standardization(
        nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.LazyConv2d(2, 1)), scaled=True),
        "pending_lazy_scaled_ws.pt")
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from normhooks import ScaledWeightStandardization, WeightNorm, apply_weight_norm

GOLDEN = Path(__file__).parent / "golden" / "pickles"
CASES = {
    "wn": ("pending_lazy_weight_norm.pt", torch.randn(2, 5), WeightNorm),
    "scaled-ws": (
        "pending_lazy_scaled_ws.pt",
        torch.randn(2, 3, 8, 8),
        ScaledWeightStandardization,
    ),
}


def pickled_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) of every class and function a torch.save archive's pickle names."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        pickle = archive.read(name)
    # GLOBAL names both at once; STACK_GLOBAL (protocol 4+) takes two strings, pushed or
    # fetched from the memo.
    found: set[tuple[str, str]] = set()
    stack: list[object] = []
    memo: dict[int, object] = {}
    for op, arg, _ in pickletools.genops(pickle):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            stack.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif op.name in ("BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = stack[-1] if stack else None
        elif op.name in ("BINGET", "LONG_BINGET"):
            stack.append(memo.get(int(arg)))
        elif op.name == "GLOBAL":  # protocol 2, torch.save's: "module name"
            module, name = str(arg).split(" ")
            found.add((module, name))
            stack.append(None)
        elif op.name == "STACK_GLOBAL":
            first, second = stack[-2], stack[-1]
            if isinstance(first, str) and isinstance(second, str):
                found.add((first, second))
        else:
            stack.append(None)
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_the_golden_pickle_names_the_old_module_path(case: str) -> None:
    """What the test below loads really is a pickle of the old layout."""
    names = pickled_globals((GOLDEN / CASES[case][0]).read_bytes())
    assert ("normhooks._parametrize", "_Deferred") in names
    assert ("normhooks._parametrize", "_Pending") in names


@pytest.mark.parametrize("case", list(CASES))
def test_a_pending_model_pickled_by_the_old_layout_loads_and_converts(case: str) -> None:
    file, x, parametrization = CASES[case]
    model = torch.load(GOLDEN / file, weights_only=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()  # materializes and converts the layers
    optimizer.step()
    converted = [m for m in model.modules() if isinstance(m, parametrization)]
    assert len(converted) == 2
    held = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert all(id(p) in held for p in model.parameters())


def test_a_pending_model_pickled_now_names_the_layer_by_its_old_path() -> None:
    """Pickles made now name the lazy classes by the same path, so they load where the old
    ones did."""
    buffer = io.BytesIO()
    torch.save(apply_weight_norm(nn.Sequential(nn.LazyLinear(3))), buffer)
    names = pickled_globals(buffer.getvalue())
    ours = {module for module, _ in names if module.startswith("normhooks._parametrize")}
    assert ours == {"normhooks._parametrize"}
    assert ("normhooks._parametrize", "_Deferred") in names


def test_unfusing_a_model_fused_before_it_was_pickled_removes_its_hooks() -> None:
    """A scope pickled by the old layout holds no handles to its hooks: unfusing finds them
    as fusion_of does."""
    from normhooks._kernels import _scope

    model = torch.load(GOLDEN / CASES["wn"][0], weights_only=False)
    assert _scope.fusion_of(model) is not None
    _scope.unfuse(model)
    assert _scope.fusion_of(model) is None
    assert not model._forward_pre_hooks
    assert not model._forward_hooks
    assert not model._forward_hooks_always_called
