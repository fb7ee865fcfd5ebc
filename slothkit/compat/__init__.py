"""Other libraries' spellings that slothkit accepts and translates, importing only
slothkit.core:

- unsloth_options: Unsloth's FastModel options, refused, dropped or rewritten.
- sampling_params: vLLM's ``SamplingParams``, for ``model.fast_generate`` and GRPO.

The public module paths that notebooks import (slothkit.vllm, slothkit.chat_templates)
stay at the package root and read from here.
"""
