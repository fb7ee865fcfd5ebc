"""A device tensor's bytes in pinned host memory, held as power-of-two pieces.

torch's pinned-memory allocator (the caching host allocator behind
``torch.empty(..., pin_memory=True)``) rounds every request up to the next power of two
and keeps the blocks for reuse.  A layer input whose size is not a power of two pays for
the difference: Llama-3-70B's at 98,304 tokens is 1.5 GiB and took a 2 GiB block, so the
80 offloaded inputs of one step asked for a third more host memory than they hold, and
the host ran out.  Split into the binary decomposition of its size (1 GiB + 512 MiB),
each piece is an exact power of two: nothing is rounded but the last piece below
``slothkit.memory.sizes.MIN_PIECE``, and the inputs of the next step, of the same sizes,
reuse the same blocks.
"""

from __future__ import annotations

import torch

from slothkit.memory.sizes import MIN_PIECE, piece_sizes, pinned_bytes


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


class PinnedPieces:
    """Host copy of one device tensor, in pinned pieces (``pin=False``: pageable, as the
    CPU tests use it).

    Args:
        like: the tensor whose shape, dtype and size the copy has (not copied here).
        pin: allocate page-locked memory (a GPU is needed for that).
        min_piece: ``slothkit.memory.sizes.piece_sizes``'s.
    """

    def __init__(self, like: torch.Tensor, pin: bool = True, min_piece: int = MIN_PIECE):
        self.shape, self.dtype = like.shape, like.dtype
        self._size, self._min_piece = like.numel() * like.element_size(), min_piece
        sizes = piece_sizes(self._size, min_piece)
        self.pieces = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in sizes]

    @property
    def nbytes(self) -> int:
        """The host memory the pieces take once the allocator has rounded them: the
        figure the checkpointer counts before allocating (``pinned_bytes``)."""
        return pinned_bytes(self._size, self._min_piece)

    def copy_from(self, tensor: torch.Tensor, non_blocking: bool = True) -> None:
        """Copy ``tensor`` (contiguous, of this shape and dtype) into the pieces."""
        self._each(_as_bytes(tensor), lambda piece, part: piece.copy_(part, non_blocking=non_blocking))

    def copy_to(self, tensor: torch.Tensor, non_blocking: bool = True) -> None:
        """Copy the pieces into ``tensor`` (contiguous, of this shape and dtype)."""
        self._each(_as_bytes(tensor), lambda piece, part: part.copy_(piece, non_blocking=non_blocking))

    def _each(self, flat: torch.Tensor, copy) -> None:
        offset = 0
        for piece in self.pieces:
            copy(piece, flat[offset : offset + piece.numel()])
            offset += piece.numel()
