"""The fast decode loop of a family with no record, checked against the model's own
forward when it is switched on.

A family with a record decodes through steps whose every part the record names and the
GPU tests cover. A family on the generic path (its step built for it in this package:
Qwen3.5's DeltaNet layers, Gemma 4's shared keys and values, the mixture-of-experts
blocks) can differ from its checkpoint in ways a config does not show, or on a GPU, Triton
or transformers release the tests have not met. So ``for_inference`` runs the loop once on
a short random prompt, teacher-forced: the prefill, then one-token steps through the
captured step the decode replays, each step's logits compared with those of the model's
own forward over the whole sequence at the same position. Where one differs beyond the
rounding of the model's dtype (norm-wise, as slothkit.engine.generic_layers checks its
layers) or the loop fails, ``generate`` stays Hugging Face's, said once with the reason.
"""

from __future__ import annotations

import torch

from slothkit.engine.generic_layers import relative_tolerance

PROMPT_TOKENS = 12  # the prefill: longer than the tiny models' sliding windows
STEPS = 4  # one-token steps after it, each through the captured step


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
    was_training = causal_lm.training
    causal_lm.eval()  # dropout off on both sides; put back below
    try:
        expected = causal_lm(input_ids=ids, use_cache=False).logits.float()[0, PROMPT_TOKENS - 1 : -1]
        got = torch.cat(_logits_of_the_loop(decoder, ids))
    except Exception as error:  # noqa: BLE001 - any failure means Hugging Face's generate
        return f"its first steps failed ({type(error).__name__}: {error})"
    finally:
        causal_lm.train(was_training)
        decoder.captured = decoder._key = None  # the next generate captures for its own batch
    tolerance = relative_tolerance(decoder.step.dtype)
    difference = ((got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-12)).max().item()
    if not difference <= tolerance:  # NaN included
        return (
            f"its logits differ from the model's own forward on a random prompt by {difference:.2g} "
            f"(norm-wise; at most {tolerance:g} for {decoder.step.dtype})"
        )
    return None
