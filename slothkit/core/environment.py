"""What this machine has: versions and accelerator, for reports and benchmark records."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time

import torch

from slothkit.core.allocator import VARIABLES

REPORTED_PACKAGES = (
    "slothkit",
    "torch",
    "triton",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "trl",
    "datasets",
    "liger-kernel",
    "unsloth",
)


def package_versions(names=REPORTED_PACKAGES) -> dict[str, str | None]:
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    if "slothkit" in versions and versions["slothkit"] is None:
        # Run from a source tree on the path (as on the GPU machine), not installed.
        from slothkit.core.version import __version__

        versions["slothkit"] = f"{__version__} (source tree)"
    return versions


def allocator_settings() -> str:
    """The CUDA caching allocator's settings this process runs under: the environment
    variable torch reads when the allocator starts (PYTORCH_ALLOC_CONF, or its older name
    PYTORCH_CUDA_ALLOC_CONF), or "defaults".  A library imported first may have set it
    (Unsloth sets expandable segments), and it moves reserved memory, so benchmark rows
    keep it beside their memory figures."""
    for name in VARIABLES:
        if os.environ.get(name):
            return os.environ[name]
    return "defaults"


def accelerator() -> dict:
    """The GPU slothkit would train on, or a note that there is none."""
    if not torch.cuda.is_available():
        return {"device": "cpu", "name": platform.processor() or platform.machine()}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "device": "cuda",
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "compute_capability": f"{props.major}.{props.minor}",
        "bf16": torch.cuda.is_bf16_supported(),
        "cuda": torch.version.cuda,
    }


def host() -> dict:
    """The CPU that drives the GPU, and how long it takes per small torch operation.

    Where training is partly bound by the host (Python and launches), the same GPU
    gives different speeds on hosts of different speed; benchmark records keep this so
    that such runs can be told apart.  The cost is the median over 5 batches of 2,000
    adds on a one-element CPU tensor (Python, the dispatcher, no real work)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    one = torch.zeros(1)
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            one.add(1)
        batches.append((time.perf_counter() - start) / 2000 * 1e6)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_op_us": round(sorted(batches)[2], 2)}


def describe() -> str:
    lines = [f"python {platform.python_version()} on {platform.system()} {platform.machine()}"]
    acc = accelerator()
    if acc["device"] == "cuda":
        lines.append(
            f"GPU: {acc['name']}, {acc['memory_gib']} GiB, compute {acc['compute_capability']}, "
            f"bf16 {'yes' if acc['bf16'] else 'no'}, CUDA {acc['cuda']}"
        )
    else:
        lines.append("GPU: none (training runs on the CPU, slowly)")
    for name, version in package_versions().items():
        lines.append(f"{name:14s} {version or 'not installed'}")
    return "\n".join(lines)
