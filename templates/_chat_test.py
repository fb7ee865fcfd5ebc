# %% Chat with it (streamed)
from slothkit.notebook.inference import generate_chat

FastModel.for_inference(model)
for message in ["Convert 3 kilometres to metres.", "What is the capital of France?"]:
    generate_chat(model, tokenizer, message, max_new_tokens=48)
