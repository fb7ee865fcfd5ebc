"""slothkit.trl's trainers, one record each: what slothkit.trl exports, what the docs' table
of trainers shows, and what the tests enrol every trainer by.

A record names the trainer; the rest is read from where it is defined once: the trainer's
class says which TRL trainer it extends (``_trl_trainer``), the config it takes
(``_config_class``, slothkit.trl.configs) and its key in slothkit's defaults (``_method``);
slothkit.trl.defaults holds the defaults (``LEARNING_RATES``) and the config factory
(``<method>_config``).  A new trainer is its class, its config, its learning rate and
factory, and a record here; tests/slothkit/test_trl_registry.py names any part missing.
"""

from __future__ import annotations

import dataclasses

from slothkit.trl import defaults
from slothkit.trl.online import GRPOTrainer, RLOOTrainer
from slothkit.trl.preference import DPOTrainer, KTOTrainer, ORPOTrainer
from slothkit.trl.reward import RewardTrainer
from slothkit.trl.supervised import SFTTrainer


@dataclasses.dataclass(frozen=True)
class TrainerRecord:
    """One trainer of slothkit.trl."""

    label: str  # the method's name in the docs ("SFT", "reward model")
    trainer: type  # slothkit.trl's trainer, under TRL's name
    data: str  # the columns its training data holds, as docs/trainers.md writes them

    @property
    def method(self) -> str:
        """The trainer's key in slothkit's defaults ("sft", "dpo", ...)."""
        return self.trainer._method

    @property
    def trl_trainer(self) -> type:
        """TRL's trainer class, which the trainer extends."""
        return self.trainer._trl_trainer

    @property
    def config(self) -> type:
        """The config the trainer takes (slothkit.trl.configs), under TRL's name."""
        return self.trainer._config_class

    @property
    def learning_rate(self) -> float:
        """slothkit's default LoRA learning rate for the method."""
        return defaults.LEARNING_RATES[self.method]

    @property
    def factory(self):
        """slothkit's config factory for the method (slothkit.trl.defaults)."""
        return getattr(defaults, f"{self.method}_config")


TRAINERS: tuple[TrainerRecord, ...] = (
    TrainerRecord("SFT", SFTTrainer, "`text`, `messages`/`conversations`, or `prompt` + `completion`"),
    TrainerRecord("DPO", DPOTrainer, "`prompt`, `chosen`, `rejected`"),
    TrainerRecord("ORPO", ORPOTrainer, "`prompt`, `chosen`, `rejected`"),
    TrainerRecord("KTO", KTOTrainer, "`prompt`, `completion`, `label` (True: desirable), or DPO's pairs"),
    TrainerRecord("GRPO", GRPOTrainer, "`prompt`, and reward functions"),
    TrainerRecord("RLOO", RLOOTrainer, "`prompt`, and reward functions"),
    TrainerRecord("reward model", RewardTrainer, "`chosen`, `rejected` (and `prompt`, `margin`)"),
)
TRAINERS_BY_METHOD = {record.method: record for record in TRAINERS}
