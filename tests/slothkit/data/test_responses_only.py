"""train_on_responses_only keeps exactly the assistant tokens, and says so clearly when a
batch would have none to train on."""

import os
import warnings

import pytest
import torch
from transformers import AutoTokenizer

from slothkit.data import (
    FORMATS,
    NoTrainableTokensError,
    apply_chat_template,
    example_dataset,
    format_alpaca,
    get_chat_template,
    train_on_responses_only,
)
from slothkit.data.responses_only import (
    ResponseMasker,
    ResponsesOnlyCollator,
    infer_markers,
    probe_markers,
)
from slothkit.testing import tiny_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    [
        {"role": "user", "content": "Convert 3 km to m."},
        {"role": "assistant", "content": "3000 metres.\nDone"},
    ],
    [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": " spaced reply "},
        {"role": "user", "content": "\nnewline first"},
        {"role": "assistant", "content": "(ok)"},
    ],
]


def _tokenizer(arch="llama", name="llama-3", add_missing_tokens=True):
    """The format on a tiny tokenizer: with the markers it lacks added as tokens (the
    model grows with them), or with None (the default) written as text and the turn end
    as the tokenizer's EOS."""
    from transformers import AutoModelForCausalLM

    path = str(tiny_model_path(arch))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_chat_template(tokenizer, name, model=model, add_missing_tokens=add_missing_tokens)


def _template_mask(tokenizer, conversation):
    encoded = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return torch.tensor(encoded["input_ids"]), torch.tensor(encoded["assistant_masks"]).bool()


@pytest.mark.parametrize("add_missing_tokens", [True, None], ids=["added", "as-text"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_markers_keep_exactly_the_generation_blocks(name, arch, add_missing_tokens):
    tokenizer = _tokenizer(arch, name, add_missing_tokens)
    fmt = FORMATS[name]
    assert infer_markers(tokenizer) == (fmt.instruction_part, fmt.response_part)
    # A template slothkit did not tag is probed; the probe finds the same markers.
    assert probe_markers(tokenizer) == (fmt.instruction_part, fmt.response_part)
    masker = ResponseMasker(tokenizer, fmt.instruction_part, fmt.response_part)
    for conversation in CONVERSATIONS:
        ids, expected = _template_mask(tokenizer, conversation)
        assert masker.keep_row(ids).tolist() == expected.tolist(), tokenizer.decode(ids)


def _trainer_stub(tokenizer, dataset, collator):
    class Stub:  # what train_on_responses_only touches on a Trainer
        pass

    stub = Stub()
    stub.processing_class, stub.train_dataset = tokenizer, dataset
    stub.eval_dataset, stub.data_collator = None, collator
    return stub


def _tokenized(tokenizer, texts):
    import datasets

    return datasets.Dataset.from_dict({"input_ids": [tokenizer(t)["input_ids"] for t in texts]})


def _pad_collator(tokenizer):
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tokenizer, mlm=False)


def test_collator_masks_batches_of_the_example_data():
    tokenizer = _tokenizer()
    records = example_dataset("chat").select(range(6))
    texts = apply_chat_template(records, tokenizer)["text"]
    trainer = train_on_responses_only(
        _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer))
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    for row, record in enumerate(records):
        labels = batch["labels"][row]
        kept = tokenizer.decode(labels[labels != -100])
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert kept == "<|eot_id|>".join(replies) + "<|eot_id|>"
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()  # padding stays ignored


def test_existing_ignored_labels_stay_ignored():
    tokenizer = _tokenizer()
    masker = ResponseMasker(tokenizer, *infer_markers(tokenizer))
    ids, _ = _template_mask(tokenizer, CONVERSATIONS[0])
    labels = ids.clone()
    labels[-3:] = -100

    def collate(features):
        return {"input_ids": ids[None], "labels": labels[None].clone()}

    batch = ResponsesOnlyCollator(collate, masker)([None])
    assert (batch["labels"][0, -3:] == -100).all()
    assert (batch["labels"] != -100).sum() == masker.keep_row(ids)[:-3].sum()


