"""Online RL: GRPO and RLOO, TRL's trainers after slothkit's checks.

Both sample completions of each prompt from the policy (through slothkit's fast decode
loop: on_policy_generation.py), score them
with reward functions or reward models, and weight each completion's log-probabilities
by its advantage: GRPO against its group's mean reward (scaled by its spread), RLOO
against the mean of the other completions of its prompt (leave one out).
"""

from __future__ import annotations

from slothkit.trainers.checks import checked_trainer
from slothkit.trainers.configs import grpo_config, rloo_config, trl_class
from slothkit.trainers.on_policy_generation import generate_on_fast_path


def _online_trainer(
    name, make_config, model, tokenizer, reward_funcs, train_dataset, args, eval_dataset, kwargs
):
    from slothkit.data.validation import check_prompt_dataset

    args = make_config(model) if args is None else args
    fast = kwargs.pop("fast_generation", None)
    trainer = checked_trainer(
        trl_class(name),
        model,
        tokenizer,
        args,
        check_prompt_dataset,
        train_dataset,
        eval_dataset,
        reward_funcs=reward_funcs,
        **kwargs,
    )
    return generate_on_fast_path(trainer, model, fast)


def grpo_trainer(
    model, tokenizer, reward_funcs, train_dataset, args=None, eval_dataset=None, **trainer_kwargs
):
    """``trl.GRPOTrainer`` after checking the prompts and the setup, as ``sft_trainer``.

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        reward_funcs: a reward function, a reward model's name, or a list of them, as
            ``trl.GRPOTrainer`` takes.
        train_dataset: a ``datasets.Dataset`` with a "prompt" column (text or
            conversations).
        args: a ``trl.GRPOConfig``; None (default): ``grpo_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``trl.GRPOTrainer``; ``fast_generation=`` (None, True,
            False) chooses how completions are sampled (slothkit.trainers.on_policy_generation).

    Returns:
        The ``trl.GRPOTrainer``.

    Raises:
        ValueError: the data or the setup would fail in training.
    """
    return _online_trainer(
        "GRPOTrainer",
        grpo_config,
        model,
        tokenizer,
        reward_funcs,
        train_dataset,
        args,
        eval_dataset,
        trainer_kwargs,
    )


def rloo_trainer(
    model, tokenizer, reward_funcs, train_dataset, args=None, eval_dataset=None, **trainer_kwargs
):
    """``trl.RLOOTrainer`` after checking the prompts and the setup, as ``sft_trainer``.

    Args:
        model: the model from ``FastModel.get_peft_model``.
        tokenizer: its tokenizer (TRL's processing_class).
        reward_funcs: a reward function, a reward model's name, or a list of them, as
            ``trl.RLOOTrainer`` takes.
        train_dataset: a ``datasets.Dataset`` with a "prompt" column (text or
            conversations).
        args: a ``trl.RLOOConfig``; None (default): ``rloo_config(model)``.
        eval_dataset: an evaluation dataset of the same kind (default None).
        **trainer_kwargs: passed to ``trl.RLOOTrainer``; ``fast_generation=`` as for
            ``grpo_trainer``.

    Returns:
        The ``trl.RLOOTrainer``.

    Raises:
        ValueError: the data or the setup would fail in training.
    """
    return _online_trainer(
        "RLOOTrainer",
        rloo_config,
        model,
        tokenizer,
        reward_funcs,
        train_dataset,
        args,
        eval_dataset,
        trainer_kwargs,
    )
