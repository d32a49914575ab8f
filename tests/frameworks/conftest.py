"""Settings every framework test shares: no network, and no state carried between tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# Set before transformers or huggingface_hub is imported: every model here is built from a
# config, and nothing may reach the Hub.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps its state in process-wide singletons; each test starts from none.

    (The private reset is the one accelerate's own test suite uses between tests.)
    """
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
