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
# merged 16-bit model, GGUF files, optionally pushed to the Hugging Face Hub. The
# defaults fit a free Colab or Kaggle T4.

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
SAVE_GGUF = True  # @param {type:"boolean"}
GGUF_QUANTS = "q4_k_m,q8_0"  # @param {type:"string"}
OUTPUT_DIR = "outputs"  # @param {type:"string"}
HUB_REPO = ""  # @param {type:"string"}

from slothkit.notebook import NotebookConfig

config = NotebookConfig.from_cell(globals())
config.show()

# %include hardware

# %include load_chat

# %include chat_before

# %% Data: prompt / chosen / rejected records (conversational or plain text)
from slothkit.notebook.training import load_configured_dataset

dataset = load_configured_dataset(config.dataset)
print(dataset)
print(dataset[0])

# %% Train with DPO
from slothkit.notebook.training import train

result = train(model, tokenizer, dataset, config, method="dpo")
assert result.loss_went_down, f"the DPO loss did not go down: {result.losses}"

# %include chat_test

# %include save
