# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fine-tune gpt-oss-20b with slothkit
#
# LoRA (or QLoRA, on 4-bit weights) fine-tuning on instruction data in the Alpaca
# format, then a few test prompts, then saving: the LoRA adapter, a merged 16-bit
# model, and GGUF files for llama.cpp / Ollama / LM Studio, optionally pushed to the
# Hugging Face Hub.
#
# openai/gpt-oss-20b ships its experts in MXFP4, which trains in no kernel: slothkit has transformers dequantise them as they load and quantises each to NF4 as it arrives, but that checkpoint's attention then stays 16-bit; this notebook loads unsloth/gpt-oss-20b-BF16, a 16-bit copy whose attention loads in NF4 too and whose experts slothkit quantises to NF4 as they load: about 12 GiB of weights. With the experts' adapters that is more than a free T4's 15 GB, where the hardware cell stops and says so; an L4 (24 GB) or an A100 trains it as set. SAVE_GGUF is off here: slothkit writes gpt-oss as GGUF checked by llama.cpp at f16 and q8_0, not yet at the notebook's q4_k_m.
#
# Run the cells top to bottom. Change settings in the **Config** cell (a form on
# Colab, a panel in Jupyter and Kaggle).

# %% [markdown]
# ## 1. Install what is missing (Colab's torch and ipywidgets stay, where torch is 2.11 or newer)

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
MODEL_NAME = "unsloth/gpt-oss-20b-BF16"  # @param {type:"string"}
LOAD_IN_4BIT = True  # @param {type:"boolean"}
MAX_SEQ_LENGTH = 1024  # @param {type:"integer"}
LORA_R = 16  # @param {type:"integer"}
LORA_ALPHA = 16  # @param {type:"integer"}
LEARNING_RATE = 2e-4  # @param {type:"number"}
MAX_STEPS = 60  # @param {type:"integer"}
BATCH_SIZE = 2  # @param {type:"integer"}
GRAD_ACCUM = 4  # @param {type:"integer"}
DATASET = "example:alpaca"  # @param {type:"string"}
SAVE_LORA = True  # @param {type:"boolean"}
SAVE_MERGED = True  # @param {type:"boolean"}
SAVE_GGUF = False  # @param {type:"boolean"}
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
# ## 4. Load the model and add LoRA adapters

# %%
from slothkit import FastModel

model, tokenizer = FastModel.from_pretrained(
    config.model_name, max_seq_length=config.max_seq_length, load_in_4bit=config.load_in_4bit
)
model = FastModel.get_peft_model(
    model,
    r=config.lora_r,
    lora_alpha=config.lora_alpha,
    target_modules="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj".split(","),
    use_gradient_checkpointing="auto",  # keep the layers that fit in GPU memory, offload the rest
    batch_size=config.batch_size,
)

# %% [markdown]
# ## 5. Ask it: an Alpaca prompt, then generate, streamed as it comes

# %%
from transformers import TextStreamer

from slothkit.data import alpaca_prompt


def ask(instruction, max_new_tokens=48):
    """The model's greedy answer to one instruction, printed token by token."""
    inputs = tokenizer(alpaca_prompt(instruction), return_tensors="pt").to(model.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    print(f">>> {instruction}")
    output = model.generate(**inputs, streamer=streamer, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# %% [markdown]
# ## 6. How it answers before training

# %%
# A few steps teach a small model the answers' form (one sentence, then stop), not facts
# it lacks: questions it can answer show the change without a wrong fact in the "after".
TEST_PROMPTS = ["What is 12 plus 30?", "What is the capital of France?"]
FastModel.for_inference(model)  # eval mode with the KV cache (on a GPU, slothkit's fast decode loop)
before = {prompt: ask(prompt) for prompt in TEST_PROMPTS}
FastModel.for_training(model)  # back to training mode before the trainer takes it

# %% [markdown]
# ## 7. Data: instruction / input / response records, formatted as Alpaca prompts ending in EOS

# %%
from slothkit.data import format_alpaca
from slothkit.notebook.training import load_configured_dataset

dataset = format_alpaca(load_configured_dataset(config.dataset), tokenizer)
print(dataset)
print(dataset[0]["text"])

# %% [markdown]
# ## 8. Train

# %%
from slothkit.notebook.training import trainer_defaults
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    processing_class=tokenizer,
    train_dataset=dataset,
    args=SFTConfig(
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        max_length=config.max_seq_length,
        dataset_text_field="text",
        packing=False,
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
assert result.loss_went_down, f"the loss did not go down: {result.losses}"

# %% [markdown]
# ## 9. Try it: the same prompts after training

# %%
from slothkit.notebook.inference import compare_answers

FastModel.for_inference(model)
after = {prompt: ask(prompt) for prompt in TEST_PROMPTS}  # ask your own: ask("...")
compare_answers(before, after)

# %% [markdown]
# ## 10. Save: the LoRA adapter, the merged 16-bit model, GGUF files (each behind its Config flag)

# %%
from slothkit.core.distributed import is_main_process
from slothkit.notebook.saving import list_files

out = config.output_dir
if is_main_process():  # under a multi-GPU launch every process holds the same adapters: one saves
    if config.save_lora:  # the adapter alone (megabytes), loaded on top of the base model
        model.save_pretrained(f"{out}/lora")
        tokenizer.save_pretrained(f"{out}/lora")
    if config.save_merged:  # base and adapter as one 16-bit checkpoint, for transformers, vLLM, ...
        model.save_pretrained_merged(
            f"{out}/merged-16bit", tokenizer, save_method="merged_16bit", overwrite=True
        )
    if config.save_gguf:  # for llama.cpp, Ollama (a Modelfile beside each file) and LM Studio
        model.save_pretrained_gguf(
            f"{out}/gguf", tokenizer, quantization_method=config.gguf_quants, overwrite=True
        )
    list_files(out)

# %% [markdown]
# ## 11. Publish to the Hugging Face Hub (when HUB_REPO is set)

# %%
if config.hub_repo and is_main_process():
    token = config.hub_token or None  # None: HF_TOKEN, else the login `hf auth login` saved
    if config.save_lora:
        pushed = model.push_to_hub_merged(f"{config.hub_repo}-lora", tokenizer, save_method="lora", token=token)
        print(pushed.commit_url)
    if config.save_merged:
        pushed = model.push_to_hub_merged(config.hub_repo, tokenizer, save_method="merged_16bit", token=token)
        print(pushed.commit_url)
    if config.save_gguf:
        pushed = model.push_to_hub_gguf(
            f"{config.hub_repo}-gguf", tokenizer, quantization_method=config.gguf_quants, token=token
        )
        print(pushed.commit_url)
