"""What GRPOConfig and RLOOConfig take beyond TRL's keywords, as Unsloth's GRPO notebooks
write them:

    use_vllm=True               use_vllm=False: slothkit samples through its own fast decode
                                loop (slothkit.trl.on_policy_generation), with no vLLM engine
    vllm_sampling_params=p      p's temperature, top_p, top_k, min_p and repetition_penalty,
                                where they differ from vLLM's defaults, become the config's
                                (a keyword given to the config itself wins); p's seed, n,
                                max_tokens and include_stop_str_in_output have no effect
                                (the trainer's seed, num_generations and
                                max_completion_length rule); its stop strings other than
                                the EOS token are refused by the trainer
    per_device_train_batch_size=1, num_generations=4
                                every generation batch must hold whole groups of a prompt's
                                num_generations completions (TRL refuses otherwise): the batch
                                is raised to the smallest size that does, as Unsloth raises it

Each is said once.
"""

from __future__ import annotations

import dataclasses
import os

from slothkit.core.notices import SettingChangedWarning, say_once

# vLLM settings with a GRPOConfig field of the same meaning, and vLLM's defaults for them
# (top_k: -1 and 0 both mean no top-k there, 0 in TRL's config).
SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# vLLM settings the trainer decides itself, with the value at which they ask for nothing.
DECIDED_BY_TRAINER = {
    "seed": (None, "the trainer's seed"),
    "n": (1, "num_generations"),
    "max_tokens": (16, "max_completion_length"),
    "include_stop_str_in_output": (False, "the completions are decoded without special tokens"),
}


def translate_online_keywords(kwargs: dict, owner: str, base) -> dict:
    """The keywords of a GRPOConfig or RLOOConfig call with Unsloth's additions translated
    (module docstring).

    Args:
        kwargs: the keywords as given; not changed.
        owner: the class name, for the notices ("GRPOConfig").
        base: TRL's config class (its fields and their defaults).

    Returns:
        The translated keywords (``vllm_sampling_params`` kept, for the trainer's check).
    """
    kwargs = dict(kwargs)
    defaults = {field.name: field.default for field in dataclasses.fields(base) if field.init}
    if kwargs.get("use_vllm"):
        kwargs["use_vllm"] = False
        say_once(
            f"{owner}(use_vllm=True): slothkit samples the completions through its own fast decode loop, "
            "without vLLM; use_vllm is set False",
            SettingChangedWarning,
        )
    params = kwargs.get("vllm_sampling_params")
    if params is not None:
        _take_sampling_settings(kwargs, params, owner, set(defaults))
    _whole_groups(kwargs, owner, defaults)
    return kwargs


def vllm_sampling_value(params, name: str, default):
    """A vLLM SamplingParams setting (slothkit's or vLLM's own class), top_k's -1 read as 0."""
    value = getattr(params, name, default)
    return 0 if name == "top_k" and value == -1 else value


def _take_sampling_settings(kwargs: dict, params, owner: str, fields: set[str]) -> None:
    for name, default in SAMPLING_FIELDS.items():
        value = vllm_sampling_value(params, name, default)
        if name not in fields or value == default or value is None:
            continue
        if name in kwargs and kwargs[name] != value:
            say_once(
                f"{owner}(vllm_sampling_params=SamplingParams({name}={value!r}), {name}={kwargs[name]!r}): "
                f"the config's own {name} is used",
                SettingChangedWarning,
            )
            continue
        kwargs[name] = value
    unused = [
        f"{name} ({reason})"
        for name, (inert, reason) in DECIDED_BY_TRAINER.items()
        if getattr(params, name, inert) != inert
    ]
    if unused:
        say_once(
            f"{owner}(vllm_sampling_params=...): its {', '.join(unused)} have no effect on the trainer's sampling; "
            "temperature, top_p, top_k, min_p and repetition_penalty are taken",
            SettingChangedWarning,
        )


def _whole_groups(kwargs: dict, owner: str, defaults: dict) -> None:
    if (
        "num_generations" not in defaults
        or "generation_batch_size" in kwargs
        or "steps_per_generation" in kwargs
    ):
        return
    names = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations")
    batch, steps, groups = (kwargs.get(name, defaults[name]) for name in names)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if not all(isinstance(value, int) and value > 0 for value in (batch, steps, groups)):
        return  # TRL says what is wrong with them
    if (batch * processes * steps) % groups == 0:
        return
    raised = next(
        size for size in range(batch + 1, batch + groups + 1) if (size * processes * steps) % groups == 0
    )
    kwargs["per_device_train_batch_size"] = raised
    say_once(
        f"{owner}(per_device_train_batch_size={batch}, num_generations={groups}): each generation batch must "
        f"hold whole groups of a prompt's {groups} completions; per_device_train_batch_size is raised to {raised}",
        SettingChangedWarning,
    )
