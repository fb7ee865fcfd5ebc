"""vLLM's ``SamplingParams``, read by slothkit's ``model.fast_generate`` and by
slothkit.trl's ``GRPOConfig(vllm_sampling_params=...)``.

Unsloth's GRPO and inference notebooks write ``from vllm import SamplingParams`` and pass
it to ``model.fast_generate``; ``from slothkit.vllm import SamplingParams`` is the same
class with the same names and defaults, without vLLM.  Each setting means what it means
in vLLM, and maps onto ``generate``'s:

    temperature=0 (below 1e-5)   greedy (do_sample=False; top_p, top_k, min_p unused)
    temperature, top_p, min_p    the same names
    top_k=0 or -1                no top-k (generate's default is 50: written top_k=0)
    repetition_penalty           the same (both divide positive logits of tokens seen in the
                                 prompt or the output, and multiply negative ones)
    max_tokens, min_tokens       max_new_tokens, min_new_tokens (vLLM's default 16 kept)
    n                            each prompt decoded n times in one batch
    stop_token_ids               more end-of-sequence ids beside the model's
    stop                         strings that end the output where they first appear; one
                                 that is a single token of the vocabulary stops decoding
                                 there, a longer one cuts the text after decoding
    seed                         the sampling is drawn from torch's generator seeded with
                                 it, the caller's generator state left as it was

What vLLM has and slothkit does not (presence and frequency penalties, log-probabilities,
guided decoding, logit biases, ...) is refused when set, in one line; an unknown keyword is
a TypeError, as in vLLM.
"""

from __future__ import annotations

import dataclasses

# vLLM's threshold below which a temperature means greedy decoding.
GREEDY_BELOW = 1e-5

# vLLM settings slothkit does not implement, with the value at which they change nothing.
_INERT = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "bad_words": None,
    "logits_processors": None,
    "guided_decoding": None,
    "structured_outputs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "ignore_eos": False,
}


@dataclasses.dataclass
class SamplingParams:
    """How ``model.fast_generate`` samples: vLLM's ``SamplingParams`` (module docstring)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list | None = None
    truncate_prompt_tokens: int | None = None
    guided_decoding: object | None = None
    structured_outputs: object | None = None
    logit_bias: dict | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(token) for token in self.stop_token_ids or []]
        self._check()

    def _check(self) -> None:
        set_but_absent = [name for name, inert in _INERT.items() if getattr(self, name) != inert]
        if set_but_absent:
            raise ValueError(
                f"SamplingParams({', '.join(f'{name}=...' for name in set_but_absent)}): slothkit's fast_generate "
                "does not implement that vLLM setting; leave it out (slothkit.compat.sampling_params lists what it reads)"
            )
        if self.best_of not in (None, self.n):
            raise ValueError(
                f"SamplingParams(best_of={self.best_of}, n={self.n}): slothkit returns every sample it draws; "
                "leave best_of out"
            )
        checks = (
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0, "temperature must be 0 (greedy) or more"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k must be -1 or 0 (off) or a number of tokens"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be above 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be 0 or more"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
            ),
            (
                self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
                "truncate_prompt_tokens must be at least 1",
            ),
        )
        for holds, rule in checks:
            if not holds:
                raise ValueError(f"SamplingParams: {rule} ({self._given()})")

    def _given(self) -> str:
        defaults = SamplingParams.__dataclass_fields__
        changed = [
            f"{name}={value!r}"
            for name, value in dataclasses.asdict(self).items()
            if value != defaults[name].default and name not in ("stop", "stop_token_ids")
        ]
        return ", ".join(changed) or "the defaults"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generate_settings(self) -> dict:
        """``generate``'s sampling keywords for these settings (the stops and lengths aside,
        which depend on the tokenizer and the model: slothkit.inference.vllm_generate)."""
        if self.greedy:
            return {"do_sample": False, "repetition_penalty": self.repetition_penalty}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "min_p": self.min_p or None,
            "repetition_penalty": self.repetition_penalty,
        }

    @classmethod
    def from_generation_config(cls, generation_config) -> SamplingParams:
        """vLLM's settings when a call gives none: the model's generation_config.json
        values of temperature, top_p, top_k, min_p and repetition_penalty, else vLLM's
        defaults (max_tokens 16)."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        found = {name: getattr(generation_config, name, None) for name in names}
        return cls(**{name: value for name, value in found.items() if value is not None})
