"""Every save of a model whose tokenizer gained tokens carries the grown embeddings and head.

``get_chat_template(tokenizer, "llama-3.1", add_missing_tokens=True)`` on
SmolLM2-135M-Instruct adds Llama 3's three turn tokens (ids 49152 to 49154) and grows the
embeddings and the tied head from 49,152 to 49,155 rows.  The adapter folder (PEFT saves
the resized embedding whole), the merged 16-bit model and the GGUF file must each hold
those rows, and give the trained model's logits on a prompt that uses the new tokens;
llama.cpp reads the added tokens whole from the chat-formatted prompt.
"""

import warnings

import pytest
import torch

pytestmark = pytest.mark.slow

ADDED = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _assert_close(actual, expected, rounded_to_16_bits=False):
    # fp32 on the CPU: the same weights by another route agree to rounding, which grows with
    # the logits' size; weights rounded to 16 bits to a few hundredths of the largest logit.
    largest = max(1.0, expected.abs().max().item())
    tolerance = (3e-2 if rounded_to_16_bits else 1e-5) * largest
    assert (actual - expected).abs().max().item() <= tolerance


def test_every_save_carries_the_rows_of_added_tokens(smollm2_path, tmp_path, monkeypatch):
    from gguf import GGUFReader
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from slothkit import FastModel
    from slothkit.data import get_chat_template

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embeddings-grew notice
        model, tokenizer = FastModel.from_pretrained(
            str(smollm2_path), load_in_4bit=False, dtype=torch.float32
        )
        get_chat_template(tokenizer, "llama-3.1", add_missing_tokens=True)  # grows the model loaded with it
        model = FastModel.get_peft_model(
            model, r=8, lora_alpha=16, target_modules=PROJECTIONS, use_gradient_checkpointing=False
        )
    assert tokenizer.convert_tokens_to_ids(ADDED) == [49152, 49153, 49154] and len(tokenizer) == 49155
    assert tokenizer.eos_token == "<|eot_id|>"
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # PEFT starts every lora_B at zero: give the adapters an effect
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        # The new rows start as the mean of the others; make them differ, as training would.
        new_rows = model.get_input_embeddings().weight[49152:]
        new_rows += torch.randn(new_rows.shape, generator=generator) * 0.05
    FastModel.for_inference(model)
    conversation = [{"role": "user", "content": "What is 7 times 6?"}]
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == 49152 and (ids == 49154).sum() == 1  # the template's tokens, whole
    expected = _logits(model, ids)

    # The adapter: PEFT saves the resized embedding (the tied head with it).
    model.save_pretrained("lora")
    tokenizer.save_pretrained("lora")
    with safe_open("lora/adapter_model.safetensors", "pt") as adapter:
        rows = {
            name: adapter.get_slice(name).get_shape()[0] for name in adapter.keys() if "lora_" not in name
        }
    assert rows and set(rows.values()) == {49155}, rows
    print(
        f"\nadapter with the added rows: {(tmp_path / 'lora/adapter_model.safetensors').stat().st_size / 2**20:.1f} MiB"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded, reloaded_tokenizer = FastModel.from_pretrained(
            "lora", load_in_4bit=False, dtype=torch.float32
        )
    assert len(reloaded_tokenizer) == 49155 and reloaded_tokenizer.eos_token == "<|eot_id|>"
    _assert_close(_logits(reloaded.eval(), ids), expected)
    del reloaded

    # The merged 16-bit model: embeddings and tied head of 49,155 rows.
    model.save_pretrained_merged("merged", tokenizer, save_method="merged_16bit")
    merged = AutoModelForCausalLM.from_pretrained("merged").float().eval()
    assert merged.get_input_embeddings().weight.shape[0] == 49155
    assert merged.get_output_embeddings().weight.shape[0] == 49155
    _assert_close(_logits(merged, ids), expected, rounded_to_16_bits=True)

    # The GGUF file: 49,155 tokens, the added ones by name; llama.cpp tokenises the chat
    # prompt with them whole (verify_gguf checks its tokens against Hugging Face's) and
    # continues it as the model does.
    pytest.importorskip("llama_cpp", reason="llama-cpp-python runs the GGUF file")
    from slothkit.export.gguf import verify_gguf

    model.save_pretrained_gguf("gguf", tokenizer, quantization_method="f16")
    (path,) = (tmp_path / "gguf").glob("*.F16.gguf")
    tokens = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 49155
    assert [bytes(tokens.parts[tokens.data[i]]).decode() for i in (49152, 49153, 49154)] == ADDED
    report = verify_gguf(path, model, tokenizer, "f16", prompts=(prompt,), greedy_tokens=8)
    assert report.greedy_tokens == 8 and report.greedy_exact >= 6, report