def test_packed_sequences_stop_at_the_next_document():
    tokenizer = _tokenizer()
    masker = ResponseMasker(tokenizer, *infer_markers(tokenizer))
    first, first_mask = _template_mask(tokenizer, CONVERSATIONS[1])
    second, second_mask = _template_mask(tokenizer, CONVERSATIONS[0])
    packed = torch.cat([first, second])
    positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])
    keep = masker.keep_row(packed, positions)
    assert keep.tolist() == torch.cat([first_mask, second_mask]).tolist()
    # Without BOS or positions the reply would run into the next document's system turn.
    no_bos = torch.cat([first, second[1:]])
    no_bos_positions = torch.cat([torch.arange(len(first)), torch.arange(len(second) - 1)])
    assert (
        masker.keep_row(no_bos, no_bos_positions).tolist()
        == torch.cat([first_mask, second_mask[1:]]).tolist()
    )


def test_batch_without_a_reply_raises_a_clear_error():
    tokenizer = _tokenizer()
    prompt_only = tokenizer.apply_chat_template(
        CONVERSATIONS[1][:1], tokenize=False, add_generation_prompt=True
    )
    truncated = tokenizer(prompt_only)["input_ids"]
    masker = ResponseMasker(tokenizer, *infer_markers(tokenizer))
    collator = ResponsesOnlyCollator(_pad_collator(tokenizer), masker)
    with pytest.raises(NoTrainableTokensError) as error:
        collator([{"input_ids": truncated}])
    message = str(error.value)
    assert "response_part='<|start_header_id|>assistant<|end_header_id|>\\n\\n'" in message
    assert "instruction_part='<|start_header_id|>user<|end_header_id|>\\n\\n'" in message
    assert "Convert 3 km to m." in message and "0/0" in message


def test_dataset_screening_drops_or_refuses():
    tokenizer = _tokenizer()
    good = apply_chat_template([{"messages": CONVERSATIONS[1]}], tokenizer)["text"][0]
    bad = "just some text without any marker"
    with pytest.warns(UserWarning, match="1 of 3 samples of the training dataset have no reply tokens"):
        trainer = train_on_responses_only(
            _trainer_stub(tokenizer, _tokenized(tokenizer, [good, bad, good]), None)
        )
    assert len(trainer.train_dataset) == 2
    with pytest.raises(NoTrainableTokensError, match="none of the 2 samples.*just some text"):
        train_on_responses_only(_trainer_stub(tokenizer, _tokenized(tokenizer, [bad, bad]), None))
    # Markers that are not in the template: every sample is refused, naming the markers.
    with pytest.raises(NoTrainableTokensError, match="response_part='### Response:\\\\n'"):
        train_on_responses_only(
            _trainer_stub(tokenizer, _tokenized(tokenizer, [good]), None),
            "### Instruction:\n",
            "### Response:\n",
        )


def test_alpaca_text_with_explicit_markers():
    import datasets

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("mistral")))
    assert tokenizer.chat_template  # ignored: the markers are given
    records = datasets.Dataset.from_list(
        [
            {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        ]
    )
    texts = format_alpaca(records, tokenizer)["text"]
    trainer = train_on_responses_only(
        _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer)),
        instruction_part="### Instruction:\n",
        response_part="### Response:\n",
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    for row, output in enumerate(["5", "Blue."]):
        labels = batch["labels"][row]
        assert tokenizer.decode(labels[labels != -100]) == output + "</s>"


def test_markers_need_a_template_or_arguments():
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("llama")))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="pass instruction_part and response_part"):
        infer_markers(tokenizer)
    with pytest.raises(ValueError, match="both"):
        ResponseMasker(tokenizer, "### Response:\n", "### Response:\n")


