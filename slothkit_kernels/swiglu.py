"""SwiGLU: h = silu(e) * g, the gated activation of Llama/Mistral/Qwen MLPs.

``e`` is the gate projection's output, ``g`` the up projection's; both have the
same shape and dtype and the op is elementwise, so any shape works.  Values are
computed in fp32 and rounded to the input dtype once, on store.

Backward, with s = sigmoid(e):
    silu(e)   = e * s
    silu'(e)  = s + e * s * (1 - s) = s * (1 + e * (1 - s))
    dL/dg     = dL/dh * silu(e)
    dL/de     = dL/dh * g * silu'(e)
Only e and g are saved; silu(e) is recomputed in the backward kernel, which
costs one sigmoid per element instead of a stored (tokens, intermediate) tensor.

The backward launcher also returns the recomputed h: the LoRA MLP backward
(``slothkit_kernels.lora``) needs it for the down projection's adapter grads
and otherwise would have to store it.  With ``inplace=True`` the launcher writes
its three results into the storage of its three inputs (h into grad_h, de into
gate, dg into up), so the MLP backward needs no new (tokens, intermediate)
buffers.  Every element is read before it is overwritten by the same program,
so aliasing is safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slothkit_kernels.utils import (
    check_float_dtype,
    check_not_empty,
    check_same_device,
    use_triton,
    warn_reference_once,
)

# Elements per program.  A power of two; 1024 fp32 values = 8 per thread at 4 warps.
BLOCK_SIZE = 1024
NUM_WARPS = 4


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in plain torch (fp32 inside), differentiable by autograd."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


@triton.jit
def _swiglu_forward_kernel(
    E,  # pointer to the gate values e, flattened
    G,  # pointer to the up values g, flattened
    H,  # pointer to the output h = silu(e) * g, flattened
    n_elements,  # number of elements in each tensor
    BLOCK_SIZE: tl.constexpr,  # elements handled by one program
):
    # int64: n_elements may exceed 2**31 (e.g. 16 x 8192 tokens x 28672 features).
    start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements

    e = tl.load(E + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    h = e * tl.sigmoid(e) * g
    tl.store(H + offsets, h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    DH,  # pointer to dL/dh; receives h (may alias the DH input)
    E,  # pointer to the gate values e; receives dL/de (may alias E)
    G,  # pointer to the up values g; receives dL/dg (may alias G)
    H_OUT,  # pointer where h is written (DH when in place)
    DE_OUT,  # pointer where dL/de is written (E when in place)
    DG_OUT,  # pointer where dL/dg is written (G when in place)
    n_elements,  # number of elements in each tensor
    BLOCK_SIZE: tl.constexpr,  # elements handled by one program
):
    start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements

    # All three loads happen before any store, so the outputs may alias the inputs.
    dh = tl.load(DH + offsets, mask=mask, other=0.0).to(tl.float32)
    e = tl.load(E + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)

    s = tl.sigmoid(e)
    silu = e * s
    h = silu * g
    dg = dh * silu
    de = dh * g * s * (1.0 + e * (1.0 - s))

    tl.store(H_OUT + offsets, h.to(H_OUT.dtype.element_ty), mask=mask)
    tl.store(DE_OUT + offsets, de.to(DE_OUT.dtype.element_ty), mask=mask)
    tl.store(DG_OUT + offsets, dg.to(DG_OUT.dtype.element_ty), mask=mask)


def check_gated_inputs(gate: torch.Tensor, up: torch.Tensor, op: str) -> None:
    check_float_dtype(f"{op}: gate", gate)
    check_not_empty(f"{op}: gate", gate)
    check_same_device(gate=gate, up=up)
    if up.shape != gate.shape:
        raise ValueError(
            f"{op}: up has shape {tuple(up.shape)} but gate has {tuple(gate.shape)}; they must match"
        )
    if up.dtype != gate.dtype:
        raise TypeError(f"{op}: up has dtype {up.dtype} but gate has {gate.dtype}; they must match")


def check_gated_grad(grad_h: torch.Tensor, gate: torch.Tensor, op: str) -> None:
    check_same_device(grad_h=grad_h, gate=gate)
    if grad_h.shape != gate.shape:
        raise ValueError(f"{op}: grad_h has shape {tuple(grad_h.shape)} but gate has {tuple(gate.shape)}")
    if grad_h.dtype != gate.dtype:
        raise TypeError(f"{op}: grad_h has dtype {grad_h.dtype} but gate has {gate.dtype}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_no_overlap(op: str, **tensors: torch.Tensor) -> None:
    """In-place results need separate memory; refuse inputs whose memory overlaps."""
    names = list(tensors)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            a0, a1 = _byte_span(tensors[a])
            b0, b1 = _byte_span(tensors[b])
            if a0 < b1 and b0 < a1:
                raise ValueError(
                    f"{op}(inplace=True): {a} and {b} overlap in memory, so the results "
                    f"would overwrite each other; pass separate tensors or inplace=False"
                )


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up, no autograd; a new tensor of gate's shape and dtype."""
    check_gated_inputs(gate, up, "swiglu_forward")
    if not use_triton(gate):
        warn_reference_once("swiglu", gate.device.type)
        with torch.no_grad():
            return swiglu_reference(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = gate.numel()
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    _swiglu_forward_kernel[grid](gate, up, h, n, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS)
    return h


def _swiglu_backward_torch(grad_h, gate, up):
    e, g, dh = gate.float(), up.float(), grad_h.float()
    s = torch.sigmoid(e)
    silu = e * s
    de = dh * g * s * (1.0 + e * (1.0 - s))
    return silu * g, de, dh * silu


def swiglu_backward(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute h and differentiate: returns (h, dL/dgate, dL/dup), no autograd.

    inplace=False: three new tensors.  inplace=True: h is written into grad_h's
    storage, dL/dgate into gate's and dL/dup into up's, and those tensors are
    returned (their previous contents are gone; their autograd version counters are
    bumped so a saved-tensor reuse fails loudly).  A non-contiguous input is first
    copied, and then the copy receives the result: always use the returned tensors.
    """

    def launch(grad_h, gate, up, h, de, dg, n):
        grid = (triton.cdiv(n, BLOCK_SIZE),)
        _swiglu_backward_kernel[grid](
            grad_h, gate, up, h, de, dg, n, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS
        )

    return gated_backward("swiglu", grad_h, gate, up, inplace, _swiglu_backward_torch, launch)


def gated_backward(op: str, grad_h, gate, up, inplace: bool, torch_backward, launch):
    """What every gated activation's backward shares around its kernel: checks,
    contiguity, output buffers (new, or the inputs' own when ``inplace``), the torch
    fallback, and the version bump that makes reuse of overwritten tensors fail loudly.

    torch_backward(grad_h, gate, up) -> (h, de, dg) in fp32;
    launch(grad_h, gate, up, h, de, dg, n) runs the Triton kernel over n elements.
    """
    check_gated_inputs(gate, up, f"{op}_backward")
    check_gated_grad(grad_h, gate, f"{op}_backward")
    # A non-contiguous input is copied here, and the copy receives its result.
    grad_h, gate, up = grad_h.contiguous(), gate.contiguous(), up.contiguous()
    if inplace:
        check_no_overlap(f"{op}_backward", grad_h=grad_h, gate=gate, up=up)
    if not use_triton(gate):
        warn_reference_once(op, gate.device.type)
        with torch.no_grad():
            h, de, dg = torch_backward(grad_h, gate, up)
            if inplace:
                return grad_h.copy_(h), gate.copy_(de), up.copy_(dg)
            return h.to(gate.dtype), de.to(gate.dtype), dg.to(gate.dtype)
    if inplace:
        h, de, dg = grad_h, gate, up
    else:
        h, de, dg = torch.empty_like(gate), torch.empty_like(gate), torch.empty_like(gate)
    n = gate.numel()
    launch(grad_h, gate, up, h, de, dg, n)
    if inplace:
        torch.autograd.graph.increment_version([h, de, dg])
    return h, de, dg


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad_h):
        gate, up = ctx.saved_tensors
        # Not in place: gate and up belong to the caller's graph.
        _, d_gate, d_up = swiglu_backward(grad_h.to(gate.dtype), gate, up, inplace=False)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, differentiable; gate and up share shape and dtype."""
    check_gated_inputs(gate, up, "swiglu")
    if not use_triton(gate):
        warn_reference_once("swiglu", gate.device.type)
        return swiglu_reference(gate, up)
    return SwiGLUFunction.apply(gate, up)
