"""The notebook's config: the cell's variables, SLOTHKIT_* overrides, the GRPO-only fields."""

import pytest

from slothkit.notebook.config import NotebookConfig


def _cell(**values):
    return {"MODEL_NAME": "m", **values}


def test_generation_fields_are_read_from_the_cell_and_the_environment():
    config = NotebookConfig.from_cell(_cell(NUM_GENERATIONS=4, MAX_COMPLETION_LENGTH=64), environ={})
    assert (config.num_generations, config.max_completion_length) == (4, 64)
    environ = {"SLOTHKIT_NUM_GENERATIONS": "2", "SLOTHKIT_MAX_COMPLETION_LENGTH": "8"}
    config = NotebookConfig.from_cell(_cell(NUM_GENERATIONS=4, MAX_COMPLETION_LENGTH=64), environ=environ)
    assert (config.num_generations, config.max_completion_length) == (2, 8)
    with pytest.raises(ValueError, match="SLOTHKIT_NUM_GENERATIONS='four' is not a valid int"):
        NotebookConfig.from_cell(_cell(), environ={"SLOTHKIT_NUM_GENERATIONS": "four"})


def test_a_notebook_without_generation_neither_shows_nor_checks_those_fields(capsys):
    config = NotebookConfig.from_cell(_cell(), environ={})
    assert (config.num_generations, config.max_completion_length) == (None, None)
    config.show()
    printed = capsys.readouterr().out
    assert "model_name      m\n" in printed and "max_seq_length  2048\n" in printed
    assert "num_generations" not in printed and "max_completion_length" not in printed

    NotebookConfig.from_cell(_cell(NUM_GENERATIONS=4, MAX_COMPLETION_LENGTH=64), environ={}).show()
    printed = capsys.readouterr().out
    assert "num_generations        4\n" in printed and "max_completion_length  64\n" in printed


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"NUM_GENERATIONS": 1}, r"NUM_GENERATIONS = 1; expected an integer of at least 2"),
        ({"NUM_GENERATIONS": 2.0}, r"NUM_GENERATIONS = 2.0; expected an integer of at least 2"),
        ({"MAX_COMPLETION_LENGTH": 0}, r"MAX_COMPLETION_LENGTH = 0; expected a positive integer"),
        (
            {"NUM_GENERATIONS": 4, "BATCH_SIZE": 3, "GRAD_ACCUM": 2},
            r"BATCH_SIZE x GRAD_ACCUM = 6 completions per step is not a multiple of NUM_GENERATIONS = 4",
        ),
        ({"MAX_STEPS": True}, r"MAX_STEPS = True; expected a positive integer"),
        (
            {"SAVE_GGUF": True, "GGUF_QUANTS": "q4_k_m,q3_k_s"},
            r"GGUF_QUANTS = 'q4_k_m,q3_k_s': unknown GGUF quantization_method 'q3_k_s'; valid: 'f32'",
        ),
    ],
)
def test_bad_values_are_refused_with_the_variable_named(values, message):
    with pytest.raises(ValueError, match=message):
        NotebookConfig.from_cell(_cell(**values), environ={})


def test_gguf_quants_are_checked_only_when_gguf_files_are_saved():
    config = NotebookConfig.from_cell(_cell(SAVE_GGUF=False, GGUF_QUANTS="q3_k_s"), environ={})
    assert config.gguf_quants == "q3_k_s"
    config = NotebookConfig.from_cell(_cell(SAVE_GGUF=True, GGUF_QUANTS="Q4_K_M, q8_0"), environ={})
    assert config.gguf_quants == "Q4_K_M, q8_0"  # passed as written to quantization_method=


def test_whole_groups_per_step_are_accepted():
    config = NotebookConfig.from_cell(_cell(NUM_GENERATIONS=4, BATCH_SIZE=2, GRAD_ACCUM=6), environ={})
    assert config.batch_size * config.grad_accum % config.num_generations == 0


def test_the_panel_has_a_widget_per_shown_field():
    pytest.importorskip("ipywidgets")
    plain = NotebookConfig.from_cell(_cell(), environ={}).panel()
    grpo = NotebookConfig.from_cell(_cell(NUM_GENERATIONS=4, MAX_COMPLETION_LENGTH=64), environ={})
    panel = grpo.panel()
    assert len(panel.children) == len(plain.children) + 2
    (widget,) = [w for w in panel.children if w.description == "num_generations"]
    assert type(widget).__name__ == "IntText" and widget.value == 4
    widget.value = 8
    assert grpo.num_generations == 8


def test_the_hub_token_is_never_printed(capsys):
    config = NotebookConfig(model_name="x", hub_token="hf_secretvalue")
    assert "hf_secretvalue" not in repr(config) and "hf_secretvalue" not in str(config)
    config.show()
    shown = capsys.readouterr().out
    assert "hf_secretvalue" not in shown and "***" in shown
