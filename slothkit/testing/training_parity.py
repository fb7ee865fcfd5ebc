"""What the trainer convergence tests share: the same tiny checkpoint loaded as a slothkit
FastModel (fused path) and as plain Hugging Face + PEFT, with the same LoRA
initialisation, and comparisons of what the two runs logged and learned.

    from slothkit.testing.training_parity import load_for_training, history, assert_same_lora
    fused, tokenizer = load_for_training("slothkit")
    plain, _ = load_for_training("hf")

Needs peft; imported by tests only (their fixtures, reference_kernels and quiet_training,
are in tests/slothkit/conftest.py).
"""

from __future__ import annotations

import torch

from slothkit.core.model_state import state_of

MAX_SEQ = 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Trainer settings every parity run shares: no warmup, so the first step already moves;
# no checkpoints written; no progress bar.
RUN = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=1,
    warmup_steps=0,
    save_strategy="no",
    disable_tqdm=True,
    dataloader_pin_memory=False,
)
SEED = 3407  # the LoRA initialisation's (FastModel.get_peft_model's random_state)


def load_for_training(
    kind,
    load_in_4bit=False,
    arch="llama",
    template="llama-3",
    dtype=torch.float32,
    num_labels=None,
    max_seq_length=MAX_SEQ,
    checkpointing=False,
):
    """A tiny checkpoint with LoRA (r=8, alpha=16) on all seven projections.

    Args:
        kind: "slothkit" (FastModel, fused path) or "hf" (transformers
            and PEFT as a user without slothkit would write them).
        load_in_4bit: NF4 weights through bitsandbytes, computing in `dtype`.
        arch: the tiny architecture (slothkit.testing.tiny_model_path).
        template: the chat template to install (slothkit.data.get_chat_template).
        dtype: the weights' (or a 4-bit model's compute) dtype.
        num_labels: None: a causal LM; an integer: a sequence classifier with a score
            head of that many outputs, initialised from the same seed in both kinds.
        max_seq_length: set on the model (the configs' max_length).
        checkpointing: "slothkit" only: its use_gradient_checkpointing (default False:
            none; "offload" is what FastModel users get).

    Returns:
        ``(peft_model, tokenizer)``.
    """
    from slothkit import FastModel
    from slothkit.data import get_chat_template
    from slothkit.testing import tiny_model_path

    path = str(tiny_model_path(arch))
    torch.manual_seed(SEED)  # a new score head draws from the global generator
    if kind == "slothkit":
        model, tokenizer = FastModel.from_pretrained(
            path,
            dtype=dtype,
            load_in_4bit=load_in_4bit,
            max_seq_length=max_seq_length,
            fused=True,
            num_labels=num_labels,
        )
        get_chat_template(tokenizer, template, model=model)
        model = FastModel.get_peft_model(
            model, r=8, lora_alpha=16, use_gradient_checkpointing=checkpointing, random_state=SEED
        )
        assert state_of(model).architecture == arch  # the fused path is on
        return model, tokenizer

    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BitsAndBytesConfig,
    )

    quantization = None
    if load_in_4bit:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None  # as FastModel does
    extra = {} if num_labels is None else {"num_labels": num_labels}
    auto_class = AutoModelForCausalLM if num_labels is None else AutoModelForSequenceClassification
    model = auto_class.from_pretrained(
        path,
        dtype=dtype,
        quantization_config=quantization,
        attn_implementation="sdpa",
        device_map=device_map,
        **extra,
    )
    model.max_seq_length = max_seq_length
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    get_chat_template(tokenizer, template, model=model)
    torch.manual_seed(SEED)
    task_type = "CAUSAL_LM" if num_labels is None else "SEQ_CLS"
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type=task_type, target_modules=TARGETS)
    return get_peft_model(model, config), tokenizer


def lora_weights(model):
    """The trained adapter's LoRA matrices (and a classifier's score head), by name,
    copied to the CPU; DPOTrainer's frozen "ref" copy is left out."""
    return {
        n: p.detach().cpu().clone()
        for n, p in model.named_parameters()
        if ("lora_" in n or "modules_to_save" in n) and ".default." in n
    }


def history(trainer, *keys):
    """For each logged training step, the values of `keys`."""
    return [[entry[key] for key in keys] for entry in trainer.state.log_history if "loss" in entry]


def assert_same_lora(fused, plain, initial, tolerance=1e-3):
    """Every LoRA matrix trained, and trained the same way: the two runs' weights differ by
    less than `tolerance` of the distance they moved.  (Measured over the whole matrix:
    Adam turns a last-digit difference in a near-zero gradient into a difference of a
    fraction of the learning rate in that one element.)"""
    fused_weights, plain_weights = lora_weights(fused), lora_weights(plain)
    assert fused_weights.keys() == plain_weights.keys() == initial.keys()
    for name, weight in fused_weights.items():
        moved = (plain_weights[name] - initial[name]).norm()
        assert moved > 0, name
        assert weight.dtype == torch.float32, name  # not the TRL trainers' bf16 cast of QLoRA adapters
        assert (weight - plain_weights[name]).norm() <= tolerance * moved, name


def assert_trains_as_hf_peft_does(fast, path, device, steps: int = 8, lr: float = 2e-3) -> None:
    """``fast`` (a FastModel with LoRA r=8, alpha=16 on TARGETS) and HF + PEFT loaded from
    ``path`` in fp32, given the same adapters (B drawn at 0.05 so that the first step's
    gradients reach A too), take ``steps`` AdamW steps on one random batch: the losses fall,
    and agree to 1e-5 relative, the adapters to 5e-5."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=TARGETS)
    plain = get_peft_model(plain, config).train().to(device)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for (name, p), (other, q) in zip(sorted(fast.named_parameters()), sorted(plain.named_parameters())):
            assert name == other, (name, other)
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            if "lora_" in name:
                q.copy_(p)
    ids = torch.randint(3, 500, (2, 13), generator=torch.Generator().manual_seed(2)).to(device)
    losses = {}
    for label, model in (("fast", fast), ("plain", plain)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        losses[label] = []
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[label].append(loss.item())
    assert losses["plain"][-1] < losses["plain"][0]
    torch.testing.assert_close(torch.tensor(losses["fast"]), torch.tensor(losses["plain"]), rtol=1e-5, atol=0)
    plain_state = plain.state_dict()
    for name, value in fast.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(value, plain_state[name], rtol=0, atol=5e-5, msg=name)
