"""cross_entropy: Triton kernels against the torch reference, F.cross_entropy and HF's loss."""

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from slothkit_kernels.cross_entropy import cross_entropy, cross_entropy_reference
from slothkit_kernels.testing import assert_close, relative_error
from slothkit_kernels.utils import use_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Largest relative error (in norm) of the gradient, which is rounded to the input dtype.
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
LOSS_TOL = {"atol": 2e-5, "rtol": 2e-5}  # the loss is fp32 whatever the input dtype

# (rows, vocab): one row, odd sizes, a vocabulary longer than one block (8192).
SHAPES = [(1, 7), (5, 1000), (3, 1023), (4, 20000)]


def make_inputs(n_rows, vocab, dtype, device, seed, scale=3.0, ignore_index=-100, n_ignored=1):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_rows, vocab, generator=gen) * scale).to(dtype).to(device)
    labels = torch.randint(0, vocab, (n_rows,), generator=gen)
    if n_rows > 1:
        labels[torch.randperm(n_rows, generator=gen)[:n_ignored]] = ignore_index
    return logits, labels.to(device)


def run_with_grad(fn, logits, labels, grad_seed=0, **kwargs):
    """Loss and dL/dlogits for L = sum(loss * w) with fixed random weights w."""
    x = logits.clone().requires_grad_()
    loss = fn(x, labels, **kwargs)
    weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(grad_seed)).to(loss.device)
    (loss * weights).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, softcap, reduction, device):
    logits, labels = make_inputs(*shape, dtype, device, seed=sum(shape) + len(reduction))
    loss, grad = run_with_grad(cross_entropy, logits, labels, softcap=softcap, reduction=reduction)
    ref_loss, ref_grad = run_with_grad(
        cross_entropy_reference, logits, labels, softcap=softcap, reduction=reduction
    )
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert loss.shape == ref_loss.shape
    assert_close(loss, ref_loss, **LOSS_TOL, msg="loss")
    assert relative_error(grad, ref_grad) < GRAD_RTOL[dtype]
    # Ignored rows: no loss, no gradient.
    ignored = labels == -100
    assert (grad[ignored] == 0).all()
    if reduction == "none":
        assert (loss[ignored] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_cross_entropy(dtype, reduction, device):
    """Against F.cross_entropy on the fp32 logits, soft-capped the way HF's Gemma 2 does."""
    logits, labels = make_inputs(6, 1001, dtype, device, seed=1, scale=20.0, n_ignored=2)
    cap = 30.0

    def torch_loss(x, y, reduction):
        z = torch.tanh(x.float() / cap) * cap
        return F.cross_entropy(z, y, ignore_index=-100, reduction=reduction)

    loss, grad = run_with_grad(cross_entropy, logits, labels, softcap=cap, reduction=reduction)
    ref_loss, ref_grad = run_with_grad(torch_loss, logits, labels, reduction=reduction)
    assert_close(loss, ref_loss, **LOSS_TOL, msg="loss")
    assert relative_error(grad, ref_grad) < GRAD_RTOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_hf_causal_lm_loss(dtype, device):
    """HF's ForCausalLMLoss shifts the labels; feed ours the shifted labels."""
    gen = torch.Generator().manual_seed(2)
    batch, seq, vocab = 2, 5, 517
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 2).to(dtype).to(device)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :2] = -100
    labels = labels.to(device)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()  # (B, T)

    loss, grad = run_with_grad(cross_entropy, logits, shifted)
    hf_loss, hf_grad = run_with_grad(lambda x, y: ForCausalLMLoss(x, y, vocab_size=vocab), logits, labels)
    assert_close(loss, hf_loss, **LOSS_TOL, msg="loss")
    assert relative_error(grad, hf_grad) < GRAD_RTOL[dtype]


