"""The Triton kernels against hand-written float64 formulas.

Without CUDA they run on CPU tensors through Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``), so shapes stay tiny; tests/test_cuda.py runs them on a GPU, and
``test_kernels_compile_for_sm90`` compiles every kernel with the real backend here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton", reason="the fused kernels need Triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    # conftest turns the interpreter on only without CUDA; on a GPU machine the same kernels
    # run on CUDA tensors in tests/test_cuda.py instead.
    pytest.skip(
        "runs the kernels on CPU tensors through Triton's interpreter", allow_module_level=True
    )

from normhooks import _kernels
from normhooks._kernels import lars as lars_kernels
from normhooks._kernels import weight_standardization as ws_kernels
from normhooks._kernels.weight_norm import weight_norm

# The interpreter computes with NumPy, which warns where a GPU silently computes the 0/0 or the
# overflow that a test provokes on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

HALVES = [pytest.param(torch.float16, id="float16"), pytest.param(torch.bfloat16, id="bfloat16")]
FULL = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float64, id="float64")]
SRC = Path(__file__).resolve().parents[1] / "src"


# --------------------------------------------------------------------------------------------
# LARS


def lars_reference(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    threshold: float = 1e-2,
    weight_decay: float = 0.0,
    eps: float = 1e-9,
    trust_coefficient: float = 1.0,
    lr: float | None = None,
    clip: bool = False,
    grad_scale: float | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """Rates and new gradients, one tensor at a time in float64."""
    rates, results = [], []
    for param, grad in zip(params, grads, strict=True):
        w, g = param.double(), grad.double()
        if grad_scale is not None:
            g = g / grad_scale
        w_norm, g_norm = w.norm().item(), g.norm().item()
        denominator = (g_norm + eps) + weight_decay * w_norm
        rate = 1.0
        if w_norm > threshold and not (eps == 0 and weight_decay == 0 and denominator == 0):
            rate = w_norm / denominator * trust_coefficient
            if clip and lr is not None:
                rate = min(rate / lr, 1.0)
        rates.append(rate)
        results.append(rate * (g + weight_decay * w))
    return torch.tensor(rates, dtype=torch.float64), results


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Chunks of 64 values read 16 at a time, partial sums 2 at a time: tiny tensors cross
    chunk boundaries and every loop of both launches runs more than once."""
    monkeypatch.setattr(lars_kernels, "_BLOCK", 16)
    monkeypatch.setattr(lars_kernels, "_CHUNK", 64)
    monkeypatch.setattr(lars_kernels, "_PARTIALS_BLOCK", 2)
    lars_kernels._tables.clear()
    yield
    lars_kernels._tables.clear()


# Sizes around the 64-value chunk: empty, below, at, just over, several chunks.
SHAPES = [(3, 4), (64,), (65,), (0,), (5, 13), (300,), (1,)]


def tensors(dtype: torch.dtype, shapes: list[tuple[int, ...]] = SHAPES) -> list[Tensor]:
    return [torch.randn(shape, dtype=dtype) for shape in shapes]


def run_lars(params: list[Tensor], grads: list[Tensor], **settings: object) -> Tensor:
    arguments: dict[str, object] = {
        "threshold": 1e-2,
        "weight_decay": 0.0,
        "eps": 1e-9,
        "trust_coefficient": 1.0,
        "lr": None,
        "clip": False,
        "grad_scale": None,
        "found_inf": None,
    }
    arguments.update(settings)
    return lars_kernels.lars_unit_(params, grads, **arguments)  # type: ignore[arg-type]


