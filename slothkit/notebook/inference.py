"""The notebook's inference cell: streamed generation from a prompt."""

from __future__ import annotations

import torch


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, stream: bool = True) -> str:
    """Greedy generation, printed token by token as it comes; returns the new text."""
    from transformers import TextStreamer

    inputs = tokenizer(
        prompt, return_tensors="pt", add_special_tokens=not _starts_with_bos(tokenizer, prompt)
    )
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            streamer=streamer,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def generate_alpaca(model, tokenizer, instruction: str, input: str = "", **kwargs) -> str:
    from slothkit.data import alpaca_prompt

    return generate_text(model, tokenizer, alpaca_prompt(instruction, input), **kwargs)


def generate_chat(model, tokenizer, message: str, **kwargs) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    return generate_text(model, tokenizer, prompt, **kwargs)


def _starts_with_bos(tokenizer, text: str) -> bool:
    bos = tokenizer.bos_token
    return bool(bos) and text.startswith(bos)
