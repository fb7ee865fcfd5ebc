"""The experts' gated activations, on the (rows, 2I) output of the gate/up projection.

The gate and up halves are columns of one product: the first I and the last I
(Qwen3-MoE, Mixtral), or the even and the odd columns when ``interleaved`` (gpt-oss).

    "swiglu":      h = silu(g) * u
    "gpt_oss":     g' = min(g, limit),  u' = clamp(u, -limit, limit),
                   h = (u' + 1) * g' * sigmoid(alpha g')        (transformers' GptOssExperts)
    "geglu_tanh":  h = gelu_tanh(g) * u                          (Gemma 4's gelu_pytorch_tanh)

Backward, given dh, with s = sigmoid(g) resp. s = sigmoid(alpha g'):

    swiglu:      dg = dh u s (1 + g (1 - s)),            du = dh g s
    gpt_oss:     dg = dh (u' + 1) s (1 + alpha g' (1 - s)) [g <= limit],
                 du = dh g' s [-limit <= u <= limit]
    geglu_tanh:  dg = dh u gelu_tanh'(g),                du = dh gelu_tanh(g)
(torch.clamp passes the gradient where the input lies in the closed range, and so do these;
gelu_tanh and its derivative are slothkit_kernels.geglu's, derived and computed there as
g sigmoid(2 k (g + c g^3)), with no tanh.)

In the expert block the backward kernel also finishes two things that need the whole
row: dh = w gY is the routing weight w times the unweighted gradient gY of the row
(dOut W_down + the adapter's term), and the routing weight's gradient is

    dw = <dOut, y> = <gY, h> + <dOut, bias_down_e>,     y = h W_down^T + s (h A^T) B^T + bias

so neither y nor h is kept from the forward pass: h is recomputed from the saved gate/up
product, in fp32, rounded to the storage dtype once as in the forward kernel.
Rows past the last expert's (ids outside [0, E)) are skipped, their dw is 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slothkit_kernels.geglu import gelu_and_derivative
from slothkit_kernels.moe.routing import ExpertRouting
from slothkit_kernels.utils import interpreter_enabled

ACTIVATIONS = ("swiglu", "gpt_oss", "geglu_tanh")


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def expert_activation_reference(
    gate_up: torch.Tensor, activation: str, interleaved: bool, alpha: float, limit: float
) -> torch.Tensor:
    """h from the (rows, 2I) gate/up product in plain torch, in its dtype, differentiable."""
    gate, up = split_gate_up(gate_up, interleaved)
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "geglu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@triton.jit
def _columns(offs, I, INTERLEAVED: tl.constexpr):
    """The gate and up columns of intermediate features offs."""
    if INTERLEAVED:
        return 2 * offs, 2 * offs + 1
    return offs, offs + I


@triton.jit
def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gpt_oss":
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    if ACTIVATION == "geglu_tanh":
        gelu, _ = gelu_and_derivative(gate, True)
        return gelu * up
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _activate_backward(gate, up, dh, alpha, limit, ACTIVATION: tl.constexpr):
    """(h, dL/dgate, dL/dup) in fp32."""
    if ACTIVATION == "geglu_tanh":
        gelu, d_gelu = gelu_and_derivative(gate, True)
        return gelu * up, dh * up * d_gelu, dh * gelu
    if ACTIVATION == "gpt_oss":
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        s = tl.sigmoid(alpha * g)
        glu = g * s
        d_gate = tl.where(gate <= limit, dh * (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s)), 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), dh * glu, 0.0)
        return (u + 1.0) * glu, d_gate, d_up
    s = tl.sigmoid(gate)
    silu = gate * s
    return silu * up, dh * up * s * (1.0 + gate * (1.0 - s)), dh * silu


@triton.jit
def _activation_forward_kernel(
    GU,  # pointer to the gate/up product, (M, 2I)
    stride_gu,  # GU's row stride
    H,  # pointer to the output h, (M, I)
    stride_h,  # H's row stride
    END,  # pointer to the number of rows that belong to an expert (OFFSETS[E]), int32
    I,  # intermediate features
    alpha,  # gpt_oss: the sigmoid's slope
    limit,  # gpt_oss: the clamp
    ACTIVATION: tl.constexpr,  # "swiglu", "gpt_oss" or "geglu_tanh" (module docstring)
    INTERLEAVED: tl.constexpr,  # gate/up are the even/odd columns, else the two halves
    BLOCK: tl.constexpr,  # intermediate features per program
):
    row = tl.program_id(0)
    if row >= tl.load(END):
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate_cols, up_cols = _columns(offs, I, INTERLEAVED)
    gu_row = GU + row.to(tl.int64) * stride_gu
    gate = tl.load(gu_row + gate_cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_row + up_cols, mask=mask, other=0.0).to(tl.float32)
    h = _activate(gate, up, alpha, limit, ACTIVATION)
    tl.store(H + row.to(tl.int64) * stride_h + offs, h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _activation_backward_kernel(
    GU,  # pointer to the gate/up product, (M, 2I)
    stride_gu,  # GU's row stride
    GY,  # pointer to the unweighted gradient of h, (M, I); receives h (H_OUT may alias it)
    stride_gy,  # GY's row stride
    ROUTING_WEIGHT,  # pointer to the routing weight of each sorted row, (M,)
    DGU,  # pointer to the output dL/d(gate/up), (M, 2I)
    stride_dgu,  # DGU's row stride
    H_OUT,  # pointer to the output h, (M, I)
    stride_h,  # H_OUT's row stride
    DW,  # pointer to the output dL/dw per sorted row, (M,) fp32
    DOUT,  # pointer to dL/dOut, (T, HID) (HAS_BIAS only)
    stride_dout,  # DOUT's row stride
    ROWS,  # pointer to the token of each sorted row, (M,) int32 (HAS_BIAS only)
    ROW_EXPERT,  # pointer to the expert of each sorted row, (M,) int32 (HAS_BIAS only)
    BIAS,  # pointer to the down projection's bias, (E, HID) (HAS_BIAS only)
    stride_bias_e,  # BIAS's expert stride
    stride_bias_n,  # BIAS's feature stride
    END,  # pointer to the number of rows that belong to an expert (OFFSETS[E]), int32
    I,  # intermediate features
    HID,  # hidden features (the down projection's output)
    alpha,  # gpt_oss: the sigmoid's slope
    limit,  # gpt_oss: the clamp
    HAS_BIAS: tl.constexpr,  # add <dOut, bias_e> to dw
    ACTIVATION: tl.constexpr,  # "swiglu", "gpt_oss" or "geglu_tanh" (module docstring)
    INTERLEAVED: tl.constexpr,  # gate/up are the even/odd columns, else the two halves
    BLOCK: tl.constexpr,  # features per step along a row
):
    row = tl.program_id(0)
    if row >= tl.load(END):
        tl.store(DW + row, 0.0)
        return
    row64 = row.to(tl.int64)
    weight = tl.load(ROUTING_WEIGHT + row).to(tl.float32)
    gu_row = GU + row64 * stride_gu
    dgu_row = DGU + row64 * stride_dgu
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for i0 in range(0, I, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        mask = offs < I
        gate_cols, up_cols = _columns(offs, I, INTERLEAVED)
        gate = tl.load(gu_row + gate_cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_row + up_cols, mask=mask, other=0.0).to(tl.float32)
        gy = tl.load(GY + row64 * stride_gy + offs, mask=mask, other=0.0).to(tl.float32)
        h, d_gate, d_up = _activate_backward(gate, up, weight * gy, alpha, limit, ACTIVATION)
        h = h.to(H_OUT.dtype.element_ty)  # the forward pass's rounding
        dot += gy * h.to(tl.float32)
        tl.store(H_OUT + row64 * stride_h + offs, h, mask=mask)
        tl.store(dgu_row + gate_cols, d_gate.to(DGU.dtype.element_ty), mask=mask)
        tl.store(dgu_row + up_cols, d_up.to(DGU.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        token = tl.load(ROWS + row).to(tl.int64)
        expert = tl.load(ROW_EXPERT + row).to(tl.int64)
        for n0 in range(0, HID, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            mask = offs < HID
            dout = tl.load(DOUT + token * stride_dout + offs, mask=mask, other=0.0).to(tl.float32)
            bias = tl.load(BIAS + expert * stride_bias_e + offs * stride_bias_n, mask=mask, other=0.0)
            dot += dout * bias.to(tl.float32)
    tl.store(DW + row, tl.sum(dot, axis=0))


def _block(n: int) -> int:
    return min(64 if interpreter_enabled() else 1024, max(16, triton.next_power_of_2(n)))


def expert_activation(
    gate_up: torch.Tensor,
    routing: ExpertRouting,
    activation: str,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """h (M, I) from the sorted (M, 2I) gate/up product, no autograd."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    h = torch.empty((m, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = _block(inter)
    grid = (m, triton.cdiv(inter, block))
    _activation_forward_kernel[grid](
        gate_up, gate_up.stride(0), h, h.stride(0),
        routing.offsets[routing.num_experts:],
        inter, float(alpha), float(limit),
        ACTIVATION=activation, INTERLEAVED=interleaved, BLOCK=block,
    )  # fmt: skip
    return h


