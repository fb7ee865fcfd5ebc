"""One implementation's generation run, in its own process
(``python -m slothkit.bench.generate_worker``).

Every implementation decodes the same thing: the named shape with the same random weights
(slothkit.bench.model_setup.build_model), LoRA r=16 on the seven projections (a
mixture-of-experts model's on its experts' 3-D parameters, as FastModel adapts them) with
the same random adapter weights (so that the adapters change the output), the same random
prompts, greedy, ``min_new_tokens = max_new_tokens`` so that every run makes the same
number of tokens.  An image-text shape's prompts hold one random default-resolution
image each besides their text (slothkit.bench.image_text_batch), its adapters are on the
language model's layers, and slothkit decodes through FastVisionModel.for_inference.
``slothkit-merged`` is slothkit's model with those adapters merged
into its 16-bit weights (PEFT's merge_and_unload), as a model saved merged decodes; under
--mode qlora it is the 4-bit base alone, which is what a merged model loaded back in
4-bit reads.  Each run also records its bandwidth limit (slothkit.bench.decode_limit).
Prints one JSON line prefixed with RESULT_TAG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

from slothkit.bench.decode_limit import copy_gb_per_s, decode_limit
from slothkit.bench.image_text_batch import generation_prompts
from slothkit.bench.image_text_setup import (
    load_with_unsloth_vision,
    prepare_image_text,
    take_fast_vision_path,
)
from slothkit.bench.model_setup import (
    build_for,
    build_model,
    load_with_unsloth,
    lora_targets,
    take_fast_model_path,
)
from slothkit.bench.train_worker import RESULT_TAG
from slothkit.core.allocator import prefer_expandable_segments
from slothkit.core.environment import allocator_settings
from slothkit.core.model_state import state_of
from slothkit.models import IMAGE_TEXT_SHAPES

# Tokens of each row compared between implementations (the first 32).
COMPARED_TOKENS = 32


def _randomise_adapters(model, seed: int) -> None:
    """Give every implementation's adapters the same random values: B (which starts at
    zero, so that the adapters do nothing) and A too, which each library draws from the
    global generator in its own order and on its own device, so that without this the
    implementations would decode different models.  One generator over the names in
    sorted order; A at about Kaiming's scale (1/sqrt(in_features)), B at 0.01."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if "lora_A" in name:
                scale = parameter.shape[-1] ** -0.5
            elif "lora_B" in name:
                scale = 0.01
            else:
                continue
            values = torch.randn(parameter.shape, generator=generator) * scale
            parameter.copy_(values.to(parameter.device, parameter.dtype))


def prepare(impl: str, args, dtype, device, fast_decode: bool | None = None):
    """The model with LoRA, switched to inference as each implementation's users do.

    fast_decode: slothkit's for_inference argument (None: its fast loop on a CUDA GPU;
    True: on a CPU too, for checking).
    """
    if args.model in IMAGE_TEXT_SHAPES:
        return prepare_image_text_inference(impl, args, dtype, device, fast_decode)
    if impl == "unsloth":
        from unsloth import FastLanguageModel

        args.seq = args.prompt_len + args.new_tokens
        model, _ = load_with_unsloth(build_model(args.model, dtype, device, args.seed), args, dtype)
        _randomise_adapters(model, args.seed + 2)
        FastLanguageModel.for_inference(model)
        return model
    model = build_for(impl, args, dtype, device)
    if impl == "hf":
        from peft import LoraConfig, get_peft_model

        from slothkit.loading.lora_setup import onto_expert_parameters

        # A mixture-of-experts model's experts: the same 3-D parameters FastModel adapts.
        targets, expert_parameters = onto_expert_parameters(model, lora_targets(model))
        extra = {"target_parameters": expert_parameters} if expert_parameters else {}
        model = get_peft_model(
            model,
            LoraConfig(
                r=args.rank, lora_alpha=args.rank, target_modules=targets, task_type="CAUSAL_LM", **extra
            ),
        )
        _randomise_adapters(model, args.seed + 2)
        model.eval()
        model.config.use_cache = True
        return model
    if impl in ("slothkit", "slothkit-merged"):
        from slothkit import FastModel
        from slothkit.inference.generation import accept_encoding_in_generate

        take_fast_model_path(model)
        accept_encoding_in_generate(model)
        if impl == "slothkit-merged" and args.mode == "qlora":
            # Merging into a 4-bit base writes 16-bit weights; a merged model loaded back
            # in 4-bit reads what this base reads, so it decodes at this base's speed.
            FastModel.for_inference(model)
            return model
        model = FastModel.get_peft_model(
            model, r=args.rank, lora_alpha=args.rank, use_gradient_checkpointing=False
        )
        _randomise_adapters(model, args.seed + 2)
        if impl == "slothkit-merged":
            model = model.merge_and_unload()  # the adapters added into the 16-bit weights
        FastModel.for_inference(model, fast_decode)
        return model
    raise ValueError(f"unknown implementation {impl!r}")


