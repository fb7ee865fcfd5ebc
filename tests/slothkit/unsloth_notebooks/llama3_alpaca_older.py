# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Llama-3 8B, Alpaca SFT, the notebook's early-2025 form (TRL trainer keywords,
# `TrainingArguments`), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` and `transformers.TrainingArguments` ->
#   `slothkit.trl`;
# - the model and the data are local (a tiny offline Llama, or `MODEL` when the caller
#   gives one; a few Alpaca records in memory), and `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below);
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
load_in_4bit = ON_GPU  # 16-bit LoRA on the CPU runner: bitsandbytes' CPU 4-bit path is slow

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

# %% Data: Alpaca records rendered into one prompt ending in EOS
from datasets import Dataset

alpaca_prompt = """Here is a task, with context where there is some. Answer it.

### Task:
{}

### Context:
{}

### Answer:
{}"""

EOS_TOKEN = tokenizer.eos_token


def formatting_prompts_func(examples):
    texts = []
    for instruction, context, output in zip(examples["instruction"], examples["input"], examples["output"]):
        texts.append(alpaca_prompt.format(instruction, context, output) + EOS_TOKEN)
    return {"text": texts}


# Local stand-in for load_dataset("unsloth/alpaca-cleaned", split="train").
dataset = Dataset.from_list(
    [
        {"instruction": "Add the numbers.", "input": "12 and 30", "output": "12 + 30 = 42."},
        {"instruction": "Name the capital of France.", "input": "", "output": "Paris."},
        {"instruction": "Reverse the word.", "input": "sloth", "output": "htols"},
        {"instruction": "What colour is the sky on a clear day?", "input": "", "output": "Blue."},
        {"instruction": "Continue the sequence.", "input": "2, 4, 6", "output": "8, 10, 12"},
        {"instruction": "Give the opposite.", "input": "slow", "output": "fast"},
        {"instruction": "Count the letters.", "input": "tree", "output": "4"},
        {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
    ]
)
dataset = dataset.map(formatting_prompts_func, batched=True)

# %% Train
from slothkit import is_bfloat16_supported
from slothkit.trl import SFTTrainer, TrainingArguments

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    dataset_text_field="text",
    max_seq_length=max_seq_length,
    dataset_num_proc=2,
    packing=False,
    args=TrainingArguments(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,
        learning_rate=2e-4,
        fp16=not is_bfloat16_supported(),
        bf16=is_bfloat16_supported(),
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir="outputs",
    ),
)

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
FastLanguageModel.for_inference(model)
inputs = tokenizer(
    [alpaca_prompt.format("Continue the fibonnaci sequence.", "1, 1, 2, 3, 5, 8", "")],
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
outputs = model.generate(**inputs, max_new_tokens=64, use_cache=True)
tokenizer.batch_decode(outputs)

# %% Inference, streamed
from transformers import TextStreamer

FastLanguageModel.for_inference(model)
inputs = tokenizer(
    [alpaca_prompt.format("Continue the fibonnaci sequence.", "1, 1, 2, 3, 5, 8", "")],
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
text_streamer = TextStreamer(tokenizer)
_ = model.generate(**inputs, streamer=text_streamer, max_new_tokens=128)

# %% Save the LoRA adapter
model.save_pretrained("lora_model")
tokenizer.save_pretrained("lora_model")

# %% Load the saved adapter and generate (the notebook's `if False:`, flipped)
if True:
    from slothkit import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="lora_model",
        max_seq_length=max_seq_length,
        dtype=dtype,
        load_in_4bit=load_in_4bit,
    )
    FastLanguageModel.for_inference(model)

inputs = tokenizer(
    [alpaca_prompt.format("What is a famous tall tower in Paris?", "", "")],
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
outputs = model.generate(**inputs, max_new_tokens=64, use_cache=True)
tokenizer.batch_decode(outputs)

# %% Plain PEFT instead of slothkit (stays off: it replaces `model` with a PeftModel that
# has no save_pretrained_merged, which the next cells call)
if False:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained("lora_model", load_in_4bit=load_in_4bit)
    tokenizer = AutoTokenizer.from_pretrained("lora_model")

# %% Merged 16-bit and 4-bit models and the LoRA, each into the folder "model" (the Hub
# pushes stay off: no network)
if True:
    model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
if False:
    model.push_to_hub_merged("hf/model", tokenizer, save_method="merged_16bit", token="")
if True:
    # overwrite=True added: "model" holds the 16-bit merge now, which slothkit replaces
    # unasked only with another 16-bit merge (the 4-bit weights cannot give it back).
    model.save_pretrained_merged("model", tokenizer, save_method="merged_4bit", overwrite=True)
if False:
    model.push_to_hub_merged("hf/model", tokenizer, save_method="merged_4bit", token="")
if True:
    # overwrite=True added: slothkit refuses to save into a folder that holds another
    # method's save (here the merged model: adapter files beside it would make transformers
    # load the base model and the adapter instead of the merged weights); this replaces it
    # atomically.
    model.save_pretrained_merged("model", tokenizer, save_method="lora", overwrite=True)
if False:
    model.push_to_hub_merged("hf/model", tokenizer, save_method="lora", token="")

# %% GGUF: the default (q8_0), f16 and q4_k_m, into the same folder
if True:
    model.save_pretrained_gguf("model", tokenizer)
if False:
    model.push_to_hub_gguf("hf/model", tokenizer, token="")
if True:
    model.save_pretrained_gguf("model", tokenizer, quantization_method="f16")
if False:
    model.push_to_hub_gguf("hf/model", tokenizer, quantization_method="f16", token="")
if True:
    model.save_pretrained_gguf("model", tokenizer, quantization_method="q4_k_m")
if False:
    model.push_to_hub_gguf("hf/model", tokenizer, quantization_method="q4_k_m", token="")
