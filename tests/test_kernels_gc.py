"""Gradient centralization's Triton kernels against the formula written out in float64.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``), with chunks of 64 values read 16 at a time so that tiny tensors cross
block and chunk boundaries; with CUDA the same tests run on CUDA tensors. The hook's dispatch
is tested through ``_kernels.route_cpu_tensors()`` on the CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("triton", reason="the kernels need Triton")

import normhooks
from normhooks import GradientCentralization, _kernels, centralize_gradients_
from normhooks._kernels import _multi
from normhooks._kernels import gradient_centralization as gc_kernels

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.skipif(
        not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
        reason="without CUDA the kernels run through Triton's interpreter",
    ),
    # The interpreter computes with NumPy, which warns at an empty row's 0 / 0 (never written).
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

# Rows around the 16-value block and the 64-value chunk of ``small_chunks``.
ROWS = {
    "one-value": (3, 1),
    "below-a-block": (2, 5),
    "one-block": (3, 16),
    "a-block-and-one": (2, 17),
    "one-chunk": (2, 64),
    "a-chunk-and-one": (2, 65),
    "several-chunks": (3, 200),  # 4 chunks: more than the 2 partial sums read at a time
    "conv": (4, 2, 3, 3),
    "one-long-row": (1, 5, 50),
}
EMPTY = {"no-rows": (0, 3), "empty-rows": (3, 0), "empty-conv": (0, 2, 2, 2)}
DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.float64, id="float64"),
    pytest.param(torch.float16, id="float16"),
    pytest.param(torch.bfloat16, id="bfloat16"),
]


def reference(grad: Tensor) -> Tensor:
    """Each row along dim 0 less its mean, in float64 (a tensor of under 2 dims is one row)."""
    g = grad.detach().cpu().double()
    if g.numel() == 0:
        return g
    rows = g.reshape(g.shape[0] if g.ndim >= 2 else 1, -1)
    return (rows - rows.sum(1, keepdim=True) / rows.shape[1]).reshape(g.shape)


def gradients(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[Tensor]:
    """Random gradients whose rows have a mean to remove, drawn on the CPU."""
    return [(torch.randn(shape, dtype=torch.float64) + 0.5).to(DEVICE, dtype) for shape in shapes]


def assert_centralized(got: list[Tensor], wanted: list[Tensor]) -> None:
    for grad, want in zip(got, wanted, strict=True):
        assert grad.shape == want.shape
        if grad.dtype == torch.float64:
            # Values of a few units: a sum in float32 would be off by about 1e-7.
            torch.testing.assert_close(grad.cpu(), want, rtol=0, atol=1e-13)
        else:
            # The dtype's own tolerances: about one unit in the last place of the result,
            # which a mean computed in float32 and rounded once keeps (the interpreter
            # truncates float32 to bfloat16 where a GPU rounds: one unit off at most).
            torch.testing.assert_close(grad.cpu(), want.to(grad.dtype))


class Launches:
    """Stands for one of the module's kernels: counts its launches and keeps the arguments
    of the last one, by name."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.count = 0
        self.grid: tuple[int, ...] = ()
        self.arguments: dict[str, Any] = {}

    def __call__(self, cache: Any, grid: Any, device: Any, pointers: Any, *args: Any) -> None:
        self.count += 1
        self.grid = grid
        self.arguments = dict(zip(self.kernel.fn.arg_names, args, strict=True))
        self.kernel(cache, grid, device, pointers, *args)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Chunks of 64 values read 16 at a time, partial sums 2 at a time."""
    monkeypatch.setattr(gc_kernels, "_BLOCK", 16)
    monkeypatch.setattr(gc_kernels, "_CHUNK", 64)
    monkeypatch.setattr(gc_kernels, "_PARTIALS_BLOCK", 2)
    monkeypatch.setattr(_multi, "_kept", [])
    _multi._tables.clear()
    yield
    _multi._tables.clear()


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> tuple[Launches, Launches]:
    """The two kernels, counted: (centralize, subtract the means)."""
    first, second = Launches(gc_kernels._CENTRALIZE), Launches(gc_kernels._SUBTRACT_MEANS)
    monkeypatch.setattr(gc_kernels, "_CENTRALIZE", first)
    monkeypatch.setattr(gc_kernels, "_SUBTRACT_MEANS", second)
    return first, second


@contextlib.contextmanager
def kernel_path() -> Iterator[None]:
    """Where the hook's dispatch sends these tensors to the kernels: CUDA, or the CPU routed."""
    with contextlib.nullcontext() if CUDA else _kernels.route_cpu_tensors():
        yield


