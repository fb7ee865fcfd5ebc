"""rope against transformers' apply_rotary_pos_emb (cos/sin from LlamaRotaryEmbedding)
and the reference: forward, dL/dq and dL/dk, in place, grouped-query heads.

Tolerances are rounding bounds, element by element.  Each output is
round(round(x1 c) + round(x2 s)), so it is within 2u * M of the exact value, with
M = |x * cos| + |rotate_half(x) * sin| (fp64, from the rounded cos/sin) and u the
unit roundoff; two such results differ by at most 2 (u_ours + u_theirs) M.  u is
2^-24 for fp32, 2^-11 for fp16 and 2^-8 for bf16, except that the Triton
interpreter truncates fp32 -> bf16 instead of rounding, so our bf16 results on the
CPU carry u = 2^-7.  When cos/sin are not the very tensors transformers used (a
table gathered by position, or an fp32 table for bf16 q) one more rounding of
cos/sin is allowed for (k = 3).  The gradients are bounded the same way with
M = |g * cos| + |rotate_half(g * sin)|.

rope/kernel.py and rope/checks.py are tested here, through ``rope`` and ``rotate``: every
case runs the kernel, and the refusals are the checks'.
"""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from slothkit_kernels import utils
from slothkit_kernels.rope import rope, rope_reference, rotate
from slothkit_kernels.testing import relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, Hq, Hk, T, D): grouped-query heads, odd T, Gemma's D=256, one token, and
# Hq larger than one tile of heads (D=256 -> 8 heads per tile) with Hq = Hk.
SHAPES = [(2, 4, 2, 7, 64), (1, 4, 2, 5, 256), (3, 2, 1, 1, 16), (2, 12, 12, 3, 256)]


def _unit_roundoff(dtype, device, ours):
    if dtype == torch.float32:
        return 2.0**-24
    if dtype == torch.float16:
        return 2.0**-11
    return 2.0**-7 if (ours and device == "cpu") else 2.0**-8


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _check(actual, expected, scale, dtype, device, k=2.0, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert torch.isfinite(actual).all(), f"{what}: NaN or inf"
    u = _unit_roundoff(dtype, device, ours=True) + _unit_roundoff(dtype, device, ours=False)
    err = (actual.double() - expected.double()).abs()
    bound = k * u * scale + (1e-7 if dtype == torch.float16 else 0.0)
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what}: error {err.flatten()[worst]:.3g} exceeds bound {bound.flatten()[worst]:.3g} "
        f"(actual {actual.flatten()[worst].item()}, expected {expected.flatten()[worst].item()})"
    )


def _rotary(head_dim, dtype, device, position_ids):
    """cos, sin (B, T, D) in dtype, as a Llama attention layer receives them."""
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=256,
    )
    rotary = LlamaRotaryEmbedding(config).to(device)
    return rotary(torch.zeros(1, device=device, dtype=dtype), position_ids.to(device))


def _projections(b, hq, hk, t, d, dtype, device, seed):
    """Leaf projection outputs (B, T, H*D) and output grads (B, H, T, D)."""
    gen = torch.Generator().manual_seed(seed)
    xq = (torch.randn(b, t, hq * d, generator=gen) * 2).to(device, dtype)
    xk = (torch.randn(b, t, hk * d, generator=gen) * 2).to(device, dtype)
    gq = torch.randn(b, hq, t, d, generator=gen).to(device, dtype)
    gk = torch.randn(b, hk, t, d, generator=gen).to(device, dtype)
    return xq, xk, gq, gk


def _heads(x, n_heads, d):
    """HF's layout: (B, T, H*D) -> view (B, T, H, D) -> transpose to (B, H, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, d).transpose(1, 2)


def _run(fn, xq, xk, gq, gk, hq, hk, d):
    """Apply fn to HF-layout views of fresh copies of xq, xk; return outputs and grads."""
    xq = xq.clone().requires_grad_()
    xk = xk.clone().requires_grad_()
    q, k = _heads(xq.clone(), hq, d), _heads(xk.clone(), hk, d)  # non-leaf, strided views
    q_out, k_out = fn(q, k)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    return q_out.detach(), k_out.detach(), _heads(xq.grad, hq, d), _heads(xk.grad, hk, d)


def _scales(q, k, gq, gk, cos, sin):
    """fp64 magnitudes M for q_out, k_out, dq, dk; cos/sin (B or 1, T, D) in q's dtype."""
    c = cos.double().unsqueeze(1)
    s = sin.double().unsqueeze(1)

    def fwd(x):
        return (x.double() * c).abs() + (_rotate_half(x.double()) * s).abs()

    def bwd(g):
        return (g.double() * c).abs() + _rotate_half(g.double() * s).abs()

    return fwd(q), fwd(k), bwd(gq), bwd(gk)


