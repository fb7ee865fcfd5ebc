"""The element-wise work before a decode step's projections, with the adapters' first
product in the same launch.

A batch-1 decode step is a chain of a few hundred launches, and between the weight
GEMVs (which stream the weights) sit small ones that each cost a launch's fill, drain
and the gap before the next more than their bytes: the residual add, the RMSNorm, the
gated activation and, for LoRA, the first product x A^T of every group of projections
that read x.  Two of those seams are the same shape, "an element-wise function of a
few rows, then those rows times A^T", and each becomes one launch here:

* ``add_rms_norm_low_rank``: before the attention's and the MLP's projections,
      s = hidden + update                        (rounded to hidden's dtype, as torch adds)
      y = RMSNorm(s)                              (Llama's or Gemma's flavour, rms_norm.py)
      xa = y A^T                                  (A: the stacked A of q/k/v, or gate/up)
* ``gated_low_rank``: before the down projection,
      h = act(gate) * up                          (SwiGLU or GeGLU, swiglu.py / geglu.py)
      xa = h A^T                                  (A: down's)

Work split, for rows of M <= 8 (a decode step's): a (row, part) grid.  A part owns
BLOCK_RANK rows of A and reads them whole; it recomputes the row's function on its way
(the row is a few KB from L2, A is what comes from memory), and writes the chunks of
the row's outputs whose index is its own modulo the parts, so every element is written
once.  The row's sum of squares (RMSNorm) is a first pass over the row.  Everything is
fp32 inside; the outputs are rounded to their dtype once, and xa is the product of the
rounded y (or h), the value the unfused path hands its A product.

Both are forward-only: the decode step runs without autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels import split_k
from slothkit_kernels.geglu import _gelu_and_derivative
from slothkit_kernels.utils import interpreter_enabled, use_triton, warn_reference_once

MAX_ROWS = 8
# Elements of A a program multiplies per step (its rows per step times the columns of its
# slice), and the longest stretch of a row summed at once for the norm's mean square.
TILE_ELEMENTS = 8192
# At most this many columns a slice: a (16, columns) fp32 tile of the rows (tl.dot's 16
# rows, padded) per value live in the loop (gate, up, h) stays in registers.
MAX_COLS = 256
SQUARES_COLS = 8192
NUM_WARPS = 8
ACTIVATIONS = {"swiglu": 0, "geglu_tanh": 1, "geglu": 2}


@triton.jit
def _slice_times_a(y, cols, col_mask, A, r0, rank, stride_a, DOT_FP32: tl.constexpr, BLOCK_R: tl.constexpr):
    """(BLOCK_M, BLOCK_R) fp32: the rows ``y`` (BLOCK_M, BLOCK_COLS) of this slice times
    A's rows r0 .. r0 + BLOCK_R over the same columns, transposed (products of 16-bit
    values are exact in the fp32 accumulator)."""
    ranks = r0 + tl.arange(0, BLOCK_R)
    a = tl.load(
        A + ranks[:, None] * stride_a + cols[None, :],
        mask=(ranks < rank)[:, None] & col_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        return tl.dot(y.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
    return tl.dot(y, tl.trans(a))


@triton.jit
def _store_partial(part, PARTIALS, offs_m, m_mask, r0, rank, M, pid, BLOCK_R: tl.constexpr):
    ranks = r0 + tl.arange(0, BLOCK_R)
    at = PARTIALS + pid.to(tl.int64) * M * rank + offs_m[:, None] * rank + ranks[None, :]
    tl.store(at, part, mask=m_mask[:, None] & (ranks < rank)[None, :])


@triton.jit
def _sum_slices(
    PARTIALS,
    COUNTER,
    XA,
    M,
    rank,
    slices,
    stride_xam,
    BLOCK_R: tl.constexpr,
    ROWS: tl.constexpr,  # a power of two >= M
    BLOCK_SLICES: tl.constexpr,  # a power of two >= slices
):
    """After every slice stored its partial products: the last program to arrive adds
    them up, all slices in one tile (one fixed order of additions, whoever came last,
    and one round trip to memory rather than one per slice), rounds them into XA and
    sets the counter back to 0 (split_k.py's protocol)."""
    tl.debug_barrier()  # every thread's partials stored before the count says so
    arrived = tl.atomic_add(COUNTER, 1, sem="acq_rel")
    if arrived == slices - 1:
        offs_s = tl.arange(0, BLOCK_SLICES)
        offs_m = tl.arange(0, ROWS)
        for r0 in range(0, rank, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            mask = (
                (offs_s < slices)[:, None, None] & (offs_m < M)[None, :, None] & (ranks < rank)[None, None, :]
            )
            at = (
                offs_s.to(tl.int64)[:, None, None] * M * rank
                + offs_m[None, :, None] * rank
                + ranks[None, None, :]
            )
            parts = tl.load(PARTIALS + at, mask=mask, other=0.0, cache_modifier=".cg")
            xa = tl.sum(parts, axis=0)
            out = XA + offs_m[:, None] * stride_xam + ranks[None, :]
            tl.store(out, xa.to(XA.dtype.element_ty), mask=(offs_m < M)[:, None] & (ranks < rank)[None, :])
        tl.atomic_xchg(COUNTER, 0)  # ready for the next call


@triton.jit
def _add_rms_norm_low_rank_kernel(
    HIDDEN,  # (M, H) the residual stream, contiguous along H
    UPDATE,  # (M, H) added to it first (unused without ADD)
    WEIGHT,  # (H,) the norm's weight
    SUMMED,  # (M, H) hidden + update (unused without ADD)
    NORMED,  # (M, H) the norm's output
    A,  # (R, H) the stacked LoRA A (unused without HAS_LORA)
    XA,  # (M, R) NORMED times A^T (unused without HAS_LORA)
    PARTIALS,  # (slices, M, R) fp32, each slice's share of XA (unused without HAS_LORA)
    COUNTER,  # (1,) int32, 0 between calls (unused without HAS_LORA)
    M,
    n_cols,
    cols_per_slice,  # a multiple of BLOCK_COLS
    rank,
    rank_end,  # max(rank, 1): the loop over A's rows runs once without an adapter too
    eps,
    stride_hm,
    stride_um,
    stride_sm,
    stride_nm,
    stride_a,
    stride_xam,
    ADD: tl.constexpr,
    GEMMA: tl.constexpr,  # y = x_hat * (1 + w), rounded once (GemmaRMSNorm)
    HAS_LORA: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands in IEEE precision (fp32 inputs; the interpreter)
    BLOCK_M: tl.constexpr,  # 16, tl.dot's least; rows past M are masked
    BLOCK_COLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SQUARES_COLS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_SLICES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M

    # Each row's mean square over the whole row (every slice needs it; a row is a few KB,
    # read from L2 by each), one row at a time into a (BLOCK_M,) vector.
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    offs_sq = tl.arange(0, SQUARES_COLS)
    for m in range(0, M):
        squares = tl.zeros((SQUARES_COLS,), dtype=tl.float32)
        for c0 in range(0, n_cols, SQUARES_COLS):
            cols = c0 + offs_sq
            mask = cols < n_cols
            x = tl.load(HIDDEN + m * stride_hm + cols, mask=mask, other=0.0).to(tl.float32)
            if ADD:  # torch rounds the sum to the stream's dtype before the norm reads it
                u = tl.load(UPDATE + m * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
                x = (x + u).to(HIDDEN.dtype.element_ty).to(tl.float32)
            squares += x * x
        row_rstd = tl.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)
        rstd = tl.where(offs_m == m, row_rstd, rstd)

    k_start = pid * cols_per_slice
    k_stop = tl.minimum(k_start + cols_per_slice, n_cols)
    rows_h = HIDDEN + offs_m[:, None] * stride_hm
    for r0 in range(0, rank_end, BLOCK_R):
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for c0 in range(k_start, k_stop, BLOCK_COLS):
            cols = c0 + tl.arange(0, BLOCK_COLS)
            col_mask = cols < k_stop
            mask = m_mask[:, None] & col_mask[None, :]
            x = tl.load(rows_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if ADD:
                u = tl.load(UPDATE + offs_m[:, None] * stride_um + cols[None, :], mask=mask, other=0.0)
                s = (x + u.to(tl.float32)).to(HIDDEN.dtype.element_ty)
                if r0 == 0:
                    tl.store(SUMMED + offs_m[:, None] * stride_sm + cols[None, :], s, mask=mask)
                x = s.to(tl.float32)
            w = tl.load(WEIGHT + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            x_hat = x * rstd[:, None]
            if GEMMA:
                y = (x_hat * (1.0 + w)).to(NORMED.dtype.element_ty)
            else:  # LlamaRMSNorm rounds x_hat to the input dtype before the weight multiply
                y = (w * x_hat.to(HIDDEN.dtype.element_ty).to(tl.float32)).to(NORMED.dtype.element_ty)
            if r0 == 0:
                tl.store(NORMED + offs_m[:, None] * stride_nm + cols[None, :], y, mask=mask)
            if HAS_LORA:
                acc += _slice_times_a(y, cols, col_mask, A, r0, rank, stride_a, DOT_FP32, BLOCK_R)
        if HAS_LORA:
            _store_partial(acc, PARTIALS, offs_m, m_mask, r0, rank, M, pid, BLOCK_R)
    if HAS_LORA:
        _sum_slices(
            PARTIALS, COUNTER, XA, M, rank, tl.num_programs(0), stride_xam, BLOCK_R, ROWS, BLOCK_SLICES
        )


@triton.jit
def _gated_low_rank_kernel(
    GATE,  # (M, I), contiguous along I
    UP,  # (M, I)
    OUT,  # (M, I) act(gate) * up
    A,  # (R, I) LoRA A of the projection that reads OUT
    XA,  # (M, R) OUT times A^T
    PARTIALS,  # (slices, M, R) fp32
    COUNTER,  # (1,) int32, 0 between calls
    M,
    n_cols,
    cols_per_slice,
    rank,
    stride_gm,
    stride_um,
    stride_om,
    stride_a,
    stride_xam,
    ACTIVATION: tl.constexpr,  # 0 SwiGLU, 1 GeGLU (tanh), 2 GeGLU (erf)
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_SLICES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    k_start = pid * cols_per_slice
    k_stop = tl.minimum(k_start + cols_per_slice, n_cols)
    for r0 in range(0, rank, BLOCK_R):
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for c0 in range(k_start, k_stop, BLOCK_COLS):
            cols = c0 + tl.arange(0, BLOCK_COLS)
            col_mask = cols < k_stop
            mask = m_mask[:, None] & col_mask[None, :]
            e = tl.load(GATE + offs_m[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
            g = tl.load(UP + offs_m[:, None] * stride_um + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if ACTIVATION == 0:
                h = e * tl.sigmoid(e) * g
            else:
                gelu, _ = _gelu_and_derivative(e, ACTIVATION == 1)
                h = gelu * g
            h = h.to(OUT.dtype.element_ty)
            if r0 == 0:
                tl.store(OUT + offs_m[:, None] * stride_om + cols[None, :], h, mask=mask)
            acc += _slice_times_a(h, cols, col_mask, A, r0, rank, stride_a, DOT_FP32, BLOCK_R)
        _store_partial(acc, PARTIALS, offs_m, m_mask, r0, rank, M, pid, BLOCK_R)
    _sum_slices(PARTIALS, COUNTER, XA, M, rank, tl.num_programs(0), stride_xam, BLOCK_R, ROWS, BLOCK_SLICES)


def _plan(rows: torch.Tensor, n_cols: int, rank: int):
    """(slices, columns per slice, partials, counter) for rows (M, n_cols) times an A of
    ``rank`` rows: a slice of BLOCK_COLS columns (_blocks) per program, where the partial products'
    workspace exists (split_k.workspace; made outside CUDA graph capture), else one
    program over the whole row."""
    block_cols = _blocks(rank)[1]
    count = triton.cdiv(n_cols, block_cols)
    partials = counter = None
    if rank:
        partials, counter = split_k.workspace(rows.device, rows.shape[0], rank, count, 1)
        if partials is None:
            # One slice needs no workspace of split_k's: a zeroed counter and its partials.
            count = 1
            partials = torch.empty(1, rows.shape[0], rank, dtype=torch.float32, device=rows.device)
            counter = torch.zeros(1, dtype=torch.int32, device=rows.device)
    return count, triton.cdiv(triton.cdiv(n_cols, count), block_cols) * block_cols, partials, counter


def _blocks(rank: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_COLS): A's rows per step of the product, and the columns of a slice,
    so that an A tile holds at most TILE_ELEMENTS (a Turing GPU stages a bf16 product's
    operands in fp32 shared memory: 32 KB)."""
    block_r = min(64, max(16, triton.next_power_of_2(max(rank, 1))))
    return block_r, min(MAX_COLS, TILE_ELEMENTS // block_r)


def _constants(rows: torch.Tensor, rank: int, slices: int) -> dict:
    block_r, block_cols = _blocks(rank)
    return dict(
        DOT_FP32=rows.dtype == torch.float32 or interpreter_enabled(),
        BLOCK_M=16,
        BLOCK_COLS=block_cols,
        BLOCK_R=block_r,
        ROWS=triton.next_power_of_2(rows.shape[0]),
        BLOCK_SLICES=triton.next_power_of_2(slices),
        num_warps=NUM_WARPS,
        # A slice is one step of its loop (more only in the one-program fallback): no
        # software pipelining, whose buffers would double the shared memory of the A tile.
        num_stages=1,
    )


def _check_rows(name: str, **tensors) -> None:
    first = next(iter(tensors.values()))
    for label, t in tensors.items():
        if t.dim() != 2 or t.shape != first.shape:
            raise ValueError(f"{name}: {label} has shape {tuple(t.shape)}; expected (M, H) like the others")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {label} needs a contiguous last dimension")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name}: forward-only (a decode step's); {label} requires grad")
    if not 1 <= first.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: {first.shape[0]} rows; it takes 1 to {MAX_ROWS} (a decode step's)")
    if len({t.device for t in tensors.values()}) != 1 or len({t.dtype for t in tensors.values()}) != 1:
        raise ValueError(f"{name}: give {', '.join(tensors)} on one device in one dtype")


def _check_lora_a(name: str, lora_a, rows: torch.Tensor) -> None:
    if lora_a is None:
        return
    if lora_a.dim() != 2 or lora_a.shape[1] != rows.shape[1] or lora_a.stride(-1) != 1:
        raise ValueError(
            f"{name}: lora_a {tuple(lora_a.shape)}; expected (R, {rows.shape[1]}) with a contiguous last dimension"
        )
    if lora_a.dtype != rows.dtype or lora_a.device != rows.device:
        raise ValueError(f"{name}: lora_a is {lora_a.dtype} on {lora_a.device}; give it like the rows")


def add_rms_norm_low_rank_reference(hidden, update, weight, eps: float, gemma: bool, lora_a):
    """The same in plain torch: (summed, normed, xa), summed = hidden without an update,
    xa None without lora_a."""
    from slothkit_kernels.rms_norm import rms_norm_reference

    summed = hidden if update is None else hidden + update
    normed = rms_norm_reference(summed, weight, eps, gemma)
    xa = None if lora_a is None else (normed.float() @ lora_a.float().t()).to(normed.dtype)
    return summed, normed, xa


def add_rms_norm_low_rank(
    hidden: torch.Tensor,
    update: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    lora_a: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``s = hidden + update``, ``y = RMSNorm(s)`` and ``y A^T`` in one launch.

    Args:
        hidden: (M, H), M <= 8, the residual stream.  update: (M, H) or None (no add).
        weight: (H,) the norm's weight, in hidden's dtype.  eps, gemma: as rms_norm's.
        lora_a: (R, H) the stacked A of the projections that read y, or None.

    Returns:
        (s, y, xa): s is ``hidden`` itself without an update; xa is None without lora_a.
    """
    tensors = dict(hidden=hidden) if update is None else dict(hidden=hidden, update=update)
    _check_rows("add_rms_norm_low_rank", **tensors)
    _check_lora_a("add_rms_norm_low_rank", lora_a, hidden)
    if weight.shape != (hidden.shape[1],) or weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"add_rms_norm_low_rank: weight {tuple(weight.shape)} {weight.dtype}; expected "
            f"({hidden.shape[1]},) in {hidden.dtype} on {hidden.device}"
        )
    if not use_triton(hidden):
        warn_reference_once("add_rms_norm_low_rank", hidden.device.type)
        return add_rms_norm_low_rank_reference(hidden, update, weight, eps, gemma, lora_a)
    rows, n_cols = hidden.shape
    summed = hidden if update is None else torch.empty_like(hidden)
    normed = torch.empty_like(hidden)
    rank = 0 if lora_a is None else lora_a.shape[0]
    xa = None if lora_a is None else torch.empty(rows, rank, dtype=hidden.dtype, device=hidden.device)
    slices, cols_per_slice, partials, counter = _plan(hidden, n_cols, rank)
    _add_rms_norm_low_rank_kernel[(slices,)](
        hidden,
        hidden if update is None else update,
        weight.contiguous(),
        summed,
        normed,
        hidden if lora_a is None else lora_a,
        normed if xa is None else xa,
        normed if partials is None else partials,
        normed if counter is None else counter,
        rows,
        n_cols,
        cols_per_slice,
        rank,
        max(rank, 1),
        float(eps),
        hidden.stride(0),
        0 if update is None else update.stride(0),
        summed.stride(0),
        normed.stride(0),
        0 if lora_a is None else lora_a.stride(0),
        0 if xa is None else xa.stride(0),
        ADD=update is not None,
        GEMMA=bool(gemma),
        HAS_LORA=lora_a is not None,
        SQUARES_COLS=min(SQUARES_COLS, triton.next_power_of_2(n_cols)),
        **_constants(hidden, rank, slices),
    )
    return summed, normed, xa


def gated_low_rank_reference(gate, up, activation: str, lora_a):
    """The same in plain torch: (h, h A^T)."""
    if activation == "swiglu":
        from slothkit_kernels.swiglu import swiglu_reference

        h = swiglu_reference(gate, up)
    else:
        from slothkit_kernels.geglu import geglu_reference

        h = geglu_reference(gate, up, "tanh" if activation == "geglu_tanh" else "none")
    return h, (h.float() @ lora_a.float().t()).to(h.dtype)


def gated_low_rank(
    gate: torch.Tensor, up: torch.Tensor, activation: str, lora_a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = act(gate) * up`` and ``h A^T`` in one launch.

    Args:
        gate, up: (M, I), M <= 8 (a row stride of their own is fine: Phi-3's halves of
            one gate_up output).
        activation: "swiglu", "geglu_tanh" or "geglu" (erf).
        lora_a: (R, I), the A of the projection that reads h.
    """
    _check_rows("gated_low_rank", gate=gate, up=up)
    _check_lora_a("gated_low_rank", lora_a, gate)
    if lora_a is None:
        raise ValueError("gated_low_rank: give lora_a (without an adapter, swiglu/geglu are the ops)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_low_rank: activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
    if not use_triton(gate):
        warn_reference_once("gated_low_rank", gate.device.type)
        return gated_low_rank_reference(gate, up, activation, lora_a)
    rows, n_cols = gate.shape
    rank = lora_a.shape[0]
    out = torch.empty(rows, n_cols, dtype=gate.dtype, device=gate.device)
    xa = torch.empty(rows, rank, dtype=gate.dtype, device=gate.device)
    slices, cols_per_slice, partials, counter = _plan(gate, n_cols, rank)
    _gated_low_rank_kernel[(slices,)](
        gate,
        up,
        out,
        lora_a,
        xa,
        partials,
        counter,
        rows,
        n_cols,
        cols_per_slice,
        rank,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        lora_a.stride(0),
        xa.stride(0),
        ACTIVATION=ACTIVATIONS[activation],
        **_constants(gate, rank, slices),
    )
    return out, xa
