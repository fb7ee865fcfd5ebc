"""NF4 dequantisation: bit-exact against bitsandbytes' own dequantize_4bit.

nf4/weight.py (NF4Weight, read from bitsandbytes' quantisation state) is tested here and
in test_gemv.py, which also tests nf4/scales.py (nested and plain block scales) and
nf4/gemv_mma.py (its tensor-core candidates, in fp16 and bf16)."""

import copy
import dataclasses

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch
from bitsandbytes.functional import QuantState

import slothkit_kernels.nf4.dequantize as nf4_module
from slothkit_kernels.nf4 import dequantize_nf4, dequantize_nf4_reference
from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.utils import warn_reference_once

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def quantize(shape, dtype, nested, blocksize, device, seed=0):
    """Random weights quantised by bitsandbytes on the CPU, then moved to ``device``."""
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    packed, state = F.quantize_4bit(
        w,
        blocksize=blocksize,
        compress_statistics=nested,
        quant_type="nf4",
        quant_storage=torch.uint8,
    )
    state.to(device)
    return w.to(device), packed.to(device), state


def bnb_dequantize(packed, state):
    """bitsandbytes' own ``dequantize_4bit``, shaped like the weight.

    bitsandbytes 0.50's AVX-512 CPU kernel starts a new block at every row, which
    is wrong when a row is not a whole number of blocks (its CUDA kernel, its
    pure-torch fallback and its quantiser all run blocks over the flat weight);
    it is right on the flat shape, so on the CPU it gets that.
    """
    shape = state.shape
    if packed.device.type == "cpu" and shape[-1] % state.blocksize != 0:
        state = copy.copy(state)
        state.shape = torch.Size([shape.numel()])
    # reshape: bitsandbytes returns (1, n) for 1-D shapes and transposes (1, 2).
    return F.dequantize_4bit(packed, state, quant_type="nf4").reshape(shape)


def assert_bit_equal(actual, expected, msg=""):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, msg
    assert not torch.isnan(actual).any(), f"{msg}: NaN in output"
    if not torch.equal(actual, expected):
        diff = (actual.float() - expected.float()).abs()
        raise AssertionError(
            f"{msg}: {int((diff != 0).sum())} of {diff.numel()} elements differ (max {diff.max().item():.3g})"
        )


