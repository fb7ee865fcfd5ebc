"""level_lookup: the byte-permute program run through an interpreter of its PTX
instructions' semantics (the PTX ISA's prmt, lop3, shl, shr, xor) gives every packed
byte's two levels bit for bit, for NF4's table and fresh random ones; the PTX it renders
names every register it uses; and the program never reads its input after writing an
output (so the outputs may share the input's register)."""

import random
import re
import struct

import bitsandbytes.functional as bnbf
import pytest

from slothkit_kernels import level_lookup

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


def run(program, word: int, levels) -> dict[str, int]:
    registers = {level_lookup.WORD: word}
    registers.update(zip(level_lookup.TABLE_REGISTERS, level_lookup.register_words(levels)))
    for opcode, destination, *operands in program:
        values = [registers[o] if isinstance(o, str) else o for o in operands]
        registers[destination] = OPERATIONS[opcode](*values)
    return registers


def bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _tables():
    nf4 = bnbf.get_4bit_type("nf4", device="cpu").tolist()
    rng = random.Random(random.getrandbits(32))
    # Fresh random fp32 levels of both signs and wide magnitudes, with a zero and a -0.0.
    fresh = [rng.choice((-1, 1)) * rng.uniform(0.5, 2.0) * 2.0 ** rng.randint(-40, 40) for _ in range(14)]
    fresh = [struct.unpack("<f", struct.pack("<f", v))[0] for v in fresh + [0.0, -0.0]]
    rng.shuffle(fresh)
    return {"nf4": nf4, "random": fresh}


@pytest.mark.parametrize("table", ["nf4", "random"])
def test_every_byte_in_every_position_gives_both_its_levels(table):
    levels = _tables()[table]
    program = level_lookup.lookup_program(levels)
    words = [v | (255 - v) << 8 | (v * 7 + 3) % 256 << 16 | (v * 13 + 5) % 256 << 24 for v in range(256)]
    words += [random.getrandbits(32) for _ in range(256)]
    for word in words:
        registers = run(program, word, levels)
        for i in range(4):
            byte = (word >> (8 * i)) & 0xFF
            assert registers[level_lookup.HIGH_LEVELS[i]] == bits(levels[byte >> 4]), (hex(word), i)
            assert registers[level_lookup.LOW_LEVELS[i]] == bits(levels[byte & 15]), (hex(word), i)


def test_input_is_not_read_after_an_output_is_written():
    program = level_lookup.lookup_program(_tables()["nf4"])
    outputs = set(level_lookup.HIGH_LEVELS + level_lookup.LOW_LEVELS)
    first_output = next(i for i, ins in enumerate(program) if ins[1] in outputs)
    assert all(level_lookup.WORD not in ins[2:] for ins in program[first_output:])
    assert {ins[1] for ins in program} >= outputs


def test_rendered_ptx_declares_its_temporaries_and_uses_declared_operands():
    levels = _tables()["random"]
    asm = level_lookup.lookup_asm(tuple(levels))
    declared = set(re.search(r"\.reg \.b32 ([^;]*);", asm).group(1).replace(" ", "").split(","))
    used = set(re.findall(r"%\w+", asm))
    assert used == declared
    operands = {int(n) for n in re.findall(r"\$(\d+)", asm)}
    assert max(operands) < len(level_lookup.CONSTRAINTS.split(","))
    instructions = [line for line in asm.splitlines() if line.endswith(";") and not line.startswith(".reg")]
    assert len(instructions) == len(level_lookup.lookup_program(levels)) == 46


def test_a_table_of_other_than_sixteen_levels_is_refused():
    with pytest.raises(ValueError, match="16 levels"):
        level_lookup.lookup_program([0.0] * 15)