# --------------------------------------------------------------------------------------------
# The kernels alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(ROWS.values()), ids=list(ROWS))
@pytest.mark.usefixtures("small_chunks")
def test_each_row_shape_matches_the_formula(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    (grad,) = grads = gradients([shape], dtype)
    wanted = [reference(grad)]
    gc_kernels.centralize_unit_(grads)
    assert_centralized(grads, wanted)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("small_chunks")
def test_many_tensors_in_one_call_match_the_formula(dtype: torch.dtype) -> None:
    """Rows of one chunk and of several, and empty ones, side by side in one table."""
    grads = gradients([*ROWS.values(), *EMPTY.values(), (7,)], dtype)
    wanted = [reference(grad) for grad in grads]
    gc_kernels.centralize_unit_(grads)
    assert_centralized(grads, wanted)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.usefixtures("small_chunks")
def test_halves_are_computed_in_float32_and_rounded_once(dtype: torch.dtype) -> None:
    # A large mean beside a small spread: a mean rounded to the half dtype first, or a
    # difference taken in it, would be off by several units in the last place.
    grads = [
        (torch.randn(shape, dtype=torch.float64) * 0.05 + 3.0).to(DEVICE, dtype)
        for shape in [(3, 40), (2, 150)]
    ]
    plain = []
    for grad in grads:
        rows = grad.cpu().float().reshape(grad.shape[0], -1)
        plain.append((rows - rows.mean(1, keepdim=True)).reshape(grad.shape).to(dtype))
    wanted = [reference(grad) for grad in grads]
    gc_kernels.centralize_unit_(grads)
    assert_centralized(grads, wanted)
    for grad, want in zip(grads, plain, strict=True):
        torch.testing.assert_close(grad.cpu(), want)


@pytest.mark.usefixtures("small_chunks")
def test_one_launch_where_every_row_fits_a_chunk(launches: tuple[Launches, Launches]) -> None:
    first, second = launches
    grads = gradients([(3, 16), (2, 64), (4, 2, 3, 3), (0, 3)], torch.float32)
    gc_kernels.centralize_unit_(grads)
    assert (first.count, second.count) == (1, 0)
    # Nothing allocated: partials and means stand for each other and are never touched.
    assert first.arguments["partials"] is first.arguments["means"]


@pytest.mark.usefixtures("small_chunks")
def test_a_second_launch_over_the_chunks_of_rows_of_several(
    launches: tuple[Launches, Launches],
) -> None:
    """Its programs cover the span from the first chunk of such a row to the last."""
    first, second = launches
    shapes = [(3, 16), (2, 65), (4, 2, 3, 3), (1, 200), (5, 7)]
    grads = gradients(shapes, torch.float32)
    wanted = [reference(grad) for grad in grads]
    gc_kernels.centralize_unit_(grads)
    assert (first.count, second.count) == (1, 1)
    assert second.arguments["means"] is first.arguments["means"]
    # Chunks: 3 rows of 1, 2 rows of 2, 4 rows of 1, 1 row of 4, 5 rows of 1.
    assert first.grid[0] == 3 + 4 + 4 + 4 + 5
    assert (second.arguments["first"], second.grid[0]) == (3, 4 + 4 + 4)
    (table,) = _multi._tables.values()
    per_row = table.row_first_chunk.diff().cpu()
    several = torch.repeat_interleave(per_row > 1, per_row)
    assert several.nonzero().flatten().tolist() == [3, 4, 5, 6, 11, 12, 13, 14]
    assert_centralized(grads, wanted)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda t: t.t(), id="transposed"),
        pytest.param(lambda t: t[:, ::2], id="strided"),
        pytest.param(lambda t: t.view(6, 4, 3, 3)[:, :, :, :2], id="sliced-conv"),
    ],
)
@pytest.mark.usefixtures("small_chunks")
def test_gradients_whose_rows_are_not_runs_are_copied_back(
    layout: Callable[[Tensor], Tensor],
) -> None:
    base = torch.randn(24, 9, dtype=torch.float64, device=DEVICE) + 0.5
    grad = layout(base)
    other = torch.randn(5, 70, dtype=torch.float64, device=DEVICE)
    wanted = [reference(grad), reference(other)]
    gc_kernels.centralize_unit_([grad, other])
    assert_centralized([grad, other], wanted)


