"""Notices shown once per process: the older spelling of a call was accepted and translated,
and this is how it is written now.

Code written for older TRL, transformers or Unsloth releases runs on slothkit's
compatibility names (slothkit.trl, slothkit.chat_templates); each translation says once
what the current spelling is, so that the user can update the code and the message stops.
"""

from __future__ import annotations

import functools
import pathlib
import sys
import warnings

_PACKAGE = str(pathlib.Path(__file__).resolve().parent)


class LegacySpellingWarning(UserWarning):
    """An older spelling was accepted and translated; the message gives the current one."""


@functools.cache
def say_once(message: str) -> None:
    """Warn with `message` (a LegacySpellingWarning) the first time this process sees it.

    Args:
        message: the whole notice; equal messages are shown once.
    """
    warnings.warn(message, LegacySpellingWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stacklevel of the first frame outside slothkit, seen from warnings.warn in
    say_once, so that the warning names the user's line."""
    frame, level = sys._getframe(2), 2  # say_once's caller
    while frame is not None and str(pathlib.Path(frame.f_code.co_filename).resolve()).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
