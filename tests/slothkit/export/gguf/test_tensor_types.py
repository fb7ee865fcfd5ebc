"""Quantization methods parsed once where users pass them (tensor_types.quantization_methods)."""

import pytest

from slothkit.export.gguf.tensor_types import QUANTIZATION_METHODS, quantization_method, quantization_methods

VALID = "valid: 'f32', 'f16', 'bf16', 'q8_0', 'q4_0', 'q4_k_m', 'q5_k_m', 'q6_k'"


@pytest.mark.parametrize(
    "value, names",
    [
        ("q4_k_m", ["q4_k_m"]),
        ("Q8_0", ["q8_0"]),
        ("q4_k_m,q8_0", ["q4_k_m", "q8_0"]),
        (" q4_k_m , Q6_K ,", ["q4_k_m", "q6_k"]),  # a notebook form's spacing and trailing comma
        (["f16", "q5_k_m,bf16"], ["f16", "q5_k_m", "bf16"]),
        (("q4_0",), ["q4_0"]),
        (QUANTIZATION_METHODS["q6_k"], ["q6_k"]),
        ([QUANTIZATION_METHODS["f32"], "q8_0"], ["f32", "q8_0"]),
    ],
)
def test_what_users_pass_becomes_methods_in_order(value, names):
    methods = quantization_methods(value)
    assert isinstance(methods, tuple)
    assert [m.name for m in methods] == names
    assert all(m is QUANTIZATION_METHODS[n] for m, n in zip(methods, names))
    assert quantization_methods(methods) == methods  # parsed values pass through as they are


@pytest.mark.parametrize(
    "value, message",
    [
        ("q3_k_s", f"unknown GGUF quantization_method 'q3_k_s'; {VALID}"),
        ("q4_k_m,q3_k_s", "unknown GGUF quantization_method 'q3_k_s'; valid: 'f32'"),
        (["q8_0", 8], "unknown GGUF quantization_method 8; valid: 'f32'"),
        (None, "unknown GGUF quantization_method None; valid: 'f32'"),
        ("", "quantization_method is empty; give one or more of 'f32', 'f16'"),
        ([], "quantization_method is empty"),
        (" , ", "quantization_method is empty"),
        (["q8_0", "Q8_0"], r"lists a method twice: \['q8_0', 'q8_0'\]"),
        ("q4_k_m,q8_0,q4_k_m", "lists a method twice"),
    ],
)
def test_bad_input_names_what_is_accepted(value, message):
    with pytest.raises(ValueError, match=message):
        quantization_methods(value)


def test_one_name():
    assert quantization_method("Q4_K_M") is QUANTIZATION_METHODS["q4_k_m"]
    assert QUANTIZATION_METHODS["q4_k_m"].label == "Q4_K_M"
    with pytest.raises(ValueError, match=f"unknown GGUF quantization_method 'q4_k_m,q8_0'; {VALID}"):
        quantization_method("q4_k_m,q8_0")  # one name only; lists go through quantization_methods
