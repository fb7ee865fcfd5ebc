# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # gpt-oss (20B) fine-tuning, reasoning effort and harmony chat (Unsloth's
# "gpt-oss-(20B)-Fine-tuning" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.chat_templates` ->
#   `slothkit.chat_templates`, `trl` -> `slothkit.trl`;
# - the model and the data are local: the tiny offline gpt-oss (its tokenizer holds
#   harmony's tokens and chat template, as gpt-oss-20b's does), or `MODEL` when the caller
#   gives one, and the first 120 conversations of slothkit's example chat data (a
#   `messages` column, as HuggingFaceH4/Multilingual-Thinking has) for the Hub dataset;
#   `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below);
# - the reload and merged 16-bit cells behind `if False:` run (users flip them); the
#   `save_method="mxfp4"` cell and the Hub pushes stay off (no MXFP4 writer in slothkit; no
#   network).

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

# The tiny gpt-oss stands in for "unsloth/gpt-oss-20b".
MODEL = globals().get("MODEL") or str(tiny_generic_model_path("gpt_oss"))
ON_GPU = torch.cuda.is_available()

max_seq_length = 1024
dtype = None

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=MODEL,
    dtype=dtype,
    max_seq_length=max_seq_length,
    load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    full_finetuning=False,
)

# %%
model = FastLanguageModel.get_peft_model(
    model,
    r=8,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha=16,
    lora_dropout=0,
    bias="none",
    use_gradient_checkpointing="unsloth",
    random_state=3407,
    use_rslora=False,
    loftq_config=None,
)

# %% Reasoning effort: low, medium, high (the notebook: one cell each)
from transformers import TextStreamer

for reasoning_effort in ("low", "medium", "high"):
    messages = [{"role": "user", "content": "Solve x^5 + 3x^4 - 10 = 3."}]
    inputs = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        reasoning_effort=reasoning_effort,
    ).to(model.device)  # the notebook writes .to("cuda")
    _ = model.generate(**inputs, max_new_tokens=64, streamer=TextStreamer(tokenizer))


# %% Data
def formatting_prompts_func(examples):
    convos = examples["messages"]
    texts = [
        tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=False) for convo in convos
    ]
    return {"text": texts}


from slothkit.data import example_dataset

# Local stand-in for load_dataset("HuggingFaceH4/Multilingual-Thinking", split="train").
dataset = example_dataset("chat").select(range(120))
print(dataset)

# %%
from slothkit.chat_templates import standardize_sharegpt

dataset = standardize_sharegpt(dataset)
dataset = dataset.map(formatting_prompts_func, batched=True)

# %%
print(dataset[0]["text"])

# %% Train
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    args=SFTConfig(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,  # the notebook: 30
        learning_rate=2e-4,
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.001,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir="outputs",
        report_to="none",
    ),
)

# %% Learn the final answers alone
from slothkit.chat_templates import train_on_responses_only

gpt_oss_kwargs = dict(
    instruction_part="<|start|>user<|message|>", response_part="<|start|>assistant<|channel|>final<|message|>"
)

trainer = train_on_responses_only(
    trainer,
    **gpt_oss_kwargs,
)

# %%
tokenizer.decode(trainer.train_dataset[100]["input_ids"])

# %%
tokenizer.decode(
    [tokenizer.pad_token_id if x == -100 else x for x in trainer.train_dataset[100]["labels"]]
).replace(tokenizer.pad_token, " ")

# %% GPU memory before training (no CUDA device to report on the CPU runner)
if ON_GPU:
    gpu_stats = torch.cuda.get_device_properties(0)
    start_gpu_memory = round(torch.cuda.max_memory_reserved() / 1024 / 1024 / 1024, 3)
    max_memory = round(gpu_stats.total_memory / 1024 / 1024 / 1024, 3)
    print(f"GPU = {gpu_stats.name}. Max memory = {max_memory} GB.")
    print(f"{start_gpu_memory} GB of memory reserved.")

# %%
trainer_stats = trainer.train()

# %% Final memory and time
if ON_GPU:
    used_memory = round(torch.cuda.max_memory_reserved() / 1024 / 1024 / 1024, 3)
    used_memory_for_lora = round(used_memory - start_gpu_memory, 3)
    print(f"Peak reserved memory = {used_memory} GB.")
    print(f"Peak reserved memory for training = {used_memory_for_lora} GB.")
print(f"{trainer_stats.metrics['train_runtime']} seconds used for training.")

# %% Inference
messages = [
    {
        "role": "system",
        "content": "reasoning language: French\n\nYou are a helpful assistant that can solve mathematical problems.",
    },
    {"role": "user", "content": "Solve x^5 + 3x^4 - 10 = 3."},
]
inputs = tokenizer.apply_chat_template(
    messages,
    add_generation_prompt=True,
    return_tensors="pt",
    return_dict=True,
    reasoning_effort="medium",
).to(model.device)  # the notebook writes .to("cuda")
from transformers import TextStreamer

_ = model.generate(**inputs, max_new_tokens=64, streamer=TextStreamer(tokenizer))

# %% Save the LoRA adapter
model.save_pretrained("gpt_oss_lora")

# %% Reload it (the notebook: behind `if False:`)
if True:
    from slothkit import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="gpt_oss_lora",
        max_seq_length=1024,
        dtype=None,
        load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    )

messages = [
    {
        "role": "system",
        "content": "reasoning language: French\n\nYou are a helpful assistant that can solve mathematical problems.",
    },
    {"role": "user", "content": "Solve x^5 + 3x^4 - 10 = 3."},
]
inputs = tokenizer.apply_chat_template(
    messages,
    add_generation_prompt=True,
    return_tensors="pt",
    return_dict=True,
    reasoning_effort="high",
).to(model.device)  # the notebook writes .to("cuda")
from transformers import TextStreamer

_ = model.generate(**inputs, max_new_tokens=64, streamer=TextStreamer(tokenizer))

# %% Merged saves: MXFP4 stays off (see above); 16-bit (the notebook: behind `if False:`)
if True:
    model.save_pretrained_merged("gpt_oss_finetune_16bit", tokenizer, save_method="merged_16bit")
