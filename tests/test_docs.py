"""The documentation site's Python examples run as written, and its API reference is complete.

Every fenced ``python`` block of ``docs/**/*.md`` runs, one test per block, in a fresh
namespace (blocks do not share state). ``py`` blocks are shown but not run: the distributed
examples need ``torchrun``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import normhooks

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
API_BLOCK = re.compile(r"^::: (\S+)", flags=re.MULTILINE)

EXAMPLES = [
    pytest.param(page, code, id=f"{page.relative_to(DOCS).with_suffix('')}-{i}")
    for page in PAGES
    for i, code in enumerate(BLOCK.findall(page.read_text()))
]


def _documented() -> set[str]:
    """The last component of every object named in a ``:::`` block of the site."""
    return {
        path.rsplit(".", 1)[-1] for page in PAGES for path in API_BLOCK.findall(page.read_text())
    }


def test_examples_found() -> None:
    pages = {page.name for page, _ in (p.values for p in EXAMPLES)}
    assert {
        "index.md",
        "lars.md",
        "weight-standardization.md",
        "weight-normalization.md",
        "agc.md",
        "trust-ratio.md",
        "caching.md",
    } <= pages


@pytest.mark.parametrize(("page", "code"), EXAMPLES)
def test_docs_example_runs(page: Path, code: str) -> None:
    exec(compile(code, str(page), "exec"), {"__name__": "docs"})


def test_every_public_name_has_an_api_block() -> None:
    missing = set(normhooks.__all__) - _documented()
    assert not missing, f"public names without a ::: block in docs/: {sorted(missing)}"
