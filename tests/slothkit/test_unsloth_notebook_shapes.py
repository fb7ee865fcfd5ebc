"""Pieces of notebooks written for Unsloth, on slothkit, where a whole notebook does not
reach them (test_unsloth_notebooks.py runs the notebooks whole).

Written here from the calls those notebooks make (their text is not copied): Alpaca SFT
through ``TrainingArguments`` with ``warmup_ratio`` and the SFT options given to the
trainer; ChatML on a tokenizer without its tokens; DPO with a ``max_prompt_length`` that
cuts; ORPO with one that cuts; continued pretraining with an embedding learning rate
measured on one step; and the refusals.  Each imports only from ``slothkit``,
``slothkit.chat_templates`` and ``slothkit.trl`` (plus datasets and transformers, as the
notebooks do), on the tiny offline models, in fp32, for a few steps.

The notebooks' cells run as written (bitsandbytes' 8-bit AdamW runs on a CPU too); the
model and data are local.
"""

import math
import os
import warnings

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from slothkit import (  # noqa: E402
    FastLanguageModel,
    PatchDPOTrainer,
    UnslothTrainer,
    UnslothTrainingArguments,
    is_bfloat16_supported,
    unsloth_train,
)
from slothkit.chat_templates import (  # noqa: E402
    get_chat_template,
)
from slothkit.core.notices import FallbackWarning, SlothkitNotice, say_once  # noqa: E402
from slothkit.testing import tiny_model_path  # noqa: E402
from slothkit.trl import (  # noqa: E402
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    ORPOConfig,
    ORPOTrainer,
    SFTConfig,
    SFTTrainer,
    TrainingArguments,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MAX_SEQ = 128
OPTIM = "adamw_8bit"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# An Alpaca-style prompt in slothkit's own words: three slots, instruction, input, response.
PROMPT = """Here is a task, with context where there is some. Answer it.

### Task:
{}

### Context:
{}

### Answer:
{}"""

ALPACA = [
    {"instruction": "Add the numbers.", "input": "12 and 30", "output": "12 + 30 = 42."},
    {"instruction": "Name the capital of France.", "input": "", "output": "Paris."},
    {"instruction": "Reverse the word.", "input": "sloth", "output": "htols"},
    {"instruction": "What colour is the sky on a clear day?", "input": "", "output": "Blue."},
]

PREFERENCES = [
    {
        "prompt": "A long preamble that the prompt limit has to cut away. Which planet is closest to the sun?",
        "chosen": " Mercury.",
        "rejected": " Jupiter.",
    },
    {"prompt": "How many legs does a spider have?", "chosen": " Eight.", "rejected": " Six."},
    {"prompt": "What is 2 + 2?", "chosen": " 4.", "rejected": " 5."},
    {"prompt": "Name a primary colour.", "chosen": " Red.", "rejected": " Green."},
]


@pytest.fixture(autouse=True)
def notebook_run(monkeypatch, tmp_path):
    """Run in a fresh folder (outputs/), on the kernels' torch references (the Triton
    interpreter costs seconds a step), with each notice shown afresh."""
    monkeypatch.chdir(tmp_path)
    interpreter = os.environ.get("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    say_once.cache_clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="slothkit_kernels.*no Triton backend")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        yield
    # The SFT runs with dataset_num_proc > 1 leave TRITON_INTERPRET=0 behind in os.environ
    # past monkeypatch's undo; later tests that need the interpreter get it back here.
    if interpreter is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = interpreter


def _load(arch="llama"):
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(tiny_model_path(arch)), max_seq_length=MAX_SEQ, dtype=None, load_in_4bit=False
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=8,
        target_modules=PROJECTIONS,
        lora_alpha=16,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        use_rslora=False,
        loftq_config=None,
        max_seq_length=MAX_SEQ,
    )
    return model, tokenizer


def _training_arguments(**overrides):
    settings = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        warmup_steps=0,
        max_steps=2,
        learning_rate=2e-4,
        fp16=not is_bfloat16_supported(),
        bf16=is_bfloat16_supported(),
        logging_steps=1,
        optim=OPTIM,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir="outputs",
        report_to="none",
        disable_tqdm=True,
    )
    return TrainingArguments(**{**settings, **overrides})


def _notices(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, SlothkitNotice)]


def _lora(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n and ".default." in n}


def _assert_trained(model, before, trainer):
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    after = _lora(model)
    assert any((after[name] - before[name]).abs().max() > 0 for name in before)


