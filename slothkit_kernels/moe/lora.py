"""The per-expert LoRA adapters of one expert projection, as the MoE kernels take them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertLoRA:
    """Adapters of E experts: y_e += scale * (x A_e^T) B_e^T.

    A is (E, r, in_features) and B is (E, out_features, r), in any strides: a view of
    PEFT's parameters (``lora_B.weight.reshape(out, r, E).permute(2, 0, 1)``) is read
    where it lies, never copied.  They may be in another float dtype than x (PEFT keeps
    adapters in fp32); the kernels read them in fp32 or round them to x's dtype for the
    tensor cores, and their gradients come back in their own dtype.
    """

    A: torch.Tensor  # (E, r, in_features)
    B: torch.Tensor  # (E, out_features, r)
    scale: float

    @property
    def rank(self) -> int:
        return self.A.shape[1]

    def transposed(self) -> ExpertLoRA:
        """The adapter of the transposed projection, x -> x W_e: A and B swap roles."""
        return ExpertLoRA(self.B.transpose(1, 2), self.A.transpose(1, 2), self.scale)
