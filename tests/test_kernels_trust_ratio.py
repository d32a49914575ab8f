"""TrustRatio's Triton kernels on Triton's interpreter, against the formula in float64.

Without CUDA, conftest sets ``TRITON_INTERPRET=1`` and the kernels run on CPU tensors (shapes
stay tiny, chunks of 64 values read 16 at a time, so tensors cross chunk boundaries and every
loop runs more than once); the hook's dispatch is exercised through
``_kernels.route_cpu_tensors()``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("triton", reason="the fused kernels need Triton")

import normhooks
from normhooks import _kernels
from normhooks._kernels import _fallback, _multi
from normhooks._kernels import trust_ratio as tr_kernels

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="runs the kernels on CPU tensors through Triton's interpreter",
    ),
    # The interpreter computes with NumPy, which warns where a GPU silently computes the 0/0
    # of a branch that tl.where then discards (a zero update's or zero weight's ratio).
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

# Around the 64-value chunk: empty, one value, below, at, just over, several chunks.
SHAPES = [(3, 4), (64,), (65,), (0,), (5, 13), (300,), (1,)]
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "eps-coefficient": {"eps": 1e-3, "trust_coefficient": 0.5},
    "clip-floor": {"clip": 1.5, "floor": 0.9},
    "max-weight-norm": {"max_weight_norm": 2.0},
    "threshold": {"threshold": 5.0},
    "infinite-threshold": {"threshold": math.inf},
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(tr_kernels, "_BLOCK", 16)
    monkeypatch.setattr(tr_kernels, "_CHUNK", 64)
    monkeypatch.setattr(tr_kernels, "_PARTIALS_BLOCK", 2)
    monkeypatch.setattr(_multi, "_kept", [])
    _multi._tables.clear()
    yield
    _multi._tables.clear()


def settings_of(**given: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "threshold": 0.0,
        "eps": 0.0,
        "trust_coefficient": 1.0,
        "clip": None,
        "floor": None,
        "max_weight_norm": None,
    }
    return base | given


def reference(
    olds: list[Tensor], news: list[Tensor], lr: float, s: dict[str, Any]
) -> tuple[list[float], list[Tensor]]:
    """The ratios and the rescaled parameters in float64, written out per tensor, from the
    difference rounded to the parameters' dtype (as the kernel and the eager hook take it)."""
    ratios, results = [], []
    for old, new in zip(olds, news, strict=True):
        d = (old - new).double()
        w_norm = old.double().norm().item()
        u_norm = d.norm().item() / lr if lr else (math.inf if d.norm() > 0 else math.nan)
        phi = w_norm if s["max_weight_norm"] is None else min(w_norm, s["max_weight_norm"])
        ratio = 1.0
        if w_norm > s["threshold"] and u_norm > 0:
            ratio = s["trust_coefficient"] * phi / (u_norm + s["eps"])
            if s["floor"] is not None:
                ratio = max(ratio, s["floor"])
            if s["clip"] is not None:
                ratio = min(ratio, s["clip"])
        ratios.append(ratio)
        results.append(new.double() + (1 - ratio) * d)
    return ratios, results


def offsets(tensors: list[Tensor]) -> tuple[Tensor, int]:
    """Where each tensor starts in a flat buffer of them all, and the buffer's size."""
    starts = [0]
    for tensor in tensors:
        starts.append(starts[-1] + tensor.numel())
    return torch.tensor(starts[:-1]), starts[-1]


