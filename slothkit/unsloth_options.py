"""The Unsloth options FastModel takes that slothkit reads another way: refused in one
line saying what to use instead, dropped with a one-time notice, or rewritten in PEFT's
spelling.  Unsloth notebooks pass them; tests/slothkit/test_unsloth_notebooks.py runs them.
"""

from __future__ import annotations

from slothkit.notices import say_once

# vLLM settings that older notebooks pass with fast_inference=True.
FAST_INFERENCE_OPTIONS = ("gpu_memory_utilization", "max_lora_rank", "float8_kv_cache")
EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def check_loading_options(load_in_8bit, full_finetuning, fast_inference, hf_kwargs: dict) -> None:
    """Refuse what slothkit cannot do, in one line each; drop from ``hf_kwargs`` (saying
    once) the fast inference options it does not use yet."""
    if load_in_8bit:
        raise ValueError(
            "load_in_8bit=True is not supported: slothkit's kernels read 16-bit or 4-bit NF4 weights; "
            "use load_in_4bit=True (QLoRA) or load_in_4bit=False (16-bit LoRA)"
        )
    if full_finetuning:
        raise ValueError(
            "full_finetuning=True is not supported: slothkit trains LoRA adapters; load with "
            "full_finetuning=False and call FastModel.get_peft_model (a high r comes closest)"
        )
    given = [name for name in FAST_INFERENCE_OPTIONS if name in hf_kwargs]
    for name in given:
        hf_kwargs.pop(name)
    if fast_inference or given:
        say_once(
            "from_pretrained(fast_inference=True"
            + "".join(f", {name}=..." for name in given)
            + ") is ignored: slothkit has no vLLM decode path yet, and generate runs through transformers"
        )


def embeddings_trained_in_full(target_modules: list, modules_to_save):
    """Older notebooks list embed_tokens and lm_head in target_modules for continued
    pretraining, meaning "train them in full"; PEFT's spelling of that is modules_to_save
    (an adapter on them would be a low-rank update instead).

    Returns:
        ``(target_modules, modules_to_save)`` in PEFT's spelling.
    """
    named = [name for name in EMBEDDING_MODULES if name in target_modules]
    if not named:
        return target_modules, modules_to_save
    say_once(
        f"get_peft_model(target_modules=[..., {', '.join(map(repr, named))}]) is written "
        f"modules_to_save={named!r} in PEFT: they are trained in full, not through an adapter"
    )
    saved = list(modules_to_save or [])
    return [m for m in target_modules if m not in named], saved + [m for m in named if m not in saved]
