# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # CodeGemma 7B, conversational SFT in ChatML (Unsloth's "CodeGemma (7B) Conversational"
# notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.chat_templates` ->
#   `slothkit.chat_templates`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline Gemma, or `MODEL` when the caller
#   gives one; a few ShareGPT conversations in memory, in guanaco-sharegpt's form), and
#   `max_steps` is 2; `max_seq_length` stays 4096, twice the tiny model's context, so
#   RoPE is scaled as for a short-context checkpoint;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below);
# - the cells behind `if False:` that save or reload locally run (users flip them);
#   pushing to the Hub stays off (no network).  The custom-template cell stays off: its
#   template has an `{% endif %}` without an `{% if %}`, which no Jinja parser accepts.

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("gemma"))  # local stand-in for the Hub id
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

# %% Data: ChatML over ShareGPT's keys, and a formatter that renders each conversation
from datasets import Dataset

from slothkit.chat_templates import get_chat_template

tokenizer = get_chat_template(
    tokenizer,
    chat_template="chatml",
    mapping={"role": "from", "content": "value", "user": "human", "assistant": "gpt"},
    map_eos_token=True,
)


def formatting_prompts_func(examples):
    convos = examples["conversations"]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in convos]
    return {"text": texts}


def turns(*pairs):
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(pairs)]


# Local stand-in for load_dataset("philschmid/guanaco-sharegpt-style", split="train").
dataset = Dataset.from_list(
    [
        {"conversations": turns("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b")},
        {"conversations": turns("What does len([1, 2, 3]) return?", "3")},
        {"conversations": turns("Reverse a string in Python.", "text[::-1]", "And in place?", "Strings are immutable.")},
        {"conversations": turns("Name a sorting algorithm.", "Merge sort.")},
        {"conversations": turns("What is a list comprehension?", "[x * 2 for x in items]")},
        {"conversations": turns("How do I open a file?", "with open(path) as f:")},
    ]
)  # fmt: skip
dataset = dataset.map(formatting_prompts_func, batched=True)

# %%
dataset[5]["conversations"]

# %%
print(dataset[5]["text"])

# %% A template of one's own (stays off, as in the notebook: the notebook's template has an
# `{% endif %}` without its `{% if %}` and does not parse)
unsloth_template = (
    "{{ bos_token }}"
    "{{ 'You are a helpful assistant to the user\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '>>> User: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '>>> Assistant: ' + message['content'] + eos_token + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '>>> Assistant: ' }}{% endif %}"
)
unsloth_eos_token = "eos_token"
if False:
    tokenizer = get_chat_template(
        tokenizer,
        chat_template=(unsloth_template, unsloth_eos_token),
        mapping={"role": "from", "content": "value", "user": "human", "assistant": "gpt"},
        map_eos_token=True,
    )

# %% Train
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    packing=False,
    args=SFTConfig(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,
        learning_rate=2e-4,
        optim="adamw_8bit",
        weight_decay=0.001,
        lr_scheduler_type="linear",
        seed=3407,
        dataset_text_field="text",
        report_to="none",
        max_grad_norm=0.3,
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
from slothkit.chat_templates import get_chat_template

tokenizer = get_chat_template(
    tokenizer,
    chat_template="chatml",
    mapping={"role": "from", "content": "value", "user": "human", "assistant": "gpt"},
    map_eos_token=True,
)
FastLanguageModel.for_inference(model)
messages = [{"from": "human", "value": "Continue the fibonacci sequence: 1, 1, 2, 3, 5, 8,"}]
inputs = tokenizer.apply_chat_template(
    messages,
    tokenize=True,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
outputs = model.generate(input_ids=inputs, max_new_tokens=64, use_cache=True)
tokenizer.batch_decode(outputs)

# %% Inference, streamed
from transformers import TextStreamer

FastLanguageModel.for_inference(model)
messages = [{"from": "human", "value": "Continue the fibonacci sequence: 1, 1, 2, 3, 5, 8,"}]
inputs = tokenizer.apply_chat_template(
    messages,
    tokenize=True,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
text_streamer = TextStreamer(tokenizer)
_ = model.generate(input_ids=inputs, streamer=text_streamer, max_new_tokens=128, use_cache=True)

# %% Save the LoRA adapter
model.save_pretrained("codegemma_lora")
# Added: the notebook saves no tokenizer here, so the reloading cell below would get the base
# model's, without ChatML (its template then refuses the ShareGPT keys) and without the
# tokens ChatML added.
tokenizer.save_pretrained("codegemma_lora")

# %% Load the saved adapter and generate (the notebook's `if False:`, flipped)
if True:
    from slothkit import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="codegemma_lora",
        max_seq_length=max_seq_length,
        dtype=dtype,
        load_in_4bit=load_in_4bit,
    )
    FastLanguageModel.for_inference(model)

messages = [{"from": "human", "value": "What is a famous tall tower in Paris?"}]
inputs = tokenizer.apply_chat_template(
    messages,
    tokenize=True,
    add_generation_prompt=True,
    return_tensors="pt",
).to(model.device)  # the notebook writes .to("cuda")
text_streamer = TextStreamer(tokenizer)
_ = model.generate(input_ids=inputs, streamer=text_streamer, max_new_tokens=128, use_cache=True)

# %% Plain PEFT instead of slothkit (stays off: it replaces `model` with a PeftModel that
# has no save_pretrained_merged, which the next cells call)
if False:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained("codegemma_lora", load_in_4bit=load_in_4bit)
    tokenizer = AutoTokenizer.from_pretrained("codegemma_lora")

# %% Merged 16-bit and 4-bit models, the LoRA again (the Hub pushes stay off: no network)
if True:
    model.save_pretrained_merged("codegemma_finetune_16bit", tokenizer, save_method="merged_16bit")
if False:
    model.push_to_hub_merged(
        "HF_USERNAME/codegemma_finetune_16bit", tokenizer, save_method="merged_16bit", token=""
    )
if True:
    model.save_pretrained_merged("codegemma_finetune_4bit", tokenizer, save_method="merged_4bit")
if False:
    model.push_to_hub_merged(
        "HF_USERNAME/codegemma_finetune_4bit", tokenizer, save_method="merged_4bit", token=""
    )
if True:
    model.save_pretrained("codegemma_lora")
    tokenizer.save_pretrained("codegemma_lora")
if False:
    model.push_to_hub("HF_USERNAME/codegemma_lora", token="")
    tokenizer.push_to_hub("HF_USERNAME/codegemma_lora", token="")

# %% GGUF: the default (q8_0), f16 and q4_k_m, one after the other into one folder
if True:
    model.save_pretrained_gguf("codegemma_finetune", tokenizer)
if True:
    model.save_pretrained_gguf("codegemma_finetune", tokenizer, quantization_method="f16")
if True:
    model.save_pretrained_gguf("codegemma_finetune", tokenizer, quantization_method="q4_k_m")
if False:
    model.push_to_hub_gguf(
        "HF_USERNAME/codegemma_finetune", tokenizer, quantization_method="q4_k_m", token=""
    )
