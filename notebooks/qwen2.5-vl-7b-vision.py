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
# # Vision fine-tune Qwen2.5-VL 7B Instruct with slothkit
#
# LoRA (or QLoRA, on 4-bit language weights) fine-tuning of an image-text model on
# images with their answers: by default the formula images shipped with slothkit, each
# to be read back as LaTeX (an OCR task). Then the model reads a formula, and saving:
# the LoRA adapter, a merged 16-bit model with its processor and, where slothkit writes
# the model's family, GGUF files for llama.cpp (the language model and its projector file),
# optionally pushed to the Hugging Face Hub.
#
# The defaults fit a free Colab or Kaggle T4 (15 GB) in 4 bits: about 6 GiB of language weights (NF4, with the 16-bit embeddings and head) and the 0.7B-parameter vision tower in 16 bits; the shipped formula images are a few image tokens each. Qwen/Qwen2.5-VL-7B-Instruct is quantised to NF4 by slothkit as it loads. Not measured on a T4. transformers builds Qwen2.5-VL's processor only where torchvision is installed (Colab and Kaggle have it). SAVE_GGUF writes Qwen2.5-VL's language model as GGUF (llama.cpp's qwen2vl graph), a file per GGUF_QUANTS (they quantise the language model only), and its vision tower and merger as llama.cpp's projector file (mmproj, F16; F32 only when every method is f32), for `llama-mtmd-cli --mmproj`; each file is checked by llama.cpp when llama-cpp-python is installed. Checked on a tiny random Qwen2.5-VL image-text model, not yet on Qwen2.5-VL 7B itself.
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
MODEL_NAME = "Qwen/Qwen2.5-VL-7B-Instruct"  # @param {type:"string"}
LOAD_IN_4BIT = True  # @param {type:"boolean"}
MAX_SEQ_LENGTH = 2048  # @param {type:"integer"}
LORA_R = 16  # @param {type:"integer"}
LORA_ALPHA = 16  # @param {type:"integer"}
LEARNING_RATE = 2e-4  # @param {type:"number"}
MAX_STEPS = 30  # @param {type:"integer"}
BATCH_SIZE = 2  # @param {type:"integer"}
GRAD_ACCUM = 4  # @param {type:"integer"}
DATASET = "example:latex_ocr"  # @param {type:"string"}
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
# ## 4. Load the model and its processor, add LoRA adapters

# %%
from slothkit import FastVisionModel

model, processor = FastVisionModel.from_pretrained(
    config.model_name, max_seq_length=config.max_seq_length, load_in_4bit=config.load_in_4bit
)
model = FastVisionModel.get_peft_model(
    model,
    finetune_vision_layers=False,  # True adapts the vision tower too: for images unlike its training
    finetune_language_layers=True,
    finetune_attention_modules=True,
    finetune_mlp_modules=True,
    r=config.lora_r,
    lora_alpha=config.lora_alpha,
    use_gradient_checkpointing="offload",  # the language layers' inputs wait in pinned host memory
)

# %% [markdown]
# ## 5. Data: chat messages with an image and the answer

# %%
from slothkit.notebook.training import load_configured_image_dataset

dataset = load_configured_image_dataset(config.dataset)
print(f"{len(dataset)} records; the first:")
print(dataset[0]["messages"])
dataset[0]["messages"][0]["content"][0]["image"]

# %% [markdown]
# ## 6. Ask it: an image and a question through the chat template, then generate, streamed

# %%
from transformers import TextStreamer


