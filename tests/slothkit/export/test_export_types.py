"""Every export type is a complete record: writer, push counterpart, and every reader of the
table (the save dispatch, the model methods, `slothkit export --to`) enrols it."""

from __future__ import annotations

import inspect

import pytest

from slothkit.cli import build_parser
from slothkit.export import EXPORT_TARGETS, SAVE_METHODS, attach_export_methods, save
from slothkit.export.export_types import EXPORT_TYPES, ExportType


@pytest.mark.parametrize("export", EXPORT_TYPES.values(), ids=lambda export: export.name)
def test_each_export_type_has_a_writer_and_a_push_counterpart(export: ExportType):
    writer = export.function(export.save)
    push = export.function(export.push)
    assert callable(writer) and callable(push)
    # The writer takes a folder, its push counterpart a repo; both the model first.
    assert list(inspect.signature(writer).parameters)[:2] == ["model", "save_directory"]
    assert list(inspect.signature(push).parameters)[:2] == ["model", "repo_id"]
    assert export.holds and export.name in EXPORT_TARGETS
    if export.save == "save_pretrained_merged":
        assert export.name in SAVE_METHODS
        assert callable(save.FOLDER_WRITERS[export.name]), "add its folder writer to save.FOLDER_WRITERS"
        assert export.push == "push_to_hub_merged"


def test_the_save_dispatch_writes_exactly_the_types_save_pretrained_merged_writes():
    assert set(save.FOLDER_WRITERS) == set(SAVE_METHODS)
    assert SAVE_METHODS == ("merged_16bit", "merged_4bit", "lora")
    with pytest.raises(ValueError, match="'merged_16bit', 'merged_4bit', 'lora'.*save_pretrained_gguf"):
        save.check_save_method("gguf")


def test_the_model_gets_each_types_save_and_push_method(make_lora_model):
    model, _, _ = make_lora_model("llama")
    attach_export_methods(model)
    for export in EXPORT_TYPES.values():
        assert export.save in vars(model) and export.push in vars(model), export.name


def test_the_export_command_offers_every_export_type():
    parser = build_parser()
    for name in EXPORT_TYPES:
        assert parser.parse_args(["export", "adapter", "--to", name]).to == name
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "adapter", "--to", "onnx"])