@pytest.mark.usefixtures("small_chunks")
def test_channels_last_rows_are_read_in_place(launches: tuple[Launches, Launches]) -> None:
    """A row's order does not change its mean: channels_last keeps each row one run."""
    first, _ = launches
    grad = gradients([(4, 5, 3, 3)], torch.float32)[0].contiguous(memory_format=torch.channels_last)
    wanted = reference(grad)
    gc_kernels.centralize_unit_([grad])
    assert first.arguments["g_ptrs"][0].item() == grad.data_ptr()
    assert grad.is_contiguous(memory_format=torch.channels_last)
    assert_centralized([grad], [wanted])


@pytest.mark.usefixtures("small_chunks")
def test_a_non_finite_value_stays_in_its_row() -> None:
    grad = gradients([(3, 100)], torch.float32)[0]
    grad[1, 70] = float("inf")
    gc_kernels.centralize_unit_([grad])
    assert not torch.isfinite(grad[1]).any()
    assert torch.isfinite(grad[[0, 2]]).all()


@pytest.mark.usefixtures("small_chunks")
def test_every_call_on_one_table_matches_and_leaves_the_counts_at_zero() -> None:
    grads = gradients([(2, 200), (3, 16)], torch.float64)
    for _ in range(3):
        for grad in grads:
            grad.copy_(torch.randn(grad.shape, dtype=grad.dtype) + 0.5)
        wanted = [reference(grad) for grad in grads]
        gc_kernels.centralize_unit_(grads)
        assert_centralized(grads, wanted)
    (table,) = _multi._tables.values()
    assert torch.equal(table.arrivals.cpu(), torch.zeros(table.rows, dtype=torch.int64))


@pytest.mark.usefixtures("small_chunks")
def test_a_gradient_moved_to_new_memory_is_found_there() -> None:
    grads = gradients([(2, 200), (3, 16)], torch.float32)
    gc_kernels.centralize_unit_(grads)
    grads[0] = gradients([(2, 200)], torch.float32)[0]
    wanted = [reference(grad) for grad in grads]
    gc_kernels.centralize_unit_(grads)
    assert len(_multi._tables) == 2
    assert_centralized(grads, wanted)


@pytest.mark.usefixtures("small_chunks")
def test_results_are_deterministic() -> None:
    grads = gradients([(2, 300), (3, 17)], torch.float32)
    copies = [grad.clone() for grad in grads]
    gc_kernels.centralize_unit_(grads)
    gc_kernels.centralize_unit_(copies)
    assert all(torch.equal(a, b) for a, b in zip(grads, copies, strict=True))


def test_long_rows_keep_the_precision_of_a_cascaded_sum() -> None:
    """At the real chunk size: a row of 2**18 + 3 equal values, 9 chunks; what is left is the
    mean's rounding, a few units in the last place (a running float32 sum would leave far
    more)."""
    for value in (0.1, 1.7):
        grad = torch.full((2, (1 << 18) + 3), value, device=DEVICE)
        gc_kernels.centralize_unit_([grad])
        assert grad.abs().max().item() <= 4 * torch.finfo(torch.float32).eps * value


@pytest.mark.usefixtures("small_chunks")
def test_under_capture_unseen_gradients_are_refused_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = gradients([(3, 16), (2, 65)], torch.float32)
    before = [grad.clone() for grad in grads]
    monkeypatch.setattr(_multi, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"gradient centralization's Triton kernel meets"):
        gc_kernels.centralize_unit_(grads)
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))


def test_mixed_dtypes_are_refused() -> None:
    grads = [torch.randn(2, 3, device=DEVICE), torch.randn(2, 3, device=DEVICE).double()]
    with pytest.raises(ValueError, match=r"grads\[1\] is a torch.float64 tensor"):
        gc_kernels.centralize_unit_(grads)


# --------------------------------------------------------------------------------------------
# Through the hook's dispatch


