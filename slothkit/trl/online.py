"""Online RL: GRPO and RLOO, TRL's trainers with slothkit's setup (slothkit.trl.setup).

Both sample completions of each prompt from the policy (through slothkit's fast decode
loop: slothkit.trl.on_policy_generation), score them with reward functions or reward
models, and weight each completion's log-probabilities by its advantage: GRPO against its
group's mean reward (scaled by its spread), RLOO against the mean of the other completions
of its prompt (leave one out).

``max_prompt_length`` (dropped by TRL 1.16, which no longer cuts these trainers' prompts):
the prompts longer than it are left out of the training set, said once with their number
(the older cut kept a prompt's last tokens, dropping a chat prompt's system turn); a
dataset with none shorter is refused.  Unsloth's ``use_vllm`` and
``vllm_sampling_params``: slothkit.trl.online_configs.
"""

from __future__ import annotations

import trl

from slothkit.core.notices import DataWarning, say_once
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
            kwargs["train_dataset"] = _without_long_prompts(
                kwargs.get("train_dataset"), kwargs.get("processing_class"), limit
            )
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


def _without_long_prompts(dataset, tokenizer, limit: int):
    """The dataset without its prompts of more than `limit` tokens, said once with their
    number (module docstring); refused when none is left."""
    if dataset is None or tokenizer is None or "prompt" not in (dataset.column_names or []):
        return dataset
    kept, longest = [], None
    for index, prompt in enumerate(dataset["prompt"]):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        if len(ids) <= limit:
            kept.append(index)
        elif longest is None or len(ids) > longest[1]:
            longest = (index, len(ids))
    if longest is None:
        return dataset
    dropped = len(dataset) - len(kept)
    if not kept:
        raise ValueError(
            f"every prompt is longer than max_prompt_length={limit} (prompt {longest[0]}: {longest[1]} tokens), and "
            "TRL 1.16's GRPOTrainer and RLOOTrainer no longer cut prompts: raise max_prompt_length or leave it out"
        )
    say_once(
        f"max_prompt_length={limit}: {dropped} of {len(dataset)} prompts are longer (the longest, prompt "
        f"{longest[0]}, {longest[1]} tokens) and are left out of training; TRL 1.16 no longer cuts prompts, and "
        "cutting a chat prompt would drop its system turn (filter them out yourself to keep this quiet)",
        DataWarning,
    )
    return dataset.select(kept)


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
