"""rope_into_cache against ``rope`` followed by ``index_copy_`` into the cache: q rotated
as ``rope`` rotates it, the rotated k and v at the step's slots, every other slot as it
was.  The kernel shares ``rope``'s arithmetic, so on the same device the two agree bit
for bit; fp32 against the plain-torch reference within rounding."""

import pytest
import torch

from slothkit_kernels.rope import rope, rope_reference
from slothkit_kernels.rope.cache import rope_into_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, Hq, Hkv, T, D, S): one decode token, a prefill of several, Gemma's D=256, grouped heads.
SHAPES = [(2, 4, 2, 1, 64, 9), (1, 8, 8, 5, 32, 12), (3, 4, 1, 2, 256, 6)]


def _step(batch, q_heads, kv_heads, tokens, head_dim, slots, dtype, device, generator):
    """Projections laid out as an attention layer makes them (strided views), rotary
    tables of random positions, a cache already holding other tokens, and slots."""

    def heads(n):
        x = torch.randn(batch, tokens, n * head_dim, generator=generator, dtype=torch.float32)
        return x.to(device, dtype).view(batch, tokens, n, head_dim).transpose(1, 2)

    q, k, v = heads(q_heads), heads(kv_heads), heads(kv_heads)
    positions = torch.randint(0, 4096, (batch, tokens), generator=generator).double()
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2).double() / head_dim)
    angles = positions[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    cache = [
        torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(device, dtype) for _ in range(2)
    ]
    first = int(torch.randint(0, slots - tokens + 1, (), generator=generator))
    step_slots = (first + torch.arange(tokens)).to(device)
    return q, k, v, cos, sin, cache, step_slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_into_cache_equals_rope_then_index_copy(shape, dtype, device):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v, cos, sin, (keys, values), slots = _step(*shape, dtype, device, generator)
    expected_q, expected_k = q.clone(), k.clone()
    rope(expected_q, expected_k, cos, sin)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.index_copy_(2, slots, expected_k)
    expected_values.index_copy_(2, slots, v)
    k_before, v_before = k.clone(), v.clone()

    out = rope_into_cache(q, k, v, cos, sin, keys, values, slots)

    assert out is q
    assert torch.equal(q, expected_q)
    assert torch.equal(keys, expected_keys)  # the step's slots rotated, the rest untouched
    assert torch.equal(values, expected_values)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_rope_into_cache_in_fp32_matches_the_torch_reference(device):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v, cos, sin, (keys, values), slots = _step(2, 8, 2, 3, 64, 10, torch.float32, device, generator)
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    rope_into_cache(q, k, v, cos, sin, keys, values, slots)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(keys[:, :, slots], k_ref, rtol=1e-6, atol=1e-6)


def test_tables_shared_by_the_batch_and_unbatched_tables_rotate_every_row_alike(device):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v, cos, sin, (keys, values), slots = _step(3, 4, 2, 2, 32, 5, torch.float32, device, generator)
    shared_cos, shared_sin = cos[:1], sin[:1]
    expected_q, expected_k = rope_reference(q, k, shared_cos.expand_as(cos), shared_sin.expand_as(sin))
    for tables in ((shared_cos, shared_sin), (shared_cos[0], shared_sin[0])):
        q_run, keys_run = q.clone(), keys.clone()
        rope_into_cache(q_run, k, v, *tables, keys_run, values.clone(), slots)
        torch.testing.assert_close(q_run, expected_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(keys_run[:, :, slots], expected_k, rtol=1e-6, atol=1e-6)


def test_what_cannot_be_written_is_refused_before_anything_changes(device):
    generator = torch.Generator().manual_seed(0)
    q, k, v, cos, sin, (keys, values), slots = _step(2, 4, 2, 1, 16, 4, torch.float32, device, generator)
    cases = [
        ("must share a dtype", lambda: rope_into_cache(q, k.double(), v, cos, sin, keys, values, slots)),
        ("keys is torch.float16", lambda: rope_into_cache(q, k, v, cos, sin, keys.half(), values, slots)),
        ("slots must be 1 integer", lambda: rope_into_cache(q, k, v, cos, sin, keys, values, slots.float())),
        (
            "expected \\(2 or 1, 1, 16\\)",
            lambda: rope_into_cache(q, k, v, cos[..., :8], sin[..., :8], keys, values, slots),
        ),
        ("v has shape", lambda: rope_into_cache(q, k, v[:, :1], cos, sin, keys, values, slots)),
        ("keys has shape", lambda: rope_into_cache(q, k, v, cos, sin, keys[:, :1], values, slots)),
        (
            "odd",
            lambda: rope_into_cache(q[..., :15], k[..., :15], v[..., :15], cos, sin, keys, values, slots),
        ),
    ]
    for match, call in cases:
        before = [x.clone() for x in (q, keys, values)]
        with pytest.raises(ValueError, match=match):
            call()
        assert all(torch.equal(a, b) for a, b in zip((q, keys, values), before)), match
