# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Qwen3 (4B) GRPO (Unsloth's "Qwen3 (4B) GRPO" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words: a custom reasoning chat template, a short SFT stage that teaches
# the format, then GRPO with four reward functions, vLLM-style generation before and after
# with the saved LoRA, and the saves.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` -> `slothkit.trl`, `vllm` -> `slothkit.vllm`;
# - the model and the data are local (a tiny offline Qwen3, or `MODEL` when the caller
#   gives one; a few rows in memory with the columns of OpenMathReasoning-mini's "cot"
#   split and of DAPO-Math-17k-Processed), each training runs 2 steps (the notebook: 2
#   epochs, then 100 steps), the completions are 16 tokens long (the notebook:
#   max_seq_length - max_prompt_length) and the answers 32 to 64 (the notebook: 1,024 to
#   2,048);
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)` (marked below);
# - the cells behind `if False:` that save locally run (users flip them); the two merged
#   saves go to folders of their own (the notebook names "model" for every save, so run in
#   turn they would overwrite one another); pushing to the Hub stays off (no network).

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("qwen3"))  # stand-in for "unsloth/Qwen3-4B-Base"

max_seq_length = 2048
lora_rank = 32

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=MODEL,
    max_seq_length=max_seq_length,
    load_in_4bit=False,
    fast_inference=True,
    max_lora_rank=lora_rank,
    gpu_memory_utilization=0.9,
)

# %%
model = FastLanguageModel.get_peft_model(
    model,
    r=lora_rank,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha=lora_rank * 2,
    use_gradient_checkpointing="unsloth",
    random_state=3407,
)

# %% The reasoning format and a chat template that writes it
reasoning_start = "<start_working_out>"
reasoning_end = "<end_working_out>"
solution_start = "<SOLUTION>"
solution_end = "</SOLUTION>"

system_prompt = (
    "You are given a problem.\nThink about the problem and provide your working out.\n"
    f"Place it between {reasoning_start} and {reasoning_end}.\n"
    f"Then, provide your solution between {solution_start}{solution_end}"
)

# A system turn (or the default one) and each assistant reply end with the EOS; the
# generation prompt opens the working out.
chat_template = (
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + eos_token }}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{{ '{system_prompt}' + eos_token }}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '{reasoning_start}' }}{% endif %}"
)
chat_template = chat_template.replace("'{system_prompt}'", f"'{system_prompt}'").replace(
    "'{reasoning_start}'", f"'{reasoning_start}'"
)
tokenizer.chat_template = chat_template

# %%
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

# %% Pre-format: a short SFT on worked solutions
import pandas as pd
from datasets import Dataset

# Local stand-in for load_dataset("unsloth/OpenMathReasoning-mini", split="cot").
dataset = Dataset.from_list(
    [
        {"expected_answer": "14", "problem": "What is 2 times 7?", "generated_solution": "<think>\nDouble seven.\n</think>\n14"},
        {"expected_answer": "x^2", "problem": "Simplify x times x.", "generated_solution": "<think>\nA square.\n</think>\nx^2"},
        {"expected_answer": "3", "problem": "What is 9 / 3?", "generated_solution": "<think>\nThree threes make nine.\n</think>\n3"},
        {"expected_answer": "10", "problem": "What is 6 + 4?", "generated_solution": "<think>\nCount up four from six.\n</think>\n10"},
    ]
).to_pandas()[["expected_answer", "problem", "generated_solution"]]  # fmt: skip

# Keep the rows whose answer is a number.
is_number = pd.to_numeric(pd.Series(dataset["expected_answer"]), errors="coerce").notnull()
dataset = dataset.iloc[is_number.values]


# %%
def format_dataset(x):
    thoughts = x["generated_solution"].replace("<think>", "").replace("</think>", "").strip()
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": x["problem"]},
        {
            "role": "assistant",
            "content": reasoning_start
            + thoughts
            + reasoning_end
            + solution_start
            + x["expected_answer"]
            + solution_end,
        },
    ]


dataset["Messages"] = dataset.apply(format_dataset, axis=1)

# %% Only conversations up to half the context
dataset["N"] = dataset["Messages"].apply(lambda x: len(tokenizer.apply_chat_template(x)))
dataset = dataset.loc[dataset["N"] <= max_seq_length / 2].copy()
pre_format_lengths = list(dataset["N"])

# %%
dataset["text"] = tokenizer.apply_chat_template(dataset["Messages"].values.tolist(), tokenize=False)
dataset = Dataset.from_pandas(dataset)

# %%
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
        max_steps=2,  # the notebook: num_train_epochs = 2
        learning_rate=2e-4,
        logging_steps=5,
        optim="adamw_8bit",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        report_to="none",
    ),
)

# %%
trainer.train()
pre_format_trainer = trainer

# %% Does it write the format?
text = tokenizer.apply_chat_template(dataset[0]["Messages"][:2], tokenize=False, add_generation_prompt=True)

from transformers import TextStreamer

_ = model.generate(
    **tokenizer(text, return_tensors="pt").to(model.device),  # the notebook writes .to("cuda")
    temperature=0,
    max_new_tokens=32,  # the notebook: 1,024
    streamer=TextStreamer(tokenizer, skip_prompt=False),
)

# %%
import gc

del dataset
torch.cuda.empty_cache()
gc.collect()

# %% GRPO data
# Local stand-in for load_dataset("open-r1/DAPO-Math-17k-Processed", "en", split="train").
dataset = Dataset.from_list(
    [
        {"prompt": "What is 3 + 4?", "solution": "7"},
        {"prompt": "What is 5 times 5?", "solution": "25"},
        {"prompt": "How many legs has a spider?", "solution": "8"},
        {"prompt": "What is 100 minus 1, written as a number of two or three digits?", "solution": "99"},
        {"prompt": "What is 12 / 4?", "solution": "3"},
    ]
)


# %%
def extract_hash_answer(text):
    return text


dataset = dataset.map(
    lambda x: {
        "prompt": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": x["prompt"]},
        ],
        "answer": extract_hash_answer(x["solution"]),
    }
)

# %% Reward functions
import re

# The end of the working out, then the solution, then at most whitespace and the EOS.
solution_end_regex = r"</SOLUTION>[\s]{0,}" + "(?:" + re.escape(tokenizer.eos_token) + ")?"
match_format = re.compile(
    rf"{reasoning_end}.*?{solution_start}(.+?){solution_end_regex}[\s]{{0,}}$",
    flags=re.MULTILINE | re.DOTALL,
)


def match_format_exactly(completions, **kwargs):
    return [3.0 if match_format.search(c[0]["content"]) is not None else 0.0 for c in completions]


def match_format_approximately(completions, **kwargs):
    scores = []
    for completion in completions:
        response = completion[0]["content"]
        # The generation prompt wrote reasoning_start: each other tag once.
        scores.append(
            sum(
                0.5 if response.count(tag) == 1 else -1.0
                for tag in (reasoning_end, solution_start, solution_end)
            )
        )
    return scores


def check_answer(prompts, completions, answer, **kwargs):
    guesses = [
        (found.group(1) if (found := match_format.search(c[0]["content"])) is not None else None)
        for c in completions
    ]
    scores = []
    for guess, true_answer in zip(guesses, answer):
        if guess is None:
            scores.append(-2.0)
        elif guess == true_answer:
            scores.append(5.0)
        elif guess.strip() == true_answer.strip():
            scores.append(3.5)
        else:
            try:
                ratio = float(guess) / float(true_answer)
                scores.append(2.0 if 0.9 <= ratio <= 1.1 else 1.5 if 0.8 <= ratio <= 1.2 else -2.5)
            except (ValueError, ZeroDivisionError):
                scores.append(-4.5)
    return scores


match_numbers = re.compile(solution_start + r".*?[\s]{0,}([-]?[\d\.\,]{1,})", flags=re.MULTILINE | re.DOTALL)
PRINTED_TIMES = 0
PRINT_EVERY_STEPS = 5


def check_numbers(prompts, completions, answer, **kwargs):
    global PRINTED_TIMES
    responses = [c[0]["content"] for c in completions]
    guesses = [
        (found.group(1) if (found := match_numbers.search(r)) is not None else None) for r in responses
    ]
    if PRINTED_TIMES % PRINT_EVERY_STEPS == 0:
        print(
            "*" * 20,
            f"Question:\n{prompts[0][-1]['content']}",
            f"\nAnswer:\n{answer[0]}",
            f"\nResponse:\n{responses[0]}",
        )
    PRINTED_TIMES += 1
    scores = []
    for guess, true_answer in zip(guesses, answer):
        try:
            scores.append(
                3.5 if float(guess.strip().replace(",", "")) == float(true_answer.strip()) else -1.5
            )
        except (AttributeError, ValueError):
            scores.append(-2.5 if guess is None else 0.0)
    return scores


# %% The prompts' lengths: keep those up to the 90th percentile
tokenized = dataset.map(
    lambda x: {
        "tokens": tokenizer.apply_chat_template(x["prompt"], add_generation_prompt=True, tokenize=True)
    },
    batched=True,
)
print(tokenizer.decode(tokenized[0]["tokens"]))
tokenized = tokenized.map(lambda x: {"L": len(x["tokens"])})

import numpy as np

maximum_length = int(np.quantile(tokenized["L"], 0.9))
print("Max Length = ", maximum_length)

dataset = dataset.select(np.where(np.array(tokenized["L"]) <= maximum_length)[0])
prompt_lengths = list(tokenized["L"])
del tokenized

# %% Train with GRPO
max_prompt_length = maximum_length + 1
max_completion_length = max_seq_length - max_prompt_length

from slothkit.vllm import SamplingParams

vllm_sampling_params = SamplingParams(
    min_p=0.1,
    top_p=1.0,
    top_k=-1,
    seed=3407,
    stop=[tokenizer.eos_token],
    include_stop_str_in_output=True,
)

from slothkit.trl import GRPOConfig, GRPOTrainer

training_args = GRPOConfig(
    vllm_sampling_params=vllm_sampling_params,
    temperature=1.0,
    learning_rate=5e-6,
    weight_decay=0.01,
    warmup_ratio=0.1,
    lr_scheduler_type="linear",
    optim="adamw_8bit",
    logging_steps=1,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=1,
    num_generations=4,
    max_prompt_length=max_prompt_length,
    max_completion_length=16,  # the notebook: max_completion_length
    max_steps=2,  # the notebook: 100
    save_steps=100,
    report_to="none",
    output_dir="outputs",
)

# %%
trainer = GRPOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=[
        match_format_exactly,
        match_format_approximately,
        check_answer,
        check_numbers,
    ],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()

# %% Inference: the model without the GRPO adapter
text = "What is the sqrt of 101?"

from slothkit.vllm import SamplingParams

sampling_params = SamplingParams(
    temperature=1.0,
    top_k=50,
    max_tokens=32,  # the notebook: 1,024
)
output = (
    model.fast_generate(
        [text],
        sampling_params=sampling_params,
        lora_request=None,
    )[0]
    .outputs[0]
    .text
)

print(output)

# %% Save the LoRA, and check that it is not all zeros
model.save_lora("grpo_saved_lora")

from safetensors import safe_open

tensors = {}
with safe_open("grpo_saved_lora/adapter_model.safetensors", framework="pt") as f:
    for key in f.keys():
        tensor = f.get_tensor(key)
        n_zeros = (tensor == 0).sum() / tensor.numel()
        assert n_zeros.item() != tensor.numel()

# %% Inference with the saved LoRA
messages = [
    {"role": "system", "content": system_prompt},
    {"role": "user", "content": "What is the sqrt of 101?"},
]

text = tokenizer.apply_chat_template(
    messages,
    add_generation_prompt=True,
    tokenize=False,
)
from slothkit.vllm import SamplingParams

sampling_params = SamplingParams(
    temperature=1.0,
    top_k=50,
    max_tokens=64,  # the notebook: 2,048
)
output = (
    model.fast_generate(
        text,
        sampling_params=sampling_params,
        lora_request=model.load_lora("grpo_saved_lora"),
    )[0]
    .outputs[0]
    .text
)

print(output)

# %% Merged 16-bit and 4-bit (the notebook: behind `if False:`, both into "model")
if True:
    model.save_pretrained_merged("model_16bit", tokenizer, save_method="merged_16bit")
if True:
    model.save_pretrained_merged("model_4bit", tokenizer, save_method="merged_4bit")

# %% Just the LoRA adapter (the notebook: behind `if False:`)
if True:
    model.save_pretrained("model")
    tokenizer.save_pretrained("model")

# %% GGUF: Q8_0, 16-bit and q4_k_m (the notebook: behind `if False:`)
if True:
    model.save_pretrained_gguf("model", tokenizer)
if True:
    model.save_pretrained_gguf("model", tokenizer, quantization_method="f16")
if True:
    model.save_pretrained_gguf("model", tokenizer, quantization_method="q4_k_m")