SETTINGS = [
    pytest.param({}, id="defaults"),
    pytest.param({"weight_decay": 1e-2, "trust_coefficient": 0.02}, id="decay-trust"),
    pytest.param({"weight_decay": 5e-4, "clip": True, "lr": 0.1}, id="clip"),
    pytest.param({"clip": True, "lr": 1e-4, "trust_coefficient": 1e-3}, id="clip-saturates"),
    pytest.param({"threshold": 8.0}, id="threshold"),
    pytest.param({"eps": 0.0}, id="eps0"),
    pytest.param({"eps": 0.5, "weight_decay": 0.1}, id="large-eps"),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("dtype", FULL)
@pytest.mark.usefixtures("small_chunks")
def test_lars_matches_reference(settings: dict[str, object], dtype: torch.dtype) -> None:
    params, grads = tensors(dtype), tensors(dtype)
    expected_rates, expected = lars_reference(params, grads, **settings)  # type: ignore[arg-type]
    rates = run_lars(params, grads, **settings)
    assert rates.dtype == dtype
    torch.testing.assert_close(rates, expected_rates.to(dtype))
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, want.to(dtype))


@pytest.mark.usefixtures("small_chunks")
def test_lars_clip_with_a_tensor_lr() -> None:
    params, grads = tensors(torch.float32), tensors(torch.float32)
    expected_rates, expected = lars_reference(params, grads, clip=True, lr=0.5, eps=1e-3)
    rates = run_lars(params, grads, clip=True, lr=torch.tensor(0.5), eps=1e-3)
    torch.testing.assert_close(rates, expected_rates.float())
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, want.float())


@pytest.mark.usefixtures("small_chunks")
def test_lars_zero_tensors_and_zero_grads_keep_rate_one() -> None:
    params = [torch.zeros(70), torch.randn(70), torch.randn(3)]
    grads = [torch.randn(70), torch.zeros(70), torch.zeros(3)]
    before = [g.clone() for g in grads]
    rates = run_lars(params, grads, eps=0.0)
    # w = 0 is below the threshold; g = 0 with eps = weight_decay = 0 is 0/0 in the rate.
    torch.testing.assert_close(rates, torch.ones(3))
    for grad, old in zip(grads, before, strict=True):
        torch.testing.assert_close(grad, old)


def test_lars_empty_list_returns_no_rates() -> None:
    rates = run_lars([], [])
    assert rates.shape == (0,)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.usefixtures("small_chunks")
def test_lars_half_precision_is_float32_rounded_once(dtype: torch.dtype) -> None:
    params, grads = tensors(dtype), tensors(dtype)
    settings = {"weight_decay": 1e-2, "trust_coefficient": 0.5}
    expected_rates, _ = lars_reference(
        [p.float() for p in params], [g.float() for g in grads], **settings
    )
    once = [
        (rate * (g.float() + 1e-2 * p.float())).to(dtype)
        for rate, p, g in zip(expected_rates.float(), params, grads, strict=True)
    ]
    rates = run_lars(params, grads, **settings)
    assert rates.dtype == torch.float32
    torch.testing.assert_close(rates, expected_rates.float())
    for grad, want in zip(grads, once, strict=True):
        torch.testing.assert_close(grad, want)


@pytest.mark.usefixtures("small_chunks")
def test_lars_unscales_gradients_and_leaves_the_flag_down_when_finite() -> None:
    params, grads = tensors(torch.float32), tensors(torch.float32)
    scaled = [g * 1024 for g in grads]
    expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
    found_inf = torch.zeros(1)
    rates = run_lars(
        params, scaled, weight_decay=1e-2, grad_scale=torch.tensor(1024.0), found_inf=found_inf
    )
    torch.testing.assert_close(rates, expected_rates.float())
    for grad, want in zip(scaled, expected, strict=True):
        torch.testing.assert_close(grad, want.float())
    assert found_inf.item() == 0.0


