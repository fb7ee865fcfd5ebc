"""Long steps run each decoder layer's MLP over token chunks (slothkit.memory.sizes'
SHORT_STEP_TOKENS / MLP_TOKEN_CHUNK, slothkit_kernels.lora.lora_mlp's token_chunk): the
same training, step for step, as the whole MLP."""

import pytest
import torch

import slothkit.memory.memory_model as memory_model
import slothkit.memory.sizes as sizes
import slothkit_kernels.lora.ops as lora
from slothkit import FastModel
from slothkit.testing import build_tiny_model

BATCH, SEQ = 2, 24
LR = 2e-3


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), num_layers=3)


def _train(path, steps=2):
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing="offload")
    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in params]


def test_a_long_step_trains_as_the_whole_mlp(tiny_path, reference_kernels, monkeypatch):
    whole_losses, whole_params = _train(tiny_path)

    calls = {"recompute": 0, "forward": 0}
    recompute, forward = lora._ChunkedLoRAMLPRecompute.apply, lora._chunked_mlp_forward

    def counted_recompute(*args):
        calls["recompute"] += 1
        return recompute(*args)

    def counted_forward(*args):
        calls["forward"] += 1
        return forward(*args)

    monkeypatch.setattr(lora._ChunkedLoRAMLPRecompute, "apply", counted_recompute)
    monkeypatch.setattr(lora, "_chunked_mlp_forward", counted_forward)
    # 48 tokens per step: "long" above 16, in chunks of 20 (20, 20, 8).
    monkeypatch.setattr(sizes, "SHORT_STEP_TOKENS", 16)
    monkeypatch.setattr(sizes, "MLP_TOKEN_CHUNK", 20)
    chunked_losses, chunked_params = _train(tiny_path)

    # Each step: every layer's checkpointed forward, then its recompute, in chunks.
    assert calls == {"forward": 2 * 3, "recompute": 2 * 3}
    torch.testing.assert_close(torch.tensor(chunked_losses), torch.tensor(whole_losses), rtol=1e-5, atol=0)
    # AdamW moves each weight by about lr per step whatever the gradient's size, so an
    # element whose gradient is near zero turns a rounding difference (the chunks sum in
    # another order; on a GPU that shows) into a visible one: allow 1% of one step.  A
    # wrong chunk would move weights by a whole step.
    for chunked, whole in zip(chunked_params, whole_params):
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=LR / 100)


def test_the_memory_model_counts_one_chunk_of_the_mlp_in_long_offloaded_steps():
    from slothkit.models import shape_by_name

    shape = shape_by_name("llama-3-8b")
    i, e = shape.intermediate_size, 2
    long, longer = 2 * sizes.SHORT_STEP_TOKENS, 4 * sizes.SHORT_STEP_TOKENS
    # Beyond the threshold the MLP's share stops growing: only the per-token rest does.
    step = memory_model.activation_bytes(shape, longer) - memory_model.activation_bytes(shape, long)
    per_token_rest = (step - e * shape.vocab_size * (longer - long) // 16) / (longer - long)
    assert per_token_rest < e * 4 * i  # the 4 I per token is gone
    short = sizes.SHORT_STEP_TOKENS
    whole = memory_model.activation_bytes(shape, short) - memory_model.activation_bytes(shape, short // 2)
    assert whole / (short // 2) > e * 4 * i
    # Kept layers and torch's checkpoint run the MLP whole.
    assert (
        memory_model.activation_bytes(shape, long, kept_layers=1) - memory_model.activation_bytes(shape, long)
        > e * 4 * i * (long - sizes.MLP_TOKEN_CHUNK) + memory_model.kept_layer_bytes(shape, long) * 0.99
    )
