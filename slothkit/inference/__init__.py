"""Fast generation after ``FastModel.for_inference``.

    enable_fast_decode(model, fast)     # for_inference: attach a FastDecoder (or say why not)
    disable_fast_decode(model)          # for_training: drop it and free its cache
    fast_generate(model, args, kwargs)  # generate's glue: the fast loop's output, or None

Files: kv_cache.py (the static cache), model_step.py (one decoder step over it),
gemma4_step.py (Gemma 4's step: per-layer inputs, shared keys and values),
decode_experts.py (a mixture-of-experts block's chosen experts in a step),
decode_deltanet.py (a gated DeltaNet layer's recurrent state in a step), decode_check.py
(a family without a record checked against its own forward when switched on),
image_prompt.py (an image-text model's prompt: its images merged by the model), sampling.py
(generate's settings and logits processors), fast_decoder.py (prefill, the captured
decode step, the loop).
"""

from __future__ import annotations

import torch

from slothkit.core.inspection import causal_lm_of
from slothkit.core.model_state import attach_state, state_of
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.inference.decode_check import decode_disagreement
from slothkit.inference.fast_decoder import FastDecoder
from slothkit.inference.gemma4_step import Gemma4Step
from slothkit.inference.image_prompt import IMAGE_INPUTS
from slothkit.inference.model_step import ModelStep, longrope_short_positions
from slothkit.inference.sampling import generation_config_for, setting, unsupported_settings
from slothkit.models import ARCHITECTURES, architecture_for, export_record_for, language_model_architecture
from slothkit.models.gpt_oss import GPT_OSS
from slothkit.models.image_text import is_image_text_config
from slothkit.models.mixtral import MIXTRAL
from slothkit.models.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from slothkit.models.qwen3_moe import QWEN3_MOE

__all__ = ["FastDecoder", "disable_fast_decode", "enable_fast_decode", "fast_generate"]

# The mixture-of-experts families whose decode step decode_experts.py computes, each
# checked token for token against Hugging Face's generate: Qwen3-MoE (softmax router,
# SwiGLU experts, q/k-normed attention), gpt-oss (attention sinks and biases, a router and
# experts with biases, the clamped SwiGLU) and Mixtral (Mistral's attention).
DECODED_EXPERT_RECORDS = (QWEN3_MOE, GPT_OSS, MIXTRAL)
# The families whose gated DeltaNet layers decode_deltanet.py steps, checked token for
# token against Hugging Face's generate: Qwen3.5 (its gated attention in model_step.py).
DECODED_DELTANET_FAMILIES = (QWEN3_5, QWEN3_5_MOE)

# Families with no record whose decoder has its own step (model_type -> step class), each
# checked token for token against Hugging Face's generate: Gemma 4's text model (per-layer
# input embeddings, keys and values shared across layers, 26B-A4B's experts beside its MLP).
DECODED_FAMILY_STEPS = {"gemma4_text": Gemma4Step}

# generate's keywords that are not generation settings and that the fast loop reads.
_INPUTS = ("input_ids", "attention_mask", "streamer", "generation_config")


def fused_record(config):
    """The fused record of the model (an image-text model's: its language model's), or None."""
    return language_model_architecture(config) if is_image_text_config(config) else architecture_for(config)


def decoded_record(config):
    """The record of a family the fast loop decodes: a fused family's (an image-text
    model's language model's: the prefill merges its images, image_prompt.py), a
    mixture-of-experts family's (DECODED_EXPERT_RECORDS; its blocks run decode_experts.py),
    or a gated DeltaNet family's (DECODED_DELTANET_FAMILIES), else None."""
    arch = fused_record(config)
    if arch is not None or is_image_text_config(config):
        return arch
    record = export_record_for(config)
    return record if record in DECODED_EXPERT_RECORDS + DECODED_DELTANET_FAMILIES else None


def step_class_for(config):
    """The step that decodes a model of ``config``: its family's own, else ModelStep."""
    return DECODED_FAMILY_STEPS.get(getattr(config, "model_type", None), ModelStep)


def _why_not(causal_lm, fast: bool | None) -> str | None:
    """Why the fast path cannot take this model, or None when it can ("" on a CPU, which
    FastModel.from_pretrained's notice has already named)."""
    config = causal_lm.config
    if decoded_record(config) is None and config.model_type not in DECODED_FAMILY_STEPS:
        families = ARCHITECTURES + DECODED_EXPERT_RECORDS + DECODED_DELTANET_FAMILIES
        covered = ", ".join([family.name for family in families] + list(DECODED_FAMILY_STEPS))
        if is_image_text_config(config):
            text_type = config.get_text_config().model_type
            return (
                f"fast generation covers the image-text models whose language model is of a fused family "
                f"({', '.join(family.name for family in ARCHITECTURES)}), not {config.model_type!r} "
                f"(its language model is {text_type!r})"
            )
        return f"fast generation covers {covered}, not {config.model_type!r}"
    refusal = step_class_for(config).cannot_decode(config)
    if refusal is not None:
        return f"fast generation does not cover {refusal}"
    device = causal_lm.get_input_embeddings().weight.device
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major < 7:
            return "fast generation needs a GPU of compute capability 7.0 (Volta) or newer"
        return None
    if fast:
        return None  # asked for on a CPU: the same loop without the graph (tests, parity)
    return ""  # a CPU: from_pretrained's notice already said that generate stays Hugging Face's


