"""``slothkit.trainers``, the module path slothkit's docs taught for its TRL trainers before
``slothkit.trl``: the same names, and a notice saying the current path, once."""

from slothkit.core.notices import LegacySpellingWarning, say_once
from slothkit.trl import *  # noqa: F403 - every trainer and config, under TRL's names
from slothkit.trl import __all__  # noqa: F401

say_once(
    "import slothkit.trainers is written slothkit.trl now (from slothkit.trl import SFTTrainer, "
    "SFTConfig, ...); the names are the same",
    LegacySpellingWarning,
)