def _compare(ours, theirs, scales, dtype, device, k, name):
    for what, a, e, m in zip(("q", "k", "dq", "dk"), ours, theirs, scales):
        _check(a, e, m, dtype, device, k=k, what=f"{what} vs {name}")


@pytest.mark.parametrize("cos_form", ["BTD", "1TD", "TD"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}Hq{}Hk{}T{}D{}".format(*s))
def test_rope_matches_transformers(shape, dtype, cos_form, device):
    b, hq, hk, t, d = shape
    xq, xk, gq, gk = _projections(b, hq, hk, t, d, dtype, device, seed=sum(shape))
    if cos_form == "BTD":  # a different offset per batch row
        position_ids = torch.arange(t)[None] + 3 * torch.arange(b)[:, None]
    else:
        position_ids = torch.arange(t)[None].expand(b, t)
    cos, sin = _rotary(d, dtype, device, position_ids)  # (B, T, D)
    ours_cos, ours_sin = {"BTD": (cos, sin), "1TD": (cos[:1], sin[:1]), "TD": (cos[0], sin[0])}[cos_form]

    ours = _run(lambda q, k: rope(q, k, ours_cos, ours_sin), xq, xk, gq, gk, hq, hk, d)
    hf = _run(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), xq, xk, gq, gk, hq, hk, d)
    ref = _run(lambda q, k: rope_reference(q, k, ours_cos, ours_sin), xq, xk, gq, gk, hq, hk, d)
    scales = _scales(_heads(xq, hq, d), _heads(xk, hk, d), gq, gk, cos, sin)
    _compare(ours, hf, scales, dtype, device, k=2.0, name="transformers")
    _compare(ours, ref, scales, dtype, device, k=2.0, name="reference")
    if dtype == torch.float32:  # the spec's plain tolerance, on top of the bound
        for a, e in zip(ours, hf):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("table_dtype", ["q", torch.float32], ids=["table_in_q_dtype", "fp32_table"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 2, 7, 64), (2, 4, 2, 9, 256)], ids=["D64", "D256"])
def test_rope_table_with_packed_positions(shape, dtype, table_dtype, device):
    """Positions restart inside a row (packed sequences); cos/sin are one table."""
    b, hq, hk, t, d = shape
    xq, xk, gq, gk = _projections(b, hq, hk, t, d, dtype, device, seed=t + d)
    starts = [[0, 3, 5], [0, 4]]  # where each packed sequence begins, per row
    position_ids = torch.zeros(b, t, dtype=torch.long)
    for row, row_starts in enumerate(starts):
        for i, s in enumerate(row_starts):
            end = row_starts[i + 1] if i + 1 < len(row_starts) else t
            position_ids[row, s:end] = torch.arange(end - s) + 2 * row  # not always from 0
    table_dtype = dtype if table_dtype == "q" else table_dtype
    table_cos, table_sin = _rotary(d, table_dtype, device, torch.arange(40)[None])
    table_cos, table_sin = table_cos[0], table_sin[0]  # (max_positions, D)
    cos, sin = _rotary(d, dtype, device, position_ids)  # what HF's layer would get
    pos = position_ids.to(device)

    ours = _run(lambda q, k: rope(q, k, table_cos, table_sin, pos), xq, xk, gq, gk, hq, hk, d)
    hf = _run(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), xq, xk, gq, gk, hq, hk, d)
    ref = _run(lambda q, k: rope_reference(q, k, table_cos, table_sin, pos), xq, xk, gq, gk, hq, hk, d)
    scales = _scales(_heads(xq, hq, d), _heads(xk, hk, d), gq, gk, cos, sin)
    _compare(ours, hf, scales, dtype, device, k=3.0, name="transformers")
    _compare(ours, ref, scales, dtype, device, k=3.0, name="reference")

    # Shared positions (1, T) broadcast over the batch.
    shared = _run(lambda q, k: rope(q, k, table_cos, table_sin, pos[:1]), xq, xk, gq, gk, hq, hk, d)
    cos1, sin1 = _rotary(d, dtype, device, position_ids[:1])
    hf1 = _run(lambda q, k: apply_rotary_pos_emb(q, k, cos1, sin1), xq, xk, gq, gk, hq, hk, d)
    scales1 = _scales(_heads(xq, hq, d), _heads(xk, hk, d), gq, gk, cos1, sin1)
    _compare(shared, hf1, scales1, dtype, device, k=3.0, name="transformers, shared positions")


