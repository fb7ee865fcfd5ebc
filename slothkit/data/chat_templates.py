"""Install a chat format on a tokenizer (and its model): `get_chat_template`.

    tokenizer = get_chat_template(tokenizer, "llama-3", model=model)

What changes, and why:

* ``tokenizer.chat_template`` renders the format (slothkit.data.chat_formats), with each
  assistant reply inside ``{% generation %}`` for TRL's ``assistant_only_loss``.
* Markers the format's own tokenizers hold as single tokens (``<|im_start|>``,
  ``<|eot_id|>``, ``<start_of_turn>``, ...) that this tokenizer lacks
  (slothkit.data.marker_tokens): by default nothing is added; a missing turn end is
  written as the tokenizer's EOS (``map_eos_token=True``) and the other missing markers
  stay text, said once.  ``add_missing_tokens=True`` adds them as special tokens instead,
  and with ``model=`` the embeddings grow to match (their new rows are untrained: train
  them with ``modules_to_save=["embed_tokens", "lm_head"]``).  A custom ``(jinja_template,
  eos_token)`` pair whose token the tokenizer lacks is treated alike: the template writes
  the tokenizer's EOS where it wrote the token (slothkit.data.template_text), said once.
* ``map_eos_token=True``: the token that closes an assistant turn becomes the tokenizer's
  EOS, and with ``model=`` the first of ``generation_config.eos_token_id``, so ``generate``
  stops at the end of the reply and TRL ends plain-text samples with it.
* BOS: the template emits the tokenizer's BOS only when the tokenizer itself puts one in
  front of plain text; ``tokenizer.apply_chat_template(..., tokenize=True)`` tokenizes
  without adding special tokens, so a conversation holds exactly one BOS.  Text rendered
  for a ``text`` column goes through slothkit.data.conversations, which drops that leading
  BOS again because tokenizing the text adds it.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

from slothkit.core.inspection import causal_lm_of
from slothkit.data.chat_formats import (
    DEFAULT_MAPPING,
    FORMATS,
    ChatFormat,
    check_mapping,
    format_named,
    format_of_template,
    template_source,
    with_turn_end,
)
from slothkit.data.marker_tokens import plan_custom_turn_end, plan_marker_tokens, say_what_was_mapped
from slothkit.data.processor_chat_template import is_processor, keep_processor_template
from slothkit.data.template_text import replace_written_text

# Conversations on which a tokenizer's own template is compared with slothkit's formats,
# each with the arguments it is rendered with. The last two turn the thinking switch
# (enable_thinking, which templates without one ignore) both ways: Qwen3.5's template and
# Qwen3 Thinking's write the same text but for it.
_PROMPT = [{"role": "user", "content": "Name a colour."}]
_PROBES = (
    ([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}], {}),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6"},
        ],
        {},
    ),
    (_PROMPT, {"add_generation_prompt": True}),
    (
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
        {"add_generation_prompt": True},
    ),
    (_PROMPT, {"add_generation_prompt": True, "enable_thinking": False}),
    (_PROMPT, {"add_generation_prompt": True, "enable_thinking": True}),
)


def chat_template_names() -> tuple[str, ...]:
    return tuple(FORMATS)


def adds_bos(tokenizer) -> bool:
    """Whether tokenizing plain text puts the BOS token in front of it."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def get_chat_template(
    tokenizer,
    chat_template: str = "chatml",
    mapping: dict | None = None,
    map_eos_token: bool = True,
    system_message: str | None = None,
    *,
    model=None,
    add_missing_tokens: bool | None = None,
):
    """Set `tokenizer`'s chat template to a chat format (module docstring: what else
    changes, and why).

    Args:
        tokenizer: a Hugging Face tokenizer; changed in place.  An image-text model's
            processor keeps its own chat template where that renders the named format
            (slothkit.data.processor_chat_template).
        chat_template: the format's name: "chatml" (default), "vicuna", "zephyr",
            "alpaca", "llama-3", "gemma", "mistral", "llama-2", "qwen-2.5", "qwen3", "phi-3", "phi-4"
            or "vicuna_old" (aliases such as "llama-3.1", "gemma-3", "llama" for llama-2,
            "qwen2.5", "phi-3.5": slothkit.data.chat_formats.ALIASES); or "model" (or
            None) for the tokenizer's own template, replaced by slothkit's equivalent when
            it renders the same text (so that it gains the ``{% generation %}`` marks) and
            kept otherwise; or a ``(jinja_template, eos_token)`` pair, installed as written
            with that token as the end of a turn (the word "eos_token", as Unsloth's
            notebooks write it, names the tokenizer's own EOS: nothing is added).  A token
            the tokenizer lacks is handled as a format's turn end is (map_eos_token,
            add_missing_tokens): by default the template's text and string literals write
            the tokenizer's EOS in its place.
        mapping: the dataset's key and role names, e.g. {"role": "from", "content":
            "value", "user": "human", "assistant": "gpt"}, to render ShareGPT records
            directly with slothkit.data.apply_chat_template.  None (default): "role" and
            "content" with the roles "system", "user", "assistant".  (TRL converts a
            "conversations" column to role/content itself before rendering: with TRL,
            keep the default.)
        map_eos_token: make the token that closes an assistant turn the tokenizer's EOS,
            and with ``model`` the first id generation stops at (default True).  Where the
            format's turn end (or a custom pair's token) is not in the tokenizer's vocabulary (Llama 3's
            ``<|eot_id|>`` on SmolLM2), the template writes the tokenizer's own EOS in its
            place (SmolLM2's ``<|im_end|>``), as Unsloth maps it, and adds nothing.  With
            False such a turn end cannot stay text (generation could not stop on it), so
            the format's missing markers are added as by ``add_missing_tokens=True``.
        system_message: system text for conversations that have none; None (default):
            the format's own (vicuna and alpaca have one, the others none); "" gives none.
        model: the model whose embeddings grow with the tokenizer when tokens are added
            and whose generation_config follows the EOS.  None (default): the model
            ``FastModel.from_pretrained`` loaded with this tokenizer, if any; when tokens
            must be added and no model is known, a ValueError asks for model= (without
            it the new ids could point past the embeddings); an EOS change alone only warns.
        add_missing_tokens: what becomes of the format's markers this tokenizer lacks
            (``<|start_header_id|>``, ``<|end_header_id|>`` and ``<|eot_id|>`` for
            llama-3 on SmolLM2).  None (default): nothing is added while the turn end is
            in the vocabulary or can be the EOS (``map_eos_token=True``): the turn end is
            written as the EOS, the other markers stay text tokenized into ordinary
            pieces, the embeddings keep their size, and a notice says so once; they are
            added only when the turn end can be neither (``map_eos_token=False`` or no
            EOS).  True: every missing marker becomes a special token of its own and the
            model's embeddings and head grow by as many rows (untrained: train them with
            ``modules_to_save=["embed_tokens", "lm_head"]``; the adapter and every export
            then carry the grown matrices).  False: nothing is added; a turn end that can
            be neither a token nor the EOS is refused.  A custom pair's end-of-turn token
            follows the same rules: None and False write the EOS in its place
            (``map_eos_token=True``), True adds it.

    Returns:
        The same tokenizer.

    Raises:
        ValueError: an unknown or refused format name, "model" for a tokenizer without a
            template, mapping or system_message with a template kept as written, a bad
            mapping, tokens to add with no model to grow, or add_missing_tokens=False with a
            turn end that is neither in the vocabulary nor mapped to the EOS.
        TypeError: system_message is not a string, or add_missing_tokens not a bool or None.
    """
    if is_processor(tokenizer):
        if mapping is not None or system_message is not None or add_missing_tokens:
            raise ValueError(
                "get_chat_template(processor, ...): an image-text model's processor keeps its own chat template; "
                "mapping, system_message and add_missing_tokens are not accepted with it"
            )
        return keep_processor_template(tokenizer, chat_template, matching_format)
    mapping = check_mapping(mapping)
    if system_message is not None and not isinstance(system_message, str):
        raise TypeError(f"system_message must be a string or None; got {type(system_message).__name__}")
    if add_missing_tokens is not None and not isinstance(add_missing_tokens, bool):
        raise TypeError(f"add_missing_tokens must be True, False or None; got {add_missing_tokens!r}")
    if model is None:
        model = linked_model(tokenizer)
    if isinstance(chat_template, (tuple, list)):
        return _install_custom(
            tokenizer, chat_template, mapping, system_message, map_eos_token, model, add_missing_tokens
        )

    if chat_template in (None, "model"):
        fmt = matching_format(tokenizer)
        if fmt is None:
            if mapping != DEFAULT_MAPPING or system_message is not None:
                raise ValueError(
                    "mapping and system_message apply to slothkit's formats; the tokenizer's own "
                    "template is kept as it is. Pick a format by name: " + ", ".join(FORMATS)
                )
            turn_end = own_turn_end(tokenizer)
            _finish(tokenizer, model, turn_end, map_eos_token, added=[])
            return tokenizer
    else:
        fmt = format_named(chat_template)

    plan = plan_marker_tokens(
        tokenizer, fmt, map_eos_token=map_eos_token, add_missing_tokens=add_missing_tokens
    )
    _require_model_for_new_tokens(tokenizer, plan.added, model, repr(fmt.name), plan.add_reason)
    added = _add_missing_tokens(tokenizer, plan.added)
    written = fmt if plan.mapped_from is None else with_turn_end(fmt, plan.turn_end)
    tokenizer.chat_template = template_source(
        written, mapping=mapping, system_message=system_message, use_bos=adds_bos(tokenizer)
    )
    say_what_was_mapped(repr(fmt.name), plan)
    _finish(tokenizer, model, plan.turn_end or tokenizer.eos_token, map_eos_token, added)
    return tokenizer


