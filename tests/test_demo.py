"""``normhooks demo``: a quick run's outputs, the verdict rules, and every reported error."""

from __future__ import annotations

import contextlib
import io
import json
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
from normhooks.demo import experiments
from normhooks.demo.experiments import EXPERIMENTS
from normhooks.demo.training import Configuration, RunResult

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


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    out = tmp_path_factory.mktemp("quick") / "demo"
    return run_demo("--quick", "--out", out), out


@pytest.fixture(scope="module")
def results(quick: tuple[Run, Path]) -> dict[str, Any]:
    _, out = quick
    loaded: dict[str, Any] = json.loads((out / "results.json").read_text())
    return loaded


CONFIGURATIONS = [
    (key, configuration.name)
    for key, build in EXPERIMENTS.items()
    for configuration in build().configurations
]


def test_quick_run_succeeds(quick: tuple[Run, Path]) -> None:
    run, _ = quick
    assert run.status == 0, run.stderr


def test_quick_run_writes_exactly_the_results(quick: tuple[Run, Path]) -> None:
    _, out = quick
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["results.json", *(f"{key}.png" for key in EXPERIMENTS)]
    )
    assert [p.name for p in out.parent.iterdir()] == [out.name]


@pytest.mark.parametrize(("experiment", "name"), CONFIGURATIONS, ids=lambda v: str(v))
def test_json_has_every_configuration(results: dict[str, Any], experiment: str, name: str) -> None:
    run = results["experiments"][experiment]["configurations"][name]
    epochs = results["settings"]["epochs"][experiment]
    assert 0 <= run["test_accuracy"] <= 1
    assert run["wall_time_s"] > 0
    assert len(run["curves"]["train_loss"]) == len(run["curves"]["test_accuracy"]) == epochs
    assert run["final_train_loss"] == run["curves"]["train_loss"][-1]


@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_json_has_each_verdict_and_its_rule(results: dict[str, Any], experiment: str) -> None:
    entry = results["experiments"][experiment]
    assert isinstance(entry["verdict"]["reproduced"], bool)
    assert entry["verdict"]["summary"]
    assert entry["rule"].startswith("reproduced if")


def test_json_records_the_settings(results: dict[str, Any]) -> None:
    settings = results["settings"]
    assert settings["quick"] is True
    assert settings["seed"] == 0
    assert settings["device"] == "cpu"
    assert settings["data"].startswith("scikit-learn digits")
    assert settings["input_shape"] == [1, 8, 8]
    assert settings["train_samples"] == 512
    assert settings["train_samples"] + settings["test_samples"] <= 1797


@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_plots_are_valid_png_images(quick: tuple[Run, Path], experiment: str) -> None:
    _, out = quick
    path = out / f"{experiment}.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.ndim == 3
    assert pixels.shape[0] > 100
    assert pixels.shape[1] > 100


def test_table_is_printed_with_every_configuration(quick: tuple[Run, Path]) -> None:
    run, _ = quick
    assert "| experiment | configuration | test accuracy | final train loss | time |" in (
        " ".join(run.stdout.split())
    )
    for build in EXPERIMENTS.values():
        for configuration in build().configurations:
            assert f"| {configuration.label} " in run.stdout


@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_one_verdict_line_per_claim(quick: tuple[Run, Path], experiment: str) -> None:
    run, _ = quick
    title = EXPERIMENTS[experiment]().title
    lines = [line for line in run.stdout.splitlines() if line.startswith(f"{title} (")]
    assert len(lines) == 1
    assert "): reproduced; " in lines[0] or "): not reproduced; " in lines[0]


def test_one_progress_bar_per_configuration(quick: tuple[Run, Path]) -> None:
    run, _ = quick
    for key, build in EXPERIMENTS.items():
        for configuration in build().configurations:
            assert f"{key}: {configuration.label}: 100%" in run.stderr


def save_npz(path: Path, **arrays: np.ndarray[Any, Any]) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def digit_like(samples: int = 60, classes: int = 3) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    y = np.arange(samples) % classes
    x = rng.normal(size=(samples, 6, 6)).astype(np.float32) + y[:, None, None]
    return {"x": x, "y": y}


