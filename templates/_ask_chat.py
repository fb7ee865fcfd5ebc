# %% Ask it: a message through the chat template, then generate, streamed as it comes
from transformers import TextStreamer


def ask(message, max_new_tokens=48):
    """The model's greedy reply to one user message, printed token by token."""
    messages = [{"role": "user", "content": message}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(model.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    print(f">>> {message}")
    output = model.generate(**inputs, streamer=streamer, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
