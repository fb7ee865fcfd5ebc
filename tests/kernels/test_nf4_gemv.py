"""nf4_matmul: x @ W^T straight from an NF4 weight, against the rounded weight in float64.

Kernel and reference both sum in fp32 and round once, in different orders, so neither is
compared bit for bit with the other: each is held to the error bound of an fp32 dot
product (gamma_n = n u / (1 - n u) times sum |x_k w_k|, for any order of additions)
followed by one rounding to the output dtype, around the exact float64 value of
x @ W^T computed from the weight as dequantize_nf4 rounds it.
"""

import dataclasses

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

import slothkit_kernels.nf4_gemv as gemv_module
from slothkit_kernels import NF4Weight, nf4_matmul, nf4_matmul_reference
from slothkit_kernels.nf4 import dequantize_nf4_reference
from slothkit_kernels.utils import warn_reference_once

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def quantize(shape, dtype, nested, blocksize=64, device="cpu", seed=0):
    """An NF4Weight of random weights quantised by bitsandbytes on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    packed, state = F.quantize_4bit(
        w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4", quant_storage=torch.uint8
    )
    state.to(device)
    return NF4Weight.from_bitsandbytes(packed.to(device), state)


def random_input(shape, dtype, device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def assert_within_fp32_dot_bound(y, x, weight, bias=None, msg=""):
    """|y - exact| <= gamma_n sum|x w| + u_out (|exact| + gamma_n sum|x w|) + tiny, where
    n counts the roundings along any path of the fp32 sum (K products and additions, the
    bias, up to 32 partial sums added after a split of K)."""
    k = weight.shape[1]
    w = dequantize_nf4_reference(weight).double().cpu()  # (N, K), rounded as dequantize_nf4 does
    x64 = x.double().cpu().reshape(-1, k)
    exact = x64 @ w.t()
    magnitude = x64.abs() @ w.abs().t()
    if bias is not None:
        exact = exact + bias.double().cpu()
        magnitude = magnitude + bias.double().cpu().abs()
    n = k + 1 + 32
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    accumulated = gamma * magnitude
    u = UNIT_ROUNDOFF[y.dtype]
    bound = accumulated + u * (exact.abs() + accumulated) + torch.finfo(y.dtype).tiny
    assert y.shape == (*x.shape[:-1], weight.shape[0]), msg
    error = (y.double().cpu().reshape(exact.shape) - exact).abs()
    assert torch.isfinite(error).all(), f"{msg}: NaN or inf in the output"
    worst = (error / bound).max().item()
    assert worst <= 1, f"{msg}: error {worst:.3g} times the bound (max abs error {error.max().item():.3g})"


# (40, 512): 40 rows are not a whole number of any tile's rows; 512 columns, 8 blocks.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat_absmax"])
def test_matches_the_rounded_weight(dtype, m, nested, device):
    weight = quantize((40, 512), dtype, nested, device=device)
    x = random_input((m, 512), dtype, device)
    y = nf4_matmul(x, weight)
    assert y.dtype == dtype and y.device == x.device
    assert_within_fp32_dot_bound(y, x, weight, msg="kernel")
    assert_within_fp32_dot_bound(nf4_matmul_reference(x, weight), x, weight, msg="reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split_k", [1, 3])
def test_bias_and_split_k(dtype, m, split_k, device):
    # 1536 columns: three slices of 512 with split_k=3, each program summing one slice.
    weight = quantize((24, 1536), dtype, True, device=device, seed=2)
    x = random_input((m, 1536), dtype, device)
    bias = random_input((24,), dtype, device, seed=3)
    y = nf4_matmul(x, weight, bias=bias, split_k=split_k)
    assert_within_fp32_dot_bound(y, x, weight, bias, msg=f"split_k={split_k}")
    assert_within_fp32_dot_bound(nf4_matmul_reference(x, weight, bias), x, weight, bias, msg="reference")


@pytest.mark.parametrize("config", gemv_module.CONFIGS, ids=str)
def test_every_launch_setting(config, device):
    # What the tuner may pick: row programs (one row of x each) and dot programs, each
    # with K whole and cut in two (1024 columns: two slices of 512).
    weight = quantize((36, 1024), torch.bfloat16, True, device=device, seed=4)
    x = random_input((2, 1024), torch.bfloat16, device)
    bias = random_input((36,), torch.bfloat16, device, seed=5)
    for split_k in (1, 2):
        out = torch.full((2, 36), float("nan"), dtype=torch.bfloat16, device=device)
        gemv_module._launch(x, weight, bias, out, config, split_k)
        assert_within_fp32_dot_bound(out, x, weight, bias, msg=f"{config} split_k={split_k}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_weight_is_rounded_as_dequantize_nf4(dtype, m, device):
    """With x = e_i + e_j the fp32 sum is exact, so y = dtype(fp32(w_i + w_j)) bit for bit.

    A kernel that skipped rounding the dequantised weight to its dtype before the
    multiply (or rounded it differently) would give other values for 16-bit weights."""
    weight = quantize((48, 256), dtype, True, device=device, seed=6)
    w = dequantize_nf4_reference(weight).cpu()
    generator = torch.Generator().manual_seed(7)
    pairs = torch.randint(0, 256, (m, 2), generator=generator)
    pairs[:, 1] = (pairs[:, 0] + 1 + pairs[:, 1] % 255) % 256  # two different columns
    x = torch.zeros(m, 256, dtype=dtype)
    x[torch.arange(m), pairs[:, 0]] = 1
    x[torch.arange(m), pairs[:, 1]] = 1
    expected = (w[:, pairs[:, 0]].float() + w[:, pairs[:, 1]].float()).t().to(dtype)  # (m, 48)
    y = nf4_matmul(x.to(device), weight).cpu()
    assert torch.equal(y, expected), f"{int((y != expected).sum())} of {y.numel()} outputs differ"


@pytest.mark.parametrize("blocksize", [32, 256, 1024])
def test_other_blocksizes(blocksize, device):
    # 1024: a block is longer than some settings' step (BLOCK_K), so a scale spans steps.
    weight = quantize((20, 2048), torch.float16, True, blocksize=blocksize, device=device, seed=8)
    for m in (1, 2):
        x = random_input((m, 2048), torch.float16, device)
        assert_within_fp32_dot_bound(nf4_matmul(x, weight), x, weight, msg=f"blocksize {blocksize}, M={m}")


def test_hand_built_nested_record(device):
    """Random codes and a random 256-entry nested table, nested blocks of 4 codes spanning
    rows (12 blocks of 128 per row of 1536), and an offset: every field is read as
    the NF4Weight docstring lays it out."""
    generator = torch.Generator().manual_seed(9)
    rows, cols, blocksize = 10, 1536, 128
    n_blocks = rows * cols // blocksize
    weight = NF4Weight(
        packed=torch.randint(0, 256, (rows * cols // 2,), generator=generator, dtype=torch.uint8),
        absmax=torch.randint(0, 256, (n_blocks,), generator=generator, dtype=torch.uint8),
        code=F.get_4bit_type("nf4", device="cpu"),
        blocksize=blocksize,
        shape=torch.Size([rows, cols]),
        dtype=torch.float32,
        nested_absmax=torch.rand(-(-n_blocks // 4), generator=generator) + 0.5,
        nested_code=torch.randn(256, generator=generator).sort().values,
        nested_blocksize=4,
        offset=torch.tensor(0.25),
    )
    weight = dataclasses.replace(
        weight,
        **{
            f: getattr(weight, f).to(device)
            for f in ("packed", "absmax", "code", "nested_absmax", "nested_code")
        },
    )
    x = random_input((3, cols), torch.float32, device)
    bias = random_input((rows,), torch.float32, device, seed=10)
    for split_k in (1, 3):
        y = nf4_matmul(x, weight, bias=bias, split_k=split_k)
        assert_within_fp32_dot_bound(y, x, weight, bias, msg=f"split_k={split_k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear4bit_layer(dtype, device):
    """A bitsandbytes Linear4bit (quantised by bitsandbytes on the move to the device) gives
    the layer's output, with its dequantised weight, within the bound."""
    torch.manual_seed(11)
    layer = bnb.nn.Linear4bit(256, 56, bias=True, compute_dtype=dtype, quant_type="nf4")
    layer = layer.to(dtype).to(device)
    weight = NF4Weight.from_bitsandbytes(layer.weight.data, layer.weight.quant_state)
    x = random_input((2, 5, 256), dtype, device)
    bias = layer.bias.detach()
    y = nf4_matmul(x, weight, bias=bias)
    assert y.shape == (2, 5, 56)
    assert_within_fp32_dot_bound(y, x, weight, bias, msg="Linear4bit")


