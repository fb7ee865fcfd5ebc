"""Predict GPU memory for LoRA-training a model, and pick settings that fit.

    slothkit plan llama-3-8b --gpu t4 --seq 2048 --batch 2
    slothkit plan llama-3-8b --gpu h100 --max-memory 40

The prediction is slothkit.memory.memory_model's arithmetic on the model's shape: the peak
allocated and the peak reserved memory (the allocator's slack on top, which is what an
out-of-memory error is about).  With every decoder layer's activations offloaded
(use_gradient_checkpointing="offload") the step needs the least; if that does not fit the
budget, the batch is halved, then the sequence.  Then the plan says what
use_gradient_checkpointing="auto" would do under the budget: how many layers keep their
activations, and the predicted peak, in the very words the policy
(slothkit.engine.checkpointing.recompute_policy) prints.

The budget: ``max_memory`` GiB if given, else the GPU's free memory (``--gpu auto``) or
its size less the CUDA context (a named GPU), less 5 % (memory_model.BUDGET_MARGIN).
Host memory, where the offloaded layers' inputs are pinned: ``max_host_memory`` GiB if
given, else, for ``--gpu auto``, this machine's available memory less 10 % (as "auto"
reads it); a named GPU's host is not known, so it has no host budget unless given (a
free Colab has 12.7 GB).  Layers the host cannot take are checkpointed on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from slothkit.checkpoint.before_loading import MAX_ROPE_FACTOR
from slothkit.memory.memory_model import (
    GIB,
    MemoryBudgetError,
    RecomputeChoice,
    TrainingMemory,
    activation_bytes,
    budget_from_free,
    free_bytes,
    host_budget_bytes,
    lora_bytes,
    weights_bytes,
)
from slothkit.models import Shape, architecture_for, shape_by_name
from slothkit.models.shape import shape_from_config

__all__ = ["MemoryPlan", "plan", "shape_from_config"]

GPU_MEMORY_GIB = {
    "t4": 15.0,
    "l4": 22.5,
    "a10": 22.5,
    "v100": 16.0,
    "a100": 40.0,
    "a100-80": 80.0,
    "h100": 80.0,
    "h200": 141.0,
}
# Compute capability below 8.0: no bfloat16, and neither CUDA graphs nor kept sums by
# default (slothkit.engine.checkpointing.choice.enable_checkpointing).
NO_BF16 = {"t4", "v100"}
# Memory a GPU has that no process can allocate: the CUDA context and its kernels.
CUDA_CONTEXT_GIB = 0.5


@dataclass
class MemoryPlan:
    model: str
    mode: str
    seq: int
    batch: int
    grad_accum: int
    dtype: str
    weights_gib: float
    lora_gib: float
    activations_gib: float  # every layer offloaded
    host_gib: float  # pinned host memory, every layer offloaded
    host_budget_gib: float | None
    allocated_gib: float  # predicted peak allocated, every layer offloaded
    total_gib: float  # predicted peak reserved, every layer offloaded
    gpu_gib: float | None
    budget_gib: float | None
    fits: bool | None
    recompute: RecomputeChoice | None  # what use_gradient_checkpointing="auto" keeps
    notes: list

    def report(self) -> str:
        where = ""
        if self.budget_gib is not None:
            gpu = f" ({self.gpu_gib:.1f} GiB GPU)" if self.gpu_gib else ""
            where = f" of a {self.budget_gib:.1f} GiB budget{gpu}: {'fits' if self.fits else 'does NOT fit'}"
        lines = [
            f"{self.model} {self.mode} ({self.dtype}), batch {self.batch} x seq {self.seq}, "
            f"gradient accumulation {self.grad_accum}",
            f"  weights      {self.weights_gib:6.2f} GiB",
            f"  LoRA + Adam  {self.lora_gib:6.2f} GiB",
            f"  activations  {self.activations_gib:6.2f} GiB (every layer offloaded)",
            f"  host memory  {self.host_gib:6.2f} GiB pinned (every layer offloaded)"
            + (f", budget {self.host_budget_gib:.1f} GiB" if self.host_budget_gib is not None else ""),
            f"  predicted peak {self.allocated_gib:.2f} GiB allocated, {self.total_gib:.2f} GiB reserved{where}",
        ]
        if self.recompute is not None:
            lines.append(f"  {self.recompute.notice()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan(
    model: str | Shape,
    gpu: str = "auto",
    seq: int = 2048,
    batch: int = 2,
    mode: str = "qlora",
    rank: int = 16,
    target_batch: int = 8,
    max_memory: float | None = None,
    cuda_graphs: bool | None = None,
    keep_sums: bool | None = None,
    max_host_memory: float | None = None,
) -> MemoryPlan:
    """Predict the peak memory, adjust batch (then seq) to fit the budget, and say what
    use_gradient_checkpointing="auto" would keep.

    Args:
        model: a shape name (``slothkit.models.SHAPES``), a local checkpoint folder (its
            config.json is read), or a Shape.
        gpu: "auto" (this machine's GPU and its free memory; none on a CPU) or a name of
            ``GPU_MEMORY_GIB``, any case.
        seq: the sequence length.
        batch: the batch size; lowered (then seq) until the step fits.
        mode: "lora" (16-bit weights) or "qlora" (NF4).
        rank: the LoRA rank, on all seven projections.
        target_batch: the effective batch gradient accumulation keeps near.
        max_memory: the budget in GiB; None: the GPU's memory less a margin.
        cuda_graphs: whether the checkpointed layers replay from CUDA graphs; None: as
            FastModel chooses (on GPUs of compute capability 8.0 and up, for 4-bit models
            and for families with per-head q/k norms, Qwen3 and Gemma 3).
        keep_sums: whether they keep their residual sums; None: as FastModel chooses
            (GPUs of compute capability 8.0 and up). Gemma 3's layers keep none either way.
        max_host_memory: the host memory budget in GiB for the offloaded inputs; None:
            this machine's available memory less 10 % with gpu="auto", none for a
            named GPU.

    Returns:
        The MemoryPlan (``report()`` prints it).

    Raises:
        ValueError: a size that is not a positive integer, an unknown shape, mode or GPU.
    """
    for name, value in (("seq", seq), ("batch", batch), ("rank", rank), ("target_batch", target_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}; expected a positive integer")
    if max_memory is not None and (isinstance(max_memory, bool) or not max_memory > 0):
        raise ValueError(f"max_memory={max_memory!r}; expected a positive number of GiB")
    if max_host_memory is not None and (isinstance(max_host_memory, bool) or not max_host_memory > 0):
        raise ValueError(f"max_host_memory={max_host_memory!r}; expected a positive number of GiB")
    shape, text_only = _shape_of(model)
    model = model if isinstance(model, str) else f"{shape.model_type} ({shape.hidden_size} hidden)"
    if mode not in ("lora", "qlora"):
        raise ValueError(f"mode={mode!r}; accepted: 'lora' (16-bit base) or 'qlora' (4-bit base)")
    head_dim = shape.head_dim()
    smallest = min(shape.hidden_size, shape.intermediate_size, shape.num_key_value_heads * head_dim)
    if rank > smallest:
        raise ValueError(
            f"rank={rank} exceeds {smallest}, the smallest width of the adapted projections: a LoRA "
            f"update cannot have a higher rank, and get_peft_model refuses it; use rank <= {smallest}"
        )
    context = shape.max_position_embeddings
    if seq > MAX_ROPE_FACTOR * context:
        raise ValueError(
            f"seq={seq:,} exceeds {model}'s context of {context:,} tokens more than {MAX_ROPE_FACTOR} times "
            f"over, the most from_pretrained's linear RoPE scaling stretches it (and refuses beyond); "
            f"use seq <= {MAX_ROPE_FACTOR * context:,}"
        )
    gpu_gib, gpu_name, free_gib = _gpu_memory(gpu)
    if max_memory is not None and gpu_gib is not None and max_memory > gpu_gib:
        raise ValueError(
            f"max_memory={max_memory:g} GiB exceeds the {gpu_name}'s {gpu_gib:g} GiB; give a budget "
            f"within the GPU's memory (or leave it out: the GPU's memory less a margin)"
        )
    newer = gpu_name not in NO_BF16 and gpu_name != "cpu"  # compute capability 8.0 and up
    # FastModel's default (slothkit.loading.training_mode.is_launch_bound): graphs where the host
    # limits the layers, 4-bit weights or a fused family's per-head q/k norms.
    fused = architecture_for(shape)
    launch_bound = mode == "qlora" or (fused is not None and fused.qk_norm)
    layers_keep_sums = fused is None or fused.keeps_attention_sum  # not Gemma 3's
    memory = TrainingMemory(
        shape,
        mode,
        lora_bytes(shape, rank),
        rank,
        cuda_graphs=(launch_bound and newer) if cuda_graphs is None else cuda_graphs,
        keep_sums=layers_keep_sums and (newer if keep_sums is None else keep_sums),
    )
    weights = weights_bytes(shape, mode)
    budget = None
    if max_memory is not None:
        budget = max_memory * GIB
    elif free_gib is not None:
        budget = budget_from_free(free_gib * GIB)
    host_budget = None
    if max_host_memory is not None:
        host_budget = max_host_memory * GIB
    elif gpu.lower() == "auto" and gpu_name != "cpu":
        host_budget = host_budget_bytes()
    dtype = "fp16" if gpu_name in NO_BF16 else "bf16"
    notes = []
    if text_only:
        notes.append(
            "an image-text checkpoint: planned for its language model (config.json's text_config) "
            "alone; the vision tower's weights and the image tokens' activations are not counted"
        )
    if dtype == "fp16":
        notes.append(f"{gpu_name} has no bfloat16: training in float16 with loss scaling")

    if budget is not None:
        limit = f"{budget / GIB:.1f} GiB"
        asked_batch, asked_seq = batch, seq
        # The least a step can reserve: with nothing kept for the re-runs where "auto" may
        # stop keeping (below).
        least = (dataclasses.replace(memory, keep_sums=False) if keep_sums is None else memory).least_reserved
        while batch > 1 and least(batch * seq, host_budget) > budget:
            batch //= 2
        while seq > 256 and least(batch * seq, host_budget) > budget:
            seq //= 2
        if batch != asked_batch:
            notes.append(f"batch lowered from {asked_batch} to {batch} to fit {limit}")
        if seq != asked_seq:
            notes.append(f"max_seq_length lowered from {asked_seq:,} to {seq:,} to fit {limit}")
    if seq > context:
        notes.append(
            f"max_seq_length {seq:,} is past {model}'s context of {context:,} tokens: from_pretrained "
            f"scales RoPE linearly by {seq / context:g} to reach it"
        )
    recompute = None
    if budget is not None:
        try:
            recompute = memory.recompute_choice(
                batch * seq, budget, host_budget, may_stop_keeping=keep_sums is None
            )
            if recompute.stops_keeping:
                memory = dataclasses.replace(memory, keep_sums=False)
                notes.append(
                    f"the layers' re-runs recompute their residual sums (and experts' products) "
                    f"instead of keeping them, as use_gradient_checkpointing='auto' does where "
                    f"only that fits {budget / GIB:.1f} GiB"
                )
        except MemoryBudgetError as error:
            what = (
                "the weights alone"
                if weights > budget
                else f"the weights, the adapters and their optimiser state with a step of {batch * seq:,} "
                f"tokens (at least {error.minimum_bytes / GIB:.1f} GiB)"
            )
            notes.append(
                f"{what} do not fit in {budget / GIB:.1f} GiB"
                + ("; try load_in_4bit=True (qlora)" if mode == "lora" else "")
            )
    fits = None if budget is None else recompute is not None
    if mode == "qlora" and shape.experts():
        # bitsandbytes leaves the experts' 3-D parameters alone; slothkit quantises each to
        # NF4 as transformers loads it (slothkit.engine.experts_loading), so loading holds
        # the 4-bit weights and one experts parameter in 16 bits: a per-expert checkpoint's
        # gate/up is read as every expert's gate and up, each stacked, then joined, up to
        # three copies of it at once.
        experts = shape.experts()
        gate_up = 2 * experts.count * experts.width * shape.hidden_size * 2
        loading = (weights + 3 * gate_up) / GIB
        notes.append(
            f"the experts are quantised to NF4 as they load, one layer at a time: loading peaks "
            f"at about {loading:.1f} GiB"
        )
        if budget is not None and loading * GIB > budget:
            fits = False
    if fused is None:
        # The generic path keeps the model's own modules, which "auto" cannot budget: it
        # offloads every layer, and a layer's recompute holds more than a fused one's.
        recompute = None
        notes.append(
            f"slothkit has no fused path for {shape.model_type}: it trains on its Hugging Face "
            f"modules with every layer offloaded ('auto' too); the figures are the fused "
            f"layers', so leave some margin"
        )
    tokens = batch * seq
    return MemoryPlan(
        model=model,
        mode=mode,
        seq=seq,
        batch=batch,
        grad_accum=max(1, target_batch // batch),
        dtype=dtype,
        weights_gib=weights / GIB,
        lora_gib=lora_bytes(shape, rank) / GIB,
        activations_gib=activation_bytes(shape, tokens, rank=rank) / GIB,
        host_gib=memory.layers * memory.host_checkpoint_bytes(tokens) / GIB,
        host_budget_gib=None if host_budget is None else host_budget / GIB,
        allocated_gib=memory.allocated(tokens) / GIB,
        total_gib=memory.reserved(tokens) / GIB,
        gpu_gib=gpu_gib,
        budget_gib=None if budget is None else budget / GIB,
        fits=fits,
        recompute=recompute,
        notes=notes,
    )


def _shape_of(model: str | Shape) -> tuple[Shape, bool]:
    """The shape to plan for, and whether it is an image-text checkpoint's language model."""
    if isinstance(model, Shape):
        return model, False
    config = Path(model) / "config.json"
    if not config.is_file():
        return shape_by_name(model), False
    fields = json.loads(config.read_text())
    text = fields.get("text_config")
    if not isinstance(text, dict) or "hidden_size" in fields:
        return shape_from_config(SimpleNamespace(**fields)), False
    # An image-text checkpoint (Qwen3.5's and Gemma 4's releases, Gemma 3 4B and up): its
    # language model's sizes are under text_config, where the file leaves out the fields
    # at their defaults; transformers' config class fills them in.
    try:
        from transformers import AutoConfig

        text_config = AutoConfig.from_pretrained(model).get_text_config()
    except (ImportError, OSError, ValueError, KeyError):  # a model_type this transformers lacks
        text_config = SimpleNamespace(**text)
    return shape_from_config(text_config), True


def _gpu_memory(gpu: str) -> tuple[float | None, str, float | None]:
    """(the GPU's memory, its name, the memory free for training) in GiB; on a machine
    without a GPU, (None, "cpu", None)."""
    gpu = gpu.lower()  # --gpu T4 as well as t4
    if gpu == "auto":
        import torch

        if not torch.cuda.is_available():
            return None, "cpu", None
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        name = props.name.lower()
        key = next((k for k in GPU_MEMORY_GIB if k.split("-")[0] in name), name)
        if torch.cuda.get_device_capability(device) < (8, 0):
            key = next((k for k in NO_BF16 if k in name), "t4")
        return props.total_memory / GIB, key, free_bytes(device) / GIB
    if gpu not in GPU_MEMORY_GIB:
        raise ValueError(f"unknown GPU {gpu!r}; known: auto, {', '.join(GPU_MEMORY_GIB)}")
    return GPU_MEMORY_GIB[gpu], gpu, GPU_MEMORY_GIB[gpu] - CUDA_CONTEXT_GIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="a model shape, e.g. llama-3-8b, gemma-7b, mistral-7b, or a local checkpoint folder"
    )
    parser.add_argument("--gpu", default="auto", help=f"auto or one of {', '.join(GPU_MEMORY_GIB)}")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--mode", choices=["lora", "qlora"], default="qlora")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--max-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="the memory budget in GiB (FastModel.get_peft_model's max_memory=); default: the "
        "GPU's memory less 5 %%",
    )
    parser.add_argument(
        "--max-host-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="the host memory budget in GiB for offloaded layer inputs (get_peft_model's "
        "max_host_memory=); default: this machine's available memory less 10 %% with --gpu auto, "
        "none for a named GPU (a free Colab has 12.7 GB)",
    )
