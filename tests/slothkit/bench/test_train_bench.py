"""`slothkit bench train` on CPU at tiny shapes: its logic and record, not its speed."""

import json
import os
import re
from pathlib import Path

import pytest
import torch

from slothkit.bench.model_setup import build_model
from slothkit.cli import main
from slothkit.core.model_state import state_of
from slothkit.models import SHAPES, shape_by_name


@pytest.mark.parametrize(
    "name",
    [
        "tiny-llama",
        "tiny-mistral",
        "tiny-gemma",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-phi3",
        "tiny-gemma2",
        "tiny-ministral",
        "tiny-olmo2",
    ],
)
def test_build_model_keeps_buffers_and_gives_finite_loss(name):
    from transformers import AutoModelForCausalLM

    model = build_model(name, torch.float32, "cpu", seed=0)
    reference = AutoModelForCausalLM.from_config(shape_by_name(name).config())
    expected = dict(reference.named_buffers())
    for buffer_name, buffer in model.named_buffers():  # rotary inv_freq, Gemma's embed_scale
        torch.testing.assert_close(buffer, expected[buffer_name].to(buffer.dtype), msg=buffer_name)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_nf4_build_keeps_the_projection_biases():
    """Qwen2's q/k/v biases survive the swap to NF4 layers: the same values as the 16-bit
    build (one generator, parameters in the same order), and a finite loss."""
    pytest.importorskip("bitsandbytes")
    plain = build_model("tiny-qwen2", torch.float32, "cpu", seed=0)
    quantized = build_model("tiny-qwen2", torch.float32, "cpu", seed=0, quantize_nf4=True)
    for name in ("q_proj", "k_proj", "v_proj"):
        expected = getattr(plain.model.layers[1].self_attn, name).bias
        got = getattr(quantized.model.layers[1].self_attn, name)
        assert type(got).__name__ == "Linear4bit" and not got.bias.requires_grad
        torch.testing.assert_close(got.bias, expected)
    ids = torch.randint(0, quantized.config.vocab_size, (1, 16))
    assert torch.isfinite(quantized(input_ids=ids, labels=ids).loss)


def test_phi3_builds_adapt_and_quantise_its_fused_projections():
    """HF + PEFT's side of the bench adapts what FastModel adapts for the seven names on
    Phi-3 (qkv_proj, o_proj, gate_up_proj, down_proj), and the NF4 build quantises those."""
    pytest.importorskip("bitsandbytes")
    from slothkit.bench.model_setup import lora_targets, prepare

    model = build_model("tiny-phi3", torch.float32, "cpu", seed=0)
    assert lora_targets(model) == ["o_proj", "down_proj", "qkv_proj", "gate_up_proj"]
    plain = prepare("hf", model, rank=8, hf_checkpointing="off")
    adapted = {name.split(".")[-2] for name, _ in plain.named_modules() if name.endswith("lora_A")}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    quantized = build_model("tiny-phi3", torch.float32, "cpu", seed=0, quantize_nf4=True)
    layer = quantized.model.layers[0]
    for module in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert type(module).__name__ == "Linear4bit"


def test_unknown_shape_lists_the_known_ones():
    with pytest.raises(ValueError, match="llama-3-8b.*gemma-7b"):
        shape_by_name("llama-9")


def test_flops_counted_from_real_shapes():
    # Llama-3-8B: 6.98e9 in the projections plus 0.53e9 in the head, so about
    # 45 GFLOP per trained token (6 x), as shared/GPU.md's floor estimate says.
    assert 7.4e9 < SHAPES["llama-3-8b"].matmul_parameters() < 7.6e9


