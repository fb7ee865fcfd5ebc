"""Tiny tokenizers trained offline, in the flavours of real families' tokenizers, for the
tiny checkpoints of slothkit.testing.tiny_models (and alone, build_tiny_tokenizer).

They are trained here, with the `tokenizers` library, on a few paragraphs of plain English
embedded below (CORPUS); they have a few hundred tokens, so most words split into pieces:

    flavour        like                      split                       specials
    bpe            Llama 3's byte-level BPE  Llama 3's regex (digits     <|begin_of_text|> added,
                                             in groups of three)         <|end_of_text|>, pad
    qwen           Qwen's byte-level BPE     Qwen2's regex (each digit   no BOS added; <|im_end|>
                                             alone)                      eos, <|endoftext|> pad
    sentencepiece  Llama 2 / Mistral / Gemma "▁"-marked words, byte      <unk> <s> </s> <pad>
                                             fallback

Each tokenizer_config.json carries the architecture record's chat template and the special
tokens it needs (slothkit.models, TinyTraits).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import tempfile

from slothkit.models import RECORDS as _RECORDS
from slothkit.models import architecture_named
from slothkit.models.tokenizer_splits import LLAMA3_SPLIT, QWEN2_SPLIT
from slothkit.testing.tiny_chat_templates import tiny_chat_template

ARCHITECTURES = tuple(arch.name for arch in _RECORDS)
TOKENIZER_FLAVOURS = ("bpe", "qwen", "sentencepiece")

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
        split = LLAMA3_SPLIT if flavour == "bpe" else QWEN2_SPLIT
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
        "chat_template": tiny_chat_template(tiny.chat_format),
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


def _write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
