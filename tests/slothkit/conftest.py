"""Fixtures for the tests of slothkit's fused model path."""

import pytest


@pytest.fixture
def mlp_calls(monkeypatch):
    """backward_only of each fused MLP call, in call order."""
    from slothkit.engine import decoder
    from slothkit_kernels.lora import lora_mlp

    calls = []

    def recording_lora_mlp(*args, backward_only=False, **kwargs):
        calls.append(backward_only)
        return lora_mlp(*args, backward_only=backward_only, **kwargs)

    monkeypatch.setattr(decoder, "lora_mlp", recording_lora_mlp)
    return calls


@pytest.fixture
def known_sums(monkeypatch):
    """For each fused o_proj residual sum, in call order: whether it was given the sum
    the checkpointed forward kept (and so ran no projection)."""
    from slothkit.engine import decoder_layer
    from slothkit_kernels.lora import lora_o_residual

    calls = []

    def recording(x, o_proj, residual, known_sum=None):
        calls.append(known_sum is not None)
        return lora_o_residual(x, o_proj, residual, known_sum=known_sum)

    monkeypatch.setattr(decoder_layer, "lora_o_residual", recording)
    return calls


@pytest.fixture
def checkpointing_asked(monkeypatch):
    """The keyword arguments FastModel.get_peft_model gives enable_checkpointing, one
    dict per call (the call itself still runs)."""
    from slothkit import fast_model

    calls = []
    enable = fast_model.enable_checkpointing

    def recording(layers, mode, **kwargs):
        calls.append(kwargs)
        return enable(layers, mode, **kwargs)

    monkeypatch.setattr(fast_model, "enable_checkpointing", recording)
    return calls
