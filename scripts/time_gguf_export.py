"""Time slothkit's GGUF export of a real-size model against llama.cpp's own quantiser.

    python scripts/time_gguf_export.py --model llama-3-8b --quant q4_k_m --out /tmp/gguf-timing

Builds the named shape with random weights (bf16, on the GPU when there is one), then
1. slothkit: save_pretrained_gguf(..., quant) -- time, peak GPU memory, peak host memory;
2. slothkit: an F16 GGUF of the same model (llama.cpp's quantiser needs one as input);
3. llama-cpp-python: llama_model_quantize(F16 -> quant) on every CPU core -- time;
4. the reconstruction error of both files on a few weights, against the original;
5. slothkit's verification of its own file (llama.cpp logits against the HF model).
Prints the figures and writes them as JSON to --out/gguf-timing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import numpy as np
import torch


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def record(out: Path, figures: dict, show: bool = False) -> None:
    text = json.dumps(figures, indent=1, default=str)
    (out / "gguf-timing.json").write_text(text + "\n")
    if show:
        print(text, flush=True)


def relative_errors(path: Path, originals: dict[str, torch.Tensor]) -> dict[str, float]:
    """rms(dequantised - original) / rms(original) for the named GGUF tensors."""
    import gguf

    errors = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name in originals:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            original = originals[tensor.name].float().numpy().reshape(values.shape)
            errors[f"{tensor.name} ({tensor.tensor_type.name})"] = float(
                np.sqrt(np.mean((values - original) ** 2)) / np.sqrt(np.mean(original**2))
            )
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--quant", default="q4_k_m")
    parser.add_argument("--out", default="/tmp/gguf-timing")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument(
        "--verify-reference",
        action="store_true",
        help="also verify llama.cpp's own file the same way (is a failure the "
        "quantisation type's, on these weights, or slothkit's file's?)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    from transformers import AutoTokenizer

    from slothkit.bench.model_setup import build_model
    from slothkit.export.gguf import save_pretrained_gguf, write_gguf
    from slothkit.export.gguf.tensor_types import quantization_method
    from slothkit.export.gguf.verify import quantize_with_llama_cpp
    from slothkit.testing import build_tiny_tokenizer

    method = quantization_method(args.quant)

    figures: dict = {"model": args.model, "quant": args.quant, "device": device, "cpu_count": os.cpu_count()}
    if device == "cuda":
        figures["gpu"] = torch.cuda.get_device_name()
    start = time.perf_counter()
    model = build_model(args.model, torch.bfloat16, device, seed=0).eval()
    tokenizer_dir = out / "tokenizer"
    build_tiny_tokenizer("bpe", tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tokenizer) > model.config.vocab_size:  # only the tiny shapes (a dry run on a CPU)
        model.resize_token_embeddings(len(tokenizer))
    figures["build_s"] = time.perf_counter() - start
    # Weights to compare after quantisation (GGUF names; attn_q/attn_k are row-permuted,
    # so only tensors that go in unchanged are compared).
    layer = model.model.layers[len(model.model.layers) // 2]
    index = len(model.model.layers) // 2
    originals = {
        f"blk.{index}.ffn_down.weight": layer.mlp.down_proj.weight.detach().cpu(),
        f"blk.{index}.ffn_up.weight": layer.mlp.up_proj.weight.detach().cpu(),
        f"blk.{index}.attn_v.weight": layer.self_attn.v_proj.weight.detach().cpu(),
        f"blk.{index}.attn_output.weight": layer.self_attn.o_proj.weight.detach().cpu(),
    }

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    (saved,) = [
        p
        for p in save_pretrained_gguf(model, out / "slothkit", tokenizer, method, verify=False)
        if p.suffix == ".gguf"
    ]
    figures["slothkit_export_s"] = time.perf_counter() - start
    figures["slothkit_file_gib"] = saved.stat().st_size / 2**30
    if device == "cuda":
        figures["slothkit_export_gpu_extra_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    figures["host_peak_gib_after_export"] = host_peak_gib()

    start = time.perf_counter()
    f16 = write_gguf(model, out / "model.F16.gguf", tokenizer, quantization_method("f16"))
    figures["slothkit_f16_s"] = time.perf_counter() - start

    record(out, figures)  # written after every stage: a run cut short still reports
    reference = out / f"llama-cpp.{args.quant}.gguf"
    start = time.perf_counter()
    quantize_with_llama_cpp(f16, reference, args.quant)
    figures["llama_cpp_quantize_s"] = time.perf_counter() - start
    figures["llama_cpp_file_gib"] = reference.stat().st_size / 2**30
    figures["slothkit_error"] = relative_errors(saved, originals)
    figures["llama_cpp_error"] = relative_errors(reference, originals)

    record(out, figures, show=True)
    if not args.no_verify:
        from slothkit.export.gguf.verify import verify_gguf

        start = time.perf_counter()
        try:
            report = verify_gguf(saved, model, tokenizer, method)
            figures["verify"] = {"passed": True, **vars(report)}
        except Exception as error:  # recorded: this script measures, the tests judge
            figures["verify"] = {"passed": False, "error": f"{type(error).__name__}: {error}"}
        figures["verify_s"] = time.perf_counter() - start
        checks = [("verify_gguf_weights", saved, "gguf_weights")]
        if args.verify_reference:
            checks += [
                ("verify_llama_cpp_file", reference, "model"),
                ("verify_llama_cpp_file_gguf_weights", reference, "gguf_weights"),
            ]
        for key, path, against in checks:
            try:
                report = verify_gguf(path, model, tokenizer, method, reference=against)
                figures[key] = {"passed": True, **vars(report)}
            except Exception as error:
                figures[key] = {"passed": False, "error": f"{type(error).__name__}: {error}"}
    figures["host_peak_gib"] = host_peak_gib()

    record(out, figures, show=True)
    for path in out.glob("*.gguf"):
        path.unlink()  # 16 GB of F16: not kept
    for path in (out / "slothkit").glob("*.gguf"):
        path.unlink()


if __name__ == "__main__":
    main()
