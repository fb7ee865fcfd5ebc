"""Linear layers that read the same input, applied together for decoding.

A decode step is bound by kernel launches, not by arithmetic: PEFT's LoRA layer costs
five launches per projection (the base matmul, x A^T, (x A^T) B^T, the scaling and the
sum) plus two casts when the adapters are kept in fp32, about seventy per decoder layer.
Projections that share an input (q, k and v; gate and up) share their first adapter
matmul here, and each adapter's second matmul accumulates into its base output in the
same launch:

    x A^T for all of them = x [A_1; A_2; A_3]^T              one launch (stacked A)
    y_i = base_i(x);  y_i += scaling_i (x A_i^T) B_i^T          two launches each (addmm_)

which is what slothkit's fused training functions compute too (the adapters cast to the
compute dtype), with no merge: the base weights (16-bit or NF4) are read where they are.
On a GPU a 16-bit projection of one to eight rows may instead run slothkit's
``lora_gemv``, which adds the adapter in its GEMV's epilogue (one launch): where it was
timed faster than cuBLAS's GEMV and the ``addmm_`` for that shape (gemv_choice.py);
and where every layer of the group is such a weight, the whole group (q, k and v; gate
and up) may run as one ``lora_gemv_group`` launch (``nf4_lora_gemv_group`` for NF4
weights quantised alike), where that was timed faster than each projection on its own
path: a small projection alone cannot fill the GPU long enough to stream its weight at
full bandwidth.
The stacked A and the cast B are small copies of the adapters, refreshed before each
generate call when an adapter tensor was changed in place (its version counter moved),
so training between generate calls is seen.

NF4 base weights (bitsandbytes Linear4bit) are read by bitsandbytes' layer for one row
of x (its 4-bit GEMV, the batch-1 decode step).  For more rows (the prefill, a batched
step) bitsandbytes dequantises the whole weight and multiplies; slothkit's dequantisation
kernel gives the same bits about 1.4x faster (docs/kernel-benchmarks.md), so those calls
dequantise with it and multiply with the same F.linear.  On a GPU, one to eight rows may
instead run slothkit's ``nf4_lora_gemv``, which dequantises in registers (the weight is
read as its half-byte codes, never written out) and adds the adapter in its epilogue:
where it was timed faster than that path and the ``addmm_`` for the shape (gemv_choice.py).

Layers that cannot be described this way (several active adapters, DoRA, dropout while
training, a bias on B) are applied by their own forward, with the same result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from slothkit.engine.lora_projection import describe
from slothkit.engine.nf4_layout import keep_nf4_layout
from slothkit.inference.gemv_choice import (
    dense_path,
    gemv_candidate,
    group_gemv_candidate,
    nf4_gemv_candidate,
    nf4_group_gemv_candidate,
)
from slothkit_kernels.lora.gemv import MAX_ROWS, lora_gemv
from slothkit_kernels.lora.gemv_group import MAX_GROUPS, lora_gemv_group
from slothkit_kernels.nf4.gemv import host_levels, nf4_lora_gemv, supports
from slothkit_kernels.nf4.gemv_group import nf4_lora_gemv_group
from slothkit_kernels.nf4.weight import NF4Weight


def _base_layer(layer: nn.Module) -> nn.Module:
    return getattr(layer, "base_layer", layer)


def _nf4_base(layer: nn.Module, described, dtype: torch.dtype):
    """(NF4Weight, bias) of a bitsandbytes NF4 base layer that computes in ``dtype`` and
    dequantises to it, else None (the layer's own forward is used)."""
    if isinstance(described, str) or not isinstance(described.weight, NF4Weight):
        return None
    compute_dtype = getattr(_base_layer(layer), "compute_dtype", None)
    if described.weight.dtype != dtype or compute_dtype not in (None, dtype):
        return None
    bias = described.bias
    return described.weight, (None if bias is None else bias.to(dtype))


def _dense_base(described, dtype: torch.dtype):
    """(weight, bias) of a 16-bit base weight in ``dtype`` that slothkit's GEMV can read,
    else None."""
    if isinstance(described, str) or isinstance(described.weight, NF4Weight):
        return None
    weight, bias = described.weight, described.bias
    if weight.dtype != dtype or weight.stride(-1) != 1 or (bias is not None and bias.dtype != dtype):
        return None
    return weight, bias


def _gemv_may_run(rows: torch.Tensor) -> bool:
    """Whether slothkit's GEMV is considered at all: a decode step's few rows on a GPU."""
    return rows.is_cuda and rows.shape[0] <= MAX_ROWS


class SharedInputProjections:
    """Apply ``layers`` (all reading the same input) with their adapters, for decoding.

    Args:
        layers: PEFT LoRA linears, plain nn.Linear or bitsandbytes Linear4bit layers with
            the same in_features.
        dtype: the compute dtype (that of the activations); the adapter copies are kept in it.
    """

    def __init__(self, layers: Sequence[nn.Module], dtype: torch.dtype):
        self.layers = list(layers)
        for layer in self.layers:
            # One row goes through bitsandbytes' layer, more through the NF4Weight read
            # here: both must see the weight as it was quantised, not repacked for
            # bitsandbytes' CPU kernels at its first eval forward (engine/nf4_layout.py).
            keep_nf4_layout(layer)
        with torch.no_grad():  # describe() refuses trainable bases only under autograd
            described = [describe(layer) for layer in self.layers]
        self.own_forward = any(isinstance(d, str) for d in described)
        self.nf4 = [_nf4_base(layer, d, dtype) for layer, d in zip(self.layers, described)]
        self.dense = [_dense_base(d, dtype) for d in described]
        self.adapters = [] if self.own_forward else [d for d in described if d.lora_a is not None]
        self.with_adapter = [not self.own_forward and d.lora_a is not None for d in described]
        self.scalings = [d.scaling for d in self.adapters]
        self.dense_group = self._dense_group()
        self.nf4_group = self._nf4_group()
        self.stacked_a = self.b = None
        self._versions = None
        if self.adapters:
            device = self.adapters[0].lora_a.device
            ranks = [d.lora_a.shape[0] for d in self.adapters]
            self.stacked_a = torch.empty(
                sum(ranks), self.adapters[0].lora_a.shape[1], dtype=dtype, device=device
            )
            self.a_rows = list(self.stacked_a.split(ranks))
            self.b = [torch.empty(d.lora_b.shape, dtype=dtype, device=device) for d in self.adapters]
            self.refresh()

    def _dense_group(self):
        """(weights, biases or None) where every layer is a contiguous 16-bit weight that
        ``lora_gemv_group`` can read with the others in one launch, else None."""
        if self.own_forward or not 1 < len(self.layers) <= MAX_GROUPS or None in self.dense:
            return None
        weights = [weight for weight, _ in self.dense]
        biases = [bias for _, bias in self.dense]
        if not all(w.is_contiguous() for w in weights) or len({b is None for b in biases}) > 1:
            return None
        return weights, (None if biases[0] is None else biases)

    def _nf4_group(self):
        """(weights, biases or None) where every layer is an NF4 weight that
        ``nf4_lora_gemv_group`` can read with the others in one launch (quantised alike,
        one table of levels: bitsandbytes' layers of one model are), else None."""
        if self.own_forward or not 1 < len(self.layers) <= MAX_GROUPS or None in self.nf4:
            return None
        weights = [weight for weight, _ in self.nf4]
        biases = [bias for _, bias in self.nf4]

        def quantisation(w):
            return w.blocksize, w.is_nested, w.nested_blocksize if w.is_nested else None, w.dtype, w.shape[1]

        if len({b is None for b in biases}) > 1 or not all(supports(w) for w in weights):
            return None
        if len({quantisation(w) for w in weights}) > 1 or len({host_levels(w) for w in weights}) > 1:
            return None
        return weights, (None if biases[0] is None else biases)

    def refresh(self) -> None:
        """Copy the adapters into the decode copies if any was changed since the last copy."""
        if not self.adapters:
            return
        versions = [(d.lora_a._version, d.lora_b._version) for d in self.adapters]
        if versions == self._versions:
            return
        with torch.no_grad():
            for rows, b, d in zip(self.a_rows, self.b, self.adapters):
                rows.copy_(d.lora_a)
                b.copy_(d.lora_b)
        self._versions = versions

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output for ``x`` (..., in_features)."""
        if self.own_forward:
            return [layer(x) for layer in self.layers]
        rows = x.reshape(-1, x.shape[-1])
        low_rank = None  # (N, sum of ranks): x A^T of every adapter, side by side
        if self.adapters:
            if _gemv_may_run(rows) and rows.dtype == self.stacked_a.dtype:
                # A GEMV too, of few output columns and a long K, which cuBLAS may split
                # into two launches: slothkit's where timed faster (gemv_choice).
                low_rank = dense_path(rows, self.stacked_a, None, None, None, 1.0)
            else:
                low_rank = rows @ self.stacked_a.t()
        terms = []  # per layer: (its columns of low_rank, its B, its scaling)
        start = adapter = 0
        for index in range(len(self.layers)):
            if self.with_adapter[index]:
                b = self.b[adapter]
                terms.append((low_rank[:, start : start + b.shape[1]], b, self.scalings[adapter]))
                start += b.shape[1]
                adapter += 1
            else:
                terms.append((None, None, 1.0))
        # The whole group in one launch where that was timed faster than each projection
        # on its own path (gemv_choice).
        outs = self._group_outputs(rows, low_rank, [t[1] for t in terms], [t[2] for t in terms])
        if outs is not None:
            return [out.view(*x.shape[:-1], out.shape[-1]) for out in outs]
        return [self._output(index, x, rows, *terms[index]) for index in range(len(self.layers))]

    def _group_outputs(self, rows, low_rank, lora_bs, scalings) -> list[torch.Tensor] | None:
        """Every layer's output (N, out) from one group launch, or None where none runs."""
        if not _gemv_may_run(rows):
            return None
        if self.dense_group is not None:
            weights, biases = self.dense_group
            candidate = group_gemv_candidate(rows, weights, biases, low_rank, lora_bs, scalings)
            if candidate is not None:
                return lora_gemv_group(
                    rows, weights, biases, low_rank, lora_bs, scalings, candidate=candidate
                )
        elif self.nf4_group is not None and rows.dtype == self.nf4_group[0][0].dtype:
            weights, biases = self.nf4_group
            bases = [
                lambda weight, layer=layer, bias=bias: _nf4_base_output(layer, rows, weight, bias)
                for layer, (_, bias) in zip(map(_base_layer, self.layers), self.nf4)
            ]
            candidate = nf4_group_gemv_candidate(rows, weights, biases, low_rank, lora_bs, scalings, bases)
            if candidate is not None:
                return nf4_lora_gemv_group(
                    rows, weights, biases, low_rank, lora_bs, scalings, candidate=candidate
                )
        return None

    def _output(self, index: int, x, rows, xa, b, scaling: float) -> torch.Tensor:
        """One layer's output: through slothkit's GEMV with the adapter in its epilogue
        where that was timed faster for this shape (gemv_choice), else the base layer's
        output with the adapter accumulated into it."""
        dense, nf4 = self.dense[index], self.nf4[index]
        out = None
        if dense is not None and _gemv_may_run(rows):
            candidate = gemv_candidate(rows, *dense, xa, b, scaling)
            if candidate is not None:
                out = lora_gemv(rows, *dense, xa, b, scaling, candidate=candidate)
        elif nf4 is not None and _gemv_may_run(rows) and rows.dtype == nf4[0].dtype:
            layer = _base_layer(self.layers[index])
            candidate = nf4_gemv_candidate(
                rows, *nf4, xa, b, scaling, lambda weight: _nf4_base_output(layer, rows, weight, nf4[1])
            )
            if candidate is not None:
                out = nf4_lora_gemv(rows, *nf4, xa, b, scaling, candidate=candidate)
        if out is not None:
            return out.view(*x.shape[:-1], out.shape[-1])
        output = self._base_output(index, x)
        if xa is not None:
            output.view(-1, output.shape[-1]).addmm_(xa, b.t(), alpha=scaling)
        return output

    def _base_output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        nf4 = self.nf4[index]
        if nf4 is None or x.numel() == x.shape[-1] or x.dtype != nf4[0].dtype:
            return _base_layer(self.layers[index])(x)
        from slothkit_kernels.nf4 import dequantize_nf4

        weight, bias = nf4
        return F.linear(x, dequantize_nf4(weight), bias)


def _nf4_base_output(layer: nn.Module, rows: torch.Tensor, weight: NF4Weight, bias) -> torch.Tensor:
    """What the bitsandbytes layer ``layer`` computes for ``rows`` (N, K) in its compute
    dtype, read from ``weight`` (its NF4 weight, or the same over a copy of the codes, which
    the GEMV choice times with): bitsandbytes' ``matmul_4bit``, as the layer's forward
    calls it (its 4-bit GEMV for one row), for more rows slothkit's dequantisation and
    F.linear (``SharedInputProjections._base_output``)."""
    if rows.shape[0] > 1:
        from slothkit_kernels.nf4 import dequantize_nf4

        return F.linear(rows, dequantize_nf4(weight), bias)
    import bitsandbytes as bnb

    param = layer.weight
    packed = weight.packed.view(param.dtype).reshape(param.shape)
    return bnb.matmul_4bit(rows, packed.t(), bias=bias, quant_state=param.quant_state)
