"""GGUF export of Qwen2.5-VL: its language model as llama.cpp's qwen2vl graph plus the
projector file (clip.projector_type "qwen2.5vl_merger"), on the tiny Qwen2.5-VL checkpoint of
slothkit.testing (a two-block tower, the second attending fully, 14-pixel patches merged
2 x 2, 112-pixel windows) with LoRA on the language and vision layers (random B, so that
both LoRA parts move the outputs).

llama.cpp's libmtmd loads the projector beside the text GGUF and encodes a random image of
140 x 224 pixels (40 image tokens, windows of 4 x 4 tokens and two cut short); its
embeddings are compared with the unmerged LoRA model's image features."""

import importlib.util
import types

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from slothkit.export.gguf import mmproj
from slothkit.export.gguf import mmproj_qwen2_5_vl as qwen
from slothkit.export.save import merged_plain_model
from slothkit.testing import tiny_image_text_path
from slothkit.testing.image_text_parity import load_for_training

T = GGMLQuantizationType
FAMILY = "qwen2_5_vl"
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)


def _tokenizer():
    """The processor where transformers builds it, else the tokenizer (Qwen-VL's processor
    needs torchvision); the projector's mean and std are then Qwen2.5-VL's own default."""
    from transformers import AutoProcessor, AutoTokenizer

    from slothkit.testing.tiny_image_text import image_text_processor_loads

    path = tiny_image_text_path(FAMILY)
    if image_text_processor_loads(FAMILY) is None:
        return AutoProcessor.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    """(LoRA model, tokenizer, merged model, folder, paths written by save_pretrained_gguf at f16)."""
    model = load_for_training("slothkit", FAMILY, vision=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.eval()
    tokenizer = _tokenizer()
    folder = tmp_path_factory.mktemp("qwen2_5_vl") / "out"
    # verified inside (llama-cpp-python present): the text GGUF's logits and libmtmd's image embeddings
    paths = model.save_pretrained_gguf(folder, tokenizer, quantization_method="f16")
    return model, tokenizer, merged_plain_model(model, tokenizer), folder, paths


def _field(reader, key):
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types and field.types[0].name == "STRING":
        return bytes(field.parts[-1]).decode()
    values = [field.parts[i][0].item() for i in field.data]
    return values if len(values) > 1 else values[0]


def _error_against(model, mmproj_path, text_path, seed=1):
    from slothkit.export.gguf.verify_mmproj import (
        file_normalisation,
        hf_image_features,
        llama_cpp_image_embeddings,
        random_image,
        verification_image_shape,
    )

    image = random_image(verification_image_shape(model.config), seed)
    reference = hf_image_features(model, image, *file_normalisation(mmproj_path))
    embeddings = llama_cpp_image_embeddings(mmproj_path, text_path, image)
    assert embeddings.shape == reference.shape == (40, model.config.text_config.hidden_size)
    return float(np.sqrt(np.mean((embeddings - reference) ** 2)) / reference.std())


@needs_llama_cpp
def test_writes_the_qwen2vl_language_gguf_and_the_projector(qwen2_5_vl):
    _, _, _, folder, paths = qwen2_5_vl
    names = [path.name for path in paths]
    assert names == ["qwen2_5_vl-image-text.F16.gguf", "mmproj-qwen2_5_vl-image-text.F16.gguf", "Modelfile"]
    text = GGUFReader(folder / names[0])
    assert _field(text, "general.architecture") == "qwen2vl"
    # head_dim 16: 8 rotated pairs, mrope_section [2, 3, 3] (time, height, width)
    assert _field(text, "qwen2vl.rope.dimension_sections") == [2, 3, 3, 0]
    assert {"blk.0.attn_q.bias", "blk.1.attn_v.bias", "output.weight"} <= {t.name for t in text.tensors}
    projector = GGUFReader(folder / names[1])
    assert _field(projector, "clip.projector_type") == "qwen2.5vl_merger"
    assert _field(projector, "clip.vision.n_wa_pattern") == 2  # block 1 attends fully, block 0 in windows
    assert _field(projector, "clip.use_silu") is True or _field(projector, "clip.use_silu") == 1
    assert np.allclose(_field(projector, "clip.vision.image_mean"), qwen.IMAGE_MEAN)
    types_ = {tensor.name: tensor.tensor_type for tensor in projector.tensors}
    assert types_["mm.0.weight"] == T.F16 and types_["v.blk.0.attn_q.weight"] == T.F16
    assert types_["v.patch_embd.weight"] == T.F32 and types_["v.patch_embd.weight.1"] == T.F32
    assert types_["v.post_ln.weight"] == T.F32 and "v.blk.0.ln1.bias" not in types_  # RMSNorm: no bias


def test_pixel_layout_is_the_image_processors(tmp_path):
    """The verifier's pixels equal the image processor's for an image it keeps as it is."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor

    from slothkit.export.gguf.verify_mmproj import random_image

    path = tiny_image_text_path(FAMILY)
    vision = AutoConfig.from_pretrained(path).vision_config
    processor = AutoImageProcessor.from_pretrained(path)
    image = random_image(qwen.verification_image_shape(vision), seed=3)
    assert image.shape == (140, 224, 3)
    pixels = 140 * 224
    expected = processor(images=[Image.fromarray(image)], return_tensors="pt",
                         size={"shortest_edge": pixels, "longest_edge": pixels})  # fmt: skip
    mean, std = np.array(processor.image_mean), np.array(processor.image_std)
    values, grid = qwen.pixel_values(image, mean, std, vision)
    assert grid.tolist() == expected["image_grid_thw"].tolist() == [[1, 10, 16]]
    torch.testing.assert_close(values, expected["pixel_values"].float(), rtol=0, atol=1e-5)


@needs_llama_cpp
def test_language_gguf_matches_the_merged_language_model(qwen2_5_vl):
    """The text GGUF through llama.cpp against Qwen2ForCausalLM on the merged weights, which
    on text alone (every M-RoPE axis at the token's position) is the image-text model."""
    from slothkit.export.gguf.image_text import language_model_of, text_tokenizer
    from slothkit.export.gguf.verify import verify_gguf

    _, tokenizer, merged, folder, _ = qwen2_5_vl
    text = language_model_of(merged)
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole, alone = merged(input_ids=ids).logits, text(input_ids=ids).logits
    torch.testing.assert_close(alone, whole, rtol=1e-5, atol=1e-5)
    report = verify_gguf(folder / "qwen2_5_vl-image-text.F16.gguf", text, text_tokenizer(tokenizer), "f16")
    assert report.logit_error < report.tolerance


@needs_llama_cpp
@pytest.mark.parametrize("float_type", [T.F32, T.F16], ids=["F32", "F16"])
def test_projector_matches_the_lora_models_image_features(qwen2_5_vl, tmp_path, float_type):
    """llama.cpp's embeddings against the unmerged LoRA model's: the vision LoRA is in the file."""
    from slothkit.export.gguf.verify_mmproj import TOLERANCES

    model, tokenizer, merged, folder, _ = qwen2_5_vl
    path = mmproj.write_mmproj(merged, tmp_path / "mmproj.gguf", tokenizer, float_type)
    error = _error_against(model.base_model.model, path, folder / "qwen2_5_vl-image-text.F16.gguf")
    assert error < TOLERANCES[float_type] / 10  # measured 0.0003 (F32), 0.0006 (F16)


def _fault(merged, model, fault, monkeypatch):
    """(model the file is written from, its tensors) for a faulty projector file."""
    tensors = mmproj.mmproj_tensors(merged)
    if fault == "no block attending fully":  # n_wa_pattern 3: blocks 2, 5, ... (none of 2) attend fully
        monkeypatch.setattr(qwen, "window_pattern", lambda vision: 3)
    if fault == "vision LoRA dropped":  # the LoRA wrappers' .weight is their base layer's
        return merged, mmproj.mmproj_tensors(model.base_model.model)
    if fault == "merger matrix transposed":
        tensors["mm.0.weight"] = tensors["mm.0.weight"].T.contiguous()
    elif fault == "q and k of block 0 swapped":
        for part in ("weight", "bias"):
            q, k = f"v.blk.0.attn_q.{part}", f"v.blk.0.attn_k.{part}"
            tensors[q], tensors[k] = tensors[k], tensors[q]
    return merged, tensors


FAULTS = ["no block attending fully", "vision LoRA dropped", "merger matrix transposed",
          "q and k of block 0 swapped"]  # fmt: skip


@needs_llama_cpp
@pytest.mark.parametrize("fault", FAULTS)
def test_faulty_projector_files_fail_verification(qwen2_5_vl, tmp_path, fault, monkeypatch):
    from slothkit.export.gguf.verify import GGUFVerificationError
    from slothkit.export.gguf.verify_mmproj import verify_mmproj

    model, tokenizer, merged, folder, _ = qwen2_5_vl
    source, tensors = _fault(merged, model, fault, monkeypatch)
    path = mmproj.write_mmproj(source, tmp_path / "faulty.gguf", tokenizer, T.F32, tensors=tensors)
    with pytest.raises(GGUFVerificationError, match="rms / std"):
        verify_mmproj(path, folder / "qwen2_5_vl-image-text.F16.gguf", merged, T.F32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"window_size": 56}, "windows of 112 pixels"),
        ({"depth": 4, "fullatt_block_indexes": [1, 2]}, "not every n-th block"),
        ({"fullatt_block_indexes": [0, 1]}, "every block .* attends fully"),
        ({"spatial_merge_size": 3}, "merges 2 x 2"),
    ],
)
def test_towers_llama_cpp_would_compute_otherwise_are_refused(change, message, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_image_text_path(FAMILY))
    for key, value in change.items():
        setattr(config.vision_config, key, value)
    with pytest.raises(ValueError, match=message):
        mmproj.write_mmproj(types.SimpleNamespace(config=config), tmp_path / "x.gguf", tensors={})
    assert not (tmp_path / "x.gguf").exists()


def test_the_processors_mean_and_std_are_written_else_clips():
    processor = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(image_mean=[0.1] * 3, image_std=[0.2] * 3)
    )
    assert mmproj.image_normalisation(processor, FAMILY) == ([0.1] * 3, [0.2] * 3)
    assert mmproj.image_normalisation(object(), FAMILY) == (qwen.IMAGE_MEAN, qwen.IMAGE_STD)
    assert mmproj.image_normalisation(object(), "gemma3") == ([0.5] * 3, [0.5] * 3)


@needs_llama_cpp
def test_bfloat16_model_is_verified_on_a_float32_copy_of_its_tower(tmp_path):
    """A 16-bit model's tower is compared in float32 (the file's weights are its own)."""
    from transformers import AutoModelForImageTextToText

    from slothkit.export.gguf import save_pretrained_gguf
    from slothkit.export.gguf.verify_mmproj import verify_mmproj

    path = tiny_image_text_path(FAMILY)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    text, projector, _ = save_pretrained_gguf(model, tmp_path / "out", _tokenizer(), "f16")
    report = verify_mmproj(projector, text, model, T.F16)
    assert report.image_tokens == 40 and report.relative_error < report.tolerance / 10  # measured 0.0004
