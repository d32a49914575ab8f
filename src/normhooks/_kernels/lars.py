r"""LARS for every tensor of one device and dtype in two kernel launches.

Launch 1 splits every tensor into chunks of ``_CHUNK`` values and sums the squares of
:math:`w` and :math:`g` in each (a multi-tensor pass: tensors are found through a table of
addresses). A tensor of one chunk gets its rate from that program; in a tensor of several,
each program writes its partial sums and counts itself in with an integer atomic, and the one
that arrives last adds the tensor's partial sums in a fixed order (deterministic, no float
atomics, each partial sum read once) and writes the rate. Launch 2 runs one program per chunk
again and writes :math:`g \leftarrow r\,(g / s + \beta w)`, with :math:`s` a GradScaler's
scale when given.

Both launch through :class:`~normhooks._kernels._launch.Kernel`: a call signature met before
(see :func:`_compiled`) launches its compiled kernels directly, without Triton's binder.
"""

# Triton ships without type information: its modules and @triton.jit are untyped to mypy.
# mypy: disable-error-code="import-untyped, untyped-decorator"

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from normhooks._kernels._cache import KeyedCache
from normhooks._kernels._common import (
    DeviceTable,
    acc_dtype,
    as_float,
    bits,
    current_stream,
    device_index,
    div,
    is_finite,
    on_device,
    sqrt,
)
from normhooks._kernels._common import tl_dtype as _tl_dtype
from normhooks._kernels._launch import Kernel
from normhooks._precision import compute_dtype

# Values per program: a chunk is _CHUNK values of one tensor, read _BLOCK at a time.
_BLOCK = 1024
_CHUNK = 32 * _BLOCK
# Partial sums added at a time by the last program of a tensor.
_PARTIALS_BLOCK = 128
# Triton passes an int argument as int32 when it fits, as int64 otherwise.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# Tables kept for this many distinct sets of tensors (an optimizer has one per device, dtype
# and param group; a few more cover models trained side by side).
_CACHE_SIZE = 64


