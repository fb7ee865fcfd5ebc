"""TRL on slothkit models: configs with defaults that fit the hardware, and trainer
constructors that check the data first.

    from slothkit.trainers import sft_config, sft_trainer
    trainer = sft_trainer(model, tokenizer, dataset, args=sft_config(model, max_steps=60))
    trainer.train()

The suite, one config and one constructor per method:

    method  config, trainer                  data                                 module
    SFT     sft_config, sft_trainer          text | conversations | prompt+completion  supervised
    DPO     dpo_config, dpo_trainer          prompt, chosen, rejected             preference
    ORPO    orpo_config, orpo_trainer        prompt, chosen, rejected             preference
    KTO     kto_config, kto_trainer          prompt, completion, label            preference
    GRPO    grpo_config, grpo_trainer        prompt, and reward functions         online
    RLOO    rloo_config, rloo_trainer        prompt, and reward functions         online
    reward  reward_config, reward_trainer    [prompt,] chosen, rejected           reward

The reward model is a sequence classifier, ``FastModel.from_pretrained(..., num_labels=1)``
(slothkit.trainers.reward); the others train the causal LM.  configs holds the defaults,
checks the setup checks, out_of_memory the explanation of a CUDA out-of-memory error.

How the trainers meet slothkit's fused model (TRL >= 1.16):

* SFT, DPO, KTO, GRPO and RLOO give the model TRL's own fused LM head (``trl.trainer.utils.
  add_fused_lm_head``): the loss, log-probabilities, entropy and accuracy are computed in
  tiles from the last hidden state, so the (batch, seq, vocab) logits are never built.
  The decoder layers still run slothkit's kernels; only the head's cross-entropy is TRL's.
* transformers' Trainer calls the model with labels: slothkit's forward returns its fused
  loss and logits=None.  Older TRL SFTTrainers did the same with ``loss_type="nll"`` (the
  default before TRL 1.x made "chunked_nll" the default) and then read ``outputs.logits``
  for their entropy and token-accuracy metrics, which fails on None: hence the version
  floor below (the lowest version tested with slothkit).
* Gradient accumulation: both paths divide the summed token losses by the number of
  trainable tokens of the whole accumulated batch (``num_items_in_batch``), so 2 x batch 1
  trains like batch 2.
* ORPO (trl.experimental in TRL 1.16) computes the logits with the model's own forward:
  slothkit's decoder layers, the plain LM head.  The reward model has no LM head.

Defaults that differ from TRL's, and why:

* checkpointing off (``activation_checkpointing=False``, ``gradient_checkpointing`` before
  transformers 5): FastModel.get_peft_model already set up checkpointing (offloaded by
  default); the Trainer's would replace it with plain checkpointing.
* ``bf16`` / ``fp16`` follow the model's compute dtype (TRL's default bf16=True fails on a
  T4 and is slow on a CPU); ``optim="adamw_8bit"`` when bitsandbytes and a GPU are there.
* ``max_length`` = the model's ``max_seq_length``; longer samples are truncated to it
  (keeping the start) by TRL, and samples left without a trainable token are dropped.
  GRPO and RLOO have no max_length: max_completion_length bounds what they generate.
* The trainer constructors here keep the adapters in the dtype get_peft_model gave them
  (float32): TRL's trainers cast a quantized model's adapters to bf16.
* Under torchrun or accelerate launch (WORLD_SIZE > 1), ``ddp_find_unused_parameters=False``:
  the Trainer would search for unused parameters (a PeftModel is not a PreTrainedModel),
  and the search cannot follow slothkit's offloaded checkpointing (slothkit.distributed).
* Learning rates for LoRA, per method (configs.LEARNING_RATES): SFT 2e-4, DPO, KTO, GRPO
  and RLOO 5e-6, ORPO 8e-6, reward 1e-4.
"""

from slothkit.trainers.checks import check_setup, checked_trainer, restore_adapter_dtypes
from slothkit.trainers.configs import (
    COMMON_DEFAULTS,
    LEARNING_RATES,
    MIN_TRL_VERSION,
    checkpointing_off,
    dpo_config,
    grpo_config,
    hardware_defaults,
    kto_config,
    machine_defaults,
    orpo_config,
    require_trl,
    reward_config,
    rloo_config,
    sft_config,
    training_arguments,
    trl_class,
)
from slothkit.trainers.online import grpo_trainer, rloo_trainer
from slothkit.trainers.out_of_memory import (
    TrainingOutOfMemoryError,
    explain_out_of_memory,
    out_of_memory_advice,
)
from slothkit.trainers.preference import dpo_trainer, kto_trainer, orpo_trainer
from slothkit.trainers.reward import check_reward_model, reward_trainer
from slothkit.trainers.supervised import sft_trainer

# Their names before slothkit.trainers became a package.
_checked_trainer = checked_trainer
_restore_adapter_dtypes = restore_adapter_dtypes

__all__ = [
    "COMMON_DEFAULTS",
    "LEARNING_RATES",
    "MIN_TRL_VERSION",
    "TrainingOutOfMemoryError",
    "check_reward_model",
    "check_setup",
    "checked_trainer",
    "dpo_config",
    "dpo_trainer",
    "explain_out_of_memory",
    "grpo_config",
    "grpo_trainer",
    "checkpointing_off",
    "hardware_defaults",
    "machine_defaults",
    "kto_config",
    "kto_trainer",
    "orpo_config",
    "orpo_trainer",
    "out_of_memory_advice",
    "require_trl",
    "restore_adapter_dtypes",
    "reward_config",
    "reward_trainer",
    "rloo_config",
    "rloo_trainer",
    "sft_config",
    "sft_trainer",
    "training_arguments",
    "trl_class",
]
