"""The decode step in bf16 on real checkpoints stays within Hugging Face's own bf16 noise:
teacher-forced over a real paragraph (the prefill, then one token a step), its logits'
error against the same weights computed in fp32 is no larger than the larger of Hugging
Face's two bf16 forwards' (SDPA and eager attention round differently), in the prefill
and in the steps alike, and its top-1 agrees with fp32's about as often.
SmolLM2-135M-Instruct (Llama's layer) and Gemma 3 270M past its 512-token window
(sandwich layers, q/k norms, the local layers in rings), each with random LoRA adapters
(B nonzero), on the CPU."""

import pytest
import torch

from slothkit import FastModel
from slothkit.testing import CORPUS

# (prompt tokens, decode steps): Gemma 3's prompt passes its window, so the steps read rings.
LENGTHS = {"smollm2": (200, 32), "gemma3": (520, 32)}


def _errors(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(mean absolute error, fraction of positions whose top-1 token equals the reference's)."""
    error = (logits.float() - reference).abs().mean().item()
    return error, (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()


def _fast_logits(model, ids: torch.Tensor, prompt: int, expect_rings: bool) -> torch.Tensor:
    """The prefill's logits of ``prompt`` tokens, then one step's per later token."""
    from slothkit.inference.fast_decoder import FastDecoder
    from slothkit.models import architecture_for

    causal_lm = model.get_base_model()
    decoder = FastDecoder(causal_lm, architecture_for(causal_lm.config).embedding_scale, use_graph=False)
    decoder._prepare(1, 1024, ids.device)
    decoder.cache.reset(torch.ones_like(ids[:, :prompt]))
    assert any(ring is not None and ring < prompt for ring in decoder.cache.rings) == expect_rings
    first = torch.zeros(1, dtype=torch.long)
    positions = torch.arange(ids.shape[1])[None]
    prefill = decoder.step(
        ids[:, :prompt],
        positions[:, :prompt],
        decoder.cache,
        first,
        last_only=False,
        visible=prompt,
        causal=True,
    )
    logits = [prefill[0]]
    for offset in range(prompt, ids.shape[1] - 1):
        logits.append(decoder.captured(ids[:, offset], positions[:, offset], offset))
    return torch.cat(logits)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["smollm2", "gemma3"])
def test_bf16_decode_error_is_within_hf_bf16_noise(checkpoint, request):
    path = request.getfixturevalue(f"{checkpoint}_path")
    model, tokenizer = FastModel.from_pretrained(
        str(path), dtype=torch.float32, load_in_4bit=False, fused=False
    )
    model = FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
    model.eval()
    prompt, steps = LENGTHS[checkpoint]
    ids = tokenizer(CORPUS, return_tensors="pt")["input_ids"][:, : prompt + steps]
    with torch.no_grad():
        # The reference is the bf16 model's own weights computed in fp32: only the
        # arithmetic's rounding differs between it and the bf16 paths.
        reference = model.to(torch.bfloat16).to(torch.float32)(input_ids=ids).logits[0, :-1]
        model.to(torch.bfloat16)
        hf = {}
        for attention in ("sdpa", "eager"):
            model.get_base_model().set_attn_implementation(attention)
            hf[attention] = model(input_ids=ids).logits[0, :-1].float()
        model.get_base_model().set_attn_implementation("sdpa")
        fast = _fast_logits(model, ids, prompt, expect_rings=checkpoint == "gemma3")

    for part, rows in (("prefill", slice(0, prompt)), ("steps", slice(prompt, None))):
        noise = max(_errors(logits[rows], reference[rows])[0] for logits in hf.values())
        assert noise > 0, "the bf16 model computed in fp32"
        error = _errors(fast[rows], reference[rows])[0]
        assert error <= 1.1 * noise, f"{part}: fast {error:.4f} against HF bf16's up to {noise:.4f}"
    top1 = min(_errors(logits, reference)[1] for logits in hf.values())
    fast_top1 = _errors(fast, reference)[1]
    assert fast_top1 >= top1 - 0.03, f"top-1 equal to fp32: fast {fast_top1:.3f}, HF bf16 {top1:.3f}"
