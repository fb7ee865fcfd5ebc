# %% How it answers before training
# A few steps teach a small model the answers' form (one sentence, then stop), not facts
# it lacks: questions it can answer show the change without a wrong fact in the "after".
TEST_PROMPTS = ["What is 12 plus 30?", "What is the capital of France?"]
FastModel.for_inference(model)  # eval mode with the KV cache (on a GPU, slothkit's fast decode loop)
before = {prompt: ask(prompt) for prompt in TEST_PROMPTS}
FastModel.for_training(model)  # back to training mode before the trainer takes it
