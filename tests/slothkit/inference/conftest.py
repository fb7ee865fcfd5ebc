"""The decode tests here compare the fast loop with Hugging Face's generate themselves,
count the calls of its parts, or break a part on purpose to see the comparison fail: the
check ``for_inference`` runs on a family without a record (slothkit.inference.
decode_check) would add calls, or switch the broken loop off before the comparison sees it.
test_decode_check.py tests that check; the other files run without it."""

import pytest


@pytest.fixture(autouse=True)
def decode_unchecked(request, monkeypatch):
    if request.module.__name__.rsplit(".", 1)[-1] != "test_decode_check":
        monkeypatch.setattr("slothkit.inference.decode_disagreement", lambda decoder: None)
