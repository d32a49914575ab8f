"""The CPU proxy of GPU host time: the dispatch switch, the no-op Triton driver, the benchmark.

``_kernels.route_cpu_tensors()`` sends plain CPU tensors to the kernels; ``benchmarks/_proxy.py``
adds a Triton driver that compiles for sm_90 and launches nothing; ``benchmarks/host.py``
times normhooks' CUDA path with both, and ``benchmarks/gpu.py --smoke`` runs the GPU suite's
code on the CPU through them. The switch is tested here in the suite's process; the proxy in
child processes, since Triton decides at import whether a kernel is interpreted and
conftest turns the interpreter on without a GPU.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from normhooks import _kernels

pytest.importorskip("triton", reason="the fused kernels need Triton")
pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(BENCHMARKS)])
    return env


# ---------------------------------------------------------------------------------------------
# The switch


def test_cpu_tensors_go_to_the_kernels_only_inside_the_switch() -> None:
    cpu = torch.ones(3)
    before = _kernels.available(cpu)
    with _kernels.route_cpu_tensors():
        inside = _kernels.available(cpu)
    assert (before, inside, _kernels.available(cpu)) == (False, True, False)


def test_the_switch_is_off_again_after_an_exception() -> None:
    with pytest.raises(ZeroDivisionError), _kernels.route_cpu_tensors():
        1 / 0  # noqa: B018
    assert not _kernels.available(torch.ones(3))


def test_a_nested_switch_leaves_the_outer_one_on() -> None:
    with _kernels.route_cpu_tensors():
        with _kernels.route_cpu_tensors():
            pass
        assert _kernels.available(torch.ones(3))
    assert not _kernels.available(torch.ones(3))


class _Subclass(torch.Tensor):
    pass


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        return func(*args, **(kwargs or {}))


def _under_vmap() -> bool:
    seen = []

    def record(t: torch.Tensor) -> torch.Tensor:
        seen.append(_kernels.available(t))
        return t

    torch.func.vmap(record)(torch.ones(2, 3))
    return seen[0]


def _under_mode() -> bool:
    with _Mode():
        return _kernels.available(torch.ones(3))


@pytest.mark.parametrize(
    "available",
    [
        pytest.param(
            lambda: _kernels.available(torch.ones(3).as_subclass(_Subclass)), id="subclass"
        ),
        pytest.param(_under_vmap, id="torch.func"),
        pytest.param(_under_mode, id="dispatch-mode"),
        pytest.param(lambda: _kernels.available(torch.ones(3, device="meta")), id="meta"),
    ],
)
def test_the_switch_routes_only_plain_eager_cpu_tensors(available: Callable[[], bool]) -> None:
    with _kernels.route_cpu_tensors():
        assert not available()


# ---------------------------------------------------------------------------------------------
# The proxy, in a child process with Triton's interpreter off

PROXY_RUN = """
import json, os
import _proxy
_proxy.interpreter_off()
import torch
from torch import nn
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from _counts import count
from normhooks import GradientLARS, _kernels, apply_weight_standardization, weight_norm

before = driver._active
torch.manual_seed(0)
wn = weight_norm(nn.Linear(4, 3))
ws = apply_weight_standardization(nn.Sequential(nn.Conv2d(2, 3, 3)))
lars = nn.Linear(4, 3)
optimizer = torch.optim.SGD(lars.parameters(), lr=0.1)
GradientLARS().attach(optimizer)
result = {}
with _proxy.cuda_path_on_cpu() as proxy:
    result["driver_installed"] = driver.active is proxy
    result["target"] = repr(driver.active.get_current_target())
    result["routed"] = _kernels.available(torch.ones(1))

    def launches():
        return sum(proxy.launches.values())

    first = launches()
    wn(torch.randn(2, 4)).sum().backward()
    result["wn"] = launches() - first
    first = launches()
    ws(torch.randn(1, 2, 5, 5)).sum().backward()
    result["ws"] = launches() - first
    lars(torch.randn(2, 4)).sum().backward()
    first = launches()
    optimizer.step()
    result["lars"] = launches() - first
    counts = count(lambda: wn(torch.randn(2, 4)).sum(), launches)
    result["counted_launches"] = counts.launches
    result["counted_allocations"] = counts.allocations
    compiled = {
        name
        for module in _proxy.kernel_modules()
        for name, value in vars(module).items()
        if isinstance(value, JITFunction)
    }
    result["launched"] = sorted(proxy.launches)
    result["not_normhooks_kernels"] = sorted(set(proxy.launches) - compiled)
