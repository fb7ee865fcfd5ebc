"""VisionDataCollator on the tiny image-text Gemma 3: the processor's batch with labels on
the answers only, and TRL's SFTTrainer training on it as Unsloth's vision notebooks set it
up."""

import os
import warnings

import numpy as np
import pytest
import torch

from slothkit import FastVisionModel, UnslothVisionDataCollator, VisionDataCollator
from slothkit.testing.tiny_image_text import tiny_image_text_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def loaded():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FastVisionModel.from_pretrained(
            str(tiny_image_text_path("gemma3")), load_in_4bit=False, dtype=torch.float32, max_seq_length=128,
            fused=False,
        )  # fmt: skip


def _image(rng, size=(40, 30)):
    from PIL import Image

    return Image.fromarray(rng.randint(0, 255, (*size, 3), dtype=np.uint8))


def _record(rng, question, answer, images=1):
    content = [{"type": "image", "image": _image(rng)} for _ in range(images)]
    return {
        "messages": [
            {"role": "user", "content": [*content, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def _trained_text(processor, labels_row):
    return processor.tokenizer.decode([int(t) for t in labels_row if t != -100])


def test_labels_are_the_answers_with_their_end_of_turn(loaded):
    model, processor = loaded
    rng = np.random.RandomState(0)
    answers = ["A cat on a mat.", "Two dogs."]
    records = [
        _record(rng, "What is this?", answers[0]),
        _record(rng, "And this, a longer question?", answers[1], 2),
    ]
    batch = VisionDataCollator(model, processor)(records)
    assert {"input_ids", "attention_mask", "pixel_values", "labels"} <= batch.keys()
    assert batch["pixel_values"].shape[0] == 3  # one per image
    for row, answer in enumerate(answers):
        assert _trained_text(processor, batch["labels"][row]) == answer + "<end_of_turn>\n"
    # The rows are the processor's own encoding of the rendered conversations.
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in records]
    images = [[p["image"] for p in r["messages"][0]["content"] if p["type"] == "image"] for r in records]
    expected = processor(
        text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False
    )
    torch.testing.assert_close(batch["input_ids"], expected["input_ids"], rtol=0, atol=0)
    torch.testing.assert_close(batch["pixel_values"], expected["pixel_values"], rtol=0, atol=0)


def test_without_responses_only_every_token_but_padding_and_images_is_trained(loaded):
    model, processor = loaded
    rng = np.random.RandomState(1)
    batch = VisionDataCollator(model, processor, train_on_responses_only=False)(
        [_record(rng, "Short?", "Yes."), _record(rng, "A much longer question than the first?", "No.")]
    )
    config = model.config
    image_ids = {config.image_token_index, config.boi_token_index, config.eoi_token_index}
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    is_image = torch.isin(ids, torch.tensor(sorted(image_ids)))
    assert is_image.sum() == 2 * (config.mm_tokens_per_image + 2)
    expected = torch.where((mask == 1) & ~is_image, ids, torch.full_like(ids, -100))
    torch.testing.assert_close(labels, expected, rtol=0, atol=0)


def test_left_padding_finds_the_answers_too(loaded):
    model, processor = loaded
    rng = np.random.RandomState(2)
    processor.tokenizer.padding_side = "left"
    try:
        batch = VisionDataCollator(model, processor)(
            [_record(rng, "Q?", "First answer."), _record(rng, "A longer question here?", "Second.")]
        )
    finally:
        processor.tokenizer.padding_side = "right"
    assert _trained_text(processor, batch["labels"][0]) == "First answer.<end_of_turn>\n"
    assert _trained_text(processor, batch["labels"][1]) == "Second.<end_of_turn>\n"


def test_images_given_beside_the_messages_and_as_datasets_stores_them(loaded):
    import io

    model, processor = loaded
    rng = np.random.RandomState(3)
    image = _image(rng)
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    text = [{"type": "text", "text": "What?"}]
    placeholder = {"messages": [{"role": "user", "content": [{"type": "image"}, *text]}], "images": [image]}
    stored = {"messages": [{"role": "user", "content": [{"type": "image", "image": {"bytes": encoded.getvalue(), "path": None}}, *text]}]}  # fmt: skip
    direct = {"messages": [{"role": "user", "content": [{"type": "image", "image": image}, *text]}]}
    collator = VisionDataCollator(model, processor, train_on_responses_only=False)
    reference = collator([direct])
    for record in (placeholder, stored):
        batch = collator([record])
        torch.testing.assert_close(batch["pixel_values"], reference["pixel_values"], rtol=0, atol=0)
        torch.testing.assert_close(batch["input_ids"], reference["input_ids"], rtol=0, atol=0)


def test_max_seq_length_cuts_text_but_refuses_to_cut_an_image(loaded):
    model, processor = loaded
    rng = np.random.RandomState(4)
    record = _record(rng, "Describe the picture in a few words please?", "It is noise, nothing more.")
    full = VisionDataCollator(model, processor)([record])
    length = full["input_ids"].shape[1]
    cut = VisionDataCollator(model, processor, max_seq_length=length - 3)([record])
    assert cut["input_ids"].shape[1] == length - 3
    torch.testing.assert_close(cut["labels"], full["labels"][:, : length - 3], rtol=0, atol=0)
    with pytest.raises(ValueError, match="image tokens after max_seq_length=8"):
        VisionDataCollator(model, processor, max_seq_length=8)([record])


def test_a_tokenizer_is_refused_naming_the_processor(loaded):
    model, processor = loaded
    with pytest.raises(ValueError, match="needs the model's processor"):
        VisionDataCollator(model, processor.tokenizer)


def test_sft_trainer_trains_both_towers_as_unsloths_notebooks_set_it_up(loaded, tmp_path, reference_kernels):
    """With the language model on the fused path (the kernels' torch references), as on a GPU."""
    from slothkit.trl import SFTConfig, SFTTrainer

    _, processor = loaded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, processor = FastVisionModel.from_pretrained(
            str(tiny_image_text_path("gemma3")), load_in_4bit=False, dtype=torch.float32, max_seq_length=128,
            fused=True,
        )  # fmt: skip
        model = FastVisionModel.get_peft_model(model, r=8, lora_alpha=16)
    rng = np.random.RandomState(5)
    record = _record(rng, "What is in the picture?", "Noise in many colours.")
    records = [record] * 6  # every batch the same, so the first logged loss is known
    collator = UnslothVisionDataCollator(model, processor)
    batch = collator(records[:2])
    with torch.no_grad():
        first_loss = model(**batch).loss.item()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    FastVisionModel.for_training(model)
    trainer = SFTTrainer(
        model=model,
        tokenizer=processor,
        data_collator=collator,
        train_dataset=records,
        args=SFTConfig(
            per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2, warmup_steps=0, logging_steps=1,
            output_dir=str(tmp_path), report_to="none", save_strategy="no", disable_tqdm=True,
            dataloader_pin_memory=False, remove_unused_columns=False, dataset_text_field="",
            dataset_kwargs={"skip_prepare_dataset": True}, max_length=128,
        ),
    )  # fmt: skip
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3
    assert losses[0] == pytest.approx(first_loss, rel=1e-4)
    assert losses[-1] < losses[0]
    moved = {n for n, p in model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])}
    assert moved == set(before)  # every adapter, the vision tower's included
    assert any("vision_tower" in n for n in moved)


@pytest.fixture(scope="module")
def mllama_loaded():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FastVisionModel.from_pretrained(
            str(tiny_image_text_path("mllama")), load_in_4bit=False, dtype=torch.float32, max_seq_length=128
        )


def test_mllama_labels_leave_out_its_image_token_past_the_heads_rows(mllama_loaded):
    """Llama 3.2 Vision's <|image|> is the first id past its output head's rows: a label
    left on it could not be scored.  The collator masks it, and the model's loss is the
    cross-entropy of the answers' tokens alone."""
    model, processor = mllama_loaded
    rng = np.random.RandomState(6)
    answers = ["A cat.", "Two dogs on a mat."]
    records = [_record(rng, "What is this?", answers[0]), _record(rng, "And these two?", answers[1], 2)]
    batch = VisionDataCollator(model, processor)(records)
    image_token = model.config.image_token_index
    assert image_token >= model.lm_head.out_features
    assert (batch["input_ids"] == image_token).sum(dim=1).tolist() == [1, 2]
    assert not (batch["labels"] == image_token).any()
    for row, answer in enumerate(answers):
        assert _trained_text(processor, batch["labels"][row]) == answer + "<|eot_id|>"
    # The cross-attention mask is the processor's own for the rendered conversations.
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in records]
    images = [[p["image"] for p in r["messages"][0]["content"] if p["type"] == "image"] for r in records]
    expected = processor(
        text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False
    )
    torch.testing.assert_close(
        batch["cross_attention_mask"], expected["cross_attention_mask"], rtol=0, atol=0
    )
    with torch.no_grad():
        output = model(**batch)
    logits, labels = output.logits[:, :-1], batch["labels"][:, 1:]
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    torch.testing.assert_close(output.loss, reference, rtol=1e-6, atol=1e-6)


def test_mllama_cut_rows_keep_the_cross_attention_mask_in_step(mllama_loaded):
    model, processor = mllama_loaded
    rng = np.random.RandomState(7)
    record = _record(rng, "Describe the picture in a few words please?", "It is noise, nothing more.")
    full = VisionDataCollator(model, processor)([record])
    length = full["input_ids"].shape[1]
    cut = VisionDataCollator(model, processor, max_seq_length=length - 3)([record])
    assert cut["cross_attention_mask"].shape[1] == cut["input_ids"].shape[1] == length - 3
    torch.testing.assert_close(
        cut["cross_attention_mask"], full["cross_attention_mask"][:, : length - 3], rtol=0, atol=0
    )
    torch.testing.assert_close(cut["pixel_values"], full["pixel_values"], rtol=0, atol=0)
