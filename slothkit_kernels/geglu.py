"""GeGLU: h = gelu(e) * g, the gated activation of Gemma MLPs.

``e`` is the gate projection's output, ``g`` the up projection's; same shape and
dtype, elementwise, any shape.  fp32 inside, rounded to the input dtype on store.
Two GELU flavours, as in ``torch.nn.functional.gelu(approximate=...)``:

approximate="tanh" (Gemma's ``gelu_pytorch_tanh``), with k = sqrt(2/pi), c = 0.044715:
    u         = k (e + c e^3),   t = tanh(u)
    gelu(e)   = e/2 (1 + t)                    = e * sigmoid(2u)
    gelu'(e)  = (1 + t)/2 + e/2 (1 - t^2) k (1 + 3c e^2)
              = q + 2 e q (1 - q) k (1 + 3c e^2),   q = sigmoid(2u)
  (1 + tanh u = 2 sigmoid(2u) avoids the cancellation of 1 + t near t = -1 and
  needs no tanh, which Triton only offers through libdevice.)

approximate="none" (exact, erf):
    gelu(e)   = e/2 (1 + erf(e / sqrt 2))
    gelu'(e)  = (1 + erf(e / sqrt 2))/2 + e exp(-e^2 / 2) / sqrt(2 pi)

Then dL/dg = dL/dh * gelu(e) and dL/de = dL/dh * g * gelu'(e).  Only e and g
are saved; gelu(e) is recomputed in backward.  The backward launcher returns the
recomputed h as well and can write its results into its inputs' storage, exactly
as ``slothkit_kernels.swiglu.swiglu_backward`` (see there).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from slothkit_kernels.swiglu import (
    BLOCK_SIZE,
    NUM_WARPS,
    check_gated_inputs,
    gated_backward,
)
from slothkit_kernels.utils import use_triton, warn_reference_once

_APPROXIMATIONS = ("tanh", "none")


def _check_approximate(approximate: str) -> None:
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up in plain torch (fp32 inside), differentiable."""
    h = torch.nn.functional.gelu(gate.float(), approximate=approximate) * up.float()
    return h.to(gate.dtype)


@triton.jit
def gelu_and_derivative(
    e,  # fp32 block of gate values
    APPROXIMATE_TANH: tl.constexpr,  # True: tanh approximation; False: exact erf form
):
    """(gelu(e), gelu'(e)) in fp32 (module docstring); the MoE experts' GeGLU reads it too."""
    if APPROXIMATE_TANH:
        k = 0.7978845608028654  # sqrt(2 / pi)
        u = k * e * (1.0 + 0.044715 * e * e)
        q = tl.sigmoid(2.0 * u)  # (1 + tanh u) / 2
        gelu = e * q
        d_gelu = q + 2.0 * e * q * (1.0 - q) * k * (1.0 + 3.0 * 0.044715 * e * e)
    else:
        half_cdf = 0.5 * (1.0 + tl.erf(e * 0.7071067811865476))  # Phi(e)
        gelu = e * half_cdf
        d_gelu = half_cdf + e * tl.exp(-0.5 * e * e) * 0.3989422804014327  # 1/sqrt(2 pi)
    return gelu, d_gelu


