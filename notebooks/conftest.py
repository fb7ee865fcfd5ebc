"""nbval runs every notebook here top to bottom, offline: each is pointed (through the
SLOTHKIT_* variables its config cell reads) at a tiny random model of its architecture
and at a local server that speaks the Hugging Face Hub's protocol."""

import json
import os
import tempfile
from pathlib import Path

import pytest

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
MODELS = json.loads((TEMPLATES_DIR / "models.json").read_text())
# The vision template's models (templates/vision_models.json): each runs on the tiny image-text
# checkpoint of its family (its model_type; slothkit.testing.tiny_image_text), processor and all.
VISION_MODELS = json.loads((TEMPLATES_DIR / "vision_models.json").read_text())
# What a template's notebook runs with beyond the settings every notebook gets.  GRPO
# samples completions with Hugging Face generate before each step: two short ones per
# prompt, one prompt a step and two steps keep its run under a minute on a 2-core CPU
# (tests/slothkit/test_trl.py checks that GRPO's steps on slothkit's model match HF + PEFT).
TEMPLATE_ENVIRONMENT = {
    # Each vision record renders its conversation and its prompt through the processor (the
    # collator locates the answer): one record a step keeps the run short.
    "vision": {"SLOTHKIT_GRAD_ACCUM": "1", "SLOTHKIT_BATCH_SIZE": "2"},
    "grpo": {
        "SLOTHKIT_MAX_STEPS": "2",
        "SLOTHKIT_GRAD_ACCUM": "1",
        "SLOTHKIT_NUM_GENERATIONS": "2",
        "SLOTHKIT_MAX_COMPLETION_LENGTH": "8",
    },
}
# Notebook models whose real checkpoints are image-text models (FastModel loads their text
# model alone, slothkit.loading.text_tower): they run on a tiny image-text stand-in (the name of
# its builder in slothkit.testing), so that the notebook meets what a user's load meets.
IMAGE_TEXT_MODELS = {
    "gemma-3-4b": "tiny_image_text_gemma3_path",
    "gemma-4-e4b": "tiny_image_text_gemma4_path",
}
_state = {}


def _model_key(stem: str) -> str:
    models = {**MODELS, **VISION_MODELS}
    for key in sorted(models, key=len, reverse=True):
        if stem.startswith(key + "-"):
            return key
    raise ValueError(f"notebook {stem!r} is not named <model>-<template>; models: {', '.join(models)}")


def _template(stem: str) -> str:
    return stem[len(_model_key(stem)) + 1 :]


def _hub():
    if "hub" not in _state:
        from slothkit.testing.local_hub import LocalHub

        _state["hub"] = LocalHub().start()
        _state["outputs"] = tempfile.TemporaryDirectory(prefix="slothkit-notebooks-")
    return _state["hub"]


def _stand_in(model: str):
    """The tiny checkpoint a notebook of `model` runs on: an image-text one, that of its
    record's family, or (a family without a record) its tiny generic shape's."""
    import slothkit.testing
    from slothkit.notebook.render import architecture_of, shape_of
    from slothkit.testing import tiny_model_path
    from slothkit.testing.tiny_generic_models import tiny_generic_model_path

    if model in IMAGE_TEXT_MODELS:
        return getattr(slothkit.testing, IMAGE_TEXT_MODELS[model])()
    record = architecture_of(model)
    if record is None:
        return tiny_generic_model_path(shape_of(model).model_type)
    return tiny_model_path(record.name)


def _vision_stand_in(model: str):
    """The tiny image-text checkpoint a vision notebook of `model` runs on; the test is skipped
    where transformers cannot build its processor here (Qwen-VL's needs torchvision)."""
    from slothkit.testing.tiny_image_text import image_text_processor_loads, tiny_image_text_path

    family = VISION_MODELS[model]["model_type"]
    why_not = image_text_processor_loads(family)
    if why_not is not None:
        pytest.skip(f"{model} vision notebook: {why_not}")
    return tiny_image_text_path(family)


def _writes_gguf(model: str, vision: bool) -> bool:
    """SAVE_GGUF's default in the model's notebook (a vision notebook's is computed:
    slothkit.notebook.render.vision_model_data)."""
    if not vision:
        return MODELS[model]["save_gguf"]
    from slothkit.notebook.render import vision_model_data

    return vision_model_data()[model]["save_gguf"]


def notebook_environment(stem: str) -> dict[str, str]:
    hub = _hub()
    model = _model_key(stem)
    vision = _template(stem) == "vision"
    stand_in = _vision_stand_in(model) if vision else _stand_in(model)
    return {
        **hub.client_env(),
        "SLOTHKIT_NO_INSTALL": "1",
        "SLOTHKIT_MODEL_NAME": str(stand_in),
        "SLOTHKIT_LOAD_IN_4BIT": "0",
        "SLOTHKIT_MAX_STEPS": "16",
        "SLOTHKIT_LEARNING_RATE": "0.002",
        "SLOTHKIT_OUTPUT_DIR": os.path.join(_state["outputs"].name, stem),
        # GGUF where the model's notebook writes it (models.json's save_gguf: not gpt-oss; a
        # vision notebook's: where slothkit writes its family, Gemma 3's language model and projector).
        "SLOTHKIT_SAVE_GGUF": "1" if _writes_gguf(model, vision) else "0",
        # One quantisation keeps the run short; every type is tested in tests/slothkit/export.
        "SLOTHKIT_GGUF_QUANTS": "q8_0",
        "SLOTHKIT_HUB_REPO": f"local-user/{stem}",
        "SLOTHKIT_HUB_TOKEN": hub.token,
        # tests/conftest.py turns the Triton interpreter on for the kernel tests; in a
        # notebook kernel it would make every step crawl, and the kernels' CPU path
        # (their torch references) is what a notebook on a CPU runs anyway.
        "TRITON_INTERPRET": "0",
        # Other tests set HF_HUB_OFFLINE=1 for this process; the notebooks push to the local Hub.
        "HF_HUB_OFFLINE": "0",
        **TEMPLATE_ENVIRONMENT.get(_template(stem), {}),
    }


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # nbval starts a notebook's kernel when its first cell is set up, from this
    # process's environment: set that notebook's variables just before.
    path = Path(str(item.fspath))
    notebook = item.parent
    if path.suffix == ".ipynb" and not getattr(notebook, "_slothkit_environment", False):
        environment = notebook_environment(path.stem)
        _state["saved"] = {key: os.environ.get(key) for key in environment}
        os.environ.update(environment)
        notebook._slothkit_environment = True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # After a notebook's last cell, give the process its environment back: the tests that
    # run next in this process (a `slothkit demo` reads the same SLOTHKIT_* variables) and
    # the next notebook must not see this one's settings.
    notebook = item.parent
    if getattr(notebook, "_slothkit_environment", False) and (
        nextitem is None or nextitem.parent is not notebook
    ):
        for key, value in _state.pop("saved", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def pytest_sessionfinish(session, exitstatus):
    hub = _state.pop("hub", None)
    if hub is not None:
        hub.stop()
