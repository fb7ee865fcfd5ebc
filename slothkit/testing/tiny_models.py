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
    qwen2    GQA, q/k/v biases         SiLU GLU   w * x       own    1000000     Qwen's byte-level BPE
    qwen3    GQA, q/k norms per head,  SiLU GLU   w * x       own    1000000     Qwen's byte-level BPE
             head_dim 32 (not hidden / heads)

Qwen's tokenizer adds no BOS, splits every digit alone, ends an instruct turn with
<|im_end|> (its eos) and pads with <|endoftext|>, as Qwen2.5 Instruct's does.

The tokenizers are trained here, with the `tokenizers` library, on a few paragraphs of
plain English embedded below; they have a few hundred tokens, so most words split into
pieces, and the model's vocabulary is padded up to a multiple of 256 (or to Gemma's real
256,000 rows with `large_vocab=True`); the padding rows are never produced by the tokenizer.

    path = tiny_model_path("gemma")                    # built once per process, then cached
    path = build_tiny_model("llama", hidden_size=256, intermediate_size=512)  # GGUF K-quant rows
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import pathlib
import tempfile

import torch

from slothkit.models import RECORDS as _RECORDS
from slothkit.models import Architecture, architecture_named

ARCHITECTURES = tuple(arch.name for arch in _RECORDS)
TOKENIZER_FLAVOURS = ("bpe", "qwen", "sentencepiece")
LARGE_VOCAB_SIZE = 256_000  # Gemma's real vocabulary

# ---------------------------------------------------------------------------------------
# Training text: written for this file. Digits, punctuation, quotes, contractions and a
# little code so that every pre-tokenizer rule and number split gets exercised.
# ---------------------------------------------------------------------------------------

CORPUS = """\
The lighthouse on the northern cape was built in 1871 and has been lit every night since. \
Its keeper, a patient woman named Ada, climbs 114 steps at dusk to wind the clockwork that \
turns the lens. She writes the weather in a ledger: wind from the west, 12 knots; sea \
moderate; visibility good. On foggy nights she sounds the horn twice a minute until dawn.

Baking bread at home is simpler than it looks. Mix 500 grams of flour with 350 grams of \
warm water, 10 grams of salt and 7 grams of dried yeast. Knead the dough for ten minutes, \
let it rise for an hour, shape it, and let it rise again. Bake at 230 degrees for 35 to 40 \
minutes. The loaf is done when it sounds hollow as you tap the bottom.

Sloths spend most of their lives hanging upside down in the trees of Central and South \
America. They move slowly because their diet of leaves gives them very little energy. A \
sloth may come down to the ground only once a week. Surprisingly, they are good swimmers, \
and they can hold their breath for up to 40 minutes!

The 08:15 train to the coast leaves from platform 3. It stops at Millbrook (08:42), \
Stonebridge (09:05) and Harbour Road (09:31). Tickets cost 14.50 for a single journey or \
22.00 for a return. Children under 5 travel free; a family pass covers 2 adults and up to \
3 children. Please keep your bags off the seats.

"Could you help me plan a garden?" asked the user. "Of course," replied the assistant. \
"Start with the light: most vegetables need at least six hours of sun each day. Tomatoes, \
beans and courgettes like warmth; lettuce and spinach prefer a cooler, shadier spot. Water \
in the morning, not in the evening, and add compost to the soil every spring."

A good system answers questions clearly and admits what it doesn't know. When a model is \
trained to follow instructions, it learns from many short conversations between a user and \
an assistant. Each turn has a role and some content. The model reads the whole conversation \
but is usually trained only on the answers it should give.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

Numbers appear everywhere: 3.14159, 2.71828, 1,000,000 and 42. The year 2024 had 366 days. \
Water boils at 100 degrees Celsius and freezes at 0. A kilometre is 1000 metres, a mile is \
about 1609 metres, and light travels roughly 299,792 kilometres every second.

The river runs past the old mill, under three stone bridges, and into the sea. In summer \
children swim near the weir; in winter the water rises and floods the meadows. People have \
lived along its banks for thousands of years, fishing, farming and trading wool.

Questions worth asking: What is it? Why does it work? How could it fail? Who will use it, \
and what will they expect? If you can't answer these, you aren't ready to build it yet. \
Write the test first; then write the code; then make it fast; then make it clear.

It's a quiet morning. We're early, they'll be late, and I'd rather wait here than there. \
You've seen the map; she's got the keys; he'll drive. Let's go!
"""

