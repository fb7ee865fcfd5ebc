"""fused_linear_cross_entropy against the reference, F.cross_entropy(hidden @ W.T) and HF's loss."""

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from slothkit_kernels.fused_linear_cross_entropy import (
    default_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from slothkit_kernels.testing import assert_close, relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error (in norm) of the gradients against the reference, which rounds
# the logits gradient to the input dtype at a different point (before the 1/count).
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
LOSS_TOL = {"atol": 2e-5, "rtol": 2e-5}  # both compute the loss in fp32 from the same logits
# F.cross_entropy on fp16/bf16 logits rounds log_softmax to the input dtype.
TORCH_LOSS_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (3e-2, 1e-2)}
TORCH_GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

N, H, V = 37, 48, 1003


def make_inputs(n, h, v, dtype, device, seed, n_ignored=5, bias=False):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=gen) * 2 / h**0.5).to(dtype).to(device)
    lm_bias = torch.randn(v, generator=gen).to(dtype).to(device) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.randperm(n, generator=gen)[:n_ignored]] = -100
    return hidden, weight, lm_bias, labels.to(device)


def run(fn, hidden, weight, lm_bias, labels, grads=("hidden",), out_scale=1.0, **kwargs):
    """Loss and the gradients of the named inputs, for loss * out_scale."""
    tensors = {"hidden": hidden, "weight": weight, "bias": lm_bias}
    leaves = {
        name: (t.clone().requires_grad_(name in grads) if t is not None else None)
        for name, t in tensors.items()
    }
    loss = fn(leaves["hidden"], leaves["weight"], labels, lm_bias=leaves["bias"], **kwargs)
    (loss * out_scale).backward()
    return loss.detach(), {name: leaves[name].grad for name in grads}


def torch_baseline(hidden, weight, labels, lm_bias=None, softcap=None, reduction="mean", ignore_index=-100):
    """What the fused op replaces: logits in the input dtype, then F.cross_entropy."""
    logits = F.linear(hidden, weight, lm_bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap  # as Hugging Face's Gemma 2 does
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        reduction=reduction,
        ignore_index=ignore_index,
    ).float()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [8])  # five chunks, the last one short
def test_matches_reference_frozen_weight(chunk_size, dtype, softcap, reduction, device):
    inputs = make_inputs(N, H, V, dtype, device, seed=len(reduction) + chunk_size)
    kwargs = {"softcap": softcap, "reduction": reduction}
    loss, grads = run(fused_linear_cross_entropy, *inputs, chunk_size=chunk_size, **kwargs)
    ref_loss, ref_grads = run(fused_linear_cross_entropy_reference, *inputs, **kwargs)
    assert loss.dtype == torch.float32 and grads["hidden"].dtype == dtype
    assert_close(loss, ref_loss, **LOSS_TOL, msg="loss")
    assert relative_error(grads["hidden"], ref_grads["hidden"]) < GRAD_RTOL[dtype]


def test_one_row_chunks_and_one_chunk(device):
    inputs = make_inputs(N, H, V, torch.bfloat16, device, seed=19)
    ref_loss, ref_grads = run(fused_linear_cross_entropy_reference, *inputs, softcap=4.0)
    for chunk_size in (1, N, 1000):
        loss, grads = run(fused_linear_cross_entropy, *inputs, chunk_size=chunk_size, softcap=4.0)
        assert_close(loss, ref_loss, **LOSS_TOL, msg=f"loss, chunk_size={chunk_size}")
        assert relative_error(grads["hidden"], ref_grads["hidden"]) < GRAD_RTOL[torch.bfloat16]


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_cross_entropy(dtype, softcap, device):
    hidden, weight, _, labels = make_inputs(N, H, V, dtype, device, seed=20)
    loss, grads = run(
        fused_linear_cross_entropy, hidden, weight, None, labels, softcap=softcap, chunk_size=16
    )
    ref_loss, ref_grads = run(
        lambda h, w, y, lm_bias: torch_baseline(h, w, y, lm_bias, softcap=softcap),
        hidden,
        weight,
        None,
        labels,
    )
    atol, rtol = TORCH_LOSS_TOL[dtype]
    assert_close(loss, ref_loss, atol=atol, rtol=rtol, msg="loss")
    assert relative_error(grads["hidden"], ref_grads["hidden"]) < TORCH_GRAD_RTOL[dtype]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_trainable_weight_and_bias(dtype, reduction, device):
    inputs = make_inputs(N, H, V, dtype, device, seed=21, bias=True)
    names = ("hidden", "weight", "bias")
    loss, grads = run(
        fused_linear_cross_entropy, *inputs, grads=names, chunk_size=8, reduction=reduction, out_scale=0.5
    )
    ref_loss, ref_grads = run(
        fused_linear_cross_entropy_reference, *inputs, grads=names, reduction=reduction, out_scale=0.5
    )
    assert_close(loss, ref_loss, **LOSS_TOL, msg="loss")
    for name in names:
        assert grads[name].dtype == dtype
        assert relative_error(grads[name], ref_grads[name]) < GRAD_RTOL[dtype], name

    # ... and against F.cross_entropy on the full logits.
    torch_loss, torch_grads = run(
        lambda h, w, y, lm_bias: torch_baseline(h, w, y, lm_bias, reduction=reduction),
        *inputs,
        grads=names,
        out_scale=0.5,
    )
    atol, rtol = TORCH_LOSS_TOL[dtype]
    assert_close(loss, torch_loss, atol=atol * (N if reduction == "sum" else 1), rtol=rtol, msg="torch loss")
    for name in names:
        assert relative_error(grads[name], torch_grads[name]) < TORCH_GRAD_RTOL[dtype], name