def test_leading_dimensions_and_strided_input(device):
    weight = quantize((40, 256), torch.bfloat16, True, device=device, seed=12)
    x = random_input((2, 3, 256), torch.bfloat16, device)
    y = nf4_matmul(x, weight)
    assert y.shape == (2, 3, 40)
    assert_within_fp32_dot_bound(y, x, weight, msg="(2, 3, K)")
    # Rows 512 elements apart (a slice of a wider tensor), and columns not contiguous.
    wide = random_input((4, 512), torch.bfloat16, device, seed=13)
    for view in (wide[:, :256], wide.t().contiguous().t()[:, 256:]):
        assert_within_fp32_dot_bound(nf4_matmul(view, weight), view, weight, msg=f"strides {view.stride()}")


def test_many_rows_and_none(device):
    # 20 rows: two tiles of dot programs (16 rows each); 0 rows: an empty result.
    weight = quantize((24, 256), torch.float16, False, device=device, seed=14)
    x = random_input((20, 256), torch.float16, device)
    assert_within_fp32_dot_bound(nf4_matmul(x, weight), x, weight, msg="M=20")
    empty = nf4_matmul(x[:0], weight)
    assert empty.shape == (0, 24) and empty.dtype == torch.float16


@pytest.mark.parametrize("split_k", [1, 2])
def test_out_buffer_is_filled_and_returned(split_k, device):
    weight = quantize((24, 1024), torch.bfloat16, True, device=device, seed=15)
    x = random_input((3, 1024), torch.bfloat16, device)
    buffer = torch.full((5 + 72 + 5,), float("nan"), dtype=torch.bfloat16, device=device)
    out = buffer[5:77].view(3, 24)
    assert nf4_matmul(x, weight, out=out, split_k=split_k) is out
    assert_within_fp32_dot_bound(out, x, weight, msg="out")
    assert torch.isnan(buffer[:5]).all() and torch.isnan(buffer[77:]).all()


