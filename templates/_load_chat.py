# %% Load the model, set its chat template, add LoRA adapters
from slothkit import FastModel
from slothkit.data import get_chat_template

model, tokenizer = FastModel.from_pretrained(
    config.model_name, max_seq_length=config.max_seq_length, load_in_4bit=config.load_in_4bit
)
tokenizer = get_chat_template(tokenizer, config.chat_template, model=model)
model = FastModel.get_peft_model(
    model,
    r=config.lora_r,
    lora_alpha=config.lora_alpha,
    target_modules="${lora_targets}".split(","),
    use_gradient_checkpointing="auto",  # keep the layers that fit in GPU memory, offload the rest
    batch_size=config.batch_size,
)
