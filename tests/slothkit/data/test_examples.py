"""The example dataset shipped with slothkit: committed files equal the generator's output."""

import json

import pytest

from slothkit.data import example_dataset
from slothkit.data.examples import ANSWER_FORMAT, CONVERSIONS, KINDS, build_example_records, example_path


@pytest.mark.parametrize("kind", list(KINDS))
def test_committed_files_match_the_generator(kind):
    lines = example_path(kind).read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == build_example_records(kind)


def test_kinds_and_their_columns():
    alpaca, chat, preference, math = (
        example_dataset(kind) for kind in ("alpaca", "chat", "preference", "math")
    )
    assert (alpaca.num_rows, chat.num_rows, preference.num_rows, math.num_rows) == (300, 300, 200, 200)
    assert sorted(math.column_names) == ["answer", "prompt"]
    assert alpaca.column_names == ["instruction", "input", "output"]
    assert chat.column_names == ["messages"]
    assert sorted(preference.column_names) == ["chosen", "prompt", "rejected"]
    roles = [[m["role"] for m in record] for record in chat["messages"]]
    assert {tuple(r) for r in roles} >= {
        ("user", "assistant"),
        ("system", "user", "assistant"),
        ("user", "assistant", "user", "assistant"),
    }
    assert sum(bool(x) for x in alpaca["input"]) > 30  # some records use the input field


def test_answers_are_right_and_rejections_wrong():
    for record in example_dataset("alpaca"):
        question = record["input"] or record["instruction"]
        if question.startswith("What is ") and question[8].isdigit():
            expression = question[8:-1]
            assert record["output"] == f"{expression} = {eval(expression)}."
    for record in example_dataset("preference"):
        assert record["chosen"][0]["content"] != record["rejected"][0]["content"]


def test_math_prompts_ask_for_the_format_and_answers_are_right():
    """Each prompt is one user turn ending in the answer format; its answer is the number."""
    conversions = {(source, target): factor for source, target, factor in CONVERSIONS}
    kinds = set()
    for record in example_dataset("math"):
        (turn,) = record["prompt"]
        assert turn["role"] == "user" and turn["content"].endswith(" " + ANSWER_FORMAT)
        question = turn["content"][: -len(ANSWER_FORMAT) - 1]
        if question.startswith("What is "):
            expression = question[len("What is ") : -1]
            kinds.add(expression.split()[1])
            assert record["answer"] == str(eval(expression)), question
        else:
            amount, source, _, target = question[len("Convert ") : -1].split()
            kinds.add("convert")
            assert record["answer"] == str(int(amount) * conversions[source, target]), question
    assert kinds == {"+", "-", "*", "convert"}
    assert any(record["answer"].startswith("-") for record in example_dataset("math"))  # negative ones too


def test_unknown_kind():
    with pytest.raises(
        ValueError, match="unknown example dataset 'dpo'; accepted: alpaca, chat, preference, math"
    ):
        example_dataset("dpo")
