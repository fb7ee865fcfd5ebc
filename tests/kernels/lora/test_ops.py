"""LoRA projections (lora_linear, lora_qkv, lora_o, lora_mlp) against PEFT.

The reference is a real PEFT model: a tiny attention + MLP block of nn.Linear
layers wrapped by ``get_peft_model`` (adapters kept in fp32 as PEFT does for a
16-bit base).  Our functions get the very same tensors through LoRAProjection
records, and the forward output and the gradients of x and of every adapter
matrix are compared.  For an NF4 base, PEFT runs on the bitsandbytes-dequantised
weights while our functions get the packed NF4Weight.

The modules behind the ops are tested here, through them: lora/attention.py's and
lora/gated_mlp.py's autograd Functions, lora/gemms.py's GEMMs (NF4 column slabs
included) and lora/projection.py's record and its input checks.
"""

import copy
import sys
import types

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from transformers.activations import ACT2FN

from slothkit_kernels.lora import (
    lora_linear,
    lora_linear_reference,
    lora_mlp,
    lora_mlp_reference,
    lora_o,
    lora_o_residual,
    lora_qkv,
    lora_qkv_reference,
    lora_qkv_rope,
)
from slothkit_kernels.lora.projection import LoRAProjection
from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.rope import rope
from slothkit_kernels.testing import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# Odd sizes: hidden 96, intermediate 80, q 64, k/v 40, rank 8, 7 tokens.
HIDDEN, INTERMEDIATE, Q_OUT, KV_OUT, RANK = 96, 80, 64, 40, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Norm-wise relative error allowed against PEFT, which runs the adapter matmuls in
# fp32 where we run them in the 16-bit compute dtype.
PEFT_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
# ... and against our own plain-torch reference, which rounds like we do.
REF_RTOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}
# GPU-sized cases reduce over thousands of elements.
LARGE_RTOL = 2e-2
ACTIVATIONS = {"swiglu": "silu", "geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu"}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _has_nf4_kernel() -> bool:
    try:
        import slothkit_kernels.nf4  # noqa: F401
    except ImportError:
        return False
    return True


needs_nf4_kernel = pytest.mark.skipif(
    not _has_nf4_kernel(),
    reason="slothkit_kernels.nf4 (dequantize_nf4) is not written yet; "
    "the NF4 plumbing is covered by the *_nf4_stub tests meanwhile",
)


