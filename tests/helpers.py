"""Test helpers: the Chainer reference vectors and the comparisons they support."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "chainer"


def golden_cases(kind: str) -> list[Any]:
    """The manifest's cases of one kind, as pytest params with readable ids.

    Collected at import time so that ids show in the test names; when the folder is missing
    each test is skipped with the reason, instead of silently collecting nothing.
    """
    manifest = GOLDEN / "manifest.json"
    if not manifest.exists():
        return [
            pytest.param(
                None,
                id=f"{kind}-missing",
                marks=pytest.mark.skip(reason=f"Chainer reference vectors not found at {GOLDEN}"),
            )
        ]
    cases = [c for c in json.loads(manifest.read_text())["cases"] if c["kind"] == kind]
    return [pytest.param(case, id=case["name"]) for case in cases]


def load_arrays(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    with np.load(GOLDEN / case["file"]) as data:
        return {name: torch.from_numpy(data[name].copy()) for name in data.files}


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance the vectors support: 1e-12 in float64, 5e-6 in float32."""
    return 1e-12 if dtype == torch.float64 else 5e-6


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Compares within ``rel`` times the largest magnitude of ``expected`` (the README's rule)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=rel * max(scale, 1e-30))
