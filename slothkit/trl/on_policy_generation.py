"""On-policy trainers (GRPO, RLOO) sample their completions through slothkit's fast
decode loop.

TRL's online trainers call ``model.generate`` in training mode under ``no_grad`` once
per step, for every prompt times num_generations completions; with Hugging Face's
generate that sampling is most of a step.  Here ``trainer.train`` gives the model a
FastDecoder that also serves training mode: the prompts are prefilled into a static KV
cache and each new token is one replay of the captured decode step.  The adapters are
read where the optimizer updates them (their copies refresh when their version moves),
so no weights are copied between the update and the next sampling.  The cache and the
graph stay allocated across steps and are freed when ``train`` returns.
"""

from __future__ import annotations

from slothkit.core.model_state import state_of
from slothkit.inference import disable_fast_decode, enable_fast_decode


def generate_on_fast_path(trainer, model, fast: bool | None = None):
    """Make ``trainer.train()`` sample through the fast decode loop (this trainer
    instance only).

    Args:
        trainer: a TRL GRPOTrainer or RLOOTrainer.
        model: the model it trains (from FastModel).
        fast: None: where the fast loop pays (a CUDA GPU, Llama/Mistral/Gemma), else
            Hugging Face's generate with a one-line notice; True: also on a CPU (the same
            numbers, for tests); False: Hugging Face's generate.

    Returns:
        The same trainer.
    """
    train = trainer.train

    def train_sampling_fast(*args, **kwargs):
        state = state_of(model)
        had_decoder = state is not None and state.fast_decoder is not None
        enabled = enable_fast_decode(model, fast, while_training=True)
        try:
            return train(*args, **kwargs)
        finally:
            if enabled and not had_decoder:
                disable_fast_decode(model)  # free the cache and the graph for what follows
            elif enabled:
                enable_fast_decode(model, fast, while_training=False)

    trainer.train = train_sampling_fast
    return trainer
