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
from normhooks.demo import data, report, runner
from normhooks.demo.data import SPLIT_SEED, TEST_FRACTION, Dataset
from normhooks.demo.errors import DemoError
from normhooks.demo.experiments import EXPERIMENTS

__all__ = ["DATASETS", "PROG", "QUICK_TRAIN_SAMPLES", "add_arguments", "run"]

PROG = "normhooks demo"
# The bundled data sets --data names; anything else is a path to a .npz file.
# digits stays the default: measured over 8 seeds, its claimed differences stand further
# from zero, relative to their intervals, than digits-hard's in 6 of the 7 claims (README).
DATASETS = ("digits", "digits-hard")
SEEDS = 8
# --quick: this many training images (the test set is kept whole), QUICK_SEEDS seeds and
# each experiment's quick_epochs.
QUICK_TRAIN_SAMPLES = 512
QUICK_SEEDS = 3


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


def _data(text: str) -> str | Path:
    return text if text in DATASETS else Path(text)


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
        "--seeds",
        type=_int_at_least(2),
        default=None,
        help=f"seeds per configuration, for the intervals (default: {SEEDS}; "
        f"{QUICK_SEEDS} with --quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run in under 30 s: {QUICK_TRAIN_SAMPLES} training images, "
        f"{QUICK_SEEDS} seeds, few epochs; its verdicts are indicative only",
    )
    parser.add_argument(
        "--data",
        type=_data,
        default=DATASETS[0],
        metavar="DATA",
        help="digits (default: scikit-learn's bundled digits), digits-hard (the same, each "
        "with a fixed random affine distortion and noise, so accuracies stay below the "
        "ceiling), or PATH.npz: a file with arrays x [N, C, H, W] or [N, H, W] and y [N] "
        "(class ids)",
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
        help="the first seed; the runs use seeds SEED .. SEED+SEEDS-1 (default: 0)",
    )
    parser.add_argument(
        "--workers",
        type=_int_at_least(1),
        default=None,
        help="processes training in parallel (default: one per CPU core, at most "
        f"{runner.GPU_WORKERS} on a GPU); 1 trains in this process",
    )
    parser.add_argument(
        "--threads",
        type=_int_at_least(1),
        default=1,
        help="CPU threads for torch per worker (default: 1; the models are so small that "
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


def _load(choice: str | Path, quick: bool) -> Dataset:
    if choice == "digits":
        x, y = data.load_digits()
        source = "digits: scikit-learn's bundled digits (sklearn.datasets.load_digits)"
    elif choice == "digits-hard":
        x, y = data.load_digits_hard()
        source = (
            "digits-hard: scikit-learn's bundled digits with fixed random affine distortions "
            f"and noise (distortion seed {data.DISTORTION_SEED})"
        )
    else:
        x, y = data.load_npz(Path(choice))
        source = str(choice)
    dataset = data.split(x, y, source=source)
    if quick:
        dataset = dataset.first_train(QUICK_TRAIN_SAMPLES)
    return dataset


class _Bar:
    """One progress bar over all runs, advanced by each run's share of the training steps."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm  # type: ignore[import-untyped]

        self._bar = tqdm(total=total, desc="training", unit="run", leave=True, dynamic_ncols=True)

    def done(self, job: runner.Job, wall_time_s: float) -> None:
        self._bar.update(1)
        self._bar.set_postfix_str(
            f"{job.experiment}: {job.configuration}, seed {job.seed}: {wall_time_s:.1f} s"
        )

    def close(self) -> None:
        self._bar.close()


def _settings(
    args: argparse.Namespace,
    dataset: Dataset,
    epochs: dict[str, int],
    seeds: Sequence[int],
    device: torch.device,
    workers: int,
) -> dict[str, Any]:
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
        "seeds": list(seeds),
        "quick": args.quick,
        "device": str(device),
        "workers": workers,
        "threads_per_worker": args.threads,
        "deterministic_algorithms": True,
        "versions": {
            "normhooks": normhooks.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def _demo(args: argparse.Namespace) -> int:
    needed = ["numpy", "matplotlib", "tqdm"] + (["sklearn"] if args.data in DATASETS else [])
    _require_extras(needed)
    device = _device(args.device)
    dataset = _load(args.data, args.quick)
    chosen = [key for key in EXPERIMENTS if key in args.experiments]
    report.check_writable(args.out, report.file_names(chosen))
    experiments = [EXPERIMENTS[key]() for key in chosen]
    epochs = {
        e.key: args.epochs or (e.quick_epochs if args.quick else e.epochs) for e in experiments
    }
    count = args.seeds or (QUICK_SEEDS if args.quick else SEEDS)
    seeds = list(range(args.seed, args.seed + count))
    jobs = runner.jobs_for(experiments, epochs, seeds)
    workers = args.workers or runner.default_workers(device, len(jobs))
    height, width = dataset.image_size
    print(
        f"{PROG}: {dataset.source}: {len(dataset.train_y)} training and "
        f"{len(dataset.test_y)} test images of {dataset.channels}x{height}x{width}, "
        f"{dataset.num_classes} classes; device {device}; {len(jobs)} runs "
        f"(seeds {seeds[0]}..{seeds[-1]}) on {workers} worker{'s' if workers > 1 else ''}",
        flush=True,
    )
    start = time.perf_counter()
    bar = _Bar(len(jobs))
    try:
        outcomes = runner.run(
            experiments,
            jobs,
            dataset,
            device=device,
            workers=workers,
            threads=args.threads,
            done=bar.done,
        )
    finally:
        bar.close()
    elapsed = time.perf_counter() - start
    print()
    print(report.table(outcomes))
    print()
    print(report.claims_table(outcomes))
    print()
    print(f"Means over {len(seeds)} seeds with 95 % t intervals; the rule: {report.RULE}.")
    if args.quick:
        print(report.QUICK_NOTE + ".")
    settings = _settings(args, dataset, epochs, seeds, device, workers)
    written = report.write_files(args.out, report.render(outcomes, settings))
    print()
    print(f"{len(written)} files written to {args.out} after {elapsed:.0f} s of training:")
    print("  " + ", ".join(path.name for path in written))
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs the demo with parsed ``args``; returns the exit status (2 after a reported error).

    Torch's global settings (threads, deterministic algorithms, random state) are as before
    afterwards.
    """
    try:
        return _demo(args)
    except DemoError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
