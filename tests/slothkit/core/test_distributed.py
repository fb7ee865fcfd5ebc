"""slothkit.core.distributed: the launcher's variables, the trainer settings DDP needs, and the
GPU each process loads onto.  (The training itself: tests/slothkit/test_distributed_training.py.)"""

import re
import types

import pytest
import torch

from slothkit.core.distributed import (
    Launch,
    check_ddp_settings,
    ddp_defaults,
    device_map_for_process,
    is_main_process,
    launch,
)

TWO = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, Launch(world_size=1, rank=0, local_rank=0)),
        ({"WORLD_SIZE": "", "RANK": ""}, Launch()),  # empty: unset
        (TWO, Launch(world_size=2, rank=1, local_rank=1)),
        ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, Launch(4, 3, 1)),  # two machines
        ({"WORLD_SIZE": "2", "RANK": "1"}, Launch(2, 1, 1)),  # LOCAL_RANK defaults to RANK
    ],
)
def test_launch_reads_the_launchers_variables(environ, expected):
    where = launch(environ)
    assert where == expected
    assert where.distributed is (expected.world_size > 1)
    assert is_main_process(environ) is (expected.rank == 0)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'; a launcher (torchrun, accelerate launch) sets it"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "WORLD_SIZE=2, RANK=2, LOCAL_RANK=2; accepted"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0, RANK=0, LOCAL_RANK=0; accepted: WORLD_SIZE >= 1"),
        # WORLD_SIZE with MASTER_ADDR but no launcher: refused before anything waits.
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"}, "WORLD_SIZE=2 but RANK is unset"),
    ],
)
def test_a_mis_set_launcher_variable_is_named(environ, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        launch(environ)


def test_ddp_defaults_only_under_a_launcher():
    from slothkit.core import distributed

    distributed._say_once.cache_clear()  # said once per process: maybe already, by another test
    assert ddp_defaults({}) == {}
    with pytest.warns(UserWarning, match="2 processes.*ddp_find_unused_parameters=False"):
        settings = ddp_defaults({"WORLD_SIZE": "2", "RANK": "0"})  # the main process says it
    expected = {"ddp_find_unused_parameters": False, "ddp_broadcast_buffers": False}
    if not torch.cuda.is_available():
        expected["use_cpu"] = True  # else accelerate starts no process group on the CPU
    assert settings == expected
    assert ddp_defaults(TWO) == expected


def test_config_builders_take_the_ddp_defaults(monkeypatch):
    from slothkit.trl.defaults import machine_defaults

    assert "ddp_find_unused_parameters" not in machine_defaults()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert machine_defaults()["ddp_find_unused_parameters"] is False


def _args(**values):
    return types.SimpleNamespace(**{"ddp_find_unused_parameters": None, "use_cpu": True, **values})


def test_check_ddp_settings():
    args = _args()
    check_ddp_settings(args, checkpointing_nested=True, environ={})
    assert args.ddp_find_unused_parameters is None  # one process: left as it is
    check_ddp_settings(args, checkpointing_nested=True, environ=TWO)
    assert args.ddp_find_unused_parameters is False
    kept = _args(ddp_find_unused_parameters=True)  # without nested checkpointing the search works
    check_ddp_settings(kept, checkpointing_nested=False, environ=TWO)
    assert kept.ddp_find_unused_parameters is True
    with pytest.raises(ValueError, match="ddp_find_unused_parameters=True with slothkit's offloaded"):
        check_ddp_settings(_args(ddp_find_unused_parameters=True), checkpointing_nested=True, environ=TWO)


def test_trainer_setup_checks_the_ddp_settings(monkeypatch):
    """check_setup, which every slothkit trainer runs, applies check_ddp_settings to a
    config slothkit did not build, knowing whether the model's checkpointing nests."""
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path
    from slothkit.trl.setup import check_setup

    model, tokenizer = FastModel.from_pretrained(
        str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False, fused=True
    )
    model = FastModel.get_peft_model(model, r=4)  # offloaded checkpointing
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    args = _args(use_cpu=not torch.cuda.is_available())
    check_setup(model, tokenizer, args)
    assert args.ddp_find_unused_parameters is False
    with pytest.raises(ValueError, match="ddp_find_unused_parameters=True with slothkit's offloaded"):
        check_setup(model, tokenizer, _args(ddp_find_unused_parameters=True, use_cpu=args.use_cpu))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_processes_on_the_cpu_need_use_cpu():
    with pytest.raises(
        ValueError, match="2 processes .* use_cpu=False: accelerate would start no process group"
    ):
        check_ddp_settings(_args(use_cpu=False), checkpointing_nested=True, environ=TWO)


class _Gpus:
    """torch.cuda as a machine with `count` GPUs would answer."""

    def __init__(self, count):
        self.count, self.current = count, 0

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", lambda index: setattr(self, "current", index))


def test_each_process_loads_onto_its_own_gpu(monkeypatch):
    gpus = _Gpus(2)
    gpus.install(monkeypatch)
    assert device_map_for_process({}) == {"": 0}
    assert device_map_for_process(TWO) == {"": 1}
    assert gpus.current == 1  # made current: Triton launches and graphs capture there
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but this machine has 2 GPU\(s\)"):
        device_map_for_process({"WORLD_SIZE": "3", "RANK": "2"})


def test_no_gpu_leaves_the_model_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_map_for_process(TWO) is None
