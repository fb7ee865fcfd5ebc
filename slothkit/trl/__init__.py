"""TRL's trainers and configs for slothkit models, under TRL's names: what a user builds.

    from slothkit.trl import SFTTrainer, SFTConfig
    from slothkit.trl.defaults import sft_config  # slothkit's defaults for this machine

    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset,
                         args=sft_config(model, max_steps=60))
    trainer.train()

One layer: each trainer is a subclass of TRL's (TRL and transformers themselves are left
as they are), and slothkit's hardware-aware defaults are config factories in
slothkit.trl.defaults that the trainers use when given no config.  Each trainer takes the
keywords older notebooks pass, checks the setup and the data before TRL sees them, keeps
the adapters in float32 and explains a CUDA out-of-memory error (slothkit.trl.setup).

The trainers, each with its TRL class, config, defaults and data, are the records of
slothkit.trl.registry (``TRAINERS``; docs/trainers.md shows them as a table): supervised
(SFT), preference (DPO, ORPO, KTO), online (GRPO, RLOO) and reward define them.

The other modules: configs (the configs taking older keywords), library (TRL's version
floor and where it keeps each class), on_policy_generation (GRPO's and RLOO's sampling
through the fast decode loop), out_of_memory, unsloth (Unsloth's trainer names).

How the trainers meet slothkit's fused model (TRL >= 1.16):

* SFT, DPO, KTO, GRPO and RLOO give the model TRL's own fused LM head (``trl.trainer.utils.
  add_fused_lm_head``): the loss, log-probabilities, entropy and accuracy are computed in
  tiles from the last hidden state, so the (batch, seq, vocab) logits are never built.
  The decoder layers still run slothkit's kernels; only the head's cross-entropy is TRL's.
* transformers' Trainer calls the model with labels: slothkit's forward returns its fused
  loss and logits=None.  Older TRL SFTTrainers did the same with ``loss_type="nll"`` (the
  default before TRL 1.x made "chunked_nll" the default) and then read ``outputs.logits``
  for their entropy and token-accuracy metrics, which fails on None: hence the version
  floor (slothkit.trl.library).
* Gradient accumulation: both paths divide the summed token losses by the number of
  trainable tokens of the whole accumulated batch (``num_items_in_batch``), so 2 x batch 1
  trains like batch 2.
* ORPO (trl.experimental in TRL 1.16) computes the logits with the model's own forward:
  slothkit's decoder layers, the plain LM head.  The reward model (a sequence classifier,
  ``FastModel.from_pretrained(..., num_labels=1)``) has no LM head.
* TRL's trainers cast a quantized model's adapters to bf16; these keep the dtype
  get_peft_model gave them (float32).
"""

from slothkit.trl.configs import (
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    ORPOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
    TrainingArguments,
    UnslothTrainingArguments,
)
from slothkit.trl.online import GRPOTrainer, RLOOTrainer
from slothkit.trl.preference import DPOTrainer, KTOTrainer, ORPOTrainer
from slothkit.trl.reward import RewardTrainer
from slothkit.trl.supervised import SFTTrainer
from slothkit.trl.unsloth import PatchDPOTrainer, UnslothTrainer, UnslothVisionDataCollator, unsloth_train

# Named one by one, so that editors and type checkers see them; test_trl_registry.py
# checks that these are exactly the registered trainers and configs.
__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "ORPOConfig",
    "ORPOTrainer",
    "PatchDPOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "TrainingArguments",
    "UnslothTrainer",
    "UnslothTrainingArguments",
    "UnslothVisionDataCollator",
    "unsloth_train",
]