def test_flops_count_the_re_run_only_for_the_layers_that_re_run():
    from slothkit.bench.train import flops_per_token

    shape = SHAPES["llama-3-8b"]
    attention_per_pass = 2 * 2048 * shape.num_hidden_layers * shape.hidden_size  # causal QK^T and PV
    rerun = flops_per_token("llama-3-8b", 2048, 1.0) - flops_per_token("llama-3-8b", 2048, 0.0)
    assert rerun == pytest.approx(2 * shape.matmul_parameters() + attention_per_pass)
    half = flops_per_token("llama-3-8b", 2048, 0.5)
    assert half == pytest.approx(flops_per_token("llama-3-8b", 2048, 0.0) + rerun / 2)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_recomputed_share_reads_the_layers_flags(checkpointing):
    from peft import LoraConfig, get_peft_model

    from slothkit.bench.model_setup import LORA_TARGETS
    from slothkit.bench.train_measures import recomputed_share

    model = build_model("tiny-llama", torch.float32, "cpu", seed=0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=4, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    assert recomputed_share(model) == (1.0 if checkpointing else 0.0)
    if checkpointing:  # what use_gradient_checkpointing="auto" does to the first layers only
        layers = model.get_base_model().model.layers
        for layer in layers[len(layers) // 2 :]:
            layer.gradient_checkpointing = False
        assert recomputed_share(model) == 0.5


def test_tiny_run_writes_a_record(tmp_path, capsys, monkeypatch):
    output = tmp_path / "record.json"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.9")  # the workers inherit it
    code = main(
        [
            "bench",
            "train",
            "--model",
            "tiny-llama",
            "--dtype",
            "fp32",
            "--seq",
            "32",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--impl",
            "slothkit,hf,unsloth",
            "--output",
            str(output),
        ]
    )
    assert code == 0
    record = json.loads(output.read_text())
    rows = {row["impl"]: row for row in record["rows"]}
    assert rows["slothkit"]["status"] == "ok" and rows["hf"]["status"] == "ok"
    assert rows["hf"]["vs_hf"] == pytest.approx(1.0)
    for impl in ("slothkit", "hf"):
        assert rows[impl]["tokens_per_s"] > 0
        assert len(rows[impl]["losses"]) == 3
        (times,) = rows[impl]["step_times_s"]  # one run's timed steps, whose median is step_s
        assert len(times) == 2 and rows[impl]["step_s"] == pytest.approx(sum(times) / 2)
        assert all(torch.isfinite(torch.tensor(rows[impl]["losses"])))
        assert rows[impl]["recomputed"] == 1.0  # slothkit offloads, HF checkpoints, every layer
    # Both adapt the same weights.
    assert rows["slothkit"]["trainable_parameters"] == rows["hf"]["trainable_parameters"] > 0
    # Same model, data and LoRA init: the first losses agree.
    assert rows["slothkit"]["losses"][0] == pytest.approx(rows["hf"]["losses"][0], rel=1e-4)
    # slothkit reports how many layer graphs it replayed: none on a CPU; on a GPU of
    # compute capability 8.0 or more a forward and a backward graph per layer (3 steps:
    # the first eager, then captured).
    on = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    graphs = 2 * SHAPES["tiny-llama"].num_hidden_layers if on else 0
    assert rows["slothkit"]["cuda_graphs"] == graphs
    assert "cuda_graphs" not in rows["hf"]
    assert rows["slothkit"]["keep_sums"] is on and "keep_sums" not in rows["hf"]
    # Host memory: the worker's peak resident set, which holds at least torch itself.
    for impl in ("slothkit", "hf"):
        assert 0.1 < rows[impl]["peak_host_gib"] < 64
        assert rows[impl]["peak_host_scope"] == "steps" and rows[impl]["peak_host_before_steps_gib"] > 0.1
        assert rows[impl]["allocator"] == "garbage_collection_threshold:0.9"  # what each ran under
    # A peer that is not installed is reported, never faked.
    assert rows["unsloth"]["status"] in ("skipped", "error")
    assert record["versions"]["torch"] and record["command"].startswith("slothkit")
    # The host's speed, which a partly host-bound step depends on.
    assert record["host"]["cpu"] and record["host"]["cores"] >= 1 and record["host"]["torch_op_us"] > 0
    table = capsys.readouterr().out
    assert "| slothkit | ok |" in table and "unsloth" in table


def test_real_shape_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("checks the message shown without a GPU")
    with pytest.raises(SystemExit, match="no CUDA GPU.*tiny-llama"):
        main(["bench", "train", "--model", "llama-3-8b", "--impl", "hf"])


def test_unknown_implementation_is_refused(capsys):
    assert main(["bench", "train", "--model", "tiny-llama", "--impl", "deepspeed"]) == 2
    assert (
        "unknown implementation(s) ['deepspeed']; known: slothkit, hf, liger, unsloth"
        in capsys.readouterr().err
    )


def test_slothkit_from_another_source_tree_runs_that_tree(tmp_path):
    """slothkit@DIR imports slothkit, its kernels and the worker from DIR: a tree whose
    slothkit cannot be imported fails that row only, with DIR's own error."""
    import shutil

    root = Path(__file__).resolve().parents[3]
    tree = tmp_path / "old"
    shutil.copytree(root / "slothkit", tree / "slothkit")
    shutil.copytree(root / "slothkit_kernels", tree / "slothkit_kernels")
    init = tree / "slothkit" / "__init__.py"
    init.write_text('raise ImportError("this is the other tree")\n' + init.read_text())
    output = tmp_path / "record.json"
    main(
        [
            "bench",
            "train",
            "--model",
            "tiny-llama",
            "--dtype",
            "fp32",
            "--seq",
            "16",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--impl",
            f"slothkit,slothkit@{tree}",
            "--output",
            str(output),
        ]
    )
    rows = {row["impl"]: row for row in json.loads(output.read_text())["rows"]}
    assert rows["slothkit"]["status"] == "ok"
    assert "this is the other tree" in rows[f"slothkit@{tree}"]["error"]


def test_worker_path_for_another_tree_leaves_out_this_checkout(tmp_path):
    """The GPU scripts put the checkout's root on PYTHONPATH; a worker for another tree
    must not see it, so that it imports one version of slothkit and its kernels."""
    from slothkit.bench.train import tree_first_path

    root = str(Path(__file__).resolve().parents[3])
    site = tmp_path / "site"
    (site / "slothkit_kernels").mkdir(parents=True)
    tree = str(tmp_path / "old")
    path = tree_first_path(tree, os.pathsep.join([str(site), root, ""]))
    assert path.split(os.pathsep) == [tree, str(site)]


def test_source_tree_without_slothkit_is_refused(tmp_path, capsys):
    assert main(["bench", "train", "--model", "tiny-llama", "--impl", f"slothkit@{tmp_path}"]) == 2
    assert re.search(r"lacks slothkit, slothkit_kernels/.*ab_tree\.sh", capsys.readouterr().err)
    assert main(["bench", "train", "--model", "tiny-llama", "--impl", f"hf@{tmp_path}"]) == 2
    assert "only slothkit can be run from another source tree" in capsys.readouterr().err


@pytest.mark.parametrize("flag, expected", [([], True), (["--no-autocast"], False)])
def test_autocast_switch_reaches_every_worker_and_the_record(tmp_path, monkeypatch, flag, expected):
    _check_switch(tmp_path, monkeypatch, flag, None if expected else "--no-autocast", "autocast", expected)


@pytest.mark.parametrize("flag, expected", [([], "offload"), (["--slothkit-checkpointing", "on"], "on")])
def test_checkpointing_switch_reaches_every_worker_and_the_record(tmp_path, monkeypatch, flag, expected):
    _check_switch(
        tmp_path, monkeypatch, flag, "on" if expected == "on" else None, "slothkit_checkpointing", expected
    )


@pytest.mark.parametrize(
    "flag, key, expected",
    [
        ([], "slothkit_cuda_graphs", "auto"),
        (["--cuda-graphs", "forward"], "slothkit_cuda_graphs", "forward"),
        (["--cuda-graphs", "off"], "slothkit_cuda_graphs", "off"),
        ([], "slothkit_keep_sums", "auto"),
        (["--keep-sums", "on"], "slothkit_keep_sums", "on"),
        (["--keep-sums", "off"], "slothkit_keep_sums", "off"),
        ([], "slothkit_moe_gemm", "auto"),
        (["--moe-gemm", "grouped_mm"], "slothkit_moe_gemm", "grouped_mm"),
        (["--moe-gemm", "triton"], "slothkit_moe_gemm", "triton"),
    ],
)
def test_slothkit_switches_reach_every_worker_and_the_record(tmp_path, monkeypatch, flag, key, expected):
    word = flag[0] if flag else None
    commands = _check_switch(tmp_path, monkeypatch, flag, word, key, expected)
    if word is not None:
        assert all(command[command.index(word) + 1] == expected for command in commands)


@pytest.mark.parametrize(
    "variable, value, key, expected",
    [
        ("SLOTHKIT_CUDA_GRAPHS", "forward", "slothkit_cuda_graphs", "forward"),
        ("SLOTHKIT_KEEP_SUMS", "0", "slothkit_keep_sums", "off"),
    ],
)
def test_a_variable_left_to_auto_is_recorded_and_passed_as_a_flag(
    tmp_path, monkeypatch, variable, value, key, expected
):
    """The variables give the flags their default: the record says what ran, and the
    workers get it as an argument."""
    flag = {"slothkit_cuda_graphs": "--cuda-graphs", "slothkit_keep_sums": "--keep-sums"}[key]
    commands = _check_switch(tmp_path, monkeypatch, [], flag, key, expected, environ={variable: value})
    assert all(command[command.index(flag) + 1] == expected for command in commands)


def test_the_worker_sets_the_experts_backend_for_slothkit_only(monkeypatch):
    """--moe-gemm reaches slothkit_kernels' backend switch in a slothkit worker only."""
    import argparse

    from slothkit.bench import train_worker
    from slothkit_kernels.moe import grouped_mm

    monkeypatch.setattr(grouped_mm, "BACKEND", "auto")
    monkeypatch.setattr(train_worker, "matmul_peak_tflops", lambda: 1.0)
    train_worker.run(argparse.Namespace(impl="matmul-peak", moe_gemm="grouped_mm"))
    assert grouped_mm.BACKEND == "auto"
    with pytest.raises(AttributeError):  # the Namespace lacks the rest of a run's arguments
        train_worker.run(argparse.Namespace(impl="slothkit", moe_gemm="grouped_mm"))
    assert grouped_mm.BACKEND == "grouped_mm"


def test_the_worker_hands_its_switches_to_fast_model(monkeypatch):
    from slothkit import FastModel
    from slothkit.bench.model_setup import prepare

    seen = []
    monkeypatch.setattr(FastModel, "get_peft_model", lambda model, **kwargs: seen.append(kwargs))
    model = build_model("tiny-llama", torch.float32, "cpu", seed=0)
    for graphs, sums in (("auto", "auto"), ("on", "off"), ("forward", "on"), ("off", "auto")):
        prepare("slothkit", model, 4, cuda_graphs=graphs, keep_sums=sums)
    assert [(kw["cuda_graphs"], kw["keep_sums"]) for kw in seen] == [
        (None, None),
        (True, False),
        ("forward", True),
        (False, None),
    ]


def _check_switch(tmp_path, monkeypatch, flag, word, key, expected, environ=None):
    import subprocess

    from slothkit.bench import train

    for variable in ("SLOTHKIT_CUDA_GRAPHS", "SLOTHKIT_KEEP_SUMS"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in (environ or {}).items():
        monkeypatch.setenv(variable, value)
    commands = []

    real_run = subprocess.run

    def fake_run(command, **kwargs):
        if "slothkit.bench.train_worker" not in command:  # e.g. platform's own uname -p
            return real_run(command, **kwargs)
        commands.append(command)
        result = {"status": "ok", "step_s": 1.0, "tokens_per_s": 1.0, "losses": [1.0], "final_loss": 1.0}
        return subprocess.CompletedProcess(command, 0, train.RESULT_TAG + json.dumps(result) + "\n", "")

    monkeypatch.setattr(train.subprocess, "run", fake_run)
    output = tmp_path / "record.json"
    assert (
        main(
            [
                "bench",
                "train",
                "--model",
                "tiny-llama",
                "--impl",
                "slothkit,hf",
                "--output",
                str(output),
                *flag,
            ]
        )
        == 0
    )
    assert len(commands) == 2, commands
    assert all((word in command) is (word is not None) for command in commands)
    assert json.loads(output.read_text())[key] == expected
    return commands


def test_quantising_while_building_gives_the_same_nf4_weights():
    # The --t4 runs build QLoRA models layer by layer under a 15 GiB cap; they must train
    # exactly the weights that quantising the whole 16-bit model gives.
    from slothkit.bench.model_setup import quantize_to_nf4

    whole = quantize_to_nf4(build_model("tiny-llama", torch.float32, "cpu", seed=3), torch.float32)
    streamed = build_model("tiny-llama", torch.float32, "cpu", seed=3, quantize_nf4=True)
    whole_state, streamed_state = whole.state_dict(), streamed.state_dict()
    assert whole_state.keys() == streamed_state.keys()
    assert any("quant_state" in key for key in whole_state)
    for key, value in whole_state.items():
        assert torch.equal(value, streamed_state[key]), key
    ids = torch.randint(0, whole.config.vocab_size, (1, 16))
    torch.testing.assert_close(streamed(input_ids=ids).logits, whole(input_ids=ids).logits)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_experts_quantised_while_building_equal_those_quantised_after(name):
    # A whole Qwen3-30B-A3B QLoRA bench under a 24 GiB cap builds each block's experts
    # straight into NF4; they must be the records quantising the built 16-bit experts gives.
    from slothkit.engine.experts import DOWN, GATE_UP, experts_modules
    from slothkit.engine.experts_nf4 import nf4_experts_of, quantize_expert_parameters

    after = build_model(name, torch.float32, "cpu", seed=5)
    streamed = build_model(name, torch.float32, "cpu", seed=5, quantize_nf4=True, quantize_experts=True)
    pairs = list(zip(experts_modules(after), experts_modules(streamed), strict=True))
    assert pairs
    for built, quantized in pairs:
        quantize_expert_parameters(built, (GATE_UP, DOWN))
        for weight in (GATE_UP, DOWN):
            expected, got = nf4_experts_of(getattr(built, weight)), nf4_experts_of(getattr(quantized, weight))
            assert got is not None, weight
            assert got.stored_shape == expected.stored_shape, weight
            for field in ("packed", "absmax", "nested_absmax", "offset"):
                assert torch.equal(getattr(expected, field), getattr(got, field)), (weight, field)


def test_unsloth_checkpoint_is_deleted_once_loaded(monkeypatch, tmp_path):
    """Each Unsloth run saves the random model (16 GB at 8B) for Unsloth to load; left in
    /tmp, a few runs filled the GPU machine's disk."""
    import argparse
    import sys
    import types

    from slothkit.bench import model_setup

    seen = {}

    class FakeFastLanguageModel:
        @staticmethod
        def from_pretrained(folder, **kwargs):
            seen["folder"] = folder
            seen["files"] = sorted(p.name for p in Path(folder).iterdir())
            return torch.nn.Linear(2, 2), None

        @staticmethod
        def get_peft_model(model, **kwargs):
            return model

    monkeypatch.setitem(
        sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FakeFastLanguageModel)
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    model = build_model("tiny-llama", torch.float32, "cpu", 0)
    args = argparse.Namespace(seq=64, mode="lora", rank=4, seed=0)
    model_setup.load_with_unsloth(model, args, torch.float32)
    assert "model.safetensors" in seen["files"] and "tokenizer.json" in seen["files"]
    assert not Path(seen["folder"]).exists()
    assert not list(tmp_path.glob("slothkit-bench-unsloth-*"))


def test_a_run_cut_short_keeps_the_record_of_what_finished(tmp_path, monkeypatch):
    """The record is rewritten after each implementation, with what is still to come
    under "pending": a benchmark killed at a time limit keeps its finished rows."""
    import slothkit.bench.train as train

    def worker(impl, args, extra_env=None):
        if impl == "hf":
            raise KeyboardInterrupt  # the run is killed here
        return {"status": "ok", "step_s": 0.5, "losses": [2.0], "final_loss": 2.0}

    monkeypatch.setattr(train, "run_worker", worker)
    output = tmp_path / "record.json"
    command = ["bench", "train", "--model", "tiny-llama", "--seq", "16", "--impl", "slothkit,hf"]
    assert main([*command, "--repeats", "2", "--output", str(output)]) == 130  # interrupted
    record = json.loads(output.read_text())
    assert [row["impl"] for row in record["rows"]] == ["slothkit"]
    assert record["rows"][0]["tokens_per_s"] == pytest.approx(2 * 16 / 0.5)
    assert record["pending"] == ["hf (repeat 1)", "hf (repeat 2)", "slothkit (repeat 2)"]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_finished_run_has_nothing_pending(tmp_path, monkeypatch):
    import slothkit.bench.context as context

    monkeypatch.setattr(
        context,
        "longest_sequence",
        lambda impl, args: {
            "impl": impl,
            "status": "ok",
            "longest_seq": 64,
            "first_failing_seq": None,
            "probes": [],
        },
    )
    output = tmp_path / "context.json"
    main(["bench", "context", "--model", "tiny-llama", "--impl", "slothkit,hf", "--output", str(output)])
    record = json.loads(output.read_text())
    assert [row["impl"] for row in record["rows"]] == ["slothkit", "hf"] and "pending" not in record


def test_t4_stand_in_runs_slothkit_as_on_a_t4(monkeypatch):
    """--t4: fp16, a 15 GiB cap, and no layer CUDA graphs, which a real T4 does not use."""
    import argparse

    from slothkit.bench.train import apply_environment_defaults, apply_t4

    def t4_args(cuda_graphs="auto"):
        args = argparse.Namespace(
            t4=True, dtype="bf16", memory_gib=None, cuda_graphs=cuda_graphs, keep_sums="auto"
        )
        apply_environment_defaults(args)
        apply_t4(args)
        return args

    monkeypatch.delenv("SLOTHKIT_CUDA_GRAPHS", raising=False)
    args = t4_args()
    assert (args.dtype, args.memory_gib) == ("fp16", 15.0)
    assert args.cuda_graphs == "off"
    assert "SLOTHKIT_CUDA_GRAPHS" not in os.environ  # an argument for the workers, not a variable
    assert args.keep_sums == "off"  # as below compute capability 8.0
    assert t4_args("on").cuda_graphs == "on"  # an explicit setting wins
    monkeypatch.setenv("SLOTHKIT_CUDA_GRAPHS", "1")  # also one made through the variable
    assert t4_args().cuda_graphs == "on"
    assert os.environ["SLOTHKIT_CUDA_GRAPHS"] == "1"


def test_the_worker_hands_auto_its_budget_and_step_and_turns_hf_checkpointing_off(monkeypatch):
    from slothkit import FastModel
    from slothkit.bench.model_setup import prepare

    seen = []
    monkeypatch.setattr(FastModel, "get_peft_model", lambda model, **kwargs: seen.append(kwargs))
    model = build_model("tiny-llama", torch.float32, "cpu", seed=0)
    prepare("slothkit", model, 4, checkpointing="auto", memory_gib=24.0, batch=2, seq=2048)
    prepare("slothkit", model, 4)  # offload: no budget passed
    assert seen[0]["use_gradient_checkpointing"] == "auto"
    assert (seen[0]["max_memory"], seen[0]["batch_size"], seen[0]["max_seq_length"]) == (24.0, 2, 2048)
    assert seen[1]["use_gradient_checkpointing"] == "offload" and "max_memory" not in seen[1]
    for setting, checkpointed in (("on", True), ("off", False)):
        peft = prepare(
            "hf", build_model("tiny-llama", torch.float32, "cpu", seed=0), 4, hf_checkpointing=setting
        )
        assert peft.is_gradient_checkpointing is checkpointed and peft.training


def _fake_workers(monkeypatch, outcomes):
    """Replace the worker processes: outcomes(impl, args) -> the worker's result; the
    calls are recorded as (impl, hf_checkpointing, slothkit_checkpointing, memory_gib)."""
    import slothkit.bench.train as train

    calls = []

    def worker(impl, args, extra_env=None):
        calls.append((impl, args.hf_checkpointing, args.slothkit_checkpointing, args.memory_gib))
        return outcomes(impl, args)

    monkeypatch.setattr(train, "run_worker", worker)
    return calls


def _ran(step_s, **extra):
    return {"status": "ok", "step_s": step_s, "losses": [2.0], "final_loss": 2.0, **extra}


def test_best_runs_every_setting_once_and_keeps_the_fastest_that_fits(tmp_path, monkeypatch):
    """--memory-gib B --best: HF and Liger with and without checkpointing, Unsloth its
    own way, slothkit "auto" with max_memory=B, one worker each; the fastest that trained
    is the row, recorded with its setting, every candidate, and its ratio to HF's best."""

    def outcomes(impl, args):
        if impl == "hf":  # without checkpointing it does not fit
            if args.hf_checkpointing == "off":
                return {"status": "out of memory", "error": "CUDA out of memory"}
            return _ran(1.0)
        if impl == "liger":  # both fit: the faster is without
            return _ran(0.5 if args.hf_checkpointing == "off" else 0.8)
        if impl == "unsloth":
            return {"status": "out of memory", "error": "CUDA out of memory"}
        return _ran(0.4, recompute={"kept_layers": 22, "layers": 32})

    calls = _fake_workers(monkeypatch, outcomes)
    output = tmp_path / "best.json"
    command = [
        "bench",
        "train",
        "--model",
        "tiny-llama",
        "--seq",
        "16",
        "--impl",
        "slothkit,hf,liger,unsloth",
    ]
    assert main([*command, "--memory-gib", "24", "--best", "--output", str(output)]) == 0
    assert calls == [
        ("slothkit", "on", "auto", 24.0),
        ("hf", "on", "offload", 24.0),
        ("hf", "off", "offload", 24.0),
        ("liger", "on", "offload", 24.0),
        ("liger", "off", "offload", 24.0),
        ("unsloth", "on", "offload", 24.0),
    ]
    record = json.loads(output.read_text())
    assert record["best"] is True and record["memory_gib"] == 24.0 and "pending" not in record
    rows = {row["impl"]: row for row in record["rows"]}
    assert rows["hf"]["setting"] == "gradient checkpointing" and rows["hf"]["vs_hf"] == pytest.approx(1.0)
    assert rows["liger"]["setting"] == "no gradient checkpointing"
    assert rows["liger"]["vs_hf"] == pytest.approx(2.0)
    assert rows["slothkit"]["setting"] == "use_gradient_checkpointing='auto'"
    assert (
        rows["slothkit"]["vs_hf"] == pytest.approx(2.5) and rows["slothkit"]["recompute"]["kept_layers"] == 22
    )
    assert rows["unsloth"]["status"] == "out of memory" and "vs_hf" not in rows["unsloth"]
    assert [(c["setting"], c["status"]) for c in rows["hf"]["candidates"]] == [
        ("gradient checkpointing", "ok"),
        ("no gradient checkpointing", "out of memory"),
    ]
    assert [c["tokens_per_s"] for c in rows["liger"]["candidates"]] == [
        pytest.approx(40.0),
        pytest.approx(64.0),
    ]


def test_fastest_that_fits_picks_among_the_runs_that_trained():
    from slothkit.bench.best import fastest_that_fits

    oom = {"status": "out of memory", "error": "CUDA out of memory"}
    assert fastest_that_fits({"a": {"status": "ok", "tokens_per_s": 5.0}, "b": oom}) == (
        "a",
        {"status": "ok", "tokens_per_s": 5.0},
    )
    assert (
        fastest_that_fits(
            {"a": {"status": "ok", "tokens_per_s": 5.0}, "b": {"status": "ok", "tokens_per_s": 7.0}}
        )[0]
        == "b"
    )
    error = {"status": "error", "error": "boom"}
    assert fastest_that_fits({"a": oom, "b": error}) == ("a", oom)  # none fit: the first says why


def test_best_needs_a_budget(capsys):
    assert main(["bench", "train", "--model", "tiny-llama", "--impl", "hf", "--best"]) == 2
    assert (
        "--best runs each implementation in its fastest setting that fits a budget" in capsys.readouterr().err
    )


def test_a_setting_reaches_the_worker_as_a_flag(tmp_path, monkeypatch):
    commands = _check_switch(
        tmp_path, monkeypatch, ["--slothkit-checkpointing", "auto"], "auto", "slothkit_checkpointing", "auto"
    )
    assert all("--hf-checkpointing" not in command for command in commands)


def test_a_budget_auto_cannot_meet_is_reported_as_out_of_memory(capsys):
    """slothkit's "auto" refuses a step that does not fit even fully offloaded before it
    trains: the row says out of memory, with the least it needs, as a peer's would."""
    from slothkit.bench.train_worker import RESULT_TAG
    from slothkit.bench.train_worker import main as worker_main

    arguments = ["--impl", "slothkit", "--model", "tiny-llama", "--dtype", "fp32", "--seq", "16"]
    arguments += ["--steps", "1", "--warmup", "0", "--slothkit-checkpointing", "auto", "--memory-gib", "0.1"]
    assert worker_main(arguments) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(RESULT_TAG))
    result = json.loads(line[len(RESULT_TAG) :])
    assert result["status"] == "out of memory"
    assert result["error"].startswith(
        "refused before training: training at 32 tokens per step needs at least"
    )


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's clear_refs")
def test_the_host_peak_restarts_from_the_current_resident_memory():
    """The host column reports the training steps' peak, not the loading's: after a
    512 MiB buffer is touched and freed, the reset brings the peak back below it."""
    from slothkit.bench.train_measures import peak_host_bytes, reset_peak_host

    buffer = torch.ones(512 * 2**20, dtype=torch.uint8)  # touched: resident
    with_buffer = peak_host_bytes()
    assert with_buffer > 512 * 2**20
    del buffer
    # A peak survives the free (the kernel's per-thread counters are approximate).
    assert peak_host_bytes() > with_buffer - 16 * 2**20
    assert reset_peak_host()
    after_reset = peak_host_bytes()
    assert after_reset < with_buffer - 400 * 2**20


def test_the_record_says_how_auto_split_the_layers(tmp_path):
    """A slothkit row under "auto" records the split: layers kept, checkpointed on the GPU
    for want of host memory, the predicted pinned host memory and the host budget."""
    from slothkit import FastModel
    from slothkit.bench.train_measures import slothkit_settings
    from slothkit.testing import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "tiny", num_layers=4)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing="auto", max_memory=1000)
    policy = state_of(model).recompute_policy
    tokens = 2 * 24
    per_layer = policy.memory.host_checkpoint_bytes(tokens)  # as pinned host memory holds it
    policy.host_budget = 2.5 * per_layer  # two layers' inputs
    policy.budget = policy.memory.reserved(tokens, 1, 1) * (1 + 1e-9)
    with pytest.warns(UserWarning, match="checkpoints 1 on the GPU"):
        policy.decide(tokens)
    recompute = slothkit_settings(model)["recompute"]
    assert (recompute["kept_layers"], recompute["on_gpu_layers"], recompute["layers"]) == (1, 1, 4)
    assert recompute["predicted_host_gib"] == pytest.approx(2 * per_layer / 2**30)
    assert recompute["host_budget_gib"] == pytest.approx(2.5 * per_layer / 2**30)