def test_rope_is_in_place(device):
    b, hq, hk, t, d = 2, 4, 2, 5, 32
    xq, xk, _, _ = _projections(b, hq, hk, t, d, torch.bfloat16, device, seed=1)
    cos, sin = _rotary(d, torch.bfloat16, device, torch.arange(t)[None])
    q, k = _heads(xq, hq, d), _heads(xk, hk, d)
    expected_q, expected_k = rope_reference(q, k, cos, sin)
    scale_q, scale_k, _, _ = _scales(q, k, q, k, cos, sin)
    versions = (q._version, k._version)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out is q and k_out is k
    assert q._version > versions[0] and k._version > versions[1]
    # The projection outputs underneath the views hold the rotated values.
    _check(_heads(xq, hq, d), expected_q, scale_q, torch.bfloat16, device, what="q's base")
    _check(_heads(xk, hk, d), expected_k, scale_k, torch.bfloat16, device, what="k's base")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_views_of_one_fused_qkv_projection(dtype, device):
    """Phi-3 style: q and k are slices of one (B, T, (Hq + 2 Hk) * D) tensor."""
    b, hq, hk, t, d = 2, 4, 2, 5, 32
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(b, t, (hq + 2 * hk) * d, generator=gen).to(device, dtype)
    g = torch.randn(b, t, hq + 2 * hk, d, generator=gen).to(device, dtype)
    cos, sin = _rotary(d, dtype, device, torch.arange(t)[None].expand(b, t))

    def run(fn):
        leaf = qkv.clone().requires_grad_()
        heads = leaf.clone().view(b, t, hq + 2 * hk, d)
        q, k = heads[:, :, :hq].transpose(1, 2), heads[:, :, hq : hq + hk].transpose(1, 2)
        v = heads[:, :, hq + hk :].transpose(1, 2)
        q_out, k_out = fn(q, k)
        out = torch.cat((q_out, k_out, v), dim=1).transpose(1, 2)  # (B, T, H, D)
        out.backward(g)
        return out.detach(), leaf.grad.view(b, t, hq + 2 * hk, d)

    out, grad = run(lambda q, k: rope(q, k, cos, sin))
    out_hf, grad_hf = run(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin))
    c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2)  # (B, T, 1, D)
    scale_out = (qkv.view_as(g).double() * c).abs() + (_rotate_half(qkv.view_as(g).double()) * s).abs()
    scale_grad = (g.double() * c).abs() + _rotate_half(g.double() * s).abs()
    _check(out, out_hf, scale_out, dtype, device, what="outputs")
    _check(grad, grad_hf, scale_grad, dtype, device, what="grad of the fused projection")
    assert torch.equal(grad[:, :, hq + hk :], g[:, :, hq + hk :]), "v's grad must pass untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_backward_with_strided_and_expanded_grads(dtype, device):
    """Contiguous (B, H, T, D) non-leaf q, k; grads arriving transposed or broadcast."""
    b, hq, hk, t, d = 2, 3, 1, 6, 16
    gen = torch.Generator().manual_seed(3)
    q0 = torch.randn(b, hq, t, d, generator=gen).to(device, dtype)
    k0 = torch.randn(b, hk, t, d, generator=gen).to(device, dtype)
    gq = torch.randn(b, t, hq, d, generator=gen).to(device, dtype).transpose(1, 2)  # strided
    cos, sin = _rotary(d, dtype, device, torch.arange(t)[None])

    def run(fn, use_sum):
        ql, kl = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        q_out, k_out = fn(ql.clone(), kl.clone())
        if use_sum:  # k's grad arrives expanded from a scalar (all strides 0)
            ((q_out * gq).sum() + k_out.sum()).backward()
        else:
            torch.autograd.backward((q_out, k_out), (gq, torch.ones_like(k_out)))
        return ql.grad, kl.grad

    for use_sum in (False, True):
        dq, dk = run(lambda q, k: rope(q, k, cos, sin), use_sum)
        dq_hf, dk_hf = run(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), use_sum)
        _, _, scale_q, scale_k = _scales(q0, k0, gq, torch.ones_like(k0), cos, sin)
        _check(dq, dq_hf, scale_q, dtype, device, what=f"dq (sum={use_sum})")
        _check(dk, dk_hf, scale_k, dtype, device, what=f"dk (sum={use_sum})")


