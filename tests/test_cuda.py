"""Checks that need a GPU: no host sync, fused AMP, cuDNN RNNs, and every kernel case of
tests/kernel_cases.py on CUDA tensors. Skipped without CUDA, except the check that this file
runs every kernel case that the interpreter suite runs."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from helpers import assert_compiled_training_matches_eager, assert_grad_scaler_matches_unscaled
from normhooks import (
    GradientLARS,
    apply_weight_norm,
    apply_weight_standardization,
    convert_with_weight_normalization,
    data_dependent_init,
    lars_param_groups,
    standardize_weight,
    weight_norm,
)

NEEDS_CUDA = "needs a CUDA device"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
needs_memory = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 2**35,
    reason="needs a CUDA device with 32 GiB",
)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


@needs_cuda
def test_lars_hook_never_syncs_with_host() -> None:
    model = cnn().cuda()
    optimizer = torch.optim.SGD(lars_param_groups(model), lr=0.1, momentum=0.9)
    GradientLARS(weight_decay=1e-4, clip=True).attach(optimizer)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    model(x).square().mean().backward()
    optimizer.step()  # state creation outside the checked region
    model(x).square().mean().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_lars_cuda_matches_cpu_in_float64() -> None:
    cpu = cnn().double()
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    for model, data in ((cpu, x), (gpu, x.cuda())):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        GradientLARS(weight_decay=1e-3).attach(optimizer)
        for _ in range(3):
            optimizer.zero_grad()
            model(data).square().mean().backward()
            optimizer.step()
    for a, b in zip(cpu.parameters(), gpu.parameters(), strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-9, atol=1e-12)


@needs_cuda
@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    ],
    ids=["sgd", "adamw"],
)
def test_fused_optimizer_under_grad_scaler_gives_unscaled_result(
    make: Callable[[Any], torch.optim.Optimizer],
) -> None:
    def hooked(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = make(model.parameters())
        GradientLARS(weight_decay=1e-3).attach(optimizer)
        return optimizer

    x = torch.randn(8, 3, 16, 16, device="cuda")
    assert_grad_scaler_matches_unscaled(cnn().cuda(), x, hooked, hooked, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_ws_and_wn_match_cpu() -> None:
    cpu = apply_weight_standardization(cnn())
    weight_norm(cpu[8], "weight")
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    data_dependent_init(cpu, x)
    data_dependent_init(gpu, x.cuda())
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("convert", [apply_weight_norm, apply_weight_standardization])
def test_fused_training_matches_cpu_in_float64(convert: Callable[[nn.Module], nn.Module]) -> None:
    cpu = convert(cnn().double())
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    for model, data in ((cpu, x), (gpu, x.cuda())):
        model(data).square().sum().backward()
    for on_cpu, on_gpu in zip(cpu.parameters(), gpu.parameters(), strict=True):
        assert on_cpu.grad is not None
        assert on_gpu.grad is not None
        torch.testing.assert_close(on_gpu.grad.cpu(), on_cpu.grad, rtol=1e-10, atol=1e-12)


@needs_cuda
def test_a_fused_weight_read_on_another_stream_is_computed_there() -> None:
    class SideStream(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Conv2d(3, 8, 3)
            self.second = nn.Conv2d(8, 4, 3)
            self.stream = torch.cuda.Stream()

        def forward(self, x: Tensor) -> Tensor:
            y = self.first(x)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                z = self.second(y)
            torch.cuda.current_stream().wait_stream(self.stream)
            return z

    cpu = apply_weight_norm(SideStream().double())
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-10, atol=1e-12)


@needs_cuda
def test_a_fused_train_step_never_syncs_with_host() -> None:
    model = apply_weight_norm(cnn()).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    for _ in range(2):  # tables, plans and optimizer state outside the checked step
        model(x).square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).square().mean().backward()
        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("rnn_type", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_cudnn_rnn_with_weight_norm(rnn_type: type[nn.RNNBase]) -> None:
    torch.manual_seed(0)
    cpu = convert_with_weight_normalization(rnn_type, 8, 16, num_layers=2, bidirectional=True)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(5, 3, 8)
    optimizer = torch.optim.SGD(gpu.parameters(), lr=0.1)
    cpu_optimizer = torch.optim.SGD(cpu.parameters(), lr=0.1)
    # cuDNN's RNNs use TF32 by default, which differs from the CPU's float32 by about 1e-3.
    with warnings.catch_warnings(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        warnings.simplefilter("error")
        for _ in range(3):
            for model, opt, data in ((gpu, optimizer, x.cuda()), (cpu, cpu_optimizer, x)):
                opt.zero_grad()
                model(data)[0].square().sum().backward()
                opt.step()
        gpu.flatten_parameters()
        gpu.eval()
        cpu.eval()
        with torch.no_grad():
            torch.testing.assert_close(gpu(x.cuda())[0].cpu(), cpu(x)[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(gpu(x.cuda())[0].cpu(), cpu(x)[0], rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize(
    ("shape", "dim", "groups"),
    [((8, 3, 3, 3), 0, 1), ((4, 6, 3), 1, 1), ((6, 2, 3, 3), 1, 3), ((5, 7), 0, 1)],
    ids=["conv", "transposed", "grouped-transposed", "linear"],
)
def test_standardization_on_gpu_matches_cpu_in_float64(
    shape: tuple[int, ...], dim: int, groups: int
) -> None:
    weight = torch.randn(shape, dtype=torch.float64)
    weight[0] = 1.5  # a constant slice
    gain = torch.rand(shape[dim] * groups, dtype=torch.float64) + 0.5
    upstream = torch.randn(shape, dtype=torch.float64)
    results = []
    for device in ("cpu", "cuda"):
        w = weight.to(device, copy=True).requires_grad_()
        g = gain.to(device, copy=True).requires_grad_()
        out = standardize_weight(w, dim, groups=groups, gain=g)
        out.backward(upstream.to(device))
        assert w.grad is not None
        assert g.grad is not None
        results.append((out.detach().cpu(), w.grad.cpu(), g.grad.cpu()))
    for on_gpu, on_cpu in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-12, atol=1e-12)


@needs_cuda
@pytest.mark.parametrize("eps", [1e-12, 0.5, 0.0], ids=["default", "big-eps", "no-eps"])
def test_weight_norm_on_gpu_matches_cpu_in_float64(eps: float) -> None:
    torch.manual_seed(0)
    cpu = weight_norm(nn.Embedding(6, 4, padding_idx=2, dtype=torch.float64), eps=eps)
    gpu = copy.deepcopy(cpu).cuda()
    index = torch.tensor([[0, 2, 5], [2, 1, 3]])
    for model, data in ((cpu, index), (gpu, index.cuda())):
        model(data).square().sum().backward()
    assert not gpu.weight.isnan().any()
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight, rtol=1e-12, atol=1e-12)
    for on_cpu, on_gpu in zip(cpu.parameters(), gpu.parameters(), strict=True):
        assert on_cpu.grad is not None
        assert on_gpu.grad is not None
        torch.testing.assert_close(on_gpu.grad.cpu(), on_cpu.grad, rtol=1e-12, atol=1e-12)


@needs_cuda
def test_inductor_compiled_step_matches_eager() -> None:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(lars_param_groups(model), lr=0.1, momentum=0.9)
        GradientLARS(weight_decay=1e-4).attach(optimizer)
        return optimizer

    model = apply_weight_standardization(cnn()).cuda()
    x = torch.randn(8, 3, 16, 16, device="cuda")
    assert_compiled_training_matches_eager(model, x, make, backend="inductor", rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The Triton kernels on the GPU: every case of the interpreter suite, then sizes that cross the
# real chunk size (32768 values), against the float64 formulas of tests/kernel_cases.py.

if importlib.util.find_spec("triton") is not None:
    # Without Triton the library never launches a kernel (its dispatch requires Triton), so
    # neither suite has a kernel to test.
    from kernel_cases import (
        KernelCases,
        assert_lars_result,
        gain_shape,
        lars_reference,
        wn_reference,
        ws_layout,
        ws_reference,
    )
    from kernel_cases import weight_norm as fused_weight_norm
    from normhooks._kernels import _multi
    from normhooks._kernels import weight_norm as wn_kernels
    from normhooks._kernels.lars import lars_unit_
    from normhooks._kernels.weight_standardization import standardize_rows

    @needs_cuda
    class TestKernelsOnCUDA(KernelCases):
        @pytest.fixture
        def device(self) -> str:
            return "cuda"

        @pytest.mark.parametrize(
            "dtype", [torch.float32, torch.float64], ids=["float32", "float64"]
        )
        def test_lars_kernel_at_real_chunk_sizes(self, dtype: torch.dtype) -> None:
            shapes = [(3, 4), (32768,), (70000,), (0,), (64, 3, 3, 3), (1,)]
            params = [torch.randn(s, dtype=dtype) for s in shapes]
            grads = [torch.randn(s, dtype=dtype) * 512 for s in shapes]
            expected_rates, expected = lars_reference(
                params, grads, weight_decay=1e-2, clip=True, lr=0.5, grad_scale=512.0
            )
            cuda_grads = [g.cuda() for g in grads]
            found_inf = torch.zeros(1, device="cuda")
            rates = lars_unit_(
                [p.cuda() for p in params],
                cuda_grads,
                threshold=1e-2,
                weight_decay=1e-2,
                eps=1e-9,
                trust_coefficient=1.0,
                lr=torch.tensor(0.5, device="cuda"),
                clip=True,
                grad_scale=torch.tensor(512.0, device="cuda"),
                found_inf=found_inf,
            )
            torch.testing.assert_close(rates.cpu(), expected_rates.to(dtype))
            for grad, want in zip(cuda_grads, expected, strict=True):
                torch.testing.assert_close(grad.cpu(), want.to(dtype))
            assert found_inf.item() == 0.0

        def test_lars_kernel_never_syncs_with_host(self) -> None:
            params = [torch.randn(s, device="cuda") for s in [(64, 3, 3, 3), (70000,), (10,)]]
            grads = [torch.randn_like(p) for p in params]
            settings: dict[str, Any] = {
                "threshold": 1e-2,
                "weight_decay": 1e-4,
                "eps": 1e-9,
                "trust_coefficient": 1.0,
                "lr": torch.tensor(0.1, device="cuda"),
                "clip": True,
                "grad_scale": torch.tensor(1024.0, device="cuda"),
                "found_inf": torch.zeros(1, device="cuda"),
            }
            lars_unit_(params, grads, **settings)  # compiles and builds the table
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                lars_unit_(params, grads, **settings)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        def test_lars_table_dropped_while_another_stream_still_reads_it(
            self, monkeypatch: pytest.MonkeyPatch
        ) -> None:
            """A table built on one stream, last used on another, then dropped from the cache:
            its memory must not serve the first stream before the second is done with it."""
            monkeypatch.setattr(_multi, "_tables", type(_multi._tables)(1))
            settings: dict[str, Any] = {
                "threshold": 1e-2,
                "weight_decay": 1e-3,
                "eps": 1e-9,
                "trust_coefficient": 1.0,
                "lr": None,
                "clip": False,
                "grad_scale": None,
                "found_inf": None,
            }
            params = [torch.randn(70000), torch.randn(3, 5)]
            grads = [torch.randn(70000), torch.randn(3, 5)]
            _, once = lars_reference(params, grads, weight_decay=1e-3)
            _, twice = lars_reference(params, once, weight_decay=1e-3)
            on_gpu = [p.cuda() for p in params]
            grads_on_gpu = [g.cuda() for g in grads]
            builder, user = torch.cuda.Stream(), torch.cuda.Stream()
            builder.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(builder):
                lars_unit_(on_gpu, grads_on_gpu, **settings)  # builds the table here
            user.wait_stream(builder)
            with torch.cuda.stream(user):
                torch.cuda._sleep(200_000_000)  # the launches below wait behind this
                lars_unit_(on_gpu, grads_on_gpu, **settings)
            with torch.cuda.stream(builder):
                other = [torch.randn(10, device="cuda")]
                lars_unit_(other, [torch.randn(10, device="cuda")], **settings)  # drops it
                # Small blocks of the builder's stream, zeroed: the dropped table's among
                # them unless the user's stream still holds it.
                taken = [torch.zeros(64, dtype=torch.int64, device="cuda") for _ in range(512)]
            torch.cuda.synchronize()
            del taken
            for grad, want in zip(grads_on_gpu, twice, strict=True):
                torch.testing.assert_close(grad.cpu(), want.float())

        @staticmethod
        def clip_settings(lr: float | Tensor) -> dict[str, Any]:
            return {
                "threshold": 1e-2,
                "weight_decay": 1e-3,
                "eps": 1e-9,
                "trust_coefficient": 1e-3,
                "lr": lr,
                "clip": True,
                "grad_scale": None,
                "found_inf": None,
            }

        def test_lars_kernel_in_a_cuda_graph_follows_a_tensor_lr(self) -> None:
            params = [torch.randn(70000, device="cuda"), torch.randn(64, 3, 3, 3, device="cuda")]
            sources = [torch.randn_like(p) for p in params]
            grads = [torch.empty_like(p) for p in params]
            lr = torch.tensor(1.0, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles and builds the table before capturing
                for grad, source in zip(grads, sources, strict=True):
                    grad.copy_(source)
                lars_unit_(params, grads, **self.clip_settings(lr))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for grad, source in zip(grads, sources, strict=True):
                    grad.copy_(source)
                rates = lars_unit_(params, grads, **self.clip_settings(lr))
            # Each replay reads the lr of its time: rates near 1e-3 and 0.1, then all clipped.
            for value in (1.0, 1e-2, 1e-4):
                lr.fill_(value)
                graph.replay()
                expected_rates, expected = lars_reference(
                    params,
                    sources,
                    weight_decay=1e-3,
                    trust_coefficient=1e-3,
                    lr=value,
                    clip=True,
                )
                assert_lars_result(rates, grads, expected_rates, expected)

        def test_lars_kernel_refuses_tensors_first_seen_inside_a_capture(self) -> None:
            params = [torch.randn(100, device="cuda")]
            grads = [torch.randn(100, device="cuda")]
            before = grads[0].clone()
            settings = self.clip_settings(torch.tensor(0.1, device="cuda"))
            graph = torch.cuda.CUDAGraph()
            with (
                pytest.raises(RuntimeError, match="before capturing"),
                torch.cuda.graph(graph),
            ):
                lars_unit_(params, grads, **settings)
            assert torch.equal(grads[0], before)

        def test_lars_kernel_refuses_a_float_lr_to_clip_by_inside_a_capture(self) -> None:
            params = [torch.randn(100, device="cuda")]
            grads = [torch.randn(100, device="cuda")]
            lars_unit_(params, grads, **self.clip_settings(0.1))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with (
                pytest.raises(TypeError, match="float lr would be fixed"),
                torch.cuda.graph(graph),
            ):
                lars_unit_(params, grads, **self.clip_settings(0.1))

        def test_trust_ratio_refuses_parameters_first_seen_inside_a_capture(self) -> None:
            from normhooks._step_hook.copies import _Copies

            copies = _Copies([torch.randn(100, device="cuda"), torch.randn(3, 4, device="cuda")])
            graph = torch.cuda.CUDAGraph()
            with (
                pytest.raises(RuntimeError, match="before capturing"),
                torch.cuda.graph(graph),
            ):
                copies.offsets()
            # Made outside a capture, the offsets are kept for every later step.
            offsets, total = copies.offsets()
            assert offsets.tolist() == [0, 100]
            assert total == 112

        @pytest.mark.parametrize(
            "dtype", [torch.float32, torch.float64], ids=["float32", "float64"]
        )
        @pytest.mark.parametrize(
            ("shape", "dim"), [((64, 32, 3, 3), 0), ((32, 64, 3, 3), 1), ((20, 30), 1)]
        )
        @pytest.mark.parametrize("eps", [0.0, 1e-3], ids=["eps0", "eps1e-3"])
        def test_weight_norm_kernel_at_real_sizes(
            self, shape: tuple[int, ...], dim: int, eps: float, dtype: torch.dtype
        ) -> None:
            v = torch.randn(shape, dtype=torch.float64)
            v.select(dim, 1).zero_()
            g = torch.rand(gain_shape(v, dim), dtype=torch.float64) + 0.5
            upstream = torch.randn(shape, dtype=torch.float64)
            exact = [t.clone().requires_grad_() for t in (g, v)]
            want = wn_reference(*exact, dim, eps)
            wanted = torch.autograd.grad(want, exact, upstream)
            ours = [t.to("cuda", dtype).requires_grad_() for t in (g, v)]
            out = fused_weight_norm(*ours, dim, eps)
            grads = torch.autograd.grad(out, ours, upstream.to("cuda", dtype))
            torch.testing.assert_close(out.cpu(), want.to(dtype))
            for got, expected in zip(grads, wanted, strict=True):
                torch.testing.assert_close(got.cpu(), expected.to(dtype))

        @pytest.mark.parametrize(
            "dtype", [torch.float32, torch.float64], ids=["float32", "float64"]
        )
        @pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
        def test_standardize_rows_kernel_at_real_sizes(
            self, transposed: bool, dtype: torch.dtype
        ) -> None:
            rows = torch.randn(64, 1200, dtype=torch.float64) * 3 + 1
            gain = torch.randn(64, dtype=torch.float64)
            upstream = torch.randn(64, 1200, dtype=torch.float64)
            exact = [rows.clone().requires_grad_(), gain.clone().requires_grad_()]
            want = ws_reference(*exact)
            wanted = torch.autograd.grad(want, exact, upstream)
            on_gpu = rows.to("cuda", dtype)
            if transposed:
                on_gpu = on_gpu.t().contiguous().t()
            ours = [on_gpu.requires_grad_(), gain.to("cuda", dtype).requires_grad_()]
            out = standardize_rows(ours[0], 1e-5, ours[1])
            grads = torch.autograd.grad(out, ours, upstream.to("cuda", dtype))
            torch.testing.assert_close(out.cpu(), want.to(dtype))
            for got, expected in zip(grads, wanted, strict=True):
                torch.testing.assert_close(got.cpu(), expected.to(dtype))

        @pytest.mark.parametrize(
            ("dtype", "tolerance"),
            [(torch.float32, 1e-5), (torch.float64, 1e-12)],
            ids=["float32", "float64"],
        )
        @pytest.mark.parametrize(
            ("shape", "dim"), [((2, 2**20), 0), ((3, 4, 2**16), 1)], ids=["rows", "dim1"]
        )
        def test_weight_norm_kernel_splits_long_rows(
            self, shape: tuple[int, ...], dim: int, dtype: torch.dtype, tolerance: float
        ) -> None:
            v = torch.randn(shape, dtype=dtype).double()
            assert wn_kernels._layout(v, dim).plan.splits > 1
            g = (torch.rand(gain_shape(v, dim), dtype=dtype) + 0.5).double()
            upstream = torch.randn(shape, dtype=dtype).double()
            exact = [t.clone().requires_grad_() for t in (g, v)]
            want = wn_reference(*exact, dim, 1e-3)
            wanted = torch.autograd.grad(want, exact, upstream)
            ours = [t.to("cuda", dtype).requires_grad_() for t in (g, v)]
            out = fused_weight_norm(*ours, dim, 1e-3)
            grads = torch.autograd.grad(out, ours, upstream.to("cuda", dtype))
            close = {"rtol": tolerance, "atol": tolerance}
            torch.testing.assert_close(out.cpu(), want.to(dtype), **close)
            for got, expected in zip(grads, wanted, strict=True):
                torch.testing.assert_close(got.cpu(), expected.to(dtype), **close)

        @pytest.mark.parametrize(
            ("dtype", "tolerance"),
            [(torch.float32, 1e-5), (torch.float64, 1e-12)],
            ids=["float32", "float64"],
        )
        @pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
        def test_standardize_rows_kernel_splits_long_rows(
            self, transposed: bool, dtype: torch.dtype, tolerance: float
        ) -> None:
            rows = torch.randn(4, 2**18, dtype=torch.float64) * 3 + 1
            rows[3] = rows[3] * 0.03 + 10  # a mean large against the spread
            # Values of the kernel's dtype, so the reference starts from the same numbers.
            rows = rows.to(dtype).double()
            gain = torch.randn(4, dtype=dtype).double()
            upstream = torch.randn(4, 2**18, dtype=dtype).double()
            exact = [rows.clone().requires_grad_(), gain.clone().requires_grad_()]
            want = ws_reference(*exact)
            wanted = torch.autograd.grad(want, exact, upstream)
            on_gpu = rows.to("cuda", dtype)
            if transposed:
                on_gpu = on_gpu.t().contiguous().t()
            assert ws_layout(on_gpu).splits > 1
            ours = [on_gpu.requires_grad_(), gain.to("cuda", dtype).requires_grad_()]
            out = standardize_rows(ours[0], 1e-5, ours[1])
            grads = torch.autograd.grad(out, ours, upstream.to("cuda", dtype))
            close = {"rtol": tolerance, "atol": tolerance}
            torch.testing.assert_close(out.cpu(), want.to(dtype), **close)
            for got, expected in zip(grads, wanted, strict=True):
                torch.testing.assert_close(got.cpu(), expected.to(dtype), **close)

        # Tensors of 2**31 values, where 32-bit offsets wrap: float16, up to 17 GB each.

        @needs_memory
        def test_weight_norm_kernel_past_2_31_values(self) -> None:
            v = torch.randn(2, 2**30, device="cuda", dtype=torch.float16)
            plan = wn_kernels._layout(v, 0).plan
            assert plan.wide
            assert plan.splits > 1
            g = torch.tensor([[1024.0], [4096.0]], device="cuda", dtype=torch.float16)
            upstream = torch.randn_like(v)
            g.requires_grad_()
            v.requires_grad_()
            out = fused_weight_norm(g, v, 0, 0.0)
            grad_g, grad_v = torch.autograd.grad(out, (g, v), upstream)
            v = v.detach()
            norms = row_sums(lambda x: x * x, v).sqrt()
            dots = row_sums(lambda x, u: x * u, v, upstream)
            # The last values: in 32 bits their offsets pass 2**31.
            tail = slice(2**30 - 4096, None)
            w, incoming = v[:, tail].float(), upstream[:, tail].float()
            scale = g.detach().float() / norms[:, None]
            want_v = scale * incoming - (scale * dots[:, None] / norms[:, None] ** 2) * w
            torch.testing.assert_close(out[:, tail], (scale * w).half())
            torch.testing.assert_close(grad_v[:, tail], want_v.half())
            torch.testing.assert_close(grad_g, (dots / norms)[:, None].half())

        @needs_memory
        def test_standardize_rows_kernel_past_2_31_values(self) -> None:
            rows = torch.randn(2, 2**30, device="cuda", dtype=torch.float16)
            assert ws_layout(rows).wide
            upstream = torch.randn_like(rows)
            rows.requires_grad_()
            out = standardize_rows(rows, 1e-5)
            (grad,) = torch.autograd.grad(out, rows, upstream)
            rows = rows.detach()
            means = row_sums(lambda x: x, rows) / 2**30
            rstds = (row_sums(lambda x: (x - means[:, None]) ** 2, rows) / 2**30 + 1e-5).rsqrt()

            def normalized(x: Tensor) -> Tensor:
                return (x - means[:, None]) * rstds[:, None]

            incoming_mean = row_sums(lambda u: u, upstream) / 2**30
            product_mean = row_sums(lambda x, u: normalized(x) * u, rows, upstream) / 2**30
            tail = slice(2**30 - 4096, None)
            x, incoming = normalized(rows[:, tail].float()), upstream[:, tail].float()
            want = rstds[:, None] * (incoming - incoming_mean[:, None] - x * product_mean[:, None])
            torch.testing.assert_close(out[:, tail], x.half())
            torch.testing.assert_close(grad[:, tail], want.half())

        @needs_memory
        def test_lars_kernel_past_2_31_values(self) -> None:
            params = [torch.randn(2**31, device="cuda", dtype=torch.float16)]
            grads = [torch.randn(2**31, device="cuda", dtype=torch.float16)]
            tail = grads[0][-4096:].float()
            w_norm = row_sums(lambda w: w * w, params[0].view(1, -1)).sqrt()
            g_norm = row_sums(lambda g: g * g, grads[0].view(1, -1)).sqrt()
            settings = self.clip_settings(None) | {"weight_decay": 0.0, "clip": False}
            rates = lars_unit_(params, grads, **settings)
            want = w_norm / (g_norm + 1e-9) * 1e-3
            torch.testing.assert_close(rates, want, rtol=1e-5, atol=0)
            torch.testing.assert_close(grads[0][-4096:], (want * tail).half())


def row_sums(fn: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """Sums over each row of ``fn`` of float32 copies of ``tensors`` (2-D, one shape), a block
    of columns at a time, so that no float32 copy of a whole tensor is made."""
    blocks = zip(*(t.split(2**26, dim=1) for t in tensors), strict=True)
    return torch.stack([fn(*(b.float() for b in block)).sum(1) for block in blocks]).sum(0)


# --------------------------------------------------------------------------------------------
# That this file runs every kernel case: checked on any machine, from what pytest collects.

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_GATE = "runs the kernels on CPU tensors through Triton's interpreter"
# The tests of tests/test_kernels.py outside KernelCases, and why none has a CUDA counterpart.
NO_CUDA_COUNTERPART = {
    "test_kernels_are_not_available_for_cpu_tensors": "launches no kernel",
    "test_importing_normhooks_leaves_triton_unimported": "launches no kernel",
    "test_kernels_compile_for_sm90": "compiles, launches nothing",
    "test_lars_table_cache_is_safe_across_threads": "launches no kernel",
    "test_lars_reads_each_partial_sum_once": "counts loads through the interpreter's hooks",
    "test_row_plan_splits_few_long_rows_across_programs": "launches no kernel",
    "test_row_plan_keeps_rows_whole_when_programs_or_lengths_suffice": "launches no kernel",
    "test_weight_norm_is_64_bit_for_tensors_past_int32": "launches no kernel",
    "test_standardization_is_64_bit_for_tensors_past_int32": "launches no kernel",
    "test_standardization_is_64_bit_where_strides_reach_past_int32": "launches no kernel",
}

COLLECT = """
import json, sys
import pytest

