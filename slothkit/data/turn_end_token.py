"""The token a chat template writes after an assistant's reply: what a fine-tuned model ends
its answers with, and so where generation must stop (slothkit.export.generation_config)
and the turn end an Ollama Modelfile writes (slothkit.data.ollama_templates). Found by
rendering a one-turn conversation and reading the first special token after the reply."""

from __future__ import annotations

_PROBE_ANSWER = "slothkit probe answer"


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special token that closes an assistant turn in the tokenizer's chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _PROBE_ANSWER}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # templates may reject this conversation shape; then nothing to learn
        return None
    if not isinstance(text, str) or _PROBE_ANSWER not in text:
        return None
    after = text[text.rindex(_PROBE_ANSWER) + len(_PROBE_ANSWER) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", []))
    for token_id in ids:
        if token_id in special:
            return int(token_id)
    return None
