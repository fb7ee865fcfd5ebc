"""Notices shown once per process, each in a category that says what it is, so that a user
can filter them (``warnings.filterwarnings("ignore", category=FallbackWarning)``):

- LegacySpellingWarning: an older spelling of a call (TRL, transformers or Unsloth code)
  was accepted and translated; the message gives the current one, so that the user can
  update the code and the message stops.
- FallbackWarning: a slower or narrower path runs than the one asked for (eager attention,
  Hugging Face's generate, a module slothkit does not fuse, a text model without its
  vision tower); the message says why.
- SettingChangedWarning: slothkit set or changed a setting to make the call work (RoPE
  scaled for a longer context, a batch raised to hold whole groups).
- DataWarning: something in the data or the request will not do what it seems to (prompts
  left out, a doubled BOS, generation past the model's positions).

All four are SlothkitNotice, a UserWarning.
"""

from __future__ import annotations

import functools
import pathlib
import sys
import warnings

_PACKAGE = str(pathlib.Path(__file__).resolve().parent)


class SlothkitNotice(UserWarning):
    """A notice from slothkit; its subclass says which kind."""


class LegacySpellingWarning(SlothkitNotice):
    """An older spelling was accepted and translated; the message gives the current one."""


class FallbackWarning(SlothkitNotice):
    """A slower or narrower path runs than the one asked for; the message says why."""


class SettingChangedWarning(SlothkitNotice):
    """slothkit set or changed a setting so that the call works; the message says which."""


class DataWarning(SlothkitNotice):
    """The data or the request will not do what it seems to; the message says what happens."""


@functools.cache
def say_once(message: str, category: type[SlothkitNotice]) -> None:
    """Warn with `message` the first time this process sees it.

    Args:
        message: the whole notice; equal messages are shown once.
        category: which kind of notice it is (a SlothkitNotice subclass).
    """
    warnings.warn(message, category, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stacklevel of the first frame outside slothkit, seen from warnings.warn in
    say_once, so that the warning names the user's line."""
    frame, level = sys._getframe(2), 2  # say_once's caller
    while frame is not None and str(pathlib.Path(frame.f_code.co_filename).resolve()).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
