# %% Try it: the same prompts after training
from slothkit.notebook.inference import compare_answers

FastModel.for_inference(model)
after = {prompt: ask(prompt) for prompt in TEST_PROMPTS}  # ask your own: ask("...")
compare_answers(before, after)
