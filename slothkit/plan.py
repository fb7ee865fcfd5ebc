"""Predict GPU memory for loading and LoRA-training a model, and pick settings that fit.

    slothkit plan llama-3-8b --gpu t4 --seq 2048 --batch 2

The prediction is arithmetic on the model's shape, in bytes:

  weights      16-bit: 2 per parameter.  NF4: 0.5 per projection parameter plus its
               scales (1/64 of a byte for the uint8 block scale, 4/16384 for the
               nested fp32 scale); embeddings, head and norms stay 16-bit.
  LoRA         r * (in + out) per adapted projection, trained in fp32: weight 4,
               gradient 4, AdamW moments 8 = 16 per adapter parameter.
  activations  with slothkit's offloaded checkpointing the GPU holds one decoder
               layer's saved tensors at a time plus two layer inputs in flight; per
               token that is about 2 * (6 H + 4 I + 2 (Hq + 2 Hkv) D) bytes (hidden
               states, the MLP's gate/up pre-activations and their recomputed
               product, q/k/v), plus the fused loss's d_hidden (2 H) and one chunk
               of logits.  Plain checkpointing adds one layer input (2 H) per layer.
  overhead     CUDA context and allocator slack: 0.5 GiB plus 4 % of the rest.

The constants were fitted to `slothkit bench train` records on an H200
(results/bench/); `docs/planner.md` compares predictions with measured peaks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slothkit.bench.shapes import Shape, shape_by_name
from slothkit.models import architecture_for

GIB = 2**30
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
NO_BF16 = {"t4", "v100"}
CONTEXT_OVERHEAD_GIB = 0.5
SLACK = 0.04


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
    activations_gib: float
    total_gib: float
    gpu_gib: float | None
    fits: bool | None
    notes: list

    def report(self) -> str:
        lines = [
            f"{self.model} {self.mode} ({self.dtype}), batch {self.batch} x seq {self.seq}, "
            f"gradient accumulation {self.grad_accum}",
            f"  weights      {self.weights_gib:6.2f} GiB",
            f"  LoRA + Adam  {self.lora_gib:6.2f} GiB",
            f"  activations  {self.activations_gib:6.2f} GiB",
            f"  predicted peak {self.total_gib:.2f} GiB"
            + (
                f" of {self.gpu_gib:.1f} GiB: {'fits' if self.fits else 'does NOT fit'}"
                if self.gpu_gib
                else ""
            ),
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _head_dim(shape: Shape) -> int:
    return shape.extra.get("head_dim", shape.hidden_size // shape.num_attention_heads)


def weights_bytes(shape: Shape, mode: str) -> float:
    d = _head_dim(shape)
    h, i = shape.hidden_size, shape.intermediate_size
    projections = shape.num_hidden_layers * (
        h * shape.num_attention_heads * d * 2 + h * shape.num_key_value_heads * d * 2 + 3 * h * i
    )
    embeddings = shape.vocab_size * h
    arch = architecture_for(shape)
    head = 0 if arch is not None and arch.tied_embeddings else shape.vocab_size * h
    norms = (2 * shape.num_hidden_layers + 1) * h
    per_projection = 2.0 if mode == "lora" else 0.5 + 1 / 64 + 4 / 16384
    return projections * per_projection + 2.0 * (embeddings + head + norms)


def lora_bytes(shape: Shape, rank: int) -> float:
    d = _head_dim(shape)
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    per_layer = rank * ((h + q) * 2 + (h + kv) * 2 + 3 * (h + i))
    return 16.0 * shape.num_hidden_layers * per_layer


def activation_bytes(shape: Shape, tokens: int, checkpointing: str = "offload") -> float:
    d = _head_dim(shape)
    h, i = shape.hidden_size, shape.intermediate_size
    per_token = 2 * (6 * h + 4 * i + 2 * (shape.num_attention_heads + 2 * shape.num_key_value_heads) * d)
    per_token += 2 * h  # the fused loss's d_hidden
    logits_chunk = (
        2 * shape.vocab_size * max(1, min(tokens, max(tokens // 16, 4 * 2**20 // shape.vocab_size)))
    )
    total = tokens * per_token + logits_chunk
    if checkpointing != "offload":
        total += shape.num_hidden_layers * tokens * 2 * h
    return total


def shape_from_config(config) -> Shape:
    """A Shape read off a transformers config (for checkpoints the bench does not name)."""
    extra = {}
    head_dim = getattr(config, "head_dim", None)
    if head_dim and head_dim != config.hidden_size // config.num_attention_heads:
        extra["head_dim"] = head_dim
    return Shape(
        config.model_type,
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        config.vocab_size,
        getattr(config, "max_position_embeddings", 0),
        extra,
    )


def plan(
    model: str | Shape,
    gpu: str = "auto",
    seq: int = 2048,
    batch: int = 2,
    mode: str = "qlora",
    rank: int = 16,
    target_batch: int = 8,
) -> MemoryPlan:
    """Predict the peak and adjust batch (then seq) to fit the GPU; keep the effective
    batch near target_batch through gradient accumulation.  model: a shape name or a Shape."""
    for name, value in (("seq", seq), ("batch", batch), ("rank", rank), ("target_batch", target_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}; expected a positive integer")
    shape = model if isinstance(model, Shape) else shape_by_name(model)
    model = model if isinstance(model, str) else f"{shape.model_type} ({shape.hidden_size} hidden)"
    if mode not in ("lora", "qlora"):
        raise ValueError(f"mode={mode!r}; accepted: 'lora' (16-bit base) or 'qlora' (4-bit base)")
    gpu_gib, gpu_name = _gpu_memory(gpu)
    dtype = "fp16" if gpu_name in NO_BF16 else "bf16"
    notes = []
    if dtype == "fp16":
        notes.append(f"{gpu_name} has no bfloat16: training in float16 with loss scaling")

    def total(b, s):
        fixed = weights_bytes(shape, mode) + lora_bytes(shape, rank)
        used = fixed + activation_bytes(shape, b * s)
        return used * (1 + SLACK) / GIB + CONTEXT_OVERHEAD_GIB

    if gpu_gib is not None:
        while batch > 1 and total(batch, seq) > gpu_gib:
            batch //= 2
            notes.append(f"batch lowered to {batch} to fit {gpu_gib:.0f} GiB")
        while seq > 256 and total(batch, seq) > gpu_gib:
            seq //= 2
            notes.append(f"max_seq_length lowered to {seq} to fit {gpu_gib:.0f} GiB")
        if total(batch, seq) > gpu_gib:
            notes.append(
                f"the weights alone do not fit in {gpu_gib:.0f} GiB"
                + ("; try load_in_4bit=True (qlora)" if mode == "lora" else "")
            )
    grad_accum = max(1, target_batch // batch)
    peak = total(batch, seq)
    return MemoryPlan(
        model=model,
        mode=mode,
        seq=seq,
        batch=batch,
        grad_accum=grad_accum,
        dtype=dtype,
        weights_gib=weights_bytes(shape, mode) / GIB,
        lora_gib=lora_bytes(shape, rank) / GIB,
        activations_gib=activation_bytes(shape, batch * seq) / GIB,
        total_gib=peak,
        gpu_gib=gpu_gib,
        fits=None if gpu_gib is None else peak <= gpu_gib,
        notes=notes,
    )


def _gpu_memory(gpu: str) -> tuple[float | None, str]:
    gpu = gpu.lower()  # --gpu T4 as well as t4
    if gpu == "auto":
        import torch

        if not torch.cuda.is_available():
            return None, "cpu"
        props = torch.cuda.get_device_properties(0)
        name = props.name.lower()
        key = next((k for k in GPU_MEMORY_GIB if k.split("-")[0] in name), name)
        return props.total_memory / GIB, ("t4" if "t4" in name else key)
    if gpu not in GPU_MEMORY_GIB:
        raise ValueError(f"unknown GPU {gpu!r}; known: auto, {', '.join(GPU_MEMORY_GIB)}")
    return GPU_MEMORY_GIB[gpu], gpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model shape, e.g. llama-3-8b, gemma-7b, mistral-7b")
    parser.add_argument("--gpu", default="auto", help=f"auto or one of {', '.join(GPU_MEMORY_GIB)}")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--mode", choices=["lora", "qlora"], default="qlora")
    parser.add_argument("--rank", type=int, default=16)
