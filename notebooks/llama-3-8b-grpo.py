# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Reinforcement-learn Llama 3 8B Instruct with GRPO and slothkit
#
# Group Relative Policy Optimisation with LoRA (or QLoRA): for each prompt the model
# samples a group of completions, reward functions score them, and each completion is
# made more likely or less by how its reward compares with the rest of its group. No
# reference answers to imitate, only a way to score one: here arithmetic questions whose
# reply must give the number between `<answer>` and `</answer>`, rewarded for that form
# and for the right number. Then a streamed chat test, and saving: LoRA adapter, merged
# 16-bit model, GGUF files, optionally pushed to the Hugging Face Hub. The defaults fit
# a free Colab or Kaggle T4.

# %% [markdown]
# ## 1. Install what is missing (never replaces Colab's torch or ipywidgets)

# %%
import glob
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("slothkit") is None:
    # In order: SLOTHKIT_PIP_SPEC, the newest slothkit wheel uploaded next to this notebook
    # (Colab's Files pane, a Kaggle dataset), then PyPI.
    wheels = glob.glob("slothkit-*.whl") + glob.glob("/content/slothkit-*.whl") + glob.glob("/kaggle/input/*/slothkit-*.whl")
    tried = [s for s in [os.environ.get("SLOTHKIT_PIP_SPEC"), *sorted(wheels, key=os.path.getmtime)[-1:], "slothkit"] if s]
    if not any(subprocess.call([sys.executable, "-m", "pip", "install", "-q", spec]) == 0 for spec in tried):
        raise RuntimeError(
            f"pip could not install slothkit from {' or '.join(map(repr, tried))} (pip says why above). "
            "This cell installs slothkit from, in order: the pip spec in the SLOTHKIT_PIP_SPEC environment "
            "variable (a wheel file, a git URL or a version), a slothkit-*.whl uploaded next to this notebook "
            "(Colab: the Files pane; Kaggle: add it as a dataset), then PyPI. Build a wheel in a slothkit "
            "checkout with `pip wheel --no-deps -w dist .`, upload dist/slothkit-*.whl, and run this cell again."
        )
from slothkit.notebook import prepare_runtime

runtime = prepare_runtime()

# %% [markdown]
# ## 2. Config

# %%
MODEL_NAME = "unsloth/llama-3-8b-Instruct-bnb-4bit"  # @param {type:"string"}
LOAD_IN_4BIT = True  # @param {type:"boolean"}
MAX_SEQ_LENGTH = 2048  # @param {type:"integer"}
LORA_R = 16  # @param {type:"integer"}
LORA_ALPHA = 16  # @param {type:"integer"}
LEARNING_RATE = 5e-6  # @param {type:"number"}
MAX_STEPS = 60  # @param {type:"integer"}
# Each step trains BATCH_SIZE x GRAD_ACCUM completions: that many / NUM_GENERATIONS prompts.
BATCH_SIZE = 2  # @param {type:"integer"}
GRAD_ACCUM = 4  # @param {type:"integer"}
NUM_GENERATIONS = 4  # @param {type:"integer"}
MAX_COMPLETION_LENGTH = 64  # @param {type:"integer"}
DATASET = "example:math"  # @param {type:"string"}
CHAT_TEMPLATE = "llama-3"  # @param {type:"string"}
SAVE_LORA = True  # @param {type:"boolean"}
SAVE_MERGED = True  # @param {type:"boolean"}
SAVE_GGUF = True  # @param {type:"boolean"}
GGUF_QUANTS = "q4_k_m,q8_0"  # @param {type:"string"}
OUTPUT_DIR = "outputs"  # @param {type:"string"}
HUB_REPO = ""  # @param {type:"string"}

from slothkit.notebook import NotebookConfig

config = NotebookConfig.from_cell(globals())
config.show()

# %% [markdown]
# ## 3. Hardware and memory plan

# %%
from slothkit.notebook.hardware import hardware_report

config = hardware_report(config)

# %% [markdown]
# ## 4. Load the model, set its chat template, add LoRA adapters

# %%
from slothkit import FastModel
from slothkit.data import get_chat_template

model, tokenizer = FastModel.from_pretrained(
    config.model_name, max_seq_length=config.max_seq_length, load_in_4bit=config.load_in_4bit
)
tokenizer = get_chat_template(tokenizer, config.chat_template, model=model)
model = FastModel.get_peft_model(
    model,
    r=config.lora_r,
    lora_alpha=config.lora_alpha,
    target_modules="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj".split(","),
    use_gradient_checkpointing="auto",  # keep the layers that fit in GPU memory, offload the rest
    batch_size=config.batch_size,
)

# %% [markdown]
# ## 5. Data: prompts (conversational), and the answer column the rewards check

# %%
from slothkit.notebook.training import load_configured_dataset

dataset = load_configured_dataset(config.dataset)
print(dataset)
print(dataset[0])

# %% [markdown]
# ## 6. Reward functions: one for the form of the reply, one for the right number

# %%
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


# %% [markdown]
# ## 7. How it answers before training

# %%
from slothkit.notebook.inference import answer_prompts

TEST_PROMPTS = [record["prompt"][-1]["content"] for record in dataset.select(range(2))]
before = answer_prompts(model, tokenizer, TEST_PROMPTS, kind="chat")

# %% [markdown]
# ## 8. Train with GRPO

# %%
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

# %% [markdown]
# ## 9. Chat with it: the same messages after training

# %%
from slothkit.notebook.inference import compare_answers

# Ask your own the same way: answer_prompts(model, tokenizer, ["..."], kind="chat")
after = answer_prompts(model, tokenizer, TEST_PROMPTS, kind="chat")
compare_answers(before, after)

# %% [markdown]
# ## 10. Save and publish (each behind its Config flag)

# %%
from slothkit.notebook.saving import save_all

saved = save_all(model, tokenizer, config)
for kind, path in saved.items():
    print(f"{kind:12s} {path}")
