"""Expandable segments for torch's CUDA caching allocator, unless the user chose a setting.

With its defaults the allocator reserves memory in segments of fixed sizes and splits them
into blocks; a block freed inside a segment can only serve a request that fits it, so a
step that frees and asks for blocks of many sizes (long-context training: activations,
offloaded checkpoints coming back, the head's chunks) strands memory between them.  On an
H200 under a 24 GiB cap, Llama-3-8B QLoRA at batch 1 x 131,072 ran out of memory with
16.94 GiB allocated and 3.70 GiB reserved but unallocated, asking for 4.02 GiB; with
``expandable_segments:True``, whose one segment per stream grows and shrinks by mapping
pages into one address range, the same step fit at 21.1 GiB allocated / 21.5 reserved.

So FastModel.from_pretrained turns expandable segments on for a CUDA model, before the
weights load, when neither PYTORCH_ALLOC_CONF nor its older name PYTORCH_CUDA_ALLOC_CONF
is set, and says so once; either variable set, even to an empty value, is the user's
choice and is kept.  torch reads the variable when CUDA starts; where CUDA started before
(the user ran something on the GPU first), the same setting is applied at run time,
where it covers the segments reserved from then on.
"""

from __future__ import annotations

import os
import warnings

import torch

VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def users_setting() -> str | None:
    """The allocator setting the environment holds (the first variable set), or None."""
    for name in VARIABLES:
        if name in os.environ:
            return os.environ[name]
    return None


def prefer_expandable_segments() -> bool:
    """Turn expandable segments on unless the user set the allocator's variable; True when
    slothkit chose the setting (in this call or an earlier one)."""
    global _chosen_here
    if _chosen_here or users_setting() is not None:
        return _chosen_here
    # Set for this process (torch reads it when CUDA starts) and for the processes it
    # starts; the torch of before PYTORCH_ALLOC_CONF (< 2.9) reads only the older name.
    os.environ[_variable_torch_reads()] = EXPANDABLE
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    _chosen_here = True
    warnings.warn(
        f"slothkit: CUDA memory is reserved in expandable segments ({_variable_torch_reads()}="
        f"{EXPANDABLE}), which keeps reserved memory close to what is allocated in long-context "
        "steps; set PYTORCH_ALLOC_CONF yourself before loading (an empty value keeps torch's "
        "defaults) to choose otherwise",
        stacklevel=3,
    )
    return True


_chosen_here = False  # this process's setting is slothkit's (the notice was given)


def _variable_torch_reads() -> str:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return VARIABLES[0] if (major, minor) >= (2, 9) else VARIABLES[1]
