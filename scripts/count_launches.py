"""Count the device kernels one forward and backward launch, per decoder layer, on a CPU.

When a step is partly bound by the CPU (Python, the dispatcher, Triton's launcher),
the number of launches per layer is what costs, not their size. This counts them
without a GPU: the step runs on tiny tensors on the CPU, every torch operator that
would launch a kernel is counted by a dispatch mode (views, reshapes and allocations
launch nothing and are not counted), and every Triton kernel is counted by name at its
launch and not executed (``TRITON_INTERPRET=1`` routes slothkit's kernels to Triton
rather than to the torch reference; the outputs are then garbage, which does not
change what is launched). The offloaded-checkpoint copies, which exist only on CUDA,
are not included (two per layer per step), nor is the optimizer (one fused launch on
a GPU).

    python scripts/count_launches.py                  # slothkit and HF + PEFT, tiny-llama
    python scripts/count_launches.py --model tiny-gemma --impl slothkit --top 20
    python scripts/count_launches.py --impl slothkit --mode qlora    # NF4 projections

Per layer = (count with 4 layers - count with 2 layers) / 2, so the embedding, the
loss and the optimizer fall out of it. ``--time`` also reports the host time per layer
(the Python, the dispatcher and the CPU's own tiny matmuls; Triton's launcher is not
run, so add its overhead per Triton launch on a GPU): a layer whose host time is below
its GPU time keeps the GPU fed.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Operators that only make views, change metadata or allocate: no kernel on a GPU.
NO_KERNEL = {
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "as_strided",
    "detach",
    "alias",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "narrow",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "_to_copy_noop",
    "unflatten",
    "flatten",
    "set_",
    "_reshape_alias",
    "view_as",
    "expand_as",
    "resize_",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "promote_types",
    "result_type",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
}


class CountKernels(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL:
            self.counts[f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


_COUNTER: list[collections.Counter] = []  # where Triton launches are counted, when counting


def count_triton_launches() -> None:
    """Replace the interpreter's launch with a counter: the kernel never runs."""
    from triton.runtime.interpreter import InterpretedFunction

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and _COUNTER:
            _COUNTER[-1][f"triton::{self.fn.__name__}"] += 1

    InterpretedFunction.run = run


def one_step_counts(
    impl: str, model_name: str, layers: int, seq: int, timed_steps: int = 0, mode: str = "lora"
):
    """(launch counts of one forward and backward, fastest host ms of ``timed_steps`` more)."""
    from slothkit import models
    from slothkit.bench.model_setup import build_model, prepare

    base = models.shape_by_name(model_name)
    name = f"{model_name}-{layers}-layers"
    models.SHAPES[name] = dataclasses.replace(base, num_hidden_layers=layers)
    torch.manual_seed(0)
    # bf16 weights and fp32 adapters, as the benchmark trains on a GPU
    model = prepare(impl, build_model(name, torch.bfloat16, "cpu", 0, quantize_nf4=mode == "qlora"), 8)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    ids = torch.randint(0, model.config.vocab_size, (2, seq))

    def forward_backward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    forward_backward()  # first-call work (lazy state, caches) is not what a step costs
    optimizer.zero_grad(set_to_none=True)
    counts = collections.Counter()
    _COUNTER.append(counts)
    try:
        with CountKernels(counts):
            forward_backward()
    finally:
        _COUNTER.pop()
    times = []
    for _ in range(timed_steps):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        forward_backward()
        times.append((time.perf_counter() - start) * 1e3)
    return counts, (min(times) if times else None)  # noise on a shared host only adds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--impl", default="slothkit,hf")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--mode",
        choices=["lora", "qlora"],
        default="lora",
        help="qlora: the seven projections in NF4 (bitsandbytes on the CPU)",
    )
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="also print one JSON line of the totals")
    parser.add_argument(
        "--time",
        action="store_true",
        help="also time the host side per layer (fastest of 15 steps, one thread)",
    )
    args = parser.parse_args()
    count_triton_launches()
    if args.time:
        torch.set_num_threads(1)  # one host thread issues a GPU's launches
    steps = 15 if args.time else 0
    totals = {}
    for impl in args.impl.split(","):
        two, ms_two = one_step_counts(impl, args.model, 2, args.seq, steps, args.mode)
        four, ms_four = one_step_counts(impl, args.model, 4, args.seq, steps, args.mode)
        per_layer = {k: (four[k] - two[k]) / 2 for k in set(two) | set(four)}
        total = sum(per_layer.values())
        totals[impl] = total
        host = f"; host {(ms_four - ms_two) / 2:.2f} ms per layer" if args.time else ""
        print(
            f"\n== {impl} {args.model} {args.mode}: {total:.0f} launches per decoder layer per training step "
            f"({sum(v for k, v in per_layer.items() if k.startswith('triton::')):.0f} Triton); "
            f"{sum(two.values()) - 2 * total:.0f} outside the layers{host}"
        )
        for key, n in sorted(per_layer.items(), key=lambda kv: -kv[1])[: args.top]:
            if n:
                print(f"{n:7.1f}  {key}")
    if args.json:
        print(json.dumps({"model": args.model, "launches_per_layer": totals}))


if __name__ == "__main__":
    main()