@pytest.mark.usefixtures("small_chunks")
def test_lars_raises_the_flag_on_a_non_finite_gradient() -> None:
    params, grads = tensors(torch.float16), tensors(torch.float16)
    grads[5][200] = float("inf")
    found_inf = torch.zeros(1)
    run_lars(params, grads, grad_scale=torch.tensor(65536.0), found_inf=found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.usefixtures("small_chunks")
def test_lars_raises_the_flag_when_a_finite_gradient_overflows_on_writing() -> None:
    params = [torch.full((100,), 60000.0, dtype=torch.float16)]
    grads = [torch.ones(100, dtype=torch.float16)]
    found_inf = torch.zeros(1)
    # Rate 1 (below the threshold); g + 2 w overflows float16.
    run_lars(params, grads, threshold=1e9, weight_decay=2.0, found_inf=found_inf)
    assert torch.isinf(grads[0]).all()
    assert found_inf.item() == 1.0


@pytest.mark.usefixtures("small_chunks")
def test_lars_never_lowers_a_raised_flag() -> None:
    params, grads = tensors(torch.float32), tensors(torch.float32)
    found_inf = torch.ones(1)
    run_lars(params, grads, found_inf=found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.usefixtures("small_chunks")
def test_lars_reuses_its_table_and_rebuilds_it_when_a_tensor_moves() -> None:
    params, grads = tensors(torch.float64), tensors(torch.float64)
    for _ in range(3):
        run_lars(params, grads)
    assert len(lars_kernels._tables) == 1
    params[2] = torch.randn(65, dtype=torch.float64)  # a new address
    grads = tensors(torch.float64)
    expected_rates, expected = lars_reference(params, grads)
    rates = run_lars(params, grads)
    assert len(lars_kernels._tables) == 2
    torch.testing.assert_close(rates, expected_rates)
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, want)


@pytest.mark.usefixtures("small_chunks")
def test_lars_rebuilds_its_table_when_a_tensor_changes_size_in_place() -> None:
    storage_w, storage_g = torch.randn(300, dtype=torch.float64), torch.randn(300)
    storage_g = storage_g.double()
    for size in (10, 200):  # same addresses, another size
        params, grads = [storage_w[:size]], [storage_g[:size].clone()]
        expected_rates, expected = lars_reference(params, grads)
        rates = run_lars(params, grads)
        torch.testing.assert_close(rates, expected_rates)
        torch.testing.assert_close(grads[0], expected[0])


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda t: t.t(), id="both-transposed"),
        pytest.param(lambda t: t[:, ::2], id="strided"),
    ],
)
@pytest.mark.usefixtures("small_chunks")
def test_lars_non_contiguous_tensors(layout: object) -> None:
    make = layout  # a view of a bigger tensor
    bases = [torch.randn(12, 30, dtype=torch.float64) for _ in range(2)]
    params = [make(bases[0]), torch.randn(70, dtype=torch.float64)]  # type: ignore[operator]
    grads = [make(bases[1]), torch.randn(70, dtype=torch.float64)]  # type: ignore[operator]
    expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
    rates = run_lars(params, grads, weight_decay=1e-2)
    torch.testing.assert_close(rates, expected_rates)
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, want)


@pytest.mark.usefixtures("small_chunks")
def test_lars_gradient_laid_out_unlike_its_parameter() -> None:
    params = [torch.randn(12, 30, dtype=torch.float64)]
    grads = [torch.randn(30, 12, dtype=torch.float64).t()]
    expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
    rates = run_lars(params, grads, weight_decay=1e-2)
    torch.testing.assert_close(rates, expected_rates)
    torch.testing.assert_close(grads[0], expected[0])


@pytest.mark.usefixtures("small_chunks")
def test_lars_is_deterministic() -> None:
    params, grads = tensors(torch.float32), tensors(torch.float32)
    copies = [g.clone() for g in grads]
    first = run_lars(params, grads, weight_decay=1e-3)
    second = run_lars(params, copies, weight_decay=1e-3)
    assert torch.equal(first, second)
    assert all(torch.equal(a, b) for a, b in zip(grads, copies, strict=True))


