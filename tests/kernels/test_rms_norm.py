"""rms_norm against transformers' LlamaRMSNorm and GemmaRMSNorm and the reference.

Tolerances are rounding bounds, element by element.  Both sides compute in fp32
and round to the low dtype at the same points, so they differ by at most a few
unit roundoffs u of that dtype times the size of the quantities rounded:

    |ours - theirs| <= k * (u_ours + u_theirs) * (|theirs| + scale)

with scale the magnitude of what feeds the rounded value (for dx: r * (|g v| +
|x_hat| * mean|g v x_hat|); for dw: the row sum of |g x_hat|), computed in fp64.
u is 2^-11 for fp16 and 2^-8 for bf16 (round to nearest), except that the Triton
interpreter truncates fp32 -> bf16 instead of rounding, so our bf16 results on
the CPU carry u = 2^-7.  fp32 uses 2^-20 for reduction-order differences.
"""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from slothkit_kernels import utils
from slothkit_kernels.rms_norm import rms_norm, rms_norm_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One row, H of one, H not a power of two, several leading dims, a 1-D input.
SHAPES = [(1, 5), (4, 1), (3, 7, 33), (2, 3, 4, 100), (17, 1000), (129,)]


def _unit_roundoff(dtype, device, ours):
    if dtype == torch.float32:
        return 2.0**-20
    if dtype == torch.float16:
        return 2.0**-11
    return 2.0**-7 if (ours and device == "cpu") else 2.0**-8


def _check(actual, expected, scale, dtype, device, k=2.0, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert torch.isfinite(actual).all(), f"{what}: NaN or inf"
    u = _unit_roundoff(dtype, device, ours=True) + _unit_roundoff(dtype, device, ours=False)
    err = (actual.double() - expected.double()).abs()
    bound = k * u * (expected.double().abs() + scale) + (1e-7 if dtype == torch.float16 else 0.0)
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what}: error {err.flatten()[worst]:.3g} exceeds bound {bound.flatten()[worst]:.3g} "
        f"(actual {actual.flatten()[worst].item()}, expected {expected.flatten()[worst].item()})"
    )


def _scales(x, weight, dy, eps, gemma):
    """fp64 magnitudes feeding y, dx and dw (see the module docstring)."""
    x = x.double()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x * r
    v = (1.0 + weight.double()) if gemma else weight.double()
    u = dy.double() * v
    y = (x_hat * v).abs()
    dx = r * (u.abs() + x_hat.abs() * (u * x_hat).abs().mean(-1, keepdim=True))
    dw = (dy.double() * x_hat).abs().reshape(-1, x.shape[-1]).sum(0)
    return y, dx, dw