def expert_activation_backward(
    gate_up: torch.Tensor,
    grad_y: torch.Tensor,
    routing_weight: torch.Tensor,
    routing: ExpertRouting,
    activation: str,
    interleaved: bool,
    alpha: float,
    limit: float,
    grad_out: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, dL/d(gate_up), dL/dw per sorted row in fp32), no autograd (module docstring).

    grad_y (M, I): the unweighted gradient of h; h is written into its storage.
    routing_weight (M,): each sorted row's routing weight.  With ``down_bias`` (E, HID),
    grad_out (T, HID) adds <dOut, bias_e> to dw.
    """
    m, two_i = gate_up.shape
    inter = two_i // 2
    d_gate_up = torch.empty_like(gate_up)
    dw = torch.empty(m, dtype=torch.float32, device=gate_up.device)
    has_bias = down_bias is not None
    hid = down_bias.shape[1] if has_bias else 0
    block = _block(max(inter, hid))
    _activation_backward_kernel[(m,)](
        gate_up, gate_up.stride(0),
        grad_y, grad_y.stride(0),
        routing_weight,
        d_gate_up, d_gate_up.stride(0),
        grad_y, grad_y.stride(0),
        dw,
        grad_out if has_bias else dw, grad_out.stride(0) if has_bias else 0,
        routing.tokens, routing.row_expert,
        down_bias if has_bias else dw, *(down_bias.stride() if has_bias else (0, 0)),
        routing.offsets[routing.num_experts:],
        inter, hid, float(alpha), float(limit),
        HAS_BIAS=has_bias, ACTIVATION=activation, INTERLEAVED=interleaved, BLOCK=block,
    )  # fmt: skip
    return grad_y, d_gate_up, dw
