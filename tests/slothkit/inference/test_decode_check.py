"""The check for_inference runs on the fast loop of a family without a record
(slothkit.inference.decode_check): a loop that computes the model's logits is switched on;
one whose logits differ, or whose first steps fail, is switched off with one notice, and
generate then gives Hugging Face's tokens; a family with a record is not checked."""

import warnings

import pytest
import torch

import slothkit.inference as inference
import slothkit.inference.decode_check as decode_check
from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.testing import tiny_model_path
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fresh_notices():
    say_once.cache_clear()


def _gemma4():
    model, _ = FastModel.from_pretrained(
        str(tiny_generic_model_path("gemma4_text")),
        max_seq_length=256,
        dtype=torch.float32,
        load_in_4bit=False,
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights at 10x transformers' scale: every part moves the logits
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.to(DEVICE)


def _switch_on(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FastModel.for_inference(model, fast_decode=True)
    return [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def _greedy(model):
    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


def test_a_loop_that_agrees_is_switched_on():
    model = _gemma4()
    assert not [n for n in _switch_on(model) if "fast generation is off" in n]
    assert state_of(model).fast_decoder is not None


@pytest.mark.parametrize("fault", ["wrong-logits", "failing-step"])
def test_a_loop_that_differs_or_fails_is_switched_off_once(monkeypatch, fault):
    model = _gemma4()
    FastModel.for_inference(model, fast_decode=False)
    expected = _greedy(model)
    step_class = inference.step_class_for(model.config)
    real_call = step_class.__call__

    def faulty(self, input_ids, *args, **kwargs):
        if fault == "failing-step":
            raise RuntimeError("a kernel this GPU cannot run")
        logits = real_call(self, input_ids, *args, **kwargs)
        return logits + 0.5 * logits.std() * torch.randn_like(logits)

    monkeypatch.setattr(step_class, "__call__", faulty)
    notices = [n for n in _switch_on(model) if "fast generation is off" in n]
    assert len(notices) == 1, notices
    assert ("differ from the model's own forward" if fault == "wrong-logits" else "failed") in notices[0]
    assert state_of(model).fast_decoder is None
    torch.testing.assert_close(_greedy(model), expected, rtol=0, atol=0)  # Hugging Face's generate
    assert not _switch_on(model)  # refused for good, said once
    assert state_of(model).fast_decoder is None


def test_a_family_with_a_record_is_not_checked(monkeypatch):
    def unexpected(decoder):
        raise AssertionError("a record's loop was checked")

    monkeypatch.setattr(inference, "decode_disagreement", unexpected)
    model, _ = FastModel.from_pretrained(
        str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False
    )
    model = model.to(DEVICE)
    _switch_on(model)
    assert state_of(model).fast_decoder is not None


def _with_relative_noise(logits: torch.Tensor, size: float, seed: int) -> torch.Tensor:
    """``logits`` with Gaussian noise whose norm is about ``size`` times each row's norm."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(logits.shape, generator=generator).to(logits.device, logits.dtype)
    return logits + size * logits.norm(dim=-1, keepdim=True) * noise / logits.shape[-1] ** 0.5


@torch.no_grad()
def test_the_models_own_cached_decode_is_its_forward():
    """The model decoding through its own cache gives its forward's logits (fp32)."""
    model = _gemma4().eval()
    prompt, total = decode_check.PROMPT_TOKENS, decode_check.PROMPT_TOKENS + decode_check.STEPS + 1
    ids = torch.randint(3, 500, (1, total), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    own = decode_check._logits_of_own_decode(model, ids)
    forward = model(input_ids=ids, use_cache=False).logits.float()[0, prompt - 1 : -1]
    assert own is not None and own.shape == forward.shape == (total - prompt, forward.shape[-1])
    assert decode_check.largest_difference(list(own), list(forward)) < 1e-5


def test_the_bound_is_the_dtypes_rounding_or_the_models_own_decodes():
    bf16 = decode_check.relative_tolerance(torch.bfloat16)
    assert decode_check.allowed_difference(torch.bfloat16, None) == bf16
    assert decode_check.allowed_difference(torch.bfloat16, bf16 / 10) == bf16
    assert decode_check.allowed_difference(torch.bfloat16, 0.08) == pytest.approx(0.24)
    assert decode_check.allowed_difference(torch.bfloat16, 1.0) == decode_check.CHECK_LIMIT
    assert decode_check.allowed_difference(torch.float32, float("nan")) == decode_check.relative_tolerance(
        torch.float32
    )


@pytest.mark.parametrize(("loop_noise", "switched_on"), [(2e-3, True), (0.5, False)])
def test_a_model_whose_own_decode_rounds_far_allows_its_loop_as_much(monkeypatch, loop_noise, switched_on):
    """A model that moves 1e-3 from its forward when it decodes through its own cache (as a
    deep random bf16 model moves 0.08): a loop as far is switched on, one at 0.5 is not,
    and the notice names both distances."""
    model = _gemma4()
    own_decode = decode_check._logits_of_own_decode
    monkeypatch.setattr(
        decode_check,
        "_logits_of_own_decode",
        lambda causal_lm, ids: _with_relative_noise(own_decode(causal_lm, ids), 1e-3, seed=2),
    )
    step_class = inference.step_class_for(model.config)
    real_call = step_class.__call__

    def rounding_far(self, input_ids, *args, **kwargs):
        return _with_relative_noise(real_call(self, input_ids, *args, **kwargs), loop_noise, seed=3)

    monkeypatch.setattr(step_class, "__call__", rounding_far)
    notices = [n for n in _switch_on(model) if "fast generation is off" in n]
    assert (state_of(model).fast_decoder is not None) == switched_on
    if switched_on:
        assert not notices
    else:
        assert len(notices) == 1 and "its own cached decode differs by 0.001" in notices[0], notices
