"""GPU figures for normhooks against its peers and floors, side by side, in one short GPU slot.

Sections (each prints median times over interleaved repeats and ratios to its baseline; a
second copy of the baseline is the run's noise line). Each runs on its own: one that fails
prints its error and the next one runs; the exit status is 1 if anything failed.

1. Kernels alone: normhooks' Triton kernels called directly against the plain torch formula
   and the peers' formulations (weight norm and weight standardization forward + backward
   over ResNet-18's weights).
2. Gradient hooks, on ResNet-50's and ViT-B/16's parameter shapes (benchmarks/shapes, at
   full size): the LARS kernel alone against a per-parameter loop; then the rows
   benchmarks/host.py times on the proxy (``_hooks.hook_rows``): the optimizer's step alone
   (SGD(momentum, foreach), AdamW(foreach)) and its floors (empty step hooks; those hooks
   launching two empty Triton kernels), each of GradientLARS, AdaptiveGradientClipping,
   GradientCentralization and TrustRatio beside its peers (pytorch-optimizer's LARS, agc,
   centralize_gradient and Lamb; timm's Lars, adaptive_clip_grad and Lamb where timm
   imports) and a loop written by hand; each sample 5 steps between two synchronizations;
   then one verdict line per hook against issue 26's targets.
3. Models, eager train step (forward, cross-entropy backward, SGD): ResNet-18 with GroupNorm
   at batch 32 and 256 and a 2-layer LSTM. Candidates: plain; normhooks' weight
   standardization and the batch_norm formulation timm's StdConv2d uses; normhooks'
   weight_norm and torch's torch.nn.utils.parametrizations.weight_norm; the floors (an empty
   parametrization and a multiply-by-1 parametrization).
4. The host proxy (benchmarks/host.py --quick) on this machine's CPU: the CPU's prediction of
   the host time, next to the GPU's own figures of section 3.
5. ResNet-18 at batch 32 under torch.compile, inductor's default mode and
   mode="reduce-overhead": plain, normhooks' weight_norm and weight standardization in both
   modes, then the peers in both, compiled in that order while the time budget lasts (a
   compile takes tens of seconds; none starts that the longest so far would carry past the
   budget); those left out are named.

The budget (240 s from the start of main; 120 with --quick) is what keeps a run inside a
5-minute GPU slot: sections 1-4 are expected to take a minute or two on an H200 (not measured
yet; the host proxy's hooks tables, with their per-tensor loops over 1,200 tensors, are its
longest part), and section 5 compiles while the rest lasts. ``--only hooks host`` runs the
gradient hooks on the GPU and on its host's proxy alone.

    python3 benchmarks/gpu.py [--repeats 10] [--budget 240] [--quick] [--no-compile]
                              [--only kernels hooks models host compile]
    python3 benchmarks/gpu.py --smoke   # no GPU: every section on tiny CPU models, the
                                        # kernels through the host proxy (nothing is timed)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm as torch_weight_norm

import _hooks
from _models import (
    LSTMModel,
    ResNet18,
    on_every_matrix,
    with_batch_norm_standardization,
    with_empty_parametrizations,
)
from _timing import print_ratios, synchronize, time_side_by_side
from normhooks import (
    _kernels,
    apply_weight_norm,
    apply_weight_standardization,
)
from normhooks import weight_norm as normhooks_weight_norm
from normhooks.weight_norm import _weight_norm as plain_weight_norm

SHAPES = Path(__file__).resolve().parent / "shapes"
# The gradient hooks' sets: those of issue 26's targets (host.py adds many small tensors).
SHAPE_SETS = {"ResNet-50": "resnet50_shapes.json", "ViT-B/16": "vitb16_shapes.json"}
# Optimizer steps per sample in the hooks' tables.
HOOK_STEPS = 5
WEIGHT_DECAY = 1e-4
WS_EPS = 1e-5
WN_EPS = 1e-12


@dataclass
class Run:
    """The run's settings, its clock and what failed."""

    device: torch.device
    repeats: int
    budget: float
    batches: tuple[int, ...]
    width: int  # ResNet-18's first width
    image: int
    lstm: tuple[int, int, int]  # features, hidden, steps
    shape_cap: int | None  # every dimension of the hooks' tensors capped at this
    compile_modes: tuple[tuple[str, dict[str, Any]], ...]
    host_args: tuple[str, ...]
    start: float = field(default_factory=time.perf_counter)
    failures: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, title: str, body: Callable[[Run], None]) -> None:
        """Runs one section; an error is printed and recorded, and the run goes on."""
        print(f"\n== {title}", flush=True)
        began = time.perf_counter()
        try:
            body(self)
        except Exception:  # a benchmark reports, it does not stop at one failure
            traceback.print_exc(file=sys.stdout)
            self.failures.append(title)
        print(f"[{time.perf_counter() - began:.0f} s; {self.elapsed():.0f} s in all]", flush=True)

    def working(
        self, title: str, candidates: dict[str, Callable[[], object]]
    ) -> dict[str, Callable[[], object]]:
        """The candidates that run once; one that fails says so, is recorded and left out."""
        working = {}
        for name, fn in candidates.items():
            try:
                fn()
                synchronize(self.device)
                working[name] = fn
            except Exception as error:  # a benchmark reports, it does not stop at one failure
                print(f"  [{title}] {name}: failed, {type(error).__name__}: {error}")
                self.failures.append(f"{title}: {name}")
        return working

    def measure(self, title: str, candidates: dict[str, Callable[[], object]]) -> None:
        """Times the candidates that run, against the first of them."""
        working = self.working(title, candidates)
        if not working:
            return
        times = time_side_by_side(working, self.device, self.repeats)
        print_ratios(title, times, next(iter(working)))


