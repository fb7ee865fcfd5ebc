"""The Unsloth options FastModel takes that slothkit reads another way: refused in one
line saying what to use instead, dropped with a one-time notice, or rewritten in PEFT's
spelling.  Unsloth notebooks pass them; tests/slothkit/test_unsloth_notebooks.py runs them.
"""

from __future__ import annotations

import os

from slothkit.core.notices import FallbackWarning, LegacySpellingWarning, say_once

# vLLM settings that older notebooks pass with fast_inference=True.
FAST_INFERENCE_OPTIONS = ("gpu_memory_utilization", "max_lora_rank", "float8_kv_cache")
# Unsloth's own loader switches, and why slothkit needs none.
UNSLOTH_LOADER_OPTIONS = {
    "fix_tokenizer": "slothkit loads the tokenizer as transformers does and only gives it a pad token "
    "where it has none",
    "use_exact_model_name": "slothkit loads the name it is given, never a renamed upload",
}
EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def check_loading_options(load_in_8bit, full_finetuning, fast_inference, hf_kwargs: dict) -> None:
    """Refuse what slothkit cannot do, in one line each; drop from ``hf_kwargs`` (saying
    once) the vLLM engine's options, which slothkit's fast_generate does not need."""
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
    for name, reason in UNSLOTH_LOADER_OPTIONS.items():
        if name in hf_kwargs:
            say_once(
                f"from_pretrained({name}={hf_kwargs.pop(name)!r}) is ignored: {reason}", LegacySpellingWarning
            )
    given = [name for name in FAST_INFERENCE_OPTIONS if name in hf_kwargs]
    for name in given:
        hf_kwargs.pop(name)
    if fast_inference or given:
        say_once(
            "from_pretrained(fast_inference=True"
            + "".join(f", {name}=..." for name in given)
            + ") needs no vLLM engine in slothkit: model.fast_generate, save_lora and load_lora take vLLM's "
            "calls and decode through slothkit's own loop (slothkit.inference.vllm_generate); the vLLM settings are unused",
            LegacySpellingWarning,
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
        f"modules_to_save={named!r} in PEFT: they are trained in full, not through an adapter",
        LegacySpellingWarning,
    )
    saved = list(modules_to_save or [])
    return [m for m in target_modules if m not in named], saved + [m for m in named if m not in saved]


# Unsloth's get_peft_model chooses the adapted layers of its FastModel by kind with these
# flags (its Gemma 3, Gemma 3n and Qwen3-VL notebooks pass them). slothkit loads text models
# only (a multimodal checkpoint as its text model: slothkit.loading.text_tower), so the language
# layers are all there is; the attention and MLP flags pick among their projections.
LAYER_FLAGS = (
    "finetune_vision_layers",
    "finetune_language_layers",
    "finetune_attention_modules",
    "finetune_mlp_modules",
)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def targets_from_layer_flags(target_modules, lora_kwargs: dict):
    """target_modules narrowed by Unsloth's finetune_* flags, which are taken out of
    ``lora_kwargs`` (PEFT's LoraConfig does not know them).

    Args:
        target_modules: get_peft_model's (None: the seven projections).
        lora_kwargs: get_peft_model's further keywords; the flags are removed from it.

    Returns:
        target_modules unchanged when no flag turns a kind of layer off, else the list of
        names left.

    Raises:
        ValueError: the flags leave nothing to adapt, or turn a kind off while
            target_modules is "all-linear" (which names no kinds).
    """
    flags = {name: lora_kwargs.pop(name) for name in LAYER_FLAGS if name in lora_kwargs}
    if flags.get("finetune_vision_layers"):
        say_once(
            "FastModel.get_peft_model(finetune_vision_layers=True): FastModel loads text models (a multimodal "
            "checkpoint as its text model alone), so only the language layers get adapters; "
            "FastVisionModel loads the whole image-text model and adapts its vision layers too",
            FallbackWarning,
        )
    if flags.get("finetune_language_layers", True) is False:
        raise ValueError(
            "finetune_language_layers=False leaves nothing to adapt: FastModel loads text models, whose "
            "layers are all language layers; FastVisionModel loads image-text models with their vision layers"
        )
    dropped = [
        kind
        for kind, flag in (("attention", "finetune_attention_modules"), ("MLP", "finetune_mlp_modules"))
        if flags.get(flag, True) is False
    ]
    if not dropped:
        return target_modules
    if target_modules == "all-linear":
        raise ValueError(
            f"target_modules='all-linear' with finetune_{dropped[0].lower()}_modules=False: name the "
            f"layers to adapt in target_modules instead"
        )
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if target_modules is not None:
        names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    off = (ATTENTION_PROJECTIONS if "attention" in dropped else ()) + (
        MLP_PROJECTIONS if "MLP" in dropped else ()
    )
    kept = [name for name in names if name not in off]
    if not kept:
        raise ValueError(
            f"finetune_attention_modules and finetune_mlp_modules leave none of target_modules={names!r} "
            f"to adapt: turn one of them on, or name other layers"
        )
    return kept


def gguf_method_keyword(kwargs: dict) -> dict:
    """save_pretrained_gguf / push_to_hub_gguf keywords with Unsloth FastModel's spelling,
    quantization_type="Q8_0" (its Gemma 3 and Qwen3 notebooks), written quantization_method
    as slothkit's functions take it, said once.

    Raises:
        TypeError: both spellings are given.
    """
    if "quantization_type" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    if "quantization_method" in kwargs:
        raise TypeError("give quantization_method or quantization_type (Unsloth's spelling of it), not both")
    kwargs["quantization_method"] = kwargs.pop("quantization_type")
    say_once(
        f"save_pretrained_gguf(quantization_type={kwargs['quantization_method']!r}) is written "
        f"quantization_method={kwargs['quantization_method']!r} in slothkit",
        LegacySpellingWarning,
    )
    return kwargs


def gguf_push_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """push_to_hub_gguf's arguments with Unsloth FastModel's spelling,
    ``push_to_hub_gguf("local-folder", quantization_type=..., repo_id="me/model")`` (its Gemma 3
    notebooks), written ``push_to_hub_gguf("me/model", ...)`` as slothkit's takes it, said once:
    slothkit writes the files into a temporary folder and uploads that.

    Raises:
        TypeError: the first argument, beside repo_id=, is not a folder name.
    """
    if "repo_id" not in kwargs or not args:
        return args, kwargs
    folder, *rest = args
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(
            f"push_to_hub_gguf got repo_id= and a first argument {type(folder).__name__}; give the repository once"
        )
    say_once(
        f"push_to_hub_gguf({str(folder)!r}, repo_id={kwargs['repo_id']!r}) is written "
        f"push_to_hub_gguf({kwargs['repo_id']!r}) in slothkit: the files are written into a temporary folder "
        f"and uploaded, not into {str(folder)!r} (save_pretrained_gguf writes a local copy)",
        LegacySpellingWarning,
    )
    return tuple(rest), kwargs
