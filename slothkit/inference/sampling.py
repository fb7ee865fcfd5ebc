"""What ``generate``'s settings mean for the fast decode loop: the generation config a call
amounts to, whether the fast path covers it, and how logits become the next tokens.

The logits processors are transformers' own public classes, in the order its generate
applies them, so greedy and sampled decoding mean exactly what they mean there.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# generate's defaults for the settings the fast loop reads (GenerationConfig leaves them
# None and fills these in during generate).
DEFAULTS = {
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
}
SUPPORTED = set(DEFAULTS) | {"max_new_tokens", "min_new_tokens", "min_p", "eos_token_id", "pad_token_id"}
# Bookkeeping and settings with no effect on greedy or sampled decoding of one sequence.
IGNORED = {
    "transformers_version",
    "_from_model_config",
    "bos_token_id",
    "decoder_start_token_id",
    "use_cache",
    "cache_implementation",
    "cache_config",
    "compile_config",
    "disable_compile",
    "is_assistant",
    "low_memory",
}


def generation_config_for(model_config: GenerationConfig | None, call_config, kwargs: dict):
    """The generation config of one call, as generate builds it: the model's, replaced by
    ``generation_config=`` when given, updated with the call's keywords.

    Returns:
        (config, unused keywords): keywords that are no generation setting come back.
    """
    config = copy.deepcopy(call_config if call_config is not None else model_config or GenerationConfig())
    unused = config.update(**kwargs)
    return config, unused


# generate's defaults for the settings the fast loop does not implement: at these values
# (or None or False) they change nothing.  transformers 5.2x keeps the same table in
# GenerationConfig._get_default_generation_params; older versions in the blank config.
INERT = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "early_stopping": False,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "diversity_penalty": 0.0,
    "encoder_repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
    "assistant_lookbehind": 10,
    "target_lookbehind": 10,
}


def _hf_defaults() -> dict:
    blank = GenerationConfig().to_dict()
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    return {**blank, **(defaults() if callable(defaults) else {}), **INERT}


def unsupported_settings(config: GenerationConfig) -> list[str]:
    """Names of the settings in ``config`` that the fast loop does not implement (beam
    search, scores in the output, n-gram bans, ...), where they differ from generate's
    defaults; empty when the fast loop decodes exactly what generate would."""
    defaults = _hf_defaults()
    names = []
    for name, value in config.to_dict().items():
        if name in SUPPORTED or name in IGNORED or value is None or value is False:
            continue
        if value != defaults.get(name):
            names.append(name)
    return sorted(names)


def setting(config: GenerationConfig, name: str):
    """``config``'s value for ``name``, or generate's default when unset."""
    value = getattr(config, name, None)
    return DEFAULTS.get(name) if value is None else value


def eos_ids(config: GenerationConfig) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [
        int(token)
        for token in (eos.tolist() if torch.is_tensor(eos) else eos if isinstance(eos, list) else [eos])
    ]


def logits_processors(config: GenerationConfig, prompt_length: int, device) -> LogitsProcessorList:
    """The processors generate would apply for ``config``, in its order: penalties and
    length rules first, then (when sampling) temperature, top-k, top-p, min-p."""
    processors = LogitsProcessorList()
    eos = eos_ids(config)
    if setting(config, "repetition_penalty") != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=setting(config, "repetition_penalty")))
    if eos and setting(config, "min_length") > 0:
        processors.append(MinLengthLogitsProcessor(setting(config, "min_length"), eos, device=device))
    if eos and (config.min_new_tokens or 0) > 0:
        processors.append(
            MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos, device=device)
        )
    if setting(config, "do_sample"):
        if setting(config, "temperature") != 1.0:
            processors.append(TemperatureLogitsWarper(setting(config, "temperature")))
        if setting(config, "top_k") not in (0, None):
            processors.append(TopKLogitsWarper(top_k=setting(config, "top_k")))
        if setting(config, "top_p") < 1.0:
            processors.append(TopPLogitsWarper(top_p=setting(config, "top_p")))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=config.min_p))
    return processors


def next_tokens(logits: torch.Tensor, sequences: torch.Tensor, processors, do_sample: bool) -> torch.Tensor:
    """The next token of each row (B,) from float32 ``logits`` (B, V), given the
    ``sequences`` (B, L) so far."""
    scores = processors(sequences, logits) if processors else logits
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)