def test_weight_grad_only(device):
    """A trainable head with frozen inputs (no hidden gradient requested)."""
    inputs = make_inputs(N, H, V, torch.float32, device, seed=22)
    _, grads = run(fused_linear_cross_entropy, *inputs, grads=("weight",), chunk_size=16, softcap=3.0)
    _, ref_grads = run(fused_linear_cross_entropy_reference, *inputs, grads=("weight",), softcap=3.0)
    assert relative_error(grads["weight"], ref_grads["weight"]) < 1e-5


@pytest.mark.parametrize("chunk_size", [5, 16, 64])
def test_mean_is_over_all_chunks(chunk_size, device):
    """Chunks with very different numbers of ignored labels: one global normaliser."""
    hidden, weight, _, labels = make_inputs(N, H, V, torch.float32, device, seed=23, n_ignored=0)
    labels[:20] = -100  # the first chunks are (almost) all ignored
    loss, grads = run(fused_linear_cross_entropy, hidden, weight, None, labels, chunk_size=chunk_size)
    ref_loss, ref_grads = run(
        lambda h, w, y, lm_bias: F.cross_entropy(h @ w.t(), y), hidden, weight, None, labels
    )
    assert_close(loss, ref_loss, **LOSS_TOL)
    assert relative_error(grads["hidden"], ref_grads["hidden"]) < 1e-5
    assert (grads["hidden"][:20] == 0).all()


@pytest.mark.parametrize("num_items", [17, 1000])
def test_num_items_in_batch_matches_hf(num_items, device):
    """Gradient accumulation: sum / num_items_in_batch, as HF's ForCausalLMLoss computes."""
    batch, seq = 3, 7
    hidden, weight, _, labels = make_inputs(batch * seq, H, V, torch.float32, device, seed=24)
    hidden, labels = hidden.reshape(batch, seq, H), labels.reshape(batch, seq)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # (B, T)

    for given in (num_items, torch.tensor(num_items, device=device)):
        loss, grads = run(
            fused_linear_cross_entropy, hidden, weight, None, shifted, chunk_size=4, num_items_in_batch=given
        )
        hf_loss, hf_grads = run(
            lambda h, w, y, lm_bias: ForCausalLMLoss(
                h @ w.t(), y, vocab_size=V, num_items_in_batch=torch.tensor(num_items)
            ),
            hidden,
            weight,
            None,
            labels,
        )
        assert_close(loss, hf_loss, **LOSS_TOL)
        assert grads["hidden"].shape == (batch, seq, H)
        assert relative_error(grads["hidden"], hf_grads["hidden"]) < 1e-5


def test_default_mean_matches_hf_causal_lm_loss(device):
    hidden, weight, _, labels = make_inputs(2 * 9, H, V, torch.bfloat16, device, seed=25)
    hidden, labels = hidden.reshape(2, 9, H), labels.reshape(2, 9)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    loss, grads = run(fused_linear_cross_entropy, hidden, weight, None, shifted)
    hf_loss, hf_grads = run(
        lambda h, w, y, lm_bias: ForCausalLMLoss(h @ w.t(), y, vocab_size=V), hidden, weight, None, labels
    )
    assert_close(loss, hf_loss, **LOSS_TOL)
    assert relative_error(grads["hidden"], hf_grads["hidden"]) < GRAD_RTOL[torch.bfloat16]


def test_all_labels_ignored_gives_zero_not_nan(device):
    hidden, weight, _, labels = make_inputs(6, H, 70, torch.float32, device, seed=26)
    labels[:] = -100
    for reduction in ("mean", "sum"):
        loss, grads = run(
            fused_linear_cross_entropy, hidden, weight, None, labels, chunk_size=4, reduction=reduction
        )
        assert loss == 0
        assert (grads["hidden"] == 0).all()


