"""The fast decode loop on a real checkpoint past its sliding window: Gemma 3 270M (its 15
local layers attend within 512 positions, its 3 global layers over everything), a real
paragraph of 600 tokens beside a 300-token one, left-padded.
The local layers keep rings of 512 slots, so the prefill leaves only the prompt's last
512 tokens in them and every decode step writes over the oldest; the greedy tokens equal
Hugging Face's generate on the same loaded model, in fp32 on the CPU."""

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.testing import CORPUS

NEW_TOKENS = 16


@pytest.mark.slow
def test_gemma3_greedy_tokens_past_the_window_equal_hf_generate(gemma3_path):
    model, tokenizer = FastModel.from_pretrained(
        str(gemma3_path), dtype=torch.float32, load_in_4bit=False, fused=False
    )
    model.eval()
    window = model.config.sliding_window
    ids = tokenizer(CORPUS, return_tensors="pt")["input_ids"]
    long, short = ids[:, :600], ids[:, 200:500]
    assert long.shape[1] > window, "the prompt must pass the window"
    padded = torch.cat([torch.zeros(long.shape[1] - short.shape[1], dtype=long.dtype), short[0]])
    batch = {
        "input_ids": torch.stack([long[0], padded]),
        "attention_mask": torch.stack(
            [torch.ones_like(long[0]), (torch.arange(long.shape[1]) >= 300).long()]
        ),
    }
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    FastModel.for_inference(model, fast_decode=False)
    expected = model.generate(**batch, **settings)
    FastModel.for_inference(model, fast_decode=True)
    got = model.generate(**batch, **settings)
    cache = state_of(model).fast_decoder.cache
    assert sorted({ring for ring in cache.rings if ring is not None}) == [window]
    assert sum(ring is not None for ring in cache.rings) == 15
    assert torch.equal(got, expected), f"first difference at {(got != expected).nonzero()[:1].tolist()}"
