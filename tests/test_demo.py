"""``normhooks demo``: a quick run's outputs, the verdict rules, and every reported error."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from matplotlib import image
from torch import nn

from normhooks.__main__ import main
from normhooks.demo import data, experiments, report, stats
from normhooks.demo.experiments import EXPERIMENTS
from normhooks.demo.training import Configuration, RunResult, lr_factor

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ERROR_PREFIX = "normhooks demo: error: "


@dataclass(frozen=True)
class Run:
    status: int
    stdout: str
    stderr: str


def run_demo(*args: str | Path) -> Run:
    """Runs ``normhooks demo ARGS`` in this process; argparse's exits become a status."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = main(["demo", *map(str, args)])
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return Run(status, stdout.getvalue(), stderr.getvalue())


def save_npz(path: Path, **arrays: np.ndarray[Any, Any]) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def digit_like(samples: int = 60, classes: int = 3) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    y = np.arange(samples) % classes
    x = rng.normal(size=(samples, 6, 6)).astype(np.float32) + y[:, None, None]
    return {"x": x, "y": y}


# The whole demo on a tiny data set: every experiment, configuration and claim, in seconds.
TINY = ("--epochs", "2", "--seeds", "2", "--workers", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    folder = tmp_path_factory.mktemp("tiny")
    path = save_npz(folder / "tiny.npz", **digit_like())
    out = folder / "demo"
    return run_demo("--data", path, *TINY, "--out", out), out


@pytest.fixture(scope="module")
def results(tiny: tuple[Run, Path]) -> dict[str, Any]:
    _, out = tiny
    loaded: dict[str, Any] = json.loads((out / "results.json").read_text())
    return loaded


CONFIGURATIONS = [
    (key, configuration.name)
    for key, build in EXPERIMENTS.items()
    for configuration in build().configurations
]
CLAIMS = [(key, claim) for key, build in EXPERIMENTS.items() for claim in build().claims]


def test_tiny_run_succeeds(tiny: tuple[Run, Path]) -> None:
    run, _ = tiny
    assert run.status == 0, run.stderr


def test_tiny_run_writes_exactly_the_results(tiny: tuple[Run, Path]) -> None:
    _, out = tiny
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["results.json", *(f"{key}.png" for key in EXPERIMENTS)]
    )
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo", "tiny.npz"]


@pytest.mark.parametrize(("experiment", "name"), CONFIGURATIONS, ids=lambda v: str(v))
def test_json_keeps_every_seed(results: dict[str, Any], experiment: str, name: str) -> None:
    entry = results["experiments"][experiment]["configurations"][name]
    assert [run["seed"] for run in entry["runs"]] == [0, 1]
    for run in entry["runs"]:
        assert 0 <= run["test_accuracy"] <= 1
        assert run["wall_time_s"] > 0
        assert len(run["curves"]["train_loss"]) == len(run["curves"]["test_accuracy"]) == 2
        assert run["final_train_loss"] == run["curves"]["train_loss"][-1]
        assert run["early_train_loss"] == pytest.approx(sum(run["curves"]["train_loss"]) / 2)


@pytest.mark.parametrize(("experiment", "name"), CONFIGURATIONS, ids=lambda v: str(v))
def test_json_summary_is_the_interval_of_the_seeds(
    results: dict[str, Any], experiment: str, name: str
) -> None:
    entry = results["experiments"][experiment]["configurations"][name]
    accuracies = [run["test_accuracy"] for run in entry["runs"]]
    expected = stats.interval(accuracies)
    summary = entry["summary"]["test_accuracy"]
    assert summary["n"] == 2
    assert summary["mean"] == pytest.approx(expected.mean)
    assert summary["low"] == pytest.approx(expected.low)
    assert summary["high"] == pytest.approx(expected.high)


