"""The generic path's module-by-module fusion: a model whose layers stay its own gets the
fused RMSNorm and gated MLP on each module that computes them (checked at loading), keeps
the modules that compute something else, and trains as HF + PEFT does."""

import copy

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import patched_module
from slothkit.engine import generic_modules
from slothkit.engine.generic_layers import fuse_generic_layers
from slothkit.engine.generic_modules import fuse_generic_modules
from slothkit.models.generic_shapes import GENERIC_SHAPES
from slothkit.testing import build_tiny_tokenizer
from slothkit.testing.training_parity import assert_trains_as_hf_peft_does

SIZES = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, pad_token_id=0,
)  # fmt: skip
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(name: str, dtype=torch.float32):
    """A tiny model of a family whose layers stay its own: a GENERIC_SHAPES name, or a
    model_type at SIZES (SmolLM3 with its fourth layer without RoPE)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if name in GENERIC_SHAPES:
        config = GENERIC_SHAPES[name].config()
    else:
        extra = {"num_hidden_layers": 4} if name == "smollm3" else {}
        config = AutoConfig.for_model(name, **{**SIZES, **extra})
    return AutoModelForCausalLM.from_config(config).to(DEVICE, dtype)


def _fused_modules(model) -> list:
    return [m for m in model.model.modules() if patched_module(m) is not None]


@pytest.mark.parametrize("name", ["olmo2", "smollm3", "tiny-gemma4", "tiny-qwen3.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norms_and_mlps_of_kept_layers_are_fused_and_compute_the_same(name, dtype):
    """Logits equal the model's own in float32; in bf16 they are as far from the float32
    model's as the model's own bf16 logits are (twice that at most): rounding only."""
    reference = _model(name).eval()
    model = copy.deepcopy(reference).to(dtype)
    assert fuse_generic_layers(model) is not None  # the layers stay the model's own
    own = copy.deepcopy(model)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    norms, mlps, reason = fuse_generic_modules(model)
    assert reason is None
    assert norms >= 2 * model.config.num_hidden_layers and mlps == model.config.num_hidden_layers
    assert len(_fused_modules(model)) == norms + mlps
    with torch.no_grad():
        logits = [m(input_ids=ids).logits.float() for m in (model, own, reference)]

    def distance(a, b):
        return ((a - b).norm() / b.norm()).item()

    fused, own_logits, exact = logits
    if dtype == torch.float32:
        assert distance(fused, own_logits) < 1e-5
    else:
        assert distance(fused, exact) < 2 * distance(own_logits, exact) + 1e-3
    assert fuse_generic_modules(model)[:2] == (0, 0)  # patched already: nothing more


def test_a_gated_norm_and_a_sparse_mlp_keep_their_own_forward():
    """Qwen3.5's DeltaNet output norm takes a gate beside its input, and Gemma 3n's first MLP
    keeps only its top activations: neither is what the kernels compute."""
    qwen = _model("tiny-qwen3.5")
    fuse_generic_modules(qwen)
    gated = [m for m in qwen.model.modules() if type(m).__name__.endswith("RMSNormGated")]
    assert gated and all(patched_module(m) is None for m in gated)
    gemma3n = _model("tiny-gemma3n")
    assert gemma3n.config.activation_sparsity_pattern[0] > 0
    fuse_generic_modules(gemma3n)
    mlps = [layer.mlp for layer in gemma3n.model.layers]
    assert patched_module(mlps[0]) is None
    assert all(patched_module(mlp) is not None for mlp in mlps[1:])


def test_an_mlp_with_another_activation_is_told_apart():
    """At the tiny checkpoint's small weights SiLU and GELU are both about x / 2: the check's
    random projections of order one tell them apart."""
    model = _model("olmo2")
    mlp = model.model.layers[0].mlp
    assert generic_modules.mlp_difference(mlp, "swiglu") < 1e-5
    assert generic_modules.mlp_difference(mlp, "geglu") > 1e-2


def test_a_fused_module_that_differs_in_the_model_undoes_every_patch(monkeypatch):
    """The model-level check, on the model's own weights and calls: a norm patch that scales
    its output by 1.01 fails it, and no module stays patched."""
    patch_rms_norm = generic_modules.patch_rms_norm

    def off_by_a_percent(norm, adds_one):
        patch_rms_norm(norm, adds_one)
        fused = norm.forward
        norm.forward = lambda x: fused(x) * 1.01

    monkeypatch.setattr(generic_modules, "patch_rms_norm", off_by_a_percent)
    model = _model("olmo2")
    norms, mlps, reason = fuse_generic_modules(model)
    assert (norms, mlps) == (0, 0)
    assert "compute something else" in reason
    assert not _fused_modules(model)


def test_olmo2_trains_like_hf_peft_with_fused_norms_and_mlps(tmp_path):
    """OLMo 2 (its layers stay) through FastModel: its norms and MLPs are slothkit's, and 8
    steps with slothkit's offloaded checkpointing (whose re-run must keep the MLP's output:
    OLMo 2's post_feedforward_layernorm reads it) give HF + PEFT's losses and adapters."""
    path = tmp_path / "olmo2"
    _model("olmo2").cpu().save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    with pytest.warns(UserWarning, match="RMSNorms and 2 gated MLPs in slothkit's kernels"):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    fast = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing="unsloth")
    assert patched_module(fast.get_base_model().model.layers[0].mlp) is not None
    assert_trains_as_hf_peft_does(fast, path, DEVICE)