@triton.jit
def _geglu_forward_kernel(
    E,  # pointer to the gate values e, flattened
    G,  # pointer to the up values g, flattened
    H,  # pointer to the output h = gelu(e) * g, flattened
    n_elements,  # number of elements in each tensor
    APPROXIMATE_TANH: tl.constexpr,  # tanh-approximate (True) or erf (False) GELU
    BLOCK_SIZE: tl.constexpr,  # elements handled by one program
):
    # int64: n_elements may exceed 2**31.
    start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements

    e = tl.load(E + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    gelu, _ = gelu_and_derivative(e, APPROXIMATE_TANH)
    tl.store(H + offsets, (gelu * g).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_backward_kernel(
    DH,  # pointer to dL/dh
    E,  # pointer to the gate values e
    G,  # pointer to the up values g
    H_OUT,  # pointer where h is written (DH when in place)
    DE_OUT,  # pointer where dL/de is written (E when in place)
    DG_OUT,  # pointer where dL/dg is written (G when in place)
    n_elements,  # number of elements in each tensor
    APPROXIMATE_TANH: tl.constexpr,  # tanh-approximate (True) or erf (False) GELU
    BLOCK_SIZE: tl.constexpr,  # elements handled by one program
):
    start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements

    # All loads precede all stores, so the outputs may alias the inputs.
    dh = tl.load(DH + offsets, mask=mask, other=0.0).to(tl.float32)
    e = tl.load(E + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)

    gelu, d_gelu = gelu_and_derivative(e, APPROXIMATE_TANH)
    h = gelu * g
    dg = dh * gelu
    de = dh * g * d_gelu

    tl.store(H_OUT + offsets, h.to(H_OUT.dtype.element_ty), mask=mask)
    tl.store(DE_OUT + offsets, de.to(DE_OUT.dtype.element_ty), mask=mask)
    tl.store(DG_OUT + offsets, dg.to(DG_OUT.dtype.element_ty), mask=mask)


def geglu_forward(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """h = gelu(gate) * up, no autograd; a new tensor of gate's shape and dtype."""
    _check_approximate(approximate)
    check_gated_inputs(gate, up, "geglu_forward")
    if not use_triton(gate):
        warn_reference_once("geglu", gate.device.type)
        with torch.no_grad():
            return geglu_reference(gate, up, approximate)
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = gate.numel()
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    _geglu_forward_kernel[grid](
        gate,
        up,
        h,
        n,
        APPROXIMATE_TANH=approximate == "tanh",
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
    return h


def _geglu_backward_torch(grad_h, gate, up, approximate):
    e, g, dh = gate.float(), up.float(), grad_h.float()
    if approximate == "tanh":
        k = math.sqrt(2.0 / math.pi)
        q = torch.sigmoid(2.0 * k * e * (1.0 + 0.044715 * e * e))
        gelu = e * q
        d_gelu = q + 2.0 * e * q * (1.0 - q) * k * (1.0 + 3.0 * 0.044715 * e * e)
    else:
        half_cdf = 0.5 * (1.0 + torch.erf(e / math.sqrt(2.0)))
        gelu = e * half_cdf
        d_gelu = half_cdf + e * torch.exp(-0.5 * e * e) / math.sqrt(2.0 * math.pi)
    return gelu * g, dh * g * d_gelu, dh * gelu


def geglu_backward(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: str = "tanh",
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute h and differentiate: returns (h, dL/dgate, dL/dup), no autograd.

    inplace=True writes h into grad_h's storage, dL/dgate into gate's and dL/dup
    into up's (version counters bumped); a non-contiguous input is copied first and
    the copy receives the result, so always use the returned tensors.
    """
    _check_approximate(approximate)

    def launch(grad_h, gate, up, h, de, dg, n):
        grid = (triton.cdiv(n, BLOCK_SIZE),)
        _geglu_backward_kernel[grid](
            grad_h,
            gate,
            up,
            h,
            de,
            dg,
            n,
            APPROXIMATE_TANH=approximate == "tanh",
            BLOCK_SIZE=BLOCK_SIZE,
            num_warps=NUM_WARPS,
        )

    def torch_backward(grad_h, gate, up):
        return _geglu_backward_torch(grad_h, gate, up, approximate)

    return gated_backward("geglu", grad_h, gate, up, inplace, torch_backward, launch)


class GeGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, approximate):
        ctx.save_for_backward(gate, up)
        ctx.approximate = approximate
        return geglu_forward(gate, up, approximate)

    @staticmethod
    def backward(ctx, grad_h):
        gate, up = ctx.saved_tensors
        _, d_gate, d_up = geglu_backward(grad_h, gate, up, ctx.approximate, inplace=False)
        return d_gate, d_up, None


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up, differentiable; approximate is "tanh" or "none"."""
    _check_approximate(approximate)
    check_gated_inputs(gate, up, "geglu")
    if not use_triton(gate):
        warn_reference_once("geglu", gate.device.type)
        return geglu_reference(gate, up, approximate)
    return GeGLUFunction.apply(gate, up, approximate)
