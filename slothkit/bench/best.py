"""`slothkit bench train --memory-gib B --best`: each implementation in its fastest
setting that fits B GiB, at the same batch and sequence.

The question a user with a 24, 40 or 80 GB GPU asks is not how fast each library runs
with every layer checkpointed, but how fast it can train the model on that card.  So
each implementation runs in the settings its users would pick from, each in its own
worker process under ``torch.cuda.set_per_process_memory_fraction(B)``, and the fastest
one that trained is its row, recorded with the setting and with every candidate's
outcome:

- HF + PEFT and HF + Liger: with gradient checkpointing and without (without is faster
  where it fits);
- Unsloth: its own settings (use_gradient_checkpointing="unsloth");
- slothkit: use_gradient_checkpointing="auto" with max_memory=B, which picks how many
  layers to keep itself.

The candidates run only on a GPU (the budget is a GPU memory cap); on a CPU the
argument handling and the selection (``fastest_that_fits``) are what can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Setting:
    """One candidate setting: its name as recorded, and the worker flags it sets (keys of
    `slothkit bench train`'s arguments)."""

    name: str
    flags: dict = field(default_factory=dict)


_CHECKPOINTED = Setting("gradient checkpointing", {"hf_checkpointing": "on"})
_NOT_CHECKPOINTED = Setting("no gradient checkpointing", {"hf_checkpointing": "off"})
SETTINGS = {
    "hf": (_CHECKPOINTED, _NOT_CHECKPOINTED),
    "liger": (_CHECKPOINTED, _NOT_CHECKPOINTED),
    "unsloth": (Setting("use_gradient_checkpointing='unsloth'"),),
    "slothkit": (Setting("use_gradient_checkpointing='auto'", {"slothkit_checkpointing": "auto"}),),
}


def settings_for(impl: str) -> tuple[Setting, ...]:
    """The candidates of an implementation (slothkit@DIR: slothkit's).

    Args:
        impl: a name `slothkit bench train --impl` accepts.
    """
    return SETTINGS[impl.partition("@")[0]]


def fastest_that_fits(rows: dict[str, dict]) -> tuple[str, dict]:
    """The setting whose run trained fastest; where none trained, the first setting's row
    (it says why: out of memory, an error).

    Args:
        rows: setting name -> the summarised row of its runs (``status``, ``tokens_per_s``).

    Returns:
        (setting name, its row).
    """
    trained = [(name, row) for name, row in rows.items() if row.get("status") == "ok"]
    if trained:
        return max(trained, key=lambda item: item[1]["tokens_per_s"])
    return next(iter(rows.items()))


def candidate_summary(name: str, row: dict) -> dict:
    """What the record keeps of a candidate the selection weighed.

    Args:
        name: the setting's name.
        row: its summarised row.
    """
    kept = ("status", "tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "error")
    return {"setting": name, **{key: row[key] for key in kept if key in row}}
