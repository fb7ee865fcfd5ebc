# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Zephyr 7B, DPO (Unsloth's "Zephyr (7B) DPO" notebook), on slothkit
#
# The notebook's calls, in its order and with its keyword arguments, written here in
# slothkit's own words (its data helpers, adapted from the alignment handbook, are
# written afresh: they turn each UltraFeedback pair into prompt / chosen / rejected text
# with the tokenizer's chat template).  What differs from the notebook:
#
# - the imports: `unsloth` -> `slothkit`, `trl` -> `slothkit.trl`;
# - the model and the data are local (a tiny offline Llama, or `MODEL` when the caller
#   gives one; a few UltraFeedback-style pairs in memory, as the train and test splits),
#   and 2 steps (`max_steps=2`) replace `num_train_epochs=3`; `max_seq_length` stays 4096,
#   twice the tiny model's context, so RoPE is scaled as for a short-context checkpoint;
# - `r=64` exceeds the tiny model's narrowest projection (k_proj, 32 wide), which slothkit
#   refuses: 32 here unless the model is wider;
# - on a machine without CUDA the model loads in 16 bits (marked below).
#
# The notebook ends with training: it has no inference or saving cells.

# %%
from slothkit import PatchDPOTrainer

PatchDPOTrainer()

# %%
import torch

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path

MODEL = globals().get("MODEL") or str(tiny_model_path("llama"))  # local stand-in for the Hub id
ON_GPU = torch.cuda.is_available()

max_seq_length = 4096
dtype = None
load_in_4bit = ON_GPU  # 16-bit LoRA on the CPU runner: bitsandbytes' CPU 4-bit path is slow

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=MODEL,
    max_seq_length=max_seq_length,
    dtype=dtype,
    load_in_4bit=load_in_4bit,
)

# %% Data: each preference pair as text, the prompt ending where the assistant begins
from datasets import Dataset, DatasetDict


def as_dpo_text(example, tokenizer):
    """prompt: the system turn (empty when there is none) and the first user turn, with the
    generation prompt; chosen / rejected: what each whole conversation adds after it."""
    texts = {}
    for key in ("chosen", "rejected"):
        turns = example[key]
        system = turns[0] if turns[0]["role"] == "system" else {"role": "system", "content": ""}
        user = next(m for m in turns if m["role"] == "user")
        reply = next(m for m in turns if m["role"] == "assistant")
        prompt = tokenizer.apply_chat_template([system, user], tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template([system, user, reply], tokenize=False)
        if not whole.startswith(prompt):
            raise ValueError(
                f"the chat template does not render the prompt as the start of the {key} conversation"
            )
        texts["text_prompt"], texts[f"text_{key}"] = prompt, whole[len(prompt) :]
    return texts


def pair(question, good, bad):
    def conversation(reply):
        return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]

    return {
        "prompt": question,
        "chosen": conversation(good),
        "rejected": conversation(bad),
        "messages": conversation(good),
        "score_chosen": 8.0,
        "score_rejected": 3.0,
    }


# Local stand-in for 0.5% of HuggingFaceH4/ultrafeedback_binarized's train_prefs and test_prefs.
raw_datasets = DatasetDict(
    {
        "train": Dataset.from_list(
            [
                pair("Which planet is closest to the sun?", "Mercury.", "Jupiter."),
                pair("How many legs does a spider have?", "Eight.", "Six."),
                pair("What is 2 + 2?", "4.", "5."),
                pair("Name a primary colour.", "Red.", "Green."),
                pair(
                    "What is the boiling point of water at sea level?", "100 degrees Celsius.", "50 degrees."
                ),
                pair("Which animal is known for being slow?", "The sloth.", "The cheetah."),
            ]
        ),
        "test": Dataset.from_list([pair("What is 3 + 3?", "6.", "7.")]),
    }
)
column_names = list(raw_datasets["train"].features)
raw_datasets = raw_datasets.map(
    as_dpo_text,
    fn_kwargs={"tokenizer": tokenizer},
    remove_columns=column_names,
    desc="Formatting comparisons with prompt template",
)
for split in ["train", "test"]:
    raw_datasets[split] = raw_datasets[split].rename_columns(
        {"text_prompt": "prompt", "text_chosen": "chosen", "text_rejected": "rejected"}
    )

# %%
import pprint

row = raw_datasets["train"][5]
pprint.pprint(row["prompt"])
pprint.pprint(row["chosen"])
pprint.pprint(row["rejected"])

# %%
narrowest = min(
    min(m.in_features, m.out_features) for n, m in model.named_modules() if n.endswith(("k_proj", "v_proj"))
)
model = FastLanguageModel.get_peft_model(
    model,
    r=min(64, narrowest),  # the notebook's 64 where the model is that wide
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha=64,
    lora_dropout=0,
    bias="none",
    use_gradient_checkpointing="unsloth",
    random_state=3407,
    use_rslora=False,
    loftq_config=None,
)

# %%
from slothkit import PatchDPOTrainer

PatchDPOTrainer()

# %% Train
from slothkit.trl import DPOConfig, DPOTrainer

dpo_trainer = DPOTrainer(
    model=model,
    ref_model=None,
    args=DPOConfig(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        warmup_ratio=0.1,
        max_steps=2,  # the notebook: num_train_epochs=3
        learning_rate=5e-6,
        logging_steps=1,
        optim="adamw_8bit",
        weight_decay=0.0,
        lr_scheduler_type="linear",
        seed=42,
        output_dir="outputs",
        report_to="none",
    ),
    beta=0.1,
    train_dataset=raw_datasets["train"],
    tokenizer=tokenizer,
    max_length=1024,
    max_prompt_length=512,
)

# %%
dpo_trainer.train()
