"""use_gradient_checkpointing="auto": keep as many decoder layers' activations as the
memory budget allows, and offload the rest.

A layer that is not checkpointed keeps what it saves for backward on the GPU (about
13 hidden states per token on Llama-3-8B: 0.4 GiB per layer at 2 x 2048 tokens) and is
not re-run in backward, which saves about a third of its work; an offloaded one
(slothkit.engine.checkpointing.offload_checkpoint) keeps only its input, in host memory.  The policy
keeps the last layers and offloads the first ones: in backward the last layers run
first, so the offloaded inputs come back while the kept layers' backward runs, and the
last layers' inputs, the newest ones offloaded, are not copied out just to be copied
straight back.

How many layers to keep is slothkit.memory.memory_model's arithmetic on the model's shape
(``TrainingMemory.recompute_choice``: the most layers with the predicted peak reserved
memory at or under the budget), the same that `slothkit plan` prints.  It depends on
the tokens per step: decided when ``get_peft_model`` is given the batch size (with
max_seq_length), else at the first training forward from the input's shape, and again
whenever a step with more tokens arrives.  Each decision is said in one line.

The budget: ``max_memory`` (GiB, or bytes) when given; else the memory this process can
have on the model's GPU (its free memory plus what this process already reserved,
capped by a per-process memory fraction) less 5 %.  On a CPU, with no max_memory, there
is no budget: every layer is offloaded, as with "offload", and that is said once.

Host memory has a budget too: ``max_host_memory`` (GiB, or bytes), else the host's
available memory less 10 %.  Offloaded layers pin their inputs (and kept sums) there:
at long context that is more than a free Colab's 12.7 GB (Llama-3-8B at 90K tokens: 22
GiB of inputs alone), and a host that runs out kills the process, notebook kernel
included.  The layers the host cannot take are checkpointed on the GPU instead (their
inputs stay there, as with plain checkpointing), which the GPU budget then pays for.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch import nn

from slothkit.core.model_state import attach_state, state_of
from slothkit.memory.memory_model import (
    RecomputeChoice,
    TrainingMemory,
    budget_from_free,
    free_bytes,
    gib_or_bytes,
)
from slothkit.models.shape import shape_from_config


class RecomputeNotice(UserWarning):
    """What use_gradient_checkpointing="auto" chose, in one line."""


def budget_bytes(max_memory, device: torch.device) -> float | None:
    """The budget in bytes: ``max_memory`` (a number of GiB, or of bytes from 2**20 up),
    else ``budget_from_free(free_bytes(device))``; None when neither is known.

    Args:
        max_memory: the budget asked for, or None.
        device: the model's device.

    Raises:
        ValueError: max_memory is not a positive number.
    """
    if max_memory is not None:
        return gib_or_bytes("max_memory", max_memory)
    free = free_bytes(device)
    return None if free is None else budget_from_free(free)


@functools.cache
def _notice_no_budget(device_type: str) -> None:
    warnings.warn(
        f"slothkit: use_gradient_checkpointing='auto' has no memory budget on the {device_type} "
        f"(give one with max_memory=): every layer is offloaded, as with 'offload'",
        RecomputeNotice,
        stacklevel=4,
    )


@functools.cache
def _notice_unfused(model_type: str) -> None:
    warnings.warn(
        f"slothkit: use_gradient_checkpointing='auto' predicts memory for slothkit's fused layers, "
        f"and {model_type!r} trains through Hugging Face's: every layer is offloaded, as with 'offload'",
        RecomputeNotice,
        stacklevel=4,
    )


class RecomputePolicy:
    """The per-layer choice for one model: which decoder layers are checkpointed.

    Args:
        layers: the decoder layers, checkpointed by ``enable_checkpointing`` with one
            OffloadedCheckpointer (the policy sets each layer's ``gradient_checkpointing``,
            and its ``_gradient_checkpointing_func`` to that checkpointer or to its
            ``on_device`` form).
        memory: the model's TrainingMemory.
        budget: the GPU budget in bytes.
        host_budget: the host budget in bytes, or None for no limit.
        may_stop_keeping: whether the policy may turn the checkpointer's kept sums off
            where only that makes the step fit (not where the user asked for them).
    """

    def __init__(
        self,
        layers,
        memory: TrainingMemory,
        budget: float,
        host_budget: float | None = None,
        may_stop_keeping: bool = True,
    ):
        self.layers = list(layers)
        self.memory = memory
        self.budget = budget
        self.host_budget = host_budget
        self.may_stop_keeping = may_stop_keeping
        self.checkpointer = self.layers[0]._gradient_checkpointing_func
        self.choice: RecomputeChoice | None = None

    def decide(self, tokens: int) -> RecomputeChoice:
        """Choose for steps of ``tokens`` tokens, unless a choice for at least as many
        stands; say what was chosen when it differs from the last choice.

        Args:
            tokens: tokens per step (batch x sequence).

        Returns:
            The choice in force.

        Raises:
            slothkit.memory.memory_model.MemoryBudgetError: not even every layer offloaded fits.
        """
        if self.choice is not None and tokens <= self.choice.tokens:
            return self.choice
        previous = self.choice
        self.choice = self.memory.recompute_choice(
            tokens, self.budget, self.host_budget, self.may_stop_keeping
        )
        if self.choice.stops_keeping:
            # From now on the layers keep nothing for their re-runs (a layer graph captured
            # while keeping is keyed apart and no longer replayed), and later choices are
            # made for layers that keep nothing.
            self.checkpointer.keeps = False
            self.memory = dataclasses.replace(self.memory, keep_sums=False)
        checkpointed = self.choice.offloaded + self.choice.on_gpu
        for index, layer in enumerate(self.layers):
            layer.gradient_checkpointing = index < checkpointed
            on_gpu = self.choice.offloaded <= index < checkpointed
            layer._gradient_checkpointing_func = self.checkpointer.on_device if on_gpu else self.checkpointer
        # Said when the split changes: a run whose padded lengths creep up step by step
        # would otherwise print a line per new longest batch.
        if previous is None or (previous.kept, previous.on_gpu) != (self.choice.kept, self.choice.on_gpu):
            warnings.warn(self.choice.notice(), RecomputeNotice, stacklevel=3)
        return self.choice

    def before_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder (the stack of layers): decide from the step's
        tokens before any layer runs.  Not a hook on the first layer: transformers up to
        5.1x checkpoint a layer in its ``__call__``, which reads the layer's flag before the
        layer's hooks run and runs them under the checkpoint's no_grad.

        Args:
            module: the decoder (``model.model`` of a *ForCausalLM).
            args: its positional arguments (input_ids first).
            kwargs: its keyword arguments.
        """
        if not (module.training and torch.is_grad_enabled()):
            return
        embeds = kwargs.get("inputs_embeds")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
            self.decide(embeds.numel() // embeds.shape[-1])
        elif isinstance(ids, torch.Tensor) and ids.dim() >= 1:
            self.decide(ids.numel())


def training_memory(causal_lm: nn.Module, peft_model: nn.Module, checkpointer) -> TrainingMemory:
    """The TrainingMemory of a model as it will train: its shape, 4-bit or not, its
    trained parameters (weight, gradient and two AdamW moments each), LoRA rank, compute
    dtype and the checkpointer's CUDA graphs and kept sums.

    Args:
        causal_lm: the transformers model (inside the PeftModel).
        peft_model: the PeftModel.
        checkpointer: the layers' OffloadedCheckpointer.
    """
    from slothkit.core.inspection import compute_dtype, is_4bit_model

    trainable = sum(4 * p.numel() * p.element_size() for p in peft_model.parameters() if p.requires_grad)
    config = getattr(peft_model, "peft_config", {}).get("default")
    graphs = getattr(checkpointer, "graphs", None)
    return TrainingMemory(
        shape_from_config(causal_lm.config),
        "qlora" if is_4bit_model(causal_lm) else "lora",
        float(trainable),
        rank=getattr(config, "r", 16),
        element_bytes=compute_dtype(causal_lm).itemsize,
        cuda_graphs=graphs is not None,
        keep_sums=bool(getattr(checkpointer, "keeps", False)),
        graph_max_tokens=graphs.max_tokens if graphs is not None else checkpointer.keep_max_tokens,
    )


def enable_recompute_policy(
    causal_lm: nn.Module,
    peft_model: nn.Module,
    layers,
    max_memory=None,
    tokens: int | None = None,
    keeps_as_asked: bool = False,
) -> RecomputePolicy | None:
    """Turn use_gradient_checkpointing="auto" on for layers that ``enable_checkpointing``
    has set up for "offload": every layer stays offloaded until the policy decides.

    Args:
        causal_lm: the transformers model (inside the PeftModel).
        peft_model: the PeftModel (its trained parameters and LoRA config).
        layers: the decoder layers.
        max_memory: the budget, GiB or bytes; None: from the GPU's free memory.
        tokens: the tokens per step if known (batch size x max_seq_length): decide now.
        keeps_as_asked: the user chose the checkpointer's kept sums (keep_sums=True): the
            policy does not turn them off to fit the budget (by default it does, said in
            its one line).

    The host budget is the layers' checkpointer's ``host_limit_bytes`` (FastModel sets it
    from ``max_host_memory``): the plan is made within the limit the checkpointer keeps.

    Returns:
        The policy, also kept as the model's ``state_of(model).recompute_policy``; None
        where there is no budget or the model is not on slothkit's fused path (then the
        layers stay offloaded, said once).

    Raises:
        ValueError: max_memory is not accepted.
        slothkit.memory.memory_model.MemoryBudgetError: with ``tokens``, not even every layer
            offloaded fits the budget.
    """
    device = next(causal_lm.parameters()).device
    budget = budget_bytes(max_memory, device)
    if budget is None:
        # On a CPU nothing is budgeted (from_pretrained's notice already said that a CPU
        # keeps Hugging Face's modules); a notebook's "auto" must not add a second line there.
        if device.type != "cpu":
            _notice_no_budget(device.type)
        return None
    state = state_of(causal_lm)
    if state is None or state.architecture is None:
        _notice_unfused(causal_lm.config.model_type)
        return None
    layers = list(layers)
    checkpointer = layers[0]._gradient_checkpointing_func
    memory = training_memory(causal_lm, peft_model, checkpointer)
    policy = RecomputePolicy(
        layers, memory, budget, checkpointer.host_limit_bytes, may_stop_keeping=not keeps_as_asked
    )
    if tokens is not None:
        policy.decide(tokens)
    causal_lm.model.register_forward_pre_hook(policy.before_decoder, with_kwargs=True)
    attach_state(causal_lm).recompute_policy = policy
    return policy