def test_a_model_without_a_fused_record_is_benched_on_the_generic_path(tmp_path):
    """OLMo 2 has no record: slothkit's row trains its Hugging Face modules (what
    FastModel.from_pretrained gives it), from the same weights as HF + PEFT's row."""
    output = tmp_path / "record.json"
    args = ["bench", "train", "--model", "tiny-olmo2", "--dtype", "fp32", "--seq", "32"]
    args += ["--steps", "2", "--warmup", "1", "--impl", "slothkit,hf", "--output", str(output)]
    assert main(args) == 0
    rows = {row["impl"]: row for row in json.loads(output.read_text())["rows"]}
    assert rows["slothkit"]["status"] == rows["hf"]["status"] == "ok"
    assert rows["slothkit"]["losses"][0] == pytest.approx(rows["hf"]["losses"][0], rel=1e-4)
    assert rows["slothkit"]["cuda_graphs"] == 0  # layer graphs replay fused layers only


def test_the_slothkit_row_takes_the_path_from_pretrained_would(monkeypatch):
    from slothkit.bench.model_setup import take_fast_model_path

    fused = build_model("tiny-qwen3", torch.float32, "cpu", seed=0)
    take_fast_model_path(fused)
    assert state_of(fused).architecture == "qwen3"
    generic = build_model("tiny-olmo2", torch.float32, "cpu", seed=0)
    taken = []
    monkeypatch.setattr(
        "slothkit.loading.load_model.take_generic_path", lambda model, fused: taken.append(fused)
    )
    take_fast_model_path(generic)
    assert taken == [None] and state_of(generic) is None