result["driver_restored"] = driver._active is before
result["routing_restored"] = not _kernels.available(torch.ones(1))
result["interpreter_env"] = os.environ.get("TRITON_INTERPRET")
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def proxy_run() -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", PROXY_RUN],
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    facts: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return facts


def test_the_proxy_installs_an_sm90_driver(proxy_run: dict[str, object]) -> None:
    assert proxy_run["driver_installed"] is True
    assert proxy_run["target"] == "GPUTarget(backend='cuda', arch=90, warp_size=32)"


def test_the_proxy_routes_cpu_tensors(proxy_run: dict[str, object]) -> None:
    assert proxy_run["routed"] is True


@pytest.mark.parametrize(
    ("technique", "launches"),
    [("wn", 2), ("ws", 2), ("lars", 2)],
    ids=["weight-norm-forward-backward", "weight-standardization-forward-backward", "lars-step"],
)
def test_each_kernel_launch_is_counted(
    proxy_run: dict[str, object], technique: str, launches: int
) -> None:
    assert proxy_run[technique] == launches


def test_the_launches_are_normhooks_compiled_kernels(proxy_run: dict[str, object]) -> None:
    assert proxy_run["launched"]
    assert proxy_run["not_normhooks_kernels"] == []


def test_the_op_counter_keeps_the_kernel_path(proxy_run: dict[str, object]) -> None:
    # A dispatch mode would send the layer to the plain formula: no launch, no allocation.
    assert (proxy_run["counted_launches"], proxy_run["counted_allocations"]) == (2, 3)


def test_the_proxy_restores_triton_and_the_routing(proxy_run: dict[str, object]) -> None:
    assert (proxy_run["driver_restored"], proxy_run["routing_restored"]) == (True, True)


def test_the_proxy_runs_without_the_interpreter(proxy_run: dict[str, object]) -> None:
    assert proxy_run["interpreter_env"] is None