def test_k_slices_on_llama3_8b_shapes():
    """On 132 SMs K is cut so the grid has at least two programs per SM at 64 rows each."""
    expected = {(4096, 4096): 4, (1024, 4096): 8, (14336, 4096): 2, (4096, 14336): 5}
    for (n, k), slices in expected.items():
        per_slice, got = gemv_module._k_slices(k, n, 1, 132, None)
        assert got == slices, (n, k)
        assert per_slice % gemv_module.SPLIT_GRANULE == 0 and (got - 1) * per_slice < k <= got * per_slice
    assert gemv_module._k_slices(4096, 4096, 1, 132, 1) == (4096, 1)
    assert gemv_module._k_slices(1024, 64, 1, 132, 100) == (512, 2)  # at most one per granule


def test_reference_fallback_without_triton(monkeypatch):
    weight = quantize((8, 128), torch.bfloat16, True, seed=16)
    x = random_input((2, 128), torch.bfloat16, "cpu")
    monkeypatch.setattr(gemv_module, "use_triton", lambda *tensors: False)
    warn_reference_once.cache_clear()
    out = torch.full((2, 8), float("nan"), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="nf4_matmul"):
        assert nf4_matmul(x, weight, out=out) is out
    assert torch.equal(out, nf4_matmul_reference(x, weight))


def _bad_call(**changes):
    weight = quantize((8, 128), torch.float16, True, seed=17)
    arguments = {"x": torch.zeros(2, 128, dtype=torch.float16), "weight": weight, "bias": None, "out": None}
    arguments.update({k: (v(weight) if callable(v) else v) for k, v in changes.items()})
    return arguments


