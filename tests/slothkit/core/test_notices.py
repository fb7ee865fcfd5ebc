"""Notices come once per message, in the category that says what they are."""

import ast
import pathlib
import warnings

import pytest

from slothkit.core import notices
from slothkit.core.notices import (
    DataWarning,
    FallbackWarning,
    LegacySpellingWarning,
    SettingChangedWarning,
    SlothkitNotice,
    say_once,
)

CATEGORIES = (LegacySpellingWarning, FallbackWarning, SettingChangedWarning, DataWarning)
PACKAGE = pathlib.Path(notices.__file__).resolve().parents[1]


@pytest.mark.parametrize("category", CATEGORIES)
def test_each_category_is_shown_once_and_can_be_filtered_alone(category):
    say_once.cache_clear()
    message = f"a {category.__name__} for this test"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        say_once(message, category)
        say_once(message, category)
    assert [(w.category, str(w.message)) for w in caught] == [(category, message)]
    assert issubclass(category, SlothkitNotice) and issubclass(category, UserWarning)
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=category)
        for other in CATEGORIES:
            say_once(f"{message}: {other.__name__}", other)
    assert sorted(w.category.__name__ for w in caught) == sorted(
        c.__name__ for c in CATEGORIES if c is not category
    )


def test_the_warning_names_the_callers_line():
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        say_once("named here", DataWarning)
    assert caught[0].filename == __file__


def test_every_notice_in_slothkit_names_its_category():
    """say_once takes its category as the second argument; a call without one, or with
    a category that is not a SlothkitNotice, is found here rather than when it fires."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "say_once":
                names = [arg.id for arg in node.args[1:2] if isinstance(arg, ast.Name)]
                if not names or names[0] not in {c.__name__ for c in CATEGORIES}:
                    wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not wrong, "say_once without one of the notice categories: " + ", ".join(wrong)
