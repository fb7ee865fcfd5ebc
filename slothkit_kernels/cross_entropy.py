"""Cross-entropy over a large vocabulary, with optional Gemma-2 logit soft-capping.

For row i with logits x_i (length V), label y_i and soft-cap s:

    z_ij   = s * tanh(x_ij / s)          (z = x without soft-capping)
    lse_i  = log sum_j exp(z_ij)
    loss_i = lse_i - z_{i, y_i}          (0 when y_i == ignore_index)

One Triton program handles one row and walks the vocabulary in blocks, keeping a
running maximum m and a running sum d of exp(z - m) (the "online softmax"):

    m' = max(m, max_j z_j),   d' = d * exp(m - m') + sum_j exp(z_j - m')

so V is not limited by the block size (Gemma's 256,000 and beyond).  All
arithmetic is fp32 whatever the storage dtype.  The forward keeps only lse_i.

Backward.  With g_i = dL/dloss_i (grad_output, divided by the number of
non-ignored labels for reduction="mean"):

    dL/dz_ij = g_i * (softmax(z_i)_j - [j == y_i]),   softmax(z_i)_j = exp(z_ij - lse_i)
    dz/dx    = 1 - tanh^2(x / s) = 1 - (z / s)^2
    dL/dx_ij = g_i * (exp(z_ij - lse_i) - [j == y_i]) * (1 - tanh^2(x_ij / s))

and dL/dx_ij = 0 for ignored rows.  The backward kernel writes dL/dx INTO the
logits buffer (each element is read, then overwritten by its own gradient) and
returns that buffer as the gradient: no fp32 copy of the logits and no second
N x V allocation.  So after ``loss.backward()`` the logits tensor holds its own
gradient (and when the logits are a leaf, ``logits.grad`` shares their storage).  The kernel bumps the tensor's autograd version counter, so autograd
raises its usual "modified by an inplace operation" error (rather than silently
computing garbage) if anything else still needs the logits in its backward,
e.g. a second loss on the same logits or an op that saved them.

reduction="mean" divides by the number of non-ignored labels.  When every label
is ignored that count is 0; the loss is then 0 with all-zero gradients (not NaN,
unlike torch.nn.functional.cross_entropy).

The loss is always returned in fp32 (as Hugging Face's loss does, which upcasts
the logits); the gradient has the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .utils import (
    calculate_settings,
    check_float_dtype,
    check_not_empty,
    check_same_device,
    tanh,
    use_triton,
    warn_reference_once,
)

REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (torch.int64, torch.int32)

# Elements one program loads per step along a row.  Long rows loop; short rows
# use the next power of two of their length.
MAX_BLOCK_SIZE = 8192


def cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Plain-torch cross-entropy with the same conventions as :func:`cross_entropy`."""
    vocab_size = logits.shape[-1]
    z = logits.reshape(-1, vocab_size).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    flat_labels = labels.reshape(-1).long()
    losses = F.cross_entropy(z, flat_labels, ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return losses.reshape(labels.shape)
    if reduction == "sum":
        return losses.sum()
    count = (flat_labels != ignore_index).sum().clamp_min(1)
    return losses.sum() / count


@triton.jit
def _cross_entropy_forward_kernel(
    LOGITS,  # pointer to the logits, (N, V), last dimension contiguous
    LABELS,  # pointer to the labels, (N,), int32 or int64
    LOSS,  # pointer to the per-row loss, (N,) fp32, written
    LSE,  # pointer to the per-row log-sum-exp, (N,) fp32, written
    stride_row,  # elements between the starts of consecutive rows of LOGITS
    V,  # vocabulary size (row length)
    ignore_index,  # label marking a row that contributes no loss
    softcap,  # s in z = s * tanh(x / s); unused unless HAS_SOFTCAP
    HAS_SOFTCAP: tl.constexpr,  # whether to soft-cap the logits
    BLOCK_SIZE: tl.constexpr,  # elements per step along the row
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row).to(tl.int64)
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        tl.store(LSE + row, 0.0)
        return
    LOGITS += row * stride_row  # int64: row * stride can exceed 2^31

    m = float("-inf")  # running maximum of z
    d = 0.0  # running sum of exp(z - m)
    for start in range(0, V, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        mask = cols < V
        z = tl.load(LOGITS + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # While every logit so far is -inf (e.g. masked-out vocabulary entries),
        # shift by 0 instead of m_new so that exp(-inf - -inf) never makes NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
    lse = m + tl.log(d)

    # A label outside [0, V) (possible only with check_labels=False) gives a NaN
    # loss rather than an out-of-bounds read.
    in_range = (label >= 0) & (label < V)
    z_label = tl.load(LOGITS + label, mask=in_range, other=float("nan")).to(tl.float32)
    if HAS_SOFTCAP:
        z_label = softcap * tanh(z_label / softcap)
    tl.store(LOSS + row, lse - z_label)
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_backward_kernel(
    LOGITS,  # pointer to the logits, (N, V); overwritten with dL/dlogits
    LABELS,  # pointer to the labels, (N,), int32 or int64
    LSE,  # pointer to the per-row log-sum-exp from the forward, (N,) fp32
    GRAD_SCALE,  # pointer to g_i = dL/dloss_i, read at row * stride_scale
    stride_row,  # elements between the starts of consecutive rows of LOGITS
    stride_scale,  # stride of GRAD_SCALE (0 when one scale serves every row)
    V,  # vocabulary size (row length)
    ignore_index,  # label marking a row whose gradient is zero
    softcap,  # s in z = s * tanh(x / s); unused unless HAS_SOFTCAP
    HAS_SOFTCAP: tl.constexpr,  # whether the logits were soft-capped
    BLOCK_SIZE: tl.constexpr,  # elements per step along the row
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row).to(tl.int64)
    LOGITS += row * stride_row
    if label == ignore_index:
        for start in range(0, V, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            zeros = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            tl.store(LOGITS + cols, zeros.to(LOGITS.dtype.element_ty), mask=cols < V)
        return

    scale = tl.load(GRAD_SCALE + row * stride_scale).to(tl.float32)
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        mask = cols < V
        x = tl.load(LOGITS + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            t = tanh(x / softcap)
            z = softcap * t
        else:
            z = x
        grad = tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)
        grad = grad * scale
        if HAS_SOFTCAP:
            grad = grad * (1.0 - t * t)
        tl.store(LOGITS + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def _launch_settings(vocab_size: int) -> tuple[int, int]:
    return calculate_settings(min(vocab_size, MAX_BLOCK_SIZE))


def _cross_entropy_forward(
    logits: torch.Tensor,  # (N, V), stride(1) == 1
    labels: torch.Tensor,  # (N,)
    loss: torch.Tensor,  # (N,) fp32, written
    lse: torch.Tensor,  # (N,) fp32, written
    ignore_index: int,
    softcap: float | None,
) -> None:
    n_rows, vocab_size = logits.shape
    block_size, num_warps = _launch_settings(vocab_size)
    _cross_entropy_forward_kernel[(n_rows,)](
        logits,
        labels,
        loss,
        lse,
        logits.stride(0),
        vocab_size,
        ignore_index,
        0.0 if softcap is None else float(softcap),
        HAS_SOFTCAP=softcap is not None,
        BLOCK_SIZE=block_size,
        num_warps=num_warps,
    )


def _cross_entropy_backward_(
    logits: torch.Tensor,  # (N, V), stride(1) == 1; overwritten with the gradient
    labels: torch.Tensor,  # (N,)
    lse: torch.Tensor,  # (N,) fp32
    grad_scale: torch.Tensor,  # 0-d (one scale for all rows) or (N,)
    ignore_index: int,
    softcap: float | None,
) -> None:
    n_rows, vocab_size = logits.shape
    block_size, num_warps = _launch_settings(vocab_size)
    stride_scale = 0 if grad_scale.dim() == 0 else grad_scale.stride(0)
    _cross_entropy_backward_kernel[(n_rows,)](
        logits,
        labels,
        lse,
        grad_scale,
        logits.stride(0),
        stride_scale,
        vocab_size,
        ignore_index,
        0.0 if softcap is None else float(softcap),
        HAS_SOFTCAP=softcap is not None,
        BLOCK_SIZE=block_size,
        num_warps=num_warps,
    )


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, softcap, reduction):
        n_rows = logits.shape[0]
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        _cross_entropy_forward(logits, labels, losses, lse, ignore_index, softcap)

        count = None
        if reduction == "none":
            out = losses
        elif reduction == "sum":
            out = losses.sum()
        else:
            # Stays on the device: no host sync for the normaliser.
            count = (labels != ignore_index).sum().clamp_min(1).to(torch.float32)
            out = losses.sum() / count
        ctx.save_for_backward(logits, labels, lse, count)
        ctx.ignore_index = ignore_index
        ctx.softcap = softcap
        return out

    @staticmethod
    def backward(ctx, grad_output):
        logits, labels, lse, count = ctx.saved_tensors
        grad_scale = grad_output.float()
        if count is not None:
            grad_scale = grad_scale / count
        _cross_entropy_backward_(logits, labels, lse, grad_scale, ctx.ignore_index, ctx.softcap)
        # The logits now hold their gradient: make autograd refuse any later use
        # of the old values instead of silently reading the gradient.
        torch.autograd.graph.increment_version(logits)
        return logits, None, None, None, None


def check_labels_in_range(labels: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """Raise ValueError unless every label is in [0, num_classes) or equals ignore_index.

    One min/max reduction and one device-to-host copy of two numbers (a sync).
    """
    kept = torch.where(labels == ignore_index, torch.zeros_like(labels), labels)
    low, high = torch.stack(torch.aminmax(kept)).tolist()
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise ValueError(
            f"labels must lie in [0, {num_classes}) (the vocabulary size) or equal "
            f"ignore_index={ignore_index}; found {bad}"
        )


def validate_loss_options(ignore_index, softcap, reduction, reductions=REDUCTIONS) -> None:
    if reduction not in reductions:
        raise ValueError(f"reduction must be one of {reductions}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a positive number or None, got {softcap!r}")
        if not (0 < softcap < float("inf")):
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")


def check_labels_dtype(labels: torch.Tensor) -> None:
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"labels has dtype {labels.dtype}; supported: int64, int32")


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
    check_labels: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V) against integer ``labels`` (...).

    Args:
        logits: fp32, fp16 or bf16, any vocabulary size V.  After ``backward`` this
            tensor holds its own gradient (see the module docstring); if it must
            survive, pass a copy.  A non-contiguous input is copied first, and then
            only the copy is overwritten.
        labels: int64 or int32, shape ``logits.shape[:-1]``.
        ignore_index: rows with this label add no loss and get a zero gradient.
        softcap: if given, the logits are soft-capped, z = softcap * tanh(logits /
            softcap), before the softmax (Gemma 2).
        reduction: "mean" (over non-ignored labels; 0 if there are none), "sum" or
            "none" (per-row losses of shape ``labels.shape``, 0 on ignored rows).
        check_labels: check on the host that every label is in [0, V) or equals
            ignore_index, raising ValueError otherwise.  This costs one small
            reduction and a device sync; with False, an out-of-range label gives a
            NaN loss for its row.

    Returns:
        The loss in fp32.
    """
    validate_loss_options(ignore_index, softcap, reduction)
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be torch.Tensors")
    check_float_dtype("logits", logits)
    check_labels_dtype(labels)
    check_same_device(logits=logits, labels=labels)
    if logits.dim() == 0 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape logits.shape[:-1]; got logits {tuple(logits.shape)} "
            f"and labels {tuple(labels.shape)}"
        )
    check_not_empty("logits", logits)
    vocab_size = logits.shape[-1]
    if check_labels:
        check_labels_in_range(labels, vocab_size, ignore_index)

    if not use_triton(logits):
        warn_reference_once("cross_entropy", logits.device.type)
        return cross_entropy_reference(logits, labels, ignore_index, softcap, reduction)

    logits_2d = logits.reshape(-1, vocab_size)  # (N, V)
    if logits_2d.stride(1) != 1:
        logits_2d = logits_2d.contiguous()
    labels_1d = labels.reshape(-1).contiguous()  # (N,)
    loss = CrossEntropyFunction.apply(logits_2d, labels_1d, ignore_index, softcap, reduction)
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    return loss