def param_with_grad(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    param = nn.Parameter(torch.randn(shape, dtype=dtype, device=DEVICE))
    param.grad = torch.randn(shape, dtype=dtype, device=DEVICE) + 0.5
    return param


SHAPES = [(6, 5), (5,), (4, 3, 3), (8, 3, 3, 3), (2, 70), (0, 3)]


@pytest.mark.parametrize("conv_only", [False, True], ids=["gc", "gcc"])
@pytest.mark.usefixtures("small_chunks")
def test_the_function_takes_the_kernel_and_chooses_the_tensors(
    conv_only: bool, launches: tuple[Launches, Launches]
) -> None:
    first, _ = launches
    params = [param_with_grad(*shape) for shape in SHAPES]
    least = 4 if conv_only else 2
    wanted = [reference(p.grad) if p.ndim >= least else p.grad.clone() for p in params]
    with kernel_path():
        centralize_gradients_(params, conv_only)
    assert first.count == 1
    # Only the chosen gradients are in the table.
    chosen = [p.grad.data_ptr() for p in params if p.ndim >= least]
    assert first.arguments["g_ptrs"].tolist() == chosen
    assert_centralized([p.grad for p in params], wanted)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("small_chunks")
def test_the_hook_on_the_kernel_path_steps_as_on_the_plain_path(
    dtype: torch.dtype, launches: tuple[Launches, Launches]
) -> None:
    first, second = launches
    grads = [param_with_grad(*shape, dtype=dtype).grad for shape in SHAPES]

    def steps(kernels: bool) -> list[Tensor]:
        params = [nn.Parameter(torch.ones(g.shape, dtype=dtype, device=DEVICE)) for g in grads]
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        GradientCentralization().attach(optimizer)
        with kernel_path(), normhooks.set_kernels_enabled(kernels):
            for step in range(2):
                for param, grad in zip(params, grads, strict=True):
                    param.grad = grad * (step + 1)
                optimizer.step()
        return [p.detach().clone() for p in params] + [p.grad for p in params]

    plain = steps(False)
    assert first.count == 0
    ours = steps(True)
    # One launch per step: (2, 70) spans two chunks, so a second one each step.
    assert (first.count, second.count) == (2, 2)
    # Two units in the last place of 1: the parameters pass 1 after the first step, where a
    # gradient one unit off (the interpreter's bfloat16 truncation) can move one by a unit.
    close = 2 * torch.finfo(dtype).eps
    for got, want in zip(ours, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=close, atol=close)


@pytest.mark.usefixtures("small_chunks")
def test_a_failing_kernel_warns_once_and_the_formula_takes_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(gc_kernels, "_launch", fail)
    params = [param_with_grad(*shape) for shape in SHAPES]
    wanted = [reference(p.grad) if p.ndim >= 2 else p.grad.clone() for p in params]
    try:
        with (
            kernel_path(),
            pytest.warns(RuntimeWarning, match="kernel for gradient centralization failed"),
        ):
            centralize_gradients_(params)
        assert _kernels._fallback.broken()
    finally:
        normhooks.set_kernels_enabled(True)  # on again, for the tests after this one
    assert_centralized([p.grad for p in params], wanted)


@pytest.mark.usefixtures("small_chunks")
def test_out_of_memory_in_the_kernel_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(gc_kernels, "_launch", out_of_memory)
    with kernel_path(), pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        centralize_gradients_([param_with_grad(3, 4)])
    assert not _kernels._fallback.broken()


@pytest.mark.parametrize("bad", [None, float("inf")], ids=["finite", "inf"])
@pytest.mark.usefixtures("small_chunks")
def test_under_grad_scaler_a_fused_step_is_the_plain_paths(
    bad: float | None, launches: tuple[Launches, Launches]
) -> None:
    """GradScaler leaves a fused optimizer's gradients scaled: the hook unscales them for the
    kernel, and an inf still skips the step."""
    first, _ = launches
    weights = torch.randn(3, 70, device=DEVICE)

    def step(kernels: bool) -> tuple[Tensor, Tensor, float]:
        param = nn.Parameter(torch.ones(3, 70, device=DEVICE))
        optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
        GradientCentralization().attach(optimizer)
        scaler = torch.amp.GradScaler(DEVICE, init_scale=1024.0)
        with kernel_path(), normhooks.set_kernels_enabled(kernels):
            scaler.scale((param * weights).sum()).backward()
            assert param.grad is not None
            if bad is not None:
                param.grad[1, 3] = bad
            scaler.step(optimizer)
            scaler.update()
        return param.detach(), param.grad, scaler.get_scale()

    plain = step(False)
    ours = step(True)
    assert first.count == 1
    torch.testing.assert_close(ours[:2], plain[:2], equal_nan=True)
    assert ours[2] == plain[2] == (1024.0 if bad is None else 512.0)
    if bad is not None:
        assert torch.equal(ours[0], torch.ones(3, 70, device=DEVICE))
