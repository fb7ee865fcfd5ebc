# %% Chat with it: the same messages after training
from slothkit.notebook.inference import compare_answers

# Ask your own the same way: answer_prompts(model, tokenizer, ["..."], kind="chat")
after = answer_prompts(model, tokenizer, TEST_PROMPTS, kind="chat")
compare_answers(before, after)
