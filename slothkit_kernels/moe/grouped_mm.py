"""grouped_lora_gemm's product through PyTorch's ``torch._grouped_mm`` (CUTLASS's grouped
GEMM on Hopper) instead of slothkit's Triton kernel, with the adapter split off:

    XA = X[src] A_e^T                   one grouped GEMM of rank r
    Y  = X[src] W_e^T + s XA B_e^T      two more, added in x's dtype (as PEFT adds its term)
       + bias_e

for the sorted rows of each expert (``routing.offsets``).  The Triton kernel keeps the
adapter's product inside the base product's launch and rounds once; this backend rounds
the base product and the adapter's term each to bf16 before adding them, and gathers X's
rows into a sorted copy first (T * top_k rows of K features) where the Triton kernel reads
them in place.

It applies where ``torch._grouped_mm`` multiplies: bf16 on a GPU of compute capability
9.0 or newer (or the CPU), every matrix's leading stride a multiple of 16 bytes (K, N and
the rank multiples of 8), and 4-bit experts that fit one dequantisation run.

The default backend, "auto", takes it where it applies on such a GPU and the Triton kernel
everywhere else (other dtypes, older GPUs, the CPU and Triton's interpreter), silently: on
an H100 a training step of Qwen3-30B-A3B's layers (LoRA r 16, 2 x 2048, bf16) ran 41,871
tokens/s with it against 34,310 with the Triton kernel, and QLoRA 36,821
(results/bench/h100-2026-12-07-qwen3-30b-a3b-12l-*-4b0f43e.json).  ``set_backend``
chooses one for every grouped GEMM: "grouped_mm" (where it does not apply the Triton
kernel runs, said once) or "triton".
"""

from __future__ import annotations

import warnings

import torch

from slothkit_kernels.moe.lora import ExpertLoRA
from slothkit_kernels.moe.routing import ExpertRouting

BACKENDS = ("auto", "triton", "grouped_mm")
BACKEND = "auto"  # what the experts' grouped GEMMs run; set_backend changes it
_said: set[str] = set()


def set_backend(name: str) -> None:
    """Run the experts' grouped GEMMs through torch._grouped_mm where it applies on a GPU of
    compute capability 9.0 or newer and slothkit's Triton kernel elsewhere ("auto", the
    default), through slothkit's Triton kernel always ("triton"), or through
    torch._grouped_mm wherever it applies ("grouped_mm")."""
    global BACKEND
    if name not in BACKENDS:
        raise ValueError(f"set_backend: {name!r} is not one of {BACKENDS}")
    BACKEND = name


def say_triton_instead(reason: str) -> None:
    """Say once that a grouped GEMM the grouped_mm backend was asked for runs in Triton
    (under "auto" the Triton kernel is the plain choice there, and nothing is said)."""
    if BACKEND == "auto":
        return
    if reason not in _said:
        _said.add(reason)
        warnings.warn(
            f"the grouped_mm backend of the experts: {reason}; this grouped GEMM runs slothkit's Triton kernel",
            stacklevel=3,
        )


def _leading_stride_aligned(matrix: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: the last two dims row- or column-major, the other
    stride a multiple of 16 bytes."""
    alignment = 16 // matrix.element_size()
    rows_stride, cols_stride = matrix.stride()[-2:]
    if cols_stride == 1:
        return rows_stride % alignment == 0
    if rows_stride == 1:
        return cols_stride % alignment == 0
    return False


def grouped_mm_applies(x: torch.Tensor, n: int, k: int, lora: ExpertLoRA | None) -> bool:
    """Whether the grouped GEMM of x (rows of K features) to N features takes this backend:
    chosen by set_backend and within what torch._grouped_mm multiplies."""
    if BACKEND == "triton":
        return False
    if BACKEND == "auto" and not (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)):
        return False
    if not hasattr(torch, "_grouped_mm"):
        say_triton_instead(f"this torch ({torch.__version__}) has no torch._grouped_mm")
        return False
    if x.dtype != torch.bfloat16:
        say_triton_instead(f"torch._grouped_mm multiplies bf16 only, not {x.dtype}")
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (9, 0):
        say_triton_instead("torch._grouped_mm's fast kernel needs compute capability 9.0 or newer")
        return False
    sizes = {"input features": k, "output features": n}
    if lora is not None:
        sizes["LoRA rank"] = lora.rank
    for name, size in sizes.items():
        if size % 8:
            say_triton_instead(f"{name} = {size} is not a multiple of 8 (rows of 16 bytes)")
            return False
    return True


def _bf16_matrices(t: torch.Tensor) -> torch.Tensor:
    """t (E, a, b) in bf16 with the layout torch._grouped_mm reads: kept where it already
    is one (a view of the stored weights), else copied contiguous (the adapters, which
    PEFT keeps in fp32 and in an expert-interleaved view)."""
    if t.dtype == torch.bfloat16 and _leading_stride_aligned(t):
        return t
    return t.to(dtype=torch.bfloat16, memory_format=torch.contiguous_format)


def grouped_mm_lora_gemm(
    x: torch.Tensor,
    routing: ExpertRouting,
    weight: torch.Tensor,
    lora: ExpertLoRA | None,
    bias: torch.Tensor | None,
    *,
    gather: bool,
    store_xa: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grouped_lora_gemm's (Y, XA) through torch._grouped_mm; weight logically (E, N, K) in
    any layout torch._grouped_mm reads (its transposed view is what it multiplies).  Rows
    of no expert (past ``offsets[E]``) belong to no group and are left unwritten, as the
    Triton kernel leaves them."""
    ends = routing.offsets[1:].to(torch.int32)  # group e is rows offsets[e] .. ends[e] - 1
    rows = x[routing.tokens.long()] if gather else x
    y = torch._grouped_mm(rows, _bf16_matrices(weight.mT), offs=ends)
    xa = None
    if lora is not None:
        xa = torch._grouped_mm(rows, _bf16_matrices(lora.A.mT), offs=ends)  # (M, r)
        y = y + lora.scale * torch._grouped_mm(xa, _bf16_matrices(lora.B.mT), offs=ends)
    if bias is not None:
        expert_of_row = routing.row_expert.long().clamp(max=bias.shape[0] - 1)
        y = y + bias.to(y.dtype)[expert_of_row]
    return y, (xa if store_xa else None)
