"""RMSNorm: y = w * x / rms(x), one row of the last dimension at a time.

Two flavours, each matching its Hugging Face module to the rounding:

* ``gemma=False`` (LlamaRMSNorm, also Mistral, Qwen2, ...)::

      y = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)

  The normalised row is rounded to x's dtype *before* the weight multiply, and
  the product has dtype ``torch.promote_types(x.dtype, weight.dtype)`` (a bf16
  input with an fp32 weight gives an fp32 output, as in transformers).

* ``gemma=True`` (GemmaRMSNorm)::

      y = (x_fp32 * rsqrt(mean(x_fp32^2) + eps) * (1 + weight.float())).to(x.dtype)

  The weight is stored as an offset from one; everything is fp32 and rounded once.

Everything inside the kernels is fp32.  The forward pass saves x and the per-row
r = rsqrt(mean(x^2) + eps) (fp32, one value per row); x_hat = x * r is recomputed.

Backward, per row of H elements, with g = dL/dy and v = w (Llama) or 1 + w (Gemma):
    x_hat_i = x_i r,            r = (mean_j x_j^2 + eps)^(-1/2)
    dr/dx_j = -r^3 x_j / H,     so  d x_hat_i / d x_j = r (delta_ij - x_hat_i x_hat_j / H)
    u = g * v                   (dL/dx_hat)
    dL/dx = r * (u - x_hat * mean(u * x_hat))
    dL/dw = sum over rows of g * x_hat
The rounding of x_hat to x.dtype in the Llama flavour is treated as the identity
(as autograd does), but dL/dw uses the rounded x_hat, which is the value the
weight actually multiplied.  Each backward program handles a run of rows and
keeps its share of dL/dw in fp32 registers; the per-program partial sums are
added up afterwards.  dL/dw is only computed when weight requires grad.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.utils import (
    calculate_settings,
    check_float_dtype,
    check_not_empty,
    check_same_device,
    use_triton,
    warn_reference_once,
)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, gemma: bool = False
) -> torch.Tensor:
    """The same function in plain torch, written as transformers writes it."""
    x32 = x.float()
    x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (x_hat * (1.0 + weight.float())).to(x.dtype)
    return weight * x_hat.to(x.dtype)


@triton.jit
def _rms_norm_forward_kernel(
    X,  # pointer to the input rows, (n_rows, H), last dim contiguous
    W,  # pointer to the weight, (H,)
    Y,  # pointer to the output rows, (n_rows, H), contiguous
    RSTD,  # pointer to the saved r = rsqrt(mean(x^2) + eps), (n_rows,) fp32
    x_row_stride,  # elements between consecutive rows of X
    n_cols,  # H, the length of a row
    eps,  # added to the mean square
    GEMMA: tl.constexpr,  # True: y = x_hat * (1 + w) rounded once (GemmaRMSNorm)
    BLOCK_SIZE: tl.constexpr,  # power of two >= H
):
    # int64: row * stride can exceed 2**31 (e.g. 8192 x 256000).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols

    x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    x_hat = x * rstd
    if GEMMA:
        y = x_hat * (1.0 + w)
    else:
        # LlamaRMSNorm rounds x_hat to the input dtype before multiplying by w.
        y = w * x_hat.to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    DY,  # pointer to dL/dy, (n_rows, H), last dim contiguous
    X,  # pointer to the saved input, (n_rows, H), last dim contiguous
    W,  # pointer to the weight, (H,)
    RSTD,  # pointer to the saved r per row, (n_rows,) fp32
    DX,  # pointer to dL/dx, (n_rows, H), contiguous (unused unless COMPUTE_DX)
    DW_PARTIAL,  # pointer to per-program sums of g * x_hat, (programs, H) fp32 (unused unless COMPUTE_DW)
    dy_row_stride,  # elements between consecutive rows of DY
    x_row_stride,  # elements between consecutive rows of X
    n_rows,  # number of rows
    n_cols,  # H, the length of a row
    rows_per_program,  # consecutive rows handled by one program
    GEMMA: tl.constexpr,  # the weight enters as (1 + w)
    COMPUTE_DX: tl.constexpr,  # write dL/dx
    COMPUTE_DW: tl.constexpr,  # write this program's partial dL/dw
    BLOCK_SIZE: tl.constexpr,  # power of two >= H
    BLOCK_ROWS: tl.constexpr,  # rows per tile, a power of two
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols

    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = 1.0 + w
    dw_acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)

    # A tile of BLOCK_ROWS rows per step keeps several rows' loads in flight; one row
    # at a time leaves the loop waiting on memory latency.  int64 loop bounds make
    # the row index int64, so row * stride cannot overflow.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for first_row in range(row_start, row_end, BLOCK_ROWS):
        rows = first_row + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        if COMPUTE_DX:
            u = dy * w[None, :]
            mean_ux = tl.sum(u * x_hat, axis=1) / n_cols
            dx = rstd[:, None] * (u - x_hat * mean_ux[:, None])
            tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if GEMMA:
                dw_acc += tl.sum(dy * x_hat, axis=0)
            else:
                dw_acc += tl.sum(dy * x_hat.to(X.dtype.element_ty).to(tl.float32), axis=0)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(..., H) -> (rows, H) with a unit stride along H (a view when possible)."""
    rows = t.reshape(-1, n_cols)
    if rows.stride(-1) != 1 and n_cols > 1:
        rows = rows.contiguous()
    return rows


