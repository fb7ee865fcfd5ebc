# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Mistral 7B, continued pretraining on plain text (Unsloth's "Mistral (7B) Text
# Completion" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline Mistral, or `MODEL` when the caller
#   gives one; a few short stories in memory, in TinyStories' one "text" column), and 2
#   steps (`max_steps=2`) replace `num_train_epochs=1`;
# - `r=128` exceeds the tiny model's narrowest projection (k_proj, 32 wide), which slothkit
#   refuses: 32 here unless the model is wider;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below).
#
# The notebook ends with streamed generation: it has no saving cells.

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("mistral"))  # local stand-in for the Hub id
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

# %% LoRA on every projection, and the embeddings and head trained too
narrowest = min(
    min(m.in_features, m.out_features) for n, m in model.named_modules() if n.endswith(("k_proj", "v_proj"))
)
model = FastLanguageModel.get_peft_model(
    model,
    r=min(128, narrowest),  # the notebook's 128 where the model is that wide
    target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head",
    ],
    lora_alpha=32,
    lora_dropout=0,
    bias="none",
    use_gradient_checkpointing="unsloth",
    random_state=3407,
    use_rslora=True,
    loftq_config=None,
)  # fmt: skip

# %% Data: plain stories, each ending in EOS
from datasets import Dataset

# Local stand-in for load_dataset("roneneldan/TinyStories", split="train[:2500]").
dataset = Dataset.from_list(
    [
        {
            "text": "Once upon a time, a little sloth named Sam lived in a tall tree. He liked to sleep all day."
        },
        {"text": "Lily found a red ball in the park. She threw it to her dog, and the dog ran after it."},
        {"text": "Tom wanted to fly a kite. The wind was strong, and the kite went up into the sky."},
        {"text": "A small bird sang every morning. One day it sang for the sun, and the sun smiled back."},
        {"text": "Ben and Mia built a castle of sand. A wave came and took it, so they built another."},
        {"text": "The cat sat by the window and watched the rain. Then the rain stopped, and it went out."},
    ]
)
EOS_TOKEN = tokenizer.eos_token


def formatting_prompts_func(examples):
    return {"text": [example + EOS_TOKEN for example in examples["text"]]}


dataset = dataset.map(formatting_prompts_func, batched=True)

# %%
for row in dataset[:5]["text"]:
    print("=========================")
    print(row)

# %% Train, the embeddings at their own learning rate
from slothkit import UnslothTrainer, UnslothTrainingArguments
from slothkit.trl import SFTTrainer, TrainingArguments  # noqa: F401 - imported, unused, as in the notebook

trainer = UnslothTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    dataset_text_field="text",
    max_seq_length=max_seq_length,
    dataset_num_proc=8,
    args=UnslothTrainingArguments(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=8,
        warmup_ratio=0.1,
        max_steps=2,  # the notebook: num_train_epochs=1
        learning_rate=5e-5,
        embedding_learning_rate=5e-6,
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.00,
        lr_scheduler_type="cosine",
        seed=3407,
        output_dir="outputs",
        report_to="none",
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

# %% Generate in a thread, printing the stream wrapped at 100 characters
import textwrap
from threading import Thread

from transformers import TextIteratorStreamer

text_streamer = TextIteratorStreamer(tokenizer)
max_print_width = 100

FastLanguageModel.for_inference(model)
inputs = tokenizer(["Once upon a time, in a galaxy, far far away,"] * 1, return_tensors="pt").to(
    model.device
)  # the notebook writes .to("cuda")

generation_kwargs = dict(inputs, streamer=text_streamer, max_new_tokens=256, use_cache=True)
thread = Thread(target=model.generate, kwargs=generation_kwargs)
thread.start()

streamed = []
length = 0
for j, new_text in enumerate(text_streamer):
    streamed.append(new_text)
    if j == 0:
        wrapped_text = textwrap.wrap(new_text, width=max_print_width)
        length = len(wrapped_text[-1]) if wrapped_text else 0
        print("\n".join(wrapped_text), end="")
    else:
        length += len(new_text)
        if length >= max_print_width:
            length = 0
            print()
        print(new_text, end="")
thread.join()
