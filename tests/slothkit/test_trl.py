"""TRL's SFT, DPO and GRPO trainers on slothkit models against plain Hugging Face + PEFT.

Same checkpoint, same LoRA initialisation (seed 3407), same data, same optimizer: the
logged losses (and DPO rewards, GRPO rewards) and the trained LoRA weights must agree.

Most runs use the kernels' plain-torch references (TRITON_INTERPRET=0 for the test): the
subject here is how slothkit's patched model meets the trainers, and the Triton
interpreter costs seconds per step on a 2-core CPU.  One SFT run goes through the Triton
kernels under the interpreter; the kernels themselves are compared with torch in
tests/kernels and tests/slothkit/test_fast_model.py.
"""

import os
import warnings

import pytest
import torch

pytest.importorskip("trl")

from slothkit import FastModel
from slothkit.core.notices import LegacySpellingWarning
from slothkit.data import (
    NoTrainableTokensError,
    apply_chat_template,
    example_dataset,
    get_chat_template,
    train_on_responses_only,
)
from slothkit.testing import tiny_model_path
from slothkit.testing.training_parity import (
    MAX_SEQ,
    RUN,
    assert_same_lora,
    history,
    load_for_training,
    lora_weights,
)
from slothkit.trl import DPOTrainer, GRPOTrainer, SFTTrainer
from slothkit.trl.defaults import dpo_config, grpo_config, hardware_defaults, sft_config, training_arguments
from slothkit.trl.library import require_trl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("quiet_training")  # tests/slothkit/conftest.py


TEMPLATES = {"llama": "llama-3", "mistral": "mistral", "gemma": "gemma"}


def _sft(kind, load_in_4bit=False, steps=3, records=12, max_length=MAX_SEQ, arch="llama"):
    model, tokenizer = load_for_training(kind, load_in_4bit, arch=arch, template=TEMPLATES[arch])
    initial = lora_weights(model)
    dataset = apply_chat_template(example_dataset("chat").select(range(records)), tokenizer)
    args = sft_config(
        model, max_steps=steps, learning_rate=2e-3, max_length=max_length, output_dir=f"unused-{kind}", **RUN
    )
    trainer = train_on_responses_only(
        SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    )
    trainer.train()
    return trainer, model, initial


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora", "qlora"])
def test_sft_matches_hf_peft(reference_kernels, load_in_4bit):
    fused, fused_model, initial = _sft("slothkit", load_in_4bit)
    plain, plain_model, _ = _sft("hf", load_in_4bit)
    fused_losses, plain_losses = history(fused, "loss", "entropy"), history(plain, "loss", "entropy")
    assert len(fused_losses) == 3
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=1e-4, atol=1e-5)
    assert fused_losses[-1][0] != fused_losses[0][0]
    assert_same_lora(fused_model, plain_model, initial)


def test_sft_runs_on_the_triton_kernels():
    """The same SFT run with the Triton kernels (interpreted on CPU): one step of two short samples."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # neither sample may lose its reply to max_length
        fused, fused_model, initial = _sft("slothkit", steps=1, records=2, max_length=64)
    plain, plain_model, _ = _sft("hf", steps=1, records=2, max_length=64)
    torch.testing.assert_close(
        torch.tensor(history(fused, "loss")), torch.tensor(history(plain, "loss")), rtol=1e-4, atol=1e-5
    )
    assert_same_lora(fused_model, plain_model, initial)


def _dpo(kind, load_in_4bit, arch="llama", steps=2):
    model, tokenizer = load_for_training(kind, load_in_4bit, arch=arch, template=TEMPLATES[arch])
    initial = lora_weights(model)
    args = dpo_config(model, max_steps=steps, learning_rate=1e-2, output_dir=f"unused-{kind}", **RUN)
    trainer = DPOTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=example_dataset("preference").select(range(8)),
        args=args,
    )
    trainer.train()
    return trainer, model, initial


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora", "qlora"])
def test_dpo_matches_hf_peft(reference_kernels, load_in_4bit):
    fused, fused_model, initial = _dpo("slothkit", load_in_4bit)
    plain, plain_model, _ = _dpo("hf", load_in_4bit)
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")
    fused_log, plain_log = torch.tensor(history(fused, *keys)), torch.tensor(history(plain, *keys))
    torch.testing.assert_close(fused_log, plain_log, rtol=1e-4, atol=1e-5)
    assert fused_log[0, 0] == pytest.approx(
        torch.log(torch.tensor(2.0)).item(), abs=1e-6
    )  # policy == reference
    assert fused_log[1, 1:3].abs().min() > 1e-4  # rewards moved away from zero after one step
    assert_same_lora(fused_model, plain_model, initial)


@pytest.mark.parametrize("arch", ["mistral", "gemma"])
def test_sft_and_dpo_match_hf_peft_on_mistral_and_gemma(reference_kernels, arch):
    """Five steps of each on the other architectures' tiny models."""
    fused, fused_model, initial = _sft("slothkit", steps=5, records=20, arch=arch)
    plain, plain_model, _ = _sft("hf", steps=5, records=20, arch=arch)
    fused_log, plain_log = torch.tensor(history(fused, "loss")), torch.tensor(history(plain, "loss"))
    assert fused_log.shape[0] == 5 and fused_log[-1, 0] != fused_log[0, 0]
    torch.testing.assert_close(fused_log, plain_log, rtol=1e-4, atol=1e-5)
    assert_same_lora(fused_model, plain_model, initial)

    fused, fused_model, initial = _dpo("slothkit", False, arch=arch, steps=5)
    plain, plain_model, _ = _dpo("hf", False, arch=arch, steps=5)
    keys = ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen")
    fused_log, plain_log = torch.tensor(history(fused, *keys)), torch.tensor(history(plain, *keys))
    assert fused_log.shape[0] == 5
    torch.testing.assert_close(fused_log, plain_log, rtol=1e-4, atol=1e-5)
    assert_same_lora(fused_model, plain_model, initial)