# ---------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------

# tiktoken-style split used by Llama 3: contractions, words, numbers in groups of at most
# three digits, punctuation runs, newlines and other whitespace.
_LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: Llama 3's with every digit alone.
_QWEN_SPLIT_PATTERN = _LLAMA3_SPLIT_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
_BPE_TRAINED_VOCAB = 640  # byte-level BPE before special tokens
_SENTENCEPIECE_VOCAB = 640  # SentencePiece-style, specials and byte tokens included


@dataclasses.dataclass(frozen=True)
class _FlavourSpecials:
    bos: str
    eos: str  # ends a document
    pad: str
    unk: str | None
    extra: tuple[str, ...]  # further special tokens that come with the flavour
    adds_bos: bool = True  # the tokenizer puts bos in front of every text


_FLAVOUR_SPECIALS = {
    "bpe": _FlavourSpecials(
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        pad="<|finetune_right_pad_id|>",
        unk=None,  # byte-level: every string is representable
        extra=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ),
    # Qwen's config names <|endoftext|> as bos, but its tokenizer never adds one.
    "qwen": _FlavourSpecials(
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        extra=("<|im_start|>",),
        adds_bos=False,
    ),
    "sentencepiece": _FlavourSpecials(bos="<s>", eos="</s>", pad="<pad>", unk="<unk>", extra=()),
}


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


@functools.cache
def _trained_tokenizer_json(flavour: str, chat_specials: tuple[str, ...]) -> str:
    """Train a tokenizer once per process and return it serialised (immutable, so cacheable)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    specials = _FLAVOUR_SPECIALS[flavour]
    extra = _extra_specials(flavour, chat_specials)
    paragraphs = [p + "\n" for p in CORPUS.split("\n\n")]

    if flavour in ("bpe", "qwen"):
        # Llama 3 and Qwen: byte-level BPE; the special tokens come after the learned vocabulary.
        split = _LLAMA3_SPLIT_PATTERN if flavour == "bpe" else _QWEN_SPLIT_PATTERN
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=_BPE_TRAINED_VOCAB,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(paragraphs, trainer)
        tok.decoder = decoders.ByteLevel()
        named = tuple(dict.fromkeys((specials.bos, specials.eos, specials.pad)))  # Qwen's bos is its pad
    else:
        # Llama 2 / Mistral / Gemma style: "▁" marks a word start, characters unseen in
        # training fall back to byte tokens <0x00>..<0xFF>. Special and byte tokens take the
        # first ids, as in the real vocabularies.
        named = (specials.unk, specials.bos, specials.eos, specials.pad)
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
        draft = Tokenizer(models.BPE(unk_token=specials.unk))
        draft.pre_tokenizer = metaspace
        trainer = trainers.BpeTrainer(
            vocab_size=_SENTENCEPIECE_VOCAB,
            special_tokens=list(named + extra) + byte_tokens,
            show_progress=False,
        )
        draft.train_from_iterator(paragraphs, trainer)
        # The trainer registers its special tokens as added tokens; byte tokens must live in
        # the model vocabulary only (typing "<0x41>" must not produce the byte token), so the
        # learned vocabulary and merges are rebuilt into a fresh tokenizer.
        learned = json.loads(draft.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
        tok = Tokenizer(
            models.BPE(learned["vocab"], merges, unk_token=specials.unk, byte_fallback=True, fuse_unk=True)
        )
        tok.pre_tokenizer = metaspace
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named + extra])
    if not specials.adds_bos:
        return tok.to_str()
    bos_id = tok.token_to_id(specials.bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{specials.bos} $A",
        pair=f"{specials.bos} $A {specials.bos}:1 $B:1",
        special_tokens=[(specials.bos, bos_id)],
    )
    return tok.to_str()


def _extra_specials(flavour: str, chat_specials: tuple[str, ...]) -> tuple[str, ...]:
    """Special tokens beyond bos/eos/pad/unk: the flavour's own, then those the chat template needs."""
    specials = _FLAVOUR_SPECIALS[flavour]
    own = specials.extra
    named = (specials.bos, specials.eos, specials.pad)
    return own + tuple(t for t in chat_specials if t not in own and t not in named)


