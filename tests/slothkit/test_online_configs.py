"""GRPOConfig and RLOOConfig with Unsloth's additions (slothkit.trl.online_configs):
use_vllm, vllm_sampling_params, and a batch of less than one whole group."""

import warnings

import pytest
from datasets import Dataset

from slothkit import FastLanguageModel
from slothkit.testing import tiny_model_path
from slothkit.trl import GRPOConfig, GRPOTrainer, RLOOConfig
from slothkit.vllm import SamplingParams

COMMON = {"output_dir": "outputs", "report_to": "none", "max_steps": 1}


def _notices(caught):
    return [str(w.message) for w in caught]


def test_use_vllm_is_turned_off_and_said():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GRPOConfig(use_vllm=True, per_device_train_batch_size=8, num_generations=8, **COMMON)
    assert config.use_vllm is False
    assert any(
        "use_vllm=True): slothkit samples the completions through its own" in n for n in _notices(caught)
    )


def test_sampling_params_become_the_configs_settings():
    # Unsloth's Qwen3 GRPO notebook's settings.
    params = SamplingParams(
        min_p=0.1, top_p=1.0, top_k=-1, seed=3407, stop=["<|im_end|>"], include_stop_str_in_output=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GRPOConfig(vllm_sampling_params=params, temperature=1.0, num_generations=4, **COMMON)
    assert (config.min_p, config.top_p, config.top_k, config.temperature) == (0.1, 1.0, 0, 1.0)
    assert config.vllm_sampling_params is params
    assert any("its seed (the trainer's seed), include_stop_str_in_output" in n for n in _notices(caught))
    # The config's own keyword wins over a different one in the params, and says so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = RLOOConfig(
            vllm_sampling_params=SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.1),
            temperature=0.9,
            num_generations=2,
            **COMMON,
        )
    assert (config.temperature, config.top_k, config.repetition_penalty) == (0.9, 20, 1.1)
    assert any(
        "temperature=0.7), temperature=0.9): the config's own temperature is used" in n
        for n in _notices(caught)
    )


@pytest.mark.parametrize(
    ("batch", "steps", "groups", "raised"),
    [(1, 1, 4, 4), (1, 1, 6, 6), (2, 1, 4, 4), (3, 2, 4, 4), (1, 4, 4, None), (8, 1, 8, None)],
)
def test_the_batch_is_raised_to_whole_groups(batch, steps, groups, raised):
    config = GRPOConfig(
        per_device_train_batch_size=batch, gradient_accumulation_steps=steps, num_generations=groups, **COMMON
    )
    assert config.per_device_train_batch_size == (raised or batch)
    assert config.generation_batch_size % groups == 0
    # Given explicitly, TRL's own rule stands.
    if raised:
        with pytest.raises(ValueError, match="must be divisible by num_generations"):
            GRPOConfig(
                per_device_train_batch_size=batch,
                steps_per_generation=steps,
                num_generations=groups,
                **COMMON,
            )


def test_stop_strings_other_than_eos_are_refused_by_the_trainer():
    model, tokenizer = FastLanguageModel.from_pretrained(str(tiny_model_path("qwen3")), load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=4)
    dataset = Dataset.from_list([{"prompt": "Count to three."}] * 4)

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    common = {**COMMON, "num_generations": 2, "max_completion_length": 4, "per_device_train_batch_size": 2}
    eos_only = GRPOConfig(vllm_sampling_params=SamplingParams(stop=[tokenizer.eos_token]), **common)
    GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=reward, args=eos_only, train_dataset=dataset
    )
    other = GRPOConfig(vllm_sampling_params=SamplingParams(stop=["</answer>"]), **common)
    with pytest.raises(
        ValueError, match=r"stop=\['</answer>'\]\): the trainer's sampling ends each completion"
    ):
        GRPOTrainer(
            model=model, processing_class=tokenizer, reward_funcs=reward, args=other, train_dataset=dataset
        )