class Record:
    def pytest_collection_finish(self, session):
        items = []
        for item in session.items:
            skips = [
                mark.kwargs.get("reason", "")
                for mark in item.iter_markers()
                if mark.name in ("skip", "xfail")
                or (mark.name == "skipif" and any(bool(arg) for arg in mark.args))
            ]
            items.append({"id": item.nodeid, "class": item.cls and item.cls.__name__,
                          "skips": skips})
        with open(sys.argv[1], "w") as file:
            json.dump(items, file)

code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[2:]],
                   plugins=[Record()])
sys.exit(int(code))
"""


def collected(path: Path) -> list[dict[str, Any]]:
    """What pytest collects from test_kernels.py and this file, as on a machine without CUDA
    (the interpreter on): collection does not depend on the machine, only skips do, and those
    are read from the marks."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    files = ["tests/test_kernels.py", "tests/test_cuda.py"]
    result = subprocess.run(
        [sys.executable, "-c", COLLECT, str(path), *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    items: list[dict[str, Any]] = json.loads(path.read_text())
    return items


def test_every_interpreter_kernel_case_runs_on_cuda(tmp_path: Path) -> None:
    """test_cuda.py must run, where CUDA exists, every kernel test that the interpreter suite
    has: same name, same parameters, and no skip but the missing GPU."""
    pytest.importorskip("triton", reason="without Triton no kernel runs anywhere")
    items = collected(tmp_path / "items.json")
    interpreter, on_cuda, strays = {}, {}, []
    for item in items:
        path, _, name = item["id"].partition("::")
        if path == "tests/test_kernels.py" and item["class"] == "TestOnInterpreter":
            interpreter[name.partition("::")[2]] = item
        elif path == "tests/test_kernels.py" and name.split("[")[0] not in NO_CUDA_COUNTERPART:
            strays.append(item["id"])
        elif path == "tests/test_cuda.py" and item["class"] == "TestKernelsOnCUDA":
            on_cuda[name.partition("::")[2]] = item
    assert not strays, (
        "kernel tests outside KernelCases have no CUDA counterpart; move them into "
        "tests/kernel_cases.py (or, if they cannot run on CUDA, into NO_CUDA_COUNTERPART "
        f"with the reason): {strays}"
    )
    assert interpreter, "the interpreter suite collected no kernel case"
    missing = sorted(set(interpreter) - set(on_cuda))
    assert not missing, f"test_cuda.py lacks these kernel cases: {missing}"
    for name in interpreter:
        assert set(interpreter[name]["skips"]) <= {INTERPRETER_GATE}, (name, interpreter[name])
        assert set(on_cuda[name]["skips"]) <= {NEEDS_CUDA}, (name, on_cuda[name])
