"""``model.generate`` after ``FastModel.for_inference``: prefill, then one captured CUDA
graph replayed per new token.

Hugging Face's generate spends most of a small-batch decode step on the host: a few
hundred kernel launches per token from Python, a cache that grows by concatenation and
masks rebuilt each step.  Here the prompt runs once through ``ModelStep`` into a
``StaticKVCache``; the one-token step is then captured as a CUDA graph whose inputs
(token, RoPE position, cache slot) are tensors updated in place, so a token costs one
graph launch plus the sampling.  On a CPU (tests) the same step runs eagerly.

The graph reads the weights where they are when it is captured.  Its key is the address of
every parameter, each LoRA layer's adapter state (active, disabled, merged) and the
model's training mode, checked each call, so moving, merging or switching adapters in
between recaptures it; adapters trained in place are seen through their refreshed
copies (decode_projections.py).
"""

from __future__ import annotations

import math

import torch

from slothkit.core.model_state import state_of
from slothkit.core.notices import DataWarning, FallbackWarning, say_once
from slothkit.inference.image_prompt import image_prompt, last_positions
from slothkit.inference.kv_cache import StaticKVCache
from slothkit.inference.model_step import ModelStep
from slothkit.inference.sampling import (
    eos_ids,
    logits_processors,
    next_tokens,
    setting,
)

# Cache lengths are rounded up to a multiple of this, so that prompts of nearby lengths
# share one cache and one captured graph.
SLOT_ROUNDING = 256
# A call's cache starts with room for its prompt and at most this many new tokens, and
# doubles (up to prompt + max_new_tokens) when the decode reaches its end.  A reasoning
# model asked for max_new_tokens=32768 after a 200-token prompt that stops after 600 then
# holds, and reads at every step, 1,280 slots rather than 33,024 (Qwen3-14B in bf16: 0.2
# GiB a row rather than 5.0), much as Hugging Face's cache, which grows by the token, holds
# what was generated.  Each doubling copies the cache and captures the step again.
FIRST_NEW_TOKENS = 1024


def _rounded_slots(tokens: int) -> int:
    return math.ceil(tokens / SLOT_ROUNDING) * SLOT_ROUNDING


# Tokens between two reads of "has every row finished?" back to the host when nothing
# streams: each read waits for the GPU, and at most this many - 1 steps are decoded
# past the end and discarded.
EOS_CHECK_EVERY = 8


def _weights_key(causal_lm) -> tuple:
    """What the captured step depends on: where every parameter is, each LoRA layer's
    adapter state, and training mode (LoRA dropout then applies).  Every generate call
    computes it, with the GPU idle, so the module tree is walked once and each module's
    own dicts are read directly (``modules()`` builds every module's name, ``parameters()``
    walks the tree again, and ``hasattr`` on a module goes through its ``__getattr__``).
    A module reached twice (tied) counts twice: the key only has to change when the
    model does."""
    addresses, adapters = [], []
    unvisited = [causal_lm]  # depth first, without the names modules() builds on the way
    while unvisited:
        module = unvisited.pop()
        unvisited.extend(child for child in module._modules.values() if child is not None)
        addresses.extend(p.data_ptr() for p in module._parameters.values() if p is not None)
        if "lora_A" in module._modules:
            adapters.append(
                (
                    bool(getattr(module, "disable_adapters", False)),
                    tuple(getattr(module, "merged_adapters", ()) or ()),
                    tuple(getattr(module, "active_adapters", ()) or ()),
                )
            )
    return tuple(addresses), tuple(adapters), causal_lm.training


class _RandomState:
    """The default generator's state of ``device`` after each sampled step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.states: list[torch.Tensor] = []

    def keep(self) -> None:
        self.states.append(torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state())

    def restore(self, step: int) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(self.states[step], self.device)
        else:
            torch.set_rng_state(self.states[step])


class _CapturedStep:
    """The one-token decode step for a fixed batch and cache, as a CUDA graph (or eager on
    a CPU), with its inputs as static tensors."""

    def __init__(self, step: ModelStep, cache: StaticKVCache, use_graph: bool, warm_slot: int = 0):
        device = cache.filled.device
        self.step, self.cache = step, cache
        self.token = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)
        self.slot = torch.full((1,), warm_slot, dtype=torch.long, device=device)
        self.graph = None
        self.logits = None
        if use_graph:
            self._capture()

    def _run(self) -> torch.Tensor:
        self.cache.mark(self.slot)
        return self.step(self.token, self.position, self.cache, self.slot)

    def _capture(self) -> None:
        # Warm up on a side stream (lazy initialisation, autotuning) before capturing; the
        # writes land in the warm slot, which holds no token a later step reads before
        # the decode rewrites it (slot 0 before a prefill; the next slot when the cache
        # grows: empty, or in a ring the position the window has just left), and the marks
        # are put back, as are DeltaNet layers' states, which every step updates in place.
        marks = [self.cache.filled, *self.cache.ring_filled.values()]
        if self.cache.linear_states is not None:
            marks += self.cache.linear_states.tensors()
        kept = [mark.clone() for mark in marks]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()
        for mark, before in zip(marks, kept):
            mark.copy_(before)

    def __call__(self, token: torch.Tensor, position: torch.Tensor, slot: int) -> torch.Tensor:
        self.token.copy_(token.view(-1, 1))
        self.position.copy_(position.view(-1, 1))
        self.slot.fill_(slot)
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits


def _warn_past_context(causal_lm, length: int) -> None:
    """Say (once per length) that a call decodes past the positions the model was made
    for, as Hugging Face's generate does: RoPE still extrapolates, the text degrades."""
    limit = getattr(causal_lm.config.get_text_config(), "max_position_embeddings", None)
    state = state_of(causal_lm)
    if state is not None and state.max_seq_length is not None:
        limit = max(limit or 0, state.max_seq_length)  # extended at load (linear RoPE scaling)
    if limit and length > limit:
        say_once(
            f"slothkit: this generate call reaches {length} tokens (prompt + max_new_tokens), past the "
            f"model's {limit} positions; what it generates beyond them degrades. Lower max_new_tokens, "
            f"or load with a longer max_seq_length (RoPE scaling)",
            DataWarning,
        )


