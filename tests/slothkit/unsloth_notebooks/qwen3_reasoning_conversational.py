# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Qwen3 (14B), reasoning and chat SFT (Unsloth's "Qwen3 (14B) Reasoning-Conversational"
# notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.chat_templates` ->
#   `slothkit.chat_templates`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline Qwen3 with Qwen3's chat template, or
#   `MODEL` when the caller gives one; a few rows in memory with the columns of
#   OpenMathReasoning-mini's "cot" split and of FineTome-100k), `max_steps` is 2 and the
#   two answers are 32 and 64 new tokens long (the notebook: 256 and 1,024);
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the GPU memory cells
#   report nothing, and the model loads in 16 bits (each marked below);
# - the cells behind `if False:` that save or reload locally run (users flip them); the
#   two merged saves go to folders of their own (the notebook names "model" for every
#   save, so run in turn they would overwrite one another), the notebook's second
#   adapter save into "model" is the one into "lora_model" above; pushing to the Hub stays
#   off (no network).

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("qwen3"))  # stand-in for "unsloth/Qwen3-14B"
ON_GPU = torch.cuda.is_available()

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=MODEL,
    max_seq_length=2048,
    load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    load_in_8bit=False,
    full_finetuning=False,
)

# %%
model = FastLanguageModel.get_peft_model(
    model,
    r=32,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha=32,
    lora_dropout=0,
    bias="none",
    use_gradient_checkpointing="unsloth",
    random_state=3407,
    use_rslora=False,
    loftq_config=None,
)

# %% Data: a reasoning set and a chat set
from datasets import Dataset


def solution(steps, answer):
    return f"<think>\n{steps}\n</think>\n\nThe answer is {answer}."


# Local stand-in for load_dataset("unsloth/OpenMathReasoning-mini", split="cot").
reasoning_dataset = Dataset.from_list(
    [
        {"expected_answer": "-2", "problem": "Solve (x + 2)^2 = 0.",
         "generated_solution": solution("A square is zero only when its base is: x + 2 = 0.", "x = -2")},
        {"expected_answer": "12", "problem": "What is 3 times 4?",
         "generated_solution": solution("3 + 3 + 3 + 3 = 12.", "12")},
        {"expected_answer": "5", "problem": "How many sides has a pentagon?",
         "generated_solution": solution("Penta means five.", "5")},
        {"expected_answer": "9", "problem": "What is the square of 3?",
         "generated_solution": solution("3 times 3 is 9.", "9")},
        {"expected_answer": "7", "problem": "What is 10 - 3?",
         "generated_solution": solution("Counting down three from ten gives seven.", "7")},
        {"expected_answer": "1", "problem": "What is 5 / 5?",
         "generated_solution": solution("Any non-zero number over itself is one.", "1")},
    ]
)  # fmt: skip


def turns(*pairs):
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(pairs)]


# Local stand-in for load_dataset("mlabonne/FineTome-100k", split="train").
non_reasoning_dataset = Dataset.from_list(
    [
        {"conversations": turns("Name a slow animal.", "The sloth."), "source": "local", "score": 5.0},
        {"conversations": turns("Say hi.", "Hi!", "Again?", "Hi again!"), "source": "local", "score": 4.0},
        {"conversations": turns("Spell cat.", "C, A, T."), "source": "local", "score": 4.5},
        {"conversations": turns("Name a primary colour.", "Red."), "source": "local", "score": 4.0},
    ]
)  # fmt: skip

# %%
print(reasoning_dataset)

# %%
print(non_reasoning_dataset)


# %% The reasoning set as conversations
def generate_conversation(examples):
    problems = examples["problem"]
    solutions = examples["generated_solution"]
    conversations = []
    for problem, solution in zip(problems, solutions):
        conversations.append(
            [
                {"role": "user", "content": problem},
                {"role": "assistant", "content": solution},
            ]
        )
    return {"conversations": conversations}