@pytest.mark.parametrize(
    ("params", "grads", "found_inf", "match"),
    [
        pytest.param([torch.ones(2)], [], None, "must pair up", id="lengths"),
        pytest.param([torch.ones(2)], [torch.ones(3)], None, "has shape", id="shapes"),
        pytest.param(
            [torch.ones(2), torch.ones(2).double()],
            [torch.ones(2), torch.ones(2).double()],
            None,
            "one device and dtype",
            id="dtypes",
        ),
        pytest.param(
            [torch.ones(2, dtype=torch.int32)] * 1,
            [torch.ones(2)],
            None,
            "float16, bfloat16, float32 or float64",
            id="integer",
        ),
        pytest.param(
            [torch.ones(2)], [torch.ones(2)], torch.zeros(1).double(), "found_inf", id="flag"
        ),
    ],
)
def test_lars_rejects_bad_input(
    params: list[Tensor], grads: list[Tensor], found_inf: Tensor | None, match: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        run_lars(params, grads, found_inf=found_inf)


# --------------------------------------------------------------------------------------------
# Weight normalization


def wn_reference(g: Tensor, v: Tensor, dim: int, eps: float) -> Tensor:
    axes = [d for d in range(v.ndim) if d != dim]
    norm = v.norm(dim=axes, keepdim=True)
    denominator = norm + eps if eps > 0 else torch.where(norm > 0, norm, torch.ones_like(norm))
    return g * v / denominator


def gain_shape(v: Tensor, dim: int) -> list[int]:
    return [n if d == dim else 1 for d, n in enumerate(v.shape)]


def check_against(fn: object, reference: object, inputs: list[Tensor], dtype: torch.dtype) -> None:
    """Forward and gradients of ``fn`` in ``dtype`` against ``reference`` in float64."""
    ours = [t.detach().to(dtype).requires_grad_() for t in inputs]
    exact = [t.detach().double().requires_grad_() for t in inputs]
    out = fn(*ours)  # type: ignore[operator]
    want = reference(*exact)  # type: ignore[operator]
    assert out.dtype == dtype
    torch.testing.assert_close(out, want.to(dtype))
    upstream = torch.randn(want.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, ours, upstream.to(dtype))
    wanted = torch.autograd.grad(want, exact, upstream)
    for got, expected in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got, expected.to(dtype))


WN_CASES = [
    pytest.param((6, 3, 3), 0, id="dim0"),
    pytest.param((3, 6, 2), 1, id="dim1"),
    pytest.param((4, 5), 1, id="last"),
]


@pytest.mark.parametrize("eps", [0.0, 1e-3], ids=["eps0", "eps1e-3"])
@pytest.mark.parametrize(("shape", "dim"), WN_CASES)
@pytest.mark.parametrize("dtype", FULL)
def test_weight_norm_matches_reference(
    shape: tuple[int, ...], dim: int, eps: float, dtype: torch.dtype
) -> None:
    v = torch.randn(shape)
    v.select(dim, 1).zero_()  # a zero row
    g = torch.rand(gain_shape(v, dim)) + 0.5
    check_against(
        lambda g, v: weight_norm(g, v, dim, eps),
        lambda g, v: wn_reference(g, v, dim, eps),
        [g, v],
        dtype,
    )


def test_weight_norm_zero_row_with_eps0_stays_zero_with_finite_gradients() -> None:
    v = torch.zeros(3, 4, requires_grad=True)
    g = torch.ones(3, 1, requires_grad=True)
    out = weight_norm(g, v, 0, 0.0)
    out.backward(torch.ones(3, 4))
    assert torch.equal(out, torch.zeros(3, 4))
    # Row 0 divides by 1: dW/dv = g, dW/dg = v = 0.
    assert torch.equal(v.grad, torch.ones(3, 4))  # type: ignore[arg-type]
    assert torch.equal(g.grad, torch.zeros(3, 1))  # type: ignore[arg-type]


def test_weight_norm_gradcheck() -> None:
    v = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    g = torch.rand(1, 4, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, v: weight_norm(g, v, 1, 1e-2), (g, v), fast_mode=True)


@pytest.mark.parametrize("dtype", HALVES)
def test_weight_norm_half_precision_is_float32_rounded_once(dtype: torch.dtype) -> None:
    v, g = torch.randn(5, 7).to(dtype), (torch.rand(5, 1) + 0.5).to(dtype)
    v32, g32 = v.float().requires_grad_(), g.float().requires_grad_()
    want = wn_reference(g32, v32, 0, 1e-3)
    vh, gh = v.clone().requires_grad_(), g.clone().requires_grad_()
    out = weight_norm(gh, vh, 0, 1e-3)
    torch.testing.assert_close(out, want.to(dtype))
    upstream = torch.randn(5, 7).to(dtype)
    grads = torch.autograd.grad(out, (gh, vh), upstream)
    wanted = torch.autograd.grad(want, (g32, v32), upstream.float())
    for got, expected in zip(grads, wanted, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected.to(dtype))


