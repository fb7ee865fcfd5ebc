"""The GEMMs of one LoRA projection, forward and backward, outside autograd, and how a
Function saves its projections on ``ctx``: what the autograd Functions of
``attention`` and ``gated_mlp`` are built from.

Forward Y = X W^T + s (X A^T) B^T (+ bias) (``projection``).  Backward, given
dY (N, out):

    dX = dY W + s (dY B) A
    dA = s (dY B)^T X                               (r, in)
    dB = s dY^T (X A^T)                             (out, r)

X A^T (N, r) is tiny, so it is saved from the forward pass instead of being
recomputed.  In dX = dY W a large NF4 W wider than tall is dequantised a column
slab at a time (``NF4_SLAB_BYTES``): dX[:, c] = dY W[:, c] writes disjoint columns of
dX, so the slabs cost no extra traffic over dX, and the transient 16-bit copy of W,
which sits at the top of a QLoRA step's memory (the MLP's dL/dh = dY W_down beside e
and g), shrinks to a slab.  Only the gradients autograd asks for are computed
(``ctx.needs_input_grad``): the first layer's input often needs none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slothkit_kernels.lora.projection import _N_FIELDS, LoRAProjection, _base_weight
from slothkit_kernels.nf4.weight import NF4Weight


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scaling: float, out: torch.Tensor | None = None):
    """scaling * (a @ b) as one GEMM: the scale rides in the GEMM's alpha, where a
    separate multiply would be one more launch and one more pass over the product.
    beta = 0, so whatever ``out`` held is ignored (NaN included)."""
    if out is None:
        out = a.new_empty((a.shape[0], b.shape[1]))
    return out.addmm_(a, b, beta=0, alpha=scaling)


def _projection_forward(x2d: torch.Tensor, proj: LoRAProjection, lead_shape=None):
    """Y = X W^T + s (X A^T) B^T + bias; returns (Y, X A^T or None).

    With ``lead_shape``, Y is returned as a fresh (*lead_shape, out) tensor rather
    than a view of a 2-D one: autograd forbids in-place changes (such as RoPE's)
    to view outputs of a Function with several outputs.
    """
    dtype = x2d.dtype
    bias = None if proj.bias is None else proj.bias.to(dtype)
    if proj.lora_a is None:
        xa = None
        if lead_shape is None:
            return F.linear(x2d, _base_weight(proj.weight, dtype), bias), None
    else:
        xa = x2d @ proj.lora_a.to(dtype).t()  # (N, r)
    lead = x2d.shape[:1] if lead_shape is None else lead_shape
    shaped = torch.empty((*lead, proj.out_features), dtype=dtype, device=x2d.device)
    y = shaped.view(-1, proj.out_features)  # (N, out), same storage
    w = _base_weight(proj.weight, dtype)
    if xa is None:
        torch.mm(x2d, w.t(), out=y)
    else:
        # The rank-r term first, then the base GEMM accumulates onto it (beta = 1): the GEMM
        # reads it in its epilogue while it is compute-bound, where adding it afterwards
        # would be a separate memory-bound read and write of the whole (N, out) output.
        _scaled_mm(xa, proj.lora_b.to(dtype).t(), proj.scaling, out=y)
        y.addmm_(x2d, w.t())
    del w
    if bias is not None:
        y.add_(bias)
    return shaped, xa


def _adapter_backward(dy, xa, x2d, proj: LoRAProjection, need_x: bool, need_a: bool, need_b: bool):
    """The adapter's share of one projection's backward.

    Returns (s dY B or None, dA or None, dB or None); s dY B (N, r) is what dX needs from
    the adapter: dX = dY W + (s dY B) A.
    """
    if proj.lora_a is None:
        return None, None, None
    dtype = dy.dtype
    d_a = d_b = dyb_s = None
    if need_x or need_a:
        dyb_s = _scaled_mm(dy, proj.lora_b.to(dtype), proj.scaling)  # s dY B: (N, r)
    if need_a:
        d_a = (dyb_s.t() @ x2d).to(proj.lora_a.dtype)  # (r, in)
    if need_b:
        d_b = _scaled_mm(dy.t(), xa, proj.scaling).to(proj.lora_b.dtype)  # (out, r)
    return dyb_s, d_a, d_b


# The most a backward GEMM's dequantised NF4 weight may take at once (see the module
# docstring): Llama-3-8B's and Mistral-7B's 112 MiB down-projection weights go in two.
# Measured on an H200 (scripts/slab_gemm_timing.py, 4096 tokens, bf16), dequantise + GEMM
# of the (4096, 14336) weight: whole 0.746 ms, two slabs 0.778, four 0.900.  Two slabs
# take 56 MB off the QLoRA peak for about 1 ms per Llama-3-8B step.
NF4_SLAB_BYTES = 64 * 2**20


def _backward_slabs(weight, dtype: torch.dtype) -> list[tuple[int, int]] | None:
    """The column slabs dX = dY W runs in, or None to dequantise W whole.

    Only a weight wider than tall (in > out) is split.  A slab's GEMM is
    (N, out) x (out, width): for a tall weight (Llama-3-8B's gate and up, 14336 x 4096)
    the slabs are narrow outputs against a long K, slower than the whole GEMM (0.747 ms
    whole, 0.897 in two slabs on an H200), and a tall weight's dX is the narrow side of
    the layer, so its transient copy is not at the top of the step's memory."""
    if not isinstance(weight, NF4Weight) or weight.dtype != dtype:
        return None
    if weight.shape[-1] <= weight.shape[0]:  # tall (or 1-D): whole
        return None
    return weight.column_slabs(NF4_SLAB_BYTES)  # None for what is not 2-D whole-block rows


def _add_in_slabs(dx, dy, weight: NF4Weight, slabs: list[tuple[int, int]]):
    """dx + dY W (or dY W when dx is None), W dequantised one column slab at a time."""
    from slothkit_kernels.nf4.dequantize import dequantize_nf4

    beta = 1
    if dx is None:
        dx, beta = dy.new_empty((dy.shape[0], weight.shape[1])), 0  # beta = 0: never read
    for start, stop in slabs:
        w = dequantize_nf4(weight, columns=(start, stop))  # (out, stop - start)
        dx[:, start:stop].addmm_(dy, w, beta=beta)  # a strided slab: cuBLAS writes it in place
        del w
    return dx


def _add_base_term(dx, dy, weight):
    """dx + dY W, or dY W when dx is None (in slabs where ``_backward_slabs`` says)."""
    slabs = _backward_slabs(weight, dy.dtype)
    if slabs is not None:
        return _add_in_slabs(dx, dy, weight, slabs)
    w = _base_weight(weight, dy.dtype)
    return dy @ w if dx is None else dx.addmm_(dy, w)


def _input_gradient(terms, adapter_terms):
    """dX = sum_i dY_i W_i + sum_i (s_i dY_i B_i) A_i over projections of one input.

    terms: (dY_i, projection_i); adapter_terms: (s dY B, A) of those with an adapter.
    The rank-r terms go first, as one GEMM over their concatenated ranks (one write of
    dX), then every base GEMM accumulates onto dX with beta = 1, reading it in its
    epilogue; adding the rank-r terms afterwards would cost a memory-bound read and
    write of dX per projection. Each dY_i is dropped from ``terms`` once its GEMM is
    queued, so that a caller that holds no other reference frees it there.
    """
    dx = None
    if adapter_terms:
        dtype = adapter_terms[0][0].dtype
        left = torch.cat([t for t, _ in adapter_terms], dim=1)  # (N, sum of ranks)
        right = torch.cat([a for _, a in adapter_terms]).to(dtype)  # (sum of ranks, in); one cast
        dx = left @ right  # (N, in)
    for i in range(len(terms)):
        dy, proj = terms[i]
        terms[i] = None
        dx = _add_base_term(dx, dy, proj.weight)
        del dy
    return dx


def _save_projections(ctx, x, projs, products, *extra) -> None:
    """save_for_backward(x, *extra, then per projection W, A, B, X A^T).

    A 16-bit W is a frozen parameter, so saving it costs nothing; an NF4Weight is
    not a tensor and is kept on ctx (its packed codes, never a dequantised copy).
    The bias is not needed in backward.
    """
    saved = []
    for p, xa in zip(projs, products):
        saved += [p.weight if isinstance(p.weight, torch.Tensor) else None, p.lora_a, p.lora_b, xa]
    ctx.save_for_backward(x, *extra, *saved)
    ctx.nf4 = [None if isinstance(p.weight, torch.Tensor) else p.weight for p in projs]
    ctx.scalings = [p.scaling for p in projs]


def _load_projections(ctx, saved) -> list[tuple[LoRAProjection, torch.Tensor | None]]:
    """(projection, X A^T) pairs from what _save_projections stored."""
    pairs = []
    for i, (nf4, scaling) in enumerate(zip(ctx.nf4, ctx.scalings)):
        weight, a, b, xa = saved[4 * i : 4 * i + 4]
        pairs.append((LoRAProjection(weight if nf4 is None else nf4, a, b, scaling), xa))
    return pairs


def _adapter_needs(ctx, first: int, i: int) -> tuple[bool, bool]:
    """needs_input_grad of (A, B) of the i-th projection whose fields start at ``first``."""
    need = ctx.needs_input_grad
    return need[first + _N_FIELDS * i + 1], need[first + _N_FIELDS * i + 2]
