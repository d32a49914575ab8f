"""AGC's Triton kernels (normhooks._kernels.agc) against the formula written out in float64.

Without CUDA, conftest sets ``TRITON_INTERPRET=1`` and the kernels run on CPU tensors through
Triton's interpreter, with chunks and blocks shrunk (``small_chunks``) so that tiny tensors
cross every boundary: rows of exactly one block, one value more, one chunk, one value more,
several chunks; 0-/1-D tensors (one row), empty tensors and empty rows. The hook's kernel
path (``route_cpu_tensors()``) is compared with its plain path end to end.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("triton", reason="the fused kernels need Triton")

import normhooks
from normhooks import AdaptiveGradientClipping, _kernels, agc_
from normhooks._kernels import _fallback, _multi
from normhooks._kernels import agc as agc_kernels
from normhooks._kernels._launch import Kernel
from normhooks.agc import AGCSettings, agc_unit_

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="runs the kernels on CPU tensors through Triton's interpreter",
    ),
    # NumPy warns where a GPU silently computes the 0/0 that where() then discards.
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

# Around the 16-value block and the 64-value chunk of ``small_chunks``, as rows along dim 0
# (and whole tensors below two dimensions).
SHAPES = [
    pytest.param([(3, 16), (2, 17), (2, 64), (2, 65), (1, 300)], id="rows-at-boundaries"),
    pytest.param([(), (1,), (16,), (64,), (65,), (300,)], id="0d-1d"),
    pytest.param([(0,), (4, 0), (0, 3), (5, 2, 0, 2)], id="empty"),
    pytest.param([(4, 2, 3, 3), (3, 5, 2), (6, 1, 1, 1), (2, 7)], id="conv-linear"),
]
FULL = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float64, id="float64")]
HALVES = [pytest.param(torch.float16, id="float16"), pytest.param(torch.bfloat16, id="bfloat16")]
SETTINGS = [
    pytest.param({"clipping": 0.01, "eps": 1e-3}, id="defaults"),
    pytest.param({"clipping": 0.5, "eps": 0.1}, id="mild"),
    pytest.param({"clipping": 1e-3, "eps": 0.0}, id="eps0"),
]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Chunks of 64 values read 16 at a time, partial sums 2 at a time."""
    monkeypatch.setattr(agc_kernels, "_BLOCK", 16)
    monkeypatch.setattr(agc_kernels, "_CHUNK", 64)
    monkeypatch.setattr(agc_kernels, "_PARTIALS_BLOCK", 2)
    monkeypatch.setattr(_multi, "_kept", [])
    _multi._tables.clear()
    yield
    _multi._tables.clear()


