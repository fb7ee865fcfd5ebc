"""What slothkit knows about a model it loaded or patched, as typed records attached to
the instances they describe.

    state = attach_state(model)          # the model's ModelState, made on first use
    state.tokenizer = tokenizer
    state_of(peft_model).tokenizer       # the same record, through the PeftModel

Three records, each kept under its own attribute name (``_ATTRIBUTES``) in the
instance's ``__dict__`` and read only through this module's functions, so that every
link between modules is an import, and a renamed field fails loudly:

- ``ModelState`` on the transformers model (the *ForCausalLM or
  *ForSequenceClassification): the architecture the fused path was patched for, the
  tokenizer loaded with it, the longest sequence to train on, the recompute policy and
  the fast decoder.  A ``peft.PeftModel`` wraps that same instance
  (``base_model.model``), so the record survives PEFT wrapping, merging and unloading
  without being copied.
- ``PatchedModule`` on each module whose forward slothkit replaced: its own forward
  and what the replacement reads (a norm's epsilon, an MLP's activation, ...).
- ``NF4Cache`` on a 4-bit weight: its ``NF4Weight`` description, with the key that says
  whether it still describes the weight.

A deep copy or a pickle of the model carries the records, like any other attribute,
except the fast decoder (a KV cache and CUDA graphs of the original), which the copy
drops.  The tokenizer does not point back at the model (slothkit.data.chat_templates
keeps that link weakly), so it pickles without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from slothkit.core.inspection import causal_lm_of


@dataclasses.dataclass
class ModelState:
    """What slothkit knows about one loaded model.

    Attributes:
        architecture: the name of the architecture record the fused path was patched
            for (slothkit.engine.decoder.patch_decoder); None: the plain Hugging Face path.
        tokenizer: the tokenizer FastModel loaded with the model (FastVisionModel: the
            processor); the save methods and the training/inference switch use it when
            none is passed.
        max_seq_length: the longest sequence to train on, as from_pretrained or
            get_peft_model were given it.
        recompute_policy: use_gradient_checkpointing="auto"'s policy
            (slothkit.engine.checkpointing.recompute_policy.RecomputePolicy), else None.
        fast_decoder: the FastDecoder ``for_inference`` attached (slothkit.inference),
            else None; not copied with the model.
        fast_decode_refused: why the fast loop of a family without a record disagreed
            with the model's own forward when it was switched on (slothkit.inference.
            decode_check), so that later switches keep Hugging Face's generate; else None.
    """

    architecture: str | None = None
    tokenizer: Any = None
    max_seq_length: int | None = None
    recompute_policy: Any = None
    fast_decoder: Any = None
    fast_decode_refused: str | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "fast_decoder": None}

    def __deepcopy__(self, memo: dict) -> ModelState:
        import copy

        return ModelState(**copy.deepcopy(self.__getstate__(), memo))


@dataclasses.dataclass
class PatchedModule:
    """A module whose forward slothkit replaced (slothkit.engine.decoder).

    Attributes:
        original_forward: the module's own forward, which runs whenever the fused path
            cannot.
        eps: an RMSNorm's epsilon.
        adds_one: whether an RMSNorm scales by ``1 + weight`` (Gemma).
        activation: a gated MLP's activation ("swiglu", "geglu", "geglu_tanh").
        attention_values: an attention's output before its output projection
            (slothkit.engine.decoder.attention_values bound to the module), which the
            decoder layer's forward calls to fuse o_proj with the residual sum.
        checkpoints_in_forward: whether transformers checkpoints the decoder layer by
            wrapping its class's forward (slothkit.engine.decoder_layer).
        qk_norm: whether an attention normalises each head's q and k before RoPE (Qwen3).
        output_unread_in_recompute: whether a gated MLP's output goes straight into the
            layer's output sum, so that a checkpoint's re-run may skip its down projection.
        sandwich_norms: whether a decoder layer normalises its attention's and MLP's
            outputs before their residual sums (Gemma 3).
    """

    original_forward: Callable
    eps: float | None = None
    adds_one: bool = False
    activation: str | None = None
    attention_values: Callable | None = None
    checkpoints_in_forward: bool = False
    qk_norm: bool = False
    output_unread_in_recompute: bool = False
    sandwich_norms: bool = False


@dataclasses.dataclass
class NF4Cache:
    """A 4-bit weight's NF4Weight description and the key it was made for (storage,
    device and quant_state: a moved or re-quantised weight needs a new one), and the row
    slices of it read so far (a fused projection's parts: Phi-3's q, k, v), by (start, stop)."""

    key: tuple
    weight: Any
    rows: dict = dataclasses.field(default_factory=dict)


_Record = TypeVar("_Record", ModelState, PatchedModule, NF4Cache)

# The attribute each kind of record is kept under; nothing outside this module reads them.
# A causal LM carries two: its ModelState and, patched, its own PatchedModule.
_ATTRIBUTES = {ModelState: "_slothkit_state", PatchedModule: "_slothkit_patched", NF4Cache: "_slothkit_nf4"}


def _attached(obj, kind: type[_Record]) -> _Record | None:
    return vars(obj).get(_ATTRIBUTES[kind])


def _attach(obj, record: _Record) -> _Record:
    vars(obj)[_ATTRIBUTES[type(record)]] = record
    return record


def state_of(model: nn.Module) -> ModelState | None:
    """The ModelState of ``model`` (a PeftModel or the transformers model inside it), or
    None when slothkit never attached one (a model not loaded through FastModel)."""
    return _attached(causal_lm_of(model), ModelState)


def attach_state(model: nn.Module) -> ModelState:
    """The ModelState of ``model``, attached (empty) on first use; the one way to write it."""
    causal_lm = causal_lm_of(model)
    state = _attached(causal_lm, ModelState)
    if state is None:
        state = _attach(causal_lm, ModelState())
    return state


def patched_module(module: nn.Module) -> PatchedModule | None:
    """The PatchedModule record of ``module``, or None when its forward is its own."""
    return _attached(module, PatchedModule)


def attach_patched_module(module: nn.Module, record: PatchedModule) -> PatchedModule:
    """Attach ``record`` to ``module``, keeping an existing record's original forward (a
    module patched twice still falls back to its own forward, not to the first patch)."""
    existing = patched_module(module)
    if existing is not None:
        record = dataclasses.replace(record, original_forward=existing.original_forward)
    return _attach(module, record)


def detach_patched_module(module: nn.Module) -> PatchedModule | None:
    """Remove and return ``module``'s PatchedModule record (None when it has none)."""
    record = patched_module(module)
    if record is not None:
        del vars(module)[_ATTRIBUTES[PatchedModule]]
    return record


def nf4_cache(param) -> NF4Cache | None:
    """The NF4Cache kept on a 4-bit weight, or None."""
    return _attached(param, NF4Cache)


def keep_nf4_cache(param, key: tuple, weight) -> None:
    """Keep ``weight`` (an NF4Weight) on ``param`` for ``key``."""
    _attach(param, NF4Cache(key, weight))