def test_rope_without_grad_and_in_inference_mode(device):
    b, hq, hk, t, d = 1, 2, 2, 3, 8
    xq, xk, _, _ = _projections(b, hq, hk, t, d, torch.float32, device, seed=5)
    cos, sin = _rotary(d, torch.float32, device, torch.arange(t)[None])
    expected = rope_reference(_heads(xq, hq, d), _heads(xk, hk, d), cos, sin)
    leaf_q = _heads(xq, hq, d).contiguous().requires_grad_()  # a leaf is fine without grad
    k = _heads(xk.clone(), hk, d)
    with torch.no_grad():
        version = leaf_q._version
        rope(leaf_q, k, cos, sin)
        assert leaf_q._version > version
    torch.testing.assert_close(leaf_q.detach(), expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, expected[1], atol=1e-6, rtol=1e-6)
    with torch.inference_mode():
        q, k = _heads(xq.clone(), hq, d), _heads(xk.clone(), hk, d)
        rope(q, k, cos, sin)
    torch.testing.assert_close(q, expected[0], atol=1e-6, rtol=1e-6)


def test_autograd_refusals_happen_before_any_write(device):
    b, h, t, d = 1, 2, 3, 8
    cos, sin = _rotary(d, torch.float32, device, torch.arange(t)[None])
    leaf = torch.randn(b, h, t, d, device=device, requires_grad=True)
    k = torch.randn(b, h, t, d, device=device)
    before = (leaf.detach().clone(), k.clone())
    with pytest.raises(ValueError, match="leaf"):
        rope(leaf, k, cos, sin)
    # split() returns several views, which autograd forbids modifying in place.
    qk = torch.randn(b, t, 2 * h * d, device=device, requires_grad=True).clone()
    q_part, k_part = qk.split(h * d, dim=-1)
    q, k2 = _heads(q_part, h, d), _heads(k_part, h, d)
    snapshot = qk.detach().clone()
    with pytest.raises(ValueError, match="modified in place"):
        rope(q, k2, cos, sin)
    assert torch.equal(leaf.detach(), before[0]) and torch.equal(k, before[1])
    assert torch.equal(qk.detach(), snapshot), "data changed although autograd refused"
    # Only k refused: q's rotation was already recorded, so q is rotated to match it.
    q_ok = torch.randn(b, h, t, d, device=device, requires_grad=True).clone()
    expected_q, _ = rope_reference(q_ok.detach(), q_ok.detach(), cos, sin)
    k_bad = _heads(qk.detach().clone().requires_grad_().clone().split(h * d, dim=-1)[1], h, d)
    k_before = k_bad.detach().clone()
    with pytest.raises(ValueError, match="k to be modified in place"):
        rope(q_ok, k_bad, cos, sin)
    torch.testing.assert_close(q_ok.detach(), expected_q, atol=1e-6, rtol=1e-6)
    assert torch.equal(k_bad.detach(), k_before)