BAD_CALLS = [
    ("x_dtype", {"x": torch.zeros(2, 128, dtype=torch.bfloat16)}, TypeError, "dtype"),
    ("x_not_tensor", {"x": [[0.0] * 128]}, TypeError, "x must be a torch.Tensor"),
    ("x_features", {"x": torch.zeros(2, 64, dtype=torch.float16)}, ValueError, r"\(\.\.\., 128\)"),
    (
        "rows_not_whole_blocks",
        {"weight": lambda w: quantize((4, 96), torch.float16, True, seed=18)},
        ValueError,
        "multiple of the block size",
    ),
    (
        "weight_not_2d",
        {"weight": lambda w: dataclasses.replace(w, shape=torch.Size([8, 2, 64]))},
        ValueError,
        "2-D",
    ),
    ("weight_not_nf4", {"weight": lambda w: torch.zeros(8, 128)}, TypeError, "NF4Weight"),
    ("weight_bad_code", {"weight": lambda w: dataclasses.replace(w, code=w.code[:8])}, ValueError, "16"),
    ("bias_shape", {"bias": torch.zeros(9, dtype=torch.float16)}, ValueError, r"bias must be a \(8,\)"),
    ("bias_dtype", {"bias": torch.zeros(8, dtype=torch.float32)}, ValueError, "dtype torch.float16"),
    ("out_shape", {"out": torch.zeros(2, 9, dtype=torch.float16)}, ValueError, "expected shape"),
    ("out_dtype", {"out": torch.zeros(2, 8, dtype=torch.float32)}, ValueError, "dtype"),
    ("out_strided", {"out": torch.zeros(8, 2, dtype=torch.float16).t()}, ValueError, "contiguous"),
]


@pytest.mark.parametrize("changes, error, match", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments(changes, error, match):
    arguments = _bad_call(**changes)
    with pytest.raises(error, match=match):
        nf4_matmul(**arguments)
    if arguments["out"] is None:
        with pytest.raises(error, match=match):
            nf4_matmul_reference(arguments["x"], arguments["weight"], arguments["bias"])


def test_bad_split_k():
    arguments = _bad_call()
    for split_k in (0, -1, 1.5):
        with pytest.raises(ValueError, match="split_k"):
            nf4_matmul(**arguments, split_k=split_k)


LLAMA3_8B_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]  # (N, K)


@pytest.mark.cuda
@pytest.mark.parametrize("n, k", LLAMA3_8B_SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 8])
def test_llama3_8b_shapes_cuda(n, k, m):
    """Llama-3-8B's four projection shapes: within the bound, tuned once, graph-capturable,
    and timed against bitsandbytes' 4-bit matmul and dequantise + cuBLAS."""
    from triton.testing import do_bench

    torch.manual_seed(19)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, state = F.quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4")
    weight = NF4Weight.from_bitsandbytes(packed, state)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = nf4_matmul(x, weight)  # tunes
    assert_within_fp32_dot_bound(y, x, weight, msg=f"{n}x{k} M={m}")
    out = torch.empty_like(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nf4_matmul(x, weight, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y), "a graph replay gives the eager call's bits"

    ours = do_bench(lambda: nf4_matmul(x, weight, out=out))
    theirs = do_bench(lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state))
    dequant = do_bench(lambda: x @ F.dequantize_4bit(packed, state).t())
    record = packed.numel() + state.absmax.numel() + 4 * state.state2.absmax.numel()
    tuned = [c for key, c in gemv_module._TUNED.items() if key[1:4] == (n, k, m)]
    print(
        f"\nnf4_matmul {n}x{k} M={m}: {tuned}; slothkit {ours * 1e3:.1f} us "
        f"({record / ours / 1e6:.0f} GB/s), bitsandbytes {theirs * 1e3:.1f} us "
        f"({record / theirs / 1e6:.0f} GB/s), dequantise + matmul {dequant * 1e3:.1f} us"
    )


@pytest.mark.cuda
def test_capture_before_tuning_uses_the_default_cuda():
    weight = quantize((72, 640), torch.bfloat16, True, device="cuda", seed=20)
    x = random_input((1, 640), torch.bfloat16, "cuda")
    out = torch.empty(1, 72, dtype=torch.bfloat16, device="cuda")
    gemv_module._launch(x, weight, None, out, gemv_module.DEFAULT_ROW_CONFIG)  # compiles outside capture
    torch.cuda.synchronize()
    tuned_before = dict(gemv_module._TUNED)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nf4_matmul(x, weight, out=out)
    assert gemv_module._TUNED == tuned_before, "nothing is tuned while capturing"
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_within_fp32_dot_bound(out, x, weight, msg="captured")
