"""The Triton kernels' test cases, written once for every device they run on.

:class:`KernelCases` holds every test that launches a kernel, each against a float64 formula
written out here. tests/test_kernels.py runs them on CPU tensors through Triton's interpreter
(without CUDA, conftest sets ``TRITON_INTERPRET=1``), tests/test_cuda.py on CUDA tensors; each
subclass only says which device. Inputs are drawn on the CPU and moved, references are computed
on the CPU, so both suites compare against the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton", reason="the fused kernels need Triton")

from normhooks._kernels import _common, _multi
from normhooks._kernels import lars as lars_kernels
from normhooks._kernels import weight_norm as wn_kernels
from normhooks._kernels import weight_standardization as ws_kernels
from normhooks.weight_norm import _weight_norm as plain_weight_norm

HALVES = [pytest.param(torch.float16, id="float16"), pytest.param(torch.bfloat16, id="bfloat16")]
FULL = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float64, id="float64")]


def weight_norm(g: Tensor, v: Tensor, dim: int, eps: float) -> Tensor:
    """The kernel, handed the package's plain formula, which a double backward goes through."""
    return wn_kernels.weight_norm(g, v, dim, eps, plain=plain_weight_norm)


# --------------------------------------------------------------------------------------------
# The float64 references


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
    """Rates and new gradients, one tensor at a time in float64 on the CPU."""
    rates, results = [], []
    for param, grad in zip(params, grads, strict=True):
        w, g = param.detach().cpu().double(), grad.detach().cpu().double()
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


def wn_reference(g: Tensor, v: Tensor, dim: int, eps: float) -> Tensor:
    axes = [d for d in range(v.ndim) if d != dim]
    norm = torch.linalg.vector_norm(v, dim=axes, keepdim=True)
    denominator = norm + eps if eps > 0 else torch.where(norm > 0, norm, torch.ones_like(norm))
    return g * v / denominator


def ws_reference(rows: Tensor, gain: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    mean = rows.mean(1, keepdim=True)
    variance = ((rows - mean) ** 2).mean(1, keepdim=True)
    out = (rows - mean) / torch.sqrt(variance + eps)
    return out if gain is None else out * gain.view(-1, 1)


def ws_layout(rows: Tensor) -> _common.RowPlan:
    """How the standardization kernels spread ``rows`` over programs."""
    return ws_kernels.plan(rows, 1e-5, None, 1.0).layout


def clear_plans() -> None:
    wn_kernels._plans.clear()
    ws_kernels._plans.clear()


def gain_shape(v: Tensor, dim: int) -> list[int]:
    return [n if d == dim else 1 for d, n in enumerate(v.shape)]


def check_against(
    fn: Callable[..., Tensor],
    reference: Callable[..., Tensor],
    inputs: list[Tensor],
    dtype: torch.dtype,
    device: str,
) -> None:
    """Forward and gradients of ``fn`` in ``dtype`` on ``device`` against ``reference`` in
    float64 on the CPU. ``inputs`` keep their layout on ``device``."""
    ours = [t.detach().to(device, dtype).requires_grad_() for t in inputs]
    exact = [t.detach().cpu().double().requires_grad_() for t in inputs]
    out = fn(*ours)
    want = reference(*exact)
    assert out.dtype == dtype
    assert out.device.type == torch.device(device).type
    torch.testing.assert_close(out.cpu(), want.to(dtype))
    upstream = torch.randn(want.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, ours, upstream.to(device, dtype))
    wanted = torch.autograd.grad(want, exact, upstream)
    for got, expected in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got.cpu(), expected.to(dtype))


# --------------------------------------------------------------------------------------------
# LARS inputs

# Sizes around the 64-value chunk of ``small_chunks``: empty, below, at, just over, several.
SHAPES = [(3, 4), (64,), (65,), (0,), (5, 13), (300,), (1,)]


def tensors(
    dtype: torch.dtype, device: str, shapes: list[tuple[int, ...]] = SHAPES
) -> list[Tensor]:
    return [torch.randn(shape, dtype=dtype).to(device) for shape in shapes]


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


def lars_table(params: list[Tensor], grads: list[Tensor]) -> _multi.ChunkTable:
    """The table LARS's kernels launch with for ``params`` and ``grads`` (outside a capture)."""
    return _multi.table(
        [params, grads], ("params", "grads"), _multi.WHOLE, lars_kernels._CHUNK, False, "LARS"
    )


def assert_lars_result(
    rates: Tensor, grads: list[Tensor], expected_rates: Tensor, expected: list[Tensor]
) -> None:
    torch.testing.assert_close(rates.cpu(), expected_rates.to(rates.dtype))
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad.cpu(), want.to(grad.dtype))


SETTINGS = [
    pytest.param({}, id="defaults"),
    pytest.param({"weight_decay": 1e-2, "trust_coefficient": 0.02}, id="decay-trust"),
    pytest.param({"weight_decay": 5e-4, "clip": True, "lr": 0.1}, id="clip"),
    pytest.param({"clip": True, "lr": 1e-4, "trust_coefficient": 1e-3}, id="clip-saturates"),
    pytest.param({"threshold": 8.0}, id="threshold"),
    pytest.param({"eps": 0.0}, id="eps0"),
    pytest.param({"eps": 0.5, "weight_decay": 0.1}, id="large-eps"),
]

