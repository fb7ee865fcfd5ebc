"""What slothkit.bench.kernels measures: shapes, inputs, implementations and byte counts.

One builder per op returns its :class:`Case` objects.  Building a case allocates
nothing: inputs are made on demand by ``make_inputs`` (fresh and seeded, so every
implementation sees the same values), and each op is imported only when its
implementation is loaded, so a missing op shows up as "not available" in the table.

Byte counts are the least traffic the op needs to make: each input read once and
each output written once, over the whole pass.  For forward+backward that means
the forward inputs, the output gradient and the forward output once each, plus the
input gradients; s below is the element size in bytes.  FLOP counts are given for
the matmul-bound ops only.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

Inputs = dict[str, Any]
Impl = Callable[[Inputs], Any]  # inputs -> output tensor or tuple of tensors

SHAPE_SETS = ("full", "quick", "tiny")


@dataclass
class Case:
    op: str
    shape: str  # human-readable shape, e.g. "16384x4096"
    dtype: torch.dtype
    make_inputs: Callable[[torch.device, bool], Inputs]  # (device, requires_grad) -> inputs
    impls: dict[str, Callable[[], Impl]]  # impl name -> loader (may raise: "not available")
    bytes_fwd: int
    bytes_fwd_bwd: int | None  # None: the op has no backward pass
    flops_fwd: int | None = None
    flops_fwd_bwd: int | None = None
    note: str = ""


def _kernel(module: str, name: str, bind: Callable[[Callable, Inputs], Any]) -> Callable[[], Impl]:
    """Loader for slothkit_kernels.<module>.<name>, called on inputs through ``bind``."""

    def load() -> Impl:
        fn = getattr(importlib.import_module(f"slothkit_kernels.{module}"), name)
        return lambda inputs: bind(fn, inputs)

    return load


def _plain(fn: Impl) -> Callable[[], Impl]:
    """Loader for a plain-torch implementation defined in this file."""
    return lambda: fn


def _randn(shape, device, dtype, requires_grad=False, scale=1.0) -> torch.Tensor:
    t = torch.randn(shape, device=device, dtype=torch.float32) * scale
    return t.to(dtype).requires_grad_(requires_grad)


def _labels(n_rows: int, vocab: int, device) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n_rows,), device=device)
    labels[::7] = -100  # some ignored positions (padding / prompt tokens)
    return labels


# --- rms_norm ------------------------------------------------------------------------


def rms_norm_cases(shapes: str, dtype: torch.dtype) -> list[Case]:
    sizes = {"full": [(16384, 4096), (8192, 3072)], "quick": [(8192, 3072)], "tiny": [(7, 33)]}

    def bind(fn, i):
        return fn(i["x"], i["weight"], eps=1e-6)

    cases = []
    for n, d in sizes[shapes]:

        def make(device, grad, n=n, d=d):
            torch.manual_seed(0)
            weight = (1.0 + 0.1 * torch.randn(d, device=device)).to(dtype).requires_grad_(grad)
            return {"x": _randn((n, d), device, dtype, grad), "weight": weight}

        s = dtype.itemsize
        fwd = s * (n * d + d + n * d)  # read x, weight; write y
        cases.append(
            Case(
                "rms_norm",
                f"{n}x{d}",
                dtype,
                make,
                {
                    "eager": _kernel("rms_norm", "rms_norm_reference", bind),
                    "slothkit": _kernel("rms_norm", "rms_norm", bind),
                },
                bytes_fwd=fwd,
                bytes_fwd_bwd=fwd + s * (n * d + n * d + d),  # + read dy; write dx, dweight
            )
        )
    return cases


# --- rope ----------------------------------------------------------------------------


def _rope_bind(fn, i):
    q, k = i["q"], i["k"]
    if q.requires_grad:  # rope works in place, which autograd refuses on leaf tensors
        q, k = q.clone(), k.clone()
    return fn(q, k, i["cos"], i["sin"])


def rope_cases(shapes: str, dtype: torch.dtype) -> list[Case]:
    # (batch, q heads, kv heads, tokens, head dim)
    sizes = {"full": [(2, 32, 8, 4096, 128)], "quick": [(2, 32, 8, 4096, 128)], "tiny": [(1, 4, 2, 5, 16)]}
    cases = []
    for b, hq, hk, t, d in sizes[shapes]:

        def make(device, grad, b=b, hq=hq, hk=hk, t=t, d=d):
            torch.manual_seed(0)
            inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device) / d))
            angles = torch.arange(t, device=device)[:, None] * inv_freq[None, :]
            angles = torch.cat([angles, angles], dim=-1).expand(b, t, d)  # (B, T, D)
            return {
                "q": _randn((b, hq, t, d), device, dtype, grad),
                "k": _randn((b, hk, t, d), device, dtype, grad),
                "cos": angles.cos().to(dtype).contiguous(),
                "sin": angles.sin().to(dtype).contiguous(),
            }

        s = dtype.itemsize
        qk = b * (hq + hk) * t * d
        fwd = s * (qk + 2 * b * t * d + qk)  # read q, k, cos, sin; write q, k
        cases.append(
            Case(
                "rope",
                f"B{b} Hq{hq} Hkv{hk} T{t} D{d}",
                dtype,
                make,
                {
                    "eager": _kernel("rope", "rope_reference", _rope_bind),
                    "slothkit": _kernel("rope", "rope", _rope_bind),
                },
                bytes_fwd=fwd,
                # + read dq, dk; write their grads; + the clone of q, k (read + write)
                bytes_fwd_bwd=fwd + s * 2 * qk + s * 2 * qk,
                note="fwd+bwd includes a clone of q, k (in-place op on leaf tensors), counted in bytes",
            )
        )
    return cases


# --- swiglu / geglu ------------------------------------------------------------------


def _gated_cases(op: str, shapes: str, dtype: torch.dtype) -> list[Case]:
    sizes = {"full": [(16384, 14336)], "quick": [(4096, 14336)], "tiny": [(5, 37)]}

    def bind(fn, i):
        return fn(i["gate"], i["up"])

    cases = []
    for n, f in sizes[shapes]:

        def make(device, grad, n=n, f=f):
            torch.manual_seed(0)
            return {"gate": _randn((n, f), device, dtype, grad), "up": _randn((n, f), device, dtype, grad)}

        s = dtype.itemsize
        cases.append(
            Case(
                op,
                f"{n}x{f}",
                dtype,
                make,
                {"eager": _kernel(op, f"{op}_reference", bind), "slothkit": _kernel(op, op, bind)},
                bytes_fwd=s * 3 * n * f,  # read gate, up; write h
                bytes_fwd_bwd=s * 6 * n * f,  # + read dh; write dgate, dup
            )
        )
    return cases


def swiglu_cases(shapes, dtype):
    return _gated_cases("swiglu", shapes, dtype)


def geglu_cases(shapes, dtype):
    return _gated_cases("geglu", shapes, dtype)


# --- cross_entropy -------------------------------------------------------------------


def cross_entropy_cases(shapes: str, dtype: torch.dtype) -> list[Case]:
    # (rows, vocab, softcap): Llama-3 and Gemma vocabularies; Gemma-2 caps logits at 30
    sizes = {
        "full": [(8192, 128256, None), (8192, 256000, None), (8192, 256000, 30.0)],
        "quick": [(8192, 128256, None)],
        "tiny": [(4, 97, None), (3, 300, 30.0)],
    }
    cases = []
    for n, v, cap in sizes[shapes]:

        def bind(fn, i, cap=cap):
            return fn(i["logits"], i["labels"], softcap=cap)

        def make(device, grad, n=n, v=v):
            torch.manual_seed(0)
            return {"logits": _randn((n, v), device, dtype, grad, scale=2.0), "labels": _labels(n, v, device)}

        s = dtype.itemsize
        fwd = s * n * v + 8 * n + 4  # read logits, int64 labels; write the loss
        cases.append(
            Case(
                "cross_entropy",
                f"{n}x{v}" + (f" softcap {cap:g}" if cap else ""),
                dtype,
                make,
                {
                    "eager": _kernel("cross_entropy", "cross_entropy_reference", bind),
                    "slothkit": _kernel("cross_entropy", "cross_entropy", bind),
                },
                bytes_fwd=fwd,
                bytes_fwd_bwd=fwd + s * n * v,  # + write dlogits
            )
        )
    return cases


# --- fused_linear_cross_entropy ------------------------------------------------------


def _linear_ce_torch(i: Inputs) -> torch.Tensor:
    return F.cross_entropy(i["hidden"] @ i["lm_weight"].t(), i["labels"])


def _linear_ce_torch_fp32(i: Inputs) -> torch.Tensor:
    # What Hugging Face's causal-LM loss does: upcast the logits before the loss.
    return F.cross_entropy((i["hidden"] @ i["lm_weight"].t()).float(), i["labels"])


def fused_linear_cross_entropy_cases(shapes: str, dtype: torch.dtype) -> list[Case]:
    # (tokens, vocab, hidden): Gemma-7B-like head, Llama-3-8B head
    sizes = {
        "full": [(8192, 256000, 3072), (8192, 128256, 4096)],
        "quick": [(8192, 256000, 3072)],
        "tiny": [(6, 50, 16)],
    }

    def bind(fn, i):
        return fn(i["hidden"], i["lm_weight"], i["labels"])

    cases = []
    for n, v, h in sizes[shapes]:

        def make(device, grad, n=n, v=v, h=h):
            torch.manual_seed(0)
            return {
                "hidden": _randn((n, h), device, dtype, grad),
                "lm_weight": _randn((v, h), device, dtype, scale=h**-0.5),  # frozen
                "labels": _labels(n, v, device),
            }

        s = dtype.itemsize
        fwd = s * (n * h + v * h) + 8 * n + 4  # read hidden, weight, labels; write the loss
        cases.append(
            Case(
                "fused_linear_cross_entropy",
                f"{n} tok x {v} vocab x {h} hidden",
                dtype,
                make,
                {
                    "eager": _plain(_linear_ce_torch),
                    "eager-fp32": _plain(_linear_ce_torch_fp32),
                    "slothkit": _kernel("fused_linear_cross_entropy", "fused_linear_cross_entropy", bind),
                },
                bytes_fwd=fwd,
                bytes_fwd_bwd=fwd + s * n * h,  # + write dhidden (the weight is frozen)
                flops_fwd=2 * n * h * v,  # logits
                flops_fwd_bwd=4 * n * h * v,  # + dhidden = dlogits @ W
                note="eager = F.cross_entropy(hidden @ W.T); eager-fp32 upcasts logits as HF does",
            )
        )
    return cases


# --- nf4 -----------------------------------------------------------------------------

NF4_BLOCKSIZE = 64  # bitsandbytes' default for 4-bit weights
NF4_NESTED_BLOCKSIZE = 256  # bitsandbytes' fixed block for double quantisation


def _nf4_inputs(rows: int, cols: int, dtype: torch.dtype, device) -> Inputs:
    import bitsandbytes.functional as bnbf  # optional: without it the case is not available

    from slothkit_kernels.nf4.weight import NF4Weight

    torch.manual_seed(0)
    dense = _randn((rows, cols), device, dtype, scale=0.02)
    packed, state = bnbf.quantize_4bit(
        dense, blocksize=NF4_BLOCKSIZE, compress_statistics=True, quant_type="nf4"
    )
    return {"weight": NF4Weight.from_bitsandbytes(packed, state), "packed": packed, "state": state}


def _bitsandbytes_dequant() -> Impl:
    import bitsandbytes.functional as bnbf

    return lambda i: bnbf.dequantize_4bit(i["packed"], i["state"])


def _nf4_record_bytes(rows: int, cols: int) -> int:
    """Bytes of a double-quantised NF4 record: what a kernel reading the weight must read."""
    n = rows * cols
    blocks = n // NF4_BLOCKSIZE
    return (
        n // 2  # packed 4-bit codes
        + blocks  # uint8 absmax codes
        + 4 * math.ceil(blocks / NF4_NESTED_BLOCKSIZE)  # fp32 nested scales
        + 4 * (16 + 256)  # the two code tables
    )


def nf4_cases(shapes: str, dtype: torch.dtype) -> list[Case]:
    sizes = {"full": [(14336, 4096), (4096, 4096)], "quick": [(14336, 4096)], "tiny": [(16, 64)]}

    def bind(fn, i):
        return fn(i["weight"])

    cases = []
    for rows, cols in sizes[shapes]:
        n = rows * cols
        stored = _nf4_record_bytes(rows, cols)
        cases.append(
            Case(
                "nf4",
                f"dequant {rows}x{cols}",
                dtype,
                lambda device, grad, rows=rows, cols=cols: _nf4_inputs(rows, cols, dtype, device),
                {
                    "eager": _kernel("nf4", "dequantize_nf4_reference", bind),
                    "slothkit": _kernel("nf4", "dequantize_nf4", bind),
                    "bitsandbytes": _bitsandbytes_dequant,
                },
                bytes_fwd=stored + dtype.itemsize * n,  # read the NF4 record; write the weight
                bytes_fwd_bwd=None,
                note="double-quantised, blocksize 64",
            )
        )
    return cases


# --- lora_mlp ------------------------------------------------------------------------

LORA_RANK = 16
LORA_SCALING = 2.0  # alpha / rank with alpha = 32
PROJECTIONS = ("gate", "up", "down")


def _lora_mlp_torch(i: Inputs) -> torch.Tensor:
    def project(x, p):
        adapter = F.linear(F.linear(x, i[f"{p}_a"]), i[f"{p}_b"])
        return F.linear(x, i[f"{p}_weight"]) + LORA_SCALING * adapter

    x = i["x"]
    return project(F.silu(project(x, "gate")) * project(x, "up"), "down")


def _lora_mlp_kernel() -> Impl:
    module = importlib.import_module("slothkit_kernels.lora")

    def run(i: Inputs):
        proj = {
            p: module.LoRAProjection(i[f"{p}_weight"], i[f"{p}_a"], i[f"{p}_b"], LORA_SCALING)
            for p in PROJECTIONS
        }
        return module.lora_mlp(i["x"], proj["gate"], proj["up"], proj["down"], activation="swiglu")

    return run


def lora_mlp_cases(shapes: str, dtype: torch.dtype) -> list[Case]:
    # (tokens, hidden, intermediate): Llama-3-8B's MLP
    sizes = {"full": [(4096, 4096, 14336)], "quick": [(4096, 4096, 14336)], "tiny": [(5, 16, 24)]}
    cases = []
    for t, h, f in sizes[shapes]:
        r = LORA_RANK if shapes != "tiny" else 4
        dims = {"gate": (h, f), "up": (h, f), "down": (f, h)}  # (in, out)

        def make(device, grad, t=t, h=h, r=r, dims=dims):
            torch.manual_seed(0)
            inputs = {"x": _randn((1, t, h), device, dtype, grad)}
            for p, (d_in, d_out) in dims.items():
                inputs[f"{p}_weight"] = _randn((d_out, d_in), device, dtype, scale=d_in**-0.5)
                inputs[f"{p}_a"] = _randn((r, d_in), device, dtype, grad, scale=d_in**-0.5)
                inputs[f"{p}_b"] = _randn((d_out, r), device, dtype, grad, scale=0.01)
            return inputs

        s = dtype.itemsize
        adapters = 3 * r * (h + f)  # A and B of the three projections
        fwd = s * (t * h + 3 * h * f + adapters + t * h)  # read x, weights, adapters; write y
        base, lora = 6 * t * h * f, 6 * t * r * (h + f)  # forward matmul FLOPs
        cases.append(
            Case(
                "lora_mlp",
                f"{t} tok {h}->{f} r{r}",
                dtype,
                make,
                {"eager": _plain(_lora_mlp_torch), "slothkit": _lora_mlp_kernel},
                bytes_fwd=fwd,
                bytes_fwd_bwd=fwd + s * (2 * t * h + adapters),  # + read dy; write dx, adapter grads
                flops_fwd=base + lora,
                # frozen weights: backward needs only dx through them (1x);
                # adapters need dx, dA and dB (2x)
                flops_fwd_bwd=2 * base + 3 * lora,
                note="frozen base weights, SwiGLU, scaling 2",
            )
        )
    return cases


# --- attention (soft-capped) --------------------------------------------------------


def _sdpa_uncapped(i: Inputs) -> torch.Tensor:
    """SDPA without the cap (it cannot apply one): the speed a capless model gets."""
    group = i["q"].shape[1] // i["k"].shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (i["k"], i["v"]))
    out = F.scaled_dot_product_attention(i["q"], k, v, is_causal=True, scale=i["scaling"])
    return out.transpose(1, 2)  # (B, T, H, D), as the others return it


def attention_cases(shapes: str, dtype: torch.dtype) -> list[Case]:
    # (batch, q heads, kv heads, length, head_dim, window): Gemma-2-9B's global and
    # sliding layers at 2 x 2048 (cap 50), Gemma-2-2B's head shape.
    sizes = {
        "full": [(2, 16, 8, 2048, 256, None), (2, 16, 8, 2048, 256, 4096), (2, 8, 4, 4096, 256, None)],
        "quick": [(2, 16, 8, 2048, 256, None)],
        "tiny": [(1, 2, 1, 40, 16, None), (1, 2, 1, 40, 16, 16)],
    }
    cases = []
    for batch, heads, kv_heads, length, dim, window in sizes[shapes]:

        def bind(fn, i, window=window):
            return fn(i["q"], i["k"], i["v"], i["scaling"], softcap=50.0, window=window)

        def make(device, grad, batch=batch, heads=heads, kv_heads=kv_heads, length=length, dim=dim):
            torch.manual_seed(0)
            return {
                "q": _randn((batch, heads, length, dim), device, dtype, grad),
                "k": _randn((batch, kv_heads, length, dim), device, dtype, grad),
                "v": _randn((batch, kv_heads, length, dim), device, dtype, grad),
                "scaling": dim**-0.5,
            }

        s = dtype.itemsize
        q_bytes, kv_bytes = s * batch * heads * length * dim, s * batch * kv_heads * length * dim
        fwd = 2 * q_bytes + 2 * kv_bytes  # read q, k, v; write the output
        causal_flops = 2 * 2 * batch * heads * length * length * dim // 2  # two products, half the scores
        cases.append(
            Case(
                "attention",
                f"{batch}x{heads}/{kv_heads}x{length}x{dim} softcap 50"
                + (f" window {window}" if window else ""),
                dtype,
                make,
                {
                    "eager": _kernel("attention", "attention_reference", bind),
                    "sdpa (no cap)": _plain(_sdpa_uncapped),
                    "slothkit": _kernel("attention", "attention", bind),
                },
                bytes_fwd=fwd,
                bytes_fwd_bwd=fwd + 2 * q_bytes + 2 * kv_bytes,  # + read dout, write dq, dk, dv
                flops_fwd=causal_flops,
                flops_fwd_bwd=causal_flops * 7 // 2,  # backward: q k^T again, dP, dV, dQ, dK
            )
        )
    return cases


BUILDERS: dict[str, Callable[[str, torch.dtype], list[Case]]] = {
    "rms_norm": rms_norm_cases,
    "rope": rope_cases,
    "swiglu": swiglu_cases,
    "geglu": geglu_cases,
    "cross_entropy": cross_entropy_cases,
    "fused_linear_cross_entropy": fused_linear_cross_entropy_cases,
    "nf4": nf4_cases,
    "lora_mlp": lora_mlp_cases,
    "attention": attention_cases,
}
OPS = tuple(BUILDERS)


def build_cases(ops, dtypes, shapes: str) -> list[Case]:
    """Every case for ``ops`` x ``dtypes`` at one shape set ("full", "quick" or "tiny")."""
    if shapes not in SHAPE_SETS:
        raise ValueError(f"shapes must be one of {SHAPE_SETS}, got {shapes!r}")
    return [case for op in ops for dtype in dtypes for case in BUILDERS[op](shapes, dtype)]
