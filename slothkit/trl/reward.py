"""Reward modelling: TRL's RewardTrainer, with slothkit's setup (slothkit.trl.setup), on
a sequence classifier with one output.

    model, tokenizer = FastModel.from_pretrained(path, num_labels=1)  # a score head
    model = FastModel.get_peft_model(model, r=16)  # LoRA, and the score head trained in full
    RewardTrainer(model=model, processing_class=tokenizer, train_dataset=pairs,
                  args=reward_config(model)).train()  # reward_config: slothkit.trl.defaults

The loss is -log sigmoid(r(chosen) - r(rejected)) (Bradley-Terry), r being the score
head's output at the last token that is not padding.
"""

from __future__ import annotations

import trl

from slothkit.core.inspection import causal_lm_of
from slothkit.data.validation import check_preference_dataset
from slothkit.trl.configs import RewardConfig
from slothkit.trl.setup import TrainerSetup


def check_reward_model(model) -> None:
    """Refuse a model RewardTrainer would misuse: one without a single-output score head.

    Args:
        model: the model to train (a PeftModel or a plain model).

    Raises:
        ValueError: the model is a causal LM, or a classifier with more than one label.
    """
    base = causal_lm_of(model)
    if not type(base).__name__.endswith("ForSequenceClassification"):
        raise ValueError(
            f"a reward model scores a sequence with one number, but this model is a {type(base).__name__}; "
            "load it as one with FastModel.from_pretrained(..., num_labels=1)"
        )
    if base.config.num_labels != 1:
        raise ValueError(
            f"a reward model has one output, but this classifier has num_labels={base.config.num_labels}; "
            "load it with FastModel.from_pretrained(..., num_labels=1)"
        )


class RewardTrainer(TrainerSetup, trl.RewardTrainer):
    """``trl.RewardTrainer`` with slothkit's setup (slothkit.trl.setup), refusing a model
    that is not a one-output classifier (``check_reward_model``).

    Args:
        model: a reward model (``FastModel.from_pretrained(..., num_labels=1)`` then
            ``FastModel.get_peft_model``, which trains the score head in full) or a model
            name.
        args: a ``RewardConfig``, a ``TrainingArguments`` (converted) or None
            (``slothkit.trl.defaults.reward_config(model)`` with the options given here).
        **kwargs: ``trl.RewardTrainer``'s keywords (processing_class, train_dataset:
            "chosen" and "rejected" columns, with or without "prompt", optionally a
            "margin"), ``tokenizer=``, and RewardConfig fields such as max_length.

    Raises:
        ValueError: the model is not a one-output classifier, or the data or the setup
            would fail in training.
    """

    _trl_trainer = trl.RewardTrainer
    _config_class = RewardConfig
    _method = "reward"

    def __init__(self, model=None, args=None, **kwargs):
        if model is not None and not isinstance(model, str):
            check_reward_model(model)
        args, kwargs = self._modern_keywords(model, args, kwargs)
        self._build(model, args, kwargs)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_preference_dataset(dataset, name=name)
