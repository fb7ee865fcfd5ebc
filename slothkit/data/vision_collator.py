"""Batches of chat messages with images for an image-text model: the processor's chat
template, its image tokens and pixel values, and labels that train on the answers.

    collator = VisionDataCollator(model, processor)
    batch = collator([{"messages": [
        {"role": "user", "content": [{"type": "image", "image": pil_image},
                                     {"type": "text", "text": "Write the LaTeX for this."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "x^2"}]},
    ]}])

TRL's SFTTrainer takes it as Unsloth's vision notebooks pass theirs:
``SFTTrainer(model, data_collator=collator, train_dataset=records, args=SFTConfig(
remove_unused_columns=False, dataset_text_field="", dataset_kwargs={"skip_prepare_dataset":
True}, ...))``: the records reach the collator as they are.

The labels are the input ids with -100 (ignored by the loss) on padding, on every image
token (the image's placeholder tokens and its start and end markers) and, with
``train_on_responses_only`` (the default), on everything outside the assistant's turns.
An assistant turn's tokens are found by rendering the conversation up to it: the tokens of
``messages[:i]`` with the generation prompt end where the answer starts, and those of
``messages[: i + 1]`` end where it ends (its end-of-turn marker included, so the model
learns to stop).  Each such prefix is processed with its images, since an image's token
count depends on its size (Qwen-VL).
"""

from __future__ import annotations

import io

import torch

# The config attributes naming the tokens that stand for images (the placeholders and the
# markers around them) in transformers' image-text models.
IMAGE_TOKEN_ATTRIBUTES = (
    "image_token_id",
    "image_token_index",
    "boi_token_index",
    "eoi_token_index",
    "vision_start_token_id",
    "vision_end_token_id",
    "video_token_id",
)
IGNORED = -100