def test_user_data_runs_and_leaves_other_files_alone(tmp_path: Path) -> None:
    data = save_npz(tmp_path / "mine.npz", **digit_like())
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rng_state = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    run = run_demo("--data", data, "--experiments", "wn", "--epochs", "1", "--out", out)
    assert run.status == 0, run.stderr
    settings = json.loads((out / "results.json").read_text())["settings"]
    assert settings["data"] == str(data)
    assert settings["input_shape"] == [1, 6, 6]
    assert settings["num_classes"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "results.json", "wn.png"]
    assert (out / "notes.txt").read_text() == "mine"
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    assert torch.get_num_threads() == threads


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
    data = save_npz(tmp_path / "mine.npz", **digit_like())
    write_bytes = Path.write_bytes

    def fail_on_png(self: Path, content: bytes) -> int:
        if self.suffix == ".png":
            raise OSError(28, "No space left on device")
        return write_bytes(self, content)

    monkeypatch.setattr(Path, "write_bytes", fail_on_png)
    out = tmp_path / "deep" / "out"
    run = run_demo("--data", data, "--experiments", "wn", "--epochs", "1", "--out", out)
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
    [["--bogus"], ["--epochs", "0"], ["--experiments", "resnet"], ["--seed", "-1"]],
    ids=["unknown option", "zero epochs", "unknown experiment", "negative seed"],
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
        diverged=False,
    )


def judge(experiment: str, **runs: RunResult) -> experiments.Verdict:
    return EXPERIMENTS[experiment]().judge(runs)


@pytest.mark.parametrize(
    ("small", "large", "lars", "reproduced", "says"),
    [
        (0.98, 0.975, 0.99, False, "lost no accuracy to recover"),
        (0.98, 0.90, 0.95, True, "LARS recovered 5.0 of 8.0 points lost"),
        (0.98, 0.90, 0.93, False, "LARS recovered 3.0 of 8.0 points lost"),
        (0.98, 0.965, 0.972, False, "LARS recovered 0.7 of 1.5 points lost"),
    ],
    ids=["nothing lost", "half recovered", "under half", "under the margin"],
)
def test_large_batch_rule(
    small: float, large: float, lars: float, reproduced: bool, says: str
) -> None:
    verdict = judge(
        "lars",
        **{
            "sgd-small": fake("sgd-small", small),
            "sgd-large": fake("sgd-large", large),
            "lars-large": fake("lars-large", lars),
        },
    )
    assert verdict.reproduced is reproduced
    assert says in verdict.summary


@pytest.mark.parametrize(
    ("bn", "gn", "ws", "reproduced"),
    [(0.90, 0.95, 0.965, True), (0.90, 0.95, 0.955, False), (0.97, 0.95, 0.975, False)],
    ids=["ahead of both", "within the margin of GN", "within the margin of BN"],
)
def test_micro_batch_rule(bn: float, gn: float, ws: float, reproduced: bool) -> None:
    verdict = judge("ws", bn=fake("bn", bn), gn=fake("gn", gn), **{"gn-ws": fake("gn-ws", ws)})
    assert verdict.reproduced is reproduced


@pytest.mark.parametrize(
    ("wn", "init", "reproduced", "says"),
    [
        ((1.0, 0.8), (0.5, 0.3), True, "WN 0.900 (faster), WN + init 0.400 (faster)"),
        ((2.0, 1.0), (0.5, 0.3), False, "WN 1.500 (not faster), WN + init 0.400 (faster)"),
        ((1.0, 0.8, 0.1), (1.5, 1.45, 0.0), False, "WN + init 1.475 (not faster)"),
    ],
    ids=["both faster", "WN alone not faster", "only later epochs count"],
)
def test_weight_norm_rule(
    wn: Sequence[float], init: Sequence[float], reproduced: bool, says: str
) -> None:
    plain = fake("plain", 0.9, (2.0, 1.0) + (0.0,) * (len(wn) - 2))
    verdict = judge(
        "wn", plain=plain, wn=fake("wn", 0.9, wn), **{"wn-init": fake("wn-init", 0.9, init)}
    )
    assert verdict.reproduced is reproduced
    assert "first 2 epochs: plain 1.500" in verdict.summary
    assert says in verdict.summary