def test_agrees_with_trl_assistant_only_loss(monkeypatch, tmp_path):
    """TRL's assistant_only_loss (the template's generation marks, on a messages dataset)
    and train_on_responses_only (markers, on the rendered text) train the same tokens, but
    for the newline after the last <|im_end|> that the text column leaves out."""
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    monkeypatch.chdir(tmp_path)  # the trainers' output_dir
    tokenizer = _tokenizer("gemma", "chatml")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path("gemma")), dtype=torch.float32)
    records = example_dataset("chat").select(range(8))
    args = dict(
        output_dir="unused",
        report_to="none",
        per_device_train_batch_size=8,
        bf16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_template = SFTTrainer(
            model=model,
            args=SFTConfig(assistant_only_loss=True, **args),
            train_dataset=records,
            processing_class=tokenizer,
        )
        by_markers = SFTTrainer(
            model=model,
            args=SFTConfig(**args),
            processing_class=tokenizer,
            train_dataset=apply_chat_template(records, tokenizer),
        )
    train_on_responses_only(by_markers)
    template_batch = next(iter(by_template.get_train_dataloader()))
    marker_batch = next(iter(by_markers.get_train_dataloader()))
    for row in range(8):
        expected = template_batch["labels"][row]
        expected = expected[expected != -100].tolist()
        got = marker_batch["labels"][row]
        got = got[got != -100].tolist()
        assert got == expected[:-1] and tokenizer.decode(expected[-1:]) == "\n"
        kept = tokenizer.decode(got)
        assert kept.endswith("<|im_end|>") and "<|im_start|>" not in kept


def test_an_instruction_marker_that_never_occurs_is_reported():
    tokenizer = _tokenizer()
    texts = apply_chat_template([{"messages": c} for c in CONVERSATIONS], tokenizer)["text"]
    response = infer_markers(tokenizer)[1]
    with pytest.warns(
        UserWarning, match=r"instruction_part='### Human:' occurs in no sample of the training"
    ):
        trainer = train_on_responses_only(
            _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer)),
            instruction_part="### Human:",
            response_part=response,
        )
    # Why it matters: the user's second turn of the first conversation would be trained on.
    labels = trainer.data_collator([trainer.train_dataset[0]])["labels"][0]
    assert "What is 2+2?" in tokenizer.decode(labels[labels != -100])

    # A dataset tokenized later is checked on its first batch.
    untokenized = _trainer_stub(tokenizer, None, _pad_collator(tokenizer))
    train_on_responses_only(untokenized, instruction_part="### Human:", response_part=response)
    features = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]
    with pytest.warns(UserWarning, match="occurs in no sample of the first batch"):
        untokenized.data_collator(features)

    # The right marker gives no such warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_on_responses_only(
            _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer))
        )


@pytest.mark.parametrize("arch", ["llama", "gemma"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_swapped_markers_are_refused(name, arch):
    """Both markers occur in every sample, so swapped ones trained on every user turn and on
    no reply without a word; the chat template tells which marker opens which role."""
    tokenizer = _tokenizer(arch, name)
    instruction, response = infer_markers(tokenizer)
    texts = apply_chat_template([{"messages": c} for c in CONVERSATIONS], tokenizer)["text"]
    with pytest.raises(ValueError) as error:
        train_on_responses_only(
            _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer)),
            instruction_part=response,
            response_part=instruction,
        )
    message = str(error.value)
    assert f"instruction_part={response!r} and response_part={instruction!r} look swapped" in message
    assert f"Pass instruction_part={instruction!r} and response_part={response!r}" in message

    # The markers the right way round: replies kept, user turns not.
    trainer = train_on_responses_only(
        _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer)),
        instruction_part=instruction,
        response_part=response,
    )
    labels = trainer.data_collator([trainer.train_dataset[0]])["labels"][0]
    kept = tokenizer.decode(labels[labels != -100])
    assert "Hello!" in kept and "4" in kept and "What is 2+2?" not in kept and "Hi there" not in kept


def test_swapped_markers_without_a_template_to_tell_are_reported_from_the_data():
    """Alpaca text on a tokenizer without a chat template: nothing names the roles but the
    data, where each sample ends with its reply; swapped markers trained on the prompts."""
    import datasets

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path("mistral")))
    tokenizer.chat_template = None
    records = datasets.Dataset.from_list(
        [
            {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        ]
    )
    texts = format_alpaca(records, tokenizer)["text"]
    instruction, response = "### Instruction:\n", "### Response:\n"
    with pytest.warns(UserWarning, match=r"instruction_part='### Response:\\n' and response_part="
                      r"'### Instruction:\\n' look swapped: 2 of the first 2 samples"):  # fmt: skip
        swapped = train_on_responses_only(
            _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer)),
            instruction_part=response,
            response_part=instruction,
        )
    # Why it matters: the instruction is trained on, the reply not.
    labels = swapped.data_collator([swapped.train_dataset[0]])["labels"][0]
    kept = tokenizer.decode(labels[labels != -100])
    assert "Add the numbers." in kept and "5" not in kept

    # A dataset tokenized later is checked on its first batch.
    untokenized = _trainer_stub(tokenizer, None, _pad_collator(tokenizer))
    train_on_responses_only(untokenized, instruction_part=response, response_part=instruction)
    with pytest.warns(UserWarning, match="look swapped: 2 of the first 2 samples of the first batch"):
        untokenized.data_collator([{"input_ids": tokenizer(t)["input_ids"]} for t in texts])

    # The right way round: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_on_responses_only(
            _trainer_stub(tokenizer, _tokenized(tokenizer, texts), _pad_collator(tokenizer)),
            instruction_part=instruction,
            response_part=response,
        )
