# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Qwen2.5 (3B) GRPO (Unsloth's "Qwen2.5 (3B) GRPO" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words: GSM8K prompts in a system + user chat, five reward functions,
# GRPO with `use_vllm=True`, vLLM-style generation before and after with the saved LoRA.
# What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` -> `slothkit.trl`, `vllm` -> `slothkit.vllm`;
# - the model and the data are local (a tiny offline Qwen2, or `MODEL` when the caller
#   gives one; a few rows in memory with GSM8K's columns, one of them a question longer
#   than max_prompt_length, as GSM8K has), training runs 2 steps (the notebook: 250) with
#   completions of 16 tokens (the notebook: 200) and the answers are 32 tokens long (the
#   notebook: 1,024);
# - the model loads in 16 bits without CUDA (marked below);
# - the save cells stay behind `if False:` as in the notebook (the other scripts run them).

# %%
import torch

from slothkit import FastLanguageModel, is_bfloat16_supported  # noqa: F401 (imported, unused, as in the notebook)
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("qwen2"))  # stand-in for "unsloth/Qwen2.5-3B-Instruct"
ON_GPU = torch.cuda.is_available()

max_seq_length = 1024
lora_rank = 64

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=MODEL,
    max_seq_length=max_seq_length,
    load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    fast_inference=True,
    max_lora_rank=lora_rank,
    gpu_memory_utilization=0.9,
)

model = FastLanguageModel.get_peft_model(
    model,
    r=min(lora_rank, 32),  # the notebook: lora_rank (the tiny model's k_proj is 32 wide)
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha=lora_rank,
    use_gradient_checkpointing="unsloth",
    random_state=3407,
)

# %% Data
import re

from datasets import Dataset

SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""


def extract_xml_answer(text: str) -> str:
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def extract_hash_answer(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.split("####")[1].strip()


# Local stand-in for load_dataset("openai/gsm8k", "main")["train"].
GSM8K = Dataset.from_list(
    [
        {"question": "Tom has 3 apples and buys 4 more. How many apples has he?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "A box holds 6 eggs. How many eggs are in 5 boxes?", "answer": "6 * 5 = 30\n#### 30"},
        {"question": "Sara reads 12 pages a day. How many pages does she read in 3 days?", "answer": "12 * 3 = 36\n#### 36"},
        {"question": "There are 20 birds and 8 fly away. How many are left?", "answer": "20 - 8 = 12\n#### 12"},
        {"question": "A long story about a farmer. " * 40 + "How many cows?", "answer": "2 + 2 = 4\n#### 4"},
        {"question": "Ben has 9 marbles and gives away 4. How many remain?", "answer": "9 - 4 = 5\n#### 5"},
    ]
)  # fmt: skip


def get_gsm8k_questions(split="train") -> Dataset:
    data = GSM8K  # the notebook: load_dataset("openai/gsm8k", "main")[split]
    data = data.map(
        lambda x: {
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": x["question"]},
            ],
            "answer": extract_hash_answer(x["answer"]),
        }
    )
    return data


dataset = get_gsm8k_questions()


# %% Reward functions
def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    question = prompts[0][-1]["content"]
    extracted_responses = [extract_xml_answer(r) for r in responses]
    print("-" * 20, f"Question:\n{question}", f"\nAnswer:\n{answer[0]}", f"\nResponse:\n{responses[0]}")
    return [2.0 if r == a else 0.0 for r, a in zip(extracted_responses, answer)]


def int_reward_func(completions, **kwargs) -> list[float]:
    extracted = [extract_xml_answer(completion[0]["content"]) for completion in completions]
    return [0.5 if r.isdigit() else 0.0 for r in extracted]


def strict_format_reward_func(completions, **kwargs) -> list[float]:
    pattern = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
    return [0.5 if re.match(pattern, completion[0]["content"]) else 0.0 for completion in completions]


def soft_format_reward_func(completions, **kwargs) -> list[float]:
    pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
    return [0.5 if re.match(pattern, completion[0]["content"]) else 0.0 for completion in completions]


def count_xml(text) -> float:
    count = 0.0
    for tag in ("<reasoning>\n", "\n</reasoning>\n"):
        count += 0.125 if text.count(tag) == 1 else 0.0
    if text.count("\n<answer>\n") == 1:
        count += 0.125 - len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125 - (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def xmlcount_reward_func(completions, **kwargs) -> list[float]:
    return [count_xml(completion[0]["content"]) for completion in completions]


# %% Train
from slothkit.trl import GRPOConfig, GRPOTrainer

training_args = GRPOConfig(
    use_vllm=True,
    learning_rate=5e-6,
    adam_beta1=0.9,
    adam_beta2=0.99,
    weight_decay=0.1,
    warmup_ratio=0.1,
    lr_scheduler_type="cosine",
    optim="adamw_8bit",
    logging_steps=1,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=1,
    num_generations=8,
    max_prompt_length=256,
    max_completion_length=16,  # the notebook: 200
    max_steps=2,  # the notebook: 250
    save_steps=250,
    max_grad_norm=0.1,
    report_to="none",
    output_dir="outputs",
)

# %%
trainer = GRPOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=[
        xmlcount_reward_func,
        soft_format_reward_func,
        strict_format_reward_func,
        int_reward_func,
        correctness_reward_func,
    ],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()

# %% Inference before GRPO's adapter
text = tokenizer.apply_chat_template(
    [{"role": "user", "content": "How many r's are in strawberry?"}],
    tokenize=False,
    add_generation_prompt=True,
)

from slothkit.vllm import SamplingParams

sampling_params = SamplingParams(
    temperature=0.8,
    top_p=0.95,
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

# %% Save the LoRA and generate with it
model.save_lora("grpo_saved_lora")

# %%
text = tokenizer.apply_chat_template(
    [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "How many r's are in strawberry?"},
    ],
    tokenize=False,
    add_generation_prompt=True,
)

from slothkit.vllm import SamplingParams

sampling_params = SamplingParams(
    temperature=0.8,
    top_p=0.95,
    max_tokens=32,  # the notebook: 1,024
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

# %% Saving (behind `if False:` as in the notebook)
if False:
    model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
