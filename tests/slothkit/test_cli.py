"""The command line: parsing, the environment report, and the embedded demo."""

import pytest

from slothkit.cli import build_parser, main


def test_env_reports_versions(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "GPU:" in out


def test_unknown_command_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as excinfo:
        build_parser().parse_args(["no-such-command"])
    assert excinfo.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_trains_and_saves_adapter(tmp_path, capsys):
    from peft import PeftConfig

    assert main(["demo", "--output-dir", str(tmp_path), "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "adapter saved" in out
    adapter = tmp_path / "lora-adapter"
    config = PeftConfig.from_pretrained(adapter)
    assert set(config.target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