def reference(
    params: list[Tensor],
    grads: list[Tensor],
    clipping: float,
    eps: float,
    grad_scale: float | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """Each tensor's largest ratio and its clipped gradient, row by row in float64."""
    maxima, results = [], []
    for param, grad in zip(params, grads, strict=True):
        w, g = param.detach().double(), grad.detach().double()
        if grad_scale is not None:
            g = g / grad_scale
        rows = w.shape[0] if w.ndim >= 2 else 1
        length = w.numel() // rows if rows else 0
        w_rows, g_rows = w.reshape(rows, length), g.reshape(rows, length).clone()
        largest = 0.0
        for i in range(rows):
            w_norm, g_norm = w_rows[i].norm().item(), g_rows[i].norm().item()
            bound = max(w_norm, eps)
            if g_norm > 0:
                largest = max(largest, g_norm / bound if bound > 0 else math.inf)
            if g_norm > clipping * bound:
                g_rows[i] *= clipping * bound / g_norm
        maxima.append(largest)
        results.append(g_rows.reshape(grad.shape))
    return torch.tensor(maxima, dtype=torch.float64), results


def draw(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, g_scale: float = 0.05
) -> tuple[list[Tensor], list[Tensor]]:
    """Parameters and gradients whose ratios straddle the clipping thresholds used here."""
    params = [torch.randn(shape).to(dtype) for shape in shapes]
    grads = []
    for shape in shapes:
        # Row scales over four decades: some rows clipped, some left alone.
        rows = shape[0] if len(shape) >= 2 else 1
        spread = torch.logspace(-4, 0, max(rows, 1))[torch.randperm(max(rows, 1))][:rows]
        scale = spread.reshape((rows,) + (1,) * (len(shape) - 1)) if len(shape) >= 2 else 0.1
        grads.append((g_scale * 20 * scale * torch.randn(shape)).to(dtype))
    return params, grads


def run(params: list[Tensor], grads: list[Tensor], **settings: Any) -> Tensor:
    arguments: dict[str, Any] = {"clipping": 0.01, "eps": 1e-3, "grad_scale": None}
    arguments["found_inf"] = None
    return agc_kernels.agc_unit_(params, grads, **(arguments | settings))


def assert_result(
    maxima: Tensor, grads: list[Tensor], expected: Tensor, clipped: list[Tensor]
) -> None:
    torch.testing.assert_close(maxima, expected.to(maxima.dtype))
    for grad, want in zip(grads, clipped, strict=True):
        torch.testing.assert_close(grad, want.to(grad.dtype))


def assert_one_unit(grad: Tensor, want: Tensor) -> None:
    """``grad`` (float16/bfloat16) within one unit in the last place of the float64 ``want``,
    subnormals included."""
    one_unit = torch.finfo(grad.dtype).eps
    smallest = torch.finfo(grad.dtype).tiny * one_unit
    torch.testing.assert_close(grad.double(), want, rtol=one_unit, atol=smallest)


# --- the formula ------------------------------------------------------------------------------


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("dtype", FULL)
@pytest.mark.parametrize("shapes", SHAPES)
def test_matches_float64_formula(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, settings: dict[str, float]
) -> None:
    params, grads = draw(shapes, dtype)
    expected, clipped = reference(params, grads, **settings)
    maxima = run(params, grads, **settings)
    assert maxima.dtype == dtype
    assert_result(maxima, grads, expected, clipped)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("shapes", SHAPES)
def test_half_precision_is_float32_rounded_once(
    shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> None:
    """Norms, factors and ratios in float32; each written value rounded once (the
    interpreter truncates float32 to bfloat16, so bfloat16 may sit one unit off)."""
    params, grads = draw(shapes, dtype)
    expected, clipped = reference(params, grads, 0.01, 1e-3)
    maxima = run(params, grads)
    assert maxima.dtype == torch.float32
    torch.testing.assert_close(maxima, expected.float())
    for grad, want in zip(grads, clipped, strict=True):
        assert grad.dtype == dtype
        assert_one_unit(grad, want)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [*FULL, *HALVES])
def test_matches_the_plain_formula(dtype: torch.dtype) -> None:
    """The kernel and agc_unit_'s plain path give the same numbers, to rounding."""
    params, grads = draw([(3, 16), (2, 65), (), (65,), (4, 0), (2, 3, 3, 3)], dtype)
    plain_grads = [g.clone() for g in grads]
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})
    with normhooks.set_kernels_enabled(False):
        plain = agc_unit_(params, plain_grads, settings, None, norms=None, foreach=None)
    maxima = run(params, grads)
    torch.testing.assert_close(maxima, plain)
    for grad, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, want)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", FULL)
def test_zero_unit_without_floor_is_clipped_to_zero_with_ratio_inf(dtype: torch.dtype) -> None:
    params, grads = draw([(3, 65), (17,)], dtype)
    params[0][1].zero_()
    params[1].zero_()
    grads[0][2].zero_()  # a zero gradient on a non-zero row: left alone, ratio 0 there
    expected, clipped = reference(params, grads, 0.01, 0.0)
    maxima = run(params, grads, eps=0.0)
    assert maxima.tolist() == [math.inf, math.inf]
    assert_result(maxima, grads, expected, clipped)
    assert grads[0][1].eq(0).all()
    assert grads[1].eq(0).all()


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("eps", [0.0, 1e-3], ids=["eps0", "eps1e-3"])
def test_zero_gradients_stay_zero_and_are_never_divided_by(eps: float) -> None:
    params = [torch.randn(3, 65), torch.zeros(2, 17), torch.randn(()), torch.zeros(70)]
    grads = [torch.zeros_like(p) for p in params]
    maxima = run(params, grads, eps=eps)
    assert maxima.tolist() == [0.0] * 4
    assert all(g.eq(0).all() and not g.signbit().any() for g in grads)


