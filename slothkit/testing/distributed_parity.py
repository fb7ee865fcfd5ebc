"""Training in several processes (DDP, FSDP2) against one process with the same global batch.

N processes with a per-process batch of b, and one process with a batch of N x b, see
the same rows in the same order; DDP averages the processes' gradients (FSDP2 averages
and shards them), so when each process's loss is a mean over as many tokens as the
others' (or the trainer divides by the tokens of the whole global batch, as TRL's does),
both runs take the same steps.  The tests compare the losses of every step and the
trained adapters.

The same functions run in both: in the test's own process (one process, no process
group), and in N processes that ``run_processes`` starts with torchrun on the CPU (the
gloo backend), each writing what it measured to ``OUTPUT/rank<r>.pt``:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m slothkit.testing.distributed_parity loop --model PATH --output DIR

Needs peft (and trl for ``sft``); imported by tests only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

GLOBAL_BATCH = 4
SEQ = 16
STEPS = 3
LOOP_LR = 0.5  # SGD: large enough that three steps move the adapters well past rounding
LOOP_SETTINGS = ("offload", "offload-graphs")
PARALLEL = ("ddp", "fsdp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# What the "fsdp" kind runs, each under a name: FSDP2 in fp32 (against one process), and
# FSDP2 and DDP on 16-bit base weights (against each other: the batch split alone
# changes bf16's rounding, the sharding must not).
FSDP_RUNS = {
    "fsdp-fp32": dict(setting="offload-graphs", parallel="fsdp", dtype="fp32"),
    "fsdp-bf16": dict(setting="offload", parallel="fsdp", dtype="bf16"),
    "ddp-bf16": dict(setting="offload", parallel="ddp", dtype="bf16"),
}


def _process_group() -> tuple[int, int]:
    """(rank, world size): of the process group, started on first use (gloo, CPU)."""
    import torch.distributed as dist

    from slothkit.core.distributed import launch

    where = launch()
    if not where.distributed:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _in_parallel(model, parallel: str, world: int):
    """What the training loop calls: the model in DDP, or the model with FSDP2 sharding
    each decoder layer and then the rest (its own parameters sharded in place); the
    model itself in one process."""
    if world == 1:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from slothkit.engine.decoder import decoder_layers

    mesh = init_device_mesh("cpu", (world,))
    for layer in decoder_layers(model)[1]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _whole(weights: dict) -> dict:
    """FSDP2's sharded parameters (DTensors) gathered whole; others as they are."""
    from torch.distributed.tensor import DTensor

    return {n: w.full_tensor() if isinstance(w, DTensor) else w for n, w in weights.items()}


