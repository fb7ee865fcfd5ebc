# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Llama-3 8B for Ollama (Unsloth's "Llama3 (8B) Ollama" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words: Alpaca columns merged into chat turns (to_sharegpt), a chat template
# written as a prompt with {INPUT} and {OUTPUT}, SFT, chat generation, and a GGUF with the
# Modelfile Ollama reads.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline Llama, or `MODEL` when the caller
#   gives one; a few Alpaca-GPT4 records in memory), and `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below);
# - the Ollama cells (installing it, `ollama serve`, `ollama create`, `curl`) are shell
#   commands for a machine with Ollama; the Modelfile they read is printed and checked.

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("llama"))  # stand-in for "unsloth/llama-3-8b-bnb-4bit"
ON_GPU = torch.cuda.is_available()

max_seq_length = 2048
dtype = None
load_in_4bit = ON_GPU  # the notebook: True; 16 bits on the CPU runner

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=MODEL,
    max_seq_length=max_seq_length,
    dtype=dtype,
    load_in_4bit=load_in_4bit,
)

# %%
model = FastLanguageModel.get_peft_model(
    model,
    r=16,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha=16,
    lora_dropout=0,
    bias="none",
    use_gradient_checkpointing="unsloth",
    random_state=3407,
    use_rslora=False,
    loftq_config=None,
)

# %% Data
from datasets import Dataset

# Local stand-in for load_dataset("vicgalle/alpaca-gpt4", split="train").
dataset = Dataset.from_list(
    [
        {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well, sleep, move.", "text": ""},
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "text": ""},
        {"instruction": "Name a primary colour.", "input": "", "output": "Red.", "text": ""},
        {"instruction": "Translate to French.", "input": "cat", "output": "chat", "text": ""},
        {"instruction": "Continue the sequence.", "input": "1, 1, 2, 3, 5, 8", "output": "13, 21, 34", "text": ""},
        {"instruction": "Say hello.", "input": "", "output": "Hello!", "text": ""},
    ]
)  # fmt: skip
print(dataset.column_names)

# %% Merge the columns into one instruction, and make multi-turn conversations
from slothkit import to_sharegpt

dataset = to_sharegpt(
    dataset,
    merged_prompt="{instruction}[[\nYour input is:\n{input}]]",
    output_column_name="output",
    conversation_extension=3,
)

# %%
from slothkit import standardize_sharegpt

dataset = standardize_sharegpt(dataset)

# %% The chat template, as a prompt with {INPUT} and {OUTPUT}
chat_template = """Below are some instructions that describe some tasks. Write responses that appropriately complete each request.

### Instruction:
{INPUT}

### Response:
{OUTPUT}"""

from slothkit import apply_chat_template

dataset = apply_chat_template(
    dataset,
    tokenizer=tokenizer,
    chat_template=chat_template,
)

# %% Train
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    dataset_text_field="text",
    max_seq_length=max_seq_length,
    packing=False,
    args=SFTConfig(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,  # the notebook: 60
        learning_rate=2e-4,
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir="outputs",
        report_to="none",
    ),
)

# %%
trainer_stats = trainer.train()

# %% Inference
FastLanguageModel.for_inference(model)
messages = [
    {"role": "user", "content": "Continue the fibonacci sequence! Your input is 1, 1, 2, 3, 5, 8,"},
]
input_ids = tokenizer.apply_chat_template(
    messages,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")

from transformers import TextStreamer

text_streamer = TextStreamer(tokenizer, skip_prompt=True)
_ = model.generate(input_ids, streamer=text_streamer, max_new_tokens=16, pad_token_id=tokenizer.eos_token_id)
first_answer = (input_ids, _)

# %% A longer conversation
FastLanguageModel.for_inference(model)
messages = [
    {"role": "user", "content": "Continue the fibonacci sequence! Your input is 1, 1, 2, 3, 5, 8"},
    {"role": "assistant", "content": "The fibonacci sequence continues as 13, 21, 34, 55 and 89."},
    {"role": "user", "content": "What is France's tallest tower called?"},
]
input_ids = tokenizer.apply_chat_template(
    messages,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")

text_streamer = TextStreamer(tokenizer, skip_prompt=True)
_ = model.generate(input_ids, streamer=text_streamer, max_new_tokens=16, pad_token_id=tokenizer.eos_token_id)

# %% Save the LoRA adapter
model.save_pretrained("lora_model")
tokenizer.save_pretrained("lora_model")

# %% GGUF (q8_0), as the notebook runs it
if True:
    model.save_pretrained_gguf("model", tokenizer)

# %% The Modelfile Ollama reads
print(tokenizer._ollama_modelfile)
