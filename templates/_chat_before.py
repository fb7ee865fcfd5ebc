# %% How it answers before training
TEST_PROMPTS = ["Convert 3 kilometres to metres.", "What is the capital of France?"]
FastModel.for_inference(model)  # eval mode with the KV cache (on a GPU, slothkit's fast decode loop)
before = {prompt: ask(prompt) for prompt in TEST_PROMPTS}
FastModel.for_training(model)  # back to training mode before the trainer takes it