# The end-of-turn token of a custom (template, eos_token) pair that means "the tokenizer's
# own EOS": Unsloth's notebooks pass this word rather than the token itself.
KEEP_EOS = "eos_token"

# tokenizer -> weak reference to the model FastModel.from_pretrained loaded with it.  Kept
# here rather than on the tokenizer: datasets.map pickles the tokenizer into its worker
# processes with dill, which pickles what a weak reference points at, so a reference on
# the tokenizer would copy the whole model (CUDA tensors and all) into every worker.
_LINKED_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def link_model(tokenizer, model) -> None:
    """Remember that `tokenizer` was loaded with `model` (while both exist)."""
    _LINKED_MODELS[tokenizer] = weakref.ref(model)


def linked_model(tokenizer):
    """The model FastModel.from_pretrained loaded with `tokenizer`, while it exists."""
    try:
        reference = _LINKED_MODELS.get(tokenizer)
    except TypeError:  # an unhashable stand-in for a tokenizer
        return None
    return reference() if reference is not None else None


def _require_model_for_new_tokens(tokenizer, tokens, model, what: str, reason: str) -> None:
    missing = [t for t in tokens if t not in tokenizer.get_vocab()]
    if missing and model is None:
        raise ValueError(
            f"chat template {what} needs the tokens {missing}, which this tokenizer lacks ({reason}): pass "
            "model= (get_chat_template(tokenizer, ..., model=model)) so that the embeddings grow with them"
        )