def test_alpaca_sft_with_training_arguments_and_warmup_ratio():
    model, tokenizer = _load()
    eos = tokenizer.eos_token

    def formatting_prompts_func(examples):
        texts = [
            PROMPT.format(instruction, context, output) + eos
            for instruction, context, output in zip(
                examples["instruction"], examples["input"], examples["output"]
            )
        ]
        return {"text": texts}

    dataset = Dataset.from_list(ALPACA).map(formatting_prompts_func, batched=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = SFTTrainer(
            model=model,
            tokenizer=tokenizer,
            train_dataset=dataset,
            dataset_text_field="text",
            max_seq_length=MAX_SEQ,
            dataset_num_proc=1,
            packing=False,
            args=_training_arguments(warmup_steps=None, warmup_ratio=0.5, max_steps=4),
        )
    notices = _notices(caught)
    for expected in (
        "SFTTrainer(tokenizer=...) is written SFTTrainer(processing_class=...)",
        "SFTTrainer(max_seq_length=...) is written SFTConfig(max_length=...)",
        "SFTTrainer(dataset_text_field=...) is written SFTConfig(dataset_text_field=...)",
        "SFTTrainer(args=TrainingArguments(...)) is written SFTTrainer(args=SFTConfig(...))",
        "TrainingArguments(warmup_ratio=0.5) is written warmup_steps=0.5",
    ):
        assert sum(expected in notice for notice in notices) == 1, (expected, notices)
    args = trainer.args
    assert isinstance(args, SFTConfig)
    assert (args.max_length, args.dataset_text_field, args.packing, args.dataset_num_proc) == (
        MAX_SEQ,
        "text",
        False,
        1,
    )
    assert (args.per_device_train_batch_size, args.weight_decay, args.seed, args.max_steps) == (
        2,
        0.01,
        3407,
        4,
    )
    assert args.warmup_steps == 0.5 and args.get_warmup_steps(4) == 2  # ceil(0.5 * 4)

    before = _lora(model)
    stats = unsloth_train(trainer)
    assert stats.global_step == 4
    _assert_trained(model, before, trainer)
    # The learning rate after each step: linear warmup over ceil(0.5 * 4) = 2 steps, then linear decay.
    rates = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    expected = [2e-4 * s / 2 if s < 2 else 2e-4 * (4 - s) / 2 for s in range(4)]
    assert rates == pytest.approx(expected, rel=1e-6)

    # A second trainer says nothing again.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SFTTrainer(
            model=model,
            tokenizer=tokenizer,
            train_dataset=dataset,
            max_seq_length=MAX_SEQ,
            args=_training_arguments(),
        )
    assert _notices(caught) == []


def test_chatml_on_a_tokenizer_without_its_tokens_grows_the_model_it_came_with():
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(tiny_model_path("mistral")), max_seq_length=MAX_SEQ, dtype=None, load_in_4bit=False
    )
    model.resize_token_embeddings(len(tokenizer))  # no spare rows: the new tokens need new ones
    old_rows = len(tokenizer)
    model = FastLanguageModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    with pytest.warns(UserWarning, match="embeddings grew"):
        tokenizer = get_chat_template(
            tokenizer, chat_template="chatml", add_missing_tokens=True
        )  # no model=: found through the tokenizer
    rows = model.get_input_embeddings().weight
    assert rows.shape[0] == len(tokenizer) and not rows.requires_grad
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert start >= old_rows and start in ids  # a new id, past the old rows
    logits = model(input_ids=torch.tensor([ids], device=model.device)).logits  # every id has a row
    assert logits.shape == (1, len(ids), len(tokenizer))

    plain = FastLanguageModel.from_pretrained(
        model_name=str(tiny_model_path("mistral")), max_seq_length=MAX_SEQ, dtype=None, load_in_4bit=False
    )[1]
    from transformers import AutoTokenizer

    loose = AutoTokenizer.from_pretrained(str(tiny_model_path("mistral")))
    with pytest.raises(ValueError, match="needs the tokens .* pass model="):
        get_chat_template(loose, chat_template="chatml", add_missing_tokens=True)
    size = len(loose)  # by default nothing is added, so no model is needed
    say_once.cache_clear()
    with pytest.warns(FallbackWarning, match="each turn ends with its EOS '</s>'"):
        get_chat_template(loose, chat_template="chatml")
    assert len(loose) == size and loose.eos_token == "</s>"
    assert get_chat_template(
        plain, chat_template=("{% for m in messages %}{{ m['content'] }}{% endfor %}", "</s>")
    )
    with pytest.raises(ValueError, match="mapping= and system_message= apply to slothkit's named formats"):
        get_chat_template(plain, chat_template=("{{ messages }}", "</s>"), mapping={"role": "from"})
    with pytest.raises(ValueError, match="'unsloth' is not available"):
        get_chat_template(plain, chat_template="unsloth")


