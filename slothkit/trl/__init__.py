"""TRL's trainers and configs under the names older notebooks import, taking the keywords
those notebooks pass (``tokenizer=``, options given to the trainer instead of its config,
``TrainingArguments`` where a TRL config is expected, ``warmup_ratio``) and saying once how
each is written now.

    from slothkit.trl import SFTTrainer, SFTConfig, TrainingArguments

The classes are subclasses: TRL and transformers themselves are left as they are.
slothkit.trl.configs lists what the configs translate, slothkit.trl.trainers what the
trainers do.
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
from slothkit.trl.trainers import (
    DPOTrainer,
    GRPOTrainer,
    KTOTrainer,
    ORPOTrainer,
    PatchDPOTrainer,
    RewardTrainer,
    RLOOTrainer,
    SFTTrainer,
    UnslothTrainer,
    unsloth_train,
)

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
    "unsloth_train",
]
