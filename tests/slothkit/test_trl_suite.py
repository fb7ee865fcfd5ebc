"""ORPO, KTO, RLOO and reward-model training on slothkit models against plain Hugging Face
+ PEFT (the convergence family of tests/slothkit/test_trl.py, for the rest of TRL's suite).

Same checkpoint, same LoRA initialisation (and score head), same data, same optimizer:
five steps' logged losses and each method's key metrics must agree to rtol 1e-4, and so
must the trained LoRA weights.  The kernels run their plain-torch references
(reference_kernels, tests/slothkit/conftest.py).
"""

import functools
import os
import warnings

import pytest
import torch

pytest.importorskip("trl")

from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.data import example_dataset
from slothkit.testing.training_parity import RUN, assert_same_lora, history, load_for_training, lora_weights
from slothkit.trl import KTOTrainer, ORPOTrainer, RewardTrainer, RLOOTrainer
from slothkit.trl.defaults import LEARNING_RATES, kto_config, orpo_config, reward_config, rloo_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("quiet_training", "reference_kernels")  # tests/slothkit/conftest.py
STEPS = 5
TEMPLATES = {"llama": "llama-3", "mistral": "mistral", "gemma": "gemma"}


def _pairs(records=10):
    return example_dataset("preference").select(range(records))


def _unpaired(records=10):
    """KTO's layout from the preference pairs: each prompt once, with its chosen answer
    (label True) or its rejected one (False), alternating so that every batch of two
    holds one of each."""
    import datasets

    rows = []
    for index, pair in enumerate(_pairs(records)):
        desirable = index % 2 == 0
        completion = pair["chosen"] if desirable else pair["rejected"]
        rows.append({"prompt": pair["prompt"], "completion": completion, "label": desirable})
    return datasets.Dataset.from_list(rows)


def _compare(fused, plain, keys, moves="loss", rtol=1e-4, atol=1e-5):
    """The two runs' logged `keys`, equal at every step; `moves` changed over the run."""
    fused_log, plain_log = torch.tensor(history(fused, *keys)), torch.tensor(history(plain, *keys))
    assert fused_log.shape == (STEPS, len(keys))
    torch.testing.assert_close(fused_log, plain_log, rtol=rtol, atol=atol)
    column = keys.index(moves)
    assert fused_log[-1, column] != fused_log[0, column], moves
    return fused_log


