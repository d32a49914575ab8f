"""What the demo shows: the results table, ``results.json``, the plots, and writing them.

Every output is rendered in memory first and written only once all training has succeeded,
through a staging directory that is renamed into place, so an interrupted or failed run
leaves no partial file behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from normhooks.demo.errors import DemoError
from normhooks.demo.experiments import ExperimentResult
from normhooks.demo.training import RunResult

__all__ = [
    "RESULTS",
    "check_writable",
    "file_names",
    "plot_png",
    "render",
    "results_json",
    "table",
    "verdict_lines",
    "write_files",
]

RESULTS = "results.json"

_HEADER = ("experiment", "configuration", "test accuracy", "final train loss", "time")


def _loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "diverged"


def table(outcomes: Sequence[ExperimentResult]) -> str:
    """The results as a Markdown table: one row per configuration.

    Example:
        >>> print(table([]))
        | experiment | configuration | test accuracy | final train loss | time |
        |------------|---------------|--------------:|-----------------:|-----:|
    """
    rows = [
        (
            outcome.experiment.title,
            run.configuration.label,
            f"{100 * run.final_test_accuracy:.1f}%",
            _loss(run.final_train_loss),
            f"{run.wall_time_s:.1f} s",
        )
        for outcome in outcomes
        for run in outcome.runs.values()
    ]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(_HEADER)]
    # The numeric columns are right-aligned, in the text and in the Markdown rendering.
    right = (False, False, True, True, True)

    def line(cells: Sequence[str]) -> str:
        aligned = (
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        )
        return "| " + " | ".join(aligned) + " |"

    rule = ("-" * (w + 1) + ":" if r else "-" * (w + 2) for w, r in zip(widths, right, strict=True))
    return "\n".join([line(_HEADER), "|" + "|".join(rule) + "|", *map(line, rows)])


def verdict_lines(outcomes: Sequence[ExperimentResult]) -> list[str]:
    """One line per claim: the experiment, the verdict and the numbers behind it."""
    return [
        f"{o.experiment.title} ({o.experiment.paper}): "
        f"{'reproduced' if o.verdict.reproduced else 'not reproduced'}; {o.verdict.summary}"
        for o in outcomes
    ]


def _finite(values: Sequence[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def _run_json(run: RunResult) -> dict[str, Any]:
    return {
        "label": run.configuration.label,
        "settings": dict(run.configuration.settings),
        "epochs": run.epochs,
        "steps_per_epoch": run.steps_per_epoch,
        "test_accuracy": run.final_test_accuracy,
        "final_train_loss": _finite([run.final_train_loss])[0],
        "test_loss": _finite([run.test_loss[-1]])[0],
        "wall_time_s": run.wall_time_s,
        "diverged": run.diverged,
        "curves": {
            "epoch": list(range(1, len(run.train_loss) + 1)),
            "train_loss": _finite(run.train_loss),
            "test_loss": _finite(run.test_loss),
            "test_accuracy": run.test_accuracy,
        },
    }


def results_json(outcomes: Sequence[ExperimentResult], settings: Mapping[str, Any]) -> str:
    """``results.json``: the run's settings, and every experiment's numbers and verdict.

    Non-finite losses (a diverged run) are written as ``null``, so the file is strict JSON.
    """
    document = {
        "settings": dict(settings),
        "experiments": {
            o.experiment.key: {
                "title": o.experiment.title,
                "paper": o.experiment.paper,
                "claim": o.experiment.claim,
                "rule": o.experiment.rule,
                "verdict": {"reproduced": o.verdict.reproduced, "summary": o.verdict.summary},
                "configurations": {name: _run_json(run) for name, run in o.runs.items()},
            }
            for o in outcomes
        },
    }
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


def plot_png(outcome: ExperimentResult) -> bytes:
    """A PNG with the experiment's training-loss and test-accuracy curves, per epoch."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(10, 3.8), layout="constrained")
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    for run in outcome.runs.values():
        epochs = range(1, len(run.train_loss) + 1)
        label = run.configuration.label
        loss_axes.plot(epochs, run.train_loss, marker=".", label=label)
        accuracy_axes.plot(epochs, [100 * a for a in run.test_accuracy], marker=".", label=label)
    loss_axes.set(xlabel="epoch", ylabel="training loss (epoch mean)", yscale="log")
    accuracy_axes.set(xlabel="epoch", ylabel="test accuracy (%)")
    for axes in (loss_axes, accuracy_axes):
        axes.grid(alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    accuracy_axes.legend(loc="lower right", fontsize="small")
    verdict = "reproduced" if outcome.verdict.reproduced else "not reproduced"
    figure.suptitle(
        f"{outcome.experiment.title} ({outcome.experiment.paper}): {verdict}", fontsize="medium"
    )
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def file_names(keys: Sequence[str]) -> list[str]:
    """The files a run of the experiments ``keys`` writes: ``results.json``, one PNG each.

    Example:
        >>> file_names(["lars", "wn"])
        ['results.json', 'lars.png', 'wn.png']
    """
    return [RESULTS, *(f"{key}.png" for key in keys)]


def render(outcomes: Sequence[ExperimentResult], settings: Mapping[str, Any]) -> dict[str, bytes]:
    """Every output file's content, by the names :func:`file_names` gives."""
    names = file_names([o.experiment.key for o in outcomes])
    contents = [results_json(outcomes, settings).encode(), *map(plot_png, outcomes)]
    return dict(zip(names, contents, strict=True))


def _existing_ancestor(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor or ".")


def check_writable(out: Path, names: Sequence[str]) -> None:
    """Raises :class:`DemoError` unless the demo can create ``out`` and write ``names`` in it.

    Creates nothing that stays: writability is probed with a temporary directory in the
    nearest existing ancestor, removed at once.
    """
    where = f"--out {out}"
    existing = _existing_ancestor(out)
    if not existing.is_dir():
        what = "it" if existing == out else str(existing)
        raise DemoError(f"{where}: {what} is a file, not a directory")
    for name in names:
        target = out / name
        if target.exists() and not target.is_file():
            raise DemoError(f"{where}: {target} exists and is not a file")
    try:
        probe = tempfile.mkdtemp(prefix=".normhooks-probe-", dir=existing)
    except OSError as error:
        raise DemoError(f"{where}: cannot write in {existing} ({error.strerror})") from None
    os.rmdir(probe)


def write_files(out: Path, files: Mapping[str, bytes]) -> list[Path]:
    """Writes ``files`` (name -> content) into ``out``, leaving no partial file behind.

    The files are written to a staging directory beside ``out`` first. A new ``out`` is
    that directory renamed, so it appears complete or not at all; into an existing ``out``
    each file is renamed over its old version, and files with other names are left alone.
    Directories this call created are removed again if writing fails.

    Returns:
        The paths written, in the order of ``files``.
    """
    parent = out.parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]
    staging: Path | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = parent / f".{out.name}-{uuid.uuid4().hex[:12]}.tmp"
        staging.mkdir()
        for name, content in files.items():
            (staging / name).write_bytes(content)
        if out.exists():
            for name in files:
                os.replace(staging / name, out / name)
        else:
            staging.rename(out)
            staging = None
    except OSError as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            staging = None
        for directory in created:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise DemoError(f"--out {out}: cannot write the results ({error})") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return [out / name for name in files]