def test_reference_is_transformers_bit_for_bit():
    b, hq, hk, t, d = 2, 4, 2, 5, 32
    for dtype in DTYPES:
        xq, xk, _, _ = _projections(b, hq, hk, t, d, dtype, "cpu", seed=2)
        position_ids = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])
        cos, sin = _rotary(d, dtype, "cpu", position_ids)
        q, k = _heads(xq, hq, d), _heads(xk, hk, d)
        for a, e in zip(rope_reference(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
            assert torch.equal(a, e)


def test_falls_back_to_reference_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    utils.warn_reference_once.cache_clear()
    b, hq, hk, t, d = 2, 4, 2, 5, 16
    xq, xk, gq, gk = _projections(b, hq, hk, t, d, torch.bfloat16, "cpu", seed=8)
    cos, sin = _rotary(d, torch.bfloat16, "cpu", torch.arange(t)[None])
    with pytest.warns(UserWarning, match="rope"):
        ours = _run(lambda q, k: rope(q, k, cos, sin), xq, xk, gq, gk, hq, hk, d)
    ref = _run(lambda q, k: rope_reference(q, k, cos, sin), xq, xk, gq, gk, hq, hk, d)
    for a, e in zip(ours, ref):
        assert torch.equal(a, e)
    utils.warn_reference_once.cache_clear()


def test_bad_inputs_are_refused(device):
    b, hq, hk, t, d = 2, 4, 2, 5, 16

    def qk():
        return torch.randn(b, hq, t, d, device=device), torch.randn(b, hk, t, d, device=device)

    cos, sin = _rotary(d, torch.float32, device, torch.arange(t)[None].expand(b, t))  # (B, T, D)
    table_cos, table_sin = cos[0], sin[0]  # a (5, D) table
    pos = torch.arange(t, device=device)[None].expand(b, t)
    q, k = qk()
    cases = [
        (ValueError, "head_dim", lambda: rope(q, k, cos[..., :8], sin[..., :8])),
        (ValueError, "batch size", lambda: rope(q, k, cos.repeat(2, 1, 1)[:3], sin.repeat(2, 1, 1)[:3])),
        (ValueError, "tokens", lambda: rope(q, k, cos[:, :4], sin[:, :4])),
        (ValueError, "cos has shape", lambda: rope(q, k, cos, sin[:1])),
        (ValueError, "batch, tokens and head_dim", lambda: rope(q, k[:1], cos, sin)),
        (ValueError, "batch, tokens and head_dim", lambda: rope(q, k[..., :8], cos, sin)),
        (ValueError, "expected \\(B, heads, T, D\\)", lambda: rope(q[0], k[0], cos, sin)),
        (ValueError, "odd", lambda: rope(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])),
        (TypeError, "k has dtype", lambda: rope(q, k.half(), cos, sin)),
        (TypeError, "q has dtype", lambda: rope(q.double(), k.double(), cos, sin)),
        (ValueError, "q is empty", lambda: rope(q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0])),
        (ValueError, "stride", lambda: rope(q.transpose(2, 3), k.transpose(2, 3), cos, sin)),
        (ValueError, "stride of 0", lambda: rope(q[:1].expand(b, -1, -1, -1), k, cos, sin)),
        (ValueError, "same memory", lambda: rope(q[:, :2], q[:, :2], cos, sin)),
        (ValueError, "requires grad", lambda: rope(q, k, cos.clone().requires_grad_(), sin)),
        # position_ids
        (ValueError, "table has 5 rows", lambda: rope(q, k, table_cos, table_sin, pos + 1)),
        (ValueError, "range over \\[-1", lambda: rope(q, k, table_cos, table_sin, pos - 1)),
        (TypeError, "position_ids has dtype", lambda: rope(q, k, table_cos, table_sin, pos.float())),
        (ValueError, "position_ids has shape", lambda: rope(q, k, table_cos, table_sin, pos[:, :4])),
        (
            ValueError,
            "position_ids has shape",
            lambda: rope(q, k, table_cos, table_sin, pos.repeat(2, 1)[:3]),
        ),
        (ValueError, "must be a \\(max_positions, D\\) table", lambda: rope(q, k, cos, sin, pos)),
        (ValueError, "without position_ids expected", lambda: rope(q, k, cos[None], sin[None])),
    ]
    for error, match, call in cases:
        before = (q.clone(), k.clone())
        with pytest.raises(error, match=match):
            call()
        assert torch.equal(q, before[0]) and torch.equal(k, before[1]), f"{match}: data changed"
    if device == "cuda":
        with pytest.raises(ValueError, match="one device"):
            rope(q, k, cos.cpu(), sin.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_llama_size(dtype, device):
    """Llama-3-8B attention shapes; bf16/fp16 should agree with transformers exactly."""
    b, hq, hk, t, d = 2, 32, 8, 4096, 128
    xq, xk, gq, gk = _projections(b, hq, hk, t, d, dtype, device, seed=0)
    cos, sin = _rotary(d, dtype, device, torch.arange(t)[None].expand(b, t))
    ours = _run(lambda q, k: rope(q, k, cos, sin), xq, xk, gq, gk, hq, hk, d)
    hf = _run(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), xq, xk, gq, gk, hq, hk, d)
    scales = _scales(_heads(xq, hq, d), _heads(xk, hk, d), gq, gk, cos, sin)
    # Within the rounding bound, not bit-equal: on the GPU the kernel may fuse a
    # multiply-add where transformers' eager ops round twice.
    _compare(ours, hf, scales, dtype, device, k=2.0, name="transformers")


