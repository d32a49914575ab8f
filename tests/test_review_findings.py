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


@pytest.mark.xfail(
    strict=True,
    reason="trust_ratio.py _non_negative_or_inf: math.inf is accepted, but nan and -inf are "
    "refused by _checks.real with 'threshold must be finite', which contradicts it",
)
@pytest.mark.parametrize("value", [-math.inf, math.nan], ids=["minus-inf", "nan"])
def test_trust_ratio_threshold_message_names_what_is_accepted(value: float) -> None:
    with pytest.raises(ValueError, match=r"threshold must be non-negative or math\.inf, got"):
        TrustRatio(threshold=value)


@pytest.mark.xfail(
    strict=True,
    reason="_kernels/__init__.py reads NORMHOOKS_KERNELS as 'on' unless it is one of 0, false, "
    "off, no: a misspelt off switch leaves the kernels on without a word",
)
@pytest.mark.parametrize("value", ["disabled", "none", "n"])
def test_an_unrecognized_normhooks_kernels_value_is_not_silently_on(value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import normhooks; print(normhooks.kernels_enabled())"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "NORMHOOKS_KERNELS": value},
        capture_output=True,
        text=True,
        check=False,
    )
    said = result.returncode != 0 or "NORMHOOKS_KERNELS" in result.stderr
    assert said or result.stdout.strip() == "False", (result.stdout, result.stderr)
