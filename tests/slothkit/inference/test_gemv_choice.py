"""The per-shape choice between a library's path (cuBLAS's GEMV, or bitsandbytes' for an
NF4 weight, then addmm_ for the adapter) and slothkit's kernel (lora_gemv, nf4_lora_gemv):
the fastest candidate whose output agrees, only past MIN_GAIN, nothing timed during
graph capture or off the GPU, and the NF4 baseline timed on copies of the codes computing
what the layer computes.  The timings are replaced by given figures; the outputs are
computed (the kernels under the Triton interpreter)."""

import bitsandbytes as bnb
import pytest
import torch

from slothkit.engine.lora_projection import base_weight
from slothkit.inference import gemv_choice
from slothkit.inference.decode_projections import _nf4_base_output
from slothkit_kernels.lora.gemv import CANDIDATES, lora_gemv
from slothkit_kernels.nf4 import dequantize_nf4_reference
from slothkit_kernels.nf4.gemv import CANDIDATES as NF4_CANDIDATES
from slothkit_kernels.nf4.gemv import nf4_lora_gemv


def _seed() -> int:
    return int(torch.randint(0, 2**31, ()))


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(2, 64, generator=generator)
    weight = torch.randn(24, 64, generator=generator) / 8
    xa = torch.randn(2, 4, generator=generator)
    lora_b = torch.randn(24, 4, generator=generator) / 10
    return rows, weight, None, xa, lora_b, 2.0


def _dense_paths(seed: int, kernel=lora_gemv):
    """_decide's arguments for a 16-bit projection, as gemv_candidate builds them."""
    rows, weight, bias, xa, lora_b, scaling = _inputs(seed)
    return (
        lambda w: gemv_choice.cublas_path(rows, w, bias, xa, lora_b, scaling),
        lambda c, w: kernel(rows, w, bias, xa, lora_b, scaling, candidate=c),
        range(len(CANDIDATES)),
        [weight],
        rows.dtype,
    )


def _timings(monkeypatch, baseline_ms: float, kernel_ms: dict):
    """_graph_ms answers the baseline's figure first, then each candidate's in order."""
    answers = iter([baseline_ms, *(kernel_ms.get(c, 1.0) for c in range(len(CANDIDATES)))])
    monkeypatch.setattr(gemv_choice, "_graph_ms", lambda call, copies: next(answers))


def test_the_fastest_agreeing_candidate_is_kept_when_it_gains_enough(monkeypatch):
    _timings(monkeypatch, 1.0, {0: 0.9, 1: 0.6, 2: 0.7})
    decision = gemv_choice._decide(*_dense_paths(_seed()))
    assert decision["candidate"] == 1 and decision["kernel_ms"] == 0.6 and decision["baseline_ms"] == 1.0
    assert decision["candidates_ms"] == {
        c: {0: 0.9, 1: 0.6, 2: 0.7}.get(c, 1.0) for c in range(len(CANDIDATES))
    }


def test_the_library_is_kept_when_the_kernel_gains_less_than_min_gain(monkeypatch):
    _timings(monkeypatch, 1.0, {c: 1.0 - gemv_choice.MIN_GAIN / 2 for c in range(5)})
    decision = gemv_choice._decide(*_dense_paths(_seed()))
    assert "candidate" not in decision and decision["kernel_ms"] < 1.0


def test_a_candidate_that_disagrees_or_fails_is_never_chosen(monkeypatch):
    def faulty(rows, weight, bias, xa, lora_b, scaling, candidate=0):
        if candidate == 0:
            return lora_gemv(rows, weight, bias, xa, lora_b, scaling, candidate=candidate) * 1.5  # wrong
        if candidate == 1:
            raise RuntimeError("out of shared memory")
        return lora_gemv(rows, weight, bias, xa, lora_b, scaling, candidate=candidate)

    # the baseline, then every candidate but the two faulty ones (a spare answer would be a bug)
    timed = iter([1.0] + [0.5] * (len(CANDIDATES) - 2))
    monkeypatch.setattr(gemv_choice, "_graph_ms", lambda call, copies: next(timed))
    decision = gemv_choice._decide(*_dense_paths(_seed(), kernel=faulty))
    assert decision["candidate"] == 2
    assert decision["dropped"][0].startswith("relative error ")  # the record says why
    assert decision["dropped"][1] == "RuntimeError: out of shared memory"
    assert set(decision["dropped"]) == {0, 1}
    assert next(timed, None) is None  # every agreeing candidate was timed


