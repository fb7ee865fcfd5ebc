"""``slothkit.trainers``, an older module path of ``slothkit.trl`` that user code imports:
the same names, and a notice saying the current path, once.  It stays at the package root
because that path is what the code imports."""

from slothkit.core.notices import LegacySpellingWarning, say_once
from slothkit.trl import *  # noqa: F403 - every trainer and config, under TRL's names
from slothkit.trl import __all__  # noqa: F401

say_once(
    "import slothkit.trainers is written slothkit.trl now (from slothkit.trl import SFTTrainer, "
    "SFTConfig, ...); the names are the same",
    LegacySpellingWarning,
)
