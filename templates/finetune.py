# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fine-tune ${display_name} with slothkit
#
# LoRA (or QLoRA, on 4-bit weights) fine-tuning on instruction data in the Alpaca
# format, then a few test prompts, then saving: the LoRA adapter, a merged 16-bit
# model, and GGUF files for llama.cpp / Ollama / LM Studio, optionally pushed to the
# Hugging Face Hub.
#
# ${gpu_fit}
#
# Run the cells top to bottom. Change settings in the **Config** cell (a form on
# Colab, a panel in Jupyter and Kaggle).

# %include install

# %% Config
MODEL_NAME = "${model_4bit}"  # @param {type:"string"}
LOAD_IN_4BIT = True  # @param {type:"boolean"}
MAX_SEQ_LENGTH = ${max_seq_length}  # @param {type:"integer"}
LORA_R = 16  # @param {type:"integer"}
LORA_ALPHA = 16  # @param {type:"integer"}
LEARNING_RATE = 2e-4  # @param {type:"number"}
MAX_STEPS = 60  # @param {type:"integer"}
BATCH_SIZE = ${t4_batch}  # @param {type:"integer"}
GRAD_ACCUM = ${t4_grad_accum}  # @param {type:"integer"}
DATASET = "example:alpaca"  # @param {type:"string"}
SAVE_LORA = True  # @param {type:"boolean"}
SAVE_MERGED = True  # @param {type:"boolean"}
SAVE_GGUF = ${save_gguf}  # @param {type:"boolean"}
GGUF_QUANTS = "q4_k_m,q8_0"  # @param {type:"string"}
OUTPUT_DIR = "outputs"  # @param {type:"string"}
HUB_REPO = ""  # @param {type:"string"}

from slothkit.notebook import NotebookConfig

config = NotebookConfig.from_cell(globals())
config.show()

# %include hardware

# %% Load the model and add LoRA adapters
from slothkit import FastModel

model, tokenizer = FastModel.from_pretrained(
    config.model_name, max_seq_length=config.max_seq_length, load_in_4bit=config.load_in_4bit
)
model = FastModel.get_peft_model(
    model,
    r=config.lora_r,
    lora_alpha=config.lora_alpha,
    target_modules="${lora_targets}".split(","),
    use_gradient_checkpointing="auto",  # keep the layers that fit in GPU memory, offload the rest
    batch_size=config.batch_size,
)

# %% Ask it: an Alpaca prompt, then generate, streamed as it comes
from transformers import TextStreamer

from slothkit.data import alpaca_prompt


def ask(instruction, max_new_tokens=48):
    """The model's greedy answer to one instruction, printed token by token."""
    inputs = tokenizer(alpaca_prompt(instruction), return_tensors="pt").to(model.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    print(f">>> {instruction}")
    output = model.generate(**inputs, streamer=streamer, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# %% How it answers before training
# A few steps teach a small model the answers' form (one sentence, then stop), not facts
# it lacks: questions it can answer show the change without a wrong fact in the "after".
TEST_PROMPTS = ["What is 12 plus 30?", "What is the capital of France?"]
FastModel.for_inference(model)  # eval mode with the KV cache (on a GPU, slothkit's fast decode loop)
before = {prompt: ask(prompt) for prompt in TEST_PROMPTS}
FastModel.for_training(model)  # back to training mode before the trainer takes it

# %% Data: instruction / input / response records, formatted as Alpaca prompts ending in EOS
from slothkit.data import format_alpaca
from slothkit.notebook.training import load_configured_dataset

dataset = format_alpaca(load_configured_dataset(config.dataset), tokenizer)
print(dataset)
print(dataset[0]["text"])

# %% Train
from slothkit.notebook.training import trainer_defaults
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    processing_class=tokenizer,
    train_dataset=dataset,
    args=SFTConfig(
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        max_length=config.max_seq_length,
        dataset_text_field="text",
        packing=False,
        warmup_steps=5,
        lr_scheduler_type="linear",
        weight_decay=0.01,
        logging_steps=1,
        seed=3407,
        output_dir=f"{config.output_dir}/checkpoints",
        save_strategy="no",
        report_to="none",
        **trainer_defaults(model),  # bf16 / fp16, optim, ...: chosen for this machine, and printed
    ),
)

# %%
from slothkit.notebook.training import report_training

trainer_stats = trainer.train()
result = report_training(trainer, trainer_stats)
assert result.loss_went_down, f"the loss did not go down: {result.losses}"

# %include try_it

# %include save
