# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Gemma 3 (4B) Vision, LaTeX OCR (Unsloth's "Gemma3 (4B)-Vision" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words.  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `unsloth.trainer` and `trl` -> `slothkit.trl`;
# - the model and the data are local: the tiny offline image-text Gemma 3 (or `MODEL` when
#   the caller gives one), and slothkit's shipped formula images with their LaTeX for
#   unsloth/LaTeX_OCR, whose columns they have; `max_steps` is 2;
# - on a machine without CUDA: `.to("cuda")` is `.to(model.device)`, the model loads in 16
#   bits, and `optim="adamw_torch_fused"` is `"adamw_torch"` (each marked below);
# - the save cells behind `if False:` run (users flip them); pushing to the Hub stays off.

# %%
import torch

from slothkit import FastVisionModel
from slothkit.testing.tiny_image_text import tiny_image_text_path

MODEL = globals().get("MODEL") or str(tiny_image_text_path("gemma3"))  # stand-in for the Hub id
ON_GPU = torch.cuda.is_available()

model, processor = FastVisionModel.from_pretrained(
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
    target_modules="all-linear",
    modules_to_save=["lm_head", "embed_tokens"],
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


converted_dataset = [convert_to_conversation(sample) for sample in dataset]

# %%
converted_dataset[0]

# %% Gemma 3's chat template on the processor
from slothkit.chat_templates import get_chat_template

processor = get_chat_template(processor, "gemma-3")

# %% Before training
FastVisionModel.for_inference(model)

image = dataset[2]["image"]
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
input_text = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(image, input_text, add_special_tokens=False, return_tensors="pt").to(
    model.device  # the notebook writes .to("cuda")
)

from transformers import TextStreamer

text_streamer = TextStreamer(processor, skip_prompt=True)
result = model.generate(
    **inputs,
    streamer=text_streamer,
    max_new_tokens=128,
    use_cache=True,
    temperature=1.0,
    top_p=0.95,
    top_k=64,
)

# %% Train
from slothkit.trl import SFTConfig, SFTTrainer, UnslothVisionDataCollator

FastVisionModel.for_training(model)

trainer = SFTTrainer(
    model=model,
    train_dataset=converted_dataset,
    processing_class=processor.tokenizer,
    data_collator=UnslothVisionDataCollator(model, processor),
    args=SFTConfig(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_grad_norm=0.3,
        warmup_ratio=0.03,
        max_steps=2,
        learning_rate=2e-4,
        logging_steps=1,
        save_strategy="steps",
        optim="adamw_torch_fused" if ON_GPU else "adamw_torch",  # the notebook: adamw_torch_fused
        weight_decay=0.01,
        lr_scheduler_type="cosine",
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

image = dataset[2]["image"]
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
input_text = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(image, input_text, add_special_tokens=False, return_tensors="pt").to(
    model.device  # the notebook writes .to("cuda")
)
text_streamer = TextStreamer(processor, skip_prompt=True)
result = model.generate(
    **inputs,
    streamer=text_streamer,
    max_new_tokens=128,
    use_cache=True,
    temperature=1.0,
    top_p=0.95,
    top_k=64,
)

# %% Save the LoRA adapter
model.save_pretrained("lora_model")
processor.save_pretrained("lora_model")

# %% Merged 16-bit (the notebook: behind `if False:`)
if True:
    model.save_pretrained_merged("unsloth_finetune", processor)