@pytest.mark.parametrize(("experiment", "claim"), CLAIMS, ids=lambda v: getattr(v, "metric", v))
def test_json_claims_are_paired_differences_with_their_verdict(
    results: dict[str, Any], experiment: str, claim: experiments.Claim
) -> None:
    entry = results["experiments"][experiment]
    (recorded,) = [c for c in entry["claims"] if c["statement"] == claim.statement]

    def values(name: str) -> list[float]:
        return [run[claim.metric] for run in entry["configurations"][name]["runs"]]

    expected = stats.paired_interval(values(claim.baseline), values(claim.candidate))
    assert recorded["difference"]["mean"] == pytest.approx(expected.mean)
    assert recorded["difference"]["low"] == pytest.approx(expected.low)
    want = stats.verdict(expected, claim.direction) if claim.claimed else None
    assert recorded["verdict"] == want


def test_json_records_the_settings(results: dict[str, Any], tiny: tuple[Run, Path]) -> None:
    settings = results["settings"]
    assert settings["quick"] is False
    assert settings["seeds"] == [0, 1]
    assert settings["device"] == "cpu"
    assert settings["workers"] == 1
    assert settings["deterministic_algorithms"] is True
    assert settings["data"].endswith("tiny.npz")
    assert settings["input_shape"] == [1, 6, 6]
    assert settings["epochs"] == {key: 2 for key in EXPERIMENTS}
    assert results["rule"] == report.RULE


@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_plots_are_valid_png_images(tiny: tuple[Run, Path], experiment: str) -> None:
    _, out = tiny
    path = out / f"{experiment}.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.ndim == 3
    assert pixels.shape[0] > 100
    assert pixels.shape[1] > 100


def test_tables_show_every_configuration_and_claim(tiny: tuple[Run, Path]) -> None:
    run, _ = tiny
    flat = " ".join(run.stdout.split())
    assert "| experiment | configuration | test accuracy | train loss, last epoch | time |" in flat
    assert "| experiment | claim | metric | difference | verdict |" in flat
    for build in EXPERIMENTS.values():
        experiment = build()
        for configuration in experiment.configurations:
            assert re.search(rf"\| {re.escape(configuration.label)} +\| .*% \[", run.stdout)
        for claim in experiment.claims:
            verdicts = (
                "reproduced|contradicted|inconclusive" if claim.claimed else r"\(not claimed\)"
            )
            pattern = rf"\| {re.escape(claim.statement)} +\|.*\] \| ({verdicts}) +\|"
            assert re.search(pattern, run.stdout), claim.statement
    assert "Means over 2 seeds with 95 % t intervals; the rule: " in run.stdout
    assert "indicative only" not in run.stdout


def test_one_progress_bar_over_all_runs(tiny: tuple[Run, Path]) -> None:
    run, _ = tiny
    runs = len(CONFIGURATIONS) * 2
    assert "training: 100%" in run.stderr
    assert f"{runs}/{runs}" in run.stderr


def without_wall_times(document: Any) -> Any:
    if isinstance(document, dict):
        return {k: without_wall_times(v) for k, v in document.items() if "wall_time" not in k}
    if isinstance(document, list):
        return [without_wall_times(v) for v in document]
    return document


def claims_table(stdout: str) -> str:
    (block,) = [b for b in stdout.split("\n\n") if re.match(r"\| experiment +\| claim ", b)]
    return block


@pytest.fixture(scope="module")
def quick_wn(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Run, dict[str, Any]]]:
    """``--quick`` runs of one experiment on the default data: twice alike, once on 2 workers."""
    outcomes = []
    for workers in ("1", "1", "2"):
        out = tmp_path_factory.mktemp("quick") / "demo"
        run = run_demo("--quick", "--experiments", "wn", "--workers", workers, "--out", out)
        outcomes.append((run, json.loads((out / "results.json").read_text())))
    return outcomes


def test_quick_run_is_indicative_and_uses_the_digits(
    quick_wn: list[tuple[Run, dict[str, Any]]],
) -> None:
    run, results = quick_wn[0]
    assert run.status == 0, run.stderr
    assert "these verdicts are indicative only" in run.stdout
    settings = results["settings"]
    assert settings["quick"] is True
    assert settings["data"].startswith("digits: scikit-learn's bundled digits")
    assert settings["seeds"] == [0, 1, 2]
    assert settings["train_samples"] == 512


