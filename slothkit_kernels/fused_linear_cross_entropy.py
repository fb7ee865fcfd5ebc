"""Language-model head and cross-entropy fused, without the full (N, V) logits.

    logits = hidden @ W^T (+ b)                         # (N, V) -- never held whole
    logits = s * tanh(logits / s)                       # only with a soft-cap s
    loss   = cross_entropy(logits, labels)              # scalar

With a 256,000-entry vocabulary and 8,192 tokens the logits alone are 4 GiB in
bf16, and a plain ``F.cross_entropy(hidden @ W.T, labels)`` holds several such
tensors during its backward.  Here the tokens are processed in chunks of rows.
For each chunk, inside the forward:

    Z   = h_c @ W^T (+ b)          (c, V), input dtype, in one reused buffer
    loss rows and lse              Triton cross-entropy forward kernel
    G   = dloss_sum/dZ             Triton backward kernel, written into Z in place
    dh_c  = G @ W                  (c, H)
    dW   += G^T @ h_c              fp32, only if W requires grad
    db   += sum_rows G             fp32, only if b requires grad

The gradients are those of the *summed* loss (grad scale 1).  The loss is a
scalar and its gradients are linear in grad_output, so the backward only
multiplies the stored dh (and dW, db) by grad_output / normaliser, where the
normaliser is the count of non-ignored labels over ALL chunks ("mean"),
``num_items_in_batch`` (gradient accumulation), or 1 ("sum").  Scaling at the
end rather than inside the chunk keeps small fp16 gradients out of the subnormal
range.

Gradient derivation (G = dL/dZ, from the cross-entropy module, for Z before the soft-cap):
    with capped logits C = s * tanh(Z / s),  dC/dZ = 1 - tanh^2(Z / s) = 1 - (C / s)^2,
    G = (softmax(C) - onehot(y)) * (1 - tanh^2(Z / s))     (the last factor 1 without a cap)
    dL/dh = G W,   dL/dW = G^T h,   dL/db = sum_i G_i.

Memory beyond the inputs: one chunk of logits (about N*V/16 elements by
default), dh (N, H), two fp32 numbers per row; plus dW in fp32 and a
(V, H) scratch in the input dtype when W requires grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from .cross_entropy import (
    _cross_entropy_backward_,
    _cross_entropy_forward,
    check_labels_dtype,
    check_labels_in_range,
    cross_entropy_reference,
    validate_loss_options,
)
from .utils import (
    check_float_dtype,
    check_not_empty,
    check_same_device,
    use_triton,
    warn_reference_once,
)

REDUCTIONS = ("mean", "sum")

# Default chunking: about 1/CHUNKS_PER_PASS of the logits per chunk.  Fewer,
# larger chunks give the (chunk, V) @ (V, H) gradient matmul more output tiles
# (so more speed) at the cost of memory.
CHUNKS_PER_PASS = 16
# Below this many logits per chunk, splitting further only adds launches.
MIN_CHUNK_ELEMENTS = 1 << 22


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    lm_weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
    lm_bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: the full logits in the input dtype, then an fp32 cross-entropy."""
    logits = F.linear(hidden, lm_weight, lm_bias)  # (..., V)
    if num_items_in_batch is not None:
        total = cross_entropy_reference(logits, labels, ignore_index, softcap, "sum")
        return total / num_items_in_batch
    return cross_entropy_reference(logits, labels, ignore_index, softcap, reduction)


