"""What a benchmark training run reports besides its step times: the settings slothkit's
run used, the share of layers recomputed (for the FLOP count), the peak resident host
memory, and the measured bf16 matmul peak (the MFU denominator).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from slothkit.core.model_state import state_of


def layer_graphs_of(model):
    """slothkit's LayerGraphs of a model whose checkpointing has them, else None."""
    for module in model.modules():
        graphs = getattr(getattr(module, "_gradient_checkpointing_func", None), "graphs", None)
        if graphs is not None:
            return graphs
    return None


def recomputed_share(model) -> float:
    """The share of decoder layers that re-run their forward in backward (checkpointed or
    offloaded), from the layers' own flags after the steps: what the FLOP count needs."""
    from slothkit.engine.decoder import decoder_layers

    causal_lm, layers = decoder_layers(model)
    flags = [getattr(layer, "gradient_checkpointing", None) for layer in layers]
    if all(flag is None for flag in flags):  # checkpointing kept on the decoder, not per layer
        return float(bool(getattr(causal_lm, "is_gradient_checkpointing", True)))
    return sum(bool(flag) for flag in flags) / len(flags)


def slothkit_settings(model) -> dict:
    """What slothkit's run used: how many layer graphs it replayed (0: none, or graphs
    off), whether the layers kept their sums, and use_gradient_checkpointing="auto"'s
    choice for the step (layers kept, budget, predicted peak reserved)."""
    graphs = layer_graphs_of(model)
    settings = {"cuda_graphs": len(graphs.graphs) if graphs is not None and graphs.enabled else 0}
    for module in model.modules():
        checkpointer = getattr(module, "_gradient_checkpointing_func", None)
        if hasattr(checkpointer, "keeps"):
            settings["keep_sums"] = checkpointer.keeps
            break
    for module in model.modules():
        state = state_of(module)  # the model may be wrapped (DDP): its causal LM carries it
        policy = state.recompute_policy if state is not None else None
        if policy is not None and policy.choice is not None:
            choice = policy.choice
            settings["recompute"] = {
                "kept_layers": choice.kept,
                "layers": choice.layers,
                "tokens": choice.tokens,
                "budget_gib": choice.budget_bytes / 2**30,
                "predicted_peak_gib": choice.peak_bytes / 2**30,
                # Checkpointed on the GPU for want of host memory, and the pinned inputs.
                "on_gpu_layers": choice.on_gpu,
                "predicted_host_gib": choice.host_bytes / 2**30,
                "host_budget_gib": None
                if choice.host_budget_bytes is None
                else choice.host_budget_bytes / 2**30,
            }
    return settings


def peak_host_bytes() -> int | None:
    """The process's peak resident memory, pinned host buffers included: Linux's VmHWM
    (since the last ``reset_peak_host``), else the lifetime peak from getrusage; None
    where the platform says neither."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def reset_peak_host() -> bool:
    """Start the peak resident figure again from the current one (Linux: writing 5 to
    /proc/self/clear_refs), so that the training steps' peak is not the loading's: a
    peer that loads a 16-bit checkpoint from disk holds it in host memory for a while
    (Unsloth: 16.5 GiB for Llama-3-8B, 3.0 while training).  False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def matmul_peak_tflops() -> float:
    """bf16 matmul rate on random data, the MFU denominator (measured, not the datasheet)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12