# (96, 80): rows are not whole blocks; (1, 64): one row, one block; (7, 33): odd
# element count, last block short; (3, 5, 96): 3-D weight.
SHAPES = [(96, 80), (1, 64), (7, 33), (3, 5, 96)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat_absmax"])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_matches_bitsandbytes(shape, dtype, nested, blocksize, device):
    w, packed, state = quantize(shape, dtype, nested, blocksize, device)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    expected = bnb_dequantize(packed, state)
    assert_bit_equal(dequantize_nf4(weight), expected, "kernel")
    assert_bit_equal(dequantize_nf4_reference(weight), expected, "reference")
    # Sanity: NF4 round-trips the weight to within the block's absmax.
    assert (expected.float() - w.float()).abs().max() <= w.float().abs().max()


@pytest.mark.parametrize("blocksize", [32, 256, 4096])
def test_other_blocksizes(blocksize, device):
    _, packed, state = quantize((9, 1000), torch.bfloat16, True, blocksize, device, seed=9)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    assert_bit_equal(dequantize_nf4(weight), bnb_dequantize(packed, state), "kernel")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_buffer_is_filled_and_returned(dtype, device):
    _, packed, state = quantize((5, 13), dtype, True, 64, device, seed=1)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    # A view into a poisoned buffer: every element must be written, nothing around it.
    buffer = torch.full((2 + 65 + 3,), float("nan"), dtype=dtype, device=device)
    out = buffer[2:67].view(5, 13)
    result = dequantize_nf4(weight, out=out)
    assert result is out
    assert_bit_equal(out, bnb_dequantize(packed, state), "out")
    assert torch.isnan(buffer[:2]).all() and torch.isnan(buffer[67:]).all()


def test_single_rounding_to_output_dtype(device):
    """fp16/bf16 results are the fp32 result rounded once, not products in the narrow dtype."""
    _, packed, state = quantize((16, 64), torch.float32, True, 64, device, seed=2)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    wide = dequantize_nf4(weight)
    for dtype in (torch.float16, torch.bfloat16):
        narrow = dequantize_nf4(dataclasses.replace(weight, dtype=dtype))
        assert_bit_equal(narrow, wide.to(dtype), str(dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rounding_edge_cases(dtype, device):
    """Ties, near-overflow and subnormal products round exactly as torch does."""
    tie_bf16 = 1 + 2**-8  # halfway between two bf16 values: rounds to even (down)
    tie_bf16_up = 1 + 3 * 2**-8  # halfway: rounds to even (up)
    tie_fp16 = 1 + 2**-11
    scales = [tie_bf16, tie_bf16_up, tie_fp16, 1 + 3 * 2**-11, 3.0e38, 6.55e4, 1e-40, 3e-8]
    absmax = torch.tensor(scales, dtype=torch.float32)
    blocksize = 64
    numel = blocksize * len(scales)
    generator = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, ((numel + 1) // 2,), generator=generator, dtype=torch.uint8)
    packed[::5] = 0xFF  # level 1.0 in both nibbles: the scale itself must round right
    code = F.get_4bit_type("nf4", device="cpu")
    state = QuantState(
        absmax=absmax,
        shape=torch.Size([len(scales), blocksize]),
        code=code,
        blocksize=blocksize,
        quant_type="nf4",
        dtype=dtype,
    )
    weight = NF4Weight.from_bitsandbytes(packed, state)
    weight = dataclasses.replace(
        weight, packed=packed.to(device), absmax=absmax.to(device), code=code.to(device)
    )
    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(len(scales), blocksize)
    expected = (code[codes.long()] * absmax[:, None]).to(dtype)
    assert_bit_equal(dequantize_nf4_reference(weight).cpu(), expected, "reference")
    assert_bit_equal(dequantize_nf4(weight).cpu(), expected, "kernel")


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat_absmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear4bit(nested, dtype, device):
    torch.manual_seed(4)
    layer = bnb.nn.Linear4bit(
        160, 48, bias=False, compute_dtype=dtype, compress_statistics=nested, quant_type="nf4"
    )
    layer = layer.to(dtype).to(device)  # quantises on the move to the device
    param = layer.weight
    assert param.bnb_quantized
    weight = NF4Weight.from_bitsandbytes(param.data, param.quant_state)
    assert weight.shape == (48, 160) and weight.dtype == dtype and weight.is_nested == nested
    expected = bnb_dequantize(param.data, param.quant_state)
    assert_bit_equal(dequantize_nf4(weight), expected, "kernel")
    assert_bit_equal(dequantize_nf4_reference(weight), expected, "reference")


def test_repeated_calls_reuse_the_checked_arguments(device, monkeypatch):
    # A record is checked and its arguments flattened once; later calls give the same bits
    # without running the checks again.
    torch.manual_seed(5)
    layer = bnb.nn.Linear4bit(256, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    param = layer.to(torch.bfloat16).to(device).weight
    weight = NF4Weight.from_bitsandbytes(param.data, param.quant_state)
    expected = bnb_dequantize(param.data, param.quant_state)
    assert_bit_equal(dequantize_nf4(weight), expected, "first call")
    if weight.launch_cache is None:
        pytest.skip("the torch reference ran (no Triton here): nothing is cached")
    checks = []
    monkeypatch.setattr(nf4_module, "_check_weight", lambda w: checks.append(w))
    assert_bit_equal(dequantize_nf4(weight), expected, "second call")
    assert checks == []
    fresh = NF4Weight.from_bitsandbytes(param.data, param.quant_state)
    dequantize_nf4(fresh)
    assert checks == [fresh], "a new record is checked"


def test_params4bit_blocksize_128_bf16_storage(device):
    """A Params4bit with another quant_storage (FSDP-QLoRA stores bf16) holds the same bytes."""
    torch.manual_seed(5)
    data = torch.randn(64, 96, dtype=torch.bfloat16)
    param = bnb.nn.Params4bit(
        data,
        requires_grad=False,
        blocksize=128,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.bfloat16,
    ).to(device)
    assert param.data.dtype == torch.bfloat16
    weight = NF4Weight.from_bitsandbytes(param.data, param.quant_state)
    assert weight.packed.dtype == torch.uint8 and weight.blocksize == 128
    expected = bnb_dequantize(param.data.view(torch.uint8), param.quant_state)
    assert_bit_equal(dequantize_nf4(weight), expected, "kernel")


def test_reference_fallback_without_triton(monkeypatch):
    """Without a Triton backend the public function warns once and runs the reference."""
    _, packed, state = quantize((4, 64), torch.bfloat16, True, 64, "cpu", seed=6)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    monkeypatch.setattr(nf4_module, "use_triton", lambda *tensors: False)
    warn_reference_once.cache_clear()
    out = torch.full((4, 64), float("nan"), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="dequantize_nf4"):
        result = dequantize_nf4(weight, out=out)
    assert result is out
    assert_bit_equal(out, bnb_dequantize(packed, state), "fallback")


def test_from_bitsandbytes_refuses_other_formats():
    w = torch.randn(8, 64)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="fp4")
    with pytest.raises(ValueError, match="NF4"):
        NF4Weight.from_bitsandbytes(packed, state)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    state.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="packing_format_for_cpu"):
        NF4Weight.from_bitsandbytes(packed, state)


def _valid_weight(nested=True):
    _, packed, state = quantize((8, 64), torch.float16, nested, 64, "cpu", seed=7)
    return NF4Weight.from_bitsandbytes(packed, state)


BAD_WEIGHTS = [
    (
        "packed_dtype",
        lambda w: dataclasses.replace(w, packed=w.packed.to(torch.int32)),
        TypeError,
        "uint8",
    ),
    (
        "shape_numel",
        lambda w: dataclasses.replace(w, shape=torch.Size([8, 66])),
        ValueError,
        "bytes",
    ),
    ("blocksize", lambda w: dataclasses.replace(w, blocksize=96), ValueError, "blocksize"),
    ("absmax_count", lambda w: dataclasses.replace(w, blocksize=32), ValueError, "absmax"),
    ("dtype", lambda w: dataclasses.replace(w, dtype=torch.int8), TypeError, "dtype"),
    (
        "empty",
        lambda w: dataclasses.replace(w, shape=torch.Size([0, 64]), packed=w.packed[:0]),
        ValueError,
        "empty",
    ),
    ("code_size", lambda w: dataclasses.replace(w, code=w.code[:8]), ValueError, "16"),
    (
        "nested_float_absmax",
        lambda w: dataclasses.replace(w, absmax=w.absmax.float()),
        TypeError,
        "uint8",
    ),
    ("nested_no_offset", lambda w: dataclasses.replace(w, offset=None), ValueError, "offset"),
    (
        "nested_code_size",
        lambda w: dataclasses.replace(w, nested_code=w.nested_code[:16]),
        ValueError,
        "256",
    ),
    (
        "nested_absmax_count",
        lambda w: dataclasses.replace(w, nested_absmax=torch.ones(3)),
        ValueError,
        "nested_absmax",
    ),
    ("not_a_weight", lambda w: w.packed, TypeError, "NF4Weight"),
]


@pytest.mark.parametrize(
    "make_bad, error, match", [b[1:] for b in BAD_WEIGHTS], ids=[b[0] for b in BAD_WEIGHTS]
)
def test_bad_weight(make_bad, error, match):
    bad = make_bad(_valid_weight())
    with pytest.raises(error, match=match):
        dequantize_nf4(bad)
    with pytest.raises(error, match=match):
        dequantize_nf4_reference(bad)


def test_flat_absmax_must_be_float():
    weight = _valid_weight(nested=False)
    bad = dataclasses.replace(weight, absmax=weight.absmax.to(torch.uint8))
    with pytest.raises(TypeError, match="float"):
        dequantize_nf4(bad)


BAD_OUTS = [
    ("shape", lambda: torch.empty(64, 8, dtype=torch.float16), "shape"),
    ("dtype", lambda: torch.empty(8, 64, dtype=torch.bfloat16), "dtype"),
    ("non_contiguous", lambda: torch.empty(64, 8, dtype=torch.float16).t(), "contiguous"),
    ("odd_offset", lambda: torch.empty(8 * 64 + 1, dtype=torch.float16)[1:].view(8, 64), "offset"),
]


@pytest.mark.parametrize("make_out, match", [b[1:] for b in BAD_OUTS], ids=[b[0] for b in BAD_OUTS])
def test_bad_out(make_out, match):
    with pytest.raises(ValueError, match=match):
        dequantize_nf4(_valid_weight(), out=make_out())


# (12, 1024) with blocks of 64: nested scales in groups of 256 blocks span 16 rows, so
# slabs start inside a nested group; (40, 384) with 128: three blocks per row.
@pytest.mark.parametrize("shape, blocksize", [((12, 1024), 64), ((40, 384), 128)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat_absmax"])
def test_column_slabs_are_the_columns_of_the_whole(shape, blocksize, dtype, nested, device):
    _, packed, state = quantize(shape, dtype, nested, blocksize, device, seed=5)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    whole = bnb_dequantize(packed, state)
    cols = shape[1]
    for start, stop in [
        (0, blocksize),
        (blocksize, cols),
        (cols - blocksize, cols),
        (blocksize, 3 * blocksize),
    ]:
        slab = dequantize_nf4(weight, columns=(start, stop))
        assert slab.is_contiguous()
        assert_bit_equal(slab, whole[:, start:stop].contiguous(), f"columns {start}:{stop}")
    out = torch.full((shape[0], blocksize), float("nan"), dtype=dtype, device=device)
    assert dequantize_nf4(weight, out=out, columns=(0, blocksize)) is out
    assert_bit_equal(out, whole[:, :blocksize].contiguous(), "out")
    pieces = weight.column_slabs(max_bytes=whole.numel() * whole.element_size() // 3)
    assert len(pieces) == 3 and pieces[0][0] == 0 and pieces[-1][1] == cols
    assert all(a[1] == b[0] and a[0] % blocksize == 0 for a, b in zip(pieces, pieces[1:]))
    assert_bit_equal(
        torch.cat([dequantize_nf4(weight, columns=c) for c in pieces], dim=1), whole, "slabs side by side"
    )


def test_column_slabs_refuse_what_is_not_whole_blocks():
    _, packed, state = quantize((6, 96), torch.float16, True, 64, "cpu")
    weight = NF4Weight.from_bitsandbytes(packed, state)  # rows of 1.5 blocks
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize_nf4(weight, columns=(0, 64))
    assert weight.column_slabs(max_bytes=64) is None  # dequantised whole
    _, packed, state = quantize((6, 256), torch.float16, True, 64, "cpu")
    weight = NF4Weight.from_bitsandbytes(packed, state)
    for columns in [(0, 32), (32, 128), (0, 320), (128, 128)]:
        with pytest.raises(ValueError, match="multiples of the block size"):
            dequantize_nf4(weight, columns=columns)
    with pytest.raises(ValueError, match="shape"):
        dequantize_nf4(weight, out=torch.empty(6, 256, dtype=torch.float16), columns=(0, 64))
    assert weight.column_slabs(max_bytes=6 * 256 * 2) is None  # small enough
    assert weight.column_slabs(max_bytes=1) == [(0, 64), (64, 128), (128, 192), (192, 256)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat_absmax"])
def test_llama3_8b_mlp_shape_cuda(dtype, nested):
    """14336 x 4096 (Llama-3-8B gate/up projection): exact vs bitsandbytes CUDA; speed."""
    torch.manual_seed(8)
    w = torch.randn(14336, 4096, device="cuda", dtype=dtype) * 0.02
    packed, state = F.quantize_4bit(
        w, blocksize=64, compress_statistics=nested, quant_type="nf4", quant_storage=torch.uint8
    )
    weight = NF4Weight.from_bitsandbytes(packed, state)
    expected = F.dequantize_4bit(packed, state, quant_type="nf4")
    out = torch.full_like(expected, float("nan"))
    assert_bit_equal(dequantize_nf4(weight, out=out), expected, "kernel")
    assert_bit_equal(dequantize_nf4_reference(weight), expected, "reference")

    def seconds_per_call(fn, iters=50):
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    ours = seconds_per_call(lambda: dequantize_nf4(weight, out=out))
    theirs = seconds_per_call(lambda: F.dequantize_4bit(packed, state, quant_type="nf4"))
    scale_bytes = state.absmax.numel() * state.absmax.element_size()
    if nested:
        scale_bytes += state.state2.absmax.numel() * 4
    moved = packed.numel() + scale_bytes + out.numel() * out.element_size()
    print(
        f"\nNF4 dequant 14336x4096 {dtype} nested={nested}: {moved / 1e6:.1f} MB moved; "
        f"slothkit {ours * 1e6:.1f} us ({moved / ours / 1e9:.0f} GB/s), "
        f"bitsandbytes {theirs * 1e6:.1f} us ({moved / theirs / 1e9:.0f} GB/s)"
    )


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat_absmax"])
@pytest.mark.parametrize(
    ("shape", "start", "stop"),
    [
        ((96, 64), 0, 32),  # q of a fused qkv: the first rows
        ((96, 64), 64, 96),  # the last rows
        ((640, 192), 256, 640),  # starts on a group of 256 absmax codes (block 768)
        ((640, 192), 100, 640),  # starts inside a group (block 300): nested gets fp32 scales
        ((12, 48), 4, 9),  # rows of 48: starts on a block (4 * 48 = 192), ends inside one
    ],
)
def test_rows_dequantise_to_the_rows_of_the_weight(shape, start, stop, nested, device):
    """A fused projection's row slice (Phi-3's q, k, v, gate, up): a record over views of
    the packed bytes and scales dequantises bit-exactly to those rows of bitsandbytes'
    own dequantisation."""
    _, packed, state = quantize(shape, torch.bfloat16, nested, 64, device, seed=4)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    part = weight.rows(start, stop)
    assert part.shape == (stop - start, shape[1])
    assert part.packed.data_ptr() == weight.packed.data_ptr() + start * shape[1] // 2  # a view
    within_group = nested and (start * shape[1] // 64) % state.state2.blocksize == 0
    assert part.is_nested == within_group
    assert_bit_equal(dequantize_nf4(part), bnb_dequantize(packed, state)[start:stop], f"rows {start}:{stop}")


def test_rows_starting_inside_a_block_are_refused(device):
    _, packed, state = quantize((12, 48), torch.bfloat16, True, 64, device, seed=5)
    weight = NF4Weight.from_bitsandbytes(packed, state)
    assert weight.rows(1, 5) is None  # 48 elements in: inside the first block
    with pytest.raises(ValueError, match=r"rows \[8, 13\) are not within the weight's 12 rows"):
        weight.rows(8, 13)