def prepare_image_text_inference(impl: str, args, dtype, device, fast_decode: bool | None = None):
    """An image-text shape's model with LoRA on its language model's layers
    (slothkit.bench.image_text_setup), switched to inference: slothkit's through
    FastVisionModel.for_inference (its fast loop, which prefills the images through the
    model's own vision tower), HF + PEFT's and Unsloth's as their users do."""
    if impl == "unsloth":
        from unsloth import FastVisionModel as UnslothVisionModel

        args.seq = args.prompt_len + args.new_tokens + IMAGE_TEXT_SHAPES[args.model].image_tokens() + 2
        built = build_model(args.model, dtype, device, args.seed)
        model, _ = load_with_unsloth_vision(built, args.model, args, dtype, inference=True)
        _randomise_adapters(model, args.seed + 2)
        UnslothVisionModel.for_inference(model)
        return model
    if impl not in ("slothkit", "slothkit-merged", "hf"):
        raise ValueError(f"unknown implementation {impl!r}")
    model = build_for(impl, args, dtype, device)
    if impl == "hf":
        model = prepare_image_text("hf", model, args.rank, seq=0, hf_checkpointing="off")
        _randomise_adapters(model, args.seed + 2)
        model.eval()
        model.config.use_cache = True
        return model
    from slothkit import FastVisionModel

    take_fast_vision_path(model, model.config.get_text_config().max_position_embeddings)
    if impl == "slothkit-merged" and args.mode == "qlora":  # the 4-bit base, as for a text shape
        FastVisionModel.for_inference(model, fast_decode)
        return model
    model = FastVisionModel.get_peft_model(
        model,
        finetune_vision_layers=False,
        r=args.rank,
        lora_alpha=args.rank,
        use_gradient_checkpointing=False,
    )
    _randomise_adapters(model, args.seed + 2)
    if impl == "slothkit-merged":
        model = model.merge_and_unload()  # the adapters added into the 16-bit weights
    FastVisionModel.for_inference(model, fast_decode)
    return model


