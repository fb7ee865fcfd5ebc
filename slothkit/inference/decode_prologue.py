"""The seams between a decode step's projections, each in one launch where it can be.

Before q/k/v and before gate/up a decoder layer adds the last sublayer's output to the
residual stream and normalises it; the projections' adapters then start with x A^T of
their stacked A.  Before down it applies the gated activation, and down's adapter
starts with h A^T.  For the few rows of a decode step on a GPU those are each one
launch of slothkit's kernels (slothkit_kernels.decode_prologue) where the norm is
slothkit's RMSNorm and the activation slothkit's: the residual add, the norm and the A
product of a seam together, instead of three launches (the add, the norm, the A GEMV,
which cuBLAS may split in two).  Everywhere else (a prefill's many rows, a CPU, a
model's own norm or activation) the same sums run as before, one op at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from slothkit.inference.decode_projections import SharedInputProjections
from slothkit.model_state import patched_module
from slothkit_kernels.decode_prologue import MAX_ROWS, add_rms_norm_low_rank, gated_low_rank


def prologue_may_run(rows: torch.Tensor) -> bool:
    """Whether a seam runs as one launch: a decode step's few rows on a GPU."""
    return rows.is_cuda and rows.shape[0] <= MAX_ROWS


class NormBeforeProjections:
    """``hidden (+ update) -> (hidden, norm(hidden), x A^T or None)``: the residual add,
    the RMSNorm ``norm`` and the first adapter product of ``projections`` (which read the
    normed rows; None: the norm's output goes elsewhere, as a non-gated MLP's input), in
    one launch where ``prologue_may_run``; the A product is then handed to the projections
    rather than made by them."""

    def __init__(self, norm: nn.Module, projections: SharedInputProjections | None):
        self.norm = norm
        self.lora_a = None if projections is None else projections.stacked_a
        record = patched_module(norm)
        # slothkit's RMSNorm (engine.decoder.patch_rms_norm) records its eps and flavour;
        # a norm slothkit did not patch is the model's own and runs as it is.
        self.flavour = None if record is None or record.eps is None else (record.eps, record.adds_one)

    def _fusable(self, rows: torch.Tensor) -> bool:
        if self.flavour is None or not prologue_may_run(rows):
            return False
        lora_a = self.lora_a
        return self.norm.weight.dtype == rows.dtype and (lora_a is None or lora_a.dtype == rows.dtype)

    def __call__(
        self, hidden: torch.Tensor, update: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows = hidden.reshape(-1, hidden.shape[-1])
        if not self._fusable(rows):
            if update is not None:
                hidden = hidden + update
            return hidden, self.norm(hidden), None
        eps, gemma = self.flavour
        update_rows = None if update is None else update.reshape(rows.shape)
        summed, normed, low_rank = add_rms_norm_low_rank(
            rows, update_rows, self.norm.weight, eps, gemma, self.lora_a
        )
        return summed.view(hidden.shape), normed.view(hidden.shape), low_rank


def gated_before_projection(
    gate: torch.Tensor, up: torch.Tensor, activation: str | None, projection: SharedInputProjections
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(act(gate) * up, that times the A of projection's adapter)`` in one launch, or
    None where it does not run as one (no adapter, an activation slothkit does not fuse,
    a prefill's rows, a CPU)."""
    lora_a = projection.stacked_a
    rows = gate.reshape(-1, gate.shape[-1])
    if activation is None or lora_a is None or not prologue_may_run(rows) or lora_a.dtype != gate.dtype:
        return None
    return gated_low_rank(rows, up.reshape(rows.shape), activation, lora_a)
