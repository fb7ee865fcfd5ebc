"""Where HF weights go in a GGUF file and how they are transformed (slothkit.export.gguf.layout),
checked without writing a file; test_writer.py checks the files llama.cpp reads."""

import re
import types

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slothkit.export.gguf.layout import (
    from_gguf,
    gguf_pieces,
    gguf_tensor_name,
    permute_rotary_rows,
    to_gguf,
    unpermute_rotary_rows,
)
from slothkit.models import EXPERT_RECORDS, RECORDS, architecture_named


@pytest.mark.parametrize(
    "hf_name, expected",
    [
        ("model.embed_tokens.weight", ("token_embd.weight", None)),
        ("model.norm.weight", ("output_norm.weight", None)),
        ("lm_head.weight", ("output.weight", None)),
        ("model.layers.0.input_layernorm.weight", ("blk.0.attn_norm.weight", 0)),
        ("model.layers.11.post_attention_layernorm.weight", ("blk.11.ffn_norm.weight", 11)),
        ("model.layers.3.self_attn.q_proj.weight", ("blk.3.attn_q.weight", 3)),
        ("model.layers.3.self_attn.k_proj.bias", ("blk.3.attn_k.bias", 3)),
        ("model.layers.3.self_attn.o_proj.weight", ("blk.3.attn_output.weight", 3)),
        ("model.layers.3.mlp.down_proj.weight", ("blk.3.ffn_down.weight", 3)),
        ("model.layers.3.self_attn.rotary_emb.inv_freq", None),
        ("model.layers.3.mlp.experts.0.weight", None),
    ],
)
def test_tensor_names(hf_name, expected):
    assert gguf_tensor_name(hf_name, architecture_named("llama")) == expected


@pytest.mark.parametrize(
    "hf_name, expected",
    [
        ("model.layers.2.input_layernorm.weight", "blk.2.attn_norm.weight"),
        ("model.layers.2.self_attn.q_norm.weight", "blk.2.attn_q_norm.weight"),
        ("model.layers.2.self_attn.k_norm.weight", "blk.2.attn_k_norm.weight"),
        ("model.layers.2.post_attention_layernorm.weight", "blk.2.post_attention_norm.weight"),
        ("model.layers.2.pre_feedforward_layernorm.weight", "blk.2.ffn_norm.weight"),
        ("model.layers.2.post_feedforward_layernorm.weight", "blk.2.post_ffw_norm.weight"),
    ],
)
def test_gemma3_norm_names(hf_name, expected):
    """Gemma 3's post_attention_layernorm normalises the attention output, not the FFN input."""
    assert gguf_tensor_name(hf_name, architecture_named("gemma3")) == (expected, 2)


