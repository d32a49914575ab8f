"""``normhooks demo``: its options, the checks that run before any training, and the run.

Every input is checked before the first step (the extra's packages, ``--device``,
``--data``, ``--out``); a problem is reported as one line, ``normhooks demo: error: ...``,
with exit status 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import normhooks
from normhooks.demo import data, report
from normhooks.demo.data import SPLIT_SEED, TEST_FRACTION, Dataset
from normhooks.demo.errors import DemoError
from normhooks.demo.experiments import EXPERIMENTS, Experiment, ExperimentResult
from normhooks.demo.training import Progress, RunResult, train, warm_up

__all__ = ["PROG", "QUICK_TRAIN_SAMPLES", "add_arguments", "run"]

PROG = "normhooks demo"
# --quick trains on this many training images (the test set is kept whole) with each
# experiment's quick_epochs, which takes under a minute on 2 CPU cores.
QUICK_TRAIN_SAMPLES = 512


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to ``parser``."""
    parser.add_argument(
        "--experiments",
        nargs="+",
        choices=tuple(EXPERIMENTS),
        default=list(EXPERIMENTS),
        metavar="NAME",
        help="which experiments to run: lars (large batch), ws (micro-batch), "
        "wn (weight normalization); default: all three",
    )
    parser.add_argument(
        "--epochs",
        type=_int_at_least(1),
        default=None,
        help="epochs per configuration, for every experiment (default: each experiment's own)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run in under a minute: {QUICK_TRAIN_SAMPLES} training images, few epochs",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        metavar="PATH.npz",
        help="a .npz file with arrays x [N, C, H, W] or [N, H, W] and y [N] (class ids) "
        "instead of scikit-learn's bundled digits",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("normhooks-demo"),
        help="directory for results.json and the plots (default: ./normhooks-demo/)",
    )
    parser.add_argument(
        "--device", default="cpu", help="torch device to train on: cpu (default), cuda, cuda:1"
    )
    parser.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=0,
        help="seed of the initializations and batch orders (default: 0)",
    )
    parser.add_argument(
        "--threads",
        type=_int_at_least(1),
        default=1,
        help="CPU threads for torch during the run (default: 1; the models are so small that "
        "more threads mostly add synchronization)",
    )


def _require_extras(modules: Sequence[str]) -> None:
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise DemoError(
            "the demo needs the extra: pip install 'normhooks[demo]' "
            f"(missing: {', '.join(missing)})"
        )


def _device(text: str) -> torch.device:
    where = f"--device {text}"
    try:
        device = torch.device(text)
    except RuntimeError:
        device = torch.device("meta")
    if device.type not in ("cpu", "cuda", "mps"):
        raise DemoError(f"{where}: not a device to train on (expected cpu, cuda, cuda:N or mps)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DemoError(f"{where}: MPS is not available on this machine")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DemoError(f"{where}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DemoError(f"{where}: this machine has {count} CUDA device(s)")
    return device


def _load(path: Path | None, quick: bool, device: torch.device) -> Dataset:
    if path is None:
        x, y = data.load_digits()
        source = "scikit-learn digits (sklearn.datasets.load_digits)"
    else:
        x, y = data.load_npz(path)
        source = str(path)
    dataset = data.split(x, y, source=source)
    if quick:
        dataset = dataset.first_train(QUICK_TRAIN_SAMPLES)
    return dataset.to(device)


def _progress(description: str) -> Callable[[int], Progress]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    def make(total: int) -> Progress:
        bar: Progress = tqdm(
            total=total, desc=description, unit="step", leave=True, dynamic_ncols=True
        )
        return bar

    return make


def _run_experiment(
    experiment: Experiment, dataset: Dataset, epochs: int, seed: int
) -> ExperimentResult:
    runs: dict[str, RunResult] = {}
    for configuration in experiment.configurations:
        runs[configuration.name] = train(
            configuration,
            dataset,
            epochs=epochs,
            seed=seed,
            progress=_progress(f"{experiment.key}: {configuration.label}"),
        )
    return ExperimentResult(experiment, runs, experiment.judge(runs))


def _settings(args: argparse.Namespace, dataset: Dataset, epochs: dict[str, int]) -> dict[str, Any]:
    return {
        "data": dataset.source,
        "split_seed": SPLIT_SEED,
        "test_fraction": TEST_FRACTION,
        "train_samples": len(dataset.train_y),
        "test_samples": len(dataset.test_y),
        "input_shape": [dataset.channels, *dataset.image_size],
        "num_classes": dataset.num_classes,
        "experiments": list(epochs),
        "epochs": epochs,
        "quick": args.quick,
        "seed": args.seed,
        "device": str(dataset.train_x.device),
        "threads": args.threads,
        "versions": {
            "normhooks": normhooks.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def _demo(args: argparse.Namespace) -> int:
    needed = ["numpy", "matplotlib", "tqdm"] + (["sklearn"] if args.data is None else [])
    _require_extras(needed)
    device = _device(args.device)
    dataset = _load(args.data, args.quick, device)
    chosen = [key for key in EXPERIMENTS if key in args.experiments]
    report.check_writable(args.out, report.file_names(chosen))
    experiments = [EXPERIMENTS[key]() for key in chosen]
    epochs = {
        e.key: args.epochs or (e.quick_epochs if args.quick else e.epochs) for e in experiments
    }
    height, width = dataset.image_size
    print(
        f"{PROG}: {dataset.source}: {len(dataset.train_y)} training and "
        f"{len(dataset.test_y)} test images of {dataset.channels}x{height}x{width}, "
        f"{dataset.num_classes} classes; device {device}, seed {args.seed}",
        flush=True,
    )
    warm_up()
    start = time.perf_counter()
    outcomes = [_run_experiment(e, dataset, epochs[e.key], args.seed) for e in experiments]
    elapsed = time.perf_counter() - start
    print()
    print(report.table(outcomes))
    print()
    for line in report.verdict_lines(outcomes):
        print(line)
    settings = _settings(args, dataset, epochs) | {"total_wall_time_s": elapsed}
    written = report.write_files(args.out, report.render(outcomes, settings))
    print()
    print(f"{len(written)} files written to {args.out} in {elapsed:.0f} s of training:")
    print("  " + ", ".join(path.name for path in written))
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs the demo with parsed ``args``; returns the exit status (2 after a reported error).

    Torch's CPU thread count is set to ``--threads`` for the run and restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _demo(args)
    except DemoError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)