def test_the_same_command_gives_the_same_results(
    quick_wn: list[tuple[Run, dict[str, Any]]],
) -> None:
    (first, a), (second, b), _ = quick_wn
    assert without_wall_times(a) == without_wall_times(b)
    assert claims_table(first.stdout) == claims_table(second.stdout)


def test_parallel_workers_give_the_same_numbers(
    quick_wn: list[tuple[Run, dict[str, Any]]],
) -> None:
    (_, serial), _, (parallel_run, parallel) = quick_wn
    assert parallel_run.status == 0, parallel_run.stderr
    assert parallel["settings"].pop("workers") == 2
    assert serial["settings"].pop("workers") == 1
    assert without_wall_times(serial) == without_wall_times(parallel)


def test_user_data_runs_and_leaves_other_files_alone(tmp_path: Path) -> None:
    path = save_npz(tmp_path / "mine.npz", **digit_like())
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rng_state = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    run = run_demo("--data", path, "--experiments", "wn", *TINY, "--out", out)
    assert run.status == 0, run.stderr
    settings = json.loads((out / "results.json").read_text())["settings"]
    assert settings["num_classes"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "results.json", "wn.png"]
    assert (out / "notes.txt").read_text() == "mine"
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() is deterministic


def assert_reported(run: Run, pattern: str, *, after_training: bool = False) -> None:
    """Exit status 2 and one error line; before training starts, nothing else on stderr."""
    assert run.status == 2
    lines = run.stderr.strip().splitlines()
    if after_training:
        lines = [line.rsplit("\r", 1)[-1] for line in lines if ERROR_PREFIX in line]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(ERROR_PREFIX)
    assert re.search(pattern, lines[0]), lines[0]


BAD_DATA = {
    "missing file": (None, r"--data .*missing\.npz: no such file"),
    "not an archive": (b"not a zip", r"cannot read it as a \.npz archive"),
    "no y array": ({"x": np.zeros((20, 8, 8))}, r"'y' missing"),
    "x 2-D": ({"x": np.zeros((20, 64)), "y": np.arange(20) % 2}, r"x must be shaped .*\(20, 64\)"),
    "x 5-D": ({"x": np.zeros((20, 1, 1, 8, 8)), "y": np.arange(20) % 2}, r"x must be shaped"),
    "x not finite": (
        {"x": np.full((20, 8, 8), np.nan), "y": np.arange(20) % 2},
        r"x has values that are not finite",
    ),
    "too few samples": ({"x": np.zeros((4, 8, 8)), "y": np.arange(4) % 2}, r"at least 10"),
    "labels negative": (
        {"x": np.zeros((20, 8, 8)), "y": np.arange(20) % 2 - 1},
        r"class ids 0..K-1, got a negative one \(-1\)",
    ),
    "labels too many": (
        {"x": np.zeros((20, 8, 8)), "y": np.arange(19) % 2},
        r"x has 20 samples but y has 19 labels",
    ),
    "labels not integers": (
        {"x": np.zeros((20, 8, 8)), "y": np.arange(20) / 2},
        r"y must hold integer class ids, got dtype float64",
    ),
    "labels 2-D": ({"x": np.zeros((20, 8, 8)), "y": np.zeros((20, 1), int)}, r"y must be shaped"),
    "one class": ({"x": np.zeros((20, 8, 8)), "y": np.zeros(20, int)}, r"at least 2 classes"),
    "class id out of range": (
        {"x": np.zeros((20, 8, 8)), "y": np.array([0] * 19 + [100])},
        r"got class id 100",
    ),
}


