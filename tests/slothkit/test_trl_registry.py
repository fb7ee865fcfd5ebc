"""Every trainer of slothkit.trl is a complete record of slothkit.trl.registry: exported under
TRL's name with its config, extending TRL's classes, with slothkit's defaults and factory,
and in the docs' table; and every trainer defined in slothkit.trl is registered."""

from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("trl")

import slothkit.trl
from slothkit.trl import defaults
from slothkit.trl.library import trl_class
from slothkit.trl.registry import TRAINERS, TrainerRecord
from slothkit.trl.setup import TrainerSetup

TRAINERS_DOC = pathlib.Path(__file__).parents[2] / "docs" / "trainers.md"


@pytest.mark.parametrize("record", TRAINERS, ids=lambda record: record.method)
def test_each_trainer_is_exported_with_its_config_under_trls_names(record: TrainerRecord):
    for cls in (record.trainer, record.config):
        assert cls.__name__ in slothkit.trl.__all__, f"slothkit.trl does not export {cls.__name__}"
        assert getattr(slothkit.trl, cls.__name__) is cls
    assert record.trainer.__name__ == record.trl_trainer.__name__
    assert issubclass(record.trainer, record.trl_trainer) and issubclass(record.trainer, TrainerSetup)
    assert issubclass(record.config, trl_class(record.config.__name__))  # TRL's config of that name


@pytest.mark.parametrize("record", TRAINERS, ids=lambda record: record.method)
def test_each_trainers_factory_builds_its_config_with_slothkits_defaults(record: TrainerRecord, tmp_path):
    assert record.method in defaults.LEARNING_RATES, f"add {record.method!r} to LEARNING_RATES"
    config = record.factory(None, output_dir=str(tmp_path))
    assert type(config) is record.config
    assert config.learning_rate == record.learning_rate
    assert (config.seed, config.warmup_steps, config.report_to) == (3407, 5, [])
    assert config.gradient_checkpointing is False


def _defined_trainers(cls=TrainerSetup):
    for subclass in cls.__subclasses__():
        if "_trl_trainer" in vars(subclass):  # a trainer of its own, not a mixin or a renaming
            yield subclass
        yield from _defined_trainers(subclass)


def test_every_trainer_and_every_default_is_registered():
    registered = {record.trainer for record in TRAINERS}
    unregistered = {cls.__name__ for cls in _defined_trainers()} - {cls.__name__ for cls in registered}
    assert not unregistered, (
        f"add a TrainerRecord to slothkit.trl.registry.TRAINERS for {sorted(unregistered)}"
    )
    assert set(defaults.LEARNING_RATES) == {record.method for record in TRAINERS}
    assert len({record.method for record in TRAINERS}) == len(TRAINERS)


def _rate(value: float) -> str:
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def test_the_docs_table_shows_the_registry():
    rows = [
        f"| {r.label} | `{r.trainer.__name__}`, `{r.config.__name__}` | `{r.factory.__name__}` | {r.data} "
        f"| {_rate(r.learning_rate)} |"
        for r in TRAINERS
    ]
    documented = [
        line for line in TRAINERS_DOC.read_text().splitlines() if re.match(r"\| .* \| `\w+Trainer`", line)
    ]
    assert documented == rows


def test_the_exported_trainers_and_configs_are_the_registered_ones():
    """slothkit.trl names its exports one by one (so that editors see them); a trainer added
    there but not registered, or registered but not exported, is found here."""
    unsloth_names = {"UnslothTrainer", "UnslothTrainingArguments", "TrainingArguments", "PatchDPOTrainer"}
    exported = {name for name in slothkit.trl.__all__ if name.endswith(("Trainer", "Config"))} - unsloth_names
    registered = {cls.__name__ for record in TRAINERS for cls in (record.trainer, record.config)}
    assert exported == registered


def test_the_older_module_path_gives_the_same_names_and_says_the_current_one():
    import importlib
    import sys
    import warnings

    from slothkit.core.notices import LegacySpellingWarning, say_once

    sys.modules.pop("slothkit.trainers", None)
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainers = importlib.import_module("slothkit.trainers")
    assert [str(w.message) for w in caught if w.category is LegacySpellingWarning] == [
        "import slothkit.trainers is written slothkit.trl now (from slothkit.trl import SFTTrainer, "
        "SFTConfig, ...); the names are the same"
    ]
    assert trainers.__all__ == slothkit.trl.__all__
    assert all(getattr(trainers, name) is getattr(slothkit.trl, name) for name in slothkit.trl.__all__)
