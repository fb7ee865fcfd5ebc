"""Train on the assistant's replies only: `train_on_responses_only(trainer)`.

Every token outside a reply gets the label -100 (ignored by the loss).  A reply starts
right after a *response marker* (the text that opens an assistant turn, e.g.
"<|start_header_id|>assistant<|end_header_id|>\\n\\n") and runs until the next
*instruction marker* (the text that opens a user turn), the next response marker, a BOS,
the start of the next packed sequence, or the end of the sequence.  So a reply's
end-of-turn token and the separator after it are trained, as in the templates'
{% generation %} blocks: the model learns to stop.

Markers are found in token ids, not text.  A marker does not always tokenize the same way
inside a conversation as alone ("\\n" can merge with the first word of the reply), so
each marker is searched as every token sequence it takes in context (in the chat
template's own renderings and a few plain-text ones), taking only the tokens that lie
wholly inside the marker: a token that straddles the marker's end belongs to the reply,
as it does in transformers' assistant masks.

A batch in which no token is left to train on would give a loss of 0/0 (NaN) or a
silent zero; that raises NoTrainableTokensError instead, naming the markers and showing
the decoded sequence.
"""

from __future__ import annotations

import itertools
import warnings

import torch

from slothkit.data.chat_formats import format_of_template

_PLAIN_LEFT = ("", "Hello", "Hello.", "Hello\n", "Hello\n\n", " ", "1")
_PLAIN_RIGHT = ("Hello", " Hello", "1", "\nHello", "(", "Hello!", " 1")
# Placeholders for probing a template: plain words that no template rewrites.
_PROBE = ("QUESTIONONE", "ANSWERONE", "QUESTIONTWO", "ANSWERTWO")
_SAMPLE_CHARS = 800
_SWAP_CHECK_ROWS = 256  # samples read for the swapped-markers hint (warn_if_swapped)


class NoTrainableTokensError(ValueError):
    """A batch (or a whole dataset) has no token left to train on after masking."""


def infer_markers(tokenizer) -> tuple[str, str]:
    """(instruction_part, response_part) for the tokenizer's chat template."""
    template = tokenizer.chat_template
    fmt = format_of_template(template)
    if fmt is not None:
        return fmt.instruction_part, fmt.response_part
    if not template:
        raise ValueError(
            "the tokenizer has no chat template to find the markers in; pass instruction_part and "
            "response_part (for Alpaca text: '### Instruction:\\n' and '### Response:\\n')"
        )
    return probe_markers(tokenizer)