def gpu_run(repeats: int, budget: float, quick: bool, compile_: bool) -> Run:
    modes: tuple[tuple[str, dict[str, Any]], ...] = (
        ("default", {}),
        ("reduce-overhead", {"mode": "reduce-overhead"}),
    )
    return Run(
        device=torch.device("cuda"),
        repeats=repeats,
        budget=budget,
        batches=(32,) if quick else (32, 256),
        width=64,
        image=64,
        lstm=(128, 256, 32),
        shape_cap=None,
        compile_modes=modes if compile_ else (),
        host_args=("--quick",),
    )


def smoke_run(budget: float, compile_: bool) -> Run:
    # One thread: the smoke run only checks that everything runs, on a CPU that may be shared.
    torch.set_num_threads(1)
    return Run(
        device=torch.device("cpu"),
        repeats=1,
        budget=budget,
        batches=(2,),
        width=8,
        image=32,
        lstm=(8, 16, 4),
        shape_cap=4,
        # Dynamo alone: the compiled section's code runs, without a C++ build of the graph.
        compile_modes=(("eager backend (smoke)", {"backend": "eager"}),) if compile_ else (),
        host_args=("--smoke",),
    )


# ---------------------------------------------------------------------------------------------
# Peers, written here from their descriptions.


def with_normhooks_standardization(model: nn.Module) -> nn.Module:
    return apply_weight_standardization(model, eps=WS_EPS)


def naive_lars_(params: list[Tensor], weight_decay: float) -> None:
    """The per-parameter loop most hand-written LARS hooks use: several kernels per tensor."""
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        w_norm = torch.linalg.vector_norm(param)
        g_norm = torch.linalg.vector_norm(grad)
        rate = torch.where(w_norm > 1e-2, w_norm / (1e-9 + g_norm + weight_decay * w_norm), 1.0)
        grad.add_(param, alpha=weight_decay).mul_(rate)


# ---------------------------------------------------------------------------------------------
# Models


def train_steps(
    models: dict[str, nn.Module], x: Tensor, target: Tensor, compile_options: dict[str, Any] | None
) -> dict[str, Callable[[], object]]:
    """One train-step closure per model: forward (compiled with ``compile_options`` unless
    None), cross-entropy backward, SGD(momentum) step."""
    steps = {}
    for name, model in models.items():
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        forward: Callable[[Tensor], Tensor] = model
        if compile_options is not None:
            forward = torch.compile(model, **compile_options)
        graphs = compile_options is not None and compile_options.get("mode") == "reduce-overhead"

        def step(
            forward: Callable[[Tensor], Tensor] = forward,
            optimizer: torch.optim.Optimizer = optimizer,
            graphs: bool = graphs,
        ) -> None:
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x), target).backward()
            optimizer.step()

        steps[name] = step
    return steps


VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "plain, a second copy (noise)": lambda m: m,
    "normhooks weight standardization": with_normhooks_standardization,
    "timm-style batch_norm standardization": functools.partial(
        with_batch_norm_standardization, eps=WS_EPS
    ),
    "normhooks weight_norm": functools.partial(on_every_matrix, normhooks_weight_norm),
    # The tree conversion: every weight in one fused launch each way (convolutions and
    # linear layers, so not the LSTM's matrices).
    "normhooks apply_weight_norm (fused)": apply_weight_norm,
    "torch weight_norm": functools.partial(on_every_matrix, torch_weight_norm),
    "empty parametrization (floor)": with_empty_parametrizations,
    "multiply-by-1 parametrization (floor)": functools.partial(
        with_empty_parametrizations, times_one=True
    ),
}
STANDARDIZATIONS = ("normhooks weight standardization", "timm-style batch_norm standardization")
CNN_ONLY = (*STANDARDIZATIONS, "normhooks apply_weight_norm (fused)")


def model_variants(plain: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Module]:
    return {name: VARIANTS[name](copy.deepcopy(plain)) for name in names}


def resnet_data(run: Run, batch: int) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    plain = ResNet18(width=run.width).to(run.device)
    x = torch.randn(batch, 3, run.image, run.image, device=run.device)
    target = torch.randint(0, 100, (batch,), device=run.device)
    return plain, x, target


def eager_models(run: Run) -> None:
    for batch in run.batches:
        plain, x, target = resnet_data(run, batch)
        run.measure(
            f"ResNet-18 (GroupNorm), batch {batch}, {run.image}x{run.image}, eager",
            train_steps(model_variants(plain, tuple(VARIANTS)), x, target, None),
        )
    torch.manual_seed(0)
    features, hidden, steps = run.lstm
    lstm = LSTMModel(features, hidden).to(run.device)
    x = torch.randn(run.batches[0], steps, features, device=run.device)
    target = torch.randint(0, 10, (run.batches[0],), device=run.device)
    names = tuple(name for name in VARIANTS if name not in CNN_ONLY)
    run.measure(
        f"2-layer LSTM ({features} -> {hidden}), batch {run.batches[0]}, {steps} steps, eager",
        train_steps(model_variants(lstm, names), x, target, None),
    )


# What is compiled, in this order while the budget lasts: normhooks and the baseline in every
# mode first, then the peers. The floors are left out: inductor compiles an empty
# parametrization away.
COMPILED = ("plain", "normhooks weight_norm", "normhooks weight standardization")
COMPILED_PEERS = ("torch weight_norm", "timm-style batch_norm standardization")


def compiled_models(run: Run) -> None:
    plain, x, target = resnet_data(run, run.batches[0])
    steps = {
        label: train_steps(model_variants(plain, COMPILED + COMPILED_PEERS), x, target, options)
        for label, options in run.compile_modes
    }
    order = [
        (label, name) for names in (COMPILED, COMPILED_PEERS) for label in steps for name in names
    ]
    compiled: dict[str, dict[str, Callable[[], object]]] = {label: {} for label in steps}
    took: list[float] = []
    # Ten models of one class: raise dynamo's recompile limit, and make hitting it an error
    # rather than a silent fall back to eager (which would time the eager step as compiled).
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        for index, (label, name) in enumerate(order):
            # A compile starts only if the longest so far (a guess before the first) still fits.
            if run.elapsed() + max(took, default=60.0) > run.budget:
                left = ", ".join(f"{n} (mode={m})" for m, n in order[index:])
                print(f"  [budget] not compiled: {left}")
                break
            began = time.perf_counter()
            try:
                steps[label][name]()
                synchronize(run.device)
            except Exception as error:  # a benchmark reports, it does not stop at one failure
                print(f"  [mode={label}] {name}: failed, {type(error).__name__}: {error}")
                run.failures.append(f"compiled mode={label}: {name}")
                continue
            took.append(time.perf_counter() - began)
            print(f"  compiled {name} (mode={label}) in {took[-1]:.0f} s", flush=True)
            compiled[label][name] = steps[label][name]
        for label, chosen in compiled.items():
            if chosen:
                ordered = {n: chosen[n] for n in COMPILED + COMPILED_PEERS if n in chosen}
                run.measure(
                    f"ResNet-18 (GroupNorm), batch {run.batches[0]}, torch.compile mode={label}",
                    ordered,
                )


