"""The command line: parsing, the environment report, and the embedded demo."""

import re
import shutil

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


def test_demo_trains_and_saves_adapter(tmp_path, capsys, reference_kernels):
    """As on a user's CPU (no Triton interpreter): the Hugging Face modules train."""
    from peft import PeftConfig

    assert main(["demo", "--quick", "--output-dir", str(tmp_path), "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "adapter saved" in out
    adapter = tmp_path / "lora-adapter"
    config = PeftConfig.from_pretrained(adapter)
    assert set(config.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0


def test_demo_renders_and_runs_a_notebook_to_adapter_merged_and_gguf(tmp_path, capsys):
    # The README's main command with --tiny: a notebook rendered from a template and
    # executed on the tiny offline model of its architecture, ending in the three exports.
    import gguf
    import nbformat
    from peft import PeftConfig
    from transformers import AutoModelForCausalLM

    pytest.importorskip("nbconvert", reason="--html needs nbconvert (slothkit[dev])")
    out = tmp_path / "demo"
    assert main(["demo", "--tiny", "--output-dir", str(out), "--steps", "8", "--html"]) == 0
    printed = capsys.readouterr().out
    assert "training loss" in printed
    outputs = out / "outputs"
    assert PeftConfig.from_pretrained(outputs / "lora").peft_type == "LORA"
    merged = AutoModelForCausalLM.from_pretrained(outputs / "merged-16bit")
    assert merged.config.model_type == "llama"
    (gguf_file,) = (outputs / "gguf").glob("*.gguf")
    reader = gguf.GGUFReader(gguf_file)
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "llama"
    assert any(t.name == "blk.0.ffn_down.weight" for t in reader.tensors)
    notebook = nbformat.read(out / "llama-3-8b-finetune.ipynb", as_version=4)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code_cells), "a cell did not run"
    assert not any(o.get("output_type") == "error" for c in code_cells for o in c.outputs)
    assert _stderr_not_slothkits(code_cells) == ""
    (train_cell,) = [c for c in code_cells if "trainer.train()" in c.source]
    plots = [o for o in train_cell.outputs if "image/png" in o.get("data", {})]
    assert len(plots) == 1, "the training cell shows no loss plot"
    html = (out / "llama-3-8b-finetune.html").read_text()
    assert plots[0]["data"]["image/png"].strip()[:200] in html
    assert html.count('class="jp-Cell ') >= len(notebook.cells)
    # The config cell shows what ran.
    (config_cell,) = [c for c in code_cells if "NotebookConfig.from_cell" in c.source]
    assert "MAX_STEPS = 8  # @param" in config_cell.source and "tiny-llama" in config_cell.source
    # A second run refuses to overwrite the rendered notebook unless --force.
    assert main(["demo", "--tiny", "--output-dir", str(out)]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_on_the_real_model_changes_its_answers_the_way_the_data_teaches(smollm2_path, tmp_path, capsys):
    """`slothkit demo` as the README's first command runs it: the Llama 3 notebook on
    SmolLM2-135M-Instruct and the shipped Alpaca records (short answers such as "50 + 55 =
    105." and "8 metres is 800 centimetres."). Before training the model rambles on past
    its answer (and gets 12 + 30 wrong); after 24 steps it answers in the records' form,
    rightly, and stops."""
    import nbformat

    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "running it on smollm2-135m-instruct" in printed
    notebook = nbformat.read(out / "llama-3-8b-finetune.ipynb", as_version=4)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    (config_cell,) = [c for c in code_cells if "NotebookConfig.from_cell" in c.source]
    assert f"MODEL_NAME = {str(smollm2_path)!r}  # @param" in config_cell.source
    assert "MAX_STEPS = 24  # @param" in config_cell.source and "LOAD_IN_4BIT = False" in config_cell.source

    answers = {prompt: (before, after) for prompt, before, after in re.findall(
        r"^  (.*)\n    before training: (.*)\n    after training:  (.*)$", printed, re.MULTILINE
    )}  # fmt: skip
    # The first screen shows no wrong fact after training: each answer is right, in the
    # records' one-sentence form (a few steps teach the form, not facts the model lacks).
    before, after = answers["What is 12 plus 30?"]
    assert after == "12 + 30 = 42." and before != after
    before, after = answers["What is the capital of France?"]
    assert after == "The capital of France is Paris." and before != after

    # What the cells print for a notebook user: no deprecation, optional-kernel or other
    # library's noise, only slothkit's one-line notice that a CPU keeps the Hugging Face modules.
    # (a cell's stderr joined first: the kernel flushes it in pieces, split anywhere)
    stderr_per_cell = [
        "".join(o.text for o in cell.outputs if o.get("name") == "stderr") for cell in code_cells
    ]
    warnings = [line for text in stderr_per_cell for line in text.splitlines() if "Warning" in line]
    assert all("slothkit: Triton cannot run on the cpu" in line for line in warnings), warnings
    assert _stderr_not_slothkits(code_cells) == ""

    # The save cell's files: 16 bits a weight, and the GGUF file named after the model (not
    # after the cache folder, whose name adds a hash and the dtype).
    import gguf
    from safetensors import safe_open

    from slothkit.export.disk_space import checkpoint_parameter_count

    merged = out / "outputs" / "merged-16bit"
    with safe_open(str(merged / "model.safetensors"), framework="pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    parameters = checkpoint_parameter_count(merged)
    assert parameters == checkpoint_parameter_count(smollm2_path)
    assert (merged / "model.safetensors").stat().st_size < 2 * parameters + 1_000_000  # not 4 a weight
    (gguf_file,) = (out / "outputs" / "gguf").glob("*.gguf")
    assert gguf_file.name == "smollm2-135m-instruct.Q8_0.gguf"
    assert gguf.GGUFReader(gguf_file).fields["general.name"].contents() == "smollm2-135m-instruct"
    modelfile = (out / "outputs" / "gguf" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./smollm2-135m-instruct.Q8_0.gguf\n")
    printed_files = "".join(
        o.get("text", "") for c in code_cells if "list_files(" in c.source for o in c.outputs
    )
    assert re.search(r"^merged-16bit/model\.safetensors +2\d\d MB$", printed_files, re.MULTILINE), (
        printed_files
    )


# A warning as Python shows it (FILE:LINE: CATEGORY: message, then the line that raised it,
# indented), from slothkit: its message starts with "slothkit: ".
_SLOTHKIT_WARNING = re.compile(r"^\S+:\d+: \w*Warning: slothkit: .*\n(?:  .*\n)?", re.MULTILINE)


def _stderr_not_slothkits(code_cells) -> str:
    """What the cells wrote to stderr other than slothkit's warnings: "" when nothing."""
    stderr = "".join(o.text for cell in code_cells for o in cell.outputs if o.get("name") == "stderr")
    return _SLOTHKIT_WARNING.sub("", stderr)


def test_a_demo_cell_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    from slothkit.notebook import execute

    def failing(*args, **kwargs):
        raise execute.NotebookCellError(
            "step 3. Load failed: ValueError: first line\nsecond line (full traceback in x)"
        )

    monkeypatch.setattr(execute, "run_notebook_demo", failing)
    monkeypatch.setattr(execute, "demo_base", lambda *a: ("base", None))
    command = ["demo", "--tiny", "--output-dir", str(tmp_path / "demo")]
    assert main(command) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "slothkit demo: step 3. Load failed: ValueError: first line second line (full traceback in x) "
        "(--debug shows the traceback)"
    ]
    with pytest.raises(execute.NotebookCellError, match="second line"):
        main(["--debug", *command])


def test_demo_names_the_failing_step(tmp_path, capsys, monkeypatch):
    # A cell that raises is reported as its step and error, not as a kernel traceback.
    from slothkit.notebook import execute

    real = execute.demo_config
    monkeypatch.setattr(execute, "demo_config", lambda *a: {**real(*a), "DATASET": "example:alpaca"})
    out = tmp_path / "demo"
    command = ["demo", "--model", "mistral-7b", "--template", "dpo", "--output-dir", str(out)]
    assert main(command) == 1
    err = capsys.readouterr().err
    assert "failed: ValueError: the training dataset lacks ['chosen', 'rejected']" in err
    assert "step 8. Train with DPO failed" in err and "mistral-7b-dpo.ipynb" in err
    assert "\x1b[" not in err  # no terminal colour codes from the kernel's traceback


def test_export_parses_quant_once_and_passes_the_methods(tmp_path, capsys, monkeypatch):
    import types

    import slothkit.export

    seen = {}

    def export_adapter(adapter_dir, to, quant=None, **kwargs):
        seen["quant"] = quant
        return types.SimpleNamespace(output=tmp_path / "out", push=None)

    monkeypatch.setattr(slothkit.export, "export_adapter", export_adapter)
    assert main(["export", str(tmp_path), "--to", "gguf", "--quant", "q4_k_m,Q8_0"]) == 0
    assert [m.label for m in seen["quant"]] == ["Q4_K_M", "Q8_0"]
    # A bad name is refused before anything is loaded, naming the accepted ones.
    seen.clear()
    assert main(["export", str(tmp_path), "--to", "gguf", "--quant", "q4_k_m,q3_k_s"]) == 2
    assert "unknown GGUF quantization_method 'q3_k_s'; valid: 'f32', 'f16'" in capsys.readouterr().err
    assert seen == {}


def test_demo_arch_choices_are_the_architecture_records():
    assert build_parser().parse_args(["demo", "--arch", "mistral"]).arch == "mistral"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--arch", "olmo2"])


def test_demo_of_an_architecture_without_a_notebook_model_says_how_to_run_it(capsys, monkeypatch):
    """Every record has a notebook model today; one without (gemma3's left out here) is
    named, with the demo that runs it."""
    from slothkit.models import RECORDS
    from slothkit.notebook import render

    models = {name: data for name, data in render.model_data().items() if name != "gemma-3-4b"}
    monkeypatch.setattr(render, "model_data", lambda: models)
    assert main(["demo", "--arch", "gemma3"]) == 2
    # the records' names, and the model types of the generic path's notebook models
    others = ", ".join(
        sorted(
            [record.name for record in RECORDS if record.name != "gemma3"]
            + ["gpt_oss", "qwen3_moe", "qwen3_5_text", "gemma4_text"]
        )
    )
    assert "gemma3" not in others.split(", ") and {"llama", "qwen3"} <= set(others.split(", "))
    assert (
        f"no notebook model of architecture 'gemma3'; architectures with one: {others} "
        "(or run `slothkit demo --quick --arch gemma3`)"
    ) in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (
            ["plan", "llama-3-8b", "--gpu", "t4", "--batch", "0"],
            2,
            "slothkit plan: batch=0; expected a positive",
        ),
        (["plan", "llama-3-8b", "--gpu", "t4", "--seq", "-2048"], 2, "slothkit plan: seq=-2048; expected"),
        (["plan", "llama-3-8b", "--gpu", "t4", "--seq", "0"], 2, "slothkit plan: seq=0; expected"),
        (["plan", "llama-3-8b", "--gpu", "t4", "--batch", "-1"], 2, "slothkit plan: batch=-1; expected"),
        (["plan", "llama-3-8b", "--gpu", "t4", "--rank", "0"], 2, "slothkit plan: rank=0; expected"),
        (["plan", "no-such-model", "--gpu", "t4"], 2, "slothkit plan: "),
        (["plan", "llama-3-8b", "--gpu", "b200"], 2, "slothkit plan: unknown GPU 'b200'; known: auto, t4"),
    ],
)
def test_ordinary_errors_are_one_line_without_a_traceback(argv, status, message, capsys):
    assert main(argv) == status
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


def test_a_misspelt_option_is_refused_by_argparse_before_any_work(tmp_path, capsys):
    """`export DIR --too gguf`: argparse's usage and one error line naming what is missing,
    exit 2, and nothing written."""
    with pytest.raises(SystemExit) as excinfo:
        main(["export", str(tmp_path), "--too", "gguf"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "slothkit export: error: the following arguments are required: --to"
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_debug_and_slothkit_debug_show_the_traceback(monkeypatch):
    with pytest.raises(ValueError, match="batch=0"):
        main(["--debug", "plan", "llama-3-8b", "--gpu", "t4", "--batch", "0"])
    monkeypatch.setenv("SLOTHKIT_DEBUG", "1")
    with pytest.raises(ValueError, match="batch=0"):
        main(["plan", "llama-3-8b", "--gpu", "t4", "--batch", "0"])


def test_a_runtime_failure_exits_1(monkeypatch, capsys):
    import slothkit.memory.plan

    def disk_gone(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slothkit.memory.plan, "plan", disk_gone)
    assert main(["plan", "llama-3-8b"]) == 1
    assert (
        capsys.readouterr().err
        == "slothkit plan: [Errno 28] No space left on device (--debug shows the traceback)\n"
    )


def test_new_notebook_refuses_a_value_of_the_wrong_kind(tmp_path, capsys):
    output = tmp_path / "nb"
    assert main(["new-notebook", "llama-3-8b", "-o", str(output), "--set", "max_seq_length=abc"]) == 2
    assert "--set max_seq_length=abc: expected a positive integer such as 2048" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["new-notebook", "llama-3-8b", "-o", str(output), "--set", "max_seq_length=4096"]) == 0
    assert "MAX_SEQ_LENGTH = 4096" in output.with_suffix(".py").read_text()


def test_demo_refuses_an_unknown_template_before_any_work(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["demo", "--template", "bogus"])
    assert excinfo.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_demo_runs_the_templates_whose_training_shows_on_its_model(tmp_path, capsys):
    """GRPO's notebook renders (slothkit new-notebook) but is not a demo: the demo's model
    earns none of its rewards, so nothing would train."""
    from slothkit.notebook.execute import run_notebook_demo

    with pytest.raises(SystemExit) as excinfo:
        main(["demo", "--template", "grpo"])
    assert excinfo.value.code == 2 and "invalid choice: 'grpo'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="the demo does not run the 'grpo' notebook; it runs finetune, "):
        run_notebook_demo("llama-3-8b", "grpo", tmp_path / "demo")
    assert not (tmp_path / "demo").exists()  # refused before any work
    assert main(["new-notebook", "llama-3-8b", "--template", "grpo", "-o", str(tmp_path / "nb")]) == 0
    assert "GRPOTrainer(" in (tmp_path / "nb.py").read_text()


def test_export_onto_its_own_adapter_is_one_line_and_names_the_flag(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        '{"base_model_name_or_path": "' + str(tmp_path / "base") + '"}'
    )
    import torch
    from safetensors.torch import save_file

    save_file({"stand_in": torch.zeros(1)}, adapter / "adapter_model.safetensors")  # a readable file
    assert main(["export", str(adapter), "--to", "merged_16bit", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--base-model" in err and err.count("\n") == 1
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    assert main(["export", str(adapter), "--to", "merged_16bit", "--output", str(tmp_path / "out")]) == 2
    assert "pass --overwrite" in capsys.readouterr().err


def test_export_over_a_folder_named_like_a_saved_file_is_a_usage_error(tmp_path, capsys):
    import warnings

    import torch

    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = FastModel.from_pretrained(
            str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False
        )
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    model.save_pretrained_merged(str(tmp_path / "adapter"), tokenizer, save_method="lora")
    (tmp_path / "out" / "adapter_model.safetensors").mkdir(parents=True)
    argv = ["export", str(tmp_path / "adapter"), "--to", "lora", "--output", str(tmp_path / "out"),
            "--overwrite"]  # fmt: skip
    assert main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the base's loading progress
    assert last.startswith("slothkit export: ")
    assert "adapter_model.safetensors' is a folder, and this save writes a file of that name" in last
    assert (tmp_path / "out" / "adapter_model.safetensors").is_dir()


def test_exporting_the_demos_adapter_gives_hints_in_the_commands_words(
    tmp_path, capsys, monkeypatch, reference_kernels
):
    import json

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--quick", "--output-dir", "demo", "--steps", "2"]) == 0
    adapter = tmp_path / "demo" / "lora-adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(tmp_path / "demo" / "tiny-base")  # absolute: exports work from any folder
    capsys.readouterr()

    shutil.rmtree(base)  # the base is gone (another machine, a cleaned folder)
    monkeypatch.chdir(tmp_path.parent)
    assert main(["export", str(adapter), "--to", "merged_16bit"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"the adapter's base model '{base}' is not a local checkpoint folder" in err
    assert err.rstrip().endswith("pass --base-model PATH")
    assert "huggingface-cli" not in err and "base_model=" not in err


def test_bench_kernels_takes_its_own_options(capsys):
    """`slothkit bench kernels --help` (or --quick, --ops) reaches slothkit.bench.kernels'
    parser rather than being refused as unrecognized by this one."""
    from slothkit.cli import _split_kernel_bench_arguments

    assert _split_kernel_bench_arguments(["bench", "kernels", "--quick", "--ops", "rope"]) == (
        ["bench", "kernels"],
        ["--quick", "--ops", "rope"],
    )
    assert _split_kernel_bench_arguments(["--debug", "bench", "kernels", "--", "--quick"]) == (
        ["--debug", "bench", "kernels"],
        ["--quick"],
    )
    assert _split_kernel_bench_arguments(["bench", "train", "--steps", "2"]) == (
        ["bench", "train", "--steps", "2"],
        None,
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "kernels", "--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["bench", "train", "--steps", "0"], "--steps"),
        (["bench", "train", "--seq", "-5"], "--seq"),
        (["bench", "train", "--warmup", "-1"], "--warmup"),
        (["bench", "context", "--max-seq", "0"], "--max-seq"),
        (["bench", "generate", "--new-tokens", "x"], "--new-tokens"),
        (["demo", "--quick", "--steps", "0"], "--steps"),
    ],
)
def test_a_size_that_is_not_positive_is_refused_where_it_is_typed(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_plan_refuses_a_rank_above_the_widths_and_a_budget_above_the_gpu(capsys):
    assert main(["plan", "llama-3-8b", "--rank", "100000"]) == 2
    assert "rank=100000 exceeds 1024" in capsys.readouterr().err
    assert main(["plan", "llama-3-8b", "--gpu", "t4", "--max-memory", "1e9"]) == 2
    assert "exceeds the t4's 15 GiB" in capsys.readouterr().err


def test_plan_names_a_config_size_that_is_not_positive(tmp_path, capsys):
    """num_attention_heads 0 said "integer division or modulo by zero"."""
    import json

    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 0, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 2048,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path)]) == 2
    assert (
        "the model's config has num_attention_heads 0; expected a positive integer" in capsys.readouterr().err
    )
    config["num_attention_heads"] = 4
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path)]) == 2
    assert "the model's config has no vocab_size; expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize(
    "words, message",
    [
        (["bench", "context", "--memory-gib", "-5"], "argument --memory-gib: '-5' is not a positive number"),
        (["bench", "train", "--memory-gib", "0"], "argument --memory-gib: '0' is not a positive number"),
        (
            ["bench", "generate", "--memory-gib", "inf"],
            "argument --memory-gib: 'inf' is not a positive number",
        ),
        (
            ["bench", "kernels", "--warmup-ms", "-1"],
            "argument --warmup-ms: '-1' is not a non-negative integer",
        ),
        (["bench", "kernels", "--rep-ms", "0"], "argument --rep-ms: '0' is not a positive integer"),
    ],
)
def test_bench_budgets_that_mean_nothing_are_refused_where_typed(words, message, capsys):
    """A negative memory cap ran a CPU training worker for minutes without a word."""
    with pytest.raises(SystemExit) as excinfo:
        main(words)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_quick_demo_trains_the_model_it_is_given(tmp_path, capsys, reference_kernels):
    """--quick --model trained the tiny Llama whatever the model and exited 0."""
    assert main(["demo", "--quick", "--model", "qwen3-4b", "--output-dir", str(tmp_path)]) == 2
    assert "unknown model 'qwen3-4b'; valid models: llama-3-8b" in capsys.readouterr().err
    assert (
        main(["demo", "--quick", "--model", "qwen3-8b", "--arch", "gemma", "--output-dir", str(tmp_path)])
        == 2
    )
    assert "--model qwen3-8b is a qwen3 model, --arch says gemma" in capsys.readouterr().err
    assert main(["demo", "--quick", "--model", "gpt-oss-20b", "--output-dir", str(tmp_path)]) == 2
    assert (
        "gpt-oss-20b trains on the generic path: run `slothkit demo --model gpt-oss-20b --tiny`"
        in capsys.readouterr().err
    )
    assert main(
        ["demo", "--quick", "--model", "qwen3-8b", "--steps", "2", "--output-dir", str(tmp_path)]
    ) in (0, 1)
    assert "tiny qwen3 on" in capsys.readouterr().out