# How rows are spread over programs (see row_plan): whole rows as on a GPU at these sizes;
# tiny rows split into segments of 16 (blocks of 16); and either in 64-bit offsets.
ROWS = [
    pytest.param({}, id="whole"),
    pytest.param({"MAX_BLOCK": 16, "MIN_SEGMENT": 16, "MIN_PROGRAMS": 64}, id="split"),
    pytest.param({"INT32_SAFE": 0}, id="wide"),
    pytest.param(
        {"MAX_BLOCK": 16, "MIN_SEGMENT": 16, "MIN_PROGRAMS": 64, "INT32_SAFE": 0},
        id="split-wide",
    ),
]

WN_CASES = [
    pytest.param((6, 3, 3), 0, id="dim0"),
    pytest.param((3, 6, 2), 1, id="dim1"),
    pytest.param((4, 5), 1, id="last"),
]


# The interpreter computes with NumPy, which warns where a GPU silently computes the 0/0 or the
# overflow that a test provokes on purpose.
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
class KernelCases:
    """Every kernel test; a subclass provides the ``device`` fixture (a device type)."""

    @pytest.fixture
    def device(self) -> str:
        raise NotImplementedError("a subclass of KernelCases says which device it runs on")

    @pytest.fixture
    def small_chunks(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """Chunks of 64 values read 16 at a time, partial sums 2 at a time: tiny tensors cross
        chunk boundaries and every loop of both launches runs more than once."""
        monkeypatch.setattr(lars_kernels, "_BLOCK", 16)
        monkeypatch.setattr(lars_kernels, "_CHUNK", 64)
        monkeypatch.setattr(lars_kernels, "_PARTIALS_BLOCK", 2)
        monkeypatch.setattr(_multi, "_kept", [])
        _multi._tables.clear()
        yield
        _multi._tables.clear()

    @pytest.fixture
    def rows(
        self, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
    ) -> Iterator[Callable[[_common.RowPlan], None]]:
        """Sets how row kernels spread rows over programs, from ``request.param``; yields a
        check that a plan does what the param asks."""
        settings: dict[str, int] = request.param
        for name, value in settings.items():
            monkeypatch.setattr(_common, name, value)

        def check(plan: _common.RowPlan) -> None:
            assert (plan.splits > 1) == ("MIN_SEGMENT" in settings), plan
            assert plan.wide == ("INT32_SAFE" in settings), plan

        # Plans are kept by layout, which the settings do not enter: none made under other
        # settings may be found, before or after.
        clear_plans()
        yield check
        clear_plans()

    @pytest.fixture
    def capturing(self, monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
        """Sets whether the kernel sees a CUDA-graph capture underway (nothing is captured:
        what it refuses and keeps does not depend on it)."""

        def set_capturing(value: bool) -> None:
            monkeypatch.setattr(_multi, "capturing", lambda device: value)

        return set_capturing

    # ----------------------------------------------------------------------------------------
    # LARS

    @pytest.mark.parametrize("settings", SETTINGS)
    @pytest.mark.parametrize("dtype", FULL)
    @pytest.mark.usefixtures("small_chunks")
    def test_lars_matches_reference(
        self, settings: dict[str, Any], dtype: torch.dtype, device: str
    ) -> None:
        params, grads = tensors(dtype, device), tensors(dtype, device)
        expected_rates, expected = lars_reference(params, grads, **settings)
        rates = run_lars(params, grads, **settings)
        assert rates.dtype == dtype
        assert_lars_result(rates, grads, expected_rates, expected)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_clip_with_a_tensor_lr(self, device: str) -> None:
        params, grads = tensors(torch.float32, device), tensors(torch.float32, device)
        expected_rates, expected = lars_reference(params, grads, clip=True, lr=0.5, eps=1e-3)
        lr = torch.tensor(0.5, device=device)
        rates = run_lars(params, grads, clip=True, lr=lr, eps=1e-3)
        assert_lars_result(rates, grads, expected_rates, expected)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_zero_tensors_and_zero_grads_keep_rate_one(self, device: str) -> None:
        params = [torch.zeros(70), torch.randn(70), torch.randn(3)]
        grads = [torch.randn(70), torch.zeros(70), torch.zeros(3)]
        before = [g.clone() for g in grads]
        on_device = [g.to(device) for g in grads]
        rates = run_lars([p.to(device) for p in params], on_device, eps=0.0)
        # w = 0 is below the threshold; g = 0 with eps = weight_decay = 0 is 0/0 in the rate.
        torch.testing.assert_close(rates.cpu(), torch.ones(3))
        for grad, old in zip(on_device, before, strict=True):
            torch.testing.assert_close(grad.cpu(), old)

    def test_lars_empty_list_returns_no_rates(self, device: str) -> None:
        rates = run_lars([], [])
        assert rates.shape == (0,)

    @pytest.mark.parametrize("dtype", HALVES)
    @pytest.mark.usefixtures("small_chunks")
    def test_lars_half_precision_is_float32_rounded_once(
        self, dtype: torch.dtype, device: str
    ) -> None:
        params, grads = tensors(dtype, device), tensors(dtype, device)
        settings: dict[str, Any] = {"weight_decay": 1e-2, "trust_coefficient": 0.5}
        expected_rates, _ = lars_reference(
            [p.float() for p in params], [g.float() for g in grads], **settings
        )
        once = [
            (rate * (g.cpu().float() + 1e-2 * p.cpu().float())).to(dtype)
            for rate, p, g in zip(expected_rates.float(), params, grads, strict=True)
        ]
        rates = run_lars(params, grads, **settings)
        assert rates.dtype == torch.float32
        torch.testing.assert_close(rates.cpu(), expected_rates.float())
        for grad, want in zip(grads, once, strict=True):
            torch.testing.assert_close(grad.cpu(), want)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_unscales_gradients_and_leaves_the_flag_down_when_finite(
        self, device: str
    ) -> None:
        params, grads = tensors(torch.float32, device), tensors(torch.float32, device)
        scaled = [g * 1024 for g in grads]
        expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
        found_inf = torch.zeros(1, device=device)
        rates = run_lars(
            params,
            scaled,
            weight_decay=1e-2,
            grad_scale=torch.tensor(1024.0, device=device),
            found_inf=found_inf,
        )
        assert_lars_result(rates, scaled, expected_rates, expected)
        assert found_inf.item() == 0.0

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_raises_the_flag_on_a_non_finite_gradient(self, device: str) -> None:
        params, grads = tensors(torch.float16, device), tensors(torch.float16, device)
        grads[5][200] = float("inf")
        found_inf = torch.zeros(1, device=device)
        scale = torch.tensor(65536.0, device=device)
        run_lars(params, grads, grad_scale=scale, found_inf=found_inf)
        assert found_inf.item() == 1.0

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_raises_the_flag_when_a_finite_gradient_overflows_on_writing(
        self, device: str
    ) -> None:
        params = [torch.full((100,), 60000.0, dtype=torch.float16, device=device)]
        grads = [torch.ones(100, dtype=torch.float16, device=device)]
        found_inf = torch.zeros(1, device=device)
        # Rate 1 (below the threshold); g + 2 w overflows float16.
        run_lars(params, grads, threshold=1e9, weight_decay=2.0, found_inf=found_inf)
        assert torch.isinf(grads[0]).all()
        assert found_inf.item() == 1.0

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_never_lowers_a_raised_flag(self, device: str) -> None:
        params, grads = tensors(torch.float32, device), tensors(torch.float32, device)
        found_inf = torch.ones(1, device=device)
        run_lars(params, grads, found_inf=found_inf)
        assert found_inf.item() == 1.0

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_reuses_its_table_and_rebuilds_it_when_a_tensor_moves(self, device: str) -> None:
        params, grads = tensors(torch.float64, device), tensors(torch.float64, device)
        for _ in range(3):
            run_lars(params, grads)
        assert len(_multi._tables) == 1
        params[2] = torch.randn(65, dtype=torch.float64, device=device)  # a new address
        grads = tensors(torch.float64, device)
        expected_rates, expected = lars_reference(params, grads)
        rates = run_lars(params, grads)
        assert len(_multi._tables) == 2
        assert_lars_result(rates, grads, expected_rates, expected)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_rebuilds_its_table_when_a_tensor_changes_size_in_place(self, device: str) -> None:
        storage_w = torch.randn(300, dtype=torch.float64, device=device)
        storage_g = torch.randn(300, dtype=torch.float64, device=device)
        for size in (10, 200):  # same addresses, another size
            params, grads = [storage_w[:size]], [storage_g[:size].clone()]
            expected_rates, expected = lars_reference(params, grads)
            rates = run_lars(params, grads)
            assert_lars_result(rates, grads, expected_rates, expected)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_sees_a_parameter_transposed_in_place_on_a_cached_table(self, device: str) -> None:
        # The same addresses and sizes, but w is laid out unlike its gradient now: the
        # table's flat pairing of w and g no longer holds.
        params = [torch.randn(9, 9, dtype=torch.float64, device=device) for _ in range(2)]
        grads = [torch.randn_like(p) for p in params]
        run_lars(params, grads)
        params[0].t_()
        for grad in grads:
            grad.copy_(torch.randn(grad.shape, dtype=grad.dtype))
        expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
        rates = run_lars(params, grads, weight_decay=1e-2)
        assert_lars_result(rates, grads, expected_rates, expected)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_drops_the_table_used_least_recently(
        self, device: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_multi._tables, "size", 2)
        sets = [tensors(torch.float64, device) for _ in range(3)]
        first = lars_table(sets[0], sets[0])
        lars_table(sets[1], sets[1])
        assert lars_table(sets[0], sets[0]) is first
        # A third set while two are kept: the second, found longer ago than the first, goes.
        third = lars_table(sets[2], sets[2])
        assert [id(t) for t in _multi._tables.values()] == [id(first), id(third)]

    @pytest.mark.parametrize(
        "layout",
        [
            pytest.param(lambda t: t.t(), id="both-transposed"),
            pytest.param(lambda t: t[:, ::2], id="strided"),
        ],
    )
    @pytest.mark.usefixtures("small_chunks")
    def test_lars_non_contiguous_tensors(
        self, layout: Callable[[Tensor], Tensor], device: str
    ) -> None:
        bases = [torch.randn(12, 30, dtype=torch.float64, device=device) for _ in range(2)]
        params = [layout(bases[0]), torch.randn(70, dtype=torch.float64, device=device)]
        grads = [layout(bases[1]), torch.randn(70, dtype=torch.float64, device=device)]
        expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
        rates = run_lars(params, grads, weight_decay=1e-2)
        assert_lars_result(rates, grads, expected_rates, expected)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_gradient_laid_out_unlike_its_parameter(self, device: str) -> None:
        params = [torch.randn(12, 30, dtype=torch.float64, device=device)]
        grads = [torch.randn(30, 12, dtype=torch.float64, device=device).t()]
        expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
        rates = run_lars(params, grads, weight_decay=1e-2)
        assert_lars_result(rates, grads, expected_rates, expected)

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_is_deterministic(self, device: str) -> None:
        params, grads = tensors(torch.float32, device), tensors(torch.float32, device)
        copies = [g.clone() for g in grads]
        first = run_lars(params, grads, weight_decay=1e-3)
        second = run_lars(params, copies, weight_decay=1e-3)
        assert torch.equal(first, second)
        assert all(torch.equal(a, b) for a, b in zip(grads, copies, strict=True))

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_gives_the_reference_at_every_call_on_one_table(self, device: str) -> None:
        params, grads = tensors(torch.float64, device), tensors(torch.float64, device)
        for _ in range(3):
            for grad in grads:
                grad.copy_(torch.randn(grad.shape, dtype=grad.dtype))
            expected_rates, expected = lars_reference(params, grads, weight_decay=1e-2)
            rates = run_lars(params, grads, weight_decay=1e-2)
            assert_lars_result(rates, grads, expected_rates, expected)
        (table,) = _multi._tables.values()
        # The last program of each tensor counted its chunks back to zero for the next call.
        assert torch.equal(table.arrivals.cpu(), torch.zeros(len(params), dtype=torch.int64))

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_under_capture_refuses_tensors_it_has_not_seen(
        self, device: str, capturing: Callable[[bool], None]
    ) -> None:
        params, grads = tensors(torch.float32, device), tensors(torch.float32, device)
        before = [g.clone() for g in grads]
        capturing(True)
        with pytest.raises(RuntimeError, match=r"before capturing.*set_to_none=False"):
            run_lars(params, grads)
        assert not _multi._tables
        assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))

    @pytest.mark.usefixtures("small_chunks")
    def test_lars_under_capture_refuses_a_float_lr_to_clip_by(
        self, device: str, capturing: Callable[[bool], None]
    ) -> None:
        params, grads = tensors(torch.float32, device), tensors(torch.float32, device)
        run_lars(params, grads)  # the table, built before the capture
        before = [g.clone() for g in grads]
        capturing(True)
        with pytest.raises(TypeError, match=r"float lr would be fixed.*lr=0\.1"):
            run_lars(params, grads, clip=True, lr=0.1)
        assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))

    @pytest.mark.parametrize(
        "settings",
        [
            pytest.param({"clip": True, "lr": "tensor"}, id="clip-tensor-lr"),
            pytest.param({"lr": 0.1}, id="float-lr-without-clip"),
        ],
    )
    @pytest.mark.usefixtures("small_chunks")
    def test_lars_under_capture_runs_on_a_table_built_before_and_keeps_it(
        self,
        settings: dict[str, Any],
        device: str,
        capturing: Callable[[bool], None],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        params, grads = tensors(torch.float32, device), tensors(torch.float32, device)
        run_lars(params, grads)
        (table,) = _multi._tables.values()
        settings = dict(settings)
        lr = 0.5 if settings.get("clip") else 0.1
        expected_rates, expected = lars_reference(params, grads, **settings | {"lr": lr})
        if settings["lr"] == "tensor":
            settings["lr"] = torch.tensor(lr, device=device)
        capturing(True)
        rates = run_lars(params, grads, **settings)
        assert_lars_result(rates, grads, expected_rates, expected)
        # A graph replays its table's addresses: dropped from the cache, it stays alive.
        capturing(False)
        monkeypatch.setattr(_multi._tables, "size", 1)
        run_lars(tensors(torch.float32, device), tensors(torch.float32, device))
        assert table not in _multi._tables.values()
        assert any(kept is table for kept in _multi._kept)

    @pytest.mark.parametrize(
        ("params", "grads", "found_inf", "match"),
        [
            pytest.param([(2,)], [], None, "must pair up", id="lengths"),
            pytest.param([(2,)], [(3,)], None, "has shape", id="shapes"),
            pytest.param(
                [(2,), (2, torch.float64)],
                [(2,), (2, torch.float64)],
                None,
                "one device and dtype",
                id="dtypes",
            ),
            pytest.param(
                [(2, torch.int32)],
                [(2,)],
                None,
                "float16, bfloat16, float32 or float64",
                id="integer",
            ),
            pytest.param([(2,)], [(2,)], torch.float64, "found_inf", id="flag"),
        ],
    )
    def test_lars_rejects_bad_input(
        self,
        params: list[tuple[Any, ...]],
        grads: list[tuple[Any, ...]],
        found_inf: torch.dtype | None,
        match: str,
        device: str,
    ) -> None:
        def make(spec: tuple[Any, ...]) -> Tensor:
            return torch.ones(spec[0], dtype=spec[1] if len(spec) > 1 else None, device=device)

        flag = None if found_inf is None else torch.zeros(1, dtype=found_inf, device=device)
        grad_tensors = [make(spec) for spec in grads]
        before = [g.clone() for g in grad_tensors]
        with pytest.raises((ValueError, TypeError), match=match):
            run_lars([make(spec) for spec in params], grad_tensors, found_inf=flag)
        assert all(torch.equal(a, b) for a, b in zip(grad_tensors, before, strict=True))

    # ----------------------------------------------------------------------------------------
    # Weight normalization

    @pytest.mark.parametrize("eps", [0.0, 1e-3], ids=["eps0", "eps1e-3"])
    @pytest.mark.parametrize(("shape", "dim"), WN_CASES)
    @pytest.mark.parametrize("dtype", FULL)
    def test_weight_norm_matches_reference(
        self, shape: tuple[int, ...], dim: int, eps: float, dtype: torch.dtype, device: str
    ) -> None:
        v = torch.randn(shape)
        v.select(dim, 1).zero_()  # a zero row
        g = torch.rand(gain_shape(v, dim)) + 0.5
        check_against(
            lambda g, v: weight_norm(g, v, dim, eps),
            lambda g, v: wn_reference(g, v, dim, eps),
            [g, v],
            dtype,
            device,
        )

    @pytest.mark.parametrize("rows", ROWS, indirect=True)
    @pytest.mark.parametrize(
        ("shape", "dim"),
        [pytest.param((3, 100), 0, id="row-contiguous"), pytest.param((2, 3, 60), 1, id="dim1")],
    )
    @pytest.mark.parametrize("dtype", FULL)
    def test_weight_norm_long_rows_match_reference(
        self,
        shape: tuple[int, ...],
        dim: int,
        dtype: torch.dtype,
        device: str,
        rows: Callable[[_common.RowPlan], None],
    ) -> None:
        v = torch.randn(shape)
        rows(wn_kernels._layout(v, dim).plan)
        v.select(dim, 1).zero_()  # a zero row, split like the others
        g = torch.rand(gain_shape(v, dim)) + 0.5
        check_against(
            lambda g, v: weight_norm(g, v, dim, 0.0),
            lambda g, v: wn_reference(g, v, dim, 0.0),
            [g, v],
            dtype,
            device,
        )

    @pytest.mark.parametrize("rows", ROWS[1:2], indirect=True)
    @pytest.mark.usefixtures("rows")
    def test_weight_norm_split_rows_are_deterministic(self, device: str) -> None:
        v = torch.randn(2, 3, 60).to(device).requires_grad_()
        g = (torch.rand(1, 3, 1) + 0.5).to(device).requires_grad_()
        assert wn_kernels._layout(v, 1).plan.splits > 1
        upstream = torch.randn(2, 3, 60).to(device)

        def run() -> list[Tensor]:
            out = weight_norm(g, v, 1, 1e-3)
            return [out, *torch.autograd.grad(out, (g, v), upstream)]

        first, second = run(), run()
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    def test_weight_norm_zero_row_with_eps0_stays_zero_with_finite_gradients(
        self, device: str
    ) -> None:
        v = torch.zeros(3, 4, device=device, requires_grad=True)
        g = torch.ones(3, 1, device=device, requires_grad=True)
        out = weight_norm(g, v, 0, 0.0)
        out.backward(torch.ones(3, 4, device=device))
        assert torch.equal(out.cpu(), torch.zeros(3, 4))
        # Row 0 divides by 1: dW/dv = g, dW/dg = v = 0.
        assert v.grad is not None
        assert g.grad is not None
        assert torch.equal(v.grad.cpu(), torch.ones(3, 4))
        assert torch.equal(g.grad.cpu(), torch.zeros(3, 1))

    def test_weight_norm_gradcheck(self, device: str) -> None:
        v = torch.randn(3, 4, 2, dtype=torch.float64).to(device).requires_grad_()
        g = torch.rand(1, 4, 1, dtype=torch.float64).to(device).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda g, v: weight_norm(g, v, 1, 1e-2), (g, v), fast_mode=True
        )

    @pytest.mark.parametrize("dtype", HALVES)
    def test_weight_norm_half_precision_is_float32_rounded_once(
        self, dtype: torch.dtype, device: str
    ) -> None:
        v, g = torch.randn(5, 7).to(dtype), (torch.rand(5, 1) + 0.5).to(dtype)
        v32, g32 = v.float().requires_grad_(), g.float().requires_grad_()
        want = wn_reference(g32, v32, 0, 1e-3)
        vh, gh = v.to(device).requires_grad_(), g.to(device).requires_grad_()
        out = weight_norm(gh, vh, 0, 1e-3)
        torch.testing.assert_close(out.cpu(), want.to(dtype))
        upstream = torch.randn(5, 7).to(dtype)
        grads = torch.autograd.grad(out, (gh, vh), upstream.to(device))
        wanted = torch.autograd.grad(want, (g32, v32), upstream.float())
        for got, expected in zip(grads, wanted, strict=True):
            assert got.dtype == dtype
            torch.testing.assert_close(got.cpu(), expected.to(dtype))

    def test_weight_norm_non_contiguous_v(self, device: str) -> None:
        v = torch.randn(4, 3, 5, dtype=torch.float64).to(device).permute(2, 0, 1)  # [5, 4, 3]
        g = torch.rand(1, 4, 1, dtype=torch.float64)
        check_against(
            lambda g, v: weight_norm(g, v, 1, 1e-3),
            lambda g, v: wn_reference(g, v, 1, 1e-3),
            [g, v],
            torch.float64,
            device,
        )

    @pytest.mark.parametrize(("shape", "dim"), [((3, 0), 0), ((0, 4), 0), ((2, 0, 3), 1)])
    def test_weight_norm_zero_size(self, shape: tuple[int, ...], dim: int, device: str) -> None:
        v = torch.randn(shape, device=device, requires_grad=True)
        g = torch.ones(gain_shape(v, dim), device=device, requires_grad=True)
        out = weight_norm(g, v, dim, 0.0)
        assert out.shape == v.shape
        out.sum().backward()
        assert g.grad is not None
        assert torch.equal(g.grad.cpu(), torch.zeros(g.shape))
        assert v.grad is not None
        assert v.grad.shape == v.shape

    def test_weight_norm_double_backward_matches_reference(self, device: str) -> None:
        v = torch.randn(3, 4, dtype=torch.float64)
        g = torch.rand(3, 1, dtype=torch.float64)
        upstream = torch.randn(3, 4, dtype=torch.float64)

        def second(fn: Callable[..., Tensor], on: str) -> list[Tensor]:
            gg, vv = g.to(on).requires_grad_(), v.to(on).requires_grad_()
            grad_g, grad_v = torch.autograd.grad(
                fn(gg, vv), (gg, vv), upstream.to(on), create_graph=True
            )
            result = torch.autograd.grad(grad_g.sum() + grad_v.square().sum(), (gg, vv))
            return [t.cpu() for t in result]

        ours = second(lambda g, v: weight_norm(g, v, 0, 1e-3), device)
        want = second(lambda g, v: wn_reference(g, v, 0, 1e-3), "cpu")
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
        self, g_shape: tuple[int, ...], dim: int, eps: float, match: str, device: str
    ) -> None:
        with pytest.raises(ValueError, match=match):
            weight_norm(
                torch.ones(g_shape, device=device), torch.ones(3, 4, device=device), dim, eps
            )

    # ----------------------------------------------------------------------------------------
    # Weight standardization

    @pytest.mark.parametrize("gain", [False, True], ids=["plain", "gain"])
    @pytest.mark.parametrize("dtype", FULL)
    def test_standardize_rows_matches_reference(
        self, gain: bool, dtype: torch.dtype, device: str
    ) -> None:
        rows = torch.randn(5, 37) * 3 + 2
        rows[2] = 0.25  # a constant row: zero variance
        inputs = [rows] + ([torch.randn(5)] if gain else [])
        check_against(
            lambda *t: ws_kernels.standardize_rows(t[0], 1e-5, *t[1:]),
            lambda *t: ws_reference(*t),
            inputs,
            dtype,
            device,
        )

    @pytest.mark.parametrize("rows", ROWS, indirect=True)
    @pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "column-major"])
    @pytest.mark.parametrize("gain", [False, True], ids=["plain", "gain"])
    def test_standardize_rows_long_rows_match_reference(
        self,
        transposed: bool,
        gain: bool,
        device: str,
        rows: Callable[[_common.RowPlan], None],
    ) -> None:
        matrix = torch.randn(3, 100, dtype=torch.float64) * 3 + 2
        rows(ws_layout(matrix))
        matrix[1] = 0.25  # a constant row: zero variance
        matrix[2] = matrix[2] * 1e-3 + 1e3  # a mean large against the spread
        if transposed:
            matrix = matrix.t().contiguous().t()
        inputs = [matrix] + ([torch.randn(3, dtype=torch.float64)] if gain else [])
        check_against(
            lambda *t: ws_kernels.standardize_rows(t[0], 1e-5, *t[1:]),
            lambda *t: ws_reference(*t),
            inputs,
            torch.float64,
            device,
        )

    @pytest.mark.parametrize("rows", ROWS[1:2], indirect=True)
    @pytest.mark.usefixtures("rows")
    def test_standardize_rows_split_rows_are_deterministic(self, device: str) -> None:
        matrix = torch.randn(3, 100).to(device).requires_grad_()
        gain = torch.randn(3).to(device).requires_grad_()
        assert ws_layout(matrix).splits > 1
        upstream = torch.randn(3, 100).to(device)

        def run() -> list[Tensor]:
            out = ws_kernels.standardize_rows(matrix, 1e-5, gain)
            return [out, *torch.autograd.grad(out, (matrix, gain), upstream)]

        first, second = run(), run()
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    def test_standardize_rows_gradcheck(self, device: str) -> None:
        rows = torch.randn(3, 6, dtype=torch.float64).to(device).requires_grad_()
        gain = torch.randn(3, dtype=torch.float64).to(device).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda r, g: ws_kernels.standardize_rows(r, 1e-5, g), (rows, gain), fast_mode=True
        )

    def test_standardize_rows_non_contiguous(self, device: str) -> None:
        rows = torch.randn(40, 6, dtype=torch.float64).to(device).t()  # [6, 40], column-major
        check_against(
            lambda r: ws_kernels.standardize_rows(r, 1e-5),
            lambda r: ws_reference(r),
            [rows],
            torch.float64,
            device,
        )

    def test_standardize_rows_non_contiguous_incoming_gradient(self, device: str) -> None:
        rows = torch.randn(4, 9, dtype=torch.float64)
        upstream = torch.randn(9, 4, dtype=torch.float64).t()
        ours_rows = rows.to(device).requires_grad_()
        (ours,) = torch.autograd.grad(
            ws_kernels.standardize_rows(ours_rows, 1e-5), ours_rows, upstream.to(device)
        )
        exact = rows.clone().requires_grad_()
        (want,) = torch.autograd.grad(ws_reference(exact), exact, upstream)
        torch.testing.assert_close(ours.cpu(), want)

    @pytest.mark.parametrize("dtype", HALVES)
    def test_standardize_rows_half_precision_is_float32_rounded_once(
        self, dtype: torch.dtype, device: str
    ) -> None:
        rows, gain = torch.randn(4, 50).to(dtype), torch.randn(4).to(dtype)
        exact, exact_gain = rows.float().requires_grad_(), gain.float().requires_grad_()
        want = ws_reference(exact, exact_gain)
        ours_rows, ours_gain = rows.to(device).requires_grad_(), gain.to(device).requires_grad_()
        out = ws_kernels.standardize_rows(ours_rows, 1e-5, ours_gain)
        torch.testing.assert_close(out.cpu(), want.to(dtype))
        upstream = torch.randn(4, 50).to(dtype)
        grads = torch.autograd.grad(out, (ours_rows, ours_gain), upstream.to(device))
        wanted = torch.autograd.grad(want, (exact, exact_gain), upstream.float())
        for got, expected in zip(grads, wanted, strict=True):
            assert got.dtype == dtype
            torch.testing.assert_close(got.cpu(), expected.to(dtype))

    @pytest.mark.parametrize("shape", [(3, 0), (0, 5)], ids=["N0", "R0"])
    def test_standardize_rows_zero_size(self, shape: tuple[int, int], device: str) -> None:
        rows = torch.randn(shape, device=device, requires_grad=True)
        gain = torch.ones(shape[0], device=device, requires_grad=True)
        out = ws_kernels.standardize_rows(rows, 1e-5, gain)
        assert out.shape == shape
        out.sum().backward()
        assert rows.grad is not None
        assert rows.grad.shape == shape
        assert gain.grad is not None
        assert torch.equal(gain.grad.cpu(), torch.zeros(shape[0]))

    def test_standardize_rows_double_backward_matches_reference(self, device: str) -> None:
        rows = torch.randn(3, 5, dtype=torch.float64)
        gain = torch.randn(3, dtype=torch.float64)
        upstream = torch.randn(3, 5, dtype=torch.float64)

        def second(fn: Callable[..., Tensor], on: str) -> list[Tensor]:
            r, g = rows.to(on).requires_grad_(), gain.to(on).requires_grad_()
            grad_rows, grad_gain = torch.autograd.grad(
                fn(r, g), (r, g), upstream.to(on), create_graph=True
            )
            result = torch.autograd.grad(grad_rows.square().sum() + grad_gain.sum(), (r, g))
            return [t.cpu() for t in result]

        ours = second(lambda r, g: ws_kernels.standardize_rows(r, 1e-5, g), device)
        want = second(ws_reference, "cpu")
        for got, expected in zip(ours, want, strict=True):
            torch.testing.assert_close(got, expected)

    @pytest.mark.parametrize(
        ("shape", "gain", "eps", "match"),
        [
            pytest.param((6,), None, 1e-5, "at least 2 dimensions", id="1-D"),
            pytest.param((2, 3), 3, 1e-5, "gain must have shape", id="gain"),
            pytest.param((2, 3), None, -1.0, "eps must be non-negative", id="eps"),
        ],
    )
    def test_standardize_rows_rejects_bad_input(
        self, shape: tuple[int, ...], gain: int | None, eps: float, match: str, device: str
    ) -> None:
        rows = torch.ones(shape, device=device)
        gains = None if gain is None else torch.ones(gain, device=device)
        with pytest.raises(ValueError, match=match):
            ws_kernels.standardize_rows(rows, eps, gains)

    # ----------------------------------------------------------------------------------------
    # Many layers in one launch each way

    @pytest.mark.parametrize("dtype", FULL)
    def test_fused_weight_norms_match_reference(self, dtype: torch.dtype, device: str) -> None:
        layers = fused_wn_layers()
        ours = [t.to(device, dtype).requires_grad_() for layer in layers for t in layer[:2]]
        exact = [t.double().requires_grad_() for layer in layers for t in layer[:2]]
        plans = tuple(
            wn_kernels.plan(ours[2 * i], ours[2 * i + 1], dim, eps, plain_weight_norm)
            for i, (_, _, dim, eps) in enumerate(layers)
        )
        assert all(map(wn_kernels.fusable, plans))
        weights = wn_kernels.fused_weight_norms(wn_kernels.fused_plan(plans, ours), ours)
        wanted = [
            wn_reference(exact[2 * i], exact[2 * i + 1], dim, eps)
            for i, (_, _, dim, eps) in enumerate(layers)
        ]
        assert_fused_results(weights, wanted, ours, exact, dtype)

    def test_fused_weight_norms_half_precision_is_float32_rounded_once(self, device: str) -> None:
        layers = fused_wn_layers()
        halves = [t.half() for layer in layers for t in layer[:2]]
        ours = [t.to(device).requires_grad_() for t in halves]
        exact = [t.float().requires_grad_() for t in halves]
        plans = tuple(
            wn_kernels.plan(ours[2 * i], ours[2 * i + 1], dim, eps, plain_weight_norm)
            for i, (_, _, dim, eps) in enumerate(layers)
        )
        weights = wn_kernels.fused_weight_norms(wn_kernels.fused_plan(plans, ours), ours)
        wanted = [
            wn_reference(exact[2 * i], exact[2 * i + 1], dim, eps)
            for i, (_, _, dim, eps) in enumerate(layers)
        ]
        assert_fused_results(weights, wanted, ours, exact, torch.float16)

    @pytest.mark.parametrize("dtype", FULL)
    def test_fused_standardizations_match_reference(self, dtype: torch.dtype, device: str) -> None:
        layers = fused_ws_layers()
        ours: list[Tensor | None] = []
        exact: list[Tensor | None] = []
        for weight, gain, _ in layers:
            ours += [
                t if t is None else t.to(device, dtype).requires_grad_() for t in (weight, gain)
            ]
            exact += [t if t is None else t.double().requires_grad_() for t in (weight, gain)]
        plans = []
        for i, (_, _, factor) in enumerate(layers):
            weight = ours[2 * i]
            assert weight is not None
            plans.append(ws_kernels.plan(weight, 1e-5, ours[2 * i + 1], factor))
        assert all(map(ws_kernels.fusable, plans))
        results = ws_kernels.fused_standardizations(ws_kernels.fused_plan(tuple(plans), ours), ours)
        wanted = []
        for i, (weight, _, factor) in enumerate(layers):
            rows = exact[2 * i]
            assert rows is not None
            scale = exact[2 * i + 1]
            flat = ws_reference(
                rows.reshape(weight.shape[0], -1), None if scale is None else scale * factor
            )
            wanted.append(flat.reshape(weight.shape))
        assert_fused_results(results, wanted, ours, exact, dtype)

    def test_fused_launches_skip_the_rows_of_weights_without_a_gradient(self, device: str) -> None:
        """Every gradient given, or none: what the others get does not depend on it."""
        layers = fused_wn_layers()
        tensors = [t.to(device).requires_grad_() for layer in layers for t in layer[:2]]
        plans = tuple(
            wn_kernels.plan(tensors[2 * i], tensors[2 * i + 1], dim, eps, plain_weight_norm)
            for i, (_, _, dim, eps) in enumerate(layers)
        )
        plan = wn_kernels.fused_plan(plans, tensors)
        upstream = [torch.randn(v.shape).to(device) for v in tensors[1::2]]

        def grads(used: list[int]) -> list[Tensor | None]:
            weights = wn_kernels.fused_weight_norms(plan, tensors)
            outputs = [weights[i] for i in used]
            return list(
                torch.autograd.grad(
                    outputs, tensors, [upstream[i] for i in used], allow_unused=True
                )
            )

        every, some = grads(list(range(len(layers)))), grads([0, 2])
        for i, (got, expected) in enumerate(zip(some, every, strict=True)):
            if i // 2 in (0, 2):
                assert got is not None
                assert torch.equal(got, expected)  # type: ignore[arg-type]
            else:
                assert got is None


