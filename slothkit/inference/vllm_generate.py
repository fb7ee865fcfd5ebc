"""vLLM's generation calls on the models FastModel returns, without vLLM: Unsloth's
``fast_inference=True`` notebooks (its GRPO ones above all) write them.

    model.fast_generate(prompts, sampling_params=SamplingParams(...), lora_request=None)
    model.save_lora("grpo_saved_lora")
    model.fast_generate(text, sampling_params=..., lora_request=model.load_lora("grpo_saved_lora"))
    output[0].outputs[0].text

``fast_generate`` tokenizes the prompts, decodes them as one left-padded batch through the
model's ``generate`` (slothkit's fast decode loop on a GPU: slothkit.inference) and returns
vLLM's ``RequestOutput`` records.  Which weights decode is vLLM's rule: with
``lora_request=None`` the base model alone (the adapters switched off for the call); with
a ``LoRARequest`` that adapter, its tensors copied into the model's own adapter for the
call and the trained ones put back after.  A model in training mode is switched to
inference for the call and back after, as ``FastModel.for_inference`` / ``for_training``.

``SamplingParams`` (slothkit.compat.sampling_params) says how each vLLM setting maps onto
``generate``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import pathlib
import types

import torch

from slothkit.compat.sampling_params import SamplingParams
from slothkit.core.inspection import causal_lm_of
from slothkit.core.model_state import state_of
from slothkit.core.notices import DataWarning, say_once
from slothkit.export.adapter_export import check_adapter_weights
from slothkit.export.save import tokenizer_of
from slothkit.inference.sampling import eos_ids

# Rows decoded in one batch: the KV cache grows with rows x (prompt + max_tokens).
MAX_ROWS_PER_BATCH = 64

_lora_ids = itertools.count(1)


@dataclasses.dataclass
class LoRARequest:
    """vLLM's ``LoRARequest``: an adapter saved on disk, for ``fast_generate``.
    ``model.load_lora(path)`` makes one and reads its tensors at once."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    tensors: dict | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a prompt, as vLLM returns it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: None = None
    finish_reason: str | None = None  # "stop": an end token or stop string; "length": max_tokens
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS


