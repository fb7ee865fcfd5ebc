"""swiglu: silu(gate) * up, against torch, transformers' SiLU and LlamaMLP."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP

from slothkit_kernels import utils
from slothkit_kernels.swiglu import swiglu, swiglu_backward, swiglu_forward, swiglu_reference
from slothkit_kernels.testing import assert_close, relative_error

# The interpreter evaluates exp() with numpy, which warns when exp(-x) overflows to inf
# in sigmoid (the result, 0 or 1, is still right).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (1, 1), (7, 33), (3, 5, 123), (2, 1025), (4, 3, 2, 17)]
# Relative (norm-wise) error allowed when both sides round in the low dtype.
MODULE_RTOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * 3).to(device, dtype)  # reaches silu's flat tails
    up = torch.randn(shape, generator=gen).to(device, dtype)
    grad_h = torch.randn(shape, generator=gen).to(device, dtype)
    return gate, up, grad_h


def _gold(gate, up, grad_h):
    """fp32 autograd through transformers' SiLU, from the same (rounded) inputs."""
    e = gate.detach().float().requires_grad_()
    g = up.detach().float().requires_grad_()
    h = ACT2FN["silu"](e) * g
    h.backward(grad_h.float())
    return h.detach(), e.grad, g.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_forward_backward(shape, dtype, device):
    gate, up, grad_h = _inputs(shape, dtype, device, seed=sum(shape))
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h)

    e = gate.clone().requires_grad_()
    g = up.clone().requires_grad_()
    h = swiglu(e, g)
    assert h.shape == gate.shape and h.dtype == dtype
    assert_close(h, h_gold, dtype, msg="h vs fp32 SiLU")
    assert_close(h, swiglu_reference(gate, up), dtype, msg="h vs swiglu_reference")
    # transformers' own activation in the low dtype rounds twice; still within tolerance.
    assert_close(h, ACT2FN["silu"](gate) * up, dtype, msg="h vs ACT2FN['silu'] in dtype")

    h.backward(grad_h)
    assert e.grad.dtype == dtype and g.grad.dtype == dtype
    assert_close(e.grad, de_gold, dtype, msg="d gate")
    assert_close(g.grad, dg_gold, dtype, msg="d up")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_swiglu_launchers(dtype, inplace, device):
    gate, up, grad_h = _inputs((5, 77), dtype, device, seed=3)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h)

    assert_close(swiglu_forward(gate, up), h_gold, dtype, msg="swiglu_forward")

    dh_buf, e_buf, g_buf = grad_h.clone(), gate.clone(), up.clone()
    versions = [t._version for t in (dh_buf, e_buf, g_buf)]
    h, de, dg = swiglu_backward(dh_buf, e_buf, g_buf, inplace=inplace)
    assert_close(h, h_gold, dtype, msg="recomputed h")
    assert_close(de, de_gold, dtype, msg="d gate")
    assert_close(dg, dg_gold, dtype, msg="d up")
    for out, buf, v, name in zip((h, de, dg), (dh_buf, e_buf, g_buf), versions, ("h", "de", "dg")):
        if inplace:
            assert out.data_ptr() == buf.data_ptr(), f"{name} was not written in place"
            assert buf._version > v, f"{name}: version counter not bumped"
        else:
            assert out.data_ptr() != buf.data_ptr()
    if not inplace:  # inputs untouched
        assert torch.equal(dh_buf, grad_h) and torch.equal(e_buf, gate) and torch.equal(g_buf, up)


def test_swiglu_inplace_on_halves_of_one_buffer(device):
    """gate and up as two non-overlapping halves of one fused buffer are fine in place."""
    gate, up, grad_h = _inputs((6, 40), torch.float32, device, seed=4)
    fused = torch.cat([gate.flatten(), up.flatten()])
    e_view, g_view = fused[: gate.numel()].view_as(gate), fused[gate.numel() :].view_as(up)
    h, de, dg = swiglu_backward(grad_h.clone(), e_view, g_view, inplace=True)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h)
    assert de.data_ptr() == e_view.data_ptr() and dg.data_ptr() == g_view.data_ptr()
    assert_close(de, de_gold, msg="d gate")
    assert_close(dg, dg_gold, msg="d up")
    assert_close(h, h_gold, msg="h")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_non_contiguous(dtype, device):
    gate, up, grad_h = _inputs((33, 9), dtype, device, seed=5)
    gate_t, up_t, grad_t = gate.t(), up.t(), grad_h.t()  # (9, 33), strided
    h_gold, de_gold, dg_gold = _gold(gate_t, up_t, grad_t)
    e = gate_t.detach().requires_grad_()
    g = up_t.detach().requires_grad_()
    h = swiglu(e, g)
    h.backward(grad_t)
    assert_close(h, h_gold, dtype, msg="h")
    assert_close(e.grad, de_gold, dtype, msg="d gate")
    assert_close(g.grad, dg_gold, dtype, msg="d up")
    _, de, dg = swiglu_backward(grad_t, gate_t.clone(), up_t, inplace=True)
    assert_close(de, de_gold, dtype, msg="d gate, launcher")
    assert_close(dg, dg_gold, dtype, msg="d up, launcher")


