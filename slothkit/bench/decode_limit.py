"""How fast a GPU could decode a model if it did nothing but read memory.

A decode step at small batch does little arithmetic per byte: every weight matrix is read
once per step whatever the batch, and each row's keys and values once per step.  The
fastest any implementation can go is therefore

    tokens/s  <=  batch x steps x bandwidth / (bytes read over all steps)

with, for a run of ``new`` tokens after a ``prompt``-token prompt (the prefill makes the
first token and reads the weights once; each of the ``new - 1`` decode steps reads them
again, and the keys and values of the positions before it):

    bytes = new x W  +  batch x KV x sum over steps of the positions attended

where W is the bytes of every weight the step reads (the input embedding table excepted:
a step gathers a few of its rows; unless it is tied to the head, which reads it whole) and
KV the bytes of one position's keys and values over all layers.  A mixture-of-experts
layer's experts count at the share of them a step's tokens choose (``expert_share``).  ``slothkit bench
generate`` reports each row's tokens/s as a share of this limit at the GPU's datasheet
bandwidth, with the bandwidth a device-to-device copy reaches beside it.
"""

from __future__ import annotations

import torch
from torch import nn

# Datasheet memory bandwidth in GB/s, by a part of the name torch reports; the first
# match wins, so a longer name comes before a name it contains.
DATASHEET_GB_PER_S = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("T4", 320.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("V100", 900.0),
    ("P100", 732.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
)


def datasheet_bandwidth(device_name: str) -> float | None:
    """The GPU's datasheet memory bandwidth in GB/s, or None for a GPU not listed."""
    for part, gb_per_s in DATASHEET_GB_PER_S:
        if part.lower() in device_name.lower():
            return gb_per_s
    return None


def _quant_state_bytes(parameter: torch.Tensor) -> int:
    """The bytes beside a bitsandbytes 4-bit weight that its GEMV reads: the block
    scales (and, nested, their own scales and code book)."""
    state = getattr(parameter, "quant_state", None)
    if state is None:
        return 0
    total = 0
    for holder in (state, getattr(state, "state2", None)):
        if holder is None:
            continue
        for name in ("absmax", "code"):
            tensor = getattr(holder, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def expert_share(config, batch: int) -> float:
    """The expected share of a mixture-of-experts layer's E experts that a step of
    ``batch`` tokens reads, each token choosing top_k of them: an expert is left by every
    token with probability (1 - top_k / E)^batch when the router spreads tokens evenly,
    as a random router does (Qwen3-30B-A3B, 8 of 128: 6.3% at batch 1, 40% at batch 8).
    1.0 for a model without experts."""
    config = getattr(config, "text_config", None) or config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return 1.0
    return 1.0 - (1.0 - top_k / experts) ** batch


def _expert_weights(model: nn.Module) -> set[int]:
    """ids of the mixture-of-experts experts' 3-D weights (gate_up_proj, down_proj)."""
    from slothkit.engine.experts import DOWN, GATE_UP, is_experts_module

    return {
        id(getattr(module, name))
        for module in model.modules()
        if is_experts_module(module)
        for name in (GATE_UP, DOWN)
    }


def _stored_bytes(parameter: torch.Tensor) -> int:
    """Bytes a weight is stored in: an experts weight quantised by slothkit is its NF4
    record (the parameter is a placeholder of one element), else the tensor itself and a
    bitsandbytes weight's scales."""
    from slothkit.core.inspection import nf4_experts_of

    record = nf4_experts_of(parameter)
    if record is not None:
        return record.nbytes()
    return parameter.numel() * parameter.element_size() + _quant_state_bytes(parameter)


def weight_bytes(model: nn.Module, batch: int = 1) -> int:
    """Bytes of the weights one decode step of ``batch`` rows reads: every parameter once
    (adapters included), the input embedding table only where it is also the head, a
    mixture-of-experts layer's experts at the share its tokens choose (expert_share)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    embedding_is_head = head is not None and head.weight is embedding
    experts = _expert_weights(model)
    share = expert_share(model.config, batch) if experts else 1.0
    total = 0.0
    seen = set()
    for parameter in model.parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        if parameter is embedding and not embedding_is_head:
            continue
        total += _stored_bytes(parameter) * (share if id(parameter) in experts else 1.0)
    return round(total)


def kv_bytes_per_position(config, dtype: torch.dtype) -> list[tuple[int, int | None]]:
    """Per layer: (bytes of one position's keys and values, the layer's window or None).

    A layer that attends within a sliding window (config.layer_types names it
    "sliding_attention") reads at most its window of positions."""
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_layer = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [
        (per_layer, window if kind == "sliding_attention" and window else None)
        for kind in layer_types[: config.num_hidden_layers]
    ]


def bytes_read(
    weights: int, kv_layers: list[tuple[int, int | None]], batch: int, prompt: int, new: int
) -> int:
    """Bytes a ``new``-token greedy run reads at the least (see the module's docstring)."""
    total = new * weights
    for step in range(1, new):  # decode step ``step`` attends to prompt + step positions
        positions = prompt + step
        total += batch * sum(
            per_position * min(positions, window or positions) for per_position, window in kv_layers
        )
    return total


def limit_tokens_per_s(bytes_total: int, batch: int, new: int, gb_per_s: float) -> float:
    """The tokens/s a run reading ``bytes_total`` would make at ``gb_per_s``."""
    return batch * new / (bytes_total / (gb_per_s * 1e9))


def copy_gb_per_s(device: torch.device | str = "cuda") -> float:
    """GB/s of a device-to-device copy (bytes read plus bytes written), the median of
    the kernel benchmark's probe: what the GPU's memory reaches in practice."""
    from slothkit.bench.kernel_timing import Settings, copy_bandwidth

    return copy_bandwidth(Settings(device=torch.device(device)))


def decode_limit(
    model: nn.Module, dtype: torch.dtype, batch: int, prompt: int, new: int, device_name: str
) -> dict:
    """The record fields of one run's bandwidth limit: weight and KV bytes, bytes read,
    and the limit at the datasheet bandwidth (None where the GPU is not listed)."""
    weights = weight_bytes(model, batch)
    kv_layers = kv_bytes_per_position(model.config, dtype)
    total = bytes_read(weights, kv_layers, batch, prompt, new)
    datasheet = datasheet_bandwidth(device_name)
    return {
        "weight_gib": weights / 2**30,
        "bytes_read_gib": total / 2**30,
        "datasheet_gb_per_s": datasheet,
        "limit_tokens_per_s": None if datasheet is None else limit_tokens_per_s(total, batch, new, datasheet),
    }