@pytest.mark.usefixtures("small_chunks")
def test_non_finite_weight_or_gradient_as_the_plain_formula() -> None:
    """A NaN weight leaves its row unclipped with a NaN ratio (amax's NaN); an inf gradient
    clips its row by 0 (inf * 0 is NaN there, as in the formula)."""
    params, grads = draw([(3, 20), (3, 20)], torch.float32)
    # Its sign bit set: the ratio's NaN may come out negative, which must still win the max.
    params[0][1, 3] = -math.nan
    grads[1][2, 5] = math.inf
    plain_grads = [g.clone() for g in grads]
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})
    with normhooks.set_kernels_enabled(False):
        plain = agc_unit_(params, plain_grads, settings, None, norms=None, foreach=None)
    maxima = run(params, grads)
    torch.testing.assert_close(maxima, plain, equal_nan=True)
    assert maxima[0].isnan()
    assert maxima[1].isinf()
    for grad, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, want, equal_nan=True)


# --- layouts ---------------------------------------------------------------------------------


def _channels_last(shape: tuple[int, ...]) -> Tensor:
    return torch.randn(shape).contiguous(memory_format=torch.channels_last)


LAYOUTS = [
    pytest.param(lambda: _channels_last((4, 3, 5, 5)), lambda: _channels_last((4, 3, 5, 5)),
                 id="channels-last"),
    pytest.param(lambda: _channels_last((4, 3, 5, 5)), lambda: torch.randn(4, 3, 5, 5),
                 id="channels-last-param-contiguous-grad"),
    pytest.param(lambda: torch.randn(70, 3).t(), lambda: torch.randn(70, 3).t(),
                 id="transposed"),
    pytest.param(lambda: torch.randn(6, 40)[:, ::2], lambda: torch.randn(6, 20),
                 id="strided"),
    pytest.param(lambda: torch.randn(1, 70).t(), lambda: torch.randn(70, 1), id="one-column"),
]  # fmt: skip


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(("make_param", "make_grad"), LAYOUTS)
def test_tensors_the_kernels_cannot_read_in_place_go_through_copies(
    make_param: Any, make_grad: Any
) -> None:
    param, grad = make_param(), make_grad() * 0.05
    strides = grad.stride()
    params, grads = [torch.randn(2, 17), param], [0.05 * torch.randn(2, 17), grad]
    expected, clipped = reference(params, grads, 0.01, 1e-3)
    maxima = run(params, grads)
    assert_result(maxima, grads, expected, clipped)
    assert grads[1] is grad
    assert grad.stride() == strides


# --- GradScaler's protocol -----------------------------------------------------------------


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [*FULL, *HALVES])
@pytest.mark.parametrize("scale", [1024.0, 3.0], ids=["power-of-two", "three"])
def test_scaled_gradients_are_unscaled_and_leave_the_flag_down(
    dtype: torch.dtype, scale: float
) -> None:
    params, true_grads = draw([(3, 16), (2, 65), (65,)], dtype)
    grads = [(g.double() * scale).to(dtype) for g in true_grads]
    expected, clipped = reference(params, grads, 0.01, 1e-3, grad_scale=scale)
    found_inf = torch.zeros(1)
    maxima = run(params, grads, grad_scale=torch.tensor(scale), found_inf=found_inf)
    assert found_inf.item() == 0.0
    torch.testing.assert_close(maxima, expected.to(maxima.dtype))
    for grad, want in zip(grads, clipped, strict=True):
        if dtype in (torch.float16, torch.bfloat16):
            assert_one_unit(grad, want)
        else:
            torch.testing.assert_close(grad, want.to(dtype))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [*FULL, *HALVES])
