"""Every record brings what the per-family tests and the notebooks need beside it: a tiny
fixture flavour (slothkit.testing.tiny_models builds the family from its record's `tiny`
traits, in a tokenizer flavour and a chat format it has, and its "tiny-<name>" shape) and a notebook entry (templates/models.json, keyed by
one of its shapes). The tests that run "each family" parametrise over the records
(slothkit.testing.FUSED_FAMILIES), so a record lacking either would go untested or
unlisted; this says what to add and where."""

import dataclasses
import inspect
import pathlib
import sys

import pytest

import slothkit
from slothkit.models import RECORDS, Architecture, architecture_named
from slothkit.notebook.render import model_data
from slothkit.testing import TOKENIZER_FLAVOURS
from slothkit.testing.tiny_chat_templates import CHAT_FORMATS as TINY_CHAT_FORMATS


def _record_file(arch: Architecture) -> str:
    """The file that defines the record, relative to the repository root."""
    root = pathlib.Path(slothkit.__file__).parent.parent
    for name, module in list(sys.modules.items()):
        if name.startswith("slothkit.models.") and any(value is arch for value in vars(module).values()):
            return pathlib.Path(inspect.getfile(module)).relative_to(root).as_posix()
    return f"slothkit/models/{arch.name}.py"


def missing_parts(arch: Architecture, notebook_models: dict[str, dict]) -> list[str]:
    """What the family of `arch` lacks beside its record, each as what to add and where."""
    where = _record_file(arch)
    missing = []
    tiny_shape = f"tiny-{arch.name}"
    if tiny_shape not in arch.shapes:
        missing.append(
            f"{arch.name}: no tiny fixture flavour: add a Shape named {tiny_shape!r} (hidden 64, 2 layers, "
            f"as the other records' tiny shapes) to the record's `shapes` in {where}"
        )
    if arch.tiny.tokenizer not in TOKENIZER_FLAVOURS:
        missing.append(
            f"{arch.name}: its tiny fixture's tokenizer {arch.tiny.tokenizer!r} is no flavour of "
            f"slothkit.testing.tiny_tokenizers; set `tiny=TinyTraits(tokenizer=...)` in {where} to one of "
            f"{', '.join(TOKENIZER_FLAVOURS)}"
        )
    if arch.tiny.chat_format not in TINY_CHAT_FORMATS:
        missing.append(
            f"{arch.name}: no tiny fixture chat template in its format {arch.tiny.chat_format!r}: set "
            f"`tiny=TinyTraits(chat_format=...)` in {where} to one of {', '.join(TINY_CHAT_FORMATS)}, or add "
            "a writer for the format to slothkit/testing/tiny_chat_templates.py"
        )
    if not any(name in arch.shapes for name in notebook_models):
        real = [name for name in arch.shapes if not name.startswith("tiny-")]
        fields = ", ".join(next(iter(notebook_models.values())))
        missing.append(
            f"{arch.name}: no notebook entry: add one to templates/models.json keyed by one of the shapes "
            f"of its record in {where} ({', '.join(real) or 'add a real checkpoint shape first'}), "
            f"with the fields every entry has ({fields})"
        )
    return missing


@pytest.mark.parametrize("arch", RECORDS, ids=lambda a: a.name)
def test_every_record_has_a_tiny_flavour_and_a_notebook_entry(arch):
    assert missing_parts(arch, model_data()) == []


def test_a_record_without_them_is_told_what_to_add_and_where():
    llama = architecture_named("llama")
    bare = dataclasses.replace(
        llama,
        name="newfam",
        tiny=dataclasses.replace(llama.tiny, tokenizer="wordpiece", chat_format="vicuna"),
        shapes={"newfam-7b": llama.shapes["llama-3-8b"]},
    )
    missing = missing_parts(bare, model_data())
    assert len(missing) == 4
    assert missing[0].startswith("newfam: no tiny fixture flavour: add a Shape named 'tiny-newfam'")
    assert "'wordpiece' is no flavour" in missing[1] and "bpe, qwen, sentencepiece" in missing[1]
    assert "format 'vicuna'" in missing[2] and "slothkit/testing/tiny_chat_templates.py" in missing[2]
    assert missing[3].startswith("newfam: no notebook entry: add one to templates/models.json")
    assert "(newfam-7b)" in missing[3] and "display_name" in missing[3]
    assert all("slothkit/models/" in message for message in missing)
