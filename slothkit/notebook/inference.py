"""The notebook's inference cells: streamed generation from a prompt, and the model's
answers to a few test prompts before and after training, side by side."""

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


def answer_prompts(
    model, tokenizer, prompts: list[str], kind: str = "alpaca", max_new_tokens: int = 48
) -> dict:
    """Stream the model's greedy answer to each prompt under the prompt, and return them.

    The model is switched to inference (FastModel.for_inference) for this and back to
    training afterwards when it was training, so the cell can sit before the training cell.

    Args:
        model: the model (a FastModel model, optionally with LoRA adapters).
        tokenizer: its tokenizer.
        prompts: the instructions (kind "alpaca") or user messages (kind "chat").
        kind: "alpaca" (an Alpaca prompt) or "chat" (the tokenizer's chat template).
        max_new_tokens: the longest answer (default 48 tokens).

    Returns:
        {prompt: answer}.
    """
    from slothkit import FastModel

    generate = {"alpaca": generate_alpaca, "chat": generate_chat}.get(kind)
    if generate is None:
        raise ValueError(f"kind={kind!r}; accepted: 'alpaca', 'chat'")
    was_training = model.training
    FastModel.for_inference(model)
    answers = {}
    try:
        for prompt in prompts:
            print(f">>> {prompt}")
            answers[prompt] = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens)
    finally:
        if was_training:
            FastModel.for_training(model)
    return answers


def compare_answers(before: dict, after: dict, width: int = 100) -> None:
    """Print each prompt with its answer before and after training, one line each (line
    breaks shown as " / ", long answers cut at `width` characters)."""

    def one_line(text: str) -> str:
        text = " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())
        return text if len(text) <= width else text[: width - 3] + "..."

    for prompt, answer in after.items():
        print(prompt)
        print(f"  before: {one_line(before.get(prompt, '(not asked)'))}")
        print(f"  after:  {one_line(answer)}")
