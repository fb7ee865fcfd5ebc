"""Conversations (lists of {role, content} messages): checks, and rendering a dataset of
them to the text column a trainer tokenizes.

    dataset = standardize_sharegpt(dataset)          # from/value -> role/content
    dataset = apply_chat_template(dataset, tokenizer)  # messages -> text

The text of a training conversation differs from ``tokenizer.apply_chat_template(...,
tokenize=False)`` in two places, both so that tokenizing it the usual way gives the tokens
the template means:

* the leading BOS is dropped when the tokenizer adds one itself (tokenizing would
  otherwise put a second one in front);
* whitespace after the last assistant turn's end token is dropped: generation stops at
  that token, and TRL appends EOS to a text that does not end with it.

One tokenizer quirk remains between the two paths: a SentencePiece tokenizer whose
pre-tokenizer marks only the start of the text as a word start (Metaspace with
prepend_scheme="first") reads the first word after a BOS written *in* the text without the
"▁" prefix ("Be"), and the same word at the start of the text with it ("▁Be", as
sentencepiece itself does).  Templates that open with a special token after BOS (llama-3,
chatml, gemma, ...) are not affected; Mistral's own tokenizer (legacy Metaspace) is not either.
A format whose opening marker such a tokenizer lacks is: the marker is then text
(slothkit.data.marker_tokens), and the text column's copy of it starts with an extra "▁"
token that the template's own tokenization does not have.
"""

from __future__ import annotations

from slothkit.data.chat_formats import DEFAULT_MAPPING, mapping_of_template
from slothkit.data.chat_templates import adds_bos
from slothkit.data.text_encoding import check_no_lone_surrogate

MESSAGE_FIELDS = ("messages", "conversations")


def dataset_mapping(tokenizer) -> dict[str, str]:
    """The field and role names the tokenizer's template reads (slothkit's defaults for
    templates slothkit did not build)."""
    return mapping_of_template(tokenizer.chat_template) or dict(DEFAULT_MAPPING)


