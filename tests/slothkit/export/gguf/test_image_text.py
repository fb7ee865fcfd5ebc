"""GGUF export of an image-text model: the language model's GGUF plus llama.cpp's projector
file (mmproj), on the tiny Gemma 3 image-text checkpoint of slothkit.testing (a one-layer
SigLIP tower on 28 x 28 images of 14-pixel patches, 4 image tokens) with LoRA on the
language and vision layers (random B, so that both LoRA parts move the outputs).

llama.cpp's libmtmd loads the projector beside the text GGUF and encodes a random image;
its embeddings are compared with the unmerged LoRA model's projected image features."""

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from slothkit.core.inspection import text_tokenizer
from slothkit.export.gguf import mmproj
from slothkit.export.gguf.image_text import language_model_of
from slothkit.export.save import merged_plain_model
from slothkit.testing.image_text_parity import load_for_training

T = GGMLQuantizationType
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'slothkit[gguf]'); it runs the GGUF files",
)


def _lora_model(family: str, vision: bool = True, seed: int = 5, scale: float = 0.05):
    model = load_for_training("slothkit", family, vision=vision)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return model.eval()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(LoRA model, processor, merged model, folder written by save_pretrained_gguf at f16)."""
    model = _lora_model("gemma3")
    from slothkit.export.save import resolve_tokenizer

    processor = resolve_tokenizer(model, None)
    folder = tmp_path_factory.mktemp("gemma3-vision") / "out"
    paths = model.save_pretrained_gguf(
        folder, quantization_method="f16"
    )  # verified: llama-cpp-python present
    merged = merged_plain_model(model, processor)
    return model, processor, merged, folder, paths


def _error_against(model, mmproj_path, text_path):
    from slothkit.export.gguf.verify_mmproj import (
        file_normalisation,
        hf_image_features,
        llama_cpp_image_embeddings,
        random_image,
    )

    image = random_image(model.config.vision_config.image_size, seed=1)
    reference = hf_image_features(model, image, *file_normalisation(mmproj_path))
    embeddings = llama_cpp_image_embeddings(mmproj_path, text_path, image)
    return float(np.sqrt(np.mean((embeddings - reference) ** 2)) / reference.std())


@needs_llama_cpp
def test_gemma3_writes_the_language_gguf_and_the_projector(gemma3):
    _, _, _, folder, paths = gemma3
    names = [path.name for path in paths]
    assert names == ["gemma3-image-text.F16.gguf", "mmproj-gemma3-image-text.F16.gguf", "Modelfile"]
    text = GGUFReader(folder / names[0])
    assert bytes(text.get_field("general.architecture").parts[-1]).decode() == "gemma3"
    projector = GGUFReader(folder / names[1])
    fields = {key: projector.get_field(key) for key in ("general.architecture", "clip.projector_type")}
    assert {key: bytes(field.parts[-1]).decode() for key, field in fields.items()} == {
        "general.architecture": "clip",
        "clip.projector_type": "gemma3",
    }
    types = {tensor.name: tensor.tensor_type for tensor in projector.tensors}
    assert types["mm.input_projection.weight"] == T.F16 and types["v.blk.0.attn_q.weight"] == T.F16
    assert types["v.patch_embd.weight"] == T.F32 and types["v.blk.0.ln1.weight"] == T.F32
    # 28 / 14 = 2 patches a side pooled into 2 tokens a side: llama.cpp's default is 4, so it is written
    assert projector.get_field("clip.vision.projector.scale_factor").parts[-1][0] == 1


@needs_llama_cpp
def test_gemma3_language_gguf_matches_the_merged_language_model(gemma3, tmp_path):
    from slothkit.export.gguf.verify import verify_gguf

    _, processor, merged, folder, _ = gemma3
    report = verify_gguf(
        folder / "gemma3-image-text.F16.gguf", language_model_of(merged), text_tokenizer(processor), "f16"
    )
    assert report.logit_error < report.tolerance


@needs_llama_cpp
@pytest.mark.parametrize("float_type", [T.F32, T.F16], ids=["F32", "F16"])
def test_gemma3_projector_matches_the_lora_models_image_features(gemma3, tmp_path, float_type):
    """llama.cpp's embeddings against the unmerged LoRA model's: the vision LoRA is in the file."""
    from slothkit.export.gguf.verify_mmproj import TOLERANCES

    model, processor, merged, folder, _ = gemma3
    path = mmproj.write_mmproj(merged, tmp_path / "mmproj.gguf", processor, float_type)
    error = _error_against(model.base_model.model, path, folder / "gemma3-image-text.F16.gguf")
    assert error < TOLERANCES[float_type] / 5  # measured 0.0006 (F32), 0.0007 (F16)


@needs_llama_cpp
def test_gemma3_bfloat16_model_and_a_second_save_into_the_folder(tmp_path):
    """A 16-bit model's tower is compared in float32 (the file's weights are its own), and
    saving again asks for overwrite, which replaces the projector and keeps `Modelfile`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from slothkit.export.atomic import DirectoryNotEmptyError
    from slothkit.export.gguf import save_pretrained_gguf
    from slothkit.export.gguf.verify_mmproj import verify_mmproj
    from slothkit.testing import tiny_image_text_path

    path = tiny_image_text_path("gemma3")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    processor = AutoProcessor.from_pretrained(path)
    text, projector, _ = save_pretrained_gguf(model, tmp_path / "out", processor, "f16")
    report = verify_mmproj(projector, text, model, T.F16)
    assert report.image_tokens == 4 and report.relative_error < report.tolerance / 5  # measured 0.0006
    with pytest.raises(DirectoryNotEmptyError, match="mmproj-"):
        save_pretrained_gguf(model, tmp_path / "out", processor, "f16", verify=False)
    again = save_pretrained_gguf(model, tmp_path / "out", processor, "f16", verify=False, overwrite=True)
    assert [p.name for p in again] == [text.name, projector.name, "Modelfile"]


