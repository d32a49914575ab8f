"""What the gradient-hook benchmarks share: the shape sets, their optimizers, the run.

Each benchmark names its candidates (an optimizer's step, with or without a hook, or a loop
written by hand before the step) for one set of parameter shapes; :func:`run` parses the
common arguments, builds the candidates for every set and prints their ratios to the
baseline, timed side by side.

:func:`hook_rows` are the rows that benchmarks/host.py (on the CPU proxy of a GPU host) and
benchmarks/gpu.py (on a GPU) both time: each of the four step hooks next to its peers, the
loop a user would write by hand, and the floors, with :data:`TARGETS` and :func:`verdicts`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from _timing import print_ratios, time_side_by_side
from normhooks import (
    AdaptiveGradientClipping,
    GradientCentralization,
    GradientLARS,
    TrustRatio,
)

SHAPES = Path(__file__).resolve().parent / "shapes"
SETS = {
    "ResNet-50": "resnet50_shapes.json",
    "ViT-B/16": "vitb16_shapes.json",
    "1,200 small tensors": "many_small_shapes.json",
}

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Step = Callable[[], object]
Candidates = Callable[[list[list[int]], torch.device], Mapping[str, Step]]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum and multi-tensor ops: the gradient hooks' baseline."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)


def optimizer_for(
    shapes: list[list[int]],
    device: torch.device,
    make: Make = sgd,
    grad_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """``make`` over random parameters of ``shapes`` with random gradients times
    ``grad_scale``, after one step (its state is created outside the timed region)."""
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.randn(shape, device=device))
        param.grad = torch.randn(shape, device=device) * grad_scale
        params.append(param)
    optimizer = make(params)
    optimizer.step()
    return optimizer


def hooked(optimizer: torch.optim.Optimizer, hook: object) -> Step:
    """The step of ``optimizer`` with ``hook`` (a StepHook) attached."""
    hook.attach(optimizer)  # type: ignore[attr-defined]
    return optimizer.step


def after(rewrite_: Callable[[list[torch.Tensor]], None], optimizer: torch.optim.Optimizer) -> Step:
    """A step that runs ``rewrite_`` on the parameters (no grad), then ``optimizer``'s step:
    a technique written by hand as a loop before the step."""
    params = optimizer.param_groups[0]["params"]

    def step() -> None:
        with torch.no_grad():
            rewrite_(params)
        optimizer.step()

    return step


def run(doc: str, baseline: str, candidates: Candidates, sets: Mapping[str, str] = SETS) -> None:
    """Times ``candidates(shapes, device)`` on every shape set and prints their ratios to the
    one named ``baseline``; ``doc`` is the benchmark's docstring, whose first line heads the
    output."""
    title = doc.splitlines()[0]
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", type=Path, default=SHAPES, help="folder of shape files")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"{title.rstrip('.')} on {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    for name, file in sets.items():
        shapes = json.loads((args.shapes / file).read_text())
        steps = candidates(shapes, device)
        times = time_side_by_side(steps, device, args.repeats)
        count = sum(torch.Size(s).numel() for s in shapes)
        print_ratios(f"{name}: {len(shapes)} tensors, {count:,} values", times, baseline)
        # The next set's tensors are allocated once these are freed.
        del steps


# ---------------------------------------------------------------------------------------------
# The four step hooks next to their peers, the loop a user writes by hand, and the floors

# Issue 26's targets: each hook's step over its optimizer's step alone, on the shape sets of
# TARGET_SETS (benchmarks report them; no timed test holds them).
TARGETS: dict[str, float] = {
    "GradientLARS": 1.15,
    "AdaptiveGradientClipping": 1.25,
    "TrustRatio": 1.25,
    "GradientCentralization": 1.15,
}
TARGET_SETS = ("ResNet-50", "ViT-B/16")

LARS_THRESHOLD, LARS_WEIGHT_DECAY, LARS_EPS = 1e-2, 1e-4, 1e-9
AGC_CLIPPING, AGC_EPS = 0.01, 1e-3
# AdamW's settings, which every LAMB row shares (those of benchmarks/trust_ratio.py).
ADAMW: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 1e-2}

SGD_ALONE = "SGD alone"
ADAMW_ALONE = "AdamW alone"
NOISE = "SGD alone, again (noise)"
# The least a gradient hook's kernels cost with the checks the staleness rules ask for.
CHECKS_FLOOR = "SGD + pre-hook: the staleness checks, 2 empty kernels (floor)"
# Each hook's own row: the one its target is read from.
NORMHOOKS_ROWS = {
    hook: f"{'AdamW' if hook == 'TrustRatio' else 'SGD'} + normhooks {hook}" for hook in TARGETS
}

Params = Callable[[], list[nn.Parameter]]
Hook = Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]], None]


@dataclass(frozen=True)
class HookRow:
    """One row: the step timed, the row it is a ratio to, and the group it is printed in."""

    step: Step
    baseline: str
    group: str


@dataclass(frozen=True)
class HookTable:
    """The rows of one shape set, in print order, and the notes on peers left out."""

    rows: dict[str, HookRow]
    notes: list[str]
    # Kept as long as the rows: see hook_rows.
    spare: torch.optim.Optimizer


def _trained(optimizer: torch.optim.Optimizer) -> list[tuple[dict[str, Any], Tensor, Tensor]]:
    """Every (group, parameter, gradient) the step updates, as a user's hook walks them."""
    return [
        (g, p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None
    ]


@torch.no_grad()
def lars_by_hand(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """LARS (arXiv:1708.03888, eq. 6) in a step pre-hook, a loop of torch ops per tensor."""
    for _, p, grad in _trained(optimizer):
        w_norm = torch.linalg.vector_norm(p)
        g_norm = torch.linalg.vector_norm(grad)
        rate = w_norm / (g_norm + LARS_WEIGHT_DECAY * w_norm + LARS_EPS)
        grad.add_(p, alpha=LARS_WEIGHT_DECAY).mul_(torch.where(w_norm > LARS_THRESHOLD, rate, 1.0))


@torch.no_grad()
def agc_by_hand(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """AGC (arXiv:2102.06171, section 4.1) in a step pre-hook: unit norms along dim 0."""
    for _, p, grad in _trained(optimizer):
        dims = tuple(range(1, p.ndim)) if p.ndim > 1 else None
        max_norm = torch.linalg.vector_norm(p, dim=dims, keepdim=True).clamp_(min=AGC_EPS)
        max_norm.mul_(AGC_CLIPPING)
        g_norm = torch.linalg.vector_norm(grad, dim=dims, keepdim=True)
        grad.mul_(torch.where(g_norm > max_norm, max_norm / g_norm, 1.0))


@torch.no_grad()
def gc_by_hand(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """Gradient centralization (arXiv:2004.01461) in a step pre-hook, one tensor at a time."""
    for _, _, grad in _trained(optimizer):
        if grad.ndim > 1:
            grad.sub_(grad.mean(dim=tuple(range(1, grad.ndim)), keepdim=True))


def trust_ratio_by_hand() -> tuple[Hook, Hook]:
    """LAMB's trust ratio (arXiv:1904.00962) on any optimizer, by hand: a pre-hook keeps a copy
    of each parameter, a post-hook rescales each update ``d`` to ``lr * ||w|| / ||d|| * d``."""
    olds: list[Tensor] = []

    @torch.no_grad()
    def before(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        olds[:] = [p.clone() for _, p, _ in _trained(optimizer)]

    @torch.no_grad()
    def after(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for (group, p, _), old in zip(_trained(optimizer), olds, strict=True):
            update = p - old
            w_norm = torch.linalg.vector_norm(old)
            u_norm = torch.linalg.vector_norm(update)
            ratio = torch.where((w_norm > 0) & (u_norm > 0), group["lr"] * w_norm / u_norm, 1.0)
            p.copy_(old.add_(update.mul_(ratio)))

    return before, after


def _empty(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    return None


def _launching(launch: Callable[[], None], count: int) -> Hook:
    def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for _ in range(count):
            launch()

    return hook


def _checking(launch: Callable[[], None], count: int) -> Hook:
    """A pre-hook doing the least that the step hooks' staleness rules ask of a step whose
    tensors are as at the last one, then ``count`` empty launches: each parameter found by
    identity, each gradient read, every tensor's type, dtype, device, sizes and strides in one
    C call (dynamo's ``TensorGuards``, which normhooks' records use), every address compared,
    and the launches' two outputs allocated. Written here, not with normhooks."""
    kept: dict[str, Any] = {}
    address = Tensor.data_ptr

    def record(params: list[Tensor], grads: list[Tensor]) -> None:
        tensors = [*params, *grads]
        kept["params"] = list(params)
        kept["check"] = torch._C._dynamo.guards.TensorGuards(  # type: ignore[call-arg]
            *tensors,
            tensor_check_names=[str(i) for i in range(len(tensors))],
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        ).check
        kept["addresses"] = tuple(map(address, params)), tuple(map(address, grads))

    def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        params = optimizer.param_groups[0]["params"]
        grads = list(map(operator.attrgetter("grad"), params))
        same = (
            kept
            and len(params) == len(kept["params"])
            and all(map(operator.is_, params, kept["params"]))
            and kept["check"](*params, *grads)
            and (tuple(map(address, params)), tuple(map(address, grads))) == kept["addresses"]
        )
        if not same:
            # The first step, and the steps counted under a dispatch mode (whose keys the
            # check compares): recorded again, as a hook would.
            record(params, grads)
        device = params[0].device
        torch.empty(2 * len(params), device=device), torch.empty(len(params), device=device)
        for _ in range(count):
            launch()

    return hook


def _with_hooks(
    optimizer: torch.optim.Optimizer, pre: Hook | None = None, post: Hook | None = None
) -> Step:
    if pre is not None:
        optimizer.register_step_pre_hook(pre)
    if post is not None:
        optimizer.register_step_post_hook(post)
    return optimizer.step


def _foreach_if_offered(optimizer_class: type, name: str) -> tuple[str, dict[str, bool]]:
    """The row's name and ``foreach=True`` where the peer's optimizer has that argument."""
    if "foreach" in inspect.signature(optimizer_class).parameters:
        return f"{name} (foreach)", {"foreach": True}
    return f"{name} (per tensor)", {}


def _peers() -> tuple[Any, Any, list[str]]:
    """pytorch-optimizer and timm where they import (None where not), and a note for each
    that does not. Imported here, not with the module: timm pulls in torchvision, which does
    not import beside every torch build."""
    notes = []
    pytorch_optimizer: Any = None
    timm: Any = None
    try:
        pytorch_optimizer = importlib.import_module("pytorch_optimizer")
    except ImportError as error:
        notes.append(f"pytorch-optimizer rows left out: {type(error).__name__}: {error}")
    try:
        timm = importlib.import_module("timm")
        importlib.import_module("timm.optim")
        importlib.import_module("timm.utils.agc")
    # timm's import fails in more ways than ImportError where torchvision does not match torch.
    except Exception as error:
        timm = None
        notes.append(f"timm rows left out, it does not import: {type(error).__name__}: {error}")
    return pytorch_optimizer, timm, notes


def hook_rows(params: Params, launch: Callable[[], None]) -> HookTable:
    """The rows, grouped per hook, for the parameter sets that ``params()`` makes (a fresh one,
    with gradients, per row), and the notes on rows left out.

    ``launch`` launches a kernel that does nothing (``_floor.launcher``): the floors are the
    optimizer with empty step hooks, then with two such launches, the least a kernel
    implementation of a hook costs (a pre-hook's two for a gradient hook; one before the step
    and one after it for TrustRatio), and for the gradient hooks the same launches after the
    checks that the staleness rules ask of every step (:func:`_checking`). Each row's ratio
    is to its optimizer alone; whole optimizers (LARS, LAMB) are compared with the optimizer
    the hook goes on.
    """
    pytorch_optimizer, timm, notes = _peers()
    rows: dict[str, HookRow] = {}

    def add(group: str, name: str, baseline: str, step: Step) -> None:
        rows[name] = HookRow(step, baseline, group)

    def stepped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer.step()  # the optimizer's state is made outside the timed steps
        return optimizer

    def sgd() -> torch.optim.Optimizer:
        return stepped(torch.optim.SGD(params(), lr=0.1, momentum=0.9, foreach=True))

    def adamw() -> torch.optim.Optimizer:
        return stepped(torch.optim.AdamW(params(), **ADAMW, foreach=True))

    # The first set made, and its optimizer's state, land in the blocks that earlier work
    # freed, scattered among others: a step over them read slower than over any set made after
    # (the noise row read below 1). An optimizer made first and kept with the rows takes them.
    spare = sgd()
    group = "SGD(momentum 0.9, foreach) alone, and its floors"
    add(group, SGD_ALONE, SGD_ALONE, sgd().step)
    add(group, NOISE, SGD_ALONE, sgd().step)
    add(group, "SGD + an empty step pre-hook (floor)", SGD_ALONE, _with_hooks(sgd(), _empty))
    add(
        group,
        "SGD + pre-hook launching 2 empty kernels (floor)",
        SGD_ALONE,
        _with_hooks(sgd(), _launching(launch, 2)),
    )
    add(
        group,
        CHECKS_FLOOR,
        SGD_ALONE,
        _with_hooks(sgd(), _checking(launch, 2)),
    )

    group = f"GradientLARS (weight decay {LARS_WEIGHT_DECAY:g})"
    lars = GradientLARS(LARS_THRESHOLD, LARS_WEIGHT_DECAY, LARS_EPS)
    add(group, NORMHOOKS_ROWS["GradientLARS"], SGD_ALONE, hooked(sgd(), lars))
    add(group, "SGD + LARS by hand (per-tensor loop)", SGD_ALONE, _with_hooks(sgd(), lars_by_hand))
    if pytorch_optimizer is not None:
        name, foreach = _foreach_if_offered(pytorch_optimizer.LARS, "pytorch-optimizer LARS")
        optimizer = pytorch_optimizer.LARS(
            params(),
            lr=0.1,
            momentum=0.9,
            weight_decay=LARS_WEIGHT_DECAY,
            trust_coefficient=1.0,
            **foreach,
        )
        add(group, name, SGD_ALONE, stepped(optimizer).step)
    if timm is not None:
        name, foreach = _foreach_if_offered(timm.optim.Lars, "timm Lars")
        optimizer = timm.optim.Lars(
            params(),
            lr=0.1,
            momentum=0.9,
            weight_decay=LARS_WEIGHT_DECAY,
            trust_coeff=1.0,
            eps=LARS_EPS,
            **foreach,
        )
        add(group, name, SGD_ALONE, stepped(optimizer).step)

    group = f"AdaptiveGradientClipping (clipping {AGC_CLIPPING:g})"
    agc = AdaptiveGradientClipping(AGC_CLIPPING, AGC_EPS)
    add(group, NORMHOOKS_ROWS["AdaptiveGradientClipping"], SGD_ALONE, hooked(sgd(), agc))
    add(group, "SGD + AGC by hand (per-tensor loop)", SGD_ALONE, _with_hooks(sgd(), agc_by_hand))
    if pytorch_optimizer is not None:
        peer_agc = pytorch_optimizer.agc

        # As Ranger21 calls it (pytorch_optimizer/optimizer/ranger21.py): the clipped
        # gradient copied back, one tensor at a time.
        @torch.no_grad()
        def pytorch_optimizer_agc(optimizer: torch.optim.Optimizer, *hook_args: object) -> None:
            for _, p, grad in _trained(optimizer):
                grad.copy_(peer_agc(p, grad, AGC_EPS, AGC_CLIPPING))

        name = "SGD + pytorch-optimizer agc (per tensor)"
        add(group, name, SGD_ALONE, _with_hooks(sgd(), pytorch_optimizer_agc))
    if timm is not None:
        clip = timm.utils.agc.adaptive_clip_grad

        def timm_agc(optimizer: torch.optim.Optimizer, *hook_args: object) -> None:
            clip([p for _, p, _ in _trained(optimizer)], AGC_CLIPPING, AGC_EPS)

        add(group, "SGD + timm adaptive_clip_grad", SGD_ALONE, _with_hooks(sgd(), timm_agc))

    group = "GradientCentralization"
    gc = GradientCentralization()
    add(group, NORMHOOKS_ROWS["GradientCentralization"], SGD_ALONE, hooked(sgd(), gc))
    add(group, "SGD + GC by hand (per-tensor loop)", SGD_ALONE, _with_hooks(sgd(), gc_by_hand))
    if pytorch_optimizer is not None:
        centralize = pytorch_optimizer.centralize_gradient

        # The list form, which stacks the gradients of each shape (as its SAM calls it,
        # pytorch_optimizer/optimizer/sam.py).
        def pytorch_optimizer_gc(optimizer: torch.optim.Optimizer, *hook_args: object) -> None:
            centralize([grad for _, _, grad in _trained(optimizer)], gc_conv_only=False)

        name = "SGD + pytorch-optimizer centralize_gradient (stacked per shape)"
        add(group, name, SGD_ALONE, _with_hooks(sgd(), pytorch_optimizer_gc))

    group = "AdamW(foreach) alone, and its floors"
    add(group, ADAMW_ALONE, ADAMW_ALONE, adamw().step)
    floor = _with_hooks(adamw(), _empty, _empty)
    add(group, "AdamW + empty step pre- and post-hooks (floor)", ADAMW_ALONE, floor)
    floor = _with_hooks(adamw(), _launching(launch, 1), _launching(launch, 1))
    add(group, "AdamW + hooks launching 1 empty kernel each (floor)", ADAMW_ALONE, floor)

    group = "TrustRatio"
    add(group, NORMHOOKS_ROWS["TrustRatio"], ADAMW_ALONE, hooked(adamw(), TrustRatio()))
    by_hand = _with_hooks(adamw(), *trust_ratio_by_hand())
    add(group, "AdamW + trust ratio by hand (per-tensor loop)", ADAMW_ALONE, by_hand)
    if pytorch_optimizer is not None:
        name, foreach = _foreach_if_offered(pytorch_optimizer.Lamb, "pytorch-optimizer Lamb")
        # adam_debias=True: the same work per step as AdamW + TrustRatio (see
        # benchmarks/trust_ratio.py).
        optimizer = pytorch_optimizer.Lamb(params(), **ADAMW, adam_debias=True, **foreach)
        add(group, name, ADAMW_ALONE, stepped(optimizer).step)
    if timm is not None:
        name, foreach = _foreach_if_offered(timm.optim.Lamb, "timm Lamb")
        # No global gradient clipping and the ratio on every tensor: the same maths.
        optimizer = timm.optim.Lamb(
            params(), **ADAMW, max_grad_norm=None, always_adapt=True, **foreach
        )
        add(group, name, ADAMW_ALONE, stepped(optimizer).step)
    return HookTable(rows, notes, spare)


def verdicts(ratios: Mapping[str, Mapping[str, float]]) -> list[str]:
    """One line per hook: its ratios (per shape set, per row name) on :data:`TARGET_SETS`
    against its target, met only if met on every one of them."""
    lines = []
    for hook, target in TARGETS.items():
        row = NORMHOOKS_ROWS[hook]
        figures = {name: ratios.get(name, {}).get(row) for name in TARGET_SETS}
        measured = [ratio for ratio in figures.values() if ratio is not None]
        if len(measured) < len(figures):
            verdict = "not measured"
        else:
            verdict = "met" if all(ratio <= target for ratio in measured) else "not met"
        text = ", ".join(
            f"{name} {'-' if ratio is None else f'{ratio:.2f}x'}" for name, ratio in figures.items()
        )
        baseline = ADAMW_ALONE if hook == "TrustRatio" else SGD_ALONE
        line = f"{hook} <= {target:.2f}x {baseline}: {text}: {verdict}"
        floors = [ratios.get(name, {}).get(CHECKS_FLOOR) for name in TARGET_SETS]
        if hook != "TrustRatio" and None not in floors:
            line += " (the checks' floor: " + ", ".join(f"{f:.2f}x" for f in floors) + ")"
        lines.append(line)
    return lines


def print_hook_table(
    title: str, rows: Mapping[str, HookRow], times: Mapping[str, float]
) -> dict[str, float]:
    """Prints the rows that were timed, grouped, each against its baseline; returns the ratios."""
    print(f"\n{title}")
    width = max(len(name) for name in rows) + 2
    ratios: dict[str, float] = {}
    group = None
    for name, row in rows.items():
        if row.group != group:
            group = row.group
            print(f"  {group}")
        if name not in times:
            print(f"    {name:<{width}}  failed")
            continue
        base = times.get(row.baseline)
        ratio = "" if base is None else f"{times[name] / base:6.3f}x"
        if base is not None:
            ratios[name] = times[name] / base
        print(f"    {name:<{width}}  {times[name] * 1e3:9.3f} ms  {ratio}")
    return ratios
