"""slothkit_kernels: fused Triton kernels with hand-derived backward passes."""