def test_custom_ignore_index_and_one_row(device):
    hidden, weight, _, labels = make_inputs(1, 5, 11, torch.float32, device, seed=27, n_ignored=0)
    loss, grads = run(fused_linear_cross_entropy, hidden, weight, None, labels, ignore_index=0)
    ref_loss, ref_grads = run(
        lambda h, w, y, lm_bias: F.cross_entropy(h @ w.t(), y, ignore_index=0), hidden, weight, None, labels
    )
    assert_close(loss, ref_loss, **LOSS_TOL)
    assert relative_error(grads["hidden"], ref_grads["hidden"]) < 1e-5


def test_backward_twice_and_no_grad(device):
    hidden, weight, _, labels = make_inputs(N, H, V, torch.float32, device, seed=28)
    x = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(x, weight, labels, chunk_size=8)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert relative_error(x.grad, 2 * first) < 1e-6
    with torch.no_grad():
        again = fused_linear_cross_entropy(x, weight, labels, chunk_size=8)
    assert not again.requires_grad
    assert_close(again, loss.detach())


def test_non_contiguous_hidden(device):
    hidden, weight, _, labels = make_inputs(N, H, V, torch.float32, device, seed=29)
    wide = torch.zeros(N, 2 * H, device=device)
    wide[:, 1::2] = hidden
    loss, grads = run(fused_linear_cross_entropy, wide[:, 1::2], weight, None, labels, chunk_size=8)
    ref_loss, ref_grads = run(fused_linear_cross_entropy_reference, hidden, weight, None, labels)
    assert_close(loss, ref_loss, **LOSS_TOL)
    assert relative_error(grads["hidden"], ref_grads["hidden"]) < 1e-5


def test_default_chunk_size():
    assert default_chunk_size(8192, 256_000) == 512  # 1/16 of the logits
    assert default_chunk_size(16384, 128_256) == 1024
    assert default_chunk_size(37, 1003) == 37  # small problems are not split
    assert default_chunk_size(1, 256_000) == 1
    for n, v in [(100_000, 1000), (3000, 50_000), (8191, 256_000)]:
        rows = default_chunk_size(n, v)
        assert 1 <= rows <= n and rows & (rows - 1) == 0


def test_bad_inputs_raise(device):
    hidden, weight, bias, labels = make_inputs(
        4, 8, 20, torch.float32, device, seed=30, n_ignored=0, bias=True
    )
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 20\)"):
        fused_linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 20, 3], device=device))
    with pytest.raises(ValueError, match="lm_weight"):
        fused_linear_cross_entropy(hidden, weight[:, :7], labels)
    with pytest.raises(ValueError, match="lm_bias"):
        fused_linear_cross_entropy(hidden, weight, labels, lm_bias=bias[:19])
    with pytest.raises(ValueError, match="labels must have shape"):
        fused_linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(TypeError, match="lm_weight"):
        fused_linear_cross_entropy(hidden, weight.half(), labels)
    with pytest.raises(TypeError, match="hidden"):
        fused_linear_cross_entropy(hidden.long(), weight, labels)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        fused_linear_cross_entropy(hidden, weight, labels, reduction="sum", num_items_in_batch=3)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="empty"):
        fused_linear_cross_entropy(hidden[:0], weight, labels[:0])


@pytest.mark.cuda
def test_memory_and_time_at_gemma_size_cuda():
    """8192 tokens x 256,000 vocab x 3072 hidden, bf16, frozen head.

    Targets: extra memory <= 10% and time <= 1.3x of F.cross_entropy(hidden @ W.T, labels).
    """
    n, v, h, dtype = 8192, 256_000, 3072, torch.bfloat16
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=dtype) / h**0.5
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::9] = -100

    def baseline():
        return F.cross_entropy(hidden @ weight.t(), labels)

    def fused():
        return fused_linear_cross_entropy(hidden, weight, labels)

    def measure(fn):
        hidden.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        result = (loss.detach().float(), hidden.grad.clone())
        times = []
        for _ in range(5):
            hidden.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn().backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return extra, sorted(times)[len(times) // 2], result

    fused()  # compile the kernels outside the measurement
    base_mem, base_ms, (base_loss, base_grad) = measure(baseline)
    ours_mem, ours_ms, (loss, grad) = measure(fused)
    print(
        f"\nfused_linear_cross_entropy {n}x{v}x{h} bf16, frozen head, forward+backward:\n"
        f"  F.cross_entropy(hidden @ W.T): {base_mem / 2**30:.2f} GiB extra, {base_ms:.1f} ms\n"
        f"  fused_linear_cross_entropy:    {ours_mem / 2**30:.2f} GiB extra, {ours_ms:.1f} ms\n"
        f"  memory ratio {ours_mem / base_mem:.3f} (target <= 0.10), time ratio {ours_ms / base_ms:.2f} (target <= 1.3)"
    )
    assert_close(loss, base_loss, atol=3e-2, rtol=1e-2, msg="loss")
    assert relative_error(grad, base_grad) < 3e-2
    assert ours_mem <= 0.10 * base_mem
    assert ours_ms <= 1.3 * base_ms