def step(
    dtype: torch.dtype, shapes: list[tuple[int, ...]] = SHAPES
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Parameters after a step of about 1e-2 of their size, their old values, a flat buffer."""
    olds = [torch.randn(shape).to(dtype) for shape in shapes]
    news = [(o.float() + 1e-2 * torch.randn(o.shape)).to(dtype) for o in olds]
    flat = torch.empty(sum(o.numel() for o in olds), dtype=dtype)
    return olds, news, flat


def run(
    olds: list[Tensor], news: list[Tensor], flat: Tensor, lr: float | Tensor, **given: Any
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The copy launch on the old values, then the two launches on the new ones."""
    params = [o.clone() for o in olds]
    where = offsets(params)
    squares = tr_kernels.copy_and_squares(params, flat, *where)
    for param, new in zip(params, news, strict=True):
        param.copy_(new)
    ratios = tr_kernels.rescale_updates(
        params, flat, *where, squares, lr=lr, **settings_of(**given)
    )
    return squares, ratios, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_copy_writes_the_old_values_and_their_squares(dtype: torch.dtype) -> None:
    olds, _, flat = step(dtype)
    squares = tr_kernels.copy_and_squares(olds, flat, *offsets(olds))
    torch.testing.assert_close(flat, torch.cat([o.reshape(-1) for o in olds]), rtol=0, atol=0)
    want = torch.tensor([o.double().square().sum().item() for o in olds], dtype=torch.float64)
    torch.testing.assert_close(
        squares.double(), want, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=0
    )


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_ratios_and_parameters_match_float64(name: str, dtype: torch.dtype) -> None:
    olds, news, flat = step(dtype)
    _, ratios, params = run(olds, news, flat, 1e-2, **SETTINGS[name])
    want_ratios, want = reference(olds, news, 1e-2, settings_of(**SETTINGS[name]))
    tight = dtype == torch.float64
    torch.testing.assert_close(
        ratios.double(),
        torch.tensor(want_ratios, dtype=torch.float64),
        rtol=1e-12 if tight else 2e-6,
        atol=0,
    )
    for param, expected in zip(params, want, strict=True):
        torch.testing.assert_close(param.double(), expected, rtol=0, atol=1e-14 if tight else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_dtypes_compute_in_float32_and_round_once(dtype: torch.dtype) -> None:
    olds, news, flat = step(dtype)
    _, ratios, params = run(olds, news, flat, 1e-2)
    want_ratios, want = reference(olds, news, 1e-2, settings_of())
    assert ratios.dtype == torch.float32
    # The interpreter truncates float32 to bfloat16, where d is rounded: a few 1e-5.
    rtol = 1e-4 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        ratios.double(), torch.tensor(want_ratios, dtype=torch.float64), rtol=rtol, atol=0
    )
    for param, expected in zip(params, want, strict=True):
        # One rounding to the dtype (the interpreter truncates float32 to bfloat16: one ulp).
        torch.testing.assert_close(param, expected.to(dtype), rtol=2**-7, atol=2**-7)


def test_ratio_one_leaves_the_new_values_bit_for_bit() -> None:
    olds, news, flat = step(torch.float32)
    _, ratios, params = run(olds, news, flat, 1e-2, threshold=math.inf)
    assert ratios.tolist() == [1.0] * len(olds)
    for param, new in zip(params, news, strict=True):
        assert torch.equal(param, new)


@pytest.mark.parametrize("case", ["zero-update", "zero-weight", "zero-lr"])
def test_zero_norms_take_the_fallbacks(case: str) -> None:
    olds, news, flat = step(torch.float32, [(70,)])
    if case == "zero-update":
        news = [o.clone() for o in olds]
    if case == "zero-weight":
        olds = [torch.zeros(70)]
    lr = 0.0 if case == "zero-lr" else 1e-2
    _, ratios, params = run(olds, news, flat, lr)
    want_ratios, want = reference(olds, news, lr, settings_of())
    assert ratios.tolist() == want_ratios
    torch.testing.assert_close(params[0].double(), want[0], rtol=0, atol=1e-6)


def test_tensor_lr_is_read_on_the_device() -> None:
    olds, news, flat = step(torch.float32)
    _, by_float, _ = run(olds, news, flat, 1e-2)
    _, by_tensor, _ = run(olds, news, flat, torch.tensor(1e-2))
    torch.testing.assert_close(by_tensor, by_float, rtol=0, atol=0)


def test_non_finite_update_stays_non_finite() -> None:
    olds, news, flat = step(torch.float32, [(70,)])
    news[0][3] = math.nan
    _, _, params = run(olds, news, flat, 1e-2)
    assert torch.isnan(params[0]).any()


def test_repeated_launches_find_the_table_with_its_counts_at_zero() -> None:
    """The same parameters launched on again: the table is found (one in the cache), its
    counts of arrived programs back at zero, so every tensor's sums complete again."""
    olds, news, flat = step(torch.float32)
    params = [o.clone() for o in olds]
    where = offsets(params)
    expected_ratios, expected = reference(olds, news, 1e-2, settings_of())
    for _ in range(3):
        for param, old in zip(params, olds, strict=True):
            param.copy_(old)
        squares = tr_kernels.copy_and_squares(params, flat, *where)
        for param, new in zip(params, news, strict=True):
            param.copy_(new)
        ratios = tr_kernels.rescale_updates(params, flat, *where, squares, lr=1e-2, **settings_of())
        assert len(_multi._tables) == 1
        assert not _multi._tables.values()[0].arrivals.any()
        torch.testing.assert_close(
            ratios.double(), torch.tensor(expected_ratios, dtype=torch.float64)
        )
        for param, want in zip(params, expected, strict=True):
            torch.testing.assert_close(param.double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("short-buffer", "must be contiguous with 12 values"),
        ("offsets", "and one offset per parameter"),
        ("dtype", "flat buffer is a"),
    ],
)
def test_bad_buffers_refused(change: str, match: str) -> None:
    params = [torch.randn(4, 3)]
    flat, where, total = torch.empty(12), torch.tensor([0]), 12
    if change == "short-buffer":
        flat = torch.empty(11)
    if change == "offsets":
        where = torch.tensor([0, 6])
    if change == "dtype":
        flat = torch.empty(12, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        tr_kernels.copy_and_squares(params, flat, where, total)


# --- the hook's dispatch -------------------------------------------------------------------


def hooked_adamw(
    routed: bool, transposed: bool = False, **hook: Any
) -> tuple[list[nn.Parameter], normhooks.TrustRatio]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    if transposed:
        params.append(nn.Parameter(torch.randn(7, 5).t()))
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)
    trust = normhooks.TrustRatio(**hook)
    trust.attach(optimizer)
    for _ in range(2):
        if routed:
            with _kernels.route_cpu_tensors():
                optimizer.step()
        else:
            optimizer.step()
    return params, trust


