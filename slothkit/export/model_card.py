"""README.md (model card) for a saved or pushed model: what it is, how it was made.

The YAML header holds what the Hub indexes (base model, library, tags); the body repeats it
for people and adds the merge and LoRA details. `base_model` goes into the header only when
it looks like a Hub id: the Hub rejects metadata naming a local path, and a local path says
nothing to a reader elsewhere (it is still given in the body).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from slothkit.export.export_types import EXPORT_TYPES

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(name: str | None) -> bool:
    if not name or name.startswith((".", "/", "~")) or os.path.exists(name):
        return False
    return bool(_HUB_ID.match(name))


@dataclasses.dataclass
class CardFacts:
    save_method: str  # "merged_16bit", "merged_4bit", "lora", or another exporter's name
    base_model: str | None = None
    merged_into: str | None = None  # MergeSource.describe(), for merged saves
    weights: str = ""  # what the saved weights are: dtype and quantisation
    lora: dict | None = None  # r, lora_alpha, target_modules, ... (adapter_config fields)
    training: dict | None = None  # training settings when known
    chat_template: bool = False
    eos_tokens: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def _method_text(save_method: str) -> str:
    export = EXPORT_TYPES.get(save_method)
    return export.holds if export is not None else save_method


LORA_CARD_FIELDS = (
    "r", "lora_alpha", "use_rslora", "target_modules", "lora_dropout", "bias",
    "modules_to_save", "rank_pattern", "alpha_pattern",
)  # fmt: skip


def lora_facts(config) -> dict | None:
    """The adapter settings worth a line on the card, from a LoraConfig."""
    if config is None:
        return None
    facts = {}
    for field in LORA_CARD_FIELDS:
        value = getattr(config, field, None)
        if value in (None, {}, []):
            continue
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        facts[field] = value
    r, alpha = facts.get("r"), facts.get("lora_alpha")
    if r and alpha:
        facts["scaling"] = alpha / r**0.5 if facts.get("use_rslora") else alpha / r
    return facts


def _yaml_value(value) -> str:
    return json.dumps(value)  # a JSON string or list is valid YAML


def _table(rows: list[tuple[str, object]]) -> str:
    lines = ["| setting | value |", "|---|---|"]
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:g}"
        elif isinstance(value, (list, tuple)):
            value = ", ".join(f"`{v}`" for v in value)
        elif isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        cell = str(value).replace("|", "\\|")  # a literal pipe inside a Markdown table cell
        lines.append(f"| {key} | {cell} |")
    return "\n".join(lines)


# The line every card slothkit writes holds: a README.md without it is the user's own
# (slothkit.export.atomic keeps it on overwrite).
CARD_MARKER = "Saved with [slothkit](https://pypi.org/project/slothkit/)"
# The card's title, naming the save method (read back by card_save_method).
CARD_TITLE = "# {} export of a LoRA fine-tune"
_CARD_TITLE_LINE = re.compile("^" + re.escape(CARD_TITLE).replace(r"\{\}", r"(\S+)") + "$", re.MULTILINE)


def card_save_method(text: str) -> str | None:
    """The save method a card that render() wrote names in its title; None for a text that
    is no slothkit card."""
    if CARD_MARKER not in text:
        return None
    match = _CARD_TITLE_LINE.search(text)
    return match.group(1) if match else None


def render(facts: CardFacts) -> str:
    from slothkit.core.version import __version__

    library = "peft" if facts.save_method == "lora" else "transformers"
    tags = ["slothkit", "lora", "text-generation"]
    if facts.save_method.startswith("merged"):
        tags.append("merged")
    if facts.save_method == "merged_4bit":
        tags += ["4-bit", "bitsandbytes"]
    header = ["---"]
    if looks_like_hub_id(facts.base_model):
        header.append(f"base_model: {_yaml_value(facts.base_model)}")
    header += [
        f"library_name: {library}",
        "pipeline_tag: text-generation",
        "tags:",
        *[f"- {_yaml_value(t)}" for t in tags],
        "---",
    ]

    summary = [
        ("base model", f"`{facts.base_model}`" if facts.base_model else "unknown"),
        ("method", f"`{facts.save_method}`: {_method_text(facts.save_method)}"),
    ]
    if facts.merged_into:
        summary.append(("merged into", facts.merged_into))
    if facts.weights:
        summary.append(("weights", facts.weights))
    summary.append(("chat template", "included (tokenizer files)" if facts.chat_template else "none"))
    if facts.eos_tokens:
        summary.append(
            ("stop tokens (generation_config.json)", ", ".join(f"`{t}`" for t in facts.eos_tokens))
        )

    body = [
        "",
        CARD_TITLE.format(facts.save_method),
        "",
        f"{CARD_MARKER} {__version__}.",
        "",
        _table(summary),
    ]
    if facts.lora:
        body += ["", "## LoRA", "", _table(list(facts.lora.items()))]
    body += ["", "## Training", ""]
    if facts.training:
        body.append(_table(list(facts.training.items())))
    else:
        body.append("Training settings were not recorded with this export.")
    if facts.notes:
        body += ["", "## Notes", "", *[f"- {note}" for note in facts.notes]]
    body += ["", "## Use", "", _usage(facts), ""]
    return "\n".join(header + body)


def _usage(facts: CardFacts) -> str:
    if facts.save_method == "lora":
        return (
            "```python\nfrom peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
            'model = AutoPeftModelForCausalLM.from_pretrained("THIS_REPO_OR_FOLDER")\n'
            'tokenizer = AutoTokenizer.from_pretrained("THIS_REPO_OR_FOLDER")\n```'
        )
    return (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'model = AutoModelForCausalLM.from_pretrained("THIS_REPO_OR_FOLDER")\n'
        'tokenizer = AutoTokenizer.from_pretrained("THIS_REPO_OR_FOLDER")\n```'
    )
