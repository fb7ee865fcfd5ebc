"""Reward modelling: TRL's RewardTrainer on a sequence classifier with one output.

    model, tokenizer = FastModel.from_pretrained(path, num_labels=1)  # a score head
    model = FastModel.get_peft_model(model, r=16)  # LoRA, and the score head trained in full
    reward_trainer(model, tokenizer, pairs, args=reward_config(model)).train()

The loss is -log sigmoid(r(chosen) - r(rejected)) (Bradley-Terry), r being the score
head's output at the last token that is not padding.
"""

from __future__ import annotations

from slothkit.engine.inspection import causal_lm_of
from slothkit.trainers.checks import checked_trainer
from slothkit.trainers.configs import reward_config, trl_class


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


def reward_trainer(model, tokenizer, train_dataset, args=None, eval_dataset=None, **trainer_kwargs):
    """``trl.RewardTrainer`` after checking the model, the data and the setup, as
    ``sft_trainer``.

    Args:
        model: a reward model: ``FastModel.from_pretrained(..., num_labels=1)`` then
            ``FastModel.get_peft_model`` (which trains the score head in full).
        tokenizer: its tokenizer (TRL's processing_class).
        train_dataset: a ``datasets.Dataset`` of preference pairs: "chosen" and
            "rejected" columns, with or without "prompt" (text or conversations), and
            optionally a "margin" the reward difference should exceed.
        args: a ``trl.RewardConfig``; None (default): ``reward_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``trl.RewardTrainer`` (callbacks, ...).

    Returns:
        The ``trl.RewardTrainer``.

    Raises:
        ValueError: the model is not a one-output classifier, or the data or the setup
            would fail in training.
    """
    from slothkit.data.validation import check_preference_dataset

    check_reward_model(model)
    args = reward_config(model) if args is None else args
    return checked_trainer(
        trl_class("RewardTrainer"),
        model,
        tokenizer,
        args,
        check_preference_dataset,
        train_dataset,
        eval_dataset,
        **trainer_kwargs,
    )