# ---------------------------------------------------------------------------------------------
# Kernels and hooks


def kernels_alone(run: Run) -> None:
    print("float32, forward + backward over all of ResNet-18's weights")
    device = run.device
    weights = [p.detach() for p in ResNet18(width=run.width).to(device).parameters() if p.ndim >= 2]
    vs = [w.clone().requires_grad_() for w in weights]
    gs = [
        w.flatten(1).norm(dim=1).view(-1, *[1] * (w.ndim - 1)).clone().requires_grad_()
        for w in weights
    ]
    upstream = [torch.randn_like(w) for w in weights]

    def plain_wn() -> None:
        outs = []
        for g, v in zip(gs, vs, strict=True):
            norm = torch.linalg.vector_norm(v, dim=list(range(1, v.ndim)), keepdim=True)
            outs.append(g * v / (norm + WN_EPS))
        torch.autograd.backward(outs, upstream)

    def torch_fused_wn() -> None:
        outs = [torch._weight_norm(v, g, 0) for g, v in zip(gs, vs, strict=True)]
        torch.autograd.backward(outs, upstream)

    def kernel_wn() -> None:
        outs = [
            _kernels.fused_weight_norm(g, v, 0, WN_EPS, plain=plain_weight_norm)
            for g, v in zip(gs, vs, strict=True)
        ]
        torch.autograd.backward(outs, upstream)

    plans = tuple(
        _kernels.weight_norm_plan(g, v, 0, WN_EPS, plain_weight_norm)
        for g, v in zip(gs, vs, strict=True)
    )
    tensors = [t for pair in zip(gs, vs, strict=True) for t in pair]

    def fused_wn() -> None:
        torch.autograd.backward(_kernels.fuse_weight_norms(plans, tensors), upstream)

    run.measure(
        f"weight norm, {len(weights)} weights",
        {
            "plain formula (autograd)": plain_wn,
            "plain formula, again (noise)": plain_wn,
            "torch._weight_norm (fused, no eps)": torch_fused_wn,
            "normhooks kernel (exact, eps)": kernel_wn,
            "normhooks fused kernel, all weights in one launch": fused_wn,
        },
    )

    rows = [w.clone().reshape(w.shape[0], -1).requires_grad_() for w in weights]
    row_grads = [u.reshape(u.shape[0], -1) for u in upstream]

    def layer_norm_ws() -> None:
        outs = [F.layer_norm(r, r.shape[1:], eps=WS_EPS) for r in rows]
        torch.autograd.backward(outs, row_grads)

    def batch_norm_ws() -> None:
        outs = [
            F.batch_norm(r.unsqueeze(0), None, None, training=True, momentum=0.0, eps=WS_EPS)
            for r in rows
        ]
        torch.autograd.backward(outs, [g.unsqueeze(0) for g in row_grads])

    def kernel_ws() -> None:
        outs = [_kernels.standardize_rows(r, WS_EPS) for r in rows]
        torch.autograd.backward(outs, row_grads)

    run.measure(
        f"weight standardization, {len(weights)} weights",
        {
            "layer_norm formula": layer_norm_ws,
            "layer_norm formula, again (noise)": layer_norm_ws,
            "timm-style batch_norm formula": batch_norm_ws,
            "normhooks kernel": kernel_ws,
        },
    )


def parameter_set(run: Run, shapes: list[list[int]]) -> list[nn.Parameter]:
    params = []
    for shape in shapes:
        size = shape if run.shape_cap is None else [min(d, run.shape_cap) for d in shape]
        param = nn.Parameter(torch.randn(size, device=run.device))
        # Small enough that AGC clips about half its units: both of its branches do work.
        param.grad = torch.randn(size, device=run.device) * 0.01
        params.append(param)
    return params


def lars_kernel_(params: list[nn.Parameter], grads: list[Tensor]) -> None:
    _kernels.lars_unit_(
        params,
        grads,
        threshold=1e-2,
        weight_decay=WEIGHT_DECAY,
        eps=1e-9,
        trust_coefficient=1.0,
        lr=None,
        clip=False,
        grad_scale=None,
        found_inf=None,
    )