def test_weight_norm_non_contiguous_v() -> None:
    v = torch.randn(4, 3, 5, dtype=torch.float64).permute(2, 0, 1)  # [5, 4, 3]
    g = torch.rand(1, 4, 1, dtype=torch.float64)
    check_against(
        lambda g, v: weight_norm(g, v, 1, 1e-3),
        lambda g, v: wn_reference(g, v, 1, 1e-3),
        [g, v],
        torch.float64,
    )


@pytest.mark.parametrize(("shape", "dim"), [((3, 0), 0), ((0, 4), 0), ((2, 0, 3), 1)])
def test_weight_norm_zero_size(shape: tuple[int, ...], dim: int) -> None:
    v = torch.randn(shape, requires_grad=True)
    g = torch.ones(gain_shape(v, dim), requires_grad=True)
    out = weight_norm(g, v, dim, 0.0)
    assert out.shape == v.shape
    out.sum().backward()
    assert torch.equal(g.grad, torch.zeros_like(g))  # type: ignore[arg-type]
    assert v.grad is not None
    assert v.grad.shape == v.shape


def test_weight_norm_double_backward_matches_reference() -> None:
    v = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.rand(3, 1, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 4, dtype=torch.float64)

    def second(fn: object) -> tuple[Tensor, ...]:
        out = fn(g, v)  # type: ignore[operator]
        grad_g, grad_v = torch.autograd.grad(out, (g, v), upstream, create_graph=True)
        return torch.autograd.grad(grad_g.sum() + grad_v.square().sum(), (g, v))

    ours = second(lambda g, v: weight_norm(g, v, 0, 1e-3))
    want = second(lambda g, v: wn_reference(g, v, 0, 1e-3))
    for got, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("g_shape", "dim", "eps", "match"),
    [
        pytest.param((3, 4), 0, 0.0, "g must have shape", id="g-shape"),
        pytest.param((3, 1), 2, 0.0, "dim must be in", id="dim"),
        pytest.param((3, 1), 0, -1.0, "eps must be non-negative", id="eps"),
    ],
)
def test_weight_norm_rejects_bad_input(
    g_shape: tuple[int, ...], dim: int, eps: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        weight_norm(torch.ones(g_shape), torch.ones(3, 4), dim, eps)


# --------------------------------------------------------------------------------------------
# Weight standardization


def ws_reference(rows: Tensor, gain: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    mean = rows.mean(1, keepdim=True)
    variance = ((rows - mean) ** 2).mean(1, keepdim=True)
    out = (rows - mean) / torch.sqrt(variance + eps)
    return out if gain is None else out * gain.view(-1, 1)


@pytest.mark.parametrize("gain", [False, True], ids=["plain", "gain"])
@pytest.mark.parametrize("dtype", FULL)
def test_standardize_rows_matches_reference(gain: bool, dtype: torch.dtype) -> None:
    rows = torch.randn(5, 37) * 3 + 2
    rows[2] = 0.25  # a constant row: zero variance
    inputs = [rows] + ([torch.randn(5)] if gain else [])
    check_against(
        lambda *t: ws_kernels.standardize_rows(t[0], 1e-5, *t[1:]),
        lambda *t: ws_reference(*t),
        inputs,
        dtype,
    )


def test_standardize_rows_gradcheck() -> None:
    rows = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    gain = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda r, g: ws_kernels.standardize_rows(r, 1e-5, g), (rows, gain), fast_mode=True
    )


def test_standardize_rows_non_contiguous() -> None:
    rows = torch.randn(40, 6, dtype=torch.float64).t()  # [6, 40], column-major
    check_against(
        lambda r: ws_kernels.standardize_rows(r, 1e-5),
        lambda r: ws_reference(r),
        [rows],
        torch.float64,
    )


def test_standardize_rows_non_contiguous_incoming_gradient() -> None:
    rows = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    exact = rows.detach().clone().requires_grad_()
    upstream = torch.randn(9, 4, dtype=torch.float64).t()
    (ours,) = torch.autograd.grad(ws_kernels.standardize_rows(rows, 1e-5), rows, upstream)
    (want,) = torch.autograd.grad(ws_reference(exact), exact, upstream)
    torch.testing.assert_close(ours, want)


@pytest.mark.parametrize("dtype", HALVES)
def test_standardize_rows_half_precision_is_float32_rounded_once(dtype: torch.dtype) -> None:
    rows, gain = torch.randn(4, 50).to(dtype), torch.randn(4).to(dtype)
    exact, exact_gain = rows.float().requires_grad_(), gain.float().requires_grad_()
    want = ws_reference(exact, exact_gain)
    ours_rows, ours_gain = rows.clone().requires_grad_(), gain.clone().requires_grad_()
    out = ws_kernels.standardize_rows(ours_rows, 1e-5, ours_gain)
    torch.testing.assert_close(out, want.to(dtype))
    upstream = torch.randn(4, 50).to(dtype)
    grads = torch.autograd.grad(out, (ours_rows, ours_gain), upstream)
    wanted = torch.autograd.grad(want, (exact, exact_gain), upstream.float())
    for got, expected in zip(grads, wanted, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected.to(dtype))


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)], ids=["N0", "R0"])
def test_standardize_rows_zero_size(shape: tuple[int, int]) -> None:
    rows = torch.randn(shape, requires_grad=True)
    gain = torch.ones(shape[0], requires_grad=True)
    out = ws_kernels.standardize_rows(rows, 1e-5, gain)
    assert out.shape == shape
    out.sum().backward()
    assert rows.grad is not None
    assert rows.grad.shape == shape
    assert torch.equal(gain.grad, torch.zeros(shape[0]))  # type: ignore[arg-type]


