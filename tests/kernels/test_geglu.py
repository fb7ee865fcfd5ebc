"""geglu: gelu(gate) * up (tanh and erf), against torch, transformers' GELUs and GemmaMLP."""

import pytest
import torch
from transformers import GemmaConfig
from transformers.activations import ACT2FN
from transformers.models.gemma.modeling_gemma import GemmaMLP

from slothkit_kernels import utils
from slothkit_kernels.geglu import geglu, geglu_backward, geglu_forward, geglu_reference
from slothkit_kernels.testing import assert_close, relative_error

# The interpreter evaluates exp() with numpy, which warns when exp(-x) overflows to inf
# in sigmoid (the result, 0 or 1, is still right).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (1, 1), (7, 33), (3, 5, 123), (2, 1025), (4, 3, 2, 17)]
APPROXIMATE = ["tanh", "none"]
HF_ACTIVATION = {"tanh": "gelu_pytorch_tanh", "none": "gelu"}  # transformers' names
MODULE_RTOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * 3).to(device, dtype)  # reaches gelu's tails
    up = torch.randn(shape, generator=gen).to(device, dtype)
    grad_h = torch.randn(shape, generator=gen).to(device, dtype)
    return gate, up, grad_h


def _gold(gate, up, grad_h, approximate):
    """fp32 autograd through transformers' GELU, from the same (rounded) inputs."""
    e = gate.detach().float().requires_grad_()
    g = up.detach().float().requires_grad_()
    h = ACT2FN[HF_ACTIVATION[approximate]](e) * g
    h.backward(grad_h.float())
    return h.detach(), e.grad, g.grad


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_geglu_forward_backward(shape, dtype, approximate, device):
    gate, up, grad_h = _inputs(shape, dtype, device, seed=sum(shape))
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h, approximate)
    torch_h = torch.nn.functional.gelu(gate.float(), approximate=approximate) * up.float()

    e = gate.clone().requires_grad_()
    g = up.clone().requires_grad_()
    h = geglu(e, g, approximate=approximate)
    assert h.shape == gate.shape and h.dtype == dtype
    assert_close(h, h_gold, dtype, msg="h vs fp32 transformers GELU")
    assert_close(h, torch_h, dtype, msg="h vs torch gelu")
    assert_close(h, geglu_reference(gate, up, approximate), dtype, msg="h vs geglu_reference")
    hf_in_dtype = ACT2FN[HF_ACTIVATION[approximate]](gate) * up
    assert_close(h, hf_in_dtype, dtype, msg="h vs transformers GELU in dtype")

    h.backward(grad_h)
    assert e.grad.dtype == dtype and g.grad.dtype == dtype
    assert_close(e.grad, de_gold, dtype, msg="d gate")
    assert_close(g.grad, dg_gold, dtype, msg="d up")


def test_geglu_default_is_tanh(device):
    gate, up, _ = _inputs((3, 10), torch.float32, device, seed=1)
    assert torch.equal(geglu(gate, up), geglu(gate, up, approximate="tanh"))
    assert not torch.equal(geglu(gate, up), geglu(gate, up, approximate="none"))


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_geglu_launchers(dtype, inplace, approximate, device):
    gate, up, grad_h = _inputs((5, 77), dtype, device, seed=3)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h, approximate)

    assert_close(geglu_forward(gate, up, approximate), h_gold, dtype, msg="geglu_forward")

    dh_buf, e_buf, g_buf = grad_h.clone(), gate.clone(), up.clone()
    versions = [t._version for t in (dh_buf, e_buf, g_buf)]
    h, de, dg = geglu_backward(dh_buf, e_buf, g_buf, approximate, inplace=inplace)
    assert_close(h, h_gold, dtype, msg="recomputed h")
    assert_close(de, de_gold, dtype, msg="d gate")
    assert_close(dg, dg_gold, dtype, msg="d up")
    for out, buf, v, name in zip((h, de, dg), (dh_buf, e_buf, g_buf), versions, ("h", "de", "dg")):
        if inplace:
            assert out.data_ptr() == buf.data_ptr(), f"{name} was not written in place"
            assert buf._version > v, f"{name}: version counter not bumped"
        else:
            assert out.data_ptr() != buf.data_ptr()
    if not inplace:
        assert torch.equal(dh_buf, grad_h) and torch.equal(e_buf, gate) and torch.equal(g_buf, up)


@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_geglu_non_contiguous(approximate, device):
    dtype = torch.bfloat16
    gate, up, grad_h = _inputs((33, 9), dtype, device, seed=5)
    gate_t, up_t, grad_t = gate.t(), up.t(), grad_h.t()
    h_gold, de_gold, dg_gold = _gold(gate_t, up_t, grad_t, approximate)
    e = gate_t.detach().requires_grad_()
    g = up_t.detach().requires_grad_()
    h = geglu(e, g, approximate)
    h.backward(grad_t)
    assert_close(h, h_gold, dtype, msg="h")
    assert_close(e.grad, de_gold, dtype, msg="d gate")
    assert_close(g.grad, dg_gold, dtype, msg="d up")