# Backward launch shape: programs per SM (each keeps one fp32 dL/dw partial row)
# and warps per program (None: calculate_settings' choice for the row length).
# Chosen on an H200 with scripts/tune_kernels.py (CUDA-graph timing, bf16): one
# program of 16 warps per SM over 16384-element tiles moved 78% of the copy
# bandwidth at 16384 x 4096, against 47% for 4 programs of one row at a time.
BACKWARD_PROGRAMS_PER_SM = 1
BACKWARD_NUM_WARPS = 16
# Elements per backward tile (BLOCK_ROWS x BLOCK_SIZE).
BACKWARD_TILE_ELEMENTS = 16384
# Without dL/dw (a frozen weight, as in every LoRA run) programs keep no partial sums,
# so there can be many, each over a few rows.  Before these existed a frozen weight got
# one program per row inside a 16384-element tile, 3 of its 4 rows masked off: 95 us
# for 4096 x 4096 on an H200.  Swept there (scripts/tune_kernels.py, CUDA graphs): one
# tile of 4096 elements per program, 8 warps: 25.3 us (95% of the copy bandwidth) at
# 4096 x 4096, 93.7 us (103%) at 16384 x 4096, 19.0 us (95%) at 4096 x 3072; 16384-
# element tiles gave 62-82%.
BACKWARD_TILE_ELEMENTS_NO_DW = 4096
BACKWARD_TILES_PER_PROGRAM_NO_DW = 1
BACKWARD_NUM_WARPS_NO_DW = 8


def _backward_programs(device: torch.device, n_rows: int) -> int:
    """Programs sharing the rows in the backward pass, each with its own dL/dw partial."""
    if device.type == "cuda":
        # A few programs per SM: enough in flight to hide memory latency, while the
        # (programs, H) fp32 partial buffer stays small next to x.
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(n_rows, BACKWARD_PROGRAMS_PER_SM * sms)
    return min(n_rows, 8)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, gemma):
        n_cols = x.shape[-1]
        x_rows = _as_rows(x, n_cols)
        weight = weight.contiguous()
        n_rows = x_rows.shape[0]
        out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
        # Allocated in x's shape and returned as itself, not as a view of a (rows, H)
        # tensor: a caller may then modify it in place (Qwen3's q/k norms feed the in-place
        # RoPE), which autograd forbids on views made inside a custom Function.
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_size, num_warps = calculate_settings(n_cols)
        _rms_norm_forward_kernel[(n_rows,)](
            x_rows,
            weight,
            y.view(n_rows, n_cols),
            rstd,
            x_rows.stride(0),
            n_cols,
            eps,
            GEMMA=gemma,
            BLOCK_SIZE=block_size,
            num_warps=num_warps,
        )
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.gemma = gemma
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight, rstd = ctx.saved_tensors
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_rows, n_cols = x_rows.shape
        dy_rows = _as_rows(dy, n_cols)
        dx = torch.empty((n_rows, n_cols), dtype=x_rows.dtype, device=x_rows.device) if needs_dx else None
        block_size, num_warps = calculate_settings(n_cols)
        tile = BACKWARD_TILE_ELEMENTS if needs_dw else BACKWARD_TILE_ELEMENTS_NO_DW
        block_rows = max(1, min(16, tile // block_size))
        if needs_dw:
            n_programs = _backward_programs(x_rows.device, n_rows)
            rows_per_program = triton.cdiv(n_rows, n_programs)
            num_warps = BACKWARD_NUM_WARPS or num_warps
        else:
            rows_per_program = block_rows * BACKWARD_TILES_PER_PROGRAM_NO_DW
            num_warps = BACKWARD_NUM_WARPS_NO_DW or num_warps
        n_programs = triton.cdiv(n_rows, rows_per_program)
        dw_partial = (
            torch.empty((n_programs, n_cols), dtype=torch.float32, device=x_rows.device) if needs_dw else None
        )
        _rms_norm_backward_kernel[(n_programs,)](
            dy_rows,
            x_rows,
            weight,
            rstd,
            dx if needs_dx else x_rows,  # placeholders are never written
            dw_partial if needs_dw else rstd,
            dy_rows.stride(0),
            x_rows.stride(0),
            n_rows,
            n_cols,
            rows_per_program,
            GEMMA=ctx.gemma,
            COMPUTE_DX=needs_dx,
            COMPUTE_DW=needs_dw,
            BLOCK_SIZE=block_size,
            BLOCK_ROWS=block_rows,
            num_warps=num_warps,
        )
        dx = dx.view(ctx.x_shape) if needs_dx else None
        dw = dw_partial.sum(0).to(weight.dtype) if needs_dw else None
        return dx, dw, None, None


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_float_dtype("rms_norm: x", x)
    check_float_dtype("rms_norm: weight", weight)
    check_same_device(x=x, weight=weight)
    if x.dim() == 0:
        raise ValueError("rms_norm: x is a scalar; expected shape (..., H)")
    check_not_empty("rms_norm: x", x)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},) "
            f"to match the last dimension of x {tuple(x.shape)}"
        )
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm: eps must be a non-negative number, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading dims), differentiable.

    gemma=False: LlamaRMSNorm, output dtype promote_types(x.dtype, weight.dtype).
    gemma=True: GemmaRMSNorm (scale 1 + weight), output dtype x.dtype.
    """
    _check_inputs(x, weight, eps)
    if not use_triton(x):
        warn_reference_once("rms_norm", x.device.type)
        return rms_norm_reference(x, weight, eps, gemma)
    return _RMSNormFunction.apply(x, weight, float(eps), bool(gemma))
