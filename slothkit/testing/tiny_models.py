"""Tiny random checkpoints of real architectures, built offline in a fraction of a second.

Every slothkit test and notebook that needs "a Llama" or "a Gemma" uses these instead of
downloading one. A checkpoint is a folder holding what a Hub model holds (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json with a chat
template, special_tokens_map.json), so `AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)` load it with no network.

The models are tiny (hidden 64 by default) but keep the traits of the architecture that
kernels and patching code must get right; each architecture record (slothkit.models, its
`tiny` traits) says which:

    arch     attention                 MLP        norm        head   rope theta  tokenizer
    llama    GQA                       SiLU GLU   w * x       own    500000      byte-level BPE
    mistral  GQA, sliding window (32)  SiLU GLU   w * x       own    10000       SentencePiece-style
    gemma    GQA, head_dim 256         GeGLU      (1 + w) * x tied   10000       SentencePiece-style
             (embeddings scaled by sqrt(hidden) inside GemmaModel)
    gemma3   as gemma, q/k norms, four  GeGLU      (1 + w) * x tied   1000000 /   SentencePiece-style
             norms per layer; sliding window (16) on every                    10000 (sliding)
             second layer, the others global
    gemma2   as gemma3 without q/k     GeGLU      (1 + w) * x tied   10000       SentencePiece-style
             norms; scores soft-capped at 50, logits at 30
    qwen2    GQA, q/k/v biases         SiLU GLU   w * x       own    1000000     Qwen's byte-level BPE
    qwen3    GQA, q/k norms per head,  SiLU GLU   w * x       own    1000000     Qwen's byte-level BPE
             head_dim 32 (not hidden / heads)
    phi3     GQA, one qkv_proj         SiLU GLU,  w * x       own    10000       SentencePiece-style
                                       one gate_up_proj

The tokenizers (slothkit.testing.tiny_tokenizers) have a few hundred tokens; the model's
vocabulary is padded up to a multiple of 256 (or to Gemma's real 256,000 rows with
`large_vocab=True`); the padding rows are never produced by the tokenizer.

    path = tiny_model_path("gemma")                    # built once per process, then cached
    path = build_tiny_model("llama", hidden_size=256, intermediate_size=512)  # GGUF K-quant rows
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import pathlib
import tempfile

import torch

from slothkit.models import RECORDS as _RECORDS
from slothkit.models import Architecture, architecture_named
from slothkit.testing.tiny_tokenizers import (
    ARCHITECTURES,
    TOKENIZER_FLAVOURS,
    _check_choice,
    _write_json,
    _write_tokenizer,
)

LARGE_VOCAB_SIZE = 256_000  # Gemma's real vocabulary

# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def build_tiny_model(
    arch: str,
    path: str | pathlib.Path | None = None,
    *,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    large_vocab: bool = False,
    max_position_embeddings: int = 2048,
    sliding_window: int | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> pathlib.Path:
    """Write a random-initialised checkpoint of `arch` with its tokenizer; return the folder.

    arch: a record's name (slothkit.models.RECORDS: "llama", "gemma", ...; the module docstring
        says what each keeps).
    path: where to write; a fresh temporary folder (left for the caller) when None.
    intermediate_size: MLP width; default 3 * hidden_size.
    head_dim: default hidden_size // num_heads, except Gemma's, Gemma 3's and Gemma 2's 256 and Qwen3's 32.
    vocab_size: model vocabulary (embedding rows); default the tokenizer's size rounded up
        to a multiple of 256. `large_vocab=True` gives 256,000 rows instead.
    sliding_window: records with a sliding window only; default the record's (Mistral: 32, Gemma 3,
        Gemma 2: 16), so sequences longer than that hit it.
    tokenizer: "bpe", "qwen" or "sentencepiece"; default the record's (Llama: "bpe", Qwen:
        "qwen", the others: "sentencepiece").
    seed: the weights are a pure function of the arguments.

    When hidden_size, intermediate_size and num_heads * head_dim are multiples of 256 (as with
    hidden_size=256, intermediate_size=512 and the other defaults, for every arch but Qwen3,
    which also needs head_dim=64) every weight row is a multiple of 256 long, as GGUF
    K-quants need.

    Weights are normal with std 1/sqrt(fan_in), so every layer changes its input by a
    comparable amount and the logits spread over a few units rather than collapsing to a
    uniform distribution. RMSNorm weights are their neutral value (1, or 0 for Gemma's
    (1 + w)) plus noise of std 0.1, so confusing `w` with `1 + w` changes the output a lot.
    """
    _check_choice("arch", arch, ARCHITECTURES)
    record = architecture_named(arch)
    flavour = tokenizer if tokenizer is not None else record.tiny.tokenizer
    _check_choice("tokenizer", flavour, TOKENIZER_FLAVOURS)
    if dtype not in _DTYPES:
        raise TypeError(f"dtype must be one of {_DTYPES}; got {dtype!r}")
    for name, value in [
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("max_position_embeddings", max_position_embeddings),
    ]:
        _check_positive(name, value)
    intermediate_size = 3 * hidden_size if intermediate_size is None else intermediate_size
    _check_positive("intermediate_size", intermediate_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        head_dim = record.tiny.head_dim
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}) "
                "unless head_dim is given"
            )
        head_dim = hidden_size // num_heads
    _check_positive("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings; got {head_dim}")
    if sliding_window is None:
        sliding_window = record.tiny.sliding_window
    elif not record.sliding_window:
        windowed = [a.name for a in _RECORDS if a.sliding_window]
        raise ValueError(f"sliding_window applies to {', '.join(windowed)} only; got it for {arch!r}")
    else:
        _check_positive("sliding_window", sliding_window)

    path = (
        pathlib.Path(path) if path is not None else pathlib.Path(tempfile.mkdtemp(prefix=f"slothkit-{arch}-"))
    )
    path.mkdir(parents=True, exist_ok=True)
    tok = _write_tokenizer(flavour, arch, path, max_position_embeddings)

    if large_vocab:
        if vocab_size not in (None, LARGE_VOCAB_SIZE):
            raise ValueError(
                f"large_vocab=True means vocab_size {LARGE_VOCAB_SIZE}; got vocab_size={vocab_size}"
            )
        vocab_size = LARGE_VOCAB_SIZE
    elif vocab_size is None:
        vocab_size = -(-tok.size // 256) * 256
    if vocab_size < tok.size:
        raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer's {tok.size} tokens")

    # The end of a document, and (for chat) the end of an assistant turn, both stop generation.
    eos_ids = [tok.eos_id] + ([tok.end_of_turn_id] if tok.end_of_turn_id != tok.eos_id else [])
    eos = eos_ids[0] if len(eos_ids) == 1 else eos_ids

    config = _make_config(
        record,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        bos_token_id=tok.bos_id,
        eos_token_id=eos,
        pad_token_id=tok.pad_id,
        dtype=dtype,
    )
    _write_json(path / "config.json", _config_json(config, record))
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": tok.bos_id, "eos_token_id": eos, "pad_token_id": tok.pad_id, "do_sample": False},
    )

    from safetensors.torch import save_file

    weights = _random_weights(config, record, seed)
    save_file(
        {k: v.to(dtype) for k, v in weights.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return path


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


def _make_config(record: Architecture, *, dtype: torch.dtype, sliding_window: int | None, **sizes):
    from transformers import AutoConfig

    tiny_config = dict(record.tiny.config)
    if "layer_types" in tiny_config:  # a pattern, repeated over as many layers as are built
        pattern = tiny_config["layer_types"]
        tiny_config["layer_types"] = [pattern[i % len(pattern)] for i in range(sizes["num_hidden_layers"])]
    kwargs = dict(
        sizes,
        architectures=[record.causal_lm_class],
        **{key: record.hidden_act for key in record.activation_keys},  # every name transformers reads
        rope_theta=record.tiny.rope_theta,  # transformers 5 moves this into rope_parameters itself
        rms_norm_eps=record.tiny.rms_norm_eps,
        tie_word_embeddings=record.tied_embeddings,
        initializer_range=0.02,
        attention_dropout=0.0,
        use_cache=True,
        **tiny_config,
    )
    if record.sliding_window:
        kwargs["sliding_window"] = sliding_window
    major = int(_transformers_version().split(".")[0])
    kwargs["dtype" if major >= 5 else "torch_dtype"] = str(dtype).removeprefix("torch.")
    return AutoConfig.for_model(record.model_types[0], **kwargs)


def _config_json(config, record: Architecture) -> dict:
    """config.json as a Hub checkpoint has it: the model's fields, without the generic
    PretrainedConfig ones (id2label, return_dict, ...), and explicit about every trait even
    where it equals the class default, since GGUF converters read the file, not the class."""
    full = config.to_dict()
    traits = (
        "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "hidden_activation", "max_position_embeddings", "rms_norm_eps",
        "tie_word_embeddings", "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id",
        "rope_parameters", "rope_scaling", "layer_types", "query_pre_attn_scalar", "dtype",
        "torch_dtype",
    )  # fmt: skip
    out = {**config.to_diff_dict(), **{k: full[k] for k in traits if k in full}}
    # transformers 5 keeps rope_theta inside rope_parameters; converters and transformers 4
    # look for it at the top level.
    out.setdefault("rope_theta", record.tiny.rope_theta)
    return out


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _random_weights(config, record: Architecture, seed: int) -> dict[str, torch.Tensor]:
    """Fill every parameter of the model that `config` describes, in the model's order."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # names and shapes only, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    norm_neutral = 0.0 if record.norm_adds_one else 1.0  # the weight that leaves the input unscaled
    weights = {}
    for name, param in skeleton.named_parameters():
        if record.tied_embeddings and name == "lm_head.weight":
            continue  # tied to model.embed_tokens.weight; safetensors stores it once
        if name.endswith(".bias"):  # Qwen2's q/k/v biases: large enough to matter
            value = 0.5 * torch.randn(param.shape, generator=generator)
        elif param.ndim == 1:  # RMSNorm weights
            value = norm_neutral + 0.1 * torch.randn(param.shape, generator=generator)
        else:  # Linear (out, in) and Embedding (vocab, hidden) both have the fan-in last
            value = torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5
        weights[name] = value
    return weights


# ---------------------------------------------------------------------------------------
# Cache: each variant built once per process
# ---------------------------------------------------------------------------------------


def tiny_model_path(arch: str, **kwargs) -> pathlib.Path:
    """Like `build_tiny_model(arch, **kwargs)`, but built once per process and cached.

    The folder lives in a temporary directory removed when the process exits. Treat it as
    read-only: other callers with the same arguments get the same folder.
    """
    if "path" in kwargs:
        raise TypeError("tiny_model_path chooses the folder itself; call build_tiny_model to pick one")
    bound = inspect.signature(build_tiny_model).bind(arch, **kwargs)
    bound.apply_defaults()
    bound.arguments.pop("path")
    return _cached_model(tuple(bound.arguments.items()))


@functools.cache
def _cached_model(arguments: tuple) -> pathlib.Path:
    digest = hashlib.sha1(repr(arguments).encode()).hexdigest()[:12]
    kwargs = dict(arguments)
    arch = kwargs.pop("arch")
    return build_tiny_model(arch, _cache_root() / f"{arch}-{digest}", **kwargs)


@functools.cache
def _cache_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="slothkit-tiny-models-")


def _cache_root() -> pathlib.Path:
    return pathlib.Path(_cache_dir().name)