@needs_llama_cpp
def test_gemma3_own_image_geometry_uses_llama_cpps_default_pooling(tmp_path):
    """Gemma 3's images (896 pixels, 64 patches a side averaged 4 x 4 into 256 tokens), on a
    narrow random tower: the pool is llama.cpp's default, so no scale_factor key is written,
    and llama.cpp's pooling still matches HF's."""
    from transformers import AutoProcessor, Gemma3Config, Gemma3ForConditionalGeneration

    from slothkit.export.gguf import save_pretrained_gguf
    from slothkit.export.gguf.verify_mmproj import verify_mmproj
    from slothkit.testing import tiny_image_text_path

    path = tiny_image_text_path("gemma3")
    processor = AutoProcessor.from_pretrained(path)
    tiny = Gemma3Config.from_pretrained(path)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=896, patch_size=14, vision_use_head=False)  # fmt: skip
    config = Gemma3Config(
        text_config=tiny.text_config.to_dict(), vision_config=vision, mm_tokens_per_image=256,
        image_token_index=tiny.image_token_index, boi_token_index=tiny.boi_token_index,
        eoi_token_index=tiny.eoi_token_index,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts the projection at zero: every image alike
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 32**-0.5)
    text, projector, _ = save_pretrained_gguf(model, tmp_path / "out", processor, "f16", verify=False)
    assert GGUFReader(projector).get_field("clip.vision.projector.scale_factor") is None
    report = verify_mmproj(projector, text, model, T.F16)
    assert report.image_tokens == 256 and report.relative_error < report.tolerance / 5


def _fault_files(merged, model):
    tensors = mmproj.mmproj_tensors(merged)
    without_offset = dict(tensors)
    without_offset["mm.soft_emb_norm.weight"] = tensors["mm.soft_emb_norm.weight"] - 1.0
    # The LoRA wrappers' .weight is their base layer's: the tower without its vision LoRA.
    without_vision_lora = mmproj.mmproj_tensors(model.base_model.model)
    swapped = dict(tensors)
    swapped["v.blk.0.attn_q.weight"], swapped["v.blk.0.attn_k.weight"] = (
        tensors["v.blk.0.attn_k.weight"],
        tensors["v.blk.0.attn_q.weight"],
    )
    return {
        "norm without 1 + w": without_offset,
        "vision LoRA dropped": without_vision_lora,
        "q and k swapped": swapped,
    }


@needs_llama_cpp
@pytest.mark.parametrize("fault", ["norm without 1 + w", "vision LoRA dropped", "q and k swapped"])
def test_gemma3_faulty_projector_files_fail_verification(gemma3, tmp_path, fault):
    from slothkit.export.gguf.verify import GGUFVerificationError
    from slothkit.export.gguf.verify_mmproj import verify_mmproj

    model, processor, merged, folder, _ = gemma3
    tensors = _fault_files(merged, model)[fault]
    path = mmproj.write_mmproj(merged, tmp_path / "faulty.gguf", processor, T.F32, tensors=tensors)
    with pytest.raises(GGUFVerificationError, match="rms / std"):
        verify_mmproj(path, folder / "gemma3-image-text.F16.gguf", merged, T.F32)


