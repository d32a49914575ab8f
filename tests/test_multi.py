"""The multi-tensor table every multi-tensor kernel shares: rows, chunks, layouts, the cache.

The kernels themselves are tested through their techniques (tests/test_kernels.py for LARS);
here the host side: that the chunks cover every row's values exactly once, in order, and that
tensors the kernels cannot read as rows are copied.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from normhooks._kernels import _multi


def covered(table: _multi.ChunkTable, tensors: list[torch.Tensor]) -> list[list[range]]:
    """For each row, the ranges of its chunks in its tensor, from the table's parts."""
    rows: list[list[range]] = [[] for _ in range(table.rows)]
    first = table.row_first_chunk.tolist()
    for chunk, (tensor, row, start, stop) in enumerate(
        zip(
            table.chunk_tensor.tolist(),
            table.chunk_row.tolist(),
            table.chunk_start.tolist(),
            table.chunk_stop.tolist(),
            strict=True,
        )
    ):
        assert first[row] <= chunk < first[row + 1]
        assert 0 <= start <= stop <= max(tensors[tensor].numel(), 0)
        rows[row].append(range(start, stop))
    return rows


SHAPES = [(3, 5), (130,), (2, 70), (0,), (1, 4, 3), (4, 0)]


@pytest.mark.parametrize("rows", [_multi.WHOLE, _multi.DIM0])
def test_chunks_cover_each_row_once_in_order(rows: str) -> None:
    tensors = [torch.randn(shape) for shape in SHAPES]
    table = _multi.ChunkTable([tensors], rows, chunk=32)
    expected = []
    for tensor in tensors:
        count = _multi.row_count(tensor.shape, rows)
        length = tensor.numel() // count
        expected += [range(r * length, (r + 1) * length) for r in range(count)]
    found = covered(table, tensors)
    assert len(found) == len(expected) == table.rows
    for chunks, row in zip(found, expected, strict=True):
        assert [i for chunk in chunks for i in chunk] == list(row)
        assert all(len(chunk) <= 32 for chunk in chunks)
        # An empty row still has its one chunk, so its result is written.
        assert len(chunks) == max(1, -(-len(row) // 32))
    assert table.arrivals.tolist() == [0] * table.rows
    # The span of chunks holding every row of several: from the first such row to the last.
    per_row = table.row_first_chunk.diff()
    chunk_of_long_row = torch.repeat_interleave(per_row > 1, per_row).nonzero().flatten()
    first, count = table.long_rows
    if chunk_of_long_row.numel():
        assert first == chunk_of_long_row[0]
        assert first + count == chunk_of_long_row[-1] + 1
    else:
        assert count == 0
    assert table.pointers[0].tolist() == [t.data_ptr() for t in tensors]


def test_rows_along_dim0_need_dim0_outermost() -> None:
    weight = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    transposed = torch.randn(3, 4).t()
    (kept,), _ = _multi.laid_out([[weight]], ("w",), _multi.WHOLE)
    assert kept[0] is weight
    (kept, kept_grads), (_, copied) = _multi.laid_out([[weight], [grad]], ("w", "g"), _multi.DIM0)
    assert kept[0] is weight
    assert kept_grads[0] is grad
    assert not copied
    (copies,), (pairs,) = _multi.laid_out([[transposed]], ("w",), _multi.DIM0)
    assert copies[0].is_contiguous()
    assert pairs == [(transposed, copies[0])]


def test_paired_tensors_laid_out_alike() -> None:
    param = torch.randn(4, 3).t()
    grad = torch.randn(3, 4)
    (params, grads), (param_pairs, grad_pairs) = _multi.laid_out(
        [[param], [grad]], ("params", "grads"), _multi.WHOLE
    )
    assert params[0].is_contiguous()
    assert grads[0] is grad
    assert [p for p, _ in param_pairs] == [param]
    assert not grad_pairs


def test_a_table_is_found_again_until_a_tensor_moves() -> None:
    tensors = [torch.randn(5), torch.randn(2, 3)]
    args = (("params",), _multi.DIM0, 32, False, "test")
    first = _multi.table([tensors], *args)
    assert _multi.table([list(tensors)], *args) is first
    tensors[1].data = torch.randn(2, 3)
    assert _multi.table([tensors], *args) is not first
    tensors[1].data = torch.randn(3, 2)
    moved = _multi.table([tensors], *args)
    assert moved.rows == 1 + 3


def test_mismatched_lists_are_refused() -> None:
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \[3\], but params\[0\]"):
        _multi.table(
            [[torch.randn(2)], [torch.randn(3)]], ("params", "grads"), _multi.WHOLE, 32, False, "t"
        )
    with pytest.raises(ValueError, match=r"grads\[0\] is a torch.float64 tensor"):
        _multi.table(
            [[torch.randn(2)], [torch.randn(2, dtype=torch.float64)]],
            ("params", "grads"),
            _multi.WHOLE,
            32,
            False,
            "t",
        )


def test_no_table_is_made_inside_a_capture() -> None:
    with pytest.raises(RuntimeError, match="first time inside a CUDA-graph capture"):
        _multi.table([[torch.randn(7)]], ("params",), _multi.WHOLE, 32, True, "LARS")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs LARS's kernels through the interpreter"
)
@pytest.mark.filterwarnings("ignore:normhooks' Triton kernel for LARS failed:RuntimeWarning")
def test_a_failed_launch_leaves_no_table_for_the_kernels_turned_on_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launch that stops part way can leave a row's count of arrived programs above zero; a
    table found again after ``set_kernels_enabled(True)`` would then never complete that row."""
    from kernel_cases import lars_reference, lars_table, run_lars
    from normhooks import _kernels, lars_, set_kernels_enabled
    from normhooks._kernels import _fallback
    from normhooks._kernels import lars as lars_kernels

    monkeypatch.setattr(lars_kernels, "_BLOCK", 16)
    monkeypatch.setattr(lars_kernels, "_CHUNK", 64)
    monkeypatch.setattr(lars_kernels, "_PARTIALS_BLOCK", 2)
    params = [torch.randn(300, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    grads = [torch.randn_like(p) for p in params]
    run_lars(params, [g.clone() for g in grads])
    stale = lars_table(params, grads)
    stale.arrivals[0] = 1  # what a launch stopped part way leaves
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    with monkeypatch.context() as patch:
        patch.setattr(lars_kernels, "_SCALE", None)  # not callable: the second launch fails
        with _kernels.route_cpu_tensors(), pytest.warns(RuntimeWarning, match="LARS failed"):
            lars_(params)
    try:
        set_kernels_enabled(True)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        with _kernels.route_cpu_tensors():
            rates = lars_(params)
        assert lars_table(params, grads) is not stale
    finally:
        _fallback.reset()
    want_rates, want = lars_reference(params, grads)
    torch.testing.assert_close(rates.double(), want_rates)
    for p, expected in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, expected)
