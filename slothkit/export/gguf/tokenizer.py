"""A Hugging Face fast tokenizer as GGUF `tokenizer.*` metadata, in the two forms llama.cpp reads.

    HF tokenizer.json                                  GGUF tokenizer.ggml.model
    BPE over bytes (ByteLevel), e.g. Llama 3           "gpt2": tokens, token types, merges, pre
    BPE over "▁"-words with byte_fallback, e.g.        "llama": tokens, scores, token types
      Llama 2 / Mistral / Gemma (SentencePiece-style)

"gpt2": llama.cpp runs real BPE (ranked merges) after a pre-tokenizer that it knows by name
(tokenizer.ggml.pre); slothkit.export.gguf.pre_tokenizer finds the name as llama.cpp's
converter does (a hash of the ids of a check text), else from the split regexes of
tokenizer.json, and refuses a tokenizer that neither way knows rather than let llama.cpp
tokenise differently. Added tokens are CONTROL when special or when they look like control
tokens ("<|...|>", as ChatML's <|im_start|> and <|im_end|>), else USER_DEFINED, as llama.cpp's
converter marks them.

"llama": llama.cpp runs SentencePiece's algorithm, which merges the adjacent pair whose
*result* has the highest score, leftmost first. A token's score here is minus the rank of the
merge that created it, so the merge order is BPE's (SentencePiece BPE models are exactly this:
HF builds their merges from the scores). Byte tokens <0xNN> are BYTE, so characters outside the
vocabulary fall back to bytes as HF's byte_fallback does.

Leading space (tokenizer.ggml.add_space_prefix, "llama" only): llama.cpp, like SentencePiece,
prepends "▁" to the text at the start and after every special token, always. HF's legacy
Prepend("▁") normaliser does the same (written True: identical), and Gemma's Replace-only
normaliser or Metaspace prepend_scheme "never" never prepend (written False: identical).
Metaspace "first" / "always" (the tiny test tokenizers, recent Mistral tokenizer.json files)
prepend only where the text does not already start with a space, "first" only at the very
start; no llama.cpp setting reproduces that, and True is written: plain text tokenises exactly
like HF unless it starts with a space, while text that starts with a space, or follows a
special token, gets one more "▁" than in HF, as every Llama 2 / Mistral GGUF made by
llama.cpp's own converter does.

Special tokens: bos/eos/unk/pad ids, eot (the end of an assistant turn: of the ids the model's
generation_config stops at, a known end-of-turn marker, else the only one besides eos),
add_bos/add_eos as the HF tokenizer really does them (checked by encoding a letter), and the
chat template.
The model's embedding may have more rows than the tokenizer has tokens; the rest are written
as "[PAD<id>]" UNUSED tokens, as llama.cpp's converter does, because llama.cpp requires one
token per embedding row.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import warnings

from gguf import GGUFWriter, TokenType

from slothkit.export.gguf.pre_tokenizer import pre_tokenizer_name

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclasses.dataclass
class GGUFVocab:
    model: str  # "gpt2" or "llama"
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None  # "llama" only
    merges: list[str] | None  # "gpt2" only
    pre: str | None  # "gpt2" only
    add_space_prefix: bool | None  # "llama" only
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def write(self, writer: GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.token_types)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        for value, add in (
            (self.bos_id, writer.add_bos_token_id),
            (self.eos_id, writer.add_eos_token_id),
            (self.unk_id, writer.add_unk_token_id),
            (self.pad_id, writer.add_pad_token_id),
            (self.eot_id, writer.add_eot_token_id),
        ):
            if value is not None:
                add(value)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def gguf_vocab(tokenizer, n_embedding_rows: int, stop_token_ids: list[int] | None = None) -> GGUFVocab:
    """Read `tokenizer` into GGUF vocabulary metadata.

    Args:
        tokenizer: a transformers fast tokenizer (one with a tokenizer.json).
        n_embedding_rows: the model's vocabulary size (token_embd rows); the token list is
            padded to it.
        stop_token_ids: the ids generation stops at (generation_config.eos_token_id); one that
            is not the tokenizer's eos becomes tokenizer.ggml.eot_token_id.

    Raises:
        ValueError: a tokenizer llama.cpp cannot reproduce (not BPE, a byte-level
            pre-tokenizer llama.cpp does not know, duplicate token texts), or more token ids
            than embedding rows.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"GGUF export needs a fast tokenizer (one with a tokenizer.json); got {type(tokenizer).__name__}. "
            "Load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(
            f"GGUF export supports BPE tokenizers (byte-level like Llama 3, or SentencePiece-style with "
            f"byte fallback like Llama 2 / Mistral / Gemma); this one is {model.get('type')!r}"
        )

    id_to_token: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    for i, a in added.items():
        id_to_token[i] = a["content"]
    size = max(n_embedding_rows, max(id_to_token) + 1)
    if size > n_embedding_rows:
        raise ValueError(
            f"the tokenizer has ids up to {max(id_to_token)} but the model's embedding has only "
            f"{n_embedding_rows} rows; resize the embeddings (model.resize_token_embeddings) before export"
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    unk_id = tokenizer.unk_token_id

    byte_level = _has_component(spec.get("pre_tokenizer"), "ByteLevel") or _has_component(
        spec.get("decoder"), "ByteLevel"
    )
    if byte_level:
        flavour, add_space_prefix = "gpt2", None
        pre = pre_tokenizer_name(tokenizer, spec.get("pre_tokenizer"))
    elif model.get("byte_fallback"):
        flavour, pre, add_space_prefix = "llama", None, _add_space_prefix(spec)
    else:
        raise ValueError(
            "GGUF export supports byte-level BPE (Llama 3 style) and BPE with byte_fallback "
            "(SentencePiece style); this BPE tokenizer is neither"
        )

    # SentencePiece order: a token scores minus the rank of the merge that first produces it
    # (earlier merge, higher score); tokens that no merge produces score 0, padding -1000.
    ranks = _merge_ranks(merges) if flavour == "llama" else {}
    tokens, types, scores = [], [], []
    for i in range(size):
        token = id_to_token.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            scores.append(-1000.0)
            continue
        tokens.append(token)
        scores.append(-float(ranks[token]) if token in ranks and i not in added else 0.0)
        if i in added:
            # SentencePiece's <unk> is UNKNOWN; a byte-level vocabulary's unk is a text marker
            # (GPT-2's <|endoftext|>), CONTROL like llama.cpp's converter makes it.
            if i == unk_id and flavour == "llama":
                types.append(TokenType.UNKNOWN)
            elif added[i]["special"] or _looks_like_control(token):
                types.append(TokenType.CONTROL)
            else:
                types.append(TokenType.USER_DEFINED)
        elif flavour == "llama" and _BYTE_TOKEN.fullmatch(token):
            types.append(TokenType.BYTE)
        elif i == unk_id:
            types.append(TokenType.UNKNOWN)
        else:
            types.append(TokenType.NORMAL)

    duplicates = sorted(t for t, n in collections.Counter(tokens).items() if n > 1)
    if duplicates:
        raise ValueError(
            f"llama.cpp needs every token text once; these appear under several ids: {duplicates[:10]}"
        )

    probe = tokenizer("a")["input_ids"]
    eos_id = tokenizer.eos_token_id
    eot_id = _end_of_turn_id(tokens, eos_id, [i for i in (stop_token_ids or []) if i != eos_id])
    template = getattr(tokenizer, "chat_template", None)
    return GGUFVocab(
        model=flavour,
        tokens=tokens,
        token_types=[int(t) for t in types],
        scores=scores if flavour == "llama" else None,
        merges=merges if flavour == "gpt2" else None,
        pre=pre,
        add_space_prefix=add_space_prefix,
        bos_id=tokenizer.bos_token_id,
        eos_id=eos_id,
        unk_id=unk_id,
        pad_id=tokenizer.pad_token_id,
        eot_id=eot_id,
        add_bos=tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id],
        add_eos=eos_id is not None and probe[-1:] == [eos_id],
        chat_template=template if isinstance(template, str) else None,
    )


