"""Committed notebooks equal what their templates render; the CLI's answers."""

import types
from pathlib import Path

import pytest

from slothkit.cli import main
from slothkit.models import SHAPES
from slothkit.notebook.render import (
    IMAGE_TEXT_TEMPLATES,
    TEMPLATES,
    architecture_of,
    model_data,
    models_for,
    render_notebook,
    render_text,
    vision_model_data,
)

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _parts(stem):
    for template in TEMPLATES:
        if stem.endswith("-" + template):
            return stem[: -len(template) - 1], template
    raise AssertionError(f"{stem}: not named <model>-<template>")


def _cells(notebook):
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_committed_notebook_is_up_to_date(path):
    import jupytext

    model, template = _parts(path.stem)
    committed = jupytext.read(path)
    assert _cells(committed) == _cells(render_notebook(template, model)), (
        f"{path.name} is out of date with templates/{template}.py: "
        f"run slothkit new-notebook {model} --template {template} -o notebooks/{path.stem} --force"
    )
    assert all(not getattr(c, "outputs", None) for c in committed.cells), "commit notebooks without outputs"
    paired = jupytext.read(path.with_suffix(".py"))
    assert _cells(paired) == _cells(committed), f"{path.stem}.py is not paired with its .ipynb"


def test_every_model_has_a_committed_finetune_notebook():
    for model in model_data():
        assert (NOTEBOOKS / f"{model}-finetune.ipynb").is_file(), model


def test_every_image_text_model_has_a_committed_vision_notebook():
    assert list(vision_model_data()) == ["gemma-3-4b", "qwen2.5-vl-7b", "llama-3.2-11b"]
    for template in IMAGE_TEXT_TEMPLATES:
        for model in models_for(template):
            assert (NOTEBOOKS / f"{model}-{template}.ipynb").is_file(), model
    with pytest.raises(
        ValueError, match="unknown model 'llama-3-8b' for the vision template; valid models: gemma"
    ):
        render_notebook("vision", "llama-3-8b")


def test_image_text_models_language_shapes_fit_a_t4_with_room_for_the_vision_tower():
    """The vision notebooks' claim that their defaults fit a T4: the planner's peak for the
    language model (Gemma 3 4B's is the gemma-3-4b shape, Qwen2.5-VL 7B's the qwen2.5-7b
    shape, Llama 3.2 11B Vision's the text config transformers' MllamaConfig defaults to)
    leaves room for the vision tower's 16-bit weights (0.4B, 0.7B and 0.87B parameters)."""
    from transformers import MllamaConfig

    from slothkit.memory.plan import plan, shape_from_config
    from slothkit.models import shape_by_name

    language = {
        "gemma-3-4b": (shape_by_name("gemma-3-4b"), 0.4e9),
        "qwen2.5-vl-7b": (shape_by_name("qwen2.5-7b"), 0.7e9),
        "llama-3.2-11b": (shape_from_config(MllamaConfig().get_text_config()), 0.87e9),
    }
    for model, data in vision_model_data().items():
        assert data["gpu_fit"].startswith("The defaults fit a free Colab or Kaggle T4 (15 GB)"), model
        # SAVE_GGUF's default is the writer's answer (vision_model_data); the sentence must agree.
        gguf_sentence = "SAVE_GGUF writes" if data["save_gguf"] else "SAVE_GGUF is off here"
        assert gguf_sentence in data["gpu_fit"], model
        shape, tower_parameters = language[model]
        result = plan(
            shape, gpu="t4", seq=data["max_seq_length"], batch=data["t4_batch"], mode="qlora",
            rank=16, target_batch=data["t4_batch"] * data["t4_grad_accum"],
        )  # fmt: skip
        assert result.fits and (result.batch, result.seq) == (data["t4_batch"], data["max_seq_length"]), model
        assert result.total_gib + tower_parameters * 2 / 2**30 < result.budget_gib, model


