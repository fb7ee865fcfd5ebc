"""LoRA-adapted projections with hand-derived backward passes.

A projection has a frozen base weight W (out, in), either a 16-bit tensor or an
``NF4Weight`` (dequantised on the fly, in forward and again in backward, never
kept in 16-bit), an optional frozen bias, and an optional adapter A (r, in),
B (out, r) with scale s:

    Y = X W^T + s (X A^T) B^T (+ bias)              X: (N, in), Y: (N, out)

Backward, given dY (N, out):

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

Precision.  PEFT keeps A and B in fp32 while the base runs in bf16/fp16; here the
adapter matmuls run in the compute dtype (A and B are cast, which is cheap) and
dA, dB are returned in A's and B's own dtype.  The compute dtype is x's dtype, or
the autocast dtype when torch autocast is on (then x and a 16-bit W are cast to
it, as autocast would for ``F.linear``).  Without autocast a tensor W must have
x's dtype.  LoRA dropout is not modelled: use these with ``lora_dropout=0``.

Fused blocks:

* ``lora_qkv``: q, k, v projections of one input.  X is saved once and
  dX = sum over the three projections of the dX above.
* ``lora_mlp``: e = X Wg'^T, g = X Wu'^T, h = act(e) * g, Y = h Wd'^T (' = with
  adapter).  Saved: X, e, g and the (N, r) adapter products.  Backward:
      dh            = dY Wd + s_d (dY B_d) A_d
      h, de, dg     = fused activation backward (recomputes h; written into the
                      buffers of dh, e, g, so no new (N, intermediate) tensors)
      dA_d = s_d (dY B_d)^T h,   dB_d = s_d dY^T (h A_d^T)
      gate and up projections as above with dY := de and dg, their dX summed.
  Because e and g are overwritten, the block's backward can run only once (no
  ``retain_graph=True`` double backward); a second attempt raises.
* ``lora_mlp(..., token_chunk=C)``: the same over chunks of C tokens, for long
  sequences, where the (N, intermediate) tensors dominate a layer's memory (Llama-3-70B
  at 96K tokens: e, g and dh are 16 GiB).  Without autograd (a checkpointed forward, a
  prefill) each chunk runs in turn into one output.  In a recompute (backward_only) the
  forward saves only X, and backward runs each chunk's backward_only forward and
  backward in turn, summing the adapters' gradients over the chunks: the same FLOPs as
  the whole (the recompute's gate and up projections move into backward), the
  (N, intermediate) tensors C rows at a time.  A forward that autograd records without
  backward_only (a layer that is not checkpointed keeps e and g whole anyway) is not
  chunked.
* ``lora_o_residual``: Y = R + X Wo'^T, the residual sum after attention.  Given
  that sum already (a checkpointed forward kept it), it returns it as it is and
  runs no GEMM; backward is still the sum's: dR = dY, dX, dA, dB as above, with
  X A^T recomputed there (N x r, cheap) for dB.

The functions here are torch matmuls and run on any device; the Triton kernels
they call (the fused activations, NF4 dequantisation) dispatch by themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slothkit_kernels.geglu import geglu_backward, geglu_forward, geglu_reference
from slothkit_kernels.nf4_weight import NF4Weight
from slothkit_kernels.rope import rotate
from slothkit_kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_reference
from slothkit_kernels.utils import check_float_dtype, check_not_empty

ACTIVATIONS = ("swiglu", "geglu_tanh", "geglu")


@dataclass
class LoRAProjection:
    weight: torch.Tensor | NF4Weight  # frozen base, (out_features, in_features)
    lora_a: torch.Tensor | None  # (r, in_features), trainable; None = no adapter
    lora_b: torch.Tensor | None  # (out_features, r)
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA
    bias: torch.Tensor | None = None  # frozen base-layer bias (out_features,), no grad

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def fields(self) -> tuple:
        return (self.weight, self.lora_a, self.lora_b, self.scaling, self.bias)

    def fields_in(self, dtype: torch.dtype) -> tuple:
        """fields() with A and B cast to the compute dtype *before* the autograd Function.
        Autograd records the casts, so the Function's backward needs none of its own and
        returns the adapter gradients in ``dtype``, which the casts' backward turns back
        into the parameters' dtype: the same values as casting inside, fewer launches."""
        a, b = self.lora_a, self.lora_b
        if a is not None:
            a, b = a.to(dtype), b.to(dtype)
        return (self.weight, a, b, self.scaling, self.bias)


