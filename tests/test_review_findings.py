"""Findings of the review of the merged features, in files its reviewer does not own.

Each test states the behaviour the project's standards ask for and is marked
``xfail(strict=True)`` until the file's owner fixes it: a fix turns it into a failure (XPASS),
and the mark comes off with the fix.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from normhooks import TrustRatio

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", [-math.inf, math.nan, -1.0], ids=["minus-inf", "nan", "negative"])
def test_trust_ratio_threshold_message_names_what_is_accepted(value: float) -> None:
    with pytest.raises(ValueError, match=r"threshold must be non-negative or math\.inf, got"):
        TrustRatio(threshold=value)


@pytest.mark.parametrize("value", ["disabled", "none", "n"])
def test_an_unrecognized_normhooks_kernels_value_turns_the_kernels_off_with_a_warning(
    value: str,
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import normhooks; print(normhooks.kernels_enabled())"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "NORMHOOKS_KERNELS": value},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "False"
    assert f"got NORMHOOKS_KERNELS={value!r}" in result.stderr


@pytest.mark.parametrize("value", ["1", "on", "YES", ""])
def test_a_recognized_on_value_keeps_the_kernels_on_without_a_warning(value: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-c",
            "import normhooks; print(normhooks.kernels_enabled())",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "NORMHOOKS_KERNELS": value},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "True"