@pytest.mark.parametrize(
    "hook",
    [{}, {"eps": 1e-3, "clip": 2.0}, {"bias_correction": False, "max_weight_norm": 10.0}],
    ids=["defaults", "eps-clip", "uncorrected"],
)
def test_hook_through_the_kernels_matches_the_eager_hook(
    hook: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rescales: list[int] = []
    rescale = tr_kernels._RESCALE

    def counted(*args: Any) -> None:
        rescales.append(1)
        rescale(*args)

    monkeypatch.setattr(tr_kernels, "_RESCALE", counted)
    kernel_params, kernel_hook = hooked_adamw(True, **hook)
    # Two steps on the kernels; without bias correction the rescale is the eager formula's,
    # from the kernel's copy.
    assert len(rescales) == (0 if hook.get("bias_correction") is False else 2)
    eager_params, eager_hook = hooked_adamw(False, **hook)
    torch.testing.assert_close(kernel_hook.last_ratios, eager_hook.last_ratios, rtol=1e-6, atol=0)
    for a, b in zip(kernel_params, eager_params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_a_permuted_parameter_takes_the_eager_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy holds values in their logical order, which a kernel reading memory order would
    not share: a unit with a non-contiguous parameter launches nothing."""

    def unreachable(*args: Any) -> None:
        raise AssertionError("launched")

    monkeypatch.setattr(tr_kernels, "_COPY_SQUARES", unreachable)
    kernel_params, kernel_hook = hooked_adamw(True, transposed=True)
    eager_params, eager_hook = hooked_adamw(False, transposed=True)
    torch.testing.assert_close(kernel_hook.last_ratios, eager_hook.last_ratios, rtol=0, atol=0)
    for a, b in zip(kernel_params, eager_params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)


def test_hook_takes_three_launches_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[str] = []
    for name in ("_COPY_SQUARES", "_UPDATE_SQUARES_AND_RATIOS", "_RESCALE"):
        kernel = getattr(tr_kernels, name)

        def counted(*args: Any, _kernel: Any = kernel, _name: str = name) -> None:
            launched.append(_name)
            _kernel(*args)

        monkeypatch.setattr(tr_kernels, name, counted)
    hooked_adamw(True)
    assert launched == ["_COPY_SQUARES", "_UPDATE_SQUARES_AND_RATIOS", "_RESCALE"] * 2


def test_a_failing_kernel_warns_once_and_the_eager_hook_takes_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(tr_kernels, "_UPDATE_SQUARES_AND_RATIOS", broken)
    eager_params, eager_hook = hooked_adamw(False)
    try:
        with pytest.warns(RuntimeWarning, match="TrustRatio failed on this machine"):
            kernel_params, kernel_hook = hooked_adamw(True)
    finally:
        _fallback.reset()
    torch.testing.assert_close(kernel_hook.last_ratios, eager_hook.last_ratios, rtol=1e-6, atol=0)
    for a, b in zip(kernel_params, eager_params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def _moved(params: list[nn.Parameter]) -> None:
    params[1].data = params[1].data.clone()  # a new address, the same Parameter


def _reshaped(params: list[nn.Parameter]) -> None:
    params[1].data = params[1].data.view(8, 8)  # the same address and size, another shape


def _transposed(params: list[nn.Parameter]) -> None:
    params[0].data = params[0].data.t()  # the same address, other strides: the eager formula


def _to_double(params: list[nn.Parameter]) -> None:
    params[4].data = params[4].data.double()  # another dtype: a unit of its own


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(None, id="nothing"),
        pytest.param(_moved, id="data-moved"),
        pytest.param(_reshaped, id="reshaped-same-address"),
        pytest.param(_transposed, id="transposed-in-place"),
        pytest.param(_to_double, id="dtype-changed"),
    ],
)
def test_a_change_between_steps_is_seen_on_the_kernel_path(
    change: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever changes under the hook between two steps, the kernel path (its tables and the
    copies' offsets kept from the first step) gives the eager hook's numbers at the second."""

    def train(routed: bool) -> tuple[list[Tensor], Tensor]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)
        trust = normhooks.TrustRatio()
        trust.attach(optimizer)
        for step in range(2):
            if step == 1 and change is not None:
                change(params)
                # AdamW's moments keep the old shape and dtype: it starts afresh, the hook not.
                optimizer.state.clear()
            for param in params:
                param.grad = torch.randn_like(param)
            with _kernels.route_cpu_tensors() if routed else contextlib.nullcontext():
                optimizer.step()
        return [p.detach() for p in params], torch.cat(trust.last_ratios)

    launched: list[int] = []
    copy_squares = tr_kernels._COPY_SQUARES

    def counted(*args: Any) -> None:
        launched.append(1)
        copy_squares(*args)

    monkeypatch.setattr(tr_kernels, "_COPY_SQUARES", counted)
    got, got_ratios = train(routed=True)
    want, want_ratios = train(routed=False)
    # One copy launch per unit and step: a unit of its own for the float64 tensor; none for a
    # unit holding a transposed parameter (the eager formula).
    assert len(launched) == {_to_double: 3, _transposed: 1}.get(change, 2)
    torch.testing.assert_close(got_ratios, want_ratios, rtol=1e-6, atol=0)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("routed", [False, True], ids=["eager", "kernels"])
def test_the_cpu_copies_start_each_view_on_a_row_and_keep_the_padding_zero(routed: bool) -> None:
    """The CPU order reads the copies' buffer whole, as rows of one view each
    (``_step_hook.copies._Rows``): every view starts a row, and no step writes the padding,
    whether the copy and rescaling are the eager ops or the kernels (through the offsets)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in [(3,), (1025,), (70, 70), (2048,)]]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)
    trust = normhooks.TrustRatio()
    trust.attach(optimizer)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param)
        with _kernels.route_cpu_tensors() if routed else contextlib.nullcontext():
            optimizer.step()
    ((unit,),) = [plan.units for plan in trust._plans[optimizer]]
    copies = unit.copies
    flat = copies.buffer()
    padding = torch.ones(flat.numel(), dtype=torch.bool)
    for view in copies.views:
        start = view.storage_offset()
        assert start % 1024 == 0
        padding[start : start + view.numel()] = False
    assert int(padding.sum()) == 1021 + 1023 + (5 * 1024 - 4900) + 0
    assert torch.equal(flat[padding], torch.zeros(int(padding.sum())))
    want = torch.stack([view.double().norm() for view in copies.views])
    torch.testing.assert_close(copies.rows().norms().double(), want, rtol=6e-7, atol=0)
