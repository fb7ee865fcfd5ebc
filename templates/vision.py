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
# # Vision fine-tune ${display_name} with slothkit
#
# LoRA (or QLoRA, on 4-bit language weights) fine-tuning of an image-text model on
# images with their answers: by default the formula images shipped with slothkit, each
# to be read back as LaTeX (an OCR task). Then the model reads a formula, and saving:
# the LoRA adapter, a merged 16-bit model with its processor and, where slothkit writes
# the model's family, GGUF files for llama.cpp (the language model and its projector file),
# optionally pushed to the Hugging Face Hub.
#
# ${gpu_fit}
#
# Run the cells top to bottom. Change settings in the **Config** cell (a form on
# Colab, a panel in Jupyter and Kaggle).

# %include install

# %% Config
MODEL_NAME = "${model_4bit}"  # @param {type:"string"}
LOAD_IN_4BIT = True  # @param {type:"boolean"}
MAX_SEQ_LENGTH = ${max_seq_length}  # @param {type:"integer"}
LORA_R = 16  # @param {type:"integer"}
LORA_ALPHA = 16  # @param {type:"integer"}
LEARNING_RATE = 2e-4  # @param {type:"number"}
MAX_STEPS = 30  # @param {type:"integer"}
BATCH_SIZE = ${t4_batch}  # @param {type:"integer"}
GRAD_ACCUM = ${t4_grad_accum}  # @param {type:"integer"}
DATASET = "example:latex_ocr"  # @param {type:"string"}
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

# %% Load the model and its processor, add LoRA adapters
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

# %% Data: chat messages with an image and the answer
from slothkit.notebook.training import load_configured_image_dataset

dataset = load_configured_image_dataset(config.dataset)
print(f"{len(dataset)} records; the first:")
print(dataset[0]["messages"])
dataset[0]["messages"][0]["content"][0]["image"]

# %% Ask it: an image and a question through the chat template, then generate, streamed
from transformers import TextStreamer


def ask(image, question, max_new_tokens=32):
    """The model's greedy answer about one image, printed token by token."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=[image], text=prompt, add_special_tokens=False, return_tensors="pt").to(model.device)
    streamer = TextStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    output = model.generate(**inputs, streamer=streamer, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# %% How it reads the first images before training
TEST_RECORDS = dataset[:2]
TEST_QUESTION = TEST_RECORDS[0]["messages"][0]["content"][1]["text"]
FastVisionModel.for_inference(model)  # eval mode with the KV cache, left padding
before = {}
for record in TEST_RECORDS:
    answer = record["messages"][1]["content"][0]["text"]
    print(f">>> expected {answer}")
    before[answer] = ask(record["messages"][0]["content"][0]["image"], TEST_QUESTION)
model = FastVisionModel.for_training(model)  # back to training mode before the trainer takes it

# %% Train on the answers, the images entering through the collator
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

# %% Try it: the same images after training
from slothkit.notebook.inference import compare_answers

FastVisionModel.for_inference(model)
after = {}
for record in TEST_RECORDS:
    answer = record["messages"][1]["content"][0]["text"]
    print(f">>> expected {answer}")
    after[answer] = ask(record["messages"][0]["content"][0]["image"], TEST_QUESTION)  # or your own image
compare_answers(before, after)

# %% Save: the LoRA adapter, the merged 16-bit model with its processor, GGUF files (each behind its Config flag)
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

# %% Publish to the Hugging Face Hub (when HUB_REPO is set)
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
