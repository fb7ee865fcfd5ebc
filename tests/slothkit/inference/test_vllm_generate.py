"""model.fast_generate, save_lora and load_lora (vLLM's calls, slothkit.inference.vllm_generate)
against the model's own generate on tiny models with random adapters."""

import contextlib

import pytest
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path
from slothkit.vllm import LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _randomise_adapters(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


@pytest.fixture(scope="module")
def llama():
    model, tokenizer = FastLanguageModel.from_pretrained(
        str(tiny_model_path("llama")), max_seq_length=256, load_in_4bit=False
    )
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, random_state=0)
    _randomise_adapters(model, 0)
    return model, tokenizer


def _reference(model, tokenizer, text, max_new_tokens=12, adapters=True):
    """Greedy tokens of the model's own generate, with or without its adapters."""
    bos = tokenizer.bos_token
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not (bos and text.startswith(bos)))
    was_training = model.training
    model.eval()
    with torch.no_grad(), contextlib.nullcontext() if adapters else model.disable_adapter():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    model.train(was_training)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def _until_end(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_batch_matches_each_prompt_alone_with_and_without_the_adapter(llama, tmp_path):
    model, tokenizer = llama
    prompts = ["The sloth climbs", "A", "Slow and steady wins the race, said the"]
    eos = tokenizer.eos_token_id
    base = model.fast_generate(prompts, sampling_params=GREEDY, lora_request=None)
    model.save_lora(tmp_path / "adapter")
    tuned = model.fast_generate(prompts, GREEDY, lora_request=model.load_lora(tmp_path / "adapter"))
    for prompt, without, with_ in zip(prompts, base, tuned):
        assert without.prompt == prompt
        assert without.prompt_token_ids == tokenizer(prompt)["input_ids"]
        assert without.outputs[0].token_ids == _until_end(
            _reference(model, tokenizer, prompt, adapters=False), eos
        )
        assert with_.outputs[0].token_ids == _until_end(_reference(model, tokenizer, prompt), eos)
        assert with_.outputs[0].text == tokenizer.decode(
            [t for t in with_.outputs[0].token_ids if t != eos], skip_special_tokens=True
        )
    # The adapter changes the output (else the two checks above prove nothing).
    assert [r.outputs[0].token_ids for r in base] != [r.outputs[0].token_ids for r in tuned]
    assert model.training  # get_peft_model left it training; fast_generate put it back


def test_a_loaded_adapter_decodes_and_the_models_own_comes_back(llama, tmp_path):
    model, tokenizer = llama
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    model.save_lora(tmp_path / "saved")
    saved_output = model.fast_generate(text, GREEDY)  # base model: lora_request=None
    request = model.load_lora(tmp_path / "saved")
    expected = _reference(model, tokenizer, text)
    own = {name: param for name, param in model.named_parameters() if "lora_" in name}
    _randomise_adapters(model, 1)  # the model moves on; the saved adapter stays as saved
    moved = {name: param.detach().clone() for name, param in own.items()}
    result = model.fast_generate(text, GREEDY, lora_request=request)[0]
    assert result.outputs[0].token_ids == _until_end(expected, tokenizer.eos_token_id)
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert param is own[name] and torch.equal(param, moved[name])
    # The chat template wrote the BOS: it is not doubled.
    assert result.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    assert saved_output[0].prompt_token_ids == result.prompt_token_ids
    # A request made by hand reads the folder when used.
    by_hand = LoRARequest("saved", 7, str(tmp_path / "saved"))
    assert model.fast_generate(text, GREEDY, lora_request=by_hand)[0].outputs == result.outputs


def test_seeded_samples_repeat_and_leave_the_callers_generator_alone(llama):
    model, _ = llama
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=-1, min_p=0.05, max_tokens=10, seed=3407, n=3)
    torch.manual_seed(5)
    first = model.fast_generate(["The sloth", "Hello"], params)
    after_call = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(4), after_call)
    second = model.fast_generate(["The sloth", "Hello"], params)
    assert [[c.token_ids for c in r.outputs] for r in first] == [
        [c.token_ids for c in r.outputs] for r in second
    ]
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    # Three samples of one prompt differ (a sampler that ignored temperature would repeat).
    assert len({tuple(c.token_ids) for c in first[0].outputs}) > 1