@dataclasses.dataclass
class RequestOutput:
    """One prompt's samples, as vLLM returns them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: None = None
    finished: bool = True


def attach_vllm_methods(model) -> None:
    """Give `model` (this instance) ``fast_generate``, and to one with LoRA adapters
    ``save_lora`` and ``load_lora``."""
    model.fast_generate = types.MethodType(generate_like_vllm, model)
    if hasattr(model, "peft_config"):
        model.save_lora = types.MethodType(save_lora, model)
        model.load_lora = types.MethodType(load_lora, model)


def save_lora(model, save_directory, overwrite: bool = False):
    """Unsloth's ``model.save_lora``: the adapter and the tokenizer, saved atomically
    (``save_pretrained_merged(save_directory, save_method="lora")``)."""
    from slothkit.export import save_pretrained_merged

    return save_pretrained_merged(model, save_directory, None, save_method="lora", overwrite=overwrite)


def load_lora(model, save_directory, load_tensors: bool = False) -> LoRARequest:
    """Unsloth's ``model.load_lora``: a LoRARequest for an adapter folder, its tensors read
    and checked against this model's adapter now (``load_tensors`` is accepted: they are
    always read).

    Raises:
        FileNotFoundError: no adapter in the folder.
        ValueError: the adapter is not of this model's layout (other layers, ranks or scaling).
    """
    path = pathlib.Path(save_directory).expanduser().absolute()
    tensors = _adapter_tensors(model, path)
    return LoRARequest(
        lora_name=str(save_directory), lora_int_id=next(_lora_ids), lora_path=str(path), tensors=tensors
    )


def _adapter_tensors(model, path: pathlib.Path) -> dict:
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{path} holds no LoRA adapter (no adapter_config.json): pass the folder model.save_lora wrote"
        )
    check_adapter_weights(path)
    saved = json.loads((path / "adapter_config.json").read_text())
    active = _active_adapter(model)
    own = model.peft_config[active]
    for name in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"):
        mine, theirs = getattr(own, name, None), saved.get(name)
        if (mine or None) != (theirs or None):
            raise ValueError(
                f"the adapter in {path} has {name}={theirs!r}, this model's {name}={mine!r}: fast_generate "
                "decodes an adapter of the model's own layout; load another with FastModel.from_pretrained(path)"
            )
    tensors = load_peft_weights(str(path), device="cpu")
    expected = get_peft_model_state_dict(model, adapter_name=active)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = [key for key in expected if key in tensors and tensors[key].shape != expected[key].shape]
    if missing or extra or wrong:
        first = (missing or extra or wrong)[0]
        raise ValueError(
            f"the adapter in {path} does not fit this model's adapter ({len(missing)} tensors missing, "
            f"{len(extra)} not in the model, {len(wrong)} of another shape; first: {first}): load it with "
            "FastModel.from_pretrained(path)"
        )
    return tensors


def _active_adapter(model) -> str:
    active = model.active_adapter
    return active if isinstance(active, str) else active[0]


def generate_like_vllm(
    model, prompts, sampling_params=None, lora_request=None, use_tqdm: bool = True, **unsupported
) -> list[RequestOutput]:
    """vLLM's ``LLM.generate`` on this model (module docstring).

    Args:
        model: a model from FastModel (with or without LoRA adapters).
        prompts: a string, a list of strings, or vLLM's prompt dicts
            (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``) or a list of them.
        sampling_params: a SamplingParams for every prompt, a list of one per prompt, or
            None: the model's generation_config.json settings (vLLM's rule), max_tokens 16.
        lora_request: None (the base model, adapters off for the call) or a LoRARequest
            (``model.load_lora(path)``).
        use_tqdm: accepted; there is no progress bar.

    Returns:
        One RequestOutput per prompt, in order; ``outputs`` holds ``n`` samples.
    """
    if unsupported:
        raise TypeError(
            f"fast_generate got {', '.join(sorted(unsupported))}; it takes prompts, sampling_params, "
            "lora_request and use_tqdm, as vLLM's LLM.generate"
        )
    tokenizer = tokenizer_of(model)
    if tokenizer is None:
        raise ValueError(
            "fast_generate needs the tokenizer FastModel.from_pretrained returned with the model"
        )
    requests = _prompts(prompts, tokenizer)
    causal_lm = causal_lm_of(model)
    if sampling_params is None:
        sampling_params = SamplingParams.from_generation_config(causal_lm.generation_config)
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(requests):
            raise ValueError(
                f"fast_generate got {len(sampling_params)} SamplingParams for {len(requests)} prompts; "
                "give one, or one per prompt"
            )
        groups = [([index], params) for index, params in enumerate(sampling_params)]
    else:
        groups = [(list(range(len(requests))), sampling_params)]
    results: list[RequestOutput | None] = [None] * len(requests)
    with _weights_for(model, lora_request), _decoding(model):
        for indices, params in groups:
            if not isinstance(params, SamplingParams):
                raise TypeError(
                    f"sampling_params is a {type(params).__name__}; pass slothkit.vllm.SamplingParams "
                    "(vLLM's, by the same name)"
                )
            chosen = [requests[index] for index in indices]
            for index, output in zip(indices, _generate(model, causal_lm, tokenizer, chosen, params)):
                results[index] = output
    return results


def _prompts(prompts, tokenizer) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt.  Text that already starts with the tokenizer's BOS
    (a chat template's output) is not given a second one."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    requests = []
    for prompt in prompts:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            requests.append((prompt.get("prompt"), [int(token) for token in prompt["prompt_token_ids"]]))
            continue
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise TypeError(
                f"fast_generate takes prompts as strings or {{'prompt': text}} / {{'prompt_token_ids': ids}} "
                f"dicts, not {type(prompt).__name__}"
            )
        bos = tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        requests.append((text, tokenizer(text, add_special_tokens=add_special)["input_ids"]))
    if not requests:
        raise ValueError("fast_generate got no prompts")
    return requests


@contextlib.contextmanager
def _weights_for(model, lora_request):
    """The weights vLLM would decode with: the base model alone for None, else the request's
    adapter in place of the model's own for the duration."""
    has_adapters = hasattr(model, "peft_config")
    if lora_request is None:
        with model.disable_adapter() if has_adapters else contextlib.nullcontext():
            yield
        return
    if not has_adapters:
        raise ValueError("fast_generate(lora_request=...) needs a model with LoRA adapters (get_peft_model)")
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(
            f"lora_request is a {type(lora_request).__name__}; pass model.load_lora(path) (or None for the base model)"
        )
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    tensors = lora_request.tensors
    if tensors is None:  # a LoRARequest made by hand
        tensors = lora_request.tensors = _adapter_tensors(model, pathlib.Path(lora_request.lora_path))
    active = _active_adapter(model)
    own = {
        key: value.detach().clone()
        for key, value in get_peft_model_state_dict(model, adapter_name=active).items()
    }
    set_peft_model_state_dict(model, tensors, adapter_name=active)  # copied in place: the same parameters
    try:
        yield
    finally:
        set_peft_model_state_dict(model, own, adapter_name=active)


@contextlib.contextmanager
def _decoding(model):
    """The model as FastModel.for_inference leaves it (eval mode, the KV cache on, the fast
    decode loop where it runs) for the call, and as it was after."""
    from slothkit.inference import disable_fast_decode, enable_fast_decode

    causal_lm = causal_lm_of(model)
    state = state_of(model)
    had_decoder = state is not None and state.fast_decoder is not None
    was_training, use_cache = model.training, causal_lm.config.use_cache
    model.eval()
    causal_lm.config.use_cache = True
    enabled_here = not had_decoder and enable_fast_decode(model)
    try:
        yield
    finally:
        if enabled_here:
            disable_fast_decode(model)  # frees the cache and graph, as for_training does
        model.train(was_training)
        causal_lm.config.use_cache = use_cache