@pytest.mark.parametrize(("content", "pattern"), BAD_DATA.values(), ids=BAD_DATA.keys())
def test_bad_data_is_one_line_and_exit_2(
    tmp_path: Path, content: bytes | dict[str, Any] | None, pattern: str
) -> None:
    path = tmp_path / "missing.npz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        save_npz(path, **content)
    out = tmp_path / "out"
    assert_reported(run_demo("--data", path, "--out", out), pattern)
    assert not out.exists()


def test_a_single_npy_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((20, 8, 8)))
    assert_reported(run_demo("--data", path, "--out", tmp_path / "out"), r"not a \.npz archive")


def test_out_under_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_reported(
        run_demo("--quick", "--out", blocker / "demo"), rf"--out .*: {blocker} is a file"
    )
    assert blocker.read_text() == ""


def test_out_that_is_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_reported(run_demo("--quick", "--out", blocker), r"--out .*: it is a file")


def test_out_with_a_directory_in_the_way_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "out" / "wn.png").mkdir(parents=True)
    assert_reported(
        run_demo("--experiments", "wn", "--out", tmp_path / "out"),
        r"--out .*wn\.png exists and is not a file",
    )


def test_a_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_npz(tmp_path / "mine.npz", **digit_like())
    write_bytes = Path.write_bytes

    def fail_on_png(self: Path, content: bytes) -> int:
        if self.suffix == ".png":
            raise OSError(28, "No space left on device")
        return write_bytes(self, content)

    monkeypatch.setattr(Path, "write_bytes", fail_on_png)
    out = tmp_path / "deep" / "out"
    run = run_demo("--data", path, "--experiments", "wn", *TINY, "--out", out)
    assert_reported(
        run, r"--out .*: cannot write the results \(.*No space left on device", after_training=True
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.npz"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_missing_cuda_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_reported(
        run_demo("--device", "cuda", "--out", out), r"--device cuda: CUDA is not available"
    )
    assert not out.exists()


def test_unknown_device_is_one_line_and_exit_2(tmp_path: Path) -> None:
    assert_reported(
        run_demo("--device", "abacus", "--out", tmp_path / "out"), r"--device abacus: not a"
    )


def test_missing_extra_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert_reported(
        run_demo("--out", tmp_path / "out"),
        r"the demo needs the extra: pip install 'normhooks\[demo\]' \(missing: tqdm\)",
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--bogus"],
        ["--epochs", "0"],
        ["--experiments", "resnet"],
        ["--seed", "-1"],
        ["--seeds", "1"],
        ["--workers", "0"],
        ["--threads", "x"],
    ],
    ids=[
        "unknown option",
        "zero epochs",
        "unknown experiment",
        "negative seed",
        "one seed",
        "no worker",
        "threads not a number",
    ],
)
def test_bad_options_are_usage_errors(args: Sequence[str]) -> None:
    run = run_demo(*args)
    assert run.status == 2
    assert run.stderr.startswith("usage: normhooks demo")
    assert "normhooks demo: error: " in run.stderr


def test_module_entry_point_and_core_import_need_no_extra(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "for name in ('sklearn', 'matplotlib', 'tqdm'):\n"
        "    sys.modules[name] = None\n"
        "import normhooks, normhooks.__main__\n"
        "sys.argv = ['normhooks', 'demo', '--out', sys.argv[1]]\n"
        "sys.exit(normhooks.__main__.main())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "normhooks demo: error: the demo needs the extra: pip install 'normhooks[demo]' "
        "(missing: matplotlib, tqdm, sklearn)"
    )