def gradient_hooks(run: Run) -> None:
    # Imported here, once the interpreter is off in a smoke run: its kernel must compile.
    import _floor

    print(
        f"float32; LARS weight decay {_hooks.LARS_WEIGHT_DECAY:g}, AGC clipping "
        f"{_hooks.AGC_CLIPPING:g}; {HOOK_STEPS} steps per sample"
    )
    launch = _floor.launcher(run.device)
    ratios = {}
    for title, file in SHAPE_SETS.items():
        shapes = json.loads((SHAPES / file).read_text())
        params = parameter_set(run, shapes)
        grads = [p.grad for p in params]
        run.measure(
            f"{title} ({len(shapes)} tensors): LARS alone",
            {
                "per-parameter loop": functools.partial(naive_lars_, params, WEIGHT_DECAY),
                "per-parameter loop, again (noise)": functools.partial(
                    naive_lars_, params, WEIGHT_DECAY
                ),
                "normhooks kernel (2 launches)": functools.partial(lars_kernel_, params, grads),
            },
        )
        del params, grads
        table = f"{title}: optimizer step, each row against its optimizer alone"
        hooks = _hooks.hook_rows(functools.partial(parameter_set, run, shapes), launch)
        working = run.working(table, {name: row.step for name, row in hooks.rows.items()})
        times = time_side_by_side(working, run.device, run.repeats, calls=HOOK_STEPS)
        ratios[title] = _hooks.print_hook_table(table, hooks.rows, times)
        for note in hooks.notes:
            print(f"  ({note})")
        del hooks, working
        if run.device.type == "cuda":
            torch.cuda.empty_cache()  # the next set's tensors where these were
    where = "this GPU" if run.device.type == "cuda" else "a smoke run (not a measurement)"
    print(f"\nIssue 26's targets on {where}:")
    for line in _hooks.verdicts(ratios):
        print(f"  {line}")


def host_proxy(run: Run) -> None:
    import host

    status = host.main(list(run.host_args))
    if status:
        raise RuntimeError(f"benchmarks/host.py exited with {status}")


# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def kernels_for(run: Run) -> Iterator[None]:
    """On the GPU, nothing to do; in a smoke run, the kernels go through the host proxy."""
    if run.device.type == "cuda":
        yield
        return
    import _proxy

    with _proxy.cuda_path_on_cpu():
        yield


SECTIONS = ("kernels", "hooks", "models", "host", "compile")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole run; no compile starts that would overrun it (240, or 120 "
        "with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="batch 32 only, 5 repeats")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled section")
    parser.add_argument("--smoke", action="store_true", help="no GPU: check that every part runs")
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="the sections to run"
    )
    args = parser.parse_args()
    if args.smoke:
        # Before anything imports normhooks' kernels: they must compile, not be interpreted.
        import _proxy

        _proxy.interpreter_off()
        run = smoke_run(args.budget or float("inf"), not args.no_compile)
    else:
        if not torch.cuda.is_available():
            print("benchmarks/gpu.py needs a CUDA device (or --smoke to check it on the CPU)")
            return 1
        if not _kernels.available(torch.ones(1, device="cuda")):
            print("benchmarks/gpu.py needs Triton for the kernels; it is not importable here.")
            return 1
        budget = args.budget if args.budget is not None else 120.0 if args.quick else 240.0
        repeats = 5 if args.quick else args.repeats
        run = gpu_run(repeats, budget, args.quick, not args.no_compile)
    where = "the CPU, a smoke run (the kernels launch nothing: its times mean nothing)"
    if run.device.type == "cuda":
        where = torch.cuda.get_device_name()
    print(
        f"normhooks on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; medians "
        f"of {run.repeats} interleaved repeats; budget {run.budget:.0f} s"
    )
    with kernels_for(run):
        if "kernels" in args.only:
            run.section("1. Kernels alone", kernels_alone)
        if "hooks" in args.only:
            run.section("2. Gradient hooks", gradient_hooks)
        if "models" in args.only:
            run.section(
                "3. Models, eager: train step (forward, cross-entropy backward, SGD)", eager_models
            )
    if "host" in args.only:
        run.section("4. Host proxy on this machine's CPU (benchmarks/host.py)", host_proxy)
    if run.compile_modes and "compile" in args.only:
        with kernels_for(run):
            run.section("5. Models under torch.compile: train step", compiled_models)
    print(f"\ntotal {run.elapsed():.0f} s")
    if run.failures:
        print("failed: " + "; ".join(run.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
