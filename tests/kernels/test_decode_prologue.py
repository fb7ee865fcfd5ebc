"""add_rms_norm_low_rank and gated_low_rank against their plain-torch references on fresh
random inputs: rows of one to eight, rows longer than a program's step (several chunks,
spread over the parts that write them), ranks that leave parts partly empty."""

import pytest
import torch

from slothkit_kernels.decode_prologue import (
    add_rms_norm_low_rank,
    add_rms_norm_low_rank_reference,
    gated_low_rank,
    gated_low_rank_reference,
)
from slothkit_kernels.testing import assert_close, relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# xa is a sum over H products of rounded values: both sides accumulate in fp32 and round once.
XA_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _generator():
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


def _randn(generator, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, n_cols, rank, add, gemma",
    [
        (1, 2500, 40, True, False),
        (3, 200, 16, True, True),
        (8, 1100, 0, True, False),
        (2, 2100, 5, False, True),
    ],
)
def test_add_rms_norm_low_rank_matches_the_reference(rows, n_cols, rank, add, gemma, dtype, device):
    generator = _generator()
    hidden = _randn(generator, rows, n_cols, dtype=dtype, device=device, scale=3.0)
    update = _randn(generator, rows, n_cols, dtype=dtype, device=device) if add else None
    weight = _randn(generator, n_cols, dtype=dtype, device=device, scale=0.5) + (0 if gemma else 1)
    lora_a = _randn(generator, rank, n_cols, dtype=dtype, device=device, scale=n_cols**-0.5) if rank else None
    summed, normed, xa = add_rms_norm_low_rank(hidden, update, weight, 1e-6, gemma, lora_a)
    expected_summed, expected_normed, expected_xa = add_rms_norm_low_rank_reference(
        hidden, update, weight, 1e-6, gemma, lora_a
    )
    # The sum is torch's own rounding of hidden + update, bit for bit (the interpreter
    # rounds fp32 to bf16 toward zero, so there within one bf16 step).
    if device == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(summed, expected_summed)
    else:
        assert_close(summed, expected_summed, msg="summed")
    assert summed is hidden or add
    assert normed.dtype == dtype and normed.shape == hidden.shape
    assert_close(normed, expected_normed, msg="normed")
    if rank:
        assert xa.shape == (rows, rank) and xa.dtype == dtype
        # xa is the product of the normed rows the kernel wrote, not of a differently
        # rounded copy.
        own = (normed.float() @ lora_a.float().t()).to(dtype)
        assert relative_error(xa, own) < XA_TOLERANCE[dtype]
        assert relative_error(xa, expected_xa) < XA_TOLERANCE[dtype]
    else:
        assert xa is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "geglu"])
@pytest.mark.parametrize("rows, n_cols, rank", [(1, 3000, 16), (5, 700, 48), (2, 300, 70)])
def test_gated_low_rank_matches_the_reference(rows, n_cols, rank, activation, dtype, device):
    for _ in range(2):
        _check_gated_low_rank(rows, n_cols, rank, activation, dtype, device)


def _check_gated_low_rank(rows, n_cols, rank, activation, dtype, device):
    generator = _generator()
    # gate and up as the two halves of one (rows, 2 n_cols) output, rows 2 n_cols apart
    # (Phi-3's gate_up_proj).
    gate_up = _randn(generator, rows, 2 * n_cols, dtype=dtype, device=device, scale=2.0)
    gate, up = gate_up.chunk(2, dim=-1)
    lora_a = _randn(generator, rank, n_cols, dtype=dtype, device=device, scale=n_cols**-0.5)
    hidden, xa = gated_low_rank(gate, up, activation, lora_a)
    expected_hidden, expected_xa = gated_low_rank_reference(gate, up, activation, lora_a)
    assert hidden.shape == (rows, n_cols) and hidden.dtype == dtype and hidden.is_contiguous()
    assert_close(hidden, expected_hidden, msg=activation)
    assert relative_error(xa, (hidden.float() @ lora_a.float().t()).to(dtype)) < XA_TOLERANCE[dtype]
    assert relative_error(xa, expected_xa) < XA_TOLERANCE[dtype]


def test_one_program_runs_a_row_where_no_workspace_is_kept(device, monkeypatch):
    """During CUDA graph capture a shape met for the first time has no workspace for its
    slices' partial products (split_k.workspace): one program then covers the whole row."""
    from slothkit_kernels import split_k

    monkeypatch.setattr(split_k, "workspace", lambda *args: (None, None))
    generator = _generator()
    hidden, update = (_randn(generator, 2, 1500, dtype=torch.float32, device=device) for _ in range(2))
    weight = _randn(generator, 1500, dtype=torch.float32, device=device)
    lora_a = _randn(generator, 24, 1500, dtype=torch.float32, device=device, scale=0.03)
    got = add_rms_norm_low_rank(hidden, update, weight, 1e-5, False, lora_a)
    for value, expected in zip(
        got, add_rms_norm_low_rank_reference(hidden, update, weight, 1e-5, False, lora_a)
    ):
        assert_close(value, expected)
    h, xa = gated_low_rank(hidden, update, "swiglu", lora_a)
    expected_h, expected_xa = gated_low_rank_reference(hidden, update, "swiglu", lora_a)
    assert_close(h, expected_h)
    assert relative_error(xa, expected_xa) < XA_TOLERANCE[torch.float32]


def test_the_norm_matches_slothkits_rms_norm(device):
    """Without an update or adapter it is rms_norm itself, both flavours."""
    from slothkit_kernels.rms_norm import rms_norm

    generator = _generator()
    x = _randn(generator, 4, 1536, dtype=torch.bfloat16, device=device, scale=2.0)
    weight = _randn(generator, 1536, dtype=torch.bfloat16, device=device)
    for gemma in (False, True):
        _, normed, _ = add_rms_norm_low_rank(x, None, weight, 1e-5, gemma, None)
        assert_close(normed, rms_norm(x, weight, 1e-5, gemma), msg=f"gemma={gemma}")


def test_what_the_prologues_cannot_compute_is_refused(device):
    generator = torch.Generator().manual_seed(0)
    x = _randn(generator, 2, 64, dtype=torch.float32, device=device)
    weight = torch.ones(64, device=device)
    lora_a = _randn(generator, 4, 64, dtype=torch.float32, device=device)
    nine = torch.zeros(9, 64, device=device)
    for match, call in [
        ("1 to 8", lambda: add_rms_norm_low_rank(nine, None, weight, 1e-6, False, None)),
        ("expected \\(M, H\\)", lambda: add_rms_norm_low_rank(x, x[:1], weight, 1e-6, False, None)),
        ("weight", lambda: add_rms_norm_low_rank(x, None, weight[:8], 1e-6, False, None)),
        ("lora_a", lambda: add_rms_norm_low_rank(x, None, weight, 1e-6, False, lora_a[:, :8])),
        ("lora_a is", lambda: add_rms_norm_low_rank(x, None, weight, 1e-6, False, lora_a.double())),
        ("contiguous", lambda: gated_low_rank(x.t().contiguous().t(), x, "swiglu", lora_a)),
        ("one device in one dtype", lambda: gated_low_rank(x, x.double(), "swiglu", lora_a)),
        ("activation", lambda: gated_low_rank(x, x, "relu", lora_a)),
        ("give lora_a", lambda: gated_low_rank(x, x, "swiglu", None)),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match="forward-only"):
        add_rms_norm_low_rank(x.clone().requires_grad_(), None, weight, 1e-6, False, None)