def test_scaled_gradients_match_the_plain_unscaled_path(dtype: torch.dtype) -> None:
    """The kernel unscales as GradScaler does (times 1/s rounded to float32) before it
    reads a norm: the same numbers as the plain path, to rounding, for any scale."""
    params, grads = draw([(3, 16), (2, 65), (), (5, 2, 2)], dtype)
    grads = [(g.double() * 3.0).to(dtype) for g in grads]
    plain_grads = [g.clone() for g in grads]
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})
    scale = torch.tensor(3.0)
    flags = torch.zeros(1), torch.zeros(1)
    with normhooks.set_kernels_enabled(False):
        plain = agc_unit_(
            params, plain_grads, settings, None, norms=None, foreach=None,
            grad_scale=scale, found_inf=flags[0],
        )  # fmt: skip
    maxima = run(params, grads, grad_scale=scale, found_inf=flags[1])
    torch.testing.assert_close(maxima, plain)
    for grad, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, want)
    assert flags[0].item() == flags[1].item() == 0.0


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_a_non_finite_scaled_gradient_raises_the_flag(bad: float) -> None:
    params, grads = draw([(3, 16), (2, 65)], torch.float32)
    grads[1][1, 40] = bad
    found_inf = torch.zeros(1)
    run(params, grads, grad_scale=torch.tensor(8.0), found_inf=found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "plain"])