def test_standardize_rows_double_backward_matches_reference() -> None:
    rows = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    gain = torch.randn(3, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 5, dtype=torch.float64)

    def second(fn: object) -> tuple[Tensor, ...]:
        out = fn(rows, gain)  # type: ignore[operator]
        grad_rows, grad_gain = torch.autograd.grad(out, (rows, gain), upstream, create_graph=True)
        return torch.autograd.grad(grad_rows.square().sum() + grad_gain.sum(), (rows, gain))

    ours = second(lambda r, g: ws_kernels.standardize_rows(r, 1e-5, g))
    want = second(ws_reference)
    for got, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("rows", "gain", "eps", "match"),
    [
        pytest.param(torch.ones(2, 3, 4), None, 1e-5, "2-D matrix", id="3-D"),
        pytest.param(torch.ones(2, 3), torch.ones(3), 1e-5, "gain must have shape", id="gain"),
        pytest.param(torch.ones(2, 3), None, -1.0, "eps must be non-negative", id="eps"),
    ],
)
def test_standardize_rows_rejects_bad_input(
    rows: Tensor, gain: Tensor | None, eps: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ws_kernels.standardize_rows(rows, eps, gain)


# --------------------------------------------------------------------------------------------
# Dispatch and packaging


def test_kernels_are_not_available_for_cpu_tensors() -> None:
    assert not _kernels.available(torch.ones(2))


def test_importing_normhooks_leaves_triton_unimported() -> None:
    code = (
        "import sys, torch, normhooks\n"
        "from normhooks import _kernels\n"
        "assert not _kernels.available(torch.ones(1))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


COMPILE_ALL = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from normhooks._kernels import lars, weight_norm as wn, weight_standardization as ws

def build(fn, pointers, scalars, constants):
    signature = {name: "constexpr" if name in constants else pointers.get(name, scalars.get(name))
                 for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32))

for name, flag in (("fp32", False), ("fp16", True), ("bf16", False), ("fp64", True)):
    dtype = getattr(tl, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
                         "fp64": "float64"}[name])
    acc = tl.float64 if name == "fp64" else tl.float32
    a = "*fp64" if name == "fp64" else "*fp32"
    tables = {n: "*i64" for n in ("w_ptrs", "g_ptrs", "numels", "first_chunk", "chunk_tensor",
                                  "chunk_start")}
    sizes = {"block": 1024, "chunk_size": 32768}
    build(lars._partial_squares, {**tables, "partials": a}, {},
          {"dtype": dtype, "acc": acc, **sizes})
    build(lars._scale,
          {**tables, "partials": a, "rates": a, "grad_scale": "*fp32", "lr_tensor": a,
           "found_inf": "*fp32"},
          {n: "i64" for n in ("threshold", "weight_decay", "eps", "trust_coefficient", "lr")},
          {"dtype": dtype, "acc": acc, **sizes, "partials_block": 128, "has_decay": flag,
           "has_trust": flag, "clip": flag, "lr_is_tensor": flag,
           "zero_denominator_is_one": not flag, "scaled": flag, "flag_overflow": flag})
    p = "*" + name
    rows = {"length": "i32", "count": "i32", "inner": "i32", "eps": "i64"}
    build(wn._forward, {"v": p, "g": p, "w": p, "norms": a}, rows,
          {"acc": acc, "block": 1024, "row_is_contiguous": flag})
    build(wn._backward,
          {"grad_w": p, "v": p, "g": p, "norms": a, "grad_v": p, "grad_g": p}, rows,
          {"acc": acc, "block": 1024, "row_is_contiguous": not flag})
    strides = {n: "i32" for n in ("length", "x_row_stride", "x_stride", "dy_row_stride",
                                  "dy_stride")} | {"eps": "i64"}
    build(ws._forward, {"x": p, "gain": p, "y": p, "means": a, "rstds": a}, strides,
          {"acc": acc, "block": 1024, "has_gain": flag})
    build(ws._backward,
          {"grad_y": p, "x": p, "gain": p, "means": a, "rstds": a, "grad_x": p,
           "grad_gain": p}, strides, {"acc": acc, "block": 1024, "has_gain": not flag})

