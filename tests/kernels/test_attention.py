"""attention: tiled causal attention with soft-capping, masks, windows and sinks, against
an fp32 autograd reference and transformers' own eager attention (Gemma 2's, gpt-oss's)."""

import importlib

import pytest
import torch

from slothkit_kernels import utils
from slothkit_kernels.attention import attention, attention_reference

# The module, not the function the package exports under the same name.
attention_module = importlib.import_module("slothkit_kernels.attention")
KERNELS = ("forward", "backward_kv", "backward_q")
from slothkit_kernels.testing import relative_error

# (relative error of the output, of each gradient) against the fp32 reference.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.5e-2, 3e-2)}
LOWEST = torch.finfo(torch.float32).min


def _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    # q is a transposed (B, T, Hq, D) tensor, as the decoder layer hands it over.
    q = (torch.randn(batch, q_len, q_heads, head_dim, generator=gen) * 2).to(device, dtype).transpose(1, 2)
    k = (torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen) * 2).to(device, dtype)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(device, dtype)
    grad = torch.randn(batch, q_len, q_heads, head_dim, generator=gen).to(device, dtype)
    return q, k, v, grad


def _run(function, q, k, v, grad, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = function(*leaves, **options)
    out.backward(grad)
    return [out] + [t.grad for t in leaves]


def _gold(q, k, v, grad, mask=None, **options):
    """fp32 autograd through the reference, from the same (rounded) inputs."""
    q, k, v = (t.float() for t in (q, k, v))
    mask = mask.float() if mask is not None and mask.dtype != torch.bool else mask
    return _run(attention_reference, q, k, v, grad.float(), mask=mask, **options)


def _output_scale(outputs) -> float:
    """The size of the attention's output: the scale that rounding in dq is relative to."""
    return outputs[0].float().abs().max().item()


def _padding_mask(batch, q_len, kv_len, pads, dtype, device):
    """transformers' eager mask for left padding: batch row b's first pads[b] keys hidden."""
    visible = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    for row, pad in enumerate(pads):
        visible[row, :, :, :pad] = False
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min).to(device)


def _check(actual, expected, dtype):
    out_tol, grad_tol = TOLERANCE[dtype]
    for name, a, e, tol in zip(("out", "dq", "dk", "dv"), actual, expected, (out_tol,) + (grad_tol,) * 3):
        assert a.dtype == dtype and a.shape == e.shape, name
        if e.abs().max() == 0:  # one key: softmax is 1 whatever q is, so dq is zero
            assert a.float().abs().max() < 1e-3 * _output_scale(actual), name
            continue
        assert relative_error(a, e) < tol, f"{name}: relative error {relative_error(a, e):.2e} >= {tol}"