_N_FIELDS = 5  # LoRAProjection.fields() as passed to Function.apply


def _base_weight(weight: torch.Tensor | NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The base weight as a (out, in) tensor of ``dtype``; NF4 is dequantised afresh."""
    if isinstance(weight, NF4Weight):
        from slothkit_kernels.nf4 import dequantize_nf4

        weight = dequantize_nf4(weight)
    return weight if weight.dtype == dtype else weight.to(dtype)


# ----------------------------------------------------------------------------
# References (plain torch, differentiated by autograd)
# ----------------------------------------------------------------------------


def lora_linear_reference(x: torch.Tensor, proj: LoRAProjection) -> torch.Tensor:
    """Same math as ``lora_linear`` through autograd (W of an NF4 weight dequantised)."""
    dtype = x.dtype
    y = F.linear(x, _base_weight(proj.weight, dtype), None if proj.bias is None else proj.bias.to(dtype))
    if proj.lora_a is not None:
        xa = F.linear(x, proj.lora_a.to(dtype))
        y = y + proj.scaling * F.linear(xa, proj.lora_b.to(dtype))
    return y


def lora_qkv_reference(x, q_proj, k_proj, v_proj):
    return tuple(lora_linear_reference(x, p) for p in (q_proj, k_proj, v_proj))


def lora_mlp_reference(x, gate_proj, up_proj, down_proj, activation="swiglu"):
    e = lora_linear_reference(x, gate_proj)
    g = lora_linear_reference(x, up_proj)
    if activation == "swiglu":
        h = swiglu_reference(e, g)
    else:
        h = geglu_reference(e, g, "tanh" if activation == "geglu_tanh" else "none")
    return lora_linear_reference(h, down_proj)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _check_projection(
    name: str, proj: LoRAProjection, in_features: int, x: torch.Tensor, dtype: torch.dtype
) -> None:
    if not isinstance(proj, LoRAProjection):
        raise TypeError(f"{name} must be a LoRAProjection, got {type(proj).__name__}")
    w = proj.weight
    if not isinstance(w, (torch.Tensor, NF4Weight)):
        raise TypeError(f"{name}.weight must be a torch.Tensor or NF4Weight, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"{name}.weight must be (out_features, in_features), got shape {tuple(w.shape)}")
    out_features = w.shape[0]
    if w.shape[1] != in_features:
        raise ValueError(
            f"{name}.weight has in_features={w.shape[1]} but its input has last dimension {in_features}"
        )
    if w.device != x.device:
        raise ValueError(f"{name}.weight is on {w.device} but the input is on {x.device}")
    if isinstance(w, torch.Tensor):
        check_float_dtype(f"{name}.weight", w)
        if w.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{name}.weight has dtype {w.dtype} but the input has {dtype}; they must "
                f"match (or run under torch.autocast)"
            )
        if w.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name}.weight requires grad, but the base weight of a LoRA projection is "
                f"frozen and gets no gradient; call weight.requires_grad_(False)"
            )
    if proj.bias is not None:
        if proj.bias.shape != (out_features,):
            raise ValueError(f"{name}.bias has shape {tuple(proj.bias.shape)}, expected ({out_features},)")
        if proj.bias.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name}.bias requires grad, but the base bias is frozen here; "
                f"call bias.requires_grad_(False)"
            )
    a, b = proj.lora_a, proj.lora_b
    if (a is None) != (b is None):
        raise ValueError(f"{name}: lora_a and lora_b must both be tensors or both be None")
    if a is None:
        return
    check_float_dtype(f"{name}.lora_a", a)
    check_float_dtype(f"{name}.lora_b", b)
    if a.dim() != 2 or a.shape[1] != in_features:
        raise ValueError(f"{name}.lora_a must be (r, {in_features}), got shape {tuple(a.shape)}")
    if b.dim() != 2 or b.shape[0] != out_features:
        raise ValueError(f"{name}.lora_b must be ({out_features}, r), got shape {tuple(b.shape)}")
    if a.shape[0] != b.shape[1]:
        raise ValueError(
            f"{name}: rank mismatch, lora_a has r={a.shape[0]} rows but lora_b has r={b.shape[1]} columns"
        )
    for part, t in (("lora_a", a), ("lora_b", b)):
        if t.device != x.device:
            raise ValueError(f"{name}.{part} is on {t.device} but the input is on {x.device}")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("x", x)
    check_not_empty("x", x)
    if x.dim() < 1:
        raise ValueError("x must have shape (..., in_features)")


# ----------------------------------------------------------------------------
# One projection, forward and backward, without autograd
# ----------------------------------------------------------------------------


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
    from slothkit_kernels.nf4 import dequantize_nf4

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


# ----------------------------------------------------------------------------
# autograd Functions
# ----------------------------------------------------------------------------


def _heads(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, heads * D) -> the (B, heads, T, D) view RoPE rotates."""
    return y.view(*y.shape[:-1], -1, head_dim).transpose(1, 2)


class _LoRAProjectionsFunction(torch.autograd.Function):
    """k projections of one shared input (k = 1 for lora_linear, 3 for lora_qkv).

    apply(x, rotary, *fields of projection 1, ..., *fields of projection k).
    rotary: None, or (cos, sin, position_ids, head_dim) to rotate the first two outputs
    (q and k) in place before returning them; backward applies the transpose rotation to
    their gradients first. Doing it here rather than through ``rope`` on views of the
    outputs spares autograd's bookkeeping for a view modified in place (a clone, a zero
    fill and a copy of each gradient) and rotates both gradients in one launch.
    """

    @staticmethod
    def forward(ctx, x, rotary, *flat):
        projs = [LoRAProjection(*flat[i : i + _N_FIELDS]) for i in range(0, len(flat), _N_FIELDS)]
        x2d = x.reshape(-1, x.shape[-1])  # (N, in)
        outs, products = [], []
        with torch.autocast(x.device.type, enabled=False):
            for p in projs:
                y, xa = _projection_forward(x2d, p, lead_shape=x.shape[:-1])
                outs.append(y)
                products.append(xa)
            if rotary is not None:
                cos, sin, position_ids, head_dim = rotary
                rotate(_heads(outs[0], head_dim), _heads(outs[1], head_dim), cos, sin, position_ids)
        _save_projections(ctx, x, projs, products)
        ctx.rotary = rotary  # cos/sin are inputs that get no gradient: safe to keep on ctx
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *saved = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        x2d = x.reshape(-1, x.shape[-1])
        dx = None
        adapter_grads, terms, adapter_terms = [], [], []
        with torch.autocast(x.device.type, enabled=False):
            if ctx.rotary is not None:
                grads = _unrotate_gradients(grads, ctx.rotary, x.dtype)
            for i, ((proj, xa), dy) in enumerate(zip(_load_projections(ctx, saved), grads)):
                need_a, need_b = _adapter_needs(ctx, 2, i)  # fields start after x, rotary
                dy = dy.reshape(-1, dy.shape[-1]).to(x.dtype)  # (N, out_i)
                dyb_s, d_a, d_b = _adapter_backward(dy, xa, x2d, proj, need_x, need_a, need_b)
                adapter_grads += [None, d_a, d_b, None, None]
                terms.append((dy, proj))
                if dyb_s is not None and need_x:
                    adapter_terms.append((dyb_s, proj.lora_a))
            if need_x:
                dx = _input_gradient(terms, adapter_terms)
        if dx is not None:
            dx = dx.view(x.shape)
        return (dx, None, *adapter_grads)


def _unrotate_gradients(grads, rotary, dtype):
    """dL/d(q, k before RoPE) = R^T dL/d(q, k after), written to new buffers (autograd may
    share an incoming gradient with other consumers); v's gradient passes through.
    Autograd hands unused outputs' gradients over as zeros (materialised), never None."""
    cos, sin, position_ids, head_dim = rotary
    dq, dk = (g.to(dtype) if g.stride(-1) == 1 else g.to(dtype).contiguous() for g in grads[:2])
    dq_pre, dk_pre = (
        torch.empty_like(dq, memory_format=torch.contiguous_format),
        torch.empty_like(dk, memory_format=torch.contiguous_format),
    )
    rotate(
        _heads(dq, head_dim),
        _heads(dk, head_dim),
        cos,
        sin,
        position_ids,
        inverse=True,
        q_out=_heads(dq_pre, head_dim),
        k_out=_heads(dk_pre, head_dim),
        check_positions=False,
    )
    return (dq_pre, dk_pre, *grads[2:])


def _activation_launchers(activation: str):
    if activation == "swiglu":
        return swiglu_forward, swiglu_backward
    approximate = "tanh" if activation == "geglu_tanh" else "none"
    return (
        lambda e, g: geglu_forward(e, g, approximate),
        lambda dh, e, g, inplace: geglu_backward(dh, e, g, approximate, inplace=inplace),
    )


class _LoRAMLPFunction(torch.autograd.Function):
    """apply(x, activation, backward_only, *gate fields, *up fields, *down fields)."""

    @staticmethod
    def forward(ctx, x, activation, backward_only, *flat):
        gate, up, down = (LoRAProjection(*flat[i : i + _N_FIELDS]) for i in (0, 5, 10))
        act_forward, _ = _activation_launchers(activation)
        x2d = x.reshape(-1, x.shape[-1])  # (N, hidden)
        with torch.autocast(x.device.type, enabled=False):
            e, xa_g = _projection_forward(x2d, gate)  # (N, intermediate)
            g, xa_u = _projection_forward(x2d, up)  # (N, intermediate)
            if backward_only:
                # Backward needs e and g only: h is rebuilt there anyway, and h A_d^T
                # (for dB_d) is taken from it then, so the activation and the down
                # projection, a third of the MLP's FLOPs, are not run at all.
                # Zeros as one broadcast element: no memset of an (N, out) buffer.
                y = x.new_zeros(()).expand(*x.shape[:-1], down.out_features)
                ha_d = None
            else:
                h = act_forward(e, g)
                y, ha_d = _projection_forward(h, down, lead_shape=x.shape[:-1])  # (..., out)
                del h  # recomputed in backward
        _save_projections(ctx, x, (gate, up, down), (xa_g, xa_u, ha_d), e, g)
        ctx.activation = activation
        ctx.done = False
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.done:
            raise RuntimeError(
                "lora_mlp's backward reuses its saved activations' memory for gradients "
                "and can run only once per forward (retain_graph=True is not supported)"
            )
        ctx.done = True
        x, e, g, *saved = ctx.saved_tensors
        (gate, xa_g), (up, xa_u), (down, ha_d) = _load_projections(ctx, saved)
        need_x = ctx.needs_input_grad[0]
        need_ga, need_gb = _adapter_needs(ctx, 3, 0)
        need_ua, need_ub = _adapter_needs(ctx, 3, 1)
        need_da, need_db = _adapter_needs(ctx, 3, 2)
        # dL/dh is needed for anything upstream of the activation.
        need_dh = need_x or need_ga or need_gb or need_ua or need_ub

        act_forward, act_backward = _activation_launchers(ctx.activation)
        dtype = x.dtype
        s_d = down.scaling
        x2d = x.reshape(-1, x.shape[-1])
        dy = dy.reshape(-1, dy.shape[-1]).to(dtype)  # (N, out)
        d_gate = d_up = (None, None)
        d_da = d_db = dx = None
        with torch.autocast(x.device.type, enabled=False):
            has_adapter = down.lora_a is not None
            dyb_s = None
            if has_adapter and (need_dh or need_da):
                dyb_s = _scaled_mm(dy, down.lora_b.to(dtype), s_d)  # s_d dY B_d: (N, r)
            # A backward_only forward saved no h A_d^T: it comes from the rebuilt h below.
            db_from_h = has_adapter and need_db and ha_d is None

            h = None
            if need_dh:
                dh = _input_gradient([(dy, down)], [(dyb_s, down.lora_a)] if has_adapter else [])
                # h goes into dh's buffer, de into e's, dg into g's.
                h, de, dg = act_backward(dh, e, g, inplace=True)
                del dh, e, g
            elif has_adapter and (need_da or db_from_h):
                h = act_forward(e, g)
            if has_adapter and need_da:
                d_da = (dyb_s.t() @ h).to(down.lora_a.dtype)  # (r, intermediate)
            if has_adapter and need_db:
                if db_from_h:
                    ha_d = h @ down.lora_a.to(dtype).t()  # (N, r)
                d_db = _scaled_mm(dy.t(), ha_d, s_d).to(down.lora_b.dtype)  # (out, r)
            del h

            if need_dh:
                dyb_g, *d_gate = _adapter_backward(de, xa_g, x2d, gate, need_x, need_ga, need_gb)
                dyb_u, *d_up = _adapter_backward(dg, xa_u, x2d, up, need_x, need_ua, need_ub)
                if need_x:
                    adapter_terms = [(t, p.lora_a) for t, p in ((dyb_g, gate), (dyb_u, up)) if t is not None]
                    terms = [(de, gate), (dg, up)]
                    del de, dg  # _input_gradient frees each once its GEMM is queued
                    dx = _input_gradient(terms, adapter_terms)
                else:
                    del de, dg
        if dx is not None:
            dx = dx.view(x.shape)
        return (
            dx, None, None,
            None, d_gate[0], d_gate[1], None, None,
            None, d_up[0], d_up[1], None, None,
            None, d_da, d_db, None, None,
        )  # fmt: skip


class _ChunkedLoRAMLPRecompute(torch.autograd.Function):
    """apply(x, activation, token_chunk, *gate, *up, *down fields): lora_mlp's
    backward_only recompute over chunks of token_chunk rows (module docstring)."""

    @staticmethod
    def forward(ctx, x, activation, token_chunk, *flat):
        # Frozen weights and the adapters: saving them costs nothing (no copies).
        tensors = [f for f in flat if isinstance(f, torch.Tensor)]
        ctx.save_for_backward(x, *tensors)
        ctx.layout = [isinstance(f, torch.Tensor) for f in flat]
        ctx.others = [None if isinstance(f, torch.Tensor) else f for f in flat]
        ctx.activation, ctx.token_chunk = activation, token_chunk
        out_features = flat[2 * _N_FIELDS].shape[0]
        return x.new_zeros(()).expand(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy):
        x, *tensors = ctx.saved_tensors
        supplied = iter(tensors)
        flat = [next(supplied) if is_tensor else other for is_tensor, other in zip(ctx.layout, ctx.others)]
        need = ctx.needs_input_grad
        # Leaves for the adapters whose gradients are asked for; the rest as they are.
        leaves = {}
        for i, field in enumerate(flat):
            if isinstance(field, torch.Tensor) and need[3 + i]:
                leaves[i] = field.detach().requires_grad_(True)
        chunk_flat = [
            leaves.get(i, f.detach() if isinstance(f, torch.Tensor) else f) for i, f in enumerate(flat)
        ]
        x2d = x.reshape(-1, x.shape[-1])
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(x2d) if need[0] else None
        sums = dict.fromkeys(leaves)
        for start in range(0, x2d.shape[0], ctx.token_chunk):
            stop = start + ctx.token_chunk
            x_chunk = x2d[start:stop].detach().requires_grad_(need[0])
            with torch.enable_grad():
                y_chunk = _LoRAMLPFunction.apply(x_chunk, ctx.activation, True, *chunk_flat)
            inputs = ([x_chunk] if need[0] else []) + [leaves[i] for i in leaves]
            grads = torch.autograd.grad(y_chunk, inputs, dy2d[start:stop], allow_unused=True)
            if need[0]:
                dx[start:stop] = grads[0]
                grads = grads[1:]
            for i, grad in zip(leaves, grads):
                if grad is not None:
                    sums[i] = grad if sums[i] is None else sums[i].add_(grad)
            del y_chunk, grads
        flat_grads = [sums.get(i) for i in range(len(flat))]
        return (None if dx is None else dx.view(x.shape), None, None, *flat_grads)


def _chunked_mlp_forward(x, activation: str, token_chunk: int, flat) -> torch.Tensor:
    """lora_mlp without autograd, token_chunk rows at a time into one output."""
    x2d = x.reshape(-1, x.shape[-1])
    y = x.new_empty((x2d.shape[0], flat[2 * _N_FIELDS].shape[0]))
    for start in range(0, x2d.shape[0], token_chunk):
        stop = start + token_chunk
        y[start:stop] = _LoRAMLPFunction.apply(x2d[start:stop], activation, False, *flat)
    return y.view(*x.shape[:-1], y.shape[-1])


class _KnownLoRASumFunction(torch.autograd.Function):
    """apply(known, residual, x, *projection fields): returns ``known``, which must equal
    residual + x W'^T; backward is that sum's."""

    @staticmethod
    def forward(ctx, known, residual, x, *fields):
        _save_projections(ctx, x, [LoRAProjection(*fields)], [None])
        return known.view_as(known)

    @staticmethod
    def backward(ctx, dy):
        x, *saved = ctx.saved_tensors
        ((proj, _),) = _load_projections(ctx, saved)
        need_residual, need_x = ctx.needs_input_grad[1:3]
        need_a, need_b = _adapter_needs(ctx, 3, 0)  # fields start after known, residual, x
        x2d = x.reshape(-1, x.shape[-1])
        dx = d_a = d_b = None
        with torch.autocast(x.device.type, enabled=False):
            dy2d = dy.reshape(-1, dy.shape[-1]).to(x.dtype)  # (N, out)
            xa = None
            if proj.lora_a is not None and need_b:
                xa = x2d @ proj.lora_a.t()  # (N, r): not saved, since no forward GEMM ran
            dyb_s, d_a, d_b = _adapter_backward(dy2d, xa, x2d, proj, need_x, need_a, need_b)
            if need_x:
                adapter_terms = [(dyb_s, proj.lora_a)] if dyb_s is not None else []
                dx = _input_gradient([(dy2d, proj)], adapter_terms).view(x.shape)
        return (None, dy if need_residual else None, dx, None, d_a, d_b, None, None)


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


def _prepare(x: torch.Tensor, checks) -> torch.Tensor:
    """Validate x and each (name, projection, in_features or None for x's last dim).

    Returns x cast to the compute dtype.
    """
    _check_input(x)
    dtype = _compute_dtype(x)
    for name, proj, in_features in checks:
        _check_projection(name, proj, in_features or x.shape[-1], x, dtype)
    return x.to(dtype)


def _project(x: torch.Tensor, named: list, rotary=None) -> tuple:
    """Checked projections of one input x through _LoRAProjectionsFunction.

    named: (name, LoRAProjection) pairs; rotary as for the Function."""
    x = _prepare(x, [(name, proj, None) for name, proj in named])
    fields = [f for _, proj in named for f in proj.fields_in(x.dtype)]
    return _LoRAProjectionsFunction.apply(x, rotary, *fields)


def lora_linear(x: torch.Tensor, proj: LoRAProjection) -> torch.Tensor:
    """y = x W^T + s (x A^T) B^T (+ bias) for x of shape (..., in); y: (..., out)."""
    return _project(x, [("proj", proj)])[0]


def lora_o(x: torch.Tensor, o_proj: LoRAProjection) -> torch.Tensor:
    """The attention output projection: ``lora_linear`` under its usual name."""
    return _project(x, [("o_proj", o_proj)])[0]


def lora_o_residual(
    x: torch.Tensor,
    o_proj: LoRAProjection,
    residual: torch.Tensor,
    known_sum: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + lora_o(x, o_proj): the residual stream after attention.

    known_sum: that sum, computed before from the same x, residual and weights (the
    forward of gradient checkpointing can keep it for the recomputation).  It is then
    returned as it is and no GEMM runs; backward is the sum's all the same (gradients
    for residual, x, A and B), so a recompute that needs the sum only to go on with the
    layer spends nothing on the output projection.
    """
    if known_sum is None:
        return residual + lora_o(x, o_proj)
    x = _prepare(x, [("o_proj", o_proj, None)])
    if known_sum.shape != residual.shape or known_sum.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"lora_o_residual: known_sum has shape {tuple(known_sum.shape)}, residual "
            f"{tuple(residual.shape)} and x {tuple(x.shape)}; the sum is shaped like the "
            f"residual, with x's leading dimensions"
        )
    return _KnownLoRASumFunction.apply(known_sum.detach(), residual, x, *o_proj.fields_in(x.dtype))


def lora_qkv(
    x: torch.Tensor, q_proj: LoRAProjection, k_proj: LoRAProjection, v_proj: LoRAProjection
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) projections of one input x (..., hidden); x is saved once."""
    return _project(x, [("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)])


def lora_qkv_rope(
    x: torch.Tensor,
    q_proj: LoRAProjection,
    k_proj: LoRAProjection,
    v_proj: LoRAProjection,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lora_qkv`` of x (B, T, hidden), then RoPE on q and k, in one autograd Function.

    Returns (q, k, v) of shapes (B, T, heads * head_dim), q and k rotated as ``rope``
    rotates their (B, heads, T, head_dim) views; cos/sin/position_ids as for ``rope``.
    Same values as ``lora_qkv`` followed by ``rope``, with less work in backward.
    """
    named = [("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)]
    if isinstance(x, torch.Tensor) and x.dim() != 3:
        raise ValueError(f"lora_qkv_rope: x must be (B, T, hidden), got shape {tuple(x.shape)}")
    for name, proj in named[:2]:
        if isinstance(proj, LoRAProjection) and proj.out_features % head_dim:
            raise ValueError(
                f"lora_qkv_rope: {name} has out_features={proj.out_features}, not a multiple "
                f"of head_dim={head_dim}"
            )
    rotary = (cos.detach(), sin.detach(), position_ids, head_dim)
    return _project(x, named, rotary)


def lora_mlp(
    x: torch.Tensor,
    gate_proj: LoRAProjection,
    up_proj: LoRAProjection,
    down_proj: LoRAProjection,
    activation: str = "swiglu",
    backward_only: bool = False,
    token_chunk: int | None = None,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with LoRA on each projection; x: (..., hidden).

    activation: "swiglu" (silu, Llama), "geglu_tanh" (tanh GELU, Gemma) or
    "geglu" (exact erf GELU).

    backward_only=True is for the recomputation of gradient checkpointing, where the
    forward runs again only to rebuild what backward needs and its output is thrown
    away: the activation and the down projection are skipped, the returned y is zeros
    (a broadcast view of one element, not a filled buffer), and backward gives the same
    gradients as after a full forward.

    token_chunk: with more tokens than this, run without autograd or as a recompute
    (backward_only) over chunks of this many tokens, so that the (tokens, intermediate)
    tensors exist one chunk at a time (module docstring); the same values.  None
    (default): never chunked.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if token_chunk is not None and (
        isinstance(token_chunk, bool) or not isinstance(token_chunk, int) or token_chunk <= 0
    ):
        raise ValueError(f"token_chunk={token_chunk!r}; expected a positive number of tokens or None")
    x = _prepare(x, [("gate_proj", gate_proj, None), ("up_proj", up_proj, None)])
    if up_proj.out_features != gate_proj.out_features:
        raise ValueError(
            f"up_proj has out_features={up_proj.out_features} but gate_proj has "
            f"{gate_proj.out_features}; they must match"
        )
    _check_projection("down_proj", down_proj, gate_proj.out_features, x, x.dtype)
    flat = (*gate_proj.fields_in(x.dtype), *up_proj.fields_in(x.dtype), *down_proj.fields_in(x.dtype))
    if token_chunk is not None and x.numel() // x.shape[-1] > token_chunk:
        if not torch.is_grad_enabled():
            return _chunked_mlp_forward(x, activation, token_chunk, flat)
        if backward_only:
            return _ChunkedLoRAMLPRecompute.apply(x, activation, token_chunk, *flat)
    return _LoRAMLPFunction.apply(x, activation, bool(backward_only), *flat)