# %%
reasoning_conversations = tokenizer.apply_chat_template(
    reasoning_dataset.map(generate_conversation, batched=True)["conversations"],
    tokenize=False,
)

# %%
reasoning_conversations[0]

# %% The chat set in role/content form
from slothkit.chat_templates import standardize_sharegpt

dataset = standardize_sharegpt(non_reasoning_dataset)

non_reasoning_conversations = tokenizer.apply_chat_template(
    dataset["conversations"],
    tokenize=False,
)

# %%
non_reasoning_conversations[0]

# %%
print(len(reasoning_conversations))
print(len(non_reasoning_conversations))

# %% A quarter chat, three quarters reasoning
chat_percentage = 0.25

# %%
import pandas as pd

non_reasoning_subset = pd.Series(non_reasoning_conversations)
non_reasoning_subset = non_reasoning_subset.sample(
    int(len(reasoning_conversations) * (chat_percentage / (1 - chat_percentage))),
    random_state=2407,
)
print(len(reasoning_conversations))
print(len(non_reasoning_subset))
print(len(non_reasoning_subset) / (len(non_reasoning_subset) + len(reasoning_conversations)))

# %%
data = pd.concat([pd.Series(reasoning_conversations), pd.Series(non_reasoning_subset)])
data.name = "text"

from datasets import Dataset

combined_dataset = Dataset.from_pandas(pd.DataFrame(data))
combined_dataset = combined_dataset.shuffle(seed=3407)

# %% Train
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=combined_dataset,
    eval_dataset=None,
    args=SFTConfig(
        dataset_text_field="text",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,  # the notebook: 30
        learning_rate=2e-4,
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        report_to="none",
    ),
)

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

# %% Inference without thinking
messages = [{"role": "user", "content": "Solve (x + 2)^2 = 0."}]
text = tokenizer.apply_chat_template(
    messages,
    tokenize=False,
    add_generation_prompt=True,
    enable_thinking=False,
)

from transformers import TextStreamer

_ = model.generate(
    **tokenizer(text, return_tensors="pt").to(model.device),  # the notebook writes .to("cuda")
    max_new_tokens=32,  # the notebook: 256
    temperature=0.7,
    top_p=0.8,
    top_k=20,
    streamer=TextStreamer(tokenizer, skip_prompt=True),
)
no_thinking = (text, _)

# %% Inference with thinking
messages = [{"role": "user", "content": "Solve (x + 2)^2 = 0."}]
text = tokenizer.apply_chat_template(
    messages,
    tokenize=False,
    add_generation_prompt=True,
    enable_thinking=True,
)

from transformers import TextStreamer

_ = model.generate(
    **tokenizer(text, return_tensors="pt").to(model.device),  # the notebook writes .to("cuda")
    max_new_tokens=64,  # the notebook: 1,024
    temperature=0.6,
    top_p=0.95,
    top_k=20,
    streamer=TextStreamer(tokenizer, skip_prompt=True),
)

# %% Save the LoRA adapter
model.save_pretrained("lora_model")
tokenizer.save_pretrained("lora_model")

# %% Reload it (the notebook: behind `if False:`); the saves below are of this model
if True:
    from slothkit import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="lora_model",
        max_seq_length=2048,
        load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    )

# %% Merged 16-bit and 4-bit (the notebook: behind `if False:`, both into "model")
if True:
    model.save_pretrained_merged("model_16bit", tokenizer, save_method="merged_16bit")
if True:
    model.save_pretrained_merged("model_4bit", tokenizer, save_method="merged_4bit")

# %% GGUF: Q8_0, 16-bit and q4_k_m (the notebook: behind `if False:`)
if True:
    model.save_pretrained_gguf("model", tokenizer)
if True:
    model.save_pretrained_gguf("model", tokenizer, quantization_method="f16")
if True:
    model.save_pretrained_gguf("model", tokenizer, quantization_method="q4_k_m")
