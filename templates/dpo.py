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
# # Preference-tune ${display_name} with DPO and slothkit
#
# Direct Preference Optimisation with LoRA (or QLoRA): each record has a prompt, a
# chosen reply and a rejected one, and the model learns to prefer the chosen. The
# reference model is the same model with its adapters switched off, so no second
# copy is held in memory. Then a streamed chat test, and saving: LoRA adapter,
# merged 16-bit model, GGUF files, optionally pushed to the Hugging Face Hub.
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
BATCH_SIZE = ${t4_batch}  # @param {type:"integer"}
GRAD_ACCUM = ${t4_grad_accum}  # @param {type:"integer"}
DATASET = "example:preference"  # @param {type:"string"}
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

# %include ask_chat

# %include chat_before

# %% Data: prompt / chosen / rejected records (conversational or plain text)
from slothkit.notebook.training import load_configured_dataset

dataset = load_configured_dataset(config.dataset)
print(dataset)
print(dataset[0])

# %% Train with DPO
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

# %include try_it

# %include save
