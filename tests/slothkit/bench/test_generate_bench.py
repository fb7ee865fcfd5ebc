"""`slothkit bench generate`'s host-side logic: batch parsing, rows against HF, the table.
(The GPU run itself is scripts/gpu_bench.sh on the H200.)"""

import pytest

from slothkit.bench.generate import _batches, format_table, summarise


def test_batches_are_positive_integers():
    assert _batches("1,8") == [1, 8]
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(ValueError, match="--batch"):
            _batches(bad)


def test_rows_compare_speed_time_to_first_token_and_tokens_with_hf():
    results = {
        (1, "hf"): {"status": "ok", "tokens_per_s": 30.0, "ttft_s": 0.2, "first_tokens": [[5, 6, 7]]},
        (1, "slothkit"): {"status": "ok", "tokens_per_s": 75.0, "ttft_s": 0.1, "first_tokens": [[5, 6, 7]]},
        (8, "hf"): {"status": "ok", "tokens_per_s": 200.0, "first_tokens": [[1], [2], [3]]},
        (8, "slothkit"): {"status": "ok", "tokens_per_s": 500.0, "first_tokens": [[1], [9], [3]]},
        (8, "unsloth"): {"status": "skipped", "error": "not importable"},
    }
    rows = {(r["batch"], r["impl"]): r for r in summarise(results)}
    assert rows[(1, "slothkit")]["vs_hf"] == pytest.approx(2.5)
    assert rows[(1, "slothkit")]["ttft_vs_hf"] == pytest.approx(0.5)
    assert rows[(8, "slothkit")]["rows_equal_hf"] == "2/3"
    assert rows[(8, "unsloth")]["status"] == "skipped"
    table = format_table(summarise(results)).splitlines()
    assert table[0].startswith("| impl |") and len(table) == 2 + len(results)
    assert "| slothkit | 8 | 500.0 | 2.50 |" in "\n".join(table)


def _tiny_models_prepared_by(shape: str, *impls: str) -> dict:
    """Each implementation's model as the worker prepares it: a tiny shape, fp32, on the CPU."""
    import argparse

    import torch

    from slothkit.bench.generate_worker import prepare

    models = {}
    for impl in impls:
        args = argparse.Namespace(model=shape, mode="lora", rank=8, seed=0, prompt_len=16, new_tokens=4)
        torch.manual_seed(0)
        models[impl] = prepare(impl, args, torch.float32, "cpu")
    return models


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3-moe"])
def test_every_implementation_decodes_the_same_adapted_model(shape):
    """The rows-equal-HF column compares tokens, so HF + PEFT and slothkit must be given
    the same model: the same base weights and the same LoRA A and B (a mixture-of-experts
    model's on its experts too), although each library draws its own A from the global
    generator (fp32, on the CPU)."""
    import torch

    models = _tiny_models_prepared_by(shape, "hf", "slothkit")
    adapters = {
        impl: {n: p for n, p in model.named_parameters() if "lora_" in n} for impl, model in models.items()
    }
    assert adapters["hf"].keys() == adapters["slothkit"].keys() and adapters["hf"]
    for name, parameter in adapters["hf"].items():
        assert parameter.abs().sum() > 0, name  # B too: the adapters change the output
        torch.testing.assert_close(adapters["slothkit"][name], parameter, rtol=0, atol=0, msg=name)
    ids = torch.randint(
        3, models["hf"].config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        reference = models["hf"](input_ids=ids).logits
        fast = models["slothkit"](input_ids=ids).logits
    torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)


def test_a_failure_on_the_long_prompt_keeps_the_throughput_and_says_why():
    """A peer whose attention cannot take the time-to-first-token prompt loses that
    figure only: its tokens/s from the timed run stays in the record."""
    import torch

    from slothkit.bench.generate_worker import _time_to_first_token

    class FailsOnLongPrompts:
        def generate(self, input_ids, **kwargs):
            raise RuntimeError("The size of tensor a (256) must match the size of tensor b (2048)\nmore")

    measured = _time_to_first_token(FailsOnLongPrompts(), torch.zeros(1, 2048, dtype=torch.long))
    assert measured == {
        "ttft_error": "RuntimeError: The size of tensor a (256) must match the size of tensor b (2048)",
        "ttft_len": 2048,
    }
    results = {
        (1, "hf"): {"status": "ok", "tokens_per_s": 10.0, "ttft_s": 0.1, "first_tokens": [[1]]},
        (1, "unsloth"): {"status": "ok", "tokens_per_s": 20.0, "first_tokens": [[1]], **measured},
    }
    row = {r["impl"]: r for r in summarise(results)}["unsloth"]
    assert row["tokens_per_s"] == 20.0 and row["vs_hf"] == 2.0
    assert row["ttft_s"] is None and row["ttft_error"].startswith("RuntimeError: The size")


def test_the_merged_row_decodes_the_adapted_model_without_adapters():
    """`slothkit-merged` is slothkit's adapted model with the same adapters merged into its
    weights: no LoRA layer left, the same logits (a tiny Llama, fp32, on the CPU)."""
    import torch

    models = _tiny_models_prepared_by("tiny-llama", "slothkit", "slothkit-merged")
    assert not [n for n, _ in models["slothkit-merged"].named_parameters() if "lora_" in n]
    ids = torch.randint(
        3, models["slothkit"].config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        adapted = models["slothkit"](input_ids=ids).logits
        merged = models["slothkit-merged"](input_ids=ids).logits
        with models["slothkit"].disable_adapter():
            base = models["slothkit"](input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)


def test_rows_give_their_share_of_the_bandwidth_limit_and_skip_tokens_of_another_model():
    results = {
        (1, "hf"): {
            "status": "ok",
            "tokens_per_s": 30.0,
            "first_tokens": [[5, 6]],
            "limit_tokens_per_s": 300.0,
        },
        (1, "slothkit"): {
            "status": "ok",
            "tokens_per_s": 150.0,
            "first_tokens": [[5, 6]],
            "limit_tokens_per_s": 300.0,
        },
        (1, "slothkit-merged"): {
            "status": "ok",
            "tokens_per_s": 240.0,
            "first_tokens": [[1, 2]],
            "limit_tokens_per_s": 320.0,
            "compare_tokens": False,
        },
    }
    rows = {r["impl"]: r for r in summarise(results)}
    assert rows["slothkit"]["share_of_limit"] == pytest.approx(0.5)
    assert rows["slothkit"]["rows_equal_hf"] == "1/1"
    assert rows["slothkit-merged"]["share_of_limit"] == pytest.approx(0.75)
    assert "rows_equal_hf" not in rows["slothkit-merged"]
    table = format_table(summarise(results))
    assert "| slothkit | 1 | 150.0 | 5.00 | 50% |" in table
    assert "| slothkit-merged | 1 | 240.0 | 8.00 | 75% |" in table