CASES = [
    # batch, q heads, kv heads, q_len, kv_len, head_dim, softcap, window
    (1, 1, 1, 1, 1, 16, None, None),
    (2, 4, 2, 37, 37, 24, 50.0, None),  # Gemma 2's cap; head_dim not a power of two
    (1, 4, 1, 70, 70, 32, 5.0, 16),  # a tight cap, several tiles past the window
    (2, 2, 2, 5, 40, 16, None, None),  # queries after 35 cached keys
    (1, 2, 1, 33, 48, 64, 30.0, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_attention_matches_the_reference(case, dtype, device):
    batch, q_heads, kv_heads, q_len, kv_len, head_dim, softcap, window = case
    q, k, v, grad = _inputs(
        batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, seed=sum(case[:6])
    )
    options = {"scaling": head_dim**-0.5, "softcap": softcap, "window": window}
    _check(_run(attention, q, k, v, grad, **options), _gold(q, k, v, grad, **options), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padding_mask_hides_keys_and_fully_hidden_rows_stay_exact(dtype, device):
    """Left padding: the first rows of a padded sequence see only hidden keys, which the
    mask's -3.4e38 then weighs alike (its size swamps the scores); the saved row maximum
    and log-sum keep those rows' backward exact too."""
    q, k, v, grad = _inputs(3, 4, 2, 20, 20, 16, dtype, device, seed=5)
    mask = _padding_mask(3, 20, 20, pads=(0, 3, 11), dtype=dtype, device=device)
    options = {"scaling": 0.25, "softcap": 20.0, "mask": mask}
    _check(_run(attention, q, k, v, grad, **options), _gold(q, k, v, grad, **options), dtype)
    boolean = mask == 0  # True where attended: the same attention
    same = _run(attention, q, k, v, grad, **{**options, "mask": boolean})
    for a, b in zip(same, _run(attention, q, k, v, grad, **options)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_packed_batch_attends_within_each_sequence(device):
    """Padding-free packing: a block-diagonal mask keeps three sequences apart, so each
    one's output and gradients equal those of the sequence run alone."""
    lengths = (7, 12, 9)
    total = sum(lengths)
    q, k, v, grad = _inputs(1, 2, 1, total, total, 16, torch.float32, device, seed=9)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    same = (segment[:, None] == segment[None, :]).to(device)
    packed = _run(attention, q, k, v, grad, scaling=0.25, softcap=50.0, mask=same[None, None])
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        alone = _run(
            attention,
            q[:, :, rows],
            k[:, :, rows],
            v[:, :, rows],
            grad[:, rows],
            scaling=0.25,
            softcap=50.0,
        )
        for name, whole, part in zip(("out", "dq", "dk", "dv"), packed, alone):
            piece = whole[:, rows] if name == "out" else whole[:, :, rows]
            torch.testing.assert_close(
                piece, part, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )
        start += length


@pytest.mark.parametrize("head_dim", [256, 96], ids=["width-256", "width-128-padded"])
def test_every_tuned_launch_computes_the_reference(head_dim, device, monkeypatch):
    """The launches chosen on a GPU with large shared memory (query tiles up to 128 rows
    over 32- or 64-row key tiles) tile uneven lengths, a window, a padding mask and grouped
    heads the way the small tiles do: the chooser is made to see an H200."""
    monkeypatch.setattr(attention_module, "_shared_memory", lambda device: 232448)
    tiles = {kernel: attention_module.tiles_for(kernel, head_dim, 150, 150, device) for kernel in KERNELS}
    assert tiles == dict(zip(KERNELS, attention_module._TUNED[attention_module._block_d(head_dim)]))
    q, k, v, grad = _inputs(2, 4, 2, 150, 150, head_dim, torch.float32, device, seed=head_dim)
    mask = _padding_mask(2, 150, 150, pads=(0, 70), dtype=torch.float32, device=device)
    options = {"scaling": head_dim**-0.5, "softcap": 30.0, "window": 90, "mask": mask}
    _check(_run(attention, q, k, v, grad, **options), _gold(q, k, v, grad, **options), torch.float32)


def test_launches_follow_the_gpu_shared_memory(monkeypatch):
    """Tuned launches only where a block has the shared memory they were measured with;
    64 KB (a T4) gets tiles that fit it; short sequences shrink the tiles, never below 16."""
    cuda = torch.device("cuda", 0)
    for memory, expected in ((232448, "tuned"), (65536, "small"), (166912, "small")):
        monkeypatch.setattr(attention_module, "_shared_memory", lambda device, memory=memory: memory)
        for head_dim in (256, 128):
            for index, kernel in enumerate(KERNELS):
                want = attention_module._TUNED[head_dim][index] if expected == "tuned" else None
                want = want or attention_module._small_tiles(head_dim, kernel)
                assert attention_module.tiles_for(kernel, head_dim, 4096, 4096, cuda) == want
    short = attention_module.tiles_for("forward", 256, 5, 9, cuda)
    assert (short.block_m, short.block_n) == (16, 16)
    # 64 KB holds the small forward tiles of a 256-wide head: q, k and v tiles in bf16.
    small = attention_module._small_tiles(256, "forward")
    assert (small.block_m + 2 * small.block_n * small.num_stages) * 256 * 2 <= 65536


def test_launches_shrink_until_they_fit(monkeypatch):
    """The tuned tiles assume 16-bit operands; fp32 ones (or a smaller GPU) can need more
    shared memory than a block has, which Triton reports as OutOfResources: the launch
    drops to one stage, then halves the taller tile until it fits, and gives up (raising)
    only at 16 x 16."""
    from triton.runtime.errors import OutOfResources

    launched = []

    class Kernel:  # stands in for a jit kernel: kernel[grid](*args, BLOCK_M=..., ...)
        def __init__(self, limit):
            self.limit = limit

        def __getitem__(self, grid):
            def launch(*args, BLOCK_M, BLOCK_N, num_stages, **options):
                need = (BLOCK_M + BLOCK_N) * num_stages
                if need > self.limit:
                    raise OutOfResources(need, self.limit, "shared memory")
                launched.append((grid, BLOCK_M, BLOCK_N, num_stages))

            return launch

    tuned = attention_module.Tiles(128, 64, 8, 2)
    grid = lambda t: (1024 // t.block_m,)  # noqa: E731
    attention_module._launch_fitting(Kernel(96), grid, tuned, 256, "q")
    assert launched == [((32,), 32, 64, 1)]  # (128, 64) in 2 stages -> 1 stage -> (64, 64) -> (32, 64)
    with pytest.raises(OutOfResources):
        attention_module._launch_fitting(Kernel(31), grid, tuned, 256, "q")


def test_gemma2_eager_attention_is_what_it_computes(device):
    """transformers' Gemma 2 eager attention (scores, cap, its own mask, fp32 softmax) on
    a sliding layer, forward and backward, with the mask and window the model builds.
    Rows whose every key is padding differ by design (eager weighs all 24 keys alike,
    the kernel the causal ones): they are padding's own outputs, whose gradient is zero
    in training, as here."""
    from transformers import Gemma2Config
    from transformers.models.gemma2 import modeling_gemma2

    config = Gemma2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16
    )
    module = modeling_gemma2.Gemma2Attention(config, layer_idx=0).to(device).train()
    q, k, v, grad = _inputs(2, 4, 2, 24, 24, 16, torch.float32, device, seed=3)
    window = 8
    position = torch.arange(24)
    visible = (position[None, :] <= position[:, None]) & (position[:, None] - position[None, :] < window)
    mask = torch.zeros(2, 1, 24, 24).masked_fill(~visible, LOWEST).to(device)
    mask[1, :, :, :4] = LOWEST  # and left padding on the second row

    def eager(q, k, v, **_):
        out, _ = modeling_gemma2.eager_attention_forward(
            module,
            q,
            k,
            v,
            mask,
            dropout=0.0,
            scaling=module.scaling,
            softcap=config.attn_logit_softcapping,
        )
        return out

    grad[1, :4] = 0.0  # padding rows reach no loss
    ours = _run(attention, q, k, v, grad, scaling=module.scaling, softcap=50.0, window=window, mask=mask)
    theirs = _run(eager, q, k, v, grad)
    for output in (ours, theirs):
        output[0][1, :4] = 0.0
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_bad_inputs_are_named(device):
    q, k, v, _ = _inputs(1, 4, 2, 8, 8, 16, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match="not a multiple"):
        attention(q[:, :3], k, v, scaling=1.0)
    with pytest.raises(ValueError, match="only 4 keys"):
        attention(q, k[:, :, :4], v[:, :, :4], scaling=1.0)
    with pytest.raises(ValueError, match="softcap"):
        attention(q, k, v, scaling=1.0, softcap=0.0)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, scaling=1.0, window=0)
    with pytest.raises(ValueError, match="mask must be"):
        attention(q, k, v, scaling=1.0, mask=torch.zeros(1, 1, 8, 4, device=device))
    with pytest.raises(TypeError, match="share a dtype"):
        attention(q, k.half(), v.half(), scaling=1.0)


def test_without_triton_the_reference_runs_and_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    utils.warn_reference_once.cache_clear()
    q, k, v, _ = _inputs(1, 2, 1, 6, 6, 16, torch.float32, "cpu", seed=1)
    with pytest.warns(UserWarning, match="slothkit_kernels.attention: no Triton backend"):
        out = attention(q, k, v, scaling=0.25, softcap=10.0)
    torch.testing.assert_close(out, attention_reference(q, k, v, 0.25, softcap=10.0))


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 1024], ids=["global", "sliding"])
def test_gemma2_9b_layer_shape_on_the_gpu(window):
    """Gemma-2-9B's layer at 2 x 2048 in bf16: 16 query heads over 8 key heads of 256 (the
    widest tiles), a cap of 50, its sliding window scaled to the length."""
    q, k, v, grad = _inputs(2, 16, 8, 2048, 2048, 256, torch.bfloat16, "cuda", seed=11)
    options = {"scaling": 256**-0.5, "softcap": 50.0, "window": window}
    _check(_run(attention, q, k, v, grad, **options), _gold(q, k, v, grad, **options), torch.bfloat16)


def _sinks(heads, device, seed, dtype=torch.float32):
    """Sink logits of the scores' size (order one), so each head's sink takes a visible
    share of every row: rows of few keys most, long rows less."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 1.5).to(device, dtype)


def _run_with_sinks(function, q, k, v, sinks, grad, **options):
    """(out, dq, dk, dv, dsinks) of ``function`` with trainable sinks."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out = function(*leaves[:3], sinks=leaves[3], **options)
    out.backward(grad)
    return [out] + [t.grad for t in leaves]


def _score_gradient_scales(q, k, v, sinks, grad, scaling, window=None, mask=None) -> dict:
    """The norms of dq and dk with every term P_ij (dP_ij - D_i) taken at its size,
    P_ij (|dP_ij| + |D_i|), in float64: the sizes the fp32 terms are rounded at."""
    q, k, v, grad = (t.detach().double() for t in (q, k, v, grad))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    visible = attention_module._visible_keys(q.shape[2], k.shape[2], window, q.device).double()
    scores = (q @ k.transpose(-1, -2)) * scaling + visible
    if mask is not None:
        scores = scores + mask.double()
    batch, heads, q_len, _ = scores.shape
    column = sinks.double().reshape(1, heads, 1, 1).expand(batch, heads, q_len, 1)
    p = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    g = grad.transpose(1, 2)  # (B, Hq, T, D)
    dp = g @ v.transpose(-1, -2)
    delta = (p * dp).sum(-1, keepdim=True)
    terms = p * (dp.abs() + delta.abs())  # (B, Hq, T, S)
    dq = scaling * terms @ k.abs()
    dk = scaling * (terms.transpose(-1, -2) @ q.abs()).unflatten(1, (-1, group)).sum(2)
    return {"dq": dq.norm().item(), "dk": dk.norm().item()}


SINK_CASES = [
    # batch, q heads, kv heads, q_len, kv_len, head_dim, window, padding of each batch row
    (1, 2, 2, 1, 1, 16, None, None),  # one key: the sink is the row's only rival
    (2, 4, 2, 37, 37, 16, None, None),  # grouped heads, several tiles
    (2, 4, 1, 40, 40, 24, 8, None),  # gpt-oss's sliding layers: a window, head_dim padded
    (2, 4, 2, 20, 20, 16, 6, (0, 7)),  # left padding on the second row under a window
    (1, 2, 1, 5, 30, 16, None, None),  # queries after 25 cached keys
]


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: "x".join(map(str, c[:7])) + f"-pad{c[7]}")
def test_sinks_match_the_reference(case, device):
    """Every row's softmax gains its head's sink: the output and all four gradients (q, k,
    v and the sinks, summed over batch rows and queries) equal fp32 autograd through the
    reference, with and without a window, grouped heads, padding and cached keys."""
    batch, q_heads, kv_heads, q_len, kv_len, head_dim, window, pads = case
    q, k, v, grad = _inputs(
        batch, q_heads, kv_heads, q_len, kv_len, head_dim, torch.float32, device, seed=q_len
    )
    sinks = _sinks(q_heads, device, seed=kv_len)
    options = {"scaling": head_dim**-0.5, "window": window}
    if pads is not None:
        options["mask"] = _padding_mask(batch, q_len, kv_len, pads, torch.float32, device)
    ours = _run_with_sinks(attention, q, k, v, sinks, grad, **options)
    gold = _run_with_sinks(attention_reference, q, k, v, sinks, grad, **options)
    scales = _score_gradient_scales(q, k, v, sinks, grad, **options)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dsinks"), ours, gold):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        # dq and dk are sums of P_ij (dP_ij - D_i) terms, rounded to fp32 before they cancel
        # (they cancel most where a sink leaves a row's keys almost all the weight): bounded
        # by the rounding of the terms' sizes, not of their sum.
        scale = max(e.norm().item(), scales.get(name, 0.0))
        error = (a - e).norm().item()
        assert error < 1e-5 * scale, f"{name}: error {error:.2e} >= 1e-5 x {scale:.2e}"
    assert relative_error(attention(q, k, v, **options), ours[0]) > 1e-2  # the sinks count here


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sinks_in_16_bits(dtype, device):
    """16-bit q, k, v with fp32 sinks (a model's parameters may be of either dtype): each
    result within the dtype's rounding of fp32 autograd through the reference."""
    q, k, v, grad = _inputs(2, 4, 2, 33, 33, 16, dtype, device, seed=12)
    sinks = _sinks(4, device, seed=13)
    options = {"scaling": 0.25, "window": 9}
    ours = _run_with_sinks(attention, q, k, v, sinks, grad, **options)
    gold = _run_with_sinks(
        attention_reference, *(t.float() for t in (q, k, v)), sinks, grad.float(), **options
    )
    out_tol, grad_tol = TOLERANCE[dtype]
    for name, a, e, tol in zip(("out", "dq", "dk", "dv", "dsinks"), ours, gold, (out_tol,) + (grad_tol,) * 4):
        assert a.dtype == (torch.float32 if name == "dsinks" else dtype), name
        assert relative_error(a, e) < tol, f"{name}: relative error {relative_error(a, e):.2e} >= {tol}"