def loop_run(model_path: str, setting: str = "offload", parallel: str = "ddp", dtype: str = "fp32") -> dict:
    """A plain training loop; launched as several processes, in torch's DDP or FSDP2.

    Args:
        model_path: a tiny checkpoint (slothkit.testing.tiny_model_path).
        setting: "offload" (use_gradient_checkpointing="offload", the default) or
            "offload-graphs" (the same with the layer-graph plumbing replayed on the CPU,
            slothkit.testing.layer_graphs_on_cpu: gradients reach .grad from the
            graphs' buffers, not from autograd's backward of the layer).
        parallel: "ddp" or "fsdp" (FSDP2's fully_shard), when launched.
        dtype: the base weights' dtype, "fp32" or "bf16" (the adapters stay float32).

    Returns:
        {"losses": the global batch's mean loss per step, "lora": the trained adapters,
        "graphs": how many layer graphs were captured}.
    """
    from slothkit.testing.training_parity import lora_weights

    if setting not in LOOP_SETTINGS or parallel not in PARALLEL or dtype not in DTYPES:
        raise ValueError(
            f"setting={setting!r}, parallel={parallel!r}, dtype={dtype!r}; accepted: {LOOP_SETTINGS}, "
            f"{PARALLEL}, {tuple(DTYPES)}"
        )
    rank, world = _process_group()
    model, _ = _load(model_path, checkpointing="offload", dtype=DTYPES[dtype])
    graphs = None
    if setting == "offload-graphs":
        from slothkit.testing.layer_graphs_on_cpu import GraphsOnCPU

        graphs = GraphsOnCPU()
        for module in model.modules():
            checkpointer = getattr(module, "_gradient_checkpointing_func", None)
            if checkpointer is not None:
                checkpointer.graphs = graphs
    trained = _in_parallel(model, parallel, world)
    params = [p for p in model.parameters() if p.requires_grad]  # after sharding: the shards
    optimizer = torch.optim.SGD(params, lr=LOOP_LR)
    generator = torch.Generator().manual_seed(0)
    per_process = GLOBAL_BATCH // world
    losses = []
    for _ in range(STEPS):
        # Every row is SEQ tokens, all trained on: each process's mean loss is over as
        # many tokens as the others', so the mean of the means is the global mean.
        batch = torch.randint(3, model.config.vocab_size, (GLOBAL_BATCH, SEQ), generator=generator)
        mine = batch[rank * per_process : (rank + 1) * per_process]  # (B / world, T)
        loss = trained(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(_mean_over_processes(loss.detach().float(), world))
    return {
        "losses": losses,
        "lora": _whole(lora_weights(model)),
        "graphs": 0 if graphs is None else len(graphs.graphs),
    }


def sft_run(model_path: str, output_dir: str) -> dict:
    """slothkit.trl's SFTTrainer (its config from ``sft_config``), with
    offloaded checkpointing; under a launcher the Trainer wraps the model in DDP itself.

    Args:
        model_path: a tiny checkpoint.
        output_dir: the trainer's output_dir (nothing is saved there).

    Returns:
        {"losses": the logged loss per step, "lora": the trained adapters,
        "ddp_find_unused_parameters": the config's value}.
    """
    from slothkit.data import apply_chat_template, example_dataset, train_on_responses_only
    from slothkit.testing.training_parity import RUN, history, lora_weights
    from slothkit.trl import SFTTrainer
    from slothkit.trl.defaults import sft_config

    _, world = _process_group()
    model, tokenizer = _load(model_path, checkpointing="offload")
    dataset = apply_chat_template(example_dataset("chat").select(range(GLOBAL_BATCH * STEPS)), tokenizer)
    run = {**RUN, "per_device_train_batch_size": GLOBAL_BATCH // world}
    args = sft_config(model, max_steps=STEPS, learning_rate=2e-3, max_length=96, output_dir=output_dir, **run)
    trainer = train_on_responses_only(
        SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    )
    trainer.train()
    return {
        "losses": [entry[0] for entry in history(trainer, "loss")],
        "lora": lora_weights(model),
        "ddp_find_unused_parameters": args.ddp_find_unused_parameters,
    }


def _load(model_path: str, checkpointing, dtype=torch.float32):
    from slothkit.testing.training_parity import load_for_training

    return load_for_training("slothkit", arch=_arch_of(model_path), dtype=dtype, checkpointing=checkpointing)


def _arch_of(model_path: str) -> str:
    import json

    return json.loads((Path(model_path) / "config.json").read_text())["model_type"]


def _mean_over_processes(value: torch.Tensor, world: int) -> float:
    if world == 1:
        return value.item()
    import torch.distributed as dist

    value = value.clone()
    dist.all_reduce(value)
    return value.item() / world


def run_processes(kind: str, model_path: str, output: Path, processes: int = 2, timeout: float = 240) -> list:
    """Run ``kind`` ("loop", "fsdp" or "sft") in ``processes`` processes under torchrun on
    the CPU, and return what each wrote (a list by rank).

    Args:
        kind: "loop" (DDP, every setting of LOOP_SETTINGS in turn), "fsdp" (FSDP_RUNS in
            turn) or "sft".
        model_path: a tiny checkpoint.
        output: a folder for the processes' results.
        processes: how many (each gets GLOBAL_BATCH / processes rows per step).
        timeout: seconds before the run counts as hung.

    Raises:
        RuntimeError: torchrun failed; the message holds the end of its output.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(processes),
        "-m",
        "slothkit.testing.distributed_parity",
        kind,
        "--model",
        str(model_path),
        "--output",
        str(output),
    ]
    # On the CPU (gloo) even where there are GPUs, with the kernels' torch references
    # (the interpreter would cost seconds per step), one thread per process, no network.
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "TRITON_INTERPRET": "0",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"torchrun exited {done.returncode}:\n{tail}")
    return [torch.load(output / f"rank{rank}.pt") for rank in range(processes)]


def main(argv=None) -> int:
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["loop", "fsdp", "sft"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="slothkit_kernels.*no Triton backend")
    warnings.filterwarnings("ignore", category=FutureWarning)
    output = Path(args.output)
    rank, _ = _process_group()
    if args.kind == "loop":
        result = {setting: loop_run(args.model, setting) for setting in LOOP_SETTINGS}
    elif args.kind == "fsdp":
        result = {name: loop_run(args.model, **run) for name, run in FSDP_RUNS.items()}
    else:
        result = sft_run(args.model, str(output / "trainer"))
    torch.save(result, output / f"rank{rank}.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