def test_swiglu_writes_every_element(monkeypatch, device):
    """Outputs are allocated NaN-poisoned: a tail element left unwritten would fail."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    gate, up, grad_h = _inputs((3, 1025), torch.bfloat16, device, seed=8)  # 3075 = 3 * 1024 + 3
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h)
    assert_close(swiglu_forward(gate, up), h_gold, torch.bfloat16, msg="h")
    h, de, dg = swiglu_backward(grad_h, gate, up)
    assert_close(h, h_gold, torch.bfloat16, msg="recomputed h")
    assert_close(de, de_gold, torch.bfloat16, msg="d gate")
    assert_close(dg, dg_gold, torch.bfloat16, msg="d up")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_extreme_values(dtype, device):
    big = 60000.0 if dtype == torch.float16 else 1e4
    gate = torch.tensor([-big, -100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, big])
    gate = gate.to(device, dtype)
    up = torch.ones_like(gate)
    grad_h = torch.full_like(gate, 0.5)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h)
    h, de, dg = swiglu_backward(grad_h, gate, up)
    assert_close(swiglu_forward(gate, up), h_gold, dtype, msg="h")
    assert_close(h, h_gold, dtype, msg="recomputed h")
    assert_close(de, de_gold, dtype, msg="d gate")
    assert_close(dg, dg_gold, dtype, msg="d up")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_in_llama_mlp(dtype, device):
    """LlamaMLP with our swiglu in place of act_fn(gate) * up: output and every grad."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=70,
        num_attention_heads=4,
        hidden_act="silu",
        mlp_bias=False,
    )
    mlp = LlamaMLP(config).to(device, dtype)
    x = torch.randn(2, 7, 48, device=device, dtype=dtype)
    dy = torch.randn(2, 7, 48, device=device, dtype=dtype)
    params = [x] + list(mlp.parameters())

    x.requires_grad_()
    y_hf = mlp(x)
    grads_hf = torch.autograd.grad(y_hf, params, dy)
    y = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    grads = torch.autograd.grad(y, params, dy)

    names = ["y", "dx", "d gate_proj", "d up_proj", "d down_proj"]
    for name, ours, theirs in zip(names, [y, *grads], [y_hf, *grads_hf]):
        assert ours.dtype == theirs.dtype
        err = relative_error(ours, theirs)
        assert err < MODULE_RTOL[dtype], f"{name}: relative error {err:.2e} ({dtype})"


def test_swiglu_reference_fallback(monkeypatch):
    """Without Triton for the device, the public functions run the torch reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if utils.use_triton(torch.empty(1)):
        pytest.skip("CPU tensors use Triton in this environment")
    utils.warn_reference_once.cache_clear()
    gate, up, grad_h = _inputs((4, 19), torch.float32, "cpu", seed=6)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h)
    e = gate.clone().requires_grad_()
    with pytest.warns(UserWarning, match="swiglu"):
        h = swiglu(e, up)
    h.backward(grad_h)
    assert_close(h, h_gold, msg="h")
    assert_close(e.grad, de_gold, msg="d gate")
    h2, de, dg = swiglu_backward(grad_h.clone(), gate.clone(), up.clone(), inplace=True)
    assert_close(h2, h_gold, msg="recomputed h")
    assert_close(de, de_gold, msg="d gate, launcher")
    assert_close(dg, dg_gold, msg="d up, launcher")


def test_swiglu_bad_inputs(device):
    a = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="shape"):
        swiglu(a, torch.randn(4, 9, device=device))
    with pytest.raises(TypeError, match="dtype"):
        swiglu(a, a.half())
    with pytest.raises(TypeError, match="dtype"):
        swiglu(a.long(), a.long())
    with pytest.raises(TypeError, match="dtype"):
        swiglu(a.double(), a.double())
    with pytest.raises(ValueError, match="empty"):
        swiglu(torch.empty(0, 8, device=device), torch.empty(0, 8, device=device))
    with pytest.raises(ValueError, match="grad_h"):
        swiglu_backward(torch.randn(4, 7, device=device), a, a.clone())
    with pytest.raises(TypeError, match="grad_h"):
        swiglu_backward(a.half(), a, a.clone())
    with pytest.raises(ValueError, match="overlap"):
        swiglu_backward(a, a, torch.randn_like(a), inplace=True)


@pytest.mark.cuda
def test_swiglu_more_than_2_31_elements():
    """int64 offsets: the last elements of a >2**31-element tensor are right."""
    n = 2**31 + 4099
    gate = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    h = swiglu_forward(gate, up)
    tail = slice(n - 10000, n)
    assert_close(h[tail], swiglu_reference(gate[tail], up[tail]), msg="forward tail")
    del h
    grad_h = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    h_gold, de_gold, dg_gold = _gold(gate[tail], up[tail], grad_h[tail])
    h, de, dg = swiglu_backward(grad_h, gate, up, inplace=True)
    assert_close(h[tail], h_gold, torch.bfloat16, msg="h tail")
    assert_close(de[tail], de_gold, torch.bfloat16, msg="d gate tail")
    assert_close(dg[tail], dg_gold, torch.bfloat16, msg="d up tail")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_large_llama_shape(dtype):
    gate, up, grad_h = _inputs((4, 2048, 14336), dtype, "cuda", seed=7)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h)
    e = gate.clone().requires_grad_()
    g = up.clone().requires_grad_()
    h = swiglu(e, g)
    h.backward(grad_h)
    assert_close(h, h_gold, dtype, msg="h")
    assert_close(e.grad, de_gold, dtype, msg="d gate")
    assert_close(g.grad, dg_gold, dtype, msg="d up")
