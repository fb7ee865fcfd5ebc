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

from slothkit_kernels.geglu import _gelu_and_derivative
from slothkit_kernels.utils import use_triton, warn_reference_once

MAX_ROWS = 8
# Columns a program handles per step of its loop, and the programs a row's A is spread
# over (about; each owns a power of two of A's rows): enough parts to stream A from
# several SMs at once, few enough that each part's recomputation of the row stays small.
BLOCK_COLS = 1024
TARGET_PARTS = 16
NUM_WARPS = 4
ACTIVATIONS = {"swiglu": 0, "geglu_tanh": 1, "geglu": 2}


@triton.jit
def _add_rms_norm_low_rank_kernel(
    HIDDEN,  # (M, H) the residual stream, contiguous along H
    UPDATE,  # (M, H) added to it first (unused without ADD)
    WEIGHT,  # (H,) the norm's weight
    SUMMED,  # (M, H) hidden + update (unused without ADD)
    NORMED,  # (M, H) the norm's output
    A,  # (R, H) the stacked LoRA A (unused without HAS_LORA)
    XA,  # (M, R) NORMED times A^T (unused without HAS_LORA)
    n_cols,
    rank,
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
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    offs = tl.arange(0, BLOCK_COLS)

    squares = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_COLS):
        cols = c0 + offs
        mask = cols < n_cols
        x = tl.load(HIDDEN + row * stride_hm + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # torch rounds the sum to the stream's dtype before the norm reads it
            u = tl.load(UPDATE + row * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + u).to(HIDDEN.dtype.element_ty).to(tl.float32)
        squares += x * x
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)

    ranks = part * BLOCK_RANK + tl.arange(0, BLOCK_RANK)
    rank_mask = ranks < rank
    acc = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_COLS):
        cols = c0 + offs
        mask = cols < n_cols
        mine = mask & ((cols // BLOCK_COLS) % parts == part)
        x = tl.load(HIDDEN + row * stride_hm + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            u = tl.load(UPDATE + row * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + u).to(HIDDEN.dtype.element_ty)
            tl.store(SUMMED + row * stride_sm + cols, s, mask=mine)
            x = s.to(tl.float32)
        w = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
        x_hat = x * rstd
        if GEMMA:
            y = (x_hat * (1.0 + w)).to(NORMED.dtype.element_ty)
        else:  # LlamaRMSNorm rounds x_hat to the input dtype before the weight multiply
            y = (w * x_hat.to(HIDDEN.dtype.element_ty).to(tl.float32)).to(NORMED.dtype.element_ty)
        tl.store(NORMED + row * stride_nm + cols, y, mask=mine)
        if HAS_LORA:
            a = tl.load(
                A + ranks[:, None] * stride_a + cols[None, :],
                mask=rank_mask[:, None] & mask[None, :],
                other=0.0,
            )
            acc += a.to(tl.float32) * y.to(tl.float32)[None, :]
    if HAS_LORA:
        tl.store(XA + row * stride_xam + ranks, tl.sum(acc, axis=1).to(XA.dtype.element_ty), mask=rank_mask)


@triton.jit
def _gated_low_rank_kernel(
    GATE,  # (M, I), contiguous along I
    UP,  # (M, I)
    OUT,  # (M, I) act(gate) * up
    A,  # (R, I) LoRA A of the projection that reads OUT
    XA,  # (M, R) OUT times A^T
    n_cols,
    rank,
    stride_gm,
    stride_um,
    stride_om,
    stride_a,
    stride_xam,
    ACTIVATION: tl.constexpr,  # 0 SwiGLU, 1 GeGLU (tanh), 2 GeGLU (erf)
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    offs = tl.arange(0, BLOCK_COLS)
    ranks = part * BLOCK_RANK + tl.arange(0, BLOCK_RANK)
    rank_mask = ranks < rank
    acc = tl.zeros((BLOCK_RANK, BLOCK_COLS), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_COLS):
        cols = c0 + offs
        mask = cols < n_cols
        e = tl.load(GATE + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(UP + row * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION == 0:
            h = e * tl.sigmoid(e) * g
        else:
            gelu, _ = _gelu_and_derivative(e, ACTIVATION == 1)
            h = gelu * g
        h = h.to(OUT.dtype.element_ty)
        tl.store(OUT + row * stride_om + cols, h, mask=mask & ((cols // BLOCK_COLS) % parts == part))
        a = tl.load(
            A + ranks[:, None] * stride_a + cols[None, :], mask=rank_mask[:, None] & mask[None, :], other=0.0
        )
        acc += a.to(tl.float32) * h.to(tl.float32)[None, :]
    tl.store(XA + row * stride_xam + ranks, tl.sum(acc, axis=1).to(XA.dtype.element_ty), mask=rank_mask)


def _block_rank(rank: int) -> int:
    """A's rows per part: a power of two that spreads ``rank`` rows over about
    TARGET_PARTS parts."""
    return min(16, triton.next_power_of_2(max(1, triton.cdiv(rank, TARGET_PARTS))))


def _block_cols(n_cols: int) -> int:
    return min(BLOCK_COLS, triton.next_power_of_2(n_cols))


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
    block_rank = _block_rank(rank)
    parts = max(1, triton.cdiv(rank, block_rank))
    _add_rms_norm_low_rank_kernel[(rows, parts)](
        hidden,
        hidden if update is None else update,
        weight.contiguous(),
        summed,
        normed,
        hidden if lora_a is None else lora_a,
        normed if xa is None else xa,
        n_cols,
        rank,
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
        BLOCK_COLS=_block_cols(n_cols),
        BLOCK_RANK=block_rank,
        num_warps=NUM_WARPS,
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
    block_rank = _block_rank(rank)
    _gated_low_rank_kernel[(rows, triton.cdiv(rank, block_rank))](
        gate,
        up,
        out,
        lora_a,
        xa,
        n_cols,
        rank,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        lora_a.stride(0),
        xa.stride(0),
        ACTIVATION=ACTIVATIONS[activation],
        BLOCK_COLS=_block_cols(n_cols),
        BLOCK_RANK=block_rank,
        num_warps=NUM_WARPS,
    )
    return out, xa
