"""Check a dataset's layout before a TRL trainer sees it, so that bad records give an
error that names the record and the problem instead of a KeyError or a template error
deep inside TRL's preprocessing.

Layouts TRL accepts, and which trainer takes them:

    SFT           text | messages | conversations (ShareGPT) | prompt + completion | input_ids
    DPO, ORPO,    chosen + rejected [+ prompt]    (strings, or conversations)
      reward
    KTO           prompt + completion + label     (label: True for a desirable completion),
                  or DPO's pairs (TRL splits each into two)
    GRPO, RLOO    prompt                          (a string, or a conversation)

Over-long samples are not an error: TRL truncates them to ``max_length`` keeping the
start, and drops those left without a trainable token.
"""

from __future__ import annotations

import itertools

from slothkit.data.chat_formats import DEFAULT_MAPPING
from slothkit.data.conversations import check_conversation, dataset_mapping
from slothkit.data.sharegpt import standardize_conversation
from slothkit.data.text_encoding import check_no_lone_surrogate

_STREAMED_CHECKED = 100  # records checked from a streamed (iterable) dataset


def _records(dataset, column: str):
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        return ((i, record[column]) for i, record in enumerate(itertools.islice(dataset, _STREAMED_CHECKED)))
    return enumerate(dataset[column])


def _columns(dataset) -> list[str]:
    names = dataset.column_names
    if names is None:  # an IterableDataset with unknown features
        names = list(next(iter(dataset)).keys())
    return list(names)


def _check_not_empty(dataset, name: str) -> None:
    import datasets

    if isinstance(dataset, datasets.Dataset) and len(dataset) == 0:
        raise ValueError(f"the {name} dataset has no records")


def _check_text(value, where: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string; got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where} is empty")
    check_no_lone_surrogate(value, where)  # a streamed record's text has not been through pyarrow


def _is_conversation(value) -> bool:
    return isinstance(value, (list, tuple))


def check_sft_dataset(dataset, tokenizer=None, *, text_field: str = "text", name: str = "training") -> None:
    """Raise ValueError on the first record SFTTrainer could not use (see the module docstring)."""
    _check_not_empty(dataset, name)
    columns = _columns(dataset)
    if "input_ids" in columns:
        return  # already tokenized: TRL uses it as it is
    if text_field in columns:
        for index, value in _records(dataset, text_field):
            _check_text(value, f"{name} record {index} ({text_field!r})")
        return
    if "messages" in columns or "conversations" in columns:
        field = "messages" if "messages" in columns else "conversations"
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the {name} dataset holds conversations but the tokenizer has no chat template; "
                "set one with slothkit.data.get_chat_template(tokenizer, name)"
            )
        mapping = dataset_mapping(tokenizer) if tokenizer is not None else dict(DEFAULT_MAPPING)
        for index, messages in _records(dataset, field):
            where = f"{name} record {index} ({field!r})"
            if field == "conversations" and mapping == DEFAULT_MAPPING:
                messages = standardize_conversation(messages, where=where)  # TRL converts from/value itself
            check_conversation(messages, mapping=mapping, where=where)
        return
    if "prompt" in columns and "completion" in columns:
        for index, (prompt, completion) in enumerate(
            zip((v for _, v in _records(dataset, "prompt")), (v for _, v in _records(dataset, "completion")))
        ):
            where = f"{name} record {index}"
            if _is_conversation(prompt):
                check_conversation(prompt, where=f"{where} ('prompt')", need_assistant=False)
                check_conversation(completion, where=f"{where} ('completion')")
            else:
                _check_text(prompt, f"{where} ('prompt')")
                _check_text(completion, f"{where} ('completion')")
        return
    raise ValueError(
        f"the {name} dataset has the columns {columns}; SFT needs one of: {text_field!r} (text), 'messages' "
        "(conversations), 'conversations' (ShareGPT), 'prompt' + 'completion'. Alpaca records "
        "(instruction/input/output) go through slothkit.data.format_alpaca first"
    )


def check_preference_dataset(dataset, *, name: str = "training") -> None:
    """Raise ValueError on the first record DPOTrainer (ORPOTrainer, RewardTrainer) could not use."""
    _check_not_empty(dataset, name)
    columns = _columns(dataset)
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise ValueError(
            f"the {name} dataset lacks {missing}; preference data needs 'chosen' and 'rejected' (and usually "
            f"'prompt'); its columns: {columns}"
        )
    fields = [c for c in ("prompt", "chosen", "rejected") if c in columns]
    for field in fields:
        for index, value in _records(dataset, field):
            where = f"{name} record {index} ({field!r})"
            if _is_conversation(value):
                check_conversation(value, where=where, need_assistant=field != "prompt")
            else:
                _check_text(value, where)


def check_unpaired_preference_dataset(dataset, *, name: str = "training") -> None:
    """Raise ValueError on the first record KTOTrainer could not use: "prompt",
    "completion" and a boolean "label" (True: desirable), or preference pairs, which TRL
    splits into one desirable and one undesirable record each."""
    _check_not_empty(dataset, name)
    columns = _columns(dataset)
    if "label" not in columns and "chosen" in columns and "rejected" in columns:
        check_preference_dataset(dataset, name=name)
        return
    missing = [c for c in ("prompt", "completion", "label") if c not in columns]
    if missing:
        raise ValueError(
            f"the {name} dataset lacks {missing}; KTO needs 'prompt', 'completion' and 'label' (True for a "
            f"desirable completion), or preference pairs ('chosen' and 'rejected'); its columns: {columns}"
        )
    for index, label in _records(dataset, "label"):
        if not isinstance(label, bool):
            raise ValueError(
                f"{name} record {index} ('label'): expected True (desirable) or False; got {label!r}"
            )
    for field in ("prompt", "completion"):
        for index, value in _records(dataset, field):
            where = f"{name} record {index} ({field!r})"
            if _is_conversation(value):
                check_conversation(value, where=where, need_assistant=field == "completion")
            else:
                _check_text(value, where)


def check_prompt_dataset(dataset, *, name: str = "training") -> None:
    """Raise ValueError on the first record GRPOTrainer or RLOOTrainer could not use."""
    _check_not_empty(dataset, name)
    columns = _columns(dataset)
    if "prompt" not in columns:
        raise ValueError(
            f"the {name} dataset needs a 'prompt' column for GRPO and RLOO; its columns: {columns}"
        )
    for index, value in _records(dataset, "prompt"):
        where = f"{name} record {index} ('prompt')"
        if _is_conversation(value):
            check_conversation(value, where=where, need_assistant=False)
            if value[-1].get("role") == "assistant":
                raise ValueError(
                    f"{where} ends with an assistant message; a GRPO or RLOO prompt ends with the user's turn"
                )
        else:
            _check_text(value, where)
