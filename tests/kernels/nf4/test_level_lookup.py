"""level_lookup: the byte-permute and the shuffle programs run through an interpreter of
their PTX instructions' semantics (the PTX ISA's prmt, lop3, shl, shr, xor, and
shfl.sync.idx over a warp's lanes) give every packed byte's two levels bit for bit, for
NF4's table and fresh random ones; the PTX they render names every register it uses;
and neither program reads its input after writing an output (so the outputs may share
the input's register)."""

import random
import re
import struct

import bitsandbytes.functional as bnbf
import pytest
import torch

from slothkit_kernels.nf4 import level_lookup

MASK32 = 0xFFFFFFFF


def prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 (generic mode): byte i of d is byte c[4i+2:4i] of (b << 32) | a, or its
    sign bit spread over the byte where c[4i+3] is set."""
    source = ((b & MASK32) << 32) | (a & MASK32)
    d = 0
    for i in range(4):
        selector = (c >> (4 * i)) & 0xF
        byte = (source >> (8 * (selector & 7))) & 0xFF
        if selector & 8:
            byte = 0xFF if byte & 0x80 else 0
        d |= byte << (8 * i)
    return d


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit k of d is bit (a_k << 2 | b_k << 1 | c_k) of the truth table."""
    d = 0
    for k in range(32):
        index = ((a >> k) & 1) << 2 | ((b >> k) & 1) << 1 | ((c >> k) & 1)
        d |= ((lut >> index) & 1) << k
    return d


OPERATIONS = {
    "prmt": lambda a, b, c: prmt(a, b, c),
    "lop3": lambda a, b, c, lut: lop3(a, b, c, lut),
    "shl": lambda a, bits: (a << bits) & MASK32,
    "shr": lambda a, bits: (a & MASK32) >> bits,
    "xor": lambda a, b: (a ^ b) & MASK32,
}


def shfl_idx(lanes: dict[str, list[int]], a: str, b: int, c: int, members: int) -> int:
    """PTX shfl.sync.idx.b32 with c = 0x1f (no segment mask, clamp 31) and every lane a
    member: register ``a`` of lane b[4:0]."""
    assert (c, members) == (0x1F, MASK32)
    return lanes[a][b & 31]


def run(
    program, word: int, levels, width=32, dtype="bfloat16", lane: int = 0, shuffle=False
) -> dict[str, int]:
    """The program's registers after it ran in ``lane`` on ``word``, with the table words
    of the lookup (the shuffle's: each lane its own, ``shuffle_words``)."""
    registers = {level_lookup.WORD: word}
    tables = level_lookup.table_registers(width)
    if shuffle:
        words = level_lookup.shuffle_words(levels, width, dtype)
        lanes = {name: words[i :: len(tables)] for i, name in enumerate(tables)}  # name -> per lane
        registers.update({name: values[lane] for name, values in lanes.items()})
    else:
        registers.update(zip(tables, level_lookup.register_words(levels, width, dtype)))
    for opcode, destination, *operands in program:
        if opcode == "shfl.sync.idx":
            table, index, c, members = operands
            registers[destination] = shfl_idx(lanes, table, registers[index], c, members)
            continue
        values = [registers[o] if isinstance(o, str) else o for o in operands]
        registers[destination] = OPERATIONS[opcode](*values)
    return registers


def bits(value: float, width: int = 32, dtype: str = "bfloat16") -> int:
    """The level's bits, from torch's own conversion (not level_lookup's)."""
    if width == 32:
        return struct.unpack("<I", struct.pack("<f", value))[0]
    return torch.tensor([value], dtype=getattr(torch, dtype)).view(torch.int16).item() & 0xFFFF


def levels_of(registers, width: int) -> tuple[list[int], list[int]]:
    """The high and low nibbles' level bits of bytes 0-3 from the output registers."""
    high, low = level_lookup.outputs(width)
    if width == 32:
        return [registers[r] for r in high], [registers[r] for r in low]
    return tuple([registers[r] >> (16 * i) & 0xFFFF for r in names for i in (0, 1)] for names in (high, low))