def enable_fast_decode(model, fast: bool | None = None, while_training: bool = False) -> bool:
    """Give the model inside ``model`` a FastDecoder, so that its ``generate`` (with the
    instance glue of slothkit.inference.generation) decodes through it.

    Args:
        model: a model from FastModel (a PeftModel or the causal LM itself).
        fast: None: where it pays (a CUDA GPU, a supported architecture), else Hugging
            Face's generate with a one-line notice; True: also on a CPU (same numbers,
            no graph); False: Hugging Face's generate.
        while_training: also decode through it while the model is in training mode (the
            on-policy trainers' sampling); otherwise a model in training mode generates
            with Hugging Face's generate.

    Returns:
        Whether the fast path is on.
    """
    causal_lm = causal_lm_of(model)
    if fast is False or causal_lm.get_output_embeddings() is None:  # a classifier does not generate
        disable_fast_decode(model)
        return False
    reason = _why_not(causal_lm, fast)
    if reason is not None:
        disable_fast_decode(model)
        if reason:
            say_once(f"slothkit: {reason}; model.generate runs Hugging Face's generate", FallbackWarning)
        return False
    state = attach_state(causal_lm)
    if state.fast_decode_refused is not None:
        return False
    if state.fast_decoder is None:
        arch = decoded_record(causal_lm.config)
        # A family step's embedding scales itself (Gemma 4's embedding module does).
        embedding_scale = arch is not None and arch.embedding_scale
        use_graph = causal_lm.get_input_embeddings().weight.device.type == "cuda"
        step_class = step_class_for(causal_lm.config)
        decoder = FastDecoder(causal_lm, embedding_scale, use_graph, step_class)
        if fused_record(causal_lm.config) is None:  # no record: checked here (decode_check.py)
            disagreement = decode_disagreement(decoder)
            if disagreement is not None:
                decoder.release()
                state.fast_decode_refused = disagreement
                say_once(
                    f"slothkit: fast generation is off for this {causal_lm.config.model_type!r} model: "
                    f"{disagreement}; model.generate runs Hugging Face's generate",
                    FallbackWarning,
                )
                return False
        state.fast_decoder = decoder
    state.fast_decoder.while_training = while_training
    return True


def disable_fast_decode(model) -> None:
    """Drop the model's FastDecoder, freeing its cache and graph."""
    state = state_of(model)
    decoder = state.fast_decoder if state is not None else None
    if decoder is not None:
        state.fast_decoder = None
        decoder.release()


def fast_generate(model, args: tuple, kwargs: dict):
    """``model.generate(*args, **kwargs)`` through the model's FastDecoder, or None when it
    has none or the call asks for something the fast loop does not do (said once)."""
    causal_lm = causal_lm_of(model)
    state = state_of(causal_lm)
    decoder = state.fast_decoder if state is not None else None
    if decoder is None or (causal_lm.training and not decoder.while_training):
        return None
    kwargs = dict(kwargs)
    if args:
        if len(args) > 1 or "input_ids" in kwargs:
            return None
        kwargs["input_ids"] = args[0]
    inputs = {name: kwargs.pop(name, None) for name in _INPUTS}
    image_inputs = None
    if is_image_text_config(causal_lm.config):
        image_inputs = {name: kwargs.pop(name) for name in IMAGE_INPUTS if kwargs.get(name) is not None}
        if "pixel_values" not in image_inputs:  # a prompt without images: the token types say nothing
            image_inputs = None
    input_ids = inputs["input_ids"]
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        return _refuse("generate without a (batch, length) input_ids tensor")
    config, unused = generation_config_for(causal_lm.generation_config, inputs["generation_config"], kwargs)
    unused = sorted(name for name in unused if name != "token_type_ids" or unused[name] is None)
    unsupported = unused + unsupported_settings(config)
    if unsupported:
        return _refuse(", ".join(unsupported))
    short_positions = longrope_short_positions(causal_lm.config.get_text_config())
    if short_positions is not None:
        prompt = input_ids.shape[1]
        new = (
            config.max_new_tokens
            if config.max_new_tokens is not None
            else setting(config, "max_length") - prompt
        )
        if prompt + new > short_positions:
            return _refuse(
                f"a longrope model's call past its first {short_positions} positions (its rotary "
                "tables switch to the long factors there, and Hugging Face's generate re-runs the prompt)"
            )
    attention_mask = inputs["attention_mask"]
    if attention_mask is None and config.pad_token_id is not None:
        # generate's rule: pad tokens in the prompt mark padding unless pad is also eos.
        pad = config.pad_token_id
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        if pad not in eos and bool((input_ids == pad).any()):
            attention_mask = (input_ids != pad).long()
    return decoder.generate(
        input_ids, attention_mask, config, streamer=inputs["streamer"], image_inputs=image_inputs
    )


def _refuse(what: str):
    say_once(
        f"slothkit: fast generation does not cover {what}; that call runs Hugging Face's generate",
        FallbackWarning,
    )
    return None
