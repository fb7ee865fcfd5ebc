# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Llama-3 8B, ORPO on preference pairs (Unsloth's "Llama3 (8B) ORPO" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline Llama, or `MODEL` when the caller
#   gives one; a few Alpaca-style preference records in memory), and `max_steps` is 2;
#   `max_seq_length` stays 4096, twice the tiny model's context, so RoPE is scaled as for
#   a short-context checkpoint;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)` and the model loads in
#   16 bits (each marked below);
# - the cells behind `if False:` that save or reload locally run (users flip them);
#   pushing to the Hub stays off (no network).

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("llama"))  # local stand-in for the Hub id
ON_GPU = torch.cuda.is_available()

max_seq_length = 4096
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

# %% Data: Alpaca-style prompts with an accepted and a rejected answer
from datasets import Dataset

alpaca_prompt = """Here is a task, with context where there is some. Answer it.

### Task:
{}

### Context:
{}

### Answer:
{}"""

EOS_TOKEN = tokenizer.eos_token


def format_prompt(sample):
    sample["prompt"] = alpaca_prompt.format(sample["instruction"], sample["input"], "")
    sample["chosen"] = sample["accepted"] + EOS_TOKEN
    sample["rejected"] = sample["rejected"] + EOS_TOKEN
    return sample


# Local stand-in for load_dataset("reciperesearch/dolphin-sft-v0.1-preference")["train"].
dataset = Dataset.from_list(
    [
        {"instruction": "Add the numbers.", "input": "12 and 30", "accepted": "42.", "rejected": "1230."},
        {
            "instruction": "Name the capital of France.",
            "input": "",
            "accepted": "Paris.",
            "rejected": "Lyon.",
        },
        {"instruction": "Reverse the word.", "input": "sloth", "accepted": "htols", "rejected": "sloth"},
        {"instruction": "What colour is the sky?", "input": "", "accepted": "Blue.", "rejected": "Green."},
        {"instruction": "Give the opposite.", "input": "slow", "accepted": "fast", "rejected": "slower"},
        {"instruction": "Count the letters.", "input": "tree", "accepted": "4", "rejected": "3"},
    ]
)
dataset = dataset.map(format_prompt)

# %%
import pprint

row = dataset[1]
print("INSTRUCTION: " + "=" * 50)
pprint.pprint(row["prompt"])
print("ACCEPTED: " + "=" * 50)
pprint.pprint(row["chosen"])
print("REJECTED: " + "=" * 50)
pprint.pprint(row["rejected"])

# %%
from slothkit import PatchDPOTrainer

PatchDPOTrainer()

# %% Train
from slothkit.trl import ORPOConfig, ORPOTrainer

orpo_trainer = ORPOTrainer(
    model=model,
    train_dataset=dataset,
    tokenizer=tokenizer,
    args=ORPOConfig(
        max_length=max_seq_length,
        max_prompt_length=max_seq_length // 2,
        max_completion_length=max_seq_length // 2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        beta=0.1,
        logging_steps=1,
        optim="adamw_8bit",
        lr_scheduler_type="linear",
        max_steps=2,
        output_dir="outputs",
        report_to="none",
    ),
)

# %%
orpo_trainer.train()

# %% Inference
FastLanguageModel.for_inference(model)
inputs = tokenizer(
    [alpaca_prompt.format("Continue the fibonacci sequence.", "1, 1, 2, 3, 5, 8", "")],
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
outputs = model.generate(**inputs, max_new_tokens=64, use_cache=True)
tokenizer.batch_decode(outputs)

# %% Inference, streamed
from transformers import TextStreamer

FastLanguageModel.for_inference(model)
inputs = tokenizer(
    [alpaca_prompt.format("Continue the fibonacci sequence.", "1, 1, 2, 3, 5, 8", "")],
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
text_streamer = TextStreamer(tokenizer)
_ = model.generate(**inputs, streamer=text_streamer, max_new_tokens=128)

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
    model.push_to_hub_gguf("HF_USERNAME/llama_finetune", tokenizer, quantization_method="q4_k_m", token="")