def _stops(causal_lm, tokenizer, params: SamplingParams):
    """The token ids that end a sample (the model's and tokenizer's EOS, stop_token_ids,
    and stop strings that are one token), and the stop strings cut from the text."""
    eos = set(eos_ids(causal_lm.generation_config))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    by_token = {token: token for token in params.stop_token_ids}
    cut_strings = []
    vocabulary = tokenizer.get_vocab()
    for text in params.stop:
        token = vocabulary.get(text)
        if token is not None and tokenizer.convert_tokens_to_string([text]) == text:
            by_token[token] = text
        else:
            cut_strings.append(text)
    if cut_strings:
        say_once(
            f"fast_generate: stop strings {cut_strings!r} span more than one token: each sample decodes "
            "to its end token or max_tokens and its text is cut where one first appears",
            DataWarning,
        )
    return eos, by_token, cut_strings


def _generate(model, causal_lm, tokenizer, requests, params: SamplingParams) -> list[RequestOutput]:
    eos, by_token, cut_strings = _stops(causal_lm, tokenizer, params)
    stop_ids = sorted(eos | set(by_token))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    prompts = [
        ids[-params.truncate_prompt_tokens :] if params.truncate_prompt_tokens else ids for _, ids in requests
    ]
    rows = [prompt for prompt in prompts for _ in range(params.n)]
    limit = _context_length(causal_lm)
    settings = params.generate_settings()
    samples = []
    with _seeded(params.seed, causal_lm):
        for start in range(0, len(rows), MAX_ROWS_PER_BATCH):
            batch = rows[start : start + MAX_ROWS_PER_BATCH]
            longest = max(len(row) for row in batch)
            max_new = params.max_tokens if params.max_tokens is not None else limit - longest
            if max_new < 1:
                raise ValueError(
                    f"a prompt of {longest} tokens leaves no room in the model's {limit} positions; "
                    "set max_tokens or shorten the prompt"
                )
            device = causal_lm.get_input_embeddings().weight.device
            input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, prompt in enumerate(batch):  # left padding: every prompt ends at the same column
                input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
                attention_mask[row, longest - len(prompt) :] = 1
            sequences = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=params.min_tokens or None,
                eos_token_id=stop_ids,
                pad_token_id=pad,
                **settings,
            )
            samples.extend(sequences[:, longest:].tolist())
    outputs = []
    for number, ((text, _), prompt) in enumerate(zip(requests, prompts)):
        completions = [
            _completion(
                index, samples[number * params.n + index], tokenizer, params, eos, by_token, cut_strings
            )
            for index in range(params.n)
        ]
        outputs.append(RequestOutput(str(number), text, prompt, completions))
    return outputs


def _completion(index, new_tokens, tokenizer, params, eos, by_token, cut_strings) -> CompletionOutput:
    """One sample's CompletionOutput: its tokens up to the first end token (kept in
    token_ids, as vLLM keeps it), its text up to the first stop string."""
    finish, reason, shown = "length", None, new_tokens
    for position, token in enumerate(new_tokens):
        if token in eos or token in by_token:
            new_tokens = new_tokens[: position + 1]
            shown = new_tokens[:position]
            finish = "stop"
            reason = by_token.get(token)
            break
    decode = (
        (lambda ids: tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens))
        if params.detokenize
        else (lambda ids: "")
    )
    text = decode(shown)
    if isinstance(reason, str) and params.include_stop_str_in_output:
        text += reason
    found = [(text.find(stop), stop) for stop in cut_strings if stop in text]
    if found:
        position, stop = min(found)
        text = text[: position + (len(stop) if params.include_stop_str_in_output else 0)]
        finish, reason = "stop", stop
        new_tokens = _tokens_covering(new_tokens, len(text), decode)
    return CompletionOutput(index, text, list(new_tokens), finish_reason=finish, stop_reason=reason)


def _tokens_covering(tokens: list[int], length: int, decode) -> list[int]:
    """The shortest prefix of `tokens` whose text is at least `length` characters."""
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if len(decode(tokens[:middle])) >= length:
            high = middle
        else:
            low = middle + 1
    return tokens[:low]


def _context_length(causal_lm) -> int:
    state = state_of(causal_lm)
    if state is not None and state.max_seq_length:
        return state.max_seq_length
    return int(getattr(causal_lm.config, "max_position_embeddings", 2048))


@contextlib.contextmanager
def _seeded(seed, causal_lm):
    """torch's generators seeded with `seed` for the call and put back after (vLLM's
    per-request seed leaves the caller's random state alone); nothing for None."""
    if seed is None:
        yield
        return
    device = causal_lm.get_input_embeddings().weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