def ask(image, question, max_new_tokens=32):
    """The model's greedy answer about one image, printed token by token."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=[image], text=prompt, add_special_tokens=False, return_tensors="pt").to(model.device)
    streamer = TextStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    output = model.generate(**inputs, streamer=streamer, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# %% [markdown]
# ## 7. How it reads the first images before training

# %%
TEST_RECORDS = dataset[:2]
TEST_QUESTION = TEST_RECORDS[0]["messages"][0]["content"][1]["text"]
FastVisionModel.for_inference(model)  # eval mode with the KV cache, left padding
before = {}
for record in TEST_RECORDS:
    answer = record["messages"][1]["content"][0]["text"]
    print(f">>> expected {answer}")
    before[answer] = ask(record["messages"][0]["content"][0]["image"], TEST_QUESTION)
model = FastVisionModel.for_training(model)  # back to training mode before the trainer takes it

# %% [markdown]
# ## 8. Train on the answers, the images entering through the collator

# %%
from slothkit import VisionDataCollator
from slothkit.notebook.training import trainer_defaults
from slothkit.trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(
    model=model,
    processing_class=processor,
    data_collator=VisionDataCollator(model, processor, max_seq_length=config.max_seq_length),
    train_dataset=dataset,
    args=SFTConfig(
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        max_length=config.max_seq_length,
        # The collator renders and tokenizes the records: TRL passes them on as they are.
        remove_unused_columns=False,
        dataset_text_field="",
        dataset_kwargs={"skip_prepare_dataset": True},
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
# ## 9. Try it: the same images after training

# %%
from slothkit.notebook.inference import compare_answers

FastVisionModel.for_inference(model)
after = {}
for record in TEST_RECORDS:
    answer = record["messages"][1]["content"][0]["text"]
    print(f">>> expected {answer}")
    after[answer] = ask(record["messages"][0]["content"][0]["image"], TEST_QUESTION)  # or your own image
compare_answers(before, after)

# %% [markdown]
# ## 10. Save: the LoRA adapter, the merged 16-bit model with its processor, GGUF files (each behind its Config flag)

# %%
from slothkit.core.distributed import is_main_process
from slothkit.notebook.saving import image_text_gguf_wanted, list_files

out = config.output_dir
# SAVE_GGUF where slothkit writes this model's family as GGUF; for any other family this says why not.
save_gguf = image_text_gguf_wanted(model, config.save_gguf)
if is_main_process():  # under a multi-GPU launch every process holds the same adapters: one saves
    if config.save_lora:  # the adapter alone (megabytes), loaded on top of the base model
        model.save_pretrained(f"{out}/lora")
        processor.save_pretrained(f"{out}/lora")
    if config.save_merged:  # base, adapter, vision tower and processor files: for transformers, vLLM, ...
        model.save_pretrained_merged(
            f"{out}/merged-16bit", processor, save_method="merged_16bit", overwrite=True
        )
    if save_gguf:  # for llama.cpp: the language model, a file per GGUF_QUANTS, and its projector
        # file mmproj-MODEL.F16.gguf (F32 when every quant is f32), run together as
        # llama-mtmd-cli -m MODEL.Q4_K_M.gguf --mmproj mmproj-MODEL.F16.gguf --image photo.png
        model.save_pretrained_gguf(
            f"{out}/gguf", processor, quantization_method=config.gguf_quants, overwrite=True
        )
    list_files(out)

# %% [markdown]
# ## 11. Publish to the Hugging Face Hub (when HUB_REPO is set)

# %%
if config.hub_repo and is_main_process():
    token = config.hub_token or None  # None: HF_TOKEN, else the login `hf auth login` saved
    if config.save_lora:
        pushed = model.push_to_hub_merged(f"{config.hub_repo}-lora", processor, save_method="lora", token=token)
        print(pushed.commit_url)
    if config.save_merged:
        pushed = model.push_to_hub_merged(config.hub_repo, processor, save_method="merged_16bit", token=token)
        print(pushed.commit_url)
    if save_gguf:  # the GGUF files, their Modelfiles and the projector file, in one commit
        pushed = model.push_to_hub_gguf(
            f"{config.hub_repo}-gguf", processor, quantization_method=config.gguf_quants, token=token
        )
        print(pushed.commit_url)