_END_OF_TURN_TEXTS = ("<|eot_id|>", "<end_of_turn>", "<|im_end|>", "<|end|>")


def _end_of_turn_id(tokens: list[str], eos_id: int | None, extra_stop_ids: list[int]) -> int | None:
    """Which stop id closes an assistant turn: an extra one whose text is a known end-of-turn
    marker (Llama 3's <|eot_id|> beside eos <|end_of_text|>), else eos if its text is one
    (ChatML models whose eos is <|im_end|> and who also stop on <|endoftext|>), else the only
    extra one; None when that is ambiguous (llama.cpp then finds the markers by their text)."""
    for i in [*extra_stop_ids, eos_id]:
        if i is not None and 0 <= i < len(tokens) and tokens[i] in _END_OF_TURN_TEXTS:
            return i
    return extra_stop_ids[0] if len(extra_stop_ids) == 1 else None


def _has_component(node, kind: str) -> bool:
    """Whether a tokenizer.json component (or a Sequence of them) contains one of type `kind`."""
    if not node:
        return False
    if node.get("type") == kind:
        return True
    children = node.get("pretokenizers") or node.get("decoders") or node.get("normalizers") or []
    return any(_has_component(child, kind) for child in children)


def _components(node) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        children = node.get("pretokenizers") or node.get("decoders") or node.get("normalizers") or []
        return [c for child in children for c in _components(child)]
    return [node]


def _looks_like_control(token: str) -> bool:
    """Added tokens that some tokenizers leave unmarked but that are control tokens (llama.cpp's
    converter's list): <|...|> (ChatML, Llama 3), DeepSeek's full-width <｜...｜>, Gemma's <unused..>
    and <mask>, DeepSeek-Coder's <pad>."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _add_space_prefix(spec: dict) -> bool:
    """What llama.cpp's add_space_prefix should be to match HF (see the module docstring)."""
    for part in _components(spec.get("pre_tokenizer")):
        if part["type"] == "Metaspace":
            scheme = part.get("prepend_scheme")
            if scheme is None:  # tokenizers < 0.14 spelled it add_prefix_space
                return bool(part.get("add_prefix_space", True))
            return scheme != "never"
    normalizers = _components(spec.get("normalizer"))
    for part in normalizers:
        if part["type"] not in ("Prepend", "Replace", "Strip"):
            warnings.warn(
                f"tokenizer normaliser {part['type']!r} has no llama.cpp counterpart; tokenisation in "
                "llama.cpp may differ from Hugging Face's (verify=True checks it)",
                stacklevel=3,
            )
    return any(p["type"] == "Prepend" and p.get("prepend") == "▁" for p in normalizers)


def _merge_ranks(merges: list[str]) -> dict[str, int]:
    """Rank of the merge that first produces each token text."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1)
        ranks.setdefault(left + right, rank)
    return ranks
