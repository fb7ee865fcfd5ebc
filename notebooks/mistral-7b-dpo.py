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
# # Preference-tune Mistral 7B Instruct v0.3 with DPO and slothkit
#
# Direct Preference Optimisation with LoRA (or QLoRA): each record has a prompt, a
# chosen reply and a rejected one, and the model learns to prefer the chosen. The
# reference model is the same model with its adapters switched off, so no second
# copy is held in memory. Then a streamed chat test, and saving: LoRA adapter,
# merged 16-bit model, GGUF files, optionally pushed to the Hugging Face Hub. The
# defaults fit a free Colab or Kaggle T4.

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
MODEL_NAME = "unsloth/mistral-7b-instruct-v0.3-bnb-4bit"  # @param {type:"string"}
LOAD_IN_4BIT = True  # @param {type:"boolean"}
MAX_SEQ_LENGTH = 2048  # @param {type:"integer"}
LORA_R = 16  # @param {type:"integer"}
LORA_ALPHA = 16  # @param {type:"integer"}
LEARNING_RATE = 5e-6  # @param {type:"number"}
MAX_STEPS = 60  # @param {type:"integer"}
BATCH_SIZE = 2  # @param {type:"integer"}
GRAD_ACCUM = 4  # @param {type:"integer"}
DATASET = "example:preference"  # @param {type:"string"}
CHAT_TEMPLATE = "mistral"  # @param {type:"string"}
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
# ## 5. How it answers before training

# %%
from slothkit.notebook.inference import answer_prompts

TEST_PROMPTS = ["Convert 3 kilometres to metres.", "What is the capital of France?"]
before = answer_prompts(model, tokenizer, TEST_PROMPTS, kind="chat")

# %% [markdown]
# ## 6. Data: prompt / chosen / rejected records (conversational or plain text)

# %%
from slothkit.notebook.training import load_configured_dataset

dataset = load_configured_dataset(config.dataset)
print(dataset)
print(dataset[0])

# %% [markdown]
# ## 7. Train with DPO

# %%
from slothkit.notebook.training import trainer_defaults
from slothkit.trl import DPOConfig, DPOTrainer

trainer = DPOTrainer(
    model=model,
    ref_model=None,  # the model with its adapters switched off: no second copy in memory
    processing_class=tokenizer,
    train_dataset=dataset,
    args=DPOConfig(
        beta=0.1,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        max_length=config.max_seq_length,
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

trainer_stats = trainer.train()
result = report_training(trainer, trainer_stats)
assert result.loss_went_down, f"the DPO loss did not go down: {result.losses}"

# %% [markdown]
# ## 8. Chat with it: the same messages after training

# %%
from slothkit.notebook.inference import compare_answers

# Ask your own the same way: answer_prompts(model, tokenizer, ["..."], kind="chat")
after = answer_prompts(model, tokenizer, TEST_PROMPTS, kind="chat")
compare_answers(before, after)

# %% [markdown]
# ## 9. Save and publish (each behind its Config flag)

# %%
from slothkit.notebook.saving import save_all

saved = save_all(model, tokenizer, config)
for kind, path in saved.items():
    print(f"{kind:12s} {path}")
