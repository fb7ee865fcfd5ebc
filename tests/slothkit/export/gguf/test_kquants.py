"""K-quant encoders (slothkit.export.gguf.kquants) and the per-tensor type choice, against the `gguf`
package's decoder and llama.cpp's own quantiser (llama-cpp-python's llama_model_quantize)."""

import importlib.util

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.export.gguf import kquants, write_gguf
from slothkit.export.gguf.tensor_types import (
    quantization_method,
    tensor_type,
    use_more_bits,
)
from slothkit.export.gguf.verify import quantize_with_llama_cpp
from slothkit.testing import build_tiny_model

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
T = gguf.GGMLQuantizationType
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it is the reference quantiser",
)


def awkward_blocks(seed: int) -> torch.Tensor:
    """Super-blocks that stress the encoder: gaussian, heavy-tailed, one outlier, all zero,
    constant, one-signed, tiny and large magnitudes. (rows, 256)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    outlier = randn(256)
    outlier[17] = 40.0
    rows = [
        randn(256),
        randn(256) * torch.exp(1.5 * randn(256)),  # log-normal scale mixture: heavy tails
        outlier,
        torch.zeros(256),
        torch.full((256,), 0.3),
        rand(256),
        -rand(256),
        randn(256) * 1e-4,
        randn(256) * 1e3,
        torch.cat([torch.zeros(128), randn(128)]),  # half the sub-blocks empty
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("name", K_TYPES)
def test_gguf_decodes_our_blocks_as_we_do(name):
    x = torch.cat(
        [awkward_blocks(1), torch.randn(6, 256, generator=torch.Generator().manual_seed(2))]
    ).reshape(4, -1)
    blocks = kquants.QUANTIZERS[name](x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, x.shape[1] // 256 * kquants.BLOCK_BYTES[name])
    ours = kquants.DEQUANTIZERS[name](blocks)
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), getattr(T, name)))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name,bound", [("Q4_K", 0.075), ("Q5_K", 0.037), ("Q6_K", 0.019)])
def test_reconstruction_error_on_gaussian_rows(name, bound):
    # Relative rms error of Gaussian data; llama.cpp's encoder gives 0.068 / 0.034 / 0.017.
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))
    back = kquants.DEQUANTIZERS[name](kquants.QUANTIZERS[name](x))
    error = ((back - x).square().mean() / x.square().mean()).sqrt().item()
    assert bound * 0.85 < error < bound


@pytest.mark.parametrize("name", K_TYPES)
def test_degenerate_blocks_decode_sensibly(name):
    x = awkward_blocks(4)
    back = kquants.DEQUANTIZERS[name](kquants.QUANTIZERS[name](x))
    assert torch.isfinite(back).all()
    assert torch.equal(back[3], torch.zeros(256))  # all-zero block
    assert torch.equal(back[9, :128], torch.zeros(128))  # empty sub-blocks stay empty
    assert (back[4] - 0.3).abs().max() < 0.3 * 0.02  # constant block
    worst = ((back - x).abs() / x.abs().amax(-1, keepdim=True)).amax(-1)  # per block, in units of its range
    assert worst[[0, 1, 2, 5, 6, 8]].max() < 0.07
    # Magnitudes near 1e-4: Q6_K's fp16 super-block scale (range / 4096) is subnormal there and
    # loses bits, in ggml as here; the 4/5-bit types divide by 63 only.
    assert worst[7] < (0.2 if name == "Q6_K" else 0.07)


def test_rows_must_tile_into_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize_q4_k(torch.randn(4, 300))
    with pytest.raises(ValueError, match="multiple of 176"):
        kquants.dequantize_q5_k(torch.zeros(4, 100, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------
# Against llama.cpp: the same tensors through llama_model_quantize
# ---------------------------------------------------------------------------------------

K_AND_Q4_0 = ("q4_k_m", "q5_k_m", "q6_k", "q4_0")  # the types whose mix llama.cpp decides per tensor


def _model_and_f32_gguf(tmp_path, arch, **sizes):
    path = build_tiny_model(arch, tmp_path / arch, seed=11, **sizes)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():  # non-Gaussian weights too: heavy tails and outliers
        up = model.model.layers[0].mlp.up_proj.weight
        up.copy_(up * torch.exp(1.5 * torch.randn(up.shape, generator=g)))
        gate = model.model.layers[0].mlp.gate_proj.weight
        gate.view(-1)[torch.randint(0, gate.numel(), (64,), generator=g)] = 30.0
    tokenizer = AutoTokenizer.from_pretrained(path)
    source = write_gguf(model, tmp_path / f"{arch}.F32.gguf", tokenizer, quantization_method("f32"))
    return model, tokenizer, source


def _as_array(tensor) -> np.ndarray:
    return np.array(tensor.data).reshape(tuple(reversed([int(n) for n in tensor.shape])))


@needs_llama_cpp
def test_reconstruction_error_within_5_percent_of_llama_cpp(tmp_path):
    _, _, source = _model_and_f32_gguf(
        tmp_path, "llama", hidden_size=256, intermediate_size=512, num_layers=1
    )
    originals = {t.name: _as_array(t) for t in gguf.GGUFReader(source).tensors}
    for name, method in (("Q4_K", "q4_k_m"), ("Q5_K", "q5_k_m"), ("Q6_K", "q6_k")):
        reference = gguf.GGUFReader(
            quantize_with_llama_cpp(source, tmp_path / f"{name}.gguf", method, pure=True)
        )
        identical = total = 0
        for tensor in reference.tensors:
            if tensor.tensor_type.name != name:
                continue  # the F32 norms
            x = originals[tensor.name]
            theirs_blocks = np.array(tensor.data)
            ours_blocks = kquants.QUANTIZERS[name](torch.from_numpy(x)).numpy()
            theirs = gguf.quants.dequantize(theirs_blocks, tensor.tensor_type)
            ours = gguf.quants.dequantize(ours_blocks, tensor.tensor_type)
            theirs_error = np.sqrt(np.mean((theirs - x) ** 2))
            ours_error = np.sqrt(np.mean((ours - x) ** 2))
            assert ours_error <= 1.05 * theirs_error, (name, tensor.name, ours_error / theirs_error)
            size = kquants.BLOCK_BYTES[name]
            same = (theirs_blocks.reshape(-1, size) == ours_blocks.reshape(-1, size)).all(-1)
            identical, total = identical + int(same.sum()), total + same.size
        # Same algorithm, not merely a similar one: most blocks are byte-identical.
        assert identical / total > 0.6, (name, identical / total)


@needs_llama_cpp
@pytest.mark.parametrize(
    "arch,sizes,methods",
    [
        # untied, 8 layers: the _M mixes give Q6_K to attn_v / ffn_down of layers 0, 3, 6, 7
        ("llama", dict(hidden_size=256, intermediate_size=256, num_layers=8), ("q4_k_m", "q5_k_m")),
        (
            "gemma",
            dict(hidden_size=256, intermediate_size=512),
            K_AND_Q4_0,
        ),  # output tied to token_embd
        (
            "llama",
            dict(hidden_size=288, intermediate_size=576),
            K_AND_Q4_0,
        ),  # rows of 288, 576: fallbacks
    ],
    ids=["llama-8-layers", "gemma-tied", "llama-rows-288"],
)
def test_tensor_types_match_llama_quantize(tmp_path, arch, sizes, methods):
    model, tokenizer, source = _model_and_f32_gguf(tmp_path, arch, **sizes)
    for method in methods:
        theirs = gguf.GGUFReader(quantize_with_llama_cpp(source, tmp_path / f"ref.{method}.gguf", method))
        ours = gguf.GGUFReader(
            write_gguf(model, tmp_path / f"ours.{method}.gguf", tokenizer, quantization_method(method))
        )
        expected = {t.name: t.tensor_type.name for t in theirs.tensors}
        assert {t.name: t.tensor_type.name for t in ours.tensors} == expected, method


def test_use_more_bits_layers_for_32_layers():
    chosen = [i for i in range(32) if use_more_bits(i, 32)]
    assert chosen == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


@pytest.mark.parametrize(
    "method,name,shape,expected",
    [
        ("q4_k_m", "blk.0.attn_q.weight", (288, 288), T.Q5_0),
        ("q5_k_m", "blk.0.attn_q.weight", (288, 288), T.Q5_1),
        ("q6_k", "blk.0.attn_q.weight", (288, 288), T.Q8_0),
        ("q4_k_m", "blk.0.attn_q.weight", (100, 100), T.F16),
        ("q4_k_m", "output.weight", (768, 288), T.Q8_0),
        ("q4_k_m", "output.weight", (768, 256), T.Q6_K),
        ("q4_0", "output.weight", (768, 256), T.Q6_K),
        ("q8_0", "output.weight", (768, 256), T.Q8_0),
        ("q8_0", "blk.3.ffn_up.weight", (512, 100), T.F16),
        ("q4_k_m", "blk.3.ffn_norm.weight", (256,), T.F32),
        ("bf16", "token_embd.weight", (768, 256), T.BF16),
    ],
)
def test_tensor_type_rules(method, name, shape, expected):
    got = tensor_type(
        quantization_method(method), name, shape, layer=3, n_layers=32, output_tied_to_embeddings=False
    )
    assert got == expected


@pytest.mark.cuda
@pytest.mark.parametrize("name", K_TYPES)
def test_gpu_encoder_gives_the_cpu_blocks(name):
    # The GPU may fuse multiply-adds, so a near-tie between grids can go the other way.
    x = torch.cat([awkward_blocks(6), torch.randn(4094, 256, generator=torch.Generator().manual_seed(7))])
    cpu = kquants.QUANTIZERS[name](x)
    gpu = kquants.QUANTIZERS[name](x.cuda()).cpu()
    assert (cpu == gpu).all(-1).float().mean() > 0.95

    def error(blocks):
        return (kquants.DEQUANTIZERS[name](blocks) - x).square().mean().sqrt()

    assert error(gpu) <= 1.01 * error(cpu)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_chunking_does_not_change_the_blocks(name, monkeypatch):
    # Blocks are encoded in chunks sized for the device's cache; every chunk size gives the
    # same bytes (each super-block is encoded on its own).
    weight = torch.randn(24, 512, generator=torch.Generator().manual_seed(9)) * 0.05
    monkeypatch.setitem(kquants._CHUNK_BLOCKS, "cpu", 5)  # 48 blocks: ten chunks, the last short
    small = kquants.QUANTIZERS[name](weight)
    monkeypatch.setitem(kquants._CHUNK_BLOCKS, "cpu", 1 << 15)
    assert torch.equal(small, kquants.QUANTIZERS[name](weight))
