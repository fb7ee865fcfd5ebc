"""The train cell's report: losses, and for GRPO the mean reward per step and its curve."""

import types

import pytest

from slothkit.notebook import training


def _trainer(log_history):
    return types.SimpleNamespace(state=types.SimpleNamespace(log_history=log_history))


@pytest.fixture
def plotted(monkeypatch):
    curves = []
    monkeypatch.setattr(training, "plot_curve", lambda values, ylabel: curves.append((ylabel, values)))
    return curves


def test_a_supervised_run_reports_and_plots_its_loss(plotted, capsys):
    log = [{"loss": 2.5, "grad_norm": 1.0}, {"loss": 2.0}, {"loss": 1.5}, {"train_runtime": 3.0}]
    result = training.report_training(_trainer(log), types.SimpleNamespace(metrics={"train_runtime": 3.0}))
    assert (result.losses, result.rewards) == ([2.5, 2.0, 1.5], [])
    assert result.loss_went_down
    assert "3 steps in 3.0 s; loss 2.5000 -> 1.5000\n" in capsys.readouterr().out
    assert plotted == [("training loss", [2.5, 2.0, 1.5])]


def test_a_grpo_run_reports_its_mean_reward_and_plots_it(plotted, capsys):
    log = [
        {"loss": 0.0, "reward": 0.25, "rewards/format_reward/mean": 0.25},
        {"loss": 0.0125, "reward": 0.5},
        {"loss": -0.003, "reward": 1.625},
        {"train_runtime": 9.5},
    ]
    result = training.report_training(_trainer(log), types.SimpleNamespace(metrics={"train_runtime": 9.5}))
    assert result.losses == [0.0, 0.0125, -0.003] and result.rewards == [0.25, 0.5, 1.625]
    assert "3 steps in 9.5 s; loss 0.0000 -> -0.0030; mean reward 0.250 -> 1.625\n" in capsys.readouterr().out
    assert plotted == [("mean reward", [0.25, 0.5, 1.625])]


def test_no_logged_loss_is_an_error(plotted):
    with pytest.raises(RuntimeError, match="training logged no loss; check max_steps and logging_steps"):
        training.report_training(_trainer([{"train_runtime": 1.0}]), None)


def test_the_curve_says_what_it_is_without_matplotlib(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    training.plot_curve([1.0, 0.5], ylabel="mean reward")
    assert "(no plot of the mean reward: matplotlib is not installed" in capsys.readouterr().out


def test_the_image_dataset_is_the_shipped_formulas_or_a_file_of_images_with_their_text(tmp_path):
    import json

    import datasets
    import numpy as np

    from slothkit.data import example_image_dataset, example_images

    shipped = training.load_configured_image_dataset("example:latex_ocr")
    assert [r["messages"][1] for r in shipped] == [r["messages"][1] for r in example_image_dataset()]
    with pytest.raises(ValueError, match="accepted: example:latex_ocr"):
        training.load_configured_image_dataset("example:chat")

    pairs = example_images()[:3]
    datasets.Dataset.from_list(pairs).to_parquet(tmp_path / "pairs.parquet")
    records = training.load_configured_image_dataset(str(tmp_path / "pairs.parquet"))
    for record, pair in zip(records, pairs, strict=True):
        user, assistant = record["messages"]
        assert assistant["content"] == [{"type": "text", "text": pair["text"]}]
        image = user["content"][0]["image"]
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), np.asarray(pair["image"]))

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    assert training.load_configured_image_dataset(str(tmp_path / "chat.jsonl")) == [{"messages": messages}]
    (tmp_path / "other.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match="accepted: a 'messages' column"):
        training.load_configured_image_dataset(str(tmp_path / "other.jsonl"))