def _inputs(shape, dtype, device, gemma, seed, weight_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(device, dtype)
    if gemma:  # Gemma stores the scale as an offset from one
        w = 0.3 * torch.randn(h, generator=gen)
    else:
        w = 1.0 + 0.3 * torch.randn(h, generator=gen)
    dy = torch.randn(shape, generator=gen).to(device)
    return x, w.to(device, weight_dtype or dtype), dy


def _hf_module(h, eps, gemma, weight):
    module = GemmaRMSNorm(h, eps=eps) if gemma else LlamaRMSNorm(h, eps=eps)
    module = module.to(weight.device, weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def _run(fn, x, weight, dy):
    x = x.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    y = fn(x, weight)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_transformers(shape, dtype, gemma, device):
    eps = 1e-6 if gemma else 1e-5
    x, w, dy = _inputs(shape, dtype, device, gemma, seed=sum(shape) + gemma)
    scale_y, scale_dx, scale_dw = _scales(x, w, dy, eps, gemma)

    y, dx, dw = _run(lambda x, w: rms_norm(x, w, eps, gemma=gemma), x, w, dy)
    module = _hf_module(shape[-1], eps, gemma, w)
    y_hf, dx_hf, _ = _run(lambda x, w: module(x), x, w, dy)
    dw_hf = module.weight.grad
    y_ref, dx_ref, dw_ref = _run(lambda x, w: rms_norm_reference(x, w, eps, gemma), x, w, dy)

    for name, expected in (("transformers", (y_hf, dx_hf, dw_hf)), ("reference", (y_ref, dx_ref, dw_ref))):
        # Llama rounds twice in the forward (x_hat, then w * x_hat), Gemma once.
        _check(y, expected[0], scale_y, dtype, device, k=2.0 if not gemma else 1.0, what=f"y vs {name}")
        _check(dx, expected[1], scale_dx, dtype, device, what=f"dx vs {name}")
        _check(dw, expected[2], scale_dw, dtype, device, what=f"dw vs {name}")


@pytest.mark.parametrize(
    "x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_llama_mixed_dtypes_promote_like_transformers(x_dtype, w_dtype, device):
    """LlamaRMSNorm returns weight * x_hat.to(x.dtype) in the promoted dtype."""
    shape = (5, 48)
    x, w, dy = _inputs(shape, x_dtype, device, gemma=False, seed=11, weight_dtype=w_dtype)
    module = _hf_module(shape[-1], 1e-6, False, w)
    y_hf, dx_hf, _ = _run(lambda x, w: module(x), x, w, dy)
    y, dx, dw = _run(lambda x, w: rms_norm(x, w, 1e-6), x, w, dy)
    assert y.dtype == torch.float32 == y_hf.dtype
    assert dx.dtype == x_dtype and dw.dtype == w_dtype
    # Only the bf16 side rounds anywhere, so bf16's roundoff bounds the difference.
    scale_y, scale_dx, scale_dw = _scales(x, w, dy, 1e-6, False)
    _check(y, y_hf, scale_y, torch.bfloat16, device, what="y")
    _check(dx, dx_hf, scale_dx, torch.bfloat16, device, what="dx")
    _check(dw, module.weight.grad, scale_dw, torch.bfloat16, device, what="dw")


def test_gemma_output_keeps_input_dtype(device):
    x, w, _ = _inputs((3, 40), torch.bfloat16, device, gemma=True, seed=5, weight_dtype=torch.float32)
    y = rms_norm(x, w, gemma=True)
    y_hf = _hf_module(40, 1e-6, True, w)(x)
    assert y.dtype == torch.bfloat16 == y_hf.dtype
    scale_y, _, _ = _scales(x, w, torch.zeros_like(x, dtype=torch.float32), 1e-6, True)
    _check(y, y_hf.detach(), scale_y, torch.bfloat16, device, k=1.0, what="y")


# (37, 300) and (41, 1000): several programs of 16-row tiles with a frozen weight, the
# last one partly masked.
@pytest.mark.parametrize("shape", [(6, 70), (37, 300), (41, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_only_where_required(shape, dtype, device):
    x, w, dy = _inputs(shape, dtype, device, gemma=False, seed=2)
    _, dx_ref, dw_ref = _run(lambda x, w: rms_norm_reference(x, w, 1e-6), x, w, dy)
    _, scale_dx, scale_dw = _scales(x, w, dy, 1e-6, False)

    xg = x.clone().requires_grad_()
    frozen = w.clone()
    rms_norm(xg, frozen).backward(dy.to(dtype))
    assert frozen.grad is None
    _check(xg.grad, dx_ref, scale_dx, dtype, device, what="dx with a frozen weight")

    wg = w.clone().requires_grad_()
    rms_norm(x, wg).backward(dy.to(dtype))
    _check(wg.grad, dw_ref, scale_dw, dtype, device, what="dw with a constant x")


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_strided_input_and_grad(gemma, device):
    """x with a non-unit last stride, and an incoming grad broadcast from a scalar."""
    dtype = torch.float16
    x, w, _ = _inputs((6, 37), dtype, device, gemma, seed=9)
    x = x.t().contiguous().t()  # same values, last stride 6
    assert x.stride(-1) != 1
    dy = torch.ones(x.shape, device=x.device)
    y, dx, dw = _run(lambda x, w: rms_norm(x, w, gemma=gemma), x, w, dy)
    x_c = x.contiguous()
    y_ref, dx_ref, dw_ref = _run(lambda x, w: rms_norm_reference(x, w, gemma=gemma), x_c, w, dy)
    scale_y, scale_dx, scale_dw = _scales(x_c, w, dy, 1e-6, gemma)
    _check(y, y_ref, scale_y, dtype, device, what="y")
    _check(dx, dx_ref, scale_dx, dtype, device, what="dx")
    _check(dw, dw_ref, scale_dw, dtype, device, what="dw")

    # y.sum() hands backward an expanded (stride 0) grad.
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm(xg, wg, gemma=gemma).float().sum().backward()
    _check(xg.grad, dx_ref, scale_dx, dtype, device, what="dx from sum()")
    _check(wg.grad, dw_ref, scale_dw, dtype, device, what="dw from sum()")


def test_reference_is_transformers_bit_for_bit():
    """The reference is the code transformers runs; on the CPU they agree exactly."""
    for gemma in (False, True):
        for dtype in DTYPES:
            x, w, _ = _inputs((4, 3, 57), dtype, "cpu", gemma, seed=1)
            module = _hf_module(57, 1e-6, gemma, w)
            assert torch.equal(rms_norm_reference(x, w, 1e-6, gemma), module(x))


def test_falls_back_to_reference_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    utils.warn_reference_once.cache_clear()
    x, w, _ = _inputs((3, 20), torch.bfloat16, "cpu", False, seed=4)
    with pytest.warns(UserWarning, match="rms_norm"):
        y = rms_norm(x, w)
    assert torch.equal(y, rms_norm_reference(x, w))
    utils.warn_reference_once.cache_clear()


def test_bad_inputs_are_refused(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.ones(1, 8, device=device))
    with pytest.raises(TypeError, match="x has dtype"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="weight has dtype"):
        rms_norm(x, w.double())
    with pytest.raises(ValueError, match="x is empty"):
        rms_norm(torch.randn(0, 8, device=device), w)
    with pytest.raises(ValueError, match="scalar"):
        rms_norm(torch.tensor(1.0, device=device), w)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=-1.0)
    if device == "cuda":
        with pytest.raises(ValueError, match="one device"):
            rms_norm(x, w.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", [(16384, 4096), (4, 2048, 3072), (8192, 16384)])
def test_rms_norm_large(shape, gemma, device):
    dtype = torch.bfloat16
    x, w, dy = _inputs(shape, dtype, device, gemma, seed=0)
    y, dx, dw = _run(lambda x, w: rms_norm(x, w, gemma=gemma), x, w, dy)
    module = _hf_module(shape[-1], 1e-6, gemma, w)
    y_hf, dx_hf, _ = _run(lambda x, w: module(x), x, w, dy)
    scale_y, scale_dx, scale_dw = _scales(x, w, dy, 1e-6, gemma)
    _check(y, y_hf, scale_y, dtype, device, k=2.0, what="y")
    _check(dx, dx_hf, scale_dx, dtype, device, what="dx")
    _check(dw, module.weight.grad, scale_dw, dtype, device, k=3.0, what="dw")


@pytest.mark.cuda
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", [(2, 2048, 4096), (3, 1000, 3072)])
def test_rms_norm_large_frozen_weight(shape, gemma, device):
    """dx alone, as LoRA training asks for it: the backward's other launch shape."""
    dtype = torch.bfloat16
    x, w, dy = _inputs(shape, dtype, device, gemma, seed=4)
    xg = x.clone().requires_grad_()
    rms_norm(xg, w, gemma=gemma).backward(dy.to(dtype))
    module = _hf_module(shape[-1], 1e-6, gemma, w).requires_grad_(False)
    x_hf = x.clone().requires_grad_()
    module(x_hf).backward(dy.to(dtype))
    _, scale_dx, _ = _scales(x, w, dy, 1e-6, gemma)
    _check(xg.grad, x_hf.grad, scale_dx, dtype, device, what="dx with a frozen weight")


@pytest.mark.cuda
def test_rms_norm_offsets_past_int32(device):
    """rows * H > 2^31: the last rows must still be addressed correctly."""
    n_rows, h = 32769, 65536  # 2^31 + 65536 elements, 4 GiB in bf16
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((n_rows, h), device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (1.0 + 0.3 * torch.randn(h, device=device, generator=gen)).to(torch.bfloat16).requires_grad_()
    y = rms_norm(x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    tail = slice(n_rows - 3, n_rows)
    y_ref, dx_ref, _ = _run(lambda x, w: rms_norm_reference(x, w), x.detach()[tail], w.detach(), dy[tail])
    scale_y, scale_dx, _ = _scales(x.detach()[tail], w.detach(), dy[tail], 1e-6, False)
    _check(y.detach()[tail], y_ref, scale_y, torch.bfloat16, device, what="y tail")
    _check(x.grad[tail], dx_ref, scale_dx, torch.bfloat16, device, what="dx tail")
    assert torch.isfinite(w.grad).all()
