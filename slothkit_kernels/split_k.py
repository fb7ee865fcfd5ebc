"""Split-K for the decode GEMVs (lora_gemv, nf4_lora_gemv): several programs share one band of
output rows, each summing one slice of K, in one launch and deterministically.

At one to eight rows a projection with few output rows (a Llama-3-8B k/v projection:
N = 1,024, 64 bands of 16 rows) gives too few programs to keep enough loads in flight to
reach the memory's bandwidth.  Cutting K into ``slices`` gives ``bands x slices``
programs.  Each stores its fp32 partial sums, then counts itself in with an atomic add on
its band's counter; the last of the band's programs to arrive adds the partials in slice
order (so the result does not depend on which finished first), and sets the counter back
to 0 for the next call.  That program alone then applies the kernel's epilogue.

The partial sums and counters are a workspace per device and shape, made at the first
call outside CUDA graph capture and kept for the process (a captured graph keeps pointing
at it); a split call made during capture before its shape has a workspace runs unsplit
instead.  Split calls on a device share that workspace, so they must run on one stream
at a time, as a decode step does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Workspaces of split calls, per (device, rows, N, slices, bands): kept for the process.
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@triton.jit
def combine_slices(acc, offs_m, offs_n, m_mask, n_mask, PARTIALS, COUNTERS, M, N, pid_n, pid_k, slices):
    """Store this program's partial sums ``acc`` (BLOCK_M, BLOCK_N) of slice ``pid_k``;
    return (the band's full sums, True) in the band's last program to arrive, else
    (acc, False)."""
    band = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(PARTIALS + pid_k.to(tl.int64) * M * N + band, acc, mask=mn_mask)
    tl.debug_barrier()  # every thread's partials stored before the count says so
    arrived = tl.atomic_add(COUNTERS + pid_n, 1, sem="acq_rel")
    last = arrived == slices - 1
    if last:  # the others' partials are in
        acc = tl.zeros_like(acc)
        for s in range(0, slices):  # in slice order: the same sum whoever came last
            acc += tl.load(PARTIALS + s * M * N + band, mask=mn_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(COUNTERS + pid_n, 0)  # ready for the next call
    return acc, last


def slices(device: torch.device, bands: int, k: int, block_k: int, programs_per_sm: int) -> tuple[int, int]:
    """How many slices K is cut into (and the columns of each, a multiple of block_k) for
    the grid to hold ``programs_per_sm`` programs per SM; 1 slice when that is 0."""
    if programs_per_sm == 0:
        return 1, k
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    steps = triton.cdiv(k, block_k)
    count = min(triton.cdiv(programs_per_sm * sms, bands), steps)
    k_per_slice = triton.cdiv(steps, count) * block_k
    return triton.cdiv(k, k_per_slice), k_per_slice


def workspace(device, rows: int, n: int, count: int, bands: int):
    """The partial sums and zeroed counters of a call cut into ``count`` slices, or
    (None, None): unsplit, or a shape first met during CUDA graph capture (memory made
    then belongs to the graph)."""
    if count == 1:
        return None, None
    key = (str(device), rows, n, count, bands)
    if key not in _workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None, None
        _workspaces[key] = (
            torch.empty(count, rows, n, dtype=torch.float32, device=device),
            torch.zeros(bands, dtype=torch.int32, device=device),
        )
    return _workspaces[key]


def plan(device, rows: int, n: int, k: int, block_n: int, block_k: int, programs_per_sm: int):
    """(bands, slices, columns per slice, partials, counters) of a launch over an (n, k)
    weight in bands of block_n rows; one slice (and no workspace) where unsplit."""
    bands = triton.cdiv(n, block_n)
    count, k_per_slice = slices(device, bands, k, block_k, programs_per_sm)
    partials, counters = workspace(device, rows, n, count, bands)
    if partials is None:
        count, k_per_slice = 1, k
    return bands, count, k_per_slice, partials, counters