def check_conversation(
    messages,
    *,
    mapping: dict[str, str] = DEFAULT_MAPPING,
    where: str = "conversation",
    need_assistant: bool = True,
) -> None:
    """Raise ValueError naming what is wrong with one conversation.

    Accepted: a non-empty list of dicts, each with a `role` of system (first message only),
    user or assistant and a string `content` (names as in `mapping`); with need_assistant,
    at least one assistant message (else there is nothing to train on).
    """
    role_key, content_key = mapping["role"], mapping["content"]
    roles = {mapping["system"]: "system", mapping["user"]: "user", mapping["assistant"]: "assistant"}
    if not isinstance(messages, (list, tuple)):
        raise ValueError(
            f"{where}: expected a list of {{{role_key!r}, {content_key!r}}} messages; got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise ValueError(f"{where} is empty; a conversation needs at least a user and an assistant message")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            hint = ""
            if isinstance(message, dict) and {"from", "value"} <= set(message):
                hint = " (ShareGPT records: run slothkit.data.standardize_sharegpt first)"
            raise ValueError(
                f"{where}, message {position}: expected keys {role_key!r} and {content_key!r}; got {keys}{hint}"
            )
        role = roles.get(message[role_key]) if isinstance(message[role_key], str) else None
        if role is None or (role == "system" and position != 0):
            raise ValueError(
                f"{where}, message {position}: role {message[role_key]!r} is not accepted here; accepted roles: "
                f"{mapping['system']!r} (first message only), {mapping['user']!r}, {mapping['assistant']!r}"
            )
        if not isinstance(message[content_key], str):
            raise ValueError(
                f"{where}, message {position}: {content_key!r} must be a string; got "
                f"{type(message[content_key]).__name__}"
            )
        check_no_lone_surrogate(message[content_key], f"{where}, message {position} ({content_key!r})")
    if need_assistant and not any(roles.get(m[role_key]) == "assistant" for m in messages):
        raise ValueError(f"{where} has no {mapping['assistant']!r} message, so nothing to train on")


def conversation_text(
    tokenizer, messages, *, add_generation_prompt: bool = False, where: str = "conversation"
) -> str:
    """One conversation rendered for a text column (see the module docstring)."""
    from jinja2 import TemplateError

    if not tokenizer.chat_template:
        raise ValueError(
            "the tokenizer has no chat template; set one with slothkit.data.get_chat_template(tokenizer, name)"
        )
    mapping = dataset_mapping(tokenizer)
    check_conversation(messages, mapping=mapping, where=where, need_assistant=not add_generation_prompt)
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as error:
        raise ValueError(f"{where}: {error}") from None
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and adds_bos(tokenizer):
        text = text[len(bos) :]
    last_role = messages[-1][mapping["role"]]
    if not add_generation_prompt and last_role == mapping["assistant"]:
        text = text.rstrip()
    return text


def messages_field_of(column_names, messages_field: str | None) -> str:
    if messages_field is not None:
        if messages_field not in column_names:
            raise ValueError(
                f"the dataset has no column {messages_field!r}; its columns: {list(column_names)}"
            )
        return messages_field
    for name in MESSAGE_FIELDS:
        if name in column_names:
            return name
    raise ValueError(
        f"the dataset has no conversation column ({' or '.join(MESSAGE_FIELDS)}); its columns: "
        f"{list(column_names)}. Alpaca-style records (instruction/input/output) go through "
        "slothkit.data.format_alpaca instead"
    )


def apply_chat_template(
    dataset,
    tokenizer,
    chat_template: str | None = None,
    default_system_message: str | None = None,
    *,
    messages_field: str | None = None,
    text_field: str = "text",
    add_generation_prompt: bool = False,
    keep_messages: bool = False,
):
    """Render every conversation of `dataset` with the tokenizer's chat template into `text_field`.

    chat_template: None (default): the tokenizer's own; a prompt with {INPUT} and
        {OUTPUT} fields (and optionally {SYSTEM}), as Unsloth's Ollama notebooks write
        one: made the tokenizer's chat template first (slothkit.data.prompt_templates),
        its Ollama Modelfile text left in ``tokenizer._ollama_modelfile``.
    default_system_message: with a prompt that has {SYSTEM}, the system text of
        conversations that have none.
    messages_field: the column holding the conversations (default: "messages", else
        "conversations"). It is removed unless keep_messages, because TRL trains on a
        "messages" column in preference to the text.
    add_generation_prompt: render prompts that end with an open assistant turn (for
        generation, GRPO prompts); conversations may then end with a user message.
    """
    from slothkit.data.loading import as_dataset

    if chat_template is not None:
        install_prompt_template(tokenizer, chat_template, default_system_message)
    elif default_system_message is not None:
        raise ValueError("default_system_message goes with a chat_template prompt that has a {SYSTEM} field")
    dataset = as_dataset(dataset)
    field = messages_field_of(dataset.column_names, messages_field)
    if text_field in dataset.column_names and text_field != field:
        raise ValueError(f"the dataset already has a {text_field!r} column; pass another text_field")

    def render(record, index):
        where = f"record {index} ({field!r})"
        return {
            text_field: conversation_text(
                tokenizer, record[field], add_generation_prompt=add_generation_prompt, where=where
            )
        }

    remove = [] if keep_messages or field == text_field else [field]
    return dataset.map(render, with_indices=True, remove_columns=remove, desc="Applying the chat template")


def install_prompt_template(tokenizer, chat_template: str, default_system_message: str | None = None) -> None:
    """Make a {SYSTEM}/{INPUT}/{OUTPUT} prompt the tokenizer's chat template, and leave the
    Ollama Modelfile for it in ``tokenizer._ollama_modelfile`` (Unsloth's attribute; the
    GGUF saves write the same layout into their Modelfile).

    Raises:
        ValueError: `chat_template` is not such a prompt, or default_system_message is given
            for one without {SYSTEM}.
    """
    from slothkit.data.ollama_templates import render_modelfile
    from slothkit.data.prompt_templates import is_prompt_template, jinja_template, parse_prompt_template

    if not is_prompt_template(chat_template):
        raise ValueError(
            "apply_chat_template(chat_template=...) takes a prompt with {INPUT} and {OUTPUT} fields (and "
            "optionally {SYSTEM}); for a named format call get_chat_template(tokenizer, name) first"
        )
    if default_system_message is not None and "{SYSTEM}" not in chat_template:
        raise ValueError("default_system_message needs a {SYSTEM} field in the chat_template prompt")
    template = parse_prompt_template(
        chat_template, tokenizer.eos_token, tokenizer.bos_token, default_system=default_system_message
    )
    tokenizer.chat_template = jinja_template(template)
    location = "{__FILE_LOCATION__}"
    tokenizer._ollama_modelfile = render_modelfile(location, tokenizer).replace(f"./{location}", location)