def test_each_model_is_a_shape_its_architecture_record_names():
    """models.json holds notebook data only; what the model is comes from the record, or for
    a mixture-of-experts model of the generic path (no record) from its named shape."""
    from slothkit.models.generic_shapes import GENERIC_SHAPES
    from slothkit.notebook.render import family_of

    expected = {
        "llama-3-8b": "llama",
        "gemma-2b": "gemma",
        "gemma-7b": "gemma",
        "mistral-7b": "mistral",
        "qwen3-8b": "qwen3",
        "qwen2.5-7b": "qwen2",
        "gemma-3-4b": "gemma3",
        "gemma-2-9b": "gemma2",
        "phi-3-mini-4k": "phi3",
        "phi-4": "phi3",
        "ministral-8b": "ministral",
        "qwen3-30b-a3b": "qwen3_moe",
        "gpt-oss-20b": "gpt_oss",
        "qwen3.5-9b": "qwen3_5_text",
        "gemma-4-e4b": "gemma4_text",
    }
    assert {model: family_of(model) for model in model_data()} == expected
    for model, data in model_data().items():
        record = architecture_of(model)
        assert model in SHAPES  # bench and plan know it
        assert (model in record.shapes) if record is not None else (model in GENERIC_SHAPES)
        assert "tiny_arch" not in data
    assert [model for model in model_data() if architecture_of(model) is None] == [
        "qwen3-30b-a3b",
        "gpt-oss-20b",
        "qwen3.5-9b",
        "gemma-4-e4b",
    ]
    with pytest.raises(ValueError, match="unknown model 'gemma-9b'; valid models: llama-3-8b"):
        architecture_of("gemma-9b")


