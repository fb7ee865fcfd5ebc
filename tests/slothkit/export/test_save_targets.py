"""Save targets that are not a plain folder: a symbolic link to one, a mount point (which
cannot be renamed over), a read-only mount."""

import os
import subprocess

import pytest

from slothkit.export import save_pretrained_merged


def _mounted_tmpfs(folder, read_only=False):
    """A tmpfs mounted at `folder`, or a skip where this process may not mount (not root, a
    container without the capability)."""
    folder.mkdir()
    options = "size=64m" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0 or not os.path.ismount(folder):
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return folder


@pytest.fixture
def mount_point(tmp_path):
    folder = _mounted_tmpfs(tmp_path / "volume")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


@pytest.fixture
def read_only_mount_point(tmp_path):
    folder = _mounted_tmpfs(tmp_path / "read-only", read_only=True)
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_a_save_into_a_mount_point_moves_its_files_in(make_lora_model, mount_point):
    """It failed with "[Errno 16] Device or resource busy" after all its work: the staged
    folder cannot be renamed over a mount point. Now each file is moved in; an overwrite
    with another save method replaces the first save's files and keeps the user's."""
    model, tokenizer, _ = make_lora_model("llama")
    save_pretrained_merged(model, mount_point, tokenizer, save_method="lora")
    assert (mount_point / "adapter_model.safetensors").is_file()
    (mount_point / "notes.txt").write_text("mine")
    save_pretrained_merged(model, mount_point, tokenizer, save_method="merged_16bit", overwrite=True)
    names = set(os.listdir(mount_point))
    assert {"model.safetensors", "config.json", "notes.txt"} <= names
    assert "adapter_model.safetensors" not in names and "adapter_config.json" not in names
    assert not [n for n in names if "partial" in n]  # no staging folder left
    assert (mount_point / "notes.txt").read_text() == "mine"


def test_a_read_only_mount_point_is_named(make_lora_model, read_only_mount_point):
    model, tokenizer, _ = make_lora_model("llama")
    with pytest.raises(OSError, match=r"cannot save there: '.*read-only' is on a read-only filesystem"):
        save_pretrained_merged(model, read_only_mount_point, tokenizer, save_method="lora")


def test_a_link_to_a_folder_is_saved_through_and_stays_a_link(make_lora_model, tmp_path):
    """It failed with "[Errno 20] Not a directory" (the rename met the link)."""
    model, tokenizer, _ = make_lora_model("llama")
    real, link = tmp_path / "drive" / "run-1", tmp_path / "run-1"
    real.mkdir(parents=True)
    link.symlink_to(real)
    save_pretrained_merged(model, link, tokenizer, save_method="lora")
    assert link.is_symlink() and (real / "adapter_model.safetensors").is_file()
    save_pretrained_merged(model, link, tokenizer, save_method="lora", overwrite=True)
    assert link.is_symlink() and sorted(os.listdir(real)) == sorted(os.listdir(link))
