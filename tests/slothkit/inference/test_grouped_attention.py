"""The decode step's grouped-query attention against attention with the key/value heads
repeated for every query head (what Hugging Face's eager attention computes), on fresh
random inputs: a one-token step and a padded prompt, with and without Gemma 2's
soft-capping; and the prompt's mask the size of one (B, 1, T, S) mask, not G of them."""

import pytest
import torch

from slothkit.inference.model_step import _additive_mask, _grouped_attention


def _reference(q, keys, values, allowed, scaling, softcap):
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = (q.double() @ keys.double().transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values.double()).float()


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("tokens", [1, 7])
def test_grouped_attention_equals_attention_over_repeated_heads(tokens, softcap):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    batch, heads, kv_heads, slots, dim = 3, 8, 2, 12, 16
    q = torch.randn(batch, heads, tokens, dim, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, slots, dim, generator=generator) for _ in range(2))
    # Left padding of various lengths; each query reads its own slot and those before it.
    first = torch.tensor([0, 3, 5])
    slot = torch.arange(slots)
    own = slots - tokens + torch.arange(tokens)
    allowed = (slot[None, None, :] >= first[:, None, None]) & (slot[None, None, :] <= own[None, :, None])
    mask = _additive_mask(allowed, heads // kv_heads, torch.float32)
    rows = (heads // kv_heads) if tokens == 1 else tokens
    assert mask.shape == (batch, 1, rows, slots)
    got = _grouped_attention(q, keys, values, mask, 0.25, softcap)
    expected = _reference(q, keys, values, allowed, 0.25, softcap)
    assert got.shape == (batch, heads, tokens, dim)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