def test_new_notebook_refuses_to_overwrite_and_explains_bad_names(tmp_path, capsys):
    out = tmp_path / "nb"
    assert main(["new-notebook", "gemma-7b", "-o", str(out), "--set", "max_seq_length=4096"]) == 0
    assert "MAX_SEQ_LENGTH = 4096" in (tmp_path / "nb.py").read_text()
    assert main(["new-notebook", "gemma-7b", "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["new-notebook", "gemma-7b", "-o", str(out), "--force"]) == 0
    assert main(["new-notebook", "gemma-9b"]) == 2
    assert (
        "valid models: llama-3-8b, gemma-2b, gemma-7b, mistral-7b, qwen3-8b, qwen2.5-7b"
        in capsys.readouterr().err
    )
    assert main(["new-notebook", "gemma-7b", "-o", str(out), "--force", "--set", "colour=red"]) == 2
    assert "valid keys" in capsys.readouterr().err


def test_a_dotted_model_name_keeps_its_dot_in_the_file_names(tmp_path, monkeypatch):
    """The default output MODEL-TEMPLATE of qwen2.5-7b is qwen2.5-7b-finetune.ipynb, not qwen2.ipynb."""
    monkeypatch.chdir(tmp_path)
    assert main(["new-notebook", "qwen2.5-7b"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "qwen2.5-7b-finetune.ipynb",
        "qwen2.5-7b-finetune.py",
    ]
    assert main(["new-notebook", "qwen2.5-7b", "-o", str(tmp_path / "named.ipynb")]) == 0
    assert (tmp_path / "named.ipynb").is_file() and (tmp_path / "named.py").is_file()


def test_list_shows_models_templates_and_defaults(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for model in model_data():
        assert model in out
    for template in TEMPLATES:
        assert template in out


def _install_cell(monkeypatch, tmp_path, pip_exit_codes):
    """Run the rendered install cell in tmp_path as if slothkit were not installed, with pip
    answering from pip_exit_codes (spec -> exit code, 1 when absent); returns the specs tried."""
    import importlib.util
    import subprocess

    notebook = render_notebook("finetune", "gemma-7b")
    (cell,) = [c for c in notebook.cells if c.cell_type == "code" and "SLOTHKIT_PIP_SPEC" in c.source]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "slothkit" else real_find_spec(name, *a)
    )
    calls = []
    monkeypatch.setattr(
        subprocess, "call", lambda command: calls.append(command[-1]) or pip_exit_codes.get(command[-1], 1)
    )
    monkeypatch.chdir(tmp_path)
    return cell.source, calls


def test_install_cell_says_what_to_do_when_pip_cannot_install_slothkit(monkeypatch, tmp_path):
    source, calls = _install_cell(monkeypatch, tmp_path, {})
    monkeypatch.setenv("SLOTHKIT_PIP_SPEC", "/nowhere/slothkit.whl")
    with pytest.raises(
        RuntimeError, match="could not install slothkit from '/nowhere/slothkit.whl' or 'slothkit'"
    ):
        exec(source, {})
    assert calls == ["/nowhere/slothkit.whl", "slothkit"]


def test_install_cell_tries_the_spec_then_an_uploaded_wheel_then_pypi(monkeypatch, tmp_path):
    import os

    old = tmp_path / "slothkit-0.0.9-py3-none-any.whl"
    new = tmp_path / "slothkit-0.1.0-py3-none-any.whl"
    for age, wheel in ((200, old), (100, new)):
        wheel.write_bytes(b"")
        os.utime(wheel, (wheel.stat().st_mtime - age,) * 2)
    monkeypatch.delenv("SLOTHKIT_PIP_SPEC", raising=False)
    # After installing, the cell imports slothkit.notebook and installs the notebook's other
    # packages; run only its install part.
    source, calls = _install_cell(monkeypatch, tmp_path, {new.name: 0})
    install_part = source.split("from slothkit.notebook import")[0]
    exec(install_part, {})
    assert calls == [new.name], "with no spec set, the newest uploaded wheel comes first"

    source, calls = _install_cell(monkeypatch, tmp_path, {"slothkit": 0})
    exec(install_part, {})
    assert calls == [new.name, "slothkit"], "PyPI is tried when the uploaded wheel fails"

    monkeypatch.setenv("SLOTHKIT_PIP_SPEC", "slothkit==0.1.0")
    source, calls = _install_cell(monkeypatch, tmp_path, {"slothkit==0.1.0": 0})
    exec(install_part, {})
    assert calls == ["slothkit==0.1.0"], "SLOTHKIT_PIP_SPEC comes before everything else"


@pytest.mark.parametrize(
    ("template", "trainer_name", "make_config"),
    [
        ("finetune", "SFTTrainer", "sft_config"),
        ("conversational", "SFTTrainer", "sft_config"),
        ("dpo", "DPOTrainer", "dpo_config"),
    ],
)
def test_train_cell_builds_the_config_slothkit_chooses(
    template, trainer_name, make_config, monkeypatch, tmp_path
):
    """The values the train cell writes out in its SFTConfig(...) / DPOConfig(...) are
    slothkit's defaults (slothkit.trl.defaults) with the notebook config's batch, accumulation,
    steps, rate and length: the cell shows them, and cannot drift from them."""
    import slothkit.data
    import slothkit.trl
    from slothkit.notebook.config import NotebookConfig
    from slothkit.trl import defaults

    (cell,) = [
        c for c in render_notebook(template, "llama-3-8b").cells if f"trainer = {trainer_name}(" in c.source
    ]
    built = {}
    monkeypatch.setattr(slothkit.trl, trainer_name, lambda **kwargs: built.update(kwargs) or "the trainer")
    monkeypatch.setattr(slothkit.data, "train_on_responses_only", lambda trainer: ("responses only", trainer))
    config = NotebookConfig(
        model_name="m", batch_size=3, grad_accum=5, max_steps=7, learning_rate=1e-3, max_seq_length=333,
        output_dir=str(tmp_path),
    )  # fmt: skip
    namespace = {"model": None, "tokenizer": "the tokenizer", "dataset": "the data", "config": config}
    exec(cell.source, namespace)

    expected = getattr(defaults, make_config)(
        None,
        output_dir=f"{tmp_path}/checkpoints",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=5,
        max_steps=7,
        learning_rate=1e-3,
        max_length=333,
        save_strategy="no",
    )
    assert built.pop("args").to_dict() == expected.to_dict()
    assert built == {
        "model": None,
        "processing_class": "the tokenizer",
        "train_dataset": "the data",
        **({"ref_model": None} if template == "dpo" else {}),
    }
    wrapped = ("responses only", "the trainer") if template == "conversational" else "the trainer"
    assert namespace["trainer"] == wrapped


def _grpo_cell(marker):
    (cell,) = [c for c in render_notebook("grpo", "llama-3-8b").cells if marker in c.source]
    return cell


def test_grpo_train_cell_builds_the_config_slothkit_chooses(monkeypatch, tmp_path):
    """As for SFT and DPO: the GRPOConfig(...) the cell writes out is slothkit's grpo_config
    with the notebook config's values, generation settings included, and the trainer gets
    the notebook's reward functions."""
    import slothkit.trl
    from slothkit.notebook.config import NotebookConfig
    from slothkit.trl import defaults

    built = {}
    monkeypatch.setattr(slothkit.trl, "GRPOTrainer", lambda **kwargs: built.update(kwargs) or "the trainer")
    config = NotebookConfig(
        model_name="m", batch_size=3, grad_accum=5, max_steps=7, learning_rate=1e-3, max_seq_length=333,
        num_generations=3, max_completion_length=24, output_dir=str(tmp_path),
    )  # fmt: skip
    rewards = {"format_reward": object(), "correct_reward": object()}
    namespace = {
        "model": None,
        "tokenizer": "the tokenizer",
        "dataset": "the data",
        "config": config,
        **rewards,
    }
    exec(_grpo_cell("trainer = GRPOTrainer(").source, namespace)

    expected = defaults.grpo_config(
        None,
        output_dir=f"{tmp_path}/checkpoints",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=5,
        max_steps=7,
        learning_rate=1e-3,
        num_generations=3,
        max_completion_length=24,
        save_strategy="no",
    )
    args = built.pop("args")
    assert args.to_dict() == expected.to_dict()
    assert (args.num_generations, args.max_completion_length, args.generation_batch_size) == (3, 24, 15)
    assert built == {
        "model": None,
        "processing_class": "the tokenizer",
        "reward_funcs": [rewards["format_reward"], rewards["correct_reward"]],
        "train_dataset": "the data",
    }
    assert namespace["trainer"] == "the trainer"


def test_grpo_rewards_score_the_form_and_the_number_of_the_example_answers():
    """The reward cell's functions, called as GRPOTrainer calls them (conversational
    completions, the dataset's other columns and TRL's extras as keywords), on the answers
    of the math records the notebook trains on."""
    from slothkit.data import example_dataset

    namespace = {}
    exec(_grpo_cell("def correct_reward(").source, namespace)
    records = example_dataset("math")
    first = records[0]
    negative = next(r for r in records if r["answer"].startswith("-"))
    replies = [
        (first, f"<answer>{first['answer']}</answer>", 0.5, 2.0),
        (first, f"So it is <answer> {first['answer']} </answer>.", 0.5, 2.0),
        (first, f"<answer>{int(first['answer']) + 1}</answer>", 0.5, 0.0),
        (first, first["answer"], 0.0, 0.0),
        (first, "<answer>twenty-seven</answer>", 0.0, 0.0),
        (negative, f"<answer>{negative['answer']}</answer>", 0.5, 2.0),
        (negative, f"<answer>{negative['answer'][1:]}</answer>", 0.5, 0.0),
    ]
    keywords = {
        "prompts": [record["prompt"] for record, *_ in replies],
        "completions": [[{"role": "assistant", "content": text}] for _, text, *_ in replies],
        "completion_ids": [[1, 2]] * len(replies),
        "answer": [record["answer"] for record, *_ in replies],
        "trainer_state": None,
    }
    assert namespace["format_reward"](**keywords) == [form for *_, form, _ in replies]
    assert namespace["correct_reward"](**keywords) == [number for *_, number in replies]


class _Recorder:
    """Stands in for the trained model and its tokenizer in the save cells: records every
    save and push call, and answers a push with its commit URL."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getattr__(self, method):
        if not method.startswith(("save_", "push_")):
            raise AttributeError(method)

        def call(*args, **kwargs):
            self.calls.append((f"{self.name}.{method}", *args, kwargs))
            return types.SimpleNamespace(commit_url=f"https://hub/{args[0]}/commit/1")

        return call


def _run_save_cells(template, tmp_path, monkeypatch, environ=None, model_type=None, **settings):
    """The calls the save and publish cells make; model_type: the config's of the model (the
    vision cells ask whether its family's GGUF is written)."""
    from slothkit.notebook.config import NotebookConfig

    for name, value in {"WORLD_SIZE": "", "RANK": "", **(environ or {})}.items():
        monkeypatch.setenv(name, value)
    model = next(iter(models_for(template)))
    cells = [c.source for c in render_notebook(template, model).cells if c.cell_type == "code"]
    save, publish = cells[-2:]
    calls = []
    config = NotebookConfig(model_name="m", output_dir=str(tmp_path), hub_token="hf_x", **settings)
    recorder = _Recorder("model", calls)
    recorder.config = types.SimpleNamespace(model_type=model_type)
    namespace = {
        "model": recorder,
        "tokenizer": _Recorder("tokenizer", calls),
        "processor": _Recorder("processor", calls),
        "config": config,
    }
    exec(save, namespace)
    exec(publish, namespace)
    return calls


@pytest.mark.parametrize("template", sorted(set(TEMPLATES) - set(IMAGE_TEXT_TEMPLATES)))
def test_save_cells_call_each_save_and_push_behind_its_flag(template, tmp_path, monkeypatch, capsys):
    """The save and publish cells call the methods a user types (PEFT's save_pretrained and
    slothkit's save_pretrained_merged, save_pretrained_gguf, push_to_hub_merged and
    push_to_hub_gguf), each only when its Config flag asks, with the notebook's folders,
    quantisations, repo names and token."""
    out = str(tmp_path)
    calls = _run_save_cells(
        template,
        tmp_path,
        monkeypatch,
        save_merged=True,
        save_gguf=True,
        gguf_quants="q4_k_m,q8_0",
        hub_repo="me/m",
    )
    assert [call[:2] for call in calls] == [
        ("model.save_pretrained", f"{out}/lora"),
        ("tokenizer.save_pretrained", f"{out}/lora"),
        ("model.save_pretrained_merged", f"{out}/merged-16bit"),
        ("model.save_pretrained_gguf", f"{out}/gguf"),
        ("model.push_to_hub_merged", "me/m-lora"),
        ("model.push_to_hub_merged", "me/m"),
        ("model.push_to_hub_gguf", "me/m-gguf"),
    ]
    assert [call[2].name for call in calls[2:]] == ["tokenizer"] * 5  # every export gets the tokenizer
    assert [call[-1] for call in calls] == [
        {},
        {},
        {"save_method": "merged_16bit", "overwrite": True},
        {"quantization_method": "q4_k_m,q8_0", "overwrite": True},
        {"save_method": "lora", "token": "hf_x"},
        {"save_method": "merged_16bit", "token": "hf_x"},
        {"quantization_method": "q4_k_m,q8_0", "token": "hf_x"},
    ]
    assert "https://hub/me/m-gguf/commit/1" in capsys.readouterr().out

    # Flags off, no repo: only the adapter.
    calls = _run_save_cells(template, tmp_path, monkeypatch, save_merged=False, save_gguf=False, hub_repo="")
    assert [call[0] for call in calls] == ["model.save_pretrained", "tokenizer.save_pretrained"]
    # Under a launcher, process 1 writes and pushes nothing: process 0 does.
    calls = _run_save_cells(
        template, tmp_path, monkeypatch, {"WORLD_SIZE": "2", "RANK": "1"}, save_gguf=True, hub_repo="me/m"
    )
    assert calls == []


def test_vision_save_cells_save_the_adapter_merged_model_and_gguf_with_the_processor(
    tmp_path, monkeypatch, capsys
):
    """The vision notebook's save and publish cells: the adapter, the merged 16-bit model and
    the GGUF files (the language model's and the projector file), each written with the
    processor, each behind its flag."""
    out = str(tmp_path)
    calls = _run_save_cells(
        "vision", tmp_path, monkeypatch, model_type="gemma3", save_merged=True, save_gguf=True,
        gguf_quants="q4_k_m,q8_0", hub_repo="me/m",
    )  # fmt: skip
    assert [call[:2] for call in calls] == [
        ("model.save_pretrained", f"{out}/lora"),
        ("processor.save_pretrained", f"{out}/lora"),
        ("model.save_pretrained_merged", f"{out}/merged-16bit"),
        ("model.save_pretrained_gguf", f"{out}/gguf"),
        ("model.push_to_hub_merged", "me/m-lora"),
        ("model.push_to_hub_merged", "me/m"),
        ("model.push_to_hub_gguf", "me/m-gguf"),
    ]
    assert [call[2].name for call in calls[2:]] == ["processor"] * 5
    assert [call[-1] for call in calls[2:]] == [
        {"save_method": "merged_16bit", "overwrite": True},
        {"quantization_method": "q4_k_m,q8_0", "overwrite": True},
        {"save_method": "lora", "token": "hf_x"},
        {"save_method": "merged_16bit", "token": "hf_x"},
        {"quantization_method": "q4_k_m,q8_0", "token": "hf_x"},
    ]
    printed = capsys.readouterr().out
    assert "https://hub/me/m-gguf/commit/1" in printed and "not written" not in printed
    calls = _run_save_cells(
        "vision", tmp_path, monkeypatch, model_type="gemma3", save_lora=False, save_merged=False,
        save_gguf=False, hub_repo="me/m",
    )  # fmt: skip
    assert calls == [] and capsys.readouterr().out == ""


@pytest.mark.parametrize("family", ["mllama", "llava"])
@pytest.mark.parametrize("save_gguf", [True, False], ids=["SAVE_GGUF on", "SAVE_GGUF off"])
def test_vision_save_cells_skip_gguf_of_a_refused_family_saying_why_once(
    family, save_gguf, tmp_path, monkeypatch, capsys
):
    calls = _run_save_cells(
        "vision", tmp_path, monkeypatch, model_type=family, save_merged=True, save_gguf=save_gguf,
        hub_repo="me/m",
    )  # fmt: skip
    assert not [call for call in calls if "gguf" in call[0]]
    assert [call[0] for call in calls][-2:] == ["model.push_to_hub_merged"] * 2
    refusals = [line for line in capsys.readouterr().out.splitlines() if "GGUF files are not written" in line]
    assert len(refusals) == 1 and f"{family!r} is refused" in refusals[0]
    assert ("(SAVE_GGUF is on)" in refusals[0]) == save_gguf


def test_vision_notebooks_offer_gguf_where_the_writer_writes_the_family(monkeypatch):
    """SAVE_GGUF's default in a vision notebook is the GGUF writer's answer for its family:
    on for Gemma 3 and Qwen2.5-VL, off for the refused Llama 3.2 Vision; and off for
    Qwen2.5-VL where the writer knew its projector but not its language model (here
    pretended), with no notebook data changed."""
    from slothkit.export.gguf import image_text

    def save_gguf_line(model):
        (line,) = [line for line in render_text("vision", model).splitlines() if line.startswith("SAVE_GGUF")]
        return line.split("  #")[0]

    assert {model: save_gguf_line(model) for model in vision_model_data()} == {
        "gemma-3-4b": "SAVE_GGUF = True",
        "qwen2.5-vl-7b": "SAVE_GGUF = True",
        "llama-3.2-11b": "SAVE_GGUF = False",
    }
    monkeypatch.delitem(image_text.LANGUAGE_MODELS, "qwen2_5_vl")
    assert save_gguf_line("qwen2.5-vl-7b") == "SAVE_GGUF = False"


def test_vision_train_cell_builds_the_config_slothkit_chooses_with_the_collator(monkeypatch, tmp_path):
    """The vision notebook's SFTConfig(...) is slothkit's sft_config with the notebook config's
    values and the settings that pass the records to the collator untouched; the trainer gets
    the processor and a VisionDataCollator cut at the config's sequence length."""
    import slothkit
    import slothkit.trl
    from slothkit.notebook.config import NotebookConfig
    from slothkit.trl import defaults

    (cell,) = [
        c for c in render_notebook("vision", "gemma-3-4b").cells if "trainer = SFTTrainer(" in c.source
    ]
    built = {}
    monkeypatch.setattr(slothkit.trl, "SFTTrainer", lambda **kwargs: built.update(kwargs) or "the trainer")
    monkeypatch.setattr(slothkit, "VisionDataCollator", lambda *args, **kwargs: ("collator", args, kwargs))
    config = NotebookConfig(
        model_name="m", batch_size=3, grad_accum=5, max_steps=7, learning_rate=1e-3, max_seq_length=333,
        output_dir=str(tmp_path),
    )  # fmt: skip
    namespace = {"model": None, "processor": "the processor", "dataset": "the records", "config": config}
    exec(cell.source, namespace)

    expected = defaults.sft_config(
        None,
        output_dir=f"{tmp_path}/checkpoints",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=5,
        max_steps=7,
        learning_rate=1e-3,
        max_length=333,
        save_strategy="no",
        remove_unused_columns=False,
        dataset_text_field="",
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    assert built.pop("args").to_dict() == expected.to_dict()
    assert built == {
        "model": None,
        "processing_class": "the processor",
        "data_collator": ("collator", (None, "the processor"), {"max_seq_length": 333}),
        "train_dataset": "the records",
    }


def test_new_notebook_renders_the_vision_template_for_an_image_text_model(tmp_path, capsys):
    out = tmp_path / "nb"
    assert main(["new-notebook", "qwen2.5-vl-7b", "--template", "vision", "-o", str(out)]) == 0
    text = (tmp_path / "nb.py").read_text()
    assert 'MODEL_NAME = "Qwen/Qwen2.5-VL-7B-Instruct"' in text and "FastVisionModel.get_peft_model(" in text
    assert main(["new-notebook", "qwen2.5-vl-7b", "-o", str(out), "--force"]) == 2
    assert "unknown model 'qwen2.5-vl-7b' for the finetune template" in capsys.readouterr().err