def probe_markers(tokenizer) -> tuple[str, str]:
    """Markers read off renderings of a two-exchange conversation with placeholder texts."""
    q1, a1, q2, a2 = _PROBE
    conversation = [
        {"role": "user", "content": q1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": q2},
        {"role": "assistant", "content": a2},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    if not all(p in text for p in _PROBE):
        raise ValueError(
            "cannot find the markers in this chat template; pass instruction_part and response_part"
        )
    response = _probed_response(tokenizer, conversation, text)
    turn_end = text[text.index(a2) + len(a2) :]  # what closes a reply
    between_exchanges = text[text.index(a1) + len(a1) : text.index(q2)]  # a reply's close + a user header
    if between_exchanges.startswith(turn_end):
        instruction = between_exchanges[len(turn_end) :]
    else:
        # The last reply closes otherwise than earlier ones (harmony's <|return|> and
        # <|end|>): the user's turn opens where a header like the reply's opens, the
        # longest start of the response marker found there ("<|start|>").
        shared = 0
        while (
            shared < min(len(turn_end), len(between_exchanges))
            and turn_end[shared] == between_exchanges[shared]
        ):
            shared += 1
        header = next(
            (response[:n] for n in range(len(response), 0, -1) if response[:n] in between_exchanges),
            "",
        )
        instruction = (
            between_exchanges[between_exchanges.rfind(header) :] if header else between_exchanges[shared:]
        )
    bos = tokenizer.bos_token
    if bos and instruction.startswith(bos):  # a BOS opening each exchange (llama-2) stops a reply anyway
        instruction = instruction[len(bos) :]
    instruction, response = instruction.strip(" "), response.strip(" ")
    if not instruction.strip() or not response.strip():
        raise ValueError(
            f"could not tell the markers apart in this chat template (found {instruction!r} and {response!r}); "
            "pass instruction_part and response_part"
        )
    return instruction, response


def _probed_response(tokenizer, conversation: list[dict], text: str) -> str:
    """The text that opens a reply in `text` (a rendering of `conversation`)."""
    _, a1, q2, a2 = _PROBE
    prompt = tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    plain = tokenizer.apply_chat_template(conversation[:1], tokenize=False)
    if not (prompt.startswith(plain) and len(prompt) > len(plain)):
        # No generation prompt (Mistral): the text between a question and its answer.
        return text[text.index(q2) + len(q2) : text.index(a2)]
    response = prompt[len(plain) :]
    opening = text[: text.index(a1)].rstrip(" ")
    reply_opening = opening[len(plain) :] if opening.startswith(plain) else ""
    if reply_opening.startswith(response.rstrip(" ")):
        # The prompt opens the reply, which goes on with a header of its own (harmony's channel).
        return response
    # A generation prompt that opens more than a reply's header (Qwen3 Thinking's
    # "<think>\n", which a past reply does not have): the part of it that opens every reply.
    while response.strip() and not opening.endswith(response.rstrip(" ")):
        response = response[:-1]
    return response


def marker_variants(tokenizer, marker: str, contexts: list[str]) -> list[tuple[int, ...]]:
    """Every token sequence `marker` takes alone and in `contexts`, longest first."""
    if not isinstance(marker, str) or not marker.strip():
        raise ValueError(f"a marker must be a non-empty string; got {marker!r}")
    variants = {tuple(tokenizer(marker, add_special_tokens=False)["input_ids"])}
    # A core that lost most of the marker to its neighbours would match far too often.
    least = max(1, int(0.6 * len(marker.strip())))
    texts = list(contexts) + [left + marker + right for left in _PLAIN_LEFT for right in _PLAIN_RIGHT]
    for text in texts:
        if marker not in text:
            continue
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        start = text.find(marker)
        while start != -1:
            end = start + len(marker)
            core = [
                i for i, (s, e) in zip(encoded["input_ids"], offsets) if start <= s and e <= end and e > s
            ]
            covered = sum(e - s for s, e in offsets if start <= s and e <= end and e > s)
            if core and covered >= least:
                variants.add(tuple(core))
            start = text.find(marker, start + 1)
    return sorted((v for v in variants if v), key=len, reverse=True)


def _template_contexts(tokenizer) -> list[str]:
    """Renderings of varied conversations by the tokenizer's chat template (if any)."""
    if not tokenizer.chat_template:
        return []
    texts = []
    replies = ("Hello!", "42 is the answer.", " leading space", "\nleading newline", "(brackets)", "Yes")
    for i, reply in enumerate(replies):
        conversation = [
            {"role": "user", "content": replies[-1 - i]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": reply},
            {"role": "assistant", "content": replies[i - 1]},
        ]
        for messages in (conversation, [{"role": "system", "content": "Be brief."}] + conversation):
            try:
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
            except Exception:  # e.g. a template without a system role
                continue
    return texts


def check_marker_order(tokenizer, instruction_part: str, response_part: str) -> bool:
    """Refuse markers the tokenizer's chat template shows to be swapped; return whether the
    template could tell (it shows both markers).

    Both markers of a chat template occur in every sample, so swapped ones mask without a
    word: every user turn is trained on and no reply.  The tokenizer's own template tells
    which is which: in its rendering of a system/user/assistant probe, the marker nearest
    before the user's text must be instruction_part and the one nearest before the
    assistant's text response_part.  Reading the template's rendering, rather than the data,
    is what makes this reliable: the roles are known there, while in a sample they are what
    the markers are supposed to tell.  Only a rendering where both markers occur and both
    roles are preceded by the other marker is refused; a template that does not show both
    markers (text formats such as Alpaca on a chat tokenizer) cannot tell, and passes; the
    data is then checked more weakly (ResponseMasker.warn_if_swapped).
    """
    if not tokenizer.chat_template:
        return False
    question, answer = _PROBE[:2]
    exchange = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    text = None
    for messages in ([{"role": "system", "content": "Be brief."}] + exchange, exchange):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            break
        except Exception:  # e.g. a template without a system role
            continue
    if text is None or question not in text or answer not in text:
        return False
    if instruction_part not in text or response_part not in text:
        return False

    def nearest_before(content: str) -> str | None:
        at = text.index(content)
        instruction, response = text.rfind(instruction_part, 0, at), text.rfind(response_part, 0, at)
        if instruction == response == -1:
            return None
        return "instruction" if instruction > response else "response"

    if nearest_before(question) == "response" and nearest_before(answer) == "instruction":
        raise ValueError(
            f"instruction_part={instruction_part!r} and response_part={response_part!r} look swapped: the "
            f"tokenizer's chat template opens the user's turn with {response_part!r} and the assistant's "
            f"with {instruction_part!r}, so the user's turns would be trained on and no reply. Pass "
            f"instruction_part={response_part!r} and response_part={instruction_part!r} (the text that opens "
            "a user turn, then the text that opens an assistant turn), or leave both out to read them from "
            "the chat template."
        )
    return True


class ResponseMasker:
    """Which tokens of a batch belong to assistant replies, found through the markers."""

    def __init__(self, tokenizer, instruction_part: str, response_part: str, *, force_match: bool = True):
        if instruction_part == response_part:
            raise ValueError(f"instruction_part and response_part are both {instruction_part!r}")
        self.template_told_order = check_marker_order(tokenizer, instruction_part, response_part)
        self.tokenizer = tokenizer
        self.instruction_part = instruction_part
        self.response_part = response_part
        contexts = _template_contexts(tokenizer)
        self.instruction_variants = marker_variants(tokenizer, instruction_part, contexts)
        self.response_variants = marker_variants(tokenizer, response_part, contexts)
        if not force_match:
            # Also the markers without their surrounding whitespace, which the text may
            # spell otherwise (a reply then starts at that whitespace).
            for attribute, marker in (
                ("instruction_variants", instruction_part),
                ("response_variants", response_part),
            ):
                if marker.strip() and marker.strip() != marker:
                    loose = marker_variants(tokenizer, marker.strip(), contexts)
                    merged = set(getattr(self, attribute)) | set(loose)
                    setattr(self, attribute, sorted(merged, key=len, reverse=True))
        self.bos_id = tokenizer.bos_token_id

    def _matches(self, ids: torch.Tensor, variants) -> list[tuple[int, int]]:
        """Non-overlapping (start, end) spans where any variant occurs in the 1-D `ids`."""
        found = []
        for variant in variants:
            if len(variant) > ids.numel():
                continue
            windows = ids.unfold(0, len(variant), 1)  # (T - m + 1, m)
            hits = (windows == torch.tensor(variant, device=ids.device)).all(-1).nonzero().flatten().tolist()
            found += [(s, s + len(variant)) for s in hits]
        spans, reach = [], -1
        for start, end in sorted(found, key=lambda span: (span[0], -span[1])):
            if end <= reach:  # inside a longer match
                continue
            spans.append((start, end))
            reach = end
        return spans

    def keep_row(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Boolean mask over the 1-D `ids`: True on reply tokens."""
        length = ids.numel()
        keep = torch.zeros(length, dtype=torch.bool, device=ids.device)
        responses = self._matches(ids, self.response_variants)
        if not responses:
            return keep
        stops = {start for start, _ in self._matches(ids, self.instruction_variants)}
        stops |= {start for start, _ in responses}
        if self.bos_id is not None:
            stops |= set((ids == self.bos_id).nonzero().flatten().tolist())
        if position_ids is not None:  # packed sequences restart their positions at 0
            stops |= set((position_ids[1:] == 0).nonzero().flatten().add(1).tolist())
        ordered = sorted(stops)
        for _, end in responses:
            stop = next((s for s in ordered if s >= end), length)
            keep[end:stop] = True
        return keep

    def keep_mask(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) boolean mask of reply tokens for a (B, T) batch."""
        rows = [
            self.keep_row(input_ids[b], None if position_ids is None else position_ids[b])
            for b in range(input_ids.shape[0])
        ]
        return torch.stack(rows)

    def has_instruction(self, ids) -> bool:
        """Whether the instruction marker occurs in the 1-D `ids`."""
        return bool(self._matches(torch.as_tensor(ids), self.instruction_variants))

    def warn_missing_instruction(self, where: str, ids) -> None:
        """The instruction marker occurs nowhere: a reply then runs on to the next response
        marker, through the user's next turn, which is trained on; say so."""
        warnings.warn(
            f"train_on_responses_only: instruction_part={self.instruction_part!r} occurs in no sample of "
            f"{where}, so each reply runs on through the next user turn and the user's text is trained on. "
            f"Check the marker against the chat template: {self.describe(ids)}",
            stacklevel=4,
        )

    def ends_after_instruction(self, ids) -> bool | None:
        """Whether the last marker of the 1-D `ids` is the instruction marker; None when
        the sequence lacks one of the markers."""
        ids = torch.as_tensor(ids)
        instructions = self._matches(ids, self.instruction_variants)
        responses = self._matches(ids, self.response_variants)
        if not instructions or not responses:
            return None
        return instructions[-1][0] > responses[-1][0]

    def warn_if_swapped(self, where: str, rows) -> None:
        """Where the chat template cannot tell the markers' order (check_marker_order), the
        data can hint at it: a training sample ends with a reply, so its last marker is the
        response marker.  When each sample holding both (of the first _SWAP_CHECK_ROWS) ends
        after the instruction marker instead, the markers look swapped: say so (a warning, as
        data can be unusual)."""
        if self.template_told_order:
            return
        rows = list(itertools.islice(rows, _SWAP_CHECK_ROWS))
        verdicts = [(row, self.ends_after_instruction(row)) for row in rows]
        verdicts = [(row, verdict) for row, verdict in verdicts if verdict is not None]
        if not verdicts or not all(verdict for _, verdict in verdicts):
            return
        warnings.warn(
            f"train_on_responses_only: instruction_part={self.instruction_part!r} and "
            f"response_part={self.response_part!r} look swapped: {len(verdicts)} of the first {len(rows)} "
            f"samples of {where} hold both, and each ends with a turn opened by {self.instruction_part!r}, "
            "where a sample ends with a reply; so the prompts would be trained on and the replies not. Pass "
            "the text that opens a user turn as instruction_part and the text that opens a reply as "
            f"response_part: {self.describe(verdicts[0][0])}",
            stacklevel=4,
        )

    def describe(self, ids) -> str:
        """The markers and the decoded sequence, for error messages."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        if len(text) > _SAMPLE_CHARS:
            text = text[:_SAMPLE_CHARS] + f"... ({len(text)} characters)"
        return (
            f"response_part={self.response_part!r} (token ids {list(self.response_variants[0])}), "
            f"instruction_part={self.instruction_part!r} (token ids {list(self.instruction_variants[0])}). "
            f"Decoded sequence: {text!r}"
        )


class ResponsesOnlyCollator:
    """Wraps a data collator: labels outside the replies become -100."""

    def __init__(self, collator, masker: ResponseMasker):
        self.collator = collator
        self.masker = masker
        self.instruction_checked = False  # the first batch is checked for the instruction marker

    def __call__(self, features):
        batch = self.collator(features)
        input_ids = batch["input_ids"]
        labels = batch.get("labels")
        if labels is None:
            labels = input_ids.clone()
            if batch.get("attention_mask") is not None:
                labels[batch["attention_mask"] == 0] = -100
        if not self.instruction_checked:
            self.instruction_checked = True
            if not any(self.masker.has_instruction(row) for row in input_ids):
                self.masker.warn_missing_instruction("the first batch", _unpadded(batch, 0))
            self.masker.warn_if_swapped(
                "the first batch", [_unpadded(batch, b) for b in range(len(input_ids))]
            )
        keep = self.masker.keep_mask(input_ids, batch.get("position_ids"))
        labels = labels.masked_fill(~keep, -100)
        if not (labels != -100).any():
            raise NoTrainableTokensError(
                f"train_on_responses_only: this batch of {input_ids.shape[0]} sequence(s) has no token to "
                f"train on (the loss would be 0/0): no reply was found after the response marker, or the reply "
                f"was cut off by max_length. Check that the markers match the chat template: "
                f"{self.masker.describe(_unpadded(batch, 0))}"
            )
        batch["labels"] = labels
        return batch


def _unpadded(batch, row: int) -> list[int]:
    ids = batch["input_ids"][row]
    mask = batch.get("attention_mask")
    if mask is not None:
        ids = ids[mask[row].bool()]
    return ids.tolist()


def masked_labels(masker: ResponseMasker, record) -> list[int]:
    """The labels of one tokenized sample with every token outside a reply set to -100
    (the sample's own labels, when it has them, keep their -100s)."""
    ids = torch.tensor(record["input_ids"])
    positions = record.get("position_ids")
    keep = masker.keep_row(ids, None if positions is None else torch.tensor(positions))
    labels = torch.tensor(record["labels"]) if record.get("labels") is not None else ids
    return labels.masked_fill(~keep, -100).tolist()


def _mask_dataset(dataset, masker: ResponseMasker, name: str, num_proc: int | None = None):
    """Mask a tokenized dataset's "labels" column (TRL's SFTTrainer builds one), so that
    ``dataset[i]["labels"]`` shows -100 outside the replies; drop samples with nothing to
    train on; raise when that is every sample.  A dataset without labels gets none (a
    collator such as transformers' DataCollatorForLanguageModeling could not pad them):
    the collator masks its batches."""
    import datasets

    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        return dataset  # not tokenized yet, or streamed: the collator masks each batch
    if "labels" in dataset.column_names:
        dataset = dataset.map(
            lambda record: {"labels": masked_labels(masker, record)},
            num_proc=num_proc,
            desc=f"Masking all but the replies in the {name} dataset",
        )
        labels_per_sample = dataset["labels"]
    else:
        labels_per_sample = [masked_labels(masker, record) for record in dataset]
    counts = [sum(label != -100 for label in labels) for labels in labels_per_sample]
    empty = [i for i, count in enumerate(counts) if count == 0]
    if len(empty) == len(counts):
        raise NoTrainableTokensError(
            f"train_on_responses_only: none of the {len(counts)} samples of the {name} dataset has a token to "
            f"train on. Check that the markers match the chat template: "
            f"{masker.describe(dataset[0]['input_ids'])}"
        )
    if not any(masker.has_instruction(ids) for ids in dataset["input_ids"]):
        masker.warn_missing_instruction(f"the {name} dataset", dataset[0]["input_ids"])
    masker.warn_if_swapped(f"the {name} dataset", dataset["input_ids"])
    if empty:
        warnings.warn(
            f"train_on_responses_only: {len(empty)} of {len(counts)} samples of the {name} dataset have no reply "
            f"tokens (no response marker, or the reply was cut off by max_length) and are left out; first: "
            f"{masker.describe(dataset[empty[0]]['input_ids'])}",
            stacklevel=3,
        )
        keep = sorted(set(range(len(counts))) - set(empty))
        dataset = dataset.select(keep)
    return dataset


def train_on_responses_only(
    trainer,
    instruction_part: str | None = None,
    response_part: str | None = None,
    force_match: bool = True,
    *,
    tokenizer=None,
    num_proc: int | None = None,
):
    """Make `trainer` compute the loss on the assistant replies only (module docstring).

    A tokenized dataset's "labels" column (TRL's SFTTrainer builds one) is masked
    (``trainer.train_dataset[i]["labels"]`` shows -100 outside the replies); samples with
    no reply token left are
    dropped (with a warning); if none is left, or a batch has none at training time,
    NoTrainableTokensError says so with the markers and a decoded sample.  The data
    collator is wrapped to mask each batch the same way, which covers datasets tokenized
    later, streamed ones and packed batches.

    Args:
        trainer: a TRL SFTTrainer or a transformers Trainer, built with its datasets;
            its datasets and data collator are replaced.
        instruction_part: the text that opens a user turn, e.g.
            "<|start_header_id|>user<|end_header_id|>\\n\\n"; None (default): read from
            the tokenizer's chat template (slothkit's formats know theirs; other templates
            are probed).
        response_part: the text that opens an assistant turn; None (default): read from
            the chat template likewise.
        force_match: True (default): the markers match as written (in the token
            sequences they take in context); False: also without their surrounding
            whitespace.
        tokenizer: the tokenizer that tokenized the data; None (default): the trainer's
            processing_class (or its tokenizer).
        num_proc: processes for masking the datasets (default None: this one).

    Returns:
        The same trainer.

    Raises:
        ValueError: the trainer has no tokenizer and none was passed, the markers
            cannot be read from the chat template, or the chat template shows them
            swapped (check_marker_order).
        NoTrainableTokensError: no sample has a reply token left.
    """
    if tokenizer is None:
        tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("the trainer has no tokenizer (processing_class); pass tokenizer=")
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    if instruction_part is None or response_part is None:
        inferred_instruction, inferred_response = infer_markers(tokenizer)
        instruction_part = inferred_instruction if instruction_part is None else instruction_part
        response_part = inferred_response if response_part is None else response_part
    masker = ResponseMasker(tokenizer, instruction_part, response_part, force_match=force_match)
    if getattr(trainer, "train_dataset", None) is not None:
        trainer.train_dataset = _mask_dataset(trainer.train_dataset, masker, "training", num_proc)
    eval_dataset = getattr(trainer, "eval_dataset", None)
    if isinstance(eval_dataset, dict):
        trainer.eval_dataset = {
            key: _mask_dataset(value, masker, f"{key!r} evaluation", num_proc)
            for key, value in eval_dataset.items()
        }
    elif eval_dataset is not None:
        trainer.eval_dataset = _mask_dataset(eval_dataset, masker, "evaluation", num_proc)
    trainer.data_collator = ResponsesOnlyCollator(trainer.data_collator, masker)
    return trainer