@triton.jit
def _chunk(w_ptrs, g_ptrs, numels, chunk_tensor, chunk_start, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """This program's chunk: its index, its tensor's, where it starts in the tensor, the
    tensor's size, and its w and g."""
    chunk = tl.program_id(0).to(tl.int64)
    tensor = tl.load(chunk_tensor + chunk)
    w = tl.load(w_ptrs + tensor).to(tl.pointer_type(dtype))
    g = tl.load(g_ptrs + tensor).to(tl.pointer_type(dtype))
    return chunk, tensor, tl.load(chunk_start + chunk), tl.load(numels + tensor), w, g


@triton.jit
def _rate(  # type: ignore[no-untyped-def]
    w_squares,
    g_squares,
    grad_scale,
    lr_tensor,
    threshold,
    weight_decay,
    eps,
    trust_coefficient,
    lr,
    acc: tl.constexpr,
    has_decay: tl.constexpr,
    has_trust: tl.constexpr,
    clip: tl.constexpr,
    lr_is_tensor: tl.constexpr,
    zero_denominator_is_one: tl.constexpr,
    zero_grad_is_one: tl.constexpr,
    zero_grad_is_zero: tl.constexpr,
    scaled: tl.constexpr,
):
    w_norm = sqrt(w_squares, acc)
    g_norm = sqrt(g_squares, acc)
    if scaled:
        g_norm = div(g_norm, tl.load(grad_scale).to(acc), acc)
    # The association of the eager formula: (||g|| + eps) + weight_decay * ||w||.
    denominator = g_norm + as_float(eps, acc)
    if has_decay:
        denominator = denominator + as_float(weight_decay, acc) * w_norm
    rate = div(w_norm, denominator, acc)
    if has_trust:
        rate = rate * as_float(trust_coefficient, acc)
    if clip:
        if lr_is_tensor:
            rate = div(rate, tl.load(lr_tensor).to(acc), acc)
        else:
            rate = div(rate, as_float(lr, acc), acc)
        # Not tl.minimum: a NaN rate stays NaN, as torch.clamp leaves it.
        rate = tl.where(rate > 1.0, 1.0, rate)
    keep = w_norm > as_float(threshold, acc)
    if zero_denominator_is_one:
        keep = keep & (denominator > 0.0)
    rate = tl.where(keep, rate, 1.0)
    # Where ||g|| = 0: rate 1 for zero_grad_mode="decay", 0 for "skip" (else the formula).
    if zero_grad_is_one:
        rate = tl.where(g_norm == 0.0, 1.0, rate)
    if zero_grad_is_zero:
        rate = tl.where(g_norm == 0.0, 0.0, rate)
    return rate.to(acc)


@triton.jit(do_not_specialize=["threshold", "weight_decay", "eps", "trust_coefficient", "lr"])
def _squares_and_rates(  # type: ignore[no-untyped-def]
    w_ptrs,
    g_ptrs,
    numels,
    first_chunk,
    chunk_tensor,
    chunk_start,
    arrivals,
    partials,
    rates,
    grad_scale,
    lr_tensor,
    threshold,
    weight_decay,
    eps,
    trust_coefficient,
    lr,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    chunk_size: tl.constexpr,
    partials_block: tl.constexpr,
    has_decay: tl.constexpr,
    has_trust: tl.constexpr,
    clip: tl.constexpr,
    lr_is_tensor: tl.constexpr,
    zero_denominator_is_one: tl.constexpr,
    zero_grad_is_one: tl.constexpr,
    zero_grad_is_zero: tl.constexpr,
    scaled: tl.constexpr,
):
    chunk, tensor, start, numel, w, g = _chunk(
        w_ptrs, g_ptrs, numels, chunk_tensor, chunk_start, dtype
    )
    w_acc = tl.zeros([block], dtype=acc)
    g_acc = tl.zeros([block], dtype=acc)
    for offset in tl.range(0, chunk_size, block):
        index = start + offset + tl.arange(0, block)
        mask = index < numel
        w_values = tl.load(w + index, mask=mask, other=0.0).to(acc)
        g_values = tl.load(g + index, mask=mask, other=0.0).to(acc)
        w_acc += w_values * w_values
        g_acc += g_values * g_values
    w_squares = tl.sum(w_acc, axis=0)
    g_squares = tl.sum(g_acc, axis=0)
    low = tl.load(first_chunk + tensor)
    high = tl.load(first_chunk + tensor + 1)
    last = high - low == 1
    if high - low > 1:
        tl.store(partials + 2 * chunk, w_squares)
        tl.store(partials + 2 * chunk + 1, g_squares)
        # Every thread's store is done before the release below publishes them to the
        # program that arrives last; that one's acquire makes them visible to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + tensor, 1, sem="acq_rel")
        last = arrived == high - low - 1
        if last:
            # The tensor's partial sums in a fixed order, whichever program arrives last
            # (see _common for why the loops over run-time bounds are while loops).
            w_sums = tl.zeros([partials_block], dtype=acc)
            g_sums = tl.zeros([partials_block], dtype=acc)
            first = low
            while first < high:
                index = first + tl.arange(0, partials_block)
                mask = index < high
                w_sums += tl.load(partials + 2 * index, mask=mask, other=0.0)
                g_sums += tl.load(partials + 2 * index + 1, mask=mask, other=0.0)
                first += partials_block
            w_squares = tl.sum(w_sums, axis=0)
            g_squares = tl.sum(g_sums, axis=0)
            # Every other program of the tensor has arrived: the count is free for the next
            # launch, which finds it at zero.
            tl.store(arrivals + tensor, 0)
    if last:
        rate = _rate(
            w_squares,
            g_squares,
            grad_scale,
            lr_tensor,
            threshold,
            weight_decay,
            eps,
            trust_coefficient,
            lr,
            acc,
            has_decay,
            has_trust,
            clip,
            lr_is_tensor,
            zero_denominator_is_one,
            zero_grad_is_one,
            zero_grad_is_zero,
            scaled,
        )
        tl.store(rates + tensor, rate)


_SQUARES_AND_RATES = Kernel(_squares_and_rates)


@triton.jit(do_not_specialize=["weight_decay"])
def _scale(  # type: ignore[no-untyped-def]
    w_ptrs,
    g_ptrs,
    numels,
    chunk_tensor,
    chunk_start,
    rates,
    grad_scale,
    found_inf,
    weight_decay,
    dtype: tl.constexpr,
    acc: tl.constexpr,
    block: tl.constexpr,
    chunk_size: tl.constexpr,
    has_decay: tl.constexpr,
    scaled: tl.constexpr,
    flag_overflow: tl.constexpr,
):
    _, tensor, start, numel, w, g = _chunk(w_ptrs, g_ptrs, numels, chunk_tensor, chunk_start, dtype)
    rate = tl.load(rates + tensor)
    decay = as_float(weight_decay, acc)
    if scaled:
        scale = tl.load(grad_scale).to(acc)
    finite = tl.full([block], 1, dtype=tl.int1)
    for offset in tl.range(0, chunk_size, block):
        index = start + offset + tl.arange(0, block)
        mask = index < numel
        values = tl.load(g + index, mask=mask, other=0.0).to(acc)
        if scaled:
            values = div(values, scale, acc)
        if has_decay:
            values = values + decay * tl.load(w + index, mask=mask, other=0.0).to(acc)
        written = (rate * values).to(dtype)
        tl.store(g + index, written, mask=mask)
        if flag_overflow:
            finite = finite & is_finite(written.to(acc))
    if flag_overflow:
        overflow = tl.min(finite.to(tl.int32), axis=0) == 0
        tl.atomic_max(found_inf, 1.0, mask=overflow)


_SCALE = Kernel(_scale)


class _Table(DeviceTable):
    """Addresses, sizes and chunks of one list of tensors, on their device.

    Its content is a function of the key it is cached under (addresses and sizes), so a
    cached table is never stale: a tensor that moves or changes size makes a new key.
    """

    def __init__(self, params: Sequence[Tensor], grads: Sequence[Tensor], chunk: int) -> None:
        numels = [p.numel() for p in params]
        # Every tensor gets at least one chunk, so an empty one still has its rate written.
        counts = [max(1, -(-n // chunk)) for n in numels]
        first = [0]
        for count in counts:
            first.append(first[-1] + count)
        chunk_tensor = [i for i, count in enumerate(counts) for _ in range(count)]
        chunk_start = [c * chunk for count in counts for c in range(count)]
        rows = [
            [p.data_ptr() for p in params],
            [g.data_ptr() for g in grads],
            numels,
            first,
            chunk_tensor,
            chunk_start,
            # Programs of each tensor that have written their partial sums; the last one
            # resets its count, so the table leaves every launch as it found it.
            [0] * len(params),
        ]
        # Rows of even length: every part lies a multiple of 16 bytes from the storage's
        # start, so the storage's alignment (what Triton specializes a pointer on) is theirs.
        super().__init__([row + [0] * (len(row) % 2) for row in rows], params[0].device)
        self.chunks = len(chunk_tensor)
        (
            self.w_ptrs,
            self.g_ptrs,
            self.numels,
            self.first_chunk,
            self.chunk_tensor,
            self.chunk_start,
            self.arrivals,
        ) = [part[: len(row)] for part, row in zip(self.parts, rows, strict=True)]

    def use_on(self, stream: int | None, capturing: bool = False) -> None:
        """Makes the table safe to launch with on the current stream (see
        :meth:`DeviceTable.use_on`). Under CUDA-graph capture the graph keeps the table's
        addresses for every replay, so the table is kept for the life of the process (a
        waiting stream cannot be captured; torch.cuda.graph synchronizes the device before
        capturing, so the copy is done).
        """
        if capturing:
            with _tables_lock:
                if all(kept is not self for kept in _kept):
                    _kept.append(self)
            return
        super().use_on(stream)


# The tables by everything their content is a function of (device, dtype, chunk size, the
# tensors' addresses and sizes): valid by construction. The cache is shared by optimizer steps
# in several threads (one model per thread), which KeyedCache allows.
_tables: KeyedCache[tuple[object, ...], _Table] = KeyedCache(_CACHE_SIZE)
# Tables that a CUDA graph captured: never dropped, since any replay reads them (the one kept
# set outside a KeyedCache: its entries are pinned for the process, not evicted).
_kept: list[_Table] = []
_tables_lock = threading.Lock()


def _capturing(device: torch.device) -> bool:
    """Whether the current stream (of the current device) is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _table(params: Sequence[Tensor], grads: Sequence[Tensor], capturing: bool) -> _Table:
    device = params[0].device
    key = (
        device,
        params[0].dtype,
        _CHUNK,
        tuple(map(Tensor.data_ptr, params)),
        tuple(map(Tensor.data_ptr, grads)),
        tuple(map(Tensor.numel, params)),
    )
    table = _tables.get(key)
    if table is None:
        if capturing:
            raise RuntimeError(
                "LARS's Triton kernel meets these tensors for the first time inside a "
                "CUDA-graph capture, where it cannot build their table of addresses (the "
                "graph would replay its copy from freed host memory). Run a step on the same "
                "tensors before capturing, and keep the gradients where they are: clear them "
                "with optimizer.zero_grad(set_to_none=False), inside the captured step too, "
                "since gradients set to None are reallocated inside the capture. Parameters "
                "or gradients that are not dense are copied at every step, so cannot be "
                "captured with the kernel."
            )
        # Checked once per set of tensors: torch keeps a .grad of its parameter's shape,
        # dtype and device, so a set found again by address has passed already.
        _check(params, grads)
        table = _tables.put(key, _Table(params, grads, _CHUNK))
    table.use_on(current_stream(device), capturing)
    return table


# The compiled variants of both kernels, by everything Triton specializes them on except the
# alignment of the pointers that _launch.Kernel checks at each launch.
_variants: KeyedCache[tuple[object, ...], tuple[dict[Any, Any], dict[Any, Any]]] = KeyedCache()


def _compiled(
    device: torch.device,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None,
    flags: tuple[bool, ...],
    scalars: tuple[int, ...],
    flag_overflow: bool,
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The caches of compiled ``_squares_and_rates`` and ``_scale`` for one call signature.

    Triton keeps compiled kernels per device and specializes them on the dtype of every
    pointer (the tensors' and the scale's; partials, rates, a tensor lr and the overflow flag
    follow from the dtype), on each constexpr (the flags and the block sizes) and on whether
    each int argument fits 32 bits (the scalars' bit patterns: ``do_not_specialize`` keeps
    their values out, not their type). Every one of those is in the key.
    """
    key = (
        device,
        dtype,
        scale_dtype,
        flags,
        flag_overflow,
        tuple([_INT32_MIN <= value <= _INT32_MAX for value in scalars]),
        _BLOCK,
        _CHUNK,
        _PARTIALS_BLOCK,
    )
    return _variants.get_or_make(key, lambda: ({}, {}))


def _dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s values fill ``numel`` slots from its first address, once each."""
    if tensor.is_contiguous():
        return True
    expected = 1
    pairs = zip(tensor.stride(), tensor.shape, strict=True)
    for stride, size in sorted((stride, size) for stride, size in pairs if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check(params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    device, dtype = params[0].device, params[0].dtype
    _tl_dtype(dtype)
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        for name, tensor in (("params", param), ("grads", grad)):
            if tensor.device != device or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}[{index}] is a {tensor.dtype} tensor on {tensor.device}; one call "
                    f"takes tensors of one device and dtype ({dtype} on {device})"
                )
        if grad.shape != param.shape:
            raise ValueError(
                f"grads[{index}] has shape {list(grad.shape)}, but params[{index}] has shape "
                f"{list(param.shape)}"
            )


def lars_unit_(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    threshold: float,
    weight_decay: float,
    eps: float,
    trust_coefficient: float,
    lr: float | Tensor | None,
    clip: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    zero_grad_mode: str = "scale",
) -> Tensor:
    r"""Rewrites each ``grads[i]`` in place as :math:`r_i\,(g_i / s + \beta w_i)`, in two launches.

    The rate is the eager one: :math:`\lambda = \|w\| / ((\|g\| + \epsilon) + \beta \|w\|)`
    times ``trust_coefficient``, then :math:`\min(\lambda / lr, 1)` with ``clip``, and 1
    where :math:`\|w\| \le` ``threshold`` or, with ``eps == weight_decay == 0``, where the
    denominator is 0; where :math:`\|g\| = 0`, ``zero_grad_mode="decay"`` makes it 1 and
    ``"skip"`` 0 (a zero gradient stays zero). With ``grad_scale`` (:math:`s`, a GradScaler's
    scale) the gradients arrive scaled: norms use :math:`g / s` and the written gradients are
    unscaled. With ``found_inf`` (a 1-element float32 tensor), it is set to 1 if any written
    value is not finite, and left alone otherwise. float16/bfloat16 are computed in float32 and
    rounded once.

    Steady state: no host synchronization. The table of addresses is built on first use of a
    set of tensors (one host-to-device copy, from pinned memory) and reused while the tensors
    keep their addresses and sizes. Tensors that are not dense, or whose gradient is laid out
    unlike the parameter, go through contiguous copies (and their tables are rebuilt each call).
    A table is safe on any stream (see :meth:`_Table.use_on`). Under CUDA-graph capture a
    table is never built (the tensors must have been seen before capturing) and ``clip``
    needs a tensor ``lr``: a float would be fixed into the graph.

    Args:
        params: the parameters :math:`w`, all of one device and floating dtype.
        grads: their gradients :math:`g`, same shapes, device and dtype.
        threshold: tensors with :math:`\|w\|` at most this keep rate 1.
        weight_decay: :math:`\beta`.
        eps: added to :math:`\|g\|` in the denominator.
        trust_coefficient: multiplies the rate.
        lr: the learning rate ``clip`` divides by (a float or a 1-element tensor).
        clip: LARC's clipping mode; ignored when ``lr`` is None.
        grad_scale: the scale the gradients carry, or None.
        found_inf: the overflow flag to raise, or None.
        zero_grad_mode: ``"scale"``, ``"decay"`` or ``"skip"``, as in :func:`normhooks.lars_`.

    Returns:
        The rates, 1-D, one per tensor, in float32 for half dtypes and in the dtype otherwise.
    """
    if not params and not grads:
        return torch.empty(0)
    if len(params) != len(grads):
        raise ValueError(
            f"params and grads must pair up, got {len(params)} params and {len(grads)} grads"
        )
    device, dtype = params[0].device, params[0].dtype
    acc = compute_dtype(dtype)
    if found_inf is not None and (found_inf.dtype != torch.float32 or found_inf.numel() != 1):
        raise ValueError(
            "found_inf must be a 1-element float32 tensor (GradScaler's flag), got "
            f"{found_inf.dtype} with {found_inf.numel()} elements"
        )
    originals: list[tuple[Tensor, Tensor]] = []
    if not (all(map(Tensor.is_contiguous, params)) and all(map(Tensor.is_contiguous, grads))):
        params, grads = list(params), list(grads)
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            if not (_dense(param) and param.stride() == grad.stride()):
                params[i] = param.contiguous()
                grads[i] = grad.contiguous()
                if grads[i] is not grad:
                    originals.append((grad, grads[i]))
    lr_is_tensor = isinstance(lr, Tensor)
    clipping = clip and lr is not None
    scalars = (
        bits(threshold),
        bits(weight_decay),
        bits(eps),
        bits(trust_coefficient),
        bits(lr) if clipping and not lr_is_tensor else 0,  # type: ignore[arg-type]
    )
    has_decay = weight_decay != 0
    flags = (
        has_decay,
        trust_coefficient != 1,
        clipping,
        lr_is_tensor,
        eps == 0 and weight_decay == 0,
        zero_grad_mode == "decay",
        zero_grad_mode == "skip",
        grad_scale is not None,
    )
    with on_device(device_index(device)):
        capturing = _capturing(device)
        if capturing and clipping and not lr_is_tensor:
            raise TypeError(
                "clip=True divides the rates by lr, and a float lr would be fixed into the "
                "CUDA graph being captured (a scheduler's later lr would be ignored on "
                "replay); under capture give lr as a 1-element tensor on the device, which "
                f"schedulers update in place, got lr={lr!r}"
            )
        table = _table(params, grads, capturing)
        partials = torch.empty(2 * table.chunks, dtype=acc, device=device)
        rates = torch.empty(len(params), dtype=acc, device=device)
        scale = rates
        if grad_scale is not None:
            scale = grad_scale if grad_scale.device == device else grad_scale.to(device)
        lr_tensor = rates
        if isinstance(lr, Tensor):
            lr_tensor = lr if lr.device == device and lr.dtype == acc else lr.to(device, acc)
        flag = rates if found_inf is None else found_inf
        squares_and_rates, scale_kernel = _compiled(
            device,
            dtype,
            None if grad_scale is None else scale.dtype,
            flags,
            scalars,
            found_inf is not None,
        )
        dtype_tl, acc_tl = _tl_dtype(dtype), acc_dtype(dtype)
        grid = (table.chunks, 1)
        index = device_index(device)
        try:
            _launch(
                grid,
                index,
                table,
                partials,
                rates,
                scale,
                lr_tensor,
                flag,
                squares_and_rates,
                scale_kernel,
                scalars,
                flags,
                dtype_tl,
                acc_tl,
                found_inf is not None,
            )
        except Exception as error:
            # A kernel that cannot compile or launch here fails before it writes: the caller
            # computes the plain formula (normhooks._kernels.lars_unit_).
            raise KernelFailedError(error) from error
    for grad, copy in originals:
        grad.copy_(copy)
    return rates


class KernelFailedError(Exception):
    """A LARS kernel failed to compile or launch (``error``), before writing a gradient."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _launch(
    grid: tuple[int, int],
    index: int | None,
    table: _Table,
    partials: Tensor,
    rates: Tensor,
    scale: Tensor,
    lr_tensor: Tensor,
    flag: Tensor,
    squares_and_rates: dict[Any, Any],
    scale_kernel: dict[Any, Any],
    scalars: tuple[int, ...],
    flags: tuple[bool, ...],
    dtype_tl: Any,
    acc_tl: Any,
    flag_overflow: bool,
) -> None:
    """The two launches of :func:`lars_unit_`."""
    _SQUARES_AND_RATES(
        squares_and_rates,
        grid,
        index,
        (table.storage, scale, lr_tensor),
        table.w_ptrs,
        table.g_ptrs,
        table.numels,
        table.first_chunk,
        table.chunk_tensor,
        table.chunk_start,
        table.arrivals,
        partials,
        rates,
        scale,
        lr_tensor,
        *scalars,
        dtype_tl,
        acc_tl,
        _BLOCK,
        _CHUNK,
        _PARTIALS_BLOCK,
        *flags,
    )
    _SCALE(
        scale_kernel,
        grid,
        index,
        (table.storage, scale, flag),
        table.w_ptrs,
        table.g_ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_start,
        rates,
        scale,
        flag,
        scalars[1],
        dtype_tl,
        acc_tl,
        _BLOCK,
        _CHUNK,
        flags[0],
        flags[-1],
        flag_overflow,
    )
