# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Llama 3.2 (11B) Vision, radiography captions (Unsloth's "Llama3.2 (11B)-Vision"
# # notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.trainer` and `trl` -> `slothkit.trl`;
# - the model and the data are local: the tiny offline Llama 3.2 Vision (Mllama: a
#   cross-attention layer reads the image's tiles; or `MODEL` when the caller gives one),
#   and slothkit's shipped formula images, their LaTeX as the `caption` column, stand in
#   for unsloth/Radiology_mini (its columns are `image` and `caption`); `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)` and the model loads in
#   16 bits (each marked below);
# - the cells behind `if False:` run (users flip them): the saved adapter reloads through
#   FastVisionModel.from_pretrained, and that model is saved merged in 16 bits; pushing to
#   the Hub stays off.

# %%
import torch

from slothkit import FastVisionModel
from slothkit.testing.tiny_image_text import tiny_image_text_path

MODEL = globals().get("MODEL") or str(tiny_image_text_path("mllama"))  # stand-in for the Hub id
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

# %% Data: images with their captions
from slothkit.data import example_images

# local stand-in for load_dataset("unsloth/Radiology_mini", split="train")
dataset = [{"image": record["image"], "caption": record["text"]} for record in example_images()[:8]]

# %%
dataset[0]["image"]

# %%
dataset[0]["caption"]

# %%
instruction = "You are an expert radiographer. Describe accurately what you see in this image."


def convert_to_conversation(sample):
    conversation = [
        {
            "role": "user",
            "content": [{"type": "text", "text": instruction}, {"type": "image", "image": sample["image"]}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": sample["caption"]}]},
    ]
    return {"messages": conversation}


# %%
converted_dataset = [convert_to_conversation(sample) for sample in dataset]

# %%
converted_dataset[0]

# %% Before training: the image, then the instruction, through the processor's chat template
FastVisionModel.for_inference(model)

image = dataset[0]["image"]
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
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.001,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir="outputs",
        report_to="none",
        remove_unused_columns=False,
        dataset_text_field="",
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=2048,
    ),
)

# %%
trainer_stats = trainer.train()

# %% After training
FastVisionModel.for_inference(model)

image = dataset[0]["image"]
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
model.save_pretrained("llama_lora")
tokenizer.save_pretrained("llama_lora")

# %% Reload it for inference (the notebook: behind `if False:`)
if True:
    model, tokenizer = FastVisionModel.from_pretrained(
        model_name="llama_lora",
        load_in_4bit=ON_GPU,  # the notebook: True; 16 bits on the CPU runner
    )
    FastVisionModel.for_inference(model)

image = dataset[0]["image"]
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
input_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
inputs = tokenizer(image, input_text, add_special_tokens=False, return_tensors="pt").to(
    model.device  # the notebook writes .to("cuda")
)
text_streamer = TextStreamer(tokenizer, skip_prompt=True)
reloaded_outputs = model.generate(
    **inputs, streamer=text_streamer, max_new_tokens=128, use_cache=True, temperature=1.5, min_p=0.1
)

# %% Merged 16-bit (the notebook: behind `if False:`)
if True:
    model.save_pretrained_merged("unsloth_finetune", tokenizer)
