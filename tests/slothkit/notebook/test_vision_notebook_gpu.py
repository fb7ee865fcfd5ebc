"""The Gemma 3 vision notebook on a GPU, as a user runs it: its hardware cell plans the
image-text checkpoint, the language layers load in NF4, the trainer takes this GPU's
precision, the merged 16-bit save loads back with plain transformers, and SAVE_GGUF (on in
Gemma 3's notebook) writes the language model per GGUF_QUANTS and its projector file.
(nbval runs the committed notebooks on the CPU in 16 bits.)"""

import json

import pytest


@pytest.mark.cuda
def test_the_vision_notebook_trains_in_4_bits_and_saves_on_the_gpu(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from slothkit.notebook.execute import execute_notebook
    from slothkit.notebook.render import write_notebook
    from slothkit.testing.tiny_image_text import tiny_image_text_path

    checkpoint = tiny_image_text_path("gemma3")
    notebook_path, _ = write_notebook("vision", "gemma-3-4b", tmp_path / "gemma-3-4b-vision")
    out = tmp_path / "outputs"
    environment = {
        "SLOTHKIT_NO_INSTALL": "1",
        "SLOTHKIT_MODEL_NAME": str(checkpoint),
        "SLOTHKIT_LOAD_IN_4BIT": "1",
        "SLOTHKIT_MAX_STEPS": "16",
        "SLOTHKIT_GRAD_ACCUM": "1",
        "SLOTHKIT_LEARNING_RATE": "0.002",
        "SLOTHKIT_OUTPUT_DIR": str(out),
        "SLOTHKIT_HUB_REPO": "",
        "TRITON_INTERPRET": "0",
        "HF_HUB_OFFLINE": "1",
    }
    notebook = execute_notebook(notebook_path, environment, timeout=600)
    printed = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "GPU: " in printed and "GPU: none" not in printed
    assert "peak GPU memory" in printed  # the train cell's report, after `loss_went_down` held
    assert json.loads((out / "lora" / "adapter_config.json").read_text())["r"] > 0
    merged = AutoModelForImageTextToText.from_pretrained(out / "merged-16bit")
    assert merged.dtype in (torch.bfloat16, torch.float16)
    assert type(AutoProcessor.from_pretrained(out / "merged-16bit")).__name__ == "Gemma3Processor"
    written = sorted(path.name for path in (out / "gguf").glob("*.gguf"))
    assert [name.split(".", 1)[1] for name in written] == ["Q4_K_M.gguf", "Q8_0.gguf", "F16.gguf"], written
    assert written[-1].startswith("mmproj-"), written