def _nf4_layer(rows_out: int, width: int, seed: int):
    """A bitsandbytes NF4 layer (quantised on the CPU, computing in fp32) and its record."""
    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(width, rows_out, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.load_state_dict(
        {"weight": torch.randn(rows_out, width) / width**0.5, "bias": torch.randn(rows_out)}
    )
    layer = layer.to("cpu").eval()  # quantised when moved
    return layer, base_weight(layer)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_nf4_baseline_computes_what_the_layer_does_from_a_copy_of_its_codes(
    rows, bitsandbytes_repacks_on_cpu
):
    """One row: bitsandbytes' matmul_4bit (its GEMV on a GPU); more: slothkit's
    dequantisation and F.linear; either read from a copy of the codes gives the layer's
    output, so timing cycles through copies without changing what is timed."""
    from slothkit.engine.nf4_layout import keep_nf4_layout

    layer, weight = _nf4_layer(32, 128, _seed())
    keep_nf4_layout(layer)
    x = torch.randn(rows, 128)
    copy = weight.with_packed(weight.packed.clone())
    assert copy.packed.data_ptr() != weight.packed.data_ptr()
    with torch.no_grad():
        expected = layer(x)
        for read in (weight, copy):
            torch.testing.assert_close(
                _nf4_base_output(layer, x, read, layer.bias), expected, rtol=1e-6, atol=1e-6
            )


def test_an_nf4_candidate_is_chosen_only_where_it_agrees_with_bitsandbytes(monkeypatch):
    layer, weight = _nf4_layer(40, 128, _seed())
    generator = torch.Generator().manual_seed(_seed())
    x, xa = torch.randn(2, 128, generator=generator), torch.randn(2, 4, generator=generator)
    lora_b = torch.randn(40, 4, generator=generator) / 10

    def base(w):  # the dequantised product (what _nf4_base_output gives for two rows)
        return x @ dequantize_nf4_reference(w).t() + layer.bias

    def kernel(candidate, w):
        got = nf4_lora_gemv(x, w, layer.bias.data, xa, lora_b, 0.5, candidate=candidate)
        return got * 1.5 if candidate == 0 else got  # candidate 0 disagrees

    # bitsandbytes' path, then candidates 1, 2, ... (candidate 0 agrees with nothing: untimed;
    # the tensor-core ones refuse an fp32 weight: not candidates either)
    cuda_cores = {c for c, tile in enumerate(NF4_CANDIDATES) if tile[4] == "cuda cores"}
    timed = iter([1.0, 0.9, 0.5] + [0.8] * (len(cuda_cores) - 3))
    monkeypatch.setattr(gemv_choice, "_graph_ms", lambda call, copies: next(timed))
    decision = gemv_choice._decide(
        lambda w: gemv_choice.with_adapter(base(w), xa, lora_b, 0.5),
        kernel,
        range(len(NF4_CANDIDATES)),
        [weight],
        torch.float32,
    )
    assert decision["candidate"] == 2 and decision["kernel_ms"] == 0.5
    assert set(decision["candidates_ms"]) == cuda_cores - {0}
    assert next(timed, None) is None


def test_nothing_is_timed_off_the_gpu_or_for_too_many_rows():
    # The table is process-wide: on a GPU, decode tests before this one have filled it.
    before = gemv_choice.choices()
    rows, weight, bias, xa, lora_b, scaling = _inputs(0)
    assert gemv_choice.gemv_candidate(rows, weight, bias, xa, lora_b, scaling) is None
    _, nf4_weight = _nf4_layer(24, 64, 0)
    assert gemv_choice.nf4_gemv_candidate(rows, nf4_weight, bias, xa, lora_b, scaling, base=None) is None
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
    listed = [
        c for c in gemv_choice.choices() if (c["weight"], c["rows"], c["out_features"]) == ("16-bit", 2, 24)
    ]
    assert len(listed) == 1 and listed[0]["runs"] == ("cublas" if first is None else "lora_gemv")


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 4])
def test_nf4_choices_on_the_gpu_run_what_they_timed(rows):
    """On a GPU: the NF4 decision for a Linear4bit layer, and the chosen path's output
    within bf16 rounding of the layer's own."""
    layer = bnb.nn.Linear4bit(512, 96, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer = layer.to(torch.bfloat16).cuda().eval()
    weight = base_weight(layer)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        candidate = gemv_choice.nf4_gemv_candidate(
            x, weight, None, None, None, 1.0, lambda w: _nf4_base_output(layer, x, w, None)
        )
        expected = layer(x)
        got = expected if candidate is None else nf4_lora_gemv(x, weight, candidate=candidate)
    assert gemv_choice._relative_error(got, expected) < gemv_choice.TOLERANCE[torch.bfloat16]
    listed = [
        c for c in gemv_choice.choices() if (c["weight"], c["rows"], c["out_features"]) == ("nf4", rows, 96)
    ]
    assert len(listed) == 1 and listed[0]["runs"] == (
        "bitsandbytes" if candidate is None else "nf4_lora_gemv"
    )


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_a_chosen_ptx_lookup_is_made_outside_capture_and_skipped_inside_it(monkeypatch, tensor_cores):
    """A record that reaches a decided shape during graph capture before its lookup was
    made (it needs a host read of the levels) takes bitsandbytes' path there; outside
    capture the lookup is made for it, at the width its candidate needs."""
    _, weight = _nf4_layer(40, 128, _seed())
    candidate = next(
        c for c, tile in enumerate(NF4_CANDIDATES) if (tile[4] == "tensor cores") == tensor_cores
    )
    monkeypatch.setattr(gemv_choice, "_considered", lambda rows: True)
    monkeypatch.setattr(gemv_choice, "_usable", lambda tiles, uses_tensor_cores, device: range(len(tiles)))
    monkeypatch.setattr(gemv_choice, "_choose", lambda *args: candidate)
    capturing = {"now": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    x = torch.zeros(1, 128)

    def choose():
        return gemv_choice.nf4_gemv_candidate(x, weight, None, None, None, 1.0, base=None)

    assert weight.level_sources is None and choose() is None  # in capture, not made: bitsandbytes
    capturing["now"] = False
    assert choose() == candidate  # outside: made here
    width, lookup = (16, "registers") if tensor_cores else (32, "shuffle")  # nf4_gemv.candidate_lookup's
    assert set(weight.level_sources) == {(lookup, width), "levels"}  # the levels read once
    capturing["now"] = True
    assert choose() == candidate  # made before: the kernel runs in the graph too


@pytest.mark.parametrize(
    "capability, expected", [((7, 5), "cuda cores only"), ((8, 0), "all"), ((9, 0), "all")]
)
def test_tensor_core_tiles_are_timed_only_where_triton_makes_tensor_core_products(
    monkeypatch, capability, expected
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for tiles, uses_tensor_cores in [
        (CANDIDATES, lambda tile: tile[4]),
        (NF4_CANDIDATES, lambda tile: tile[4] == "tensor cores"),
    ]:
        usable = gemv_choice._usable(tiles, uses_tensor_cores, "cuda:0")
        cuda_cores = [c for c, tile in enumerate(tiles) if not uses_tensor_cores(tile)]
        assert usable == (cuda_cores if expected == "cuda cores only" else list(range(len(tiles))))
        assert len(cuda_cores) < len(tiles)  # both kinds exist, so the two answers differ


def _assert_group_listed_once(kind: str, rows: int, candidate, kernel: str) -> None:
    """The group decision of ``kind`` for 1024 + 256 + 256 output rows is listed once, runs
    what was chosen, and some candidate ran and agreed."""
    listed = [
        c
        for c in gemv_choice.choices()
        if (c["weight"], c["rows"], c["out_features"]) == (kind, rows, "1024+256+256")
    ]
    assert len(listed) == 1 and listed[0]["runs"] == ("separate launches" if candidate is None else kernel)
    assert listed[0]["candidates_ms"], listed[0].get("dropped")


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8])
def test_group_choices_on_the_gpu_run_what_they_timed(rows):
    """On a GPU: the decision for q, k and v of a Llama-like layer read together, listed
    once, and the chosen path's outputs within bf16 rounding of each projection apart."""
    from slothkit_kernels.lora.gemv_group import lora_gemv_group

    generator = torch.Generator().manual_seed(_seed())
    widths, k, rank = (1024, 256, 256), 1024, 8

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to("cuda", torch.bfloat16)

    x = randn(rows, k)
    weights = [randn(n, k, scale=k**-0.5) for n in widths]
    lora_bs = [randn(n, rank, scale=0.05) for n in widths]
    xa = randn(rows, rank * len(widths))
    scalings = [2.0, 1.0, 0.5]
    candidate = gemv_choice.group_gemv_candidate(x, weights, None, xa, lora_bs, scalings)
    xas = xa.split(rank, dim=1)
    expected = [
        gemv_choice.cublas_path(x, w, None, a, b, s) for w, a, b, s in zip(weights, xas, lora_bs, scalings)
    ]
    if candidate is not None:
        got = lora_gemv_group(x, weights, None, xa, lora_bs, scalings, candidate=candidate)
        assert gemv_choice._relative_error(got, expected) < gemv_choice.TOLERANCE[torch.bfloat16]
    _assert_group_listed_once("16-bit group", rows, candidate, "lora_gemv_group")


def test_a_group_times_the_tiles_fastest_for_its_projections(monkeypatch):
    """The group's candidates are the PROMISING fastest of each member's own decision
    (here given), not every tile again."""
    monkeypatch.setattr(gemv_choice, "_considered", lambda rows: True)
    monkeypatch.setattr(
        gemv_choice, "_usable", lambda tiles, uses_tensor_cores, device: list(range(len(tiles)))
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gemv_choice, "_choices", {})
    monkeypatch.setattr(gemv_choice, "_copies", lambda first, nbytes, clone, device: [first])
    rows, weight, bias, xa, lora_b, scaling = _inputs(_seed())
    narrow = weight[:8].contiguous()
    members = {  # shape -> candidates_ms
        weight.shape: {0: 0.5, 3: 0.2, 4: 0.3, 7: 0.4, 9: 0.9},
        narrow.shape: {1: 0.1, 3: 0.2, 12: 0.3, 6: 0.8},
    }
    for w in (weight, narrow):
        gemv_choice._choices[gemv_choice._dense_key(rows, w, None, xa)] = {
            "baseline_ms": 1.0,
            "candidates_ms": members[w.shape],
        }
    given = []
    monkeypatch.setattr(
        gemv_choice,
        "_decide",
        lambda baseline, kernel, candidates, copies, dtype: given.append(candidates) or {},
    )
    lora_bs = [lora_b, lora_b[:8].contiguous()]
    xa_both = torch.cat([xa, xa], dim=1)
    assert (
        gemv_choice.group_gemv_candidate(rows, [weight, narrow], None, xa_both, lora_bs, [1.0, 2.0]) is None
    )
    assert given == [[1, 3, 4, 7, 12]]


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8])
def test_nf4_group_choices_on_the_gpu_run_what_they_timed(rows):
    """On a GPU: the decision for three Linear4bit layers read together, listed once, and
    the chosen path's outputs within bf16 rounding of each layer's own."""
    from slothkit_kernels.nf4.gemv_group import nf4_lora_gemv_group

    torch.manual_seed(_seed())
    layers = [
        bnb.nn.Linear4bit(1024, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        .to(torch.bfloat16)
        .cuda()
        .eval()
        for n in (1024, 256, 256)
    ]
    weights = [base_weight(layer) for layer in layers]
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    bases = [lambda w, layer=layer: _nf4_base_output(layer, x, w, None) for layer in layers]
    with torch.no_grad():
        candidate = gemv_choice.nf4_group_gemv_candidate(x, weights, None, None, None, None, bases)
        expected = [layer(x) for layer in layers]
        if candidate is not None:
            got = nf4_lora_gemv_group(x, weights, candidate=candidate)
            assert gemv_choice._relative_error(got, expected) < gemv_choice.TOLERANCE[torch.bfloat16]
    _assert_group_listed_once("nf4 group", rows, candidate, "nf4_lora_gemv_group")
