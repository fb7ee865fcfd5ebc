"""The per-shape choice between cuBLAS's GEMV (with addmm_ for the adapter) and
slothkit's lora_gemv: the fastest candidate whose output agrees, only past MIN_GAIN, and
nothing timed during graph capture or off the GPU.  The timings are replaced by given
figures; the outputs are computed (the kernel under the Triton interpreter)."""

import pytest
import torch

from slothkit.inference import gemv_choice
from slothkit_kernels.lora_gemv import CANDIDATES
from slothkit_kernels.lora_gemv import lora_gemv as real_lora_gemv


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(2, 64, generator=generator)
    weight = torch.randn(24, 64, generator=generator) / 8
    xa = torch.randn(2, 4, generator=generator)
    lora_b = torch.randn(24, 4, generator=generator) / 10
    return rows, weight, None, xa, lora_b, 2.0


def _timings(monkeypatch, cublas_ms: float, kernel_ms: dict):
    """_graph_ms answers cuBLAS's figure first, then each candidate's in order."""
    answers = iter([cublas_ms, *(kernel_ms.get(c, 1.0) for c in range(len(CANDIDATES)))])
    monkeypatch.setattr(gemv_choice, "_graph_ms", lambda call, weight: next(answers))


def test_the_fastest_agreeing_candidate_is_kept_when_it_gains_enough(monkeypatch):
    _timings(monkeypatch, 1.0, {0: 0.9, 1: 0.6, 2: 0.7})
    decision = gemv_choice._decide(*_inputs(int(torch.randint(0, 2**31, ()))))
    assert decision == {"cublas_ms": 1.0, "kernel_ms": 0.6, "candidate": 1}


def test_cublas_is_kept_when_the_kernel_gains_less_than_min_gain(monkeypatch):
    _timings(monkeypatch, 1.0, {c: 1.0 - gemv_choice.MIN_GAIN / 2 for c in range(5)})
    decision = gemv_choice._decide(*_inputs(int(torch.randint(0, 2**31, ()))))
    assert "candidate" not in decision and decision["kernel_ms"] < 1.0


def test_a_candidate_that_disagrees_or_fails_is_never_chosen(monkeypatch):
    real = real_lora_gemv

    def faulty(rows, weight, bias, xa, lora_b, scaling, candidate=0):
        if candidate == 0:
            return real(rows, weight, bias, xa, lora_b, scaling, candidate=candidate) * 1.5  # wrong
        if candidate == 1:
            raise RuntimeError("out of shared memory")
        return real(rows, weight, bias, xa, lora_b, scaling, candidate=candidate)

    monkeypatch.setattr(gemv_choice, "lora_gemv", faulty)
    # cuBLAS, then every candidate but the two faulty ones (a spare answer would be a bug)
    timed = iter([1.0] + [0.5] * (len(CANDIDATES) - 2))
    monkeypatch.setattr(gemv_choice, "_graph_ms", lambda call, weight: next(timed))
    decision = gemv_choice._decide(*_inputs(int(torch.randint(0, 2**31, ()))))
    assert decision["candidate"] == 2
    assert next(timed, None) is None  # every agreeing candidate was timed


def test_nothing_is_timed_off_the_gpu_or_for_too_many_rows():
    # The table is process-wide: on a GPU, decode tests before this one have filled it.
    before = gemv_choice.choices()
    rows, weight, bias, xa, lora_b, scaling = _inputs(0)
    assert gemv_choice.gemv_candidate(rows, weight, bias, xa, lora_b, scaling) is None
    many_rows = torch.randn(9, 64)
    many_xa = torch.randn(9, 4)
    if torch.cuda.is_available():
        weight, lora_b, many_rows, many_xa = (t.cuda() for t in (weight, lora_b, many_rows, many_xa))
    assert gemv_choice.gemv_candidate(many_rows, weight, bias, many_xa, lora_b, scaling) is None
    assert gemv_choice.choices() == before


@pytest.mark.cuda
def test_choices_on_the_gpu_are_made_once_per_shape_and_listed():
    rows, weight, bias, xa, lora_b, scaling = (
        t.cuda().bfloat16() if isinstance(t, torch.Tensor) else t for t in _inputs(0)
    )
    first = gemv_choice.gemv_candidate(rows, weight, bias, xa, lora_b, scaling)
    assert gemv_choice.gemv_candidate(rows, weight, bias, xa, lora_b, scaling) == first
    listed = [c for c in gemv_choice.choices() if (c["rows"], c["out_features"]) == (2, 24)]
    assert len(listed) == 1 and listed[0]["runs"] == ("cublas" if first is None else "lora_gemv")
