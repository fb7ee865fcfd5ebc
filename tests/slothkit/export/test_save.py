"""save_pretrained_merged: what each save method writes, and how saving fails safely."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slothkit.core.model_state import attach_state
from slothkit.export import SAVE_METHODS, DirectoryNotEmptyError, save_pretrained_merged
from slothkit.export import atomic as atomic_module
from slothkit.export.atomic import atomic_directory
from slothkit.export.merge import merged_state_dict
from slothkit.testing import FUSED_FAMILIES

ARCHS = FUSED_FAMILIES
SAME = 1e-4
END_OF_TURN = {"llama": "<|eot_id|>", "mistral": "</s>", "gemma": "<end_of_turn>"}


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_adapter_reloads_in_plain_peft(
    arch, make_lora_model, input_ids, logits, relative_error, tmp_path
):
    from peft import PeftModel

    model, tokenizer, path = make_lora_model(arch, seed=10, lora_alpha=16)
    result = save_pretrained_merged(model, tmp_path / "adapter", tokenizer, save_method="lora")
    assert result.merge_source is None
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result.files)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 16, str(path))

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")  # plain peft, no slothkit
    assert relative_error(logits(reloaded, input_ids), logits(model, input_ids)) < SAME


@pytest.mark.parametrize("save_method", SAVE_METHODS)
def test_every_save_writes_tokenizer_chat_template_generation_config_and_card(
    save_method, make_lora_model, tmp_path
):
    model, tokenizer, path = make_lora_model("llama", seed=11)
    out = tmp_path / "out"
    save_pretrained_merged(model, out, tokenizer, save_method=save_method,
                           training_settings={"learning_rate": 2e-4, "epochs": 3})  # fmt: skip

    reloaded = AutoTokenizer.from_pretrained(out)
    assert reloaded.chat_template == tokenizer.chat_template
    assert reloaded("The lighthouse keeper")["input_ids"] == tokenizer("The lighthouse keeper")["input_ids"]

    generation = json.loads((out / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    assert tokenizer.eos_token_id in eos
    assert tokenizer.convert_tokens_to_ids(END_OF_TURN["llama"]) in eos  # the chat turn ends generation
    assert generation["pad_token_id"] == tokenizer.pad_token_id

    card = (out / "README.md").read_text()
    for fact in (str(path), f"`{save_method}`", "| r | 4 |", "| lora_alpha | 8 |", "`q_proj`", "`down_proj`",
                 "| learning_rate | 0.0002 |", "| epochs | 3 |", "chat template | included"):  # fmt: skip
        assert fact in card, fact
    assert "base_model:" not in card.split("---")[1]  # a local path is no Hub id: body only
    if save_method == "merged_4bit":
        assert "bitsandbytes 4-bit NF4" in card


@pytest.mark.parametrize("arch", ["mistral", "gemma"])
def test_end_of_turn_token_joins_the_eos_list(arch, make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model(arch)
    save_pretrained_merged(model, tmp_path / "out", tokenizer, save_method="lora")
    eos = json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids(END_OF_TURN[arch]) in (eos if isinstance(eos, list) else [eos])


def test_merged_4bit_loads_back_with_bitsandbytes_on_cpu(
    make_lora_model, input_ids, logits, relative_error, tmp_path
):
    import bitsandbytes.functional as bnbf

    model, tokenizer, _ = make_lora_model("mistral", load_in_4bit=True, seed=12)
    save_pretrained_merged(model, tmp_path / "q", tokenizer, save_method="merged_4bit", base_weights=None)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    assert config["quantization_config"]["bnb_4bit_use_double_quant"] is True

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")  # transformers + bitsandbytes, CPU
    merged, _ = merged_state_dict(model, base_weights=None)
    # Each 4-bit weight is exactly NF4(merged W): dequantising what was loaded gives the same
    # tensor as quantising the merged fp32 weight here.
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        param = loaded.get_parameter(name)
        assert type(param).__name__ == "Params4bit"
        requantized = bnbf.dequantize_4bit(*bnbf.quantize_4bit(
            merged[name], blocksize=param.quant_state.blocksize, compress_statistics=True, quant_type="nf4"))  # fmt: skip
        assert torch.equal(bnbf.dequantize_4bit(param.data, param.quant_state), requantized)

    # Documented tolerance against the 4-bit LoRA model: re-quantising W + s*B@A to NF4 rounds
    # every projection again, which on these 2-layer random models moves the logits by about
    # 0.32 of their largest magnitude (measured); the exact check above is the real test.
    assert relative_error(logits(loaded, input_ids), logits(model, input_ids)) < 0.5


def test_unknown_save_method_lists_the_valid_ones(make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama")
    with pytest.raises(ValueError, match="'merged_16bit', 'merged_4bit', 'lora'"):
        save_pretrained_merged(model, tmp_path / "x", tokenizer, save_method="merged_8bit")
    with pytest.raises(ValueError, match="save_pretrained_gguf"):
        save_pretrained_merged(model, tmp_path / "x", tokenizer, save_method="gguf")
    with pytest.raises(ValueError, match="'mxfp4' is not one of .*no MXFP4 checkpoint: 'merged_16bit'"):
        save_pretrained_merged(model, tmp_path / "x", tokenizer, save_method="mxfp4")
    assert not (tmp_path / "x").exists()


def test_missing_tokenizer_is_an_error(make_lora_model, tmp_path):
    model, _, _ = make_lora_model("llama")
    attach_state(model).tokenizer = None
    with pytest.raises(ValueError, match="pass the tokenizer"):
        save_pretrained_merged(model, tmp_path / "x")


def test_non_empty_directory_is_refused_unless_overwrite(make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama")
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(DirectoryNotEmptyError, match="overwrite=True"):
        save_pretrained_merged(model, target, tokenizer)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]

    save_pretrained_merged(model, target, tokenizer, overwrite=True)
    names = {p.name for p in target.iterdir()}
    # overwrite replaces slothkit's outputs only: the user's file stays (PEFT's save keeps it too)
    assert "notes.txt" in names and "model.safetensors" in names
    assert (target / "notes.txt").read_text() == "keep me"
    assert _siblings(target) == []  # no staging or replaced folder left behind

    (tmp_path / "empty").mkdir()  # an empty folder is no data to lose
    save_pretrained_merged(model, tmp_path / "empty", tokenizer, save_method="lora")
    assert (tmp_path / "empty" / "adapter_config.json").is_file()


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_interrupted_save_leaves_the_old_contents_or_nothing(
    interruption, existing, make_lora_model, monkeypatch, tmp_path
):
    import safetensors.torch

    model, tokenizer, _ = make_lora_model("llama")
    target = tmp_path / "out"
    if existing:
        save_pretrained_merged(model, target, tokenizer, save_method="lora")
        before = {p.name: p.read_bytes() for p in target.iterdir()}

    real_save_file = safetensors.torch.save_file

    def save_half_then_fail(tensors, filename, metadata=None):
        real_save_file(dict(list(tensors.items())[:1]), filename, metadata=metadata)  # a partial file exists
        raise interruption("interrupted mid-write")

    monkeypatch.setattr(safetensors.torch, "save_file", save_half_then_fail)
    with pytest.raises(interruption, match="mid-write"):
        save_pretrained_merged(model, target, tokenizer, save_method="merged_16bit", overwrite=True)

    if existing:
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    else:
        assert not target.exists()
    assert _siblings(target) == []


def test_sharded_checkpoint_loads(make_lora_model, input_ids, logits, assert_merged_16bit, tmp_path):
    model, tokenizer, _ = make_lora_model("gemma", seed=13)
    result = save_pretrained_merged(model, tmp_path / "m", tokenizer, max_shard_size="200KB")
    shards = [f for f in result.files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in result.files
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert_merged_16bit(tmp_path / "m", model, tokenizer, logits(model, input_ids))


@pytest.mark.parametrize(
    ("held_in", "asked", "stored"),
    [
        (torch.float32, None, torch.bfloat16),  # a model held in float32 (as on a CPU): bfloat16
        (torch.bfloat16, None, torch.bfloat16),  # else the model's own 16-bit dtype
        (torch.float16, None, torch.float16),
        (torch.float32, torch.float16, torch.float16),  # or the 16-bit dtype asked for
        (torch.bfloat16, "fp16", torch.float16),
    ],
)
def test_merged_16bit_writes_16bit_weights(held_in, asked, stored, make_lora_model, tmp_path):
    """Two bytes a weight, whatever dtype the model was held in: 538 MB of float32 for a
    135M-parameter model was the bug."""
    from safetensors import safe_open

    from slothkit.export.disk_space import checkpoint_parameter_count

    model, tokenizer, base = make_lora_model("llama", dtype=held_in, seed=15)
    result = save_pretrained_merged(model, tmp_path / "m", tokenizer, dtype=asked)
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as weights:
        dtypes = {weights.get_tensor(name).dtype for name in weights.keys()}
    assert dtypes == {stored}
    parameters = checkpoint_parameter_count(base)  # the merge adds no tensor to the base's
    assert checkpoint_parameter_count(tmp_path / "m") == parameters
    header = 64 * 1024  # safetensors' JSON header, far smaller for these tensors
    assert 2 * parameters < (tmp_path / "m" / "model.safetensors").stat().st_size < 2 * parameters + header
    name = str(stored).removeprefix("torch.")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == name
    assert f"{name} safetensors, not quantised" in (tmp_path / "m" / "README.md").read_text()
    assert result.save_method == "merged_16bit"


def test_merged_16bit_refuses_a_dtype_that_is_not_16bit(make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama")
    for dtype in (torch.float32, "fp32"):
        with pytest.raises(ValueError, match=r"merged_16bit.*dtype=torch\.float32 is not 16-bit; accepted: "):
            save_pretrained_merged(model, tmp_path / "m", tokenizer, dtype=dtype)
    assert not (tmp_path / "m").exists()


def test_overwrite_without_atomic_exchange_still_replaces(monkeypatch, tmp_path):
    # Systems without renameat2 take the rename-aside path.
    monkeypatch.setattr(atomic_module, "_exchange", lambda a, b: False)
    target = tmp_path / "t"
    target.mkdir()
    (target / "old").write_text("old")
    with atomic_directory(target, overwrite=True) as staging:
        (staging / "new").write_text("new")
        assert (target / "old").exists()  # untouched until the block completes
    assert [p.name for p in target.iterdir()] == ["new"]
    assert _siblings(target) == []


def test_atomic_directory_refuses_a_file_target(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"), atomic_directory(tmp_path / "f"):
        pass


def test_overwrite_replaces_the_model_files_and_keeps_everything_else(make_lora_model, tmp_path):
    model, tokenizer, _ = make_lora_model("llama", seed=14)
    target = tmp_path / "out"
    merged = save_pretrained_merged(model, target, tokenizer, max_shard_size="200KB")
    assert "model.safetensors.index.json" in merged.files
    (target / "notes.md").write_text("what I tried")
    (target / "scripts").mkdir()
    (target / "scripts" / "train.py").write_text("print('train')")

    lora = save_pretrained_merged(model, target, tokenizer, save_method="lora", overwrite=True)
    names = sorted(p.name for p in target.iterdir())
    assert names == sorted({*lora.files, "notes.md", "scripts"})
    # Nothing of the merged model is left to be mistaken for part of the adapter's folder.
    assert "config.json" not in names and "model.safetensors.index.json" not in names
    assert [n for n in names if n.endswith(".safetensors")] == ["adapter_model.safetensors"]
    assert (target / "notes.md").read_text() == "what I tried"
    assert (target / "scripts" / "train.py").read_text() == "print('train')"
    assert _siblings(target) == []


def test_overwrite_refuses_to_replace_a_folder_with_a_file(make_lora_model, tmp_path):
    """A user's folder named like a file the save writes (here adapter_model.safetensors/)
    is not replaced by that file: the save is refused naming it, and nothing changes."""
    model, tokenizer, _ = make_lora_model("llama", seed=16)
    target = tmp_path / "out"
    (target / "adapter_model.safetensors").mkdir(parents=True)
    (target / "adapter_model.safetensors" / "notes.md").write_text("mine")
    (target / "config.json").write_text("{}")
    with pytest.raises(
        IsADirectoryError,
        match=rf"'{target}/adapter_model.safetensors' is a folder, and this save writes a file of that name",
    ):
        save_pretrained_merged(model, target, tokenizer, save_method="lora", overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["adapter_model.safetensors", "config.json"]
    assert (target / "adapter_model.safetensors" / "notes.md").read_text() == "mine"
    assert (target / "config.json").read_text() == "{}"
    assert _siblings(target) == []


def test_the_working_folder_and_those_above_it_are_refused(make_lora_model, tmp_path, monkeypatch):
    """save_pretrained_merged(".", overwrite=True) failed with EBUSY: a save replaces its
    folder whole, which would take the working directory out from under the process."""
    from slothkit.export.atomic import OverlappingPathsError

    model, tokenizer, _ = make_lora_model("llama", seed=17)
    work = tmp_path / "project" / "run"
    work.mkdir(parents=True)
    (work / "notes.md").write_text("mine")
    monkeypatch.chdir(work)
    for target in (".", str(work), str(tmp_path / "project")):
        with pytest.raises(OverlappingPathsError, match="this process works in .* save into a subfolder"):
            save_pretrained_merged(model, target, tokenizer, save_method="lora", overwrite=True)
    assert [p.name for p in work.iterdir()] == ["notes.md"]
    save_pretrained_merged(model, "model", tokenizer, save_method="lora")
    assert (work / "model" / "adapter_config.json").is_file()


def test_overwrite_keeps_the_users_readme_and_writes_the_card_beside_it(make_lora_model, tmp_path):
    """A README.md slothkit did not write stays (PEFT keeps it too); the card goes to
    README.slothkit.md, said once, and is replaced by the next save. An earlier slothkit
    card in README.md is replaced like every saved file."""
    model, tokenizer, _ = make_lora_model("llama", seed=15)
    target = tmp_path / "out"
    target.mkdir()
    (target / "README.md").write_text("# My experiment\n\nNotes I want to keep.\n")
    with pytest.warns(
        UserWarning, match="kept your .*README.md'; slothkit's model card .* README.slothkit.md"
    ):
        save_pretrained_merged(model, target, tokenizer, save_method="lora", overwrite=True)
    assert (target / "README.md").read_text() == "# My experiment\n\nNotes I want to keep.\n"
    assert "Saved with [slothkit]" in (target / "README.slothkit.md").read_text()
    save_pretrained_merged(model, target, tokenizer, save_method="lora", overwrite=True)
    assert (target / "README.md").read_text().startswith("# My experiment")

    card_only = tmp_path / "card"
    save_pretrained_merged(model, card_only, tokenizer, save_method="lora")
    save_pretrained_merged(model, card_only, tokenizer, save_method="lora", overwrite=True)
    assert "Saved with [slothkit]" in (card_only / "README.md").read_text()
    assert not (card_only / "README.slothkit.md").exists()


def test_save_refuses_to_replace_the_base_checkpoint_it_was_loaded_from(tmp_path):
    from slothkit import FastModel
    from slothkit.testing import build_tiny_model

    base = build_tiny_model("llama", tmp_path / "base")
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    model, tokenizer = FastModel.from_pretrained(str(base), load_in_4bit=False, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    for target, how in ((base, "is"), (base / "merged", "is inside"), (tmp_path, "contains")):
        with pytest.raises(ValueError, match=f"{how} the adapter's base model"):
            save_pretrained_merged(model, target, tokenizer, overwrite=True)
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    assert not (base / "merged").exists()
