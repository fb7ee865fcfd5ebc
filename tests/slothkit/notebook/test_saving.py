"""The save cell's listing of what it wrote."""

from slothkit.notebook.saving import list_files


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
