"""Online RL: GRPO and RLOO, TRL's trainers with slothkit's setup (slothkit.trl.setup).

Both sample completions of each prompt from the policy (through slothkit's fast decode
loop: slothkit.trl.on_policy_generation), score them with reward functions or reward
models, and weight each completion's log-probabilities by its advantage: GRPO against its
group's mean reward (scaled by its spread), RLOO against the mean of the other completions
of its prompt (leave one out).

``max_prompt_length`` (dropped by TRL 1.16, which no longer cuts these trainers' prompts):
a dataset with a longer prompt is refused.  Unsloth's ``use_vllm`` and
``vllm_sampling_params``: slothkit.trl.online_configs.
"""

from __future__ import annotations

import trl

from slothkit.data.validation import check_prompt_dataset
from slothkit.trl.configs import GRPOConfig, RLOOConfig
from slothkit.trl.on_policy_generation import generate_on_fast_path
from slothkit.trl.setup import TrainerSetup


class _OnlineTrainer(TrainerSetup):
    """What GRPOTrainer and RLOOTrainer add to the setup: the prompt lengths checked, the
    prompts' records checked, and sampling through the fast decode loop."""

    def __init__(self, model=None, reward_funcs=None, args=None, fast_generation=None, **kwargs):
        args, kwargs = self._modern_keywords(model, args, kwargs)
        limit = getattr(args, "max_prompt_length", None)
        if limit is not None:
            _check_prompt_lengths(kwargs.get("train_dataset"), kwargs.get("processing_class"), limit)
        _check_stop_strings(getattr(args, "vllm_sampling_params", None), kwargs.get("processing_class"))
        self._build(model, args, {"reward_funcs": reward_funcs, **kwargs})
        generate_on_fast_path(self, self.model, fast_generation)

    def _check_dataset(self, dataset, tokenizer, args, kwargs, name):
        check_prompt_dataset(dataset, name=name)


class GRPOTrainer(_OnlineTrainer, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with slothkit's setup (slothkit.trl.setup), sampling through
    slothkit's fast decode loop.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        reward_funcs: a reward function, a reward model's name, or a list of them, as
            ``trl.GRPOTrainer`` takes.
        args: a ``GRPOConfig``, a ``TrainingArguments`` (converted) or None
            (``slothkit.trl.defaults.grpo_config(model)`` with the options given here).
        fast_generation: how completions are sampled: None (default) through slothkit's
            fast decode loop where it pays, True also on a CPU, False Hugging Face's
            generate (slothkit.trl.on_policy_generation).
        **kwargs: ``trl.GRPOTrainer``'s keywords (processing_class, train_dataset: a
            "prompt" column, text or conversations, ...), ``tokenizer=``, and GRPOConfig
            fields.

    Raises:
        ValueError: the data or the setup would fail in training, or a prompt is longer
            than max_prompt_length.
    """

    _trl_trainer = trl.GRPOTrainer
    _config_class = GRPOConfig
    _method = "grpo"


class RLOOTrainer(_OnlineTrainer, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` with slothkit's setup, as GRPOTrainer.

    Args:
        model: the model (from ``FastModel.get_peft_model``) or a model name.
        reward_funcs: as ``trl.RLOOTrainer``.
        args: an ``RLOOConfig``, a ``TrainingArguments`` (converted) or None
            (``slothkit.trl.defaults.rloo_config(model)`` with the options given here).
        fast_generation: as for GRPOTrainer.
        **kwargs: ``trl.RLOOTrainer``'s keywords, ``tokenizer=``, and RLOOConfig fields.

    Raises:
        ValueError: as GRPOTrainer.
    """

    _trl_trainer = trl.RLOOTrainer
    _config_class = RLOOConfig
    _method = "rloo"


def _check_prompt_lengths(dataset, tokenizer, limit: int) -> None:
    if dataset is None or tokenizer is None or "prompt" not in (dataset.column_names or []):
        return
    for index, prompt in enumerate(dataset["prompt"]):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        if len(ids) > limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens, more than max_prompt_length={limit}, and TRL 1.16's "
                f"GRPOTrainer and RLOOTrainer no longer cut prompts: drop the long ones first (dataset.filter(...)) or leave "
                "max_prompt_length out"
            )


def _check_stop_strings(params, tokenizer) -> None:
    """Refuse vllm_sampling_params' stop strings other than the EOS token, where sampling
    ends anyway (slothkit.trl.online_configs)."""
    stops = getattr(params, "stop", None) or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    eos = getattr(getattr(tokenizer, "tokenizer", tokenizer), "eos_token", None)
    others = [stop for stop in stops if stop != eos]
    if others:
        raise ValueError(
            f"vllm_sampling_params=SamplingParams(stop={others!r}): the trainer's sampling ends each completion at "
            f"the EOS token ({eos!r}) or max_completion_length, not at other strings; leave them out of stop"
        )
