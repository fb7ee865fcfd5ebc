# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Qwen3-30B-A3B, formatting SFT before GRPO (Unsloth's "Qwen3_MoE" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` -> `slothkit.trl`;
# - the model and the data are local: the tiny offline Qwen3-MoE (or `MODEL` when the
#   caller gives one), and a few rows in memory with the columns of OpenMathReasoning-mini's
#   "cot" split; `max_steps` is 2 and the answer 32 new tokens long (the notebook: 128);
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)` (marked below);
# - the save cells behind `if False:` that save locally run (users flip them); pushing to
#   the Hub stays off (no network).

# %%
import torch  # the notebook: `import os, torch` and a commented-out os.environ setting

# %%
from slothkit.testing.tiny_generic_models import tiny_generic_model_path

# The tiny Qwen3-MoE stands in for "unsloth/Qwen3-30B-A3B-Instruct-2507".
model_name = globals().get("MODEL") or str(tiny_generic_model_path("qwen3_moe"))
max_seq_length = 2048
lora_rank = 32

# %%
from slothkit import FastLanguageModel

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name,
    max_seq_length=max_seq_length,
    load_in_4bit=False,
    fast_inference=False,
)

model = FastLanguageModel.get_peft_model(
    model,
    r=lora_rank,
    target_modules=[
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
    ],
    lora_alpha=lora_rank * 2,
    use_gradient_checkpointing=True,
    random_state=3407,
    bias="none",
)

# %% A chat template for the reasoning format
reasoning_start = "<start_working_out>"
reasoning_end = "<end_working_out>"
solution_start = "<SOLUTION>"
solution_end = "</SOLUTION>"

system_prompt = f"""You are given a problem.
Think about the problem and provide your working out.
Place it between {reasoning_start} and {reasoning_end}.
Then, provide your solution between {solution_start}{solution_end}"""
print(system_prompt)

# %%
chat_template = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + eos_token }}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}"
    "{{ '{system_prompt}' + eos_token }}"
    "{% set loop_messages = messages %}"
    "{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '{reasoning_start}' }}"
    "{% endif %}"
)

chat_template = chat_template.replace("'{system_prompt}'", f"'{system_prompt}'").replace(
    "'{reasoning_start}'", f"'{reasoning_start}'"
)
tokenizer.chat_template = chat_template

# %%
print(
    tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is 1+1?"},
            {
                "role": "assistant",
                "content": f"{reasoning_start}I think it's 2.{reasoning_end}{solution_start}2{solution_end}",
            },
            {"role": "user", "content": "What is 2+2?"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
)

# %% Data: problems with worked solutions
import numpy as np
import pandas as pd
from datasets import Dataset


def solution(steps):
    return f"<think>\n{steps}\n</think>"


# Local stand-in for load_dataset("unsloth/OpenMathReasoning-mini", split="cot").
dataset = Dataset.from_list(
    [
        {"expected_answer": "-2", "problem": "Solve (x + 2)^2 = 0.",
         "generated_solution": solution("A square is zero only when its base is: x + 2 = 0.")},
        {"expected_answer": "12", "problem": "What is 3 times 4?", "generated_solution": solution("3 + 3 + 3 + 3 = 12.")},
        {"expected_answer": "x = 5", "problem": "Solve x - 5 = 0.", "generated_solution": solution("Add 5.")},
        {"expected_answer": "9", "problem": "What is the square of 3?", "generated_solution": solution("3 times 3 is 9.")},
        {"expected_answer": "7", "problem": "What is 10 - 3?",
         "generated_solution": solution("Counting down three from ten gives seven.")},
        {"expected_answer": "1", "problem": "What is 5 / 5?",
         "generated_solution": solution("Any non-zero number over itself is one.")},
    ]
)  # fmt: skip
dataset = dataset.to_pandas()[["expected_answer", "problem", "generated_solution"]]

is_number = pd.to_numeric(pd.Series(dataset["expected_answer"]), errors="coerce").notnull()
dataset = dataset.iloc[np.where(is_number)[0]]

print(dataset)


# %%
def format_dataset(x):
    expected_answer = x["expected_answer"]
    problem = x["problem"]

    thoughts = x["generated_solution"]
    thoughts = thoughts.replace("<think>", "").replace("</think>", "")

    thoughts = thoughts.strip()
    final_prompt = (
        reasoning_start + thoughts + reasoning_end + solution_start + expected_answer + solution_end
    )
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": problem},
        {"role": "assistant", "content": final_prompt},
    ]


dataset["Messages"] = dataset.apply(format_dataset, axis=1)

# %%
print(tokenizer.apply_chat_template(dataset["Messages"][0], tokenize=False))

# %% Keep the conversations of at most half the context
dataset["N"] = dataset["Messages"].apply(lambda x: len(tokenizer.apply_chat_template(x)))

dataset = dataset.loc[dataset["N"] <= max_seq_length / 2].copy()
print(dataset.shape)

# %%
from datasets import Dataset

dataset["text"] = tokenizer.apply_chat_template(dataset["Messages"].values.tolist(), tokenize=False)
dataset = Dataset.from_pandas(dataset)
print(dataset)

# %% Train
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    train_dataset=dataset,
    args=SFTConfig(
        dataset_text_field="text",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        warmup_steps=5,
        max_steps=2,  # the notebook: 50
        learning_rate=2e-4,
        logging_steps=5,
        optim="adamw_8bit",
        weight_decay=0.001,
        lr_scheduler_type="linear",
        seed=3407,
        report_to="none",
    ),
)

# %%
trainer.train()

# %% Does it follow the format?
text = tokenizer.apply_chat_template(
    dataset[0]["Messages"][:2],
    tokenize=False,
    add_generation_prompt=True,
)

from transformers import TextStreamer

_ = model.generate(
    **tokenizer(text, return_tensors="pt").to(model.device),  # the notebook writes .to("cuda")
    temperature=0.1,
    max_new_tokens=32,  # the notebook: 128
    streamer=TextStreamer(tokenizer, skip_prompt=False),
    use_cache=True,
)

# %% Free the data before GRPO
del dataset
torch.cuda.empty_cache()
import gc

gc.collect()

# %% Merged 16-bit and 4-bit, and the adapter (the notebook: behind `if False:`)
if True:
    model.save_pretrained_merged("qwen_finetune_16bit", tokenizer, save_method="merged_16bit")

if True:
    model.save_pretrained_merged("qwen_finetune_4bit", tokenizer, save_method="merged_4bit")

if True:
    model.save_pretrained("qwen_lora")
    tokenizer.save_pretrained("qwen_lora")

# %% GGUF: Q8_0, 16-bit and q4_k_m (the notebook: behind `if False:`)
if True:
    model.save_pretrained_gguf("qwen_finetune", tokenizer)
if True:
    model.save_pretrained_gguf("qwen_finetune", tokenizer, quantization_method="f16")
if True:
    model.save_pretrained_gguf("qwen_finetune", tokenizer, quantization_method="q4_k_m")
