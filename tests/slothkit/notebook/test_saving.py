"""The save cell's listing of what it wrote, and whether a vision notebook writes GGUF."""

import types

import pytest

from slothkit.notebook.saving import image_text_gguf_wanted, list_files


def test_list_files_prints_each_file_with_its_size_and_leaves_out_checkpoints(tmp_path, capsys):
    sizes = {
        "gguf/Modelfile": 295,
        "gguf/m.Q8_0.gguf": 144_810_880,
        "lora/adapter_model.safetensors": 19_593_064,
        "merged-16bit/model.safetensors": 1_500_000_000,
        "checkpoints/runs/events": 10,
    }
    for name, size in sizes.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            file.truncate(size)  # sparse: the sizes without the bytes

    listed = list_files(tmp_path)
    assert [path.relative_to(tmp_path).as_posix() for path in listed] == sorted(
        set(sizes) - {"checkpoints/runs/events"}
    )
    assert capsys.readouterr().out.splitlines() == [
        "gguf/Modelfile                     295 B",
        "gguf/m.Q8_0.gguf                  145 MB",
        "lora/adapter_model.safetensors     20 MB",
        "merged-16bit/model.safetensors    1.5 GB",
    ]
    assert list_files(tmp_path / "nothing-saved") == [] and capsys.readouterr().out == ""


def _model(family):
    """A PeftModel's outline: the image-text model inside, with its config."""
    inner = types.SimpleNamespace(config=types.SimpleNamespace(model_type=family))
    return types.SimpleNamespace(get_base_model=lambda: inner)


@pytest.mark.parametrize("save_gguf", [True, False])
def test_gguf_is_written_for_gemma3_as_save_gguf_says_without_a_word(save_gguf, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert image_text_gguf_wanted(_model("gemma3"), save_gguf) is save_gguf
    assert capsys.readouterr().out == ""


def test_a_refused_family_says_why_on_the_saving_process_only(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert image_text_gguf_wanted(_model("mllama"), True) is False
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("GGUF files are not written (SAVE_GGUF is on): ") and "'mllama' is refused" in line
    assert image_text_gguf_wanted(_model("llava"), False) is False
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("GGUF files are not written: ") and "'llava' is refused" in line
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert image_text_gguf_wanted(_model("mllama"), True) is False
    assert capsys.readouterr().out == ""
