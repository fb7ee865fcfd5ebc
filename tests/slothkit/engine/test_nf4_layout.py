"""keep_nf4_layout and the refusal of repacked weights, with bitsandbytes taking every
CPU for one with AVX512-BF16 (the ``bitsandbytes_repacks_on_cpu`` fixture), so that the
repacking path is met on any machine: eval-mode forwards without gradients give what the
same layer gives in training mode (where bitsandbytes never repacks), the weight
dequantises to the same bits after them as before, and a weight repacked by bitsandbytes'
own function is refused by name."""

import pytest
import torch

from slothkit import FastModel
from slothkit.engine.lora_projection import describe
from slothkit.engine.nf4_layout import REPACK_SWITCH, is_repacked_for_cpu, keep_nf4_layout
from slothkit.testing import tiny_model_path


def _linear4bit(in_features, out_features, compute_dtype, seed):
    import bitsandbytes as bnb

    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(
        in_features, out_features, bias=True, compute_dtype=compute_dtype, quant_type="nf4"
    )
    layer.load_state_dict(
        {"weight": torch.randn(out_features, in_features), "bias": torch.randn(out_features)}
    )
    return layer.to("cpu")  # quantises


def _dequantised(layer):
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


# 48 rows: not a multiple of bitsandbytes' 32-row tiles (its repacking fails); 64: one it repacks.
@pytest.mark.parametrize("out_features", [48, 64])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_eval_forwards_equal_training_forwards(bitsandbytes_repacks_on_cpu, out_features, compute_dtype):
    layer = _linear4bit(64, out_features, compute_dtype, seed=out_features)
    assert getattr(layer, REPACK_SWITCH) is True, "the fixture did not reach the layer"
    weight_before = _dequantised(layer)
    keep_nf4_layout(layer)
    for rows in (1, 5):  # bitsandbytes' GEMV for one row, dequantise and matmul for more
        x = torch.randn(rows, 64, dtype=compute_dtype)
        with torch.no_grad():
            layer.train()
            expected = layer(x)
            layer.eval()
            got = layer(x)
        assert not is_repacked_for_cpu(layer.weight.quant_state)
        assert torch.equal(got, expected)
    assert torch.equal(_dequantised(layer), weight_before)
    assert not isinstance(describe(layer), str), "slothkit could not read the weight"


def test_a_model_loaded_in_4bit_keeps_its_layout(bitsandbytes_repacks_on_cpu):
    model, tokenizer = FastModel.from_pretrained(
        str(tiny_model_path("llama")), max_seq_length=128, dtype=torch.float32, load_in_4bit=True, fused=False
    )
    quantised = [m for m in model.modules() if hasattr(m, REPACK_SWITCH)]
    assert len(quantised) == 7 * model.config.num_hidden_layers
    assert not any(getattr(m, REPACK_SWITCH) for m in quantised)
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 9)).to(model.device)
    with torch.no_grad():
        model.train()
        expected = model(input_ids=ids).logits
        model.eval()
        got = model(input_ids=ids).logits
    assert not any(is_repacked_for_cpu(m.weight.quant_state) for m in quantised)
    assert torch.equal(got, expected)


def test_a_repacked_weight_is_refused_by_name(bitsandbytes_repacks_on_cpu):
    """Repacked by bitsandbytes' own conversion (what its forward calls): the block scales
    are rounded to bf16, so slothkit refuses rather than read other numbers."""
    import bitsandbytes.functional as bnbf

    layer = _linear4bit(64, 64, torch.float32, seed=3)
    assert not isinstance(describe(layer), str)
    layer.weight.data, layer.weight.quant_state = bnbf._convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state
    )
    with pytest.raises(ValueError, match=r"Linear4bit \(64 -> 64\) was repacked.*keep_nf4_layout"):
        describe(layer)