def prompts_for(args, vocab: int, generator: torch.Generator, device) -> dict:
    """generate's inputs of the run: ``--batch`` random prompts of ``--prompt-len`` tokens,
    left-padded to various lengths after the first; an image-text shape's with one image
    each besides (its tokens on top of --prompt-len; slothkit.bench.image_text_batch)."""
    shape = IMAGE_TEXT_SHAPES.get(args.model)
    if shape is not None:
        prompts = generation_prompts(shape, args.batch, args.prompt_len, generator)
        return {name: value.to(device) for name, value in prompts.items()}
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=generator).to(device)
    mask = torch.ones_like(prompts)
    if args.batch > 1:  # left padding of various lengths, as a batch of real prompts has
        for row in range(1, args.batch):
            mask[row, : (row * args.prompt_len) // (2 * args.batch)] = 0
        prompts = prompts.masked_fill(mask == 0, 0)
    return {"input_ids": prompts, "attention_mask": mask}


def _generate(model, input_ids, attention_mask, new_tokens: int, **images):
    """Greedy, exactly ``new_tokens`` new tokens; ``images``: an image-text prompt's pixels
    and token types (generate's keywords)."""
    return model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        **images,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def timed_generate(model, input_ids, attention_mask, new_tokens: int, **images):
    """(output, seconds) of one greedy generate call of ``new_tokens`` tokens, the GPU
    synchronised before and after: what the bench times (scripts/profile_decode.py too)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = _generate(model, input_ids, attention_mask, new_tokens, **images)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def run(args) -> dict:
    if args.impl == "unsloth":
        import importlib.util

        if importlib.util.find_spec("unsloth") is None:
            raise ImportError("No module named 'unsloth'")
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
        import unsloth  # noqa: F401  (before transformers is used)
    if not torch.cuda.is_available():
        raise RuntimeError("the generation benchmark needs a CUDA GPU")
    if args.impl.startswith("slothkit") and torch.cuda.is_available():
        prefer_expandable_segments()  # as FastModel.from_pretrained does before loading
    device = "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(args.seed)
    if args.memory_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))
    model = prepare(args.impl, args, dtype, device)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(args.seed + 1)
    images = prompts_for(args, vocab, generator, device)
    prompts, mask = images.pop("input_ids"), images.pop("attention_mask")
    if "pixel_values" in images:  # in the model's dtype, as the vision collator casts them
        images["pixel_values"] = images["pixel_values"].to(dtype)
    prompt_len = prompts.shape[1]  # an image-text prompt's image tokens included

    # Warm-up: the timed call itself, once.  A static-cache decoder sizes its cache and
    # captures its graph for the length it is asked for; a shorter warm-up would leave that
    # one-time work (and compilation, autotuning) inside the timed run.
    _generate(model, prompts, mask, args.new_tokens, **images)
    torch.cuda.reset_peak_memory_stats()
    out, seconds = timed_generate(model, prompts, mask, args.new_tokens, **images)
    result = {
        "status": "ok",
        "tokens_per_s": args.batch * args.new_tokens / seconds,
        "seconds": seconds,
        "prompt_tokens": prompt_len,
        "first_tokens": out[:, prompt_len : prompt_len + COMPARED_TOKENS].tolist(),
        "loaded_gib": loaded / 2**30,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "allocator": allocator_settings(),  # as the imports left it (Unsloth sets its own)
    }
    result["generation_gib"] = result["peak_allocated_gib"] - result["loaded_gib"]
    # A 4-bit base without adapters is another model than HF's: its tokens are not compared.
    result["compare_tokens"] = not (args.impl == "slothkit-merged" and args.mode == "qlora")
    result.update(
        decode_limit(model, dtype, args.batch, prompt_len, args.new_tokens, torch.cuda.get_device_name())
    )
    try:
        result["copy_gb_per_s"] = copy_gb_per_s()
    except torch.OutOfMemoryError:  # under a tight --memory-gib cap: the limit stands without it
        result["copy_gb_per_s"] = None
    if args.impl.startswith("slothkit"):
        from slothkit.inference.gemv_choice import choices

        result["gemv_choices"] = choices()  # which GEMV each decode projection shape runs
    state = state_of(model)
    decoder = state.fast_decoder if state is not None else None
    if decoder is not None:
        result["kv_cache_gib"] = decoder.nbytes / 2**30
        result["graph_captured"] = decoder.captured is not None and decoder.captured.graph is not None
    if args.ttft_len and args.batch == 1:
        # Text alone, below an image-text shape's image ids (no image to prefill).
        shape = IMAGE_TEXT_SHAPES.get(args.model)
        top = min(shape.image_markers()) if shape is not None else vocab
        long_prompt = torch.randint(3, top, (1, args.ttft_len), generator=generator).to(device)
        result.update(_time_to_first_token(model, long_prompt))
    return result


def _time_to_first_token(model, long_prompt) -> dict:
    """The best of two timed one-token generates on ``long_prompt`` after one untimed.

    A failure here (a peer whose attention cannot take the long prompt) is recorded as
    ``ttft_error`` beside the throughput already measured, rather than losing both."""
    long_mask = torch.ones_like(long_prompt)
    try:
        _generate(model, long_prompt, long_mask, 1)
        seconds = min(timed_generate(model, long_prompt, long_mask, 1)[1] for _ in range(2))
    except Exception as error:  # recorded, as main() records a failed run
        return {
            "ttft_error": f"{type(error).__name__}: {str(error).splitlines()[0]}",
            "ttft_len": long_prompt.shape[1],
        }
    return {"ttft_s": seconds, "ttft_len": long_prompt.shape[1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["lora", "qlora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--ttft-len", type=int, default=0)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-gib", type=float, default=None)
    args = parser.parse_args(argv)
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run(args)
        # slothkit's one-line notices (a fallback said once) belong in the record.
        result["notices"] = sorted({str(w.message) for w in caught if str(w.message).startswith("slothkit")})
    except torch.cuda.OutOfMemoryError as error:
        result = {"status": "out of memory", "error": str(error).splitlines()[0]}
    except ImportError as error:
        result = {"status": "skipped", "error": f"not importable: {error}"}
    except Exception as error:  # reported in the table; the other implementations still run
        result = {
            "status": "error",
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