class VisionDataCollator:
    """Turn records of chat messages with images into a batch for an image-text model.

    Args:
        model: the model the batches are for (its config names the image tokens; its dtype
            is the pixel values').
        processor: the model's processor (FastVisionModel.from_pretrained returns it).
        max_seq_length: None (default): rows as long as they render; else rows longer
            are cut to it at the end, refused where that would cut an image's tokens.
        train_on_responses_only: True (default): only the assistant's turns are trained
            on; False: every token that is not padding or an image's.
        ignore_index: the label of tokens not trained on (default -100).

    A record is ``{"messages": [...]}`` (or ``"conversations"``), each message's content a
    string or a list of parts: ``{"type": "text", "text": ...}`` and ``{"type": "image",
    "image": PIL.Image}``; image parts without ``"image"`` take the record's ``"images"``
    in order.
    """

    def __init__(
        self,
        model,
        processor,
        max_seq_length: int | None = None,
        train_on_responses_only: bool = True,
        ignore_index: int = IGNORED,
    ):
        if not hasattr(processor, "image_processor"):
            raise ValueError(
                f"VisionDataCollator needs the model's processor (with an image processor), not a "
                f"{type(processor).__name__}: pass the processor FastVisionModel.from_pretrained returned"
            )
        if max_seq_length is not None and (not isinstance(max_seq_length, int) or max_seq_length <= 0):
            raise ValueError(f"max_seq_length={max_seq_length!r}; expected None or a positive integer")
        self.processor = processor
        self.max_seq_length = max_seq_length
        self.train_on_responses_only = train_on_responses_only
        self.ignore_index = ignore_index
        self.image_token_ids = sorted(_image_token_ids(model.config, processor))
        self.pixel_dtype = _floating_dtype(model)

    def __call__(self, records: list[dict]) -> dict[str, torch.Tensor]:
        conversations = [_messages_with_images(record, index) for index, record in enumerate(records)]
        texts = [self._render(messages) for messages in conversations]
        images = [_images_in(messages) for messages in conversations]
        batch = self._process(texts, images)
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = self.ignore_index
        labels[torch.isin(labels, torch.tensor(self.image_token_ids, dtype=labels.dtype))] = self.ignore_index
        if self.train_on_responses_only:
            for row, messages in enumerate(conversations):
                self._mask_outside_answers(labels, row, messages, batch)
        batch["labels"] = labels
        if self.max_seq_length is not None and labels.shape[1] > self.max_seq_length:
            batch = self._cut(batch)
        if "pixel_values" in batch and batch["pixel_values"].is_floating_point():
            batch["pixel_values"] = batch["pixel_values"].to(self.pixel_dtype)
        return batch

    def _render(self, messages: list[dict], prompt: bool = False) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    def _process(self, texts: list[str], images: list[list]) -> dict[str, torch.Tensor]:
        # The chat template writes the BOS where the model wants one: tokenizing adds none.
        with_images = any(images)
        return dict(
            self.processor(
                text=texts,
                images=images if with_images else None,
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
        )

    def _prefix_ids(self, messages: list[dict], prompt: bool) -> torch.Tensor:
        return self._process([self._render(messages, prompt)], [_images_in(messages)])["input_ids"][0]

    def _mask_outside_answers(self, labels, row: int, messages: list[dict], batch) -> None:
        """-100 on the row's tokens outside its assistant turns."""
        mask = batch["attention_mask"][row]
        start_of_row = int(mask.nonzero()[0]) if mask.any() else 0  # left padding shifts the row
        trained = torch.zeros_like(mask, dtype=torch.bool)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt_ids = self._prefix_ids(messages[:turn], prompt=True)
            start, end = len(prompt_ids), len(self._prefix_ids(messages[: turn + 1], prompt=False))
            if not torch.equal(prompt_ids, batch["input_ids"][row, start_of_row : start_of_row + start]):
                raise ValueError(
                    f"record {row}: the chat template renders the conversation before assistant turn {turn} "
                    f"(with the generation prompt) as other tokens than the start of the whole conversation, "
                    f"so its answer cannot be located; pass train_on_responses_only=False to train on every token"
                )
            trained[start_of_row + start : start_of_row + end] = True
        labels[row, ~trained] = self.ignore_index

    def _cut(self, batch: dict) -> dict:
        """The batch's rows cut to max_seq_length, where no image token is cut: every
        tensor laid out (rows, tokens, ...) is cut on its token axis, Mllama's
        (rows, tokens, images, tiles) cross-attention mask with the ids."""
        keep = self.max_seq_length
        ids = batch["input_ids"]
        cut_images = torch.isin(ids[:, keep:], torch.tensor(self.image_token_ids, dtype=ids.dtype))
        if cut_images.any():
            raise ValueError(
                f"a row of {ids.shape[1]} tokens has image tokens after max_seq_length={keep}; cutting it would "
                f"separate an image from its tokens: raise max_seq_length, or use smaller images"
            )
        length = ids.shape[1]
        return {
            name: value[:, :keep]
            if value.dim() >= 2 and value.shape[1] == length and name != "pixel_values"
            else value
            for name, value in batch.items()
        }


def _image_token_ids(config, processor) -> set[int]:
    ids = set()
    for source in (config, getattr(config, "get_text_config", lambda: None)(), processor):
        for name in IMAGE_TOKEN_ATTRIBUTES:
            value = getattr(source, name, None)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return ids


def _floating_dtype(model) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (a 4-bit model's vision
    tower and norms stay 16-bit)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def _messages_with_images(record: dict, index: int) -> list[dict]:
    """The record's messages, each image part holding its image (from the record's
    "images" where the part has none)."""
    messages = record.get("messages", record.get("conversations"))
    if not isinstance(messages, list):
        raise ValueError(
            f"record {index} has no 'messages' (or 'conversations') list of chat messages; its keys are "
            f"{sorted(record)}"
        )
    images = list(record.get("images") or [])
    result = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "image" and part.get("image") is None:
                    if not images:
                        raise ValueError(
                            f"record {index}: an image part has no 'image' and the record's 'images' has no "
                            f"image left for it"
                        )
                    part = {**part, "image": images.pop(0)}
                if part.get("type") == "image":
                    part = {**part, "image": _decoded(part["image"])}
                parts.append(part)
            message = {**message, "content": parts}
        result.append(message)
    return result


def _decoded(image):
    """An image as the processor takes it: datasets stores a PIL image nested in a record
    as {"bytes": ..., "path": ...} (a list of records passed to a trainer becomes such a
    dataset), which is opened here; anything else is the processor's to read."""
    if isinstance(image, dict) and ("bytes" in image or "path" in image):
        from PIL import Image

        if image.get("bytes") is not None:
            return Image.open(io.BytesIO(image["bytes"]))
        return Image.open(image["path"])
    return image


def _images_in(messages: list[dict]) -> list:
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image"
    ]
