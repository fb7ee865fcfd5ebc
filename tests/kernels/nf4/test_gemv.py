"""nf4_lora_gemv against the fp32 product of bitsandbytes' dequantised weight, on fresh
weights quantised by bitsandbytes: one to eight rows, with and without an adapter and a
bias, nested and plain block scales, every tile candidate, fp32 / fp16 / bf16."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import bitsandbytes.functional as bnbf
import pytest
import torch
import triton

from slothkit_kernels import split_k
from slothkit_kernels.lora.gemv import lora_gemv_reference
from slothkit_kernels.nf4 import level_lookup
from slothkit_kernels.nf4.gemv import (
    CANDIDATES,
    LOOKUPS,
    has_level_source,
    level_source,
    nf4_lora_gemv,
    nf4_lora_gemv_reference,
    steps,
    supports,
    tile,
)
from slothkit_kernels.nf4.weight import NF4Weight
from slothkit_kernels.testing import relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both sides form the same weights and accumulate in fp32, rounding once: fp16/bf16
# outputs differ by that rounding and the order of the additions.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _seed() -> int:
    return int(torch.randint(0, 2**31, ()))


def _quantized(n, k, dtype, nested, blocksize, device, generator):
    """A random (n, k) weight quantised to NF4 by bitsandbytes (on the CPU), as a record on
    ``device``, and the weight bitsandbytes dequantises it to."""
    w = (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype)
    packed, state = bnbf.quantize_4bit(
        w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4", quant_storage=torch.uint8
    )
    dequantized = bnbf.dequantize_4bit(packed, state, quant_type="nf4").reshape(n, k)
    state.to(device)
    return NF4Weight.from_bitsandbytes(packed.to(device), state), dequantized.to(device)


def _activations(rows, n, k, rank, dtype, device, bias, generator):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    xa = None if rank == 0 else randn(rows, rank)
    lora_b = None if rank == 0 else randn(n, rank, scale=0.05)
    return randn(rows, k), (randn(n) if bias else None), xa, lora_b


ROWS = [1, 3, 8]
CASES = [(16, False, True), (8, True, False), (0, False, False), (0, True, True)]  # rank, bias, nested


def _candidates(device, case: int, dtype) -> list[int]:
    """A rotating few candidates per case (every one of them over the cases): five on a
    GPU, two under the interpreter.  Each (candidate, tile, dtype, epilogue) compiles on
    its own, and all of them in every case would take a fresh GPU machine most of its
    ten minutes.  Tensor-core candidates multiply in 16 bits: none for fp32."""
    usable = [c for c in range(len(CANDIDATES)) if dtype != torch.float32 or not _tensor_cores(c)]
    count = 5 if device == "cuda" else 2
    return sorted({usable[(case + i * len(usable) // count) % len(usable)] for i in range(count)})


def _tensor_cores(candidate: int) -> bool:
    return CANDIDATES[candidate][4] == "tensor cores"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("rank, bias, nested", CASES)
def test_nf4_lora_gemv_matches_the_dequantised_product(rows, rank, bias, nested, dtype, device):
    generator = torch.Generator().manual_seed(_seed())
    # N = 72 is no multiple of any BLOCK_N (masks); 72 x 256 / 64 = 288 block scales make
    # two groups of nested scales, the second short.
    weight, dequantized = _quantized(72, 256, dtype, nested, 64, device, generator)
    x, b, xa, lora_b = _activations(rows, 72, 256, rank, dtype, device, bias, generator)
    scaling = float(torch.rand((), generator=generator)) * 2
    expected = lora_gemv_reference(x, dequantized, b, xa, lora_b, scaling)
    case = (DTYPES.index(dtype) * len(ROWS) + ROWS.index(rows)) * len(CASES) + CASES.index(
        (rank, bias, nested)
    )
    # The interpreter runs no PTX: it reads the table whichever lookup is asked for.  On a
    # GPU the two lookups in registers take turns (permutes, shuffles), and the table (the
    # slower one, kept for comparison) joins in every third case.
    lookups = ("registers",)
    if device == "cuda":
        lookups = (("registers", "shuffle")[case % 2],) + (("table",) if case % 3 == 0 else ())
    for lookup in lookups:
        for candidate in _candidates(device, case, dtype):
            got = nf4_lora_gemv(x, weight, b, xa, lora_b, scaling, candidate=candidate, lookup=lookup)
            assert got.dtype == dtype and got.shape == (rows, 72)
            assert relative_error(got, expected) < TOLERANCE[dtype], (CANDIDATES[candidate], lookup)
    reference = nf4_lora_gemv_reference(x, weight, b, xa, lora_b, scaling)
    assert relative_error(reference, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("blocksize", [32, 128, 256])
def test_other_blocksizes_keep_each_step_within_a_block(blocksize, device):
    """BLOCK_K is capped at the block: a 32-wide block gives 32-wide steps, a 256-wide
    block several steps per block."""
    generator = torch.Generator().manual_seed(_seed())
    weight, dequantized = _quantized(40, 512, torch.float32, True, blocksize, device, generator)
    x = torch.randn(2, 512, generator=generator).to(device)
    cuda_cores = [c for c in range(len(CANDIDATES)) if not _tensor_cores(c)]  # fp32
    for candidate in cuda_cores if device == "cuda" else (cuda_cores[blocksize % len(cuda_cores)],):
        assert tile(candidate, 2, blocksize)[2] <= blocksize
        got = nf4_lora_gemv(x, weight, candidate=candidate)
        assert relative_error(got, x @ dequantized.t()) < 1e-5


def test_steps_an_iteration_fill_k_with_whole_iterations():
    """A CUDA-core candidate asking for more columns than a block takes several steps of
    a block per iteration, as many as still divide K; fewer as rows double its tile's
    columns down; one on tensor cores."""
    wide = next(c for c, tile_ in enumerate(CANDIDATES) if tile_[1] == 256 and tile_[4] == "cuda cores")
    assert steps(wide, 1, 64, 4096) == 4
    assert steps(wide, 1, 64, 6 * 64) == 2  # 384 columns: two steps of 64 divide it, four do not
    assert steps(wide, 1, 64, 5 * 64) == 1
    assert steps(wide, 2, 64, 4096) == 2 and steps(wide, 8, 64, 4096) == 1
    assert steps(wide, 1, 32, 4096) == 8  # 32-wide blocks: eight steps of 32
    assert all(steps(c, 1, 64, 4096) == 1 for c in range(len(CANDIDATES)) if _tensor_cores(c))


@pytest.mark.parametrize("k", [5 * 64, 6 * 64, 16 * 64])
def test_several_steps_an_iteration_give_the_dequantised_product(k, device):
    """Candidates that take several blocks per iteration, whole or split into slices,
    where K allows one, two or four steps an iteration."""
    generator = torch.Generator().manual_seed(_seed())
    weight, dequantized = _quantized(40, k, torch.float32, True, 64, device, generator)
    x, _, xa, lora_b = _activations(1, 40, k, 8, torch.float32, device, False, generator)
    expected = lora_gemv_reference(x, dequantized, None, xa, lora_b, 0.5)
    wide = [c for c, tile_ in enumerate(CANDIDATES) if tile_[1] > 64 and tile_[4] == "cuda cores"]
    assert wide and max(steps(c, 1, 64, k) for c in wide) == {5: 1, 6: 2, 16: 4}[k // 64]
    for candidate in wide:
        got = nf4_lora_gemv(x, weight, None, xa, lora_b, 0.5, candidate=candidate)
        assert relative_error(got, expected) < TOLERANCE[torch.float32], CANDIDATES[candidate]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_split_k_candidates_add_every_slice_once_and_reset_their_counters(rows, dtype, device):
    generator = torch.Generator().manual_seed(_seed())
    n, k = 40, 512
    weight, dequantized = _quantized(n, k, dtype, True, 64, device, generator)
    cut = 0
    for candidate, (*_, programs_per_sm, multiplier) in enumerate(CANDIDATES):
        if not programs_per_sm or (multiplier == "tensor cores" and dtype == torch.float32):
            continue
        _, block_n, block_k = tile(candidate, rows, weight.blocksize)
        bands = triton.cdiv(n, block_n)
        # A slice is whole loop iterations: steps(...) blocks of K each, as launch plans it.
        iteration = block_k * steps(candidate, rows, weight.blocksize, k)
        slices, _ = split_k.slices(torch.device(device), bands, k, iteration, programs_per_sm)
        for _ in range(2):  # the second call starts from the counters the first one left
            x = torch.randn(rows, k, generator=generator).to(device, dtype)
            xa = torch.randn(rows, 8, generator=generator).to(device, dtype)
            lora_b = (torch.randn(n, 8, generator=generator) * 0.05).to(device, dtype)
            got = nf4_lora_gemv(x, weight, None, xa, lora_b, 0.5, candidate=candidate)
            expected = lora_gemv_reference(x, dequantized, None, xa, lora_b, 0.5)
            assert relative_error(got, expected) < TOLERANCE[dtype], (CANDIDATES[candidate], slices)
        if slices > 1:
            cut += 1
            _, counters = split_k._workspaces[(str(x.device), rows, n, slices, bands)]
            assert not counters.any()
    assert cut or device == "cuda"


def _first_tensor_cores() -> int:
    return next(c for c in range(len(CANDIDATES)) if _tensor_cores(c))


def test_what_nf4_lora_gemv_cannot_compute_is_refused(device):
    generator = torch.Generator().manual_seed(0)
    weight, _ = _quantized(16, 128, torch.float32, False, 64, device, generator)
    odd_rows, _ = _quantized(16, 96, torch.float32, False, 64, device, generator)
    assert supports(weight) and not supports(odd_rows)
    x = torch.zeros(2, 128, device=device)
    xa, lora_b = torch.zeros(2, 4, device=device), torch.zeros(16, 4, device=device)
    for match, call in [
        ("whole blocks", lambda: nf4_lora_gemv(torch.zeros(2, 96, device=device), odd_rows)),
        ("1 to 8", lambda: nf4_lora_gemv(torch.zeros(9, 128, device=device), weight)),
        ("expected \\(M, 128\\)", lambda: nf4_lora_gemv(x[:, :64], weight)),
        ("both xa and lora_b", lambda: nf4_lora_gemv(x, weight, None, xa)),
        ("expected \\(2, R\\) and \\(16, R\\)", lambda: nf4_lora_gemv(x, weight, None, xa, lora_b[:8])),
        ("bias", lambda: nf4_lora_gemv(x, weight, torch.zeros(3, device=device))),
        ("give them in torch.float32", lambda: nf4_lora_gemv(x.half(), weight)),
        ("lookup='shared'", lambda: nf4_lora_gemv(x, weight, lookup="shared")),
        ("there are 13", lambda: nf4_lora_gemv(x, weight, candidate=len(CANDIDATES))),
        ("takes a CUDA-core candidate", lambda: nf4_lora_gemv(x, weight, candidate=_first_tensor_cores())),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_ptx_lookups_are_made_once_per_record_and_shared_by_copies():
    """Made once per record and shared by its copies, those made before it too: the
    decode GEMV choice clones the codes before its first call makes the lookup, and a
    copy that lacked it would make its own (a host read of the levels) inside the CUDA
    graph that times it."""
    generator = torch.Generator().manual_seed(_seed())
    weight, _ = _quantized(16, 128, torch.bfloat16, True, 64, "cpu", generator)
    earlier_copy = weight.with_packed(weight.packed.clone())
    levels = weight.code.tolist()
    for width in (32, 16):
        asm, words = level_source(weight, "registers", width)
        assert asm == level_lookup.lookup_asm(tuple(levels), width, "bfloat16")
        expected = level_lookup.register_words(levels, width, "bfloat16") * 32  # a copy a lane
        assert [w & 0xFFFFFFFF for w in words.tolist()] == expected
        asm, words = level_source(weight, "shuffle", width)
        assert asm == level_lookup.shuffle_asm(width)
        expected = level_lookup.shuffle_words(levels, width, "bfloat16")  # per lane
        assert [w & 0xFFFFFFFF for w in words.tolist()] == expected
    for lookup, width in itertools.product(("registers", "shuffle"), (32, 16)):
        assert has_level_source(earlier_copy, lookup, width)
    copy = weight.with_packed(weight.packed.clone())
    for lookup, width in itertools.product(LOOKUPS, (32, 16)):
        assert level_source(copy, lookup, width) is level_source(weight, lookup, width)
        assert level_source(earlier_copy, lookup, width) is level_source(weight, lookup, width)


def test_every_lookup_compiles_for_an_h100_and_the_ptx_loops_load_no_levels(tmp_path):
    """scripts/cuda_sass.py compiles the kernels for sm_90 here (ptxas accepts the lookups'
    PTX) and counts their main loops.  On CUDA cores the register lookup's loop issues
    fewer loads than the table's (no gather) and stays near the count it was designed at
    (nine to ten a code at one row: six of lookup, one and a half of arithmetic, the rest
    x's conversion, loads and addresses); the shuffle lookup's has one SHFL a code, no
    LOP3, and fewer instructions than the permutes' (about six a code at one row); on
    tensor cores the products are warpgroup MMAs and the loop spends about five or six a
    code whatever the rows (the 16-bit lookup's 2.75 and the MMAs' staging)."""
    script = Path(__file__).parents[3] / "scripts" / "cuda_sass.py"
    output = tmp_path / "sass.json"
    tensor_cores = _first_tensor_cores() + 1  # 64 x 64, four warps
    assert CANDIDATES[tensor_cores][:2] == (64, 64)
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    subprocess.run(
        [sys.executable, str(script), "--shape", "256,512", "--rows", "1,8", "--candidates", f"0,{tensor_cores}",
         "--json", str(output)],
        check=True, capture_output=True, env=env, timeout=600,
    )  # fmt: skip
    results = {(r["candidate"], r["rows"], r["lookup"]): r for r in json.loads(output.read_text())["results"]}
    for rows in (1, 8):
        registers, table = results[0, rows, "registers"], results[0, rows, "table"]
        assert registers["opcodes"].get("LDG", 0) < table["opcodes"]["LDG"]
        _, block_n, block_k = registers["block"]
        codes = block_n * block_k // (32 * registers["warps"])  # a thread's, per iteration
        assert registers["opcodes"]["PRMT"] >= 34 * codes // 8  # the lookup's 34 per word of 8
        shuffle = results[0, rows, "shuffle"]
        assert shuffle["opcodes"].get("LDG", 0) == registers["opcodes"].get("LDG", 0)
        assert shuffle["opcodes"]["SHFL"] == codes and "LOP3" not in shuffle["opcodes"]
        assert shuffle["instructions_per_weight"] < registers["instructions_per_weight"]
        assert results[tensor_cores, rows, "shuffle"]["opcodes"]["SHFL"] == 32  # a thread's codes
        mma = results[tensor_cores, rows, "registers"]
        assert mma["opcodes"]["HGMMA"] >= 2 and mma["instructions_per_weight"] < 7
        assert mma["opcodes"]["PRMT"] >= 14 * 32 // 8  # 32 codes a thread; 14 PRMT per 8 at 16 bits
    assert results[0, 1, "registers"]["instructions_per_weight"] < 11
    assert results[0, 1, "shuffle"]["instructions_per_weight"] < 7


def test_the_lookup_bound_stand_ins_compile_for_an_h100_without_the_lookups_work(tmp_path):
    """scripts/nf4_lookup_bound.py times the one-row kernel with stand-in lookups (wrong
    levels at a known cost) to see what the lookup costs on a GPU; compiled here for
    sm_90, "no lookup" keeps the loads and multiply-adds but no shuffle or permute, and
    "shifts" no shuffle, so each differs from the real loop by its lookup alone."""
    script = Path(__file__).parents[3] / "scripts" / "nf4_lookup_bound.py"
    output = tmp_path / "bound.json"
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    subprocess.run(
        [sys.executable, str(script), "--compile-only", "90", "--shape", "256,512", "--candidates", "0",
         "--output", str(output)],
        check=True, capture_output=True, env=env, timeout=600,
    )  # fmt: skip
    loops = {r["variant"]: r for r in json.loads(output.read_text())["results"]}
    assert set(loops) == {"shuffle", "registers", "shifts", "no lookup"}
    ffma = loops["shuffle"]["opcodes"]["FFMA"]
    assert all(loop["opcodes"]["FFMA"] == ffma for loop in loops.values())  # the same arithmetic
    assert loops["shuffle"]["opcodes"]["SHFL"] > 0 and "LOP3" in loops["registers"]["opcodes"]
    for stand_in in ("shifts", "no lookup"):
        assert "SHFL" not in loops[stand_in]["opcodes"]
    bare = loops["no lookup"]
    assert bare["instructions_per_weight"] < loops["shuffle"]["instructions_per_weight"]
    assert bare["opcodes"].get("LDG", 0) == loops["shuffle"]["opcodes"].get("LDG", 0)  # codes still loaded
