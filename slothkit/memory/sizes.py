"""Where the engine changes what it does with the size of a step or of a tensor.

Torch-free, so that slothkit.memory.memory_model (and through it `slothkit plan`) predicts from
the numbers the engine runs by rather than from copies of them.

- Steps of up to SHORT_STEP_TOKENS tokens replay checkpointed layers from CUDA graphs
  (slothkit.engine.layer_graphs) and keep their residual sums for the re-run
  (slothkit.engine.checkpointing.offload_checkpoint); in longer ones attention dominates the re-run,
  while the graphs' pool and the kept tensors grow with the tokens.
- Longer steps run each fused MLP in chunks of MLP_TOKEN_CHUNK tokens
  (``mlp_token_chunk``, slothkit_kernels.lora.lora_mlp's token_chunk), where the
  (tokens, intermediate) tensors are most of a layer's working memory; 8,192-token chunks
  keep every GEMM large.
- Offloaded layer inputs are held in pinned host memory as power-of-two pieces
  (slothkit.engine.checkpointing.pinned_pieces), since torch's pinned-memory allocator rounds each
  request up to one: ``piece_sizes`` splits a copy, ``pinned_bytes`` is what it then
  takes.
"""

from __future__ import annotations

SHORT_STEP_TOKENS = 16384
MLP_TOKEN_CHUNK = 8192
# Bytes below this go in one last piece (rounded by the allocator, so less than this is
# wasted per tensor); above it, one piece per set bit of the size.
MIN_PIECE = 1 << 20


def mlp_token_chunk(tokens: int) -> int | None:
    """The MLP's token_chunk for a step of ``tokens`` tokens: None (whole) up to
    SHORT_STEP_TOKENS, MLP_TOKEN_CHUNK beyond."""
    return MLP_TOKEN_CHUNK if tokens > SHORT_STEP_TOKENS else None


def piece_sizes(nbytes: int, min_piece: int = MIN_PIECE) -> list[int]:
    """Byte sizes, largest first, that sum to ``nbytes``: the powers of two of its bits
    from ``min_piece`` up, then the remainder below ``min_piece`` (if any) as one."""
    remainder = nbytes % min_piece
    high = nbytes - remainder
    sizes = [1 << bit for bit in reversed(range(high.bit_length())) if high >> bit & 1]
    return sizes + [remainder] if remainder else sizes


def pinned_bytes(nbytes: int, min_piece: int = MIN_PIECE) -> int:
    """The host memory the pieces of ``nbytes`` take once the allocator has rounded them."""
    return sum(1 << (size - 1).bit_length() for size in piece_sizes(nbytes, min_piece))
