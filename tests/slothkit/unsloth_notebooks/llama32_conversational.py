# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Llama-3.2 (1B and 3B), conversational SFT (Unsloth's "Llama3.2 (1B and 3B)
# Conversational" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.chat_templates` ->
#   `slothkit.chat_templates`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline Llama, or `MODEL` when the caller
#   gives one; a few ShareGPT conversations in memory, with FineTome's columns), and
#   `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below); `optim="adamw_8bit"`
#   and the merged 4-bit save run as written (bitsandbytes runs both on a CPU);
# - the cells behind `if False:` that save or reload locally run (users flip them);
#   pushing to the Hub stays off (no network).

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("llama"))  # local stand-in for the Hub id
ON_GPU = torch.cuda.is_available()

max_seq_length = 2048
dtype = None
# bitsandbytes loads 4-bit on a CPU too; 16-bit there keeps the merged and reloaded models
# comparable with the trained one to fp32 rounding (a 4-bit model's merged_16bit save
# merges into the original 16-bit weights, not the 4-bit ones it trained on).
load_in_4bit = ON_GPU

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

# %% Data: the llama-3.1 chat format, and a formatter that renders each conversation
from datasets import Dataset

from slothkit.chat_templates import get_chat_template

tokenizer = get_chat_template(tokenizer, chat_template="llama-3.1")


def formatting_prompts_func(examples):
    convos = examples["conversations"]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in convos]
    return {"text": texts}


def turns(*pairs):
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(pairs)]


# Local stand-in for load_dataset("mlabonne/FineTome-100k", split="train"): its columns,
# ShareGPT turns.
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
from slothkit.chat_templates import standardize_sharegpt

dataset = standardize_sharegpt(dataset)
dataset = dataset.map(formatting_prompts_func, batched=True)

# %%
dataset[5]["conversations"]

# %%
dataset[5]["text"]

# %% Train
from transformers import DataCollatorForSeq2Seq

from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    dataset_text_field="text",
    max_seq_length=max_seq_length,
    data_collator=DataCollatorForSeq2Seq(tokenizer=tokenizer),
    packing=False,
    args=SFTConfig(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,
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

# %% The loss on the assistant's replies only
from slothkit.chat_templates import train_on_responses_only

trainer = train_on_responses_only(trainer)

# %% Check the masking: the whole text, then what is left to learn
tokenizer.decode(trainer.train_dataset[5]["input_ids"])

# %%
space = tokenizer(" ", add_special_tokens=False).input_ids[0]
tokenizer.decode([space if x == -100 else x for x in trainer.train_dataset[5]["labels"]])

# %% GPU memory before training (no CUDA device to report on the CPU runner)
if ON_GPU:
    gpu_stats = torch.cuda.get_device_properties(0)
    start_gpu_memory = round(torch.cuda.max_memory_reserved() / 1024**3, 3)
    max_memory = round(gpu_stats.total_memory / 1024**3, 3)
    print(f"GPU = {gpu_stats.name}. Max memory = {max_memory} GB.")
    print(f"{start_gpu_memory} GB of memory reserved.")

# %%
trainer_stats = trainer.train()

# %% Time and GPU memory used (the memory part needs CUDA)
print(f"{trainer_stats.metrics['train_runtime']} seconds used for training.")
if ON_GPU:
    used_memory = round(torch.cuda.max_memory_reserved() / 1024**3, 3)
    used_memory_for_lora = round(used_memory - start_gpu_memory, 3)
    print(f"Peak reserved memory = {used_memory} GB, {used_memory_for_lora} GB of it for training.")
    print(f"Peak reserved memory = {round(used_memory / max_memory * 100, 3)} % of the GPU's.")

# %% Inference
from slothkit.chat_templates import get_chat_template

tokenizer = get_chat_template(tokenizer, chat_template="llama-3.1")
FastLanguageModel.for_inference(model)
messages = [{"role": "user", "content": "Continue the fibonacci sequence: 1, 1, 2, 3, 5, 8,"}]
inputs = tokenizer.apply_chat_template(
    messages,
    tokenize=True,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
outputs = model.generate(input_ids=inputs, max_new_tokens=64, use_cache=True, temperature=1.5, min_p=0.1)
tokenizer.batch_decode(outputs)

# %% Inference, streamed
from transformers import TextStreamer

FastLanguageModel.for_inference(model)
messages = [{"role": "user", "content": "Continue the fibonacci sequence: 1, 1, 2, 3, 5, 8,"}]
inputs = tokenizer.apply_chat_template(
    messages,
    tokenize=True,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
text_streamer = TextStreamer(tokenizer, skip_prompt=True)
_ = model.generate(
    input_ids=inputs, streamer=text_streamer, max_new_tokens=128, use_cache=True, temperature=1.5, min_p=0.1
)

# %% Save the LoRA adapter
model.save_pretrained("llama_lora")
tokenizer.save_pretrained("llama_lora")

# %% Load the saved adapter and generate (the notebook's `if False:`, flipped)
if True:
    from slothkit import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="llama_lora",
        max_seq_length=max_seq_length,
        dtype=dtype,
        load_in_4bit=load_in_4bit,
    )
    FastLanguageModel.for_inference(model)

messages = [{"role": "user", "content": "Describe a tall tower in the capital of France."}]
inputs = tokenizer.apply_chat_template(
    messages,
    tokenize=True,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
text_streamer = TextStreamer(tokenizer, skip_prompt=True)
_ = model.generate(
    input_ids=inputs, streamer=text_streamer, max_new_tokens=128, use_cache=True, temperature=1.5, min_p=0.1
)

# %% Plain PEFT instead of slothkit (stays off: it replaces `model` with a PeftModel that
# has no save_pretrained_merged, which the next cells call)
if False:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained("llama_lora", load_in_4bit=load_in_4bit)
    tokenizer = AutoTokenizer.from_pretrained("llama_lora")

# %% Merged 16-bit and 4-bit models, the LoRA again (the Hub pushes stay off: no network)
if True:
    model.save_pretrained_merged("llama_finetune_16bit", tokenizer, save_method="merged_16bit")
if False:
    model.push_to_hub_merged(
        "HF_USERNAME/llama_finetune_16bit", tokenizer, save_method="merged_16bit", token=""
    )
if True:
    model.save_pretrained_merged("llama_finetune_4bit", tokenizer, save_method="merged_4bit")
if False:
    model.push_to_hub_merged(
        "HF_USERNAME/llama_finetune_4bit", tokenizer, save_method="merged_4bit", token=""
    )
if True:
    model.save_pretrained("llama_lora")
    tokenizer.save_pretrained("llama_lora")
if False:
    model.push_to_hub("HF_USERNAME/llama_lora", token="")
    tokenizer.push_to_hub("HF_USERNAME/llama_lora", token="")

# %% GGUF: the default (q8_0), f16 and q4_k_m, one after the other into one folder
if True:
    model.save_pretrained_gguf("llama_finetune", tokenizer)
if True:
    model.save_pretrained_gguf("llama_finetune", tokenizer, quantization_method="f16")
if True:
    model.save_pretrained_gguf("llama_finetune", tokenizer, quantization_method="q4_k_m")
if False:
    model.push_to_hub_gguf(
        "HF_USERNAME/llama_finetune", tokenizer, quantization_method=["q4_k_m", "q8_0"], token=""
    )