@pytest.mark.parametrize("arch", RECORDS, ids=lambda a: a.name)
def test_every_weight_is_named_as_the_gguf_package_names_it(arch):
    """Each weight of a small model of the family gets the name that gguf-py's tensor map
    (what llama.cpp's converter uses) gives it for the record's GGUF architecture."""
    config = AutoConfig.for_model(
        arch.model_types[0], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, pad_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    tensor_map = gguf.get_tensor_name_map(by_name[arch.gguf.arch], 2)
    names = [name for name, _ in model.named_parameters()]
    biases = sum(name.endswith(".bias") for name in names)  # Qwen2's q/k/v: 3 per layer
    assert biases == (6 if arch.name == "qwen2" else 0)
    projections = 4 if arch.fused_projections else 7  # Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj
    assert (
        len(names)
        == 2 + (0 if arch.tied_embeddings else 1) + 2 * (projections + len(arch.gguf.norms)) + biases
    )
    for hf_name in names:
        stem, _, kind = hf_name.rpartition(".")
        expected = tensor_map.get_name(stem) + "." + kind
        assert gguf_tensor_name(hf_name, arch)[0] == expected, hf_name


@pytest.mark.parametrize("arch", RECORDS, ids=lambda a: a.name)
def test_to_gguf_and_back(arch):
    """Q/K rows permuted exactly where the record says, norms offset by 1 where the norm adds
    one, everything else as it is; from_gguf undoes it."""
    config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    g = torch.Generator().manual_seed(11)
    head_dim, hidden = 8, 16
    weights = {
        "blk.0.attn_q.weight": (torch.randn(4 * head_dim, hidden, generator=g), 4),
        "blk.0.attn_k.weight": (torch.randn(2 * head_dim, hidden, generator=g), 2),
        "blk.0.attn_v.weight": (torch.randn(2 * head_dim, hidden, generator=g), None),
        "blk.0.attn_norm.weight": (torch.randn(hidden, generator=g), None),
        "output_norm.weight": (torch.randn(hidden, generator=g), None),
    }
    for name, (value, heads) in weights.items():
        stored = to_gguf(value, name, arch, config)
        if heads is not None and arch.gguf.permute_qk:
            expected = permute_rotary_rows(value, heads)
            assert not torch.equal(stored, value)
        elif name.endswith("_norm.weight") and arch.norm_adds_one:
            expected = value.float() + 1.0
        else:
            expected = value
        assert torch.equal(stored, expected), name
        # (w + 1) - 1 in float32 rounds w by up to half the float spacing near 1 + w (2**-21 below 8).
        atol = 2**-22 if name.endswith("_norm.weight") and arch.norm_adds_one else 0.0
        torch.testing.assert_close(from_gguf(stored, name, arch, config), value, rtol=0.0, atol=atol)


def test_qk_permutation_turns_half_split_rope_into_interleaved_rope():
    """HF rotates pairs (i, i + d/2) of each head; llama.cpp's llama arch pairs (2i, 2i + 1).
    With Q and K rows permuted, both give the same attention scores at every position pair."""
    g = torch.Generator().manual_seed(5)
    heads, d, hidden = 2, 8, 16
    wq, wk = torch.randn(heads * d, hidden, generator=g), torch.randn(heads * d, hidden, generator=g)
    x = torch.randn(6, hidden, generator=g)  # 6 positions
    angles = torch.arange(6.0)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)  # (pos, d/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rope_half_split(v):  # (pos, heads, d)
        a, b = v[..., : d // 2], v[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def rope_interleaved(v):
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)

    hf_q, hf_k = rope_half_split((x @ wq.T).view(6, heads, d)), rope_half_split((x @ wk.T).view(6, heads, d))
    pq, pk = permute_rotary_rows(wq, heads), permute_rotary_rows(wk, heads)
    cpp_q, cpp_k = (
        rope_interleaved((x @ pq.T).view(6, heads, d)),
        rope_interleaved((x @ pk.T).view(6, heads, d)),
    )
    hf_scores = torch.einsum("phd,shd->hps", hf_q, hf_k)
    assert torch.allclose(torch.einsum("phd,shd->hps", cpp_q, cpp_k), hf_scores, atol=1e-4)
    plain = torch.einsum(
        "phd,shd->hps",
        rope_interleaved((x @ wq.T).view(6, heads, d)),
        rope_interleaved((x @ wk.T).view(6, heads, d)),
    )
    assert not torch.allclose(plain, hf_scores, atol=1e-2)  # without the permutation they differ
    assert torch.equal(unpermute_rotary_rows(pq, heads), wq)


@pytest.mark.parametrize("arch", EXPERT_RECORDS, ids=lambda a: a.name)
def test_every_expert_weight_is_named_as_the_gguf_package_names_it(arch):
    """A mixture-of-experts model's weights get gguf-py's names for the record's graph: the
    router and down_proj by their own HF names, the halves of the fused gate_up_proj by the
    names of the separate gate_proj and up_proj that the tensor map knows, the experts'
    biases (gpt-oss) as those tensors' .bias, attention sinks as .weight, each piece a tensor
    of the graph."""
    config = AutoConfig.for_model(
        arch.model_types[0], hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=4, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, pad_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    tensor_map = gguf.get_tensor_name_map(by_name[arch.gguf.arch], 2)
    graph = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[by_name[arch.gguf.arch]]}
    halves = ("gate_proj", "up_proj")
    written = []
    for hf_name, _ in model.named_parameters():
        stem, _, kind = hf_name.rpartition(".")
        # 3-D parameters and their biases: no .weight suffix in HF, .weight or .bias in GGUF
        if kind in ("gate_up_proj", "gate_up_proj_bias"):
            suffix = ".bias" if kind.endswith("_bias") else ".weight"
            expected = [tensor_map.get_name(f"{stem}.{half}") + suffix for half in halves]
        elif kind in ("down_proj", "down_proj_bias"):
            suffix = ".bias" if kind.endswith("_bias") else ".weight"
            expected = [tensor_map.get_name(f"{stem}.down_proj") + suffix]
        elif kind == "sinks":
            expected = [tensor_map.get_name(hf_name) + ".weight"]
        else:
            expected = [tensor_map.get_name(stem) + "." + kind]
        pieces = gguf_pieces(hf_name, arch)
        assert [piece.name for piece in pieces] == expected, hf_name
        written += [piece.name for piece in pieces]
    layer_names = {re.sub(r"blk\.\d+\.", "blk.{bid}.", name).rsplit(".", 1)[0] for name in written}
    assert layer_names <= graph
    assert {"blk.{bid}.ffn_gate_inp", "blk.{bid}.ffn_gate_exps", "blk.{bid}.ffn_up_exps"} <= layer_names
