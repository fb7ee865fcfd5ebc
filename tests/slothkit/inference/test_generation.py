"""The generate that FastModel's models carry (slothkit.inference.generation): token ids the model has
no embedding for are refused before generating, naming the id and the vocabulary."""

import pytest
import torch

from slothkit import FastModel
from slothkit.testing import tiny_model_path


@pytest.mark.parametrize("fast_decode", [False, True], ids=["hf", "fast"])
def test_a_token_id_outside_the_vocabulary_is_named(fast_decode):
    model, tokenizer = FastModel.from_pretrained(
        str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False, fused=False
    )
    FastModel.for_inference(model, fast_decode=fast_decode)
    rows = model.get_input_embeddings().weight.shape[0]
    prompt = tokenizer(["Sloths"], return_tensors="pt")["input_ids"]
    beyond = torch.cat([prompt, torch.tensor([[rows + 5, rows]])], dim=1)
    with pytest.raises(
        ValueError, match=rf"input_ids holds token id {rows + 5}, beyond the model's vocabulary of {rows} ids"
    ):
        model.generate(input_ids=beyond, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids holds token id -1, which no token has"):
        model.generate(input_ids=torch.cat([prompt, torch.tensor([[-1]])], dim=1), max_new_tokens=2)
    encoding = tokenizer(["Sloths"], return_tensors="pt")
    encoding["input_ids"][0, 0] = rows
    with pytest.raises(ValueError, match=f"token id {rows}, beyond"):  # the dict apply_chat_template returns
        model.generate(encoding, max_new_tokens=2)
    assert model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False).shape[1] == prompt.shape[1] + 2