@dataclasses.dataclass(frozen=True)
class _TokenizerInfo:
    size: int  # number of token ids, special tokens included
    bos_id: int
    eos_id: int
    pad_id: int
    end_of_turn_id: int  # closes an assistant turn in the chat template


def _write_tokenizer(flavour: str, arch: str, path: pathlib.Path, model_max_length: int) -> _TokenizerInfo:
    tiny = architecture_named(arch).tiny
    specials = _FLAVOUR_SPECIALS[flavour]
    tokenizer_json = _trained_tokenizer_json(flavour, tiny.chat_specials)
    vocab = _vocab_of(tokenizer_json)
    extra = _extra_specials(flavour, tiny.chat_specials)

    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    special_map = {"eos_token": specials.eos, "pad_token": specials.pad}
    if specials.adds_bos:  # Qwen's tokenizer has none (tokenizer_config.json: null)
        special_map["bos_token"] = specials.bos
    if specials.unk is not None:
        special_map["unk_token"] = specials.unk
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,  # as Qwen's and byte-level vocabularies write a token they lack
        "unk_token": None,  # (else a tokenizer class may fill in its own default)
        **special_map,
        "additional_special_tokens": list(extra),
        "add_bos_token": specials.adds_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "padding_side": "right",
        "chat_template": tiny.chat_template,
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "special_tokens_map.json", {**special_map, "additional_special_tokens": list(extra)})
    end_of_turn = tiny.end_of_turn or specials.eos
    return _TokenizerInfo(
        size=len(vocab),
        bos_id=vocab[specials.bos],
        eos_id=vocab[specials.eos],
        pad_id=vocab[specials.pad],
        end_of_turn_id=vocab[end_of_turn],
    )


@functools.cache
def _vocab_of(tokenizer_json: str) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True)


def build_tiny_tokenizer(
    flavour: str = "bpe",
    path: str | pathlib.Path | None = None,
    *,
    arch: str | None = None,
    model_max_length: int = 2048,
) -> pathlib.Path:
    """Write a tokenizer trained on `CORPUS` to `path` (a fresh temporary folder when None).

    flavour: "bpe" (Llama 3 style byte-level BPE, no unk), "qwen" (Qwen's: byte-level BPE,
        digits alone, no BOS) or "sentencepiece" (BPE over "▁"-marked words with byte
        fallback, `<unk> <s> </s> <pad>`).
    arch: whose chat template (and its special tokens) to include; defaults to the first
        architecture whose tiny checkpoint uses the flavour ("llama" for "bpe", "mistral" for
        "sentencepiece").
    Returns the folder; load it with `AutoTokenizer.from_pretrained(path)`.
    """
    _check_choice("flavour", flavour, TOKENIZER_FLAVOURS)
    if arch is None:
        arch = next(record.name for record in _RECORDS if record.tiny.tokenizer == flavour)
    _check_choice("arch", arch, ARCHITECTURES)
    path = pathlib.Path(path) if path is not None else pathlib.Path(tempfile.mkdtemp(prefix="slothkit-tok-"))
    _write_tokenizer(flavour, arch, path, model_max_length)
    return path


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

    arch: "llama", "mistral", "gemma", "qwen2", "qwen3" or "gemma3" (see the module docstring
        for what each keeps).
    path: where to write; a fresh temporary folder (left for the caller) when None.
    intermediate_size: MLP width; default 3 * hidden_size.
    head_dim: default hidden_size // num_heads, except Gemma's and Gemma 3's 256 and Qwen3's 32.
    vocab_size: model vocabulary (embedding rows); default the tokenizer's size rounded up
        to a multiple of 256. `large_vocab=True` gives 256,000 rows instead.
    sliding_window: Mistral and Gemma 3 only; default 32 (Gemma 3: 16), so sequences longer
        than that hit it.
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
        **record.tiny.config,
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


def _write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


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
