"""A fused PEFT layer (Phi-3's qkv_proj) read as row slices: views of one weight and one B,
one shared A, through the fused kernels, against the PEFT layer itself."""

import pytest
import torch
from torch import nn

from slothkit.engine.lora_projection import describe_rows
from slothkit_kernels.lora import lora_qkv
from slothkit_kernels.nf4.weight import NF4Weight

SPLITS = (0, 32, 48, 64)  # q: 32 rows, k and v: 16 each


def _lora_layer(in_features: int, out_features: int, seed: int, quantize: bool = False):
    """A PEFT LoRA layer over one linear (NF4 with ``quantize``), B made non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=False)
    if quantize:
        import bitsandbytes as bnb

        quantized = bnb.nn.Linear4bit(in_features, out_features, bias=False, quant_type="nf4",
                                      compute_dtype=torch.float32, compress_statistics=True)  # fmt: skip
        quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
        linear = quantized.to("cpu")
    model = get_peft_model(nn.Sequential(linear), LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.1)
    return layer


def test_row_slices_are_views_with_one_a_and_compute_the_layer():
    layer = _lora_layer(48, SPLITS[-1], seed=0)
    parts = describe_rows(layer, SPLITS)
    weight, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    for part, start in zip(parts, SPLITS):
        assert part.weight.data_ptr() == weight[start].data_ptr()  # views, no copy
        assert part.lora_b.data_ptr() == b[start].data_ptr()
        assert part.lora_a is a  # one A for the three
        assert part.scaling == 2.0

    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(2, 5, SPLITS[-1], generator=torch.Generator().manual_seed(2))
    expected = layer(x)
    expected.backward(grad)
    reference = [t.grad.clone() for t in (x, a, b)]
    for t in (x, a, b):
        t.grad = None

    got = torch.cat(lora_qkv(x, *parts), dim=-1)
    got.backward(grad)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, t, want in zip(("x", "A", "B"), (x, a, b), reference):
        # A's gradient is the sum over the three parts; B's rows land in the one leaf.
        torch.testing.assert_close(t.grad, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("in_features", "aligned"), [(64, True), (21, False)])
def test_nf4_row_slices_start_on_a_block_or_say_why_not(in_features, aligned):
    """k's and v's first rows, 32 and 48, start on blocks of 64 values in a 64-column weight;
    in a 21-column one, row 32 starts 672 values in, inside a block, so the layer keeps its
    own forward (the reason is what the fused path's one warning says)."""
    pytest.importorskip("bitsandbytes")
    layer = _lora_layer(in_features, SPLITS[-1], seed=3, quantize=True)
    parts = describe_rows(layer, SPLITS)
    if not aligned:
        assert parts == (
            "its 4-bit weight's rows from 32 do not start on a quantisation block (of 64 values), "
            "so they cannot be read as a weight of their own"
        )
        return
    assert all(isinstance(part.weight, NF4Weight) for part in parts)
    assert [tuple(part.weight.shape) for part in parts] == [(32, 64), (16, 64), (16, 64)]
    again = describe_rows(layer, SPLITS)
    assert all(p.weight is q.weight for p, q in zip(parts, again))  # kept on the weight's NF4Cache