def fused_wn_layers() -> list[tuple[Tensor, Tensor, int, float]]:
    """(g, v, dim, eps) of layers one fused launch takes: rows along dim 0 and 1, a zero row
    with eps = 0, a matrix, row lengths below and above one block."""
    layers = []
    for shape, dim, eps in [
        ((6, 3, 3), 0, 1e-3),
        ((3, 6, 2), 1, 0.0),
        ((4, 5), 0, 1e-12),
        ((2, 3, 700), 1, 0.5),
    ]:
        v = torch.randn(shape)
        g = torch.rand(gain_shape(v, dim)) + 0.5
        layers.append((g, v, dim, eps))
    layers[1][1].select(1, 2).zero_()
    return layers


def fused_ws_layers() -> list[tuple[Tensor, Tensor | None, float]]:
    """(weight, gain or None, factor) of weights one fused launch takes: with and without a
    gain, a constant row, a row of one value, rows longer than one block."""
    weights = [
        torch.randn(5, 3, 3, 3) * 3 + 2,
        torch.randn(4, 7),
        torch.randn(3, 1, 1),
        torch.randn(2, 1500),
    ]
    weights[0][1] = 0.25
    gains = [torch.randn(5), None, torch.randn(3), torch.rand(2) + 0.5]
    factors = [1.3 / 27**0.5, 1.0, 1.0, 0.7]
    return list(zip(weights, gains, factors, strict=True))


def assert_fused_results(
    results: tuple[Tensor, ...],
    wanted: list[Tensor],
    ours: list[Tensor | None],
    exact: list[Tensor | None],
    dtype: torch.dtype,
) -> None:
    """Each result against its float64 (or float32, for halves) reference, then the
    gradients of every input, from one random upstream gradient per result."""
    assert len(results) == len(wanted)
    for got, want in zip(results, wanted, strict=True):
        assert got.shape == want.shape
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu(), want.to(dtype))
    # In the results' dtype, so that both sides start from the same numbers.
    upstream = [torch.randn(w.shape, dtype=torch.float64).to(dtype) for w in wanted]
    inputs = [t for t in ours if t is not None]
    references = [t for t in exact if t is not None]
    device = inputs[0].device
    grads = torch.autograd.grad(results, inputs, [u.to(device, dtype) for u in upstream])
    expected = torch.autograd.grad(wanted, references, [u.to(wanted[0].dtype) for u in upstream])
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.cpu(), want.to(dtype))
