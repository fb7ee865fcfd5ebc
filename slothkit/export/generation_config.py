"""generation_config.json that stops where the fine-tuned model stops.

A model trained on a chat template ends its answers with the template's end-of-turn token
(`<|eot_id|>`, `<end_of_turn>`, `</s>`, ...). If that token is not among the EOS ids,
`generate` runs past the answer. The saved EOS list is therefore the union, in this order,
of the base's generation-config EOS, the config's EOS, the tokenizer's EOS and the chat
template's end-of-turn token (found by rendering a one-turn conversation and reading the
first special token after the assistant's text).
"""

from __future__ import annotations

import copy
import pathlib

from slothkit.data.turn_end_token import end_of_turn_token_id


def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def generation_config_with_eos(causal_lm, tokenizer):
    """The model's generation config with the EOS list described above and a pad id."""
    from transformers import GenerationConfig

    base = getattr(causal_lm, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig.from_model_config(causal_lm.config)
    eos: list[int] = []
    candidates = _as_list(config.eos_token_id) + _as_list(getattr(causal_lm.config, "eos_token_id", None))
    if tokenizer is not None:
        candidates += _as_list(tokenizer.eos_token_id) + _as_list(end_of_turn_token_id(tokenizer))
    for token_id in candidates:
        if token_id not in eos:
            eos.append(token_id)
    if not eos:
        raise ValueError(
            "cannot write generation_config.json: neither the model nor the tokenizer names an EOS token; "
            "set tokenizer.eos_token (or model.generation_config.eos_token_id) before saving"
        )
    config.eos_token_id = eos[0] if len(eos) == 1 else eos
    if config.pad_token_id is None:
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        config.pad_token_id = pad if pad is not None else eos[0]
    if config.bos_token_id is None and tokenizer is not None and tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    return config


def write_generation_config(causal_lm, tokenizer, directory: pathlib.Path) -> list[int]:
    """Write generation_config.json; return its EOS ids."""
    config = generation_config_with_eos(causal_lm, tokenizer)
    config.save_pretrained(directory)
    return _as_list(config.eos_token_id)
