"""Packing: a packed batch trains on exactly what the padded batch trains on."""

import pytest
import torch

from slothkit import FastModel
from slothkit.data import PackingCollator
from slothkit.testing import tiny_model_path


def test_collator_layout():
    batch = PackingCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]


def test_collator_bad_input():
    with pytest.raises(ValueError, match="empty batch"):
        PackingCollator()([])
    with pytest.raises(KeyError, match="input_ids"):
        PackingCollator()([{"text": "hi"}])
    with pytest.raises(ValueError, match="labels"):
        PackingCollator()([{"input_ids": [1, 2], "labels": [1]}])


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma"])
def test_packed_loss_equals_padded_loss(arch, device):
    path = tiny_model_path(arch)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    g = torch.Generator().manual_seed(1)
    lengths = [7, 11, 4]
    samples = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]

    packed = {k: v.to(device) for k, v in PackingCollator()([{"input_ids": s} for s in samples]).items()}
    packed_loss = model(**packed).loss

    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
        labels[row, : len(s)] = torch.tensor(s)
    padded_loss = model(
        input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)
    ).loss
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