def default_chunk_size(n_rows: int, vocab_size: int) -> int:
    """Rows per chunk: the largest power of two <= N / CHUNKS_PER_PASS.

    Never fewer rows than make MIN_CHUNK_ELEMENTS logits, never more than N.
    """
    target = max(n_rows * vocab_size // CHUNKS_PER_PASS, MIN_CHUNK_ELEMENTS)
    rows = max(1, target // vocab_size)
    rows = triton.next_power_of_2(rows + 1) // 2  # largest power of two <= rows
    return max(1, min(rows, n_rows))


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,  # (N, H)
        weight,  # (V, H)
        bias,  # (V,) or None
        labels,  # (N,)
        normaliser,  # 0-d fp32 tensor (loss = sum / normaliser) or None (sum)
        ignore_index,
        softcap,
        chunk_size,
        needs_grad,  # (hidden, weight, bias)
    ):
        n_rows, hidden_size = hidden.shape
        vocab_size = weight.shape[0]
        device, dtype = hidden.device, hidden.dtype
        need_hidden, need_weight, need_bias = needs_grad
        need_any = need_hidden or need_weight or need_bias

        losses = torch.empty(n_rows, dtype=torch.float32, device=device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=device)
        logits_buffer = torch.empty(min(chunk_size, n_rows), vocab_size, dtype=dtype, device=device)
        one = torch.ones((), dtype=torch.float32, device=device)
        d_hidden = torch.empty_like(hidden) if need_hidden else None
        d_weight = d_weight_chunk = d_bias = None
        if need_weight:
            d_weight = torch.zeros(vocab_size, hidden_size, dtype=torch.float32, device=device)
            if dtype != torch.float32:
                d_weight_chunk = torch.empty_like(weight, memory_format=torch.contiguous_format)
        if need_bias:
            d_bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)

        weight_t = weight.t()  # (H, V)
        for start in range(0, n_rows, chunk_size):
            end = min(start + chunk_size, n_rows)
            h = hidden[start:end]  # (c, H)
            y = labels[start:end]  # (c,)
            z = logits_buffer[: end - start]  # (c, V)
            if bias is None:
                torch.mm(h, weight_t, out=z)
            else:
                torch.addmm(bias, h, weight_t, out=z)
            _cross_entropy_forward(z, y, losses[start:end], lse[start:end], ignore_index, softcap)
            if not need_any:
                continue
            _cross_entropy_backward_(z, y, lse[start:end], one, ignore_index, softcap)  # z := G
            if need_hidden:
                torch.mm(z, weight, out=d_hidden[start:end])
            if need_weight:
                if d_weight_chunk is None:
                    d_weight.addmm_(z.t(), h)
                else:
                    torch.mm(z.t(), h, out=d_weight_chunk)
                    d_weight.add_(d_weight_chunk)
            if need_bias:
                d_bias.add_(z.sum(dim=0, dtype=torch.float32))

        loss = losses.sum()
        if normaliser is not None:
            loss = loss / normaliser
        ctx.save_for_backward(d_hidden, d_weight, d_bias, normaliser)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        d_hidden, d_weight, d_bias, normaliser = ctx.saved_tensors
        scale = grad_output.float()
        if normaliser is not None:
            scale = scale / normaliser
        grad_hidden = grad_weight = grad_bias = None
        if d_hidden is not None:
            grad_hidden = d_hidden * scale  # stays in the input dtype (0-d scale)
        # Multiply in fp32 and round straight into the parameter's dtype (no fp32 temp).
        if d_weight is not None:
            grad_weight = torch.mul(d_weight, scale, out=torch.empty_like(d_weight, dtype=ctx.weight_dtype))
        if d_bias is not None:
            grad_bias = torch.mul(d_bias, scale, out=torch.empty_like(d_bias, dtype=ctx.bias_dtype))
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    lm_weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
    lm_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """``cross_entropy(hidden @ lm_weight.T + lm_bias, labels)`` without the full logits.

    Args:
        hidden: (..., H) fp32, fp16 or bf16.
        lm_weight: (V, H), same dtype as ``hidden``; usually frozen.
        labels: int64 or int32 of shape ``hidden.shape[:-1]`` (already shifted for
            causal LM).
        ignore_index: rows with this label add no loss and no gradient.
        softcap: if given, logits are soft-capped, softcap * tanh(logits / softcap).
        reduction: "mean" (over the non-ignored labels of all chunks; 0 with zero
            gradients if every label is ignored) or "sum".
        lm_bias: optional (V,) bias, same dtype as ``hidden``.
        chunk_size: rows per chunk; default :func:`default_chunk_size`.
        num_items_in_batch: if given, the loss is the sum divided by this number
            (gradient accumulation over several micro-batches, as in Hugging Face
            Trainer); ``reduction`` must then be left at "mean".
        check_labels: check every label is in [0, V) or ignore_index (one
            reduction and a device sync); ValueError otherwise.

    Returns:
        The scalar loss in fp32.  The gradients are computed during the forward
        (only for the inputs that require them, and only when grad mode is on);
        ``backward`` just scales them.
    """
    validate_loss_options(ignore_index, softcap, reduction, REDUCTIONS)
    for name, tensor in (("hidden", hidden), ("lm_weight", lm_weight), ("labels", labels)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_float_dtype("hidden", hidden)
    check_labels_dtype(labels)
    for name, tensor in (("lm_weight", lm_weight), ("lm_bias", lm_bias)):
        if tensor is not None and tensor.dtype != hidden.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but hidden has {hidden.dtype}; they must match")
    check_same_device(hidden=hidden, lm_weight=lm_weight, labels=labels, lm_bias=lm_bias)
    if hidden.dim() == 0 or labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape hidden.shape[:-1]; got hidden {tuple(hidden.shape)} "
            f"and labels {tuple(labels.shape)}"
        )
    if lm_weight.dim() != 2 or lm_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_weight must have shape (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}; "
            f"got {tuple(lm_weight.shape)}"
        )
    vocab_size = lm_weight.shape[0]
    if lm_bias is not None and lm_bias.shape != (vocab_size,):
        raise ValueError(f"lm_bias must have shape ({vocab_size},); got {tuple(lm_bias.shape)}")
    check_not_empty("hidden", hidden)
    check_not_empty("lm_weight", lm_weight)
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError("num_items_in_batch replaces the mean's normaliser; leave reduction at 'mean'")
        if not isinstance(num_items_in_batch, torch.Tensor) and not num_items_in_batch > 0:
            raise ValueError(f"num_items_in_batch must be positive, got {num_items_in_batch!r}")
    if check_labels:
        check_labels_in_range(labels, vocab_size, ignore_index)

    if not use_triton(hidden):
        warn_reference_once("fused_linear_cross_entropy", hidden.device.type)
        return fused_linear_cross_entropy_reference(
            hidden, lm_weight, labels, ignore_index, softcap, reduction, lm_bias, num_items_in_batch
        )

    hidden_2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # (N, H)
    labels_1d = labels.reshape(-1).contiguous()  # (N,)
    n_rows = hidden_2d.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(n_rows, vocab_size)

    if num_items_in_batch is not None:
        normaliser = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    elif reduction == "mean":
        normaliser = (labels_1d != ignore_index).sum().clamp_min(1).to(torch.float32)
    else:
        normaliser = None

    grad_on = torch.is_grad_enabled()
    needs_grad = (
        grad_on and hidden.requires_grad,
        grad_on and lm_weight.requires_grad,
        grad_on and lm_bias is not None and lm_bias.requires_grad,
    )
    return FusedLinearCrossEntropyFunction.apply(
        hidden_2d, lm_weight, lm_bias, labels_1d, normaliser, ignore_index, softcap, chunk_size, needs_grad
    )