def test_stops_lengths_and_finish_reasons(llama):
    model, tokenizer = llama
    prompt = "The sloth climbs"
    greedy = _reference(model, tokenizer, prompt, max_new_tokens=12, adapters=False)
    stop_token = greedy[3]
    out = model.fast_generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token])
    )
    completion = out[0].outputs[0]
    assert completion.token_ids == greedy[: greedy.index(stop_token) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)
    assert model.fast_generate(prompt, GREEDY)[0].outputs[0].finish_reason == "length"
    # A stop string of several tokens cuts the text where it first appears.
    full_text = tokenizer.decode(greedy, skip_special_tokens=True)
    stop = full_text[len(full_text) // 3 : len(full_text) // 3 + 3]
    assert len(tokenizer(stop, add_special_tokens=False)["input_ids"]) > 1
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=include)
        completion = model.fast_generate(prompt, params)[0].outputs[0]
        cut = full_text.index(stop) + (len(stop) if include else 0)
        assert completion.text == full_text[:cut]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        assert tokenizer.decode(completion.token_ids, skip_special_tokens=True).startswith(completion.text)
    # max_tokens is vLLM's default of 16 when not given.
    assert len(model.fast_generate(prompt, SamplingParams(temperature=0))[0].outputs[0].token_ids) <= 16


def test_prompt_forms_and_the_model_default_settings(llama):
    model, tokenizer = llama
    ids = tokenizer("The sloth")["input_ids"]
    as_text = model.fast_generate({"prompt": "The sloth"}, GREEDY)[0]
    as_ids = model.fast_generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert as_text.outputs == as_ids.outputs and as_ids.prompt is None
    assert model.fast_generate("The sloth", [GREEDY])[0].outputs == as_text.outputs
    truncated = model.fast_generate("The sloth", SamplingParams(temperature=0, truncate_prompt_tokens=1))[0]
    assert truncated.prompt_token_ids == ids[-1:]


def test_refusals_are_one_line(llama, tmp_path):
    model, _ = llama
    with pytest.raises(TypeError, match="unexpected keyword"):
        SamplingParams(temprature=0.5)
    with pytest.raises(
        ValueError, match="presence_penalty=...\\): slothkit's fast_generate does not implement"
    ):
        SamplingParams(presence_penalty=0.5)
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\]"):
        SamplingParams(top_p=0)
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        model.load_lora(tmp_path)
    with pytest.raises(TypeError, match="takes prompts, sampling_params, lora_request and use_tqdm"):
        model.fast_generate("x", GREEDY, prompt_token_ids=[1])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        model.fast_generate("x", [GREEDY, GREEDY])
    other, _ = FastLanguageModel.from_pretrained(str(tiny_model_path("llama")), load_in_4bit=False)
    other = FastLanguageModel.get_peft_model(other, r=4, lora_alpha=16)
    other.save_lora(tmp_path / "rank4")
    with pytest.raises(ValueError, match="has r=4, this model's r=8"):
        model.load_lora(tmp_path / "rank4")
    weights = tmp_path / "rank4" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short: safetensors named no file
    with pytest.raises(
        ValueError, match="rank4/adapter_model.safetensors' is not a complete safetensors file"
    ):
        model.load_lora(tmp_path / "rank4")


def test_a_model_without_adapters_generates_and_refuses_a_lora_request(tmp_path):
    model, tokenizer = FastLanguageModel.from_pretrained(str(tiny_model_path("qwen3")), load_in_4bit=False)
    assert not hasattr(model, "save_lora")
    out = model.fast_generate(["Hello there"], GREEDY)[0].outputs[0]
    assert out.token_ids == _until_end(_reference(model, tokenizer, "Hello there"), tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="needs a model with LoRA adapters"):
        model.fast_generate("Hello", GREEDY, lora_request=LoRARequest("x", 1, str(tmp_path)))


def test_the_fast_decode_loop_decodes_what_generate_does(llama, tmp_path, monkeypatch):
    """After for_inference(fast_decode=True) (a GPU's default) fast_generate runs slothkit's
    decode loop: switching the adapters off and swapping a saved adapter in reach it too."""
    from slothkit.inference.fast_decoder import FastDecoder

    model, tokenizer = llama
    prompts = ["The sloth climbs", "A", "Slow and steady wins the race, said the"]
    model.save_lora(tmp_path / "adapter")
    request = model.load_lora(tmp_path / "adapter")
    _randomise_adapters(model, 2)  # the model's own adapter now differs from the saved one

    def outputs():
        """Base model, the saved adapter, then the model's own adapter (put back) through
        its generate."""
        decoded = [
            [r.outputs[0].token_ids for r in model.fast_generate(prompts, GREEDY, lora_request=lora)]
            for lora in (None, request)
        ]
        return [*decoded, [_reference(model, tokenizer, prompt) for prompt in prompts]]

    expected = outputs()  # Hugging Face's generate (a CPU's default)
    calls = []
    loop = FastDecoder.generate
    monkeypatch.setattr(FastDecoder, "generate", lambda self, *a, **k: calls.append(1) or loop(self, *a, **k))
    FastLanguageModel.for_inference(model, fast_decode=True)
    try:
        assert outputs() == expected and len(calls) == 2 + len(prompts)
    finally:
        FastLanguageModel.for_training(model)
    assert expected[0] != expected[1]
    assert [_until_end(own, tokenizer.eos_token_id) for own in expected[2]] != expected[1]