def _digits_reward(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(sum(ch.isdigit() for ch in t) - 0.1 * len(t)) for t in texts]


def _grpo(kind, load_in_4bit):
    model, tokenizer = load_for_training(kind, load_in_4bit)
    initial = lora_weights(model)
    prompts = example_dataset("preference").select(range(8)).remove_columns(["chosen", "rejected"])
    args = grpo_config(
        model,
        max_steps=2,
        learning_rate=1e-2,
        num_generations=2,
        max_completion_length=6,
        beta=0.1,
        output_dir=f"unused-{kind}",
        **RUN,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[_digits_reward],
        train_dataset=prompts,
        args=args,
    )
    trainer.train()
    return trainer, model, initial


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora", "qlora"])
def test_grpo_matches_hf_peft(reference_kernels, load_in_4bit):
    """GRPO samples completions, so the runs agree only if both models sample the same
    tokens from the same seed; beta > 0 also exercises the reference (adapters off) pass."""
    fused, fused_model, initial = _grpo("slothkit", load_in_4bit)
    plain, plain_model, _ = _grpo("hf", load_in_4bit)
    keys = ("loss", "reward", "reward_std", "kl", "grad_norm", "completions/mean_length")
    fused_log, plain_log = torch.tensor(history(fused, *keys)), torch.tensor(history(plain, *keys))
    torch.testing.assert_close(fused_log, plain_log, rtol=1e-4, atol=1e-5)
    assert fused_log[:, 4].min() > 0  # gradients flowed
    assert_same_lora(fused_model, plain_model, initial)


# --- gradient accumulation ---------------------------------------------------------------


def _two_samples(tokenizer):
    """Two conversations with replies of different lengths, so that a mean of per-batch
    means differs from the mean over all reply tokens."""
    short = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    long = [
        {"role": "user", "content": "Convert 3 km to m."},
        {"role": "assistant", "content": "3 kilometres is 3000 metres, since 1 km is 1000 m."},
    ]
    records = [{"messages": short}, {"messages": long}]
    return apply_chat_template(records, tokenizer)


def _sgd_step(kind_of_trainer, batch, accumulation):
    model, tokenizer = load_for_training("slothkit")
    dataset = _two_samples(tokenizer)
    common = dict(
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        warmup_steps=0,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        output_dir="unused",
    )
    if kind_of_trainer == "sft":
        trainer = SFTTrainer(
            model=model, processing_class=tokenizer, train_dataset=dataset, args=sft_config(model, **common)
        )
    else:
        from transformers import Trainer

        encoded = dataset.map(lambda r: tokenizer(r["text"]), remove_columns=["text"])
        trainer = Trainer(
            model=model,
            args=training_arguments(model, **common),
            train_dataset=encoded,
            data_collator=_pad_right(tokenizer),
            processing_class=tokenizer,
        )
    trainer = train_on_responses_only(trainer)
    trainer.train()
    return history(trainer, "loss")[0][0], lora_weights(model)