def test_large_vocab_few_rows(device):
    """Gemma's 256,000-entry vocabulary: many blocks per row, labels at both ends."""
    vocab = 256_000
    logits, _ = make_inputs(2, vocab, torch.bfloat16, device, seed=3)
    labels = torch.tensor([0, vocab - 1], device=device)
    for softcap in (None, 30.0):
        loss, grad = run_with_grad(cross_entropy, logits, labels, softcap=softcap, reduction="none")
        ref_loss, ref_grad = run_with_grad(
            cross_entropy_reference, logits, labels, softcap=softcap, reduction="none"
        )
        assert_close(loss, ref_loss, **LOSS_TOL, msg="loss")
        assert relative_error(grad, ref_grad) < GRAD_RTOL[torch.bfloat16]


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_custom_ignore_index(ignore_index, device):
    logits, labels = make_inputs(
        7, 300, torch.float32, device, seed=4, ignore_index=ignore_index, n_ignored=3
    )
    loss, grad = run_with_grad(cross_entropy, logits, labels, ignore_index=ignore_index)
    ref = F.cross_entropy(logits.clone().requires_grad_(), labels, ignore_index=ignore_index)
    assert_close(loss, ref.detach(), **LOSS_TOL)
    assert (grad[labels == ignore_index] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_labels_ignored_gives_zero_not_nan(reduction, device):
    logits, _ = make_inputs(4, 100, torch.float32, device, seed=5)
    labels = torch.full((4,), -100, device=device)
    loss, grad = run_with_grad(cross_entropy, logits, labels, reduction=reduction)
    assert (loss == 0).all()
    assert (grad == 0).all()


def test_leading_dimensions_and_scalar_scaling(device):
    logits, labels = make_inputs(12, 257, torch.float32, device, seed=6)
    logits_3d, labels_2d = logits.reshape(3, 4, 257), labels.reshape(3, 4)
    per_row = cross_entropy(logits_3d.clone(), labels_2d, reduction="none")
    assert per_row.shape == (3, 4)
    assert_close(per_row.reshape(-1), cross_entropy_reference(logits, labels, reduction="none"))

    x = logits_3d.clone().requires_grad_()
    (cross_entropy(x, labels_2d) * 2.5).backward()
    y = logits.clone().requires_grad_()
    (F.cross_entropy(y, labels) * 2.5).backward()
    assert relative_error(x.grad.reshape(12, 257), y.grad) < 1e-5


def test_non_contiguous_logits(device):
    logits, labels = make_inputs(5, 301, torch.float32, device, seed=7)
    wide = torch.zeros(5, 2 * 301, device=device)
    wide[:, ::2] = logits
    strided = wide[:, ::2]  # last dimension not contiguous
    padded = torch.zeros(5, 400, device=device)
    padded[:, :301] = logits
    row_strided = padded[:, :301]  # rows 400 apart, last dimension contiguous
    ref_loss, ref_grad = run_with_grad(F.cross_entropy, logits, labels)
    for view in (strided, row_strided, logits.t().contiguous().t()):
        loss, grad = run_with_grad(cross_entropy, view, labels)
        assert_close(loss, ref_loss, **LOSS_TOL)
        assert relative_error(grad, ref_grad) < 1e-5


def test_backward_writes_gradient_into_logits(device):
    """Documented behaviour: the logits buffer is reused for the gradient."""
    hidden = torch.randn(4, 8, device=device, requires_grad=True)
    weight = torch.randn(50, 8, device=device)
    labels = torch.tensor([1, 2, -100, 49], device=device)
    logits = hidden @ weight.t()  # (4, 50), not a leaf
    expected = torch.softmax(logits.detach(), dim=-1)
    expected[torch.arange(4), labels.clamp_min(0)] -= 1
    expected[2] = 0
    expected /= 3
    cross_entropy(logits, labels).backward()
    assert relative_error(logits.detach(), expected) < 1e-5
    assert relative_error(hidden.grad, expected @ weight) < 1e-5


def test_second_use_of_overwritten_logits_raises(device):
    """Two losses on one logits tensor: autograd refuses rather than read the gradient."""
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the reference path does not overwrite the logits")
    logits, labels = make_inputs(3, 40, torch.float32, device, seed=8)
    x = logits.clone().requires_grad_()
    total = cross_entropy(x, labels) + cross_entropy(x, labels, softcap=4.0)
    with pytest.raises(RuntimeError, match="inplace"):
        total.backward()


def test_no_nan_with_extreme_logits(device):
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e30, 1e30, 5.0]], device=device)
    labels = torch.tensor([1, 0], device=device)
    for softcap in (None, 30.0):
        loss, grad = run_with_grad(cross_entropy, logits, labels, softcap=softcap, reduction="none")
        ref_loss, ref_grad = run_with_grad(
            cross_entropy_reference, logits, labels, softcap=softcap, reduction="none"
        )
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
        assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_minus_inf_logits(device):
    """Masked-out vocabulary entries (-inf), filling the whole first block of a row."""
    logits, labels = make_inputs(3, 20000, torch.float32, device, seed=14, n_ignored=0)
    logits[0, :9000] = float("-inf")
    logits[1, ::3] = float("-inf")
    labels[0], labels[1] = 15000, 1
    for softcap in (None, 30.0):
        loss, grad = run_with_grad(cross_entropy, logits, labels, softcap=softcap, reduction="none")
        ref_loss, ref_grad = run_with_grad(
            cross_entropy_reference, logits, labels, softcap=softcap, reduction="none"
        )
        assert_close(loss, ref_loss, **LOSS_TOL)
        assert relative_error(grad, ref_grad) < 1e-5


