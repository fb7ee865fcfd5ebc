"""The fast decode loop of a family with no record, checked against the model's own
forward when it is switched on.

A family with a record decodes through steps whose every part the record names and the
GPU tests cover. A family on the generic path (its step built for it in this package:
Qwen3.5's DeltaNet layers, Gemma 4's shared keys and values, the mixture-of-experts
blocks) can differ from its checkpoint in ways a config does not show, or on a GPU, Triton
or transformers release the tests have not met. So ``for_inference`` runs the loop once on
a short random prompt, teacher-forced: the prefill, then one-token steps through the
captured step the decode replays, each step's logits compared with those of the model's
own forward over the whole sequence at the same position. Where one differs beyond what
rounding explains, or the loop fails, ``generate`` stays Hugging Face's, said once with the
reason.

What rounding explains: the rounding of the model's dtype (norm-wise, as
slothkit.engine.generic_layers checks its layers), or, where the model itself is further
than that from its own forward when it decodes through its own cache (the same prompt,
then one token a call, as Hugging Face's generate runs it), OWN_DECODE_MARGIN times that
distance, up to CHECK_LIMIT. Deep models with random weights in bf16 amplify each rounding
from layer to layer, and a mixture-of-experts router flips near-tied choices: a random
gpt-oss-20b shape (24 layers, 8 experts) on a CPU decodes through its own cache 0.082 from
its forward, and slothkit's loop 0.11, where one bf16 rounding bounds a layer's output at
0.03. A semantic fault (a missing sink, rotary or scale) moves the logits by order one.
"""

from __future__ import annotations

import inspect

import torch

from slothkit.engine.generic_layers import largest_difference, relative_tolerance

PROMPT_TOKENS = 12  # the prefill: longer than the tiny models' sliding windows
STEPS = 4  # one-token steps after it, each through the captured step
# How much further than the model's own cached decode the loop may be from the forward:
# the loop rounds in other places again (1.3x and 1.7x the model's own distance on the
# random gpt-oss-20b shapes above, with and without router flips).
OWN_DECODE_MARGIN = 3.0
# Past this the comparison cannot tell a fault from rounding: a loop this far is refused.
CHECK_LIMIT = 0.5


def allowed_difference(dtype: torch.dtype, own_decode: float | None) -> float:
    """The largest norm-wise relative difference of the loop's logits from the model's
    forward that rounding explains, given ``own_decode``, the model's own cached decode's
    difference (None where it could not run)."""
    tolerance = relative_tolerance(dtype)
    if own_decode is None or not own_decode == own_decode:  # not measured, or NaN
        return tolerance
    return max(tolerance, min(CHECK_LIMIT, OWN_DECODE_MARGIN * own_decode))


def _logits_of_the_loop(decoder, ids: torch.Tensor) -> list[torch.Tensor]:
    """The fast loop's float32 logits at positions PROMPT_TOKENS - 1 .. T - 2 of ``ids``
    (1, T): the prefill's last, then each step fed the next token of ``ids``."""
    from slothkit.inference.fast_decoder import _rounded_slots

    total = ids.shape[1]
    decoder._prepare(1, _rounded_slots(total), ids.device)
    decoder.step.refresh()
    cache = decoder.cache
    cache.reset(torch.ones(1, PROMPT_TOKENS, dtype=torch.long, device=ids.device))
    positions = torch.arange(PROMPT_TOKENS, device=ids.device)[None]
    first = torch.zeros(1, dtype=torch.long, device=ids.device)
    logits = [
        decoder.step(ids[:, :PROMPT_TOKENS], positions, cache, first, visible=PROMPT_TOKENS, causal=True)
    ]
    for index in range(PROMPT_TOKENS, total - 1):
        position = torch.full((1,), index, dtype=torch.long, device=ids.device)
        logits.append(decoder.captured(ids[:, index], position, index).clone())
    return [row.float() for row in logits]


def _logits_of_own_decode(causal_lm, ids: torch.Tensor) -> torch.Tensor | None:
    """The model's float32 logits at the loop's positions when it decodes through its own
    cache (the prompt in one call, then one token a call, as Hugging Face's generate
    runs it), or None where it cannot (a model without a cache)."""
    # transformers 5.25 names the cache `cache` (in and out), earlier releases `past_key_values`.
    keyword = "cache" if "cache" in inspect.signature(causal_lm.forward).parameters else "past_key_values"
    try:
        out = causal_lm(input_ids=ids[:, :PROMPT_TOKENS], use_cache=True)
        logits = [out.logits[0, -1:].float()]
        for index in range(PROMPT_TOKENS, ids.shape[1] - 1):
            out = causal_lm(input_ids=ids[:, index : index + 1], use_cache=True, **{keyword: out[keyword]})
            logits.append(out.logits[0, -1:].float())
    except Exception:  # noqa: BLE001 - then the dtype's rounding alone bounds the loop
        return None
    return torch.cat(logits)


@torch.no_grad()
def decode_disagreement(decoder) -> str | None:
    """Why ``decoder``'s loop may not decode its model (its logits differ from the model's
    own forward, or it failed), or None where it agrees."""
    causal_lm = decoder.causal_lm
    embeddings = causal_lm.get_input_embeddings()
    device = embeddings.weight.device
    vocab = causal_lm.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, PROMPT_TOKENS + STEPS + 1), generator=generator).to(device)
    dtype = decoder.step.dtype
    was_training = causal_lm.training
    causal_lm.eval()  # dropout off on both sides; put back below
    try:
        expected = causal_lm(input_ids=ids, use_cache=False).logits.float()[0, PROMPT_TOKENS - 1 : -1]
        got = torch.cat(_logits_of_the_loop(decoder, ids))
        difference = largest_difference(list(got), list(expected))  # of each position's logits
        # How far rounding takes the model itself, only where the dtype's rounding does not
        # explain the loop (two more forwards).
        own = _logits_of_own_decode(causal_lm, ids) if not difference <= relative_tolerance(dtype) else None
        own_decode = None if own is None else largest_difference(list(own), list(expected))
    except Exception as error:  # noqa: BLE001 - any failure means Hugging Face's generate
        return f"its first steps failed ({type(error).__name__}: {error})"
    finally:
        causal_lm.train(was_training)
        decoder.captured = decoder._key = None  # the next generate captures for its own batch
    allowed = allowed_difference(dtype, own_decode)
    if not difference <= allowed:  # NaN included
        own_said = "" if own_decode is None else f"; its own cached decode differs by {own_decode:.2g}"
        return (
            f"its logits differ from the model's own forward on a random prompt by {difference:.2g} "
            f"(norm-wise; at most {allowed:.2g} for {dtype}{own_said})"
        )
    return None