def _install_custom(
    tokenizer, chat_template, mapping, system_message, map_eos_token, model, add_missing_tokens
):
    """A ``(jinja_template, eos_token)`` pair, installed as written, except that an
    end-of-turn token the tokenizer lacks is written as its EOS (map_eos_token=True), as
    for a named format, or added (add_missing_tokens=True, or no EOS to write):
    slothkit.data.marker_tokens.plan_custom_turn_end."""
    if len(chat_template) != 2 or not all(isinstance(part, str) for part in chat_template):
        raise ValueError(
            "a custom chat_template is a pair (jinja_template, eos_token) of strings; got "
            f"{type(chat_template).__name__} of {len(chat_template)}"
        )
    template, eos_token = chat_template
    if eos_token == KEEP_EOS:
        eos_token = tokenizer.eos_token
        if eos_token is None:
            raise ValueError(
                f"chat_template=(template, {KEEP_EOS!r}) keeps the tokenizer's EOS, but this tokenizer has "
                "none: name the token that ends a turn instead of 'eos_token'"
            )
    if "{%" not in template and "{{" not in template:
        raise ValueError(
            "a custom chat_template must be a Jinja template over `messages` ({% for message in messages %}"
            "...); a prompt with {INPUT}/{OUTPUT}-style placeholders is text to format yourself"
        )
    if mapping != DEFAULT_MAPPING or system_message is not None:
        raise ValueError(
            "mapping= and system_message= apply to slothkit's named formats; a custom (template, eos_token) "
            "is installed as written: write the dataset's key names and any system text into the template"
        )
    plan = plan_custom_turn_end(
        tokenizer, eos_token, map_eos_token=map_eos_token, add_missing_tokens=add_missing_tokens
    )
    what = f"(template, {eos_token!r})"
    _require_model_for_new_tokens(tokenizer, plan.added, model, what, plan.add_reason)
    added = _add_missing_tokens(tokenizer, plan.added)
    if plan.mapped_from is not None:
        template = replace_written_text(template, plan.mapped_from, plan.turn_end)
    tokenizer.chat_template = template
    say_what_was_mapped(what, plan)
    _finish(tokenizer, model, plan.turn_end, map_eos_token, added)
    return tokenizer