def test_reference_matches_torch():
    logits, labels = make_inputs(6, 77, torch.float32, "cpu", seed=9, n_ignored=2)
    assert_close(cross_entropy_reference(logits, labels), F.cross_entropy(logits, labels))
    assert_close(
        cross_entropy_reference(logits, labels, reduction="sum"),
        F.cross_entropy(logits, labels, reduction="sum"),
    )
    capped = cross_entropy_reference(logits, labels, softcap=2.0, reduction="none")
    assert_close(capped, F.cross_entropy(2.0 * torch.tanh(logits / 2.0), labels, reduction="none"))


@pytest.mark.parametrize("bad", [-1, 50, 10**12])
def test_out_of_range_labels_raise(bad, device):
    logits, labels = make_inputs(3, 50, torch.float32, device, seed=10)
    labels[1] = bad
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 50\)"):
        cross_entropy(logits, labels)


def test_unchecked_out_of_range_label_gives_nan_not_garbage(device):
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("Triton path only")
    logits, labels = make_inputs(3, 50, torch.float32, device, seed=11, n_ignored=0)
    labels[1] = 50
    loss = cross_entropy(logits, labels, reduction="none", check_labels=False)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()


def test_bad_inputs_raise(device):
    logits, labels = make_inputs(3, 10, torch.float32, device, seed=12)
    with pytest.raises(TypeError, match="logits"):
        cross_entropy(logits.long(), labels)
    with pytest.raises(TypeError, match="labels"):
        cross_entropy(logits, labels.float())
    with pytest.raises(ValueError, match="shape"):
        cross_entropy(logits, labels[:2])
    with pytest.raises(ValueError, match="empty"):
        cross_entropy(logits[:0], labels[:0])
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, labels, reduction="avg")
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy(logits, labels, softcap=0.0)
    with pytest.raises(TypeError, match="ignore_index"):
        cross_entropy(logits, labels, ignore_index=1.5)


def test_int32_labels(device):
    logits, labels = make_inputs(4, 33, torch.float32, device, seed=13)
    assert_close(cross_entropy(logits, labels.int()), F.cross_entropy(logits, labels))


@pytest.mark.cuda
def test_memory_at_gemma_vocab_cuda():
    """8192 x 256,000 bf16: forward + backward allocate no copy of the (N, V) logits."""
    n_rows, vocab, hidden_size = 8192, 256_000, 64
    torch.manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16) / 4
    labels = torch.randint(0, vocab, (n_rows,), device="cuda")
    labels[::7] = -100
    logits = hidden @ weight.t()  # (N, V), 4.2 GB
    ref = cross_entropy_reference(logits[:64].detach(), labels[:64], reduction="sum")

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    per_row = cross_entropy(logits, labels, reduction="none")
    per_row.sum().backward()
    end.record()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    fp32_copy = n_rows * vocab * 4
    print(
        f"\ncross_entropy 8192x256000 bf16: extra peak {extra / 2**20:.1f} MiB "
        f"(an fp32 copy of the logits is {fp32_copy / 2**20:.0f} MiB), "
        f"forward+backward incl. dh matmul {start.elapsed_time(end):.2f} ms"
    )
    assert extra < 0.05 * n_rows * vocab * 2  # not even a bf16 copy
    assert_close(per_row[:64].sum().detach(), ref, atol=1e-3, rtol=1e-4)
    assert torch.isfinite(hidden.grad).all()