def test_the_proxy_refuses_interpreted_kernels() -> None:
    code = (
        "import _proxy\n"
        "from normhooks._kernels import weight_norm\n"
        "with _proxy.cuda_path_on_cpu():\n"
        "    pass\n"
    )
    env = {**child_env(), "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "imported with TRITON_INTERPRET=1" in result.stderr


@pytest.fixture(scope="module")
def smoke_run() -> subprocess.CompletedProcess[str]:
    """``gpu.py --smoke``: every section of the GPU suite on tiny CPU models, the kernels under
    the proxy, ``host.py --smoke`` as its section 4, the compiled one with dynamo alone."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), "--smoke"],
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def section(output: str, number: int) -> str:
    """The text of section ``number`` of a gpu.py run."""
    start = output.index(f"\n== {number}.")
    end = output.find("\n== ", start + 1)
    return output[start : end if end >= 0 else len(output)]


def test_the_gpu_benchmark_and_the_host_proxy_run_on_the_cpu(
    smoke_run: subprocess.CompletedProcess[str],
) -> None:
    assert smoke_run.returncode == 0, smoke_run.stdout[-4000:] + smoke_run.stderr
    rows = (
        "normhooks kernel (exact, eps)",  # 1. kernels alone
        "normhooks kernel (2 launches)",  # 2. gradient hooks
        "multiply-by-1 parametrization (floor)",  # 3. eager models
        "normhooks apply_weight_norm (fused)",  # 4. host.py
        "compiled normhooks weight standardization",  # 5. torch.compile
    )
    assert [row for row in rows if row not in smoke_run.stdout] == []


HOOK_ROWS = [
    "SGD alone",
    "SGD alone, again (noise)",
    "SGD + an empty step pre-hook (floor)",
    "SGD + pre-hook launching 2 empty kernels (floor)",
    "SGD + normhooks GradientLARS",
    "SGD + LARS by hand (per-tensor loop)",
    "SGD + normhooks AdaptiveGradientClipping",
    "SGD + AGC by hand (per-tensor loop)",
    "SGD + normhooks GradientCentralization",
    "SGD + GC by hand (per-tensor loop)",
    "AdamW alone",
    "AdamW + empty step pre- and post-hooks (floor)",
    "AdamW + hooks launching 1 empty kernel each (floor)",
    "AdamW + normhooks TrustRatio",
    "AdamW + trust ratio by hand (per-tensor loop)",
]
# How each peer's rows begin: an optimizer's name ends in "(foreach)" or "(per tensor)", by
# whether the installed version has a foreach mode.
PEER_ROWS = {
    "pytorch_optimizer": [
        "pytorch-optimizer LARS (",
        "SGD + pytorch-optimizer agc (per tensor)",
        "SGD + pytorch-optimizer centralize_gradient (stacked per shape)",
        "pytorch-optimizer Lamb (",
    ],
    "timm": ["timm Lars (", "SGD + timm adaptive_clip_grad", "timm Lamb ("],
}
# gpu.py's hooks section and host.py's (run as gpu.py's section 4).
HOOK_SECTIONS = {"gpu": 2, "host": 4}


def timed_rows(text: str) -> list[str]:
    """The names of the rows of ``text`` that carry a time."""
    return [m.group(1) for m in re.finditer(r"^ +(\S.*?) +[\d.]+ ms ", text, re.MULTILINE)]


@pytest.mark.parametrize("where", HOOK_SECTIONS)
@pytest.mark.parametrize("row", HOOK_ROWS)
def test_every_hook_row_is_timed_on_both_shape_sets(
    smoke_run: subprocess.CompletedProcess[str], where: str, row: str
) -> None:
    text = section(smoke_run.stdout, HOOK_SECTIONS[where])
    # ResNet-50 and ViT-B/16 in gpu.py; host.py adds 1,200 small tensors.
    assert timed_rows(text).count(row) >= 2


@functools.cache
def _importable(module: str) -> bool:
    code = f"import {module}"
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True)
    return result.returncode == 0


@pytest.mark.parametrize("where", HOOK_SECTIONS)
@pytest.mark.parametrize("peer", PEER_ROWS)
def test_each_peer_is_timed_where_it_imports_and_said_left_out_where_not(
    smoke_run: subprocess.CompletedProcess[str], where: str, peer: str
) -> None:
    text = section(smoke_run.stdout, HOOK_SECTIONS[where])
    timed = {row: sum(name.startswith(row) for name in timed_rows(text)) for row in PEER_ROWS[peer]}
    if _importable(peer):
        assert [row for row, count in timed.items() if count < 2] == []
    else:
        assert [row for row, count in timed.items() if count] == []
        assert f"({peer.replace('_', '-')} rows left out" in text


@pytest.mark.parametrize("where", HOOK_SECTIONS)
@pytest.mark.parametrize(
    ("hook", "baseline"),
    [
        ("GradientLARS", "SGD"),
        ("AdaptiveGradientClipping", "SGD"),
        ("TrustRatio", "AdamW"),
        ("GradientCentralization", "SGD"),
    ],
)
def test_a_verdict_line_per_hook_on_both_target_sets(
    smoke_run: subprocess.CompletedProcess[str], where: str, hook: str, baseline: str
) -> None:
    text = section(smoke_run.stdout, HOOK_SECTIONS[where])
    line = (
        rf"^  {hook} <= \d\.\d\dx {baseline} alone: ResNet-50 [\d.]+x, ViT-B/16 [\d.]+x: "
        r"(met|not met)"
        # The gradient hooks' lines end with the floor of the checks their rules ask for.
        + (r"$" if hook == "TrustRatio" else r" \(the checks' floor: [\d.]+x, [\d.]+x\)$")
    )
    assert len(re.findall(line, text, re.MULTILINE)) == 1
