"""GPU figures for normhooks against its peers and floors, side by side in one run.

Sections (each prints median times over interleaved repeats and ratios to its baseline; a
second copy of the baseline is the run's noise line):

1. Kernels alone: normhooks' Triton kernels called directly against the plain torch formula
   and the peers' formulations (weight norm and weight standardization forward + backward
   over ResNet-18's weights; LARS over the parameter sets of benchmarks/shapes).
2. LARS in an optimizer step: SGD alone; + normhooks' GradientLARS; + a per-parameter loop;
   + the LARS kernel called directly.
3. Models, train step (forward, backward, SGD): ResNet-18 with GroupNorm at batch 32 and 256
   and a 2-layer LSTM, eager; ResNet-18 at batch 32 under torch.compile (inductor, and
   mode="reduce-overhead"). Candidates: plain; normhooks' weight standardization and the
   batch_norm formulation timm's StdConv2d uses; normhooks' weight_norm and torch's
   torch.nn.utils.parametrizations.weight_norm; the floors (an empty parametrization and a
   multiply-by-1 parametrization).

    python benchmarks/gpu.py [--repeats 10] [--no-compile]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm as torch_weight_norm

from _models import LSTMModel, ResNet18, on_every_matrix, with_empty_parametrizations
from _timing import print_ratios, time_side_by_side
from normhooks import GradientLARS, _kernels, apply_weight_standardization
from normhooks import weight_norm as normhooks_weight_norm

SHAPES = Path(__file__).resolve().parent / "shapes"
SHAPE_SETS = {
    "ResNet-50": "resnet50_shapes.json",
    "ViT-B/16": "vitb16_shapes.json",
    "1,200 small tensors": "many_small_shapes.json",
}
WEIGHT_DECAY = 1e-4
WS_EPS = 1e-5
WN_EPS = 1e-12
DEVICE = torch.device("cuda")


# ---------------------------------------------------------------------------------------------
# Peers, written here from their descriptions.


class BatchNormStandardization(nn.Module):
    """Weight standardization as timm's StdConv2d computes it: ``F.batch_norm`` over the weight
    viewed as ``[1, out, -1]``, training mode, momentum 0, no running statistics."""

    def forward(self, weight: Tensor) -> Tensor:
        rows = weight.reshape(1, weight.shape[0], -1)
        standardized = F.batch_norm(rows, None, None, training=True, momentum=0.0, eps=WS_EPS)
        return standardized.reshape_as(weight)


def with_batch_norm_standardization(model: nn.Module) -> nn.Module:
    for module in list(model.modules()):
        if isinstance(module, nn.Conv2d):
            parametrize.register_parametrization(module, "weight", BatchNormStandardization())
    return model


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
# Timing helpers


def measure(title: str, candidates: dict[str, Callable[[], object]], repeats: int) -> None:
    """Times the candidates that run; one that fails says so and is left out of the table."""
    working = {}
    for name, fn in candidates.items():
        try:
            fn()
            torch.cuda.synchronize()
            working[name] = fn
        except Exception as error:  # a benchmark reports, it does not stop at one failure
            print(f"  [{title}] {name}: failed, {type(error).__name__}: {error}")
    if not working:
        return
    times = time_side_by_side(working, DEVICE, repeats)
    print_ratios(title, times, next(iter(working)))


def train_steps(
    models: dict[str, nn.Module], x: Tensor, target: Tensor, mode: str | None
) -> dict[str, Callable[[], object]]:
    """One train-step closure per model: forward (compiled with ``mode`` unless None),
    cross-entropy backward, SGD(momentum) step."""
    steps = {}
    for name, model in models.items():
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        forward: Callable[[Tensor], Tensor] = model
        if mode is not None:
            forward = torch.compile(model, mode=None if mode == "default" else mode)

        def step(
            forward: Callable[[Tensor], Tensor] = forward,
            optimizer: torch.optim.Optimizer = optimizer,
        ) -> None:
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x), target).backward()
            optimizer.step()

        steps[name] = step
    return steps


def model_variants(
    plain: nn.Module, floors: bool, standardize: bool = True
) -> dict[str, nn.Module]:
    variants: dict[str, Callable[[nn.Module], nn.Module]] = {
        "plain": lambda m: m,
        "plain, a second copy (noise)": lambda m: m,
        "normhooks weight standardization": with_normhooks_standardization,
        "timm-style batch_norm standardization": with_batch_norm_standardization,
        "normhooks weight_norm": functools.partial(on_every_matrix, normhooks_weight_norm),
        "torch weight_norm": functools.partial(on_every_matrix, torch_weight_norm),
    }
    if not standardize:  # weight standardization is for convolutions
        del variants["normhooks weight standardization"]
        del variants["timm-style batch_norm standardization"]
    if floors:
        variants["empty parametrization (floor)"] = with_empty_parametrizations
        variants["multiply-by-1 parametrization (floor)"] = lambda m: with_empty_parametrizations(
            m, times_one=True
        )
    return {name: make(copy.deepcopy(plain)) for name, make in variants.items()}


# ---------------------------------------------------------------------------------------------
# Sections


def kernels_alone(repeats: int) -> None:
    print("\n== 1. Kernels alone (float32, forward + backward over all of ResNet-18's weights)")
    weights = [p.detach() for p in ResNet18().to(DEVICE).parameters() if p.ndim >= 2]
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
        outs = [_kernels.fused_weight_norm(g, v, 0, WN_EPS) for g, v in zip(gs, vs, strict=True)]
        torch.autograd.backward(outs, upstream)

    measure(
        f"weight norm, {len(weights)} weights",
        {
            "plain formula (autograd)": plain_wn,
            "plain formula, again (noise)": plain_wn,
            "torch._weight_norm (fused, no eps)": torch_fused_wn,
            "normhooks kernel (exact, eps)": kernel_wn,
        },
        repeats,
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

    measure(
        f"weight standardization, {len(weights)} weights",
        {
            "layer_norm formula": layer_norm_ws,
            "layer_norm formula, again (noise)": layer_norm_ws,
            "timm-style batch_norm formula": batch_norm_ws,
            "normhooks kernel": kernel_ws,
        },
        repeats,
    )


def parameter_set(shapes: list[list[int]]) -> list[nn.Parameter]:
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.randn(shape, device=DEVICE))
        param.grad = torch.randn(shape, device=DEVICE)
        params.append(param)
    return params


def optimizer_step(
    name: str,
    params: list[nn.Parameter],
    kernel: Callable[[list[nn.Parameter], list[Tensor]], None],
) -> Callable[[], None]:
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    optimizer.step()  # momentum buffers outside the timed region
    if name == "+ GradientLARS":
        GradientLARS(weight_decay=WEIGHT_DECAY).attach(optimizer)
    grads = [p.grad for p in params]

    def run() -> None:
        if name == "+ loop":
            naive_lars_(params, WEIGHT_DECAY)
        elif name == "+ kernel":
            kernel(params, grads)  # type: ignore[arg-type]
        optimizer.step()

    return run


def lars_sections(repeats: int) -> None:
    print("\n== 2. LARS (float32): kernel alone, and in an SGD(momentum, foreach) step")
    for title, file in SHAPE_SETS.items():
        shapes = json.loads((SHAPES / file).read_text())
        params = parameter_set(shapes)
        grads = [p.grad for p in params]

        def kernel(params: list[nn.Parameter], grads: list[Tensor]) -> None:
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

        measure(
            f"{title} ({len(shapes)} tensors): LARS alone",
            {
                "per-parameter loop": functools.partial(naive_lars_, params, WEIGHT_DECAY),
                "per-parameter loop, again (noise)": functools.partial(
                    naive_lars_, params, WEIGHT_DECAY
                ),
                "normhooks kernel (2 launches)": functools.partial(kernel, params, grads),
            },
            repeats,
        )

        steps = {}
        for name in (
            "SGD alone",
            "SGD alone, again (noise)",
            "+ GradientLARS",
            "+ loop",
            "+ kernel",
        ):
            steps[name] = optimizer_step(name, parameter_set(shapes), kernel)
        measure(f"{title}: optimizer step", steps, repeats)


def model_sections(repeats: int, compile_: bool) -> None:
    print("\n== 3. Models: train step (forward, cross-entropy backward, SGD)")
    for batch in (32, 256):
        torch.manual_seed(0)
        plain = ResNet18().to(DEVICE)
        x = torch.randn(batch, 3, 64, 64, device=DEVICE)
        target = torch.randint(0, 100, (batch,), device=DEVICE)
        measure(
            f"ResNet-18 (GroupNorm), batch {batch}, 64x64, eager",
            train_steps(model_variants(plain, floors=True), x, target, None),
            repeats,
        )
    torch.manual_seed(0)
    lstm = LSTMModel().to(DEVICE)
    x = torch.randn(32, 32, 128, device=DEVICE)
    target = torch.randint(0, 10, (32,), device=DEVICE)
    measure(
        "2-layer LSTM (128 -> 256), batch 32, 32 steps, eager",
        train_steps(model_variants(lstm, floors=True, standardize=False), x, target, None),
        repeats,
    )
    if not compile_:
        return
    for mode in ("default", "reduce-overhead"):
        torch.manual_seed(0)
        plain = ResNet18().to(DEVICE)
        x = torch.randn(32, 3, 64, 64, device=DEVICE)
        target = torch.randint(0, 100, (32,), device=DEVICE)
        # The floors are left out here: inductor compiles an empty parametrization away.
        models = model_variants(plain, floors=False)
        measure(
            f"ResNet-18 (GroupNorm), batch 32, torch.compile mode={mode}",
            train_steps(models, x, target, mode),
            repeats,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled section")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; none is available here, nothing to time.")
        return 0
    if not _kernels.available(torch.ones(1, device=DEVICE)):
        print("benchmarks/gpu.py needs Triton for the kernels; it is not importable here.")
        return 0
    start = time.perf_counter()
    print(
        f"normhooks on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; medians of {args.repeats} interleaved repeats"
    )
    kernels_alone(args.repeats)
    lars_sections(args.repeats)
    model_sections(args.repeats, compile_=not args.no_compile)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
