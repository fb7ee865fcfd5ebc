"""Offloaded layer inputs are held in power-of-two pieces of host memory
(slothkit.engine.checkpointing.pinned_pieces): what the pieces are, what they cost, and that a tensor
comes back from them bit for bit."""

import random

import pytest
import torch

from slothkit.engine.checkpointing.pinned_pieces import PinnedPieces
from slothkit.memory.memory_model import TrainingMemory, lora_bytes
from slothkit.memory.sizes import MIN_PIECE, piece_sizes, pinned_bytes
from slothkit.models import shape_by_name

GIB = 2**30


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_pieces_are_the_bits_of_the_size_down_to_the_last_small_one():
    rng = random.Random(0)
    for nbytes in [
        1,
        MIN_PIECE,
        MIN_PIECE + 1,
        3 * GIB // 2,
        *[rng.randrange(1, 1 << 36) for _ in range(200)],
    ]:
        sizes = piece_sizes(nbytes)
        assert sum(sizes) == nbytes
        assert sizes == sorted(sizes, reverse=True)
        whole = [s for s in sizes if s >= MIN_PIECE]
        assert all(s & (s - 1) == 0 for s in whole)  # powers of two
        assert len(set(whole)) == len(whole)
        assert len(sizes) - len(whole) <= 1 and all(s < MIN_PIECE for s in sizes[len(whole) :])


def test_pieces_waste_less_than_one_small_piece_where_one_block_wastes_up_to_half():
    # Llama-3-70B's layer input at 98,304 tokens: 1.5 GiB, one 2 GiB block.
    seventy_b = 98304 * 8192 * 2
    assert pinned_bytes(seventy_b) == seventy_b
    assert _next_power_of_two(seventy_b) == 2 * GIB
    # Gemma-7B's at 2 x 2048 (hidden size 3072): 24 MiB, a 32 MiB block.
    assert pinned_bytes(2 * 2048 * 3072 * 2) == 24 * 2**20
    rng = random.Random(1)
    for _ in range(200):
        nbytes = rng.randrange(1, 1 << 36)
        assert nbytes <= pinned_bytes(nbytes) < nbytes + MIN_PIECE
        assert pinned_bytes(nbytes) <= _next_power_of_two(nbytes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(0, 4), (1,), (3, 37, 5), (2, 129, 64)])
def test_a_tensor_comes_back_from_its_pieces_bit_for_bit(dtype, shape):
    generator = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    tensor = (torch.randn(shape, generator=generator) * 100).to(dtype)
    # Small pieces, so that a few kilobytes span several of them and a remainder.
    copy = PinnedPieces(tensor, pin=False, min_piece=64)
    assert sum(piece.numel() for piece in copy.pieces) == tensor.numel() * tensor.element_size()
    copy.copy_from(tensor, non_blocking=False)
    back = torch.empty_like(tensor)
    copy.copy_to(back, non_blocking=False)
    assert torch.equal(back.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))
    assert copy.nbytes == pinned_bytes(tensor.numel() * tensor.element_size(), 64)


def test_the_memory_model_counts_host_memory_as_the_pieces_hold_it():
    shape = shape_by_name("llama-3-70b")
    memory = TrainingMemory(shape, "qlora", lora_bytes(shape, 16), keep_sums=True, graph_max_tokens=16384)
    for tokens in (4096, 98304, 100000):  # two copies (input and kept sum), then one
        per_copy = tokens * shape.hidden_size * 2
        copies = memory.checkpoint_bytes(tokens) / per_copy
        assert memory.host_checkpoint_bytes(tokens) == copies * pinned_bytes(per_copy)
    # 98,304 tokens: exactly the tensors' bytes, where whole blocks would have taken 2 GiB.
    assert memory.host_checkpoint_bytes(98304) == memory.checkpoint_bytes(98304)
