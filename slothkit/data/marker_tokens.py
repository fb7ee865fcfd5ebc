"""How a chat format's markers meet a tokenizer's vocabulary: which are added as tokens,
which stay text, and what ends a turn.

A format names the markers its own tokenizers hold as single tokens (``<|eot_id|>``,
``<|start_header_id|>``, ...); another model's tokenizer often lacks some of them.  There
are two ways to install the format on it:

* map (the default): the turn end the tokenizer lacks is written as the tokenizer's own
  EOS (Llama 3's ``<|eot_id|>`` becomes SmolLM2's ``<|im_end|>``), so that the model
  learns to stop on a token it already has and ``generate`` stops there; the other missing
  markers stay text, tokenized into ordinary pieces, which trains as well as any prompt
  text.  Nothing is added: the embeddings, the tied head, the adapter and every export
  keep the checkpoint's vocabulary.
* add (``add_missing_tokens=True``): every missing marker becomes a special token with an
  embedding row of its own (untrained until trained: ``modules_to_save=["embed_tokens",
  "lm_head"]``), as the format's own tokenizers hold them; the saves carry the grown
  embeddings and head.

A custom (jinja_template, eos_token) pair follows the same rules for its one end-of-turn
token (plan_custom_turn_end): mapped, the template writes the tokenizer's EOS where it wrote
the token (slothkit.data.template_text).

A turn end the tokenizer lacks that cannot be the EOS (``map_eos_token=False``, or a
tokenizer without an EOS) would be text, which generation cannot stop on; the default
then adds the missing markers, and ``add_missing_tokens=False`` refuses.
"""

from __future__ import annotations

import dataclasses

from slothkit.core.notices import FallbackWarning, say_once
from slothkit.data.chat_formats import ChatFormat


@dataclasses.dataclass(frozen=True)
class MarkerTokens:
    """What installing a format on one tokenizer does with the format's markers."""

    added: tuple[str, ...]  # markers to add as special tokens (the embeddings grow)
    turn_end: str | None  # the token written where the format ends a turn (None: the format writes EOS)
    mapped_from: str | None  # the format's own turn end, where `turn_end` is the EOS standing in for it
    as_text: tuple[str, ...]  # missing markers written as text, tokenized into ordinary pieces
    add_reason: str  # why the markers are added (for the error asking for a model)


def plan_marker_tokens(
    tokenizer, fmt: ChatFormat, *, map_eos_token: bool, add_missing_tokens: bool | None
) -> MarkerTokens:
    """Decide, for `fmt` on `tokenizer`, what is added, mapped and left as text (module
    docstring).  Raises ValueError where add_missing_tokens=False leaves a turn end that
    is neither a token of the tokenizer nor its EOS."""
    vocab = tokenizer.get_vocab()
    missing = tuple(token for token in fmt.special_tokens if token not in vocab)
    turn_end_missing = fmt.turn_end is not None and fmt.turn_end in missing
    eos = tokenizer.eos_token if map_eos_token else None
    if add_missing_tokens is None:
        add_missing_tokens = turn_end_missing and eos is None
        reason = (
            "map_eos_token=False, so the turn end must be a token of its own"
            if not map_eos_token
            else "the tokenizer has no EOS to end turns with"
        )
    else:
        reason = "add_missing_tokens=True"
    if add_missing_tokens or not missing:
        return MarkerTokens(
            added=missing, turn_end=fmt.turn_end, mapped_from=None, as_text=(), add_reason=reason
        )
    if turn_end_missing and eos is None:
        why = "map_eos_token=False" if not map_eos_token else "the tokenizer has no EOS"
        raise ValueError(
            f"chat template {fmt.name!r} ends turns with {fmt.turn_end!r}, which this tokenizer lacks, and "
            f"{why}: as text the turn end is no token that generation can stop on. Pass map_eos_token=True "
            "to end turns with the tokenizer's EOS, or add_missing_tokens=True (with model=) to add it"
        )
    if turn_end_missing:
        as_text = tuple(token for token in missing if token != fmt.turn_end)
        return MarkerTokens(added=(), turn_end=eos, mapped_from=fmt.turn_end, as_text=as_text, add_reason="")
    return MarkerTokens(added=(), turn_end=fmt.turn_end, mapped_from=None, as_text=missing, add_reason="")


def plan_custom_turn_end(
    tokenizer, turn_end: str, *, map_eos_token: bool, add_missing_tokens: bool | None
) -> MarkerTokens:
    """Decide, for the end-of-turn token of a custom (jinja_template, eos_token) pair, whether
    it is added or the tokenizer's EOS is written in its place, as plan_marker_tokens decides
    for a format's turn end.  Raises ValueError where add_missing_tokens=False leaves a token
    that is neither in the vocabulary nor mapped to the EOS."""
    if turn_end in tokenizer.get_vocab():
        return MarkerTokens(added=(), turn_end=turn_end, mapped_from=None, as_text=(), add_reason="")
    eos = tokenizer.eos_token if map_eos_token else None
    if add_missing_tokens:
        return MarkerTokens(
            added=(turn_end,),
            turn_end=turn_end,
            mapped_from=None,
            as_text=(),
            add_reason="add_missing_tokens=True",
        )
    if eos is not None:
        return MarkerTokens(added=(), turn_end=eos, mapped_from=turn_end, as_text=(), add_reason="")
    why = "map_eos_token=False" if not map_eos_token else "the tokenizer has no EOS"
    if add_missing_tokens is False:
        raise ValueError(
            f"the custom chat template ends turns with {turn_end!r}, which this tokenizer lacks, "
            f"add_missing_tokens=False and {why}: pass map_eos_token=True to write the tokenizer's EOS in "
            "its place, or let the token be added"
        )
    reason = f"{why}, so the turn end must be a token of its own"
    return MarkerTokens(added=(turn_end,), turn_end=turn_end, mapped_from=None, as_text=(), add_reason=reason)


def say_what_was_mapped(template: str, plan: MarkerTokens) -> None:
    """Say once what stands in for the markers the tokenizer lacks, and how to get tokens
    of their own instead; `template` names the chat template as the call gave it ("'llama-3'",
    "(template, '<|eot_id|>')")."""
    if plan.mapped_from is None and not plan.as_text:
        return
    said = []
    if plan.mapped_from is not None:
        said.append(
            f"this tokenizer has no token {plan.mapped_from!r}, so each turn ends with its EOS "
            f"{plan.turn_end!r} (map_eos_token=True)"
        )
    if plan.as_text:
        names = " and ".join(repr(token) for token in plan.as_text)
        verb = "stays" if len(plan.as_text) == 1 else "stay"
        said.append(f"{names} {verb} plain text, tokenized into ordinary pieces")
    one = len(plan.as_text) + (plan.mapped_from is not None) == 1
    own = "a token of its own" if one else "tokens of their own"
    rows = "row" if one else "rows"
    say_once(
        f"get_chat_template({template}): " + "; ".join(said) + ". No token is added and the embeddings "
        f"keep their size. For {own}, pass add_missing_tokens=True (the embeddings and head grow, and "
        f"every save carries them; train the new {rows} with modules_to_save=['embed_tokens', 'lm_head'])",
        FallbackWarning,
    )