def test_sinks_gradient_keeps_their_dtype_and_frozen_sinks_get_none(device):
    """bfloat16 sinks on fp32 attention get a bfloat16 gradient equal to the fp32 one
    rounded; sinks that do not require a gradient (frozen under LoRA) get none while q, k
    and v still get theirs."""
    q, k, v, grad = _inputs(1, 2, 1, 18, 18, 16, torch.float32, device, seed=21)
    sinks = _sinks(2, device, seed=22, dtype=torch.bfloat16)
    ours = _run_with_sinks(attention, q, k, v, sinks, grad, scaling=0.25)
    gold = _run_with_sinks(attention_reference, q, k, v, sinks.float(), grad, scaling=0.25)
    assert ours[4].dtype == torch.bfloat16
    torch.testing.assert_close(ours[4].float(), gold[4].bfloat16().float(), rtol=1e-2, atol=0)
    frozen = _run(lambda *t, **o: attention(*t, sinks=sinks, **o), q, k, v, grad, scaling=0.25)
    for a, b in zip(frozen, ours[:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gpt_oss_eager_attention_is_what_it_computes(device):
    """transformers' gpt-oss eager attention (the sink as an extra score column, dropped
    after the softmax) on a sliding layer with the mask the model builds, forward and every
    gradient, the sinks' included. Padding rows differ by design, as for Gemma 2."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss import modeling_gpt_oss

    config = GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2
    )
    module = modeling_gpt_oss.GptOssAttention(config, layer_idx=0).to(device).train()
    q, k, v, grad = _inputs(2, 4, 2, 24, 24, 16, torch.float32, device, seed=7)
    sinks = _sinks(4, device, seed=8)
    window = 8
    position = torch.arange(24)
    visible = (position[None, :] <= position[:, None]) & (position[:, None] - position[None, :] < window)
    mask = torch.zeros(2, 1, 24, 24).masked_fill(~visible, LOWEST).to(device)
    mask[1, :, :, :4] = LOWEST  # and left padding on the second row

    def eager(q, k, v, sinks, **_):
        module.sinks = torch.nn.Parameter(sinks)  # the leaf the gradient is read from
        out, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=module.scaling)
        grads.append(module.sinks)
        return out

    grads = []
    grad[1, :4] = 0.0  # padding rows reach no loss
    ours = _run_with_sinks(attention, q, k, v, sinks, grad, scaling=module.scaling, window=window, mask=mask)
    theirs = _run_with_sinks(eager, q, k, v, sinks, grad)
    theirs[4] = grads[0].grad
    for output in (ours, theirs):
        output[0][1, :4] = 0.0
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_bad_sinks_are_named(device):
    q, k, v, _ = _inputs(1, 4, 2, 8, 8, 16, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
        attention(q, k, v, scaling=1.0, sinks=torch.zeros(2, device=device))
    with pytest.raises(TypeError, match="sinks has dtype torch.int64"):
        attention(q, k, v, scaling=1.0, sinks=torch.zeros(4, dtype=torch.long, device=device))


def test_without_triton_the_reference_applies_the_sinks(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    utils.warn_reference_once.cache_clear()
    q, k, v, _ = _inputs(1, 2, 1, 6, 6, 16, torch.float32, "cpu", seed=1)
    sinks = _sinks(2, "cpu", seed=2)
    with pytest.warns(UserWarning, match="no Triton backend"):
        out = attention(q, k, v, scaling=0.25, sinks=sinks)
    torch.testing.assert_close(out, attention_reference(q, k, v, 0.25, sinks=sinks))
    assert (out - attention_reference(q, k, v, 0.25)).abs().max() > 1e-2  # the sinks count


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 128], ids=["full", "sliding"])
def test_gpt_oss_layer_shape_on_the_gpu(window):
    """gpt-oss's layer at 2 x 2048 in bf16: 64 query heads over 8 key heads of 64, its
    sinks, alternately full and sliding over 128 positions."""
    q, k, v, grad = _inputs(2, 64, 8, 2048, 2048, 64, torch.bfloat16, "cuda", seed=17)
    sinks = _sinks(64, "cuda", seed=18, dtype=torch.bfloat16)
    options = {"scaling": 64**-0.5, "window": window}
    ours = _run_with_sinks(attention, q, k, v, sinks, grad, **options)
    gold = _run_with_sinks(
        attention_reference, *(t.float() for t in (q, k, v, sinks)), grad.float(), **options
    )
    out_tol, grad_tol = TOLERANCE[torch.bfloat16]
    for name, a, e, tol in zip(("out", "dq", "dk", "dv", "dsinks"), ours, gold, (out_tol,) + (grad_tol,) * 4):
        assert relative_error(a, e) < tol, f"{name}: relative error {relative_error(a, e):.2e} >= {tol}"