class TinyBlock(nn.Module):
    """The linear layers of one decoder layer, named as in Llama."""

    def __init__(self, activation: str, bias: bool):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, Q_OUT, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, KV_OUT, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, KV_OUT, bias=bias)
        self.o_proj = nn.Linear(Q_OUT, HIDDEN, bias=False)
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.act_fn = ACT2FN[ACTIVATIONS[activation]]

    def qkv(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _peft_block(dtype, device, activation="swiglu", targets=ALL_TARGETS, bias=False, rslora=False, seed=0):
    torch.manual_seed(seed)
    block = TinyBlock(activation, bias).to(device, dtype)
    config = LoraConfig(
        r=RANK,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=list(targets),
        init_lora_weights=False,  # random A and B, so that every gradient is non-trivial
        use_rslora=rslora,
    )
    model = get_peft_model(block, config)  # adapters upcast to fp32 for a 16-bit base
    return model.base_model.model


def _projection(module, nf4=None) -> LoRAProjection:
    """LoRAProjection sharing the tensors of a PEFT LoRA layer (or a plain nn.Linear)."""
    if isinstance(module, PeftLoraLinear):
        base = module.base_layer
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        scaling = module.scaling["default"]
    else:
        base, a, b, scaling = module, None, None, 1.0
    weight = base.weight if nf4 is None else nf4[base]
    return LoRAProjection(weight, a, b, scaling, base.bias)


def _adapter_params(*modules):
    params = []
    for m in modules:
        if isinstance(m, PeftLoraLinear):
            params += [m.lora_A["default"].weight, m.lora_B["default"].weight]
    return params


def _bnb_dequantize(packed, state):
    """bitsandbytes' dequantize_4bit as the reference for an NF4 weight.

    bitsandbytes 0.50's CPU kernel restarts the blocks at every row, which is wrong
    when in_features is not a multiple of the blocksize (96 here, blocksize 64; its
    quantiser and CUDA kernel run blocks over the flat weight), so on the CPU it
    dequantises the flat weight and the result is reshaped.
    """
    import bitsandbytes.functional as bnb_functional

    shape = state.shape
    if packed.device.type == "cpu" and shape[-1] % state.blocksize != 0:
        state = copy.copy(state)
        state.shape = torch.Size([shape.numel()])
    return bnb_functional.dequantize_4bit(packed, state).reshape(shape)


def _quantize_to_nf4(block):
    """Quantise every base weight to NF4 with bitsandbytes.

    The block's base weights are replaced by their dequantised values (what PEFT then
    computes with) and the NF4Weight records are returned by base layer.
    """
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    records = {}
    for module in block.modules():
        if isinstance(module, nn.Linear) and not isinstance(module, PeftLoraLinear):
            packed, state = bnb_functional.quantize_4bit(
                module.weight.data, quant_type="nf4", compress_statistics=True, blocksize=64
            )
            module.weight.data = _bnb_dequantize(packed, state)
            records[module] = NF4Weight.from_bitsandbytes(packed, state)
    return records


def _compare(ours, theirs, rtol, what):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, f"{what}[{i}]: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{what}[{i}]: dtype {a.dtype} vs {b.dtype}"
        err = relative_error(a, b)
        assert err < rtol, f"{what}[{i}]: relative error {err:.2e} >= {rtol:.0e}"


def _run(fn, params, seed=1):
    """Outputs of fn and the grads of params, for fixed random output grads."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    dys = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, params, dys)
    return [o.detach() for o in outs], list(grads)


def _x(shape, dtype, device, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()


# ----------------------------------------------------------------------------
# 16-bit (and fp32) base
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize(
    "targets",
    [ALL_TARGETS, ["gate_proj", "down_proj"]],  # the second leaves up_proj without adapter
    ids=["all", "partial"],
)
def test_lora_mlp_matches_peft(dtype, activation, targets, device):
    block = _peft_block(dtype, device, activation, targets)
    gate, up, down = block.gate_proj, block.up_proj, block.down_proj
    projs = [_projection(m) for m in (gate, up, down)]
    x = _x((2, 7, HIDDEN), dtype, device)
    params = [x] + _adapter_params(gate, up, down)

    y, grads = _run(lambda: lora_mlp(x, *projs, activation=activation), params)
    y_peft, grads_peft = _run(lambda: block.mlp(x), params)
    y_ref, grads_ref = _run(lambda: lora_mlp_reference(x, *projs, activation), params)
    _compare(y, y_peft, PEFT_RTOL[dtype], "y vs PEFT")
    _compare(grads, grads_peft, PEFT_RTOL[dtype], "grads (x, A, B...) vs PEFT")
    _compare(y, y_ref, REF_RTOL[dtype], "y vs reference")
    _compare(grads, grads_ref, REF_RTOL[dtype], "grads vs reference")
    for p, g in zip(params[1:], grads[1:]):
        assert g.dtype == torch.float32 == p.dtype  # PEFT's fp32 adapters get fp32 grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("targets", [ALL_TARGETS, ["q_proj", "v_proj"]], ids=["all", "k_without_adapter"])
def test_lora_qkv_matches_peft(dtype, bias, targets, device):
    block = _peft_block(dtype, device, bias=bias, targets=targets, seed=3)
    q, k, v = block.q_proj, block.k_proj, block.v_proj
    projs = [_projection(m) for m in (q, k, v)]
    x = _x((7, HIDDEN), dtype, device)
    params = [x] + _adapter_params(q, k, v)

    outs, grads = _run(lambda: lora_qkv(x, *projs), params)
    outs_peft, grads_peft = _run(lambda: block.qkv(x), params)
    outs_ref, grads_ref = _run(lambda: lora_qkv_reference(x, *projs), params)
    _compare(outs, outs_peft, PEFT_RTOL[dtype], "q, k, v vs PEFT")
    _compare(grads, grads_peft, PEFT_RTOL[dtype], "grads vs PEFT")
    _compare(outs, outs_ref, REF_RTOL[dtype], "q, k, v vs reference")
    _compare(grads, grads_ref, REF_RTOL[dtype], "grads vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize("shape", [(1, Q_OUT), (7, Q_OUT), (2, 3, Q_OUT)])
def test_lora_o_and_linear_match_peft(dtype, rslora, shape, device):
    block = _peft_block(dtype, device, rslora=rslora, seed=4)
    o = block.o_proj
    proj = _projection(o)
    expected_scaling = 16 / RANK**0.5 if rslora else 16 / RANK
    assert proj.scaling == pytest.approx(expected_scaling)
    x = _x(shape, dtype, device)
    params = [x] + _adapter_params(o)

    y_peft, grads_peft = _run(lambda: o(x), params)
    y_ref, grads_ref = _run(lambda: lora_linear_reference(x, proj), params)
    for fn in (lora_o, lora_linear):
        y, grads = _run(lambda fn=fn: fn(x, proj), params)
        _compare(y, y_peft, PEFT_RTOL[dtype], f"{fn.__name__} y vs PEFT")
        _compare(grads, grads_peft, PEFT_RTOL[dtype], f"{fn.__name__} grads vs PEFT")
        _compare(y, y_ref, REF_RTOL[dtype], f"{fn.__name__} y vs reference")
        _compare(grads, grads_ref, REF_RTOL[dtype], f"{fn.__name__} grads vs reference")


def test_lora_linear_without_adapter_is_plain_linear(device):
    torch.manual_seed(5)
    layer = nn.Linear(HIDDEN, KV_OUT).to(device).requires_grad_(False)
    x = _x((7, HIDDEN), torch.float32, device)
    proj = LoRAProjection(layer.weight, None, None, 2.0, layer.bias)
    y, (dx,) = _run(lambda: lora_linear(x, proj), [x])
    y_ref, (dx_ref,) = _run(lambda: layer(x), [x])
    _compare([*y, dx], [*y_ref, dx_ref], 1e-6, "y, dx")


@pytest.mark.parametrize("layout", ["1d", "transposed"])
def test_lora_linear_input_layouts(layout, device):
    """A single token without batch dimension, and a non-contiguous x."""
    block = _peft_block(torch.float32, device, seed=16)
    proj = _projection(block.q_proj)
    params = _adapter_params(block.q_proj)
    if layout == "1d":
        x = _x((HIDDEN,), torch.float32, device)
    else:
        x = _x((HIDDEN, 5), torch.float32, device).detach().t().requires_grad_()
        assert not x.is_contiguous()
    y, grads = _run(lambda: lora_linear(x, proj), [x, *params])
    y_peft, grads_peft = _run(lambda: block.q_proj(x), [x, *params])
    assert y[0].shape == x.shape[:-1] + (Q_OUT,)
    _compare(y, y_peft, PEFT_RTOL[torch.float32], f"y ({layout})")
    _compare(grads, grads_peft, PEFT_RTOL[torch.float32], f"grads ({layout})")


@pytest.mark.parametrize("which", ["x_only", "adapters_only"])
def test_lora_grads_only_where_needed(which, device):
    """x without grad (first layer) or frozen adapters: the other grads are still right."""
    dtype = torch.float32
    block = _peft_block(dtype, device, seed=6)
    mods = (block.gate_proj, block.up_proj, block.down_proj)
    projs = [_projection(m) for m in mods]
    adapters = _adapter_params(*mods)
    x = _x((7, HIDDEN), dtype, device)
    if which == "adapters_only":
        x.requires_grad_(False)
        params = adapters
    else:
        for p in adapters:
            p.requires_grad_(False)
        params = [x]
    _, grads = _run(lambda: lora_mlp(x, *projs), params)
    _, grads_peft = _run(lambda: block.mlp(x), params)
    _compare(grads, grads_peft, PEFT_RTOL[dtype], f"grads ({which})")

    qkv = (block.q_proj, block.k_proj, block.v_proj)
    qkv_projs = [_projection(m) for m in qkv]
    params = _adapter_params(*qkv) if which == "adapters_only" else [x]
    _, grads = _run(lambda: lora_qkv(x, *qkv_projs), params)
    _, grads_peft = _run(lambda: block.qkv(x), params)
    _compare(grads, grads_peft, PEFT_RTOL[dtype], f"qkv grads ({which})")


def test_lora_mlp_only_down_adapter_without_x_grad(device):
    """No gradient flows above the activation: h is recomputed just for dA_down."""
    block = _peft_block(torch.float32, device, targets=["down_proj"], seed=7)
    mods = (block.gate_proj, block.up_proj, block.down_proj)
    projs = [_projection(m) for m in mods]
    x = _x((7, HIDDEN), torch.float32, device).requires_grad_(False)
    params = _adapter_params(*mods)
    assert len(params) == 2
    _, grads = _run(lambda: lora_mlp(x, *projs), params)
    _, grads_peft = _run(lambda: block.mlp(x), params)
    _compare(grads, grads_peft, PEFT_RTOL[torch.float32], "down A, B grads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("which", ["x_and_adapters", "adapters_only", "down_adapter_only"])
def test_lora_mlp_backward_only_gives_the_same_gradients(dtype, activation, which, device):
    """The recompute form: y is zeros, and for the same output gradient every gradient
    equals the one after a full forward (h A_d^T then comes from the h rebuilt in
    backward instead of the forward's)."""
    targets = ["down_proj"] if which == "down_adapter_only" else ALL_TARGETS
    block = _peft_block(dtype, device, activation, targets, seed=17)
    mods = (block.gate_proj, block.up_proj, block.down_proj)
    projs = [_projection(m) for m in mods]
    x = _x((2, 7, HIDDEN), dtype, device, seed=18)
    params = _adapter_params(*mods)
    if which == "x_and_adapters":
        params = [x] + params
    else:
        x.requires_grad_(False)

    y, grads = _run(lambda: lora_mlp(x, *projs, activation=activation), params)
    y_skip, grads_skip = _run(lambda: lora_mlp(x, *projs, activation=activation, backward_only=True), params)
    assert y_skip[0].shape == y[0].shape and y_skip[0].dtype == y[0].dtype
    assert torch.count_nonzero(y_skip[0]) == 0
    _compare(grads_skip, grads, REF_RTOL[dtype], f"backward_only grads ({which})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["x_and_adapters", "adapters_only", "down_adapter_only"])
def test_lora_mlp_in_token_chunks_gives_the_same_values(dtype, which, device):
    """token_chunk below the token count: a forward without autograd gives the same y,
    and the recompute form the same gradients as unchunked (the adapters' summed over
    the chunks), including a last chunk shorter than the rest (14 tokens in chunks of 4)."""
    targets = ["down_proj"] if which == "down_adapter_only" else ALL_TARGETS
    block = _peft_block(dtype, device, "swiglu", targets, seed=23)
    mods = (block.gate_proj, block.up_proj, block.down_proj)
    projs = [_projection(m) for m in mods]
    x = _x((2, 7, HIDDEN), dtype, device, seed=24)
    params = _adapter_params(*mods)
    if which == "x_and_adapters":
        params = [x] + params
    else:
        x.requires_grad_(False)

    with torch.no_grad():
        y_whole = lora_mlp(x, *projs)
        y_chunked = lora_mlp(x, *projs, token_chunk=4)
    _compare([y_chunked], [y_whole], REF_RTOL[dtype], "chunked forward")
    assert y_chunked.shape == y_whole.shape

    _, grads = _run(lambda: lora_mlp(x, *projs, backward_only=True), params)
    y_skip, grads_chunked = _run(lambda: lora_mlp(x, *projs, backward_only=True, token_chunk=4), params)
    assert torch.count_nonzero(y_skip[0]) == 0 and y_skip[0].shape == y_whole.shape
    _compare(grads_chunked, grads, REF_RTOL[dtype], f"chunked recompute grads ({which})")


def test_lora_mlp_token_chunk_only_where_it_applies(nf4_stub, device):
    """A step of at most token_chunk tokens, and a forward autograd records without
    backward_only, run whole (one dequantisation per projection); a chunked forward
    without autograd dequantises per chunk; a bad chunk is refused."""
    block = _peft_block(torch.float32, device, seed=25)
    nf4 = _quantize_to_nf4(block)
    projs = [_projection(m, nf4) for m in (block.gate_proj, block.up_proj, block.down_proj)]
    x = _x((12, HIDDEN), torch.float32, device)
    with torch.no_grad():
        lora_mlp(x, *projs, token_chunk=12)
    assert len(nf4_stub) == 3
    nf4_stub.clear()
    lora_mlp(x.requires_grad_(True), *projs, token_chunk=4)  # autograd, not a recompute
    assert len(nf4_stub) == 3
    nf4_stub.clear()
    with torch.no_grad():
        lora_mlp(x, *projs, token_chunk=4)
    assert len(nf4_stub) == 9  # three chunks
    nf4_stub.clear()
    y = lora_mlp(x, *projs, backward_only=True, token_chunk=4)
    assert len(nf4_stub) == 0  # the recompute's forward saves x only
    y.backward(torch.ones_like(y))
    assert len(nf4_stub) == 3 * 5  # per chunk: gate and up forward, then down, gate, up
    for wrong in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="token_chunk="):
            lora_mlp(x, *projs, token_chunk=wrong)


def test_lora_mlp_backward_only_runs_no_down_projection(nf4_stub, device):
    """With NF4 weights every projection that runs dequantises its weight once: a
    backward_only forward dequantises gate and up only."""
    block = _peft_block(torch.float32, device, seed=19)
    nf4 = _quantize_to_nf4(block)
    projs = [_projection(m, nf4) for m in (block.gate_proj, block.up_proj, block.down_proj)]
    x = _x((7, HIDDEN), torch.float32, device)
    lora_mlp(x, *projs)
    assert [w.shape for w in nf4_stub] == [p.weight.shape for p in projs]
    nf4_stub.clear()
    lora_mlp(x, *projs, backward_only=True)
    assert [w.shape for w in nf4_stub] == [p.weight.shape for p in projs[:2]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["all", "adapters_only", "no_adapter"])
def test_lora_o_residual_with_a_known_sum_gives_the_same_gradients(dtype, which, device):
    """Given the sum it would compute, lora_o_residual returns it as it is and its
    gradients (residual, x, A, B) equal those of the computed sum for the same output
    gradient; dB then comes from an x A^T recomputed in backward."""
    targets = ["q_proj"] if which == "no_adapter" else ALL_TARGETS
    block = _peft_block(dtype, device, targets=targets, seed=21)
    proj = _projection(block.o_proj)
    x = _x((2, 7, Q_OUT), dtype, device, seed=22)
    residual = _x((2, 7, HIDDEN), dtype, device, seed=23)
    params = _adapter_params(block.o_proj)
    if which != "adapters_only":
        params = [x, residual] + params
    else:
        x.requires_grad_(False)
        residual.requires_grad_(False)

    y, grads = _run(lambda: lora_o_residual(x, proj, residual), params)
    with torch.no_grad():
        y_ref = residual + lora_linear_reference(x, proj)
    _compare(y, [y_ref], REF_RTOL[dtype], "sum")
    # A different tensor with the same values: nothing is computed from x in forward.
    known = y[0].clone()
    y_known, grads_known = _run(lambda: lora_o_residual(x, proj, residual, known_sum=known), params)
    assert torch.equal(y_known[0], known)
    _compare(grads_known, grads, REF_RTOL[dtype], f"known-sum grads ({which})")


def test_lora_o_residual_with_a_known_sum_runs_no_projection(nf4_stub, device):
    """NF4 weights are dequantised once per GEMM that runs: none in a known-sum forward,
    once (for dx) in its backward."""
    block = _peft_block(torch.float32, device, seed=24)
    nf4 = _quantize_to_nf4(block)
    proj = _projection(block.o_proj, nf4)
    x = _x((7, Q_OUT), torch.float32, device)
    residual = _x((7, HIDDEN), torch.float32, device, seed=25)
    known = lora_o_residual(x, proj, residual).detach()
    nf4_stub.clear()
    y = lora_o_residual(x, proj, residual, known_sum=known)
    assert nf4_stub == []
    y.sum().backward()
    assert len(nf4_stub) == 1


def test_lora_o_residual_refuses_a_known_sum_of_another_shape(device):
    block = _peft_block(torch.float32, device, seed=26)
    x = _x((2, 7, Q_OUT), torch.float32, device)
    residual = _x((2, 7, HIDDEN), torch.float32, device)
    with pytest.raises(ValueError, match="known_sum has shape"):
        lora_o_residual(x, _projection(block.o_proj), residual, known_sum=residual[:, :5])


def test_lora_under_autocast(device):
    """fp32 model and input under bf16 autocast: run in bf16, like PEFT under autocast."""
    block = _peft_block(torch.float32, device, seed=8)
    mods = (block.gate_proj, block.up_proj, block.down_proj)
    projs = [_projection(m) for m in mods]
    x = _x((7, HIDDEN), torch.float32, device)
    params = [x] + _adapter_params(*mods)
    qkv_projs = [_projection(m) for m in (block.q_proj, block.k_proj, block.v_proj)]
    with torch.autocast(device, dtype=torch.bfloat16):
        y, grads = _run(lambda: lora_mlp(x, *projs), params)
        y_peft, grads_peft = _run(lambda: block.mlp(x), params)
        qkv, (dx_qkv,) = _run(lambda: lora_qkv(x, *qkv_projs), [x])
    assert y[0].dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in qkv)
    assert grads[0].dtype == torch.float32 and dx_qkv.dtype == torch.float32  # x's dtype
    _compare(y, y_peft, PEFT_RTOL[torch.bfloat16], "y under autocast")
    _compare(grads[1:], grads_peft[1:], PEFT_RTOL[torch.bfloat16], "adapter grads under autocast")
    assert relative_error(grads[0], grads_peft[0]) < PEFT_RTOL[torch.bfloat16]


def test_lora_mlp_backward_runs_once(device):
    block = _peft_block(torch.float32, device, seed=9)
    projs = [_projection(m) for m in (block.gate_proj, block.up_proj, block.down_proj)]
    x = _x((7, HIDDEN), torch.float32, device)
    y = lora_mlp(x, *projs)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        y.sum().backward()


def test_lora_qkv_retain_graph_backward_twice(device):
    block = _peft_block(torch.float32, device, seed=10)
    projs = [_projection(m) for m in (block.q_proj, block.k_proj, block.v_proj)]
    x = _x((7, HIDDEN), torch.float32, device)
    q, k, v = lora_qkv(x, *projs)
    loss = q.sum() + k.square().sum() + v.mean()
    (g1,) = torch.autograd.grad(loss, [x], retain_graph=True)
    (g2,) = torch.autograd.grad(loss, [x])
    assert torch.equal(g1, g2)


HEAD_DIM = 8  # q: 8 heads, k and v: 5 (grouped-query with a ratio that is not a power of 2)


def _rotary_tables(kind, batch, seq, device, seed=12):
    """cos/sin gathered per token (B, T, D), or a table (P, D) and position_ids (B, T)
    restarting inside a row, as packed sequences have them."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "gathered":
        cos, sin = (torch.randn(batch, seq, HEAD_DIM, generator=gen).to(device) for _ in range(2))
        return cos, sin, None
    cos, sin = (torch.randn(3 * seq, HEAD_DIM, generator=gen).to(device) for _ in range(2))
    positions = torch.cat([torch.arange(seq - 2), torch.arange(2)]).repeat(batch, 1)
    return cos, sin, positions.to(device)


def _heads(t, batch, seq):
    return t.view(batch, seq, -1, HEAD_DIM).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables", ["gathered", "positions"])
@pytest.mark.parametrize("used", ["all", "v_only", "q_only"])
def test_lora_qkv_rope_equals_lora_qkv_then_rope(dtype, tables, used, device):
    """The fused function gives the values and gradients of lora_qkv followed by rope
    on the (B, heads, T, D) views, with gradients flowing only through what is used."""
    batch, seq = 2, 7
    block = _peft_block(dtype, device, seed=13)
    projs = [_projection(m) for m in (block.q_proj, block.k_proj, block.v_proj)]
    cos, sin, positions = _rotary_tables(tables, batch, seq, device)
    x = _x((batch, seq, HIDDEN), dtype, device)
    params = [x] + [t for p in projs for t in (p.lora_a, p.lora_b)]
    pick = {"all": slice(0, 3), "v_only": slice(2, 3), "q_only": slice(0, 1)}[used]

    def separate():
        q, k, v = lora_qkv(x, *projs)
        q4, k4 = rope(_heads(q, batch, seq), _heads(k, batch, seq), cos, sin, positions)
        return (q4, k4, _heads(v, batch, seq))[pick]

    def fused():
        q, k, v = lora_qkv_rope(x, *projs, cos, sin, HEAD_DIM, positions)
        return tuple(_heads(t, batch, seq) for t in (q, k, v))[pick]

    outs_ref, grads_ref = _run(separate, params)
    outs, grads = _run(fused, params)
    for a, b in zip(outs + grads, outs_ref + grads_ref):
        assert torch.equal(a, b), f"max difference {(a.float() - b.float()).abs().max():.3e}"


def test_lora_qkv_rope_bad_head_dim(device):
    block = _peft_block(torch.float32, device, seed=14)
    projs = [_projection(m) for m in (block.q_proj, block.k_proj, block.v_proj)]
    cos, sin, _ = _rotary_tables("gathered", 1, 3, device)
    with pytest.raises(ValueError, match="multiple of head_dim=16"):
        lora_qkv_rope(_x((1, 3, HIDDEN), torch.float32, device), *projs, cos, sin, 16)


def test_lora_no_grad_inference(device):
    block = _peft_block(torch.bfloat16, device, seed=11)
    projs = [_projection(m) for m in (block.gate_proj, block.up_proj, block.down_proj)]
    x = _x((1, HIDDEN), torch.bfloat16, device).detach()
    with torch.no_grad():
        y = lora_mlp(x, *projs)
        y_peft = block.mlp(x)
    assert not y.requires_grad
    _compare([y], [y_peft], PEFT_RTOL[torch.bfloat16], "no_grad forward")


# ----------------------------------------------------------------------------
# NF4 base
# ----------------------------------------------------------------------------


@pytest.fixture
def nf4_stub(monkeypatch):
    """A stand-in ``slothkit_kernels.nf4.dequantize`` whose dequantize_nf4 returns
    bitsandbytes' dequantised weight, and counts its calls, to test the LoRA ops' NF4
    plumbing."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    calls = []

    def dequantize_nf4(weight: NF4Weight) -> torch.Tensor:
        assert isinstance(weight, NF4Weight)
        calls.append(weight)
        state = bnb_functional.QuantState(
            absmax=weight.absmax,
            shape=weight.shape,
            code=weight.code,
            blocksize=weight.blocksize,
            quant_type="nf4",
            dtype=weight.dtype,
            offset=weight.offset,
            state2=bnb_functional.QuantState(
                absmax=weight.nested_absmax,
                code=weight.nested_code,
                blocksize=weight.nested_blocksize,
                dtype=torch.float32,
            )
            if weight.is_nested
            else None,
        )
        return _bnb_dequantize(weight.packed, state)

    module = types.ModuleType("slothkit_kernels.nf4.dequantize")
    module.dequantize_nf4 = dequantize_nf4
    monkeypatch.setitem(sys.modules, "slothkit_kernels.nf4.dequantize", module)
    return calls


def _check_mlp_nf4(dtype, activation, targets, device):
    block = _peft_block(dtype, device, activation, targets, seed=12)
    nf4 = _quantize_to_nf4(block)
    mods = (block.gate_proj, block.up_proj, block.down_proj)
    projs = [_projection(m, nf4) for m in mods]
    assert all(isinstance(p.weight, NF4Weight) for p in projs)
    x = _x((7, HIDDEN), dtype, device)
    params = [x] + _adapter_params(*mods)

    saved_shapes = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, grads = _run(lambda: lora_mlp(x, *projs, activation=activation), params)
    for p in projs:
        w_shape = tuple(p.weight.shape)
        assert w_shape not in saved_shapes and w_shape[::-1] not in saved_shapes, (
            f"a dequantised {w_shape} weight was saved for backward"
        )
    y_peft, grads_peft = _run(lambda: block.mlp(x), params)
    _compare(y, y_peft, PEFT_RTOL[dtype], "NF4 y vs PEFT on dequantised weights")
    _compare(grads, grads_peft, PEFT_RTOL[dtype], "NF4 grads vs PEFT on dequantised weights")


def _check_qkv_o_nf4(dtype, device):
    block = _peft_block(dtype, device, targets=["q_proj", "v_proj", "o_proj"], bias=True, seed=13)
    nf4 = _quantize_to_nf4(block)
    qkv = (block.q_proj, block.k_proj, block.v_proj)
    projs = [_projection(m, nf4) for m in qkv]
    x = _x((2, 7, HIDDEN), dtype, device)
    params = [x] + _adapter_params(*qkv)
    outs, grads = _run(lambda: lora_qkv(x, *projs), params)
    outs_peft, grads_peft = _run(lambda: block.qkv(x), params)
    _compare(outs, outs_peft, PEFT_RTOL[dtype], "NF4 q, k, v")
    _compare(grads, grads_peft, PEFT_RTOL[dtype], "NF4 qkv grads")

    o = block.o_proj
    xo = _x((2, 7, Q_OUT), dtype, device)
    params = [xo] + _adapter_params(o)
    y, grads = _run(lambda: lora_o(xo, _projection(o, nf4)), params)
    y_peft, grads_peft = _run(lambda: o(xo), params)
    _compare(y, y_peft, PEFT_RTOL[dtype], "NF4 o")
    _compare(grads, grads_peft, PEFT_RTOL[dtype], "NF4 o grads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_lora_mlp_nf4_stub(dtype, activation, nf4_stub, device):
    _check_mlp_nf4(dtype, activation, ["gate_proj", "down_proj"], device)
    # Dequantised once per projection in forward and once again in backward.
    assert len(nf4_stub) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_qkv_o_nf4_stub(dtype, nf4_stub, device):
    _check_qkv_o_nf4(dtype, device)
    assert len(nf4_stub) == 3 + 3 + 1 + 1


@needs_nf4_kernel
@pytest.mark.parametrize(
    "dtype, activation",
    [
        (torch.float32, "swiglu"),
        (torch.float16, "geglu_tanh"),
        (torch.bfloat16, "swiglu"),
        (torch.bfloat16, "geglu"),
    ],
)
def test_lora_mlp_nf4(dtype, activation, device):
    _check_mlp_nf4(dtype, activation, ALL_TARGETS, device)


@needs_nf4_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_qkv_o_nf4(dtype, device):
    _check_qkv_o_nf4(dtype, device)


@needs_nf4_kernel
@pytest.mark.parametrize("adapters", [True, False], ids=["adapters", "frozen"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_nf4_input_gradient_in_column_slabs(dtype, adapters, device, monkeypatch):
    """With the slab bound below a weight's size, backward dequantises it a column slab
    at a time (forward still whole), and every gradient equals the whole-weight run's;
    also where no adapter term comes first (frozen projections: dX starts empty)."""
    import slothkit_kernels.lora.gemms as gemms_module
    import slothkit_kernels.nf4.dequantize as nf4_module

    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    hidden, inter = 128, 192  # rows of whole 64-element blocks
    gen = torch.Generator().manual_seed(21)
    projs = []
    for in_f, out_f in ((hidden, inter), (hidden, inter), (inter, hidden)):
        weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)
        packed, state = bnb_functional.quantize_4bit(
            weight, quant_type="nf4", compress_statistics=True, blocksize=64
        )
        state.to(device)
        a = (torch.randn(RANK, in_f, generator=gen) / in_f**0.5).to(device).requires_grad_()
        b = (torch.randn(out_f, RANK, generator=gen) / RANK**0.5).to(device).requires_grad_()
        if not adapters:
            a = b = None
        projs.append(LoRAProjection(NF4Weight.from_bitsandbytes(packed.to(device), state), a, b, 2.0))
    x = _x((2, 5, hidden), dtype, device)
    params = [x] + [t for p in projs for t in (p.lora_a, p.lora_b) if t is not None]

    columns = []
    real = nf4_module.dequantize_nf4

    def counting(weight, out=None, **kwargs):
        columns.append((tuple(weight.shape), kwargs.get("columns")))
        return real(weight, out, **kwargs)

    monkeypatch.setattr(nf4_module, "dequantize_nf4", counting)
    whole = _run(lambda: lora_mlp(x, *projs), params)
    assert [c for _, c in columns] == [None] * 6  # gate, up, down in forward and in backward
    columns.clear()
    # 128 x 192 x itemsize bytes per weight: a bound of a third splits down's weight
    # (128 x 192, wider than tall) into three 64-column slabs; gate's and up's
    # (192 x 128, taller than wide) stay whole.
    monkeypatch.setattr(gemms_module, "NF4_SLAB_BYTES", hidden * inter * dtype.itemsize // 3)
    slabbed = _run(lambda: lora_mlp(x, *projs), params)
    assert columns == [
        ((inter, hidden), None),
        ((inter, hidden), None),
        ((hidden, inter), None),
        ((hidden, inter), (0, 64)),
        ((hidden, inter), (64, 128)),
        ((hidden, inter), (128, 192)),  # dL/dh = dY W_down
        ((inter, hidden), None),
        ((inter, hidden), None),
    ]  # dX: gate and up
    # Each element of a slab's product is the same dot product as the whole GEMM's.
    _compare(slabbed[0], whole[0], REF_RTOL[dtype] / 10, "y")
    _compare(slabbed[1], whole[1], REF_RTOL[dtype] / 10, "grads in slabs vs whole")


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------


def _proj(in_f, out_f, r=4, device="cpu", dtype=torch.float32):
    return LoRAProjection(
        torch.randn(out_f, in_f, device=device, dtype=dtype),
        torch.randn(r, in_f, device=device, requires_grad=True),
        torch.randn(out_f, r, device=device, requires_grad=True),
        2.0,
    )


def test_lora_bad_inputs(device):
    x = torch.randn(3, 16, device=device)
    good = _proj(16, 12, device=device)
    with pytest.raises(ValueError, match="in_features=20"):
        lora_linear(x, _proj(20, 12, device=device))
    bad = _proj(16, 12, device=device)
    bad.lora_b = torch.randn(12, 5, device=device)
    with pytest.raises(ValueError, match="rank mismatch"):
        lora_linear(x, bad)
    bad = _proj(16, 12, device=device)
    bad.lora_a = torch.randn(4, 15, device=device)
    with pytest.raises(ValueError, match="lora_a must be"):
        lora_linear(x, bad)
    bad = _proj(16, 12, device=device)
    bad.lora_b = torch.randn(11, 4, device=device)
    with pytest.raises(ValueError, match="lora_b must be"):
        lora_linear(x, bad)
    bad = _proj(16, 12, device=device)
    bad.lora_b = None
    with pytest.raises(ValueError, match="both"):
        lora_linear(x, bad)
    bad = _proj(16, 12, device=device)
    bad.bias = torch.zeros(11, device=device)
    with pytest.raises(ValueError, match="bias"):
        lora_linear(x, bad)
    bad = _proj(16, 12, device=device)
    bad.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(x, bad)
    with pytest.raises(TypeError, match="dtype"):
        lora_linear(x.bfloat16(), good)  # bf16 input, fp32 base weight, no autocast
    with pytest.raises(TypeError, match="dtype"):
        lora_linear(x.double(), good)
    with pytest.raises(ValueError, match="empty"):
        lora_linear(torch.empty(0, 16, device=device), good)
    with pytest.raises(TypeError, match="LoRAProjection"):
        lora_linear(x, "q_proj")
    with pytest.raises(ValueError, match="k_proj"):
        lora_qkv(x, good, _proj(17, 12, device=device), good)
    with pytest.raises(ValueError, match="activation"):
        lora_mlp(
            x,
            _proj(16, 12, device=device),
            _proj(16, 12, device=device),
            _proj(12, 16, device=device),
            "relu",
        )
    with pytest.raises(ValueError, match="up_proj"):
        lora_mlp(
            x,
            _proj(16, 12, device=device),
            _proj(16, 13, device=device),
            _proj(12, 16, device=device),
        )
    with pytest.raises(ValueError, match="down_proj"):
        lora_mlp(
            x,
            _proj(16, 12, device=device),
            _proj(16, 12, device=device),
            _proj(13, 16, device=device),
        )


# ----------------------------------------------------------------------------
# GPU-sized cases
# ----------------------------------------------------------------------------


def _big_projection(in_f, out_f, r, dtype, nf4=False):
    weight = torch.randn(out_f, in_f, device="cuda", dtype=dtype) / in_f**0.5
    a = (torch.randn(r, in_f, device="cuda") / in_f**0.5).requires_grad_()
    b = (torch.randn(out_f, r, device="cuda") / r**0.5).requires_grad_()
    if nf4:
        import bitsandbytes.functional as bnb_functional

        packed, state = bnb_functional.quantize_4bit(
            weight, quant_type="nf4", compress_statistics=True, blocksize=64
        )
        return (
            LoRAProjection(NF4Weight.from_bitsandbytes(packed, state), a, b, 2.0),
            LoRAProjection(_bnb_dequantize(packed, state), a, b, 2.0),
        )
    proj = LoRAProjection(weight, a, b, 2.0)
    return proj, proj


@pytest.mark.cuda
@pytest.mark.parametrize("nf4", [False, pytest.param(True, marks=needs_nf4_kernel)], ids=["bf16", "nf4"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_lora_mlp_large(nf4, activation):
    dtype = torch.bfloat16
    torch.manual_seed(14)
    pairs = [
        _big_projection(4096, 14336, 16, dtype, nf4),
        _big_projection(4096, 14336, 16, dtype, nf4),
        _big_projection(14336, 4096, 16, dtype, nf4),
    ]
    projs, ref_projs = zip(*pairs)
    x = (torch.randn(2, 2048, 4096, device="cuda", dtype=dtype)).requires_grad_()
    params = [x] + [t for p in projs for t in (p.lora_a, p.lora_b)]
    y, grads = _run(lambda: lora_mlp(x, *projs, activation=activation), params)
    y_ref, grads_ref = _run(lambda: lora_mlp_reference(x, *ref_projs, activation), params)
    _compare(y, y_ref, LARGE_RTOL, "y")
    _compare(grads, grads_ref, LARGE_RTOL, "grads")


@pytest.mark.cuda
def test_lora_qkv_large():
    dtype = torch.bfloat16
    torch.manual_seed(15)
    projs = [_big_projection(4096, n, 16, dtype)[0] for n in (4096, 1024, 1024)]
    x = torch.randn(4, 2048, 4096, device="cuda", dtype=dtype).requires_grad_()
    params = [x] + [t for p in projs for t in (p.lora_a, p.lora_b)]
    outs, grads = _run(lambda: lora_qkv(x, *projs), params)
    outs_ref, grads_ref = _run(lambda: lora_qkv_reference(x, *projs), params)
    _compare(outs, outs_ref, LARGE_RTOL, "q, k, v")
    _compare(grads, grads_ref, LARGE_RTOL, "grads")


@pytest.mark.cuda
def test_lora_qkv_rope_large():
    """Llama-3-8B's attention shapes: the fused function against lora_qkv then rope."""
    dtype, batch, seq, head_dim = torch.bfloat16, 2, 2048, 128
    torch.manual_seed(16)
    projs = [_big_projection(4096, n, 16, dtype)[0] for n in (4096, 1024, 1024)]
    x = torch.randn(batch, seq, 4096, device="cuda", dtype=dtype).requires_grad_()
    angles = torch.arange(seq, device="cuda")[:, None] / 10000 ** (
        torch.arange(0, head_dim, 2, device="cuda") / head_dim
    )
    angles = torch.cat([angles, angles], dim=-1)[None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    params = [x] + [t for p in projs for t in (p.lora_a, p.lora_b)]

    def heads(t):
        return t.view(batch, seq, -1, head_dim).transpose(1, 2)

    def separate():
        q, k, v = lora_qkv(x, *projs)
        return (*rope(heads(q), heads(k), cos, sin), heads(v))

    outs_ref, grads_ref = _run(separate, params)
    outs, grads = _run(lambda: tuple(heads(t) for t in lora_qkv_rope(x, *projs, cos, sin, head_dim)), params)
    for a, b in zip(outs + grads, outs_ref + grads_ref):
        assert torch.equal(a, b)


def test_lora_qkv_rope_refuses_positions_outside_the_table(device):
    block = _peft_block(torch.float32, device, seed=17)
    projs = [_projection(m) for m in (block.q_proj, block.k_proj, block.v_proj)]
    cos, sin, positions = _rotary_tables("positions", 1, 4, device)
    positions = positions.clone()
    positions[0, -1] = cos.shape[0]  # one past the last row
    with pytest.raises(ValueError, match="position_ids range over"):
        lora_qkv_rope(_x((1, 4, HIDDEN), torch.float32, device), *projs, cos, sin, HEAD_DIM, positions)