@pytest.mark.cuda
def test_rope_packed_table_long_sequence(device):
    b, hq, hk, t, d = 1, 8, 2, 16384, 256
    dtype = torch.bfloat16
    xq, xk, gq, gk = _projections(b, hq, hk, t, d, dtype, device, seed=1)
    position_ids = (torch.arange(t) % 3000)[None]  # packed: restarts every 3000 tokens
    table_cos, table_sin = _rotary(d, dtype, device, torch.arange(8192)[None])
    cos, sin = _rotary(d, dtype, device, position_ids)
    pos = position_ids.to(device)
    ours = _run(lambda q, k: rope(q, k, table_cos[0], table_sin[0], pos), xq, xk, gq, gk, hq, hk, d)
    hf = _run(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), xq, xk, gq, gk, hq, hk, d)
    scales = _scales(_heads(xq, hq, d), _heads(xk, hk, d), gq, gk, cos, sin)
    _compare(ours, hf, scales, dtype, device, k=3.0, name="transformers")


@pytest.mark.cuda
def test_rope_offsets_past_int32(device):
    """q with more than 2^31 elements: the last tokens must still be addressed correctly."""
    b, hq, hk, t, d = 2, 32, 1, 262145, 128  # q: 2^31 + 8192 elements, 4 GiB in bf16
    dtype = torch.bfloat16
    q = torch.randn(b, hq, t, d, device=device, dtype=dtype)
    k = torch.randn(b, hk, t, d, device=device, dtype=dtype)
    cos, sin = _rotary(d, dtype, device, torch.arange(t)[None])
    tail = slice(t - 4, t)
    expected = rope_reference(q[:, :, tail], k[:, :, tail], cos[:, tail], sin[:, tail])
    rope(q, k, cos, sin)
    for a, e in zip((q[:, :, tail], k[:, :, tail]), expected):
        # bf16 results one rounding apart at most (fused multiply-add on the GPU).
        torch.testing.assert_close(a.float(), e.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_and_its_transpose_outside_autograd(dtype, device):
    """rotate() gives rope_reference's values, and with inverse=True the gradient that
    autograd gets through rope_reference, for tables whose halves differ (so the
    transpose is not simply the rotation by -sin), into separate output buffers."""
    gen = torch.Generator().manual_seed(21)
    batch, seq, dim = 2, 5, 16

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k = rand(batch, 4, seq, dim), rand(batch, 3, seq, dim)
    cos, sin = rand(batch, seq, dim), rand(batch, seq, dim)
    q_ref, k_ref = rope_reference(q.float(), k.float(), cos.float(), sin.float())
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rotate(q, k, cos, sin, q_out=q_out, k_out=k_out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert relative_error(q_out, q_ref) < tol and relative_error(k_out, k_ref) < tol

    gq, gk = rand(*q.shape), rand(*k.shape)
    qf, kf = q.float().requires_grad_(), k.float().requires_grad_()
    dq_ref, dk_ref = torch.autograd.grad(
        rope_reference(qf, kf, cos.float(), sin.float()), (qf, kf), (gq.float(), gk.float())
    )
    dq, dk = rotate(gq.clone(), gk.clone(), cos, sin, inverse=True)  # in place
    assert relative_error(dq, dq_ref) < tol and relative_error(dk, dk_ref) < tol