def test_dpo_with_beta_and_lengths_given_to_the_trainer():
    model, tokenizer = _load()
    PatchDPOTrainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PatchDPOTrainer()
    assert _notices(caught) == []  # said once, by the first call
    trainer = DPOTrainer(
        model=model,
        ref_model=None,
        args=_training_arguments(learning_rate=5e-6),
        beta=0.1,
        train_dataset=Dataset.from_list(PREFERENCES),
        tokenizer=tokenizer,
        max_length=48,
        max_prompt_length=12,
    )
    assert (trainer.args.beta, trainer.args.max_length, trainer.args.max_prompt_length) == (0.1, 48, 12)
    bos = tokenizer.bos_token_id
    for record, row in zip(PREFERENCES, trainer.train_dataset):
        full = tokenizer(record["prompt"])["input_ids"]
        kept = full if len(full) <= 12 else [bos] + full[len(full) - 11 :]
        assert row["prompt_ids"] == kept  # the prompt's end, next to the answer, and its BOS
    assert len(tokenizer(PREFERENCES[0]["prompt"])["input_ids"]) > 12  # the limit did cut one
    before = _lora(model)
    trainer.train()
    _assert_trained(model, before, trainer)
    assert any("rewards/chosen" in entry for entry in trainer.state.log_history)


def test_orpo_with_its_config():
    model, tokenizer = _load()
    trainer = ORPOTrainer(
        model=model,
        train_dataset=Dataset.from_list(PREFERENCES),
        tokenizer=tokenizer,
        args=ORPOConfig(
            max_length=48,
            max_prompt_length=10,
            max_completion_length=38,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=1,
            beta=0.1,
            logging_steps=1,
            optim=OPTIM,
            lr_scheduler_type="linear",
            max_steps=2,
            fp16=not is_bfloat16_supported(),
            bf16=is_bfloat16_supported(),
            output_dir="outputs",
            report_to="none",
            disable_tqdm=True,
        ),
    )
    for record, row in zip(PREFERENCES, trainer.train_dataset):
        prompt = row["prompt_input_ids"]
        text = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        assert len(prompt) <= 10 + 1  # the limit, and the BOS TRL puts in front
        if len(text) <= 10:
            assert prompt[1:] == text
    before = _lora(model)
    trainer.train()
    _assert_trained(model, before, trainer)


def test_text_completion_with_an_embedding_learning_rate():
    # float32 weights (dtype=None gives bf16 on a GPU): one step's move of 5e-5 must be
    # measurable, and a bf16 weight of 0.05 only moves in steps of 2e-4.
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(tiny_model_path("llama")),
        max_seq_length=MAX_SEQ,
        dtype=torch.float32,
        load_in_4bit=False,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=8,
        target_modules=PROJECTIONS + ["embed_tokens", "lm_head"],
        lora_alpha=16,
        use_gradient_checkpointing="unsloth",
        random_state=3407,
    )
    assert model.peft_config["default"].modules_to_save == ["embed_tokens", "lm_head"]
    text = "The lighthouse keeper climbs the stairs at dusk and winds the clockwork. " * 3
    dataset = Dataset.from_list([{"text": text + tokenizer.eos_token}] * 4)
    rate, embedding_rate = 5e-4, 5e-5
    trainer = UnslothTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=MAX_SEQ,
        dataset_num_proc=1,
        args=UnslothTrainingArguments(
            per_device_train_batch_size=2,
            gradient_accumulation_steps=1,
            warmup_ratio=0.0,
            max_steps=1,
            learning_rate=rate,
            embedding_learning_rate=embedding_rate,
            fp16=not is_bfloat16_supported(),
            bf16=is_bfloat16_supported(),
            logging_steps=1,
            optim=OPTIM,
            weight_decay=0.0,
            lr_scheduler_type="constant",
            seed=3407,
            output_dir="outputs",
            report_to="none",
            disable_tqdm=True,
        ),
    )
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    # Adam's first step moves each weight by lr * g / (|g| + eps): the learning rate itself
    # wherever the gradient is well above eps.
    moved = {
        n: (p.detach() - weights[n]).abs().max().item() for n, p in model.named_parameters() if n in weights
    }
    embeddings = [n for n in moved if "modules_to_save" in n]
    adapters = [n for n in moved if "lora_B" in n]
    assert len(embeddings) == 2 and adapters
    for name in embeddings:
        assert moved[name] == pytest.approx(embedding_rate, rel=1e-3), name
    for name in adapters:
        assert moved[name] == pytest.approx(rate, rel=1e-3), name


