"""HubOptions: the one value the pushes build from their keywords."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from slothkit.export import push_folder_to_hub, push_to_hub_merged
from slothkit.export.gguf import push_to_hub_gguf
from slothkit.export.hub_options import HubOptions

OPTION_NAMES = [field.name for field in dataclasses.fields(HubOptions)]


@pytest.mark.parametrize("push", [push_folder_to_hub, push_to_hub_merged], ids=lambda f: f.__name__)
def test_every_option_is_a_keyword_of_the_push_with_the_options_default(push):
    parameters = inspect.signature(push).parameters
    defaults = HubOptions()
    for name in OPTION_NAMES:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameters[name].default == getattr(defaults, name), name


def test_the_gguf_push_takes_its_options_with_the_same_defaults():
    parameters = inspect.signature(push_to_hub_gguf).parameters
    taken = [name for name in OPTION_NAMES if name in parameters]
    assert taken == ["commit_message", "endpoint", "stall_timeout_s", "use_xet"]
    for name in taken:
        assert parameters[name].default == getattr(HubOptions(), name), name


def test_the_defaults():
    assert dataclasses.asdict(HubOptions()) == {
        "commit_message": None,
        "endpoint": None,
        "retries": 2,
        "retry_wait_s": 2.0,
        "timeout_s": 60.0,
        "stall_timeout_s": 180.0,
        "use_xet": False,
    }


@pytest.mark.parametrize("stall_timeout_s", [0, -1.5, float("nan")])
def test_a_stall_timeout_that_is_no_positive_number_is_refused_by_the_value(stall_timeout_s):
    with pytest.raises(
        ValueError, match=r"stall_timeout_s=.*: expected a positive number of seconds, or None"
    ):
        HubOptions(stall_timeout_s=stall_timeout_s)


def test_no_stall_timeout_and_a_frozen_value():
    options = HubOptions(stall_timeout_s=None, timeout_s=None)
    assert options.stall_timeout_s is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.retries = 5