def test_geglu_writes_every_element(monkeypatch, device):
    """Outputs are allocated NaN-poisoned: a tail element left unwritten would fail."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    gate, up, grad_h = _inputs((3, 1025), torch.bfloat16, device, seed=8)  # 3075 = 3 * 1024 + 3
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h, "none")
    assert_close(geglu_forward(gate, up, "none"), h_gold, torch.bfloat16, msg="h")
    h, de, dg = geglu_backward(grad_h, gate, up, "none")
    assert_close(h, h_gold, torch.bfloat16, msg="recomputed h")
    assert_close(de, de_gold, torch.bfloat16, msg="d gate")
    assert_close(dg, dg_gold, torch.bfloat16, msg="d up")


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_extreme_values(dtype, approximate, device):
    big = 60000.0 if dtype == torch.float16 else 1e4
    gate = torch.tensor([-big, -100.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 100.0, big])
    gate = gate.to(device, dtype)
    up = torch.ones_like(gate)
    grad_h = torch.full_like(gate, 0.5)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h, approximate)
    h, de, dg = geglu_backward(grad_h, gate, up, approximate)
    assert_close(geglu_forward(gate, up, approximate), h_gold, dtype, msg="h")
    assert_close(h, h_gold, dtype, msg="recomputed h")
    assert_close(de, de_gold, dtype, msg="d gate")
    assert_close(dg, dg_gold, dtype, msg="d up")


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_in_gemma_mlp(dtype, approximate, device):
    """GemmaMLP with our geglu in place of act_fn(gate) * up: output and every grad."""
    torch.manual_seed(0)
    config = GemmaConfig(hidden_size=48, intermediate_size=70, num_attention_heads=4, head_dim=12)
    mlp = GemmaMLP(config).to(device, dtype)
    assert type(mlp.act_fn) is type(ACT2FN["gelu_pytorch_tanh"])  # Gemma's own choice
    # The same module with the activation under test (the erf form for "none").
    mlp.act_fn = ACT2FN[HF_ACTIVATION[approximate]]
    x = torch.randn(2, 7, 48, device=device, dtype=dtype)
    dy = torch.randn(2, 7, 48, device=device, dtype=dtype)
    params = [x] + list(mlp.parameters())

    x.requires_grad_()
    y_hf = mlp(x)
    grads_hf = torch.autograd.grad(y_hf, params, dy)
    y = mlp.down_proj(geglu(mlp.gate_proj(x), mlp.up_proj(x), approximate))
    grads = torch.autograd.grad(y, params, dy)

    names = ["y", "dx", "d gate_proj", "d up_proj", "d down_proj"]
    for name, ours, theirs in zip(names, [y, *grads], [y_hf, *grads_hf]):
        assert ours.dtype == theirs.dtype
        err = relative_error(ours, theirs)
        assert err < MODULE_RTOL[dtype], f"{name}: relative error {err:.2e} ({dtype})"


@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_geglu_reference_fallback(approximate, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if utils.use_triton(torch.empty(1)):
        pytest.skip("CPU tensors use Triton in this environment")
    utils.warn_reference_once.cache_clear()
    gate, up, grad_h = _inputs((4, 19), torch.float32, "cpu", seed=6)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h, approximate)
    e = gate.clone().requires_grad_()
    with pytest.warns(UserWarning, match="geglu"):
        h = geglu(e, up, approximate)
    h.backward(grad_h)
    assert_close(h, h_gold, msg="h")
    assert_close(e.grad, de_gold, msg="d gate")
    h2, de, dg = geglu_backward(grad_h.clone(), gate.clone(), up.clone(), approximate, inplace=True)
    assert_close(h2, h_gold, msg="recomputed h")
    assert_close(de, de_gold, msg="d gate, launcher")
    assert_close(dg, dg_gold, msg="d up, launcher")


def test_geglu_bad_inputs(device):
    a = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="approximate"):
        geglu(a, a, approximate="erf")
    with pytest.raises(ValueError, match="shape"):
        geglu(a, torch.randn(4, 9, device=device))
    with pytest.raises(TypeError, match="dtype"):
        geglu(a, a.bfloat16())
    with pytest.raises(TypeError, match="dtype"):
        geglu(a.int(), a.int())
    with pytest.raises(ValueError, match="empty"):
        geglu(torch.empty(3, 0, device=device), torch.empty(3, 0, device=device))
    with pytest.raises(ValueError, match="grad_h"):
        geglu_backward(torch.randn(2, 8, device=device), a, a.clone())
    with pytest.raises(ValueError, match="overlap"):
        geglu_backward(torch.randn_like(a), a, a, inplace=True)


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_geglu_more_than_2_31_elements(approximate):
    n = 2**31 + 4099
    gate = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    grad_h = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    tail = slice(n - 10000, n)
    h_gold, de_gold, dg_gold = _gold(gate[tail], up[tail], grad_h[tail], approximate)
    h = geglu_forward(gate, up, approximate)
    assert_close(h[tail], h_gold, torch.bfloat16, msg="forward tail")
    del h
    h, de, dg = geglu_backward(grad_h, gate, up, approximate, inplace=True)
    assert_close(h[tail], h_gold, torch.bfloat16, msg="h tail")
    assert_close(de[tail], de_gold, torch.bfloat16, msg="d gate tail")
    assert_close(dg[tail], dg_gold, torch.bfloat16, msg="d up tail")


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_geglu_large_gemma_shape(dtype, approximate):
    gate, up, grad_h = _inputs((2, 2048, 24576), dtype, "cuda", seed=7)
    h_gold, de_gold, dg_gold = _gold(gate, up, grad_h, approximate)
    e = gate.clone().requires_grad_()
    g = up.clone().requires_grad_()
    h = geglu(e, g, approximate)
    h.backward(grad_h)
    assert_close(h, h_gold, dtype, msg="h")
    assert_close(e.grad, de_gold, dtype, msg="d gate")
    assert_close(g.grad, dg_gold, dtype, msg="d up")