def test_loading_options_refused_or_said_once():
    path = str(tiny_model_path("llama"))
    with pytest.raises(ValueError, match="load_in_8bit=True is not supported: .*use load_in_4bit=True"):
        FastLanguageModel.from_pretrained(path, load_in_8bit=True, load_in_4bit=False)
    with pytest.raises(
        ValueError, match="full_finetuning=True is not supported: slothkit trains LoRA adapters"
    ):
        FastLanguageModel.from_pretrained(path, full_finetuning=True, load_in_4bit=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model, _ = FastLanguageModel.from_pretrained(
                path,
                load_in_4bit=False,
                load_in_8bit=False,
                full_finetuning=False,
                fast_inference=True,
                gpu_memory_utilization=0.6,
                max_lora_rank=8,
            )
    assert (
        sum(
            "fast_inference=True, gpu_memory_utilization=..., max_lora_rank=...) needs no vLLM engine" in n
            for n in _notices(caught)
        )
        == 1
    )
    with pytest.raises(ValueError, match="max_seq_length"):
        FastLanguageModel.get_peft_model(model, max_seq_length=10**9)


def test_translation_refusals_are_one_line():
    with pytest.raises(ValueError, match="warmup_ratio=1.0; .*write warmup_steps=<a number of steps>"):
        TrainingArguments(output_dir="outputs", warmup_ratio=1.0)
    with pytest.raises(TypeError, match="got the keyword\\(s\\) \\['warmup_ration'\\]"):
        TrainingArguments(output_dir="outputs", warmup_ration=0.1)
    with pytest.raises(ValueError, match="save_safetensors=False\\) is not possible any more"):
        TrainingArguments(output_dir="outputs", save_safetensors=False)
    args = TrainingArguments(output_dir="outputs", evaluation_strategy="no", group_by_length=True)
    assert (args.eval_strategy, args.train_sampling_strategy) == ("no", "group_by_length")


def test_grpo_leaves_out_prompts_past_max_prompt_length(recwarn):
    # TRL 1.16's GRPO no longer cuts prompts: the longer ones are left out, said once with
    # their number; a dataset of only longer ones is refused.
    model, tokenizer = _load()
    long = "A prompt that is far too long " * 4
    prompts = Dataset.from_list([{"prompt": "Short."}, {"prompt": long}, {"prompt": "Also short."}])
    args = GRPOConfig(output_dir="outputs", max_prompt_length=8, report_to="none", num_generations=2)
    reward = lambda completions, **_: [0.0] * len(completions)  # noqa: E731
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=prompts, tokenizer=tokenizer
    )
    assert trainer.train_dataset["prompt"] == ["Short.", "Also short."]
    assert any(
        "max_prompt_length=8: 1 of 3 prompts are longer (the longest, prompt 1," in str(w.message)
        for w in recwarn
    )
    with pytest.raises(
        ValueError, match="every prompt is longer than max_prompt_length=8 \\(prompt 0: \\d+ tokens\\)"
    ):
        GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=prompts.select([1]),
            tokenizer=tokenizer,
        )


def test_the_tool_calling_notebooks_loader_call():
    """Unsloth's Qwen2.5-Coder tool-calling notebook: its per-family loader name,
    max_seq_length=None and fix_tokenizer=False."""
    import slothkit
    from slothkit.core.model_state import state_of

    assert slothkit.FastQwen2Model is slothkit.FastLlamaModel is FastLanguageModel
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = slothkit.FastQwen2Model.from_pretrained(
            str(tiny_model_path("qwen2")), max_seq_length=None, load_in_4bit=False, fix_tokenizer=False
        )
    context = model.config.max_position_embeddings
    assert state_of(model).max_seq_length == tokenizer.model_max_length == model.max_seq_length == context
    assert any("from_pretrained(fix_tokenizer=False) is ignored" in n for n in _notices(caught))
