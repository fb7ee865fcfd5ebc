"""Fast decode of image-text models (slothkit.inference.image_prompt) against Hugging Face's
generate on the same model, fp32: the tiny Gemma 3 and Qwen2.5-VL checkpoints of
slothkit.testing, LoRA on the vision tower and the language model (B made non-zero by two
training steps), prompts with an image, at batch 1 and in a left-padded batch of 2.

Greedy tokens must be identical, and the prefill's logits at every position must be the
model's own forward's within 1e-4.  The logits check sees each trait the prefill takes
over: without Gemma 3's two-way attention between one image's tokens, or without
Qwen2.5-VL's M-RoPE positions, the prefill's logits move by far more than the tolerance
(test_the_comparison_sees_each_trait).  On a CPU the loop runs without the CUDA graph."""

import warnings

import pytest
import torch

import slothkit.inference.image_prompt as image_prompt_module
from slothkit import FastVisionModel
from slothkit.core.inspection import causal_lm_of
from slothkit.core.model_state import state_of
from slothkit.core.notices import say_once
from slothkit.inference.fast_decoder import FastDecoder
from slothkit.inference.kv_cache import StaticKVCache
from slothkit.testing.image_text_parity import load_for_training, on_device, random_batch, train

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = ("gemma3", "qwen2_5_vl")  # Mllama's language model has no fused record
NEW_TOKENS = 8
PAD = 0


@pytest.fixture(autouse=True)
def fresh_notices():
    say_once.cache_clear()


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request):
    """(family, a FastVisionModel with vision and language LoRA after two steps)."""
    family = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_for_training("slothkit", family, vision=True, fused=False)
    train(model, [random_batch(family, seed) for seed in range(2)])
    return family, model


def _prompt(family: str, rows: int, pad_rows: int) -> dict:
    """An image prompt of ``rows`` rows, the first ``pad_rows`` left-padded by 2 tokens
    each (their token types 0 there, as a processor pads them)."""
    batch = random_batch(family, seed=100, rows=rows, text_tokens=8)
    batch.pop("labels")
    for row in range(pad_rows):
        for name in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"):
            if name in batch:
                values = batch[name]
                values[row] = torch.cat((torch.zeros(2, dtype=values.dtype), values[row, :-2]))
                if name == "input_ids":
                    values[row, :2] = PAD
    if pad_rows:  # the padded rows lost their last 2 text tokens to the padding
        batch["attention_mask"][:pad_rows, :2] = 0
    return on_device(batch, DEVICE)


def _hf_then_fast(model, prompt: dict) -> tuple[torch.Tensor, torch.Tensor]:
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    FastVisionModel.for_inference(model, fast_decode=False)
    with torch.no_grad():
        expected = model.generate(**prompt, **settings)
    FastVisionModel.for_inference(model, fast_decode=True)
    decoder = state_of(causal_lm_of(model)).fast_decoder
    assert decoder is not None, "for_inference did not switch the fast loop on"
    decoder.release()
    with torch.no_grad():
        got = model.generate(**prompt, **settings)
    assert decoder.cache is not None, "the fast loop did not run"
    FastVisionModel.for_training(model)
    return expected, got


@pytest.mark.parametrize(("rows", "pad_rows"), [(1, 0), (2, 1)], ids=["batch-1", "padded-batch-2"])
def test_greedy_generation_with_an_image_is_hf_s(trained, rows, pad_rows):
    family, model = trained
    expected, got = _hf_then_fast(model.to(DEVICE), _prompt(family, rows, pad_rows))
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_language_path_decodes_as_hf(family, reference_kernels):
    """The language model on slothkit's fused layers (the default where Triton runs; here
    the kernels' torch references): the step reads the same modules, and a padded batch's
    greedy tokens are Hugging Face's generate's over that model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_for_training("slothkit", family, vision=True, fused=True)
    assert state_of(causal_lm_of(model)).architecture is not None, (
        "the language model is not on the fused path"
    )
    train(model, [random_batch(family, seed) for seed in range(2)])
    expected, got = _hf_then_fast(model.to(DEVICE), _prompt(family, rows=2, pad_rows=1))
    assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"


def _prefill_logits(model, prompt: dict) -> torch.Tensor:
    """The step's logits at every prompt position, prefilled as the fast loop does."""
    causal_lm = causal_lm_of(model)
    decoder = FastDecoder(causal_lm, embedding_scale=True, use_graph=False)
    ids, mask = prompt["input_ids"], prompt["attention_mask"]
    images = {name: prompt[name] for name in image_prompt_module.IMAGE_INPUTS if name in prompt}
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    merged = image_prompt_module.image_prompt(causal_lm, ids, mask, positions, images)
    windows, kv_heads, head_dims = decoder.step.cache_layout()
    cache = StaticKVCache(
        len(windows), ids.shape[0], kv_heads, 256, head_dims, torch.float32, ids.device, windows
    )
    cache.reset(mask)
    first = torch.zeros(1, dtype=torch.long, device=ids.device)
    return decoder.step(
        ids, merged.positions, cache, first, last_only=False, visible=ids.shape[1],
        inputs_embeds=merged.embeds, both_ways=merged.both_ways,
    )  # fmt: skip


def _forward_logits(model, prompt: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**prompt).logits.float()


@pytest.mark.parametrize("pad_rows", [0, 1], ids=["unpadded", "padded"])
def test_prefill_logits_are_the_models_forward_s(trained, pad_rows):
    family, model = trained
    model.to(DEVICE).eval()
    prompt = _prompt(family, rows=2, pad_rows=pad_rows)
    real = prompt["attention_mask"].bool()
    got, expected = _prefill_logits(model, prompt)[real], _forward_logits(model, prompt)[real]
    model.train()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_the_comparison_sees_each_trait(trained, monkeypatch):
    """Gemma 3 without its images' two-way attention, Qwen2.5-VL with text positions in
    place of M-RoPE's: the prefill's logits leave the tolerance far behind."""
    family, model = trained
    model.to(DEVICE).eval()
    prompt = _prompt(family, rows=1, pad_rows=0)
    expected = _forward_logits(model, prompt)[0]
    if family == "gemma3":
        monkeypatch.setattr(image_prompt_module, "TWO_WAY_IMAGE_TYPES", ())
    else:
        original = image_prompt_module.image_prompt

        def text_positions(causal_lm, input_ids, attention_mask, positions, image_inputs):
            merged = original(causal_lm, input_ids, attention_mask, positions, image_inputs)
            merged.positions = positions
            return merged

        monkeypatch.setattr(image_prompt_module, "image_prompt", text_positions)
    got = _prefill_logits(model, prompt)[0]
    model.train()
    assert (got - expected).abs().max() > 10 * 1e-4  # measured: 0.003 (Qwen2.5-VL), more for Gemma 3


def test_a_family_without_a_record_generates_through_hf(recwarn):
    """Mllama's language model (cross-attention layers) has no fused record: for_inference
    says so once and generate is Hugging Face's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_for_training("slothkit", "mllama", vision=False, fused=False)
    FastVisionModel.for_inference(model)
    assert state_of(causal_lm_of(model)).fast_decoder is None
    said = [
        str(w.message) for w in recwarn if "fast generation covers the image-text models" in str(w.message)
    ]
    assert len(said) == 1 and "'mllama'" in said[0], said
