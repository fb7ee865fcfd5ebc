"""Keep bitsandbytes' 4-bit weights in the layout they were quantised in.

On a CPU with AVX512-BF16 (AMD EPYC, recent Xeons), bitsandbytes 0.50's Linear4bit
repacks its weight for its CPU kernels on its first forward in eval mode whose input
needs no gradient (``Linear4bit.forward``, which calls
bitsandbytes.functional._convert_weight_packed_for_cpu):
the codes are regrouped in tiles of 32 output rows, the double-quantised block scales are
dequantised and rounded to bfloat16, and the product is then computed in bfloat16.  That
changes a model slothkit loads in three ways:

  * a layer whose out_features is not a multiple of 32 fails ("N must be divisible by
    block_n"), in Hugging Face's generate as much as in slothkit's;
  * the numbers change: w = code * bf16(absmax) rather than code * absmax, and a bf16
    product even in an fp32 model, so evaluation no longer computes what training did;
  * the weight can no longer be read as NF4 (slothkit_kernels.nf4.weight), and
    bitsandbytes' inverse cannot give it back: the rounded scales are quantised again,
    around another offset.

So slothkit turns the repacking off on the layers it owns, through the per-layer switch
bitsandbytes reads (``support_avx512bf16_for_cpu``, set from the CPU's features in
``Linear4bit.__init__``), and refuses a weight that was repacked before it got there.
The cost is bitsandbytes' bf16 CPU GEMM, faster on such CPUs than dequantising; slothkit
on a CPU is for checking a model against its training and against Hugging Face, where
the same numbers come first.
"""

from __future__ import annotations

from torch import nn

# The Linear4bit attribute its forward reads before repacking (as of bitsandbytes 0.50).
REPACK_SWITCH = "support_avx512bf16_for_cpu"


def keep_nf4_layout(module: nn.Module) -> None:
    """Keep bitsandbytes from repacking the 4-bit weights of ``module`` and its
    submodules for its CPU kernels (a no-op where none would be, or none is 4-bit).

    Args:
        module: a model, or a layer, whose bitsandbytes Linear4bit layers slothkit reads.
    """
    for layer in module.modules():
        if hasattr(layer, REPACK_SWITCH):
            setattr(layer, REPACK_SWITCH, False)


def is_repacked_for_cpu(quant_state) -> bool:
    """Whether bitsandbytes has repacked this weight for its CPU kernels."""
    return bool(getattr(quant_state, "packing_format_for_cpu", False))


def repacked_weight_error(layer: nn.Module) -> ValueError:
    """The error for a 4-bit weight that bitsandbytes has already repacked."""
    return ValueError(
        f"the 4-bit weight of this {type(layer).__name__} ({layer.in_features} -> "
        f"{layer.out_features}) was repacked by bitsandbytes for its CPU kernels "
        f"(quant_state.packing_format_for_cpu), which rounds its block scales to bfloat16: it "
        f"no longer holds the values it was quantised to, and slothkit does not read it. "
        f"bitsandbytes does this at the first forward in eval mode whose input needs no gradient, "
        f"on a CPU with AVX512-BF16; load the model with FastModel.from_pretrained (which turns this "
        f"off), or call slothkit.engine.nf4_layout.keep_nf4_layout(model) on a model you "
        f"loaded yourself before its first such forward"
    )
