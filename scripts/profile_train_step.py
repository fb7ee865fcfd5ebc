"""Profile one slothkit training step at a real shape; print the top CUDA kernels.

    python scripts/profile_train_step.py llama-3-8b lora 2 2048
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from slothkit.bench.train_worker import build_model, prepare


def main(model_name="llama-3-8b", mode="lora", batch=2, seq=2048, impl="slothkit"):
    model = build_model(model_name, torch.bfloat16, "cuda", 0, quantize_nf4=mode == "qlora")
    model = prepare(impl, model, 16)
    ids = torch.randint(0, model.config.vocab_size, (int(batch), int(seq)), device="cuda")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))


if __name__ == "__main__":
    main(*sys.argv[1:])