def test_the_flag_without_a_scale_sees_a_nan_in_an_unclipped_row(kernel: bool) -> None:
    """A NaN gradient leaves its row's factor at 1 (nothing to write), yet is flagged."""
    params, grads = draw([(3, 16), (2, 65)], torch.float32)
    grads[1][0, 10] = math.nan
    found_inf = torch.zeros(1)
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})
    with _kernels.route_cpu_tensors() if kernel else contextlib.nullcontext():
        agc_unit_(params, grads, settings, None, norms=None, foreach=None, found_inf=found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.usefixtures("small_chunks")
def test_a_raised_flag_is_never_lowered() -> None:
    params, grads = draw([(3, 16)], torch.float32)
    found_inf = torch.ones(1)
    run(params, grads, grad_scale=torch.tensor(8.0), found_inf=found_inf)
    assert found_inf.item() == 1.0


# --- launches, tables, determinism -----------------------------------------------------------


class Counting(Kernel):
    """A :class:`Kernel` that counts its launches."""

    def __init__(self, kernel: Kernel) -> None:
        super().__init__(kernel.fn)
        self.launches = 0

    def __call__(self, *args: Any) -> None:
        self.launches += 1
        super().__call__(*args)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("count", [1, 12], ids=["one-tensor", "twelve-tensors"])
def test_two_launches_whatever_the_number_of_tensors(
    monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    kernels = Counting(agc_kernels._SQUARES_AND_FACTORS), Counting(agc_kernels._CLIP)
    monkeypatch.setattr(agc_kernels, "_SQUARES_AND_FACTORS", kernels[0])
    monkeypatch.setattr(agc_kernels, "_CLIP", kernels[1])
    params, grads = draw([(3, 20), (70,), ()] * 4, torch.float32)
    run(params[:count], grads[:count])
    assert [k.launches for k in kernels] == [1, 1]


@pytest.mark.usefixtures("small_chunks")
def test_gives_the_formula_at_every_call_on_one_table() -> None:
    """The arrival counts a launch leaves behind are zero: the next call on the same table
    (new values in the same tensors) is right again."""
    params, grads = draw([(2, 150), (130,)], torch.float32)
    for _ in range(3):
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.copy_(torch.randn_like(p))
                g.copy_(0.05 * torch.randn_like(g))
        expected, clipped = reference(params, grads, 0.01, 1e-3)
        assert_result(run(params, grads), grads, expected, clipped)
    assert len(_multi._tables) == 1


@pytest.mark.usefixtures("small_chunks")
def test_is_deterministic() -> None:
    params, grads = draw([(3, 200), (150,), (4, 2, 3, 3)], torch.float32)
    copies = [g.clone() for g in grads]
    first, second = run(params, grads), run(params, copies)
    assert torch.equal(first, second)
    assert all(torch.equal(a, b) for a, b in zip(grads, copies, strict=True))


@pytest.mark.usefixtures("small_chunks")
def test_under_capture_refuses_tensors_it_has_not_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is captured here: what the kernel refuses does not depend on it."""
    params, grads = draw([(3, 20), (70,)], torch.float32)
    before = [g.clone() for g in grads]
    monkeypatch.setattr(_multi, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"AGC's Triton kernel .* before capturing"):
        run(params, grads)
    assert not _multi._tables
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))


@pytest.mark.usefixtures("small_chunks")
def test_under_capture_runs_on_a_table_built_before_and_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params, grads = draw([(3, 20), (70,)], torch.float32)
    values = [g.clone() for g in grads]
    run(params, grads)  # the table, built before the capture
    (table,) = _multi._tables.values()
    for grad, value in zip(grads, values, strict=True):
        grad.copy_(value)
    expected, clipped = reference(params, grads, 0.01, 1e-3)
    monkeypatch.setattr(_multi, "capturing", lambda device: True)
    assert_result(run(params, grads), grads, expected, clipped)
    assert any(kept is table for kept in _multi._kept)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    ("params", "grads", "found_inf", "match"),
    [
        ([(3,)], [], None, "params and grads must pair up, got 1 params and 0 grads"),
        ([(3,)], [(3,)], torch.zeros(2), "found_inf must be a 1-element float32 tensor"),
        ([(3,)], [(3,)], torch.zeros(1, dtype=torch.float64), "found_inf must be a 1-element"),
        ([(3,)], [(4,)], None, r"grads\[0\] has shape \[4\], but params\[0\] has shape \[3\]"),
    ],
    ids=["unpaired", "flag-size", "flag-dtype", "shapes"],
)
def test_rejects_bad_input(
    params: list[tuple[int, ...]],
    grads: list[tuple[int, ...]],
    found_inf: Tensor | None,
    match: str,
) -> None:
    with pytest.raises(ValueError, match=match):
        run(
            [torch.randn(s) for s in params],
            [torch.randn(s) for s in grads],
            found_inf=found_inf,
            grad_scale=None if found_inf is None else torch.tensor(2.0),
        )


def test_an_empty_unit_gives_no_ratios() -> None:
    assert run([], []).numel() == 0


# --- the dispatch and the hook ---------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(4 * 3 * 3, 3))


def _train(model: nn.Module, steps: int = 2, scaler: bool = False) -> list[Tensor]:
    """A few steps of (fused) Adam under AGC; the last ratios of every group."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=scaler)
    hook = AdaptiveGradientClipping(clipping=0.05)
    hook.attach(optimizer)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if scaler else None
    generator = torch.Generator().manual_seed(2)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(4, 2, 5, 5, generator=generator)
        loss = model(x).square().mean()
        if grad_scaler is None:
            loss.backward()
            optimizer.step()
        else:
            grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
    return [r.clone() for r in hook.last_ratios]


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad-scaler-fused"])
def test_the_hook_on_the_kernel_path_trains_as_on_the_plain_path(
    monkeypatch: pytest.MonkeyPatch, scaler: bool
) -> None:
    kernel = Counting(agc_kernels._CLIP)
    monkeypatch.setattr(agc_kernels, "_CLIP", kernel)
    plain_model, kernel_model = _model(), _model()
    with normhooks.set_kernels_enabled(False):
        plain_ratios = _train(plain_model, scaler=scaler)
    with _kernels.route_cpu_tensors():
        kernel_ratios = _train(kernel_model, scaler=scaler)
    assert kernel.launches == 2  # one per step: the kernel path ran
    for got, want in zip(kernel_ratios, plain_ratios, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(kernel_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.usefixtures("small_chunks")
def test_agc_functional_form_takes_the_kernel_path() -> None:
    params = [nn.Parameter(torch.randn(3, 20)), nn.Parameter(torch.randn(70))]
    for p in params:
        p.grad = 0.05 * torch.randn_like(p)
    expected, clipped = reference(params, [p.grad for p in params], 0.01, 1e-3)
    with _kernels.route_cpu_tensors():
        maxima = agc_(params)
    assert_result(maxima, [p.grad for p in params], expected, clipped)


def test_units_with_whole_norms_keep_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards (``norms`` given) take the formula: the kernel is never called for them."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel was called for a sharded unit")

    monkeypatch.setattr(_kernels, "agc_unit_", refuse)
    params, grads = draw([(3, 4), (5,)], torch.float32)
    norms = (torch.stack([p.norm() for p in params]), torch.stack([g.norm() for g in grads]))
    expected, clipped = reference(params, grads, 0.01, 1e-3)
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})
    with _kernels.route_cpu_tensors():
        maxima = agc_unit_(params, grads, settings, None, norms=norms, foreach=None)
    assert_result(maxima, grads, expected, clipped)


@pytest.mark.usefixtures("small_chunks")
def test_a_kernel_that_fails_warns_once_and_the_formula_takes_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*args: Any) -> None:
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(agc_kernels, "_launch", fail)
    monkeypatch.setattr(_fallback, "_broken", False)
    monkeypatch.setattr(_fallback, "_warned", False)
    params, grads = draw([(3, 20), (70,)], torch.float32)
    expected, clipped = reference(params, grads, 0.01, 1e-3)
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})
    with _kernels.route_cpu_tensors(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        maxima = agc_unit_(params, grads, settings, None, norms=None, foreach=None)
    assert_result(maxima, grads, expected, clipped)
    texts = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(texts) == 1
    assert "Triton kernel for AGC failed" in texts[0]
    assert _fallback.broken()


def _swap_data(params: list[nn.Parameter]) -> None:
    params[0].data = params[0].data.clone()  # moved: a new address, the same identity


def _transpose_in_place(params: list[nn.Parameter]) -> None:
    params[1].data = params[1].data.t()  # square: same address and shape, other strides


def _to_double(params: list[nn.Parameter]) -> None:
    params[2].data = params[2].data.double()  # another dtype: a launch of its own


def _resize(params: list[nn.Parameter]) -> None:
    params[0].data = params[0].data[:2]  # fewer rows at the same address


CHANGES = [
    pytest.param(None, id="nothing"),
    pytest.param(_swap_data, id="data-moved"),
    pytest.param(_transpose_in_place, id="transposed-in-place"),
    pytest.param(_to_double, id="dtype-changed"),
    pytest.param(_resize, id="fewer-rows-same-address"),
]


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("change", CHANGES)
def test_a_change_between_steps_is_seen_on_the_kernel_path(
    monkeypatch: pytest.MonkeyPatch, change: Any
) -> None:
    """Whatever changes under the hook between two steps (new gradients at each step too),
    the kernel path gives the plain path's numbers at the second step."""

    def train(routed: bool) -> tuple[list[Tensor], list[Tensor]]:
        generator = torch.Generator().manual_seed(3)
        shapes = [(5, 20), (6, 6), (3, 2, 3), (70,)]
        params = [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
        optimizer = torch.optim.SGD(params, lr=0.1)
        hook = AdaptiveGradientClipping(clipping=0.02)
        hook.attach(optimizer)
        for step in range(2):
            if step == 1 and change is not None:
                change(params)
            for param in params:
                param.grad = 0.1 * torch.randn(param.shape, generator=generator).to(param.dtype)
            with _kernels.route_cpu_tensors() if routed else contextlib.nullcontext():
                optimizer.step()
        return [p.detach() for p in params], hook.last_ratios

    kernel = Counting(agc_kernels._CLIP)
    monkeypatch.setattr(agc_kernels, "_CLIP", kernel)
    want_params, want_ratios = train(routed=False)
    got_params, got_ratios = train(routed=True)
    # One launch per step, and one more for a tensor moved to a dtype of its own.
    assert kernel.launches == (3 if change is _to_double else 2)
    for got, want in zip([*got_params, *got_ratios], [*want_params, *want_ratios], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