def matching_format(tokenizer) -> ChatFormat | None:
    """slothkit's format that renders exactly like `tokenizer`'s own chat template, if any.

    Many templates put a system message of their own in front of conversations that have
    none (SmolLM2's "You are a helpful AI assistant named SmolLM, ...", Qwen2.5's "You are
    Qwen, ..."). The format is then returned with that text as its `default_system`, so
    that installing it keeps what the model saw in training.
    """
    own = tokenizer.chat_template
    if not own:
        raise ValueError(
            "chat_template='model' but this tokenizer has no chat template; pick one of: "
            + ", ".join(FORMATS)
        )
    tagged = format_of_template(own)
    if tagged is not None:
        return tagged
    use_bos = adds_bos(tokenizer)
    for fmt in FORMATS.values():
        if any(token not in tokenizer.get_vocab() for token in fmt.special_tokens):
            continue
        candidate = template_source(fmt, mapping=DEFAULT_MAPPING, system_message=None, use_bos=use_bos)
        if _renders_alike(tokenizer, own, candidate):
            return fmt
        system = _own_default_system(tokenizer, own, fmt, use_bos)
        if system is None:
            continue
        candidate = template_source(fmt, mapping=DEFAULT_MAPPING, system_message=system, use_bos=use_bos)
        if _renders_alike(tokenizer, own, candidate):
            return dataclasses.replace(fmt, default_system=system)
    return None


def _own_default_system(tokenizer, own: str, fmt: ChatFormat, use_bos: bool) -> str | None:
    """The system text `own` puts in a conversation that has none, if `fmt` would render
    that conversation with a system message as `own` does: `fmt` with a placeholder system
    text renders prefix + placeholder + suffix, and `own` must render prefix + text + suffix."""
    conversation = [{"role": "user", "content": "Name a colour."}]
    placeholder = "SYSTEMTEXTPLACEHOLDER"
    probe = template_source(fmt, mapping=DEFAULT_MAPPING, system_message=placeholder, use_bos=use_bos)
    try:
        expected = tokenizer.apply_chat_template(conversation, chat_template=own, tokenize=False)
        with_placeholder = tokenizer.apply_chat_template(conversation, chat_template=probe, tokenize=False)
    except Exception:  # either template refuses a lone user turn
        return None
    if with_placeholder.count(placeholder) != 1:
        return None
    prefix, suffix = with_placeholder.split(placeholder)
    fits = len(expected) > len(prefix) + len(suffix)
    if not (fits and expected.startswith(prefix) and expected.endswith(suffix)):
        return None
    return expected[len(prefix) : len(expected) - len(suffix)]


def _renders_alike(tokenizer, own: str, candidate: str) -> bool:
    compared = 0
    for messages, kwargs in _PROBES:
        try:
            expected = tokenizer.apply_chat_template(messages, chat_template=own, tokenize=False, **kwargs)
        except Exception:  # the own template refuses this conversation (e.g. a system turn)
            continue
        try:
            got = tokenizer.apply_chat_template(messages, chat_template=candidate, tokenize=False, **kwargs)
        except Exception:
            return False
        if got != expected:
            return False
        compared += 1
    return compared > 0


