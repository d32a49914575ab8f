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
from normhooks.demo.experiments import (
    METRICS,
    Comparison,
    ExperimentResult,
    Metric,
    metric_value,
)
from normhooks.demo.stats import Interval, interval
from normhooks.demo.training import RunResult

__all__ = [
    "QUICK_NOTE",
    "RESULTS",
    "RULE",
    "check_writable",
    "claims_table",
    "file_names",
    "format_interval",
    "plot_png",
    "render",
    "results_json",
    "table",
    "write_files",
]

RESULTS = "results.json"

RULE = (
    "each claim is judged on the paired difference (claimed configuration minus the one it "
    "is compared with, seed by seed) and its 95 % t interval over seeds: reproduced if the "
    "interval excludes zero on the side the paper predicts, contradicted if it excludes zero "
    "on the other side, inconclusive otherwise"
)
QUICK_NOTE = (
    "--quick: few seeds, few epochs and a subset of the training images; these verdicts are "
    "indicative only"
)

_RUN_HEADER = ("experiment", "configuration", "test accuracy", "train loss, last epoch", "time")
_CLAIM_HEADER = ("experiment", "claim", "metric", "difference", "verdict")


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        aligned = (
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        )
        return "| " + " | ".join(aligned) + " |"

    rule = ("-" * (w + 1) + ":" if r else "-" * (w + 2) for w, r in zip(widths, right, strict=True))
    return "\n".join([line(header), "|" + "|".join(rule) + "|", *map(line, rows)])


def _is_accuracy(metric: Metric) -> bool:
    return metric == "test_accuracy"


def format_interval(value: Interval, metric: Metric, *, signed: bool = False) -> str:
    """``mean [low, high]``: accuracies in percent (points for a difference), losses as is.

    Example:
        >>> format_interval(Interval(0.9312, 0.925, 0.9374, 8), "test_accuracy")
        '93.1% [92.5, 93.7]'
        >>> format_interval(Interval(0.0146, 0.0002, 0.029, 8), "test_accuracy", signed=True)
        '+1.46 pts [+0.02, +2.90]'
        >>> format_interval(Interval(-0.0123, -0.02, -0.0046, 8), "final_train_loss", signed=True)
        '-0.0123 [-0.0200, -0.0046]'
    """
    if math.isnan(value.mean):
        return "diverged"
    # A difference of accuracies gets two decimals, so a bound near zero shows its side.
    scale, digits = (100.0, 2 if signed else 1) if _is_accuracy(metric) else (1.0, 4)
    sign = "+" if signed else ""

    def number(x: float) -> str:
        return f"{scale * x:{sign}.{digits}f}" if math.isfinite(x) else "inf"

    unit = " pts" if signed and _is_accuracy(metric) else ("%" if _is_accuracy(metric) else "")
    return f"{number(value.mean)}{unit} [{number(value.low)}, {number(value.high)}]"


def table(outcomes: Sequence[ExperimentResult]) -> str:
    """The configurations as a Markdown table: means over seeds and 95 % intervals.

    Example:
        >>> print(table([]))
        | experiment | configuration | test accuracy | train loss, last epoch | time |
        |------------|---------------|--------------:|-----------------------:|-----:|
    """
    rows = [
        (
            outcome.experiment.title,
            configuration.label,
            format_interval(outcome.summary(configuration.name, "test_accuracy"), "test_accuracy"),
            format_interval(
                outcome.summary(configuration.name, "final_train_loss"), "final_train_loss"
            ),
            f"{_mean_time(outcome.runs[configuration.name]):.1f} s",
        )
        for outcome in outcomes
        for configuration in outcome.experiment.configurations
    ]
    return _markdown(_RUN_HEADER, rows, (False, False, True, True, True))


def _mean_time(runs: Sequence[RunResult]) -> float:
    return math.fsum(r.wall_time_s for r in runs) / len(runs)


def _outcome_text(comparison: Comparison) -> str:
    if comparison.outcome is None:
        return "(not claimed)"
    return comparison.outcome


def claims_table(outcomes: Sequence[ExperimentResult]) -> str:
    """The claims as a Markdown table: each paired difference, its interval, its verdict.

    Example:
        >>> print(claims_table([]))
        | experiment | claim | metric | difference | verdict |
        |------------|-------|--------|-----------:|---------|
    """
    rows = [
        (
            outcome.experiment.title,
            comparison.claim.statement,
            METRICS[comparison.claim.metric],
            format_interval(comparison.difference, comparison.claim.metric, signed=True),
            _outcome_text(comparison),
        )
        for outcome in outcomes
        for comparison in outcome.comparisons()
    ]
    return _markdown(_CLAIM_HEADER, rows, (False, False, False, True, False))


