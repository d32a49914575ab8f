"""Runs every (experiment, configuration, seed) of a demo, in parallel worker processes.

Each run is one job, independent of every other: its numbers depend only on the
configuration, the seed, the epochs, the data and the device, never on which worker ran it or
when. Workers are started with ``spawn`` (safe with CUDA and with OpenMP thread pools), train
with ``--threads`` CPU threads each and with deterministic algorithms, and send back plain
numbers; the parent rebuilds the results in seed order. With one worker the jobs run in this
process, under the same settings.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch

from normhooks.demo.data import Dataset
from normhooks.demo.experiments import EXPERIMENTS, Experiment, ExperimentResult
from normhooks.demo.training import RunResult, train, warm_up

__all__ = ["GPU_WORKERS", "Job", "default_workers", "deterministic", "jobs_for", "run"]

# The models are so small that one process leaves a GPU mostly idle; a few processes overlap
# their kernel launches.
GPU_WORKERS = 4

# cuBLAS is deterministic only with a fixed workspace (CUDA's documented setting); it must be
# in the environment before the first cuBLAS call, which is why it is set before any worker
# starts and in each worker before it touches the device.
_CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@dataclass(frozen=True)
class Job:
    """One training run: a configuration of an experiment, with one seed."""

    experiment: str
    configuration: str
    seed: int
    epochs: int


# A run's numbers without its configuration, whose callables do not pickle: every field of
# RunResult but that one, by name, so the two cannot drift apart.
_Measured = dict[str, Any]


def jobs_for(
    experiments: Sequence[Experiment], epochs: dict[str, int], seeds: Sequence[int]
) -> list[Job]:
    """Every run of ``experiments`` over ``seeds``, in a fixed order."""
    return [
        Job(e.key, c.name, seed, epochs[e.key])
        for e in experiments
        for c in e.configurations
        for seed in seeds
    ]


@contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Deterministic algorithms and ``threads`` CPU threads inside, as before afterwards."""
    os.environ.setdefault(*_CUBLAS_WORKSPACE)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
        torch.set_num_threads(was_threads)


# A worker's state, set once by _start_worker: the data on the worker's device, and the
# experiments, built once.
_WORKER: dict[str, Any] = {}


def _start_worker(dataset: Dataset, device: str, threads: int) -> None:
    os.environ.setdefault(*_CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    _WORKER["dataset"] = dataset.to(torch.device(device))
    _WORKER["experiments"] = {}
    warm_up()


def _experiment(cache: dict[str, Experiment], key: str) -> Experiment:
    if key not in cache:
        cache[key] = EXPERIMENTS[key]()
    return cache[key]


def _measure(job: Job, dataset: Dataset, cache: dict[str, Experiment]) -> _Measured:
    configuration = _experiment(cache, job.experiment).configuration(job.configuration)
    result = train(configuration, dataset, epochs=job.epochs, seed=job.seed)
    return {f.name: getattr(result, f.name) for f in fields(result) if f.name != "configuration"}


def _work(job: Job) -> _Measured:
    return _measure(job, _WORKER["dataset"], _WORKER["experiments"])


def _cost(job: Job, experiments: dict[str, Experiment], samples: int) -> float:
    """A rough relative cost, so the longest jobs start first and the workers end together."""
    batch = min(experiments[job.experiment].configuration(job.configuration).batch_size, samples)
    # Per step, a fixed cost comparable to about 32 samples' worth of compute.
    return job.epochs * (samples // batch) * (batch + 32)


def run(
    experiments: Sequence[Experiment],
    jobs: Sequence[Job],
    dataset: Dataset,
    *,
    device: torch.device,
    workers: int,
    threads: int,
    done: Callable[[Job, float], None] | None = None,
) -> list[ExperimentResult]:
    """Runs ``jobs`` on ``workers`` processes and collects each experiment's runs.

    Args:
        experiments: the experiments the jobs belong to.
        jobs: the runs, from :func:`jobs_for`.
        dataset: the split, on the CPU (each worker moves it to ``device``).
        device: where to train.
        workers: worker processes; 1 runs the jobs in this process.
        threads: CPU threads per worker.
        done: called in this process after each job with the job and its wall time.

    Returns:
        One result per experiment, in order, with each configuration's runs in seed order.
    """
    by_key = {e.key: e for e in experiments}
    samples = len(dataset.train_y)
    order = sorted(jobs, key=lambda j: -_cost(j, by_key, samples))
    measured: dict[Job, _Measured] = {}

    def record(job: Job, result: _Measured) -> None:
        measured[job] = result
        if done is not None:
            done(job, result["wall_time_s"])

    if workers == 1:
        local = dataset.to(device)
        warm_up()
        with deterministic(threads):
            for job in order:
                record(job, _measure(job, local, dict(by_key)))
    else:
        os.environ.setdefault(*_CUBLAS_WORKSPACE)
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker,
            initargs=(dataset, str(device), threads),
        ) as pool:  # fmt: skip
            futures = {pool.submit(_work, job): job for job in order}
            try:
                for future in concurrent.futures.as_completed(futures):
                    record(futures[future], future.result())
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    return [_collect(e, jobs, measured) for e in experiments]


def _collect(
    experiment: Experiment, jobs: Sequence[Job], measured: dict[Job, _Measured]
) -> ExperimentResult:
    mine = [j for j in jobs if j.experiment == experiment.key]
    seeds = tuple(sorted({j.seed for j in mine}))
    runs: dict[str, list[RunResult]] = {}
    for configuration in experiment.configurations:
        by_seed = {j.seed: measured[j] for j in mine if j.configuration == configuration.name}
        runs[configuration.name] = [
            RunResult(configuration=configuration, **by_seed[seed]) for seed in seeds
        ]
    return ExperimentResult(experiment, seeds, runs)


def default_workers(device: torch.device, jobs: int) -> int:
    """One worker per CPU core this process may use (at most ``GPU_WORKERS`` on a GPU, where
    each holds its own CUDA context), and at most one per job."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    if device.type != "cpu":
        cores = min(cores, GPU_WORKERS)
    return max(1, min(cores, jobs))