def own_turn_end(tokenizer) -> str:
    """The first special token after an assistant reply in the tokenizer's own template
    (its end-of-turn token), or the EOS when the reply is followed by none."""
    answer = "Hello from the assistant"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}], tokenize=False
    )
    tail = text[text.rfind(answer) + len(answer) :]
    special = set(tokenizer.all_special_ids)
    for token_id in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return tokenizer.convert_ids_to_tokens(token_id)
    return tokenizer.eos_token


def _add_missing_tokens(tokenizer, tokens: tuple[str, ...]) -> list[str]:
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        tokenizer.add_tokens(
            [AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True
        )
    return missing


def _finish(tokenizer, model, turn_end: str, map_eos_token: bool, added: list[str]) -> None:
    changed_eos = False
    if map_eos_token and turn_end != tokenizer.eos_token:
        tokenizer.eos_token = turn_end
        changed_eos = True
    if model is not None:
        follow_tokenizer(model, tokenizer, turn_end)
    elif added or changed_eos:
        what = []
        if added:
            what.append(f"gained the tokens {added} (now {len(tokenizer)} ids)")
        if changed_eos:
            what.append(f"ends turns with EOS {turn_end!r}")
        warnings.warn(
            "the tokenizer " + " and ".join(what) + "; pass model= to get_chat_template so that the "
            "model's embeddings and generation_config follow (or call slothkit.data.follow_tokenizer)",
            stacklevel=3,
        )


def follow_tokenizer(model, tokenizer, turn_end: str | None = None) -> None:
    """Grow `model`'s embeddings to the tokenizer's size when needed and make `turn_end`
    (default: the tokenizer's EOS) the first id generation stops on (a model that
    generates: a sequence classifier has no generation_config)."""
    causal_lm = causal_lm_of(model)
    rows = causal_lm.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        _grow_embeddings(causal_lm, len(tokenizer), after_lora=_has_lora(model, causal_lm))
        warnings.warn(
            f"the embeddings grew from {rows} to {len(tokenizer)} rows; the new rows are untrained, so add "
            "modules_to_save=['embed_tokens', 'lm_head'] to get_peft_model to learn them",
            stacklevel=3,
        )
    generation = getattr(causal_lm, "generation_config", None)
    if generation is None:  # a sequence classifier (a reward model) generates nothing
        return
    turn_end = turn_end or tokenizer.eos_token
    turn_end_id = tokenizer.convert_tokens_to_ids(turn_end)
    current = generation.eos_token_id
    current = [] if current is None else [current] if isinstance(current, int) else list(current)
    stop_ids = [turn_end_id] + [i for i in current if i != turn_end_id]
    generation.eos_token_id = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id


def _has_lora(model, causal_lm) -> bool:
    """Whether PEFT wraps `causal_lm` (given as the PeftModel or as the model inside it)."""
    return causal_lm is not model or any(
        "lora_" in name for name, _ in causal_lm.named_parameters(recurse=True)
    )


def _grow_embeddings(causal_lm, rows: int, *, after_lora: bool) -> None:
    """Resize the embeddings (and an untied head) to `rows`.  With LoRA adapters already
    attached this works only while the embeddings are plain modules (not adapted or in
    modules_to_save); they stay frozen, as they were."""
    import torch

    embeddings, head = causal_lm.get_input_embeddings(), causal_lm.get_output_embeddings()
    if after_lora and not (
        type(embeddings) is torch.nn.Embedding and (head is None or type(head) is torch.nn.Linear)
    ):
        raise ValueError(
            f"the tokenizer has {rows} ids, more than the model's embeddings, and LoRA adapters already wrap "
            "the embeddings; call get_chat_template(..., model=model) before FastModel.get_peft_model"
        )
    trainable = {name: p.requires_grad for name, p in causal_lm.named_parameters()}
    causal_lm.resize_token_embeddings(rows)
    for name, param in causal_lm.named_parameters():
        if name in trainable:
            param.requires_grad_(trainable[name])
