"""ShareGPT records to the role/content conversations chat templates and TRL read.

ShareGPT dumps store a conversation as ``[{"from": "human", "value": "..."}, {"from":
"gpt", "value": "..."}]``; the rest of the ecosystem uses ``[{"role": "user", "content":
"..."}, {"role": "assistant", "content": "..."}]``.
"""

from __future__ import annotations

# Speaker names seen in ShareGPT-style dumps, and what they are.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
}
_KEY_PAIRS = (("from", "value"), ("role", "content"))


def standardize_message(message, *, where: str = "message", aliases: dict[str, str] | None = None) -> dict:
    """One ShareGPT (or already standard) message as {"role", "content"}."""
    aliases = ROLE_ALIASES if aliases is None else {**ROLE_ALIASES, **aliases}
    if not isinstance(message, dict):
        raise ValueError(f"{where}: expected a dict with 'from' and 'value'; got {type(message).__name__}")
    for role_key, content_key in _KEY_PAIRS:
        if message.get(role_key) is not None and message.get(content_key) is not None:
            break
    else:
        raise ValueError(
            f"{where}: expected keys 'from' and 'value' (or 'role' and 'content'); got {sorted(message)}"
        )
    speaker = message[role_key]
    role = aliases.get(speaker.lower()) if isinstance(speaker, str) else None
    if role is None:
        raise ValueError(
            f"{where}: unknown speaker {speaker!r}; accepted: {', '.join(sorted(aliases))} "
            "(pass aliases={'name': 'user' | 'assistant' | 'system'} for others)"
        )
    content = message[content_key]
    if not isinstance(content, str):
        raise ValueError(f"{where}: {content_key!r} must be a string; got {type(content).__name__}")
    return {"role": role, "content": content}


def standardize_conversation(messages, *, where: str = "conversation", aliases=None) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where}: expected a list of messages; got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError(f"{where} is empty")
    return [
        standardize_message(m, where=f"{where}, message {i}", aliases=aliases) for i, m in enumerate(messages)
    ]


def standardize_sharegpt(
    dataset,
    *,
    field: str | None = None,
    output_field: str | None = None,
    aliases: dict[str, str] | None = None,
    aliases_for_system=None,
    aliases_for_user=None,
    aliases_for_assistant=None,
    num_proc: int | None = None,
):
    """Rewrite the conversations of `dataset` as {"role", "content"} messages with the roles
    system, user and assistant, in the same column (or `output_field`).

    Args:
        dataset: a ``datasets.Dataset``, a list of records, or what slothkit.data.load_data
            reads.
        field: the column with the conversations; None (default): "conversations", else
            "messages".
        output_field: the column to write; None (default): the same column, so a
            ShareGPT "conversations" column stays "conversations" (TRL and
            slothkit.data.apply_chat_template read either name).
        aliases: extra speaker names, e.g. {"doctor": "assistant", "patient": "user"}.
        aliases_for_system: more names of the system speaker, e.g. ["context"].
        aliases_for_user: more names of the user, e.g. ["patient"].
        aliases_for_assistant: more names of the assistant, e.g. ["doctor"].
        num_proc: processes for ``dataset.map`` (default None: this one).

    Returns:
        The standardised ``datasets.Dataset``.

    Raises:
        ValueError: no conversation column, a bad alias, or a record that is not a
            conversation (the message names the record and message).
    """
    from slothkit.data.loading import as_dataset

    dataset = as_dataset(dataset)
    columns = dataset.column_names
    if field is None:
        field = next((name for name in ("conversations", "messages") if name in columns), None)
        if field is None:
            raise ValueError(
                f"no 'conversations' or 'messages' column to standardise; the columns are {columns}"
            )
    elif field not in columns:
        raise ValueError(f"the dataset has no column {field!r}; its columns: {columns}")
    output_field = field if output_field is None else output_field
    aliases = dict(aliases or {})
    for role, names in (
        ("system", aliases_for_system),
        ("user", aliases_for_user),
        ("assistant", aliases_for_assistant),
    ):
        if isinstance(names, str):
            raise ValueError(f"aliases_for_{role} is a list of speaker names; got the string {names!r}")
        aliases.update({name: role for name in names or ()})
    bad = {name: role for name, role in aliases.items() if role not in ("system", "user", "assistant")}
    if bad:
        raise ValueError(f"aliases must map speaker names to 'system', 'user' or 'assistant'; got {bad}")
    aliases = {name.lower(): role for name, role in aliases.items()} or None

    def convert(record, index):
        messages = standardize_conversation(
            record[field], where=f"record {index} ({field!r})", aliases=aliases
        )
        return {output_field: messages}

    remove = [field] if field != output_field else []
    if output_field in columns and output_field != field:
        raise ValueError(f"the dataset already has a {output_field!r} column; pass another output_field")
    return dataset.map(
        convert,
        with_indices=True,
        remove_columns=remove,
        num_proc=num_proc,
        desc="Standardising ShareGPT records",
    )


def standardize_data_formats(
    dataset, *, aliases_for_system=None, aliases_for_user=None, aliases_for_assistant=None, num_proc=None
):
    """Bring a conversation dataset to role/content messages, whichever of the usual
    layouts it uses ("conversations" or "messages"; from/value or role/content), in the
    column it came in.

    Args:
        dataset: as standardize_sharegpt.
        aliases_for_system: more names of the system speaker.
        aliases_for_user: more names of the user.
        aliases_for_assistant: more names of the assistant.
        num_proc: processes for ``dataset.map`` (default None: this one).

    Returns:
        The standardised ``datasets.Dataset``.

    Raises:
        ValueError: the dataset holds no conversations (Alpaca-style records go through
            slothkit.data.format_alpaca), or a record is not a conversation.
    """
    from slothkit.data.loading import as_dataset

    dataset = as_dataset(dataset)
    if not {"conversations", "messages"} & set(dataset.column_names):
        raise ValueError(
            f"no conversation column ('conversations' or 'messages') to standardise; the columns are "
            f"{dataset.column_names} (Alpaca-style instruction/output records go through "
            "slothkit.data.format_alpaca)"
        )
    return standardize_sharegpt(
        dataset,
        aliases_for_system=aliases_for_system,
        aliases_for_user=aliases_for_user,
        aliases_for_assistant=aliases_for_assistant,
        num_proc=num_proc,
    )