# The launcher turns an int argument equal to 1 into a constant unless told not to: every
# kernel must compile with each of its int arguments that it lets be specialized equal to 1
# (rows of one element, one row, unit strides).
p = a = "*fp32"
ws_pointers = {"x": p, "gain": p, "y": p, "means": a, "rstds": a, "grad_y": p, "grad_x": p,
               "grad_gain": p}
for fn, pointers, scalars in (
    (wn._forward, {"v": p, "g": p, "w": p, "norms": a}, rows),
    (wn._backward, {"grad_w": p, "v": p, "g": p, "norms": a, "grad_v": p, "grad_g": p}, rows),
    (ws._forward, ws_pointers, strides),
    (ws._backward, ws_pointers, strides),
):
    ones = {q.name: 1 for q in fn.params
            if scalars.get(q.name) == "i32" and not q.do_not_specialize}
    flags = {"row_is_contiguous": False} if fn in (wn._forward, wn._backward) else {
        "has_gain": True}
    build(fn, pointers, scalars, {"acc": tl.float32, "block": 16, **flags, **ones})
"""


def test_kernels_compile_for_sm90() -> None:
    """Every kernel in every dtype through Triton's real compiler, for an H100/H200.

    The interpreter runs Python, not the compiler, so a kernel can pass every other test here
    and still fail to compile; ptxas ships with Triton, so this needs no GPU.
    """
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_lars_table_cache_is_safe_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Optimizer steps in several threads share the cache; eviction must not break lookups.

    Tables only (Triton's interpreter is not thread-safe itself): building and finding them
    is what the threads share.
    """
    import threading

    monkeypatch.setattr(lars_kernels, "_CACHE_SIZE", 2)
    errors: list[BaseException] = []

    def lookups(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(4, generator=generator) for _ in range(8)]
        try:
            for i in range(200):
                pair = [tensors[i % 4]], [tensors[4 + i % 4]]
                lars_kernels._table(*pair)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=lookups, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
