# %% How it answers before training
from slothkit.notebook.inference import answer_prompts

TEST_PROMPTS = ["Convert 3 kilometres to metres.", "What is the capital of France?"]
before = answer_prompts(model, tokenizer, TEST_PROMPTS, kind="chat")
