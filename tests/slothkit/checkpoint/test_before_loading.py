"""A local checkpoint that cannot be read is named with what is wrong, before transformers
tries it (its own messages say "no such directory" or "No such file" for files that are
there); bitsandbytes' notice about an optional Hub kernel never reaches a user."""

import builtins
import errno
import os
import shutil

import pytest

from slothkit import FastModel
from slothkit.checkpoint import before_loading
from slothkit.testing import tiny_model_path

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_model_path("llama"), folder)
    return folder


def test_an_invalid_config_json_is_named_not_called_missing(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(
        ValueError, match=r"config\.json' is not valid JSON \(.*\); the checkpoint's config is damaged"
    ) as error:
        FastModel.from_pretrained(str(checkpoint))
    assert "no such directory" not in str(error.value)
    (checkpoint / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not the object a config is"):
        FastModel.from_pretrained(str(checkpoint))


def test_an_unreadable_weights_file_is_named_with_the_reason(checkpoint, monkeypatch):
    weights = checkpoint / "model.safetensors"

    def denied(path, *args, **kwargs):
        if os.fspath(path) == str(weights):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(before_loading, "open", denied, raising=False)  # root reads any file: denied here
    with pytest.raises(
        PermissionError, match=rf"cannot read '{weights}': Permission denied; make it readable"
    ):
        FastModel.from_pretrained(str(checkpoint))


@pytest.mark.skipif(IS_ROOT, reason="root reads files whatever their mode")
def test_a_weights_file_without_read_permission_is_named(checkpoint):
    (checkpoint / "model.safetensors").chmod(0)
    with pytest.raises(PermissionError, match="model.safetensors': Permission denied"):
        FastModel.from_pretrained(str(checkpoint))


def test_a_cut_short_or_dangling_weights_file_is_named(checkpoint):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4])  # a download that stopped
    with pytest.raises(ValueError, match=r"is not a complete safetensors file \(4 bytes\).*did not finish"):
        FastModel.from_pretrained(str(checkpoint))
    weights.unlink()
    weights.symlink_to(checkpoint / "gone" / "model.safetensors")
    with pytest.raises(
        FileNotFoundError, match=r"is a link to '.*gone/model.safetensors', which does not exist"
    ):
        FastModel.from_pretrained(str(checkpoint))


def test_a_weights_file_cut_inside_its_tensors_or_with_a_garbled_header_is_named(checkpoint):
    """Cut after its header (the header whole, the tensors not): safetensors' own
    "incomplete metadata, file not fully covered" named nothing; a header that is not
    safetensors' JSON table: named too."""
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError,
        match=rf"is not a complete safetensors file \({len(data) // 2} bytes of the {len(data)} its header lists\)",
    ):
        FastModel.from_pretrained(str(checkpoint))
    length = int.from_bytes(data[:8], "little")
    weights.write_bytes(data[:8] + b"\xff" * length + data[8 + length :])  # overwritten bytes
    with pytest.raises(ValueError, match="is not a safetensors file: its header is not the JSON table"):
        FastModel.from_pretrained(str(checkpoint))


def test_an_adapter_export_names_a_damaged_base_before_loading(checkpoint, tmp_path):
    import json

    from slothkit.export import export_adapter

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(checkpoint)}))
    import torch
    from safetensors.torch import save_file

    save_file({"stand_in": torch.zeros(1)}, adapter / "adapter_model.safetensors")  # a readable file
    (checkpoint / "config.json").write_text("not json")
    with pytest.raises(ValueError, match=r"config\.json' is not valid JSON"):
        export_adapter(adapter, "merged_16bit", output=tmp_path / "out")


@pytest.mark.parametrize(
    "logger_name, notice, kept",
    [
        (
            before_loading.BITSANDBYTES_CPU_LOGGER,
            before_loading.BITSANDBYTES_KERNEL_NOTICE + ": %s. Please make sure ...",
            "Failed to load the CPU library",
        ),
        (
            before_loading.KERNELS_HUB_LOGGER,
            before_loading.KERNELS_OFFLINE_NOTICE + " because Hugging Face Hub is in offline mode. %s",
            "Skipping publisher trust check for 'someone/else'",
        ),
    ],
    ids=["bitsandbytes", "kernels-offline"],
)
def test_the_optional_kernel_notices_are_dropped_and_those_loggers_other_records_kept(
    logger_name, notice, kept
):
    import logging

    logger = logging.getLogger(logger_name)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append  # a logger's filters run before its handlers
    logger.addHandler(handler)
    try:
        before_loading.quiet_bitsandbytes_kernel_notice()  # a second call adds no second filter
        logger.warning(notice, "No module named 'x'")
        logger.warning(kept)
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in seen] == [kept]
    assert len(logger.filters) == 1


@pytest.mark.slow
def test_importing_bitsandbytes_after_slothkit_prints_nothing(tmp_path):
    """The notice as bitsandbytes prints it, on a CPU where it does (AVX512-BF16, without
    the `kernels` package), and not once slothkit's loading module is imported."""
    import subprocess
    import sys

    def stderr_of(code):
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
        ).stderr

    bare = stderr_of("import bitsandbytes")
    if before_loading.BITSANDBYTES_KERNEL_NOTICE not in bare:
        pytest.skip("bitsandbytes prints no kernel notice on this machine")
    assert stderr_of("import slothkit.checkpoint.before_loading, bitsandbytes") == ""