def _finite(values: Sequence[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def _interval_json(value: Interval) -> dict[str, Any]:
    mean, low, high = _finite([value.mean, value.low, value.high])
    return {"mean": mean, "low": low, "high": high, "n": value.n}


def _run_json(seed: int, run: RunResult) -> dict[str, Any]:
    return {
        "seed": seed,
        "epochs": run.epochs,
        "steps_per_epoch": run.steps_per_epoch,
        **{metric: _finite([metric_value(run, metric)])[0] for metric in METRICS},
        "diverged": run.diverged,
        "wall_time_s": run.wall_time_s,
        "curves": {
            "epoch": list(range(1, len(run.train_loss) + 1)),
            "train_loss": _finite(run.train_loss),
            "test_loss": _finite(run.test_loss),
            "test_accuracy": run.test_accuracy,
        },
    }


def _experiment_json(outcome: ExperimentResult) -> dict[str, Any]:
    experiment = outcome.experiment
    return {
        "title": experiment.title,
        "paper": experiment.paper,
        "seeds": list(outcome.seeds),
        "configurations": {
            c.name: {
                "label": c.label,
                "settings": dict(c.settings),
                "summary": {m: _interval_json(outcome.summary(c.name, m)) for m in METRICS},
                "runs": [
                    _run_json(seed, run)
                    for seed, run in zip(outcome.seeds, outcome.runs[c.name], strict=True)
                ],
            }
            for c in experiment.configurations
        },
        "claims": [
            {
                "statement": comparison.claim.statement,
                "metric": comparison.claim.metric,
                "baseline": comparison.claim.baseline,
                "candidate": comparison.claim.candidate,
                "direction": comparison.claim.direction,
                "claimed": comparison.claim.claimed,
                "difference": _interval_json(comparison.difference),
                "verdict": comparison.outcome,
            }
            for comparison in outcome.comparisons()
        ],
    }


def results_json(outcomes: Sequence[ExperimentResult], settings: Mapping[str, Any]) -> str:
    """``results.json``: the run's settings, the rule, every seed's numbers, every verdict.

    Non-finite numbers (a diverged run's loss) are written as ``null``, so the file is strict
    JSON. Wall times are the only numbers that differ between two runs of the same command
    on the same machine.
    """
    document = {
        "settings": dict(settings),
        "rule": RULE,
        "experiments": {o.experiment.key: _experiment_json(o) for o in outcomes},
    }
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


def _band(curves: Sequence[Sequence[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per epoch, the mean and 95 % interval over the runs that reached it (nan if none)."""
    longest = max(len(c) for c in curves)
    means, lows, highs = [], [], []
    for epoch in range(longest):
        values = [c[epoch] for c in curves if len(c) > epoch]
        summary = interval(values)
        means.append(summary.mean)
        lows.append(summary.low if math.isfinite(summary.low) else summary.mean)
        highs.append(summary.high if math.isfinite(summary.high) else summary.mean)
    return means, lows, highs


def plot_png(outcome: ExperimentResult) -> bytes:
    """A PNG of the training-loss and test-accuracy curves: means over seeds, 95 % bands."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(10, 3.8), layout="constrained")
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    smallest = math.inf
    for configuration in outcome.experiment.configurations:
        runs = outcome.runs[configuration.name]
        label = configuration.label
        for axes, curves in (
            (loss_axes, [r.train_loss for r in runs]),
            (accuracy_axes, [[100 * a for a in r.test_accuracy] for r in runs]),
        ):
            means, lows, highs = _band(curves)
            epochs = list(range(1, len(means) + 1))
            (line,) = axes.plot(epochs, means, marker=".", label=label)
            if axes is loss_axes:
                smallest = min([smallest, *(m for m in means if math.isfinite(m) and m > 0)])
                # A log axis cannot show a band below zero; it is cut at the smallest mean.
                lows = [max(low, smallest / 2) for low in lows]
            axes.fill_between(epochs, lows, highs, color=line.get_color(), alpha=0.2, lw=0)
    if math.isfinite(smallest):
        loss_axes.set_ylim(bottom=smallest / 2)
    loss_axes.set(xlabel="epoch", ylabel="training loss (epoch mean)", yscale="log")
    accuracy_axes.set(xlabel="epoch", ylabel="test accuracy (%)")
    for axes in (loss_axes, accuracy_axes):
        axes.grid(alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    accuracy_axes.legend(loc="lower right", fontsize="small")
    verdicts = [c.outcome for c in outcome.comparisons() if c.outcome is not None]
    counts = ", ".join(
        f"{verdicts.count(v)} {v}"
        for v in ("reproduced", "contradicted", "inconclusive")
        if v in verdicts
    )
    figure.suptitle(
        f"{outcome.experiment.title} ({outcome.experiment.paper}), mean and 95 % interval "
        f"over {len(outcome.seeds)} seeds: {counts}",
        fontsize="medium",
    )
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
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