class FastDecoder:
    """Greedy and sampled decoding of one causal LM over a static cache.

    Args:
        causal_lm: the transformers *ForCausalLM (the model inside a PeftModel).
        embedding_scale: the token embeddings are scaled by sqrt(hidden size) (Gemma).
        use_graph: capture the decode step as a CUDA graph (a CUDA model); False runs it
            eagerly (same numbers, host-bound).
        step_class: ModelStep, or a family's own step built on it (Gemma 4's).
    """

    def __init__(self, causal_lm, embedding_scale: bool, use_graph: bool, step_class=ModelStep):
        self.causal_lm = causal_lm
        self.step = step_class(causal_lm, embedding_scale=embedding_scale)
        self.use_graph = use_graph
        self.while_training = False  # also decode for a model in training mode (GRPO, RLOO)
        self.cache: StaticKVCache | None = None
        self.captured: _CapturedStep | None = None
        self._key = None

    def release(self) -> None:
        """Free the cache and the captured graph (for_training calls this)."""
        self.cache = self.captured = self._key = None

    @property
    def nbytes(self) -> int:
        """Device bytes held by the cache (the graph's pool is reported by the bench)."""
        return 0 if self.cache is None else self.cache.nbytes

    def _new_cache(self, batch: int, slots: int, device, linear_states=None) -> StaticKVCache:
        """A cache for ``batch`` rows of ``slots`` tokens, laid out as the step says
        (cache_layout), with ``linear_states`` (a shorter cache's, when it grows) or new ones
        where the model has gated DeltaNet layers."""
        windows, kv_heads, head_dims = self.step.cache_layout()
        dtype = self._kv_dtype()
        try:
            if linear_states is None:
                linear_states = self.step.new_linear_states(batch, device)
            return StaticKVCache(
                len(windows),
                batch,
                kv_heads,
                slots,
                head_dims,
                dtype,
                device,
                windows,
                linear_states=linear_states,
            )
        except torch.OutOfMemoryError as error:
            per_slot = (
                2
                * sum(heads * size for heads, size in zip(kv_heads, head_dims))
                * torch.empty((), dtype=dtype).element_size()
            )
            raise torch.OutOfMemoryError(
                f"slothkit: the key/value cache for {batch} row(s) of {slots} tokens (at most "
                f"{batch * slots * per_slot / 2**30:.2f} GiB) does not fit in the GPU's free memory; "
                f"ask for fewer tokens (max_new_tokens), fewer rows, or a shorter prompt ({error})"
            ) from error

    def _grow(self, slots: int) -> None:
        """Move the tokens so far into a cache of ``slots`` and capture the step for it."""
        shorter = self.cache
        self.captured = None  # the old graph reads the old cache: drop it first
        self.cache = self._new_cache(shorter.batch, slots, shorter.filled.device, shorter.linear_states)
        self.cache.take_over(shorter)
        self._capture(warm_slot=shorter.slots)  # the slot the next step writes

    def _prepare(self, batch: int, slots: int, device) -> None:
        key = _weights_key(self.causal_lm)
        if self.cache is None or not self.cache.fits(batch, slots, self._kv_dtype(), device):
            self.release()
            self.cache = self._new_cache(batch, slots, device)
        if self.captured is None or key != self._key:
            self.captured = None
            self.step.build_projections()
            self._capture()
            self._key = key

    def _capture(self, warm_slot: int = 0) -> None:
        """The decode step for the current cache, as a graph where one can be captured;
        ``warm_slot``: the slot the capture's warm-up may write (the next one the decode
        writes: 0 before a prefill, which rewrites it)."""
        try:
            self.captured = _CapturedStep(self.step, self.cache, self.use_graph, warm_slot)
        except RuntimeError as error:  # a layer that cannot be captured: decode eagerly
            if not self.use_graph:
                raise
            say_once(
                f"slothkit: the decode step could not be captured as a CUDA graph ({error}); "
                "generating without the graph (slower)",
                FallbackWarning,
            )
            self.use_graph = False
            self.captured = _CapturedStep(self.step, self.cache, use_graph=False)

    def _kv_dtype(self):
        # The dtype the attention computes in: that of the embeddings' output (the 16-bit
        # weights of a 4-bit model).
        embeddings = self.causal_lm.get_input_embeddings()
        base = embeddings.get_base_layer() if hasattr(embeddings, "get_base_layer") else embeddings
        return base.weight.dtype

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, config, streamer=None, image_inputs=None) -> torch.Tensor:
        """Decode up to the config's length; returns (B, prompt + new) token ids, rows
        that finished early padded with the pad token, as generate returns them.

        Args:
            input_ids: (B, P) prompt tokens, left-padded for a batch.
            attention_mask: (B, P), 1 for real tokens; None: all real.
            config: the call's GenerationConfig (sampling.generation_config_for).
            streamer: a transformers streamer (put / end), or None.
            image_inputs: an image-text model's images for the prompt (pixel_values and
                the rest, image_prompt.IMAGE_INPUTS), or None.
        """
        device = self.causal_lm.get_input_embeddings().weight.device
        input_ids = input_ids.to(device)
        batch, prompt = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(device)
        max_new = config.max_new_tokens
        if max_new is None:
            max_new = setting(config, "max_length") - prompt
        if max_new <= 0:
            return input_ids
        _warn_past_context(self.causal_lm, prompt + max_new)
        eos = eos_ids(config)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        largest = _rounded_slots(prompt + max_new)
        self._prepare(batch, min(largest, _rounded_slots(prompt + min(max_new, FIRST_NEW_TOKENS))), device)
        self.step.refresh()
        cache = self.cache
        cache.reset(attention_mask)

        # Positions as generate counts them: real tokens from 0, padding at 0.
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        first = torch.zeros(1, dtype=torch.long, device=device)
        # Without padding the prefill needs no mask: the flash kernel, as Hugging Face's
        # prefill uses, or slothkit's tiled kernel where a window or a cap applies.
        causal = bool(attention_mask.all())
        merged = {}
        if image_inputs:  # the model's own vision tower and merge (image_prompt.py)
            prompt_input = image_prompt(self.causal_lm, input_ids, attention_mask, positions, image_inputs)
            positions = prompt_input.positions
            merged = {"inputs_embeds": prompt_input.embeds, "both_ways": prompt_input.both_ways}
            causal = causal and prompt_input.both_ways is None
        logits = self.step(input_ids, positions, cache, first, visible=prompt, causal=causal, **merged)

        processors = logits_processors(config, prompt, device)
        do_sample = bool(setting(config, "do_sample"))
        eos_tensor = torch.tensor(eos, device=device) if eos else None
        # Every token is written into one preallocated output; the rows' "finished" marks
        # stay on the GPU and are read back every EOS_CHECK_EVERY tokens (every token when
        # streaming, which reads each token anyway), so the host queues the next replay
        # while the GPU still runs the last one.  Tokens decoded past the step where every
        # row had finished are cut off: the output is what generate returns.
        out = torch.full((batch, prompt + max_new), pad, dtype=input_ids.dtype, device=device)
        out[:, :prompt] = input_ids
        pad_tokens = torch.full((batch,), pad, dtype=input_ids.dtype, device=device)
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        any_unfinished = torch.ones(max_new, dtype=torch.bool, device=device)
        produced = max_new
        position = last_positions(positions)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # Sampling past the end draws random numbers generate would not: keep the
        # generator's state after each step and put back the one of the last kept token.
        rng = _RandomState(device) if do_sample and eos_tensor is not None else None
        for index in range(max_new):
            token = next_tokens(logits, out[:, : prompt + index], processors, do_sample)
            if rng is not None:
                rng.keep()
            token = torch.where(unfinished, token, pad_tokens)
            out[:, prompt + index] = token
            if streamer is not None:
                streamer.put(token.cpu())
            if eos_tensor is not None:
                unfinished &= ~torch.isin(token, eos_tensor)
                any_unfinished[index] = unfinished.any()
                last = index == max_new - 1
                if streamer is not None or last or (index + 1) % EOS_CHECK_EVERY == 0:
                    finished = (~any_unfinished[: index + 1]).nonzero()
                    if finished.numel():
                        produced = int(finished[0]) + 1
                        if rng is not None:
                            rng.restore(produced - 1)
                        break
            if index == max_new - 1:
                break
            position = position + 1
            if prompt + index >= self.cache.slots:
                self._grow(min(2 * self.cache.slots, largest))
            logits = self.captured(token, position, prompt + index)
        if streamer is not None:
            streamer.end()
        return out if produced == max_new else out[:, : prompt + produced].contiguous()