def _pad_right(tokenizer):
    def collate(features):
        length = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), length), tokenizer.pad_token_id)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for row, f in enumerate(features):
            ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[row, : len(f["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


@pytest.mark.parametrize("kind_of_trainer", ["sft", "transformers"])
def test_gradient_accumulation_matches_a_bigger_batch(reference_kernels, monkeypatch, kind_of_trainer):
    """2 x batch 1 with accumulation must train exactly like batch 2: the summed token
    losses are divided by the reply tokens of the whole accumulated batch.  The plain
    Trainer goes through slothkit's fused loss, which must receive num_items_in_batch."""
    from slothkit.engine import decoder

    seen = []
    fused = decoder.fused_linear_cross_entropy

    def recording(*args, **kwargs):
        seen.append(kwargs.get("num_items_in_batch"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(decoder, "fused_linear_cross_entropy", recording)
    loss_big, weights_big = _sgd_step(kind_of_trainer, batch=2, accumulation=1)
    loss_accumulated, weights_accumulated = _sgd_step(kind_of_trainer, batch=1, accumulation=2)
    assert loss_accumulated == pytest.approx(loss_big, rel=1e-5)
    for name, weight in weights_big.items():
        torch.testing.assert_close(weights_accumulated[name], weight, rtol=1e-4, atol=1e-6, msg=name)
    if kind_of_trainer == "transformers":
        # one call for the batch of 2, two for the micro-batches; every one told the total count
        assert len(seen) == 3 and seen[0] is not None and seen[1] == seen[2] == seen[0]
    else:
        assert seen == []  # TRL >= 1.16 scores the head itself (trl.trainer.utils.add_fused_lm_head)


# --- generation ----------------------------------------------------------------------------


def test_batched_generation_with_left_padding_matches_one_by_one(reference_kernels):
    model, tokenizer = FastModel.from_pretrained(
        str(tiny_model_path("llama")),
        dtype=torch.float32,
        load_in_4bit=False,
        max_seq_length=MAX_SEQ,
        fused=True,
    )
    get_chat_template(tokenizer, "llama-3", model=model)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    assert tokenizer.padding_side == "right"
    with torch.no_grad():  # make the adapters matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                generator = torch.Generator(device=param.device).manual_seed(len(name))
                param.normal_(0, 0.05, generator=generator)
    FastModel.for_inference(model)
    assert tokenizer.padding_side == "left"
    questions = [
        "Name a colour.",
        "Convert 3 kilometres to metres, please.",
        "What is the capital of France?",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    assert (batch["attention_mask"][:, -1] == 1).all()  # padded on the left
    batched = model.generate(**batch, **settings)[:, batch["input_ids"].shape[1] :]
    for row, prompt in enumerate(prompts):
        single = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
        alone = model.generate(**single, **settings)[0, single["input_ids"].shape[1] :]
        assert batched[row, : len(alone)].tolist() == alone.tolist()
    FastModel.for_training(model)
    assert tokenizer.padding_side == "right"


# --- configs and checks ---------------------------------------------------------------------


def test_a_trainer_given_no_config_builds_slothkits(reference_kernels):
    """slothkit.trl's trainers use slothkit.trl.defaults' factory when given no config,
    with the config options given to the trainer."""
    model, tokenizer = load_for_training("slothkit")
    dataset = apply_chat_template(example_dataset("chat").select(range(2)), tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacySpellingWarning)  # max_seq_length: said once per process
        trainer = SFTTrainer(
            model=model, processing_class=tokenizer, train_dataset=dataset, max_seq_length=40
        )
    expected = sft_config(model, max_length=40)
    names = ("learning_rate", "max_length", "optim", "bf16", "seed", "output_dir", "gradient_checkpointing")
    assert [getattr(trainer.args, n) for n in names] == [getattr(expected, n) for n in names]
    assert trainer.args.learning_rate == 2e-4 and trainer.args.max_length == 40


def test_configs_fit_the_hardware(reference_kernels, monkeypatch):
    model, _ = load_for_training("slothkit", load_in_4bit=True)
    args = sft_config(model, output_dir="unused")
    # An fp32 model trains in fp32; 8-bit AdamW only where bitsandbytes has a GPU to run on.
    optim = "adamw_8bit" if torch.cuda.is_available() else "adamw_torch"
    assert (args.bf16, args.fp16, args.optim, args.gradient_checkpointing) == (False, False, optim, False)
    assert args.max_length == MAX_SEQ and args.learning_rate == 2e-4 and args.gradient_accumulation_steps == 4
    assert sft_config(model, output_dir="unused", learning_rate=1e-3).learning_rate == 1e-3
    assert dpo_config(model, output_dir="unused").max_length == MAX_SEQ
    assert grpo_config(model, output_dir="unused").gradient_checkpointing is False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert hardware_defaults() == {"bf16": False, "fp16": True, "optim": "adamw_8bit"}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert hardware_defaults() == {"bf16": True, "fp16": False, "optim": "adamw_8bit"}
    assert hardware_defaults(model)["bf16"] is False  # this model computes in float32


def test_setup_checks(reference_kernels):
    from trl import SFTConfig

    model, tokenizer = load_for_training("slothkit")
    dataset = apply_chat_template(example_dataset("chat").select(range(2)), tokenizer)
    args = SFTConfig(
        output_dir="unused", bf16=False, report_to="none"
    )  # TRL's default turns checkpointing on
    with pytest.warns(UserWarning, match="would replace the checkpointing FastModel.get_peft_model set up"):
        SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    # activation_checkpointing: transformers >= 5.24's name; earlier ones have gradient_checkpointing only
    assert args.gradient_checkpointing is False and getattr(args, "activation_checkpointing", False) is False
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(600)])
    with pytest.raises(ValueError, match="embeddings 768 rows; call get_chat_template"):
        SFTTrainer(
            model=model,
            processing_class=tokenizer,
            train_dataset=dataset,
            args=sft_config(model, output_dir="unused"),
        )


@pytest.mark.parametrize(
    "records, match",
    [
        ([{"question": "a", "answer": "b"}], "SFT needs one of: 'text'"),
        (
            [{"messages": [{"role": "bot", "content": "a"}]}],
            "training record 0 \\('messages'\\), message 0: role 'bot'",
        ),
        ([{"messages": []}], "training record 0 \\('messages'\\) is empty"),
    ],
)
def test_bad_data_is_refused_before_trl(reference_kernels, records, match):
    import datasets

    model, tokenizer = load_for_training("slothkit")
    with pytest.raises(ValueError, match=match):
        SFTTrainer(
            model=model,
            processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_list(records),
            args=sft_config(model, output_dir="unused"),
        )


def test_over_long_samples_are_truncated_or_refused_clearly(reference_kernels):
    """Samples longer than max_length are cut to it (keeping the start); when the cut
    leaves no reply token, the error names the markers and shows what was left."""
    model, tokenizer = load_for_training("slothkit")
    long_reply = " ".join(["The lighthouse keeper climbs the steps at dusk."] * 20)
    records = [
        {
            "messages": [
                {"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": long_reply},
            ]
        }
    ] * 2
    dataset = apply_chat_template(records, tokenizer)
    assert len(tokenizer(dataset[0]["text"])["input_ids"]) > MAX_SEQ
    args = sft_config(model, max_steps=1, max_length=40, output_dir="unused", **RUN)
    trainer = train_on_responses_only(
        SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    )
    assert [len(ids) for ids in trainer.train_dataset["input_ids"]] == [40, 40]
    trainer.train()
    assert torch.isfinite(torch.tensor(history(trainer, "loss"))).all()

    args = sft_config(model, max_steps=1, max_length=22, output_dir="unused", **RUN)
    with pytest.raises(NoTrainableTokensError, match="none of the 2 samples.*Tell me a story"):
        train_on_responses_only(
            SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
        )


def test_old_trl_is_refused(monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.14.0")
    with pytest.raises(ImportError, match="TRL 1.14.0 is too old.*outputs.logits"):
        require_trl()
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    assert require_trl() is trl


def test_out_of_memory_in_training_names_the_settings_to_change(reference_kernels, monkeypatch):
    from slothkit.trl.out_of_memory import TrainingOutOfMemoryError

    model, tokenizer = load_for_training("slothkit")
    dataset = apply_chat_template(example_dataset("chat").select(range(4)), tokenizer)
    args = sft_config(model, max_steps=1, max_length=MAX_SEQ, output_dir="unused-oom", **RUN)
    trainer = train_on_responses_only(
        SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    )

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(model, "forward", out_of_memory)
    with pytest.raises(TrainingOutOfMemoryError) as excinfo:
        trainer.train()
    message = str(excinfo.value)
    assert isinstance(excinfo.value, torch.cuda.OutOfMemoryError)  # still caught as one
    assert f"per_device_train_batch_size={args.per_device_train_batch_size}" in message
    assert f"max_length={MAX_SEQ}" in message and "gradient_accumulation_steps" in message
    assert "load_in_4bit=True" in message and "Tried to allocate 2.00 GiB" in message


def test_a_list_of_records_is_taken_and_a_list_of_anything_else_explained(reference_kernels):
    import datasets

    model, tokenizer = load_for_training("slothkit")
    records = [{"text": f"Record {i}: the sloth sleeps."} for i in range(4)]

    def build(data):
        args = sft_config(model, output_dir="unused")
        return SFTTrainer(model=model, processing_class=tokenizer, train_dataset=data, args=args)

    trainer = build(records)  # was AttributeError: 'list' object has no attribute ...
    assert isinstance(trainer.train_dataset, datasets.Dataset) and len(trainer.train_dataset) == 4
    with pytest.raises(
        ValueError,
        match=r"train_dataset: records must be dicts; record 0 is str; pass a datasets\.Dataset",
    ):
        build([r["text"] for r in records])