def _run(kind, make_config, trainer_class, dataset, load_kwargs, learning_rate, **config):
    load_kwargs = dict(load_kwargs)
    arch = load_kwargs.setdefault("arch", "llama")
    model, tokenizer = load_for_training(kind, template=TEMPLATES[arch], **load_kwargs)
    initial = lora_weights(model)
    args = make_config(
        model, max_steps=STEPS, learning_rate=learning_rate, output_dir=f"unused-{kind}", **RUN, **config
    )
    trainer = trainer_class(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    trainer.train()
    return trainer, model, initial


def _both(*args, **kwargs):
    fused, fused_model, initial = _run("slothkit", *args, **kwargs)
    plain, plain_model, _ = _run("hf", *args, **kwargs)
    return fused, plain, fused_model, plain_model, initial


@pytest.mark.parametrize(
    "load_kwargs",
    [{}, {"load_in_4bit": True}, {"arch": "mistral"}, {"arch": "gemma"}],
    ids=["lora", "qlora", "mistral", "gemma"],
)
def test_orpo_matches_hf_peft(load_kwargs):
    fused, plain, fused_model, plain_model, initial = _both(
        orpo_config, ORPOTrainer, _pairs(), load_kwargs, 1e-3, beta=0.1
    )
    keys = ("loss", "nll_loss", "log_odds_ratio", "rewards/chosen", "rewards/rejected", "logps/chosen")
    _compare(fused, plain, keys)
    assert_same_lora(fused_model, plain_model, initial)


@pytest.mark.parametrize(
    "load_kwargs",
    [{}, {"load_in_4bit": True}, {"arch": "mistral"}, {"arch": "gemma"}],
    ids=["lora", "qlora", "mistral", "gemma"],
)
def test_kto_matches_hf_peft(load_kwargs):
    """KTO's reference is the model with its adapters off; its KL estimate pairs each
    completion with the other prompt of its batch."""
    fused, plain, fused_model, plain_model, initial = _both(
        kto_config, KTOTrainer, _unpaired(), load_kwargs, 1e-3, beta=0.1
    )
    keys = ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm")
    log = _compare(fused, plain, keys)
    assert log[0, 2:4].abs().max() < 1e-6  # step 1: policy == reference, so rewards are 0
    assert log[-1, 2:4].abs().min() > 1e-4  # and they moved
    assert_same_lora(fused_model, plain_model, initial)


def _digits_reward(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(sum(ch.isdigit() for ch in t) - 0.1 * len(t)) for t in texts]


@pytest.mark.parametrize(
    "load_kwargs",
    [{}, {"load_in_4bit": True}, {"arch": "mistral"}, {"arch": "gemma"}],
    ids=["lora", "qlora", "mistral", "gemma"],
)
def test_rloo_matches_hf_peft(load_kwargs):
    """RLOO samples completions, so the runs agree only if both models sample the same
    tokens from the same seed; beta > 0 also runs the reference (adapters off) pass."""
    prompts = _pairs(10).remove_columns(["chosen", "rejected"])
    fused, plain, fused_model, plain_model, initial = _both(
        rloo_config,
        functools.partial(RLOOTrainer, reward_funcs=[_digits_reward]),
        prompts,
        load_kwargs,
        1e-2,
        num_generations=2,
        max_completion_length=4,
        beta=0.1,
    )
    keys = ("loss", "reward", "reward_std", "kl", "grad_norm", "completions/mean_length")
    # On-policy, one update per batch: the importance ratio is 1 and the leave-one-out
    # advantages of each prompt sum to 0, so the policy term of the loss is 0 at every
    # step; the KL to the reference (0 at the first step) shows the policy moved.
    log = _compare(fused, plain, keys, moves="kl")
    assert log[0, 3] == 0 and log[-1, 3] > 0
    assert log[:, 4].min() > 0  # gradients flowed
    # With NF4 weights the two paths dequantise in a different order of fp32 operations;
    # RLOO's per-completion gradients nearly cancel (its advantages sum to zero), and
    # Adam turns their last-digit differences into 1.1e-3 of the distance moved in one
    # matrix over five steps (every logged metric still equal to 1e-4).
    assert_same_lora(
        fused_model, plain_model, initial, tolerance=2e-3 if load_kwargs.get("load_in_4bit") else 1e-3
    )


@pytest.mark.parametrize(
    "load_kwargs",
    [{}, {"load_in_4bit": True}, {"arch": "mistral"}, {"arch": "gemma"}],
    ids=["lora", "qlora", "mistral", "gemma"],
)
def test_reward_model_matches_hf_peft(load_kwargs):
    """A LoRA reward model: FastModel.from_pretrained(num_labels=1), its decoder on the
    fused path, the score head trained in full (PEFT's SEQ_CLS modules_to_save)."""
    fused, plain, fused_model, plain_model, initial = _both(
        reward_config, RewardTrainer, _pairs(), {"num_labels": 1, **load_kwargs}, 1e-3
    )
    keys = ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward")
    _compare(fused, plain, keys)
    assert any("score" in name for name in initial)  # the head is trained and compared
    assert_same_lora(fused_model, plain_model, initial)


def test_reward_model_saves_and_reloads_as_an_adapter(tmp_path):
    model, tokenizer = load_for_training("slothkit", num_labels=1)
    with torch.no_grad():  # a trained-looking adapter and head
        for name, param in model.named_parameters():
            if param.requires_grad:
                generator = torch.Generator().manual_seed(len(name))
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    texts = ["The capital of France is Paris.", "2 weeks is 21 days, since a week has 10 days."]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        rewards = model(**batch).logits  # (2, 1)
    model.save_pretrained(tmp_path / "reward")
    tokenizer.save_pretrained(tmp_path / "reward")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        reloaded, reloaded_tokenizer = FastModel.from_pretrained(
            str(tmp_path / "reward"), dtype=torch.float32, load_in_4bit=False, fused=True
        )
    assert not [w for w in seen if "score head" in str(w.message)]  # the adapter holds it
    assert type(reloaded.get_base_model()).__name__ == "LlamaForSequenceClassification"
    assert state_of(reloaded).architecture == "llama"
    reloaded.eval()
    with torch.no_grad():
        again = reloaded(**reloaded_tokenizer(texts, return_tensors="pt", padding=True)).logits
    assert rewards.shape == (2, 1) and rewards[0, 0] != rewards[1, 0]
    torch.testing.assert_close(again, rewards, rtol=1e-5, atol=1e-6)


def test_configs_take_each_method_rate_and_the_models_length():
    model, _ = load_for_training("slothkit")
    for make, kind in ((orpo_config, "orpo"), (kto_config, "kto"), (rloo_config, "rloo")):
        args = make(model, output_dir="unused")
        assert args.learning_rate == LEARNING_RATES[kind], kind
        assert (args.bf16, args.fp16, args.gradient_checkpointing) == (False, False, False), kind
    assert orpo_config(model, output_dir="unused").max_length == model.get_base_model().max_seq_length
    assert kto_config(model, output_dir="unused").max_length == model.get_base_model().max_seq_length
    assert reward_config(model, output_dir="unused").learning_rate == 1e-4


def test_reward_trainer_refuses_a_causal_lm():
    model, tokenizer = load_for_training("slothkit")
    with pytest.raises(
        ValueError, match="this model is a LlamaForCausalLM; load it as one with .*num_labels=1"
    ):
        RewardTrainer(
            model=model,
            processing_class=tokenizer,
            train_dataset=_pairs(2),
            args=reward_config(model, output_dir="unused"),
        )


@pytest.mark.parametrize(
    "records, match",
    [
        (
            [{"prompt": "a", "completion": "b"}],
            "lacks \\['label'\\]; KTO needs 'prompt', 'completion' and 'label'",
        ),
        ([{"prompt": "a", "completion": "b", "label": 1}], "training record 0 \\('label'\\): expected True"),
        (
            [{"prompt": "a", "completion": " ", "label": True}],
            "training record 0 \\('completion'\\) is empty",
        ),
    ],
)
def test_kto_data_is_refused_before_trl(records, match):
    import datasets

    model, tokenizer = load_for_training("slothkit")
    with pytest.raises(ValueError, match=match):
        KTOTrainer(
            model=model,
            processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_list(records),
            args=kto_config(model, output_dir="unused"),
        )


def test_slothkit_trl_takes_the_older_kto_keywords():
    """slothkit.trl.KTOTrainer as older notebooks call it: tokenizer=, and the
    max_prompt_length and max_completion_length TRL 1.16 dropped, applied to the text."""
    import datasets
    import trl

    from slothkit.trl import KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer

    assert issubclass(RewardTrainer, trl.RewardTrainer) and issubclass(RLOOTrainer, trl.RLOOTrainer)
    assert issubclass(RewardConfig, trl.RewardConfig) and issubclass(RLOOConfig, trl.RLOOConfig)
    model, tokenizer = load_for_training("slothkit")
    prompt = "Tell me about the lighthouse keeper who climbs the steps at dusk."
    completion = "He climbs slowly, counting every one of the hundred steps."
    records = [{"prompt": prompt, "completion": completion, "label": i % 2 == 0} for i in range(4)]
    args = KTOConfig(output_dir="unused", max_prompt_length=5, max_completion_length=4, report_to="none")
    trainer = KTOTrainer(
        model=model, tokenizer=tokenizer, train_dataset=datasets.Dataset.from_list(records), args=args
    )
    record = trainer.train_dataset[0]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    assert record["prompt_ids"][-5:] == prompt_ids[-5:] and len(record["prompt_ids"]) <= 6  # and a BOS
    assert (
        record["completion_ids"][:4] == completion_ids[:4] and len(record["completion_ids"]) <= 5
    )  # and an EOS


@pytest.mark.parametrize(
    "method, arch", [("grpo", "llama"), ("rloo", "llama"), ("grpo", "mistral"), ("grpo", "gemma")]
)
def test_on_policy_sampling_through_the_fast_loop_matches_hf_peft(method, arch, monkeypatch):
    """GRPO and RLOO sample through slothkit's decode loop (forced on this CPU with
    fast_generation=True) in training mode; the sampled tokens, and so every logged
    metric, equal Hugging Face + PEFT's run with Hugging Face's generate.  After train()
    the loop's cache is freed."""
    from slothkit.inference.fast_decoder import FastDecoder
    from slothkit.trl import GRPOTrainer
    from slothkit.trl.defaults import grpo_config

    sampled_in_training = []
    original = FastDecoder.generate

    def recording(self, *args, **kwargs):
        sampled_in_training.append(self.causal_lm.training)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FastDecoder, "generate", recording)
    make_config, trainer_class = {"grpo": (grpo_config, GRPOTrainer), "rloo": (rloo_config, RLOOTrainer)}[
        method
    ]
    prompts = _pairs(10).remove_columns(["chosen", "rejected"])

    settings = dict(num_generations=2, max_completion_length=6, beta=0.1)
    fused, fused_model, initial = _run(
        "slothkit",
        make_config,
        functools.partial(trainer_class, reward_funcs=[_digits_reward], fast_generation=True),
        prompts,
        {"arch": arch},
        1e-2,
        **settings,
    )
    assert len(sampled_in_training) == STEPS and all(sampled_in_training)
    assert state_of(fused_model).fast_decoder is None, "the cache was kept"
    plain, plain_model, _ = _run(
        "hf",
        make_config,
        functools.partial(trainer_class, reward_funcs=[_digits_reward], fast_generation=False),
        prompts,
        {"arch": arch},
        1e-2,
        **settings,
    )
    assert len(sampled_in_training) == STEPS  # the plain run used Hugging Face's generate
    keys = ("loss", "reward", "reward_std", "kl", "grad_norm", "completions/mean_length")
    _compare(fused, plain, keys, moves="kl")
    assert_same_lora(fused_model, plain_model, initial)
