"""A training forward past the model's positions is said once, on every path, from shapes
alone; a context extended at load (RoPE scaling) raises the limit."""

import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.core.notices import DataWarning
from slothkit.engine.position_limit import PositionLimitNotice
from slothkit.testing import build_tiny_model, build_tiny_tokenizer

POSITIONS = 64


@pytest.fixture(autouse=True)
def fresh_notices():
    from slothkit.core.notices import say_once

    say_once.cache_clear()


def _olmo2_checkpoint(path):
    """A model slothkit has no record for: the generic path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=768, max_position_embeddings=POSITIONS, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    return path


def _load(tmp_path, source, max_seq_length=POSITIONS):
    if source == "olmo2":
        path, fused = _olmo2_checkpoint(tmp_path / "olmo2"), True
    else:
        path = build_tiny_model("llama", tmp_path / "llama", max_position_embeddings=POSITIONS)
        fused = source == "fused"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = FastModel.from_pretrained(
            str(path), dtype=torch.float32, load_in_4bit=False, fused=fused, max_seq_length=max_seq_length
        )
    return model


def _ids(length, seed=0):
    return torch.randint(3, 600, (2, length), generator=torch.Generator().manual_seed(seed))


def _notices(record):
    return [str(w.message) for w in record if issubclass(w.category, DataWarning)]


@pytest.mark.parametrize("source", ["huggingface", "fused", "olmo2"])
def test_a_training_forward_past_the_positions_is_said_once(source, tmp_path):
    model = _load(tmp_path, source)
    model.train()
    ids = _ids(POSITIONS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids)  # at the limit: nothing to say
        assert _notices(record) == []
        ids = _ids(POSITIONS + 16, seed=1)
        loss = model(input_ids=ids, labels=ids).loss
        model(input_ids=_ids(POSITIONS + 30, seed=2), labels=_ids(POSITIONS + 30, seed=2))
    assert torch.isfinite(loss)  # it still runs: a notice, not a refusal
    (notice,) = _notices(record)
    assert (
        f"a training forward of {POSITIONS + 16} tokens runs past the model's {POSITIONS} positions" in notice
    )
    assert f"SFTConfig(max_length={POSITIONS})" in notice and f"max_seq_length={POSITIONS + 16}" in notice


def test_nothing_is_said_where_rope_was_scaled_in_eval_or_for_packed_rows(tmp_path):
    scaled = _load(tmp_path, "huggingface", max_seq_length=2 * POSITIONS)
    assert scaled.config.max_position_embeddings == 2 * POSITIONS
    scaled.train()
    ids = _ids(POSITIONS + 16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scaled(input_ids=ids, labels=ids)
        scaled.eval()
        scaled(input_ids=_ids(3 * POSITIONS))  # eval: generation and scoring have their own notices
        scaled.train()
        # Two packed samples of 3/4 the limit each: their positions restart, and the collator
        # (TRL's padding-free) gives the longest.
        row = _ids(3 * POSITIONS // 2)[:1]
        positions = torch.cat([torch.arange(3 * POSITIONS // 4)] * 2)[None]
        scaled(input_ids=row, position_ids=positions, max_length_q=3 * POSITIONS // 4, labels=row)
    assert _notices(record) == []


def test_the_notice_reads_shapes_only():
    """Meta tensors have shapes and no values: any read of a value (a GPU sync on CUDA)
    would raise here."""

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"max_position_embeddings": POSITIONS})()

    notice = PositionLimitNotice()
    decoder = Decoder()
    meta = torch.empty(2, POSITIONS + 1, dtype=torch.long, device="meta")
    notice(decoder, (), {"input_ids": meta, "attention_mask": meta})
    assert notice.said
    packed = PositionLimitNotice()
    packed(decoder, (meta,), {"position_ids": meta})  # no longest given: unknown, nothing said
    packed(decoder, (), {"inputs_embeds": torch.empty(1, POSITIONS, 8, device="meta")})
    assert not packed.said
    packed(decoder, (), {"input_ids": meta, "position_ids": meta, "max_length_q": POSITIONS + 1})
    assert packed.said