def test_llama_3_2_vision_is_refused_by_name_before_any_work(tmp_path):
    """llama.cpp's libmtmd has no Llama 3.2 Vision projector; the written families are named."""
    model = load_for_training("slothkit", "mllama", vision=True)
    from slothkit.export.save import resolve_tokenizer

    tokenizer = resolve_tokenizer(model, None)
    with pytest.raises(mmproj.UnsupportedImageTextModel, match="'mllama'.*no Llama 3.2 Vision") as refused:
        model.save_pretrained_gguf(tmp_path / "out", tokenizer, quantization_method="f16")
    assert "Written: gemma3, qwen2_5_vl" in str(refused.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the merge's scratch folder


def test_push_uploads_the_language_gguf_and_the_projector_file(gemma3, local_hub, tmp_path):
    """model.push_to_hub_gguf of the LoRA Gemma 3 image-text model (the vision notebook's
    publish cell): one commit holding the language model's GGUF, its Modelfile and the
    projector file, which comes back from the Hub as llama.cpp's clip file of the model."""
    from huggingface_hub import hf_hub_download

    model, processor, _, _, _ = gemma3
    pushed = model.push_to_hub_gguf(
        "local-user/gemma3-vision-gguf",
        processor,
        quantization_method="q8_0",
        token="hf_writer",
        verify=False,
    )
    text, projector = "gemma3-image-text.Q8_0.gguf", "mmproj-gemma3-image-text.F16.gguf"
    assert sorted(pushed.files) == ["Modelfile", text, projector]
    assert set(local_hub.files("local-user/gemma3-vision-gguf")) == {
        ".gitattributes",
        "Modelfile",
        text,
        projector,
    }
    pulled = hf_hub_download(
        "local-user/gemma3-vision-gguf", projector, token="hf_writer", local_dir=tmp_path
    )
    reader = GGUFReader(pulled)
    assert bytes(reader.get_field("clip.projector_type").parts[-1]).decode() == "gemma3"
    local = mmproj.mmproj_tensors(gemma3[2])  # the merged model's: the vision LoRA is in the upload
    uploaded = {tensor.name: np.asarray(tensor.data) for tensor in reader.tensors}
    for name in ("v.blk.0.attn_q.weight", "mm.input_projection.weight"):
        expected = local[name].numpy().astype(np.float16)
        assert np.array_equal(uploaded[name].reshape(expected.shape), expected), name


@pytest.mark.parametrize(
    ("family", "written"), [("gemma3", True), ("qwen2_5_vl", True), ("mllama", False), ("llava", False)]
)
def test_gguf_refusal_says_which_families_are_written(family, written):
    """What the vision notebooks read to offer SAVE_GGUF: the writer's own tables."""
    from slothkit.export.gguf.image_text import gguf_refusal, writes_gguf

    assert writes_gguf(family) is written
    assert (gguf_refusal(family) is None) is written
    if not written:
        assert f"{family!r} is refused" in gguf_refusal(family)


def test_a_family_is_written_once_both_its_language_model_and_projector_are(monkeypatch):
    """Pretended for LLaVA: its projector type alone is not enough."""
    from slothkit.export.gguf.image_text import LANGUAGE_MODELS, gguf_refusal, writes_gguf

    monkeypatch.setitem(mmproj.PROJECTOR_TYPES, "llava", "mlp")
    assert "knows no text model class" in gguf_refusal("llava")
    monkeypatch.setitem(LANGUAGE_MODELS, "llava", "LlamaForCausalLM")
    assert writes_gguf("llava")


@needs_llama_cpp
def test_projector_verification_keeps_libmtmds_log_to_errors(gemma3, capfd):
    """libmtmd logs every hyperparameter and encoding step unless told otherwise: dozens of
    lines in a notebook's save cell for one check."""
    from slothkit.export.gguf.verify_mmproj import verify_mmproj

    _, _, merged, folder, _ = gemma3
    capfd.readouterr()
    verify_mmproj(
        folder / "mmproj-gemma3-image-text.F16.gguf", folder / "gemma3-image-text.F16.gguf", merged, T.F16
    )
    printed = capfd.readouterr()
    assert "load_hparams" not in printed.err + printed.out and "clip_encode" not in printed.err + printed.out
