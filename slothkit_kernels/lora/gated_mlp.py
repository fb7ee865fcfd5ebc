"""The gated MLP with LoRA on its three projections: its autograd Functions, over all
tokens at once or over chunks of them.

* ``lora_mlp``: e = X Wg'^T, g = X Wu'^T, h = act(e) * g, Y = h Wd'^T (' = with
  adapter).  Saved: X, e, g and the (N, r) adapter products.  Backward:
      dh            = dY Wd + s_d (dY B_d) A_d
      h, de, dg     = fused activation backward (recomputes h; written into the
                      buffers of dh, e, g, so no new (N, intermediate) tensors)
      dA_d = s_d (dY B_d)^T h,   dB_d = s_d dY^T (h A_d^T)
      gate and up projections as one projection's (``gemms``) with dY := de and
      dg, their dX summed.
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
"""

from __future__ import annotations

import torch

from slothkit_kernels.geglu import geglu_backward, geglu_forward
from slothkit_kernels.lora.gemms import (
    _adapter_backward,
    _adapter_needs,
    _input_gradient,
    _load_projections,
    _projection_forward,
    _save_projections,
    _scaled_mm,
)
from slothkit_kernels.lora.projection import _N_FIELDS, LoRAProjection
from slothkit_kernels.swiglu import swiglu_backward, swiglu_forward

ACTIVATIONS = ("swiglu", "geglu_tanh", "geglu")


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
