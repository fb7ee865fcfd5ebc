# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Reinforcement-learn ${display_name} with GRPO and slothkit
#
# Group Relative Policy Optimisation with LoRA (or QLoRA): for each prompt the model
# samples a group of completions, reward functions score them, and each completion is
# made more likely or less by how its reward compares with the rest of its group. No
# reference answers to imitate, only a way to score one: here arithmetic questions whose
# reply must give the number between `<answer>` and `</answer>`, rewarded for that form
# and for the right number. Then a streamed chat test, and saving: LoRA adapter, merged
# 16-bit model, GGUF files, optionally pushed to the Hugging Face Hub.
#
# ${gpu_fit}

# %include install

# %% Config
MODEL_NAME = "${model_4bit}"  # @param {type:"string"}
LOAD_IN_4BIT = True  # @param {type:"boolean"}
MAX_SEQ_LENGTH = ${max_seq_length}  # @param {type:"integer"}
LORA_R = 16  # @param {type:"integer"}
LORA_ALPHA = 16  # @param {type:"integer"}
LEARNING_RATE = 5e-6  # @param {type:"number"}
MAX_STEPS = 60  # @param {type:"integer"}
# Each step trains BATCH_SIZE x GRAD_ACCUM completions: that many / NUM_GENERATIONS prompts.
BATCH_SIZE = ${t4_batch}  # @param {type:"integer"}
GRAD_ACCUM = ${t4_grad_accum}  # @param {type:"integer"}
NUM_GENERATIONS = 4  # @param {type:"integer"}
MAX_COMPLETION_LENGTH = 64  # @param {type:"integer"}
DATASET = "example:math"  # @param {type:"string"}
CHAT_TEMPLATE = "${chat_template}"  # @param {type:"string"}
SAVE_LORA = True  # @param {type:"boolean"}
SAVE_MERGED = True  # @param {type:"boolean"}
SAVE_GGUF = ${save_gguf}  # @param {type:"boolean"}
GGUF_QUANTS = "q4_k_m,q8_0"  # @param {type:"string"}
OUTPUT_DIR = "outputs"  # @param {type:"string"}
HUB_REPO = ""  # @param {type:"string"}

from slothkit.notebook import NotebookConfig

config = NotebookConfig.from_cell(globals())
config.show()

# %include hardware

# %include load_chat

# %% Data: prompts (conversational), and the answer column the rewards check
from slothkit.notebook.training import load_configured_dataset

dataset = load_configured_dataset(config.dataset)
print(dataset)
print(dataset[0])

# %% Reward functions: one for the form of the reply, one for the right number
import re

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def format_reward(completions, **kwargs):
    """0.5 for a reply that gives a number between the tags (a completion of a
    conversational prompt is a list holding the assistant's message)."""
    return [0.5 if ANSWER.search(completion[-1]["content"]) else 0.0 for completion in completions]


def correct_reward(completions, answer, **kwargs):
    """2 for the right number between the tags; `answer` is the dataset's column."""
    found = [ANSWER.search(completion[-1]["content"]) for completion in completions]
    return [
        2.0 if match and match.group(1) == str(expected) else 0.0 for match, expected in zip(found, answer)
    ]


# %include ask_chat

# %% How it answers before training
TEST_PROMPTS = [record["prompt"][-1]["content"] for record in dataset.select(range(2))]
FastModel.for_inference(model)  # eval mode with the KV cache (on a GPU, slothkit's fast decode loop)
before = {prompt: ask(prompt) for prompt in TEST_PROMPTS}
FastModel.for_training(model)  # back to training mode before the trainer takes it

# %% Train with GRPO
from slothkit.notebook.training import trainer_defaults
from slothkit.trl import GRPOConfig, GRPOTrainer

trainer = GRPOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=[format_reward, correct_reward],
    train_dataset=dataset,
    args=GRPOConfig(
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
        beta=0.0,  # the KL term's weight; at 0 no reference pass (adapters off) runs
        per_device_train_batch_size=config.batch_size,  # completions, not prompts
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        warmup_steps=5,
        lr_scheduler_type="linear",
        weight_decay=0.01,
        logging_steps=1,
        seed=3407,
        output_dir=f"{config.output_dir}/checkpoints",
        save_strategy="no",
        report_to="none",
        **trainer_defaults(model),  # bf16 / fp16, optim, ...: chosen for this machine, and printed
    ),
)

# %%
from slothkit.notebook.training import report_training

# Each step samples NUM_GENERATIONS completions per prompt (on a GPU through slothkit's
# fast decode loop, docs/trainers.md), then updates; the mean reward should rise.
trainer_stats = trainer.train()
result = report_training(trainer, trainer_stats)

# %include try_it

# %include save
