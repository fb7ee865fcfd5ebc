"""Launch settings and dispatch rules shared by every op in slothkit_kernels.

Dispatch: an op runs its Triton kernel when its tensors live on a CUDA device,
or on the CPU when the Triton interpreter is on (``TRITON_INTERPRET=1``, which
must be set before this package is imported, because ``triton.jit`` picks the
interpreter at decoration time).  Otherwise it runs its plain-torch reference,
which computes the same function more slowly; that is said once per op.

The interpreter evaluates bf16/fp16 arithmetic incorrectly, so every kernel
casts loaded values to fp32 straight after ``tl.load`` and only rounds to the
storage dtype at ``tl.store``.  That is also what the GPU path wants: all
reductions and transcendental functions run in fp32.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

# Largest block a single Triton program handles along one row.  Rows longer than
# this (e.g. Gemma's 256,000-entry vocabulary) are processed in chunks.
MAX_FUSED_SIZE = 65536

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU through the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on `device`: a CUDA device (ROCm builds of torch
    call theirs "cuda" too), or the CPU under the Triton interpreter."""
    device_type = torch.device(device).type
    return device_type == "cuda" or (device_type == "cpu" and interpreter_enabled())


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernel (rather than the torch reference) should run.

    All tensors must share a device; mixing is refused by the ops themselves.
    """
    return triton_runs_on(tensors[0].device)


@functools.cache
def warn_reference_once(op_name: str, device_type: str) -> None:
    warnings.warn(
        f"slothkit_kernels.{op_name}: no Triton backend for device '{device_type}' "
        f"(set TRITON_INTERPRET=1 to run the kernels on CPU); using the slower "
        f"plain-torch reference, which computes the same result.",
        stacklevel=3,
    )


def calculate_settings(n: int) -> tuple[int, int]:
    """Block size (next power of two >= n) and warp count for a row of n elements."""
    block_size = triton.next_power_of_2(n)
    if block_size > MAX_FUSED_SIZE:
        raise ValueError(
            f"a row of {n} elements exceeds the largest fused block ({MAX_FUSED_SIZE}); "
            f"this op must chunk the row instead"
        )
    num_warps = 4
    if block_size >= 32768:
        num_warps = 32
    elif block_size >= 8192:
        num_warps = 16
    elif block_size >= 2048:
        num_warps = 8
    return block_size, num_warps


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {tensor.dtype}; supported: float32, float16, bfloat16")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device, got {listing}")


def check_not_empty(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(tensor.shape)})")


@triton.jit
def tanh(x):
    """tanh in fp32 for any Triton version: sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|)
    in (0, 1], which cannot overflow. Near 0 it is off by about 1e-7 absolute (1 - e
    cancels), which a soft-cap's c * tanh(s / c) scales to c * 1e-7."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)