CONSOLE_SCRIPT = Path(sys.executable).with_name("normhooks")


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "normhooks"],
        pytest.param(
            [str(CONSOLE_SCRIPT)],
            marks=pytest.mark.skipif(
                not CONSOLE_SCRIPT.exists(), reason="the console script is not installed"
            ),
        ),
    ],
    ids=["python -m normhooks", "console script"],
)
def test_entry_points_show_the_demo_help(command: list[str]) -> None:
    result = subprocess.run(
        [*command, "demo", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0
    assert "--quick" in result.stdout
    assert "usage: normhooks demo" in result.stdout


def fake(name: str, accuracy: float, losses: Sequence[float] = (1.0,)) -> RunResult:
    configuration = Configuration(
        name,
        name,
        batch_size=1,
        build_model=lambda channels, classes: nn.Identity(),
        build_optimizer=lambda model: torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
    )
    epochs = len(losses)
    return RunResult(
        configuration,
        epochs=epochs,
        steps_per_epoch=1,
        train_loss=list(losses),
        test_loss=list(losses),
        test_accuracy=[accuracy] * epochs,
        wall_time_s=1.0,
        diverged=not all(np.isfinite(losses)),
    )


# --- the statistics ---------------------------------------------------------------------------


@pytest.mark.parametrize("df", [*range(1, 41), 50, 100, 1000, 10**6])
def test_t_quantile_matches_scipy(df: int) -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    assert stats.t_quantile(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=6e-5)


@pytest.mark.parametrize(("df", "value"), [(1, 12.7062), (4, 2.7764), (7, 2.3646), (30, 2.0423)])
def test_t_quantile_matches_the_printed_table(df: int, value: float) -> None:
    assert stats.t_quantile(df) == value


@pytest.mark.parametrize("df", [0, -1, 2.5, True])
def test_t_quantile_refuses_bad_degrees_of_freedom(df: Any) -> None:
    with pytest.raises(ValueError, match=r"df must be an integer >= 1, got df="):
        stats.t_quantile(df)


def test_interval_by_hand() -> None:
    # mean 0.9, sample variance ((-0.02)^2 + 0 + 0.02^2 + 0) / 3, t_{0.975,3} = 3.1824.
    values = [0.88, 0.90, 0.92, 0.90]
    half = 3.1824 * math.sqrt((0.02**2 * 2 / 3) / 4)
    result = stats.interval(values)
    assert result.n == 4
    assert result.mean == pytest.approx(0.9)
    assert (result.low, result.high) == pytest.approx((0.9 - half, 0.9 + half))


def test_interval_matches_scipy() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    values = [0.31, 0.12, 0.55, 0.47, 0.29, 0.38, 0.41, 0.22]
    low, high = scipy_stats.t.interval(
        0.95, len(values) - 1, loc=np.mean(values), scale=scipy_stats.sem(values)
    )
    result = stats.interval(values)
    assert (result.low, result.high) == pytest.approx((low, high), rel=1e-5)


def test_interval_of_one_value_is_unbounded() -> None:
    result = stats.interval([0.5])
    assert (result.mean, result.low, result.high) == (0.5, -math.inf, math.inf)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_interval_with_a_diverged_value_is_nan(bad: float) -> None:
    result = stats.interval([0.5, bad, 0.4])
    assert math.isnan(result.mean)
    assert math.isnan(result.low)
    assert math.isnan(result.high)


def test_interval_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one number, got none"):
        stats.interval([])


def test_paired_interval_is_the_interval_of_the_differences() -> None:
    a, b = [0.90, 0.80, 0.95], [0.92, 0.83, 0.96]
    paired = stats.paired_interval(a, b)
    direct = stats.interval([0.02, 0.03, 0.01])
    assert (paired.mean, paired.low, paired.high) == pytest.approx(
        (direct.mean, direct.low, direct.high)
    )


def test_paired_interval_needs_one_value_per_seed() -> None:
    with pytest.raises(ValueError, match="one value per seed, got 2 and 3 values"):
        stats.paired_interval([1.0, 2.0], [1.0, 2.0, 3.0])


VERDICTS = {
    "higher, above zero": ((0.01, 0.03), "higher", "reproduced"),
    "higher, below zero": ((-0.03, -0.01), "higher", "contradicted"),
    "higher, across zero": ((-0.01, 0.03), "higher", "inconclusive"),
    "higher, touching zero": ((0.0, 0.03), "higher", "inconclusive"),
    "lower, below zero": ((-0.03, -0.01), "lower", "reproduced"),
    "lower, above zero": ((0.01, 0.03), "lower", "contradicted"),
    "lower, across zero": ((-0.03, 0.01), "lower", "inconclusive"),
    "lower, touching zero": ((-0.03, 0.0), "lower", "inconclusive"),
    "one seed": ((-math.inf, math.inf), "higher", "inconclusive"),
    "diverged": ((math.nan, math.nan), "lower", "inconclusive"),
}


@pytest.mark.parametrize(("bounds", "direction", "outcome"), VERDICTS.values(), ids=VERDICTS)
def test_verdict_rule(bounds: tuple[float, float], direction: Any, outcome: str) -> None:
    low, high = bounds
    assert stats.verdict(stats.Interval((low + high) / 2, low, high, 8), direction) == outcome


def test_verdict_refuses_an_unknown_direction() -> None:
    with pytest.raises(ValueError, match="direction must be 'higher' or 'lower', got direction="):
        stats.verdict(stats.Interval(0.0, -1.0, 1.0, 8), "better")  # type: ignore[arg-type]


# --- the experiments --------------------------------------------------------------------------


def test_pairing_separates_what_the_spread_across_seeds_hides() -> None:
    # Seeds differ by several points, but the candidate is 1 point ahead on every seed.
    base = [0.80, 0.90, 0.85, 0.95]
    lars = experiments.large_batch()
    runs = {
        "sgd-small": [fake("sgd-small", a + 0.02) for a in base],
        "sgd-large": [fake("sgd-large", a) for a in base],
        "lars-large": [fake("lars-large", a + 0.01 + 0.001 * i) for i, a in enumerate(base)],
        "adamw-large": [fake("adamw-large", a) for a in base],
        "lamb-large": [fake("lamb-large", a - 0.01 - 0.001 * i) for i, a in enumerate(base)],
    }
    result = experiments.ExperimentResult(lars, (0, 1, 2, 3), runs)
    unpaired = [result.summary(n, "test_accuracy") for n in ("sgd-large", "lars-large")]
    assert unpaired[0].high > unpaired[1].low  # the separate intervals overlap
    outcomes = {c.claim.candidate: c.outcome for c in result.comparisons() if c.claim.claimed}
    assert outcomes == {
        "sgd-large": "reproduced",
        "lars-large": "reproduced",
        "lamb-large": "contradicted",
    }


def test_early_training_loss_is_the_mean_of_the_first_epochs() -> None:
    run = fake("plain", 0.9, (2.0, 1.0, 0.5, 0.1, 0.05))
    assert experiments.EARLY_EPOCHS == 4
    assert experiments.metric_value(run, "early_train_loss") == 0.9
    assert experiments.metric_value(run, "final_train_loss") == 0.05
    assert experiments.metric_value(run, "test_accuracy") == 0.9


def test_a_diverged_seed_makes_its_loss_claims_inconclusive() -> None:
    wn = experiments.weight_normalization()
    runs = {
        "plain": [fake("plain", 0.9, (2.0, 1.0)) for _ in range(3)],
        "wn-init": [
            fake("wn-init", 0.9, (1.0, 0.5)),
            fake("wn-init", 0.9, (1.0, math.inf)),
            fake("wn-init", 0.9, (1.1, 0.4)),
        ],
        "wn": [fake("wn", 0.9, (2.5, 1.2)) for _ in range(3)],
    }
    (claim, extra) = experiments.ExperimentResult(wn, (0, 1, 2), runs).comparisons()
    assert claim.outcome == "inconclusive"
    assert math.isnan(claim.difference.mean)
    assert extra.outcome is None


def test_a_claim_must_name_configurations_of_its_experiment() -> None:
    wn = experiments.weight_normalization()
    claim = experiments.Claim("typo", "test_accuracy", "plain", "wn_init", "higher")
    with pytest.raises(ValueError, match=r"names configuration 'wn_init', which experiment 'wn'"):
        experiments.Experiment("wn", "t", "p", 1, 1, wn.configurations, (claim,))


@pytest.mark.parametrize("key", list(EXPERIMENTS))
def test_every_experiment_has_a_claim_with_a_verdict(key: str) -> None:
    assert any(claim.claimed for claim in EXPERIMENTS[key]().claims)


def test_lr_factor_warms_up_then_decays_to_zero() -> None:
    factors = [lr_factor("poly2", s, total_steps=10, warmup=4) for s in range(11)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4:] == pytest.approx([(1 - k / 6) ** 2 for k in range(7)])
    assert [lr_factor("constant", s, total_steps=10, warmup=2) for s in (0, 1, 5)] == [
        0.5,
        1.0,
        1.0,
    ]


# --- the data ---------------------------------------------------------------------------------


def test_digits_hard_is_fixed_and_keeps_the_labels() -> None:
    x, y = data.load_digits_hard()
    again, labels = data.load_digits_hard()
    plain, plain_labels = data.load_digits()
    assert x.shape == plain.shape == (1797, 1, 8, 8)
    assert np.array_equal(x, again)
    assert np.array_equal(y, plain_labels)
    assert np.array_equal(labels, y)
    assert not np.allclose(x, plain, atol=1.0)


def test_distortion_with_no_warp_and_no_noise_is_the_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MAX_ROTATION_DEG", "MAX_SCALE", "MAX_SHEAR", "MAX_SHIFT", "NOISE"):
        monkeypatch.setattr(data, name, 0.0)
    x = np.random.default_rng(0).normal(size=(5, 2, 8, 6)).astype(np.float32)
    np.testing.assert_allclose(data.distort(x, seed=3), x, atol=1e-6)


def test_bilinear_sampling_at_shifted_pixel_centres_shifts_the_image() -> None:
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(1, 2, 3, 4)
    rows, cols = np.meshgrid(np.arange(3.0), np.arange(4.0), indexing="ij")
    # Sampling at column c + 1 moves the image one pixel left, with zeros entering at the right.
    shifted = data._bilinear(x, (cols + 1).ravel()[None], rows.ravel()[None])
    expected = np.zeros_like(x)
    expected[..., :3] = x[..., 1:]
    np.testing.assert_allclose(shifted, expected)
    half = data._bilinear(x, (cols + 0.5).ravel()[None], rows.ravel()[None])
    np.testing.assert_allclose(half[..., :3], (x[..., :3] + x[..., 1:]) / 2)


# --- the options ------------------------------------------------------------------------------


def test_data_digits_hard_is_the_distorted_set(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = run_demo("--data", "digits-hard", "--experiments", "wn", *TINY, "--quick", "--out", out)
    assert run.status == 0, run.stderr
    settings = json.loads((out / "results.json").read_text())["settings"]
    assert settings["data"].startswith("digits-hard: scikit-learn's bundled digits with fixed")
    assert settings["input_shape"] == [1, 8, 8]


def test_seed_shifts_the_seeds(tmp_path: Path) -> None:
    data_path = save_npz(tmp_path / "mine.npz", **digit_like())
    out = tmp_path / "out"
    args = ("--data", data_path, "--experiments", "wn", *TINY, "--seed", "5", "--out", out)
    assert run_demo(*args).status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["seeds"] == [5, 6]
    assert [r["seed"] for r in results["experiments"]["wn"]["configurations"]["plain"]["runs"]] == [
        5,
        6,
    ]


def test_lamb_row_steps_every_weight_by_lr_times_its_norm() -> None:
    """The LAMB row is AdamW with the trust ratio on the weights: each weight's step is
    lr * ||w|| long, whatever AdamW's own step; biases and gains keep AdamW's step."""
    rows = {c.name: c for c in experiments.large_batch().configurations}
    model = rows["lamb-large"].build_model(1, 10)
    optimizer = rows["lamb-large"].build_optimizer(model)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    weights = [n for n, p in model.named_parameters() if p.ndim > 1]
    assert weights
    for name in weights:
        step = (model.get_parameter(name).detach() - before[name]).norm()
        expected = experiments.LAMB_LR * before[name].norm()
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=0)