def _tables():
    nf4 = bnbf.get_4bit_type("nf4", device="cpu").tolist()
    rng = random.Random(random.getrandbits(32))
    # Fresh random fp32 levels of both signs and wide magnitudes, with a zero and a -0.0.
    fresh = [rng.choice((-1, 1)) * rng.uniform(0.5, 2.0) * 2.0 ** rng.randint(-40, 40) for _ in range(14)]
    fresh = [struct.unpack("<f", struct.pack("<f", v))[0] for v in fresh + [0.0, -0.0]]
    rng.shuffle(fresh)
    return {"nf4": nf4, "random": fresh}


WIDTHS = [(32, "bfloat16"), (16, "bfloat16"), (16, "float16")]


def _program(method: str, levels, width: int, dtype: str):
    if method == "shuffle":
        return level_lookup.shuffle_program(width)
    return level_lookup.lookup_program(levels, width, dtype)


@pytest.mark.parametrize("method", ["permute", "shuffle"])
@pytest.mark.parametrize("width, dtype", WIDTHS)
@pytest.mark.parametrize("table", ["nf4", "random"])
def test_every_byte_in_every_position_gives_both_its_levels(table, width, dtype, method):
    levels = _tables()[table]
    if dtype == "float16":  # within its range, as NF4's levels are
        levels = [max(-6e4, min(6e4, v)) for v in levels]
    program = _program(method, levels, width, dtype)
    words = [v | (255 - v) << 8 | (v * 7 + 3) % 256 << 16 | (v * 13 + 5) % 256 << 24 for v in range(256)]
    words += [random.getrandbits(32) for _ in range(256)]
    for word in words:
        lane = random.randrange(32)  # the lane a shuffle runs in does not matter
        registers = run(program, word, levels, width, dtype, lane=lane, shuffle=method == "shuffle")
        high, low = levels_of(registers, width)
        for i in range(4):
            byte = (word >> (8 * i)) & 0xFF
            assert high[i] == bits(levels[byte >> 4], width, dtype), (hex(word), i)
            assert low[i] == bits(levels[byte & 15], width, dtype), (hex(word), i)


@pytest.mark.parametrize("method", ["permute", "shuffle"])
@pytest.mark.parametrize("width", [32, 16])
def test_input_is_not_read_after_an_output_is_written(width, method):
    program = _program(method, _tables()["nf4"], width, "bfloat16")
    outputs = set(sum(level_lookup.outputs(width), ()))
    first_output = next(i for i, ins in enumerate(program) if ins[1] in outputs)
    # The instruction writing the first output may read the word: it reads before it writes.
    assert all(level_lookup.WORD not in ins[2:] for ins in program[first_output + 1 :])
    assert {ins[1] for ins in program} >= outputs


@pytest.mark.parametrize(
    "method, width, instructions",
    [("permute", 32, 46), ("permute", 16, 22), ("shuffle", 32, 15), ("shuffle", 16, 19)],
)
def test_rendered_ptx_declares_its_temporaries_and_uses_declared_operands(method, width, instructions):
    levels = _tables()["nf4"]
    if method == "shuffle":
        asm = level_lookup.shuffle_asm(width)
    else:
        asm = level_lookup.lookup_asm(tuple(levels), width)
    declared = set(re.search(r"\.reg \.b32 ([^;]*);", asm).group(1).replace(" ", "").split(","))
    used = set(re.findall(r"%\w+", asm))
    assert used == declared
    operands = {int(n) for n in re.findall(r"\$(\d+)", asm)}
    assert max(operands) < len(level_lookup.constraints(width).split(","))
    lines = [line for line in asm.splitlines() if line.endswith(";") and not line.startswith(".reg")]
    assert len(lines) == len(_program(method, levels, width, "bfloat16")) == instructions


def test_a_table_of_other_than_sixteen_levels_or_a_width_it_cannot_build_is_refused():
    with pytest.raises(ValueError, match="16 levels"):
        level_lookup.lookup_program([0.0] * 15)
    with pytest.raises(ValueError, match="supported: \\(32, 16\\)"):
        level_lookup.lookup_program([0.0] * 16, width=8)
    with pytest.raises(ValueError, match="supported: \\(32, 16\\)"):
        level_lookup.shuffle_program(width=8)
