# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Qwen2.5-VL (7B), LaTeX OCR (Unsloth's "Qwen2.5_VL (7B)-Vision" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.trainer` and `trl` -> `slothkit.trl`;
# - the model and the data are local: the tiny offline image-text Qwen2.5-VL where
#   transformers builds its processor (it needs torchvision), else the tiny image-text
#   Gemma 3, whose calls are the same (or `MODEL` when the caller gives one); slothkit's
#   shipped formula images with their LaTeX stand in for unsloth/LaTeX_OCR, whose columns
#   they have; `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)` and the model loads in
#   16 bits (each marked below);
# - the save cells behind `if False:` run (users flip them); pushing to the Hub stays off.

# %%
import torch

from slothkit import FastVisionModel
from slothkit.testing.tiny_image_text import image_text_processor_loads, tiny_image_text_path

STAND_IN = "qwen2_5_vl" if image_text_processor_loads("qwen2_5_vl") is None else "gemma3"
MODEL = globals().get("MODEL") or str(tiny_image_text_path(STAND_IN))  # stand-in for the Hub id
ON_GPU = torch.cuda.is_available()

model, tokenizer = FastVisionModel.from_pretrained(
    MODEL,
    load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    use_gradient_checkpointing="unsloth",
)

# %%
model = FastVisionModel.get_peft_model(
    model,
    finetune_vision_layers=True,
    finetune_language_layers=True,
    finetune_attention_modules=True,
    finetune_mlp_modules=True,
    r=16,
    lora_alpha=16,
    lora_dropout=0,
    bias="none",
    random_state=3407,
    use_rslora=False,
    loftq_config=None,
)

# %% Data: images with their LaTeX
from slothkit.data import example_images

dataset = example_images()[:8]  # local stand-in for load_dataset("unsloth/LaTeX_OCR", split="train")

# %%
dataset[2]["image"]

# %%
dataset[2]["text"]

# %%
instruction = "Write the LaTeX representation for this image."


def convert_to_conversation(sample):
    conversation = [
        {
            "role": "user",
            "content": [{"type": "text", "text": instruction}, {"type": "image", "image": sample["image"]}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": sample["text"]}]},
    ]
    return {"messages": conversation}


# %%
converted_dataset = [convert_to_conversation(sample) for sample in dataset]

# %%
converted_dataset[0]

# %% Before training: the image, then the instruction, through the processor's chat template
FastVisionModel.for_inference(model)

image = dataset[2]["image"]
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
input_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
inputs = tokenizer(image, input_text, add_special_tokens=False, return_tensors="pt").to(
    model.device  # the notebook writes .to("cuda")
)

from transformers import TextStreamer

text_streamer = TextStreamer(tokenizer, skip_prompt=True)
_ = model.generate(
    **inputs, streamer=text_streamer, max_new_tokens=128, use_cache=True, temperature=1.5, min_p=0.1
)

# %% Train
from slothkit import is_bf16_supported
from slothkit.trl import SFTConfig, SFTTrainer, UnslothVisionDataCollator

FastVisionModel.for_training(model)

trainer = SFTTrainer(
    model=model,
    tokenizer=tokenizer,
    data_collator=UnslothVisionDataCollator(model, tokenizer),
    train_dataset=converted_dataset,
    args=SFTConfig(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        warmup_steps=5,
        max_steps=2,
        learning_rate=2e-4,
        fp16=not is_bf16_supported(),
        bf16=is_bf16_supported(),
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir="outputs",
        report_to="none",
        remove_unused_columns=False,
        dataset_text_field="",
        dataset_kwargs={"skip_prepare_dataset": True},
        dataset_num_proc=4,
        max_seq_length=2048,
    ),
)

# %%
trainer_stats = trainer.train()

# %% After training
FastVisionModel.for_inference(model)

image = dataset[2]["image"]
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
input_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
inputs = tokenizer(image, input_text, add_special_tokens=False, return_tensors="pt").to(
    model.device  # the notebook writes .to("cuda")
)
text_streamer = TextStreamer(tokenizer, skip_prompt=True)
outputs = model.generate(
    **inputs, streamer=text_streamer, max_new_tokens=128, use_cache=True, temperature=1.5, min_p=0.1
)

# %% Save the LoRA adapter
model.save_pretrained("lora_model")
tokenizer.save_pretrained("lora_model")

# %% Merged 16-bit (the notebook: behind `if False:`)
if True:
    model.save_pretrained_merged("unsloth_finetune", tokenizer)
