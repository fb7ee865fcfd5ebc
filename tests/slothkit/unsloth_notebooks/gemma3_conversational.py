# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Gemma 3 (4B), conversational SFT (Unsloth's "Gemma3 (4B)" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.chat_templates` ->
#   `slothkit.chat_templates`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline image-text Gemma 3, as
#   gemma-3-4b-it is one, or `MODEL` when the caller gives one; a few ShareGPT
#   conversations in memory, with FineTome's columns), and `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below);
# - the cells behind `if False:` that save locally run (users flip them); pushing to the
#   Hub stays off (no network).
#
# slothkit loads the checkpoint's text model alone (said once), so the notebook's
# `finetune_vision_layers=False` is what happens anyway.

# %%
import torch

from slothkit import FastModel
from slothkit.testing import tiny_image_text_gemma3_path

MODEL = globals().get("MODEL") or str(tiny_image_text_gemma3_path())  # stand-in for the Hub id
ON_GPU = torch.cuda.is_available()

model, tokenizer = FastModel.from_pretrained(
    model_name=MODEL,
    max_seq_length=2048,
    load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    load_in_8bit=False,
    full_finetuning=False,
)

# %%
model = FastModel.get_peft_model(
    model,
    finetune_vision_layers=False,
    finetune_language_layers=True,
    finetune_attention_modules=True,
    finetune_mlp_modules=True,
    r=8,
    lora_alpha=8,
    lora_dropout=0,
    bias="none",
    random_state=3407,
)

# %% Data: Gemma 3's chat format
from datasets import Dataset

from slothkit.chat_templates import get_chat_template

tokenizer = get_chat_template(tokenizer, chat_template="gemma-3")


def turns(*pairs):
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(pairs)]


# Local stand-in for load_dataset("mlabonne/FineTome-100k", split="train").
dataset = Dataset.from_list(
    [
        {"conversations": turns("Name a slow animal.", "The sloth.", "How slow?", "About 0.24 km per hour."),
         "source": "local", "score": 5.0},
        {"conversations": turns("What is 7 times 6?", "42."), "source": "local", "score": 5.0},
        {"conversations": turns("Spell cat.", "C, A, T."), "source": "local", "score": 4.5},
        {"conversations": turns("Say hi.", "Hi!"), "source": "local", "score": 4.0},
        {"conversations": turns("Name a primary colour.", "Red."), "source": "local", "score": 4.0},
        {"conversations": turns("What is 2 + 2?", "4."), "source": "local", "score": 5.0},
    ]
)  # fmt: skip

# %%
from slothkit.chat_templates import standardize_data_formats

dataset = standardize_data_formats(dataset)

# %%
dataset[5]


# %% The formatter drops the BOS the template writes: the trainer's tokenizer adds its own
def formatting_prompts_func(examples):
    convos = examples["conversations"]
    texts = [
        tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=False).removeprefix(
            tokenizer.bos_token  # the notebook writes '<bos>', Gemma's BOS
        )
        for convo in convos
    ]
    return {"text": texts}


dataset = dataset.map(formatting_prompts_func, batched=True)

# %%
dataset[5]["text"]

# %% Train
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    eval_dataset=None,
    args=SFTConfig(
        dataset_text_field="text",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,
        learning_rate=2e-4,
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        report_to="none",
    ),
)

# %% The loss on the model's replies only
from slothkit.chat_templates import train_on_responses_only

trainer = train_on_responses_only(
    trainer,
    instruction_part="<start_of_turn>user\n",
    response_part="<start_of_turn>model\n",
)

# %%
tokenizer.decode(trainer.train_dataset[5]["input_ids"])

# %%
tokenizer.decode(
    [tokenizer.pad_token_id if x == -100 else x for x in trainer.train_dataset[5]["labels"]]
).replace(tokenizer.pad_token, " ")

# %% GPU memory before training (no CUDA device to report on the CPU runner)
if ON_GPU:
    gpu_stats = torch.cuda.get_device_properties(0)
    start_gpu_memory = round(torch.cuda.max_memory_reserved() / 1024**3, 3)
    max_memory = round(gpu_stats.total_memory / 1024**3, 3)
    print(f"GPU = {gpu_stats.name}. Max memory = {max_memory} GB.")
    print(f"{start_gpu_memory} GB of memory reserved.")

# %%
trainer_stats = trainer.train()

# %% Inference: content as a list of typed parts, as the notebook writes it
from slothkit.chat_templates import get_chat_template

tokenizer = get_chat_template(tokenizer, chat_template="gemma-3")
messages = [
    {"role": "user", "content": [{"type": "text", "text": "Continue the sequence: 1, 1, 2, 3, 5, 8,"}]}
]
text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # a string, as the notebook's
inputs = tokenizer([text], return_tensors="pt").to(model.device)  # the notebook writes .to("cuda")
outputs = model.generate(**inputs, max_new_tokens=64, temperature=1.0, top_p=0.95, top_k=64)
tokenizer.batch_decode(outputs)

# %% Save the LoRA adapter
model.save_pretrained("gemma-3")
tokenizer.save_pretrained("gemma-3")

# %% Merged 16-bit (the notebook: behind `if False:`)
if True:
    model.save_pretrained_merged("gemma-3-finetune", tokenizer)

# %% GGUF (the notebook: behind `if False:`)
if True:
    model.save_pretrained_gguf("gemma-3-finetune", quantization_type="Q8_0")
